// The conformance suite: what every transport must keep, checked through
// the engine on two engines in one process. Each test binary includes this
// file once and defines the transport under test (conformance.cpp: fake,
// tcp or shm, chosen at run time; test/rdma/vm/conformance_rdma.cpp runs it
// between soft-RoCE devices inside a VM).
//
// The contract (engine.hpp): complete means visible; the handler runs
// exactly once, never inside the initiating call, and never while a slice
// may still touch the caller's memory (after errors, cancellation and
// deadlines too); nothing touches a segment's memory after its
// unregistration completed; bounds and access are checked; a batch moves
// all or fails; notifications arrive after the data; a dead peer fails
// transfers promptly.
#pragma once

#include <kvlink/engine.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "test_support.hpp"
#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/io_context.hpp>
#include <doctest/doctest.h>

namespace conformance {

// Defined by each binary.
kvlink::config base_config();      // config.transports names the transport under test
std::string expected_transport();  // what peer.transport() must say
std::uint64_t max_transfer();      // largest single transfer the suite moves

using namespace std::chrono_literals;
using kvlink::opcode;
using kvlink_test::fill_pattern;
using kvlink_test::is_pattern;

constexpr std::size_t canary = 4096;
constexpr std::byte canary_byte{0xA5};

// Memory with canaries on both sides of the part that is registered.
struct arena {
  explicit arena(std::size_t n) : bytes(canary + n + canary, canary_byte), size(n) {}
  std::byte* data() { return bytes.data() + canary; }
  bool canaries_intact() const {
    return std::all_of(bytes.begin(), bytes.begin() + canary,
                       [](std::byte b) { return b == canary_byte; }) &&
           std::all_of(bytes.end() - canary, bytes.end(),
                       [](std::byte b) { return b == canary_byte; });
  }
  std::vector<std::byte> snapshot() { return {data(), data() + size}; }
  std::vector<std::byte> bytes;
  std::size_t size;
};

struct outcome {
  std::error_code ec;
  kvlink::transfer_result result;
  int calls = 0;
  bool returned = false;  // the initiating call had returned when the handler ran
};

// Two engines: a target with a read-write segment (and a read-only and a
// write-only one), an initiator with one local segment. Each has its own
// io_context, both driven from the test's thread, so the target can be
// paused (a peer that stops answering) without threads in the test.
struct rig {
  asio::io_context io;   // the initiator's
  asio::io_context tio;  // the target's
  bool target_paused = false;
  bool initiator_paused = false;
  std::size_t size;
  arena remote, readonly, writeonly, local;
  std::optional<kvlink::engine> target;
  kvlink::engine initiator;
  kvlink::segment_id remote_seg, readonly_seg, writeonly_seg, local_seg;
  kvlink::peer peer;

  explicit rig(std::size_t n = 4u << 20)
      : size(n),
        remote(n),
        readonly(64u << 10),
        writeonly(64u << 10),
        local(n),
        target(std::in_place, tio.get_executor(), base_config()),
        initiator(io.get_executor(), base_config()) {
    remote_seg = target->register_segment(remote.data(), n, kvlink::access::remote_read_write);
    readonly_seg =
        target->register_segment(readonly.data(), readonly.size, kvlink::access::remote_read);
    writeonly_seg =
        target->register_segment(writeonly.data(), writeonly.size, kvlink::access::remote_write);
    local_seg = initiator.register_segment(local.data(), n, kvlink::access::remote_read_write);
    std::optional<std::pair<std::error_code, kvlink::peer>> c;
    initiator.async_connect(target->local_address(),
                            [&](std::error_code ec, kvlink::peer p) { c.emplace(ec, p); });
    REQUIRE(until([&] { return c.has_value(); }));
    REQUIRE_MESSAGE(!c->first, c->first.message());
    peer = c->second;
    REQUIRE(peer.transport() == expected_transport());
    REQUIRE(peer.segments().size() == 3);
  }

  // Runs both sides' handlers (the target's unless paused) for a moment.
  void drive() {
    std::size_t n = 0;
    if (!initiator_paused) n += io.poll();
    if (!target_paused) n += tio.poll();
    if (n > 0) return;
    if (!initiator_paused) {
      io.run_one_for(std::chrono::microseconds(200));
    } else if (!target_paused) {
      tio.run_one_for(std::chrono::microseconds(200));
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Drives until `done` or the (generous) limit: a hang fails the test.
  template <class Pred>
  bool until(Pred done, std::chrono::seconds limit = 120s) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (!done()) {
      if (std::chrono::steady_clock::now() > end) return false;
      drive();
    }
    return true;
  }

  // Drives for a while (late handlers would show up here).
  void settle(std::chrono::milliseconds d = 50ms) {
    const auto end = std::chrono::steady_clock::now() + d;
    while (std::chrono::steady_clock::now() < end) drive();
  }

  // Starts a transfer; the outcome fills in when its handler runs (counted,
  // so a second call is caught).
  std::shared_ptr<outcome> start(const std::vector<kvlink::transfer_request>& reqs,
                                 kvlink::transfer_options opts = {}) {
    auto out = std::make_shared<outcome>();
    initiator.async_submit_transfer(reqs, std::move(opts),
                                    [out](std::error_code ec, kvlink::transfer_result r) {
                                      CHECK(out->returned);  // never inside the initiating call
                                      out->ec = ec;
                                      out->result = r;
                                      ++out->calls;
                                    });
    out->returned = true;
    return out;
  }

  outcome run(const std::vector<kvlink::transfer_request>& reqs,
              kvlink::transfer_options opts = {}) {
    auto out = start(reqs, std::move(opts));
    REQUIRE(until([&] { return out->calls > 0; }));
    settle();
    CHECK(out->calls == 1);
    return *out;
  }

  kvlink::transfer_request req(opcode op, std::uint64_t local_off, std::uint64_t remote_off,
                               std::uint64_t len, kvlink::segment_id seg = {}) {
    return {op, local.data() + local_off, peer.segment(seg.valid() ? seg : remote_seg), remote_off,
            len};
  }

  // Many 1 MiB requests covering the first `bytes` of both sides: a transfer
  // long enough to be interrupted.
  std::vector<kvlink::transfer_request> big(opcode op, std::uint64_t bytes) {
    std::vector<kvlink::transfer_request> reqs;
    for (std::uint64_t off = 0; off < bytes; off += 1u << 20) {
      reqs.push_back(req(op, off, off, std::min<std::uint64_t>(1u << 20, bytes - off)));
    }
    return reqs;
  }
};

inline std::size_t big_size() { return static_cast<std::size_t>(max_transfer()); }

}  // namespace conformance

TEST_CASE("conformance: complete means visible, 1 B to the largest size at odd offsets") {
  using namespace conformance;
  rig r{big_size() + 8192};
  std::mt19937_64 g{7};
  std::vector<std::uint64_t> sizes{1, 7, 4095, 65537, (1u << 20) + 3};
  if (max_transfer() >= (16u << 20)) sizes.push_back(16u << 20);
  sizes.push_back(max_transfer());
  std::uint64_t seed = 1;
  for (const auto len : sizes) {
    for (const auto op : {opcode::write, opcode::read}) {
      CAPTURE(len);
      CAPTURE(kvlink::to_string(op));
      const auto slack = r.size - len;
      const auto loff = g() % (slack + 1), roff = g() % (slack + 1);
      auto& src = op == opcode::write ? r.local : r.remote;
      auto& dst = op == opcode::write ? r.remote : r.local;
      const auto soff = op == opcode::write ? loff : roff;
      const auto doff = op == opcode::write ? roff : loff;
      fill_pattern(src.data() + soff, len, seed, soff);
      const auto before = dst.snapshot();
      // Checked inside the handler: the bytes are there when it runs.
      bool visible = false;
      auto out = std::make_shared<outcome>();
      r.initiator.async_submit_transfer(std::vector{r.req(op, loff, roff, len)},
                                        [&, out](std::error_code ec, kvlink::transfer_result res) {
                                          out->ec = ec;
                                          out->result = res;
                                          ++out->calls;
                                          visible = is_pattern(dst.data() + doff, len, seed, soff);
                                        });
      REQUIRE(r.until([&] { return out->calls > 0; }));
      r.settle(5ms);
      REQUIRE_MESSAGE(!out->ec, out->ec.message());
      CHECK(out->calls == 1);
      CHECK(visible);
      CHECK(out->result.bytes == len);
      CHECK(std::memcmp(dst.data(), before.data(), doff) == 0);  // nothing around it changed
      CHECK(std::memcmp(dst.data() + doff + len, before.data() + doff + len, r.size - doff - len) ==
            0);
      CHECK(dst.canaries_intact());
      ++seed;
    }
  }
}

TEST_CASE("conformance: batches of 1 to 1000 scattered requests, all bytes checked") {
  using namespace conformance;
  rig r{4u << 20};
  std::mt19937_64 g{11};
  for (const std::size_t n : {1u, 10u, 100u, 1000u}) {
    for (const auto op : {opcode::write, opcode::read}) {
      CAPTURE(n);
      CAPTURE(kvlink::to_string(op));
      fill_pattern(r.local.data(), r.size, g(), 0);
      fill_pattern(r.remote.data(), r.size, g(), 0);
      const std::size_t slot = r.size / n;
      std::vector<std::size_t> perm(n);
      for (std::size_t i = 0; i < n; ++i) perm[i] = i;
      std::shuffle(perm.begin(), perm.end(), g);
      std::vector<kvlink::transfer_request> reqs;
      std::uint64_t bytes = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const auto len = 1 + g() % slot;
        reqs.push_back(r.req(op, i * slot, perm[i] * slot, len));
        bytes += len;
      }
      const auto local_before = r.local.snapshot();
      const auto remote_before = r.remote.snapshot();
      auto out = r.run(reqs);
      REQUIRE_MESSAGE(!out.ec, out.ec.message());
      CHECK(out.result.bytes == bytes);
      CHECK(out.result.requests == n);
      for (std::size_t i = 0; i < n; ++i) {
        const auto& q = reqs[i];
        const auto loff =
            static_cast<std::size_t>(static_cast<std::byte*>(q.local) - r.local.data());
        if (op == opcode::write) {
          REQUIRE(std::memcmp(r.remote.data() + q.remote_offset, local_before.data() + loff,
                              q.length) == 0);
        } else {
          REQUIRE(std::memcmp(r.local.data() + loff, remote_before.data() + q.remote_offset,
                              q.length) == 0);
        }
      }
    }
  }
}

TEST_CASE("conformance: bounds and access are checked and a bad batch moves nothing") {
  using namespace conformance;
  rig r{1u << 20};
  fill_pattern(r.remote.data(), r.size, 3, 0);
  fill_pattern(r.readonly.data(), r.readonly.size, 4, 0);
  fill_pattern(r.writeonly.data(), r.writeonly.size, 5, 0);
  fill_pattern(r.local.data(), r.size, 6, 0);
  const auto remote_before = r.remote.snapshot();
  const auto ro_before = r.readonly.snapshot();
  const auto wo_before = r.writeonly.snapshot();
  const auto local_before = r.local.snapshot();
  std::vector<std::byte> unregistered(4096);
  struct bad_case {
    const char* what;
    std::vector<kvlink::transfer_request> reqs;
    kvlink::errc expect;
  };
  const std::vector<bad_case> cases{
      {"unregistered local memory",
       {{opcode::read, unregistered.data(), r.peer.segment(r.remote_seg), 0, 4096}},
       kvlink::errc::not_registered},
      {"local range past its segment",
       {r.req(opcode::write, r.size - 10, 0, 20)},
       kvlink::errc::out_of_bounds},
      {"remote range past its segment",
       {r.req(opcode::write, 0, r.size - 10, 20)},
       kvlink::errc::out_of_bounds},
      {"remote offset overflow",
       {r.req(opcode::read, 0, ~0ull - 4, 10)},
       kvlink::errc::out_of_bounds},
      {"WRITE into a read-only segment",
       {r.req(opcode::write, 0, 0, 4096, r.readonly_seg)},
       kvlink::errc::access_denied},
      {"READ from a write-only segment",
       {r.req(opcode::read, 0, 0, 4096, r.writeonly_seg)},
       kvlink::errc::access_denied},
      {"zero length", {r.req(opcode::write, 0, 0, 0)}, kvlink::errc::invalid_argument},
      {"unknown peer",
       {{opcode::write, r.local.data(), kvlink::remote_segment{kvlink::peer_id{999}, r.remote_seg},
         0, 1}},
       kvlink::errc::unknown_peer},
      {"one bad request fails the whole batch",
       {r.req(opcode::write, 0, 0, 65536), r.req(opcode::write, 0, r.size, 1)},
       kvlink::errc::out_of_bounds},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    auto out = r.run(c.reqs);
    CHECK(out.ec == c.expect);
    CHECK(out.result.bytes == 0);
  }
  // A segment id the initiator does not know is left to the target, which
  // refuses it; the path survives.
  auto unknown = r.run({{opcode::write, r.local.data(),
                         r.peer.segment(kvlink::segment_id{r.remote_seg.value() + 1000}), 0, 16}});
  CHECK(unknown.ec == kvlink::errc::not_registered);
  // Many small requests to it (over TCP: pieces sharing frames) are refused
  // all the same, and move nothing either way.
  for (const auto op : {opcode::write, opcode::read}) {
    CAPTURE(kvlink::to_string(op));
    std::vector<kvlink::transfer_request> many;
    for (std::size_t i = 0; i < 100; ++i) {
      many.push_back({op, r.local.data() + i * 64,
                      r.peer.segment(kvlink::segment_id{r.remote_seg.value() + 1000}), i * 128,
                      64});
    }
    auto refused = r.run(many);
    CHECK(refused.ec == kvlink::errc::not_registered);
    CHECK(refused.result.bytes == 0);
  }
  auto ok = r.run({r.req(opcode::read, 0, 0, 4096)});
  CHECK_FALSE(ok.ec);
  CHECK(r.peer.connected());
  fill_pattern(r.local.data(), r.size, 6, 0);  // undo the good READ
  CHECK(r.remote.snapshot() == remote_before);
  CHECK(r.readonly.snapshot() == ro_before);
  CHECK(r.writeonly.snapshot() == wo_before);
  CHECK(r.local.snapshot() == local_before);
  CHECK(r.remote.canaries_intact());
  CHECK(r.local.canaries_intact());
}

TEST_CASE("conformance: the handler is the fence after cancellation, deadline and errors") {
  using namespace conformance;
  const std::uint64_t bytes = std::min<std::uint64_t>(conformance::max_transfer(), 32u << 20);
  for (const auto op : {opcode::write, opcode::read}) {
    for (const std::string how : {"cancel", "deadline", "error"}) {
      CAPTURE(kvlink::to_string(op));
      CAPTURE(how);
      rig r{static_cast<std::size_t>(bytes)};
      fill_pattern(r.local.data(), bytes, 1, 0);
      fill_pattern(r.remote.data(), bytes, 2, 0);
      // "error": the last 4 KiB of local memory are the bad request's, so
      // that no two requests write the same bytes (a READ's destination).
      auto reqs = r.big(op, how == "error" ? bytes - 4096 : bytes);
      kvlink::transfer_options opts;
      if (how == "deadline") opts.deadline = 1ms;
      if (how == "error") {
        // A request the initiator cannot check (an id it does not know) in
        // the middle: the target refuses it while the others move.
        reqs.insert(reqs.begin() + static_cast<std::ptrdiff_t>(reqs.size() / 2),
                    {op, r.local.data() + bytes - 4096,
                     r.peer.segment(kvlink::segment_id{r.remote_seg.value() + 1000}), 0, 4096});
      }
      asio::cancellation_signal sig;
      auto out = std::make_shared<outcome>();
      r.initiator.async_submit_transfer(
          reqs, opts,
          asio::bind_cancellation_slot(sig.slot(),
                                       [out](std::error_code ec, kvlink::transfer_result res) {
                                         out->ec = ec;
                                         out->result = res;
                                         ++out->calls;
                                       }));
      if (how == "cancel") {
        // At once: the first slices are in flight when the stop arrives.
        r.drive();
        sig.emit(asio::cancellation_type::terminal);
      }
      REQUIRE(r.until([&] { return out->calls > 0; }));
      // Whatever happened, nothing touches either buffer after the handler.
      const auto local_after = r.local.snapshot();
      const auto remote_after = r.remote.snapshot();
      r.settle(100ms);
      CHECK(out->calls == 1);
      CHECK(r.local.snapshot() == local_after);
      CHECK(r.remote.snapshot() == remote_after);
      if (how == "cancel" && out->ec) CHECK(out->ec == kvlink::errc::cancelled);
      if (how == "deadline" && out->ec) CHECK(out->ec == kvlink::errc::deadline_exceeded);
      if (how == "error") CHECK(out->ec == kvlink::errc::not_registered);
      // The engine still works afterwards (the peer may have been fenced).
      if (r.peer.connected()) {
        auto again = r.run({r.req(op, 0, 0, 4096)});
        CHECK_FALSE(again.ec);
      }
    }
  }
}

TEST_CASE("conformance: a peer that stops answering: deadline, fence, then our memory is ours") {
  using namespace conformance;
  const std::uint64_t bytes = std::min<std::uint64_t>(conformance::max_transfer(), 32u << 20);
  for (const auto op : {opcode::write, opcode::read}) {
    CAPTURE(kvlink::to_string(op));
    rig r{static_cast<std::size_t>(bytes)};
    fill_pattern(r.local.data(), bytes, 51, 0);
    fill_pattern(r.remote.data(), bytes, 52, 0);
    kvlink::transfer_options opts;
    opts.deadline = 300ms;
    auto out = r.start(r.big(op, bytes), opts);
    r.target_paused = true;  // the peer hangs with slices in flight
    r.drive();
    REQUIRE(r.until([&] { return out->calls > 0; }, 30s));
    const auto local_after = r.local.snapshot();
    // The peer wakes up: whatever it still had of ours must not reach our memory.
    r.target_paused = false;
    r.settle(200ms);
    CHECK(out->calls == 1);
    CHECK(r.local.snapshot() == local_after);
    CHECK(r.local.canaries_intact());
    if (out->ec) CHECK(out->ec == kvlink::errc::deadline_exceeded);
  }
}

TEST_CASE("conformance: notifications arrive after the data they follow") {
  using namespace conformance;
  rig r{2u << 20};
  fill_pattern(r.local.data(), r.size, 21, 0);
  std::optional<kvlink::notification> got;
  bool data_there = false;
  r.target->async_receive_notification([&](std::error_code ec, kvlink::notification n) {
    REQUIRE_FALSE(ec);
    data_there = is_pattern(r.remote.data(), r.size, 21, 0);
    got = std::move(n);
  });
  kvlink::transfer_options opts;
  opts.notify = kvlink::notification{"blocks-ready", "payload"};
  auto out = r.run(r.big(opcode::write, r.size), opts);
  REQUIRE_MESSAGE(!out.ec, out.ec.message());
  REQUIRE(r.until([&] { return got.has_value(); }));
  CHECK(got->id == "blocks-ready");
  CHECK(got->payload == "payload");
  CHECK(got->from == r.initiator.instance());
  CHECK(data_there);
}

TEST_CASE("conformance: a peer that dies mid-transfer fails it promptly, once, fenced") {
  using namespace conformance;
  const std::uint64_t bytes = std::min<std::uint64_t>(conformance::max_transfer(), 32u << 20);
  for (const auto op : {opcode::write, opcode::read}) {
    CAPTURE(kvlink::to_string(op));
    rig r{static_cast<std::size_t>(bytes)};
    fill_pattern(r.local.data(), bytes, 1, 0);
    auto out = r.start(r.big(op, bytes));
    r.settle(2ms);
    const bool finished_first = out->calls > 0;
    r.target.reset();  // the peer goes away
    const auto t0 = std::chrono::steady_clock::now();
    REQUIRE(r.until([&] { return out->calls > 0; }, 30s));
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);
    const auto local_after = r.local.snapshot();
    r.settle(100ms);
    CHECK(out->calls == 1);
    CHECK(r.local.snapshot() == local_after);
    if (!finished_first && out->ec) {
      CHECK((out->ec == kvlink::errc::peer_closed || out->ec == kvlink::errc::cancelled));
    }
    REQUIRE(r.until([&] { return !r.peer.connected(); }, 30s));
    auto later = r.run({r.req(op, 0, 0, 16)});
    CHECK(later.ec == kvlink::errc::peer_closed);
  }
}

TEST_CASE("conformance: unregistering the target's segment waits for accesses in flight") {
  using namespace conformance;
  const std::uint64_t bytes = std::min<std::uint64_t>(conformance::max_transfer(), 32u << 20);
  rig r{static_cast<std::size_t>(bytes)};
  fill_pattern(r.local.data(), bytes, 31, 0);
  auto out = r.start(r.big(opcode::write, bytes));
  r.settle(2ms);
  std::optional<std::error_code> unreg;
  std::vector<std::byte> at_unregister;
  r.target->async_unregister_segment(r.remote_seg, [&](std::error_code ec) {
    unreg = ec;
    at_unregister = r.remote.snapshot();  // the memory may be freed from here on
  });
  REQUIRE(r.until([&] { return unreg.has_value() && out->calls > 0; }));
  CHECK_FALSE(*unreg);
  r.settle(100ms);
  CHECK(out->calls == 1);
  CHECK(r.remote.snapshot() == at_unregister);  // nothing wrote after it completed
  if (out->ec) CHECK(out->ec == kvlink::errc::not_registered);
}

TEST_CASE("conformance: unregistering a segment a stalled peer holds completes in bounded time") {
  using namespace conformance;
  const std::uint64_t bytes = std::min<std::uint64_t>(conformance::max_transfer(), 32u << 20);
  rig r{static_cast<std::size_t>(bytes)};
  fill_pattern(r.remote.data(), bytes, 61, 0);
  auto out = r.start(r.big(opcode::read, bytes));
  // Our requests go out, then our side stops reading: the target's answers
  // back up, holding its memory.
  for (int i = 0; i < 4; ++i) r.io.poll();
  r.initiator_paused = true;
  r.settle(50ms);
  std::optional<std::error_code> unreg;
  const auto t0 = std::chrono::steady_clock::now();
  r.target->async_unregister_segment(r.remote_seg, [&](std::error_code ec) { unreg = ec; });
  REQUIRE(r.until([&] { return unreg.has_value(); }, 30s));
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK_FALSE(*unreg);
  CHECK(waited < base_config().fence_timeout + 2s);
  r.initiator_paused = false;
  REQUIRE(r.until([&] { return out->calls > 0; }, 30s));
  r.settle(100ms);
  CHECK(out->calls == 1);
}

TEST_CASE("conformance: unregistering the initiator's buffer waits for a READ filling it") {
  using namespace conformance;
  const std::uint64_t bytes = std::min<std::uint64_t>(conformance::max_transfer(), 32u << 20);
  rig r{static_cast<std::size_t>(bytes)};
  fill_pattern(r.remote.data(), bytes, 41, 0);
  // The target stalls with the READ in flight: it cannot finish while the
  // unregistration is asked for.
  r.target_paused = true;
  auto out = r.start(r.big(opcode::read, bytes));
  r.settle(5ms);
  std::optional<std::error_code> unreg;
  std::vector<std::byte> at_unregister;
  r.initiator.async_unregister_segment(r.local_seg, [&](std::error_code ec) {
    unreg = ec;
    at_unregister = r.local.snapshot();  // the memory may be freed from here on
  });
  r.settle(50ms);
  r.target_paused = false;
  REQUIRE(r.until([&] { return unreg.has_value() && out->calls > 0; }));
  CHECK_FALSE(*unreg);
  r.settle(100ms);
  CHECK(out->calls == 1);
  CHECK(r.local.snapshot() == at_unregister);  // nothing wrote after it completed
}
