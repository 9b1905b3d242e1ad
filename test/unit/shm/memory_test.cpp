// shm::shared_memory (shm/memory.hpp): pages allocated up front or at first
// use, as asked; the allocation found by address.
#include <kvlink/shm/memory.hpp>

#include <cstddef>
#include <vector>

#include <doctest/doctest.h>
#include <sys/mman.h>
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
