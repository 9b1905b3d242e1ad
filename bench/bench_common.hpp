// Pieces shared by kvlink's two-process benches (kvlink_tcp_bench,
// kvlink-bench): touched buffers in host or device memory, a device copy
// reference, a target child process that reports its address, the
// steady-state bandwidth runner of one (op, block, batch) case, and an
// iperf3 loopback reference.
//
// Not part of the library: set-up failures throw std::system_error /
// std::runtime_error with context; the data path reports std::error_code.
#pragma once

#include <kvlink/engine.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <asio/bind_executor.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/post.hpp>
#include <asio/signal_set.hpp>
#include <asio/strand.hpp>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

namespace kvlink::bench {

using clock_type = std::chrono::steady_clock;

inline std::vector<std::string_view> split_list(std::string_view s) {
  std::vector<std::string_view> out;
  while (!s.empty()) {
    const auto comma = s.find(',');
    out.push_back(s.substr(0, comma));
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

inline std::string_view op_name(opcode op) { return op == opcode::write ? "write" : "read"; }

/// Anonymous memory for a KV cache or a transfer buffer: asked for in
/// transparent huge pages (as serving engines allocate their KV caches: large,
/// long-lived, pinned; 4 KiB pages cost a TLB miss every 4 KiB of a copy), and
/// every page written once so that page faults stay out of the measurement.
class page_buffer {
 public:
  explicit page_buffer(std::uint64_t size) : size_(static_cast<std::size_t>(size)) {
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap");
    ::madvise(p, size_, MADV_HUGEPAGE);  // a hint: fine if the kernel says no
    data_ = static_cast<std::byte*>(p);
    for (std::size_t i = 0; i < size_; i += 4096) data_[i] = std::byte{0x5a};
  }
  ~page_buffer() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  page_buffer(const page_buffer&) = delete;
  page_buffer& operator=(const page_buffer&) = delete;
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  std::size_t size_;
  std::byte* data_ = nullptr;
};

inline page_buffer make_buffer(std::uint64_t size) { return page_buffer(size); }

// ------------------------------------------------------------------ device memory

/// Synchronous copies on one stream of a device runtime (set-up and the
/// copy reference; never the measured data path): the stream posts its
/// completions on an io_context of this object's own, run while waiting.
class device_copier {
 public:
  /// Throws std::system_error with the failing call.
  device_copier(std::shared_ptr<device_runtime> rt, std::int32_t device)
      : rt_(std::move(rt)), device_(device) {
    std::error_code ec;
    std::string what;
    stream_ = rt_->open_stream(device_, io_.get_executor(), ec, what);
    if (!stream_) throw std::system_error(ec, "open_stream: " + what);
  }
  device_copier(const device_copier&) = delete;
  device_copier& operator=(const device_copier&) = delete;

  device_runtime& runtime() const noexcept { return *rt_; }
  const std::shared_ptr<device_runtime>& runtime_ptr() const noexcept { return rt_; }
  std::int32_t device() const noexcept { return device_; }

  /// `n` bytes between device memory at `dev` and host memory at `host`
  /// (H2D when `to_device`, else D2H) as copies of at most `piece` bytes,
  /// each between the same two addresses, all queued on the stream before
  /// waiting. Returns the seconds from the first enqueue to the last
  /// completion; throws on a copy error.
  double copy(bool to_device, std::byte* dev, std::byte* host, std::uint64_t piece,
              std::uint64_t n) {
    const memory_desc d{memory_kind::device, device_};
    std::size_t pending = 0;
    std::error_code first;
    const auto t0 = clock_type::now();
    for (std::uint64_t at = 0; at < n;) {
      const std::uint64_t len = std::min(piece, n - at);
      ++pending;
      auto done = [&](std::error_code ec) {
        --pending;
        if (ec && !first) first = ec;
      };
      if (to_device) {
        stream_->async_copy(dev, d, host, memory_desc{}, static_cast<std::size_t>(len), done);
      } else {
        stream_->async_copy(host, memory_desc{}, dev, d, static_cast<std::size_t>(len), done);
      }
      at += len;
    }
    while (pending > 0) {
      if (io_.run_one() == 0) io_.restart();
    }
    const double secs = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (first) throw std::system_error(first, "device copy");
    return secs;
  }

 private:
  std::shared_ptr<device_runtime> rt_;
  std::int32_t device_;
  asio::io_context io_;  // before the stream: its completions are posted here
  std::shared_ptr<device_stream> stream_;
};

/// A bench buffer in host memory (a page_buffer: every page touched) or in
/// device memory of a runtime (a device_buffer, every byte written through
/// the device's copy engine: the CPU cannot touch it), so that first-touch
/// costs stay out of the measurement either way.
class bench_buffer {
 public:
  explicit bench_buffer(std::uint64_t size) { host_.emplace(size); }
  /// Device memory on `copier`'s device, filled with 0x5a from pinned memory.
  bench_buffer(device_copier& copier, std::uint64_t size)
      : dev_(copier.runtime_ptr(), copier.device(), static_cast<std::size_t>(size)) {
    const std::uint64_t piece = std::min<std::uint64_t>(size, 64u << 20);
    pinned_buffer src{copier.runtime_ptr(), static_cast<std::size_t>(piece)};
    std::memset(src.data(), 0x5a, src.size());
    for (std::uint64_t at = 0; at < size; at += piece) {
      copier.copy(true, dev_.data() + at, src.data(), piece, std::min(piece, size - at));
    }
  }
  bench_buffer(const bench_buffer&) = delete;
  bench_buffer& operator=(const bench_buffer&) = delete;

  std::byte* data() const noexcept { return host_ ? host_->data() : dev_.data(); }
  std::size_t size() const noexcept { return host_ ? host_->size() : dev_.size(); }
  bool on_device() const noexcept { return !host_; }

 private:
  std::optional<page_buffer> host_;
  device_buffer dev_;
};

/// The device copy reference of a bench that moves device memory: what one
/// stream of the runtime copies between device memory and pinned host memory
/// (cudaMemcpyAsync D2H and H2D with --device cuda), `n` bytes in pieces of
/// at most `max_piece` (own buffers of that size, reused). GB/s = 10^9 B/s.
class copy_reference {
 public:
  copy_reference(device_copier& copier, std::uint64_t max_piece)
      : copier_(copier),
        dev_(copier.runtime_ptr(), copier.device(), static_cast<std::size_t>(max_piece)),
        pinned_(copier.runtime_ptr(), static_cast<std::size_t>(max_piece)) {
    std::memset(pinned_.data(), 0x5a, pinned_.size());
  }

  struct rates {
    double d2h_gb_per_s = 0;
    double h2d_gb_per_s = 0;
  };

  /// One D2H pass, then one H2D pass, of `n` bytes in copies of `piece`
  /// bytes (0: as large as the buffers).
  rates measure(std::uint64_t n, std::uint64_t piece = 0) {
    if (piece == 0 || piece > dev_.size()) piece = dev_.size();
    const auto gbs = [n](double s) { return s > 0 ? static_cast<double>(n) / s / 1e9 : 0.0; };
    rates r;
    r.d2h_gb_per_s = gbs(copier_.copy(false, dev_.data(), pinned_.data(), piece, n));
    r.h2d_gb_per_s = gbs(copier_.copy(true, dev_.data(), pinned_.data(), piece, n));
    return r;
  }

 private:
  device_copier& copier_;
  device_buffer dev_;
  pinned_buffer pinned_;
};

/// Where a bench's engine runs: its io_context, run by the bench's own
/// thread (threads = 1, as before), or by `threads` threads of its own while
/// the bench's thread runs only the completion handlers (on `main()`, where
/// run_until and case_runner drive), so the bench's bookkeeping never runs
/// concurrently with itself.
class bench_io {
 public:
  explicit bench_io(unsigned threads) : threads_(std::max(threads, 1u)) {
    if (threads_ > 1) {
      // Handlers arrive from the engine's threads at any time: main() never
      // runs out of work (it would stop) while this object lives.
      main_work_.emplace(main_io_.get_executor());
      work_.emplace(engine_io_.get_executor());
      for (unsigned i = 0; i < threads_; ++i) runners_.emplace_back([this] { engine_io_.run(); });
    }
  }
  ~bench_io() { stop(); }
  bench_io(const bench_io&) = delete;
  bench_io& operator=(const bench_io&) = delete;

  unsigned threads() const noexcept { return threads_; }
  /// The engine's executor.
  asio::io_context& engine_io() noexcept { return engine_io_; }
  /// Where completion handlers run: the io_context the bench's thread runs.
  asio::io_context& main() noexcept { return threads_ > 1 ? main_io_ : engine_io_; }
  /// `h`, to run on main().
  template <class Handler>
  auto bind(Handler&& h) {
    return asio::bind_executor(main().get_executor(), std::forward<Handler>(h));
  }
  /// A strand on the engine's io_context: where a bench whose handlers
  /// submit the next transfer runs them with several threads (the case
  /// runner), as an Asio program would, instead of a hop to main() and back
  /// per transfer.
  asio::strand<asio::io_context::executor_type>& handler_strand() noexcept { return strand_; }
  /// Runs main() until `done` holds.
  template <class Pred>
  void run_until(Pred done) {
    auto& io = main();
    while (!done()) io.run_one();
  }
  /// Lets the engine's threads finish (after the engine is gone).
  void stop() {
    if (work_) {
      work_.reset();
      engine_io_.stop();
      for (auto& t : runners_) t.join();
      runners_.clear();
    }
  }

 private:
  unsigned threads_;
  asio::io_context engine_io_;
  asio::io_context main_io_;
  asio::strand<asio::io_context::executor_type> strand_{engine_io_.get_executor()};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_, main_work_;
  std::vector<std::thread> runners_;
};

/// The target's main loop: announces its address (the initiator, or a
/// person, reads the `LISTEN host:port` line), drains notifications, and
/// runs until SIGINT/SIGTERM or, with `watch_stdin`, until its stdin closes
/// (the parent that started it is done or gone). Returns the number of
/// notifications received.
inline std::uint64_t serve_target(bench_io& bio, kvlink::engine& eng, std::uint64_t segment_bytes,
                                  bool watch_stdin) {
  asio::io_context& io = bio.main();
  std::printf("LISTEN %s\n", eng.local_address().c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "target: listening on %s, segment %s\n", eng.local_address().c_str(),
               kvlink::format_size(segment_bytes).c_str());
  std::uint64_t notes = 0;
  std::function<void()> receive = [&] {
    eng.async_receive_notification(bio.bind([&](std::error_code ec, kvlink::notification) {
      if (ec) return;
      ++notes;
      receive();
    }));
  };
  receive();
  asio::signal_set signals{io, SIGINT, SIGTERM};
  signals.async_wait([&io](std::error_code, int) { io.stop(); });
  std::optional<asio::posix::stream_descriptor> in;
  std::array<char, 256> sink{};
  std::function<void()> watch = [&] {
    in->async_read_some(asio::buffer(sink), [&](std::error_code ec, std::size_t) {
      if (ec) {
        io.stop();  // EOF: the initiator is done (or gone)
      } else {
        watch();
      }
    });
  };
  if (watch_stdin) {
    in.emplace(io, ::dup(STDIN_FILENO));
    watch();
  }
  io.run();
  return notes;
}

// ------------------------------------------------------------------ child

/// A child process started by spawn_target(). Destruction closes its stdin
/// (a target started with --watch-stdin stops then) and reaps it.
struct child_process {
  pid_t pid = -1;
  int to_child = -1;
  std::string address;

  child_process() = default;
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;
  ~child_process() {
    if (to_child >= 0) ::close(to_child);
    if (pid > 0) {
      int status = 0;
      ::waitpid(pid, &status, 0);
    }
  }
};

/// Starts /proc/self/exe with `args` (not counting argv[0]) and pipes on its
/// stdin and stdout, and reads the "LISTEN host:port" line the child prints
/// once it serves. Throws when the child exits or prints something else.
inline void spawn_target(const std::vector<std::string>& args, child_process& c) {
  int in_pipe[2];
  int out_pipe[2];
  if (::pipe(in_pipe) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
  if (::pipe(out_pipe) != 0) {
    const int e = errno;
    ::close(in_pipe[0]);
    ::close(in_pipe[1]);
    throw std::system_error(e, std::generic_category(), "pipe");
  }
  std::vector<std::string> argv_strings{"/proc/self/exe"};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& s : argv_strings) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::system_error(errno, std::generic_category(), "fork");
  if (pid == 0) {
    ::dup2(in_pipe[0], STDIN_FILENO);
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::close(in_pipe[0]);
    ::close(in_pipe[1]);
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    ::execv(cargv[0], cargv.data());
    std::perror("execv(/proc/self/exe)");
    ::_exit(127);
  }
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  c.pid = pid;
  c.to_child = in_pipe[1];
  std::string line;
  char ch = 0;
  while (true) {
    const auto n = ::read(out_pipe[0], &ch, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || ch == '\n') break;
    line.push_back(ch);
  }
  ::close(out_pipe[0]);
  constexpr std::string_view prefix = "LISTEN ";
  if (line.rfind(prefix, 0) != 0) {
    throw std::runtime_error("the target child did not report its address (got '" + line +
                             "'; see its messages above)");
  }
  c.address = line.substr(prefix.size());
}

// ------------------------------------------------------------------ case runner

/// One (op, block size, batch) case of a steady-state bandwidth run.
struct case_result {
  opcode op = opcode::write;
  std::uint64_t block = 0;
  std::uint64_t batch = 0;
  std::uint64_t depth = 0;
  std::uint32_t lanes = 0;
  std::uint64_t bytes = 0;
  std::uint64_t batches = 0;
  double seconds = 0;
  double mean_latency_us = 0;  // per batch, from transfer_result.duration
  double memcpy_gb_per_s = 0;  // the case's pieces copied by memcpy (same host); 0: none
  std::error_code error;

  double gb_per_s() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
  double gib_per_s() const {
    return seconds > 0 ? static_cast<double>(bytes) / seconds / 1073741824.0 : 0;
  }
};

struct case_timing {
  std::chrono::duration<double> warmup{0.1};
  std::chrono::duration<double> seconds{0.5};
  /// Remote blocks 4 KiB apart, so that the planner cannot coalesce them.
  bool scattered = true;
};

/// Keeps r.depth batches of r.batch requests of r.block bytes in flight, first
/// for the warm-up, then for the measured time. The figure is steady state:
/// payload bytes of the batches that completed after the warm-up's last
/// completion, up to and including the first completion after `seconds`,
/// divided by the time between those two completions. Requests take block
/// slots round robin, so a batch has distinct offsets unless it is larger than
/// the segment. run() drives `io` until the case is done.
class case_runner {
 public:
  case_runner(bench_io& bio, engine& eng, const peer& p, std::byte* local, std::uint64_t local_size,
              std::uint64_t remote_size, const case_timing& t, case_result& r)
      : bio_(bio), eng_(eng), r_(r), warmup_(t.warmup), seconds_(t.seconds) {
    const std::uint64_t remote_stride = r.block + (t.scattered ? 4096 : 0);
    const std::uint64_t slots = std::max<std::uint64_t>(
        1, std::min(local_size / r.block,
                    remote_size >= r.block ? (remote_size - r.block) / remote_stride + 1 : 1));
    batches_.resize(r.depth);
    const remote_segment seg = p.segment(0);
    std::uint64_t slot = 0;
    for (auto& b : batches_) {
      for (std::uint64_t i = 0; i < r.batch; ++i) {
        b.push_back(
            transfer_request{r.op, local + slot * r.block, seg, slot * remote_stride, r.block});
        slot = (slot + 1) % slots;
      }
    }
  }

  /// The batches it keeps in flight, in order (depth of them).
  const std::vector<std::vector<transfer_request>>& batches() const noexcept { return batches_; }

  /// With one thread the bench's thread runs the engine and these handlers;
  /// with several, the handlers run on a strand of the engine's io_context
  /// (a transfer's completion submits the next one on the thread it
  /// completed on) and this thread waits for the last one.
  void run() {
    if (bio_.threads() == 1) {
      start();
      bio_.run_until([this] { return outstanding_ == 0; });
      return;
    }
    asio::post(bio_.handler_strand(), [this] { start(); });
    std::unique_lock lock(end_mutex_);
    end_.wait(lock, [this] { return ended_; });
  }

 private:
  void start() {
    start_ = clock_type::now();
    for (std::size_t i = 0; i < batches_.size(); ++i) submit(i);
  }

  void submit(std::size_t i) {
    ++outstanding_;
    auto h = [this, i](std::error_code ec, transfer_result res) { on_done(i, ec, res); };
    if (bio_.threads() == 1) {
      eng_.async_submit_transfer(batches_[i], bio_.bind(std::move(h)));
    } else {
      eng_.async_submit_transfer(batches_[i], asio::bind_executor(bio_.handler_strand(), h));
    }
  }

  void on_done(std::size_t i, std::error_code ec, const transfer_result& res) {
    --outstanding_;
    const auto now = clock_type::now();
    if (ec) {
      if (!r_.error) r_.error = ec;
      phase_ = phase::draining;
    }
    switch (phase_) {
      case phase::warmup:
        if (now - start_ >= warmup_) {
          phase_ = phase::measuring;
          t0_ = now;
        }
        break;
      case phase::measuring:
        r_.bytes += res.bytes;
        ++r_.batches;
        latency_ns_ += static_cast<double>(res.duration.count());
        if (now - t0_ >= seconds_) {
          r_.seconds = std::chrono::duration<double>(now - t0_).count();
          phase_ = phase::draining;
        }
        break;
      case phase::draining:
        break;
    }
    if (phase_ != phase::draining) submit(i);
    if (phase_ == phase::draining && r_.batches > 0) {
      r_.mean_latency_us = latency_ns_ / static_cast<double>(r_.batches) / 1e3;
    }
    if (outstanding_ == 0 && bio_.threads() > 1) {
      std::lock_guard lock(end_mutex_);
      ended_ = true;
      end_.notify_all();
    }
  }

  enum class phase { warmup, measuring, draining };
  bench_io& bio_;
  engine& eng_;
  case_result& r_;
  std::chrono::duration<double> warmup_;
  std::chrono::duration<double> seconds_;
  std::vector<std::vector<transfer_request>> batches_;
  std::size_t outstanding_ = 0;
  phase phase_ = phase::warmup;
  clock_type::time_point start_;
  clock_type::time_point t0_;
  double latency_ns_ = 0;
  std::mutex end_mutex_;
  std::condition_variable end_;
  bool ended_ = false;
};

/// Runs one case and ends the progress line on stderr with its outcome.
/// False when the case failed (its error is in `r.error`).
inline bool run_and_report(case_runner& runner, const case_result& r) {
  runner.run();
  if (r.error) {
    std::fprintf(stderr, " error: %s\n", r.error.message().c_str());
    return false;
  }
  std::fprintf(stderr, " %.2f GB/s\n", r.gb_per_s());
  return true;
}

// ------------------------------------------------------------------ iperf3

/// Runs `argv` (argv[0] looked up on PATH) with stdout captured into `out`
/// and stderr discarded; returns its exit status, or -1 when it could not run.
inline int run_capture(const std::vector<std::string>& argv, std::string* out) {
  int p[2];
  if (::pipe(p) != 0) return -1;
  std::vector<std::string> a = argv;
  std::vector<char*> cargv;
  for (auto& s : a) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(p[0]);
    ::close(p[1]);
    return -1;
  }
  if (pid == 0) {
    ::dup2(p[1], STDOUT_FILENO);
    if (FILE* null = std::fopen("/dev/null", "w")) ::dup2(::fileno(null), STDERR_FILENO);
    ::close(p[0]);
    ::close(p[1]);
    ::execvp(cargv[0], cargv.data());
    ::_exit(127);
  }
  ::close(p[1]);
  char buf[4096];
  while (true) {
    const auto n = ::read(p[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (out) out->append(buf, static_cast<std::size_t>(n));
  }
  ::close(p[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/// An iperf3 loopback measurement: GB/s = 10^9 bytes/s.
struct iperf3_result {
  double sender_gb_per_s = 0;
  double receiver_gb_per_s = 0;
};

/// Runs `iperf3 -s -1` and `iperf3 -c 127.0.0.1 -P streams -t seconds -J`
/// on a free-looking port; nullopt with `why` set when iperf3 is missing or
/// fails.
inline std::optional<iperf3_result> iperf3_loopback(unsigned streams, unsigned seconds,
                                                    std::string& why) {
  std::string probe;
  if (run_capture({"iperf3", "--version"}, &probe) != 0) {
    why = "iperf3 not found on PATH (Debian: apt-get install iperf3)";
    return std::nullopt;
  }
  const std::string port = std::to_string(15201 + (::getpid() % 1000));
  const pid_t server = ::fork();
  if (server < 0) {
    why = "fork failed";
    return std::nullopt;
  }
  if (server == 0) {
    if (FILE* null = std::fopen("/dev/null", "w")) {
      ::dup2(::fileno(null), STDOUT_FILENO);
      ::dup2(::fileno(null), STDERR_FILENO);
    }
    ::execlp("iperf3", "iperf3", "-s", "-1", "-p", port.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::usleep(300000);  // let the server listen
  std::string json;
  const int rc = run_capture({"iperf3", "-c", "127.0.0.1", "-p", port, "-P",
                              std::to_string(streams), "-t", std::to_string(seconds), "-J"},
                             &json);
  if (rc != 0) ::kill(server, SIGTERM);
  int status = 0;
  ::waitpid(server, &status, 0);
  const auto j = nlohmann::json::parse(json, nullptr, false);
  if (rc != 0 || j.is_discarded() || !j.contains("end")) {
    why = "iperf3 client failed (exit status " + std::to_string(rc) + ")";
    return std::nullopt;
  }
  try {
    const auto& end = j.at("end");
    return iperf3_result{end.at("sum_sent").at("bits_per_second").get<double>() / 8e9,
                         end.at("sum_received").at("bits_per_second").get<double>() / 8e9};
  } catch (const nlohmann::json::exception& e) {
    why = std::string{"unexpected iperf3 JSON: "} + e.what();
    return std::nullopt;
  }
}

}  // namespace kvlink::bench
