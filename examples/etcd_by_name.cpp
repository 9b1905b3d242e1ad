// Two engines that find each other by name through etcd, as on two nodes:
// decode publishes its KV memory under its name; prefill connects to it by
// that name, WRITEs into it and tells it with a notification; decode checks
// every byte.
//
//   # node 1 (10.0.0.1): etcd, and the decode engine
//   etcd --listen-client-urls http://10.0.0.1:2379 --advertise-client-urls http://10.0.0.1:2379 &
//   export KVLINK_METADATA=etcd://10.0.0.1:2379 KVLINK_AUTH_SECRET=s3cret
//   build/examples/etcd_by_name decode --name decode-0 --listen 10.0.0.1:17001
//
//   # node 2 (10.0.0.2): the prefill engine
//   export KVLINK_METADATA=etcd://10.0.0.1:2379 KVLINK_AUTH_SECRET=s3cret
//   build/examples/etcd_by_name prefill --name prefill-0 --peer decode-0 --listen 10.0.0.2:0
//
// Settings come from KVLINK_* variables (KVLINK_METADATA_LEASE_TTL,
// KVLINK_METADATA_USER, ...), then from the options. Exit 0 once the bytes
// are verified.
#include <kvlink/kvlink.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <fmt/format.h>

namespace {

constexpr std::size_t kv_bytes = 64u << 20;  // 64 MiB of "KV cache"

std::byte pattern(std::size_t i) { return static_cast<std::byte>((i * 131 + 7) & 0xff); }

// Decode: its memory is published with its name; it waits for prefill's
// notification, which arrives after the data.
asio::awaitable<int> decode(kvlink::engine& engine, std::vector<std::byte>& kv) {
  engine.register_segment(kv.data(), kv.size(), kvlink::access::remote_write);
  fmt::print("{} published at {}; waiting for prefill\n", engine.name(), engine.local_address());
  std::fflush(stdout);
  const kvlink::notification n = co_await engine.async_receive_notification(asio::use_awaitable);
  for (std::size_t i = 0; i < kv.size(); ++i) {
    if (kv[i] != pattern(i)) {
      fmt::print("byte {} differs\n", i);
      co_return 1;
    }
  }
  fmt::print("{} B from {} ({}) verified\n", kv.size(), n.from_address, n.id);
  co_return 0;
}

// Prefill: connects by name (waiting for decode to appear), WRITEs, notifies.
asio::awaitable<int> prefill(kvlink::engine& engine, std::vector<std::byte>& kv,
                             const std::string& peer_name) {
  engine.register_segment(kv.data(), kv.size(), kvlink::access::none);
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = pattern(i);
  asio::steady_timer wait(co_await asio::this_coro::executor);
  kvlink::peer peer;
  for (int attempt = 0;; ++attempt) {
    auto [ec, p] =
        co_await engine.async_connect(peer_name, asio::experimental::as_tuple(asio::use_awaitable));
    if (!ec) {
      peer = p;
      break;
    }
    if (ec != kvlink::errc::name_not_found || attempt == 300) {
      fmt::print("connect {}: {}\n", peer_name, ec.message());
      co_return 1;
    }
    wait.expires_after(std::chrono::milliseconds(100));  // decode is not published yet
    co_await wait.async_wait(asio::use_awaitable);
  }
  const std::vector<kvlink::transfer_request> write{
      {kvlink::opcode::write, kv.data(), peer.segment(0), 0, kv.size()}};
  const kvlink::transfer_result r =
      co_await engine.async_submit_transfer(write, asio::use_awaitable);
  kvlink::notification done;
  done.id = engine.name();
  co_await engine.async_send_notification(peer, done, asio::use_awaitable);
  fmt::print("wrote {} B into {} at {} ({:.2f} GB/s)\n", r.bytes, peer.name(), peer.address(),
             r.gb_per_s());
  co_return 0;
}

// Either role, then a clean close: the store forgets this engine at once.
asio::awaitable<int> run(kvlink::engine& engine, const std::string& role,
                         std::vector<std::byte>& kv, const std::string& peer_name) {
  int rc = 0;
  if (role == "decode") {
    rc = co_await decode(engine, kv);
  } else {
    rc = co_await prefill(engine, kv, peer_name);
  }
  co_await engine.async_close(asio::use_awaitable);
  co_return rc;
}

int usage() {
  std::fprintf(stderr,
               "usage: etcd_by_name decode|prefill [--metadata etcd://host:2379] [--name NAME] "
               "[--peer NAME] [--listen host:port]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string role = argv[1];
  if (role != "decode" && role != "prefill") return usage();
  try {
    // KVLINK_METADATA, KVLINK_AUTH_SECRET and the rest, then the options.
    kvlink::config cfg = kvlink::config_from_env(kvlink::config{.listen = "127.0.0.1:0"});
    std::string peer_name = "decode-0";
    for (int i = 2; i + 1 < argc; i += 2) {
      const std::string opt = argv[i];
      if (opt == "--metadata") {
        cfg.metadata.url = argv[i + 1];
      } else if (opt == "--name") {
        cfg.name = argv[i + 1];
      } else if (opt == "--peer") {
        peer_name = argv[i + 1];
      } else if (opt == "--listen") {
        cfg.listen = argv[i + 1];
      } else {
        return usage();
      }
    }
    asio::io_context io;
    // Throws, naming the store, when etcd cannot be reached.
    kvlink::engine engine{io.get_executor(), cfg};
    std::vector<std::byte> kv(kv_bytes);
    int status = 2;
    asio::co_spawn(io, run(engine, role, kv, peer_name), [&](std::exception_ptr e, int rc) {
      status = e ? 3 : rc;
      io.stop();
    });
    io.run();
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "etcd_by_name: %s\n", e.what());
    return 1;
  }
}
