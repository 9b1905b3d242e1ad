// The TCP target side on its own (tcp/lane_server.hpp): frames written by
// hand to a lane_server over loopback, its answers read back. Device
// segments of the emulated device go through a staging pool: a WRITE is
// acknowledged only once its bytes are in device memory, a corrupted
// payload is answered and never copied, a target without staging answers
// device_error and keeps serving, and a connection closed while copies run
// gives back every pin and chunk once they finished.
#include <kvlink/tcp/lane_server.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "../../support/device_memory.hpp"
#include "../../support/test_support.hpp"
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/strand.hpp>
#include <doctest/doctest.h>

namespace {

using namespace std::chrono_literals;
using kvlink::tcp::frame_header;
using kvlink::tcp::frame_type;

struct counting_host final : kvlink::transport_host {
  std::atomic<int> pins{0};
  void slice_done(kvlink::detail::transfer_op*, std::uint64_t, std::error_code) override {}
  bool stopping(const kvlink::detail::transfer_op*) const noexcept override { return false; }
  bool pin(kvlink::segment_id) override {
    ++pins;
    return true;
  }
  void unpin(kvlink::segment_id) override { --pins; }
};

std::shared_ptr<kvlink::device_runtime> runtime() {
  static const auto rt = kvlink_test::require_device_or_skip();
  return rt;
}

constexpr std::uint64_t chunk = 64u << 10;

// A lane_server on a thread of its own, a client socket to it, a device
// segment and a host segment.
struct server_rig {
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  kvlink::segment_registry registry;
  counting_host host;
  std::shared_ptr<kvlink::staging_pool> staging;
  kvlink_test::test_memory device;
  std::vector<std::byte> host_memory;
  kvlink::segment_id device_seg, host_seg;
  asio::ip::tcp::socket client{io};
  std::shared_ptr<kvlink::tcp::lane_server> server;
  std::thread runner;

  explicit server_rig(bool with_staging, std::size_t n = 1u << 20)
      : device(n, true, runtime(), 0), host_memory(n) {
    if (with_staging) {
      staging =
          std::make_shared<kvlink::staging_pool>(runtime(), io.get_executor(), chunk, 4 * chunk);
    }
    std::error_code ec;
    device_seg = registry.add(device.data(), n, kvlink::access::remote_read_write, ec,
                              kvlink::memory_desc{kvlink::memory_kind::device, 0});
    REQUIRE_FALSE(ec);
    host_seg = registry.add(host_memory.data(), n, kvlink::access::remote_read_write, ec);
    REQUIRE_FALSE(ec);
    asio::ip::tcp::acceptor acceptor(io, {asio::ip::address_v4::loopback(), 0});
    client.connect(acceptor.local_endpoint());
    asio::ip::tcp::socket accepted(asio::make_strand(io));
    acceptor.accept(accepted);
    server = std::make_shared<kvlink::tcp::lane_server>(std::move(accepted), registry, host,
                                                        64u << 20, nullptr, staging);
    asio::post(server->get_executor(), [s = server] { s->start(); });
    runner = std::thread([this] { io.run(); });
  }

  ~server_rig() {
    std::error_code ignored;
    client.close(ignored);
    asio::post(server->get_executor(), [s = server] { s->close(); });
    // Copies still running would write to device memory about to be freed.
    (void)wait_for([&] { return host.pins == 0; });
    work.reset();
    io.stop();
    runner.join();
  }

  void send(frame_header h, const std::byte* payload = nullptr) {
    const auto b = kvlink::tcp::encode(h);
    asio::write(client, asio::buffer(b));
    if (payload != nullptr) asio::write(client, asio::buffer(payload, h.length));
  }

  frame_header receive(std::vector<std::byte>* payload = nullptr) {
    kvlink::tcp::frame_bytes b{};
    asio::read(client, asio::buffer(b));
    frame_header h;
    REQUIRE_FALSE(kvlink::tcp::decode(b.data(), h));
    if (h.length > 0) {
      REQUIRE(payload != nullptr);
      payload->resize(h.length);
      asio::read(client, asio::buffer(*payload));
    }
    return h;
  }

  // Waits (on this thread) for `done`, with the server running on its own.
  template <class Pred>
  bool wait_for(Pred done, std::chrono::seconds limit = 30s) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!done()) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  }
};

frame_header write_frame(kvlink::segment_id seg, std::uint64_t tag, std::uint64_t offset,
                         const std::vector<std::byte>& payload, bool checksum) {
  frame_header h;
  h.type = frame_type::write_request;
  h.tag = tag;
  h.segment = seg.value();
  h.offset = offset;
  h.length = payload.size();
  if (checksum) {
    h.flags = kvlink::tcp::frame_flag_checksum;
    h.checksum = kvlink::crc32c(payload.data(), payload.size());
  }
  return h;
}

frame_header read_frame(kvlink::segment_id seg, std::uint64_t tag, std::uint64_t offset,
                        std::uint64_t length, bool checksum) {
  frame_header h;
  h.type = frame_type::read_request;
  h.tag = tag;
  h.segment = seg.value();
  h.offset = offset;
  h.length = length;
  if (checksum) h.flags = kvlink::tcp::frame_flag_checksum;
  return h;
}

std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  kvlink_test::fill_pattern(v.data(), n, seed, 0);
  return v;
}

}  // namespace

TEST_CASE("lane_server: a WRITE into device memory is acknowledged once its bytes are there") {
  server_rig r{true};
  // Back to back, without waiting: chunk-sized, odd, and longer than a chunk
  // (pinned memory of its own), with and without checksums.
  const std::vector<std::pair<std::uint64_t, std::size_t>> frames{
      {3, 1}, {100, chunk}, {70000, 4097}, {200000, 3 * chunk + 5}, {400001, chunk - 1}};
  std::vector<std::vector<std::byte>> sent;
  std::uint64_t tag = 1;
  for (const auto& [offset, len] : frames) {
    sent.push_back(pattern(len, tag));
    r.send(write_frame(r.device_seg, tag, offset, sent.back(), tag % 2 == 0), sent.back().data());
    ++tag;
  }
  // Acknowledged in order; at each acknowledgement the bytes are in device
  // memory.
  for (std::size_t i = 0; i < frames.size(); ++i) {
    const auto h = r.receive();
    CHECK(h.type == frame_type::write_ack);
    CHECK(h.tag == i + 1);
    CHECK(h.status == 0);
    CHECK(r.device.read(frames[i].first, frames[i].second) == sent[i]);
  }
  // READs of the same bytes come back from device memory, with checksums.
  for (std::size_t i = 0; i < frames.size(); ++i) {
    r.send(read_frame(r.device_seg, 100 + i, frames[i].first, frames[i].second, i % 2 == 1));
  }
  for (std::size_t i = 0; i < frames.size(); ++i) {
    std::vector<std::byte> got;
    const auto h = r.receive(&got);
    CHECK(h.type == frame_type::read_response);
    CHECK(h.tag == 100 + i);
    CHECK(h.status == 0);
    CHECK(got == sent[i]);
    if (i % 2 == 1) {
      CHECK((h.flags & kvlink::tcp::frame_flag_checksum) != 0);
      CHECK(h.checksum == kvlink::crc32c(got.data(), got.size()));
    }
  }
  CHECK(r.wait_for([&] { return r.host.pins == 0; }));
}

TEST_CASE("lane_server: a device WRITE with a bad checksum is answered and never copied") {
  server_rig r{true};
  const auto before = r.device.read(0, 8192);
  const auto payload = pattern(8192, 7);
  auto h = write_frame(r.device_seg, 1, 0, payload, true);
  h.checksum ^= 1;
  r.send(h, payload.data());
  const auto ack = r.receive();
  CHECK(ack.tag == 1);
  CHECK(kvlink::tcp::status_to_error(ack.status) == kvlink::errc::checksum_mismatch);
  CHECK(r.device.read(0, 8192) == before);
  // The connection goes on.
  r.send(write_frame(r.device_seg, 2, 0, payload, true), payload.data());
  CHECK(r.receive().status == 0);
  CHECK(r.device.read(0, 8192) == payload);
}

TEST_CASE("lane_server: a device segment without staging is answered with device_error") {
  server_rig r{false};
  const auto payload = pattern(4096, 3);
  r.send(write_frame(r.device_seg, 1, 0, payload, false), payload.data());
  r.send(read_frame(r.device_seg, 2, 0, 4096, false));
  // Host memory is still served on the same connection.
  r.send(write_frame(r.host_seg, 3, 0, payload, true), payload.data());
  auto h = r.receive();
  CHECK(h.tag == 1);
  CHECK(kvlink::tcp::status_to_error(h.status) == kvlink::errc::device_error);
  h = r.receive();
  CHECK(h.tag == 2);
  CHECK(h.length == 0);
  CHECK(kvlink::tcp::status_to_error(h.status) == kvlink::errc::device_error);
  h = r.receive();
  CHECK(h.tag == 3);
  CHECK(h.status == 0);
  CHECK(std::memcmp(r.host_memory.data(), payload.data(), payload.size()) == 0);
  CHECK(r.wait_for([&] { return r.host.pins == 0; }));
}

TEST_CASE("lane_server: closing with device copies in flight gives back pins and chunks after") {
  server_rig r{true, 8u << 20};
  const auto payload = pattern(chunk, 5);
  // WRITEs whose acknowledgements are never read, then READs whose
  // responses (holding chunks) are never read either.
  for (std::uint64_t i = 0; i < 64; ++i) {
    r.send(write_frame(r.device_seg, i + 1, i * chunk, payload, false), payload.data());
  }
  for (std::uint64_t i = 0; i < 4; ++i) {
    r.send(read_frame(r.device_seg, 1000 + i, i * chunk, chunk, true));
  }
  std::atomic<bool> closed{false};
  asio::post(r.server->get_executor(), [s = r.server, &closed] {
    s->close();
    closed = true;
  });
  CHECK(r.wait_for([&] { return closed && r.host.pins == 0; }));
  // Every chunk is back in the pool.
  std::atomic<std::size_t> got{0};
  std::vector<std::byte*> chunks(r.staging->chunks_per_device());
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    r.staging->acquire(0, r.io.get_executor(), [&, i](std::byte* c) {
      chunks[i] = c;
      ++got;
    });
  }
  CHECK(r.wait_for([&] { return got == chunks.size(); }));
  for (auto* c : chunks) {
    CHECK(c != nullptr);
    r.staging->release(0, c);
  }
}

TEST_CASE("lane_server: frames sent in one stream land exactly through the read-ahead") {
  // Small frames come several to a receive (their headers and payloads read
  // ahead together); a large one switches to reading headers alone. One
  // write of the whole mix: small host WRITEs (with and without checksums),
  // a refused one (out of bounds: its payload drained from the read-ahead),
  // a READ, a device WRITE (staged), a bad checksum, a 1 MiB WRITE, then
  // small ones again.
  server_rig r{true, 4u << 20};
  struct sent_frame {
    frame_header h;
    std::vector<std::byte> payload;
    std::uint16_t status = 0;  // expected
  };
  std::vector<sent_frame> frames;
  std::uint64_t tag = 1;
  const auto add_write = [&](kvlink::segment_id seg, std::uint64_t offset, std::size_t len,
                             bool checksum, kvlink::errc expect = kvlink::errc{}) {
    auto p = pattern(len, tag);
    auto h = write_frame(seg, tag, offset, p, checksum);
    frames.push_back({h, std::move(p), static_cast<std::uint16_t>(expect)});
    ++tag;
  };
  for (std::uint64_t i = 0; i < 40; ++i) add_write(r.host_seg, i * 8192 + 7, 4096, i % 3 == 0);
  add_write(r.host_seg, (4u << 20) - 100, 4096, false, kvlink::errc::out_of_bounds);
  frames.push_back({read_frame(r.host_seg, tag++, 8192 + 7, 4096, true), {}, 0});
  add_write(r.device_seg, 12345, 5000, true);
  {
    auto p = pattern(3000, tag);
    auto h = write_frame(r.host_seg, tag, 1u << 20, p, true);
    h.checksum ^= 1;  // corrupted in flight
    frames.push_back(
        {h, std::move(p), static_cast<std::uint16_t>(kvlink::errc::checksum_mismatch)});
    ++tag;
  }
  add_write(r.host_seg, 2u << 20, 1u << 20, false);
  for (std::uint64_t i = 0; i < 10; ++i) add_write(r.host_seg, 600000 + i * 4096, 4096, false);

  std::vector<std::byte> stream;
  for (const auto& f : frames) {
    const auto b = kvlink::tcp::encode(f.h);
    stream.insert(stream.end(), b.begin(), b.end());
    stream.insert(stream.end(), f.payload.begin(), f.payload.end());
  }
  asio::write(r.client, asio::buffer(stream));
  for (const auto& f : frames) {
    CAPTURE(f.h.tag);
    std::vector<std::byte> got;
    const auto h = r.receive(&got);
    CHECK(h.tag == f.h.tag);
    if (f.h.type == frame_type::read_request) {
      CHECK(h.status == 0);
      CHECK(got == pattern(4096, 2));  // the second frame's bytes
      continue;
    }
    CHECK(h.type == frame_type::write_ack);
    CHECK(h.status == f.status);
  }
  // Every accepted WRITE's bytes are where it said; the refused ones wrote nothing.
  for (const auto& f : frames) {
    if (f.h.type != frame_type::write_request) continue;
    CAPTURE(f.h.tag);
    if (f.h.segment == r.device_seg.value()) {
      CHECK(r.device.read(f.h.offset, f.h.length) == f.payload);
      continue;
    }
    if (f.status != 0 && f.status != static_cast<std::uint16_t>(kvlink::errc::checksum_mismatch)) {
      continue;
    }
    const bool same =
        std::memcmp(r.host_memory.data() + f.h.offset, f.payload.data(), f.payload.size()) == 0;
    // A payload with a bad checksum is placed, then answered as corrupt.
    CHECK(same);
  }
  CHECK(r.wait_for([&] { return r.host.pins == 0; }));
}

namespace {

// A vector frame as bytes: header, piece table, then (WRITE) the pieces'
// payloads back to back, taken from `source` at each piece's offset.
std::vector<std::byte> vector_frame(frame_type type, kvlink::segment_id seg, std::uint64_t tag,
                                    const std::vector<kvlink::tcp::frame_piece>& pieces,
                                    const std::vector<std::byte>& source, bool checksum,
                                    std::uint32_t crc_flip = 0) {
  frame_header h;
  h.type = type;
  h.tag = tag;
  h.segment = seg.value();
  h.offset = pieces.size();
  std::vector<std::byte> payload;
  for (const auto& p : pieces) {
    h.length += p.length;
    if (type == frame_type::write_vector) {
      payload.insert(payload.end(), source.begin() + static_cast<std::ptrdiff_t>(p.offset),
                     source.begin() + static_cast<std::ptrdiff_t>(p.offset + p.length));
    }
  }
  if (checksum) {
    h.flags = kvlink::tcp::frame_flag_checksum;
    if (type == frame_type::write_vector) {
      h.checksum = kvlink::crc32c(payload.data(), payload.size()) ^ crc_flip;
    }
  }
  std::vector<std::byte> out(kvlink::tcp::frame_header_size +
                             pieces.size() * kvlink::tcp::piece_entry_size);
  kvlink::tcp::encode(h, out.data());
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    kvlink::tcp::encode(
        pieces[i], out.data() + kvlink::tcp::frame_header_size + i * kvlink::tcp::piece_entry_size);
  }
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

// The bytes of `pieces` of `memory`, back to back.
std::vector<std::byte> gathered(const std::byte* memory,
                                const std::vector<kvlink::tcp::frame_piece>& pieces) {
  std::vector<std::byte> out;
  for (const auto& p : pieces)
    out.insert(out.end(), memory + p.offset, memory + p.offset + p.length);
  return out;
}

}  // namespace

TEST_CASE("lane_server: vector frames place every piece and READ them back in one answer") {
  server_rig r{true, 4u << 20};
  const auto source = pattern(4u << 20, 99);
  // Small and mixed pieces (read ahead with the header), 64 pieces of 4 KiB
  // (256 KiB: most of it received straight into the pieces), a piece of
  // one byte; singles in between; with and without checksums.
  std::vector<std::vector<kvlink::tcp::frame_piece>> vectors{
      {{7, 1}, {4096, 4096}, {20000, 5000}, {70001, 65536}},
      {},
      {{3u << 20, 1}},
  };
  for (std::uint64_t i = 0; i < 64; ++i)
    vectors[1].push_back({((i * 37) % 64) * 8192 + 200000, 4096});
  std::vector<std::byte> stream;
  std::uint64_t tag = 1;
  for (std::size_t v = 0; v < vectors.size(); ++v) {
    const auto f =
        vector_frame(frame_type::write_vector, r.host_seg, tag++, vectors[v], source, v != 1);
    stream.insert(stream.end(), f.begin(), f.end());
    const auto single = pattern(100, tag);
    const auto b =
        kvlink::tcp::encode(write_frame(r.host_seg, tag++, (3u << 20) + 4096, single, true));
    stream.insert(stream.end(), b.begin(), b.end());
    stream.insert(stream.end(), single.begin(), single.end());
  }
  asio::write(r.client, asio::buffer(stream));
  for (std::uint64_t t = 1; t < tag; ++t) {
    const auto h = r.receive();
    CHECK(h.tag == t);
    CHECK(h.type == frame_type::write_ack);
    CHECK(h.status == 0);
  }
  for (const auto& pieces : vectors) {
    for (const auto& p : pieces) {
      CAPTURE(p.offset);
      CHECK(std::memcmp(r.host_memory.data() + p.offset, source.data() + p.offset, p.length) == 0);
    }
  }
  // READ the same pieces: one answer each, the pieces back to back.
  for (std::size_t v = 0; v < vectors.size(); ++v) {
    const auto f =
        vector_frame(frame_type::read_vector, r.host_seg, 100 + v, vectors[v], source, v != 0);
    asio::write(r.client, asio::buffer(f));
  }
  for (std::size_t v = 0; v < vectors.size(); ++v) {
    std::vector<std::byte> got;
    const auto h = r.receive(&got);
    CHECK(h.tag == 100 + v);
    CHECK(h.type == frame_type::read_response);
    CHECK(h.status == 0);
    CHECK(got == gathered(source.data(), vectors[v]));
    if (v != 0) {
      CHECK((h.flags & kvlink::tcp::frame_flag_checksum) != 0);
      CHECK(h.checksum == kvlink::crc32c(got.data(), got.size()));
    }
  }
  CHECK(r.wait_for([&] { return r.host.pins == 0; }));
}

TEST_CASE("lane_server: a vector frame with a piece that fails is refused whole, nothing touched") {
  server_rig r{true, 1u << 20};
  const auto source = pattern(2u << 20, 5);  // past the segment: the bad piece has bytes
  const std::vector<kvlink::tcp::frame_piece> bad{{0, 4096}, {8192, 4096}, {(1u << 20) - 10, 20}};
  const std::vector<kvlink::tcp::frame_piece> good{{0, 4096}, {8192, 4096}};
  const auto before = r.host_memory;
  // Out of bounds (WRITE drained, READ answered without payload), on a
  // device segment (staging serves frames one at a time), a bad checksum
  // (placed, never acknowledged as written); the connection goes on.
  auto f = vector_frame(frame_type::write_vector, r.host_seg, 1, bad, source, true);
  asio::write(r.client, asio::buffer(f));
  f = vector_frame(frame_type::read_vector, r.host_seg, 2, bad, source, false);
  asio::write(r.client, asio::buffer(f));
  f = vector_frame(frame_type::write_vector, r.device_seg, 3, good, source, false);
  asio::write(r.client, asio::buffer(f));
  f = vector_frame(frame_type::read_vector, r.device_seg, 4, good, source, false);
  asio::write(r.client, asio::buffer(f));
  auto h = r.receive();
  CHECK(h.tag == 1);
  CHECK(kvlink::tcp::status_to_error(h.status) == kvlink::errc::out_of_bounds);
  h = r.receive();
  CHECK(h.tag == 2);
  CHECK(h.length == 0);
  CHECK(kvlink::tcp::status_to_error(h.status) == kvlink::errc::out_of_bounds);
  h = r.receive();
  CHECK(h.tag == 3);
  CHECK(kvlink::tcp::status_to_error(h.status) == kvlink::errc::device_error);
  h = r.receive();
  CHECK(h.tag == 4);
  CHECK(kvlink::tcp::status_to_error(h.status) == kvlink::errc::device_error);
  CHECK(r.host_memory == before);
  f = vector_frame(frame_type::write_vector, r.host_seg, 5, good, source, true, 1);
  asio::write(r.client, asio::buffer(f));
  h = r.receive();
  CHECK(h.tag == 5);
  CHECK(kvlink::tcp::status_to_error(h.status) == kvlink::errc::checksum_mismatch);
  f = vector_frame(frame_type::write_vector, r.host_seg, 6, good, source, true);
  asio::write(r.client, asio::buffer(f));
  h = r.receive();
  CHECK(h.tag == 6);
  CHECK(h.status == 0);
  CHECK(gathered(r.host_memory.data(), good) == gathered(source.data(), good));
  CHECK(r.wait_for([&] { return r.host.pins == 0; }));
}

TEST_CASE("lane_server: a piece table that does not add up closes the connection") {
  const auto source = pattern(1u << 20, 6);
  const std::vector<kvlink::tcp::frame_piece> pieces{{0, 4096}, {8192, 4096}};
  for (const int how : {0, 1, 2}) {
    CAPTURE(how);
    server_rig r{false, 1u << 20};
    auto f = vector_frame(frame_type::read_vector, r.host_seg, 1, pieces, source, false);
    if (how == 0) {
      kvlink::tcp::encode(
          kvlink::tcp::frame_piece{8192, 4095},
          f.data() + kvlink::tcp::frame_header_size + kvlink::tcp::piece_entry_size);
    } else if (how == 1) {
      kvlink::tcp::encode(
          kvlink::tcp::frame_piece{8192, 0},
          f.data() + kvlink::tcp::frame_header_size + kvlink::tcp::piece_entry_size);
    } else {
      kvlink::tcp::byte_order::put_le<std::uint64_t>(  // too many pieces
          f.data() + 24, kvlink::tcp::max_vector_pieces + 1);
    }
    asio::write(r.client, asio::buffer(f));
    std::array<std::byte, 1> one{};
    std::error_code ec;
    asio::read(r.client, asio::buffer(one), ec);
    CHECK(ec == asio::error::eof);
    CHECK(r.wait_for([&] { return r.host.pins == 0; }));
  }
}
