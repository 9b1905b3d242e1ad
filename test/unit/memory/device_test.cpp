// Tests of include/kvlink/memory/device.hpp, written once over the device
// layer and run against every runtime: KVLINK_TEST_DEVICE names it
// ("emulated" by default: ctest unit.memory; "cuda": ctest cuda.memory,
// which runs only this suite). A runtime this build lacks, or one that is
// not usable here (no driver, no GPU), ends the program with exit code 77
// before any test runs, which ctest reports as skipped, never passed.
//
// Device memory is checked the only way it can be: by copying it back.
// Export/import runs in a second process (this binary again, exec'd: a
// CUDA process must not be forked and carry on), which duplicates the
// exported fd with pidfd_getfd or opens the IPC handle, checks the bytes
// the parent wrote and writes its own, which the parent then checks.
#include <kvlink/memory/device.hpp>
#include <kvlink/memory/emulated.hpp>
#ifdef KVLINK_TEST_HAS_CUDA
#include <kvlink/cuda.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "../../support/test_support.hpp"
#include <asio/io_context.hpp>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace {

using kvlink::memory_desc;
using kvlink::memory_kind;
using kvlink_test::fill_pattern;
using kvlink_test::is_pattern;

// The child's instructions (set by the parent for the exec'd child only).
constexpr const char* child_env = "KVLINK_TEST_DEVICE_CHILD";

std::string requested() {
  const char* e = std::getenv("KVLINK_TEST_DEVICE");
  return e != nullptr && *e != '\0' ? e : "emulated";
}

// Chooses the runtime before doctest runs anything: exit 77 (skipped) when
// it is missing or unusable, with the reason on stderr.
struct device_gate {
  device_gate() {
    const auto name = requested();
    auto rt = kvlink::device_catalog::global().find(name);
    std::string why;
    if (!rt) {
      why = fmt::format("this build has no '{}' device runtime (it has: {})", name,
                        kvlink::device_catalog::global().names());
    } else if (!rt->available()) {
      why = fmt::format("the '{}' device runtime is not usable here: {}", name,
                        rt->unavailable_reason());
    } else if (rt->device_count() <= 0) {
      why = fmt::format("the '{}' device runtime has no devices", name);
    }
    if (why.empty()) return;
    std::fprintf(stderr, "kvlink device tests skipped: %s\n", why.c_str());
    std::fflush(stderr);
    std::_Exit(77);
  }
};
const device_gate gate;

std::shared_ptr<kvlink::device_runtime> runtime() {
  return kvlink::device_catalog::global().find(requested());
}

// Runs `io` until `done` (at most 120 s). A stream need not keep `io` busy
// between a copy's start and its completion, so `io` is restarted whenever
// it runs out of work.
template <class Pred>
bool wait_for(asio::io_context& io, Pred done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds{120};
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    io.restart();
    if (io.run_one_for(std::chrono::milliseconds{10}) == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds{50});
    }
  }
  return true;
}

memory_desc on_device(std::int32_t d) { return memory_desc{memory_kind::device, d}; }

// Runs one copy on `s` to completion: its error code, and whether the
// handler ran inside async_copy (it never may).
struct copy_result {
  std::error_code ec;
  bool inline_call = false;
  bool completed = false;
};

copy_result copy(asio::io_context& io, kvlink::device_stream& s, void* dst, memory_desc dm,
                 const void* src, memory_desc sm, std::size_t n) {
  copy_result r;
  bool inside = true;
  s.async_copy(dst, dm, src, sm, n, [&](std::error_code ec) {
    r.ec = ec;
    r.inline_call = inside;
    r.completed = true;
  });
  inside = false;
  r.inline_call = r.inline_call || r.completed;
  REQUIRE(wait_for(io, [&] { return r.completed; }));
  return r;
}

std::shared_ptr<kvlink::device_stream> open(kvlink::device_runtime& rt, asio::io_context& io,
                                            std::int32_t device) {
  std::error_code ec;
  std::string what;
  auto s = rt.open_stream(device, io.get_executor(), ec, what);
  INFO(what);
  REQUIRE(s);
  REQUIRE_FALSE(ec);
  return s;
}

}  // namespace

TEST_SUITE("device") {
  TEST_CASE("device: the requested runtime is here, usable and in the catalog") {
    auto rt = runtime();
    REQUIRE(rt);
    CHECK(rt->name() == requested());
    CHECK(rt->available());
    CHECK(rt->unavailable_reason().empty());
    CHECK(rt->device_count() > 0);
    std::error_code ec;
    std::string what;
    kvlink::device_config c;
    c.runtime = requested();
    CHECK(kvlink::device_catalog::global().select(c, ec, what) == rt);
    CHECK_FALSE(ec);
    c.runtime = "none";
    CHECK(kvlink::device_catalog::global().select(c, ec, what) == nullptr);
  }

  TEST_CASE("device: classify finds device memory's device and allocation; host is host") {
    auto rt = runtime();
    for (std::int32_t d = 0; d < std::min(rt->device_count(), 2); ++d) {
      CAPTURE(d);
      const std::size_t n = (1u << 20) + 37;
      kvlink::device_buffer buf{rt, d, n};
      for (const std::size_t off : {std::size_t{0}, std::size_t{1}, std::size_t{4097}, n - 1}) {
        CAPTURE(off);
        const auto info = rt->classify(buf.data() + off);
        CHECK(info.memory == on_device(d));
        CHECK_FALSE(info.managed);
        CHECK(info.base == reinterpret_cast<std::uintptr_t>(buf.data()));
        CHECK(info.size >= n);
      }
    }
    int on_stack = 0;
    std::vector<std::byte> on_heap(100);
    for (const void* p :
         {static_cast<const void*>(&on_stack), static_cast<const void*>(on_heap.data()),
          static_cast<const void*>(nullptr)}) {
      const auto info = rt->classify(p);
      CHECK(info.memory.kind == memory_kind::host);
      CHECK(info.base == 0);
      CHECK(info.size == 0);
    }
  }

  TEST_CASE("device: allocate and free; a bad device or size is an error with the reason") {
    auto rt = runtime();
    std::error_code ec;
    std::string what;
    for (int i = 0; i < 3; ++i) {
      void* p = rt->allocate(0, 12345, ec, what);
      INFO(what);
      REQUIRE(p != nullptr);
      CHECK(rt->classify(p).memory == on_device(0));
      rt->free(p);
    }
    CHECK(rt->allocate(rt->device_count(), 4096, ec, what) == nullptr);
    CHECK(ec);
    CHECK_FALSE(what.empty());
    ec = {};
    what.clear();
    CHECK(rt->allocate(-1, 4096, ec, what) == nullptr);
    CHECK(ec);
    CHECK_FALSE(what.empty());
    int host = 0;
    rt->free(&host);  // not its memory: ignored
  }

  TEST_CASE("device: pinned host memory is host memory the CPU uses") {
    auto rt = runtime();
    const std::size_t n = (3u << 20) + 1;
    kvlink::pinned_buffer pinned{rt, n};
    REQUIRE(pinned.data() != nullptr);
    fill_pattern(pinned.data(), n, 11, 0);
    CHECK(is_pattern(pinned.data(), n, 11, 0));
    CHECK(rt->classify(pinned.data()).memory.kind == memory_kind::host);
  }

  TEST_CASE("device: H2D, D2D and D2H copies at odd offsets, 1 B to 64 MiB, bytes checked") {
    auto rt = runtime();
    asio::io_context io;
    const std::int32_t dev = rt->device_count() - 1;
    auto s = open(*rt, io, dev);
    CHECK(s->device() == dev);
    CHECK(s->copies(memory_kind::host, memory_kind::device));
    CHECK(s->copies(memory_kind::device, memory_kind::host));
    CHECK(s->copies(memory_kind::device, memory_kind::device));
    const std::size_t max = 64u << 20;
    kvlink::device_buffer a{rt, dev, max + 8192};
    kvlink::device_buffer b{rt, dev, max + 8192};
    kvlink::pinned_buffer pinned{rt, max + 64};
    std::vector<std::byte> src(max + 64), back(max + 64);
    std::uint64_t seed = 1;
    for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{4097},
                                std::size_t{65539}, std::size_t{(1u << 20) + 5}, max}) {
      CAPTURE(n);
      for (const bool use_pinned : {false, true}) {
        CAPTURE(use_pinned);
        ++seed;
        std::byte* host_src = use_pinned ? pinned.data() + 3 : src.data() + 3;
        fill_pattern(host_src, n, seed, 0);
        auto r = copy(io, *s, a.data() + 13, on_device(dev), host_src, {}, n);  // H2D
        CHECK_FALSE(r.inline_call);
        REQUIRE_FALSE(r.ec);
        r = copy(io, *s, b.data() + 4099, on_device(dev), a.data() + 13, on_device(dev), n);
        CHECK_FALSE(r.inline_call);
        REQUIRE_FALSE(r.ec);
        std::byte* host_dst = use_pinned ? pinned.data() + 5 : back.data() + 5;
        std::memset(host_dst, 0, n + 1);
        r = copy(io, *s, host_dst, {}, b.data() + 4099, on_device(dev), n);  // D2H
        CHECK_FALSE(r.inline_call);
        REQUIRE_FALSE(r.ec);
        CHECK(is_pattern(host_dst, n, seed, 0));
        CHECK(host_dst[n] == std::byte{0});  // not one byte more
      }
    }
  }

  TEST_CASE("device: copies on one stream complete in order, never inside async_copy") {
    auto rt = runtime();
    asio::io_context io;
    auto s = open(*rt, io, 0);
    const std::size_t max = 8u << 20;
    kvlink::device_buffer dev{rt, 0, 8 * max + 64 * 4096};
    std::vector<std::byte> host(max);
    fill_pattern(host.data(), max, 3, 0);
    std::vector<int> order;
    bool inside = false;
    bool ran_inside = false;
    const int copies = 64;
    for (int i = 0; i < copies; ++i) {
      // Large copies first, then small ones: a small copy must not
      // overtake a large one queued before it.
      const auto at = static_cast<std::size_t>(i);
      const std::size_t n = i < 8 ? max : 1 + at * 17;
      const std::size_t off = i < 8 ? at * max : 8 * max + at * 4096;
      inside = true;
      s->async_copy(dev.data() + off, on_device(0), host.data(), {}, n, [&, i](std::error_code ec) {
        ran_inside = ran_inside || inside;
        CHECK_FALSE(ec);
        order.push_back(i);
      });
      inside = false;
    }
    CHECK(order.empty());
    REQUIRE(wait_for(io, [&] { return order.size() == copies; }));
    CHECK_FALSE(ran_inside);
    CHECK(std::is_sorted(order.begin(), order.end()));
    // Copies from several threads at once, each completion once.
    std::vector<std::thread> threads;
    std::atomic<int> done{0};
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 16; ++i) {
          s->async_copy(dev.data() + static_cast<std::size_t>(t * 16 + i) * 4096, on_device(0),
                        host.data(), {}, 4096, [&](std::error_code ec) {
                          CHECK_FALSE(ec);
                          ++done;
                        });
        }
      });
    }
    for (auto& t : threads) t.join();
    REQUIRE(wait_for(io, [&] { return done.load() == 64; }));
  }

  TEST_CASE("device: a copy past its allocation, or of memory that is not the device's, fails") {
    auto rt = runtime();
    asio::io_context io;
    auto s = open(*rt, io, 0);
    const std::size_t n = 1u << 20;
    kvlink::device_buffer dev{rt, 0, n};
    const auto size = rt->classify(dev.data()).size;
    REQUIRE(size >= n);
    std::vector<std::byte> host(2 * size);
    // Runs 100 bytes past the end: out_of_bounds, posted, nothing copied.
    auto r = copy(io, *s, dev.data() + size - 10, on_device(0), host.data(), {}, 110);
    CHECK_FALSE(r.inline_call);
    CHECK(r.ec == kvlink::errc::out_of_bounds);
    r = copy(io, *s, host.data(), {}, dev.data() + 1, on_device(0), size);
    CHECK(r.ec == kvlink::errc::out_of_bounds);
    // Host memory said to be CUDA device memory (the emulated device takes
    // the caller's word: host memory is plain memory to it).
    if (rt->name() == "cuda") {
      r = copy(io, *s, host.data(), on_device(0), dev.data(), on_device(0), 64);
      CHECK_FALSE(r.inline_call);
      CHECK(r.ec == kvlink::errc::invalid_argument);
    }
    // The stream still works after errors, and the errors kept their order.
    std::vector<std::error_code> seen;
    s->async_copy(dev.data(), on_device(0), host.data(), {}, 64,
                  [&](std::error_code ec) { seen.push_back(ec); });
    s->async_copy(dev.data() + size - 1, on_device(0), host.data(), {}, 2,
                  [&](std::error_code ec) { seen.push_back(ec); });
    s->async_copy(host.data(), {}, dev.data(), on_device(0), 64,
                  [&](std::error_code ec) { seen.push_back(ec); });
    REQUIRE(wait_for(io, [&] { return seen.size() == 3; }));
    CHECK_FALSE(seen[0]);
    CHECK(seen[1] == kvlink::errc::out_of_bounds);
    CHECK_FALSE(seen[2]);
    // A zero-byte copy completes, later.
    r = copy(io, *s, dev.data(), on_device(0), host.data(), {}, 0);
    CHECK_FALSE(r.inline_call);
    CHECK_FALSE(r.ec);
  }
}

namespace {

// Where the parent's and the child's patterns lie in the exported memory.
constexpr std::uint64_t parent_seed = 101;
constexpr std::uint64_t child_seed = 202;
constexpr std::size_t parent_off = 3;
constexpr std::size_t child_off = (1u << 20) + 1;
constexpr std::size_t span = (1u << 20) - 7;

std::string hex(const std::vector<std::uint8_t>& bytes) {
  std::string out;
  for (auto b : bytes) out += fmt::format("{:02x}", b);
  return out;
}

std::vector<std::uint8_t> unhex(std::string_view s) {
  std::vector<std::uint8_t> out;
  for (std::size_t i = 0; i + 1 < s.size(); i += 2) {
    out.push_back(static_cast<std::uint8_t>(std::stoul(std::string{s.substr(i, 2)}, nullptr, 16)));
  }
  return out;
}

// Starts this test binary again, running only the child case below with
// `spec` in its environment; returns its exit status (-1: did not finish).
int run_child(const std::string& spec) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back(std::string{child_env} + "=" + spec);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::string filter = "--test-case=device: the child side of export and import";
  std::vector<char*> argv{exe.data(), filter.data(), nullptr};
  // The child takes our descriptors with pidfd_getfd: where Yama restricts
  // ptrace to ancestors, let it (no-op elsewhere).
  ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  REQUIRE(pid > 0);
  int status = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds{120};
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ::prctl(PR_SET_PTRACER, 0, 0, 0, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  ::prctl(PR_SET_PTRACER, 0, 0, 0, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Exports the allocation at `p` (at least 2 MiB), lets a child process
// import it, check the parent's bytes and write its own, then checks those.
void exchange_with_child(kvlink::device_runtime& rt, std::byte* p, std::int32_t dev) {
  asio::io_context io;
  auto s = open(rt, io, dev);
  std::vector<std::byte> host(span);
  fill_pattern(host.data(), span, parent_seed, 0);
  auto r = copy(io, *s, p + parent_off, on_device(dev), host.data(), {}, span);
  REQUIRE_FALSE(r.ec);

  kvlink::exported_memory m;
  std::string what;
  const auto ec = rt.export_memory(p + 5, m, what);
  INFO(what);
  REQUIRE_FALSE(ec);
  CHECK(m.device == dev);
  CHECK(m.size >= child_off + span);
  CHECK_FALSE(m.method.empty());
  if (m.method == "ipc") CHECK(m.handle.size() == 64);
  if (m.method == "memfd" || m.method == "fd") CHECK(m.fd >= 0);
  MESSAGE("export method: ", m.method);

  const auto spec = fmt::format("{} {} {} {} {}", m.method, m.handle.empty() ? "-" : hex(m.handle),
                                m.fd, m.device, m.size);
  CHECK(run_child(spec) == 0);

  std::fill(host.begin(), host.end(), std::byte{0});
  r = copy(io, *s, host.data(), {}, p + child_off, on_device(dev), span);
  REQUIRE_FALSE(r.ec);
  CHECK(is_pattern(host.data(), span, child_seed, 0));
}

}  // namespace

TEST_SUITE("device") {
  TEST_CASE("device: export, import in a second process, bytes both ways") {
    auto rt = runtime();
    const std::int32_t dev = 0;
    kvlink::device_buffer buf{rt, dev, 4u << 20};
    exchange_with_child(*rt, buf.data(), dev);

    // Memory that is not the runtime's is not exported.
    std::vector<std::byte> host(64);
    kvlink::exported_memory m;
    std::string what;
    CHECK(rt->export_memory(host.data(), m, what) == kvlink::errc::not_registered);
    CHECK_FALSE(what.empty());
    // A malformed import is refused (and its fd closed).
    kvlink::exported_memory bad;
    bad.method = "no-such-method";
    bad.device = 0;
    bad.size = 4096;
    std::error_code ec;
    CHECK(rt->import_memory(bad, -1, ec, what) == nullptr);
    CHECK(ec == kvlink::errc::invalid_argument);
  }

#ifdef KVLINK_TEST_HAS_CUDA
  TEST_CASE("device: CUDA VMM memory exports as an fd when created shareable, else says why") {
    auto rt = runtime();
    auto* cuda = dynamic_cast<kvlink::cuda_device*>(rt.get());
    if (cuda == nullptr) return;  // the emulated device has no VMM memory
    std::error_code ec;
    std::string what;
    void* p = cuda->allocate_vmm(0, 4u << 20, true, ec, what);
    INFO(what);
    REQUIRE(p != nullptr);
    const auto info = rt->classify(static_cast<std::byte*>(p) + 100);
    CHECK(info.memory == on_device(0));
    CHECK(info.vmm);
    CHECK(info.base == reinterpret_cast<std::uintptr_t>(p));
    exchange_with_child(*rt, static_cast<std::byte*>(p), 0);
    rt->free(p);

    p = cuda->allocate_vmm(0, 2u << 20, false, ec, what);
    REQUIRE(p != nullptr);
    kvlink::exported_memory m;
    CHECK(rt->export_memory(p, m, what) == kvlink::errc::invalid_argument);
    CHECK(what.find("POSIX_FILE_DESCRIPTOR") != std::string::npos);
    rt->free(p);
  }
#endif

  TEST_CASE("device: the child side of export and import" *
            doctest::description("runs only in the process the export test starts")) {
    const char* spec_text = std::getenv(child_env);
    if (spec_text == nullptr) return;
    std::string method, handle_hex;
    int fd = -1;
    kvlink::exported_memory m;
    {
      char method_buf[32] = {}, handle_buf[256] = {};
      unsigned long long size = 0;
      REQUIRE(std::sscanf(spec_text, "%31s %255s %d %d %llu", method_buf, handle_buf, &fd,
                          &m.device, &size) == 5);
      m.method = method_buf;
      if (std::string_view{handle_buf} != "-") m.handle = unhex(handle_buf);
      m.fd = fd;
      m.size = size;
    }
    auto rt = runtime();
    int local = -1;
    if (m.fd >= 0) {
      const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, ::getppid(), 0));
      REQUIRE(pidfd >= 0);
      local = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, m.fd, 0));
      INFO("pidfd_getfd: ", std::strerror(errno));
      ::close(pidfd);
      REQUIRE(local >= 0);
    }
    std::error_code ec;
    std::string what;
    auto* p = static_cast<std::byte*>(rt->import_memory(m, local, ec, what));
    INFO(what);
    REQUIRE(p != nullptr);
    CHECK(rt->classify(p + 1).memory == on_device(m.device));
    {
      asio::io_context io;
      auto s = open(*rt, io, m.device);
      std::vector<std::byte> host(span);
      auto r = copy(io, *s, host.data(), {}, p + parent_off, on_device(m.device), span);
      REQUIRE_FALSE(r.ec);
      CHECK(is_pattern(host.data(), span, parent_seed, 0));
      fill_pattern(host.data(), span, child_seed, 0);
      r = copy(io, *s, p + child_off, on_device(m.device), host.data(), {}, span);
      REQUIRE_FALSE(r.ec);
    }
    rt->close_imported(p);
    CHECK(rt->classify(p).memory.kind == memory_kind::host);
  }

  TEST_CASE("device: dmabuf_fd gives an fd covering whole pages, or an error that says why") {
    auto rt = runtime();
    kvlink::device_buffer buf{rt, 0, 4u << 20};
    std::uint64_t offset = 12345;
    std::error_code ec;
    std::string what;
    const int fd = rt->dmabuf_fd(buf.data() + 5000, 100000, offset, ec, what);
    MESSAGE("dmabuf_fd: ", fd >= 0 ? std::string{"an fd"} : what);
    if (rt->name() == "emulated") {
      CHECK(fd == -1);
      CHECK(ec == kvlink::errc::invalid_argument);
      CHECK(what.find("dma-buf") != std::string::npos);
    } else if (fd >= 0) {
      CHECK_FALSE(ec);
      const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
      CHECK(offset == (reinterpret_cast<std::uintptr_t>(buf.data()) + 5000) % page);
      ::close(fd);
    } else {
      CHECK(ec);
      CHECK_FALSE(what.empty());
    }
    // Host memory has none.
    std::vector<std::byte> host(4096);
    ec = {};
    CHECK(rt->dmabuf_fd(host.data(), host.size(), offset, ec, what) == -1);
    CHECK(ec);
  }
}
