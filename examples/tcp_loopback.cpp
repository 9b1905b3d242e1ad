// Two kvlink engines over TCP on loopback, in one process: register memory,
// connect (handshake), WRITE a buffer into the peer, READ it back, verify.
//
//   build/examples/tcp_loopback
#include <kvlink/kvlink.hpp>

#include <cstring>
#include <numeric>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <fmt/format.h>

asio::awaitable<int> demo(kvlink::tcp_engine& initiator, const std::string& target_address,
                          std::vector<std::byte>& src, std::vector<std::byte>& back) {
  // The handshake tells us the target's segments.
  kvlink::peer peer = co_await initiator.async_connect(target_address, asio::use_awaitable);

  // WRITE all of `src` into the target's segment 0 at offset 0...
  const std::vector<kvlink::transfer_request> write{
      {kvlink::opcode::write, src.data(), peer.segment(0), 0, src.size()}};
  kvlink::transfer_result w = co_await initiator.async_submit_transfer(write, asio::use_awaitable);

  // ... and READ it back into another local buffer, in two requests.
  const std::size_t half = back.size() / 2;
  const std::vector<kvlink::transfer_request> read{
      {kvlink::opcode::read, back.data(), peer.segment(0), 0, half},
      {kvlink::opcode::read, back.data() + half, peer.segment(0), half, back.size() - half}};
  kvlink::transfer_result r = co_await initiator.async_submit_transfer(read, asio::use_awaitable);

  const bool same = std::memcmp(src.data(), back.data(), src.size()) == 0;
  fmt::print(
      "wrote {} B in {} slices over {} lanes ({:.2f} GB/s), read {} B back ({:.2f} GB/s): {}\n",
      w.bytes, w.slices, w.lanes, w.gb_per_s(), r.bytes, r.gb_per_s(),
      same ? "verified" : "MISMATCH");
  co_return same ? 0 : 1;
}

int main() {
  asio::io_context io;
  kvlink::tcp_engine target{io.get_executor(), kvlink::config{.listen = "127.0.0.1:0"}};
  kvlink::tcp_engine initiator{io.get_executor(), kvlink::config{.listen = "127.0.0.1:0"}};

  constexpr std::size_t size = 64u << 20;  // 64 MiB
  std::vector<std::byte> remote(size), src(size), back(size);
  for (std::size_t i = 0; i < size; ++i) src[i] = static_cast<std::byte>(i * 131 + 7);

  // Peers may WRITE into and READ from the target's buffer; the initiator's
  // buffers are registered as the local side of its transfers.
  target.register_segment(remote.data(), remote.size(), kvlink::access::remote_read_write);
  initiator.register_segment(src.data(), src.size(), kvlink::access::none);
  initiator.register_segment(back.data(), back.size(), kvlink::access::none);

  int status = 2;
  asio::co_spawn(io, demo(initiator, target.local_address(), src, back),
                 [&](std::exception_ptr e, int rc) {
                   if (e) {
                     try {
                       std::rethrow_exception(e);
                     } catch (const std::exception& ex) {
                       fmt::print(stderr, "error: {}\n", ex.what());
                     }
                   }
                   status = e ? 1 : rc;
                   io.stop();
                 });
  io.run();
  return status;
}
