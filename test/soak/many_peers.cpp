// kvlink_many_peers: N engines (default 256) connected to one target on
// loopback; reports the memory an idle peer costs the target (RSS of a
// kvlink_test_peer child, before and after) and this process (per engine),
// and checks that every one of them can still move bytes.
//
//   kvlink_many_peers [--peers N]
//
// Exit status 0 when every engine connected and its WRITE arrived; 77
// (skipped) when the file descriptor limit is too low to try.
#include <kvlink/engine.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "peer_process.hpp"
#include "process_stats.hpp"
#include "test_support.hpp"
#include <asio/io_context.hpp>
#include <sys/resource.h>

int main(int argc, char** argv) {
  std::size_t peers = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--peers") peers = std::strtoull(argv[i + 1], nullptr, 10);
  }
  // Each engine: a listener and its connections (1 control + 2 lanes), here
  // and in the target.
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  const rlim_t need = 8 * peers + 256;
  if (rl.rlim_cur < need) {
    rl.rlim_cur = std::min(need, rl.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  if (rl.rlim_cur < need) {
    std::printf("SKIPPED: %zu peers need %llu file descriptors, the limit is %llu\n", peers,
                static_cast<unsigned long long>(need),
                static_cast<unsigned long long>(rl.rlim_cur));
    return 77;
  }
  kvlink_test::peer_process target{{"--size", "1048576", "--nofile", std::to_string(need)}};
  const auto target_before = std::stoull(target.command("RSS"));
  asio::io_context io;
  kvlink::config cfg;
  cfg.connect_timeout = std::chrono::seconds(10);
  std::vector<std::byte> mem(4096);
  kvlink_test::fill_pattern(mem.data(), mem.size(), 7, 0);
  const auto self_before = kvlink_test::rss_kib();
  std::vector<std::unique_ptr<kvlink::tcp_engine>> engines;
  std::vector<kvlink::peer> handles(peers);
  std::size_t connected = 0, failed = 0;
  for (std::size_t i = 0; i < peers; ++i) {
    engines.push_back(std::make_unique<kvlink::tcp_engine>(io.get_executor(), cfg));
    engines.back()->register_segment(mem.data(), mem.size(), kvlink::access::none);
    engines.back()->async_connect(target.address(), [&, i](std::error_code ec, kvlink::peer p) {
      if (ec) {
        ++failed;
        std::fprintf(stderr, "engine %zu: %s\n", i, ec.message().c_str());
      } else {
        handles[i] = p;
        ++connected;
      }
    });
  }
  if (!kvlink_test::run_until(
          io, [&] { return connected + failed == peers; }, std::chrono::seconds(120))) {
    std::printf("FAIL: connections did not finish\n");
    return 1;
  }
  for (int i = 0; i < 50; ++i) io.run_one_for(std::chrono::milliseconds(10));
  const auto target_after = std::stoull(target.command("RSS"));
  const auto self_after = kvlink_test::rss_kib();
  // Every engine still moves bytes.
  std::size_t written = 0, write_failed = 0;
  for (std::size_t i = 0; i < peers; ++i) {
    if (!handles[i].valid()) continue;
    std::vector<kvlink::transfer_request> reqs{{kvlink::opcode::write, mem.data(),
                                                handles[i].segment(std::size_t{0}),
                                                i * 4096 % (1u << 20), mem.size()}};
    engines[i]->async_submit_transfer(reqs, [&](std::error_code ec, kvlink::transfer_result) {
      ++(ec ? write_failed : written);
    });
  }
  kvlink_test::run_until(
      io, [&] { return written + write_failed == connected; }, std::chrono::seconds(120));
  std::printf(
      "many peers: %zu engines, %zu connected, %zu WRITEs arrived; target RSS %llu -> %llu KiB "
      "(%.1f KiB per idle peer: its control session and 2 lanes); this process %llu -> %llu KiB "
      "(%.1f KiB per engine: listener, peer, control channel, 2 lanes)\n",
      peers, connected, written, static_cast<unsigned long long>(target_before),
      static_cast<unsigned long long>(target_after),
      static_cast<double>(target_after - target_before) / static_cast<double>(peers),
      static_cast<unsigned long long>(self_before), static_cast<unsigned long long>(self_after),
      static_cast<double>(self_after - self_before) / static_cast<double>(peers));
  const bool ok = connected == peers && written == peers;
  std::printf("many peers: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
