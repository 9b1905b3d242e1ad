// The store master's object table: which keys exist, where their replicas
// lie, and who may read, write or remove them.
//
// Mooncake Store's model: objects are immutable and the first writer wins.
// A put is put_start (space allocated on distinct segments, the object
// invisible) -> the writer's engine WRITEs -> put_end (visible) or
// put_revoke. A get grants a read lease (lease_ttl) and returns the
// replicas; while the lease runs the object is neither removed (unless
// forced) nor evicted. Puts that never end are discarded put_discard_timeout
// after their start (the key is free again) and their space is reused
// put_release_timeout after it (their writer may still be writing into it).
//
//   kvlink::store::object_table t{};
//   kvlink::segment_id seg;
//   t.mount_segment({.client = 1, .name = "seg0", .size = 1 << 30}, seg);
//   kvlink::store::replica_list where;
//   auto now = kvlink::store::master_clock::now();
//   if (!t.put_start("key", 4096, /*writer*/ 1, {}, now, where)) {
//     // ... engine WRITEs into where[0].segment at where[0].offset ...
//     t.put_end("key", 1, now);
//   }
//
// (examples/store_master.cpp runs it, with a get and eviction.)
//
// Memory: one heap block per object holding its metadata, its replicas and
// its key (64 bytes plus the key for one replica, 16 more per further
// replica), chained in its shard's hash table (the link is in the block:
// no node), no std::string, no per-object list links: eviction is CLOCK
// over the hash table's buckets, with a reference bit that get and exists
// set. About 136 bytes per key with 50-byte keys, 184 with 98-byte ones
// (bench/store_master_bench.cpp).
//
// Chains: a put may name its parent key (the prefix this block extends). A
// parent is not evicted while an object naming it exists, so eviction takes
// chain tails before their prefixes. Children are counted per parent key
// hash: a hash collision only keeps an object longer.
//
// Time is given (`now`, a master_clock time point), never read.
//
// Thread-safe: keys are sharded over 256 shards by hash, each with its own
// mutex. Locks, in the order they may be taken: one shard's mutex, then the
// segment table's locks or one shard's chain mutex or the discard list's
// mutex (none of which takes another lock). No operation holds two shards'
// mutexes, and none holds one for a whole-table scan longer than that
// shard's part of it.
#pragma once

#include <kvlink/core/types.hpp>
#include <kvlink/store/error.hpp>
#include <kvlink/store/master/config.hpp>
#include <kvlink/store/master/segments.hpp>
#include <kvlink/store/wire/record.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace kvlink::store {

/// The most replicas one object may have.
inline constexpr std::size_t max_replicas = 8;
/// Keys are spread over this many shards, each with its own lock.
inline constexpr std::size_t shard_count = 256;

enum class replica_status : std::uint8_t {
  processing,  ///< allocated, being written: invisible to readers
  complete,    ///< written: readable
};

/// Where one replica of an object lies.
struct replica_desc {
  segment_id segment;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;  ///< the object's size
  replica_status status = replica_status::processing;
  friend bool operator==(const replica_desc&, const replica_desc&) = default;
};

/// A fixed-capacity list of replicas: filled without allocating.
class replica_list {
 public:
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  const replica_desc& operator[](std::size_t i) const noexcept { return items_[i]; }
  const replica_desc* begin() const noexcept { return items_.data(); }
  const replica_desc* end() const noexcept { return items_.data() + size_; }
  void clear() noexcept { size_ = 0; }
  void push_back(const replica_desc& r) noexcept {
    if (size_ < max_replicas) items_[size_++] = r;
  }

 private:
  std::array<replica_desc, max_replicas> items_{};
  std::size_t size_ = 0;
};

/// How a put wants its object placed and kept (Mooncake's ReplicateConfig).
struct put_options {
  /// Replicas on distinct segments, 1..max_replicas. Best effort as in
  /// Mooncake: fewer when fewer segments have room (at least one, else
  /// no_space); put_start's list says how many.
  std::size_t replicas = 1;
  std::span<const segment_id> preferred{};    ///< segments tried first, in this order
  std::string_view host{};                    ///< the writer's host: its segments next
  bool soft_pin = false;                      ///< evicted only when nothing else is
  std::chrono::milliseconds soft_pin_ttl{0};  ///< 0: master_config::soft_pin_ttl
  bool hard_pin = false;                      ///< never evicted; removed only by force
  std::string_view parent{};                  ///< the key this one extends ("" none)
};

/// What get returns.
struct object_info {
  std::uint64_t size = 0;
  master_time lease_until{};  ///< the read must finish before this
  replica_list replicas;
};

struct unmount_report {
  std::size_t replicas_dropped = 0;
  std::size_t objects_lost = 0;  ///< objects whose last replica was on it
};

struct reclaim_report {
  std::size_t discarded = 0;  ///< puts discarded now
  std::size_t released = 0;   ///< ranges of discarded puts reused now
  std::uint64_t released_bytes = 0;
  std::size_t disk_tasks_given_up = 0;  ///< stores and loads their holders never reported
};

struct pool_stats {
  std::uint64_t capacity = 0;  ///< bytes of all mounted segments
  std::uint64_t used = 0;      ///< bytes allocated (objects, puts, discarded puts)
  std::uint64_t objects = 0;   ///< objects, puts in progress included
  std::uint64_t in_progress = 0;
  std::uint64_t reserved = 0;  ///< bytes of discarded puts not yet reused
  std::size_t segments = 0;
  std::uint64_t disk_replicas = 0;  ///< replicas on clients' disks (the SSD tier)
  std::size_t disks = 0;            ///< clients with a disk mounted
  std::size_t disks_accepting = 0;  ///< of them, those eviction may send objects to
};

/// Work for a disk holder (a client with a disk mounted): the master
/// pushes these on its connection (wire::disk_task).
struct disk_task {
  enum class kind : std::uint8_t {
    store = 1,  ///< copy the object from [offset, offset + footprint) of `segment` to the disk
    load = 2,   ///< read it from the disk into [offset, ...) of `segment`
    drop = 3,   ///< the key is gone: delete it from the disk
  };
  kind what = kind::store;
  std::uint64_t client = 0;  ///< the disk holder
  std::string key;
  std::uint64_t size = 0;  ///< the object's bytes
  std::uint64_t segment = 0;
  std::uint64_t offset = 0;
};

/// What one evict_from_shard call did.
struct evict_step {
  std::uint64_t freed = 0;     ///< bytes (rounded as allocated)
  std::size_t evicted = 0;     ///< objects that left memory (those on a disk stay there)
  std::uint64_t demoting = 0;  ///< bytes to be freed once their disk copies are made
  std::size_t demoted = 0;     ///< objects sent to their owners' disks
  std::size_t visited = 0;     ///< buckets looked at
};

namespace detail {

// A replica: a range of a mounted segment, or (segment with disk_bit set)
// the disk of the client in the low bits (offset 0).
struct replica_loc {
  std::uint64_t segment = 0;
  std::uint64_t offset = 0;
};

inline constexpr std::uint64_t disk_bit = std::uint64_t{1} << 63;
inline constexpr bool on_disk(const replica_loc& r) noexcept { return (r.segment & disk_bit) != 0; }

// One object in one heap block: this struct, its replicas after the first
// (`capacity` - 1 of them, fixed at put_start), then its key's bytes. No
// std::string, no second allocation.
struct object_meta {
  static constexpr std::uint8_t complete = 1;
  static constexpr std::uint8_t hard_pin = 2;
  static constexpr std::uint8_t referenced = 4;  // CLOCK's second chance
  static constexpr std::uint8_t has_parent = 8;
  static constexpr std::uint8_t demoting = 16;  // a disk holder copies a memory replica
  static constexpr std::uint8_t loading = 32;   // a disk holder fills a memory replica
  static constexpr std::uint8_t no_disk = 64;   // a demotion failed: evicted without one

  static constexpr std::int32_t no_soft_pin = INT32_MIN;

  std::uint64_t size = 0;
  std::int64_t time_ms = 0;  // put start while in progress, lease expiry once complete
  std::uint64_t parent_hash = 0;
  std::uint64_t writer = 0;
  replica_loc first{};
  object_meta* next = nullptr;            // the shard index's bucket chain
  std::int32_t soft_pin_s = no_soft_pin;  // soft pin expiry, seconds (rounded up)
  std::uint16_t key_len = 0;
  std::uint8_t counts = 0x10;  // replicas the block has room for << 4 | replicas now
  std::uint8_t flags = 0;

  /// Replicas now (unmounts drop some) and room in the block.
  std::size_t count() const noexcept { return counts & 15u; }
  std::size_t capacity() const noexcept { return counts >> 4; }
  void set_count(std::size_t n) noexcept {
    counts = static_cast<std::uint8_t>((counts & 0xF0u) | (n & 15u));
  }
  void set_soft_pin(std::int64_t until_ms) noexcept {
    std::int64_t q = until_ms / 1000;
    if (q * 1000 < until_ms) ++q;
    soft_pin_s = static_cast<std::int32_t>(std::clamp<std::int64_t>(q, INT32_MIN + 1, INT32_MAX));
  }
  bool soft_pinned(std::int64_t now_ms) const noexcept {
    return soft_pin_s != no_soft_pin && std::int64_t{soft_pin_s} * 1000 > now_ms;
  }

  std::string_view key() const noexcept {
    return {reinterpret_cast<const char*>(this) + sizeof(object_meta) +
                (capacity() - 1u) * sizeof(replica_loc),
            key_len};
  }
  bool is(std::uint8_t f) const noexcept { return (flags & f) != 0; }
  void set(std::uint8_t f, bool on) noexcept {
    flags = static_cast<std::uint8_t>(on ? (flags | f) : (flags & ~f));
  }
  replica_loc& replica(std::size_t i) noexcept { return i == 0 ? first : extra()[i - 1]; }
  const replica_loc& replica(std::size_t i) const noexcept {
    return i == 0 ? first : extra()[i - 1];
  }
  void drop_replica(std::size_t i) noexcept {
    replica(i) = replica(count() - 1u);
    set_count(count() - 1u);
  }
  /// Replicas in memory (segments), not on disks.
  std::size_t in_memory() const noexcept {
    std::size_t n = 0;
    for (std::size_t i = 0; i < count(); ++i) n += on_disk(replica(i)) ? 0 : 1;
    return n;
  }
  /// The client whose disk holds a replica (the first), 0 when none does.
  std::uint64_t disk_holder() const noexcept {
    for (std::size_t i = 0; i < count(); ++i) {
      if (on_disk(replica(i))) return replica(i).segment & ~disk_bit;
    }
    return 0;
  }

 private:
  replica_loc* extra() noexcept {
    // sizeof(object_meta) is a multiple of alignof(replica_loc): aligned.
    return static_cast<replica_loc*>(
        static_cast<void*>(reinterpret_cast<char*>(this) + sizeof(object_meta)));
  }
  const replica_loc* extra() const noexcept {
    return static_cast<const replica_loc*>(
        static_cast<const void*>(reinterpret_cast<const char*>(this) + sizeof(object_meta)));
  }
};
static_assert(sizeof(object_meta) % alignof(replica_loc) == 0);
static_assert(sizeof(void*) != 8 || sizeof(object_meta) == 64, "one cache line per record");

struct object_deleter {
  void operator()(object_meta* o) const noexcept {
    o->~object_meta();
    ::operator delete(o);
  }
};
using object_ptr = std::unique_ptr<object_meta, object_deleter>;

// `replicas` >= 1.
inline object_ptr make_object(std::string_view key, std::size_t replicas) {
  const std::size_t extra = (replicas - 1) * sizeof(replica_loc);
  void* mem = ::operator new(sizeof(object_meta) + extra + key.size());
  object_ptr o{::new (mem) object_meta{}};
  char* tail = static_cast<char*>(mem) + sizeof(object_meta);
  for (std::size_t i = 0; i + 1 < replicas; ++i) {
    ::new (static_cast<void*>(tail + i * sizeof(replica_loc))) replica_loc{};
  }
  o->counts = static_cast<std::uint8_t>((replicas & 15u) << 4);
  o->key_len = static_cast<std::uint16_t>(key.size());
  std::memcpy(tail + extra, key.data(), key.size());
  return o;
}

inline std::uint64_t hash_key(std::string_view key) noexcept {
  return std::hash<std::string_view>{}(key);
}

// The objects of one shard: a chained hash table whose links live in the
// objects themselves (no node per object), power-of-two buckets, at most
// one object per bucket on average. Owns its objects. Not thread-safe.
class object_index {
 public:
  object_index() : buckets_(16, nullptr) {}
  object_index(const object_index&) = delete;
  object_index& operator=(const object_index&) = delete;
  ~object_index() {
    for (object_meta* head : buckets_) {
      while (head != nullptr) {
        object_ptr doomed{head};
        head = head->next;
      }
    }
  }

  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  std::size_t bucket_count() const noexcept { return buckets_.size(); }

  object_meta* find(std::string_view key) const noexcept {
    for (object_meta* o = buckets_[bucket_of(hash_key(key))]; o != nullptr; o = o->next) {
      if (o->key() == key) return o;
    }
    return nullptr;
  }

  /// Adds an object whose key is not present.
  void insert(object_ptr o) {
    if (size_ + 1 > buckets_.size()) rehash(buckets_.size() * 2);
    object_meta*& head = buckets_[bucket_of(hash_key(o->key()))];
    o->next = head;
    head = o.release();
    ++size_;
  }

  /// Unlinks and deletes an object of this index.
  void erase(object_meta* o) noexcept {
    object_meta** p = &buckets_[bucket_of(hash_key(o->key()))];
    while (*p != nullptr && *p != o) p = &(*p)->next;
    if (*p == nullptr) return;
    *p = o->next;
    --size_;
    object_ptr doomed{o};
  }

  /// Deletes every object for which pred(object&) is true.
  template <class Pred>
  void erase_if(Pred&& pred) {
    for (object_meta*& head : buckets_) {
      object_meta** p = &head;
      while (*p != nullptr) {
        object_meta* o = *p;
        if (pred(*o)) {
          *p = o->next;
          --size_;
          object_ptr doomed{o};
        } else {
          p = &o->next;
        }
      }
    }
  }

  /// Calls f(object&) for the objects of bucket `b` while it returns true.
  template <class F>
  void for_each_in_bucket(std::size_t b, F&& f) {
    for (object_meta* o = buckets_[b]; o != nullptr; o = o->next) {
      if (!f(*o)) return;
    }
  }

 private:
  std::size_t bucket_of(std::uint64_t h) const noexcept {
    return static_cast<std::size_t>(h) & (buckets_.size() - 1);
  }
  void rehash(std::size_t n) {
    std::vector<object_meta*> fresh(n, nullptr);
    for (object_meta* head : buckets_) {
      while (head != nullptr) {
        object_meta* o = head;
        head = head->next;
        object_meta*& dst = fresh[static_cast<std::size_t>(hash_key(o->key())) & (n - 1)];
        o->next = dst;
        dst = o;
      }
    }
    buckets_.swap(fresh);
  }

  std::vector<object_meta*> buckets_;  // a power of two long
  std::size_t size_ = 0;
};

}  // namespace detail

class object_table {
 public:
  /// Throws std::invalid_argument when cfg.validate() fails.
  explicit object_table(master_config cfg = {})
      : cfg_{validated(std::move(cfg))},
        segments_{cfg_.alignment, policy_of(cfg_), cfg_.placement_seed},
        shards_{std::make_unique<shard[]>(shard_count)} {}

  object_table(const object_table&) = delete;
  object_table& operator=(const object_table&) = delete;

  const master_config& config() const noexcept { return cfg_; }
  segment_table& segments() noexcept { return segments_; }
  const segment_table& segments() const noexcept { return segments_; }

  // ---- segments -------------------------------------------------------

  /// See segment_table::mount.
  std::error_code mount_segment(const segment_desc& d, segment_id& out, bool open = true) {
    return segments_.mount(d, out, open);
  }

  /// Unmounts a segment: the replicas on it are dropped, objects left with
  /// none disappear (puts in progress too: their put_end then fails with
  /// object_not_found). segment_not_found when it is not mounted.
  std::error_code unmount_segment(segment_id id, unmount_report* report = nullptr) {
    if (auto ec = segments_.begin_unmount(id)) return ec;
    unmount_report r;
    for (std::size_t s = 0; s < shard_count; ++s) {
      shard& sh = shards_[s];
      std::lock_guard lock{sh.mu};
      sh.objects.erase_if([&](detail::object_meta& o) {
        bool had = false;
        for (std::size_t i = 0; i < o.count();) {
          if (o.replica(i).segment == id.value()) {
            o.drop_replica(i);
            ++r.replicas_dropped;
            had = true;
          } else {
            ++i;
          }
        }
        // A store or load into a dropped range cannot finish.
        if (had && o.is(detail::object_meta::demoting)) end_demotion(sh, o, true);
        if (had && o.is(detail::object_meta::loading)) end_load(sh, o, false);
        if (o.count() != 0) return false;
        ++r.objects_lost;
        forget(sh, o);
        return true;
      });
    }
    {
      std::lock_guard lock{discard_mu_};
      std::erase_if(discarded_, [&](const discarded_range& d) {
        if (d.segment != id.value()) return false;
        reserved_ -= segments_.rounded(d.size);
        return true;
      });
    }
    segments_.finish_unmount(id);
    if (report) *report = r;
    return {};
  }

  /// Unmounts every segment of a client (it is gone); how many.
  std::size_t unmount_client(std::uint64_t client) {
    (void)unmount_disk(client);
    std::size_t n = 0;
    for (segment_id id : segments_.segments_of(client)) n += unmount_segment(id) ? 0 : 1;
    return n;
  }

  // ---- puts -----------------------------------------------------------

  /// Starts a put of `size` bytes under `key` by client `writer`: allocates
  /// the replicas (written to `out`) and records the object, invisible until
  /// put_end. Errors: invalid_key (empty or longer than max_key_size, the
  /// parent too), invalid_params (size 0 or larger than the largest segment,
  /// replicas 0 or above max_replicas, writer 0, parent == key),
  /// object_already_exists (a complete object has the key: first writer
  /// wins), object_in_progress (another put of the key has not ended and is
  /// younger than put_discard_timeout; an older one is discarded and this
  /// put goes ahead), no_space (no segment mounted, or none has room now:
  /// eviction is asked for, the caller backs off).
  std::error_code put_start(std::string_view key, std::uint64_t size, std::uint64_t writer,
                            const put_options& opt, master_time now, replica_list& out) {
    out.clear();
    if (auto ec = check_key(key)) return ec;
    if (!opt.parent.empty()) {
      if (auto ec = check_key(opt.parent)) return ec;
      if (opt.parent == key) return store_errc::invalid_params;
    }
    if (size == 0 || writer == 0 || opt.replicas == 0 || opt.replicas > max_replicas) {
      return store_errc::invalid_params;
    }
    const std::uint64_t largest = segments_.largest_segment();
    if (largest == 0) return store_errc::no_space;
    // The object's bytes and its record (store/wire/record.hpp).
    const std::uint64_t footprint = footprint_of(size, key.size());
    const std::uint64_t n = segments_.rounded(footprint);
    if (footprint == 0 || n == 0 || n > largest) return store_errc::invalid_params;
    const std::int64_t t = ms(now);
    const std::uint64_t h = detail::hash_key(key);
    shard& sh = shard_of(h);
    std::lock_guard lock{sh.mu};
    if (detail::object_meta* it = sh.objects.find(key); it != nullptr) {
      const detail::object_meta& o = *it;
      if (o.is(detail::object_meta::complete)) return store_errc::object_already_exists;
      if (t - o.time_ms < cfg_.put_discard_timeout.count()) return store_errc::object_in_progress;
      discard(sh, it);  // a stale put: this one preempts it
    }
    std::array<segment_range, max_replicas> got{};
    const std::size_t k = segments_.allocate(
        footprint, placement_request{opt.replicas, opt.preferred, opt.host}, std::span{got});
    if (k == 0) {
      eviction_wanted_.store(true, std::memory_order_relaxed);
      return store_errc::no_space;
    }
    detail::object_ptr o = detail::make_object(key, k);
    o->size = size;
    o->time_ms = t;
    o->writer = writer;
    if (opt.hard_pin) o->set(detail::object_meta::hard_pin, true);
    if (opt.soft_pin) {
      auto ttl = opt.soft_pin_ttl.count() > 0 ? opt.soft_pin_ttl : cfg_.soft_pin_ttl;
      ttl = std::min(ttl, cfg_.max_soft_pin_ttl);
      o->set_soft_pin(t + std::max<std::int64_t>(ttl.count(), 1));
    }
    o->set_count(k);
    for (std::size_t i = 0; i < k; ++i) {
      o->replica(i) = {got[i].segment.value(), got[i].offset};
      out.push_back({got[i].segment, got[i].offset, size, replica_status::processing});
    }
    if (!opt.parent.empty()) {
      o->parent_hash = detail::hash_key(opt.parent);
      o->set(detail::object_meta::has_parent, true);
      link_parent(o->parent_hash, +1);
    }
    sh.in_progress.insert(o.get());
    sh.objects.insert(std::move(o));
    objects_.fetch_add(1, std::memory_order_relaxed);
    in_progress_.fetch_add(1, std::memory_order_relaxed);
    return {};
  }

  /// Ends a put: the object becomes visible. object_not_found (never
  /// started, revoked, discarded, lost with its segments), illegal_client
  /// (another client's put). Ending an ended put of the same writer is a
  /// no-op success.
  std::error_code put_end(std::string_view key, std::uint64_t writer, master_time now) {
    (void)now;
    if (auto ec = check_key(key)) return ec;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it == nullptr) return store_errc::object_not_found;
    detail::object_meta& o = *it;
    if (o.writer != writer) return store_errc::illegal_client;
    if (o.is(detail::object_meta::complete)) return {};
    o.set(detail::object_meta::complete, true);
    o.set(detail::object_meta::referenced, true);
    o.time_ms = 0;  // no lease yet
    sh.in_progress.erase(&o);
    in_progress_.fetch_sub(1, std::memory_order_relaxed);
    return {};
  }

  /// Gives up a put: its space is free at once. object_not_found,
  /// illegal_client, object_already_exists (the put ended: remove it).
  std::error_code put_revoke(std::string_view key, std::uint64_t writer, master_time now) {
    (void)now;
    if (auto ec = check_key(key)) return ec;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it == nullptr) return store_errc::object_not_found;
    const detail::object_meta& o = *it;
    if (o.writer != writer) return store_errc::illegal_client;
    if (o.is(detail::object_meta::complete)) return store_errc::object_already_exists;
    free_replicas(o);
    erase(sh, it);
    return {};
  }

  // ---- a master that came up empty -----------------------------------

  /// Takes back an object a segment's owner found in its memory (a record
  /// whose bytes check out: store/wire/record.hpp), complete and readable,
  /// its bytes at [offset, offset + size) of `segment`. A key the table
  /// already holds complete with the same size gains this replica (up to
  /// max_replicas); otherwise object_already_exists (a put of the key came
  /// first: it wins). invalid_key, invalid_params (size 0, a range that is
  /// not free or not aligned), segment_not_found. No parent link and no
  /// pins come back: the record does not carry them.
  std::error_code adopt(segment_id segment, std::string_view key, std::uint64_t offset,
                        std::uint64_t size) {
    if (auto ec = check_key(key)) return ec;
    const std::uint64_t footprint = footprint_of(size, key.size());
    if (size == 0 || footprint == 0) return store_errc::invalid_params;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it != nullptr && (!it->is(detail::object_meta::complete) || it->size != size ||
                          it->is(detail::object_meta::loading) || it->count() >= max_replicas)) {
      return store_errc::object_already_exists;
    }
    if (it != nullptr) {
      for (std::size_t i = 0; i < it->count(); ++i) {
        if (it->replica(i).segment == segment.value()) return store_errc::object_already_exists;
      }
    }
    if (auto ec = segments_.reserve(segment, offset, footprint)) return ec;
    if (it != nullptr) {
      add_replica(sh, it, {segment.value(), offset});
      return {};
    }
    detail::object_ptr o = detail::make_object(key, 1);
    o->size = size;
    o->set_count(1);
    o->set(detail::object_meta::complete, true);
    o->set(detail::object_meta::referenced, true);
    o->replica(0) = {segment.value(), offset};
    sh.objects.insert(std::move(o));
    objects_.fetch_add(1, std::memory_order_relaxed);
    return {};
  }

  // ---- the SSD tier: replicas on clients' disks ----------------------
  //
  // A client with a disk mounted (mount_disk) keeps objects evicted from
  // memory: eviction sends an object whose memory replica it owns to its
  // disk (a store task; the replica stays readable and its range taken
  // until disk_stored), then drops the memory replicas of objects that have
  // a disk replica. A get of an object on a disk only starts a load (a range
  // allocated on the holder's segments, a load task; readers are answered
  // object_loading until disk_loaded). remove deletes disk copies too (drop
  // tasks). The holders' reports come back through disk_stored,
  // disk_loaded, disk_dropped and (a disk's manifest, at its mount)
  // disk_adopt. Tasks wait in an outbox the server empties
  // (take_disk_tasks). A store or load not reported within
  // put_discard_timeout is given up by reclaim().

  /// A client's disk joins the tier (`capacity` bytes, > 0), or leaves it
  /// (0: unmount_disk). Not `accepting` (it failed a write: full, read
  /// only): its objects stay readable, eviction sends it no more.
  void mount_disk(std::uint64_t client, std::uint64_t capacity, bool accepting = true) {
    if (capacity == 0) {
      (void)unmount_disk(client);
      return;
    }
    std::lock_guard lock{disk_mu_};
    disks_[client] = {capacity, accepting};
  }

  /// The client's disk leaves the tier: its disk replicas are dropped
  /// (objects left with none vanish), loads from it and stores to it are
  /// given up. How many replicas were dropped.
  std::size_t unmount_disk(std::uint64_t client) {
    {
      std::lock_guard lock{disk_mu_};
      if (disks_.erase(client) == 0) return 0;
    }
    const std::uint64_t id = detail::disk_bit | client;
    std::size_t n = 0;
    for (std::size_t s = 0; s < shard_count; ++s) {
      shard& sh = shards_[s];
      std::lock_guard lock{sh.mu};
      sh.objects.erase_if([&](detail::object_meta& o) {
        bool had = false;
        for (std::size_t i = 0; i < o.count();) {
          if (o.replica(i).segment == id) {
            o.drop_replica(i);
            had = true;
            ++n;
          } else {
            ++i;
          }
        }
        if (had) disk_replicas_.fetch_sub(1, std::memory_order_relaxed);
        if (o.is(detail::object_meta::loading) && had) end_load(sh, o, false);
        if (o.is(detail::object_meta::demoting) && owns_memory_replica(o, client)) {
          end_demotion(sh, o, false);
        }
        if (o.count() != 0) return false;
        forget(sh, o);
        return true;
      });
    }
    return n;
  }

  bool has_disk(std::uint64_t client) const {
    std::lock_guard lock{disk_mu_};
    return disks_.count(client) != 0;
  }
  bool accepting_disk(std::uint64_t client) const {
    std::lock_guard lock{disk_mu_};
    const auto it = disks_.find(client);
    return it != disks_.end() && it->second.accepting;
  }

  /// An object `client`'s disk holds (its manifest at mount): a key the
  /// table lacks comes back complete, on that disk only; a complete one of
  /// the same size gains the disk replica. object_already_exists when the
  /// key is held with another size or is being put (the holder deletes its
  /// copy), client_not_found when the client has no disk mounted,
  /// invalid_key, invalid_params (size 0).
  std::error_code disk_adopt(std::string_view key, std::uint64_t size, std::uint64_t client) {
    if (auto ec = check_key(key)) return ec;
    if (size == 0 || footprint_of(size, key.size()) == 0) return store_errc::invalid_params;
    if (!has_disk(client)) return store_errc::client_not_found;
    const std::uint64_t id = detail::disk_bit | client;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it == nullptr) {
      detail::object_ptr o = detail::make_object(key, 1);
      o->size = size;
      o->set_count(1);
      o->set(detail::object_meta::complete, true);
      o->replica(0) = {id, 0};
      sh.objects.insert(std::move(o));
      objects_.fetch_add(1, std::memory_order_relaxed);
      disk_replicas_.fetch_add(1, std::memory_order_relaxed);
      return {};
    }
    if (!it->is(detail::object_meta::complete) || it->size != size) {
      return store_errc::object_already_exists;
    }
    for (std::size_t i = 0; i < it->count(); ++i) {
      if (it->replica(i).segment == id) return {};
    }
    if (it->count() >= max_replicas) return store_errc::object_already_exists;
    add_replica(sh, it, {id, 0});
    disk_replicas_.fetch_add(1, std::memory_order_relaxed);
    return {};
  }

  /// The end of a store task: `client` copied (`ok`) or failed to copy the
  /// replica at `segment`/`offset` to its disk. object_not_found when no
  /// such demotion is under way (the object was removed, or its replica
  /// dropped, or the demotion given up): the holder deletes its copy.
  std::error_code disk_stored(std::string_view key, std::uint64_t client, std::uint64_t segment,
                              std::uint64_t offset, bool ok) {
    if (auto ec = check_key(key)) return ec;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it == nullptr || !it->is(detail::object_meta::demoting) || !holds(*it, segment, offset) ||
        segments_.client_of(segment_id{segment}) != client) {
      return store_errc::object_not_found;
    }
    end_demotion(sh, *it, ok);
    if (!ok) return {};
    if (it->count() >= max_replicas || !has_disk(client)) return store_errc::object_not_found;
    add_replica(sh, it, {detail::disk_bit | client, 0});
    disk_replicas_.fetch_add(1, std::memory_order_relaxed);
    return {};
  }

  /// The end of a load task: `client` filled (`ok`) the range at
  /// `segment`/`offset` from its disk, and the object is readable there,
  /// under a read lease from `now` (the lease its reader's get would have
  /// had: it keeps the object in memory until the reader asks again, where
  /// a pool evicting hard would push it out first and load it again, over
  /// and over); or it failed, and the range is freed and its disk replica
  /// dropped (the object is lost when that was its last replica).
  /// object_not_found when no such load is under way.
  std::error_code disk_loaded(std::string_view key, std::uint64_t client, std::uint64_t segment,
                              std::uint64_t offset, bool ok, master_time now) {
    if (auto ec = check_key(key)) return ec;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it == nullptr || !it->is(detail::object_meta::loading) || !holds(*it, segment, offset) ||
        !holds(*it, detail::disk_bit | client, 0)) {
      return store_errc::object_not_found;
    }
    end_load(sh, *it, ok);
    if (ok) grant_lease(*it, now);
    if (!ok) {
      drop_disk_replica(*it, client);
      if (it->count() == 0) erase(sh, it);
    }
    return {};
  }

  /// `client`'s disk no longer holds the key (its own space eviction): the
  /// disk replica is dropped, the object with it when it was the last.
  /// object_not_found when the table had no such replica.
  std::error_code disk_dropped(std::string_view key, std::uint64_t client) {
    if (auto ec = check_key(key)) return ec;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it == nullptr || !drop_disk_replica(*it, client)) return store_errc::object_not_found;
    if (it->is(detail::object_meta::loading) && it->disk_holder() == 0) end_load(sh, *it, false);
    if (it->count() == 0) erase(sh, it);
    return {};
  }

  /// A task that never reached its holder (no connection): a store ends
  /// and its object is evicted without a disk (the pool does not wait for
  /// a holder that may be gone), a load frees its range (the object stays
  /// on the disk; the next get asks again). Drops: nothing to undo.
  void disk_task_undelivered(const disk_task& t) {
    if (t.what == disk_task::kind::drop || check_key(t.key)) return;
    shard& sh = shard_of(detail::hash_key(t.key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(t.key);
    if (it == nullptr || !holds(*it, t.segment, t.offset)) return;
    if (t.what == disk_task::kind::store && it->is(detail::object_meta::demoting)) {
      end_demotion(sh, *it, false);
    } else if (t.what == disk_task::kind::load && it->is(detail::object_meta::loading)) {
      end_load(sh, *it, false, /*touched*/ false);
    }
  }

  /// Moves the tasks waiting for disk holders to `out` (cleared first).
  /// The server calls it after every request: without tasks waiting it
  /// reads one atomic and takes no lock.
  void take_disk_tasks(std::vector<disk_task>& out) {
    out.clear();
    if (!tasks_waiting_.load(std::memory_order_acquire)) return;
    std::lock_guard lock{tasks_mu_};
    out.swap(tasks_);
    tasks_waiting_.store(false, std::memory_order_relaxed);
  }

  // ---- lookups --------------------------------------------------------

  /// Looks a complete object up and grants it a read lease until now +
  /// lease_ttl (a lease is only ever extended). object_not_found,
  /// object_in_progress, invalid_key.
  std::error_code get(std::string_view key, master_time now, object_info& out) {
    return look_up(key, &now, out);
  }

  /// get() without a lease: where a complete object's replicas are
  /// (Mooncake's replica descriptors). Nothing is promised about them: a
  /// reader takes a lease with get().
  std::error_code describe(std::string_view key, object_info& out) {
    return look_up(key, nullptr, out);
  }

 private:
  std::error_code look_up(std::string_view key, const master_time* lease_from, object_info& out) {
    out.replicas.clear();
    if (auto ec = check_key(key)) return ec;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it == nullptr) return store_errc::object_not_found;
    detail::object_meta& o = *it;
    if (!o.is(detail::object_meta::complete)) return store_errc::object_in_progress;
    if (lease_from != nullptr && (o.is(detail::object_meta::loading) || o.in_memory() == 0)) {
      o.set(detail::object_meta::referenced, true);
      if (!o.is(detail::object_meta::loading)) {
        if (auto ec = start_load(sh, it, *lease_from)) return ec;
      }
      return store_errc::object_loading;
    }
    if (lease_from != nullptr) grant_lease(o, *lease_from);
    out.size = o.size;
    if (o.is(detail::object_meta::loading)) return {};  // describe: on a disk only for now
    out.lease_until = master_time{std::chrono::milliseconds{o.time_ms}};
    for (std::size_t i = 0; i < o.count(); ++i) {
      if (detail::on_disk(o.replica(i))) continue;
      out.replicas.push_back({segment_id{o.replica(i).segment}, o.replica(i).offset, o.size,
                              replica_status::complete});
    }
    return {};
  }

 public:
  /// Whether a complete object has the key: success, object_not_found,
  /// object_in_progress or invalid_key. Grants a read lease when
  /// lease_on_exists (as Mooncake's ExistKey).
  std::error_code exists(std::string_view key, master_time now) {
    if (auto ec = check_key(key)) return ec;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it == nullptr) return store_errc::object_not_found;
    detail::object_meta& o = *it;
    if (!o.is(detail::object_meta::complete)) return store_errc::object_in_progress;
    if (cfg_.lease_on_exists) {
      grant_lease(o, now);
    } else {
      o.set(detail::object_meta::referenced, true);
    }
    return {};
  }

  /// exists() for a batch, one result per key in input order, as
  /// Mooncake's batch_is_exist: 1 exists, 0 does not (or is in progress),
  /// a negative Mooncake code for an invalid key. `out` is at least as long
  /// as `keys` (extra entries are left alone).
  void exists(std::span<const std::string_view> keys, master_time now,
              std::span<std::int32_t> out) {
    const std::size_t n = std::min(keys.size(), out.size());
    for (std::size_t i = 0; i < n; ++i) {
      const auto ec = exists(keys[i], now);
      if (!ec) {
        out[i] = 1;
      } else if (ec == store_errc::object_not_found || ec == store_errc::object_in_progress) {
        out[i] = 0;
      } else {
        out[i] = mooncake_code(ec);
      }
    }
  }

  // ---- removal --------------------------------------------------------

  /// Removes an object. Refused, unless `force`, with object_has_lease
  /// while a read lease runs, object_hard_pinned when hard-pinned and
  /// object_in_progress for a put that has not ended (forced, that put is
  /// discarded: its space is reused only after put_release_timeout).
  std::error_code remove(std::string_view key, master_time now, bool force = false) {
    if (auto ec = check_key(key)) return ec;
    shard& sh = shard_of(detail::hash_key(key));
    std::lock_guard lock{sh.mu};
    detail::object_meta* it = sh.objects.find(key);
    if (it == nullptr) return store_errc::object_not_found;
    const detail::object_meta& o = *it;
    if (!o.is(detail::object_meta::complete)) {
      if (!force) return store_errc::object_in_progress;
      discard(sh, it);
      return {};
    }
    if (!force && o.is(detail::object_meta::hard_pin)) return store_errc::object_hard_pinned;
    if (!force && o.time_ms > ms(now)) return store_errc::object_has_lease;
    let_go(o);
    erase(sh, it);
    return {};
  }

  /// Removes every complete object that remove(key, now, force) would;
  /// puts in progress are left alone. How many were removed.
  std::size_t remove_all(master_time now, bool force = false) {
    const std::int64_t t = ms(now);
    std::size_t n = 0;
    for (std::size_t s = 0; s < shard_count; ++s) {
      shard& sh = shards_[s];
      std::lock_guard lock{sh.mu};
      sh.objects.erase_if([&](detail::object_meta& o) {
        if (!o.is(detail::object_meta::complete) ||
            (!force && (o.is(detail::object_meta::hard_pin) || o.time_ms > t))) {
          return false;
        }
        let_go(o);
        forget(sh, o);
        ++n;
        return true;
      });
    }
    return n;
  }

  /// Discards puts older than put_discard_timeout and reuses the space of
  /// discarded puts older than put_release_timeout. Call it periodically
  /// (every second is plenty); it visits only puts in progress.
  reclaim_report reclaim(master_time now) {
    const std::int64_t t = ms(now);
    reclaim_report r;
    for (std::size_t s = 0; s < shard_count; ++s) {
      shard& sh = shards_[s];
      std::lock_guard lock{sh.mu};
      thread_local std::vector<detail::object_meta*> stale;
      stale.clear();
      for (detail::object_meta* o : sh.disk_pending) {
        if (t - o->time_ms >= cfg_.put_discard_timeout.count()) stale.push_back(o);
      }
      for (detail::object_meta* o : stale) {
        // Its holder never reported: the copy is given up (a late report
        // finds nothing under way; the holder then deletes its copy).
        if (o->is(detail::object_meta::demoting)) {
          end_demotion(sh, *o, false);
        } else {
          end_load(sh, *o, false);
        }
        ++r.disk_tasks_given_up;
      }
      if (sh.in_progress.empty()) continue;
      stale.clear();
      for (detail::object_meta* o : sh.in_progress) {
        if (t - o->time_ms >= cfg_.put_discard_timeout.count()) stale.push_back(o);
      }
      for (detail::object_meta* o : stale) {
        discard(sh, o);
        ++r.discarded;
      }
    }
    thread_local std::vector<discarded_range> due;
    due.clear();
    {
      std::lock_guard lock{discard_mu_};
      std::erase_if(discarded_, [&](const discarded_range& d) {
        if (d.release_ms > t) return false;
        due.push_back(d);
        reserved_ -= segments_.rounded(d.size);
        return true;
      });
    }
    for (const discarded_range& d : due) {
      segments_.free(segment_id{d.segment}, d.offset, d.size);
      ++r.released;
      r.released_bytes += segments_.rounded(d.size);
    }
    return r;
  }

  // ---- state ----------------------------------------------------------

  pool_stats stats() const {
    pool_stats p;
    p.capacity = segments_.capacity();
    p.used = segments_.used();
    p.objects = objects_.load(std::memory_order_relaxed);
    p.in_progress = in_progress_.load(std::memory_order_relaxed);
    p.segments = segments_.count();
    p.disk_replicas = disk_replicas_.load(std::memory_order_relaxed);
    {
      std::lock_guard lock{disk_mu_};
      p.disks = disks_.size();
      for (const auto& [client, d] : disks_) p.disks_accepting += d.accepting ? 1 : 0;
    }
    std::lock_guard lock{discard_mu_};
    p.reserved = reserved_;
    return p;
  }

  // ---- for the evictor (eviction.hpp) ---------------------------------

  /// Bytes of objects being copied to disks (one replica each): a later
  /// eviction round frees them.
  std::uint64_t demoting_bytes() const noexcept {
    return demoting_bytes_.load(std::memory_order_relaxed);
  }

  /// Whether a put failed for space since the last call (and clears it).
  bool take_eviction_request() noexcept {
    return eviction_wanted_.exchange(false, std::memory_order_relaxed);
  }

  /// One step of CLOCK over one shard: looks at up to `bucket_budget`
  /// buckets of its hash set from where its hand stopped, giving referenced
  /// objects a second chance (clears the bit) and evicting the others that
  /// may go until `want` bytes are freed. An object may go when it is
  /// complete, not hard-pinned, its lease has run out, it is not soft-pinned
  /// (unless `soft_pinned_too`), and no object names it as parent. With
  /// `want` 0 it only moves the hand, clearing reference bits. Holds the
  /// shard's lock for this step only.
  evict_step evict_from_shard(std::size_t s, master_time now, std::size_t bucket_budget,
                              std::uint64_t want, bool soft_pinned_too) {
    const std::int64_t t = ms(now);
    evict_step r;
    shard& sh = shards_[s % shard_count];
    std::lock_guard lock{sh.mu};
    const std::size_t nb = sh.objects.bucket_count();
    if (sh.objects.empty() || nb == 0) {
      r.visited = 1;
      return r;
    }
    thread_local std::vector<detail::object_meta*> victims;
    victims.clear();
    std::uint64_t planned = 0;
    std::size_t b = sh.hand % nb;
    for (; r.visited < std::min(bucket_budget, nb) && (want == 0 || planned < want); ++r.visited) {
      sh.objects.for_each_in_bucket(b, [&](detail::object_meta& o) {
        if (o.is(detail::object_meta::referenced)) {
          o.set(detail::object_meta::referenced, false);
          return true;
        }
        if (!o.is(detail::object_meta::complete) || o.is(detail::object_meta::hard_pin) ||
            o.time_ms > t || (!soft_pinned_too && o.soft_pinned(t)) || has_children(o) ||
            held_by_disk_task(o) || o.in_memory() == 0) {
          return true;
        }
        if (want == 0) return true;
        victims.push_back(&o);
        planned += segments_.rounded(footprint_of(o)) * o.in_memory();
        return planned < want;
      });
      b = (b + 1) % nb;
    }
    sh.hand = b;
    for (detail::object_meta* o : victims) {
      const std::uint64_t bytes = segments_.rounded(footprint_of(*o)) * o->in_memory();
      if (o->disk_holder() != 0) {
        // On a disk already: only its memory goes.
        free_replicas(*o);
        for (std::size_t i = 0; i < o->count();) {
          if (detail::on_disk(o->replica(i))) {
            ++i;
          } else {
            o->drop_replica(i);
          }
        }
        r.freed += bytes;
        ++r.evicted;
      } else if (start_demotion(sh, *o, t)) {
        r.demoting += bytes;
        ++r.demoted;
      } else {
        r.freed += bytes;
        ++r.evicted;
        free_replicas(*o);
        erase(sh, o);
      }
    }
    return r;
  }

  /// Buckets of all shards' hash sets: how far a full CLOCK turn goes.
  std::size_t bucket_total() const {
    std::size_t n = 0;
    for (std::size_t s = 0; s < shard_count; ++s) {
      std::lock_guard lock{shards_[s].mu};
      n += shards_[s].objects.bucket_count();
    }
    return n;
  }

 private:
  struct alignas(64) shard {
    mutable std::mutex mu;
    detail::object_index objects;                           // guarded by mu
    std::unordered_set<detail::object_meta*> in_progress;   // guarded by mu
    std::unordered_set<detail::object_meta*> disk_pending;  // demoting or loading; mu
    std::size_t hand = 0;                                   // CLOCK hand, guarded by mu
    // Children per parent key hash, for keys of this shard. A leaf lock:
    // taken under any shard's mu, never with another lock under it.
    std::mutex chain_mu;
    std::unordered_map<std::uint64_t, std::uint32_t> children;  // guarded by chain_mu
  };

  struct discarded_range {
    std::uint64_t segment = 0;
    std::uint64_t offset = 0;
    std::uint64_t size = 0;
    std::int64_t release_ms = 0;
  };

  static master_config validated(master_config c) {
    if (c.validate()) throw std::invalid_argument("object_table: invalid master_config");
    return c;
  }
  static placement_policy policy_of(const master_config& c) {
    placement_policy p = placement_policy::random;
    (void)parse_placement(c.placement, p);
    return p;
  }
  static std::int64_t ms(master_time t) noexcept { return t.time_since_epoch().count(); }

  std::error_code check_key(std::string_view key) const noexcept {
    if (key.empty() || key.size() > cfg_.max_key_size) return store_errc::invalid_key;
    return {};
  }

  shard& shard_of(std::uint64_t h) noexcept {
    static_assert(shard_count == 256);
    return shards_[static_cast<std::size_t>(h >> 56)];  // the top bits: the buckets use the low
  }

  void grant_lease(detail::object_meta& o, master_time now) noexcept {
    o.time_ms = std::max(o.time_ms, ms(now) + cfg_.lease_ttl.count());
    o.set(detail::object_meta::referenced, true);
  }

  void link_parent(std::uint64_t parent_hash, int delta) {
    shard& p = shard_of(parent_hash);
    std::lock_guard lock{p.chain_mu};
    if (delta > 0) {
      ++p.children[parent_hash];
    } else if (auto it = p.children.find(parent_hash); it != p.children.end()) {
      if (--it->second == 0) p.children.erase(it);
    }
  }

  bool has_children(const detail::object_meta& o) {
    const std::uint64_t h = detail::hash_key(o.key());
    shard& p = shard_of(h);
    std::lock_guard lock{p.chain_mu};
    return p.children.find(h) != p.children.end();
  }

  // The bytes an object takes in each of its segments: its own and its
  // record's (when objects carry records).
  std::uint64_t footprint_of(std::uint64_t size, std::size_t key_size) const noexcept {
    return cfg_.object_records ? wire::object_footprint(size, key_size) : size;
  }
  std::uint64_t footprint_of(const detail::object_meta& o) const noexcept {
    return footprint_of(o.size, o.key_len);
  }

  // Frees the memory replicas' ranges (disk replicas take no range).
  void free_replicas(const detail::object_meta& o) {
    for (std::size_t i = 0; i < o.count(); ++i) {
      if (detail::on_disk(o.replica(i))) continue;
      segments_.free(segment_id{o.replica(i).segment}, o.replica(i).offset, footprint_of(o));
    }
  }

  // Keeps a range a client may still write or read until
  // put_release_timeout after `since_ms`, then reuses it.
  void reserve_range(std::uint64_t segment, std::uint64_t offset, std::uint64_t size,
                     std::int64_t since_ms) {
    std::lock_guard lock{discard_mu_};
    discarded_.push_back({segment, offset, size, since_ms + cfg_.put_release_timeout.count()});
    reserved_ += segments_.rounded(size);
  }

  // A complete object leaves the table (remove, remove_all): its ranges are
  // freed, or kept a while when a disk holder may still copy from or into
  // them; its disk copies are deleted by drop tasks.
  void let_go(const detail::object_meta& o) {
    if (held_by_disk_task(o)) {
      for (std::size_t i = 0; i < o.count(); ++i) {
        if (detail::on_disk(o.replica(i))) continue;
        reserve_range(o.replica(i).segment, o.replica(i).offset, footprint_of(o), o.time_ms);
      }
    } else {
      free_replicas(o);
    }
    for (std::size_t i = 0; i < o.count(); ++i) {
      if (!detail::on_disk(o.replica(i))) continue;
      push_task({disk_task::kind::drop, o.replica(i).segment & ~detail::disk_bit,
                 std::string(o.key()), o.size, 0, 0});
    }
  }

  static bool held_by_disk_task(const detail::object_meta& o) noexcept {
    return o.is(detail::object_meta::demoting) || o.is(detail::object_meta::loading);
  }

  static bool holds(const detail::object_meta& o, std::uint64_t segment,
                    std::uint64_t offset) noexcept {
    for (std::size_t i = 0; i < o.count(); ++i) {
      if (o.replica(i).segment == segment && o.replica(i).offset == offset) return true;
    }
    return false;
  }

  bool owns_memory_replica(const detail::object_meta& o, std::uint64_t client) const {
    for (std::size_t i = 0; i < o.count(); ++i) {
      if (detail::on_disk(o.replica(i))) continue;
      if (segments_.client_of(segment_id{o.replica(i).segment}) == client) return true;
    }
    return false;
  }

  // Drops `client`'s disk replica; whether there was one.
  bool drop_disk_replica(detail::object_meta& o, std::uint64_t client) {
    for (std::size_t i = 0; i < o.count(); ++i) {
      if (o.replica(i).segment == (detail::disk_bit | client)) {
        o.drop_replica(i);
        disk_replicas_.fetch_sub(1, std::memory_order_relaxed);
        return true;
      }
    }
    return false;
  }

  // Adds a replica to the object, in a bigger block when its own is full
  // (the old block is deleted: `it` then points to the new one).
  void add_replica(shard& sh, detail::object_meta*& it, detail::replica_loc r) {
    if (it->count() < it->capacity()) {
      it->set_count(it->count() + 1);
      it->replica(it->count() - 1) = r;
      return;
    }
    const std::size_t k = it->count();
    detail::object_ptr o = detail::make_object(it->key(), k + 1);
    o->size = it->size;
    o->time_ms = it->time_ms;
    o->parent_hash = it->parent_hash;
    o->writer = it->writer;
    o->soft_pin_s = it->soft_pin_s;
    o->flags = it->flags;  // has_parent: the link moves to o
    o->set_count(k + 1);
    for (std::size_t i = 0; i < k; ++i) o->replica(i) = it->replica(i);
    o->replica(k) = r;
    const bool pending = sh.disk_pending.erase(it) != 0;
    const bool progress = sh.in_progress.erase(it) != 0;
    sh.objects.erase(it);
    it = o.get();
    sh.objects.insert(std::move(o));
    if (pending) sh.disk_pending.insert(it);
    if (progress) sh.in_progress.insert(it);
  }

  void push_task(disk_task t) {
    std::lock_guard lock{tasks_mu_};
    tasks_.push_back(std::move(t));
    tasks_waiting_.store(true, std::memory_order_release);
  }

  // The client owning a memory replica of `o` that has a disk, 0 when none
  // has; `at`: that replica's index.
  std::uint64_t demotion_target(const detail::object_meta& o, std::size_t& at) const {
    {
      std::lock_guard lock{disk_mu_};
      if (disks_.empty()) return 0;
    }
    for (std::size_t i = 0; i < o.count(); ++i) {
      if (detail::on_disk(o.replica(i))) continue;
      const std::uint64_t c = segments_.client_of(segment_id{o.replica(i).segment});
      if (c != 0 && accepting_disk(c)) {
        at = i;
        return c;
      }
    }
    return 0;
  }

  // Sends an eviction victim to a disk: false when none takes it.
  bool start_demotion(shard& sh, detail::object_meta& o, std::int64_t now_ms) {
    if (o.is(detail::object_meta::no_disk)) return false;
    std::size_t at = 0;
    const std::uint64_t client = demotion_target(o, at);
    if (client == 0) return false;
    o.set(detail::object_meta::demoting, true);
    demoting_bytes_.fetch_add(segments_.rounded(footprint_of(o)), std::memory_order_relaxed);
    o.time_ms = now_ms;
    sh.disk_pending.insert(&o);
    push_task({disk_task::kind::store, client, std::string(o.key()), o.size, o.replica(at).segment,
               o.replica(at).offset});
    return true;
  }

  // `ok` false: the object is evicted without a disk from now on.
  void end_demotion(shard& sh, detail::object_meta& o, bool ok) {
    o.set(detail::object_meta::demoting, false);
    demoting_bytes_.fetch_sub(segments_.rounded(footprint_of(o)), std::memory_order_relaxed);
    if (!ok) o.set(detail::object_meta::no_disk, true);
    sh.disk_pending.erase(&o);
  }

  // A get of an object on a disk only: a range on its holder's segments
  // and a load task. no_space when the holder has no segment;
  // object_loading, no task, when none has room now (eviction is asked
  // for: the reader's retry may find room).
  std::error_code start_load(shard& sh, detail::object_meta*& it, master_time now) {
    const std::uint64_t client = it->disk_holder();
    if (client == 0) return store_errc::object_not_found;
    const std::vector<segment_id> own = segments_.segments_of(client);
    if (own.empty()) return store_errc::no_space;
    std::array<segment_range, 1> got{};
    const std::uint64_t footprint = footprint_of(*it);
    const std::size_t k =
        segments_.allocate(footprint, placement_request{1, own, {}}, std::span{got});
    if (k == 0 || std::find(own.begin(), own.end(), got[0].segment) == own.end()) {
      if (k != 0) segments_.free(got[0].segment, got[0].offset, footprint);
      eviction_wanted_.store(true, std::memory_order_relaxed);
      return store_errc::object_loading;
    }
    add_replica(sh, it, {got[0].segment.value(), got[0].offset});
    it->set(detail::object_meta::loading, true);
    it->time_ms = ms(now);
    sh.disk_pending.insert(it);
    push_task({disk_task::kind::load, client, std::string(it->key()), it->size,
               got[0].segment.value(), got[0].offset});
    return {};
  }

  // `ok` false: the range being filled is given up (kept a while: the
  // holder may still write into it, unless it never got the task).
  void end_load(shard& sh, detail::object_meta& o, bool ok, bool touched = true) {
    o.set(detail::object_meta::loading, false);
    sh.disk_pending.erase(&o);
    if (ok) return;
    for (std::size_t i = 0; i < o.count();) {
      if (detail::on_disk(o.replica(i))) {
        ++i;
        continue;
      }
      if (touched) {
        reserve_range(o.replica(i).segment, o.replica(i).offset, footprint_of(o), o.time_ms);
      } else {
        segments_.free(segment_id{o.replica(i).segment}, o.replica(i).offset, footprint_of(o));
      }
      o.drop_replica(i);
    }
  }

  // Drops a put in progress whose writer may still be writing: its ranges
  // are kept until put_release_timeout after its start.
  void discard(shard& sh, detail::object_meta* it) {
    const detail::object_meta& o = *it;
    {
      std::lock_guard lock{discard_mu_};
      for (std::size_t i = 0; i < o.count(); ++i) {
        if (detail::on_disk(o.replica(i))) continue;
        discarded_.push_back({o.replica(i).segment, o.replica(i).offset, footprint_of(o),
                              o.time_ms + cfg_.put_release_timeout.count()});
        reserved_ += segments_.rounded(footprint_of(o));
      }
    }
    erase(sh, it);
  }

  // The bookkeeping of an object leaving the table (its space is the
  // caller's business); the index then deletes it.
  void forget(shard& sh, detail::object_meta& o) {
    if (o.is(detail::object_meta::demoting)) {
      demoting_bytes_.fetch_sub(segments_.rounded(footprint_of(o)), std::memory_order_relaxed);
    }
    if (held_by_disk_task(o)) sh.disk_pending.erase(&o);
    for (std::size_t i = 0; i < o.count(); ++i) {
      if (detail::on_disk(o.replica(i))) disk_replicas_.fetch_sub(1, std::memory_order_relaxed);
    }
    if (!o.is(detail::object_meta::complete)) {
      sh.in_progress.erase(&o);
      in_progress_.fetch_sub(1, std::memory_order_relaxed);
    }
    if (o.is(detail::object_meta::has_parent)) link_parent(o.parent_hash, -1);
    objects_.fetch_sub(1, std::memory_order_relaxed);
  }
  void erase(shard& sh, detail::object_meta* o) {
    forget(sh, *o);
    sh.objects.erase(o);
  }

  const master_config cfg_;
  segment_table segments_;
  std::unique_ptr<shard[]> shards_;
  std::atomic<std::uint64_t> objects_{0};
  std::atomic<std::uint64_t> in_progress_{0};
  std::atomic<bool> eviction_wanted_{false};
  std::atomic<std::uint64_t> disk_replicas_{0};
  std::atomic<std::uint64_t> demoting_bytes_{0};
  struct disk_info {
    std::uint64_t capacity = 0;
    bool accepting = true;
  };
  mutable std::mutex disk_mu_;                          // a leaf lock
  std::unordered_map<std::uint64_t, disk_info> disks_;  // by client; disk_mu_
  std::mutex tasks_mu_;                                 // a leaf lock
  std::vector<disk_task> tasks_;                        // guarded by tasks_mu_
  std::atomic<bool> tasks_waiting_{false};              // tasks_ not empty (set under tasks_mu_)
  mutable std::mutex discard_mu_;
  std::vector<discarded_range> discarded_;  // guarded by discard_mu_
  std::uint64_t reserved_ = 0;              // guarded by discard_mu_
};

}  // namespace kvlink::store
