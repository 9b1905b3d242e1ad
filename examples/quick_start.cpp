// The quick start: two kvlink engines in one process, as two serving
// processes would use them: register memory, connect (handshake), WRITE a
// buffer into the peer, READ it back, verify.
//
// kvlink::engine is the one to copy: it chooses its transport per peer at
// the handshake from every transport this program has (config.transports
// empty): same-host shared memory (shm) for a peer on this host, as here,
// TCP for one on another host, and RDMA as well with <kvlink/rdma.hpp>.
// (kvlink::tcp_engine, in examples/tcp_loopback.cpp, defaults to TCP only.)
//
//   build/examples/quick_start
#include <kvlink/kvlink.hpp>

#include <cstring>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <fmt/format.h>

asio::awaitable<int> demo(kvlink::engine& initiator, std::string target_address,
                          std::vector<std::byte>& src, std::vector<std::byte>& back) {
  kvlink::peer peer = co_await initiator.async_connect(target_address, asio::use_awaitable);
  fmt::print("transport: {} ({})\n", peer.transport(), peer.transport_reason());

  const std::vector<kvlink::transfer_request> write{
      {kvlink::opcode::write, src.data(), peer.segment(0), 0, src.size()}};
  kvlink::transfer_result w = co_await initiator.async_submit_transfer(write, asio::use_awaitable);

  const std::vector<kvlink::transfer_request> read{
      {kvlink::opcode::read, back.data(), peer.segment(0), 0, back.size()}};
  kvlink::transfer_result r = co_await initiator.async_submit_transfer(read, asio::use_awaitable);

  const bool same = std::memcmp(src.data(), back.data(), src.size()) == 0;
  fmt::print("wrote {} B ({:.2f} GB/s), read {} B back ({:.2f} GB/s): {}\n", w.bytes, w.gb_per_s(),
             r.bytes, r.gb_per_s(), same ? "verified" : "MISMATCH");
  co_return same ? 0 : 1;
}

int main() {
  asio::io_context io;
  kvlink::engine target{io.get_executor(), kvlink::config{.listen = "127.0.0.1:0"}};
  kvlink::engine initiator{io.get_executor(), kvlink::config{.listen = "127.0.0.1:0"}};

  constexpr std::size_t size = 64u << 20;  // 64 MiB
  std::vector<std::byte> remote(size), src(size), back(size);
  for (std::size_t i = 0; i < size; ++i) src[i] = static_cast<std::byte>(i * 131 + 7);
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
