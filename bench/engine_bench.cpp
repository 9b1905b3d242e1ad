// The engine's own cost per request, with the wire removed (issue 25): one
// async_submit_transfer of N requests from submit to completion between two
// engines of this process over the fake transport in its instant mode
// (test/support/fake_transport.hpp: every slice completes as soon as the
// path is pumped, no byte moves), so what is timed is planning, slicing,
// striping, the path's queue and the completion fan-in: everything the
// engine does per request. Requests are 4 KiB WRITEs to scattered remote
// offsets (stride 8 KiB, so nothing coalesces: tensor parallelism's case)
// or contiguous ones (which the planner merges), from 10^3 to 10^5 per
// call. Reported: ns per request of wall time (the goal: <= 100
// ns) and of CPU time (`cpu/request`: every thread of the process, which a
// shared, busy machine inflates less than the wall clock), and the
// same over TCP on loopback with the wire in it, for scale (and 256 MiB in
// 1 MiB requests, the large-slice case): with vector frames (many pieces
// to a frame, the default) and without (`_single`: tcp_vector_pieces 0, a
// frame per request), in the same run. `bm_fake_transfers`: the cost of
// a transfer itself (the hop to the engine's strand, its state, the
// deadline, the handler): N transfers of one 4 KiB request each, 16 in
// flight (`s/transfer`, `cpu/transfer`).
//
//   <build>/bench/kvlink_engine_bench --benchmark_min_time=0.5
#include <kvlink/engine.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../test/support/fake_transport.hpp"
#include "../test/support/test_support.hpp"
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/use_future.hpp>
#include <benchmark/benchmark.h>

namespace {

// Two engines on one io_context run by `threads` threads, connected.
struct pair {
  pair(const std::string& transport, int threads, std::size_t max_requests, std::uint64_t piece_,
       std::uint32_t vector_pieces)
      : piece(piece_) {
    kvlink_test::add_fake_transport();
    kvlink_test::fake_settings::instant = transport == "fake";
    kvlink::config cfg{.listen = "127.0.0.1:0", .transports = transport};
    cfg.tcp.vector_pieces = vector_pieces;
    target = std::make_unique<kvlink::engine>(io.get_executor(), cfg);
    initiator = std::make_unique<kvlink::engine>(io.get_executor(), cfg);
    for (int i = 0; i < threads; ++i) runners.emplace_back([this] { io.run(); });
    remote.resize(2 * max_requests * piece);
    local.resize(max_requests * piece);
    target->register_segment(remote.data(), remote.size(), kvlink::access::remote_read_write);
    initiator->register_segment(local.data(), local.size(), kvlink::access::none);
    peer = initiator->async_connect(target->local_address(), asio::use_future).get();
  }
  ~pair() {
    initiator->async_close(asio::use_future).get();
    target->async_close(asio::use_future).get();
    work.reset();
    for (auto& t : runners) t.join();
    kvlink_test::fake_settings::instant = false;
  }

  std::vector<kvlink::transfer_request> batch(std::size_t n, bool scattered) {
    std::vector<kvlink::transfer_request> reqs(n);
    for (std::size_t i = 0; i < n; ++i) {
      reqs[i] = {kvlink::opcode::write, local.data() + i * piece, peer.segment(0),
                 (scattered ? 2 * i : i) * piece, piece};
    }
    return reqs;
  }

  std::uint64_t piece;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  std::vector<std::thread> runners;
  std::unique_ptr<kvlink::engine> target, initiator;
  std::vector<std::byte> remote, local;
  kvlink::peer peer;
};

void bm_submit(benchmark::State& state, const std::string& transport, bool scattered,
               std::uint64_t piece = 4096,
               std::uint32_t vector_pieces = kvlink::tcp_config{}.vector_pieces) {
  const auto n = static_cast<std::size_t>(state.range(0));
  pair p(transport, 2, n, piece, vector_pieces);
  const auto reqs = p.batch(n, scattered);
  const double cpu_before = kvlink_test::process_cpu_seconds();
  for (auto _ : state) {
    const auto r = p.initiator->async_submit_transfer(reqs, asio::use_future).get();
    if (r.requests != n) state.SkipWithError("not every request completed");
  }
  const double requests = static_cast<double>(state.iterations() * static_cast<std::int64_t>(n));
  // Seconds per request (shown with an SI prefix: 150n = 150 ns).
  state.counters["s/request"] =
      benchmark::Counter(requests, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  // CPU seconds per request, every thread of the process (the engines' and
  // the caller's): what a request costs when the machine is shared and the
  // wall clock also counts other programs' time.
  state.counters["cpu/request"] = (kvlink_test::process_cpu_seconds() - cpu_before) / requests;
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(n * piece));
}

// N transfers of one request each, `depth` in flight: each completion
// submits the next transfer from its handler (on an io thread).
void bm_fake_transfers(benchmark::State& state) {
  constexpr std::size_t depth = 16;
  const auto n = static_cast<std::size_t>(state.range(0));
  pair p("fake", 2, depth, 4096, kvlink::tcp_config{}.vector_pieces);
  const auto reqs = p.batch(depth, true);
  const double cpu_before = kvlink_test::process_cpu_seconds();
  for (auto _ : state) {
    std::atomic<std::size_t> issued{0};
    std::atomic<std::size_t> left{n};
    std::atomic<bool> failed{false};
    std::promise<void> done;
    std::function<void(std::size_t)> go = [&](std::size_t slot) {
      p.initiator->async_submit_transfer(std::span(&reqs[slot], 1),
                                         [&, slot](std::error_code ec, kvlink::transfer_result r) {
                                           if (ec || r.bytes != 4096) failed = true;
                                           if (issued.fetch_add(1) < n) go(slot);
                                           if (left.fetch_sub(1) == 1) done.set_value();
                                         });
    };
    const std::size_t first = std::min(depth, n);
    issued = first;
    for (std::size_t i = 0; i < first; ++i) go(i);
    done.get_future().get();
    if (failed) state.SkipWithError("a transfer failed");
  }
  const double transfers = static_cast<double>(state.iterations() * static_cast<std::int64_t>(n));
  state.counters["s/transfer"] =
      benchmark::Counter(transfers, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["cpu/transfer"] = (kvlink_test::process_cpu_seconds() - cpu_before) / transfers;
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
}

void bm_fake_scattered(benchmark::State& s) { bm_submit(s, "fake", true); }
void bm_fake_contiguous(benchmark::State& s) { bm_submit(s, "fake", false); }
void bm_tcp_scattered(benchmark::State& s) { bm_submit(s, "tcp", true); }
void bm_tcp_scattered_single(benchmark::State& s) { bm_submit(s, "tcp", true, 4096, 0); }
void bm_tcp_1mib(benchmark::State& s) { bm_submit(s, "tcp", false, 1u << 20); }
void bm_tcp_1mib_single(benchmark::State& s) { bm_submit(s, "tcp", false, 1u << 20, 0); }

}  // namespace

BENCHMARK(bm_fake_scattered)
    ->Arg(1000)
    ->Arg(10'000)
    ->Arg(100'000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(bm_fake_transfers)->Arg(100'000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_fake_contiguous)
    ->Arg(1000)
    ->Arg(100'000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(bm_tcp_scattered)->Arg(10'000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_tcp_scattered_single)->Arg(10'000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_tcp_1mib)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_tcp_1mib_single)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
