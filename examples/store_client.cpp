// The store: a KV-cache pool. A master (here in this process; in a cluster
// the kvlink-master program) keeps the objects' metadata; clients give
// memory to the pool (a segment) and put and get objects, the bytes moving
// between clients with their engines, never through the master.
//
//   build/examples/store_client
#include <kvlink/kvlink.hpp>
#include <kvlink/store/client/client.hpp>
#include <kvlink/store/master/server.hpp>

#include <cstring>
#include <thread>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>
#include <fmt/format.h>

asio::awaitable<bool> demo(kvlink::store::client& prefill, kvlink::store::client& decode,
                           std::vector<std::byte>& kv, std::vector<std::byte>& back) {
  // Prefill puts one block of KV cache; decode, another instance, gets it.
  co_await prefill.async_put("req-42/block-0", kv.data(), kv.size(), {}, {}, asio::use_awaitable);
  const bool there = co_await decode.async_exists("req-42/block-0", asio::use_awaitable);
  const std::uint64_t size =
      co_await decode.async_get("req-42/block-0", back.data(), back.size(), asio::use_awaitable);
  const bool same = size == kv.size() && std::memcmp(kv.data(), back.data(), size) == 0;
  fmt::print("put {} B, exists: {}, got {} B back: {}\n", kv.size(), there, size,
             same ? "verified" : "MISMATCH");
  co_return same;
}

int main() {
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  std::thread runner([&io] { io.run(); });

  kvlink::store::server_options opt;
  opt.listen = "127.0.0.1:0";
  kvlink::store::master_server master{io.get_executor(), {}, opt};
  master.listen();

  kvlink::engine prefill_engine{io.get_executor(), kvlink::config{.listen = "127.0.0.1:0"}};
  kvlink::engine decode_engine{io.get_executor(), kvlink::config{.listen = "127.0.0.1:0"}};
  // Memory prefill gives to the pool, and the buffers puts and gets use
  // (registered, so the engines move them without a copy).
  std::vector<std::byte> pool(64u << 20), kv(2359296), back(kv.size());  // a 2.25 MiB block
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<std::byte>(i * 131 + 7);
  prefill_engine.register_segment(kv.data(), kv.size());
  decode_engine.register_segment(back.data(), back.size());

  bool ok = false;
  {
    kvlink::store::client prefill{prefill_engine, {.master = master.local_address()}};
    kvlink::store::client decode{decode_engine, {.master = master.local_address()}};
    prefill.async_mount(pool.data(), pool.size(), asio::use_future).get();
    ok = asio::co_spawn(io, demo(prefill, decode, kv, back), asio::use_future).get();
    prefill.async_close(asio::use_future).get();
    decode.async_close(asio::use_future).get();
  }
  master.async_close(asio::use_future).get();
  prefill_engine.async_close(asio::use_future).get();
  decode_engine.async_close(asio::use_future).get();
  work.reset();
  runner.join();
  return ok ? 0 : 1;
}
