// Tests for include/kvlink/store/master/segments.hpp: mounting, placement
// over segments and frees after unmount.
#include <kvlink/store/master/segments.hpp>

#include <array>
#include <cstdint>
#include <set>

#include <doctest/doctest.h>

using kvlink::segment_id;
using kvlink::store_errc;
using namespace kvlink::store;

TEST_CASE("segment_table: accounting across mount, allocate, free, unmount") {
  segment_table t{4096};
  segment_id a;
  segment_id b;
  REQUIRE_FALSE(t.mount({1, "a", 10 * 4096 + 100, "h"}, a));  // rounded down
  REQUIRE_FALSE(t.mount({2, "b", 4 * 4096, "h"}, b));
  CHECK(t.capacity() == 14 * 4096);
  CHECK(t.largest_segment() == 10 * 4096);
  CHECK(t.count() == 2);
  std::array<segment_range, 4> out{};
  CHECK(t.allocate(4096, {.replicas = 2}, out) == 2);
  CHECK(out[0].segment != out[1].segment);
  CHECK(t.used() == 2 * 4096);
  CHECK(t.allocate(0, {.replicas = 1}, out) == 0);
  CHECK(t.allocate(11 * 4096, {.replicas = 1}, out) == 0);  // fits no segment
  // Unmounting b: no allocations there any more; a late free is ignored.
  std::array<segment_range, 4> keep = out;
  REQUIRE_FALSE(t.begin_unmount(b));
  CHECK(t.begin_unmount(b) == store_errc::segment_not_found);
  CHECK(t.largest_segment() == 10 * 4096);
  for (int i = 0; i < 20; ++i) {
    if (t.allocate(4096, {.replicas = 1}, out) == 1) CHECK(out[0].segment == a);
  }
  t.finish_unmount(b);
  CHECK(t.capacity() == 10 * 4096);
  CHECK(t.used() == 10 * 4096);  // a is full
  for (int i = 0; i < 2; ++i) {
    if (keep[static_cast<std::size_t>(i)].segment == b) {
      t.free(b, keep[static_cast<std::size_t>(i)].offset, 4096);  // ignored
    } else {
      t.free(a, keep[static_cast<std::size_t>(i)].offset, 4096);
    }
  }
  CHECK(t.used() == 9 * 4096);
  const auto st = t.stats();
  REQUIRE(st.size() == 1);
  CHECK(st[0].id == a);
  CHECK(st[0].name == "a");
  CHECK(st[0].host == "h");
  CHECK(st[0].used == 9 * 4096);
  CHECK(st[0].largest_free == 4096);
  CHECK(t.segments_of(1) == std::vector<segment_id>{a});
  CHECK(t.segments_of(2).empty());
}

TEST_CASE("segment_table: the same seed places the same way") {
  auto run = [](std::uint64_t seed) {
    segment_table t{64, placement_policy::random, seed};
    for (int i = 0; i < 8; ++i) {
      segment_id id;
      REQUIRE_FALSE(t.mount({1, std::string("s").append(std::to_string(i)), 1 << 20, ""}, id));
    }
    std::vector<segment_id> picks;
    std::array<segment_range, 1> out{};
    for (int i = 0; i < 32; ++i) {
      REQUIRE(t.allocate(64, {.replicas = 1}, out) == 1);
      picks.push_back(out[0].segment);
    }
    return picks;
  };
  CHECK(run(7) == run(7));
  CHECK(run(7) != run(8));
  CHECK_THROWS_AS(segment_table(3), std::invalid_argument);
}

TEST_CASE(
    "segment_table: a size beyond 1 PiB, or one that would wrap the pool's total, is refused") {
  segment_table t{64};
  segment_id a, b;
  REQUIRE_FALSE(t.mount({1, "small", 1u << 16, ""}, a));
  // Near 2^64 (the fuzzer's input): it would have wrapped the capacity around.
  CHECK(t.mount({1, "huge", ~std::uint64_t{0} - 247, ""}, b) == store_errc::invalid_params);
  CHECK(t.mount({1, "big", segment_table::max_segment_size + 1, ""}, b) ==
        store_errc::invalid_params);
  CHECK(t.capacity() == (1u << 16));
  REQUIRE_FALSE(t.mount({1, "pib", segment_table::max_segment_size, ""}, b));
  CHECK(t.capacity() == (1u << 16) + segment_table::max_segment_size);
}
