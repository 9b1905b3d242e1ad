// kvlink_store_bench: the store (include/kvlink/store/) end to end on one
// host: a kvlink-master child process, a serving child process that mounts a
// segment into the pool, and measuring store clients in this process.
//
//   kvlink_store_bench                              # every row, TCP, 2 s each
//   kvlink_store_bench --rows put-c1,get-c4-b --seconds 1 --clients 8
//   kvlink_store_bench --transports tcp,shm --json out.json
//   kvlink_store_bench --list                       # the rows' names
//   kvlink_store_bench --rebuild 10000,100000,1000000   # master restarts (below)
//   kvlink_store_bench --disk /nvme/tmp                 # the SSD tier against the disk
//
// Two sections per transport:
//  - ops: keys per second of 4 KiB put, get and exists from 1 client and from
//    --clients clients, each keeping --depths calls of one key in flight, or
//    one call of --batch keys. Puts write fresh keys (vLLM-like names:
//    "qwen3-8b@tp_rank:0@pp_rank:0@<16 hex>"); gets and exists ask for keys
//    put before the row. Beside the rate: the mean call latency and the CPU
//    time per key of the master, of this process and of the serving process
//    (utime + stime from /proc/<pid>/stat before and after the row). Rows
//    "write"/"read" are the raw engine moving the same 4 KiB, for reference.
//  - bw: GB/s of put and get of KV-sized objects, one 16-token Qwen3-8B block
//    (2359296 B, one key per call) and its per-layer pieces (65536 B, the 36
//    layers of a block in one batched call), --bw-depth calls in flight from
//    one client, each against the raw engine WRITE/READ of the same requests
//    between the same two processes (this process's engine and the serving
//    process's, into a segment of its own), measured right after; store/raw is
//    the ratio.
//
// --rebuild replaces the sections: how long a restarted master takes to get
// N objects back from their owner's records, against N (see rebuild()).
// --disk DIR replaces them too: the SSD tier's eviction to disk and gets of
// disk-only objects against the same disk's own sequential rate
// (disk_section()).
//
// Each client has its own engine; the engines share one io_context run by
// --threads threads. The serving process is this program re-executed with the
// hidden --serve role. Figures are steady state: the counts between a
// snapshot taken after a warm-up and one taken --seconds later.
//
// Units: GB = 10^9 B, GiB = 2^30 B, KiB = 2^10 B, MiB = 2^20 B; us = 10^-6 s.
#include <kvlink/engine.hpp>
#include <kvlink/store/client/client.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "disk_reference.hpp"
#include <CLI/CLI.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/use_future.hpp>
#include <fcntl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef KVLINK_STORE_BENCH_MASTER
#define KVLINK_STORE_BENCH_MASTER "kvlink-master"
#endif

namespace {

using namespace std::chrono_literals;
namespace kb = kvlink::bench;
namespace store = kvlink::store;
using clock_type = std::chrono::steady_clock;

constexpr std::uint64_t kib = 1024;
constexpr std::uint64_t mib = 1024 * kib;
constexpr std::uint64_t block_bytes =
    2359296;  // 16 tokens of Qwen3-8B: 36 layers x K,V x 8 x 128 x bf16
constexpr unsigned block_layers = 36;
constexpr std::uint64_t layer_bytes = block_bytes / block_layers;  // 65536
constexpr int bw_rounds = 4;  // store and raw alternate this many times per bw row
constexpr std::string_view key_prefix = "qwen3-8b@tp_rank:0@pp_rank:0@";

struct options {
  std::string master_bin = KVLINK_STORE_BENCH_MASTER;
  double seconds = 2.0;
  std::string rows;
  unsigned clients = 4;
  std::string depths = "1,16";
  unsigned batch = 128;
  unsigned bw_depth = 4;
  std::string transports = "tcp";
  unsigned threads = 2;
  unsigned master_threads = 2;
  unsigned server_threads = 1;
  std::uint64_t pool = 1024 * mib;
  std::uint64_t raw = 64 * mib;
  std::string json;
  bool list = false;
  // --rebuild: master restarts against the number of keys.
  std::string rebuild;
  std::uint64_t rebuild_size = 1024;
  // --disk: the SSD tier against the disk.
  std::string disk;
  std::string disk_sizes = "64KiB,1MiB,2304KiB";
  std::uint64_t disk_bytes = 2048 * mib;
  std::uint64_t disk_pool = 512 * mib;
  unsigned disk_depth = 4;
  unsigned disk_batch = 8;
  unsigned disk_lease_ms = 1000;
  // The hidden serving role.
  bool serve = false;
  std::string master;
};

// ------------------------------------------------------------------ processes

/// CPU seconds (utime + stime) of a process so far, from /proc/<pid>/stat;
/// 0 when it cannot be read.
double cpu_seconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream fields(stat.substr(paren + 1));
  std::string f;
  unsigned long long utime = 0, stime = 0;
  // After the command come fields 3 (state) .. ; utime is 14, stime 15.
  for (int i = 3; i <= 15 && fields >> f; ++i) {
    if (i == 14) utime = std::stoull(f);
    if (i == 15) stime = std::stoull(f);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

/// An io_context run by `threads` threads (at least one) until this is
/// destroyed; what uses it must be gone by then.
struct io_runners {
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> guard = asio::make_work_guard(io);
  std::vector<std::thread> threads;
  explicit io_runners(unsigned n) {
    for (unsigned i = 0; i < std::max(1u, n); ++i) threads.emplace_back([this] { io.run(); });
  }
  ~io_runners() {
    guard.reset();
    for (auto& t : threads) t.join();
  }
  io_runners(const io_runners&) = delete;
  io_runners& operator=(const io_runners&) = delete;
};

/// A child process with pipes on its stdin and stdout whose first line says
/// it is ready. Destruction closes its stdin, sends `stop_signal` (0: none)
/// and reaps it (SIGKILL after 10 s). It dies with this process
/// (PR_SET_PDEATHSIG).
class child {
 public:
  child(const std::string& exe, std::vector<std::string> args, std::string_view ready,
        int stop_signal)
      : stop_signal_(stop_signal) {
    std::signal(SIGPIPE, SIG_IGN);
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) {
      throw std::system_error(errno, std::generic_category(), "pipe2");
    }
    args.insert(args.begin(), exe);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) throw std::system_error(errno, std::generic_category(), "fork");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      ::dup2(in[0], STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      ::execv(argv[0], argv.data());
      std::perror(argv[0]);
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
    // The first line, within 60 s.
    std::string line;
    const auto until = clock_type::now() + 60s;
    for (;;) {
      const auto nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        line = buffer_.substr(0, nl);
        break;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(until - clock_type::now());
      pollfd p{from_, POLLIN, 0};
      if (left <= 0ms || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
      char chunk[512];
      const auto n = ::read(from_, chunk, sizeof chunk);
      if (n <= 0) break;
      buffer_.append(chunk, static_cast<std::size_t>(n));
    }
    if (line.rfind(ready, 0) != 0) {
      stop();
      throw std::runtime_error(exe + " did not start (its first line: '" + line + "')");
    }
    rest_ = line.substr(ready.size());
  }
  ~child() { stop(); }
  child(const child&) = delete;
  child& operator=(const child&) = delete;

  pid_t pid() const noexcept { return pid_; }
  /// The first line after its `ready` prefix.
  const std::string& rest() const noexcept { return rest_; }

 private:
  void stop() {
    if (to_ >= 0) ::close(to_);
    to_ = -1;
    if (pid_ > 0) {
      if (stop_signal_ != 0) ::kill(pid_, stop_signal_);
      int status = 0;
      const auto until = clock_type::now() + 10s;
      while (::waitpid(pid_, &status, WNOHANG) == 0) {
        if (clock_type::now() > until) {
          ::kill(pid_, SIGKILL);
          ::waitpid(pid_, &status, 0);
          break;
        }
        std::this_thread::sleep_for(5ms);
      }
      pid_ = -1;
    }
    // The stdout pipe stays open until here: a child that prints later never
    // gets SIGPIPE.
    if (from_ >= 0) ::close(from_);
    from_ = -1;
  }

  int stop_signal_ = 0;
  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  std::string buffer_;
  std::string rest_;
};

// ------------------------------------------------------------------ rebuild

/// Resident set of a process in bytes (VmRSS), 0 when unreadable.
std::uint64_t rss_bytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // kB
  }
  return 0;
}

/// --rebuild N,N,...: for each N, a master child and one owner client in
/// this process (its own segment); N objects of --rebuild-size bytes are put
/// in batches, the master is SIGKILLed and started again on the same port,
/// and the owner mounts again with its records. Prints per N: the put rate,
/// the owner's scan of its segment (measured here, the same function the
/// client runs), the time from the new master's ready line until its stats
/// count N objects, and the master's RSS per key before and after.
int rebuild(const options& o) {
  std::vector<std::uint64_t> counts;
  for (const auto n : kb::split_list(o.rebuild)) counts.push_back(std::stoull(std::string(n)));
  io_runners run_io(o.threads);
  asio::io_context& io = run_io.io;
  fmt::print(
      "# master restart with N objects of {} B in one owner's segment (this host, one client; "
      "keys \"{}<16 hex>\")\n"
      "# put k/s: batched puts of 1024; scan ms: the owner's scan of its segment for records; "
      "rebuild s: new master ready -> its stats count N; RSS B/key: the master's resident set "
      "per object before the kill and after the rebuild\n",
      o.rebuild_size, key_prefix);
  fmt::print("{:>9} {:>10} {:>10} {:>9} {:>11} {:>13} {:>13}\n", "N", "pool MiB", "put k/s",
             "scan ms", "rebuild s", "RSS B/key", "RSS after");
  int status = 0;
  for (const auto n : counts) {
    std::uint16_t port = 0;
    {
      asio::ip::tcp::acceptor a(io, {asio::ip::make_address("127.0.0.1"), 0});
      port = a.local_endpoint().port();
    }
    const std::string listen = "127.0.0.1:" + std::to_string(port);
    const std::vector<std::string> margs{"--listen", listen, "--threads",
                                         std::to_string(o.master_threads)};
    const std::string ready = "kvlink-master: listening on ";
    auto m = std::make_unique<child>(o.master_bin, margs, ready, SIGKILL);
    const std::uint64_t key_len = key_prefix.size() + 16;
    const std::uint64_t foot = kvlink::store::wire::object_footprint(o.rebuild_size, key_len);
    const std::uint64_t pool_bytes = (n * foot) / 10 * 12 + 16 * mib;  // below the watermark
    kb::page_buffer pool(pool_bytes);
    constexpr std::size_t batch = 1024;
    kb::page_buffer src(batch * o.rebuild_size);
    std::memset(src.data(), 0x5a, src.size());
    double put_rate = 0, rebuild_s = 0, scan_ms = 0;
    std::uint64_t rss_before = 0, rss_after = 0;
    try {
      kvlink::engine eng{io.get_executor(),
                         kvlink::config{.listen = "127.0.0.1:0", .transports = o.transports}};
      eng.register_segment(src.data(), src.size());
      store::client c{eng, {.master = listen}};
      c.async_mount(pool.data(), pool.size(), asio::use_future).get();
      std::vector<std::string> keys(batch);
      std::vector<std::string_view> views(batch);
      std::vector<const void*> data(batch);
      std::vector<std::uint64_t> sizes(batch, o.rebuild_size);
      std::vector<std::error_code> results(batch);
      const auto t0 = clock_type::now();
      for (std::uint64_t done = 0; done < n;) {
        const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(batch, n - done));
        for (std::size_t i = 0; i < k; ++i) {
          keys[i] = fmt::format("{}{:016x}", key_prefix, done + i);
          views[i] = keys[i];
          data[i] = src.data() + i * o.rebuild_size;
        }
        c.async_put_batch(std::span(views.data(), k), std::span(data.data(), k),
                          std::span(sizes.data(), k), std::span(results.data(), k), {},
                          std::span<const std::string_view>{}, asio::use_future)
            .get();
        for (std::size_t i = 0; i < k; ++i) {
          if (results[i]) throw std::system_error(results[i], "put " + keys[i]);
        }
        done += k;
      }
      put_rate =
          static_cast<double>(n) / std::chrono::duration<double>(clock_type::now() - t0).count();
      rss_before = rss_bytes(m->pid());
      m.reset();  // SIGKILL
      m = std::make_unique<child>(o.master_bin, margs, ready, SIGKILL);
      const auto up = clock_type::now();
      for (;;) {
        const auto st = c.async_stats(asio::use_future).get();
        if (st.objects >= n) break;
        if (clock_type::now() - up > 600s) throw std::runtime_error("no rebuild within 600 s");
        std::this_thread::sleep_for(2ms);
      }
      rebuild_s = std::chrono::duration<double>(clock_type::now() - up).count();
      rss_after = rss_bytes(m->pid());
      const auto s0 = clock_type::now();
      std::uint64_t found = 0;
      (void)kvlink::store::wire::scan_records(
          pool.data(), pool.size(), 65535, false, false,
          [&](const kvlink::store::wire::found_object&) { ++found; });
      scan_ms = std::chrono::duration<double, std::milli>(clock_type::now() - s0).count();
      if (found != n) throw std::runtime_error(fmt::format("the scan found {} of {}", found, n));
      c.async_close(asio::use_future).get();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kvlink_store_bench --rebuild %llu: %s\n",
                   static_cast<unsigned long long>(n), e.what());
      status = 1;
      continue;
    }
    fmt::print("{:>9} {:>10.0f} {:>10.1f} {:>9.1f} {:>11.3f} {:>13.0f} {:>13.0f}\n", n,
               static_cast<double>(pool_bytes) / static_cast<double>(mib), put_rate / 1e3, scan_ms,
               rebuild_s, static_cast<double>(rss_before) / static_cast<double>(n),
               static_cast<double>(rss_after) / static_cast<double>(n));
    std::fflush(stdout);
  }
  return status;
}

// ------------------------------------------------------------------ the serving role

/// --serve: mounts a pool segment of --pool bytes, registers a raw segment of
/// --raw bytes for the engine reference, prints
/// "SERVE <engine address> <raw segment id> <raw bytes>" and serves until its
/// stdin closes.
int serve(const options& o) {
  kb::page_buffer pool(o.pool);
  kb::page_buffer raw(o.raw);
  io_runners run_io(o.server_threads);
  asio::io_context& io = run_io.io;
  int status = 0;
  {
    kvlink::engine eng{io.get_executor(),
                       kvlink::config{.listen = "127.0.0.1:0", .transports = o.transports}};
    const auto raw_id = eng.register_segment(raw.data(), raw.size());
    store::client c{eng, {.master = o.master}};
    try {
      c.async_mount(pool.data(), pool.size(), asio::use_future).get();
      std::printf("SERVE %s %llu %llu\n", eng.local_address().c_str(),
                  static_cast<unsigned long long>(raw_id.value()),
                  static_cast<unsigned long long>(raw.size()));
      std::fflush(stdout);
      char sink[256];
      while (::read(STDIN_FILENO, sink, sizeof sink) > 0) {
      }
      c.async_close(asio::use_future).get();
    } catch (const std::system_error& e) {
      std::fprintf(stderr, "kvlink_store_bench --serve: %s\n", e.what());
      std::printf("ERROR %s\n", e.what());
      std::fflush(stdout);
      status = 1;
    }
  }
  return status;
}

// ------------------------------------------------------------------ rows

enum class op_kind { put, get, exists, write, read };

const char* name_of(op_kind op) {
  switch (op) {
    case op_kind::put:
      return "put";
    case op_kind::get:
      return "get";
    case op_kind::exists:
      return "exists";
    case op_kind::write:
      return "write";
    case op_kind::read:
      return "read";
  }
  return "?";
}

struct row_spec {
  std::string name;
  bool bandwidth = false;  ///< section bw: measured beside its raw twin
  op_kind op = op_kind::put;
  std::uint64_t size = 4 * kib;
  unsigned clients = 1;
  unsigned depth = 1;
  unsigned batch = 1;
};

std::vector<row_spec> all_rows(const options& o, const std::vector<unsigned>& depths) {
  std::vector<row_spec> rows;
  std::vector<unsigned> clients{1};
  if (o.clients > 1) clients.push_back(o.clients);
  for (const op_kind op : {op_kind::put, op_kind::get, op_kind::exists}) {
    for (const unsigned c : clients) {
      for (const unsigned d : depths) {
        rows.push_back({fmt::format("{}-c{}-d{}", name_of(op), c, d), false, op, 4 * kib, c, d, 1});
      }
      rows.push_back(
          {fmt::format("{}-c{}-b{}", name_of(op), c, o.batch), false, op, 4 * kib, c, 1, o.batch});
    }
  }
  // The raw engine on the same 4 KiB, at both ends of the one-at-a-time range.
  const unsigned deepest = *std::max_element(depths.begin(), depths.end());
  for (const op_kind op : {op_kind::write, op_kind::read}) {
    rows.push_back({fmt::format("{}-c1-d1", name_of(op)), false, op, 4 * kib, 1, 1, 1});
    rows.push_back({fmt::format("{}-c{}-d{}", name_of(op), clients.back(), deepest), false, op,
                    4 * kib, clients.back(), deepest, 1});
  }
  for (const bool layer : {false, true}) {
    for (const op_kind op : {op_kind::put, op_kind::get}) {
      rows.push_back({fmt::format("bw-{}-{}", name_of(op), layer ? "layer" : "block"), true, op,
                      layer ? layer_bytes : block_bytes, 1, o.bw_depth, layer ? block_layers : 1});
    }
  }
  return rows;
}

bool selected(const row_spec& r, const std::vector<std::string_view>& patterns) {
  if (patterns.empty()) return true;
  return std::any_of(patterns.begin(), patterns.end(),
                     [&](std::string_view p) { return r.name.rfind(p, 0) == 0; });
}

/// What one measurement of a row found.
struct measurement {
  std::uint64_t keys = 0;    ///< keys that succeeded
  std::uint64_t calls = 0;   ///< calls that completed
  std::uint64_t errors = 0;  ///< keys that failed
  std::string first_error;
  double seconds = 0;
  double latency_ns = 0;  ///< summed over the calls
  double master_cpu = 0, bench_cpu = 0, server_cpu = 0;

  double keys_per_s() const { return seconds > 0 ? static_cast<double>(keys) / seconds : 0; }
  /// Adds another run of the same row (the bw rows alternate store and raw).
  void add(const measurement& o) {
    keys += o.keys;
    calls += o.calls;
    errors += o.errors;
    if (first_error.empty()) first_error = o.first_error;
    seconds += o.seconds;
    latency_ns += o.latency_ns;
    master_cpu += o.master_cpu;
    bench_cpu += o.bench_cpu;
    server_cpu += o.server_cpu;
  }
  double us_per_call() const {
    return calls > 0 ? latency_ns / static_cast<double>(calls) / 1e3 : 0;
  }
  double cpu_us_per_key(double cpu) const {
    return keys > 0 ? cpu / static_cast<double>(keys) * 1e6 : 0;
  }
};

// ------------------------------------------------------------------ the measuring side

/// One measuring client: its engine, its store client, its registered buffer
/// and its engine's peer handle on the serving process.
struct bench_client {
  bench_client(asio::io_context& io, const std::string& transports, const std::string& master,
               std::uint64_t buffer_bytes)
      : eng(io.get_executor(), kvlink::config{.listen = "127.0.0.1:0", .transports = transports}),
        client(eng, {.master = master}),
        buffer(buffer_bytes) {
    eng.register_segment(buffer.data(), buffer.size());
  }
  kvlink::engine eng;
  store::client client;
  kb::page_buffer buffer;
  kvlink::remote_segment raw{};
};

struct counters {
  std::atomic<std::uint64_t> keys{0}, calls{0}, errors{0}, latency_ns{0};
};

/// A call slot: one call in flight at a time, reissued on completion until
/// the row stops.
struct slot {
  bench_client* c = nullptr;
  std::byte* region = nullptr;  ///< batch * size bytes of c's buffer
  std::uint64_t cursor = 0;     ///< the next existing key this slot reads
  std::uint64_t stride = 1;
  std::vector<std::string> names;
  std::vector<std::string_view> keys;
  std::vector<const void*> data;
  std::vector<void*> buffers;
  std::vector<std::uint64_t> sizes, capacities, got;
  std::vector<std::error_code> results;
  std::vector<kvlink::transfer_request> requests;
  clock_type::time_point start;
};

class bench {
 public:
  bench(const options& o, std::string transports, std::uint64_t buffer_bytes)
      : transports_(std::move(transports)) {
    master_.emplace(o.master_bin,
                    std::vector<std::string>{"--listen", "127.0.0.1:0", "--threads",
                                             std::to_string(o.master_threads)},
                    "kvlink-master: listening on ", SIGTERM);
    master_address_ = master_->rest().substr(0, master_->rest().find(' '));
    server_.emplace("/proc/self/exe",
                    std::vector<std::string>{"--serve", "--master", master_address_, "--transports",
                                             transports_, "--pool", std::to_string(o.pool), "--raw",
                                             std::to_string(o.raw), "--server-threads",
                                             std::to_string(o.server_threads)},
                    "SERVE ", 0);
    std::istringstream s(server_->rest());
    std::uint64_t raw_id = 0;
    s >> server_address_ >> raw_id >> raw_bytes_;
    if (server_address_.empty() || raw_id == 0 || raw_bytes_ == 0) {
      throw std::runtime_error("the serving process said '" + server_->rest() + "'");
    }
    for (unsigned i = 0; i < std::max(1u, o.threads); ++i) {
      runners_.emplace_back([this] { io_.run(); });
    }
    try {
      for (unsigned i = 0; i < std::max(1u, o.clients); ++i) {
        auto c = std::make_unique<bench_client>(io_, transports_, master_address_, buffer_bytes);
        c->client.async_connect(asio::use_future).get();
        auto p = c->eng.async_connect(server_address_, asio::use_future).get();
        c->raw = p.segment(kvlink::segment_id{raw_id});
        clients_.push_back(std::move(c));
      }
    } catch (...) {
      shut_down();  // the destructor does not run for a constructor that throws
      throw;
    }
  }

  ~bench() { shut_down(); }

  bench(const bench&) = delete;
  bench& operator=(const bench&) = delete;

  void shut_down() {
    for (auto& c : clients_) {
      try {
        c->client.async_close(asio::use_future).get();
      } catch (const std::system_error&) {
      }
    }
    clients_.clear();
    guard_.reset();
    for (auto& t : runners_) {
      if (t.joinable()) t.join();
    }
  }

  const std::string& master_address() const { return master_address_; }
  const std::string& server_address() const { return server_address_; }

  /// Runs `r` with its own op, or with `op` (the raw twin of a bw row),
  /// for `seconds` after a warm-up.
  measurement run(const row_spec& r, op_kind op, double seconds) {
    if (op == op_kind::get || op == op_kind::exists) ensure_objects(r.size, objects_for(r));
    std::vector<slot> slots(static_cast<std::size_t>(r.clients) * r.depth);
    for (unsigned c = 0; c < r.clients; ++c) {
      for (unsigned d = 0; d < r.depth; ++d) {
        auto& s = slots[c * r.depth + d];
        s.c = clients_[c].get();
        s.region = s.c->buffer.data() + static_cast<std::uint64_t>(d) * r.batch * r.size;
        prepare(s, r, op, c * r.depth + d, slots.size());
      }
    }
    counters n;
    stop_.store(false);
    inflight_.store(slots.size());
    for (auto& s : slots) {
      asio::post(io_, [this, &s, &n, &r, op] { issue(s, r, op, n); });
    }
    const auto warmup = std::chrono::duration<double>(std::clamp(seconds / 10, 0.05, 0.5));
    std::this_thread::sleep_for(warmup);
    const auto snap = [&](measurement& m) {
      m.keys = n.keys.load();
      m.calls = n.calls.load();
      m.errors = n.errors.load();
      m.latency_ns = static_cast<double>(n.latency_ns.load());
      m.master_cpu = cpu_seconds(master_->pid());
      m.bench_cpu = cpu_seconds(::getpid());
      m.server_cpu = cpu_seconds(server_->pid());
    };
    measurement a, b;
    const auto t0 = clock_type::now();
    snap(a);
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    snap(b);
    const auto t1 = clock_type::now();
    stop_.store(true);
    const auto until = clock_type::now() + 60s;
    while (inflight_.load() != 0) {
      if (clock_type::now() > until) throw std::runtime_error(r.name + ": calls never completed");
      std::this_thread::sleep_for(1ms);
    }
    measurement m;
    m.keys = b.keys - a.keys;
    m.calls = b.calls - a.calls;
    m.errors = b.errors - a.errors;
    m.latency_ns = b.latency_ns - a.latency_ns;
    m.master_cpu = b.master_cpu - a.master_cpu;
    m.bench_cpu = b.bench_cpu - a.bench_cpu;
    m.server_cpu = b.server_cpu - a.server_cpu;
    m.seconds = std::chrono::duration<double>(t1 - t0).count();
    {
      std::lock_guard lock(error_mutex_);
      m.first_error = std::move(first_error_);
      first_error_.clear();
    }
    // Puts fill the pool: empty it so that every row starts alike.
    if (op == op_kind::put) clear();
    return m;
  }

 private:
  // Gets and exists read keys put before the row: enough that no two slots
  // read the same key at once.
  static std::uint64_t objects_for(const row_spec& r) {
    const std::uint64_t want = std::uint64_t{r.clients} * r.depth * r.batch * 4;
    const std::uint64_t cap = r.size >= mib ? 64 : r.size >= 64 * kib ? 16 * block_layers : 8192;
    return std::max(want, std::min<std::uint64_t>(cap, 8192));
  }

  static std::string make_key(std::uint64_t n) {
    // splitmix64: the hex part looks like a block hash.
    std::uint64_t z = n + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return fmt::format("{}{:016x}", key_prefix, z);
  }

  void clear() {
    clients_[0]->client.async_remove_all(true, asio::use_future).get();
    objects_size_ = 0;
    objects_.clear();
  }

  /// Puts `count` objects of `size` bytes (a pattern, checked once by a get).
  void ensure_objects(std::uint64_t size, std::uint64_t count) {
    if (objects_size_ == size && objects_.size() >= count) return;
    clear();
    auto& c = *clients_[0];
    const std::uint64_t per_call =
        std::max<std::uint64_t>(1, std::min<std::uint64_t>(128, c.buffer.size() / size));
    for (std::uint64_t i = 0; i < per_call * size; ++i) {
      c.buffer.data()[i] = static_cast<std::byte>(i * 131 + 7);
    }
    std::vector<std::string> names;
    for (std::uint64_t done = 0; done < count;) {
      const std::uint64_t n = std::min(per_call, count - done);
      names.clear();
      for (std::uint64_t i = 0; i < n; ++i) names.push_back(make_key(next_key_++));
      std::vector<std::string_view> keys(names.begin(), names.end());
      std::vector<const void*> data(n);
      for (std::uint64_t i = 0; i < n; ++i) data[i] = c.buffer.data() + i * size;
      std::vector<std::uint64_t> sizes(n, size);
      std::vector<std::error_code> results(n);
      c.client.async_put_batch(keys, data, sizes, results, {}, {}, asio::use_future).get();
      for (const auto& ec : results) {
        if (ec) throw std::system_error(ec, "putting the objects gets read");
      }
      objects_.insert(objects_.end(), names.begin(), names.end());
      done += n;
    }
    objects_size_ = size;
    // The bytes of one object, read back.
    std::vector<std::byte> expect(c.buffer.data() + (count - 1) % per_call * size,
                                  c.buffer.data() + ((count - 1) % per_call + 1) * size);
    std::fill_n(c.buffer.data(), size, std::byte{0});
    const auto got =
        c.client.async_get(objects_.back(), c.buffer.data(), size, asio::use_future).get();
    if (got != size || !std::equal(expect.begin(), expect.end(), c.buffer.data())) {
      throw std::runtime_error("a get did not return the bytes put");
    }
  }

  void prepare(slot& s, const row_spec& r, op_kind op, std::size_t index, std::size_t slots) {
    const std::size_t b = r.batch;
    s.names.resize(b);
    s.keys.resize(b);
    s.data.assign(b, nullptr);
    s.buffers.assign(b, nullptr);
    s.sizes.assign(b, r.size);
    s.capacities.assign(b, r.size);
    s.got.assign(b, 0);
    s.results.assign(b, {});
    for (std::size_t j = 0; j < b; ++j) {
      s.data[j] = s.region + j * r.size;
      s.buffers[j] = s.region + j * r.size;
    }
    // Existing keys: slot i reads batches i, i + slots, ... of the list.
    s.cursor = index * b;
    s.stride = slots * b;
    if (op == op_kind::write || op == op_kind::read) {
      const std::uint64_t per = raw_bytes_ / r.size;
      for (std::size_t j = 0; j < b; ++j) {
        const std::uint64_t at = (index * b + j) % per * r.size;
        s.requests.push_back(kvlink::transfer_request{
            op == op_kind::write ? kvlink::opcode::write : kvlink::opcode::read,
            s.region + j * r.size, s.c->raw, at, r.size});
      }
    }
  }

  void next_existing(slot& s) {
    const std::size_t b = s.names.size();
    for (std::size_t j = 0; j < b; ++j) {
      s.keys[j] = objects_[(s.cursor + j) % objects_.size()];
    }
    s.cursor = (s.cursor + s.stride) % objects_.size();
  }

  void issue(slot& s, const row_spec& r, op_kind op, counters& n) {
    if (stop_.load(std::memory_order_relaxed)) {
      inflight_.fetch_sub(1);
      return;
    }
    s.start = clock_type::now();
    const bool one = r.batch == 1;
    auto done = [this, &s, &r, op, &n](std::error_code ec) { complete(s, r, op, n, ec); };
    switch (op) {
      case op_kind::put: {
        const auto first = next_key_.fetch_add(s.names.size(), std::memory_order_relaxed);
        for (std::size_t j = 0; j < s.names.size(); ++j) s.names[j] = make_key(first + j);
        for (std::size_t j = 0; j < s.names.size(); ++j) s.keys[j] = s.names[j];
        if (one) {
          s.c->client.async_put(s.keys[0], s.data[0], r.size, {}, {}, done);
        } else {
          s.c->client.async_put_batch(s.keys, s.data, s.sizes, s.results, {}, {}, done);
        }
        break;
      }
      case op_kind::get:
        next_existing(s);
        if (one) {
          s.c->client.async_get(s.keys[0], s.buffers[0], r.size,
                                [this, &s, &r, op, &n](std::error_code ec, std::uint64_t size) {
                                  if (!ec && size != r.size) {
                                    ec =
                                        kvlink::make_error_code(kvlink::store_errc::internal_error);
                                  }
                                  complete(s, r, op, n, ec);
                                });
        } else {
          s.c->client.async_get_batch(s.keys, s.buffers, s.capacities, s.got, s.results, done);
        }
        break;
      case op_kind::exists:
        next_existing(s);
        if (one) {
          s.c->client.async_exists(s.keys[0], [done](std::error_code ec, bool yes) mutable {
            done(ec    ? ec
                 : yes ? std::error_code{}
                       : kvlink::make_error_code(kvlink::store_errc::object_not_found));
          });
        } else {
          s.c->client.async_exists_batch(s.keys, s.results, done);
        }
        break;
      case op_kind::write:
      case op_kind::read:
        s.c->eng.async_submit_transfer(
            s.requests, [done](std::error_code ec, kvlink::transfer_result) mutable { done(ec); });
        break;
    }
  }

  // `ec`: the call's error; a batch's keys have theirs in s.results.
  void complete(slot& s, const row_spec& r, op_kind op, counters& n, std::error_code ec) {
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - s.start);
    std::uint64_t bad = 0;
    std::error_code first = ec;
    const bool per_key = r.batch > 1 && op != op_kind::write && op != op_kind::read;
    if (ec) {
      bad = r.batch;
    } else if (per_key) {
      for (std::size_t j = 0; j < s.results.size(); ++j) {
        if (!s.results[j] && op == op_kind::get && s.got[j] != r.size) {
          s.results[j] = kvlink::make_error_code(kvlink::store_errc::internal_error);
        }
        if (s.results[j]) {
          ++bad;
          if (!first) first = s.results[j];
        }
      }
    }
    n.keys.fetch_add(r.batch - bad, std::memory_order_relaxed);
    n.errors.fetch_add(bad, std::memory_order_relaxed);
    n.calls.fetch_add(1, std::memory_order_relaxed);
    n.latency_ns.fetch_add(static_cast<std::uint64_t>(ns.count()), std::memory_order_relaxed);
    if (first) {
      std::lock_guard lock(error_mutex_);
      if (first_error_.empty()) first_error_ = first.message();
    }
    issue(s, r, op, n);
  }

  std::string transports_;
  std::optional<child> master_;
  std::string master_address_;
  std::optional<child> server_;
  std::string server_address_;
  std::uint64_t raw_bytes_ = 0;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> guard_ = asio::make_work_guard(io_);
  std::vector<std::thread> runners_;
  std::vector<std::unique_ptr<bench_client>> clients_;
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> inflight_{0};
  std::atomic<std::uint64_t> next_key_{0};
  std::uint64_t objects_size_ = 0;
  std::vector<std::string> objects_;
  std::mutex error_mutex_;
  std::string first_error_;
};

// ------------------------------------------------------------------ output

std::string object_label(std::uint64_t size) {
  if (size == block_bytes) return "2.25MiB";
  if (size % mib == 0) return fmt::format("{}MiB", size / mib);
  if (size % kib == 0) return fmt::format("{}KiB", size / kib);
  return fmt::format("{}B", size);
}

nlohmann::json to_json(const measurement& m, std::uint64_t size) {
  return {{"keys_per_s", m.keys_per_s()},
          {"gb_per_s", m.keys_per_s() * static_cast<double>(size) / 1e9},
          {"keys", m.keys},
          {"calls", m.calls},
          {"errors", m.errors},
          {"first_error", m.first_error},
          {"seconds", m.seconds},
          {"us_per_call", m.us_per_call()},
          {"master_cpu_us_per_key", m.cpu_us_per_key(m.master_cpu)},
          {"bench_cpu_us_per_key", m.cpu_us_per_key(m.bench_cpu)},
          {"server_cpu_us_per_key", m.cpu_us_per_key(m.server_cpu)}};
}

std::string error_note(const measurement& m) {
  if (m.errors == 0) return {};
  return fmt::format("  ({} errors: {})", m.errors, m.first_error);
}

// Prints the ops table's header once per transport.
void print_ops_header(const options& o, const bench& b, const std::string& transport) {
  fmt::print(
      "# kvlink_store_bench ops: transport {}, master {} ({} threads), serving process {} "
      "({} thread{}), {} bench thread{}, {} hardware threads\n",
      transport, b.master_address(), o.master_threads, b.server_address(), o.server_threads,
      o.server_threads == 1 ? "" : "s", o.threads, o.threads == 1 ? "" : "s",
      std::thread::hardware_concurrency());
  fmt::print(
      "# keys/s over {} s after a warm-up; us/call = mean call latency; CPU us/key = "
      "utime+stime per key of the master, this process (the clients), the serving process\n",
      o.seconds);
  fmt::print("{:<16} {:<6} {:>7} {:>7} {:>5} {:>5} {:>11} {:>9} {:>9} {:>9} {:>9}\n", "row", "op",
             "object", "clients", "depth", "batch", "keys/s", "us/call", "master", "bench",
             "server");
  fmt::print("{:<16} {:<6} {:>7} {:>7} {:>5} {:>5} {:>11} {:>9} {:>9} {:>9} {:>9}\n", "", "", "",
             "", "", "", "", "", "CPU us/key", "CPU us/key", "CPU us/key");
}

void print_bw_header(const options& o) {
  fmt::print(
      "# kvlink_store_bench bw: 1 client, {} calls in flight; store = put/get through the "
      "master, raw = the engine's WRITE/READ of the same requests between the same processes, "
      "alternating in {} rounds of {} s each; GB/s = 10^9 B/s, GiB/s = 2^30 B/s\n",
      o.bw_depth, bw_rounds, o.seconds / bw_rounds);
  fmt::print("{:<14} {:<4} {:>7} {:>5} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}\n", "row",
             "op", "object", "batch", "store GB/s", "raw GB/s", "store/raw", "store GiB/s",
             "keys/s", "us/call", "master CPU us/key");
}

}  // namespace

// ------------------------------------------------------------------ the SSD tier

/// The value of one sample of the master's /metrics (Prometheus text), e.g.
/// `kvlink_store_disk_tasks_total{kind="load"}`; 0 when it is not there.
double metric(const std::string& http, std::string_view sample) {
  const auto colon = http.rfind(':');
  asio::ip::tcp::iostream s(http.substr(0, colon), http.substr(colon + 1));
  s << "GET /metrics HTTP/1.0\r\nHost: " << http << "\r\n\r\n" << std::flush;
  std::string line;
  while (std::getline(s, line)) {
    if (line.size() > sample.size() && line.compare(0, sample.size(), sample) == 0 &&
        line[sample.size()] == ' ') {
      return std::stod(line.substr(sample.size() + 1));
    }
  }
  return 0;
}

/// --disk DIR: the store's SSD tier against the disk it sits on, in one run.
/// For each size of --disk-sizes: the disk's own sequential rate
/// (disk_reference.hpp: O_DIRECT, requests of the object's size, over
/// --disk-bytes), then a kvlink-master child and one owner client in this
/// process with a segment of --disk-pool bytes and its disk under DIR.
///  - put: the pool is filled (not timed), then --disk-bytes of fresh
///    objects are put through it, --disk-depth threads each putting
///    --disk-batch keys per call (a key refused with no_space is put again
///    1 ms later): every byte put must first push an older object to the
///    disk, so the rate is the eviction-to-disk rate the user sees.
///  - get: every object in put order that was sent to the disk (the oldest:
///    CLOCK with no hits evicts in put order), same depth and batch, bytes
///    checked; "loads" is how many the master had read back from the disk
///    (its kvlink_store_disk_tasks_total{kind="load"} before and after).
///  - lat: the mean time of one get of one key at a time, 64 keys on the
///    disk only against 64 keys in memory.
int disk_section(const options& o) {
  std::vector<std::uint64_t> sizes;
  for (const auto s : kb::split_list(o.disk_sizes)) {
    const auto n = kvlink::parse_size(s);
    if (!n || *n == 0) throw std::invalid_argument("--disk-sizes: bad size " + std::string(s));
    sizes.push_back(*n);
  }
  const std::string work = o.disk + "/kvlink-store-bench-" + std::to_string(::getpid());
  std::filesystem::create_directories(work);
  io_runners run_io(o.threads);
  asio::io_context& io = run_io.io;
  fmt::print(
      "# SSD tier in the store under {}: one owner client with a {} MiB segment and a disk, a "
      "kvlink-master child (read lease {} ms); {} MiB put per row, {} threads x {} keys per call\n"
      "# disk = this program's O_DIRECT sequential writer/reader on the same directory, requests "
      "of the object's size; put = store puts through the full pool (each pushes older objects to "
      "the disk); get = gets of the objects sent to the disk, bytes checked; lat us = one key per "
      "call, disk-only vs in memory; GB = 10^9 B\n",
      o.disk, o.disk_pool / mib, o.disk_lease_ms, o.disk_bytes / mib, o.disk_depth, o.disk_batch);
  fmt::print("{:>8} | {:>8} {:>8} {:>6} | {:>8} {:>8} {:>6} {:>7} | {:>8} {:>8}\n", "object",
             "disk wr", "put", "ratio", "disk rd", "get", "ratio", "loads", "lat disk", "lat mem");
  fmt::print("{:>8} | {:>8} {:>8} {:>6} | {:>8} {:>8} {:>6} {:>7} | {:>8} {:>8}\n", "", "GB/s",
             "GB/s", "", "GB/s", "GB/s", "", "", "us", "us");
  int status = 0;
  for (const auto size : sizes) {
    try {
      // The first `warm` objects fill the pool (not timed); the n after them
      // each push an older one to the disk.
      const std::uint64_t warm = o.disk_pool / size;
      const std::uint64_t n =
          warm + std::max<std::uint64_t>(2 * o.disk_depth * o.disk_batch, o.disk_bytes / size);
      const auto ref = kb::disk::sequential(work, size, (n - warm) * size, 1, true);
      std::uint16_t port = 0, http_port = 0;
      {
        asio::ip::tcp::acceptor a(io, {asio::ip::make_address("127.0.0.1"), 0});
        asio::ip::tcp::acceptor b(io, {asio::ip::make_address("127.0.0.1"), 0});
        port = a.local_endpoint().port();
        http_port = b.local_endpoint().port();
      }
      const std::string listen = "127.0.0.1:" + std::to_string(port);
      const std::string http = "127.0.0.1:" + std::to_string(http_port);
      child m(o.master_bin,
              {"--listen", listen, "--http", http, "--threads", std::to_string(o.master_threads),
               "--default_kv_lease_ttl", std::to_string(o.disk_lease_ms)},
              "kvlink-master: listening on ", SIGTERM);
      const std::string dir = work + "/disk";
      std::filesystem::remove_all(dir);
      const std::uint64_t per_call = std::uint64_t{o.disk_batch} * size;
      kb::page_buffer pool(o.disk_pool);
      kb::page_buffer src(o.disk_depth * per_call);
      kb::page_buffer dst(o.disk_depth * per_call);
      kvlink::engine eng{io.get_executor(),
                         kvlink::config{.listen = "127.0.0.1:0", .transports = "tcp"}};
      eng.register_segment(src.data(), src.size());
      eng.register_segment(dst.data(), dst.size());
      store::client c{
          eng, {.master = listen, .disk_path = dir, .disk_capacity = 2 * n * size + 64 * mib}};
      c.async_mount(pool.data(), pool.size(), asio::use_future).get();
      const auto key = [](std::uint64_t i) { return fmt::format("{}{:016x}", key_prefix, i); };
      // Object i's bytes: a pattern of its number, checked on the way back.
      const auto fill = [size](std::byte* p, std::uint64_t i) {
        for (std::uint64_t b = 0; b < size; b += 4096) {
          const std::uint64_t v = i * 0x9E3779B97F4A7C15ull + b;
          std::memcpy(p + b, &v, std::min<std::uint64_t>(8, size - b));
        }
      };
      const auto check = [size](const std::byte* p, std::uint64_t i) {
        for (std::uint64_t b = 0; b < size; b += 4096) {
          const std::uint64_t v = i * 0x9E3779B97F4A7C15ull + b;
          if (std::memcmp(p + b, &v, std::min<std::uint64_t>(8, size - b)) != 0) return false;
        }
        return true;
      };
      // Calls of --disk-batch keys from --disk-depth threads over keys
      // [first, last), thread t taking every depth-th call; `put` or get.
      std::atomic<std::uint64_t> failures{0};
      const auto run = [&](bool put, std::uint64_t first, std::uint64_t last) {
        return kb::disk::timed(o.disk_depth, [&](unsigned t) {
          std::byte* mine = (put ? src : dst).data() + t * per_call;
          std::vector<std::string> keys(o.disk_batch);
          std::vector<std::string_view> views;
          std::vector<const void*> from;
          std::vector<void*> to;
          std::vector<std::uint64_t> sizes_in, sizes_out(o.disk_batch);
          std::vector<std::error_code> results(o.disk_batch);
          std::vector<std::uint64_t> ids;
          for (std::uint64_t call = first + t * o.disk_batch; call < last;
               call += std::uint64_t{o.disk_depth} * o.disk_batch) {
            ids.clear();
            for (std::uint64_t i = call; i < std::min(last, call + o.disk_batch); ++i) {
              ids.push_back(i);
            }
            for (int attempt = 0; !ids.empty(); ++attempt) {
              if (attempt > 0) std::this_thread::sleep_for(1ms);
              if (attempt > 30000) throw std::runtime_error("no space for 30 s");
              views.clear();
              from.clear();
              to.clear();
              sizes_in.assign(ids.size(), size);
              for (std::size_t k = 0; k < ids.size(); ++k) {
                keys[k] = key(ids[k]);
                views.push_back(keys[k]);
                std::byte* p = mine + k * size;
                if (put) fill(p, ids[k]);
                from.push_back(p);
                to.push_back(p);
              }
              const auto nk = ids.size();
              if (put) {
                c.async_put_batch(std::span(views.data(), nk), std::span(from.data(), nk),
                                  std::span(sizes_in.data(), nk), std::span(results.data(), nk), {},
                                  std::span<const std::string_view>{}, asio::use_future)
                    .get();
              } else {
                c.async_get_batch(std::span(views.data(), nk), std::span(to.data(), nk),
                                  std::span(sizes_in.data(), nk), std::span(sizes_out.data(), nk),
                                  std::span(results.data(), nk), asio::use_future)
                    .get();
              }
              std::vector<std::uint64_t> again;
              for (std::size_t k = 0; k < nk; ++k) {
                if (put && results[k] == kvlink::store_errc::no_space) {
                  again.push_back(ids[k]);
                } else if (results[k]) {
                  throw std::system_error(results[k], (put ? "put " : "get ") + keys[k]);
                } else if (!put && (sizes_out[k] != size || !check(mine + k * size, ids[k]))) {
                  ++failures;
                }
              }
              ids = std::move(again);
            }
          }
        });
      };
      (void)run(true, 0, warm);
      const double put_s = run(true, warm, n);
      // Let the copies under way finish, so that the gets below read
      // objects that are on the disk.
      std::this_thread::sleep_for(500ms);
      const std::uint64_t on_disk =
          static_cast<std::uint64_t>(metric(http, "kvlink_store_disk_replicas"));
      const std::uint64_t lat_keys = 64;
      if (on_disk < 2 * lat_keys + std::uint64_t{o.disk_depth} * o.disk_batch) {
        throw std::runtime_error(
            fmt::format("only {} of {} objects went to the disk (raise "
                        "--disk-bytes over --disk-pool)",
                        on_disk, n));
      }
      // Latency, one key per call: the first keys (on the disk only) and the
      // last ones (in memory).
      const auto one_at_a_time = [&](std::uint64_t first) {
        const auto t0 = clock_type::now();
        for (std::uint64_t i = first; i < first + lat_keys; ++i) {
          const auto got = c.async_get(key(i), dst.data(), size, asio::use_future).get();
          if (got != size || !check(dst.data(), i)) ++failures;
        }
        return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count() /
               static_cast<double>(lat_keys);
      };
      const double loads0 = metric(http, "kvlink_store_disk_tasks_total{kind=\"load\"}");
      const double lat_disk = one_at_a_time(0);
      const double lat_mem = one_at_a_time(n - lat_keys);
      const double loads1 = metric(http, "kvlink_store_disk_tasks_total{kind=\"load\"}");
      const std::uint64_t last = on_disk - lat_keys;  // the oldest on_disk objects went first
      const double get_s = run(false, lat_keys, last);
      const double loads2 = metric(http, "kvlink_store_disk_tasks_total{kind=\"load\"}");
      c.async_close(asio::use_future).get();
      if (failures != 0) {
        throw std::runtime_error(fmt::format("{} object(s) came back wrong", failures.load()));
      }
      const double put_gbs = static_cast<double>((n - warm) * size) / put_s / 1e9;
      const double get_gbs = static_cast<double>((last - lat_keys) * size) / get_s / 1e9;
      fmt::print(
          "{:>8} | {:>8.2f} {:>8.2f} {:>6.2f} | {:>8.2f} {:>8.2f} {:>6.2f} {:>7} | {:>8.0f} "
          "{:>8.0f}{}\n",
          object_label(size), ref.write_gbs, put_gbs, put_gbs / ref.write_gbs, ref.read_gbs,
          get_gbs, get_gbs / ref.read_gbs,
          fmt::format("{:.0f}/{}", loads2 - loads1, last - lat_keys), lat_disk, lat_mem,
          loads1 - loads0 < lat_keys ? fmt::format(" (only {:.0f} of the {} disk-latency gets "
                                                   "were loads)",
                                                   loads1 - loads0, lat_keys)
                                     : std::string{});
      std::fflush(stdout);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kvlink_store_bench --disk (%s): %s\n", object_label(size).c_str(),
                   e.what());
      status = 1;
    }
  }
  std::filesystem::remove_all(work);
  return status;
}

int main(int argc, char** argv) {
  options o;
  CLI::App app{
      "kvlink_store_bench: the store's put/get/exists rates and KV-object bandwidth on loopback "
      "(a kvlink-master child, a serving child, clients in this process)"};
  app.add_option("--master-bin", o.master_bin, "the kvlink-master program")->capture_default_str();
  app.add_option("--seconds", o.seconds, "measured seconds per row")->capture_default_str();
  app.add_option("--rows", o.rows, "rows to run: comma-separated name prefixes (--list)");
  app.add_option("--clients", o.clients, "clients of the many-client rows (each its own engine)")
      ->capture_default_str();
  app.add_option("--depths", o.depths, "calls in flight per client, one-at-a-time rows")
      ->capture_default_str();
  app.add_option("--batch", o.batch, "keys per call of the batched rows")->capture_default_str();
  app.add_option("--bw-depth", o.bw_depth, "calls in flight of the bandwidth rows")
      ->capture_default_str();
  app.add_option("--transports", o.transports,
                 "engine transports, comma-separated: one table each (tcp, shm)")
      ->capture_default_str();
  app.add_option("--threads", o.threads, "threads running the clients' engines")
      ->capture_default_str();
  app.add_option("--master-threads", o.master_threads, "the master's I/O threads")
      ->capture_default_str();
  app.add_option("--server-threads", o.server_threads, "the serving process's engine threads")
      ->capture_default_str();
  app.add_option("--pool", o.pool, "bytes the serving process mounts")->capture_default_str();
  app.add_option("--raw", o.raw, "bytes of the serving process's raw-engine segment")
      ->capture_default_str();
  app.add_option("--json", o.json, "also write the results to this file");
  app.add_flag("--list", o.list, "print the rows' names and exit");
  app.add_option("--rebuild", o.rebuild,
                 "instead of the rows: master restarts with these numbers of objects "
                 "(e.g. 10000,100000,1000000)");
  app.add_option("--rebuild-size", o.rebuild_size, "bytes per object of --rebuild")
      ->capture_default_str();
  app.add_option("--disk", o.disk,
                 "instead of the rows: the SSD tier's put/get against the disk under this "
                 "directory");
  app.add_option("--disk-sizes", o.disk_sizes, "object sizes of --disk")->capture_default_str();
  app.add_option("--disk-bytes", o.disk_bytes,
                 "bytes put per --disk row, above --disk-pool (KiB, MiB, GiB: K, M, G)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--disk-pool", o.disk_pool, "bytes of the owner's segment in --disk")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--disk-depth", o.disk_depth, "threads with a call in flight in --disk")
      ->capture_default_str();
  app.add_option("--disk-batch", o.disk_batch, "keys per call in --disk")->capture_default_str();
  app.add_option("--disk-lease-ms", o.disk_lease_ms,
                 "the master's read lease in --disk (store_lease_ttl; it bounds gets of "
                 "disk-only objects to about --disk-pool per lease)")
      ->capture_default_str();
  app.add_flag("--serve", o.serve)->group("");
  app.add_option("--master", o.master)->group("");
  CLI11_PARSE(app, argc, argv);

  if (o.serve) return serve(o);
  if (!o.rebuild.empty()) return rebuild(o);
  if (!o.disk.empty()) {
    if (o.disk_depth == 0 || o.disk_batch == 0 || o.disk_pool == 0 || o.disk_bytes <= o.disk_pool) {
      std::fprintf(stderr,
                   "kvlink_store_bench: --disk-depth, --disk-batch and --disk-pool must be "
                   "positive, --disk-bytes above --disk-pool\n");
      return 2;
    }
    try {
      return disk_section(o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kvlink_store_bench --disk: %s\n", e.what());
      return 1;
    }
  }

  std::vector<unsigned> depths;
  for (const auto d : kb::split_list(o.depths))
    depths.push_back(static_cast<unsigned>(std::stoul(std::string(d))));
  if (depths.empty() || o.seconds <= 0 || o.batch == 0 || o.bw_depth == 0 || o.clients == 0) {
    std::fprintf(stderr,
                 "kvlink_store_bench: --depths, --seconds, --batch, --bw-depth and "
                 "--clients must be positive\n");
    return 2;
  }
  const auto patterns = kb::split_list(o.rows);
  std::vector<row_spec> rows;
  for (auto& r : all_rows(o, depths)) {
    if (selected(r, patterns)) rows.push_back(std::move(r));
  }
  if (o.list) {
    for (const auto& r : all_rows(o, depths)) fmt::print("{}\n", r.name);
    return 0;
  }
  if (rows.empty()) {
    std::fprintf(stderr, "kvlink_store_bench: no row matches --rows %s (see --list)\n",
                 o.rows.c_str());
    return 2;
  }
  std::uint64_t buffer_bytes = 4 * mib;
  for (const auto& r : rows) {
    buffer_bytes = std::max(buffer_bytes, std::uint64_t{r.depth} * r.batch * r.size);
  }

  nlohmann::json out{{"units", "GB = 10^9 B, GiB = 2^30 B; CPU in us per key"},
                     {"hardware_threads", std::thread::hardware_concurrency()},
                     {"options",
                      {{"seconds", o.seconds},
                       {"clients", o.clients},
                       {"depths", o.depths},
                       {"batch", o.batch},
                       {"bw_depth", o.bw_depth},
                       {"threads", o.threads},
                       {"master_threads", o.master_threads},
                       {"server_threads", o.server_threads}}},
                     {"tables", nlohmann::json::array()}};
  int status = 0;
  try {
    for (const auto t : kb::split_list(o.transports)) {
      const std::string transport(t);
      bench b(o, transport, buffer_bytes);
      nlohmann::json table{{"transport", transport}, {"rows", nlohmann::json::array()}};
      bool ops_header = false, bw_header = false;
      for (const auto& r : rows) {
        std::fprintf(stderr, "%s %s ...\n", transport.c_str(), r.name.c_str());
        if (!r.bandwidth) {
          if (!ops_header) print_ops_header(o, b, transport);
          ops_header = true;
          const auto m = b.run(r, r.op, o.seconds);
          fmt::print(
              "{:<16} {:<6} {:>7} {:>7} {:>5} {:>5} {:>11.0f} {:>9.1f} {:>9.2f} {:>9.2f} "
              "{:>9.2f}{}\n",
              r.name, name_of(r.op), object_label(r.size), r.clients, r.depth, r.batch,
              m.keys_per_s(), m.us_per_call(), m.cpu_us_per_key(m.master_cpu),
              m.cpu_us_per_key(m.bench_cpu), m.cpu_us_per_key(m.server_cpu), error_note(m));
          auto j = to_json(m, r.size);
          j.update({{"row", r.name},
                    {"section", "ops"},
                    {"op", name_of(r.op)},
                    {"size", r.size},
                    {"clients", r.clients},
                    {"depth", r.depth},
                    {"batch", r.batch}});
          table["rows"].push_back(std::move(j));
          if (m.errors != 0 || m.keys == 0) status = 1;
        } else {
          if (!bw_header) {
            if (ops_header) fmt::print("\n");
            print_bw_header(o);
          }
          bw_header = true;
          const op_kind raw_op = r.op == op_kind::put ? op_kind::write : op_kind::read;
          // Store and raw alternate, so that a change of the machine's load
          // falls on both alike.
          measurement m, raw;
          for (int round = 0; round < bw_rounds; ++round) {
            m.add(b.run(r, r.op, o.seconds / bw_rounds));
            raw.add(b.run(r, raw_op, o.seconds / bw_rounds));
          }
          const double gbs = m.keys_per_s() * static_cast<double>(r.size) / 1e9;
          const double raw_gbs = raw.keys_per_s() * static_cast<double>(r.size) / 1e9;
          fmt::print(
              "{:<14} {:<4} {:>7} {:>5} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>9.0f} "
              "{:>9.1f} {:>9.2f}{}{}\n",
              r.name, name_of(r.op), object_label(r.size), r.batch, gbs, raw_gbs,
              raw_gbs > 0 ? gbs / raw_gbs : 0.0, gbs * 1e9 / (1024.0 * 1024 * 1024), m.keys_per_s(),
              m.us_per_call(), m.cpu_us_per_key(m.master_cpu), error_note(m),
              raw.errors != 0 ? " raw:" + error_note(raw) : "");
          auto j = to_json(m, r.size);
          j.update({{"row", r.name},
                    {"section", "bw"},
                    {"op", name_of(r.op)},
                    {"size", r.size},
                    {"clients", r.clients},
                    {"depth", r.depth},
                    {"batch", r.batch},
                    {"raw", to_json(raw, r.size)},
                    {"store_over_raw", raw_gbs > 0 ? gbs / raw_gbs : 0.0}});
          table["rows"].push_back(std::move(j));
          if (m.errors != 0 || raw.errors != 0 || m.keys == 0) status = 1;
        }
        std::fflush(stdout);
      }
      fmt::print("\n");
      out["tables"].push_back(std::move(table));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvlink_store_bench: %s\n", e.what());
    return 1;
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << out.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "kvlink_store_bench: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  return status;
}
