// kvlink_soak: random transfers for a while, every byte verified, with
// faults injected on one of the paths.
//
//   kvlink_soak [--seconds N] [--seed S]     (defaults: 60 s, seed 1)
//
// One target engine and two initiators in this process, on one io_context:
// - "direct" talks to the target straight, 2 lanes, no faults: every one of
//   its transfers must succeed;
// - "faulty" talks to it through the fault-injecting proxy
//   (test/support/fault_proxy.hpp), 4 lanes; before about one transfer in
//   four a fault (truncate, reset, delay, throttle, black hole) is set on a
//   random connection and cleared after it: its transfers succeed or fail
//   with a clear error, and after a failure it reconnects.
// Each initiator keeps one transfer in flight: a batch of 1 to 64 requests
// of 1 B to 1 MiB, WRITE or READ, at random offsets of its own half of the
// target's segment, a notification attached to some, CRC32C checksums on
// for some. The source holds a pattern drawn for the transfer; after a
// successful transfer every destination byte is checked against it.
//
// Prints transfers, bytes, faults injected, failures expected and
// unexpected, corrupted bytes, hangs, double completions, notifications,
// RSS and open file descriptors at start and end. Exit status 0 when there
// were no unexpected failures, no corrupted bytes, no hang, no double
// completion, RSS did not grow without bound, and once the initiators are
// closed the open fds are back to the count before they connected less
// their two listeners (while connected each connection holds 2 fds here,
// 4 through the proxy: direct has 3 connections, faulty 5); 1 otherwise.
#include <kvlink/engine.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fault_proxy.hpp"
#include "process_stats.hpp"
#include "test_support.hpp"
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>
#include <fmt/format.h>

namespace {

using namespace std::chrono_literals;
using kvlink::opcode;
using kvlink_test::direction;
using kvlink_test::fault;
using steady = std::chrono::steady_clock;

constexpr std::size_t half = 32u << 20;  // each initiator's half of the target segment

struct totals {
  std::uint64_t transfers = 0, bytes = 0, faults = 0, failed_expected = 0, failed_unexpected = 0,
                corrupted = 0, hangs = 0, double_calls = 0, reconnects = 0, checksummed = 0,
                notifications_sent = 0;
};

kvlink::config engine_config(std::uint32_t lanes) {
  kvlink::config c;
  c.transports = "tcp";
  c.tcp.lanes = lanes;
  c.fence_timeout = 300ms;
  c.connect_timeout = 2s;
  c.transfer_deadline = 5s;
  return c;
}

// One initiator doing transfers one after another.
struct driver {
  std::string name;
  asio::io_context& io;
  kvlink::engine& eng;
  std::string address;
  std::vector<std::byte>& local;  // its own buffer (half bytes)
  std::byte* remote;              // its half of the target's segment
  kvlink::segment_id remote_seg;
  std::uint64_t remote_base;  // offset of its half in the segment
  kvlink_test::fault_proxy* proxy;
  totals& t;
  std::mt19937_64 g;
  kvlink::peer peer;
  bool busy = false;
  bool faulted = false;
  steady::time_point started;
  std::shared_ptr<int> calls;

  void connect_then_go(steady::time_point end) {
    busy = true;
    eng.async_connect(address, [this, end](std::error_code ec, kvlink::peer p) {
      busy = false;
      if (ec) {  // the proxy may still hold a fault's last effects: try again later
        auto timer = std::make_shared<asio::steady_timer>(io, 50ms);
        timer->async_wait([this, end, timer](std::error_code) { connect_then_go(end); });
        return;
      }
      peer = p;
      next(end);
    });
  }

  void next(steady::time_point end) {
    if (steady::now() >= end) return;
    if (!peer.connected()) {
      ++t.reconnects;
      connect_then_go(end);
      return;
    }
    // The batch: disjoint destination slots in its half.
    const auto op = g() % 2 ? opcode::write : opcode::read;
    const std::size_t n = 1 + g() % 64;
    const std::size_t slot = half / n;
    const std::uint64_t seed = g();
    std::vector<kvlink::transfer_request> reqs;
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t max_len = std::min<std::size_t>(slot, 1u << 20);
      const std::size_t len = 1 + static_cast<std::size_t>(g() % max_len);
      const std::size_t off = i * slot + static_cast<std::size_t>(g() % (slot - len + 1));
      // Source laid out with the pattern of seed at the destination's positions.
      if (op == opcode::write) {
        kvlink_test::fill_pattern(local.data() + off, len, seed, off);
      } else {
        kvlink_test::fill_pattern(remote + off, len, seed, off);
      }
      reqs.push_back({op, local.data() + off, peer.segment(remote_seg), remote_base + off, len});
      total += len;
    }
    kvlink::transfer_options opts;
    if (g() % 3 == 0) {
      opts.checksum = true;
      ++t.checksummed;
    }
    if (g() % 4 == 0) {
      opts.notify = kvlink::notification{name, std::to_string(seed)};
      ++t.notifications_sent;
    }
    faulted = false;
    if (proxy != nullptr && g() % 4 == 0) {
      const auto conn =
          static_cast<std::int64_t>(g() % std::max<std::uint64_t>(proxy->accepted(), 1));
      const auto dir = g() % 2 ? direction::to_target : direction::to_initiator;
      fault f = fault::delay(std::chrono::milliseconds(1 + g() % 20), dir);
      switch (g() % 5) {
        case 0:
          f = fault::truncate(g() % (4u << 20), dir);
          break;
        case 1:
          f = fault::reset(g() % (4u << 20), dir);
          break;
        case 2:
          f = fault::throttle(64u << 20, dir);
          break;
        case 3:
          f = fault::black_hole(dir);
          break;
        default:
          break;
      }
      proxy->set_fault(f.on_connection(static_cast<std::uint64_t>(conn)));
      faulted = true;
      ++t.faults;
    }
    busy = true;
    started = steady::now();
    calls = std::make_shared<int>(0);
    auto c = calls;
    eng.async_submit_transfer(
        reqs, opts, [this, end, reqs, seed, total, c](std::error_code ec, kvlink::transfer_result) {
          if (++*c > 1) {
            ++t.double_calls;
            return;
          }
          busy = false;
          if (proxy != nullptr) proxy->clear_faults();
          ++t.transfers;
          if (ec) {
            const bool clear =
                ec == kvlink::errc::peer_closed || ec == kvlink::errc::deadline_exceeded ||
                ec == kvlink::errc::peer_unreachable || ec == kvlink::errc::checksum_mismatch ||
                ec == kvlink::errc::malformed_message;
            if (faulted && clear) {
              ++t.failed_expected;
            } else {
              ++t.failed_unexpected;
              std::fprintf(stderr, "soak: %s: unexpected failure: %s\n", name.c_str(),
                           ec.message().c_str());
            }
          } else {
            t.bytes += total;
            for (const auto& q : reqs) {
              const auto off =
                  static_cast<std::size_t>(static_cast<std::byte*>(q.local) - local.data());
              const std::byte* dst = q.op == opcode::write ? remote + off : local.data() + off;
              if (!kvlink_test::is_pattern(dst, q.length, seed, off)) {
                std::vector<std::byte> want(q.length);
                kvlink_test::fill_pattern(want.data(), q.length, seed, off);
                for (std::size_t i = 0; i < q.length; ++i) t.corrupted += dst[i] != want[i];
              }
            }
          }
          next(end);
        });
  }
};

}  // namespace

int main(int argc, char** argv) {
  double seconds = 60;
  std::uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--seconds") seconds = std::atof(argv[i + 1]);
    if (a == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
  }
  asio::io_context io;
  std::vector<std::byte> target_mem(2 * half), direct_mem(half), faulty_mem(half);
  kvlink::engine target{io.get_executor(), engine_config(2)};
  const auto seg = target.register_segment(target_mem.data(), target_mem.size());
  kvlink::engine direct{io.get_executor(), engine_config(2)};
  kvlink::engine faulty{io.get_executor(), engine_config(4)};
  direct.register_segment(direct_mem.data(), direct_mem.size());
  faulty.register_segment(faulty_mem.data(), faulty_mem.size());
  kvlink_test::fault_proxy proxy{target.listen_address()};
  std::uint64_t notes = 0;
  std::function<void()> receive = [&] {
    target.async_receive_notification([&](std::error_code ec, const kvlink::notification&) {
      if (ec) return;
      ++notes;
      receive();
    });
  };
  receive();

  // Warm up (allocations that stay) before the first reading.
  totals t;
  const auto rss0 = kvlink_test::rss_kib();
  const auto fds0 = kvlink_test::open_fds();
  const auto end = steady::now() + std::chrono::duration_cast<steady::duration>(
                                       std::chrono::duration<double>(seconds));
  driver d1{"direct",
            io,
            direct,
            target.local_address(),
            direct_mem,
            target_mem.data(),
            seg,
            0,
            nullptr,
            t,
            std::mt19937_64{seed},
            {},
            false,
            false,
            {},
            {}};
  driver d2{"faulty",
            io,
            faulty,
            proxy.address(),
            faulty_mem,
            target_mem.data() + half,
            seg,
            half,
            &proxy,
            t,
            std::mt19937_64{seed + 1},
            {},
            false,
            false,
            {},
            {}};
  d1.connect_then_go(end);
  d2.connect_then_go(end);
  const auto hang_limit = 5s + 300ms + 10s;
  while (steady::now() < end + hang_limit && (d1.busy || d2.busy || steady::now() < end)) {
    io.run_one_for(10ms);
    for (auto* d : {&d1, &d2}) {
      if (d->busy && steady::now() - d->started > hang_limit &&
          d->started != steady::time_point{}) {
        ++t.hangs;
        d->busy = false;
      }
    }
  }
  proxy.clear_faults();
  for (int i = 0; i < 50; ++i) io.run_one_for(10ms);
  const auto rss1 = kvlink_test::rss_kib();
  const auto fds1 = kvlink_test::open_fds();
  // Leaked descriptors show once the initiators are closed: every
  // connection they made (and the proxy's and the target's ends of it) must
  // go, leaving at most the baseline (their listeners go too).
  int closed = 0;
  direct.async_close([&](std::error_code) { ++closed; });
  faulty.async_close([&](std::error_code) { ++closed; });
  // Their two listeners were open at the baseline.
  const std::size_t fds_want = fds0 - 2;
  std::size_t fds2 = kvlink_test::open_fds();
  for (int i = 0; i < 500 && (closed < 2 || fds2 > fds_want); ++i) {
    io.run_one_for(10ms);
    fds2 = kvlink_test::open_fds();
  }
  std::printf(
      "soak: %.0f s, seed %llu: %llu transfers, %.2f GB moved, %llu faults injected, %llu failed "
      "as expected, %llu unexpected failures, %llu corrupted bytes, %llu hangs, %llu double "
      "completions, %llu reconnects, %llu with checksums, %llu/%llu notifications received; RSS "
      "%llu -> %llu KiB, fds %zu -> %zu connected, %zu after the initiators closed\n",
      seconds, static_cast<unsigned long long>(seed), static_cast<unsigned long long>(t.transfers),
      static_cast<double>(t.bytes) / 1e9, static_cast<unsigned long long>(t.faults),
      static_cast<unsigned long long>(t.failed_expected),
      static_cast<unsigned long long>(t.failed_unexpected),
      static_cast<unsigned long long>(t.corrupted), static_cast<unsigned long long>(t.hangs),
      static_cast<unsigned long long>(t.double_calls),
      static_cast<unsigned long long>(t.reconnects), static_cast<unsigned long long>(t.checksummed),
      static_cast<unsigned long long>(notes), static_cast<unsigned long long>(t.notifications_sent),
      static_cast<unsigned long long>(rss0), static_cast<unsigned long long>(rss1), fds0, fds1,
      fds2);
  const bool ok = t.failed_unexpected == 0 && t.corrupted == 0 && t.hangs == 0 &&
                  t.double_calls == 0 && t.transfers > 0 && fds2 <= fds_want &&
                  rss1 <= rss0 + 256 * 1024;
  std::printf("soak: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
