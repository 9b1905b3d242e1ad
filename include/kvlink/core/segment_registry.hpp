// Local and remote segment bookkeeping.
//
// A segment is a range of memory [base, base + length) that an engine has
// registered, with the access it grants to peers. segment_registry keeps the
// local ones: the initiator uses find()/locate() to map a request's local
// pointer to its segment, and the target uses check_remote_access() to
// validate every (segment, offset, length) a peer sends before touching
// memory. remote_segment_cache keeps what peers told us about theirs.
//
//   kvlink::segment_registry reg;
//   std::error_code ec;
//   auto id = reg.add(buf, len, kvlink::access::remote_read_write, ec);
//   std::byte* p = nullptr;
//   ec = reg.check_remote_access(id, off, n, kvlink::access::remote_write, p);
//
// Neither class ever dereferences a registered address: they only do
// arithmetic on it, so tests may use made-up addresses. No I/O, no Asio.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/types.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlink {

/// A registered local segment: [base, base + length), base + length never
/// wraps past the top of the address space.
struct segment_info {
  segment_id id;
  std::uintptr_t base = 0;
  std::uint64_t length = 0;
  access granted = access::none;
  memory_desc memory{};  ///< where the bytes live (host memory unless stated)

  /// One past the last byte.
  std::uintptr_t end() const noexcept { return base + static_cast<std::uintptr_t>(length); }
  friend bool operator==(const segment_info&, const segment_info&) = default;
};

namespace detail {

// Bounds rule shared by the target (segment_registry) and the initiator
// (remote_segment_cache): [offset, offset + length) inside a segment of
// `seg_length` bytes, written so that offset + length cannot wrap. A
// zero-length range is in bounds when offset <= seg_length.
constexpr bool range_in_bounds(std::uint64_t offset, std::uint64_t length,
                               std::uint64_t seg_length) noexcept {
  return offset <= seg_length && length <= seg_length - offset;
}

// Checks in a fixed order so both sides report the same error for the same
// request: bounds first, then access.
constexpr errc check_segment_access(std::uint64_t seg_length, access granted, std::uint64_t offset,
                                    std::uint64_t length, access needed) noexcept {
  if (!range_in_bounds(offset, length, seg_length)) return errc::out_of_bounds;
  if (!allows(granted, needed)) return errc::access_denied;
  return errc{};
}

}  // namespace detail

/// The local engine's registered segments.
///
/// Thread safety: every member may be called concurrently from any thread
/// (readers share a std::shared_mutex, add/remove take it exclusively).
/// Lookups by address are O(log n).
class segment_registry {
 public:
  segment_registry() = default;
  segment_registry(const segment_registry&) = delete;
  segment_registry& operator=(const segment_registry&) = delete;

  /// Registers [base, base + length) granting `granted` to peers.
  /// Errors (the registry is unchanged and the invalid id is returned):
  ///  - invalid_argument: base is null, length is 0, or base + length does
  ///    not fit in the address space;
  ///  - overlapping_registration: the range shares a byte with a registered
  ///    segment (adjacent segments are fine).
  /// Ids start at 1, increase, and are never reused by this registry.
  segment_id add(const void* base, std::uint64_t length, access granted, std::error_code& ec,
                 memory_desc memory = {}) {
    const auto b = reinterpret_cast<std::uintptr_t>(base);
    if (b == 0 || length == 0 || length > std::numeric_limits<std::uintptr_t>::max() - b) {
      ec = errc::invalid_argument;
      return {};
    }
    const std::uintptr_t e = b + static_cast<std::uintptr_t>(length);
    std::unique_lock lock{mutex_};
    // The first segment starting at or after b must start at or after e, and
    // the one before it must end at or before b.
    auto next = by_base_.lower_bound(b);
    if (next != by_base_.end() && next->first < e) {
      ec = errc::overlapping_registration;
      return {};
    }
    if (next != by_base_.begin() && std::prev(next)->second.end() > b) {
      ec = errc::overlapping_registration;
      return {};
    }
    const segment_id id{next_id_++};
    by_base_.emplace_hint(next, b, segment_info{id, b, length, granted, memory});
    by_id_.emplace(id, b);
    generation_.fetch_add(1, std::memory_order_release);
    ec.clear();
    return id;
  }

  /// Unregisters `id`. not_registered if it is unknown (or already removed).
  std::error_code remove(segment_id id) {
    std::unique_lock lock{mutex_};
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return errc::not_registered;
    by_base_.erase(it->second);
    by_id_.erase(it);
    generation_.fetch_add(1, std::memory_order_release);
    return {};
  }

  /// The segment that wholly contains [addr, addr + length), or nullopt.
  /// length 0 asks for the segment holding the byte at addr.
  std::optional<segment_info> find(const void* addr, std::uint64_t length) const {
    segment_info out;
    if (locate(addr, length, out)) return std::nullopt;
    return out;
  }

  /// Like find() but says why not: not_registered when no segment holds the
  /// byte at addr, out_of_bounds when one does but the range runs past its
  /// end (including when addr + length would wrap). `out` is set only on
  /// success.
  std::error_code locate(const void* addr, std::uint64_t length, segment_info& out) const {
    const auto a = reinterpret_cast<std::uintptr_t>(addr);
    std::shared_lock lock{mutex_};
    auto it = by_base_.upper_bound(a);  // first segment starting after a
    if (it == by_base_.begin()) return errc::not_registered;
    const segment_info& s = std::prev(it)->second;
    if (a >= s.end()) return errc::not_registered;
    if (!detail::range_in_bounds(a - s.base, length, s.length)) return errc::out_of_bounds;
    out = s;
    return {};
  }

  /// Whether `id` is registered (get() without the copy).
  bool contains(segment_id id) const {
    std::shared_lock lock{mutex_};
    return by_id_.contains(id);
  }

  std::optional<segment_info> get(segment_id id) const {
    std::shared_lock lock{mutex_};
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return std::nullopt;
    return by_base_.at(it->second);
  }

  /// Target-side validation of what a peer asks for, checked in this order:
  /// not_registered (unknown id), out_of_bounds ([offset, offset + length)
  /// not inside the segment; overflow-safe), access_denied (the segment does
  /// not grant `needed`). On success `out` = base + offset; otherwise `out`
  /// is untouched. A zero-length range at offset <= length passes.
  std::error_code check_remote_access(segment_id id, std::uint64_t offset, std::uint64_t length,
                                      access needed, std::byte*& out) const {
    memory_desc memory;
    return check_remote_access(id, offset, length, needed, out, memory);
  }

  /// check_remote_access(), also saying on success where the segment's
  /// bytes live (a target serves device memory through staging).
  std::error_code check_remote_access(segment_id id, std::uint64_t offset, std::uint64_t length,
                                      access needed, std::byte*& out, memory_desc& memory) const {
    std::shared_lock lock{mutex_};
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return errc::not_registered;
    const segment_info& s = by_base_.at(it->second);
    if (const errc e = detail::check_segment_access(s.length, s.granted, offset, length, needed);
        e != errc{}) {
      return e;
    }
    out = reinterpret_cast<std::byte*>(s.base + static_cast<std::uintptr_t>(offset));
    memory = s.memory;
    return {};
  }

  /// Every registered segment, ordered by id.
  std::vector<segment_info> snapshot() const {
    std::shared_lock lock{mutex_};
    std::vector<segment_info> out;
    out.reserve(by_id_.size());
    for (const auto& [id, base] : by_id_) out.push_back(by_base_.at(base));
    return out;
  }

  std::size_t size() const {
    std::shared_lock lock{mutex_};
    return by_id_.size();
  }

  /// Counts successful add()s and remove()s: a cheap "did anything change"
  /// check (e.g. before re-sending the segment list to peers).
  std::uint64_t generation() const noexcept { return generation_.load(std::memory_order_acquire); }

 private:
  mutable std::shared_mutex mutex_;
  std::map<std::uintptr_t, segment_info> by_base_;  // disjoint ranges, keyed by base
  std::map<segment_id, std::uintptr_t> by_id_;      // id -> key in by_base_
  std::uint64_t next_id_ = 1;                       // guarded by mutex_
  std::atomic<std::uint64_t> generation_{0};
};

/// What a peer told us about one of its segments. `base` is an address in
/// the peer's process (one-sided transports address memory by it); `keys`
/// holds what each of the peer's transports published for the segment
/// (transport name -> its key, e.g. "rdma" -> one rkey per NIC), opaque here.
struct remote_segment_info {
  segment_id id;
  std::uint64_t base = 0;
  std::uint64_t length = 0;
  access granted = access::none;
  nlohmann::json keys = nlohmann::json::object();
  friend bool operator==(const remote_segment_info&, const remote_segment_info&) = default;
};

/// Segments of remote peers, keyed by (peer instance, segment id). Keyed by
/// instance rather than peer_id so that a restarted peer (new instance id)
/// never matches stale entries.
///
/// Thread safety: every member may be called concurrently from any thread.
class remote_segment_cache {
 public:
  remote_segment_cache() = default;
  remote_segment_cache(const remote_segment_cache&) = delete;
  remote_segment_cache& operator=(const remote_segment_cache&) = delete;

  /// Inserts or replaces the entry for (inst, info.id).
  void put(const instance_id& inst, remote_segment_info info) {
    std::unique_lock lock{mutex_};
    auto& segs = by_instance_[inst];
    const segment_id id = info.id;
    segs.insert_or_assign(id, std::move(info));
    generation_.fetch_add(1, std::memory_order_release);
  }

  /// Replaces every entry of `inst` with `segs` (a peer's new segment list).
  void replace(const instance_id& inst, std::vector<remote_segment_info> segs) {
    std::unique_lock lock{mutex_};
    auto& map = by_instance_[inst];
    map.clear();
    for (auto& s : segs) {
      const segment_id id = s.id;
      map.insert_or_assign(id, std::move(s));
    }
    if (map.empty()) by_instance_.erase(inst);
    generation_.fetch_add(1, std::memory_order_release);
  }

  /// Counts changes: a transport that keeps its own parsed form of the keys
  /// rebuilds it when this moves.
  std::uint64_t generation() const noexcept { return generation_.load(std::memory_order_acquire); }

  /// Forgets one segment; false if it was not cached.
  bool erase(const instance_id& inst, segment_id id) {
    std::unique_lock lock{mutex_};
    auto it = by_instance_.find(inst);
    if (it == by_instance_.end()) return false;
    const bool erased = it->second.erase(id) != 0;
    if (it->second.empty()) by_instance_.erase(it);
    generation_.fetch_add(1, std::memory_order_release);
    return erased;
  }

  /// Forgets every segment of `inst` (the peer restarted or went away).
  void drop_instance(const instance_id& inst) {
    std::unique_lock lock{mutex_};
    by_instance_.erase(inst);
    generation_.fetch_add(1, std::memory_order_release);
  }

  std::optional<remote_segment_info> get(const instance_id& inst, segment_id id) const {
    std::shared_lock lock{mutex_};
    const remote_segment_info* s = find_locked(inst, id);
    if (s == nullptr) return std::nullopt;
    return *s;
  }

  /// The length and access of a cached segment, without copying its keys
  /// (the initiator's per-request check); false when it is not cached.
  bool limits(const instance_id& inst, segment_id id, std::uint64_t& length,
              access& granted) const {
    std::shared_lock lock{mutex_};
    const remote_segment_info* s = find_locked(inst, id);
    if (s == nullptr) return false;
    length = s->length;
    granted = s->granted;
    return true;
  }

  /// Initiator-side pre-check, same rules and order as
  /// segment_registry::check_remote_access: not_registered (unknown instance
  /// or id), out_of_bounds (overflow-safe), access_denied.
  std::error_code check(const instance_id& inst, segment_id id, std::uint64_t offset,
                        std::uint64_t length, access needed) const {
    std::shared_lock lock{mutex_};
    const remote_segment_info* s = find_locked(inst, id);
    if (s == nullptr) return errc::not_registered;
    if (const errc e = detail::check_segment_access(s->length, s->granted, offset, length, needed);
        e != errc{}) {
      return e;
    }
    return {};
  }

  /// The cached segments of `inst`, ordered by id.
  std::vector<remote_segment_info> segments(const instance_id& inst) const {
    std::shared_lock lock{mutex_};
    std::vector<remote_segment_info> out;
    auto it = by_instance_.find(inst);
    if (it == by_instance_.end()) return out;
    out.reserve(it->second.size());
    for (const auto& [id, info] : it->second) out.push_back(info);
    return out;
  }

  /// Number of cached segments over all instances.
  std::size_t size() const {
    std::shared_lock lock{mutex_};
    std::size_t n = 0;
    for (const auto& [inst, segs] : by_instance_) n += segs.size();
    return n;
  }

 private:
  const remote_segment_info* find_locked(const instance_id& inst, segment_id id) const {
    auto it = by_instance_.find(inst);
    if (it == by_instance_.end()) return nullptr;
    auto jt = it->second.find(id);
    return jt == it->second.end() ? nullptr : &jt->second;
  }

  mutable std::shared_mutex mutex_;
  std::map<instance_id, std::map<segment_id, remote_segment_info>> by_instance_;
  std::atomic<std::uint64_t> generation_{0};
};

}  // namespace kvlink
