// basic_engine over TCP between two processes: this test's engine against a
// kvlink_test_peer child (test/support/test_peer.cpp) on loopback. WRITE and
// READ from 1 byte to 64 MiB at random offsets and in batches of 1 to 10^4
// requests, bytes verified on both sides (READs here, WRITEs by the child's
// CHECK command); the child's access grant enforced; and a child killed with
// SIGKILL mid-transfer: the transfer ends with peer_closed, the peer reads as
// disconnected, later transfers fail fast.
//
// Every child is owned by a guard that SIGKILLs and reaps it in its
// destructor, and it gets PR_SET_PDEATHSIG, so no process outlives the test.
#include <kvlink/engine.hpp>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "../../support/peer_process.hpp"
#include "../../support/test_support.hpp"
#include "../../support/two_process_rig.hpp"
#include <asio/io_context.hpp>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef KVLINK_TEST_PEER_PATH
#error \
    "KVLINK_TEST_PEER_PATH (the kvlink_test_peer executable) is set by test/support/CMakeLists.txt"
#endif

namespace {

using namespace std::chrono_literals;
using kvlink::opcode;
using kvlink_test::fill_pattern;
using kvlink_test::is_pattern;
using kvlink_test::outcome;
using kvlink_test::peer_process;
using kvlink_test::rig;
using kvlink_test::run_until;
using kvlink_test::segment_size;

}  // namespace

TEST_CASE("two processes: the child announces its segment and serves READs of its pattern") {
  rig r{"rw", 77};
  REQUIRE(r.peer.connected());
  CHECK(r.peer.transport() == "tcp");
  CHECK(r.peer.address() == r.child.address());
  REQUIRE(r.peer.segments().size() == 1);
  CHECK(r.peer.segments()[0].length == segment_size);
  auto out = r.run({r.req(opcode::read, 0, 0, segment_size)});
  REQUIRE_MESSAGE(!out.ec, out.ec.message());
  CHECK(out.result.bytes == segment_size);
  CHECK(is_pattern(r.local_mem.data(), segment_size, 77, 0));
  // The child's own check agrees, and catches a wrong seed.
  CHECK(r.check_remote(0, segment_size, 77) == "OK");
  CHECK(r.check_remote(0, segment_size, 78).rfind("BAD ", 0) == 0);
  CHECK(r.child.command("CHECK 1 2").rfind("ERR", 0) == 0);
  CHECK(r.child.command("FILL 1 " + std::to_string(segment_size + 1)).rfind("ERR", 0) == 0);
  CHECK(r.check_remote(0, segment_size, 77) == "OK");  // the refused FILL wrote nothing
  CHECK(r.child.finish() == 0);                        // EOF on stdin: a clean exit
}

TEST_CASE("two processes: sizes from 1 byte to 64 MiB at random offsets, WRITE and READ") {
  rig r;
  std::mt19937_64 g{4242};
  // Every round fills and checks both 80 MiB segments; under ThreadSanitizer
  // (several times slower per byte, and large sizes add no interleavings)
  // fewer rounds, in their first 20 MiB.
  const std::uint64_t span = kvlink_test::under_thread_sanitizer ? 20u << 20 : segment_size;
  for (const auto size : kvlink_test::sizes_up_to_64_mib()) {
    for (const auto op : {opcode::write, opcode::read}) {
      CAPTURE(size);
      CAPTURE(kvlink::to_string(op));
      const auto slack = span - size;
      const auto loff = static_cast<std::size_t>(g() % (slack + 1));
      const auto roff = g() % (slack + 1);
      const auto local_seed = g();
      const auto remote_seed = g();
      REQUIRE(r.fill_remote(remote_seed, span) == "OK");
      fill_pattern(r.local_mem.data(), span, local_seed, 0);
      if (op == opcode::write) {
        // The local source holds the pattern of `write_seed` as it should
        // land at [roff, roff + size) in the child.
        const auto write_seed = g();
        fill_pattern(r.local_mem.data() + loff, size, write_seed, roff);
        auto out = r.run({r.req(op, loff, roff, size)});
        REQUIRE_MESSAGE(!out.ec, out.ec.message());
        CHECK(out.result.bytes == size);
        CHECK(r.check_remote(roff, size, write_seed) == "OK");
        // Nothing around the destination changed.
        CHECK(r.check_remote(0, roff, remote_seed) == "OK");
        CHECK(r.check_remote(roff + size, span - roff - size, remote_seed) == "OK");
      } else {
        auto out = r.run({r.req(op, loff, roff, size)});
        REQUIRE_MESSAGE(!out.ec, out.ec.message());
        CHECK(out.result.bytes == size);
        CHECK(is_pattern(r.local_mem.data() + loff, size, remote_seed, roff));
        CHECK(is_pattern(r.local_mem.data(), loff, local_seed, 0));
        CHECK(is_pattern(r.local_mem.data() + loff + size, span - loff - size, local_seed,
                         loff + size));
        CHECK(r.check_remote(0, span, remote_seed) == "OK");  // a READ changes nothing there
      }
    }
  }
  CHECK(r.child.finish() == 0);
}

TEST_CASE("two processes: batches of 1 to 10^4 requests, scattered, mixed sizes") {
  constexpr std::uint64_t region = 16u << 20;
  // Each round fills and checks both segments: under ThreadSanitizer their
  // first 20 MiB only (the slots and a tail beyond them).
  const std::uint64_t span = kvlink_test::under_thread_sanitizer ? 20u << 20 : segment_size;
  rig r;
  std::mt19937_64 g{99};
  const std::vector<std::size_t> counts = kvlink_test::under_thread_sanitizer
                                              ? std::vector<std::size_t>{1, 100, 10000}
                                              : std::vector<std::size_t>{1, 10, 100, 1000, 10000};
  for (const std::size_t n : counts) {
    for (const auto op : {opcode::write, opcode::read}) {
      CAPTURE(n);
      CAPTURE(kvlink::to_string(op));
      const auto local_seed = g();
      const auto remote_seed = g();
      const auto write_seed = g();
      REQUIRE(r.fill_remote(remote_seed, span) == "OK");
      fill_pattern(r.local_mem.data(), span, local_seed, 0);
      // Disjoint remote ranges: a permutation of fixed-size slots.
      const std::uint64_t slot = region / n;
      std::vector<std::uint64_t> perm(n);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), g);
      std::vector<kvlink::transfer_request> reqs;
      std::vector<std::uint64_t> lens;
      std::uint64_t bytes = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const auto len = 1 + g() % slot;
        lens.push_back(len);
        if (op == opcode::write)
          fill_pattern(r.local_mem.data() + i * slot, len, write_seed, perm[i] * slot);
        reqs.push_back(r.req(op, i * slot, perm[i] * slot, len));
        bytes += len;
      }
      auto out = r.run(reqs);
      REQUIRE_MESSAGE(!out.ec, out.ec.message());
      CHECK(out.result.bytes == bytes);
      CHECK(out.result.requests == n);
      if (op == opcode::write) {
        // Each slot: the written head, the untouched rest; then the tail of
        // the segment beyond the slots.
        std::vector<rig::range> ranges;
        for (std::size_t i = 0; i < n; ++i) {
          ranges.push_back({perm[i] * slot, lens[i], write_seed});
          ranges.push_back({perm[i] * slot + lens[i], slot - lens[i], remote_seed});
        }
        ranges.push_back({n * slot, span - n * slot, remote_seed});
        CHECK(r.check_remote(ranges) == "OK");
      } else {
        for (std::size_t i = 0; i < n; ++i) {
          CAPTURE(i);
          REQUIRE(is_pattern(r.local_mem.data() + i * slot, lens[i], remote_seed, perm[i] * slot));
          REQUIRE(is_pattern(r.local_mem.data() + i * slot + lens[i], slot - lens[i], local_seed,
                             i * slot + lens[i]));
        }
        CHECK(is_pattern(r.local_mem.data() + n * slot, span - n * slot, local_seed, n * slot));
      }
    }
  }
  CHECK(r.child.finish() == 0);
}

TEST_CASE("two processes: the child's access grant is enforced across the process boundary") {
  rig r{"r", 5};  // the child grants READ only
  fill_pattern(r.local_mem.data(), segment_size, 6, 0);
  auto w = r.run({r.req(opcode::write, 0, 4096, 1 << 20)});
  CHECK(w.ec == kvlink::errc::access_denied);
  CHECK(r.check_remote(0, segment_size, 5) == "OK");  // not a byte written
  auto rd = r.run({r.req(opcode::read, 0, 4096, 1 << 20)});
  REQUIRE_MESSAGE(!rd.ec, rd.ec.message());
  CHECK(is_pattern(r.local_mem.data(), 1 << 20, 5, 4096));
  CHECK(r.child.finish() == 0);
}

namespace {

void kill_mid_transfer(opcode op) {
  CAPTURE(kvlink::to_string(op));
  constexpr std::uint64_t size = 64u << 20;
  rig r;
  fill_pattern(r.local_mem.data(), segment_size, 3, 0);
  std::optional<outcome> out;
  r.engine.async_submit_transfer(std::vector{r.req(op, 0, 0, size)},
                                 [&](std::error_code ec, kvlink::transfer_result res) {
                                   out = outcome{ec, res};
                                 });
  // Let some bytes flow, then the child dies without a word.
  for (int i = 0; i < 20 && !out; ++i) r.io.run_one_for(5ms);
  r.child.kill_now();
  REQUIRE(run_until(r.io, [&] { return out.has_value(); }));
  if (out->ec) {  // it may have finished before the child died
    CHECK(out->ec == kvlink::errc::peer_closed);
    CHECK(out->result.bytes < size);
  } else {
    CHECK(out->result.bytes == size);
  }
  REQUIRE(run_until(r.io, [&] { return !r.peer.connected(); }));
  std::optional<std::error_code> later;
  r.engine.async_submit_transfer(std::vector{r.req(op, 0, 0, 16)},
                                 [&](std::error_code ec, kvlink::transfer_result) { later = ec; });
  REQUIRE(run_until(r.io, [&] { return later.has_value(); }));
  CHECK(*later == kvlink::errc::peer_closed);
}

}  // namespace

TEST_CASE(
    "two processes: a peer killed mid-transfer fails it with peer_closed, later transfers fail "
    "fast") {
  SUBCASE("WRITE") { kill_mid_transfer(opcode::write); }
  SUBCASE("READ") { kill_mid_transfer(opcode::read); }
}

TEST_CASE(
    "two processes: one target killed mid-transfer, another unaffected; the restarted "
    "target is a new instance and nothing stale reaches it") {
  rig a;  // the target that dies
  peer_process b_child{{"--size", std::to_string(segment_size), "--seed", "2"}};
  std::optional<std::pair<std::error_code, kvlink::peer>> cb;
  a.engine.async_connect(b_child.address(),
                         [&](std::error_code ec, kvlink::peer p) { cb.emplace(ec, p); });
  REQUIRE(run_until(a.io, [&] { return cb.has_value(); }));
  REQUIRE_FALSE(cb->first);
  const kvlink::peer b = cb->second;
  fill_pattern(a.local_mem.data(), segment_size, 9, 0);
  std::optional<outcome> to_a, to_b;
  a.engine.async_submit_transfer(
      std::vector<kvlink::transfer_request>{
          {opcode::write, a.local_mem.data(), a.remote, 0, 64u << 20}},
      [&](std::error_code ec, kvlink::transfer_result res) {
        to_a = outcome{ec, res};
      });
  a.engine.async_submit_transfer(
      std::vector<kvlink::transfer_request>{
          {opcode::write, a.local_mem.data(), b.segment(0), 0, 64u << 20}},
      [&](std::error_code ec, kvlink::transfer_result res) {
        to_b = outcome{ec, res};
      });
  for (int i = 0; i < 10 && !to_a; ++i) a.io.run_one_for(5ms);
  const auto t0 = std::chrono::steady_clock::now();
  const auto old_address = a.child.address();
  const auto old_instance = a.peer.instance();
  a.child.kill_now();
  REQUIRE(run_until(a.io, [&] { return to_a.has_value() && to_b.has_value(); }));
  if (to_a->ec) {
    CHECK(to_a->ec == kvlink::errc::peer_closed);
    MESSAGE("the killed target was reported after "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
            << " s");
  }
  REQUIRE_MESSAGE(!to_b->ec, to_b->ec.message());  // the other peer did not notice
  CHECK(b_child.command("CHECK 0 67108864 9") == "OK");

  // The target comes back on the same address: a new instance.
  peer_process restarted{{"--size", std::to_string(segment_size), "--seed", "3", "--config",
                          R"({"listen": ")" + old_address + R"("})"}};
  REQUIRE(restarted.address() == old_address);
  std::optional<std::pair<std::error_code, kvlink::peer>> cn;
  a.engine.async_connect(old_address,
                         [&](std::error_code ec, kvlink::peer p) { cn.emplace(ec, p); });
  REQUIRE(run_until(a.io, [&] { return cn.has_value(); }));
  REQUIRE_FALSE(cn->first);
  CHECK(cn->second.instance() != old_instance);
  CHECK(cn->second.id() != a.peer.id());
  // The old handle's segment does not reach the new instance.
  std::optional<std::error_code> stale;
  a.engine.async_submit_transfer(
      std::vector<kvlink::transfer_request>{{opcode::write, a.local_mem.data(), a.remote, 0, 4096}},
      [&](std::error_code ec, kvlink::transfer_result) { stale = ec; });
  REQUIRE(run_until(a.io, [&] { return stale.has_value(); }));
  CHECK(*stale == kvlink::errc::peer_closed);
  CHECK(restarted.command("CHECK 0 4096 3") == "OK");  // untouched: still its own pattern
  // The new handle works.
  std::optional<std::error_code> fresh;
  a.engine.async_submit_transfer(
      std::vector<kvlink::transfer_request>{
          {opcode::write, a.local_mem.data(), cn->second.segment(0), 0, 4096}},
      [&](std::error_code ec, kvlink::transfer_result) { fresh = ec; });
  REQUIRE(run_until(a.io, [&] { return fresh.has_value(); }));
  CHECK_FALSE(*fresh);
  CHECK(restarted.command("CHECK 0 4096 9") == "OK");
}

TEST_CASE("two processes: an initiator killed mid-WRITE; the target and its other peers go on") {
  asio::io_context io;
  auto cfg = rig::config("tcp");
  kvlink::tcp_engine target{io.get_executor(), cfg};
  std::vector<std::byte> mem(segment_size);
  const auto seg = target.register_segment(mem.data(), mem.size());
  peer_process pusher{{"--size", std::to_string(segment_size)}};
  REQUIRE(pusher.command("PUSH " + target.local_address() + " 67108864") == "STARTED");
  // Let its WRITEs flow into our segment, then kill it mid-transfer.
  for (int i = 0; i < 100; ++i) io.run_one_for(2ms);
  pusher.kill_now();
  // Another initiator (in this process) is served as before.
  kvlink::tcp_engine other{io.get_executor(), cfg};
  std::vector<std::byte> src(1u << 20);
  fill_pattern(src.data(), src.size(), 21, 0);
  other.register_segment(src.data(), src.size());
  std::optional<std::pair<std::error_code, kvlink::peer>> c;
  other.async_connect(target.local_address(),
                      [&](std::error_code ec, kvlink::peer p) { c.emplace(ec, p); });
  REQUIRE(run_until(io, [&] { return c.has_value(); }));
  REQUIRE_FALSE(c->first);
  std::optional<std::error_code> w;
  other.async_submit_transfer(
      std::vector<kvlink::transfer_request>{
          {opcode::write, src.data(), c->second.segment(seg), 0, src.size()}},
      [&](std::error_code ec, kvlink::transfer_result) { w = ec; });
  REQUIRE(run_until(io, [&] { return w.has_value(); }));
  CHECK_FALSE(*w);
  CHECK(is_pattern(mem.data(), src.size(), 21, 0));
  // The dead initiator's half-read frames hold the segment no longer:
  // unregistering it completes at once.
  std::optional<std::error_code> unreg;
  const auto t0 = std::chrono::steady_clock::now();
  target.async_unregister_segment(seg, [&](std::error_code ec) { unreg = ec; });
  REQUIRE(run_until(io, [&] { return unreg.has_value(); }));
  CHECK_FALSE(*unreg);
  CHECK(std::chrono::steady_clock::now() - t0 < cfg.fence_timeout + 1s);
}
