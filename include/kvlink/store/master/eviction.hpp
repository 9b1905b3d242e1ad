// Eviction: frees space in the pool when it is nearly full, without
// stalling lookups.
//
// run_once() does nothing unless the pool is at least
// eviction_high_watermark percent full or a put failed for space since its
// last run; then it frees eviction_share percent of the pool (more when the
// pool is above the watermark by more: max(share, used - watermark + share),
// as Mooncake). It walks the shards round-robin, each step a CLOCK step of
// at most `bucket_budget` buckets of one shard under that shard's lock only
// (object_table::evict_from_shard), so a lookup waits at most one step, never
// a whole scan (Mooncake issue 2221). Objects that were read or checked
// since the hand last passed get a second chance; leased, hard-pinned and
// in-progress objects, and parents of chain members still present, are
// skipped; soft-pinned ones go only in a second pass, when the first freed
// too little and evict_soft_pinned is set. A round stops when it freed
// enough or after two full turns of the clock (one clears the reference
// bits, one evicts): when nothing may go, it returns at once, and put_start
// keeps answering no_space (Mooncake's -200) without waiting.
//
// With disks in the pool (object_table's SSD tier), a victim whose owner
// has a disk is copied there first: its bytes count toward the target but
// are freed by a later round, once the copy is made.
//
// The master calls run_once() from one thread, e.g. every 10 ms (concurrent
// calls are serialized). Thread-safe against every object_table operation.
#pragma once

#include <kvlink/store/master/config.hpp>
#include <kvlink/store/master/objects.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace kvlink::store {

struct eviction_report {
  bool ran = false;          ///< above the watermark or asked for by a failed put
  std::uint64_t target = 0;  ///< bytes it meant to free
  std::uint64_t freed = 0;
  std::size_t evicted = 0;
  std::uint64_t demoting = 0;  ///< bytes freed later, once their owners' disks hold them
  std::size_t demoted = 0;     ///< objects sent to disks (object_table's SSD tier)
  std::size_t steps = 0;       ///< evict_from_shard calls (lock acquisitions)
  bool soft_pinned = false;    ///< whether it had to evict soft-pinned objects
};

class evictor {
 public:
  /// `bucket_budget`: buckets one step looks at under one shard lock.
  explicit evictor(object_table& table, std::size_t bucket_budget = 64) noexcept
      : table_{table}, budget_{std::max<std::size_t>(bucket_budget, 1)} {}

  /// Whether the pool is at or above the high watermark.
  bool above_watermark() const noexcept {
    const std::uint64_t cap = table_.segments().capacity();
    return cap > 0 &&
           table_.segments().used() * 100 >= cap * table_.config().eviction_high_watermark;
  }

  eviction_report run_once(master_time now) {
    std::lock_guard lock{mu_};
    eviction_report r;
    const bool asked = table_.take_eviction_request();
    const std::uint64_t cap = table_.segments().capacity();
    const std::uint64_t used = table_.segments().used();
    const std::uint64_t hwm = cap / 100 * table_.config().eviction_high_watermark +
                              cap % 100 * table_.config().eviction_high_watermark / 100;
    const bool over = cap > 0 && used >= hwm;
    if (cap == 0 || (!over && !asked)) return r;
    r.ran = true;
    const std::uint64_t share =
        std::max<std::uint64_t>(cap / 100 * table_.config().eviction_share +
                                    cap % 100 * table_.config().eviction_share / 100,
                                1);
    r.target = over ? used - hwm + share : share;
    // Copies to disks under way free their share later.
    r.target -= std::min(r.target, table_.demoting_bytes());
    // Two turns of the clock over every shard at most, per pass.
    const std::size_t turn = table_.bucket_total() + shard_count;
    // Bytes being copied to disks count as freed: the next round frees them.
    for (int pass = 0; pass < 2 && r.freed + r.demoting < r.target; ++pass) {
      const bool soft = pass == 1;
      if (soft && !table_.config().evict_soft_pinned) break;
      std::size_t visited = 0;
      while (r.freed + r.demoting < r.target && visited < 2 * turn) {
        const evict_step st =
            table_.evict_from_shard(cursor_, now, budget_, r.target - r.freed - r.demoting, soft);
        cursor_ = (cursor_ + 1) % shard_count;
        ++r.steps;
        visited += std::max<std::size_t>(st.visited, 1);
        r.freed += st.freed;
        r.evicted += st.evicted;
        r.demoting += st.demoting;
        r.demoted += st.demoted;
        if (soft && st.evicted > 0) r.soft_pinned = true;
      }
    }
    return r;
  }

 private:
  object_table& table_;
  const std::size_t budget_;
  std::mutex mu_;
  std::size_t cursor_ = 0;  // guarded by mu_
};

}  // namespace kvlink::store
