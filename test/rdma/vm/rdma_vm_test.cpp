// kvlink's RDMA tests between two hosts: run inside the two soft-RoCE VMs by
// run-rdma-tests.sh (ctest label `rdma`), one process per host.
//
//   kvlink_rdma_vm_test server        host 1: targets, verifies on request
//   kvlink_rdma_vm_test client        host 2: runs the scenarios below
//   kvlink_rdma_vm_test bench-server  host 1: a target for `bench`
//   kvlink_rdma_vm_test bench SIZES   host 2: kvlink RDMA WRITE GB/s per size
//
// Addresses come from run-vm.sh (KVLINK_SELF0, KVLINK_PEER0). The server has
// two engines: an RDMA engine on :17001 and one limited to a device that does
// not exist (so it has none: TCP only) on :17002. It checks its memory when
// the client asks ("check OFFSET LENGTH SEED" notifications; the answer goes
// back as a notification "ok"/"bad ...") and kills itself with SIGKILL on
// "die". Scenarios (each prints PASS/FAIL; the exit status is the number of
// failures):
//   1. the peer uses RDMA; WRITE and READ integrity from 1 B to 8 MiB at odd
//      offsets, verified on the target and read back; a batch of 256 requests
//   2. one 16 MiB WRITE carried by both rails (rxe0 and rxe1 packet counters)
//   3. rail 1 taken down (ip link set eth1 down) during a 24 MiB WRITE: the
//      transfer completes on rail 0, bytes verified
//   4. fallback: a peer without a device is reached over TCP; with
//      allow_tcp_fallback = false the connection fails with
//      transport_unavailable
//   5. the peer killed during a 48 MiB WRITE: the transfer fails with a clear
//      error within its deadline
#include <kvlink/rdma/transport.hpp>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "test_support.hpp"
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>
#include <sys/mman.h>

namespace {

using namespace std::chrono_literals;
using kvlink_test::fill_pattern;
using kvlink_test::is_pattern;
constexpr auto aw = kvlink::detail::use_nothrow;

constexpr std::uint64_t server_size = 64ull << 20;  // MiB = 2^20 B
constexpr std::uint64_t client_size = 64ull << 20;

struct buffer {
  explicit buffer(std::uint64_t n) : size(n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data = static_cast<std::byte*>(p);
  }
  ~buffer() { munmap(data, size); }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  std::byte* data = nullptr;
  std::uint64_t size = 0;
};

std::string env(const char* name, const char* fallback = "") {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

int failures = 0;
void report(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "PASS" : "FAIL", what.c_str());
  std::fflush(stdout);
  if (!ok) ++failures;
}

std::uint64_t counter(const std::string& dev, const char* name) {
  std::ifstream in("/sys/class/infiniband/" + dev + "/ports/1/hw_counters/" + name);
  std::uint64_t v = 0;
  in >> v;
  return v;
}

// ------------------------------------------------------------------ server

asio::awaitable<void> serve_checks(kvlink::rdma_engine& eng, buffer& mem, const char* tag) {
  std::optional<kvlink::peer> back;
  for (;;) {
    auto [ec, n] = co_await eng.async_receive_notification(aw);
    if (ec) co_return;
    if (n.id == "die") {
      std::printf("server(%s): dying on request\n", tag);
      std::fflush(stdout);
      ::kill(::getpid(), SIGKILL);
    }
    if (n.id == "bye") {
      std::printf("server(%s): bye\n", tag);
      std::exit(0);
    }
    if (n.id != "check") continue;
    std::istringstream in(n.payload);
    std::uint64_t off = 0, len = 0, seed = 0;
    in >> off >> len >> seed;
    std::string verdict = "ok";
    if (!in || off > mem.size || len > mem.size - off) {
      verdict = "bad request";
    } else if (!is_pattern(mem.data + off, len, seed, off)) {
      verdict = "bad bytes";
    }
    if (!back || !back->connected()) {
      auto [cec, p] = co_await eng.async_connect(n.from_address, aw);
      if (cec) {
        std::printf("server(%s): cannot answer %s: %s\n", tag, n.from_address.c_str(),
                    cec.message().c_str());
        continue;
      }
      back = p;
    }
    kvlink::notification answer{"result", verdict};
    co_await eng.async_send_notification(*back, std::move(answer), aw);
  }
}

int run_server() {
  asio::io_context io;
  const auto self = env("KVLINK_SELF0", "127.0.0.1");
  kvlink::rdma_engine rdma{io.get_executor(), kvlink::config{.listen = self + ":17001"}};
  kvlink::config tcp_only{.listen = self + ":17002"};
  tcp_only.rdma_devices = "no-such-device";
  kvlink::rdma_engine plain{io.get_executor(), tcp_only};
  std::printf("server: %s offers %s; %s offers %s\n", rdma.local_address().c_str(),
              rdma.transports().c_str(), plain.local_address().c_str(), plain.transports().c_str());
  buffer a(server_size), b(server_size);
  rdma.register_segment(a.data, a.size, kvlink::access::remote_read_write);
  plain.register_segment(b.data, b.size, kvlink::access::remote_read_write);
  asio::co_spawn(io, serve_checks(rdma, a, "rdma"), asio::detached);
  asio::co_spawn(io, serve_checks(plain, b, "tcp"), asio::detached);
  std::printf("server: ready\n");
  std::fflush(stdout);
  // The client ends the run (scenario 5 kills this process); a client that
  // died early must not leave the server waiting until the VM's timeout.
  asio::steady_timer limit(io, 300s);
  limit.async_wait([](std::error_code ec) {
    if (ec) return;
    std::printf("server: no end after 300 s, giving up\n");
    std::exit(3);
  });
  io.run();
  return 0;
}

// ------------------------------------------------------------------ client

struct client {
  asio::io_context& io;
  kvlink::rdma_engine& eng;
  buffer& mem;
  kvlink::peer peer;

  asio::awaitable<std::error_code> move(kvlink::opcode op, std::uint64_t local_off,
                                        std::uint64_t remote_off, std::uint64_t len,
                                        std::chrono::milliseconds deadline = 60s) {
    std::vector<kvlink::transfer_request> reqs{
        {op, mem.data + local_off, peer.segment(0), remote_off, len}};
    kvlink::transfer_options opt;
    opt.deadline = deadline;
    auto [ec, r] = co_await eng.async_submit_transfer(reqs, opt, aw);
    if (!ec && r.bytes != len) co_return kvlink::errc::malformed_message;
    co_return ec;
  }

  // Asks the target whether [off, off + len) holds the pattern of seed.
  asio::awaitable<std::string> check(kvlink::rdma_engine& e, const kvlink::peer& p,
                                     std::uint64_t off, std::uint64_t len, std::uint64_t seed) {
    // Named, not a temporary inside co_await: g++ 12 mis-destroys aggregate
    // temporaries there (strings freed from the coroutine frame).
    kvlink::notification ask{"check", fmt::format("{} {} {}", off, len, seed)};
    auto [sec] = co_await e.async_send_notification(p, std::move(ask), aw);
    if (sec) co_return "send failed: " + sec.message();
    auto [rec, n] = co_await e.async_receive_notification(aw);
    if (rec) co_return "no answer: " + rec.message();
    co_return n.payload;
  }

  // WRITE [off, off+len) with seed, have the target verify it, READ it back.
  asio::awaitable<bool> round_trip(std::uint64_t off, std::uint64_t len, std::uint64_t seed) {
    fill_pattern(mem.data + off, len, seed, off);
    if (auto ec = co_await move(kvlink::opcode::write, off, off, len)) {
      report(false, fmt::format("WRITE {} B at {}: {}", len, off, ec.message()));
      co_return false;
    }
    const auto verdict = co_await check(eng, peer, off, len, seed);
    std::memset(mem.data + off, 0, len);
    if (auto ec = co_await move(kvlink::opcode::read, off, off, len)) {
      report(false, fmt::format("READ {} B at {}: {}", len, off, ec.message()));
      co_return false;
    }
    const bool back = is_pattern(mem.data + off, len, seed, off);
    report(verdict == "ok" && back,
           fmt::format("WRITE+READ {} B at offset {}: target says {}, read back {}", len, off,
                       verdict, back ? "intact" : "WRONG"));
    co_return verdict == "ok" && back;
  }

  asio::awaitable<void> run() {
    const auto target = env("KVLINK_PEER0", "127.0.0.1");
    // 1. RDMA chosen; integrity across sizes.
    {
      auto [ec, p] = co_await eng.async_connect(target + ":17001", aw);
      report(!ec, "connect " + target + ":17001" + (ec ? ": " + ec.message() : ""));
      if (ec) co_return;
      peer = p;
      report(peer.transport() == "rdma", "transport is " + peer.transport());
      std::uint64_t seed = 1;
      for (std::uint64_t len :
           {1ull, 7ull, 4096ull, 4097ull, 65536ull, (1ull << 20) + 3, 8ull << 20}) {
        co_await round_trip(4096 * seed + seed, len, seed);
        ++seed;
      }
      // A batch of 256 requests of 12 KiB at scattered offsets, one transfer.
      std::vector<kvlink::transfer_request> reqs;
      for (std::uint64_t i = 0; i < 256; ++i) {
        const std::uint64_t off = (16ull << 20) + i * 20000;
        fill_pattern(mem.data + off, 12288, 99, off);
        reqs.push_back({kvlink::opcode::write, mem.data + off, peer.segment(0), off, 12288});
      }
      auto [bec, r] = co_await eng.async_submit_transfer(reqs, aw);
      bool all = !bec && r.bytes == 256 * 12288;
      for (std::uint64_t i = 0; all && i < 256; ++i) {
        const std::uint64_t off = (16ull << 20) + i * 20000;
        all = (co_await check(eng, peer, off, 12288, 99)) == "ok";
      }
      report(all, fmt::format("batch of 256 x 12 KiB WRITEs: {}, bytes {}, verified {}",
                              bec ? bec.message() : "ok", r.bytes, all));
    }
    // 2. Striping: both rails carry one large request.
    {
      const std::uint64_t len = 16ull << 20, off = 32ull << 20;
      const auto s0 = counter("rxe0", "sent_pkts"), s1 = counter("rxe1", "sent_pkts");
      fill_pattern(mem.data + off, len, 7, off);
      const auto t0 = std::chrono::steady_clock::now();
      auto ec = co_await move(kvlink::opcode::write, off, off, len);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const auto d0 = counter("rxe0", "sent_pkts") - s0, d1 = counter("rxe1", "sent_pkts") - s1;
      const auto verdict = co_await check(eng, peer, off, len, 7);
      // 16 MiB at MTU 1024 is ~16k packets; each rail should carry a fair part.
      report(!ec && verdict == "ok" && d0 > 2000 && d1 > 2000,
             fmt::format("16 MiB WRITE striped: {} ({:.3f} GB/s), target says {}, packets "
                         "sent rxe0 {} rxe1 {}",
                         ec ? ec.message() : "ok", len / secs / 1e9, verdict, d0, d1));
    }
    // 3. Rail 1 goes down during a transfer.
    {
      const std::uint64_t len = 24ull << 20, off = 8ull << 20;
      fill_pattern(mem.data + off, len, 11, off);
      std::thread downer([] {
        std::this_thread::sleep_for(150ms);
        const int rc = std::system("ip link set eth1 down");
        std::printf("client: ip link set eth1 down -> %d\n", rc);
        std::fflush(stdout);
      });
      const auto s1 = counter("rxe1", "sent_pkts");
      const auto t0 = std::chrono::steady_clock::now();
      auto ec = co_await move(kvlink::opcode::write, off, off, len);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      downer.join();
      const auto verdict = co_await check(eng, peer, off, len, 11);
      report(
          !ec && verdict == "ok",
          fmt::format("24 MiB WRITE with eth1 taken down after 150 ms: {} in {:.2f} s, target "
                      "says {} (rxe1 sent {} packets before it went down)",
                      ec ? ec.message() : "ok", secs, verdict, counter("rxe1", "sent_pkts") - s1));
      // And a transfer after it, on rail 0 alone.
      co_await round_trip(40ull << 20, 2ull << 20, 12);
      // Rail 1 back up: once its backoff has passed, the next transfer
      // reconnects it (lazily: that transfer's slices may all go to rail 0,
      // which is ready first), and the one after is striped again.
      const int up = std::system("ip link set eth1 up");
      asio::steady_timer settle(io, 8s);  // link renegotiation + backoff (<= 5 s)
      co_await settle.async_wait(aw);
      co_await round_trip(44ull << 20, 1ull << 20, 13);
      settle.expires_after(1s);
      co_await settle.async_wait(aw);
      const auto u1 = counter("rxe1", "sent_pkts");
      const std::uint64_t off2 = 46ull << 20, len2 = 16ull << 20;
      fill_pattern(mem.data + off2, len2, 14, off2);
      auto uec = co_await move(kvlink::opcode::write, off2, off2, len2);
      const auto uverdict = co_await check(eng, peer, off2, len2, 14);
      const auto carried = counter("rxe1", "sent_pkts") - u1;
      report(!uec && uverdict == "ok" && carried > 2000,
             fmt::format("eth1 up again ({}): 16 MiB WRITE {}, target says {}, rxe1 sent {} "
                         "packets (the rail is back)",
                         up, uec ? uec.message() : "ok", uverdict, carried));
    }
    // 4. Fallback to TCP for a peer without a device, and its refusal.
    {
      kvlink::rdma_engine e2{io.get_executor(),
                             kvlink::config{.listen = env("KVLINK_SELF0", "127.0.0.1") + ":0"}};
      buffer m2(4ull << 20);
      e2.register_segment(m2.data, m2.size, kvlink::access::remote_read_write);
      auto [ec, p] = co_await e2.async_connect(target + ":17002", aw);
      report(!ec && p.transport() == "tcp",
             fmt::format("peer without a device: connect {}, transport {}",
                         ec ? ec.message() : "ok", ec ? "-" : p.transport()));
      if (!ec) {
        fill_pattern(m2.data, m2.size, 21, 0);
        std::vector<kvlink::transfer_request> reqs{
            {kvlink::opcode::write, m2.data, p.segment(0), 0, m2.size}};
        auto [tec, r] = co_await e2.async_submit_transfer(reqs, aw);
        const auto verdict = co_await check(e2, p, 0, m2.size, 21);
        report(!tec && verdict == "ok",
               fmt::format("4 MiB WRITE over the TCP fallback: {}, target says {}",
                           tec ? tec.message() : "ok", verdict));
        (void)r;
      }
      kvlink::config strict{.listen = env("KVLINK_SELF0", "127.0.0.1") + ":0"};
      strict.allow_tcp_fallback = false;
      kvlink::rdma_engine e3{io.get_executor(), strict};
      auto [sec, sp] = co_await e3.async_connect(target + ":17002", aw);
      report(sec == kvlink::errc::transport_unavailable,
             "allow_tcp_fallback = false to a peer without a device: " +
                 (sec ? sec.message() : std::string("connected (wrong)")));
      (void)sp;
    }
    // 5. The peer dies during a transfer.
    {
      const std::uint64_t len = 48ull << 20;
      fill_pattern(mem.data, len, 31, 0);
      std::vector<kvlink::transfer_request> reqs{
          {kvlink::opcode::write, mem.data, peer.segment(0), 0, len}};
      kvlink::transfer_options opt;
      opt.deadline = 20s;
      const auto t0 = std::chrono::steady_clock::now();
      bool done = false;
      std::error_code result;
      eng.async_submit_transfer(reqs, opt, [&](std::error_code ec, kvlink::transfer_result) {
        result = ec;
        done = true;
      });
      kvlink::notification die{"die", ""};
      co_await eng.async_send_notification(peer, std::move(die), aw);
      asio::steady_timer t(io);
      while (!done) {
        t.expires_after(10ms);
        co_await t.async_wait(aw);
      }
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      report(result && secs < 20.0,
             fmt::format("peer killed during a 48 MiB WRITE: {} after {:.2f} s",
                         result ? result.message() : std::string("succeeded (wrong)"), secs));
    }
  }
};

int run_client() {
  asio::io_context io;
  kvlink::rdma_engine eng{io.get_executor(),
                          kvlink::config{.listen = env("KVLINK_SELF0", "127.0.0.1") + ":0"}};
  std::printf("client: %s offers %s\n", eng.local_address().c_str(), eng.transports().c_str());
  buffer mem(client_size);
  eng.register_segment(mem.data, mem.size, kvlink::access::remote_read_write);
  client c{io, eng, mem, {}};
  bool finished = false;
  asio::co_spawn(io, c.run(), [&](std::exception_ptr e) {
    finished = true;
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        report(false, std::string("exception: ") + x.what());
      }
    }
  });
  if (!kvlink_test::run_until(
          io, [&] { return finished; }, 400s))
    report(false, "client hung");
  std::printf("client: %d failure(s)\n", failures);
  return failures;
}

// ------------------------------------------------------------------ bench

int run_bench_server() {
  asio::io_context io;
  kvlink::config cfg{.listen = env("KVLINK_SELF0", "127.0.0.1") + ":17003"};
  cfg.rdma_devices = env("KVLINK_BENCH_DEVICES", "rxe0");
  kvlink::rdma_engine eng{io.get_executor(), cfg};
  buffer mem(server_size);
  eng.register_segment(mem.data, mem.size, kvlink::access::remote_read_write);
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        auto [ec, n] = co_await eng.async_receive_notification(aw);
        (void)ec;
        (void)n;
        io.stop();
      },
      asio::detached);
  io.run();
  return 0;
}

// bench SIZE...: for each size, 3 rounds of one transfer of 32 MiB cut into
// SIZE-byte requests; prints "kvlink SIZE GBps" with the median round.
int run_bench(int argc, char** argv) {
  asio::io_context io;
  kvlink::config cfg{.listen = env("KVLINK_SELF0", "127.0.0.1") + ":0"};
  cfg.rdma_devices = env("KVLINK_BENCH_DEVICES", "rxe0");
  kvlink::rdma_engine eng{io.get_executor(), cfg};
  buffer mem(server_size);
  eng.register_segment(mem.data, mem.size, kvlink::access::remote_read_write);
  int rc = 0;
  bool finished = false;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        kvlink::peer p;
        for (int i = 0; i < 100; ++i) {
          auto [ec, pp] = co_await eng.async_connect(env("KVLINK_PEER0") + ":17003", aw);
          if (!ec) {
            p = pp;
            break;
          }
          asio::steady_timer t(io, 200ms);
          co_await t.async_wait(aw);
        }
        if (!p.valid() || p.transport() != "rdma") {
          std::printf("bench: no RDMA peer\n");
          rc = 1;
          co_return;
        }
        for (int a = 2; a < argc; ++a) {
          const std::uint64_t size = std::strtoull(argv[a], nullptr, 10);
          const std::uint64_t total = 32ull << 20;
          if (size == 0 || size > total) continue;
          std::vector<kvlink::transfer_request> reqs;
          for (std::uint64_t off = 0; off + size <= total; off += size) {
            reqs.push_back({kvlink::opcode::write, mem.data + off, p.segment(0), off, size});
          }
          std::vector<double> rates;
          for (int round = 0; round < 3; ++round) {
            const auto t0 = std::chrono::steady_clock::now();
            auto [ec, r] = co_await eng.async_submit_transfer(reqs, aw);
            const double secs =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (ec) {
              std::printf("bench: %s\n", ec.message().c_str());
              rc = 1;
              co_return;
            }
            rates.push_back(static_cast<double>(r.bytes) / secs / 1e9);
          }
          std::sort(rates.begin(), rates.end());
          std::printf("kvlink %llu %.6f GBps (median of 3; min %.6f, max %.6f)\n",
                      static_cast<unsigned long long>(size), rates[1], rates[0], rates[2]);
          std::fflush(stdout);
        }
        kvlink::notification bye{"bye", ""};
        co_await eng.async_send_notification(p, std::move(bye), aw);
      },
      [&](std::exception_ptr) { finished = true; });
  if (!kvlink_test::run_until(
          io, [&] { return finished; }, 400s))
    rc = 1;
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "server") return run_server();
    if (mode == "client") return run_client();
    if (mode == "bench-server") return run_bench_server();
    if (mode == "bench") return run_bench(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvlink_rdma_vm_test %s: %s\n", mode.c_str(), e.what());
    return 2;
  }
  std::fprintf(stderr, "usage: kvlink_rdma_vm_test server|client|bench-server|bench SIZE...\n");
  return 2;
}
