// A kvlink_test_peer child process (test/support/test_peer.cpp), or another
// line-driven test program, for tests that need a peer in another process: pipes to its stdin and
// from its stdout, its address from its first line, commands answered line by line. The destructor
// SIGKILLs it if it still runs and always reaps it; it gets PR_SET_PDEATHSIG, so no process
// outlives the test.
#pragma once

#include <cerrno>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

namespace kvlink_test {

using namespace std::chrono_literals;

inline std::system_error sys_error(const char* what) {
  return {errno, std::generic_category(), what};
}

/// Waits until every thread of `pid` is stopped (SIGSTOP); false after `limit`.
inline bool wait_stopped(pid_t pid, std::chrono::milliseconds limit = 10s) {
  const auto until = std::chrono::steady_clock::now() + limit;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  while (std::chrono::steady_clock::now() < until) {
    bool all = true;
    std::error_code ec;
    for (const auto& t : std::filesystem::directory_iterator(tasks, ec)) {
      std::ifstream st(t.path() / "stat");
      std::string line;
      std::getline(st, line);
      const auto paren = line.rfind(')');  // "pid (comm) S ..."
      if (paren == std::string::npos || paren + 2 >= line.size() ||
          (line[paren + 2] != 'T' && line[paren + 2] != 't')) {
        all = false;
      }
    }
    if (all && !ec) return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

// A kvlink_test_peer child with pipes to its stdin and from its stdout. The
// destructor SIGKILLs it if it still runs and always reaps it.

class peer_process {
 public:
#ifdef KVLINK_TEST_PEER_PATH
  /// kvlink_test_peer (KVLINK_TEST_PEER_PATH, set by test/support/CMakeLists.txt).
  explicit peer_process(std::vector<std::string> args)
      : peer_process(KVLINK_TEST_PEER_PATH, std::move(args), "ADDR ") {}
#endif

  /// Another program of the same kind: `exe` with `args`, whose first line
  /// starts with `ready` (its rest is address()); any other first line is
  /// thrown as an error.
  peer_process(const std::string& exe, std::vector<std::string> args, const std::string& ready) {
    // Writing to the pipe of a child that died must be an error, not SIGPIPE.
    std::signal(SIGPIPE, SIG_IGN);
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0) throw sys_error("pipe2");
    if (::pipe2(out, O_CLOEXEC) != 0) {
      ::close(in[0]);
      ::close(in[1]);
      throw sys_error("pipe2");
    }
    args.insert(args.begin(), exe);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      // Child: only async-signal-safe calls until execv.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // the test already died
      ::dup2(in[0], STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      // No inherited descriptors (other children's pipes, engine sockets).
      ::close_range(3, ~0U, 0);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    if (pid_ < 0) {
      ::close(in[1]);
      ::close(out[0]);
      throw sys_error("fork");
    }
    to_child_ = in[1];
    from_child_ = out[0];
    const auto first = read_line();
    if (first.rfind(ready, 0) != 0) {
      kill_now();  // the destructor does not run for a constructor that throws
      close_fds();
      throw std::runtime_error(exe + " did not say it is ready ('" + ready + "...'); it said '" +
                               first + "'");
    }
    address_ = first.substr(ready.size());
  }

  ~peer_process() {
    close_fds();
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      reap();
    }
  }

  peer_process(const peer_process&) = delete;
  peer_process& operator=(const peer_process&) = delete;

  const std::string& address() const noexcept { return address_; }
  pid_t pid() const noexcept { return pid_; }

  /// Sends `sig` (SIGSTOP / SIGCONT: a hung peer) while it runs.
  void signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }

  /// SIGSTOPs it and waits until every thread of it has stopped: the signal
  /// takes effect asynchronously (the thread that takes it must run first,
  /// and a thread polling on another core goes on until it is interrupted;
  /// on a loaded machine that took long enough for a ring's target to serve
  /// a whole transfer). False if it did not stop within `limit`.
  bool stop(std::chrono::milliseconds limit = 10s) {
    signal(SIGSTOP);
    return pid_ > 0 && wait_stopped(pid_, limit);
  }

  /// Sends one command line and returns the one-line answer ("" on EOF or
  /// after the generous timeout).
  std::string command(const std::string& line) {
    send(line);
    return read_line();
  }

  void send(const std::string& line) {
    const std::string bytes = line + "\n";
    std::size_t done = 0;
    while (done < bytes.size()) {
      const auto n = ::write(to_child_, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw sys_error("write to kvlink_test_peer");
      done += static_cast<std::size_t>(n);
    }
  }

  std::string read_line(std::chrono::seconds limit = 120s) {
    const auto until = std::chrono::steady_clock::now() + limit;
    for (;;) {
      if (const auto nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      if (left <= 0ms || from_child_ < 0) return {};
      pollfd p{from_child_, POLLIN, 0};
      const int r = ::poll(&p, 1, static_cast<int>(left.count()));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return {};
      char chunk[4096];
      const auto n = ::read(from_child_, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return {};
      buffer_.append(chunk, static_cast<std::size_t>(n));
    }
  }

  /// SIGKILL now, and reap.
  void kill_now() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    reap();
  }

  /// Closes its stdin (the signal to exit) and waits; returns its exit
  /// status, or -1 if it did not exit normally within the limit (then it is
  /// killed).
  int finish(std::chrono::seconds limit = 120s) {
    close_fds();
    const auto until = std::chrono::steady_clock::now() + limit;
    while (pid_ > 0 && std::chrono::steady_clock::now() < until) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      if (r < 0 && errno != EINTR) break;
      ::usleep(10000);
    }
    kill_now();
    return -1;
  }

 private:
  void reap() {
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }

  void close_fds() {
    if (to_child_ >= 0) ::close(to_child_);
    if (from_child_ >= 0) ::close(from_child_);
    to_child_ = from_child_ = -1;
  }

  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buffer_;
  std::string address_;
};

}  // namespace kvlink_test
