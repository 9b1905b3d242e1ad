// basic_engine over TCP, two engines in one process on loopback: integrity
// across sizes and batch shapes, every completion token, every error the
// engine promises, cancellation and deadlines (and that no byte of the
// caller's buffer changes after the handler ran), hostile clients.
#include <kvlink/core/crc32c.hpp>
#include <kvlink/engine.hpp>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "../../support/test_support.hpp"
#include <asio/bind_cancellation_slot.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/experimental/awaitable_operators.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>
#include <doctest/doctest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

namespace {

using namespace std::chrono_literals;
using kvlink::opcode;
using kvlink_test::run_until;
using json = nlohmann::json;

void fill(std::span<std::byte> s, std::uint64_t seed) {
  std::mt19937_64 g{seed};
  std::size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    const auto v = g();
    std::memcpy(s.data() + i, &v, 8);
  }
  for (; i < s.size(); ++i) s[i] = static_cast<std::byte>(g());
}

kvlink::config test_config() {
  kvlink::config c;
  c.fence_timeout = 200ms;
  c.connect_timeout = 2s;
  return c;
}

struct run_outcome {
  std::error_code ec;
  kvlink::transfer_result result;
};

struct pair_rig {
  asio::io_context io;
  std::optional<kvlink::tcp_engine> target;
  kvlink::tcp_engine initiator;
  std::vector<std::byte> remote_mem;
  std::vector<std::byte> local_mem;
  kvlink::segment_id remote_seg;
  kvlink::peer peer;

  explicit pair_rig(std::size_t size = 1 << 20,
                    kvlink::access acc = kvlink::access::remote_read_write,
                    kvlink::config tcfg = test_config(), kvlink::config icfg = test_config())
      : target(std::in_place, io.get_executor(), tcfg),
        initiator(io.get_executor(), icfg),
        remote_mem(size),
        local_mem(size) {
    remote_seg = target->register_segment(remote_mem.data(), remote_mem.size(), acc);
    initiator.register_segment(local_mem.data(), local_mem.size());
    peer = connect(target->local_address());
  }

  kvlink::peer connect(const std::string& addr) {
    std::optional<std::pair<std::error_code, kvlink::peer>> out;
    initiator.async_connect(addr, [&](std::error_code ec, kvlink::peer p) { out.emplace(ec, p); });
    REQUIRE(run_until(io, [&] { return out.has_value(); }));
    REQUIRE_MESSAGE(!out->first, out->first.message());
    return out->second;
  }

  run_outcome run(const std::vector<kvlink::transfer_request>& reqs,
                  kvlink::transfer_options opts = {}) {
    std::optional<run_outcome> out;
    initiator.async_submit_transfer(reqs, opts, [&](std::error_code ec, kvlink::transfer_result r) {
      out = run_outcome{ec, r};
    });
    REQUIRE(run_until(io, [&] { return out.has_value(); }));
    return *out;
  }

  kvlink::transfer_request req(opcode op, std::size_t local_off, std::uint64_t remote_off,
                               std::uint64_t len) {
    return {op, local_mem.data() + local_off, peer.segment(0), remote_off, len};
  }
};

}  // namespace

TEST_CASE("write then read back, one request") {
  pair_rig r;
  REQUIRE(r.peer.connected());
  CHECK(r.peer.transport() == "tcp");
  REQUIRE(r.peer.segments().size() == 1);
  CHECK(r.peer.segments()[0].length == r.remote_mem.size());
  fill(r.local_mem, 1);
  auto w = r.run({r.req(opcode::write, 0, 0, r.local_mem.size())});
  REQUIRE_MESSAGE(!w.ec, w.ec.message());
  CHECK(w.result.bytes == r.local_mem.size());
  CHECK(w.result.requests == 1);
  CHECK(w.result.lanes == std::min(w.result.slices, 2u));
  CHECK(std::memcmp(r.local_mem.data(), r.remote_mem.data(), r.local_mem.size()) == 0);
  fill(r.remote_mem, 2);
  auto rd = r.run({r.req(opcode::read, 0, 0, r.local_mem.size())});
  REQUIRE_FALSE(rd.ec);
  CHECK(rd.result.bytes == r.local_mem.size());
  CHECK(std::memcmp(r.local_mem.data(), r.remote_mem.data(), r.local_mem.size()) == 0);
}

TEST_CASE("sizes from 1 byte to 64 MiB at random offsets, WRITE and READ") {
  // Every round fills and compares both segments whole: under
  // ThreadSanitizer (several times slower per byte; large sizes add no
  // interleavings) fewer rounds, up to 16 MiB.
  constexpr bool cut = kvlink_test::under_thread_sanitizer;
  constexpr std::size_t total = (cut ? 16u << 20 : 64u << 20) + 8192;
  pair_rig r{total};
  std::mt19937_64 g{42};
  for (const auto size : kvlink_test::sizes_up_to_64_mib()) {
    for (const auto op : {opcode::write, opcode::read}) {
      CAPTURE(size);
      CAPTURE(kvlink::to_string(op));
      const auto slack = total - size;
      const auto loff = static_cast<std::size_t>(g() % (slack + 1));
      const auto roff = g() % (slack + 1);
      fill(r.local_mem, g());
      fill(r.remote_mem, g());
      auto* src = op == opcode::write ? r.local_mem.data() + loff : r.remote_mem.data() + roff;
      std::vector<std::byte> expect(src, src + size);
      // Bytes around the destination range must not change.
      auto* dst_base = op == opcode::write ? r.remote_mem.data() : r.local_mem.data();
      const auto doff = op == opcode::write ? static_cast<std::size_t>(roff) : loff;
      std::vector<std::byte> before(dst_base, dst_base + total);
      auto out = r.run({r.req(op, loff, roff, size)});
      REQUIRE_MESSAGE(!out.ec, out.ec.message());
      CHECK(out.result.bytes == size);
      if (size >= (16u << 20)) CHECK(out.result.lanes == 2);  // one request uses every lane
      CHECK(std::memcmp(dst_base + doff, expect.data(), size) == 0);
      CHECK(std::memcmp(dst_base, before.data(), doff) == 0);
      CHECK(std::memcmp(dst_base + doff + size, before.data() + doff + size, total - doff - size) ==
            0);
    }
  }
}

TEST_CASE("batches of 1 to 10^4 requests, scattered, mixed sizes") {
  constexpr std::size_t total = 16u << 20;
  pair_rig r{total};
  std::mt19937_64 g{7};
  for (const std::size_t n : {1u, 10u, 100u, 1000u, 10000u}) {
    for (const auto op : {opcode::write, opcode::read}) {
      CAPTURE(n);
      fill(r.local_mem, g());
      fill(r.remote_mem, g());
      // Disjoint destination ranges: a permutation of fixed-size slots.
      const std::size_t slot = total / n;
      std::vector<std::size_t> perm(n);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), g);
      std::vector<kvlink::transfer_request> reqs;
      std::uint64_t bytes = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const auto len = 1 + g() % slot;
        reqs.push_back(r.req(op, i * slot, perm[i] * slot, len));
        bytes += len;
      }
      auto local_before = r.local_mem;
      auto remote_before = r.remote_mem;
      auto out = r.run(reqs);
      REQUIRE_MESSAGE(!out.ec, out.ec.message());
      CHECK(out.result.bytes == bytes);
      CHECK(out.result.requests == n);
      for (std::size_t i = 0; i < n; ++i) {
        const auto& q = reqs[i];
        const auto loff =
            static_cast<std::size_t>(static_cast<std::byte*>(q.local) - r.local_mem.data());
        if (op == opcode::write) {
          REQUIRE(std::memcmp(r.remote_mem.data() + q.remote_offset, local_before.data() + loff,
                              q.length) == 0);
        } else {
          REQUIRE(std::memcmp(r.local_mem.data() + loff, remote_before.data() + q.remote_offset,
                              q.length) == 0);
        }
      }
    }
  }
}

TEST_CASE("completion tokens: callback, future, use_awaitable, as_tuple") {
  pair_rig r;
  fill(r.local_mem, 3);
  std::vector<kvlink::transfer_request> reqs{r.req(opcode::write, 0, 0, 4096)};

  // The handler never runs inside the initiating function.
  bool called = false;
  r.initiator.async_submit_transfer(
      reqs, [&](std::error_code, kvlink::transfer_result) { called = true; });
  CHECK_FALSE(called);
  REQUIRE(run_until(r.io, [&] { return called; }));

  // From a handler of the engine's io_context, where the transfer starts in
  // the calling thread (the engine's strand is idle), the handler still
  // runs after the initiating call: for bytes moved and for an error found
  // at the start.
  {
    fill(r.local_mem, 5);
    std::optional<std::error_code> good, bad;
    bool inside_call = false, ran_inside = false;
    asio::post(r.io, [&] {
      inside_call = true;
      r.initiator.async_submit_transfer(reqs, [&](std::error_code ec, kvlink::transfer_result) {
        ran_inside |= inside_call;
        good = ec;
      });
      r.initiator.async_submit_transfer(
          std::vector<kvlink::transfer_request>{r.req(opcode::write, 0, r.remote_mem.size(), 1)},
          [&](std::error_code ec, kvlink::transfer_result) {
            ran_inside |= inside_call;
            bad = ec;
          });
      inside_call = false;
    });
    REQUIRE(run_until(r.io, [&] { return good && bad; }));
    CHECK_FALSE(ran_inside);
    REQUIRE_MESSAGE(!*good, good->message());
    CHECK(std::memcmp(r.remote_mem.data(), r.local_mem.data(), 4096) == 0);
    CHECK(*bad == kvlink::errc::out_of_bounds);
  }

  auto fut = r.initiator.async_submit_transfer(reqs, asio::use_future);
  REQUIRE(run_until(r.io, [&] { return fut.wait_for(0s) == std::future_status::ready; }));
  CHECK(fut.get().bytes == 4096);

  std::optional<std::uint64_t> bytes;
  std::optional<std::error_code> tuple_ec;
  asio::co_spawn(
      r.io,
      [&]() -> asio::awaitable<void> {
        auto res = co_await r.initiator.async_submit_transfer(reqs, asio::use_awaitable);
        bytes = res.bytes;
        // A failing transfer through as_tuple: no exception, the error code.
        std::vector<kvlink::transfer_request> bad{r.req(opcode::write, 0, r.remote_mem.size(), 1)};
        auto [ec, res2] = co_await r.initiator.async_submit_transfer(
            bad, asio::experimental::as_tuple(asio::use_awaitable));
        (void)res2;
        tuple_ec = ec;
      },
      asio::detached);
  REQUIRE(run_until(r.io, [&] { return tuple_ec.has_value(); }));
  CHECK(bytes == 4096u);
  CHECK(*tuple_ec == kvlink::errc::out_of_bounds);

  // use_awaitable turns an error into std::system_error carrying the code.
  std::optional<std::error_code> thrown;
  asio::co_spawn(
      r.io,
      [&]() -> asio::awaitable<void> {
        try {
          std::vector<kvlink::transfer_request> bad{
              r.req(opcode::write, 0, 0, r.remote_mem.size() + 1)};
          co_await r.initiator.async_submit_transfer(bad, asio::use_awaitable);
        } catch (const std::system_error& e) {
          thrown = e.code();
        }
      },
      asio::detached);
  REQUIRE(run_until(r.io, [&] { return thrown.has_value(); }));
  CHECK(*thrown == kvlink::errc::out_of_bounds);
}

TEST_CASE("request errors are reported and move nothing") {
  pair_rig r{1 << 20, kvlink::access::remote_read};  // target grants READ only
  fill(r.remote_mem, 5);
  const auto remote_before = r.remote_mem;
  std::vector<std::byte> unregistered(4096);

  SUBCASE("unregistered local memory") {
    auto out = r.run({{opcode::read, unregistered.data(), r.peer.segment(0), 0, 4096}});
    CHECK(out.ec == kvlink::errc::not_registered);
  }
  SUBCASE("local range runs past its segment") {
    auto out = r.run({r.req(opcode::read, r.local_mem.size() - 10, 0, 20)});
    CHECK(out.ec == kvlink::errc::out_of_bounds);
  }
  SUBCASE("remote out of bounds") {
    auto out = r.run({r.req(opcode::read, 0, r.remote_mem.size() - 10, 20)});
    CHECK(out.ec == kvlink::errc::out_of_bounds);
  }
  SUBCASE("remote offset overflow") {
    auto out = r.run({r.req(opcode::read, 0, ~0ull - 4, 10)});
    CHECK(out.ec == kvlink::errc::out_of_bounds);
  }
  SUBCASE("access denied: WRITE into a read-only segment") {
    auto out = r.run({r.req(opcode::write, 0, 0, 4096)});
    CHECK(out.ec == kvlink::errc::access_denied);
  }
  SUBCASE("zero length") {
    auto out = r.run({r.req(opcode::read, 0, 0, 0)});
    CHECK(out.ec == kvlink::errc::invalid_argument);
  }
  SUBCASE("unknown peer") {
    auto out = r.run({{opcode::read, r.local_mem.data(),
                       kvlink::remote_segment{kvlink::peer_id{999}, r.remote_seg}, 0, 1}});
    CHECK(out.ec == kvlink::errc::unknown_peer);
  }
  SUBCASE("a segment id the target never registered: the target refuses it") {
    auto out =
        r.run({{opcode::read, r.local_mem.data(), r.peer.segment(kvlink::segment_id{77}), 0, 16}});
    CHECK(out.ec == kvlink::errc::not_registered);
    // ... and the connection survives it.
    auto ok = r.run({r.req(opcode::read, 0, 0, 4096)});
    CHECK_FALSE(ok.ec);
  }
  SUBCASE("one bad request fails the whole batch before anything moves") {
    auto out =
        r.run({r.req(opcode::read, 0, 0, 4096), r.req(opcode::read, 0, r.remote_mem.size(), 1)});
    CHECK(out.ec == kvlink::errc::out_of_bounds);
    CHECK(out.result.bytes == 0);
  }
  CHECK(r.remote_mem == remote_before);
}

// The engine looks a batch's local segment, peer and remote segment up once
// per run of equal ones: a request that leaves the run (another segment,
// another peer whose segment has the same id, a range past the end of the
// segment the run was in) is checked against its own.
TEST_CASE("a batch alternating segments and peers: each request checked against its own") {
  pair_rig r;
  std::vector<std::byte> local2(64 << 10);
  r.initiator.register_segment(local2.data(), local2.size());
  std::vector<std::byte> readonly(64 << 10);
  const auto ro_id =
      r.target->register_segment(readonly.data(), readonly.size(), kvlink::access::remote_read);
  REQUIRE(run_until(r.io, [&] { return r.peer.segments().size() == 2; }));
  kvlink::tcp_engine other{r.io.get_executor(), test_config()};
  std::vector<std::byte> other_mem(64 << 10);
  const auto other_id =
      other.register_segment(other_mem.data(), other_mem.size(), kvlink::access::remote_read_write);
  REQUIRE(other_id == r.remote_seg);  // the same id on both peers: only the peer tells them apart
  const auto peer2 = r.connect(other.local_address());
  const kvlink::remote_segment ro = r.peer.segment(ro_id);
  const kvlink::remote_segment big = r.peer.segment(0);
  const kvlink::remote_segment small = peer2.segment(0);

  fill(r.local_mem, 41);
  fill(local2, 42);
  fill(readonly, 43);
  fill(r.remote_mem, 44);
  fill(other_mem, 45);
  // 4 KiB pieces: WRITE local_mem -> big, WRITE local2 -> small (other
  // peer), READ ro -> local_mem, in turn, 16 of each.
  std::vector<kvlink::transfer_request> reqs;
  for (std::size_t i = 0; i < 16; ++i) {
    reqs.push_back({opcode::write, r.local_mem.data() + i * 4096, big, i * 8192, 4096});
    reqs.push_back({opcode::write, local2.data() + i * 4096, small, (15 - i) * 4096, 4096});
    reqs.push_back({opcode::read, r.local_mem.data() + (512 << 10) + i * 4096, ro, i * 4096, 4096});
  }
  auto out = r.run(reqs);
  REQUIRE_MESSAGE(!out.ec, out.ec.message());
  CHECK(out.result.bytes == reqs.size() * 4096);
  for (std::size_t i = 0; i < 16; ++i) {
    CHECK(std::memcmp(r.remote_mem.data() + i * 8192, r.local_mem.data() + i * 4096, 4096) == 0);
    CHECK(std::memcmp(other_mem.data() + (15 - i) * 4096, local2.data() + i * 4096, 4096) == 0);
    CHECK(std::memcmp(r.local_mem.data() + (512 << 10) + i * 4096, readonly.data() + i * 4096,
                      4096) == 0);
  }

  const auto local_before = r.local_mem;
  const auto local2_before = local2;
  const auto remote_before = r.remote_mem;
  const auto other_before = other_mem;
  // The good batch with `bad` inserted after reqs[at - 1]: reqs[3i] writes
  // to `big`, reqs[3i + 1] from local2 to `small`, reqs[3i + 2] reads `ro`.
  const auto refused = [&](std::size_t at, kvlink::transfer_request bad) {
    auto batch = reqs;
    batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(at), bad);
    return r.run(batch);
  };
  SUBCASE("an offset inside the first peer's segment but past the end of the second's") {
    // After a WRITE to `big`, which has the same id and is 1 MiB long.
    auto bad = refused(31, {opcode::write, local2.data(), small, 64 << 10, 4096});
    CHECK(bad.ec == kvlink::errc::out_of_bounds);
    CHECK(bad.result.bytes == 0);
  }
  SUBCASE("a WRITE into the read-only segment after READs from it") {
    auto bad = refused(33, {opcode::write, r.local_mem.data() + (768 << 10), ro, 60 << 10, 4096});
    CHECK(bad.ec == kvlink::errc::access_denied);
  }
  SUBCASE("a local range that starts in the second local segment and runs past its end") {
    auto bad =
        refused(32, {opcode::write, local2.data() + local2.size() - 100, big, 900 << 10, 4096});
    CHECK(bad.ec == kvlink::errc::out_of_bounds);
  }
  SUBCASE("a request to a peer that is not connected") {
    auto bad = refused(31, {opcode::write, r.local_mem.data() + (768 << 10),
                            kvlink::remote_segment{kvlink::peer_id{999}, r.remote_seg}, 0, 4096});
    CHECK(bad.ec == kvlink::errc::unknown_peer);
  }
  CHECK(r.local_mem == local_before);
  CHECK(local2 == local2_before);
  CHECK(r.remote_mem == remote_before);
  CHECK(other_mem == other_before);
}

TEST_CASE(
    "segments registered after the handshake reach the peer; unregistration waits and refuses") {
  pair_rig r;
  std::vector<std::byte> extra(8192);
  fill(extra, 9);
  const auto id =
      r.target->register_segment(extra.data(), extra.size(), kvlink::access::remote_read);
  REQUIRE(run_until(r.io, [&] { return r.peer.segments().size() == 2; }));
  CHECK(r.peer.segments()[1].id == id);
  auto out = r.run({{opcode::read, r.local_mem.data(), r.peer.segment(id), 0, extra.size()}});
  REQUIRE_FALSE(out.ec);
  CHECK(std::memcmp(r.local_mem.data(), extra.data(), extra.size()) == 0);

  std::optional<std::error_code> unreg;
  r.target->async_unregister_segment(id, [&](std::error_code ec) { unreg = ec; });
  REQUIRE(run_until(r.io, [&] { return unreg.has_value(); }));
  CHECK_FALSE(*unreg);
  REQUIRE(run_until(r.io, [&] { return r.peer.segments().size() == 1; }));
  auto after = r.run({{opcode::read, r.local_mem.data(), r.peer.segment(id), 0, 16}});
  CHECK(after.ec == kvlink::errc::not_registered);

  std::optional<std::error_code> twice;
  r.target->async_unregister_segment(id, [&](std::error_code ec) { twice = ec; });
  REQUIRE(run_until(r.io, [&] { return twice.has_value(); }));
  CHECK(*twice == kvlink::errc::not_registered);
}

TEST_CASE("overlapping destinations in one batch are refused before anything moves") {
  pair_rig r;
  fill(r.local_mem, 21);
  fill(r.remote_mem, 22);
  const auto local_before = r.local_mem;
  const auto remote_before = r.remote_mem;
  SUBCASE("two WRITEs into overlapping remote ranges (one byte)") {
    auto out = r.run({r.req(opcode::write, 0, 0, 4096), r.req(opcode::write, 8192, 4095, 100)});
    CHECK(out.ec == kvlink::errc::overlapping_destinations);
    CHECK(out.ec.message().find("write the same bytes") != std::string::npos);
    CHECK(out.result.bytes == 0);
  }
  SUBCASE("two READs into overlapping local memory, not adjacent in the batch") {
    auto out = r.run({r.req(opcode::read, 0, 0, 4096), r.req(opcode::read, 65536, 0, 10),
                      r.req(opcode::read, 100, 8192, 10)});
    CHECK(out.ec == kvlink::errc::overlapping_destinations);
  }
  SUBCASE("the same WRITE twice") {
    auto out = r.run({r.req(opcode::write, 0, 512, 64), r.req(opcode::write, 0, 512, 64)});
    CHECK(out.ec == kvlink::errc::overlapping_destinations);
  }
  CHECK(r.local_mem == local_before);
  CHECK(r.remote_mem == remote_before);
}

TEST_CASE("overlapping sources and touching destinations are allowed") {
  pair_rig r;
  fill(r.local_mem, 23);
  fill(r.remote_mem, 24);
  // One local range written to two places; two remote ranges that touch.
  auto w = r.run({r.req(opcode::write, 0, 0, 4096), r.req(opcode::write, 0, 4096, 4096)});
  REQUIRE_MESSAGE(!w.ec, w.ec.message());
  CHECK(std::memcmp(r.remote_mem.data(), r.local_mem.data(), 4096) == 0);
  CHECK(std::memcmp(r.remote_mem.data() + 4096, r.local_mem.data(), 4096) == 0);
  // The same remote bytes read into two places; a WRITE and a READ of the
  // same remote range write different memory (remote and local).
  fill(r.remote_mem, 25);
  auto rd = r.run({r.req(opcode::read, 100000, 0, 4096), r.req(opcode::read, 200000, 0, 4096)});
  REQUIRE_MESSAGE(!rd.ec, rd.ec.message());
  CHECK(std::memcmp(r.local_mem.data() + 100000, r.remote_mem.data(), 4096) == 0);
  CHECK(std::memcmp(r.local_mem.data() + 200000, r.remote_mem.data(), 4096) == 0);
}

TEST_CASE("connect errors: unreachable, bad address") {
  asio::io_context io;
  kvlink::tcp_engine eng{io.get_executor(), test_config()};
  // A port nobody listens on: bind one, close it.
  std::uint16_t port = 0;
  {
    asio::ip::tcp::acceptor a{io, {asio::ip::make_address("127.0.0.1"), 0}};
    port = a.local_endpoint().port();
  }
  std::optional<std::error_code> e1, e2;
  eng.async_connect(fmt::format("127.0.0.1:{}", port),
                    [&](std::error_code ec, kvlink::peer) { e1 = ec; });
  eng.async_connect("no-port-here", [&](std::error_code ec, kvlink::peer) { e2 = ec; });
  REQUIRE(run_until(io, [&] { return e1 && e2; }));
  CHECK(*e1 == kvlink::errc::peer_unreachable);
  CHECK(*e2 == kvlink::errc::invalid_argument);
}

TEST_CASE("connecting twice to a live peer reuses it") {
  pair_rig r;
  auto again = r.connect(r.target->local_address());
  CHECK(again.id() == r.peer.id());
  CHECK(again.instance() == r.target->instance());
}

TEST_CASE("a restarted peer is a new instance") {
  asio::io_context io;
  kvlink::tcp_engine ini{io.get_executor(), test_config()};
  std::vector<std::byte> mem(4096);
  ini.register_segment(mem.data(), mem.size());
  std::string addr;
  kvlink::peer first, second;
  {
    kvlink::tcp_engine t{io.get_executor(), test_config()};
    t.register_segment(mem.data(), 1024);
    addr = t.local_address();
    bool done = false;
    ini.async_connect(addr, [&](std::error_code ec, kvlink::peer p) {
      REQUIRE_FALSE(ec);
      first = p;
      done = true;
    });
    REQUIRE(run_until(io, [&] { return done; }));
  }
  // The old engine is gone: its connections close.
  REQUIRE(run_until(io, [&] { return !first.connected(); }));
  auto cfg = test_config();
  cfg.listen = addr;  // same address, new instance
  kvlink::tcp_engine t2{io.get_executor(), cfg};
  bool done = false;
  ini.async_connect(addr, [&](std::error_code ec, kvlink::peer p) {
    REQUIRE_FALSE(ec);
    second = p;
    done = true;
  });
  REQUIRE(run_until(io, [&] { return done; }));
  CHECK(second.id() != first.id());
  CHECK(second.instance() == t2.instance());
  CHECK(second.instance() != first.instance());
  CHECK(second.segments().empty());  // nothing of the old instance is kept
  auto out = std::optional<std::error_code>{};
  std::vector<kvlink::transfer_request> reqs{
      {opcode::read, mem.data(), first.segment(kvlink::segment_id{1}), 0, 16}};
  ini.async_submit_transfer(reqs, [&](std::error_code ec, kvlink::transfer_result) { out = ec; });
  REQUIRE(run_until(io, [&] { return out.has_value(); }));
  CHECK(*out != std::error_code{});
}

TEST_CASE("peer closing mid-transfer fails it with peer_closed, and later transfers fail fast") {
  pair_rig r{64u << 20};
  fill(r.local_mem, 11);
  std::optional<run_outcome> out;
  r.initiator.async_submit_transfer(std::vector{r.req(opcode::write, 0, 0, r.local_mem.size())},
                                    [&](std::error_code ec, kvlink::transfer_result res) {
                                      out = run_outcome{ec, res};
                                    });
  // Let some bytes flow, then the target goes away.
  for (int i = 0; i < 20 && !out; ++i) r.io.run_one_for(10ms);
  r.target.reset();
  REQUIRE(run_until(r.io, [&] { return out.has_value(); }));
  if (out->ec) {  // it may have finished before the target went away
    CHECK(out->ec == kvlink::errc::peer_closed);
    CHECK(out->result.bytes < r.local_mem.size());
  }
  REQUIRE(run_until(r.io, [&] { return !r.peer.connected(); }));
  std::optional<std::error_code> later;
  r.initiator.async_submit_transfer(
      std::vector{r.req(opcode::write, 0, 0, 16)},
      [&](std::error_code ec, kvlink::transfer_result) { later = ec; });
  REQUIRE(run_until(r.io, [&] { return later.has_value(); }));
  CHECK(*later == kvlink::errc::peer_closed);
}

namespace {

// A peer that completes the handshake and then never answers a data frame:
// the way a hung process looks from outside.
struct silent_peer {
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor{io, {asio::ip::make_address("127.0.0.1"), 0}};
  std::vector<asio::ip::tcp::socket> held;
  std::thread thread;
  unsigned protocol;

  explicit silent_peer(unsigned proto = kvlink::protocol_version) : protocol(proto) {
    thread = std::thread([this] {
      for (int i = 0; i < 3; ++i) {
        asio::ip::tcp::socket s{io};
        std::error_code ec;
        acceptor.accept(s, ec);
        if (ec) return;
        kvlink::control::prefix_bytes prefix{};
        asio::read(s, asio::buffer(prefix), ec);
        std::uint32_t len = 0;
        if (ec || kvlink::control::decode_prefix(prefix, 1 << 20, len)) return;
        std::string body(len, '\0');
        asio::read(s, asio::buffer(body), ec);
        kvlink::control::peer_descriptor d;
        d.protocol = protocol;
        d.instance = kvlink::instance_id{1, 2};
        d.address = "127.0.0.1:1";
        d.transports = {{"tcp", {{"lanes", 2}}}};
        d.segments.push_back({kvlink::segment_id{1}, 0, 1u << 30, kvlink::access::remote_read_write,
                              nlohmann::json::object()});
        auto welcome = kvlink::control::make_welcome(d);
        welcome["protocol"] = protocol;
        asio::write(s, asio::buffer(kvlink::control::encode_message(welcome)), ec);
        held.push_back(std::move(s));  // never read again
      }
    });
  }
  std::string address() const {
    return fmt::format("127.0.0.1:{}", acceptor.local_endpoint().port());
  }
  ~silent_peer() {
    // Wakes the thread if it still waits in accept() (close() alone does not).
    ::shutdown(acceptor.native_handle(), SHUT_RDWR);
    std::error_code ignored;
    thread.join();
  }
};

}  // namespace

TEST_CASE("a peer of another protocol version is refused with protocol_version_mismatch") {
  silent_peer fake{kvlink::protocol_version + 1};
  asio::io_context io;
  kvlink::tcp_engine eng{io.get_executor(), test_config()};
  std::optional<std::error_code> out;
  eng.async_connect(fake.address(), [&](std::error_code ec, kvlink::peer) { out = ec; });
  REQUIRE(run_until(io, [&] { return out.has_value(); }));
  CHECK(*out == kvlink::errc::protocol_version_mismatch);
}

TEST_CASE("a hello of another protocol version gets a protocol_version_mismatch reply") {
  asio::io_context io;
  kvlink::tcp_engine eng{io.get_executor(), test_config()};
  std::optional<nlohmann::json> reply;
  std::thread client([&] {
    asio::io_context cio;
    asio::ip::tcp::socket s{cio};
    s.connect({asio::ip::make_address("127.0.0.1"),
               static_cast<std::uint16_t>(
                   std::stoi(eng.local_address().substr(eng.local_address().rfind(':') + 1)))});
    auto hello = kvlink::control::make_hello(
        kvlink::protocol_version + 7, kvlink::instance_id{5, 5}, kvlink::control::role::control);
    asio::write(s, asio::buffer(kvlink::control::encode_message(hello)));
    kvlink::control::prefix_bytes prefix{};
    asio::read(s, asio::buffer(prefix));
    std::uint32_t len = 0;
    REQUIRE_FALSE(kvlink::control::decode_prefix(prefix, 1 << 20, len));
    std::string body(len, '\0');
    asio::read(s, asio::buffer(body));
    reply = nlohmann::json::parse(body);
  });
  REQUIRE(run_until(io, [&] { return reply.has_value(); }));
  client.join();
  CHECK((*reply)["type"] == "error");
  CHECK(kvlink::control::error_from_message(*reply) == kvlink::errc::protocol_version_mismatch);
  CHECK((*reply)["message"].get<std::string>().find("protocol") != std::string::npos);
}

TEST_CASE(
    "deadline: a silent peer fails the transfer in bounded time; the buffer is left alone "
    "afterwards") {
  silent_peer fake;
  asio::io_context io;
  kvlink::tcp_engine eng{io.get_executor(), test_config()};
  std::vector<std::byte> mem(32u << 20);
  eng.register_segment(mem.data(), mem.size());
  kvlink::peer p;
  bool connected = false;
  eng.async_connect(fake.address(), [&](std::error_code ec, kvlink::peer x) {
    REQUIRE_MESSAGE(!ec, ec.message());
    p = x;
    connected = true;
  });
  REQUIRE(run_until(io, [&] { return connected; }));
  for (const auto op : {opcode::write, opcode::read}) {
    CAPTURE(kvlink::to_string(op));
    std::optional<run_outcome> out;
    std::vector<kvlink::transfer_request> reqs{{op, mem.data(), p.segment(0), 0, mem.size()}};
    eng.async_submit_transfer(reqs, kvlink::transfer_options{.deadline = 100ms},
                              [&](std::error_code ec, kvlink::transfer_result r) {
                                out = run_outcome{ec, r};
                              });
    REQUIRE(run_until(
        io, [&] { return out.has_value(); }, 20s));
    if (op == opcode::write) {
      CHECK(out->ec == kvlink::errc::deadline_exceeded);
    } else {
      // The WRITE's fence closed the peer's lanes: a READ fails at once.
      CHECK((out->ec == kvlink::errc::deadline_exceeded || out->ec == kvlink::errc::peer_closed));
    }
    CHECK(out->result.bytes == 0);
  }
}

TEST_CASE("deadlines: one timer serves transfers with different deadlines") {
  // The engine keeps one timer for all deadlines, set to the earliest it
  // knows of: a later transfer with an earlier deadline must set it sooner,
  // and when it fires for a transfer that already completed it must be set
  // again for the ones still under way.
  pair_rig r;
  silent_peer fake;
  const kvlink::peer silent = r.connect(fake.address());
  auto to_silent = [&](std::size_t off) {
    return std::vector<kvlink::transfer_request>{
        {opcode::write, r.local_mem.data() + off, silent.segment(0), off, 4096}};
  };
  auto submit = [&](std::vector<kvlink::transfer_request> reqs, std::chrono::milliseconds d,
                    std::optional<run_outcome>& out) {
    r.initiator.async_submit_transfer(reqs, kvlink::transfer_options{.deadline = d},
                                      [&out](std::error_code ec, kvlink::transfer_result res) {
                                        out = run_outcome{ec, res};
                                      });
  };
  SUBCASE("an earlier deadline submitted later fails first") {
    std::optional<run_outcome> slow, quick;
    submit(to_silent(0), 60s, slow);
    submit(to_silent(4096), 50ms, quick);
    // Well before the first transfer's deadline.
    REQUIRE(run_until(
        r.io, [&] { return quick.has_value(); }, 10s));
    CHECK(quick->ec == kvlink::errc::deadline_exceeded);
    CHECK(quick->result.bytes == 0);
    // The quick one's slice in flight was fenced: the silent peer's lanes
    // closed, under the slow one too, which fails with that, not with its
    // own deadline a minute away.
    REQUIRE(run_until(
        r.io, [&] { return slow.has_value(); }, 10s));
    CHECK(slow->ec == kvlink::errc::peer_closed);
    CHECK(slow->result.bytes == 0);
  }
  SUBCASE("the timer set for a transfer that completed serves the one still under way") {
    fill(r.local_mem, 31);
    std::optional<run_outcome> stuck, done;
    submit(to_silent(0), 400ms, stuck);
    submit({r.req(opcode::write, 8192, 8192, 4096)}, 150ms, done);
    REQUIRE(run_until(
        r.io, [&] { return done.has_value(); }, 10s));
    REQUIRE_MESSAGE(!done->ec, done->ec.message());
    CHECK(done->result.bytes == 4096);
    CHECK(std::memcmp(r.local_mem.data() + 8192, r.remote_mem.data() + 8192, 4096) == 0);
    REQUIRE(run_until(
        r.io, [&] { return stuck.has_value(); }, 10s));
    CHECK(stuck->ec == kvlink::errc::deadline_exceeded);
    CHECK(stuck->result.bytes == 0);
  }
}

TEST_CASE("a transfer after a refused, a cancelled and a notified one reports only its own") {
  // The engine reuses a completed transfer's state for the next one (not
  // under AddressSanitizer): nothing of the earlier ones may carry over.
  constexpr std::size_t size = 8u << 20;
  pair_rig r{size};
  std::vector<kvlink::transfer_request> whole;
  for (std::size_t off = 0; off < size; off += 1 << 20) {
    whole.push_back(r.req(opcode::write, off, off, 1 << 20));
  }
  // Refused before anything moved.
  const auto refused = r.run({r.req(opcode::write, 0, size - 10, 4096)});
  CHECK(refused.ec == kvlink::errc::out_of_bounds);
  // Cancelled while under way.
  {
    asio::cancellation_signal sig;
    std::optional<run_outcome> out;
    r.initiator.async_submit_transfer(
        whole, asio::bind_cancellation_slot(sig.slot(),
                                            [&](std::error_code ec, kvlink::transfer_result res) {
                                              out = run_outcome{ec, res};
                                            }));
    sig.emit(asio::cancellation_type::terminal);
    REQUIRE(run_until(r.io, [&] { return out.has_value(); }));
    CHECK(out->ec == kvlink::errc::cancelled);
  }
  // With a notification.
  std::optional<kvlink::notification> got;
  r.target->async_receive_notification([&](std::error_code ec, kvlink::notification n) {
    if (!ec) got = std::move(n);
  });
  kvlink::transfer_options notified;
  notified.notify = kvlink::notification{"n", "x"};
  const auto with_note = r.run({r.req(opcode::write, 0, 0, 4096)}, notified);
  REQUIRE_MESSAGE(!with_note.ec, with_note.ec.message());
  REQUIRE(run_until(r.io, [&] { return got.has_value(); }));
  // Now a plain WRITE and READ: their own results, every byte in place.
  fill(r.local_mem, 41);
  const auto w = r.run(whole);
  REQUIRE_MESSAGE(!w.ec, w.ec.message());
  CHECK(w.result.bytes == size);
  CHECK(w.result.requests == whole.size());
  CHECK(w.result.slices >= whole.size());
  CHECK(w.result.lanes >= 1);
  CHECK(w.result.lanes <= 2);
  CHECK(std::memcmp(r.local_mem.data(), r.remote_mem.data(), size) == 0);
  fill(r.remote_mem, 42);
  const auto rd = r.run({r.req(opcode::read, 0, 0, 4096)});
  REQUIRE_MESSAGE(!rd.ec, rd.ec.message());
  CHECK(rd.result.bytes == 4096);
  CHECK(rd.result.requests == 1);
  CHECK(rd.result.slices == 1);
  CHECK(rd.result.lanes == 1);
  CHECK(std::memcmp(r.local_mem.data(), r.remote_mem.data(), 4096) == 0);
}

TEST_CASE("cancellation: the handler gets errc::cancelled and no byte changes after it ran") {
  // What is in flight when the cancel lands must drain, not be fenced: a
  // fence closes the lanes and loses the peer, and under ThreadSanitizer on
  // a busy machine 64 MiB can take longer than the 200 ms of test_config().
  kvlink::config cfg = test_config();
  cfg.fence_timeout = 20s;
  pair_rig r{64u << 20, kvlink::access::remote_read_write, cfg, cfg};
  for (const auto op : {opcode::read, opcode::write}) {
    CAPTURE(kvlink::to_string(op));
    fill(r.local_mem, 21);
    fill(r.remote_mem, 22);
    asio::cancellation_signal sig;
    std::optional<run_outcome> out;
    std::vector<kvlink::transfer_request> reqs;
    // Many requests: some are in flight when the cancel lands, some are not sent yet.
    for (std::size_t off = 0; off < r.local_mem.size(); off += 1 << 20)
      reqs.push_back(r.req(op, off, off, 1 << 20));
    r.initiator.async_submit_transfer(
        reqs, asio::bind_cancellation_slot(sig.slot(),
                                           [&](std::error_code ec, kvlink::transfer_result res) {
                                             out = run_outcome{ec, res};
                                           }));
    r.io.run_one_for(1ms);
    sig.emit(asio::cancellation_type::terminal);
    REQUIRE(run_until(r.io, [&] { return out.has_value(); }));
    // Slices already in flight when the cancel lands still finish, so even a
    // cancelled transfer may have moved every byte; the code says cancelled.
    if (out->ec) CHECK(out->ec == kvlink::errc::cancelled);
    // After the handler: nothing touches either buffer any more.
    const auto local_after = r.local_mem;
    const auto remote_after = r.remote_mem;
    for (int i = 0; i < 50; ++i) r.io.run_one_for(2ms);
    CHECK(r.local_mem == local_after);
    CHECK(r.remote_mem == remote_after);
    // And the connection is still good.
    auto again = r.run({r.req(op, 0, 0, 4096)});
    CHECK_FALSE(again.ec);
  }
}

TEST_CASE("cancellation through awaitable operators (a timer racing the transfer)") {
  using namespace asio::experimental::awaitable_operators;
  // As above: what is in flight when the timer wins drains (a fence would
  // lose the peer, and under ThreadSanitizer on a busy machine 64 MiB can
  // take longer than test_config()'s 200 ms: peer_closed below).
  kvlink::config cfg = test_config();
  cfg.fence_timeout = 20s;
  pair_rig r{64u << 20, kvlink::access::remote_read_write, cfg, cfg};
  std::vector<kvlink::transfer_request> reqs;
  for (std::size_t off = 0; off < r.local_mem.size(); off += 1 << 20)
    reqs.push_back(r.req(opcode::write, off, off, 1 << 20));
  std::optional<std::size_t> winner;
  asio::co_spawn(
      r.io,
      [&]() -> asio::awaitable<void> {
        asio::steady_timer t{r.io, 1ms};
        auto v = co_await (r.initiator.async_submit_transfer(reqs, asio::use_awaitable) ||
                           t.async_wait(asio::use_awaitable));
        winner = v.index();
      },
      asio::detached);
  REQUIRE(run_until(r.io, [&] { return winner.has_value(); }));
  // Either finished first or was cancelled by the timer: no hang, no crash,
  // and the engine still works afterwards.
  auto again = r.run({r.req(opcode::write, 0, 0, 4096)});
  CHECK_FALSE(again.ec);
}

namespace {

// Opens a raw lane connection to an engine (hello as a lane) and returns the socket.
asio::ip::tcp::socket raw_lane(asio::io_context& cio, const std::string& addr,
                               const kvlink::instance_id& expect) {
  asio::ip::tcp::socket s{cio};
  const auto port = static_cast<std::uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1)));
  s.connect({asio::ip::make_address("127.0.0.1"), port});
  auto hello = kvlink::control::make_hello(kvlink::protocol_version, kvlink::instance_id{9, 9},
                                           kvlink::control::role::lane, 0, expect);
  asio::write(s, asio::buffer(kvlink::control::encode_message(hello)));
  kvlink::control::prefix_bytes prefix{};
  asio::read(s, asio::buffer(prefix));
  std::uint32_t len = 0;
  REQUIRE_FALSE(kvlink::control::decode_prefix(prefix, 1 << 20, len));
  std::string body(len, '\0');
  asio::read(s, asio::buffer(body));
  REQUIRE(nlohmann::json::parse(body)["type"] == "welcome");
  return s;
}

}  // namespace

TEST_CASE("hostile clients: garbage, truncated frames, huge lengths, out-of-bounds offsets") {
  asio::io_context io;
  auto cfg = test_config();
  cfg.tcp.max_frame_payload = 1 << 20;
  cfg.slice_size = 256 << 10;
  kvlink::tcp_engine target{io.get_executor(), cfg};
  // The segment sits between two canaries inside one allocation.
  constexpr std::size_t canary = 4096, seg_len = 64 * 1024;
  std::vector<std::byte> arena(canary + seg_len + canary, std::byte{0xA5});
  const auto seg = target.register_segment(arena.data() + canary, seg_len);
  const auto id = target.instance();
  const auto addr = target.local_address();

  std::atomic<int> finished{0};
  std::vector<std::string> notes;
  std::thread attacker([&] {
    asio::io_context cio;
    auto frame = [](kvlink::tcp::frame_type t, std::uint64_t segid, std::uint64_t off,
                    std::uint64_t len) {
      kvlink::tcp::frame_header h;
      h.type = t;
      h.tag = 1;
      h.segment = segid;
      h.offset = off;
      h.length = len;
      return kvlink::tcp::encode(h);
    };
    auto expect_status = [&](asio::ip::tcp::socket& s, kvlink::errc want) {
      kvlink::tcp::frame_bytes b{};
      std::error_code ec;
      asio::read(s, asio::buffer(b), ec);
      REQUIRE_FALSE(ec);
      kvlink::tcp::frame_header h;
      REQUIRE_FALSE(kvlink::tcp::decode(b.data(), h));
      CHECK(kvlink::tcp::status_to_error(h.status) == want);
      CHECK(h.length == 0);
    };
    // The target may answer with an error message first; then it hangs up.
    auto expect_closed = [&](asio::ip::tcp::socket& s) {
      std::vector<std::byte> b(1 << 16);
      std::error_code ec;
      const auto n = asio::read(s, asio::buffer(b), ec);
      CHECK(ec);  // eof or reset: the target hung up
      CHECK(n < b.size());
    };
    {  // pure garbage instead of a hello
      asio::ip::tcp::socket s{cio};
      const auto port = static_cast<std::uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1)));
      s.connect({asio::ip::make_address("127.0.0.1"), port});
      std::string junk(1000, 'x');
      std::error_code ec;
      asio::write(s, asio::buffer(junk), ec);
      expect_closed(s);
    }
    {  // garbage after a good lane hello
      auto s = raw_lane(cio, addr, id);
      std::vector<std::byte> junk(4096, std::byte{0x42});
      std::error_code ec;
      asio::write(s, asio::buffer(junk), ec);
      expect_closed(s);
    }
    {  // out-of-bounds WRITE: payload drained, error status, connection kept
      auto s = raw_lane(cio, addr, id);
      auto h = frame(kvlink::tcp::frame_type::write_request, seg.value(), seg_len - 8, 64);
      std::vector<std::byte> payload(64, std::byte{0xEE});
      asio::write(s, std::array{asio::buffer(h), asio::buffer(payload)});
      expect_status(s, kvlink::errc::out_of_bounds);
      auto h2 = frame(kvlink::tcp::frame_type::read_request, seg.value(), ~0ull - 2,
                      16);  // offset overflow
      asio::write(s, asio::buffer(h2));
      expect_status(s, kvlink::errc::out_of_bounds);
      auto h3 = frame(kvlink::tcp::frame_type::write_request, 12345, 0, 16);  // unknown segment
      asio::write(s, std::array{asio::buffer(h3), asio::buffer(payload.data(), 16)});
      expect_status(s, kvlink::errc::not_registered);
      // still serving a good request on the same connection
      auto h4 = frame(kvlink::tcp::frame_type::read_request, seg.value(), 0, 16);
      asio::write(s, asio::buffer(h4));
      kvlink::tcp::frame_bytes b{};
      asio::read(s, asio::buffer(b));
      kvlink::tcp::frame_header rh;
      REQUIRE_FALSE(kvlink::tcp::decode(b.data(), rh));
      CHECK(rh.status == 0);
      CHECK(rh.length == 16);
      std::array<std::byte, 16> data{};
      asio::read(s, asio::buffer(data));
    }
    {  // a length above max_frame_payload: connection closed, nothing read into memory
      auto s = raw_lane(cio, addr, id);
      auto h = frame(kvlink::tcp::frame_type::write_request, seg.value(), 0, 1ull << 40);
      asio::write(s, asio::buffer(h));
      expect_closed(s);
    }
    {  // truncated frame then hang-up
      auto s = raw_lane(cio, addr, id);
      auto h = frame(kvlink::tcp::frame_type::write_request, seg.value(), 0, 1024);
      asio::write(s, std::array{asio::buffer(h.data(), 20)});
      s.close();
    }
    {  // truncated payload then hang-up: bytes that arrived land inside the segment only
      auto s = raw_lane(cio, addr, id);
      auto h = frame(kvlink::tcp::frame_type::write_request, seg.value(), seg_len - 1024, 1024);
      std::vector<std::byte> part(512, std::byte{0x77});
      asio::write(s, std::array{asio::buffer(h), asio::buffer(part)});
      s.close();
    }
    {  // a response type sent to a target, and a bad version
      auto s = raw_lane(cio, addr, id);
      auto h = frame(kvlink::tcp::frame_type::write_ack, seg.value(), 0, 0);
      asio::write(s, asio::buffer(h));
      expect_closed(s);
      auto s2 = raw_lane(cio, addr, id);
      auto bad = frame(kvlink::tcp::frame_type::read_request, seg.value(), 0, 16);
      bad[4] = std::byte{99};
      asio::write(s2, asio::buffer(bad));
      expect_closed(s2);
    }
    {  // a lane that expects another instance is refused
      asio::ip::tcp::socket s{cio};
      const auto port = static_cast<std::uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1)));
      s.connect({asio::ip::make_address("127.0.0.1"), port});
      auto hello =
          kvlink::control::make_hello(kvlink::protocol_version, kvlink::instance_id{9, 9},
                                      kvlink::control::role::lane, 0, kvlink::instance_id{1, 1});
      asio::write(s, asio::buffer(kvlink::control::encode_message(hello)));
      kvlink::control::prefix_bytes prefix{};
      asio::read(s, asio::buffer(prefix));
      std::uint32_t len = 0;
      REQUIRE_FALSE(kvlink::control::decode_prefix(prefix, 1 << 20, len));
      std::string body(len, '\0');
      asio::read(s, asio::buffer(body));
      CHECK(kvlink::control::error_from_message(nlohmann::json::parse(body)) ==
            kvlink::errc::instance_changed);
    }
    {  // an oversized control message
      asio::ip::tcp::socket s{cio};
      const auto port = static_cast<std::uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1)));
      s.connect({asio::ip::make_address("127.0.0.1"), port});
      auto prefix = kvlink::control::encode_prefix(0x7fffffff);
      asio::write(s, asio::buffer(prefix));
      kvlink::control::prefix_bytes rp{};
      std::error_code ec;
      asio::read(s, asio::buffer(rp), ec);
      std::uint32_t len = 0;
      if (!ec && !kvlink::control::decode_prefix(rp, 1 << 20, len)) {
        std::string body(len, '\0');
        asio::read(s, asio::buffer(body), ec);
        CHECK(kvlink::control::error_from_message(nlohmann::json::parse(body)) ==
              kvlink::errc::message_too_large);
      }
    }
    finished = 1;
  });
  REQUIRE(run_until(io, [&] { return finished.load() == 1; }));
  attacker.join();
  for (int i = 0; i < 20; ++i) io.run_one_for(5ms);

  // Canaries around the segment are intact.
  for (std::size_t i = 0; i < canary; ++i) {
    REQUIRE(arena[i] == std::byte{0xA5});
    REQUIRE(arena[canary + seg_len + i] == std::byte{0xA5});
  }
  // And the target still serves a well-behaved engine.
  kvlink::tcp_engine ini{io.get_executor(), test_config()};
  std::vector<std::byte> mem(seg_len);
  fill(mem, 99);
  ini.register_segment(mem.data(), mem.size());
  kvlink::peer p;
  bool ok = false;
  ini.async_connect(addr, [&](std::error_code ec, kvlink::peer x) {
    REQUIRE_FALSE(ec);
    p = x;
    ok = true;
  });
  REQUIRE(run_until(io, [&] { return ok; }));
  std::optional<std::error_code> w;
  ini.async_submit_transfer(
      std::vector<kvlink::transfer_request>{{opcode::write, mem.data(), p.segment(0), 0, seg_len}},
      [&](std::error_code ec, kvlink::transfer_result) { w = ec; });
  REQUIRE(run_until(io, [&] { return w.has_value(); }));
  CHECK_FALSE(*w);
  CHECK(std::memcmp(arena.data() + canary, mem.data(), seg_len) == 0);
}

TEST_CASE("notifications: attached to a WRITE they arrive after the data; standalone ones too") {
  pair_rig r;
  fill(r.local_mem, 31);
  std::optional<kvlink::notification> got;
  std::vector<std::byte> seen;  // the target's bytes at the moment the notification arrives
  r.target->async_receive_notification([&](std::error_code ec, kvlink::notification n) {
    REQUIRE_FALSE(ec);
    seen.assign(r.remote_mem.begin(), r.remote_mem.end());
    got = std::move(n);
  });
  kvlink::transfer_options opts;
  opts.notify = kvlink::notification{"req-7", std::string("\x00\x01payload\xff", 10)};
  auto out = r.run({r.req(opcode::write, 0, 0, r.local_mem.size())}, opts);
  REQUIRE_FALSE(out.ec);
  REQUIRE(run_until(r.io, [&] { return got.has_value(); }));
  CHECK(got->id == "req-7");
  CHECK(got->payload == std::string("\x00\x01payload\xff", 10));
  CHECK(got->from == r.initiator.instance());
  CHECK(got->from_address == r.initiator.local_address());
  // Ordered after the data: every byte was already there when it arrived.
  CHECK(std::memcmp(seen.data(), r.local_mem.data(), seen.size()) == 0);

  // Standalone, queued while nobody waits, received in order.
  for (int i = 0; i < 3; ++i) {
    std::optional<std::error_code> sent;
    r.initiator.async_send_notification(r.peer,
                                        kvlink::notification{fmt::format("free-{}", i), "x"},
                                        [&](std::error_code ec) { sent = ec; });
    REQUIRE(run_until(r.io, [&] { return sent.has_value(); }));
    CHECK_FALSE(*sent);
  }
  for (int i = 0; i < 3; ++i) {
    std::optional<kvlink::notification> n;
    r.target->async_receive_notification([&](std::error_code ec, kvlink::notification x) {
      REQUIRE_FALSE(ec);
      n = std::move(x);
    });
    REQUIRE(run_until(r.io, [&] { return n.has_value(); }));
    CHECK(n->id == fmt::format("free-{}", i));
  }

  // Too large: refused before anything is sent; the transfer moves nothing.
  opts.notify =
      kvlink::notification{"big", std::string(r.initiator.get_config().max_notification, 'z')};
  auto big = r.run({r.req(opcode::write, 0, 0, 16)}, opts);
  CHECK(big.ec == kvlink::errc::message_too_large);
  CHECK(big.result.bytes == 0);
  std::optional<std::error_code> sent_big;
  r.initiator.async_send_notification(r.peer, *opts.notify,
                                      [&](std::error_code ec) { sent_big = ec; });
  REQUIRE(run_until(r.io, [&] { return sent_big.has_value(); }));
  CHECK(*sent_big == kvlink::errc::message_too_large);

  // A failed transfer sends no notification.
  opts.notify = kvlink::notification{"never", ""};
  auto bad = r.run({r.req(opcode::write, 0, r.remote_mem.size(), 1)}, opts);
  CHECK(bad.ec == kvlink::errc::out_of_bounds);

  // A waiting receive can be cancelled.
  asio::cancellation_signal sig;
  std::optional<std::error_code> rec;
  r.target->async_receive_notification(asio::bind_cancellation_slot(
      sig.slot(), [&](std::error_code ec, kvlink::notification) { rec = ec; }));
  r.io.run_one_for(5ms);
  sig.emit(asio::cancellation_type::terminal);
  REQUIRE(run_until(r.io, [&] { return rec.has_value(); }));
  CHECK(*rec == kvlink::errc::cancelled);
}

TEST_CASE("handshakes are served concurrently: a client that never speaks does not block others") {
  asio::io_context io;
  auto cfg = test_config();
  cfg.connect_timeout = 30s;  // the mute client would hold a one-at-a-time server this long
  kvlink::tcp_engine target{io.get_executor(), cfg};
  std::vector<std::byte> mem(4096);
  target.register_segment(mem.data(), mem.size());
  const auto addr = target.local_address();
  const auto port = static_cast<std::uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1)));
  // Several mute connections first...
  std::vector<asio::ip::tcp::socket> mute;
  for (int i = 0; i < 4; ++i) {
    mute.emplace_back(io);
    mute.back().connect({asio::ip::make_address("127.0.0.1"), port});
  }
  // ... then several engines connect at once; all get through while the mute
  // ones are still waiting for their hello.
  std::vector<std::unique_ptr<kvlink::tcp_engine>> clients;
  int connected = 0;
  for (int i = 0; i < 4; ++i) {
    clients.push_back(std::make_unique<kvlink::tcp_engine>(io.get_executor(), test_config()));
    clients.back()->async_connect(addr, [&](std::error_code ec, kvlink::peer p) {
      CHECK_FALSE(ec);
      CHECK(p.segments().size() == 1);
      ++connected;
    });
  }
  REQUIRE(run_until(
      io, [&] { return connected == 4; }, 20s));
}

TEST_CASE("requests are validated before anything is sent: opcode, address, overflow") {
  pair_rig r;
  fill(r.local_mem, 71);
  const auto remote_before = r.remote_mem;
  // An opcode that is neither read nor write (easy to produce from a binding).
  auto bad_op = r.req(opcode::write, 0, 0, 4096);
  bad_op.op = static_cast<opcode>(7);
  auto out = r.run({bad_op});
  CHECK(out.ec == kvlink::errc::invalid_argument);
  CHECK(out.result.bytes == 0);
  // A local address whose range wraps around the address space.
  auto wrap = r.req(opcode::read, 0, 0, 16);
  wrap.local = reinterpret_cast<void*>(~std::uintptr_t{0} - 7);
  out = r.run({wrap});
  CHECK(out.ec == kvlink::errc::invalid_argument);
  // A null local address.
  auto null_local = r.req(opcode::read, 0, 0, 16);
  null_local.local = nullptr;
  out = r.run({null_local});
  CHECK(out.ec == kvlink::errc::invalid_argument);
  // One bad request in a batch: nothing of the batch reaches the peer...
  out = r.run({r.req(opcode::write, 0, 0, 4096), bad_op});
  CHECK(out.ec == kvlink::errc::invalid_argument);
  CHECK(r.remote_mem == remote_before);
  // ... and the peer's lanes were never fed anything they could not parse:
  // the next valid transfer works on the same connections.
  auto ok = r.run({r.req(opcode::write, 0, 0, 65536)});
  REQUIRE_MESSAGE(!ok.ec, ok.ec.message());
  CHECK(r.peer.connected());
  CHECK(std::memcmp(r.remote_mem.data(), r.local_mem.data(), 65536) == 0);
}

TEST_CASE("destroying engines while 4 threads run their io_context, transfers in flight") {
  // Run under ThreadSanitizer in CI: the destructor used to close lanes and
  // channels from the destroying thread while io threads ran their handlers.
  for (int round = 0; round < 10; ++round) {
    CAPTURE(round);
    asio::io_context io;
    auto work = asio::make_work_guard(io);
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) threads.emplace_back([&io] { io.run(); });
    std::vector<std::byte> remote(8u << 20), local(8u << 20);
    std::atomic<int> handlers{0};
    {
      auto target = std::make_unique<kvlink::tcp_engine>(io.get_executor(), test_config());
      auto initiator = std::make_unique<kvlink::tcp_engine>(io.get_executor(), test_config());
      target->register_segment(remote.data(), remote.size());
      initiator->register_segment(local.data(), local.size());
      auto fut = initiator->async_connect(target->local_address(), asio::use_future);
      kvlink::peer p = fut.get();
      for (int t = 0; t < 8; ++t) {
        std::vector<kvlink::transfer_request> reqs{
            {t % 2 ? opcode::read : opcode::write, local.data(), p.segment(0), 0, local.size()}};
        initiator->async_submit_transfer(
            reqs, [&handlers](std::error_code, kvlink::transfer_result) { ++handlers; });
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(round % 3));
      if (round % 2) {
        initiator.reset();  // the initiator first, then its peer
        target.reset();
      } else {
        target.reset();
        initiator.reset();
      }
      // Registered memory may be freed now: nothing of the engines touches it.
    }
    work.reset();
    for (auto& t : threads) t.join();
    CHECK(handlers.load() == 8);  // every transfer completed, once
  }
}

TEST_CASE("a local buffer that is not accessible fails its transfer, not the peer") {
  // Registered, then protected (as a freed or device buffer looks to the
  // kernel): the kernel answers EFAULT while sending or receiving it.
  constexpr std::size_t half = 8u << 20;
  void* map = ::mmap(nullptr, 2 * half, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(map != MAP_FAILED);
  auto* good = static_cast<std::byte*>(map);
  std::byte* bad = good + half;
  pair_rig r{half};
  r.initiator.register_segment(good, 2 * half);
  fill(std::span(good, half), 81);
  REQUIRE(::mprotect(bad, half, PROT_NONE) == 0);
  for (const auto op : {opcode::write, opcode::read}) {
    CAPTURE(kvlink::to_string(op));
    // The good transfer and the bad one at once, on the same lanes.
    std::optional<run_outcome> ok_out, bad_out;
    r.initiator.async_submit_transfer(
        std::vector<kvlink::transfer_request>{{opcode::write, good, r.peer.segment(0), 0, half}},
        [&](std::error_code ec, kvlink::transfer_result res) {
          ok_out = run_outcome{ec, res};
        });
    r.initiator.async_submit_transfer(
        std::vector<kvlink::transfer_request>{{op, bad, r.peer.segment(0), 0, 1u << 20}},
        [&](std::error_code ec, kvlink::transfer_result res) {
          bad_out = run_outcome{ec, res};
        });
    REQUIRE(run_until(r.io, [&] { return ok_out && bad_out; }));
    CHECK(bad_out->ec == kvlink::errc::local_memory_fault);
    REQUIRE_MESSAGE(!ok_out->ec, ok_out->ec.message());
    CHECK(r.peer.connected());
    // The peer stays usable: the next transfer works and its bytes arrive.
    fill(std::span(good, half), 82 + static_cast<int>(op));
    auto next = r.run({{opcode::write, good, r.peer.segment(0), 0, half}});
    REQUIRE_MESSAGE(!next.ec, next.ec.message());
    CHECK(std::memcmp(r.remote_mem.data(), good, half) == 0);
    CHECK(r.peer.connected());
  }
  ::munmap(map, 2 * half);
}

TEST_CASE("small READs are received in bulk: bytes, checksums, a bad destination fails alone") {
  // 4 KiB READs (and a few of other sizes, a large one among them) come
  // back many to a receive and are copied into place together; a
  // destination the kernel cannot write fails its own transfer, not the
  // others on the same lanes, and the stream goes on.
  for (const bool checksums : {false, true}) {
    CAPTURE(checksums);
    auto cfg = test_config();
    cfg.checksums = checksums;
    constexpr std::size_t good_len = 2u << 20;
    constexpr std::size_t page = 4096;
    void* map = ::mmap(nullptr, good_len + 16 * page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(map != MAP_FAILED);
    auto* good = static_cast<std::byte*>(map);
    std::byte* bad = good + good_len;
    pair_rig r{good_len, kvlink::access::remote_read_write, cfg, cfg};
    r.initiator.register_segment(good, good_len + 16 * page);
    fill(r.remote_mem, 201);
    REQUIRE(::mprotect(bad, 16 * page, PROT_NONE) == 0);
    // Scattered: remote offsets run backwards, so nothing coalesces.
    std::vector<kvlink::transfer_request> many, mixed, broken;
    constexpr std::size_t pieces = 256;
    for (std::size_t i = 0; i < pieces; ++i) {
      many.push_back(
          {opcode::read, good + i * page, r.peer.segment(0), (pieces - 1 - i) * page, page});
    }
    // Sizes around the bulk receive's limits: tiny, 16 KiB (the largest
    // taken in bulk), 16 KiB + 1 and 256 KiB (read straight into place).
    const std::size_t sizes[] = {1, 100, page, 16384, 16385, 256u << 10, page, 7};
    std::size_t at = pieces * page;
    std::uint64_t from = good_len;
    for (const auto n : sizes) {
      from -= n + 64;  // backwards, with gaps
      mixed.push_back({opcode::read, good + at, r.peer.segment(0), from, n});
      at += n;
    }
    REQUIRE(at <= good_len);
    for (std::size_t i = 0; i < 8; ++i) {
      broken.push_back({opcode::read, bad + i * page, r.peer.segment(0), i * 2 * page, page});
    }
    std::optional<run_outcome> many_out, mixed_out, broken_out;
    r.initiator.async_submit_transfer(many, [&](std::error_code ec, kvlink::transfer_result res) {
      many_out = run_outcome{ec, res};
    });
    r.initiator.async_submit_transfer(broken, [&](std::error_code ec, kvlink::transfer_result res) {
      broken_out = run_outcome{ec, res};
    });
    r.initiator.async_submit_transfer(mixed, [&](std::error_code ec, kvlink::transfer_result res) {
      mixed_out = run_outcome{ec, res};
    });
    REQUIRE(run_until(r.io, [&] { return many_out && mixed_out && broken_out; }));
    CHECK(broken_out->ec == kvlink::errc::local_memory_fault);
    REQUIRE_MESSAGE(!many_out->ec, many_out->ec.message());
    REQUIRE_MESSAGE(!mixed_out->ec, mixed_out->ec.message());
    for (const auto* list : {&many, &mixed}) {
      for (const auto& q : *list) {
        CHECK(std::memcmp(q.local, r.remote_mem.data() + q.remote_offset, q.length) == 0);
      }
    }
    CHECK(r.peer.connected());
    // The lanes carry on: the same READs again, into zeroed memory.
    std::memset(good, 0, good_len);
    auto again = r.run(many);
    REQUIRE_MESSAGE(!again.ec, again.ec.message());
    for (const auto& q : many) {
      CHECK(std::memcmp(q.local, r.remote_mem.data() + q.remote_offset, q.length) == 0);
    }
    ::munmap(map, good_len + 16 * page);
  }
}

TEST_CASE("a wildcard listen address is never advertised; config.advertise is") {
  asio::io_context io;
  auto cfg = test_config();
  cfg.listen = "0.0.0.0:0";
  kvlink::tcp_engine wild{io.get_executor(), cfg};
  CHECK(wild.listen_address().rfind("0.0.0.0:", 0) == 0);
  CHECK(wild.local_address().rfind("0.0.0.0:", 0) != 0);
  const auto port = wild.listen_address().substr(wild.listen_address().rfind(':'));
  CHECK(wild.local_address().substr(wild.local_address().rfind(':')) == port);

  cfg.advertise = "decode-3.example:0";
  kvlink::tcp_engine told{io.get_executor(), cfg};
  CHECK(told.local_address() ==
        "decode-3.example" + told.listen_address().substr(told.listen_address().rfind(':')));

  // A notification from an engine listening on 0.0.0.0 names an address the
  // receiver can connect back to.
  kvlink::tcp_engine target{io.get_executor(), test_config()};
  std::vector<std::byte> mem(4096);
  target.register_segment(mem.data(), mem.size());
  wild.register_segment(mem.data(), mem.size());
  std::optional<kvlink::peer> p;
  wild.async_connect(target.local_address(), [&](std::error_code ec, kvlink::peer x) {
    REQUIRE_FALSE(ec);
    p = x;
  });
  REQUIRE(run_until(io, [&] { return p.has_value(); }));
  std::optional<kvlink::notification> got;
  target.async_receive_notification([&](std::error_code ec, kvlink::notification n) {
    REQUIRE_FALSE(ec);
    got = std::move(n);
  });
  wild.async_send_notification(*p, kvlink::notification{"hi", ""}, [](std::error_code) {});
  REQUIRE(run_until(io, [&] { return got.has_value(); }));
  CHECK(got->from_address.rfind("0.0.0.0:", 0) != 0);
  std::optional<std::error_code> back;
  target.async_connect(got->from_address, [&](std::error_code ec, kvlink::peer) { back = ec; });
  REQUIRE(run_until(io, [&] { return back.has_value(); }));
  CHECK_FALSE(*back);
}

namespace {

kvlink::config secret_config(std::string secret) {
  auto c = test_config();
  c.auth_secret = std::move(secret);
  return c;
}

// Runs a coroutine on io to completion.
template <class F>
void run_co(asio::io_context& io, F f) {
  bool done = false;
  asio::co_spawn(io, std::move(f), [&](std::exception_ptr e) {
    done = true;
    if (e) std::rethrow_exception(e);
  });
  REQUIRE(run_until(io, [&] { return done; }));
}

}  // namespace

TEST_CASE("authentication between engines: the same secret works, any other is refused") {
  pair_rig ok{1 << 20, kvlink::access::remote_read_write, secret_config("s3cret"),
              secret_config("s3cret")};
  fill(ok.local_mem, 91);
  auto w = ok.run({ok.req(opcode::write, 0, 0, ok.local_mem.size())});  // over bound lanes
  REQUIRE_MESSAGE(!w.ec, w.ec.message());
  CHECK(ok.remote_mem == ok.local_mem);

  asio::io_context io;
  kvlink::tcp_engine target{io.get_executor(), secret_config("s3cret")};
  std::vector<std::byte> mem(4096);
  target.register_segment(mem.data(), mem.size());
  for (const char* secret : {"other", ""}) {
    CAPTURE(secret);
    kvlink::tcp_engine ini{io.get_executor(), secret_config(secret)};
    std::optional<std::error_code> out;
    ini.async_connect(target.local_address(), [&](std::error_code ec, kvlink::peer) { out = ec; });
    REQUIRE(run_until(io, [&] { return out.has_value(); }));
    CHECK(*out == kvlink::errc::authentication_failed);
  }
  // An engine with a secret does not talk to one without.
  kvlink::tcp_engine open_target{io.get_executor(), test_config()};
  kvlink::tcp_engine ini{io.get_executor(), secret_config("s3cret")};
  std::optional<std::error_code> out;
  ini.async_connect(open_target.local_address(),
                    [&](std::error_code ec, kvlink::peer) { out = ec; });
  REQUIRE(run_until(io, [&] { return out.has_value(); }));
  CHECK(*out == kvlink::errc::authentication_failed);
}

TEST_CASE("authentication against raw sockets: no secret, a replay, another session's lane") {
  asio::io_context io;
  kvlink::tcp_engine target{io.get_executor(), secret_config("s3cret")};
  constexpr std::size_t canary = 4096, seg_len = 64 * 1024;
  std::vector<std::byte> arena(canary + seg_len + canary, std::byte{0xA5});
  const auto seg = target.register_segment(arena.data() + canary, seg_len);
  std::string_view host;
  std::uint16_t port = 0;
  REQUIRE(kvlink::split_host_port(target.local_address(), host, port));
  const std::array<asio::ip::tcp::endpoint, 1> eps{
      asio::ip::tcp::endpoint{asio::ip::make_address("127.0.0.1"), port}};
  namespace control = kvlink::control;
  const control::peer_guard guard{"s3cret"};
  auto control_hello = [] {
    control::hello h;
    h.instance = kvlink::instance_id{7, 7};
    return h;
  };
  auto lane_hello = [&] {
    control::hello h;
    h.instance = kvlink::instance_id{7, 7};
    h.r = control::role::lane;
    h.expect = target.instance();
    return h;
  };

  run_co(io, [&]() -> asio::awaitable<void> {
    // 1. No secret: refused with authentication_failed, no descriptor, as a
    // control connection and as a lane.
    for (auto h : {control_hello(), lane_hello()}) {
      asio::ip::tcp::socket s{io};
      json welcome;
      const control::client_auth none{};
      const auto ec = co_await control::dial(s, eps, 2s, {}, h, 1 << 20, none, welcome);
      CHECK(ec == kvlink::errc::authentication_failed);
      CHECK_FALSE(welcome.contains("descriptor"));
    }
    // 2. A replayed exchange: the recorded response does not answer a new
    // challenge.
    {
      auto h = control_hello();
      h.client_nonce = control::peer_guard::make_nonce();
      const json hello_msg = control::to_json(h);
      asio::ip::tcp::socket s1{io};
      co_await s1.async_connect(eps[0], asio::use_awaitable);
      co_await control::write_message(s1, hello_msg);
      json challenge;
      REQUIRE_FALSE(co_await control::read_message(s1, 1 << 20, challenge));
      REQUIRE(challenge["type"] == "challenge");
      control::nonce ns{};
      REQUIRE(control::parse_hex(challenge["nonce"].get<std::string>(), ns));
      const json response{
          {"type", "response"},
          {"proof", control::hex_of(guard.client_proof(*h.client_nonce, ns, target.instance()))}};
      co_await control::write_message(s1, response);
      json welcome;
      REQUIRE_FALSE(co_await control::read_message(s1, 1 << 20, welcome));
      CHECK(welcome["type"] == "welcome");  // the original exchange passes
      asio::ip::tcp::socket s2{io};
      co_await s2.async_connect(eps[0], asio::use_awaitable);
      co_await control::write_message(s2, hello_msg);
      json challenge2;
      REQUIRE_FALSE(co_await control::read_message(s2, 1 << 20, challenge2));
      CHECK(challenge2["nonce"] != challenge["nonce"]);
      co_await control::write_message(s2, response);  // the replay
      json answer;
      REQUIRE_FALSE(co_await control::read_message(s2, 1 << 20, answer));
      CHECK(control::error_from_message(answer) == kvlink::errc::authentication_failed);
      CHECK_FALSE(answer.contains("descriptor"));
    }
    // 3. A lane naming one session but proven with another's key.
    control::session_keys a, b;
    asio::ip::tcp::socket ca{io}, cb{io};
    json wa, wb;
    const control::client_auth with_secret{&guard, {}, {}};
    REQUIRE_FALSE(
        co_await control::dial(ca, eps, 2s, {}, control_hello(), 1 << 20, with_secret, wa, &a));
    REQUIRE_FALSE(
        co_await control::dial(cb, eps, 2s, {}, control_hello(), 1 << 20, with_secret, wb, &b));
    CHECK(wa.contains("descriptor"));
    CHECK(a.session != b.session);
    {
      asio::ip::tcp::socket s{io};
      json w;
      const control::client_auth stolen{&guard, a.session, b.key};
      const auto ec = co_await control::dial(s, eps, 2s, {}, lane_hello(), 1 << 20, stolen, w);
      CHECK(ec == kvlink::errc::authentication_failed);
      // The refused lane carries nothing: a WRITE frame gets no answer.
      kvlink::tcp::frame_header fh;
      fh.type = kvlink::tcp::frame_type::write_request;
      fh.segment = seg.value();
      fh.length = 16;
      const auto bytes = kvlink::tcp::encode(fh);
      std::array<std::byte, 16> payload{};
      std::error_code wec;
      asio::write(s, std::array<asio::const_buffer, 2>{asio::buffer(bytes), asio::buffer(payload)},
                  wec);
    }
    {
      asio::ip::tcp::socket s{io};
      json w;
      const control::client_auth own{&guard, a.session, a.key};
      CHECK_FALSE(co_await control::dial(s, eps, 2s, {}, lane_hello(), 1 << 20, own, w));
    }
  });
  for (int i = 0; i < 20; ++i) io.run_one_for(5ms);
  for (std::size_t i = 0; i < arena.size(); ++i) REQUIRE(arena[i] == std::byte{0xA5});
}

TEST_CASE("the secret from a file; a file that cannot be read stops the engine with the reason") {
  const std::string path = "/tmp/kvlink-test-secret-" + std::to_string(::getpid());
  {
    std::ofstream f(path);
    f << "s3cret\n";  // a trailing newline is not part of the secret
  }
  auto file_cfg = test_config();
  file_cfg.auth_secret_file = path;
  pair_rig r{1 << 16, kvlink::access::remote_read_write, secret_config("s3cret"), file_cfg};
  auto out = r.run({r.req(opcode::write, 0, 0, 4096)});
  CHECK_FALSE(out.ec);
  std::remove(path.c_str());
  asio::io_context io;
  try {
    kvlink::tcp_engine e{io.get_executor(), file_cfg};
    FAIL("an engine started with an unreadable secret file");
  } catch (const std::system_error& e) {
    CHECK(e.code() == kvlink::errc::invalid_argument);
    CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
}

TEST_CASE("checksums: end to end, both directions; a wrong one is refused, not acknowledged") {
  auto cfg = test_config();
  cfg.checksums = true;
  pair_rig r{4u << 20, kvlink::access::remote_read_write, cfg, cfg};
  fill(r.local_mem, 101);
  auto w = r.run({r.req(opcode::write, 0, 0, r.local_mem.size())});
  REQUIRE_MESSAGE(!w.ec, w.ec.message());
  CHECK(r.remote_mem == r.local_mem);
  fill(r.remote_mem, 102);
  auto rd = r.run({r.req(opcode::read, 0, 0, r.local_mem.size())});
  REQUIRE_MESSAGE(!rd.ec, rd.ec.message());
  CHECK(r.remote_mem == r.local_mem);
  kvlink::transfer_options off;
  off.checksum = false;  // per transfer
  auto plain = r.run({r.req(opcode::write, 0, 0, 4096)}, off);
  CHECK_FALSE(plain.ec);

  // A raw lane: a WRITE whose checksum does not match its payload is
  // answered checksum_mismatch; the stream stays usable.
  const auto addr = r.target->local_address();
  std::atomic<bool> finished{false};
  std::thread client([&] {
    asio::io_context cio;
    auto s = raw_lane(cio, addr, r.target->instance());
    std::vector<std::byte> payload(4096, std::byte{0x5A});
    kvlink::tcp::frame_header h;
    h.type = kvlink::tcp::frame_type::write_request;
    h.tag = 1;
    h.segment = r.remote_seg.value();
    h.length = payload.size();
    h.flags = kvlink::tcp::frame_flag_checksum;
    h.checksum = kvlink::crc32c(payload.data(), payload.size()) ^ 1u;  // one bit off
    const auto bad = kvlink::tcp::encode(h);
    asio::write(s, std::array<asio::const_buffer, 2>{asio::buffer(bad), asio::buffer(payload)});
    kvlink::tcp::frame_bytes b{};
    asio::read(s, asio::buffer(b));
    kvlink::tcp::frame_header ack;
    REQUIRE_FALSE(kvlink::tcp::decode(b.data(), ack));
    CHECK(kvlink::tcp::status_to_error(ack.status) == kvlink::errc::checksum_mismatch);
    h.tag = 2;
    h.checksum ^= 1u;  // now right
    const auto good = kvlink::tcp::encode(h);
    asio::write(s, std::array<asio::const_buffer, 2>{asio::buffer(good), asio::buffer(payload)});
    asio::read(s, asio::buffer(b));
    REQUIRE_FALSE(kvlink::tcp::decode(b.data(), ack));
    CHECK(ack.status == 0);
    // An unknown flag: the stream cannot be trusted, the target hangs up.
    h.tag = 3;
    h.flags = 0x80;
    const auto odd = kvlink::tcp::encode(h);
    asio::write(s, asio::buffer(odd));
    std::error_code ec;
    asio::read(s, asio::buffer(b), ec);
    CHECK(ec);
    finished = true;
  });
  REQUIRE(run_until(r.io, [&] { return finished.load(); }));
  client.join();
}
