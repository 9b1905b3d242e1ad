// kvlink_store_peer: a store client in its own process, for the store's
// multi-process tests (test/store/store_test.cpp, failover_test.cpp).
//
//   kvlink_store_peer --master HOST:PORT|etcd://HOST:PORT [--cluster C]
//                     [--mount BYTES] [--buffer BYTES] [--secret S] [--transports LIST]
//                     [--disk DIR --disk-capacity BYTES]
//
// Starts an engine on 127.0.0.1:0, registers a work buffer (--buffer, default
// 64 MiB) to put from and get into, connects a kvlink::store::client to the
// master, mounts a segment of --mount bytes (default 64 MiB; 0: none, a pure
// requester; --disk: its SSD tier in DIR), prints `READY <client id>` on stdout and then answers
// commands from stdin, one line each:
//
//   PUT <key> <size> <seed> [replicas]   ->  OK | ERR <code> <message>
//       puts <size> bytes of the pattern of <seed> under <key>;
//   GET <key> <seed>                     ->  OK <size> | BAD <offset> | ERR <code> <message>
//       gets <key> and checks its bytes against the pattern of <seed>;
//   EXISTS <key>                         ->  YES | NO | ERR <code> <message>
//   REMOVE <key> [force]                 ->  OK | ERR <code> <message>
//   PUTB <n> <prefix> <size> <seed>      ->  OK | ERR <index> <code> <message>
//       puts keys <prefix>0 .. <prefix>n-1 in one batch, key i with the
//       pattern of <seed> + i;
//   GETB <n> <prefix> <seed>             ->  OK | BAD <index> | ERR <index> <code> <message>
//   STATS                                ->  OK <capacity> <used> <objects>
//
// <code> is "<category>:<value>" (kvlink.store:704). Closing stdin closes
// the client (its segment leaves the pool) and ends the process with 0.
#include <kvlink/engine.hpp>
#include <kvlink/store/client/client.hpp>

#include <cstdint>
#include <cstdio>
#include <future>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "test_support.hpp"
#include <asio/io_context.hpp>
#include <asio/use_future.hpp>

namespace {

using kvlink_test::fill_pattern;
using kvlink_test::is_pattern;

std::string code_of(std::error_code ec) {
  return std::string(ec.category().name()) + ":" + std::to_string(ec.value()) + " " + ec.message();
}

int usage(const char* why) {
  std::fprintf(stderr, "kvlink_store_peer: %s\n", why);
  return 2;
}

// The first differing offset, or len when the bytes match.
std::uint64_t first_bad(const std::byte* p, std::uint64_t len, std::uint64_t seed) {
  if (is_pattern(p, len, seed, 0)) return len;
  for (std::uint64_t i = 0; i < len; ++i) {
    if (!is_pattern(p + i, 1, seed, i)) return i;
  }
  return len;
}

}  // namespace

int main(int argc, char** argv) {
  std::string master, cluster, disk;
  std::uint64_t disk_capacity = 256u << 20;
  std::uint64_t mount = 64u << 20;
  std::uint64_t buffer = 64u << 20;
  kvlink::config cfg{.listen = "127.0.0.1:0"};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i];
    const std::string value = argv[i + 1];
    if (arg == "--master") {
      master = value;
    } else if (arg == "--cluster") {
      cluster = value;
    } else if (arg == "--mount") {
      mount = std::stoull(value);
    } else if (arg == "--buffer") {
      buffer = std::stoull(value);
    } else if (arg == "--secret") {
      cfg.auth_secret = value;
    } else if (arg == "--transports") {
      cfg.transports = value;
    } else if (arg == "--disk") {
      disk = value;
    } else if (arg == "--disk-capacity") {
      disk_capacity = std::stoull(value);
    } else {
      return usage("unknown option");
    }
  }
  if (master.empty() || buffer == 0) return usage("--master HOST:PORT is required");

  std::vector<std::byte> work(buffer);
  std::vector<std::byte> pool(mount);
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  std::thread runner([&io] { io.run(); });
  int status = 0;
  {
    kvlink::engine eng{io.get_executor(), cfg};
    eng.register_segment(work.data(), work.size());
    kvlink::store::client_options copt{
        .master = master, .disk_path = disk, .disk_capacity = disk_capacity};
    if (!cluster.empty()) copt.cluster = cluster;
    kvlink::store::client client{eng, copt};
    try {
      client.async_connect(asio::use_future).get();
      if (mount != 0) client.async_mount(pool.data(), pool.size(), asio::use_future).get();
    } catch (const std::system_error& e) {
      std::cout << "ERR " << code_of(e.code()) << std::endl;
      status = 1;
    }
    if (status == 0) std::cout << "READY " << client.id() << std::endl;
    std::string line;
    while (status == 0 && std::getline(std::cin, line)) {
      std::istringstream in(line);
      std::string verb;
      in >> verb;
      std::string reply;
      try {
        if (verb == "PUT") {
          std::string key;
          std::uint64_t size = 0, seed = 0;
          std::size_t replicas = 1;
          in >> key >> size >> seed;
          if (!(in >> replicas)) replicas = 1;
          if (size > work.size()) throw std::invalid_argument("size above --buffer");
          fill_pattern(work.data(), size, seed, 0);
          kvlink::store::put_config pc;
          pc.replicas = replicas;
          client.async_put(key, work.data(), size, pc, {}, asio::use_future).get();
          reply = "OK";
        } else if (verb == "GET") {
          std::string key;
          std::uint64_t seed = 0;
          in >> key >> seed;
          const auto size = client.async_get(key, work.data(), work.size(), asio::use_future).get();
          const auto bad = first_bad(work.data(), size, seed);
          reply = bad == size ? std::string("OK ").append(std::to_string(size))
                              : std::string("BAD ").append(std::to_string(bad));
        } else if (verb == "EXISTS") {
          std::string key;
          in >> key;
          reply = client.async_exists(key, asio::use_future).get() ? "YES" : "NO";
        } else if (verb == "REMOVE") {
          std::string key, force;
          in >> key >> force;
          client.async_remove(key, force == "force", asio::use_future).get();
          reply = "OK";
        } else if (verb == "PUTB" || verb == "GETB") {
          std::uint64_t n = 0, size = 0, seed = 0;
          std::string prefix;
          in >> n >> prefix;
          if (verb == "PUTB") in >> size;
          in >> seed;
          std::vector<std::string> names(n);
          std::vector<std::string_view> keys(n);
          for (std::uint64_t i = 0; i < n; ++i) {
            names[i] = prefix + std::to_string(i);
            keys[i] = names[i];
          }
          std::vector<std::error_code> results(n);
          const std::uint64_t slot = n == 0 ? 0 : work.size() / n;
          if (verb == "PUTB") {
            if (size > slot) throw std::invalid_argument("n * size above --buffer");
            std::vector<const void*> data(n);
            std::vector<std::uint64_t> sizes(n, size);
            for (std::uint64_t i = 0; i < n; ++i) {
              fill_pattern(work.data() + i * slot, size, seed + i, 0);
              data[i] = work.data() + i * slot;
            }
            client.async_put_batch(keys, data, sizes, results, {}, {}, asio::use_future).get();
          } else {
            std::vector<void*> bufs(n);
            std::vector<std::uint64_t> caps(n, slot), sizes(n);
            for (std::uint64_t i = 0; i < n; ++i) bufs[i] = work.data() + i * slot;
            client.async_get_batch(keys, bufs, caps, sizes, results, asio::use_future).get();
            for (std::uint64_t i = 0; i < n && reply.empty(); ++i) {
              if (!results[i] &&
                  first_bad(work.data() + i * slot, sizes[i], seed + i) != sizes[i]) {
                reply = std::string("BAD ").append(std::to_string(i));
              }
            }
          }
          for (std::uint64_t i = 0; i < n && reply.empty(); ++i) {
            if (results[i])
              reply = std::string("ERR ").append(std::to_string(i)) + " " + code_of(results[i]);
          }
          if (reply.empty()) reply = "OK";
        } else if (verb == "STATS") {
          const auto s = client.async_stats(asio::use_future).get();
          reply = std::string("OK ").append(std::to_string(s.capacity)) + " " +
                  std::to_string(s.used) + " " + std::to_string(s.objects);
        } else {
          reply = "ERR unknown command";
        }
      } catch (const std::system_error& e) {
        reply = "ERR " + code_of(e.code());
      } catch (const std::exception& e) {
        reply = std::string("ERR ") + e.what();
      }
      std::cout << reply << std::endl;
    }
    try {
      client.async_close(asio::use_future).get();
    } catch (const std::system_error&) {
    }
  }
  guard.reset();
  runner.join();
  return status;
}
