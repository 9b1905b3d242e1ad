// Benchmarks kvlink::plan_slices at 10^3, 10^4 and 10^5 descriptors per call.
//
//  - contiguous: 16 KiB requests back to back on both sides: everything
//    coalesces into one run, cut into 1 MiB slices;
//  - fragmented: 4-64 KiB requests with a gap after each on both sides:
//    nothing coalesces, one slice per request.
//
// Default policy (1 MiB slices, 64 KiB min chunk), 4 lanes of equal weight
// unless the name says otherwise. ns_per_desc is CPU time per input
// descriptor (Google Benchmark's rates use CPU time), the figure the engine's
// budget (<= 25 ns at 10^5) is stated in; the console prints it with a
// trailing "s", the library's unit for inverted rates.
//
// And kvlink::destinations_overlap (the engine's check that no two requests
// of a transfer write the same bytes) over 4 KiB destinations shuffled over
// 4 KiB * n of one segment (segments 1: the radix-sorted keys) or
// alternating between two segments (2: std::sort of the ranges).
#include <kvlink/planner/slice_planner.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include <benchmark/benchmark.h>

namespace {

enum class shape : int { contiguous = 0, fragmented = 1 };

std::vector<kvlink::plan_request> make_requests(shape sh, std::size_t n) {
  std::vector<kvlink::plan_request> reqs;
  reqs.reserve(n);
  std::mt19937_64 rng{42};
  std::uniform_int_distribution<std::uint64_t> size_kib{4, 64};
  std::uintptr_t local = std::uintptr_t{1} << 40;
  std::uint64_t remote = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t len = sh == shape::contiguous ? 16u << 10 : size_kib(rng) << 10;
    reqs.push_back(
        {kvlink::opcode::write, local, kvlink::segment_id{1}, kvlink::segment_id{2}, remote, len});
    // Fragmented: a 4 KiB hole after each request on both sides.
    const std::uint64_t gap = sh == shape::contiguous ? 0 : 4u << 10;
    local += len + gap;
    remote += len + gap;
  }
  return reqs;
}

void bm_plan(benchmark::State& state) {
  const auto sh = static_cast<shape>(state.range(0));
  const auto n = static_cast<std::size_t>(state.range(1));
  const auto lanes = static_cast<std::size_t>(state.range(2));
  const auto reqs = make_requests(sh, n);
  const std::vector<double> weights(lanes, 1.0);
  const kvlink::plan_policy policy{};
  std::vector<kvlink::slice> out;  // reused, as the engine does per peer
  kvlink::plan_stats st;
  for (auto _ : state) {
    if (auto ec = kvlink::plan_slices(reqs, weights, policy, out, &st)) {
      state.SkipWithError(ec.message().c_str());
      break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetLabel(sh == shape::contiguous ? "contiguous" : "fragmented");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n));
  // value n/1e9 per iteration, as an inverted rate: seconds / (n/1e9) = ns per descriptor.
  state.counters["ns_per_desc"] = benchmark::Counter(
      static_cast<double>(n) / 1e9,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["slices"] = static_cast<double>(st.slices);
  state.counters["lanes_used"] = static_cast<double>(st.lanes_used);
}

void bm_overlap(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  const auto segments = static_cast<std::uint64_t>(state.range(1));
  std::vector<kvlink::destination_range> shuffled;
  for (std::uint64_t i = 0; i < n; ++i) {
    shuffled.push_back({1, i % segments, (i / segments) * 4096, 4096});
  }
  std::mt19937_64 rng{42};
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  std::vector<kvlink::destination_range> ranges;
  std::vector<std::uint64_t> scratch;  // reused, as the engine does
  for (auto _ : state) {
    state.PauseTiming();
    ranges = shuffled;  // it may sort them
    state.ResumeTiming();
    if (kvlink::destinations_overlap(ranges, scratch)) {
      state.SkipWithError("disjoint ranges said to overlap");
      break;
    }
    benchmark::ClobberMemory();
  }
  state.counters["ns_per_range"] = benchmark::Counter(
      static_cast<double>(n) / 1e9,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

}  // namespace

// Args: {shape, descriptors, lanes}.
BENCHMARK(bm_plan)
    ->ArgNames({"shape", "descs", "lanes"})
    ->ArgsProduct({{0, 1}, {1'000, 10'000, 100'000}, {4}})
    ->Args({1, 100'000, 64});  // O(lanes) per slice: the worst case for striping

// Args: {ranges, segments}.
BENCHMARK(bm_overlap)
    ->ArgNames({"ranges", "segments"})
    ->ArgsProduct({{10'000, 150'000}, {1, 2}})
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
