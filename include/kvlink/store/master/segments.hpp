// The segments of the pool: memory that clients mounted, each with its own
// space allocator, and replica placement over them.
//
// A client mounts a segment (its size, a name unique for that client, the
// host it runs on) and gets a segment_id, never reused. put_start asks
// allocate() for ranges on distinct segments: first the request's preferred
// segments in their order, then the segments on the writer's host, then the
// rest in the order of the placement policy (random start, or most free
// bytes first). Unmounting is two steps so the object table can drop the
// replicas on a segment in between: begin_unmount() stops new allocations
// on it, finish_unmount() forgets it. A free() of a range on a segment no
// longer mounted is ignored, so late frees are harmless.
//
// Thread-safe. Locks: the table's shared_mutex (exclusive only to mount and
// unmount), then one segment's mutex; nothing else is taken under them, so
// the object table may call in while holding a shard's lock.
#pragma once

#include <kvlink/core/types.hpp>
#include <kvlink/store/error.hpp>
#include <kvlink/store/master/allocator.hpp>
#include <kvlink/store/master/config.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvlink::store {

/// What a client mounts.
struct segment_desc {
  std::uint64_t client = 0;  ///< the owner's client id (not 0)
  std::string name{};        ///< unique among the client's segments, e.g. its engine segment
  std::uint64_t size = 0;    ///< bytes (rounded down to the master's alignment)
  std::string host{};        ///< the host the owner runs on, for same-host placement ("" none)
};

/// One segment as stats() reports it.
struct segment_stats {
  segment_id id;
  std::uint64_t client = 0;
  std::string name;
  std::string host;
  std::uint64_t capacity = 0;
  std::uint64_t used = 0;
  std::uint64_t largest_free = 0;
  std::size_t free_ranges = 0;
};

/// Where put_start may place replicas.
struct placement_request {
  std::size_t replicas = 1;
  std::span<const segment_id> preferred{};  ///< tried first, in this order
  std::string_view host{};                  ///< then this host's segments ("" none)
};

/// One range allocate() handed out.
struct segment_range {
  segment_id segment;
  std::uint64_t offset = 0;
};

class segment_table {
 public:
  /// The largest segment a client may mount (1 PiB), and the most the
  /// segments of a pool may add up to (2^62 bytes).
  static constexpr std::uint64_t max_segment_size = std::uint64_t{1} << 50;
  static constexpr std::uint64_t max_pool_size = std::uint64_t{1} << 62;

  /// Throws std::invalid_argument when `alignment` is not a power of two.
  explicit segment_table(std::uint64_t alignment = offset_allocator::default_alignment,
                         placement_policy policy = placement_policy::random, std::uint64_t seed = 1)
      : alignment_{alignment}, policy_{policy}, rng_{seed} {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
      throw std::invalid_argument("segment_table: alignment must be a power of two");
    }
  }

  segment_table(const segment_table&) = delete;
  segment_table& operator=(const segment_table&) = delete;

  /// Mounts a segment. invalid_params when the client id is 0 or the size
  /// is below the alignment; segment_already_exists when this client has a
  /// segment of that name mounted. With `open` false nothing is allocated
  /// in it until open() (ranges its owner announces are reserve()d first).
  std::error_code mount(const segment_desc& d, segment_id& out, bool open = true) {
    if (d.client == 0 || d.size < alignment_ || d.size > max_segment_size) {
      return store_errc::invalid_params;
    }
    std::unique_lock lock{mu_};
    // The pool's byte counts stay far from overflowing (found by fuzzing: a
    // client-given size near 2^64 wrapped the capacity around).
    if (capacity_.load(std::memory_order_relaxed) > max_pool_size - d.size) {
      return store_errc::invalid_params;
    }
    for (const auto& [id, s] : by_id_) {
      const segment& g = *slots_[s];
      if (g.mounted && g.client == d.client && g.name == d.name) {
        return store_errc::segment_already_exists;
      }
    }
    std::uint32_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      slot = static_cast<std::uint32_t>(slots_.size());
      slots_.emplace_back();
    }
    auto g = std::make_unique<segment>(d.size, alignment_);
    g->id = segment_id{next_id_++};
    g->client = d.client;
    g->name = d.name;
    g->host = d.host;
    g->host_hash = std::hash<std::string_view>{}(d.host);
    g->open = open;
    g->after_change();  // not shared yet
    capacity_.fetch_add(g->alloc.capacity(), std::memory_order_relaxed);
    out = g->id;
    by_id_.emplace(g->id.value(), slot);
    slots_[slot] = std::move(g);
    if (open) {
      alive_.push_back(slot);
      refresh_largest();
    }
    return {};
  }

  /// Lets allocations into a segment mount() left closed.
  void open(segment_id id) {
    std::unique_lock lock{mu_};
    auto it = by_id_.find(id.value());
    if (it == by_id_.end() || !slots_[it->second]->mounted) return;
    if (slots_[it->second]->open) return;
    slots_[it->second]->open = true;
    alive_.push_back(it->second);
    refresh_largest();
  }

  /// Whether a mounted segment takes allocations (false: closed, or not mounted).
  bool is_open(segment_id id) const {
    std::shared_lock lock{mu_};
    auto it = by_id_.find(id.value());
    return it != by_id_.end() && slots_[it->second]->mounted && slots_[it->second]->open;
  }

  /// Stops allocations on the segment, before the object table drops the
  /// replicas on it; segment_not_found when it is not mounted (or already
  /// being unmounted).
  std::error_code begin_unmount(segment_id id) {
    std::unique_lock lock{mu_};
    auto it = by_id_.find(id.value());
    if (it == by_id_.end() || !slots_[it->second]->mounted) {
      return store_errc::segment_not_found;
    }
    const std::uint32_t slot = it->second;
    slots_[slot]->mounted = false;
    if (auto a = std::find(alive_.begin(), alive_.end(), slot); a != alive_.end()) alive_.erase(a);
    refresh_largest();
    return {};
  }

  /// Forgets a segment begin_unmount() was called for.
  void finish_unmount(segment_id id) {
    std::unique_lock lock{mu_};
    auto it = by_id_.find(id.value());
    if (it == by_id_.end()) return;
    const std::uint32_t slot = it->second;
    auto& g = slots_[slot];
    capacity_.fetch_sub(g->alloc.capacity(), std::memory_order_relaxed);
    used_.fetch_sub(g->alloc.used_bytes(), std::memory_order_relaxed);
    by_id_.erase(it);
    g.reset();
    free_slots_.push_back(slot);
  }

  /// The client a mounted segment belongs to; 0 when it is not mounted.
  std::uint64_t client_of(segment_id id) const {
    std::shared_lock lock{mu_};
    auto it = by_id_.find(id.value());
    return it == by_id_.end() || !slots_[it->second]->mounted ? 0 : slots_[it->second]->client;
  }

  /// The mounted segments of a client.
  std::vector<segment_id> segments_of(std::uint64_t client) const {
    std::shared_lock lock{mu_};
    std::vector<segment_id> out;
    for (std::uint32_t s : alive_) {
      if (slots_[s]->client == client) out.push_back(slots_[s]->id);
    }
    return out;
  }

  /// Allocates `size` bytes on up to req.replicas distinct segments (fewer
  /// when fewer have room), writes them to `out` (at least req.replicas
  /// long) and returns how many.
  std::size_t allocate(std::uint64_t size, const placement_request& req,
                       std::span<segment_range> out) {
    const std::uint64_t n = rounded(size);
    const std::size_t want = std::min(req.replicas, out.size());
    if (n == 0 || want == 0) return 0;
    std::shared_lock lock{mu_};
    std::size_t got = 0;
    auto try_slot = [&](std::uint32_t s) {
      for (std::size_t i = 0; i < got; ++i) {
        if (out[i].segment == slots_[s]->id) return;  // distinct segments
      }
      segment& g = *slots_[s];
      if (g.largest_free.load(std::memory_order_relaxed) < n) return;
      std::lock_guard seg_lock{g.mu};
      auto off = g.alloc.allocate(n);
      if (!off) return;
      g.after_change();
      used_.fetch_add(n, std::memory_order_relaxed);
      out[got++] = segment_range{g.id, *off};
    };
    for (const segment_id id : req.preferred) {
      if (got == want) return got;
      auto it = by_id_.find(id.value());
      if (it != by_id_.end() && slots_[it->second]->mounted && slots_[it->second]->open) {
        try_slot(it->second);
      }
    }
    if (got == want || alive_.empty()) return got;
    // The policy's order over the alive segments, the writer's host first.
    thread_local std::vector<std::uint32_t> order;
    order.assign(alive_.begin(), alive_.end());
    if (policy_ == placement_policy::random) {
      const std::size_t start = static_cast<std::size_t>(next_random() % order.size());
      std::rotate(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(start), order.end());
    } else {
      // Sorted on a snapshot: free bytes change under other threads' feet,
      // and a comparator must not.
      thread_local std::vector<std::pair<std::uint64_t, std::uint32_t>> by_free;
      by_free.clear();
      for (std::uint32_t s : order) by_free.emplace_back(slots_[s]->alloc_free(), s);
      std::stable_sort(by_free.begin(), by_free.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = by_free[i].second;
    }
    if (!req.host.empty()) {
      const std::size_t h = std::hash<std::string_view>{}(req.host);
      std::stable_partition(order.begin(), order.end(), [&](std::uint32_t s) {
        return slots_[s]->host_hash == h && slots_[s]->host == req.host;
      });
    }
    for (std::uint32_t s : order) {
      if (got == want) break;
      try_slot(s);
    }
    return got;
  }

  /// Takes a given range of a mounted segment (offset_allocator::reserve).
  /// segment_not_found when it is not mounted; invalid_params when the
  /// range is not free.
  std::error_code reserve(segment_id id, std::uint64_t offset, std::uint64_t size) {
    std::shared_lock lock{mu_};
    auto it = by_id_.find(id.value());
    if (it == by_id_.end() || !slots_[it->second]->mounted) return store_errc::segment_not_found;
    segment& g = *slots_[it->second];
    std::lock_guard seg_lock{g.mu};
    if (auto ec = g.alloc.reserve(offset, size)) return ec;
    g.after_change();
    used_.fetch_add(rounded(size), std::memory_order_relaxed);
    return {};
  }

  /// Gives back a range allocate() handed out. Ignored when the segment is
  /// no longer mounted.
  void free(segment_id id, std::uint64_t offset, std::uint64_t size) {
    std::shared_lock lock{mu_};
    auto it = by_id_.find(id.value());
    if (it == by_id_.end()) return;
    segment& g = *slots_[it->second];
    std::lock_guard seg_lock{g.mu};
    if (!g.alloc.free(offset, size)) {
      g.after_change();
      used_.fetch_sub(rounded(size), std::memory_order_relaxed);
    }
  }

  /// The bytes an object of `size` takes in a segment.
  std::uint64_t rounded(std::uint64_t size) const noexcept {
    if (size == 0 || size > UINT64_MAX - (alignment_ - 1)) return 0;
    return (size + alignment_ - 1) & ~(alignment_ - 1);
  }

  std::uint64_t capacity() const noexcept { return capacity_.load(std::memory_order_relaxed); }
  std::uint64_t used() const noexcept { return used_.load(std::memory_order_relaxed); }
  /// The capacity of the largest mounted segment: the largest object.
  std::uint64_t largest_segment() const noexcept {
    return largest_.load(std::memory_order_relaxed);
  }
  std::size_t count() const {
    std::shared_lock lock{mu_};
    return alive_.size();
  }

  std::vector<segment_stats> stats() const {
    std::shared_lock lock{mu_};
    std::vector<segment_stats> out;
    for (std::uint32_t s : alive_) {
      const segment& g = *slots_[s];
      std::lock_guard seg_lock{g.mu};
      out.push_back({g.id, g.client, g.name, g.host, g.alloc.capacity(), g.alloc.used_bytes(),
                     g.alloc.largest_free(), g.alloc.free_ranges()});
    }
    return out;
  }

 private:
  struct segment {
    segment(std::uint64_t size, std::uint64_t alignment) : alloc{size, alignment} {}
    mutable std::mutex mu;
    offset_allocator alloc;  // guarded by mu
    // Mirrors of the allocator read without mu: a hint to skip full
    // segments and the most_free order.
    std::atomic<std::uint64_t> largest_free{0};
    std::atomic<std::uint64_t> free_bytes{0};
    segment_id id;
    std::uint64_t client = 0;
    std::string name;
    std::string host;
    std::size_t host_hash = 0;
    bool mounted = true;  // guarded by the table's mu_
    bool open = true;     // allocations allowed (in alive_); guarded by the table's mu_

    void after_change() {  // under mu
      largest_free.store(alloc.largest_free(), std::memory_order_relaxed);
      free_bytes.store(alloc.free_bytes(), std::memory_order_relaxed);
    }
    std::uint64_t alloc_free() const { return free_bytes.load(std::memory_order_relaxed); }
  };

  void refresh_largest() {  // under the exclusive lock
    std::uint64_t m = 0;
    for (std::uint32_t s : alive_) m = std::max(m, slots_[s]->alloc.capacity());
    largest_.store(m, std::memory_order_relaxed);
  }
  // splitmix64 over an atomic counter: lock-free, and deterministic for one
  // thread given the seed.
  std::uint64_t next_random() noexcept {
    std::uint64_t z = rng_.fetch_add(0x9E3779B97F4A7C15ull, std::memory_order_relaxed);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  const std::uint64_t alignment_;
  const placement_policy policy_;
  std::atomic<std::uint64_t> rng_;
  std::atomic<std::uint64_t> capacity_{0};
  std::atomic<std::uint64_t> used_{0};
  std::atomic<std::uint64_t> largest_{0};
  mutable std::shared_mutex mu_;
  std::vector<std::unique_ptr<segment>> slots_;             // guarded by mu_
  std::vector<std::uint32_t> alive_;                        // guarded by mu_
  std::vector<std::uint32_t> free_slots_;                   // guarded by mu_
  std::unordered_map<std::uint64_t, std::uint32_t> by_id_;  // guarded by mu_
  std::uint64_t next_id_ = 1;                               // guarded by mu_
};

}  // namespace kvlink::store
