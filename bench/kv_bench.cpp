// kvlink_kv_bench: cost of turning block ids into transfer requests
// (kvlink::make_block_transfer / make_tp_block_transfer) for a Qwen3-8B paged
// cache (36 layers, 8 KV heads, head dim 128, bf16, 16-token blocks).
//
// Counters: `requests` per call; `per_block` and `per_block_layer` are the
// time of one call divided by the blocks (and by blocks x 36 layers), shown
// in seconds with SI prefixes (e.g. 2.5n = 2.5 ns). The output vector keeps
// its capacity between iterations, as a serving engine reusing it would.
#include <kvlink/kv/block_transfer.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

namespace {

constexpr std::uint32_t capacity = 1 << 18;  // blocks per rank's table

kvlink::kv_layout qwen3_8b(std::uint32_t tp_rank, std::uint32_t tp_size,
                           kvlink::block_order order) {
  kvlink::kv_layout l = kvlink::find_model_preset("qwen3-8b")->layout(capacity, 16);
  l.tp_rank = tp_rank;
  l.tp_size = tp_size;
  l.order = order;
  return l;
}

// Addresses are computed, never dereferenced: no memory behind them.
void* fake_base() { return reinterpret_cast<void*>(std::uintptr_t{1} << 44); }

std::vector<std::uint32_t> contiguous_ids(std::uint32_t first, std::uint32_t n) {
  std::vector<std::uint32_t> ids(n);
  std::iota(ids.begin(), ids.end(), first);
  return ids;
}

// n distinct ids drawn from [0, capacity) in random order (fixed seed).
std::vector<std::uint32_t> scattered_ids(std::uint32_t n, std::uint32_t seed) {
  std::vector<std::uint32_t> all(capacity);
  std::iota(all.begin(), all.end(), 0u);
  std::mt19937 rng{seed};
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(n);
  return all;
}

void report(benchmark::State& state, std::size_t requests, std::uint64_t blocks) {
  state.counters["requests"] = static_cast<double>(requests);
  state.counters["per_block"] = benchmark::Counter(
      static_cast<double>(blocks),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["per_block_layer"] = benchmark::Counter(
      static_cast<double>(blocks) * 36,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// Equal TP on both sides (whole blocks): state.range(0) = blocks,
// state.range(1) = 1 for contiguous ids, 0 for scattered ones.
void bm_equal_tp(benchmark::State& state) {
  const auto n = static_cast<std::uint32_t>(state.range(0));
  const bool contiguous = state.range(1) != 0;
  const kvlink::kv_layout l = qwen3_8b(0, 1, kvlink::block_order::heads_major);
  const auto local = kvlink::kv_local_view::contiguous(l, fake_base());
  const auto remote =
      kvlink::kv_remote_view::contiguous(l, {kvlink::peer_id{1}, kvlink::segment_id{1}});
  const auto lids = contiguous ? contiguous_ids(0, n) : scattered_ids(n, 1);
  const auto rids = contiguous ? contiguous_ids(1000, n) : scattered_ids(n, 2);
  std::vector<kvlink::transfer_request> out;
  // Untimed first call: the vector's capacity is then reused, as an engine would.
  if (kvlink::make_block_transfer(kvlink::opcode::read, local, remote, lids, rids, out))
    throw std::runtime_error("bad setup");
  for (auto _ : state) {
    out.clear();
    if (kvlink::make_block_transfer(kvlink::opcode::read, local, remote, lids, rids, out))
      throw std::runtime_error("make_block_transfer failed");
    benchmark::DoNotOptimize(out.data());
  }
  report(state, out.size(), n);
}

// Different TP: local rank 0 of TP 2 against both ranks of TP 4 (local rank
// holds 4 heads, each remote rank 2). state.range(0) = blocks, range(1) = 1
// for contiguous ids, range(2) = 1 for tokens_major blocks (one piece per token).
void bm_tp_2_to_4(benchmark::State& state) {
  const auto n = static_cast<std::uint32_t>(state.range(0));
  const bool contiguous = state.range(1) != 0;
  const auto order =
      state.range(2) != 0 ? kvlink::block_order::tokens_major : kvlink::block_order::heads_major;
  const auto local = kvlink::kv_local_view::contiguous(qwen3_8b(0, 2, order), fake_base());
  std::vector<kvlink::kv_remote_view> remotes;
  for (std::uint32_t r = 0; r < 4; ++r)
    remotes.push_back(kvlink::kv_remote_view::contiguous(
        qwen3_8b(r, 4, order), {kvlink::peer_id{1}, kvlink::segment_id{1 + r}}));
  const auto lids = contiguous ? contiguous_ids(0, n) : scattered_ids(n, 1);
  const auto rids = contiguous ? contiguous_ids(1000, n) : scattered_ids(n, 2);
  std::vector<kvlink::transfer_request> out;
  // Untimed first call: the vector's capacity is then reused, as an engine would.
  if (kvlink::make_tp_block_transfer(kvlink::opcode::write, local, remotes, lids, rids, out))
    throw std::runtime_error("bad setup");
  for (auto _ : state) {
    out.clear();
    if (kvlink::make_tp_block_transfer(kvlink::opcode::write, local, remotes, lids, rids, out))
      throw std::runtime_error("make_tp_block_transfer failed");
    benchmark::DoNotOptimize(out.data());
  }
  report(state, out.size(), n);
}

}  // namespace

// 100,000 blocks of 16 tokens = 1.6M tokens; 2,048 blocks = a 32K-token prompt.
BENCHMARK(bm_equal_tp)
    ->ArgNames({"blocks", "contiguous"})
    ->Args({2048, 1})
    ->Args({2048, 0})
    ->Args({100'000, 1})
    ->Args({100'000, 0})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_tp_2_to_4)
    ->ArgNames({"blocks", "contiguous", "tokens_major"})
    ->Args({2048, 1, 0})
    ->Args({100'000, 1, 0})
    ->Args({100'000, 0, 0})
    ->Args({2048, 1, 1})
    ->Args({10'000, 1, 1})
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
