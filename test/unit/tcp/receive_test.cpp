// tcp/receive.hpp: a payload received into scattered pieces over a real
// loopback connection, with the receive low-water mark raised to what is
// still to come: every byte in its piece whatever the sender's pace, the
// last bytes (fewer than the mark) end the receive, the mark back at 1
// after; the end of the stream and a destination that is not memory end it
// with their errors.
#include <kvlink/tcp/receive.hpp>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "../../support/test_support.hpp"
#include <asio/connect.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/write.hpp>
#include <doctest/doctest.h>
#include <sys/mman.h>

namespace {

using namespace std::chrono_literals;
using asio::ip::tcp;

int rcvlowat(tcp::socket& s) {
  int v = 0;
  socklen_t len = sizeof v;
  ::getsockopt(s.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &v, &len);
  return v;
}

}  // namespace

TEST_CASE("low_water_mark sets SO_RCVLOWAT, at most a quarter of the receive buffer") {
  kvlink_test::loopback_connection p;
  p.accepted.set_option(asio::socket_base::receive_buffer_size(64 << 10));  // the kernel doubles it
  kvlink::tcp::low_water_mark m;
  CHECK(m.get() == 1);
  CHECK(rcvlowat(p.accepted) == 1);
  m.set(p.accepted, 5000);
  CHECK(m.get() == 5000);
  CHECK(rcvlowat(p.accepted) == 5000);
  m.set(p.accepted, 0);  // at least 1
  CHECK(m.get() == 1);
  CHECK(rcvlowat(p.accepted) == 1);
  m.set(p.accepted, 1 << 20);  // 128 KiB of buffer: 32 KiB
  CHECK(m.get() == 32 << 10);
  CHECK(rcvlowat(p.accepted) == 32 << 10);
}

TEST_CASE("receive_all: scattered pieces from a slow sender, all in place, the mark back at 1") {
  kvlink_test::loopback_connection p;
  // 24 pieces of 1 B .. 70,000 B, 600 KiB in all: more than the mark.
  std::vector<std::vector<std::byte>> pieces;
  std::size_t total = 0;
  for (std::size_t i = 0; i < 24; ++i) {
    const std::size_t n = i == 0 ? 1 : (i * 7919) % 70000 + 1;
    pieces.emplace_back(n);
    total += n;
  }
  std::vector<std::byte> sent(total);
  kvlink_test::fill_pattern(sent.data(), total, 17, 0);
  std::vector<asio::mutable_buffer> bufs;
  for (auto& v : pieces) bufs.emplace_back(v.data(), v.size());
  kvlink::tcp::low_water_mark mark;
  bool done = false;
  std::error_code result;
  kvlink::tcp::receive_all(p.accepted, bufs, 0, total, mark, [&](std::error_code ec) {
    result = ec;
    done = true;
  });
  // Chunks of 1,000 .. 50,000 bytes with pauses; the connection stays open
  // after the last one (the receive must end on its own).
  std::thread sender([&] {
    std::size_t at = 0;
    for (std::size_t k = 1; at < total; ++k) {
      const std::size_t n = std::min(total - at, (k * 12347) % 49000 + 1000);
      asio::write(p.connected, asio::buffer(sent.data() + at, n));
      at += n;
      std::this_thread::sleep_for(1ms);
    }
  });
  const bool ended = kvlink_test::run_until(
      p.io, [&] { return done; }, 20s);
  sender.join();
  REQUIRE(ended);
  CHECK(!result);
  std::size_t at = 0;
  bool same = true;
  for (const auto& v : pieces) {
    same = same && std::memcmp(v.data(), sent.data() + at, v.size()) == 0;
    at += v.size();
  }
  CHECK(same);
  CHECK(mark.get() == 1);
  CHECK(rcvlowat(p.accepted) == 1);
}

TEST_CASE("receive_all: the end of the stream ends it with eof") {
  kvlink_test::loopback_connection p;
  std::vector<std::byte> dst(5000);
  std::vector<asio::mutable_buffer> bufs{asio::buffer(dst)};
  kvlink::tcp::low_water_mark mark;
  bool done = false;
  std::error_code result;
  kvlink::tcp::receive_all(p.accepted, bufs, 0, dst.size(), mark, [&](std::error_code ec) {
    result = ec;
    done = true;
  });
  std::vector<std::byte> some(1000, std::byte{7});
  asio::write(p.connected, asio::buffer(some));
  p.connected.close();
  REQUIRE(kvlink_test::run_until(
      p.io, [&] { return done; }, 20s));
  CHECK(result == asio::error::eof);
  CHECK(dst[999] == std::byte{7});
}

TEST_CASE("receive_all: a destination that is not memory ends it with EFAULT") {
  kvlink_test::loopback_connection p;
  const std::size_t page = 4096;
  void* m = ::mmap(nullptr, page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(m != MAP_FAILED);
  std::vector<std::byte> first(100);
  std::vector<asio::mutable_buffer> bufs{asio::buffer(first), asio::mutable_buffer(m, page)};
  kvlink::tcp::low_water_mark mark;
  bool done = false;
  std::error_code result;
  kvlink::tcp::receive_all(p.accepted, bufs, 0, 100 + page, mark, [&](std::error_code ec) {
    result = ec;
    done = true;
  });
  std::vector<std::byte> data(100 + page, std::byte{3});
  asio::write(p.connected, asio::buffer(data));
  REQUIRE(kvlink_test::run_until(
      p.io, [&] { return done; }, 20s));
  CHECK(result == asio::error::fault);  // EFAULT
  ::munmap(m, page);
}
