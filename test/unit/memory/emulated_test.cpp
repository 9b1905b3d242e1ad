// Tests of include/kvlink/memory/emulated.hpp beyond the device layer's own
// (device_test.cpp runs those against it): its device memory is memory the
// CPU cannot touch, as a GPU's is. A load from it kills the process with
// SIGSEGV; a syscall given it fails with EFAULT; its copy engine alone
// reaches the bytes.
#include <kvlink/memory/emulated.hpp>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <string>
#include <system_error>
#include <vector>

#include "../../support/test_support.hpp"
#include <asio/io_context.hpp>
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

// Forks a child that runs `touch` on `p`; returns how it ended: the signal
// that killed it, or 0 when it exited.
template <class Touch>
int child_touching(std::byte* p, Touch touch) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);  // the fault is expected: no core file
    ::signal(SIGSEGV, SIG_DFL);
    touch(p);
    ::_exit(0);
  }
  REQUIRE(pid > 0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return WIFSIGNALED(status) ? WTERMSIG(status) : 0;
}

}  // namespace

TEST_CASE("emulated device: a CPU load or store of its memory faults") {
  auto rt = kvlink::emulated_device::get();
  kvlink::device_buffer buf{rt, 0, 8192};
  CHECK(child_touching(buf.data(), [](std::byte* p) {
          volatile std::byte b = p[100];
          (void)b;
        }) == SIGSEGV);
  CHECK(child_touching(buf.data() + 5000, [](std::byte* p) {
          *static_cast<volatile std::byte*>(p) = std::byte{1};
        }) == SIGSEGV);
  // The same child touching host memory exits normally: the fault is the
  // device memory's.
  std::vector<std::byte> host(8192);
  CHECK(child_touching(host.data(), [](std::byte* p) {
          volatile std::byte b = p[100];
          (void)b;
        }) == 0);
}

TEST_CASE("emulated device: a syscall given its memory fails with EFAULT") {
  auto rt = kvlink::emulated_device::get();
  kvlink::device_buffer buf{rt, 1, 4096};
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  errno = 0;
  CHECK(::write(fds[1], buf.data(), 16) == -1);
  CHECK(errno == EFAULT);
  const char text[] = "0123456789abcdef";
  REQUIRE(::write(fds[1], text, 16) == 16);
  errno = 0;
  CHECK(::read(fds[0], buf.data(), 16) == -1);
  CHECK(errno == EFAULT);
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST_CASE("emulated device: its copy engine reaches the bytes a syscall cannot") {
  auto rt = kvlink::emulated_device::get();
  kvlink::device_buffer buf{rt, 0, 4096};
  std::error_code ec;
  std::string what;
  asio::io_context io;
  auto s = rt->open_stream(0, io.get_executor(), ec, what);
  REQUIRE(s);
  std::vector<std::byte> in(4096), out(4096);
  kvlink_test::fill_pattern(in.data(), in.size(), 9, 0);
  int done = 0;
  s->async_copy(buf.data(), {kvlink::memory_kind::device, 0}, in.data(), {}, in.size(),
                [&](std::error_code e) {
                  CHECK_FALSE(e);
                  ++done;
                });
  s->async_copy(out.data(), {}, buf.data(), {kvlink::memory_kind::device, 0}, out.size(),
                [&](std::error_code e) {
                  CHECK_FALSE(e);
                  ++done;
                });
  // The stream holds no work on `io` between a copy's start and its
  // completion: run until both are in.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds{60};
  while (done < 2 && std::chrono::steady_clock::now() < until) {
    io.restart();
    io.run_one_for(std::chrono::milliseconds{10});
  }
  REQUIRE(done == 2);
  CHECK(out == in);
  // The engine's view is the same bytes; the user's address is not readable.
  const auto* view = rt->view(buf.data(), 4096, ec);
  REQUIRE(view != nullptr);
  CHECK(kvlink_test::is_pattern(view, 4096, 9, 0));
  CHECK(rt->view(buf.data() + 1, 4096, ec) == nullptr);
  CHECK(ec == kvlink::errc::out_of_bounds);
}
