// Same host, same kernel: who we are to peers on this machine, and
// cross-memory attach (process_vm_readv / process_vm_writev), the one-copy
// path between two processes' memory.
//
//   host_identity::self()   boot id, PID namespace, host name, pid, uid
//   cma::copy(pid, dir, ...) one kernel copy between our memory and pid's
//   cma::read(pid, at, out)  a probe: whether pid lets us attach, and what is there
//   pid_watch                a pidfd: whether the process we copy to has exited
//
// Permission: the kernel allows cross-memory attach to a process only where
// ptrace would be allowed (PTRACE_MODE_ATTACH_REALCREDS): same user and a
// dumpable process, or CAP_SYS_PTRACE, and Yama's ptrace_scope permitting.
// refusal_reason() says which, in words.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <system_error>

#include <fmt/format.h>
#include <limits.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

namespace kvlink::shm {

/// What identifies this process's machine and PID namespace to a peer.
struct host_identity {
  std::string boot_id;  ///< /proc/sys/kernel/random/boot_id: one per booted kernel
  std::string pid_ns;   ///< "pid:[4026531836]": PIDs mean the same only inside one
  std::string host;     ///< the host name, for messages
  std::int64_t pid = 0;
  std::int64_t uid = 0;

  static host_identity self() {
    host_identity h;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::getline(f, h.boot_id);
    char buf[256] = {};
    const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
    if (n > 0) h.pid_ns.assign(buf, static_cast<std::size_t>(n));
    char name[HOST_NAME_MAX + 1] = {};
    if (::gethostname(name, sizeof name - 1) == 0) h.host = name;
    h.pid = ::getpid();
    h.uid = ::geteuid();
    return h;
  }
};

namespace cma {

enum class direction { read, write };  ///< read: pid's memory -> ours; write: ours -> pid's

/// Iovec entries per call: the kernel refuses more than IOV_MAX.
inline constexpr std::size_t max_iov = IOV_MAX;

/// One copy between `local` and `remote` (pid's addresses), element by
/// element in order. Returns the bytes copied (fewer when a fault stopped
/// it), or -1 with errno.
inline ssize_t copy(pid_t pid, direction d, const iovec* local, std::size_t nlocal,
                    const iovec* remote, std::size_t nremote) noexcept {
  return d == direction::read ? ::process_vm_readv(pid, local, nlocal, remote, nremote, 0)
                              : ::process_vm_writev(pid, local, nlocal, remote, nremote, 0);
}

/// Reads `length` bytes at `at` in pid's memory into `out`.
inline std::error_code read(pid_t pid, std::uint64_t at, void* out, std::size_t length) noexcept {
  iovec l{out, length};
  iovec r{reinterpret_cast<void*>(static_cast<std::uintptr_t>(at)), length};
  const ssize_t n = copy(pid, direction::read, &l, 1, &r, 1);
  if (n < 0) return {errno, std::system_category()};
  if (static_cast<std::size_t>(n) != length) return std::make_error_code(std::errc::bad_address);
  return {};
}

/// Why the kernel refused to let us attach to `pid`, in words.
inline std::string refusal_reason(int err, std::int64_t pid) {
  switch (err) {
    case EPERM:
      return fmt::format(
          "cross-memory attach to pid {} refused (process_vm_readv: {}): the processes run as "
          "different users, the peer is not dumpable, or Yama's kernel.yama.ptrace_scope "
          "forbids it; run both as one user with ptrace_scope 0, or give this one "
          "CAP_SYS_PTRACE",
          pid, std::strerror(err));
    case ESRCH:
      return fmt::format("no process {} in this PID namespace", pid);
    case ENOSYS:
      return "process_vm_readv is not available (kernel without CONFIG_CROSS_MEMORY_ATTACH, or "
             "a seccomp filter)";
    case EFAULT:
      return fmt::format("pid {} is not the peer: its probe word is not where it said", pid);
    default:
      return fmt::format("cross-memory attach to pid {} failed: {}", pid, std::strerror(err));
  }
}

}  // namespace cma

/// Whether a process (the peer we copy to) has exited, through a pidfd: a
/// PID that was reused after the peer died must never receive its bytes.
class pid_watch {
 public:
  pid_watch() = default;
  explicit pid_watch(std::int64_t pid) noexcept {
#ifdef SYS_pidfd_open
    fd_ = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#endif
  }
  pid_watch(const pid_watch&) = delete;
  pid_watch& operator=(const pid_watch&) = delete;
  ~pid_watch() {
    if (fd_ >= 0) ::close(fd_);
  }

  /// Whether a pidfd could be opened (kernels before 5.3 have none).
  bool watching() const noexcept { return fd_ >= 0; }
  int fd() const noexcept { return fd_; }

  /// True once the process exited (a pidfd polls readable then).
  bool exited() const noexcept {
    if (fd_ < 0) return false;
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
  }

 private:
  int fd_ = -1;
};

}  // namespace kvlink::shm
