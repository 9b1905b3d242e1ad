// Device memory through the engine (engine/core.hpp registration,
// engine/transfer.hpp staging, the transports' target side): two engines
// in one process with config.device set to the runtime under test
// (KVLINK_TEST_DEVICE: emulated here, cuda in the tests labelled cuda) and
// the transport KVLINK_TEST_TRANSPORT (tcp by default; shm). Every pair of
// kinds (host/device on either side), READ and WRITE, odd offsets and
// lengths from 1 B to 64 MiB, a batch mixing kinds, bytes checked by copying
// back through the device's copy engine; cancellation and deadlines with
// copies in flight; unregistration while staged copies run; registration
// errors.
#include "../../support/device_memory.hpp"

#include <kvlink/engine.hpp>
#include <kvlink/shm/transport.hpp>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../../support/test_support.hpp"
#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/io_context.hpp>
#include <doctest/doctest.h>

namespace {

using namespace std::chrono_literals;
using kvlink::opcode;
using kvlink_test::run_until;
using kvlink_test::test_memory;

std::string transport_under_test() {
  const char* v = std::getenv("KVLINK_TEST_TRANSPORT");
  return v && *v ? v : "tcp";
}

std::shared_ptr<kvlink::device_runtime> runtime() {
  static const auto rt = kvlink_test::require_device_or_skip();
  return rt;
}

kvlink::config device_config() {
  kvlink::config c;
  c.transports = transport_under_test();
  c.device.runtime = kvlink_test::device_under_test();
  c.fence_timeout = 2s;
  c.connect_timeout = 5s;
  return c;
}

std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  kvlink_test::fill_pattern(v.data(), n, seed, 0);
  return v;
}

struct device_outcome {
  std::error_code ec;
  kvlink::transfer_result result;
  bool done = false;
};

// A target with one segment and an initiator with one, each of either kind.
struct device_rig {
  asio::io_context io;
  test_memory remote, local;
  std::optional<kvlink::engine> target;
  std::optional<kvlink::engine> initiator;
  kvlink::segment_id remote_seg, local_seg;
  kvlink::peer peer;

  device_rig(std::size_t n, bool remote_device, bool local_device,
             kvlink::config cfg = device_config())
      : remote(n, remote_device, runtime(), 0),
        local(n, local_device, runtime(),
              remote_device && local_device && runtime()->device_count() > 1 ? 1 : 0) {
    target.emplace(io.get_executor(), cfg);
    initiator.emplace(io.get_executor(), cfg);
    remote_seg = target->register_segment(remote.data(), n, kvlink::access::remote_read_write);
    local_seg = initiator->register_segment(local.data(), n, kvlink::access::remote_read_write);
    std::optional<std::error_code> c;
    initiator->async_connect(target->local_address(), [&](std::error_code ec, kvlink::peer p) {
      c = ec;
      peer = p;
    });
    REQUIRE(run_until(io, [&] { return c.has_value(); }));
    REQUIRE_MESSAGE(!*c, c->message());
    REQUIRE(peer.transport() == transport_under_test());
  }

  kvlink::remote_segment seg() const { return {peer.id(), remote_seg}; }

  device_outcome run(std::vector<kvlink::transfer_request> reqs) {
    device_outcome o;
    initiator->async_submit_transfer(reqs, [&](std::error_code ec, kvlink::transfer_result r) {
      o.ec = ec;
      o.result = r;
      o.done = true;
    });
    CHECK_FALSE(o.done);  // never inside the initiating call
    REQUIRE(run_until(io, [&] { return o.done; }));
    return o;
  }
};

std::string kind_name(bool device) { return device ? "device" : "host"; }

}  // namespace

TEST_CASE("device memory: every pair of kinds, READ and WRITE, odd offsets and lengths") {
  auto rt = runtime();
  // Every length is copied and compared on both sides: under ThreadSanitizer
  // (several times slower per byte; large lengths add no interleavings) up
  // to 3 MiB (several slices over TCP).
  constexpr bool cut = kvlink_test::under_thread_sanitizer;
  const std::size_t n = cut ? 8u << 20 : 72u << 20;
  std::vector<std::size_t> lengths{1, 4097, std::size_t{1} << 20, (std::size_t{3} << 20) + 13};
  if (!cut) lengths.push_back(std::size_t{64} << 20);
  for (const bool remote_device : {false, true}) {
    for (const bool local_device : {false, true}) {
      if (!remote_device && !local_device) continue;  // host to host: the other tests
      CAPTURE(kind_name(remote_device));
      CAPTURE(kind_name(local_device));
      device_rig r{n, remote_device, local_device};
      std::uint64_t seed = 11;
      for (const std::size_t len : lengths) {
        CAPTURE(len);
        const std::size_t loff = 7 + len % 4093;
        const std::size_t roff = 1 + len % 8191;
        // WRITE: local -> remote.
        const auto w = random_bytes(len, ++seed);
        r.local.write(loff, w.data(), len);
        auto o = r.run({{opcode::write, r.local.data() + loff, r.seg(), roff, len}});
        REQUIRE_MESSAGE(!o.ec, o.ec.message());
        CHECK(o.result.bytes == len);
        CHECK(r.remote.read(roff, len) == w);
        // READ: remote -> local, into another place.
        const auto rd = random_bytes(len, ++seed);
        r.remote.write(roff, rd.data(), len);
        const std::size_t loff2 = loff + 1;
        o = r.run({{opcode::read, r.local.data() + loff2, r.seg(), roff, len}});
        REQUIRE_MESSAGE(!o.ec, o.ec.message());
        CHECK(o.result.bytes == len);
        CHECK(r.local.read(loff2, len) == rd);
      }
    }
  }
}

TEST_CASE("device memory: one batch mixing host and device on both sides") {
  auto rt = runtime();
  const std::size_t n = 8u << 20;
  device_rig dd{n, true, true};
  // A host segment on each side of the same engines.
  std::vector<std::byte> host_remote(n), host_local(n);
  const auto hr =
      dd.target->register_segment(host_remote.data(), n, kvlink::access::remote_read_write);
  (void)dd.initiator->register_segment(host_local.data(), n, kvlink::access::remote_read_write);
  REQUIRE(run_until(dd.io, [&] { return dd.peer.segments().size() == 2; }));
  const kvlink::remote_segment hseg{dd.peer.id(), hr};
  const auto a = random_bytes(1 << 20, 1), b = random_bytes(3 << 20, 2);
  const auto c = random_bytes(100001, 3), d = random_bytes(5 << 20, 4);
  dd.local.write(0, a.data(), a.size());
  dd.local.write(2 << 20, b.data(), b.size());
  std::memcpy(host_local.data(), c.data(), c.size());
  // Apart from where b goes ([5, 3 MiB + 5)): a READ and a WRITE of the
  // same bytes in one batch may run in either order.
  const auto rd = random_bytes(3 << 20, 5);
  std::memcpy(host_remote.data() + (4 << 20), rd.data(), rd.size());
  dd.remote.write(3 << 20, d.data(), d.size() - (2 << 20));
  auto o = dd.run({
      {opcode::write, dd.local.data(), dd.seg(), 17, a.size()},                  // dev -> dev
      {opcode::write, dd.local.data() + (2 << 20), hseg, 5, b.size()},           // dev -> host
      {opcode::write, host_local.data(), dd.seg(), 2u << 20, c.size()},          // host -> dev
      {opcode::read, host_local.data() + (1 << 20), hseg, 4u << 20, 3u << 20},   // host <- host
      {opcode::read, dd.local.data() + (6 << 20), dd.seg(), 3u << 20, 2u << 20}  // dev <- dev
  });
  REQUIRE_MESSAGE(!o.ec, o.ec.message());
  CHECK(dd.remote.read(17, a.size()) == a);
  CHECK(std::memcmp(host_remote.data() + 5, b.data(), b.size()) == 0);
  CHECK(dd.remote.read(2u << 20, c.size()) == c);
  CHECK(std::memcmp(host_local.data() + (1 << 20), rd.data(), 3u << 20) == 0);
  CHECK(dd.local.read(6u << 20, 2u << 20) ==
        std::vector<std::byte>(d.begin(), d.begin() + (2 << 20)));
}

TEST_CASE("device memory: many small scattered pieces into and out of a device segment") {
  // Over TCP they would share vector frames, which a device segment refuses
  // (device_error): the lane sends them again one frame each, staged, and
  // no longer vectors to that segment.
  auto rt = runtime();
  const std::size_t n = 4u << 20;
  const std::size_t piece = 4096;
  const std::size_t count = 300;
  device_rig r{n, true, false};
  std::vector<std::size_t> slots(count);
  for (std::size_t i = 0; i < count; ++i) slots[i] = (i * 97) % count;
  const auto w = random_bytes(count * piece, 21);
  r.local.write(0, w.data(), w.size());
  std::vector<kvlink::transfer_request> writes, reads;
  for (std::size_t i = 0; i < count; ++i) {
    writes.push_back({opcode::write, r.local.data() + i * piece, r.seg(), slots[i] * 2 * piece + 3,
                      piece - (i % 3)});
    reads.push_back({opcode::read, r.local.data() + (2u << 20) + i * piece, r.seg(),
                     slots[i] * 2 * piece + 3, piece - (i % 3)});
  }
  for (int round = 0; round < 2; ++round) {  // the second after the lane stopped vectoring
    CAPTURE(round);
    auto o = r.run(writes);
    REQUIRE_MESSAGE(!o.ec, o.ec.message());
    for (std::size_t i = 0; i < count; ++i) {
      const auto len = piece - (i % 3);
      REQUIRE(r.remote.read(slots[i] * 2 * piece + 3, len) ==
              std::vector<std::byte>(w.begin() + static_cast<std::ptrdiff_t>(i * piece),
                                     w.begin() + static_cast<std::ptrdiff_t>(i * piece + len)));
    }
    o = r.run(reads);
    REQUIRE_MESSAGE(!o.ec, o.ec.message());
    for (std::size_t i = 0; i < count; ++i) {
      const auto len = piece - (i % 3);
      REQUIRE(r.local.read((2u << 20) + i * piece, len) ==
              std::vector<std::byte>(w.begin() + static_cast<std::ptrdiff_t>(i * piece),
                                     w.begin() + static_cast<std::ptrdiff_t>(i * piece + len)));
    }
  }
}

TEST_CASE("device memory: slices of device requests: shm plans large ones, TCP the configured") {
  auto rt = runtime();
  const std::size_t n = 24u << 20;
  device_rig r{n, true, true};
  const auto w = random_bytes(n, 11);
  r.local.write(0, w.data(), n);
  // 24 MiB in one request: the configured slice size is 1 MiB; shm's device
  // streams take up to 64 MiB a slice (one slice), staging over TCP uses the
  // configured size (24 slices or more).
  auto o = r.run({{opcode::write, r.local.data(), r.seg(), 0, n}});
  REQUIRE_MESSAGE(!o.ec, o.ec.message());
  CHECK(r.remote.snapshot() == w);
  if (transport_under_test() == "shm") {
    CHECK(o.result.slices == 1);
  } else {
    CHECK(o.result.slices >= 24);
  }
  // A batch with host memory on our side keeps the configured size.
  std::vector<std::byte> host(n);
  std::memcpy(host.data(), w.data(), n);
  (void)r.initiator->register_segment(host.data(), n, kvlink::access::remote_read_write);
  auto h = r.run({{opcode::read, r.local.data(), r.seg(), 0, 4u << 20},
                  {opcode::write, host.data(), r.seg(), 8u << 20, 4u << 20}});
  REQUIRE_MESSAGE(!h.ec, h.ec.message());
  CHECK(h.result.slices >= 8);
}

TEST_CASE("device memory: cancellation and deadlines with copies in flight keep the fence") {
  auto rt = runtime();
  // Over shm a device request is cut into slices of up to 64 MiB (one copy
  // each): more than two of them, so that a stop finds some unstarted.
  const std::size_t n = transport_under_test() == "shm"
                            ? 2 * kvlink::shm::device_copy_run + (1u << 20)
                            : std::size_t{64} << 20;
  for (const bool remote_device : {false, true}) {
    CAPTURE(kind_name(remote_device));
    device_rig r{n, remote_device, true};
    const auto w = random_bytes(n, 9);
    r.local.write(0, w.data(), n);
    const auto before = r.remote.snapshot();
    // Cancelled at once: fails with cancelled, and nothing changes after the handler.
    asio::cancellation_signal sig;
    device_outcome o;
    r.initiator->async_submit_transfer(
        std::vector<kvlink::transfer_request>{{opcode::write, r.local.data(), r.seg(), 0, n}},
        asio::bind_cancellation_slot(sig.slot(),
                                     [&](std::error_code ec, kvlink::transfer_result res) {
                                       o.ec = ec;
                                       o.result = res;
                                       o.done = true;
                                     }));
    // Let some chunks get under way, then cancel.
    for (int i = 0; i < 20 && !o.done; ++i) r.io.poll_one();
    sig.emit(asio::cancellation_type::terminal);
    REQUIRE(run_until(r.io, [&] { return o.done; }));
    const auto at_handler = r.remote.snapshot();
    // shm may queue a device-to-device transfer whole (a window of hundreds
    // of MiB on a GPU, where 64 MiB take 45 us): it may be done before the
    // cancellation is seen, and then it says so with every byte in place.
    const bool whole = transport_under_test() == "shm" && remote_device &&
                       n <= kvlink::shm::device_copy_window(rt.get(), true);
    if (whole && !o.ec) {
      CHECK(o.result.bytes == n);
      CHECK(at_handler == w);
    } else {
      CHECK(o.ec == kvlink::errc::cancelled);
      if (!whole) CHECK(o.result.bytes < n);  // some bytes were left unmoved
    }
    r.io.run_for(300ms);
    CHECK(r.remote.snapshot() == at_handler);  // no byte arrived after the handler
    (void)before;
    // A deadline too short for 64 MiB: deadline_exceeded, then nothing moves.
    device_outcome d;
    kvlink::transfer_options opts;
    opts.deadline = 1ms;
    r.initiator->async_submit_transfer(
        std::vector<kvlink::transfer_request>{{opcode::read, r.local.data(), r.seg(), 0, n}}, opts,
        [&](std::error_code ec, kvlink::transfer_result res) {
          d.ec = ec;
          d.result = res;
          d.done = true;
        });
    REQUIRE(run_until(r.io, [&] { return d.done; }));
    if (d.ec) {
      CHECK(d.ec == kvlink::errc::deadline_exceeded);
      const auto local_at_handler = r.local.snapshot();
      r.io.run_for(300ms);
      CHECK(r.local.snapshot() == local_at_handler);
    }
    // The engines still move bytes afterwards: fresh ones (the READ may
    // have landed slices before its deadline, over shm most of all, so the
    // local bytes are no longer `w`).
    const auto src = random_bytes(1u << 20, 10);
    r.local.write(3, src.data(), src.size());
    auto ok = r.run({{opcode::write, r.local.data() + 3, r.seg(), 5, 1u << 20}});
    REQUIRE_MESSAGE(!ok.ec, ok.ec.message());
    CHECK(r.remote.read(5, 1u << 20) == src);
  }
}

TEST_CASE("device memory: unregistering a local device segment while staged copies run") {
  auto rt = runtime();
  const std::size_t n = 64u << 20;
  device_rig r{n, false, true};
  device_outcome o;
  r.initiator->async_submit_transfer(
      std::vector<kvlink::transfer_request>{{opcode::write, r.local.data(), r.seg(), 0, n}},
      [&](std::error_code ec, kvlink::transfer_result res) {
        o.ec = ec;
        o.result = res;
        o.done = true;
      });
  for (int i = 0; i < 10; ++i) r.io.poll_one();
  std::optional<std::error_code> un;
  r.initiator->async_unregister_segment(r.local_seg, [&](std::error_code ec) { un = ec; });
  REQUIRE(run_until(r.io, [&] { return un.has_value() && o.done; }));
  CHECK_FALSE(*un);
  // The transfer either finished before the unregistration or stopped with not_registered.
  if (o.ec) CHECK(o.ec == kvlink::errc::not_registered);
  const auto at_end = r.remote.snapshot();
  r.io.run_for(200ms);
  CHECK(r.remote.snapshot() == at_end);
}

TEST_CASE("device memory: registration is classified and checked") {
  auto rt = runtime();
  asio::io_context io;
  kvlink::engine eng{io.get_executor(), device_config()};
  kvlink::device_buffer buf{rt, 0, 1u << 20};
  // Inside one allocation: fine.
  std::error_code ec;
  const auto id =
      eng.register_segment(buf.data() + 4096, 8192, kvlink::access::remote_read_write, ec);
  CHECK_FALSE(ec);
  CHECK(id.valid());
  // Past its end: refused with the reason.
  try {
    (void)eng.register_segment(buf.data() + 4096, 1u << 20, kvlink::access::remote_read_write);
    FAIL("registration past the allocation was accepted");
  } catch (const std::system_error& e) {
    CHECK(e.code() == kvlink::errc::invalid_argument);
    CHECK(std::string(e.what()).find("runs past the end of its device allocation") !=
          std::string::npos);
  }
  // An engine without a device runtime: device memory stated is refused.
  kvlink::config none = device_config();
  none.device.runtime = "none";
  kvlink::engine plain{io.get_executor(), none};
  try {
    (void)plain.register_segment(buf.data(), 4096, kvlink::access::remote_read_write,
                                 kvlink::memory_desc{kvlink::memory_kind::device, 0});
    FAIL("device memory was accepted by an engine without a device runtime");
  } catch (const std::system_error& e) {
    CHECK(e.code() == kvlink::errc::invalid_argument);
    CHECK(std::string(e.what()).find("no device runtime") != std::string::npos);
  }
  // A runtime this program lacks is named.
  kvlink::config bogus = device_config();
  bogus.device.runtime = "nosuch";
  try {
    kvlink::engine e{io.get_executor(), bogus};
    FAIL("an unknown device runtime was accepted");
  } catch (const std::system_error& e) {
    CHECK(std::string(e.what()).find("nosuch") != std::string::npos);
  }
}
