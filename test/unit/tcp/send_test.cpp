// tcp/send.hpp: a gathered write of more buffers than one sendmsg takes,
// over a real loopback connection: every byte arrives in order whatever the
// reader's pace (a full send buffer waits for the socket, then goes on),
// empty buffers are skipped, the handler runs once and never inside the
// call; a buffer the kernel cannot read ends it with EFAULT, a peer gone
// with its error (no SIGPIPE).
#include <kvlink/tcp/send.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "../../support/test_support.hpp"
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <doctest/doctest.h>
#include <sys/mman.h>

namespace {

using namespace std::chrono_literals;

using connection = kvlink_test::loopback_connection;

// send_all of `bufs` from `at` on to the accepting end, run to its end.
std::error_code send_and_wait(connection& p, std::vector<asio::const_buffer>& bufs,
                              std::size_t at = 0) {
  kvlink::tcp::gather_state state;
  bool done = false;
  std::error_code result;
  kvlink::tcp::send_all(p.connected, bufs, at, state, [&](std::error_code ec) {
    result = ec;
    done = true;
  });
  REQUIRE(kvlink_test::run_until(
      p.io, [&] { return done; }, 20s));
  return result;
}

}  // namespace

TEST_CASE("send_all: 3,000 buffers to a slow reader, every byte in order, done once and later") {
  connection p;
  // Small buffers on both sides: the sender's socket fills many times.
  p.connected.set_option(asio::socket_base::send_buffer_size(32 << 10));
  p.accepted.set_option(asio::socket_base::receive_buffer_size(32 << 10));
  // 3,000 pieces of 0 .. 9,000 bytes (every 7th empty), about 13 MB: three
  // calls' worth of buffers (IOV_MAX is 1,024) many times over.
  std::vector<std::byte> data(14 << 20);
  kvlink_test::fill_pattern(data.data(), data.size(), 29, 0);
  std::vector<asio::const_buffer> bufs;
  std::vector<std::byte> expected;
  std::size_t at = 0;
  for (std::size_t i = 0; i < 3000; ++i) {
    const std::size_t n = i % 7 == 0 ? 0 : (i * 7919) % 9001;
    at = (at + 4096 + 13) % (data.size() - 9001);  // scattered over the source
    bufs.emplace_back(data.data() + at, n);
    expected.insert(expected.end(), data.begin() + static_cast<std::ptrdiff_t>(at),
                    data.begin() + static_cast<std::ptrdiff_t>(at + n));
  }
  kvlink::tcp::gather_state state;
  int calls = 0;
  std::error_code result;
  kvlink::tcp::send_all(p.connected, bufs, 0, state, [&](std::error_code ec) {
    result = ec;
    ++calls;
  });
  CHECK(calls == 0);  // never inside the call
  std::vector<std::byte> got(expected.size());
  std::thread reader([&] {
    std::size_t have = 0;
    for (std::size_t k = 1; have < got.size(); ++k) {
      const std::size_t n = std::min(got.size() - have, (k * 12347) % 60000 + 1000);
      have += asio::read(p.accepted, asio::buffer(got.data() + have, n));
      if (k % 16 == 0) std::this_thread::sleep_for(1ms);
    }
  });
  const bool ended = kvlink_test::run_until(
      p.io, [&] { return calls > 0; }, 30s);
  reader.join();
  REQUIRE(ended);
  CHECK(!result);
  CHECK(calls == 1);
  CHECK(std::memcmp(got.data(), expected.data(), expected.size()) == 0);
  // Nothing more was written than the buffers held.
  p.connected.close();
  std::byte extra{};
  std::error_code eof;
  asio::read(p.accepted, asio::buffer(&extra, 1), eof);
  CHECK(eof == asio::error::eof);
}

TEST_CASE("send_all: from an index, the first buffer partly written before") {
  connection p;
  std::vector<std::byte> a(1000, std::byte{1}), b(3000, std::byte{2});
  std::vector<asio::const_buffer> bufs{asio::buffer(a), asio::buffer(b) + 500};
  CHECK(!send_and_wait(p, bufs, 1));
  std::vector<std::byte> got(2500);
  asio::read(p.accepted, asio::buffer(got));
  CHECK(std::all_of(got.begin(), got.end(), [](std::byte x) { return x == std::byte{2}; }));
}

TEST_CASE("send_all: a buffer that is not memory ends it with EFAULT") {
  connection p;
  const std::size_t page = 4096;
  void* m = ::mmap(nullptr, page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(m != MAP_FAILED);
  std::vector<std::byte> first(100, std::byte{5});
  std::vector<asio::const_buffer> bufs{asio::buffer(first), asio::const_buffer(m, page)};
  CHECK(send_and_wait(p, bufs) == asio::error::fault);  // EFAULT
  ::munmap(m, page);
}

TEST_CASE("send_all: a peer that is gone ends it with its error, no SIGPIPE") {
  connection p;
  p.accepted.close();
  std::vector<std::byte> data(8 << 20, std::byte{9});
  std::vector<asio::const_buffer> bufs;
  for (std::size_t i = 0; i < 2048; ++i) bufs.emplace_back(data.data() + i * 4096, 4096);
  const auto result = send_and_wait(p, bufs);
  CAPTURE(result.message());
  CHECK((result == asio::error::broken_pipe || result == asio::error::connection_reset));
}
