// The space allocator of one segment: which byte ranges of a client's
// segment hold objects and which are free.
//
// A best-fit offset allocator over [0, capacity): free ranges are kept twice,
// by offset (to coalesce a freed range with its neighbours) and by (length,
// offset) (to find the smallest range that fits, the lowest offset among
// equals), so allocate() and free() are O(log n) in the number of free
// ranges. Every allocation is rounded up to `alignment` bytes (a power of
// two) and starts at a multiple of it. It never hands out overlapping
// ranges, and free() refuses a range that is not wholly allocated (a double
// free or a range it never gave out that overlaps free space) instead of
// corrupting its state. It remembers nothing per allocation: the caller
// (the object table) passes back the offset and the size it asked for.
//
//   kvlink::store::offset_allocator a{1 << 20};     // 1 MiB, 64-byte aligned
//   auto off = a.allocate(4096);                    // std::optional<uint64_t>
//   if (off) a.free(*off, 4096);
//
// Not thread-safe: the segment table guards each allocator with its own lock.
// Pure: no I/O, no clock, no Asio.
#pragma once

#include <kvlink/store/error.hpp>

#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace kvlink::store {

class offset_allocator {
 public:
  static constexpr std::uint64_t default_alignment = 64;

  /// Manages [0, capacity rounded down to `alignment`). Throws
  /// std::invalid_argument when `alignment` is not a power of two.
  explicit offset_allocator(std::uint64_t capacity, std::uint64_t alignment = default_alignment)
      : alignment_{alignment} {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
      throw std::invalid_argument("offset_allocator: alignment must be a power of two");
    }
    capacity_ = capacity & ~(alignment - 1);
    if (capacity_ > 0) insert_free(0, capacity_);
  }

  offset_allocator(const offset_allocator&) = delete;
  offset_allocator& operator=(const offset_allocator&) = delete;
  offset_allocator(offset_allocator&&) noexcept = default;
  offset_allocator& operator=(offset_allocator&&) noexcept = default;

  /// The bytes an allocation of `size` takes: `size` rounded up to the
  /// alignment; 0 when `size` is 0 or the rounding overflows.
  std::uint64_t rounded(std::uint64_t size) const noexcept {
    if (size == 0 || size > UINT64_MAX - (alignment_ - 1)) return 0;
    return (size + alignment_ - 1) & ~(alignment_ - 1);
  }

  /// The offset of a fresh range of at least `size` bytes, or nothing when
  /// `size` is 0 or no free range is large enough (best fit).
  std::optional<std::uint64_t> allocate(std::uint64_t size) {
    const std::uint64_t n = rounded(size);
    if (n == 0 || n > capacity_) return std::nullopt;
    const auto it = by_size_.lower_bound({n, 0});
    if (it == by_size_.end()) return std::nullopt;
    const auto [len, off] = *it;
    by_size_.erase(it);
    by_offset_.erase(off);
    if (len > n) insert_free(off + n, len - n);
    used_ += n;
    return off;
  }

  /// Takes [offset, offset + size rounded) out of the free space, as if
  /// allocate() had handed it out (an object a segment's owner announces
  /// after a master restart). store_errc::invalid_params, changing
  /// nothing, for a size of 0, an offset that is not aligned, a range
  /// beyond the capacity or one that is not wholly free.
  std::error_code reserve(std::uint64_t offset, std::uint64_t size) {
    const std::uint64_t n = rounded(size);
    if (n == 0 || (offset & (alignment_ - 1)) != 0 || offset > capacity_ ||
        n > capacity_ - offset) {
      return store_errc::invalid_params;
    }
    auto it = by_offset_.upper_bound(offset);
    if (it == by_offset_.begin()) return store_errc::invalid_params;
    --it;
    const auto [start, len] = *it;
    if (start + len < offset + n) return store_errc::invalid_params;
    erase_free(it);
    if (offset > start) insert_free(start, offset - start);
    if (start + len > offset + n) insert_free(offset + n, start + len - offset - n);
    used_ += n;
    return {};
  }

  /// Gives back the range allocate(size) returned at `offset`. Refuses with
  /// store_errc::invalid_params, changing nothing, a size of 0, an offset
  /// that is not aligned, a range beyond the capacity or one that overlaps
  /// free space (freed twice, or never allocated).
  std::error_code free(std::uint64_t offset, std::uint64_t size) {
    const std::uint64_t n = rounded(size);
    if (n == 0 || (offset & (alignment_ - 1)) != 0 || offset > capacity_ ||
        n > capacity_ - offset) {
      return store_errc::invalid_params;
    }
    const std::uint64_t end = offset + n;
    auto next = by_offset_.lower_bound(offset);
    if (next != by_offset_.end() && next->first < end) return store_errc::invalid_params;
    auto prev = next == by_offset_.begin() ? by_offset_.end() : std::prev(next);
    if (prev != by_offset_.end() && prev->first + prev->second > offset) {
      return store_errc::invalid_params;
    }
    std::uint64_t start = offset;
    std::uint64_t len = n;
    if (prev != by_offset_.end() && prev->first + prev->second == offset) {
      start = prev->first;
      len += prev->second;
      erase_free(prev);
    }
    if (next != by_offset_.end() && next->first == end) {
      len += next->second;
      erase_free(next);
    }
    insert_free(start, len);
    used_ -= n;
    return {};
  }

  std::uint64_t capacity() const noexcept { return capacity_; }
  std::uint64_t alignment() const noexcept { return alignment_; }
  std::uint64_t used_bytes() const noexcept { return used_; }
  std::uint64_t free_bytes() const noexcept { return capacity_ - used_; }
  /// The longest free range: the largest allocation that can succeed now.
  std::uint64_t largest_free() const noexcept {
    return by_size_.empty() ? 0 : by_size_.rbegin()->first;
  }
  /// How many disjoint free ranges there are (1 when nothing is allocated).
  std::size_t free_ranges() const noexcept { return by_offset_.size(); }

  /// Calls f(offset, length) for each free range in offset order.
  template <class F>
  void for_each_free_range(F&& f) const {
    for (const auto& [off, len] : by_offset_) f(off, len);
  }

 private:
  using offset_map = std::map<std::uint64_t, std::uint64_t>;

  void insert_free(std::uint64_t off, std::uint64_t len) {
    by_offset_.emplace(off, len);
    by_size_.emplace(len, off);
  }
  void erase_free(offset_map::iterator it) {
    by_size_.erase({it->second, it->first});
    by_offset_.erase(it);
  }

  std::uint64_t alignment_;
  std::uint64_t capacity_ = 0;
  std::uint64_t used_ = 0;
  offset_map by_offset_;                                       // offset -> length
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;  // (length, offset)
};

}  // namespace kvlink::store
