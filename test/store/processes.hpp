// What the store's process tests share (store_test.cpp, failover_test.cpp):
// kvlink_store_peer clients, temporary files, and a put/get load with the
// check that every acknowledged put reads back with its bytes.
#pragma once

#include <kvlink/store/error.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "../support/peer_process.hpp"
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <stdlib.h>
#include <unistd.h>

#ifndef KVLINK_STORE_PEER_PATH
#error "KVLINK_STORE_PEER_PATH is set by test/store/CMakeLists.txt"
#endif

namespace kvlink_store_test {

using kvlink_test::peer_process;
using namespace std::chrono_literals;

// "<category>:<value>" as kvlink_store_peer prints it.
inline std::string code(kvlink::store_errc e) {
  return std::string("kvlink.store:").append(std::to_string(static_cast<int>(e)));
}

// A port free now (bound and released), for a master that must come back
// on the same address.
inline std::uint16_t free_port() {
  asio::io_context io;
  asio::ip::tcp::acceptor a(io, {asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}

// A file that is removed with this object.
struct temp_file {
  explicit temp_file(const std::string& text) {
    char name[] = "/tmp/kvlink_store_test_XXXXXX";
    const int fd = ::mkstemp(name);
    if (fd < 0) throw std::system_error(errno, std::generic_category(), "mkstemp");
    path = name;
    const auto n = ::write(fd, text.data(), text.size());
    ::close(fd);
    if (n != static_cast<ssize_t>(text.size())) throw std::runtime_error("write " + path);
  }
  ~temp_file() { ::unlink(path.c_str()); }
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;
  std::string path;
};

// kvlink_store_peer's arguments (--disk: its SSD tier's directory).
inline std::vector<std::string> client_args(const std::string& master, std::uint64_t mount,
                                            const std::string& secret = {},
                                            const std::string& disk = {}) {
  std::vector<std::string> a{"--master", master, "--mount", std::to_string(mount)};
  if (!secret.empty()) {
    a.push_back("--secret");
    a.push_back(secret);
  }
  if (!disk.empty()) {
    a.push_back("--disk");
    a.push_back(disk);
  }
  return a;
}

inline peer_process client(const std::string& master, std::uint64_t mount = 64u << 20,
                           const std::string& secret = {}) {
  return peer_process(KVLINK_STORE_PEER_PATH, client_args(master, mount, secret), "READY ");
}

// Repeats `line` until its answer starts with `want` or `limit` passes;
// returns the last answer.
inline std::string until(peer_process& p, const std::string& line, const std::string& want,
                         std::chrono::seconds limit = 15s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  std::string last;
  do {
    last = p.command(line);
    if (last.rfind(want, 0) == 0) return last;
    std::this_thread::sleep_for(100ms);
  } while (std::chrono::steady_clock::now() < end);
  return last;
}

// What put_get_load saw.
struct load_outcome {
  std::size_t acked = 0;  ///< puts acknowledged
  int reads = 0;          ///< gets during the load
  int bad_reads = 0;      ///< gets that returned other bytes (must be 0)
  std::size_t lost = 0;   ///< acknowledged puts not read back afterwards (must be 0)
  std::vector<std::string> lost_examples;
};

// Puts from w1 and w2 (at most 1,500 each, 1-21 KB, a third with
// `replicas` replicas) and gets from r of what was acknowledged, while
// `disrupt` runs (kills, restarts); then every acknowledged put is read
// back through r and compared (the first waits up to `settle` for a
// rebuild, the others fail at once).
inline load_outcome put_get_load(peer_process& w1, peer_process& w2, peer_process& r,
                                 const std::function<void()>& disrupt, int replicas = 2,
                                 std::chrono::seconds settle = 10s) {
  std::mutex mu;
  std::vector<std::string> acked;  // "key size seed"
  std::atomic<bool> stop{false};
  std::atomic<int> bad_reads{0}, reads{0};
  auto writer = [&](peer_process& p, const std::string& prefix) {
    // A third of a 64 MiB pool at most: far from eviction (an evicted
    // object is gone on purpose).
    for (int i = 0; !stop && i < 1500; ++i) {
      const std::string key = prefix + std::to_string(i);
      const std::string size = std::to_string(1000 + (i * 7919) % 20000);
      const std::string seed = std::to_string(i % 250);
      const std::string line = "PUT " + key + " " + size + " " + seed;
      if (p.command(line + (i % 3 == 0 ? " " + std::to_string(replicas) : "")) == "OK") {
        std::lock_guard lock{mu};
        acked.push_back(key + " " + size + " " + seed);
      }
      std::this_thread::sleep_for(2ms);
    }
  };
  std::thread t1([&] { writer(w1, "w1-"); });
  std::thread t2([&] { writer(w2, "w2-"); });
  std::thread reader([&] {
    while (!stop) {
      std::string pick;
      {
        std::lock_guard lock{mu};
        if (!acked.empty()) pick = acked[static_cast<std::size_t>(reads.load()) % acked.size()];
      }
      if (pick.empty()) {
        std::this_thread::sleep_for(5ms);
        continue;
      }
      const auto sp = pick.find(' ');
      const auto sp2 = pick.rfind(' ');
      const std::string answer =
          r.command("GET " + pick.substr(0, sp) + " " + pick.substr(sp2 + 1));
      ++reads;
      // While the master is down or rebuilding a get may fail; it must never
      // return other bytes.
      if (answer.rfind("BAD", 0) == 0) ++bad_reads;
    }
  });
  disrupt();
  stop = true;
  t1.join();
  t2.join();
  reader.join();
  load_outcome out;
  out.acked = acked.size();
  out.reads = reads.load();
  out.bad_reads = bad_reads.load();
  for (const auto& e : acked) {
    const auto sp = e.find(' ');
    const auto sp2 = e.rfind(' ');
    const std::string key = e.substr(0, sp);
    const std::string answer =
        until(r, "GET " + key + " " + e.substr(sp2 + 1), "OK", out.lost == 0 ? settle : 0s);
    if (answer != "OK " + e.substr(sp + 1, sp2 - sp - 1)) {
      if (++out.lost <= 5) out.lost_examples.push_back(key + ": " + answer);
    }
  }
  return out;
}

}  // namespace kvlink_store_test
