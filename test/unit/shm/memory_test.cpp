// shm::shared_memory (shm/memory.hpp): pages allocated up front or at first
// use, as asked; the allocation found by address; one with static storage
// released at exit.
#include <kvlink/shm/memory.hpp>

#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

// Pages of [p, p + size) that are resident (allocated, for a memfd).
std::size_t resident_pages(const std::byte* p, std::size_t size) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((size + page - 1) / page);
  REQUIRE(::mincore(const_cast<std::byte*>(p), size, vec.data()) == 0);
  std::size_t n = 0;
  for (const auto v : vec) n += (v & 1u) != 0 ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("shared_memory: pre-faulted pages are resident at creation, others at first use") {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t size = 64u << 20;
  const std::size_t pages = size / page;

  // Under the limit, by default: every page is there before the first write.
  auto def = kvlink::shm::shared_memory::allocate(size);
  REQUIRE(def.size() == size);
  CHECK(size <= kvlink::shm::shared_memory::prefault_limit);
  CHECK(resident_pages(def.data(), def.size()) == pages);

  auto yes = kvlink::shm::shared_memory::allocate(size, kvlink::shm::prefault::yes);
  CHECK(resident_pages(yes.data(), yes.size()) == pages);

  // Not pre-faulted: nothing until it is written, then the pages written.
  auto no = kvlink::shm::shared_memory::allocate(size, kvlink::shm::prefault::no);
  CHECK(resident_pages(no.data(), no.size()) == 0);
  no.data()[0] = std::byte{1};
  no.data()[10 * page] = std::byte{1};
  CHECK(resident_pages(no.data(), no.size()) == 2);

  // Zeroed either way.
  CHECK(def.data()[size - 1] == std::byte{0});
  CHECK(yes.data()[size / 2] == std::byte{0});
  CHECK(no.data()[page] == std::byte{0});
}

TEST_CASE("shared_memory: find_shared names the allocation holding a range, and only it") {
  auto m = kvlink::shm::shared_memory::allocate(1u << 20, kvlink::shm::prefault::no);
  const auto base = reinterpret_cast<std::uintptr_t>(m.data());
  const auto r = kvlink::shm::find_shared(base + 100, 1000);
  REQUIRE(r);
  CHECK(r->base == base);
  CHECK(r->size == m.size());
  CHECK_FALSE(kvlink::shm::find_shared(base + m.size() - 10, 11));
  std::vector<std::byte> other(4096);
  CHECK_FALSE(kvlink::shm::find_shared(reinterpret_cast<std::uintptr_t>(other.data()), 1));
}

namespace {
constexpr const char* static_child_env = "KVLINK_TEST_STATIC_SHARED_MEMORY";
}  // namespace

// Runs in a process of its own (the case below starts it): a shared_memory
// with static storage, made before the first allocation, is released at
// exit, after the statics it was allocated with.
TEST_CASE("shared_memory: the child holding one in a static") {
  if (std::getenv(static_child_env) == nullptr) return;  // only as that child
  static kvlink::shm::shared_memory kept;
  kept = kvlink::shm::shared_memory::allocate(1 << 20);
  kept.data()[0] = std::byte{1};
  CHECK(kvlink::shm::find_shared(reinterpret_cast<std::uintptr_t>(kept.data()), 1));
}

TEST_CASE("shared_memory: one in a static is released at exit without a fault") {
  std::string exe = "/proc/self/exe";
  std::string filter = "--test-case=shared_memory: the child holding one in a static";
  std::vector<char*> argv{exe.data(), filter.data(), nullptr};
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back(std::string{static_child_env} + "=1");
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  int status = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds{60};
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      FAIL("the child did not exit in 60 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  INFO("child status ", status);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);  // a double free at exit aborts it (SIGABRT)
}
