// Fuzzes the store master's per-segment space allocator
// (include/kvlink/store/master/allocator.hpp). The input is a program: a
// header (capacity, alignment) and then 3-byte operations (allocate a size,
// free a live allocation, free an arbitrary range), checked against a
// reference model of the live allocations.
//
// Asserts, besides "no crash, no hang, no exception, no out-of-bounds read":
// - an allocation is aligned, inside the capacity and overlaps no live one;
// - allocate() is refused only when no free range is large enough;
// - a free of a live allocation succeeds; a free of anything else that
//   overlaps free space is refused and changes nothing;
// - used, free and largest-free bytes agree with the model, free ranges are
//   disjoint and coalesced; freeing everything leaves one free range.
#include <kvlink/store/master/allocator.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>

#include "fuzz_check.hpp"

namespace {

using kvlink::store::offset_allocator;

void check_ranges(const offset_allocator& a, const std::map<std::uint64_t, std::uint64_t>& live) {
  std::uint64_t free_sum = 0;
  std::uint64_t largest = 0;
  std::uint64_t prev_end = 0;
  bool first = true;
  a.for_each_free_range([&](std::uint64_t off, std::uint64_t len) {
    KVLINK_FUZZ_CHECK(len > 0 && off % a.alignment() == 0 && len % a.alignment() == 0);
    KVLINK_FUZZ_CHECK(first || off > prev_end);  // disjoint, coalesced
    first = false;
    prev_end = off + len;
    KVLINK_FUZZ_CHECK(prev_end <= a.capacity());
    free_sum += len;
    largest = std::max(largest, len);
    // No free range overlaps a live allocation.
    auto it = live.lower_bound(off);
    if (it != live.end()) KVLINK_FUZZ_CHECK(it->first >= off + len);
    if (it != live.begin()) {
      --it;
      KVLINK_FUZZ_CHECK(it->first + a.rounded(it->second) <= off);
    }
  });
  KVLINK_FUZZ_CHECK(free_sum == a.free_bytes());
  KVLINK_FUZZ_CHECK(largest == a.largest_free());
  std::uint64_t used = 0;
  for (const auto& [off, size] : live) used += a.rounded(size);
  KVLINK_FUZZ_CHECK(used == a.used_bytes());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  // Capacity 1..65536 units; alignment 2^0..2^12.
  const std::uint64_t alignment = std::uint64_t{1} << (data[0] % 13);
  const std::uint64_t units = 1 + ((std::uint64_t{data[1]} << 8) | data[2]);
  offset_allocator a{units * alignment, alignment};
  KVLINK_FUZZ_CHECK(a.capacity() == units * alignment);
  std::map<std::uint64_t, std::uint64_t> live;  // offset -> requested size
  for (std::size_t i = 3; i + 3 <= size; i += 3) {
    const std::uint8_t op = data[i] % 3;
    const std::uint64_t arg = (std::uint64_t{data[i + 1]} << 8) | data[i + 2];
    if (op == 0) {  // allocate arg bytes scaled by the alignment's order
      const std::uint64_t want = arg * (1 + alignment / 8) + (data[i] >> 2);
      const auto off = a.allocate(want);
      if (!off) {
        KVLINK_FUZZ_CHECK(want == 0 || a.rounded(want) == 0 || a.rounded(want) > a.largest_free());
        continue;
      }
      const std::uint64_t n = a.rounded(want);
      KVLINK_FUZZ_CHECK(*off % alignment == 0 && *off + n <= a.capacity());
      auto next = live.lower_bound(*off);
      if (next != live.end()) KVLINK_FUZZ_CHECK(next->first >= *off + n);
      if (next != live.begin()) {
        auto prev = std::prev(next);
        KVLINK_FUZZ_CHECK(prev->first + a.rounded(prev->second) <= *off);
      }
      live.emplace(*off, want);
    } else if (op == 1 && !live.empty()) {  // free a live allocation
      auto it = live.begin();
      std::advance(it, static_cast<long>(arg % live.size()));
      KVLINK_FUZZ_CHECK(!a.free(it->first, it->second));
      live.erase(it);
    } else {  // free an arbitrary range: refused unless it is wholly allocated
      const std::uint64_t off = arg * alignment / 4;
      const std::uint64_t len = 1 + (data[i] >> 2) * alignment;
      const std::uint64_t before = a.used_bytes();
      // Whether [off, off + rounded(len)) overlaps free space.
      bool overlaps_free = false;
      const std::uint64_t n = a.rounded(len);
      a.for_each_free_range([&](std::uint64_t f, std::uint64_t l) {
        if (f < off + n && off < f + l) overlaps_free = true;
      });
      const auto ec = a.free(off, len);
      if (overlaps_free || off % alignment != 0 || off + n > a.capacity()) {
        KVLINK_FUZZ_CHECK(ec && a.used_bytes() == before);
      }
      if (!ec) {
        // It freed allocated space (parts of live allocations): forget every
        // live allocation it touched so the model stays a subset of truth.
        // Frees of those would now be refused or free other ranges, so the
        // model drops them and the rest of the program checks the remainder.
        for (auto it = live.begin(); it != live.end();) {
          if (it->first < off + n && off < it->first + a.rounded(it->second)) {
            // Give back the rest of that allocation so space is not leaked.
            const std::uint64_t s = it->first;
            const std::uint64_t e = it->first + a.rounded(it->second);
            if (s < off) KVLINK_FUZZ_CHECK(!a.free(s, off - s));
            if (e > off + n) KVLINK_FUZZ_CHECK(!a.free(off + n, e - off - n));
            it = live.erase(it);
          } else {
            ++it;
          }
        }
      }
    }
    check_ranges(a, live);
  }
  for (const auto& [off, sz] : live) KVLINK_FUZZ_CHECK(!a.free(off, sz));
  KVLINK_FUZZ_CHECK(a.used_bytes() == 0 && a.largest_free() == a.capacity());
  KVLINK_FUZZ_CHECK(a.capacity() == 0 || a.free_ranges() == 1);
  return 0;
}
