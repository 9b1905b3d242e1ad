// What the metadata tests run against: a real etcd from Debian's
// etcd-server (one member or a cluster, on free loopback ports, in a
// temporary data directory), the small HTTP metadata server beside this
// file (Mooncake's protocol), and the helpers to drive engines with them.
// Every process started here is SIGKILLed and reaped by its owner's
// destructor and gets PR_SET_PDEATHSIG, so none outlives the test.
#pragma once

#include <kvlink/engine.hpp>
#include <kvlink/metadata/etcd.hpp>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "../support/test_support.hpp"
#include "etcd_binary.hpp"
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

namespace kvlink_meta {

using namespace std::chrono_literals;

/// A temporary directory, removed with what it holds.
struct temp_dir {
  std::string path;
  temp_dir() {
    char tmpl[] = "/tmp/kvlink-metadata-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr)
      throw std::system_error(errno, std::generic_category(), "mkdtemp");
    path = tmpl;
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

/// A loopback port nobody listens on now.
inline std::uint16_t free_port() {
  asio::io_context io;
  asio::ip::tcp::acceptor a(io, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  return a.local_endpoint().port();
}

/// A child process; stdout+stderr to `log` (or to a pipe read by
/// read_line() when `log` is empty).
class process {
 public:
  process(std::vector<std::string> args, const std::string& log) {
    int out[2] = {-1, -1};
    if (log.empty() && ::pipe2(out, O_CLOEXEC) != 0) {
      throw std::system_error(errno, std::generic_category(), "pipe2");
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      int fd = log.empty() ? out[1] : ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
      }
      const int null_in = ::open("/dev/null", O_RDONLY);
      if (null_in >= 0) ::dup2(null_in, STDIN_FILENO);
      ::close_range(3, ~0U, 0);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    if (log.empty()) {
      ::close(out[1]);
      from_ = out[0];
    }
    if (pid_ < 0) throw std::system_error(errno, std::generic_category(), "fork");
  }
  ~process() {
    kill_now();
    if (from_ >= 0) ::close(from_);
  }
  process(const process&) = delete;
  process& operator=(const process&) = delete;

  pid_t pid() const noexcept { return pid_; }
  void signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  void kill_now() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }
  /// Waits for it to exit; its exit status (-1: killed, or still running
  /// after `limit`, then killed).
  int wait(std::chrono::milliseconds limit = 60s) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (pid_ > 0 && std::chrono::steady_clock::now() < until) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(10ms);
    }
    kill_now();
    return -1;
  }

  bool running() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
    return true;
  }

  /// One line of its output ("" on EOF or after `limit`).
  std::string read_line(std::chrono::milliseconds limit = 10s) {
    const auto until = std::chrono::steady_clock::now() + limit;
    for (;;) {
      if (const auto nl = buf_.find('\n'); nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      if (left <= 0ms || from_ < 0) return {};
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[1024];
      const auto n = ::read(from_, chunk, sizeof chunk);
      if (n <= 0) return {};
      buf_.append(chunk, static_cast<std::size_t>(n));
    }
  }

 private:
  pid_t pid_ = -1;
  int from_ = -1;
  std::string buf_;
};

/// One call to etcd's gateway on `endpoint`, from a private io_context,
/// through kvlink's own client (TLS when `tls` is given).
inline std::error_code etcd_call(const std::string& endpoint, const std::string& path,
                                 const nlohmann::json& body, nlohmann::json& out,
                                 std::shared_ptr<kvlink::detail::http::tls_context> tls = nullptr,
                                 const std::string& user = {}, const std::string& password = {}) {
  asio::io_context io;
  std::error_code result = kvlink::errc::cancelled;
  std::string what;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        kvlink::detail::etcd_client c(io.get_executor(),
                                      {{endpoint}, tls, user, password, std::chrono::seconds(2)});
        result = co_await c.call(path, body, out, what);
        c.shutdown();
      },
      asio::detached);
  io.run();
  return result;
}

/// A real etcd: `members` of them on loopback, each with its own data
/// directory under `dir`.
class etcd_cluster {
 public:
  struct options {
    int members = 1;
    bool tls = false;  ///< https client URLs with client certificate auth
    std::string cert{}, key{}, ca{};
    /// kvlink's TLS context for the harness's own calls (tls = true).
    std::shared_ptr<kvlink::detail::http::tls_context> client_tls{};
  };

  etcd_cluster(const std::string& dir, options o)
      : dir_(dir), o_(std::move(o)), tls_(o_.client_tls) {
    std::random_device rd;
    token_ = "kvlink-test-" + std::to_string(rd());
    procs_.resize(static_cast<std::size_t>(o_.members));
    // The ports are free when picked, not reserved: another process of a
    // busy machine may take one before etcd binds it (a member then never
    // joins). A start that does not become ready is tried again from
    // scratch with new ports, twice at most; the error carries the logs.
    for (int attempt = 1;; ++attempt) {
      client_.clear();
      peer_.clear();
      for (int i = 0; i < o_.members; ++i) {
        client_.push_back(free_port());
        peer_.push_back(free_port());
      }
      for (int i = 0; i < o_.members; ++i) start(i);
      try {
        wait_ready();
        return;
      } catch (const std::runtime_error& e) {
        const std::string logs = log_tails();
        for (auto& p : procs_) p.reset();
        if (attempt == 3) throw std::runtime_error(std::string(e.what()) + logs);
        std::error_code ignored;
        for (int i = 0; i < o_.members; ++i) std::filesystem::remove_all(data_dir(i), ignored);
        token_ += "-again";
      }
    }
  }

  /// "etcd://127.0.0.1:p1,127.0.0.1:p2,..."
  std::string url() const {
    std::string u = "etcd://";
    for (std::size_t i = 0; i < client_.size(); ++i) {
      if (i) u += ",";
      u += endpoint(static_cast<int>(i));
    }
    return u;
  }
  std::string endpoint(int i) const {
    return "127.0.0.1:" + std::to_string(client_[static_cast<std::size_t>(i)]);
  }

  void kill(int i) { procs_[static_cast<std::size_t>(i)].reset(); }

  /// Starts member `i` again; `wipe`: with an empty data directory (a
  /// single-member cluster that lost everything).
  void restart(int i, bool wipe) {
    kill(i);
    if (wipe) {
      std::error_code ignored;
      std::filesystem::remove_all(data_dir(i), ignored);
      token_ += "-again";
    }
    start(i);
  }

  /// Waits until every running member answers a linearizable read.
  void wait_ready(std::chrono::seconds limit = 30s) {
    const auto until = std::chrono::steady_clock::now() + limit;
    for (std::size_t i = 0; i < procs_.size(); ++i) {
      if (!procs_[i]) continue;
      for (;;) {
        nlohmann::json out;
        if (!etcd_call(endpoint(static_cast<int>(i)), "/v3/kv/range", {{"key", "eA=="}}, out,
                       tls_)) {
          break;
        }
        if (std::chrono::steady_clock::now() > until) {
          throw std::runtime_error("etcd did not become ready; see " + dir_ + "/etcd-*.log");
        }
        std::this_thread::sleep_for(100ms);
      }
    }
  }

  /// The last lines of each member's log, for an error message.
  std::string log_tails() const {
    std::string out;
    for (int i = 0; i < o_.members; ++i) {
      std::ifstream in(dir_ + "/etcd-" + std::to_string(i) + ".log", std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (text.size() > 1500) text.erase(0, text.size() - 1500);
      out += "\n--- etcd-" + std::to_string(i) + ".log (end) ---\n" + text;
    }
    return out;
  }

  /// The index of the leader (-1 if none answers).
  int leader() {
    for (std::size_t i = 0; i < procs_.size(); ++i) {
      if (!procs_[i]) continue;
      nlohmann::json out;
      if (etcd_call(endpoint(static_cast<int>(i)), "/v3/maintenance/status",
                    nlohmann::json::object(), out, tls_)) {
        continue;
      }
      // Member ids are uint64, written as strings.
      const auto leader = out.value("leader", std::string{});
      const auto self =
          out.value("header", nlohmann::json::object()).value("member_id", std::string{});
      if (!leader.empty() && leader == self) return static_cast<int>(i);
    }
    return -1;
  }

  /// Turns on etcd's authentication with user root.
  void enable_auth(const std::string& root_password) {
    nlohmann::json out;
    const auto ep = endpoint(0);
    etcd_call(ep, "/v3/auth/user/add", {{"name", "root"}, {"password", root_password}}, out, tls_);
    etcd_call(ep, "/v3/auth/role/add", {{"name", "root"}}, out, tls_);
    etcd_call(ep, "/v3/auth/user/grant", {{"user", "root"}, {"role", "root"}}, out, tls_);
    if (auto ec = etcd_call(ep, "/v3/auth/enable", nlohmann::json::object(), out, tls_)) {
      throw std::runtime_error("etcd auth enable: " + ec.message());
    }
  }

 private:
  std::string data_dir(int i) const { return dir_ + "/member-" + std::to_string(i); }

  void start(int i) {
    const std::string scheme = o_.tls ? "https://" : "http://";
    std::string cluster;
    for (int m = 0; m < o_.members; ++m) {
      if (m) cluster += ",";
      // fmt, not "m" + std::to_string(m): g++ 12 at -O3 takes the latter
      // for an overlapping memcpy (-Wrestrict, a false positive; issue 28).
      cluster += fmt::format("m{}=http://127.0.0.1:{}", m, peer_[static_cast<std::size_t>(m)]);
    }
    const std::string client = scheme + endpoint(i);
    const std::string peer = fmt::format("http://127.0.0.1:{}", peer_[static_cast<std::size_t>(i)]);
    std::vector<std::string> args{etcd_binary(),
                                  "--name",
                                  fmt::format("m{}", i),
                                  "--data-dir",
                                  data_dir(i),
                                  "--listen-client-urls",
                                  client,
                                  "--advertise-client-urls",
                                  client,
                                  "--listen-peer-urls",
                                  peer,
                                  "--initial-advertise-peer-urls",
                                  peer,
                                  "--initial-cluster",
                                  cluster,
                                  "--initial-cluster-state",
                                  "new",
                                  "--initial-cluster-token",
                                  token_,
                                  "--heartbeat-interval",
                                  "50",
                                  "--election-timeout",
                                  "500"};
    if (o_.tls) {
      args.insert(args.end(), {"--cert-file", o_.cert, "--key-file", o_.key, "--trusted-ca-file",
                               o_.ca, "--client-cert-auth"});
    }
    procs_[static_cast<std::size_t>(i)] =
        std::make_unique<process>(args, dir_ + "/etcd-" + std::to_string(i) + ".log");
  }

  std::string dir_;
  options o_;
  std::string token_;
  std::vector<std::uint16_t> client_, peer_;
  std::vector<std::unique_ptr<process>> procs_;
  std::shared_ptr<kvlink::detail::http::tls_context> tls_;
};

// ------------------------------------------------------------ engines

struct outcome {
  std::error_code ec;
  kvlink::transfer_result result;
  bool done = false;
};

inline std::pair<std::error_code, kvlink::peer> connect(asio::io_context& io, kvlink::engine& e,
                                                        const std::string& name) {
  std::optional<std::pair<std::error_code, kvlink::peer>> got;
  e.async_connect(name, [&got](std::error_code ec, kvlink::peer p) { got.emplace(ec, p); });
  if (!kvlink_test::run_until(
          io, [&] { return got.has_value(); }, 60s)) {
    throw std::runtime_error("async_connect(" + name + ") did not complete");
  }
  return *got;
}

inline std::pair<std::error_code, kvlink::resolved_peer> resolve(asio::io_context& io,
                                                                 kvlink::engine& e,
                                                                 const std::string& name) {
  std::optional<std::pair<std::error_code, kvlink::resolved_peer>> got;
  e.async_resolve(name, [&got](std::error_code ec, kvlink::resolved_peer rp) {
    got.emplace(ec, std::move(rp));
  });
  if (!kvlink_test::run_until(
          io, [&] { return got.has_value(); }, 60s)) {
    throw std::runtime_error("async_resolve(" + name + ") did not complete");
  }
  return *got;
}

/// Starts a transfer; `out.done` once it completed.
inline void start_transfer(kvlink::engine& e, std::vector<kvlink::transfer_request> reqs,
                           outcome& out) {
  out = outcome{};
  e.async_submit_transfer(reqs, [&out](std::error_code ec, kvlink::transfer_result r) {
    out.ec = ec;
    out.result = r;
    out.done = true;
  });
}

inline outcome transfer(asio::io_context& io, kvlink::engine& e,
                        std::vector<kvlink::transfer_request> reqs) {
  outcome out;
  start_transfer(e, std::move(reqs), out);
  if (!kvlink_test::run_until(
          io, [&] { return out.done; }, 60s)) {
    throw std::runtime_error("a transfer did not complete");
  }
  return out;
}

/// Runs `io` for `d`.
inline void run_for(asio::io_context& io, std::chrono::milliseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) io.run_one_for(20ms);
}

}  // namespace kvlink_meta
