// kvlink-store-client: the process that holds a host's share of the store's
// pool for the ranks of that host (Mooncake's `mooncake_client`, the "real
// client" its DummyClients use). It runs an engine and a store client,
// mounts --global_segment_size bytes with the master, and tells ranks where
// things are: a rank's MooncakeDistributedStore.setup_dummy(pool, buffer,
// "host:50052") asks it, then puts and gets with an engine of its own, so
// the bytes move between the rank's memory and this process's segment over
// the engine (same-host memory on one host), never through this process's
// CPU. The segment outlives the ranks: a rank that restarts finds the
// objects it put.
//
//   kvlink-store-client --master_server_address 10.0.0.1:50051
//                       --global_segment_size "4 GB" --host 10.0.0.2 --port 50052
//                       (one line)
//
// Flags are mooncake_client's: --host (0.0.0.0), --port (50052),
// --master_server_address (127.0.0.1:50051), --global_segment_size ("4 GB":
// bytes, or with KB/MB/GB/TB, KiB.., decimal-free), --metadata_server
// (P2PHANDSHAKE, an etcd:// or http:// URL for the engine), --protocol
// (tcp or rdma), --threads, --local_buffer_size, --device_names,
// --tenant_id (default only), --enable_offload (false only). The engine's
// own settings come from KVLINK_* variables (KVLINK_AUTH_SECRET: the
// cluster's shared secret, which the master and the ranks share).
//
// The rank service: one JSON line per TCP connection, one line back.
//   {"op": "hello", "version": 1} -> {"ok": true, "version": 1, "master": M,
//       "metadata": MD, "protocol": P, "engine": ENGINE, "segment": ID,
//       "segment_size": N}
//   {"op": "health"} -> {"ok": true} when the master answers, else
//       {"ok": false, "error": "..."}
//   anything else -> {"ok": false, "error": "..."}
// Lines are bounded (4 KiB) and a connection must send its line within 5 s.
//
// When ready it prints one line, "kvlink-store-client: serving N bytes
// (segment ID) at ENGINE for master M; ranks connect to HOST:PORT", to
// stdout; SIGINT or SIGTERM unmounts the segment (its objects leave the
// pool) and exits 0. A master that goes away is reconnected to, and the
// segment mounted again, by the store client.
#include <kvlink/control/handshake.hpp>
#include <kvlink/control/socket.hpp>
#include <kvlink/core/settings.hpp>
#include <kvlink/engine.hpp>
#include <kvlink/store/client/client.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <future>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/read_until.hpp>
#include <asio/signal_set.hpp>
#include <asio/steady_timer.hpp>
#include <asio/strand.hpp>
#include <asio/use_future.hpp>
#include <asio/write.hpp>
#include <nlohmann/json.hpp>
#include <sys/mman.h>

namespace {

namespace store = kvlink::store;

int fail(const std::string& what) {
  std::cerr << "kvlink-store-client: " << what << "\n";
  return 2;
}

// Mooncake's size strings: "4 GB", "512MB", "3.125GB", "1048576"; its units
// are powers of 1024 whichever way they are spelt.
std::optional<std::uint64_t> parse_size(const std::string& text) {
  static constexpr std::array<kvlink::detail::unit_scale, 14> units{{
      {"", 1},
      {"b", 1},
      {"k", 1ull << 10},
      {"kb", 1ull << 10},
      {"kib", 1ull << 10},
      {"m", 1ull << 20},
      {"mb", 1ull << 20},
      {"mib", 1ull << 20},
      {"g", 1ull << 30},
      {"gb", 1ull << 30},
      {"gib", 1ull << 30},
      {"t", 1ull << 40},
      {"tb", 1ull << 40},
      {"tib", 1ull << 40},
  }};
  return kvlink::detail::parse_scaled(text, units, UINT64_MAX);
}

// Anonymous memory for the segment, unmapped last.
struct mapping {
  explicit mapping(std::uint64_t n) : size(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) base = static_cast<std::byte*>(p);
  }
  ~mapping() {
    if (base != nullptr) ::munmap(base, size);
  }
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;
  std::byte* base = nullptr;
  std::uint64_t size = 0;
};

struct service {
  service(store::client& c, nlohmann::json h) : client(c), hello(std::move(h)) {}
  store::client& client;
  nlohmann::json hello;
  std::atomic<int> active{0};  // answers in flight (shutdown waits for them)
};

// Runs on the socket's strand; the deadline's handler runs there too and
// holds the socket, so it never races the answer or outlives the socket.
asio::awaitable<void> answer(std::shared_ptr<service> svc,
                             std::shared_ptr<asio::ip::tcp::socket> conn) {
  struct counted {
    service& s;
    explicit counted(service& x) : s(x) { s.active.fetch_add(1); }
    ~counted() { s.active.fetch_sub(1); }
  } count(*svc);
  auto& sock = *conn;
  asio::steady_timer deadline(sock.get_executor(), std::chrono::seconds(5));
  deadline.async_wait([conn](std::error_code ec) {
    if (!ec) {
      std::error_code ignored;
      conn->close(ignored);
    }
  });
  std::string line;
  auto [ec, n] = co_await asio::async_read_until(sock, asio::dynamic_buffer(line, 4096), '\n',
                                                 kvlink::control::use_nothrow);
  nlohmann::json out;
  if (ec) {
    out = {{"ok", false}, {"error", "no request line within 5 s and 4 KiB"}};
  } else {
    const auto req = nlohmann::json::parse(line.substr(0, n), nullptr, false);
    const std::string op = req.is_object() && req.contains("op") && req["op"].is_string()
                               ? req["op"].get<std::string>()
                               : std::string{};
    if (op == "hello") {
      out = svc->hello;
    } else if (op == "health") {
      auto [sec, stats] = co_await svc->client.async_stats(kvlink::control::use_nothrow);
      (void)stats;
      out = sec ? nlohmann::json{{"ok", false}, {"error", "master: " + sec.message()}}
                : nlohmann::json{{"ok", true}};
    } else {
      out = {{"ok", false}, {"error", "not a request: {\"op\": \"hello\" | \"health\"}"}};
    }
  }
  const std::string reply = out.dump() + "\n";
  auto [wec, wn] =
      co_await asio::async_write(sock, asio::buffer(reply), kvlink::control::use_nothrow);
  (void)wec;
  (void)wn;
  deadline.cancel();
  std::error_code ignored;
  sock.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  sock.close(ignored);
}

asio::awaitable<void> serve(std::shared_ptr<service> svc, asio::ip::tcp::acceptor& acc) {
  for (;;) {
    auto [ec, sock] = co_await acc.async_accept(asio::make_strand(acc.get_executor()),
                                                kvlink::control::use_nothrow);
    if (!acc.is_open()) co_return;
    if (ec) {
      asio::steady_timer pause(acc.get_executor(), std::chrono::milliseconds(50));
      co_await pause.async_wait(kvlink::control::use_nothrow);
      continue;
    }
    auto conn = std::make_shared<asio::ip::tcp::socket>(std::move(sock));
    asio::co_spawn(conn->get_executor(), answer(svc, conn), asio::detached);
  }
}

struct options {
  std::string host, master, segment_text, metadata, protocol, device_names;
  std::uint64_t segment_size = 0;
  unsigned port = 0;
};

// The holder's life, on io's threads: mount, serve, and on SIGINT/SIGTERM
// stop serving, unmount and close. Throws std::system_error with context.
int hold(asio::io_context& io, const options& o) {
  kvlink::config cfg = kvlink::config_from_env();
  cfg.listen = o.host + ":0";
  // Same-host ranks reach the segment through shared memory.
  cfg.transports = o.protocol == "rdma" ? "rdma,shm,tcp" : "shm,tcp";
  if (!o.device_names.empty()) cfg.rdma.devices = o.device_names;
  cfg.metadata.url = o.metadata == "P2PHANDSHAKE" ? std::string("p2p") : o.metadata;

  mapping mem(o.segment_size);
  if (mem.base == nullptr) throw std::runtime_error("cannot map " + o.segment_text + " of memory");
  kvlink::engine eng{io.get_executor(), cfg};
  int rc = 0;
  {
    store::client client{eng, {.master = o.master}};
    std::uint64_t segment = 0;
    asio::ip::tcp::acceptor acc{io};
    std::shared_ptr<service> svc;
    try {
      try {
        segment = client.async_mount(mem.base, mem.size, asio::use_future).get();
      } catch (const std::system_error& e) {
        throw std::system_error(e.code(), "mount at the master " + o.master);
      }
      const auto ep = asio::ip::tcp::endpoint(asio::ip::make_address(o.host),
                                              static_cast<std::uint16_t>(o.port));
      std::error_code bec;
      acc.open(ep.protocol(), bec);
      if (!bec) acc.set_option(asio::socket_base::reuse_address(true), bec);
      if (!bec) acc.bind(ep, bec);
      if (!bec) acc.listen(asio::socket_base::max_listen_connections, bec);
      if (bec) {
        throw std::system_error(bec, "bind(" + o.host + ":" + std::to_string(o.port) + ")");
      }
    } catch (...) {
      client.async_close(asio::use_future).get();
      eng.async_close(asio::use_future).get();
      throw;
    }
    const std::string service_address = kvlink::control::format_endpoint(acc.local_endpoint());
    svc = std::make_shared<service>(client, nlohmann::json{{"ok", true},
                                                           {"version", 1},
                                                           {"master", o.master},
                                                           {"metadata", o.metadata},
                                                           {"protocol", o.protocol},
                                                           {"engine", eng.local_address()},
                                                           {"segment", segment},
                                                           {"segment_size", mem.size}});
    asio::co_spawn(acc.get_executor(), serve(svc, acc), asio::detached);

    std::promise<void> stop;
    asio::signal_set signals{io, SIGINT, SIGTERM};
    signals.async_wait([&stop](std::error_code, int) { stop.set_value(); });
    std::printf(
        "kvlink-store-client: serving %llu bytes (segment %llu) at %s for master %s; ranks "
        "connect to %s\n",
        static_cast<unsigned long long>(mem.size), static_cast<unsigned long long>(segment),
        eng.local_address().c_str(), o.master.c_str(), service_address.c_str());
    std::fflush(stdout);
    stop.get_future().wait();

    asio::post(acc.get_executor(), [&acc] {
      std::error_code ignored;
      acc.close(ignored);
    });
    try {
      client.async_close(asio::use_future).get();  // unmounts: the objects leave the pool
    } catch (const std::system_error& e) {
      std::cerr << "kvlink-store-client: closing: " << e.what() << "\n";
      rc = 1;
    }
    // Answers still in flight end within their 5 s deadline (the client's
    // calls fail with cancelled once it is closed).
    for (int i = 0; i < 600 && svc->active.load() > 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    // The accept loop holds svc and the acceptor: it ends once the acceptor
    // closed; wait for that too.
    for (int i = 0; i < 600 && svc.use_count() > 1; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  eng.async_close(asio::use_future).get();
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  o.host = "0.0.0.0";
  o.master = "127.0.0.1:50051";
  o.segment_text = "4 GB";
  o.metadata = "P2PHANDSHAKE";
  o.protocol = "tcp";
  o.port = 50052;
  std::string tenant = "default", local_buffer = "0";
  unsigned threads = 2;
  bool offload = false;
  CLI::App app{
      "kvlink-store-client: holds a host's share of the kvlink store's pool for the ranks "
      "of that host (mooncake_client's role and flags)"};
  app.add_option("--host", o.host, "address the engine and the rank service listen on (0.0.0.0)");
  app.add_option("--port", o.port, "the rank service's port (50052)");
  app.add_option("--master_server_address", o.master, "the master, host:port (127.0.0.1:50051)");
  app.add_option("--global_segment_size", o.segment_text, "bytes given to the pool (\"4 GB\")");
  app.add_option("--metadata_server", o.metadata,
                 "P2PHANDSHAKE, or the engine's etcd:// or http:// metadata store");
  app.add_option("--protocol", o.protocol, "tcp or rdma (tcp)");
  app.add_option("--threads", threads, "I/O threads (2)");
  app.add_option("--local_buffer_size", local_buffer, "accepted: this process puts nothing");
  app.add_option("--device_names", o.device_names, "RDMA devices (the engine's rdma_devices)");
  app.add_option("--tenant_id", tenant, "only \"default\"");
  app.add_option("--enable_offload", offload, "only false: kvlink has no SSD tier yet");
  CLI11_PARSE(app, argc, argv);

  const auto segment_size = parse_size(o.segment_text);
  if (!segment_size || *segment_size == 0) {
    return fail("--global_segment_size \"" + o.segment_text + "\" is not a size above 0");
  }
  o.segment_size = *segment_size;
  if (!parse_size(local_buffer)) return fail("--local_buffer_size \"" + local_buffer + "\"");
  if (o.port > 65535) return fail("--port: not a port");
  if (o.protocol != "tcp" && o.protocol != "rdma") return fail("--protocol: tcp or rdma");
  if (tenant != "default") return fail("--tenant_id: kvlink's store has one tenant, \"default\"");
  if (offload) return fail("--enable_offload: kvlink's store has no SSD tier yet");
  if (threads == 0) threads = 1;

  asio::io_context io{static_cast<int>(threads)};
  auto work = asio::make_work_guard(io);
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < threads; ++i) pool.emplace_back([&io] { io.run(); });
  int rc = 0;
  try {
    rc = hold(io, o);
  } catch (const std::exception& e) {
    rc = fail(e.what());
  }
  work.reset();
  io.stop();
  for (auto& t : pool) t.join();
  return rc;
}
