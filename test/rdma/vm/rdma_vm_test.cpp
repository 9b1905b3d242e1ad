// kvlink's RDMA tests between two hosts: run inside the two soft-RoCE VMs by
// run-rdma-tests.sh (ctest label `rdma`), one process per host.
//
//   kvlink_rdma_vm_test server        host 1: targets, verifies on request
//   kvlink_rdma_vm_test client        host 2: runs the scenarios below
//   kvlink_rdma_vm_test bench-server  host 1: a target for `bench`
//   kvlink_rdma_vm_test bench ...     host 2: kvlink RDMA WRITE/READ GB/s per size
//
// Addresses come from run-vm.sh (KVLINK_SELF0, KVLINK_PEER0). The server has
// two engines: an RDMA engine on :17001 and one limited to a device that does
// not exist (so it has none: TCP only) on :17002. It checks its memory when
// the client asks ("check OFFSET LENGTH SEED" notifications; the answer goes
// back as a notification "ok"/"bad ...") and kills itself with SIGKILL on
// "die". Scenarios (each prints PASS/FAIL; the exit status is the number of
// failures):
//   1. the peer uses RDMA; WRITE and READ integrity from 1 B to 8 MiB at odd
//      offsets, verified on the target and read back; a batch of 256 requests;
//      2,000 scattered 4 KiB pieces written and read back (chained work
//      requests)
//   2. one 16 MiB WRITE carried by both rails (rxe0 and rxe1 packet counters)
//   3. rail 1 taken down (ip link set eth1 down) during a 24 MiB WRITE: the
//      transfer completes on rail 0, bytes verified
//   4. fallback: a peer without a device is reached over TCP; with
//      allow_tcp_fallback = false the connection fails with
//      transport_unavailable
//   5. the peer killed during a 48 MiB WRITE: the transfer fails with a clear
//      error within its deadline
//   6. a segment unregistered on the target while chained WRITEs of 4 KiB
//      pieces go into it: the transfer in flight fails with the remote
//      access error of the work request the target's device refused (a bad
//      work request in mid-chain on real verbs), or, once the target's new
//      descriptor has arrived, with not_registered; nothing hangs, and the
//      rebuilt rails carry verified bytes to another segment right after
#include <kvlink/rdma.hpp>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
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
constexpr auto aw = kvlink::control::use_nothrow;

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

// The soft-RoCE devices' non-zero counters (retries, timeouts, drops), printed
// at the first failure: what rxe saw when a transfer stalled.
void print_rxe_counters() {
  std::error_code ec;
  for (const auto& dev : std::filesystem::directory_iterator("/sys/class/infiniband", ec)) {
    const auto dir = dev.path() / "ports" / "1" / "hw_counters";
    std::string line;
    for (const auto& f : std::filesystem::directory_iterator(dir, ec)) {
      std::ifstream in(f.path());
      std::uint64_t v = 0;
      if (in >> v && v != 0) line += " " + f.path().filename().string() + "=" + std::to_string(v);
    }
    std::printf("counters %s:%s\n", dev.path().filename().c_str(), line.c_str());
  }
}

int failures = 0;
void report(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok && failures == 0) print_rxe_counters();
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

// `droppable`: the segment "drop MS" unregisters MS milliseconds later
// (scenario 6), then registers its memory `kept` again as a new segment
// (still allocated: it is checked after, and late bytes land nowhere bad);
// "pieces STRIDE PIECE COUNT SEED1 SEED2" asks
// whether every byte of every piece i of it (at i * STRIDE) is that of the
// pattern of SEED1 or of SEED2.
asio::awaitable<void> serve_checks(kvlink::rdma_engine& eng, buffer& mem, buffer& source,
                                   const char* tag,
                                   std::optional<kvlink::segment_id> droppable = std::nullopt,
                                   buffer* kept = nullptr) {
  std::map<std::string, kvlink::peer> back;  // answers go to the asking engine
  for (;;) {
    auto [ec, n] = co_await eng.async_receive_notification(aw);
    if (ec) co_return;
    if (n.id == "drop" && droppable) {
      const auto ms = std::strtoul(n.payload.c_str(), nullptr, 10);
      asio::steady_timer wait(co_await asio::this_coro::executor, std::chrono::milliseconds(ms));
      co_await wait.async_wait(aw);
      auto [uec] = co_await eng.async_unregister_segment(*droppable, aw);
      // The same memory again, as a new segment, for the next round.
      const auto again =
          eng.register_segment(kept->data, kept->size, kvlink::access::remote_read_write);
      std::printf(
          "server(%s): segment %llu unregistered after %lu ms: %s; registered again as %llu\n", tag,
          static_cast<unsigned long long>(droppable->value()), ms,
          uec ? uec.message().c_str() : "ok", static_cast<unsigned long long>(again.value()));
      std::fflush(stdout);
      droppable = again;
      continue;
    }
    if (n.id == "die") {
      std::printf("server(%s): dying on request\n", tag);
      std::fflush(stdout);
      ::kill(::getpid(), SIGKILL);
    }
    if (n.id == "bye") {
      std::printf("server(%s): bye\n", tag);
      std::exit(0);
    }
    if (n.id != "check" && n.id != "push" && n.id != "pieces") continue;
    std::istringstream in(n.payload);
    std::uint64_t off = 0, len = 0, seed = 0;
    in >> off >> len >> seed;
    auto& p = back[n.from_address];
    if (!p.connected()) {
      auto [cec, np] = co_await eng.async_connect(n.from_address, aw);
      if (cec) {
        std::printf("server(%s): cannot answer %s: %s\n", tag, n.from_address.c_str(),
                    cec.message().c_str());
        continue;
      }
      p = np;
    }
    std::string verdict = "ok";
    if (n.id == "pieces") {
      // off, len, seed read above: STRIDE, PIECE, COUNT; then SEED1 SEED2.
      std::uint64_t seed1 = 0, seed2 = 0;
      in >> seed1 >> seed2;
      const std::uint64_t stride = off, piece = len, count = seed;
      if (!in || kept == nullptr || piece == 0 || stride < piece || count == 0 ||
          count > kept->size / stride) {
        verdict = "bad request";
      }
      // A piece the failed transfer was writing when the segment went may
      // hold both: its first packets landed, the rest were refused. Each
      // byte must be one of the two.
      std::vector<std::byte> one(piece), two(piece);
      std::uint64_t torn = 0;
      for (std::uint64_t i = 0; verdict == "ok" && i < count; ++i) {
        const std::byte* at = kept->data + i * stride;
        fill_pattern(one.data(), piece, seed1, i * stride);
        fill_pattern(two.data(), piece, seed2, i * stride);
        bool a = true, b = true;
        for (std::uint64_t j = 0; j < piece; ++j) {
          a = a && at[j] == one[j];
          b = b && at[j] == two[j];
          if (at[j] != one[j] && at[j] != two[j]) {
            verdict = fmt::format("piece {} holds neither (byte {})", i, j);
            break;
          }
        }
        if (!a && !b) ++torn;
      }
      if (verdict == "ok" && torn > 0) verdict = fmt::format("ok, {} piece(s) torn", torn);
    } else if (n.id == "push") {
      // WRITE the pattern of seed into the asker's first segment at off: the
      // asker is writing to us at the same moment, both paths new.
      if (!in || len > source.size) {
        verdict = "bad request";
      } else {
        fill_pattern(source.data, len, seed, off);
        std::vector<kvlink::transfer_request> reqs{
            {kvlink::opcode::write, source.data, p.segment(0), off, len}};
        auto [tec, r] = co_await eng.async_submit_transfer(reqs, aw);
        if (tec) verdict = "push failed: " + tec.message();
        (void)r;
      }
    } else if (!in || off > mem.size || len > mem.size - off) {
      verdict = "bad request";
    } else if (!is_pattern(mem.data + off, len, seed, off)) {
      verdict = "bad bytes";
    }
    kvlink::notification answer{"result", verdict};
    co_await eng.async_send_notification(p, std::move(answer), aw);
  }
}

int run_server() {
  asio::io_context io;
  const auto self = env("KVLINK_SELF0", "127.0.0.1");
  kvlink::rdma_engine rdma{io.get_executor(), kvlink::config{.listen = self + ":17001"}};
  kvlink::config tcp_only{.listen = self + ":17002"};
  tcp_only.rdma.devices = "no-such-device";
  kvlink::rdma_engine plain{io.get_executor(), tcp_only};
  std::printf("server: %s offers %s; %s offers %s\n", rdma.local_address().c_str(),
              rdma.transports().c_str(), plain.local_address().c_str(), plain.transports().c_str());
  buffer a(server_size), b(server_size), c(8ull << 20), d(8ull << 20), g(8ull << 20);
  rdma.register_segment(a.data, a.size, kvlink::access::remote_read_write);
  plain.register_segment(b.data, b.size, kvlink::access::remote_read_write);
  rdma.register_segment(c.data, c.size, kvlink::access::none);
  plain.register_segment(d.data, d.size, kvlink::access::none);
  // The rdma engine's third segment: unregistered on request (scenario 6).
  const auto dropped = rdma.register_segment(g.data, g.size, kvlink::access::remote_read_write);
  asio::co_spawn(io, serve_checks(rdma, a, c, "rdma", dropped, &g), asio::detached);
  asio::co_spawn(io, serve_checks(plain, b, d, "tcp"), asio::detached);
  // An RDMA engine that authenticates its peers (scenario 4d).
  kvlink::config secured_cfg{.listen = self + ":17004"};
  secured_cfg.auth_secret = "vm-secret";
  kvlink::rdma_engine secured{io.get_executor(), secured_cfg};
  buffer e(8ull << 20), f(1ull << 20);
  secured.register_segment(e.data, e.size, kvlink::access::remote_read_write);
  secured.register_segment(f.data, f.size, kvlink::access::none);
  asio::co_spawn(io, serve_checks(secured, e, f, "secured"), asio::detached);
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

  // 2,000 pieces of 4 KiB at scattered offsets (a gap of 8 KiB after each;
  // the local ones in reverse order), WRITE in one transfer, checked on the
  // target, then READ back in one transfer into zeroed memory: nothing
  // coalesces, so the small slices go out as chains of work requests, and
  // one completion retires many of them.
  asio::awaitable<void> scattered_pieces() {
    constexpr std::uint64_t pieces = 2000, piece = 4096, stride = 3 * piece, seed = 61;
    constexpr std::uint64_t base = 24ull << 20;  // [24 MiB, 48 MiB + 4 KiB) on both sides
    const auto remote_of = [](std::uint64_t i) { return base + i * stride; };
    const auto local_of = [](std::uint64_t i) { return base + (pieces - 1 - i) * stride + piece; };
    std::vector<kvlink::transfer_request> writes, reads;
    for (std::uint64_t i = 0; i < pieces; ++i) {
      fill_pattern(mem.data + local_of(i), piece, seed, remote_of(i));
      writes.push_back(
          {kvlink::opcode::write, mem.data + local_of(i), peer.segment(0), remote_of(i), piece});
      reads.push_back(
          {kvlink::opcode::read, mem.data + local_of(i), peer.segment(0), remote_of(i), piece});
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto [wec, wr] = co_await eng.async_submit_transfer(writes, aw);
    const double wsecs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string verdict = wec ? "WRITE failed: " + wec.message() : "ok";
    if (!wec && wr.bytes != pieces * piece) verdict = fmt::format("WRITE moved {} B", wr.bytes);
    // The target checks every 40th piece and the last.
    std::vector<std::uint64_t> sample;
    for (std::uint64_t i = 0; i < pieces; i += 40) sample.push_back(i);
    sample.push_back(pieces - 1);
    for (const auto i : sample) {
      if (verdict != "ok") break;
      const auto v = co_await check(eng, peer, remote_of(i), piece, seed);
      if (v != "ok") verdict = fmt::format("piece {} at {}: target says {}", i, remote_of(i), v);
    }
    for (std::uint64_t i = 0; i < pieces; ++i) std::memset(mem.data + local_of(i), 0, piece);
    const auto t1 = std::chrono::steady_clock::now();
    auto [rec, rr] = co_await eng.async_submit_transfer(reads, aw);
    const double rsecs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    std::uint64_t intact = 0;
    for (std::uint64_t i = 0; i < pieces; ++i) {
      if (is_pattern(mem.data + local_of(i), piece, seed, remote_of(i))) ++intact;
    }
    report(
        verdict == "ok" && !rec && rr.bytes == pieces * piece && intact == pieces,
        fmt::format("2000 x 4 KiB scattered: WRITE {} in {:.2f} s; READ back {} ({} B) in "
                    "{:.2f} s, {} of {} pieces intact",
                    verdict, wsecs, rec ? rec.message() : "ok", rr.bytes, rsecs, intact, pieces));
  }

  // 6. The target unregisters a segment while this engine WRITEs 500
  // scattered 4 KiB pieces into it, transfer after transfer (chains of work
  // requests, one signaled per 16; the target unregisters it 2.5 transfers'
  // time after the first completed). The transfer in flight then fails:
  // with the work completion of the request the target's device refused
  // (remote access error; those before it in its chain completed, those
  // after it are flushed), or, where the target's new descriptor arrived
  // first, refused here with not_registered: which one comes first is a
  // race, so three rounds (the target registers the memory again as a new
  // segment after each) and each says which it saw. Transfer k of a round
  // writes the pattern of its seed k % 3 (three local copies): once the
  // failure is in, every piece of the segment must hold the last completed
  // transfer's bytes or the failed one's (or both: a piece being written
  // when the segment went, its first packets placed); a transfer reported complete
  // without its bytes would leave the third seed's pieces there. After it,
  // the same engine's next transfers to a live segment arrive whole (the
  // rails rebuilt).
  asio::awaitable<void> unregistered_mid_transfer() {
    std::uint64_t gone = 0;  // the segment of the round before
    for (std::uint64_t round = 0; round < 3; ++round) {
      // The segment at index 2: a new one each round (the target's
      // descriptor after its registration again).
      for (int i = 0; i < 200; ++i) {
        const auto segs = peer.segments();
        if (segs.size() >= 3 && segs[2].id.value() != gone) break;
        asio::steady_timer pause(io, 50ms);
        co_await pause.async_wait(aw);
      }
      const auto segs = peer.segments();
      if (segs.size() < 3 || segs[2].id.value() == gone) {
        report(false, fmt::format("scenario 6, round {}: no new segment from the target ({} "
                                  "segments)",
                                  round, segs.size()));
        co_return;
      }
      const auto g = peer.segment(2);
      gone = segs[2].id.value();
      co_await unregistered_round(round, g);
    }
    // Its descriptor has it no more (or its device refuses it): a READ from
    // it fails too, at once.
    std::vector<kvlink::transfer_request> one{
        {kvlink::opcode::read, mem.data,
         kvlink::remote_segment{peer.id(), kvlink::segment_id{gone}}, 0, 4096}};
    kvlink::transfer_options opt;
    opt.deadline = 20s;
    auto [rec, rr] = co_await eng.async_submit_transfer(one, opt, aw);
    (void)rr;
    report(rec == kvlink::errc::not_registered ||
               (rec.category() == kvlink::rdma::wc_status_category() &&
                rec.value() == IBV_WC_REM_ACCESS_ERR),
           "READ from the unregistered segment: " +
               (rec ? rec.message() : std::string("succeeded (wrong)")));
    // The same engine and peer, the live segment: whole, at once.
    co_await round_trip(60ull << 20, 1ull << 20, 82);
  }

  asio::awaitable<void> unregistered_round(std::uint64_t round, kvlink::remote_segment g) {
    constexpr std::uint64_t pieces = 500, piece = 4096, stride = 2 * piece;
    constexpr std::uint64_t local = 48ull << 20, region = 4ull << 20;  // 3 regions here
    const std::uint64_t seed0 = 81 + 3 * round;
    std::array<std::vector<kvlink::transfer_request>, 3> writes;
    for (std::uint64_t r = 0; r < 3; ++r) {
      for (std::uint64_t i = 0; i < pieces; ++i) {
        std::byte* at = mem.data + local + r * region + (pieces - 1 - i) * piece;
        fill_pattern(at, piece, seed0 + r, i * stride);
        writes[r].push_back({kvlink::opcode::write, at, g, i * stride, piece});
      }
    }
    kvlink::transfer_options opt;
    opt.deadline = 20s;
    std::error_code failed;
    std::uint64_t done = 0;
    auto t0 = std::chrono::steady_clock::now();
    const auto since = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    // One transfer first (its time sets when the target unregisters: in
    // the middle of a later one), then the rest back to back.
    bool asked = false;
    while (done < 20000 && since() < 60.0) {
      auto [ec, r] = co_await eng.async_submit_transfer(writes[done % 3], opt, aw);
      if (!ec && r.bytes != pieces * piece) ec = kvlink::errc::malformed_message;
      if (ec) {
        failed = ec;
        break;
      }
      ++done;
      if (!asked) {
        const auto ms = static_cast<long>(since() * 1000 * 2.5) + 1;
        kvlink::notification drop{"drop", std::to_string(ms)};
        co_await eng.async_send_notification(peer, std::move(drop), aw);
        asked = true;
        t0 = std::chrono::steady_clock::now();
      }
    }
    const double secs = since();
    const bool refused_there = failed.category() == kvlink::rdma::wc_status_category() &&
                               failed.value() == IBV_WC_REM_ACCESS_ERR;
    const bool refused_here = failed == kvlink::errc::not_registered;
    // Named, not a temporary inside co_await (g++ 12).
    kvlink::notification ask{"pieces", fmt::format("{} {} {} {} {}", stride, piece, pieces,
                                                   seed0 + (done - 1) % 3, seed0 + done % 3)};
    auto [sec] = co_await eng.async_send_notification(peer, std::move(ask), aw);
    auto [rec, n] = co_await eng.async_receive_notification(aw);
    const std::string bytes = sec   ? "send failed: " + sec.message()
                              : rec ? "no answer: " + rec.message()
                                    : n.payload;
    report((refused_there || refused_here) && bytes.starts_with("ok"),
           fmt::format("segment unregistered on the target during chained 4 KiB WRITEs into it "
                       "(round {}): {} transfers of {} pieces completed, then {} ({}) after "
                       "{:.2f} s; the target's pieces: {}",
                       round + 1, done, pieces, failed ? failed.message() : "none failed (wrong)",
                       refused_there  ? "its device refused a work request"
                       : refused_here ? "refused here: the target's new descriptor"
                                      : "unexpected",
                       secs, bytes));
  }

  asio::awaitable<void> run() {
    const auto target = env("KVLINK_PEER0", "127.0.0.1");
    // 1. RDMA chosen; integrity across sizes.
    {
      // The server may still be starting (a loaded host boots the VMs slowly).
      auto [ec, p] = co_await eng.async_connect(target + ":17001", aw);
      for (int i = 0; ec == kvlink::errc::peer_unreachable && i < 120; ++i) {
        asio::steady_timer pause(io, 500ms);
        co_await pause.async_wait(aw);
        std::tie(ec, p) = co_await eng.async_connect(target + ":17001", aw);
      }
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
      co_await scattered_pieces();
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
    // 4d. Authentication over the real path: the same secret gets RDMA and
    // bytes verified; a wrong secret and no secret are refused.
    {
      kvlink::config good{.listen = env("KVLINK_SELF0", "127.0.0.1") + ":0"};
      good.auth_secret = "vm-secret";
      kvlink::rdma_engine e5{io.get_executor(), good};
      buffer m5(4ull << 20);
      e5.register_segment(m5.data, m5.size, kvlink::access::remote_read_write);
      auto [ec, p] = co_await e5.async_connect(target + ":17004", aw);
      bool ok = !ec && p.transport() == "rdma";
      std::string verdict = "-";
      if (ok) {
        fill_pattern(m5.data, m5.size, 51, 0);
        std::vector<kvlink::transfer_request> reqs{
            {kvlink::opcode::write, m5.data, p.segment(0), 0, m5.size}};
        auto [tec, r] = co_await e5.async_submit_transfer(reqs, aw);
        (void)r;
        // No co_await inside a conditional expression: g++ 12 mishandles it.
        if (tec) {
          verdict = tec.message();
        } else {
          verdict = co_await check(e5, p, 0, m5.size, 51);
        }
        ok = verdict == "ok";
      }
      std::vector<std::string> refusals;
      const std::array<std::string, 2> secrets{"wrong", ""};
      for (const auto& secret : secrets) {
        kvlink::config bad{.listen = env("KVLINK_SELF0", "127.0.0.1") + ":0"};
        bad.auth_secret = secret;
        kvlink::rdma_engine e6{io.get_executor(), bad};
        auto [bec, bp] = co_await e6.async_connect(target + ":17004", aw);
        (void)bp;
        std::string refusal = "connected (wrong)";
        if (bec) refusal = bec.message();
        refusals.push_back(refusal);
        ok = ok && bec == kvlink::errc::authentication_failed;
      }
      report(ok, fmt::format("authenticated RDMA peer: connect {}, transport {}, 4 MiB WRITE "
                             "target says {}; wrong secret: {}; no secret: {}",
                             ec ? ec.message() : "ok", ec ? "-" : p.transport(), verdict,
                             refusals[0], refusals[1]));
    }
    // 4b. Both directions at once, both paths new: a fresh engine asks the
    // server to WRITE into it while it WRITEs to the server; the two
    // engines' queue-pair set-ups cross.
    {
      kvlink::rdma_engine e4{io.get_executor(),
                             kvlink::config{.listen = env("KVLINK_SELF0", "127.0.0.1") + ":0"}};
      buffer m4(16ull << 20);
      e4.register_segment(m4.data, m4.size, kvlink::access::remote_read_write);
      auto [ec, p] = co_await e4.async_connect(target + ":17001", aw);
      if (!ec) {
        const std::uint64_t len = 8ull << 20, mine = 24ull << 20;
        std::memset(m4.data, 0, len);
        fill_pattern(m4.data + len, len, 41, mine);
        kvlink::notification push{"push", fmt::format("{} {} {}", 0, len, 42)};
        co_await e4.async_send_notification(p, std::move(push), aw);
        std::vector<kvlink::transfer_request> reqs{
            {kvlink::opcode::write, m4.data + len, p.segment(0), mine, len}};
        auto [tec, r] = co_await e4.async_submit_transfer(reqs, aw);
        auto [rec, pushed] = co_await e4.async_receive_notification(aw);
        const bool arrived = !rec && pushed.payload == "ok" && is_pattern(m4.data, len, 42, 0);
        const auto verdict = co_await check(e4, p, mine, len, 41);
        report(!tec && verdict == "ok" && arrived,
               fmt::format("8 MiB each way at once on new paths: ours {} (target says {}), "
                           "theirs {} (bytes {})",
                           tec ? tec.message() : "ok", verdict,
                           rec ? rec.message() : pushed.payload, arrived ? "verified" : "WRONG"));
        (void)r;
      } else {
        report(false, "connect for the two-way test: " + ec.message());
      }
    }
    // 4c. Hostile rdma_connect requests on a raw control connection: each is
    // refused with rdma_reject, and the server goes on serving.
    {
      asio::ip::tcp::socket s(io);
      asio::ip::tcp::resolver res(io);
      auto [rec, eps] = co_await res.async_resolve(target, "17001", aw);
      auto [cec, ep] = co_await asio::async_connect(s, eps, aw);
      (void)ep;
      nlohmann::json welcome;
      std::error_code hec = rec ? rec : cec;
      if (!hec) {
        hec = co_await kvlink::control::write_message(
            s, kvlink::control::make_hello(kvlink::protocol_version, kvlink::make_instance_id(),
                                           kvlink::control::role::control, 0, std::nullopt,
                                           "10.77.1.2:1"));
      }
      if (!hec) hec = co_await kvlink::control::read_message(s, 1 << 20, welcome);
      const auto gid = welcome.value("descriptor", nlohmann::json{})
                           .value("transports", nlohmann::json{})
                           .value("rdma", nlohmann::json{})
                           .value("ports", nlohmann::json::array());
      const std::string good_gid = gid.empty() ? "" : gid[0].value("gid", std::string{});
      auto qps = [](std::size_t n, std::uint64_t qpn) {
        auto a = nlohmann::json::array();
        for (std::size_t i = 0; i < n; ++i) a.push_back({{"qpn", qpn}, {"psn", 1u}});
        return a;
      };
      auto base = [&](nlohmann::json q) {
        return nlohmann::json{
            {"type", "rdma_connect"}, {"rail", 0u},   {"gen", 1u},          {"port", 0u},
            {"gid", good_gid},        {"mtu", 1024u}, {"qps", std::move(q)}};
      };
      std::vector<nlohmann::json> bad;
      bad.push_back(base(qps(1, 17)));
      bad.back()["port"] = 99u;
      bad.push_back(base(qps(1, 17)));
      bad.back()["mtu"] = 3u;
      bad.push_back(base(qps(1, 17)));
      bad.back()["gid"] = "zz";
      bad.push_back(base(qps(65, 17)));
      bad.push_back(base(qps(1, 1ull << 25)));
      bad.push_back(base(qps(1, 17)));
      bad.back().erase("rail");
      bad.push_back(base(qps(1, 17)));
      bad.back()["rail"] = 5000u;
      bad.push_back(base(nlohmann::json{{"qpn", "x"}}));
      int rejected = 0;
      for (auto& m : bad) {
        if (hec) break;
        hec = co_await kvlink::control::write_message(
            s, kvlink::control::make_transport_message("rdma", m));
        nlohmann::json reply;
        if (!hec) hec = co_await kvlink::control::read_message(s, 1 << 20, reply);
        std::string from;
        const nlohmann::json* body = nullptr;
        if (!hec && kvlink::control::parse_transport_message(reply, from, body) && from == "rdma" &&
            body->value("type", std::string{}) == "rdma_reject") {
          ++rejected;
        }
      }
      report(!hec && rejected == static_cast<int>(bad.size()) && !good_gid.empty(),
             fmt::format("{} hostile rdma_connect requests: {} refused with rdma_reject{}",
                         bad.size(), rejected, hec ? " (" + hec.message() + ")" : ""));
      co_await round_trip(4ull << 20, 64ull << 10, 43);  // the server still serves
    }
    // 6 (before 5, which ends the server).
    co_await unregistered_mid_transfer();
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

// The bench engines: one device (KVLINK_BENCH_DEVICES, default rxe0, the one
// ib_write_bw uses), one registered buffer.
kvlink::config bench_config(const char* port) {
  kvlink::config cfg{.listen = env("KVLINK_SELF0", "127.0.0.1") + port};
  cfg.rdma.devices = env("KVLINK_BENCH_DEVICES", "rxe0");
  return cfg;
}

int run_bench_server() {
  asio::io_context io;
  kvlink::rdma_engine eng{io.get_executor(), bench_config(":17003")};
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

// bench [write|read] [contiguous|scattered] SIZE...: for each size, 3
// rounds of one transfer of 32 MiB in SIZE-byte requests; prints
// "kvlink[-read][-scattered] SIZE GBps" with the median round. The words
// apply to the sizes after them (default: write, contiguous). Contiguous
// requests are adjacent on both sides, so the planner coalesces them into
// runs and cuts those into its own slices (1 MiB): SIZE is then only the
// request size, not what goes on the wire. Scattered requests leave a gap of
// SIZE bytes after each one (on both sides; the local ones in reverse order),
// so nothing coalesces and each request is one slice of SIZE bytes: small
// pieces on the wire, as with tensor parallelism. "cpu" is the median of the
// rounds' CPU time of this process (user + system, so the kernel's share of
// posting too) per GB moved: where the emulated wire is the bottleneck, GB/s
// hides what a work request costs, CPU time does not.
int run_bench(int argc, char** argv) {
  asio::io_context io;
  kvlink::rdma_engine eng{io.get_executor(), bench_config(":0")};
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
        auto op = kvlink::opcode::write;
        bool scattered = false;
        for (int a = 2; a < argc; ++a) {
          const std::string word = argv[a];
          if (word == "write" || word == "read") {
            op = word == "read" ? kvlink::opcode::read : kvlink::opcode::write;
            continue;
          }
          if (word == "contiguous" || word == "scattered") {
            scattered = word == "scattered";
            continue;
          }
          const std::uint64_t size = std::strtoull(argv[a], nullptr, 10);
          const std::uint64_t total = 32ull << 20;
          if (size == 0 || size > total) continue;
          // Scattered: 2 x 32 MiB fits the 64 MiB buffers on both sides.
          const std::uint64_t stride = scattered ? 2 * size : size, n = total / size;
          std::vector<kvlink::transfer_request> reqs;
          for (std::uint64_t i = 0; i < n; ++i) {
            const std::uint64_t remote = i * stride;
            const std::uint64_t local = scattered ? (n - 1 - i) * stride : remote;
            reqs.push_back({op, mem.data + local, p.segment(0), remote, size});
          }
          std::vector<double> rates, cpu;
          for (int round = 0; round < 3; ++round) {
            const double c0 = kvlink_test::process_cpu_seconds();
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
            cpu.push_back((kvlink_test::process_cpu_seconds() - c0) /
                          (static_cast<double>(r.bytes) / 1e9));
          }
          std::sort(rates.begin(), rates.end());
          std::sort(cpu.begin(), cpu.end());
          std::printf(
              "kvlink%s%s %llu %.6f GBps (median of 3; min %.6f, max %.6f; cpu %.2f s/GB)\n",
              op == kvlink::opcode::read ? "-read" : "", scattered ? "-scattered" : "",
              static_cast<unsigned long long>(size), rates[1], rates[0], rates[2], cpu[1]);
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
  std::fprintf(stderr,
               "usage: kvlink_rdma_vm_test server|client|bench-server|bench [write|read] "
               "[contiguous|scattered] SIZE...\n");
  return 2;
}
