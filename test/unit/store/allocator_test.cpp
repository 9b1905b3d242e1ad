// Tests for include/kvlink/store/master/allocator.hpp: the per-segment
// offset allocator, against a reference model (a byte map of the segment).
#include <kvlink/store/master/allocator.hpp>

#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include <doctest/doctest.h>

using kvlink::store_errc;
using kvlink::store::offset_allocator;

TEST_CASE("offset_allocator: rounding, alignment and capacity") {
  offset_allocator a{1000, 64};
  CHECK(a.capacity() == 960);  // rounded down to the alignment
  CHECK(a.rounded(1) == 64);
  CHECK(a.rounded(64) == 64);
  CHECK(a.rounded(65) == 128);
  CHECK(a.rounded(0) == 0);
  CHECK(a.rounded(UINT64_MAX) == 0);
  CHECK_FALSE(a.allocate(0));
  CHECK_FALSE(a.allocate(961));
  auto x = a.allocate(100);
  REQUIRE(x);
  CHECK(*x % 64 == 0);
  CHECK(a.used_bytes() == 128);
  CHECK(a.free_bytes() == 832);
  CHECK(a.largest_free() == 832);
  CHECK_THROWS_AS(offset_allocator(100, 48), std::invalid_argument);
  CHECK_THROWS_AS(offset_allocator(100, 0), std::invalid_argument);
  offset_allocator empty{10, 64};
  CHECK(empty.capacity() == 0);
  CHECK_FALSE(empty.allocate(1));
}

TEST_CASE("offset_allocator: reserve takes a given free range, refuses the others") {
  offset_allocator a{64 * 10, 64};
  CHECK_FALSE(a.reserve(64 * 3, 100));  // [3,5)
  CHECK(a.used_bytes() == 128);
  CHECK(a.free_ranges() == 2);
  CHECK(a.reserve(64 * 4, 64) == store_errc::invalid_params);      // taken
  CHECK(a.reserve(64 * 2, 128) == store_errc::invalid_params);     // overlaps it
  CHECK(a.reserve(64 * 2 + 1, 10) == store_errc::invalid_params);  // not aligned
  CHECK(a.reserve(64 * 9, 128) == store_errc::invalid_params);     // past the end
  CHECK(a.reserve(64 * 10, 64) == store_errc::invalid_params);
  CHECK(a.reserve(0, 0) == store_errc::invalid_params);
  CHECK_FALSE(a.reserve(0, 64 * 3));   // [0,3): the whole left part
  CHECK_FALSE(a.reserve(64 * 9, 64));  // the last unit
  CHECK(a.used_bytes() == 64 * 6);
  CHECK(a.largest_free() == 64 * 4);
  auto x = a.allocate(64 * 4);
  REQUIRE(x);
  CHECK(*x == 64 * 5);
  CHECK_FALSE(a.allocate(1));
  CHECK_FALSE(a.free(64 * 3, 100));  // a reserved range frees like an allocated one
  CHECK(a.free_bytes() == 128);
}

TEST_CASE("offset_allocator: best fit, coalescing, refuses bad frees") {
  offset_allocator a{64 * 10, 64};
  auto a0 = *a.allocate(64 * 2);  // [0,2)
  auto a1 = *a.allocate(64 * 1);  // [2,3)
  auto a2 = *a.allocate(64 * 3);  // [3,6)
  auto a3 = *a.allocate(64 * 1);  // [6,7)
  CHECK(a0 == 0);
  CHECK(a1 == 128);
  CHECK(a2 == 192);
  CHECK(a3 == 384);
  REQUIRE_FALSE(a.free(a0, 128));  // holes: [0,2) and [7,10)
  REQUIRE_FALSE(a.free(a2, 192));  // holes: [0,2), [3,6), [7,10)
  CHECK(a.free_ranges() == 3);
  // Best fit: a 2-unit request takes the 2-unit hole, a 3-unit one the
  // lowest 3-unit hole.
  CHECK(*a.allocate(128) == 0);
  CHECK(*a.allocate(192) == 192);
  CHECK(a.largest_free() == 192);
  // Double free and frees overlapping free space are refused, nothing changes.
  CHECK(a.free(448, 64) == store_errc::invalid_params);   // inside the free tail
  CHECK(a.free(384, 128) == store_errc::invalid_params);  // runs into the free tail
  CHECK(a.free(32, 64) == store_errc::invalid_params);    // unaligned
  CHECK(a.free(640, 64) == store_errc::invalid_params);   // beyond the capacity
  CHECK(a.free(0, 0) == store_errc::invalid_params);      // zero size
  CHECK(a.free(UINT64_MAX - 63, 64) == store_errc::invalid_params);
  CHECK(a.used_bytes() == 64 * 7);
  // Everything freed: one free range again.
  REQUIRE_FALSE(a.free(0, 128));
  REQUIRE_FALSE(a.free(192, 192));
  REQUIRE_FALSE(a.free(a1, 64));
  REQUIRE_FALSE(a.free(a3, 64));
  CHECK(a.free(a3, 64) == store_errc::invalid_params);  // double free
  CHECK(a.free_ranges() == 1);
  CHECK(a.used_bytes() == 0);
  CHECK(a.largest_free() == 640);
}

namespace {

// The reference model: which alignment units are taken, and what is live.
struct model {
  std::vector<bool> taken;
  std::map<std::uint64_t, std::uint64_t> live;  // offset -> requested size
};

void check_against(const offset_allocator& a, const model& m, std::uint64_t unit) {
  std::uint64_t used = 0;
  for (bool t : m.taken) used += t ? unit : 0;
  CHECK(a.used_bytes() == used);
  // Free ranges are exactly the maximal runs of free units.
  std::vector<bool> free_units(m.taken.size(), false);
  std::uint64_t prev_end = 0;
  bool first = true;
  std::uint64_t largest = 0;
  a.for_each_free_range([&](std::uint64_t off, std::uint64_t len) {
    CHECK(off % unit == 0);
    CHECK(len % unit == 0);
    CHECK(len > 0);
    if (!first) CHECK(off > prev_end);  // disjoint and never adjacent (coalesced)
    first = false;
    prev_end = off + len;
    largest = std::max(largest, len);
    for (std::uint64_t u = off / unit; u < (off + len) / unit; ++u) free_units[u] = true;
  });
  CHECK(a.largest_free() == largest);
  for (std::size_t u = 0; u < m.taken.size(); ++u) CHECK(free_units[u] != m.taken[u]);
}

}  // namespace

TEST_CASE("offset_allocator: random alloc/free sequences match a reference model") {
  for (std::uint64_t unit : {std::uint64_t{64}, std::uint64_t{4096}}) {
    const std::uint64_t units = 512;
    offset_allocator a{units * unit, unit};
    model m{std::vector<bool>(units, false), {}};
    std::mt19937_64 rng{unit};
    for (int step = 0; step < 4000; ++step) {
      const bool do_alloc = m.live.empty() || rng() % 100 < 55;
      if (do_alloc) {
        const std::uint64_t size = 1 + rng() % (unit * 24);
        auto off = a.allocate(size);
        const std::uint64_t n = a.rounded(size);
        if (!off) {
          // Refused only when no run of free units is long enough.
          CHECK(a.largest_free() < n);
          continue;
        }
        REQUIRE(*off % unit == 0);
        REQUIRE(*off + n <= units * unit);
        for (std::uint64_t u = *off / unit; u < (*off + n) / unit; ++u) {
          REQUIRE_FALSE(m.taken[u]);  // never overlaps a live allocation
          m.taken[u] = true;
        }
        m.live[*off] = size;
      } else {
        auto it = m.live.begin();
        std::advance(it, static_cast<long>(rng() % m.live.size()));
        REQUIRE_FALSE(a.free(it->first, it->second));
        const std::uint64_t n = a.rounded(it->second);
        for (std::uint64_t u = it->first / unit; u < (it->first + n) / unit; ++u) {
          m.taken[u] = false;
        }
        // A second free of the same range is refused.
        CHECK(a.free(it->first, it->second) == store_errc::invalid_params);
        m.live.erase(it);
      }
      if (step % 97 == 0) check_against(a, m, unit);
    }
    check_against(a, m, unit);
    for (const auto& [off, size] : m.live) REQUIRE_FALSE(a.free(off, size));
    CHECK(a.free_ranges() == 1);
    CHECK(a.used_bytes() == 0);
    CHECK(a.largest_free() == units * unit);
  }
}
