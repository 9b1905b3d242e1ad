// kvlink_test_peer: a kvlink engine in its own process, for the two-process
// tests (test/unit/engine/two_process_test.cpp).
//
//   kvlink_test_peer [--size BYTES] [--seed N] [--access rw|r|w]
//                    [--config JSON] [--nofile N] [--user UID] [--shared 0|1]
//                    [--device 0|1]
//
// Starts a tcp_engine on 127.0.0.1:0, registers one segment of --size bytes
// (default 80 MiB) filled with the pattern of --seed (default 1), granted as
// --access (default rw), prints `ADDR <host:port>` on stdout and then serves
// peers while it reads commands from stdin, one per line, each answered with
// one line:
//
//   CHECK <offset> <length> <seed>  ->  OK | BAD <first differing offset> | ERR <why>
//       compares segment bytes [offset, offset + length) with the pattern of
//       <seed> at the same positions (what the test WROTE there);
//   FILL <seed> [<length>]          ->  OK | ERR <why>
//       refills the whole segment (or its first <length> bytes) with the
//       pattern of <seed>;
//   RSS                             ->  <resident set size in KiB>;
//   PUSH <address> <length>         ->  STARTED
//       connects to the engine at <address> and WRITEs [0, length) of the
//       segment into its first segment, again and again, until this process
//       ends (a test kills it mid-transfer);
//   REG <bytes> <seed>              ->  OK <segment id> | ERR <why>
//       registers one more segment of <bytes>, filled with the pattern of
//       <seed> (at positions from 0), granted rw;
//   CONNECT <address>               ->  TRANSPORT <name> <reason> | ERR <why>
//       connects to the engine at <address> (the peer WRITE uses);
//   WRITE <offset> <length>         ->  OK | ERR <why>
//       WRITEs segment bytes [offset, offset + length) to the same offsets
//       of the connected peer's first segment.
//
// --config: settings as JSON (kvlink::config_from_json) on top of a listen
// address of 127.0.0.1:0; --nofile: the process's file descriptor limit;
// --user: run as that user id (and group id) from the start, for a test run
// as root that needs a peer of another user; --shared 1: the segment is
// kvlink::shm::shared_memory (a same-host peer maps it); --device 1: the
// segment is device memory (device 0) of the runtime config.device names
// ("emulated"), filled and checked through its copy engine.
//
// EOF on stdin: the engine is destroyed and the process exits 0. Exit 1 on a
// set-up failure, 2 on bad arguments.
//
// The pattern: byte `pos` of the pattern of `seed` is byte pos % 8
// (little-end first) of mix(mix(seed) ^ pos / 8), mix being splitmix64's
// finaliser. It is random-access, so a test can lay the pattern's bytes for
// remote positions into any local buffer. The test carries the same
// function; its READ checks fail if the two ever differ.
#include <kvlink/engine.hpp>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "device_memory.hpp"
#include "process_stats.hpp"
#include "test_support.hpp"
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <grp.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

namespace {

using kvlink_test::fill_pattern;
using kvlink_test::mix;

// The first i in [0, len) where src[i] is not the pattern's byte at
// origin + i; nullopt if none.
std::optional<std::uint64_t> pattern_mismatch(const std::byte* src, std::uint64_t len,
                                              std::uint64_t seed, std::uint64_t origin) {
  const std::uint64_t key = mix(seed);
  std::uint64_t w = mix(key ^ (origin / 8));
  for (std::uint64_t i = 0; i < len; ++i) {
    const std::uint64_t pos = origin + i;
    if (pos % 8 == 0) w = mix(key ^ (pos / 8));
    if (src[i] != static_cast<std::byte>(w >> (8 * (pos % 8)))) return i;
  }
  return std::nullopt;
}

bool parse_u64(const char* text, std::uint64_t& out) {
  if (text == nullptr || *text == '\0' || *text == '-') return false;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 0);
  if (errno != 0 || *end != '\0') return false;
  out = v;
  return true;
}

int usage(const char* why) {
  std::fprintf(
      stderr,
      "kvlink_test_peer: %s\nusage: kvlink_test_peer [--size BYTES] [--seed N] [--access rw|r|w]\n",
      why);
  return 2;
}

// Answers one command line; runs on the io thread, so it is ordered with the
// engine's handlers (which wrote the segment) and sees their bytes.
// WRITEs [0, len) of mem to the peer's first segment forever.
void push_forever(kvlink::tcp_engine& engine, kvlink::peer p, std::byte* mem, std::uint64_t len) {
  std::vector<kvlink::transfer_request> reqs{
      {kvlink::opcode::write, mem, p.segment(std::size_t{0}), 0, len}};
  engine.async_submit_transfer(reqs,
                               [&engine, p, mem, len](std::error_code ec, kvlink::transfer_result) {
                                 if (!ec) push_forever(engine, p, mem, len);
                               });
}

// The peer CONNECT reached (io thread only).
std::optional<kvlink::peer> connected;

// --device 1: the runtime whose device memory the segment is (null: host
// memory), reached only through its copy engine.
std::shared_ptr<kvlink::device_runtime> device_rt;

// Bytes [off, off + len) of the segment, as host bytes.
std::vector<std::byte> segment_bytes(std::span<std::byte> mem, std::uint64_t off,
                                     std::uint64_t len) {
  std::vector<std::byte> out(len);
  if (len == 0) return out;  // out.data() may be null: no memcpy of nothing
  if (!device_rt) {
    std::memcpy(out.data(), mem.data() + off, len);
  } else if (auto ec = kvlink_test::device_copy(*device_rt, 0, out.data(), mem.data() + off, len)) {
    throw std::system_error(ec, "device copy of the segment");
  }
  return out;
}

void fill_segment(std::span<std::byte> mem, std::uint64_t seed) {
  if (!device_rt) {
    fill_pattern(mem.data(), mem.size(), seed, 0);
    return;
  }
  std::vector<std::byte> host(mem.size());
  fill_pattern(host.data(), host.size(), seed, 0);
  if (auto ec = kvlink_test::device_copy(*device_rt, 0, mem.data(), host.data(), host.size())) {
    throw std::system_error(ec, "device copy into the segment");
  }
}

// Answers the commands that wait for the engine through `reply`, later;
// false for the others (answer() does those).
bool answer_later(const std::string& line, std::span<std::byte> mem, kvlink::tcp_engine& engine,
                  std::function<void(std::string)> reply) {
  std::istringstream in(line);
  std::string verb;
  in >> verb;
  if (verb == "CONNECT") {
    std::string address;
    if (!(in >> address)) {
      reply("ERR CONNECT needs <address>");
      return true;
    }
    engine.async_connect(address, [reply](std::error_code ec, kvlink::peer p) {
      if (ec) {
        reply("ERR " + ec.message());
        return;
      }
      connected = p;
      reply("TRANSPORT " + p.transport() + " " + p.transport_reason());
    });
    return true;
  }
  if (verb == "WRITE") {
    std::uint64_t off = 0, len = 0;
    if (!(in >> off >> len) || off > mem.size() || len > mem.size() - off) {
      reply("ERR WRITE needs <offset> <length> within the segment");
      return true;
    }
    if (!connected) {
      reply("ERR not connected");
      return true;
    }
    std::vector<kvlink::transfer_request> reqs{
        {kvlink::opcode::write, mem.data() + off, connected->segment(std::size_t{0}), off, len}};
    engine.async_submit_transfer(reqs, [reply](std::error_code ec, kvlink::transfer_result) {
      reply(ec ? "ERR " + ec.message() : std::string("OK"));
    });
    return true;
  }
  return false;
}

std::string answer(const std::string& line, std::span<std::byte> mem,
                   std::list<std::vector<std::byte>>& more, kvlink::tcp_engine& engine) {
  std::istringstream in(line);
  std::string verb;
  in >> verb;
  if (verb == "CHECK") {
    std::uint64_t off = 0, len = 0, seed = 0;
    if (!(in >> off >> len >> seed)) return "ERR CHECK needs <offset> <length> <seed>";
    if (off > mem.size() || len > mem.size() - off) return "ERR range outside the segment";
    const auto bytes = segment_bytes(mem, off, len);
    if (const auto bad = pattern_mismatch(bytes.data(), len, seed, off)) {
      return "BAD " + std::to_string(off + *bad);
    }
    return "OK";
  }
  if (verb == "PUSH") {
    std::string address;
    std::uint64_t len = 0;
    if (!(in >> address >> len) || len == 0 || len > mem.size()) {
      return "ERR PUSH needs <address> <length within the segment>";
    }
    auto* m = mem.data();
    engine.async_connect(address, [&engine, m, len](std::error_code ec, kvlink::peer p) {
      if (!ec) push_forever(engine, p, m, len);
    });
    return "STARTED";
  }
  if (verb == "RSS") {
    const auto kib = kvlink_test::rss_kib();
    return kib != 0 ? std::to_string(kib) : std::string("ERR no VmRSS");
  }
  if (verb == "REG") {
    std::uint64_t bytes = 0, seed = 0;
    if (!(in >> bytes >> seed) || bytes == 0) return "ERR REG needs <bytes> <seed>";
    auto& buf = more.emplace_back(bytes);
    fill_pattern(buf.data(), buf.size(), seed, 0);
    std::error_code ec;
    const auto id =
        engine.register_segment(buf.data(), buf.size(), kvlink::access::remote_read_write, ec);
    if (ec) {
      more.pop_back();
      return "ERR " + ec.message();
    }
    return "OK " + std::to_string(id.value());
  }
  if (verb == "FILL") {
    std::uint64_t seed = 0;
    if (!(in >> seed)) return "ERR FILL needs <seed> [<length>]";
    std::uint64_t len = mem.size();
    if (!(in >> len)) {
      len = mem.size();
    } else if (len > mem.size()) {
      return "ERR length beyond the segment";
    }
    fill_segment(mem.first(static_cast<std::size_t>(len)), seed);
    return "OK";
  }
  return "ERR unknown command '" + verb + "'";
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t size = 80u << 20;  // 80 MiB
  std::uint64_t seed = 1;
  kvlink::access granted = kvlink::access::remote_read_write;
  kvlink::config cfg{.listen = "127.0.0.1:0"};
  bool shared = false;
  bool device = false;
  for (int i = 1; i < argc; i += 2) {  // every option takes a value
    const std::string arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    if (arg == "--size") {
      if (!parse_u64(value, size) || size == 0) return usage("--size needs a positive byte count");
    } else if (arg == "--seed") {
      if (!parse_u64(value, seed)) return usage("--seed needs an unsigned integer");
    } else if (arg == "--access") {
      const std::string a = value ? value : "";
      if (a == "rw") {
        granted = kvlink::access::remote_read_write;
      } else if (a == "r") {
        granted = kvlink::access::remote_read;
      } else if (a == "w") {
        granted = kvlink::access::remote_write;
      } else {
        return usage("--access needs rw, r or w");
      }
    } else if (arg == "--config") {
      try {
        cfg = kvlink::config_from_json(nlohmann::json::parse(value ? value : ""), cfg);
      } catch (const std::exception& e) {
        return usage((std::string("--config: ") + e.what()).c_str());
      }
    } else if (arg == "--shared") {
      std::uint64_t v = 0;
      if (!parse_u64(value, v) || v > 1) return usage("--shared needs 0 or 1");
      shared = v == 1;
    } else if (arg == "--device") {
      std::uint64_t v = 0;
      if (!parse_u64(value, v) || v > 1) return usage("--device needs 0 or 1");
      device = v == 1;
    } else if (arg == "--user") {
      std::uint64_t uid = 0;
      if (!parse_u64(value, uid)) return usage("--user needs a user id");
      // Groups first, while we may still change them; the parent-death
      // signal is cleared by a change of credentials, so it is set again.
      if (::setgroups(0, nullptr) != 0 || ::setgid(static_cast<gid_t>(uid)) != 0 ||
          ::setuid(static_cast<uid_t>(uid)) != 0) {
        return usage("--user: cannot change to that user (not root?)");
      }
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::prctl(PR_SET_DUMPABLE, 1);
    } else if (arg == "--nofile") {
      std::uint64_t n = 0;
      if (!parse_u64(value, n) || n == 0) return usage("--nofile needs a positive count");
      rlimit rl{n, n};
      if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) return usage("--nofile: setrlimit failed");
    } else {
      return usage(("unknown argument '" + arg + "'").c_str());
    }
  }
  // A test that went away must not kill us mid-reply; we notice EOF instead.
  std::signal(SIGPIPE, SIG_IGN);

  try {
    // --shared 1: the segment lives in shared memory (shm/memory.hpp),
    // which a same-host peer maps instead of attaching to our process.
    std::vector<std::byte> private_mem;
    kvlink::shm::shared_memory shared_mem;
    std::optional<kvlink::device_buffer> device_mem;
    std::span<std::byte> mem;
    if (device) {
      device_rt = kvlink::device_catalog::global().find(cfg.device.runtime);
      if (!device_rt) {
        return usage("--device 1 needs config.device naming a runtime (\"emulated\")");
      }
      device_mem.emplace(device_rt, 0, size);
      mem = std::span<std::byte>(device_mem->data(), size);
    } else if (shared) {
      shared_mem = kvlink::shm::shared_memory::allocate(size);
      mem = std::span<std::byte>(shared_mem.data(), size);
    } else {
      private_mem.resize(size);
      mem = std::span<std::byte>(private_mem);
    }
    fill_segment(mem, seed);
    std::list<std::vector<std::byte>> more;  // segments REG adds; outlive the engine

    asio::io_context io;
    auto work = asio::make_work_guard(io);
    std::optional<kvlink::tcp_engine> engine;
    engine.emplace(io.get_executor(), cfg);
    engine->register_segment(mem.data(), mem.size(), granted);
    std::thread runner([&io] { io.run(); });

    std::cout << "ADDR " << engine->local_address() << std::endl;  // endl flushes
    std::string line;
    while (std::getline(std::cin, line)) {
      auto reply = std::make_shared<std::promise<std::string>>();
      auto fut = reply->get_future();
      asio::post(io, [&, reply] {
        auto later = [reply](std::string a) { reply->set_value(std::move(a)); };
        if (!answer_later(line, mem, *engine, later)) later(answer(line, mem, more, *engine));
      });
      std::cout << fut.get() << std::endl;
      if (!std::cout) break;  // nobody reads our replies any more
    }

    // Close it while the io_context runs (a metadata store is told it is
    // gone), then stop the io_context and destroy it from this thread: it
    // must not be destroyed while its handlers run.
    std::promise<void> closed;
    engine->async_close([&closed](std::error_code) { closed.set_value(); });
    closed.get_future().wait();
    work.reset();
    io.stop();
    runner.join();
    connected.reset();  // nothing runs the io_context any more
    engine.reset();
    device_mem.reset();
    device_rt.reset();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvlink_test_peer: %s\n", e.what());
    return 1;
  }
}
