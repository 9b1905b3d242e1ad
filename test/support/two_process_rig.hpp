// A two-process rig: this test's engine and memory, connected to a
// kvlink_test_peer child (test/support/test_peer.cpp) over the transports
// named (config.transports on both sides): the engine's two-process tests
// run it over TCP, the same-host transport's over shm.
#pragma once

#include <kvlink/engine.hpp>

#include <algorithm>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "peer_process.hpp"
#include "test_support.hpp"
#include <asio/io_context.hpp>
#include <doctest/doctest.h>

namespace kvlink_test {

using namespace std::chrono_literals;

struct outcome {
  std::error_code ec;
  kvlink::transfer_result result;
};

constexpr std::uint64_t segment_size = 80u << 20;  // 80 MiB: the child's default

// This process's engine and memory, connected to a kvlink_test_peer child.
struct rig {
  peer_process child;
  asio::io_context io;
  std::vector<std::byte> local_mem;  // outlives the engine it is registered with
  kvlink::engine engine;
  kvlink::peer peer;
  kvlink::remote_segment remote;  // kept: a dead peer's segment list may be gone

  /// `extra`: more arguments for the child (kvlink_test_peer --shared 1);
  /// `device`: this engine's config.device (empty: the default).
  explicit rig(const std::string& access = "rw", std::uint64_t seed = 1,
               const std::string& transports = "tcp", std::vector<std::string> extra = {},
               const std::string& device = {})
      : child(child_args(access, seed, transports, std::move(extra))),
        local_mem(segment_size),
        engine(io.get_executor(), config(transports, device)) {
    engine.register_segment(local_mem.data(), local_mem.size(), kvlink::access::none);
    std::optional<std::pair<std::error_code, kvlink::peer>> out;
    engine.async_connect(child.address(),
                         [&](std::error_code ec, kvlink::peer p) { out.emplace(ec, p); });
    REQUIRE(run_until(io, [&] { return out.has_value(); }));
    REQUIRE_MESSAGE(!out->first, out->first.message());
    peer = out->second;
    REQUIRE(peer.segments().size() == 1);
    remote = peer.segment(0);
  }

  static std::vector<std::string> child_args(const std::string& access, std::uint64_t seed,
                                             const std::string& transports,
                                             std::vector<std::string> extra) {
    std::vector<std::string> a{"--size",   std::to_string(segment_size),
                               "--seed",   std::to_string(seed),
                               "--access", access,
                               "--config", "{\"transports\": \"" + transports + "\"}"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  static kvlink::config config(const std::string& transports, const std::string& device = {}) {
    kvlink::config c;
    c.transports = transports;
    if (!device.empty()) c.device.runtime = device;
    c.fence_timeout = 500ms;
    c.transfer_deadline =
        0ms;  // a loaded machine must not fail a transfer; run_until bounds the wait
    return c;
  }

  outcome run(const std::vector<kvlink::transfer_request>& reqs) {
    std::optional<outcome> out;
    engine.async_submit_transfer(reqs, [&](std::error_code ec, kvlink::transfer_result r) {
      out = outcome{ec, r};
    });
    REQUIRE(run_until(io, [&] { return out.has_value(); }));
    return *out;
  }

  kvlink::transfer_request req(kvlink::opcode op, std::size_t local_off, std::uint64_t remote_off,
                               std::uint64_t len) {
    return {op, local_mem.data() + local_off, remote, remote_off, len};
  }

  std::string fill_remote(std::uint64_t seed) {
    return child.command("FILL " + std::to_string(seed));
  }
  /// The first `len` bytes of the child's segment only.
  std::string fill_remote(std::uint64_t seed, std::uint64_t len) {
    return child.command("FILL " + std::to_string(seed) + " " + std::to_string(len));
  }

  std::string check_remote(std::uint64_t off, std::uint64_t len, std::uint64_t seed) {
    return child.command("CHECK " + std::to_string(off) + " " + std::to_string(len) + " " +
                         std::to_string(seed));
  }

  // Many CHECKs, pipelined in chunks (the answers of a chunk fit in the
  // pipe, so neither side blocks); returns the first answer that is not OK.
  struct range {
    std::uint64_t off, len, seed;
  };
  std::string check_remote(const std::vector<range>& ranges) {
    constexpr std::size_t chunk = 256;
    for (std::size_t i = 0; i < ranges.size(); i += chunk) {
      const auto end = std::min(ranges.size(), i + chunk);
      for (auto j = i; j < end; ++j) {
        child.send("CHECK " + std::to_string(ranges[j].off) + " " + std::to_string(ranges[j].len) +
                   " " + std::to_string(ranges[j].seed));
      }
      for (auto j = i; j < end; ++j) {
        auto answer = child.read_line();
        if (answer != "OK") return answer + " (range at " + std::to_string(ranges[j].off) + ")";
      }
    }
    return "OK";
  }
};

}  // namespace kvlink_test
