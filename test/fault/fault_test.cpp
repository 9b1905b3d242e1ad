// Fault injection: kvlink transfers pushed through fault_proxy
// (test/support/fault_proxy.hpp), which delays, throttles, truncates, resets
// or black-holes the control connection and the TCP lanes between two
// engines on loopback. Whatever the fault, a transfer either completes with
// the right bytes or fails with a clear kvlink error within its deadline
// (+ fence_timeout); its handler runs exactly once; after the handler no
// byte of the initiator's buffer changes; and a later connect + transfer
// works again. The proxy itself is checked first, on raw TCP streams.
//
// The random-fault loop is seeded (KVLINK_FAULT_SEED overrides the seed) and
// prints its counts with MESSAGE (run with -s to see them on success).
#include <kvlink/engine.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fault_proxy.hpp"
#include "test_support.hpp"
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>
#include <doctest/doctest.h>

namespace {

using namespace std::chrono_literals;
using kvlink::opcode;
using kvlink_test::direction;
using kvlink_test::fault;
using kvlink_test::fault_proxy;
using kvlink_test::fill_pattern;
using kvlink_test::is_pattern;
using tcp = asio::ip::tcp;
using steady = std::chrono::steady_clock;

// ------------------------------------------------------------ raw streams

// A plain TCP listener for the proxy to forward to; the test's thread uses
// blocking calls on it while the proxy runs on its own thread.
struct raw_target {
  asio::io_context io;
  tcp::acceptor acceptor{io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)};
  std::string address() const {
    return "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port());
  }
};

struct raw_pair {
  tcp::socket client, server;
};

raw_pair connect_through(fault_proxy& proxy, raw_target& t) {
  tcp::socket client(t.io);
  client.connect(proxy.endpoint());
  tcp::socket server = t.acceptor.accept();
  return {std::move(client), std::move(server)};
}

std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  fill_pattern(v.data(), n, seed, 0);
  return v;
}

// Writes `bytes` on another thread, then half-closes (errors ignored: the
// proxy may cut the stream).
std::thread send_async(tcp::socket& s, const std::vector<std::byte>& bytes) {
  return std::thread([&s, &bytes] {
    std::error_code ec;
    asio::write(s, asio::buffer(bytes), ec);
    s.shutdown(tcp::socket::shutdown_send, ec);
  });
}

struct drained {
  std::vector<std::byte> bytes;
  std::error_code end;  // eof, or the error that ended the stream
};

drained read_all(tcp::socket& s) {
  drained d;
  std::vector<std::byte> buf(64u << 10);
  for (;;) {
    std::error_code ec;
    const auto n = s.read_some(asio::buffer(buf), ec);
    d.bytes.insert(d.bytes.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n));
    if (ec) {
      d.end = ec;
      return d;
    }
  }
}

// ------------------------------------------------------------ kvlink rig

constexpr auto fence_timeout = 200ms;
constexpr auto deadline = 3000ms;
constexpr auto margin = 3000ms;  // scheduling slack on a loaded 2-core machine

kvlink::config engine_config() {
  kvlink::config c;
  c.transports = "tcp";
  c.fence_timeout = fence_timeout;
  c.transfer_deadline = deadline;
  c.connect_timeout = 1s;
  return c;
}

// The errors a transfer (or connect) may fail with when its connections are
// cut, reset or silent.
bool clear_error(std::error_code ec) {
  return ec == kvlink::errc::peer_closed || ec == kvlink::errc::peer_unreachable ||
         ec == kvlink::errc::deadline_exceeded || ec == kvlink::errc::checksum_mismatch ||
         ec == kvlink::errc::malformed_message;
}

std::size_t count_mismatches(const std::byte* p, std::size_t len, std::uint64_t seed,
                             std::uint64_t origin) {
  if (is_pattern(p, len, seed, origin)) return 0;
  std::vector<std::byte> want(len);
  fill_pattern(want.data(), len, seed, origin);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < len; ++i) bad += p[i] != want[i] ? 1 : 0;
  return bad;
}

struct outcome {
  std::error_code ec;
  kvlink::transfer_result result;
  int calls = 0;
  bool returned = false;
  bool inside = false;  // the handler ran inside the initiating call
};

// What happened to one transfer, judged against the contract.
struct verdict {
  bool hang = false;                   // no handler within deadline + fence + margin
  int calls = 0;                       // handler calls, counted a while after the first
  bool changed_after = false;          // the initiator's buffer changed after the handler
  std::error_code ec;                  // the transfer's error
  steady::duration took{};             // submission to handler
  std::shared_ptr<const outcome> out;  // keeps counting calls: checked again later
};

// Two engines on one io_context driven by the test's thread, the initiator
// reaching the target through a fault_proxy.
struct rig {
  asio::io_context io;
  std::size_t size;
  std::vector<std::byte> remote, local;
  kvlink::engine target;
  kvlink::engine initiator;
  fault_proxy proxy;
  kvlink::segment_id remote_seg, local_seg;
  kvlink::peer peer;
  std::uint64_t control_index = 0;  // the proxy's index of the peer's control connection
  std::shared_ptr<int> notes = std::make_shared<int>(0);
  // How long the io runs after a failed transfer's handler before its
  // outcome is judged.
  std::chrono::milliseconds watch_failed = fence_timeout + 50ms;

  explicit rig(std::size_t n)
      : size(n),
        remote(n),
        local(n),
        target(io.get_executor(), engine_config()),
        initiator(io.get_executor(), engine_config()),
        proxy(target.listen_address()) {
    remote_seg = target.register_segment(remote.data(), n, kvlink::access::remote_read_write);
    local_seg = initiator.register_segment(local.data(), n, kvlink::access::remote_read_write);
    receive_notes();
  }

  // Notifications are taken off the target's inbox as they come.
  void receive_notes() {
    target.async_receive_notification(
        [this, n = notes](std::error_code ec, const kvlink::notification&) {
          if (ec) return;
          ++*n;
          receive_notes();
        });
  }

  std::uint64_t lane(std::uint64_t i) const { return control_index + 1 + i; }

  void settle(std::chrono::milliseconds d) {
    const auto end = steady::now() + d;
    for (auto now = steady::now(); now < end; now = steady::now()) io.run_one_for(end - now);
  }

  // Connects (through the proxy); the handler is checked to run once.
  std::error_code connect() {
    control_index = proxy.accepted();
    struct state {
      int calls = 0;
      std::error_code ec;
      kvlink::peer p;
    };
    auto st = std::make_shared<state>();
    initiator.async_connect(proxy.address(), [st](std::error_code ec, kvlink::peer p) {
      ++st->calls;
      st->ec = ec;
      st->p = std::move(p);
    });
    REQUIRE(kvlink_test::run_until(
        io, [&] { return st->calls > 0; }, 30s));
    settle(20ms);
    CHECK(st->calls == 1);
    if (!st->ec) peer = st->p;
    return st->ec;
  }

  // Closes the peer's connections (a live peer is reused by connect(),
  // which then opens no lanes).
  void drop_peer() {
    if (peer.connected()) {
      proxy.set_fault(fault::truncate(0));
      REQUIRE(kvlink_test::run_until(
          io, [&] { return !peer.connected(); }, 10s));
    }
    proxy.clear_faults();
    settle(20ms);
  }

  void reconnect_if_needed() {
    proxy.clear_faults();
    settle(20ms);  // connections the faults closed are noticed
    if (peer.connected()) return;
    const auto ec = connect();
    REQUIRE_MESSAGE(!ec, "connect after the faults were cleared: " << ec.message());
  }

  // Lays out a transfer of `len` bytes: the source holds the pattern of
  // `seed`, the destination something else.
  std::vector<kvlink::transfer_request> prepare(opcode op, std::size_t loff, std::size_t roff,
                                                std::size_t len, std::uint64_t seed) {
    auto* src = op == opcode::write ? local.data() + loff : remote.data() + roff;
    auto* dst = op == opcode::write ? remote.data() + roff : local.data() + loff;
    fill_pattern(src, len, seed, 0);
    fill_pattern(dst, len, seed + 0x5eed, 0);
    return {{op, local.data() + loff, peer.segment(remote_seg), roff, len}};
  }

  // Submits, drives until the handler (calling `during` meanwhile: faults
  // injected mid-transfer), then checks the contract.
  verdict run(const std::vector<kvlink::transfer_request>& reqs, kvlink::transfer_options opts,
              const std::function<void()>& during = {}) {
    verdict v;
    auto out = std::make_shared<outcome>();
    const auto t0 = steady::now();
    const auto limit = opts.deadline.value_or(deadline) + fence_timeout + margin;
    initiator.async_submit_transfer(reqs, opts,
                                    [out](std::error_code ec, kvlink::transfer_result res) {
                                      out->inside = !out->returned;
                                      out->ec = ec;
                                      out->result = res;
                                      ++out->calls;
                                    });
    out->returned = true;
    while (out->calls == 0) {
      if (steady::now() - t0 > limit) {
        v.hang = true;
        return v;
      }
      io.run_one_for(5ms);
      if (during) during();
    }
    v.took = steady::now() - t0;
    const auto after = local;
    // A late second call or a late write would show up here: a failed
    // transfer is watched past its fence timeout.
    settle(out->ec ? watch_failed : 30ms);
    v.out = out;
    v.calls = out->calls;
    v.changed_after = local != after;
    v.ec = out->ec;
    CHECK_FALSE(out->inside);
    return v;
  }

  // The destination of a single-request transfer laid out by prepare().
  std::size_t corrupted(const kvlink::transfer_request& q, std::uint64_t seed) const {
    const auto loff =
        static_cast<std::size_t>(static_cast<const std::byte*>(q.local) - local.data());
    const auto* dst = q.op == opcode::write ? remote.data() + q.remote_offset : local.data() + loff;
    return count_mismatches(dst, static_cast<std::size_t>(q.length), seed, 0);
  }

  // The contract, whatever the outcome: no hang, one call, nothing written
  // after the handler, a clear error or the right bytes.
  void check(const verdict& v, const kvlink::transfer_request& q, std::uint64_t seed) {
    REQUIRE_FALSE_MESSAGE(v.hang, "no handler within deadline + fence_timeout + margin");
    CHECK(v.calls == 1);
    CHECK_FALSE(v.changed_after);
    if (v.ec) {
      CHECK_MESSAGE(clear_error(v.ec), "unexpected error: " << v.ec.message());
    } else {
      CHECK(corrupted(q, seed) == 0);
    }
  }

  // One transfer with nothing in the way: the engines work.
  void check_works(opcode op = opcode::write, std::size_t len = 1u << 20) {
    reconnect_if_needed();
    const auto reqs = prepare(op, 0, 0, len, 99);
    const auto v = run(reqs, {});
    REQUIRE_FALSE(v.hang);
    CHECK(v.calls == 1);
    REQUIRE_MESSAGE(!v.ec, v.ec.message());
    CHECK(corrupted(reqs[0], 99) == 0);
  }
};

std::string op_name(opcode op) { return op == opcode::write ? "WRITE" : "READ"; }

}  // namespace

// ============================================================ the proxy itself

TEST_CASE("fault proxy: transparent, then truncate, reset, black hole, throttle and delay") {
  raw_target t;
  fault_proxy proxy(t.address());

  SUBCASE("transparent both ways") {
    auto [c, s] = connect_through(proxy, t);
    const auto up = pattern(3u << 20, 1), down = pattern((1u << 20) + 3, 2);
    auto w1 = send_async(c, up);
    auto w2 = send_async(s, down);
    const auto at_target = read_all(s);
    const auto at_client = read_all(c);
    w1.join();
    w2.join();
    CHECK(at_target.end == asio::error::eof);
    CHECK(at_client.end == asio::error::eof);
    CHECK(at_target.bytes == up);
    CHECK(at_client.bytes == down);
    const auto st = proxy.stats();
    CHECK(st.accepted == 1);
    CHECK(st.bytes_to_target == up.size());
    CHECK(st.bytes_to_initiator == down.size());
    CHECK(st.faults_injected() == 0);
  }
  SUBCASE("truncate: exactly K bytes, then FIN") {
    proxy.set_fault(fault::truncate(100'003, direction::to_target));
    auto [c, s] = connect_through(proxy, t);
    const auto up = pattern(1u << 20, 3);
    auto w = send_async(c, up);
    const auto got = read_all(s);
    w.join();
    CHECK(got.end == asio::error::eof);
    REQUIRE(got.bytes.size() == 100'003);
    CHECK(std::equal(got.bytes.begin(), got.bytes.end(), up.begin()));
    CHECK(proxy.stats().truncations == 1);
  }
  SUBCASE("truncate(0) closes an idle connection at once") {
    auto [c, s] = connect_through(proxy, t);
    std::this_thread::sleep_for(50ms);  // the proxy has connected both sides
    proxy.set_fault(fault::truncate(0).on_connection(0));
    const auto got = read_all(s);
    CHECK(got.bytes.empty());
    CHECK(got.end == asio::error::eof);
  }
  SUBCASE("reset: at most K bytes, then RST") {
    proxy.set_fault(fault::reset(65'536, direction::to_target));
    auto [c, s] = connect_through(proxy, t);
    const auto up = pattern(1u << 20, 4);
    auto w = send_async(c, up);
    const auto got = read_all(s);
    w.join();
    CHECK(got.end == asio::error::connection_reset);
    CHECK(got.bytes.size() <= 65'536);
    CHECK(std::equal(got.bytes.begin(), got.bytes.end(), up.begin()));
    CHECK(proxy.stats().resets == 1);
  }
  SUBCASE("reset_connection: RST at once, the bytes held back dropped") {
    proxy.set_fault(fault::delay(2s, direction::to_target));
    auto [c, s] = connect_through(proxy, t);
    const auto up = pattern(4096, 8);
    asio::write(c, asio::buffer(up));
    const auto t0 = steady::now();
    while (proxy.stats().delayed_chunks == 0 && steady::now() - t0 < 10s) {
      std::this_thread::sleep_for(1ms);
    }
    REQUIRE(proxy.stats().delayed_chunks > 0);
    CHECK(proxy.reset_connection(0));
    CHECK_FALSE(proxy.reset_connection(0));  // closed already
    CHECK_FALSE(proxy.reset_connection(7));  // never accepted
    const auto got = read_all(s);
    CHECK(got.bytes.empty());
    CHECK(got.end == asio::error::connection_reset);
    CHECK(proxy.stats().bytes_to_target == 0);
    CHECK(proxy.stats().resets == 1);
  }
  SUBCASE("black hole: bytes dropped, connection kept") {
    auto [c, s] = connect_through(proxy, t);
    proxy.set_fault(fault::black_hole(direction::to_target));
    const auto dropped = pattern(64u << 10, 5);
    asio::write(c, asio::buffer(dropped));
    std::this_thread::sleep_for(150ms);
    CHECK(s.available() == 0);
    CHECK(proxy.stats().black_holed_bytes == dropped.size());
    proxy.clear_faults();
    const auto later = pattern(100, 6);
    asio::write(c, asio::buffer(later));
    std::vector<std::byte> got(later.size());
    asio::read(s, asio::buffer(got));
    CHECK(got == later);
  }
  SUBCASE("throttle: at most N bytes/s") {
    proxy.set_fault(fault::throttle(8u << 20, direction::to_target));
    auto [c, s] = connect_through(proxy, t);
    const auto up = pattern(1u << 20, 7);
    const auto t0 = steady::now();
    auto w = send_async(c, up);
    const auto got = read_all(s);
    const auto took = steady::now() - t0;
    w.join();
    CHECK(got.bytes == up);
    CHECK(took >= 100ms);  // 1 MiB at 8 MiB/s: 125 ms less the first read
    CHECK(proxy.stats().throttled_reads > 0);
  }
  SUBCASE("delay: every chunk forwarded d later, in order") {
    proxy.set_fault(fault::delay(60ms));
    auto [c, s] = connect_through(proxy, t);
    const auto t0 = steady::now();
    for (std::uint8_t i = 0; i < 5; ++i) {
      const std::byte b{i};
      asio::write(c, asio::buffer(&b, 1));
    }
    std::vector<std::byte> got(5);
    asio::read(s, asio::buffer(got));
    CHECK(steady::now() - t0 >= 60ms);
    for (std::uint8_t i = 0; i < 5; ++i) CHECK(got[i] == std::byte{i});
    // A round trip pays the delay both ways.
    const auto t1 = steady::now();
    asio::write(s, asio::buffer(got.data(), 1));
    asio::read(c, asio::buffer(got.data(), 1));
    asio::write(c, asio::buffer(got.data(), 1));
    asio::read(s, asio::buffer(got.data(), 1));
    CHECK(steady::now() - t1 >= 120ms);
  }
}

TEST_CASE("fault proxy: bit_flip flips exactly the expected bits, one direction only") {
  raw_target t;
  fault_proxy proxy(t.address());
  const std::uint64_t every = 1000;
  proxy.set_fault(fault::bit_flip(every, direction::to_target));
  auto [c, s] = connect_through(proxy, t);
  const auto up = pattern((1u << 20) + 17, 8);
  const auto down = pattern(200'000, 9);
  auto w1 = send_async(c, up);
  auto w2 = send_async(s, down);
  const auto at_target = read_all(s);
  const auto at_client = read_all(c);
  w1.join();
  w2.join();
  REQUIRE(at_target.bytes.size() == up.size());
  std::size_t wrong_bits = 0;
  for (std::size_t i = 0; i < up.size(); ++i) {
    const std::uint64_t pos = i + 1;  // the k-th byte since the fault was set
    const auto expect =
        pos % every == 0 ? up[i] ^ static_cast<std::byte>(1u << ((pos / every - 1) % 8)) : up[i];
    if (at_target.bytes[i] != expect) ++wrong_bits;
  }
  CHECK(wrong_bits == 0);
  CHECK(at_target.bytes != up);
  CHECK(proxy.stats().bit_flips == up.size() / every);
  CHECK(at_client.bytes == down);  // the other direction is untouched
}

// ============================================================ kvlink through it

TEST_CASE("fault: no fault, WRITE and READ through the proxy arrive intact") {
  rig r{24u << 20};
  REQUIRE(!r.connect());
  CHECK(r.proxy.accepted() == 1 + engine_config().tcp.lanes);  // control, then the lanes
  std::uint64_t seed = 1;
  for (const std::size_t len : {std::size_t{4096}, std::size_t{(1u << 20) + 13}, r.size}) {
    for (const auto op : {opcode::write, opcode::read}) {
      CAPTURE(len);
      CAPTURE(op_name(op));
      const auto reqs = r.prepare(op, 0, 0, len, ++seed);
      const auto v = r.run(reqs, {});
      r.check(v, reqs[0], seed);
      CHECK_MESSAGE(!v.ec, v.ec.message());
    }
  }
  const auto st = r.proxy.stats();
  CHECK(st.bytes_to_target > (24u << 20));
  CHECK(st.bytes_to_initiator > (24u << 20));
  CHECK(st.faults_injected() == 0);
}

TEST_CASE("fault: delay and throttle slow transfers down, bytes intact") {
  rig r{8u << 20};
  REQUIRE(!r.connect());
  std::uint64_t seed = 10;
  SUBCASE("delay 20 ms each way") {
    r.proxy.set_fault(fault::delay(20ms));
    for (const auto op : {opcode::write, opcode::read}) {
      for (const std::size_t len : {std::size_t{4096}, r.size}) {
        CAPTURE(op_name(op));
        CAPTURE(len);
        const auto reqs = r.prepare(op, 0, 0, len, ++seed);
        const auto v = r.run(reqs, {});
        r.check(v, reqs[0], seed);
        CHECK_MESSAGE(!v.ec, v.ec.message());
        CHECK(v.took >= 40ms);  // a request and its answer each wait 20 ms
      }
    }
    CHECK(r.proxy.stats().delayed_chunks > 0);
  }
  SUBCASE("throttle each connection to 32 MiB/s in the payload's direction") {
    for (const auto op : {opcode::write, opcode::read}) {
      CAPTURE(op_name(op));
      r.proxy.set_fault(fault::throttle(
          32u << 20, op == opcode::write ? direction::to_target : direction::to_initiator));
      const std::size_t len = 8u << 20;
      const auto reqs = r.prepare(op, 0, 0, len, ++seed);
      const auto v = r.run(reqs, {});
      r.check(v, reqs[0], seed);
      CHECK_MESSAGE(!v.ec, v.ec.message());
      CHECK(v.took >= 100ms);  // 8 MiB over two lanes at 32 MiB/s each: 125 ms
    }
    CHECK(r.proxy.stats().throttled_reads > 0);
  }
}

TEST_CASE("fault: truncate and reset during the handshake") {
  rig r{4u << 20};
  std::uint64_t seed = 100;
  struct point {
    std::string what;
    std::uint64_t connection;  // 0: control, 1: lane 0, 2: lane 1 (from control_index)
    direction dir;
    std::uint64_t after;
  };
  const point points[] = {
      {"control, before the hello", 0, direction::to_target, 0},
      {"control, inside the hello", 0, direction::to_target, 20},
      {"control, inside the welcome", 0, direction::to_initiator, 30},
      {"lane 0, inside its hello", 1, direction::to_target, 12},
      {"lane 0, inside its welcome", 1, direction::to_initiator, 9},
      {"lane 1, before its hello", 2, direction::both, 0},
      {"lane 1, past its handshake (inside the first frames)", 2, direction::to_target, 600},
  };
  for (const bool rst : {false, true}) {
    for (const auto& p : points) {
      CAPTURE(p.what);
      CAPTURE(rst);
      r.drop_peer();
      const auto base = r.proxy.accepted();
      const auto f = rst ? fault::reset(p.after, p.dir) : fault::truncate(p.after, p.dir);
      r.proxy.set_fault(f.on_connection(base + p.connection));
      const auto ec = r.connect();
      if (ec) {
        CHECK_MESSAGE(clear_error(ec), "connect failed with " << ec.message());
      } else {
        CHECK(r.proxy.accepted() == base + 1 + engine_config().tcp.lanes);  // a new peer
        // The cut came after the handshake: a transfer meets it.
        const auto reqs = r.prepare(opcode::write, 0, 0, 1u << 20, ++seed);
        r.check(r.run(reqs, {}), reqs[0], seed);
      }
      r.check_works();
      r.check_works(opcode::read);
    }
  }
  CHECK(r.proxy.stats().faults_injected() > 0);
}

TEST_CASE("fault: truncate and reset on a lane mid-payload") {
  const std::size_t len = 16u << 20;
  rig r{len};
  REQUIRE(!r.connect());
  std::uint64_t seed = 200;
  for (const bool rst : {false, true}) {
    for (const auto op : {opcode::write, opcode::read}) {
      for (const std::uint64_t lane : {0u, 1u}) {
        // In the payload's direction, a few MiB in; and the other way (the
        // acknowledgements / the read requests) a few frames in.
        for (const bool payload : {true, false}) {
          CAPTURE(rst);
          CAPTURE(op_name(op));
          CAPTURE(lane);
          CAPTURE(payload);
          const auto dir =
              (op == opcode::write) == payload ? direction::to_target : direction::to_initiator;
          const std::uint64_t after = payload ? (3u << 20) + 4099 : 40 * 5 + 17;
          const auto f = rst ? fault::reset(after, dir) : fault::truncate(after, dir);
          const auto reqs = r.prepare(op, 0, 0, len, ++seed);
          r.proxy.set_fault(f.on_connection(r.lane(lane)));
          const auto v = r.run(reqs, {});
          r.check(v, reqs[0], seed);
          CHECK(v.ec);  // every lane carries several MiB of it: the cut hits
          r.check_works(op);
        }
      }
    }
  }
}

TEST_CASE("fault: truncate and reset on the control connection") {
  const std::size_t len = 16u << 20;
  rig r{len};
  REQUIRE(!r.connect());
  std::uint64_t seed = 300;
  for (const bool rst : {false, true}) {
    for (const auto op : {opcode::write, opcode::read}) {
      CAPTURE(rst);
      CAPTURE(op_name(op));
      // The lanes are slowed so that the cut lands mid-transfer: it comes
      // once a quarter of the payload went through.
      r.proxy.set_fault(fault::throttle(64u << 20));
      const auto reqs = r.prepare(op, 0, 0, len, ++seed);
      const auto at = r.proxy.stats();
      bool cut = false;
      const auto v = r.run(reqs, {}, [&] {
        const auto now = r.proxy.stats();
        const auto moved = now.bytes_to_target + now.bytes_to_initiator - at.bytes_to_target -
                           at.bytes_to_initiator;
        if (!cut && moved >= len / 4) {
          cut = true;
          r.proxy.add_fault(rst ? fault::reset(0).on_connection(r.control_index)
                                : fault::truncate(0).on_connection(r.control_index));
        }
      });
      r.check(v, reqs[0], seed);
      CHECK(cut);
      CHECK(v.ec);  // losing the control connection loses the peer
      r.check_works(op);

      // The control connection cut inside a notification sent after the data.
      r.proxy.set_fault(rst ? fault::reset(5).on_connection(r.control_index)
                            : fault::truncate(5).on_connection(r.control_index));
      kvlink::transfer_options opts;
      opts.notify = kvlink::notification{"blocks-ready", "payload"};
      const auto reqs2 = r.prepare(op, 0, 0, 1u << 20, ++seed);
      r.check(r.run(reqs2, opts), reqs2[0], seed);
      r.check_works(op);
    }
  }
}

TEST_CASE("fault: a black hole fails the transfer with deadline_exceeded, fenced") {
  const std::size_t len = 8u << 20;
  rig r{len};
  std::uint64_t seed = 400;
  kvlink::transfer_options opts;
  opts.deadline = 500ms;
  for (const auto op : {opcode::write, opcode::read}) {
    for (const bool mid : {false, true}) {
      CAPTURE(op_name(op));
      CAPTURE(mid);
      r.reconnect_if_needed();
      const auto reqs = r.prepare(op, 0, 0, len, ++seed);
      const auto at = r.proxy.stats();
      // Mid-transfer: slowed down, then black-holed an eighth of the way in.
      r.proxy.set_fault(mid ? fault::throttle(16u << 20) : fault::black_hole());
      bool holed = !mid;
      const auto v = r.run(reqs, opts, [&] {
        if (!holed && r.proxy.stats().bytes_to_target + r.proxy.stats().bytes_to_initiator -
                              at.bytes_to_target - at.bytes_to_initiator >=
                          len / 8) {
          holed = true;
          r.proxy.set_fault(fault::black_hole());
        }
      });
      REQUIRE_FALSE(v.hang);
      CHECK(holed);
      CHECK(v.calls == 1);
      CHECK_FALSE(v.changed_after);
      CHECK_MESSAGE(v.ec == kvlink::errc::deadline_exceeded, v.ec.message());
      CHECK(v.took >= *opts.deadline);
      CHECK(v.took <= *opts.deadline + fence_timeout + margin);
      CHECK(r.proxy.stats().black_holed_bytes > at.black_holed_bytes);
      r.check_works(op);
    }
  }
}

TEST_CASE("fault: a black hole during the handshake fails the connect by connect_timeout") {
  rig r{1u << 20};
  for (const std::uint64_t conn : {0u, 2u}) {  // the control connection; lane 1
    CAPTURE(conn);
    r.drop_peer();
    r.proxy.set_fault(fault::black_hole().on_connection(r.proxy.accepted() + conn));
    const auto t0 = steady::now();
    const auto ec = r.connect();
    const auto took = steady::now() - t0;
    CHECK_MESSAGE(ec == kvlink::errc::peer_unreachable, ec.message());
    CHECK(took >= engine_config().connect_timeout);
    CHECK(took <= engine_config().connect_timeout + margin);
    r.check_works();
  }
}

TEST_CASE("fault: a link slower than the deadline: late bytes never reach the buffer") {
  const std::size_t len = 8u << 20;
  rig r{len};
  REQUIRE(!r.connect());
  std::uint64_t seed = 500;
  kvlink::transfer_options opts;
  opts.deadline = 300ms;
  for (const auto op : {opcode::write, opcode::read}) {
    CAPTURE(op_name(op));
    // Nothing is lost, everything is late: past the deadline and past the
    // fence timeout, so the fence closes the lanes with bytes still queued
    // in the proxy.
    r.proxy.set_fault(fault::delay(500ms));
    const auto reqs = r.prepare(op, 0, 0, len, ++seed);
    const auto v = r.run(reqs, opts);
    REQUIRE_FALSE(v.hang);
    CHECK(v.calls == 1);
    CHECK_FALSE(v.changed_after);
    CHECK_MESSAGE(v.ec == kvlink::errc::deadline_exceeded, v.ec.message());
    r.settle(600ms);  // what the proxy still held has been delivered (or dropped) by now
    CHECK(v.out->calls == 1);
    r.check_works(op);
  }
}

TEST_CASE("fault: concurrent transfers on a lane that is reset: each completes once") {
  const std::size_t len = 32u << 20, part = len / 4;
  rig r{len};
  REQUIRE(!r.connect());
  for (const auto op : {opcode::write, opcode::read}) {
    CAPTURE(op_name(op));
    std::vector<std::shared_ptr<outcome>> outs;
    std::vector<kvlink::transfer_request> reqs;
    for (std::size_t i = 0; i < 4; ++i) {
      reqs.push_back(r.prepare(op, i * part, i * part, part, 600 + i)[0]);
    }
    r.proxy.set_fault(
        fault::reset(3u << 20, op == opcode::write ? direction::to_target : direction::to_initiator)
            .on_connection(r.lane(1)));
    for (const auto& q : reqs) {
      auto out = std::make_shared<outcome>();
      r.initiator.async_submit_transfer(std::vector{q}, kvlink::transfer_options{},
                                        [out](std::error_code ec, kvlink::transfer_result res) {
                                          out->ec = ec;
                                          out->result = res;
                                          ++out->calls;
                                        });
      outs.push_back(out);
    }
    REQUIRE(kvlink_test::run_until(
        r.io,
        [&] {
          return std::all_of(outs.begin(), outs.end(), [](const auto& o) { return o->calls > 0; });
        },
        std::chrono::duration_cast<std::chrono::seconds>(deadline + fence_timeout + margin)));
    const auto after = r.local;
    r.settle(fence_timeout + 100ms);
    CHECK(r.local == after);
    int failed = 0;
    for (std::size_t i = 0; i < outs.size(); ++i) {
      CAPTURE(i);
      CHECK(outs[i]->calls == 1);
      if (outs[i]->ec) {
        ++failed;
        CHECK_MESSAGE(clear_error(outs[i]->ec), outs[i]->ec.message());
      } else {
        CHECK(r.corrupted(reqs[i], 600 + i) == 0);
      }
    }
    CHECK(failed > 0);  // lane 1 carried a part of each
    r.check_works(op);
  }
}

TEST_CASE("fault: random faults at random offsets, 120 transfers (seeded)") {
  std::uint64_t seed0 = 20261124;
  if (const char* s = std::getenv("KVLINK_FAULT_SEED")) seed0 = std::strtoull(s, nullptr, 10);
  CAPTURE(seed0);
  const std::size_t buffer = 20u << 20;
  rig r{buffer};
  r.watch_failed = 100ms;  // every handler is watched again at the end
  std::mt19937_64 g{seed0};
  auto pick = [&](std::uint64_t n) { return static_cast<std::size_t>(g() % n); };
  struct {
    int completed = 0, failed = 0, hangs = 0, double_completions = 0, changed_after = 0;
    std::size_t corrupted = 0;
    std::map<std::string, int> errors, kinds;
  } n;
  const char* kind_names[] = {"none", "delay", "throttle", "truncate", "reset", "black_hole"};
  const int iterations = 120;
  std::vector<std::pair<std::shared_ptr<const outcome>, int>> outcomes;  // and its calls then
  for (int i = 0; i < iterations; ++i) {
    CAPTURE(i);
    r.reconnect_if_needed();
    // The transfer: READ or WRITE, 4 KiB to 16 MiB, at random offsets.
    const auto op = pick(2) == 0 ? opcode::write : opcode::read;
    const std::size_t len = (std::size_t{4096} << pick(13)) + pick(4096);
    const std::size_t loff = pick(buffer - len + 1), roff = pick(buffer - len + 1);
    const std::uint64_t tseed = seed0 * 1000 + static_cast<std::uint64_t>(i);
    const auto reqs = r.prepare(op, loff, roff, len, tseed);
    kvlink::transfer_options opts;
    opts.deadline = 400ms;
    if (pick(4) == 0) opts.notify = kvlink::notification{"n", std::to_string(i)};
    // The fault: what, where, which way, when.
    static constexpr std::size_t weights[] = {1, 1, 1, 3, 3, 1};
    std::size_t k = pick(10);
    std::size_t kind = 0;
    while (k >= weights[kind]) k -= weights[kind++];
    const std::uint64_t conn = pick(4);  // control, lane 0, lane 1, all
    const auto dir =
        std::array{direction::to_target, direction::to_initiator, direction::both}[pick(3)];
    // Each lane carries about half of the bytes; the control connection only
    // a notification (about 100 bytes).
    const std::uint64_t after = pick(2) == 0 ? pick(200) : pick(len / 2 + 1);
    fault f;
    switch (kind) {
      case 1:
        f = fault::delay(std::chrono::milliseconds(1 + pick(20)), dir);
        break;
      case 2:
        f = fault::throttle((8u << 20) + pick(120u << 20), dir);
        break;
      case 3:
        f = fault::truncate(after, dir);
        break;
      case 4:
        f = fault::reset(after, dir);
        break;
      case 5:
        f = fault::black_hole(dir);
        break;
      default:
        break;
    }
    if (conn < 3) f = f.on_connection(r.control_index + conn);
    const bool mid = pick(2) == 0;
    const std::uint64_t when = pick(len / 2);  // bytes through the proxy before a mid fault
    ++n.kinds[kind_names[kind]];
    const auto at = r.proxy.stats();
    bool armed = false;
    auto arm = [&] {
      if (armed || kind == 0) return;
      armed = true;
      r.proxy.set_fault(f);
    };
    if (!mid) arm();
    const auto v = r.run(reqs, opts, [&] {
      if (armed) return;
      const auto now = r.proxy.stats();
      if (now.bytes_to_target + now.bytes_to_initiator - at.bytes_to_target -
              at.bytes_to_initiator >=
          when) {
        arm();
      }
    });
    if (v.hang) {
      ++n.hangs;
      MESSAGE("hang: seed " << seed0 << " iteration " << i << " " << op_name(op) << " " << len
                            << " B, fault " << kind_names[kind] << " conn " << conn << " dir "
                            << static_cast<unsigned>(dir) << " after " << after << " mid " << mid
                            << " when " << when);
      break;  // the engine is stuck: nothing after this would mean much
    }
    outcomes.emplace_back(v.out, v.calls);
    if (v.calls != 1) ++n.double_completions;
    if (v.changed_after) ++n.changed_after;
    if (v.ec) {
      ++n.failed;
      ++n.errors[v.ec.message().substr(0, 40)];
      CHECK_MESSAGE(clear_error(v.ec), "iteration " << i << ": " << v.ec.message());
    } else {
      ++n.completed;
      const auto bad = r.corrupted(reqs[0], tseed);
      n.corrupted += bad;
      CHECK_MESSAGE(bad == 0, "iteration " << i << ": " << bad << " bytes corrupted");
    }
  }
  // Every handler is watched until the end: a late second call counts too.
  r.settle(fence_timeout + 100ms);
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    if (outcomes[i].first->calls != outcomes[i].second) {  // called again since
      ++n.double_completions;
      MESSAGE("iteration " << i << ": handler called " << outcomes[i].first->calls << " times");
    }
  }
  std::string errors, kinds;
  for (const auto& [e, c] : n.errors) errors += "\n    " + std::to_string(c) + " x " + e;
  for (const auto& [e, c] : n.kinds) kinds += " " + e + "=" + std::to_string(c);
  const auto st = r.proxy.stats();
  MESSAGE("random faults, seed " << seed0 << ": " << n.completed << " completed correct, "
                                 << n.failed << " failed with an error, " << n.hangs << " hangs, "
                                 << n.double_completions << " double completions, "
                                 << n.changed_after << " buffers changed after the handler, "
                                 << n.corrupted << " corrupted bytes\n  faults:" << kinds
                                 << "\n  proxy: " << st.accepted << " connections, "
                                 << st.faults_injected() << " faults injected (" << st.truncations
                                 << " FIN, " << st.resets << " RST, " << st.black_holed_chunks
                                 << " chunks black-holed)\n  errors:" << errors);
  CHECK(n.completed + n.failed == iterations);
  CHECK(n.hangs == 0);
  CHECK(n.double_completions == 0);
  CHECK(n.changed_after == 0);
  CHECK(n.corrupted == 0);
  CHECK(n.completed > 0);
  CHECK(n.failed > 0);
}

TEST_CASE("fault: bits flipped in transit are caught by checksums, never written silently") {
  // One bit in every 100,003 bytes of the lanes flips, in the payload's
  // direction. With checksums every transfer either arrives intact or fails
  // (checksum_mismatch; malformed_message or a lost peer when the flip hit a
  // header); without them corrupted bytes are reported as written.
  for (const auto op : {opcode::write, opcode::read}) {
    CAPTURE(op_name(op));
    rig r{4u << 20};
    REQUIRE_FALSE(r.connect());
    const auto dir = op == opcode::write ? direction::to_target : direction::to_initiator;
    int mismatches = 0, intact = 0, failed = 0, silent_corruption = 0;
    for (const bool checksums : {true, false}) {
      for (int i = 0; i < 12; ++i) {
        r.reconnect_if_needed();
        for (std::uint64_t lane = 0; lane < 2; ++lane) {
          r.proxy.add_fault(fault::bit_flip(100003, dir).on_connection(r.lane(lane)));
        }
        const std::uint64_t seed = 500 + static_cast<std::uint64_t>(i);
        const auto reqs = r.prepare(op, 0, 0, 4u << 20, seed);
        kvlink::transfer_options opts;
        opts.checksum = checksums;
        const auto v = r.run(reqs, opts);
        REQUIRE_FALSE(v.hang);
        CHECK(v.calls == 1);
        CHECK_FALSE(v.changed_after);
        r.proxy.clear_faults();
        const auto bad = r.corrupted(reqs[0], seed);
        if (checksums) {
          if (v.ec) {
            ++failed;
            CHECK_MESSAGE(clear_error(v.ec), v.ec.message());
            mismatches += v.ec == kvlink::errc::checksum_mismatch ? 1 : 0;
          } else {
            ++intact;
            CHECK(bad == 0);  // never a corrupted success
          }
        } else if (!v.ec && bad > 0) {
          ++silent_corruption;
        }
      }
    }
    MESSAGE(op_name(op) << " with checksums: " << intact << " intact, " << failed << " failed ("
                        << mismatches << " checksum_mismatch); without: " << silent_corruption
                        << " of 12 corrupted silently");
    CHECK(mismatches > 0);
    CHECK(silent_corruption > 0);
  }
}
