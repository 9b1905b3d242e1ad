// The slice planner: a pure function from a batch of resolved requests, the
// lanes to one peer (with weights) and a policy to the slices the transports
// post. No I/O, no Asio, no allocation except the output vector's growth.
//
//   std::vector<kvlink::slice> slices;           // reused across calls
//   kvlink::plan_stats st;
//   const double weights[] = {1.0, 1.0, 0.5};    // e.g. per NIC x QP, or per TCP connection
//   if (auto ec = kvlink::plan_slices(requests, weights, {}, slices, &st)) { ... }
//
// Three steps, in one pass over the requests:
//  1. Coalescing. ADJACENT requests (in input order) with the same opcode,
//     local segment and remote segment, contiguous on both sides, form one
//     run. The planner does not sort: the engine and the KV layer emit requests
//     in address order already, and sorting 10^5 entries would cost more than
//     the whole plan. Out-of-order input is still planned correctly, just with
//     less coalescing.
//  2. Cutting. Each run is cut into slices of about policy.slice_size; cuts
//     inside a run fall on remote offsets that are multiples of
//     policy.alignment; no slice crosses a run boundary (hence no segment
//     boundary). See detail::cut_run for the exact rule and its bounds.
//  3. Striping. Each slice goes to the lane that is furthest behind its weight
//     share once the slice is counted (largest w_l/W * (B + len) - bytes_l, ties
//     to the lowest index), so one large request uses every lane and each
//     lane's bytes track its weight share.
//
// Thread safety: plan_slices touches only its arguments; concurrent calls with
// distinct `out` vectors are safe.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

// Where an attribute on a lambda goes differs between g++ and clang.
#if defined(__clang__)
#define KVLINK_LAMBDA_ALWAYS_INLINE __attribute__((always_inline))
#else
#define KVLINK_LAMBDA_ALWAYS_INLINE [[gnu::always_inline]]
#endif

namespace kvlink {

/// One request, as the engine resolved it (local memory to its segment, the
/// remote segment to its id on the peer).
struct plan_request {
  opcode op = opcode::write;
  std::uintptr_t local_addr = 0;
  segment_id local_segment;   ///< local segment holding [local_addr, local_addr + length)
  segment_id remote_segment;  ///< target segment on the peer
  std::uint64_t remote_offset = 0;
  std::uint64_t length = 0;
};

/// How runs are cut. Checked by plan_slices (errc::invalid_argument).
struct plan_policy {
  /// Target slice size in bytes; > 0.
  std::uint64_t slice_size = 1 << 20;
  /// Bytes, <= slice_size. A cut that would leave a tail shorter than this
  /// keeps the tail in the previous slice; likewise a short unaligned head is
  /// extended to the next aligned cut where the bounds allow (detail::cut_run).
  std::uint64_t min_chunk = 64 << 10;
  /// Power of two dividing slice_size: interior cut points fall on remote
  /// offsets that are multiples of it.
  std::uint64_t alignment = 1;
};

/// One piece of work for one lane. Slices of a run are emitted in offset
/// order; runs in input order.
struct slice {
  std::uint32_t request = 0;  ///< index (into the input) of the first request of its run
  std::uint32_t lane = 0;     ///< index into the lane weights
  opcode op = opcode::write;
  std::uintptr_t local_addr = 0;
  segment_id local_segment;
  segment_id remote_segment;
  std::uint64_t remote_offset = 0;
  std::uint64_t length = 0;
};

/// What a plan did: runs after coalescing, slices cut, distinct lanes given at
/// least one slice, payload bytes.
struct plan_stats {
  std::uint32_t runs = 0;
  std::uint32_t slices = 0;
  std::uint32_t lanes_used = 0;
  std::uint64_t bytes = 0;
};

/// The most lanes one plan spreads over: the per-lane state lives on the
/// stack so planning never allocates. 256 covers 8 NICs x 32 QPs.
inline constexpr std::size_t max_plan_lanes = 256;

namespace detail {

/// Why the input cannot be planned, or nullptr when it can. One place for the
/// rules so plan_slices and explain_plan_error never disagree. Also sums the
/// request lengths into `total_bytes` (valid only when nullptr is returned).
inline const char* check_plan_input(std::span<const plan_request> requests,
                                    std::span<const double> lane_weights, const plan_policy& policy,
                                    std::uint64_t& total_bytes) noexcept {
  constexpr std::uint64_t u32_max = std::numeric_limits<std::uint32_t>::max();
  if (lane_weights.empty()) return "no lanes: at least one lane weight is needed";
  if (lane_weights.size() > max_plan_lanes) return "more lanes than max_plan_lanes (256)";
  double weight_sum = 0.0;
  for (const double w : lane_weights) {
    if (!std::isfinite(w) || !(w > 0.0)) return "a lane weight is not finite and > 0";
    weight_sum += w;
  }
  if (!std::isfinite(weight_sum)) return "the lane weights' sum is not finite";
  if (policy.slice_size == 0) return "policy.slice_size is 0";
  if (policy.min_chunk > policy.slice_size) return "policy.min_chunk exceeds policy.slice_size";
  if (policy.alignment == 0 || !std::has_single_bit(policy.alignment)) {
    return "policy.alignment is not a power of two";
  }
  if (policy.slice_size % policy.alignment != 0) {
    return "policy.alignment does not divide policy.slice_size";
  }
  if (requests.size() > u32_max) return "more than 2^32-1 requests";

  // The fast check: no branch per request (overflow flags OR-ed together), so
  // it costs about a nanosecond per request; the reason is looked up only
  // when something is wrong.
  std::uint64_t total = 0;
  bool bad = false;
  for (const plan_request& r : requests) {
    std::uintptr_t local_end = 0;
    std::uint64_t remote_end = 0;
    bad |= r.length == 0;
    bad |= __builtin_add_overflow(r.local_addr, r.length, &local_end);
    bad |= __builtin_add_overflow(r.remote_offset, r.length, &remote_end);
    bad |= __builtin_add_overflow(total, r.length, &total);
  }
  if (bad) {
    constexpr std::uint64_t u64_max = std::numeric_limits<std::uint64_t>::max();
    constexpr std::uintptr_t uptr_max = std::numeric_limits<std::uintptr_t>::max();
    std::uint64_t sum = 0;
    for (const plan_request& r : requests) {
      if (r.length == 0) return "a request has length 0";
      if (r.local_addr > uptr_max - r.length) return "a request's local_addr + length overflows";
      if (r.remote_offset > u64_max - r.length) {
        return "a request's remote_offset + length overflows";
      }
      if (sum > u64_max - r.length) return "the requests' total length overflows 64 bits";
      sum += r.length;
    }
  }
  // Each run yields at most 2 + length / slice_size slices (one short head,
  // full slices, one tail), so this keeps slice indices and stats in 32 bits.
  if (total / policy.slice_size + 2 * static_cast<std::uint64_t>(requests.size()) > u32_max) {
    return "the plan could need more than 2^32-1 slices: raise policy.slice_size";
  }
  total_bytes = total;
  return nullptr;
}

/// Striping, shared by both stripers below. Each slice goes to the lane with
/// the largest deficit share_l * (total + length) - assigned_l, where share_l
/// = w_l / sum(w), total is the bytes striped so far and assigned_l lane l's
/// part of it; ties go to the lowest index.
///
/// Bounds: the deficits sum to `length`, so the chosen lane's is >= length /
/// lanes > 0, and after taking the slice the lane is ahead of its share by
/// less than one slice: no lane ever gets more than one (largest) slice over
/// its share. That no lane falls more than one slice behind its share is
/// checked by the property tests, not proven. With equal weights the rule is
/// "fewest bytes first", so the first `lanes` slices use every lane. With very
/// unequal weights a lane whose share of the bytes is below one slice may get
/// none: that is the proportional answer.
///
/// Byte counts are doubles: exact below 2^53 bytes (9 PB).

/// Up to N lanes (N a small power of two): the deficits, the arg-max (a tree)
/// and the update are fully unrolled and branch-free, which keeps the chain
/// from one slice's choice to the next short: that chain is most of the
/// per-slice cost of a fragmented plan. Lanes past the real ones have share 0
/// and +inf bytes: never chosen.
template <std::size_t N>
class fixed_striper {
  static_assert(N >= 1 && (N & (N - 1)) == 0);

 public:
  explicit fixed_striper(std::span<const double> weights) noexcept
      : lanes_{static_cast<std::uint32_t>(weights.size())} {
    double sum = 0.0;
    for (const double w : weights) sum += w;
    for (std::size_t l = 0; l < N; ++l) {
      share_[l] = l < weights.size() ? weights[l] / sum : 0.0;
      assigned_[l] = l < weights.size() ? 0.0 : std::numeric_limits<double>::infinity();
    }
  }

  [[gnu::always_inline]] std::uint32_t pick(std::uint64_t length) noexcept {
    return pick_impl(static_cast<double>(length), std::make_index_sequence<N>{});
  }

  std::uint32_t lanes_used() const noexcept {
    std::uint32_t n = 0;
    for (std::uint32_t l = 0; l < lanes_; ++l) n += assigned_[l] > 0.0 ? 1u : 0u;
    return n;
  }

 private:
  // Written as folds and recursion rather than loops so that they are fully
  // unrolled (GCC 12 did not unroll the loops), with arithmetic selects
  // instead of unpredictable branches.
  template <std::size_t... L>
  [[gnu::always_inline]] std::uint32_t pick_impl(double len, std::index_sequence<L...>) noexcept {
    const double after = total_ + len;
    const std::array<double, N> d{(share_[L] * after - assigned_[L])...};
    double best_deficit = 0.0;
    std::uint32_t best = 0;
    arg_max<0, N>(d, best_deficit, best);
    // + len on the chosen lane, + 0.0 elsewhere, without a branch.
    const std::uint64_t len_bits = std::bit_cast<std::uint64_t>(len);
    ((assigned_[L] += std::bit_cast<double>(len_bits & (0 - std::uint64_t{L == best}))), ...);
    total_ = after;
    return best;
  }

  // Arg-max of d[Lo, Lo + Len) as a tree. The left half holds the lower
  // indices, so taking the right only when strictly greater keeps "ties to
  // the lowest index".
  template <std::size_t Lo, std::size_t Len>
  [[gnu::always_inline]] static void arg_max(const std::array<double, N>& d, double& value,
                                             std::uint32_t& index) noexcept {
    if constexpr (Len == 1) {
      value = d[Lo];
      index = static_cast<std::uint32_t>(Lo);
    } else {
      double lv = 0.0, rv = 0.0;
      std::uint32_t li = 0, ri = 0;
      arg_max<Lo, Len / 2>(d, lv, li);
      arg_max<Lo + Len / 2, Len / 2>(d, rv, ri);
      // Arithmetic selects: with branches, the unpredictable lane choice cost
      // a mispredict per slice.
      const std::uint32_t right_mask = 0u - static_cast<std::uint32_t>(rv > lv);
      value = std::max(lv, rv);
      index = li ^ ((li ^ ri) & right_mask);
    }
  }

  std::uint32_t lanes_;
  double total_ = 0.0;
  std::array<double, N> share_;
  std::array<double, N> assigned_;
};

/// Any number of lanes up to max_plan_lanes: a plain loop, O(lanes) per slice.
class lane_striper {
 public:
  explicit lane_striper(std::span<const double> weights) noexcept
      : lanes_{static_cast<std::uint32_t>(weights.size())} {
    double sum = 0.0;
    for (const double w : weights) sum += w;
    for (std::uint32_t l = 0; l < lanes_; ++l) {
      share_[l] = weights[l] / sum;
      assigned_[l] = 0.0;
    }
  }

  std::uint32_t pick(std::uint64_t length) noexcept {
    const double len = static_cast<double>(length);
    const double after = total_ + len;
    std::uint32_t best = 0;
    double best_deficit = share_[0] * after - assigned_[0];
    for (std::uint32_t l = 1; l < lanes_; ++l) {
      const double d = share_[l] * after - assigned_[l];
      if (d > best_deficit) {
        best_deficit = d;
        best = l;
      }
    }
    assigned_[best] += len;
    total_ = after;
    return best;
  }

  std::uint32_t lanes_used() const noexcept {
    std::uint32_t n = 0;
    for (std::uint32_t l = 0; l < lanes_; ++l) n += assigned_[l] > 0.0 ? 1u : 0u;
    return n;
  }

 private:
  std::uint32_t lanes_;
  double total_ = 0.0;
  std::array<double, max_plan_lanes> share_;     // only [0, lanes_) is set
  std::array<double, max_plan_lanes> assigned_;  // only [0, lanes_) is set
};

/// One coalesced run: [remote_offset, remote_offset + length) on the remote
/// side, mapped 1:1 onto [local_addr, local_addr + length).
struct plan_run {
  std::uint32_t request;
  opcode op;
  std::uintptr_t local_addr;
  segment_id local_segment;
  segment_id remote_segment;
  std::uint64_t remote_offset;
  std::uint64_t length;
};

/// Appends the slice [offset, offset + len) of `run` (offset relative to the
/// run). Constructed in place (C++20 parenthesized aggregate init): copying a
/// temporary made the copy's wide loads wait on the narrow stores that built
/// it (failed store forwarding), which cost half the time of a fragmented
/// plan; value-initializing and then assigning doubled the stores.
template <typename Striper>
[[gnu::always_inline]] inline void emit_slice(const plan_run& run, std::uint64_t offset,
                                              std::uint64_t len, Striper& striper,
                                              std::vector<slice>& out) {
  const std::uint32_t lane = striper.pick(len);
#if defined(__cpp_aggregate_paren_init)
  out.emplace_back(run.request, lane, run.op, run.local_addr + offset, run.local_segment,
                   run.remote_segment, run.remote_offset + offset, len);
#else  // clang 14: no parenthesized aggregate initialization
  out.push_back(slice{run.request, lane, run.op, run.local_addr + offset, run.local_segment,
                      run.remote_segment, run.remote_offset + offset, len});
#endif
}

/// Cuts one run longer than slice_size into slices and stripes them. With
/// S = slice_size, M = min_chunk, A = alignment, while more than S bytes
/// remain from `pos`:
///  - cut at align_down(pos + S, A): a step in [S - A + 1, S], never 0 since
///    A <= S; it is exactly S once pos is aligned, i.e. after the first cut;
///  - if that step is shorter than M (only when pos is unaligned and A is
///    large), the head is extended to the next aligned point instead, unless
///    that would leave a tail shorter than M: then the whole rest is one slice
///    if it fits in S + M bytes, otherwise the short aligned head stays;
///  - if the cut would leave a tail shorter than M, the tail joins this slice.
/// The rest (<= S bytes) is the last slice. So every slice is in
/// (0, S + M] bytes (<= S when M = 0), every slice but the first and the last
/// of a run is exactly S, the last of a multi-slice run is >= M, and every
/// cut inside a run is at a multiple of A. A run of at most S bytes is one
/// slice (plan_impl emits it without calling this).
template <typename Striper>
inline void cut_run(const plan_run& run, const plan_policy& policy, Striper& striper,
                    std::vector<slice>& out) {
  const std::uint64_t s = policy.slice_size;
  const std::uint64_t m = policy.min_chunk;
  const std::uint64_t a = policy.alignment;
  const std::uint64_t a_mask = a - 1;
  std::uint64_t done = 0;  // bytes of the run already emitted
  std::uint64_t rem = run.length;
  while (rem > s) {
    const std::uint64_t pos = run.remote_offset + done;  // pos + s < end: no overflow
    std::uint64_t step = s - ((pos + s) & a_mask);
    if (step < m) {
      // Unaligned short head. The next aligned point is step + a away; if that
      // is at or past the end, the "bumped" slice is the whole rest.
      const std::uint64_t bumped = rem - step <= a ? rem : step + a;
      if (rem - bumped >= m) {
        step = bumped;
      } else if (rem - s <= m) {
        break;  // the whole rest fits in S + M bytes: one slice
      }
      // else: keep the short aligned head; the tail after it is > M.
    }
    if (rem - step < m) break;  // tail merge: rem = step + tail <= S + M
    emit_slice(run, done, step, striper, out);
    done += step;
    rem -= step;
  }
  emit_slice(run, done, rem, striper, out);
}

/// The planning pass over checked input; returns the number of runs.
template <typename Striper>
inline std::uint32_t plan_impl(std::span<const plan_request> requests, const plan_policy& policy,
                               Striper& striper, std::vector<slice>& out) {
  if (requests.empty()) return 0;
  const std::uint64_t s = policy.slice_size;
  std::uint32_t runs = 0;
  auto finish = [&](const plan_run& run) KVLINK_LAMBDA_ALWAYS_INLINE {
    ++runs;
    if (run.length <= s) {
      emit_slice(run, 0, run.length, striper, out);  // the common case for fragmented input
    } else {
      cut_run(run, policy, striper, out);
    }
  };
  const plan_request& first = requests[0];
  plan_run run{0,
               first.op,
               first.local_addr,
               first.local_segment,
               first.remote_segment,
               first.remote_offset,
               first.length};
  const std::size_t n = requests.size();
  for (std::size_t i = 1; i < n; ++i) {
    const plan_request& r = requests[i];
    // Contiguous on both sides, same opcode and segments: extend the run.
    // Ends cannot overflow: check_plan_input bounded every request's end.
    if (r.local_addr == run.local_addr + run.length &&
        r.remote_offset == run.remote_offset + run.length && r.op == run.op &&
        r.local_segment == run.local_segment && r.remote_segment == run.remote_segment) {
      run.length += r.length;
      continue;
    }
    finish(run);
    run = plan_run{static_cast<std::uint32_t>(i),
                   r.op,
                   r.local_addr,
                   r.local_segment,
                   r.remote_segment,
                   r.remote_offset,
                   r.length};
  }
  finish(run);
  return runs;
}

template <typename Striper>
inline std::error_code plan_with(std::span<const plan_request> requests,
                                 std::span<const double> lane_weights, const plan_policy& policy,
                                 std::uint64_t total, std::vector<slice>& out, plan_stats* stats) {
  Striper striper{lane_weights};
  const std::uint32_t runs = plan_impl(requests, policy, striper, out);
  if (stats != nullptr) {
    stats->runs = runs;
    stats->slices = static_cast<std::uint32_t>(out.size());
    stats->lanes_used = striper.lanes_used();
    stats->bytes = total;
  }
  return {};
}

}  // namespace detail

/// Plans `requests` over lanes with `lane_weights` (one weight per lane,
/// relative bandwidth). On success `out` is cleared and filled with the slices
/// (runs in input order, each run's slices in offset order) and `*stats`, if
/// given, is set. Deterministic: the same input always gives the same output.
///
/// Returns errc::invalid_argument and leaves `out` and `*stats` untouched for
/// input that cannot be planned: no lanes or more than max_plan_lanes, a
/// weight that is not finite and > 0 (or weights whose sum overflows), a
/// zero-length request, local_addr + length or remote_offset + length
/// overflowing, total length overflowing 64 bits, a bad policy (slice_size 0,
/// min_chunk > slice_size, alignment 0 / not a power of two / not dividing
/// slice_size), more than 2^32-1 requests, or a plan that could need more than
/// 2^32-1 slices. explain_plan_error says which.
///
/// Cost: about one pass to check and one to plan; O(lanes) per slice. `out`
/// is reserved to requests + bytes / slice_size + 1 entries, so a vector reused
/// across calls rarely reallocates.
inline std::error_code plan_slices(std::span<const plan_request> requests,
                                   std::span<const double> lane_weights, const plan_policy& policy,
                                   std::vector<slice>& out, plan_stats* stats = nullptr) {
  std::uint64_t total = 0;
  if (detail::check_plan_input(requests, lane_weights, policy, total) != nullptr) {
    return make_error_code(errc::invalid_argument);
  }
  out.clear();
  out.reserve(requests.size() + total / policy.slice_size + 1);
  // Same rule, same results; the fixed-size stripers keep lane state in
  // registers for the common lane counts.
  const std::size_t lanes = lane_weights.size();
  if (lanes == 1) {
    return detail::plan_with<detail::fixed_striper<1>>(requests, lane_weights, policy, total, out,
                                                       stats);
  }
  if (lanes == 2) {
    return detail::plan_with<detail::fixed_striper<2>>(requests, lane_weights, policy, total, out,
                                                       stats);
  }
  if (lanes <= 4) {
    return detail::plan_with<detail::fixed_striper<4>>(requests, lane_weights, policy, total, out,
                                                       stats);
  }
  if (lanes <= 8) {
    return detail::plan_with<detail::fixed_striper<8>>(requests, lane_weights, policy, total, out,
                                                       stats);
  }
  return detail::plan_with<detail::lane_striper>(requests, lane_weights, policy, total, out, stats);
}

/// Why plan_slices would reject this input, or an empty view when it would
/// plan it. For messages and logs on the (rare) error path.
inline std::string_view explain_plan_error(std::span<const plan_request> requests,
                                           std::span<const double> lane_weights,
                                           const plan_policy& policy) noexcept {
  std::uint64_t total = 0;
  const char* why = detail::check_plan_input(requests, lane_weights, policy, total);
  return why != nullptr ? std::string_view{why} : std::string_view{};
}

/// A range of memory one request of a transfer writes: a WRITE's range in a
/// peer's segment (`space` names the peer, `segment` the segment) or a READ's
/// local range (space 0, segment 0, `offset` the address).
struct destination_range {
  std::uintptr_t space = 0;
  std::uint64_t segment = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

namespace detail {

/// Sorts `keys` by their low `bits` bits (LSD radix, 11-bit digits), using
/// `tmp` (as long) for the passes; the result is in `keys`.
inline void radix_sort(std::span<std::uint64_t> keys, std::span<std::uint64_t> tmp, unsigned bits) {
  constexpr unsigned digit = 11;
  constexpr std::uint64_t mask = (std::uint64_t{1} << digit) - 1;
  const unsigned passes = (bits + digit - 1) / digit;
  std::vector<std::uint32_t> count(std::size_t{passes} << digit, 0);
  for (const auto k : keys) {
    for (unsigned p = 0; p < passes; ++p)
      ++count[(std::size_t{p} << digit) + ((k >> (p * digit)) & mask)];
  }
  std::span<std::uint64_t> from = keys, to = tmp;
  for (unsigned p = 0; p < passes; ++p) {
    std::uint32_t* c = count.data() + (std::size_t{p} << digit);
    std::uint32_t at = 0;
    for (std::uint64_t d = 0; d <= mask; ++d) at += std::exchange(c[d], at);
    for (const auto k : from) to[c[(k >> (p * digit)) & mask]++] = k;
    std::swap(from, to);
  }
  if (from.data() != keys.data()) std::copy(from.begin(), from.end(), keys.begin());
}

}  // namespace detail

/// The rule for one transfer's requests: no two of them write the same byte.
/// Its slices run concurrently, on several lanes and peers, so bytes two
/// requests both wrote would hold whichever landed last; the engine refuses
/// such a batch (errc::overlapping_destinations) before anything moves.
/// Sources may overlap (the same local bytes written to two places, the same
/// remote bytes read twice), and ranges may touch. Whether two of `ranges`
/// share a byte:
///   - ranges in order already (as the KV layer emits them): O(n);
///   - else, at least 1024 ranges all in one space and segment (one peer's
///     segment, or local memory) whose offset from the lowest and length
///     fit 63 bits together: the keys radix-sorted in `scratch`,
///     O(n). 1.5 * 10^5 shuffled requests in one segment: 2.4 ms, against
///     14.6 ms for std::sort of the same ranges in two segments
///     (planner_bench bm_overlap, this project's loaded 2-core machine);
///   - else `ranges` are sorted: O(n log n).
/// Lengths are at least 1 and ranges do not wrap (the engine validated them).
inline bool destinations_overlap(std::span<destination_range> ranges,
                                 std::vector<std::uint64_t>& scratch) {
  if (ranges.size() < 2) return false;
  const auto before = [](const destination_range& a, const destination_range& b) {
    if (a.space != b.space) return a.space < b.space;
    if (a.segment != b.segment) return a.segment < b.segment;
    return a.offset < b.offset;
  };
  if (!std::is_sorted(ranges.begin(), ranges.end(), before)) {
    const auto& f = ranges.front();
    bool one_segment = ranges.size() >= 1024;
    std::uint64_t low = f.offset, high = f.offset, longest = 0, any = 0;
    for (std::size_t i = 0; i < ranges.size() && one_segment; ++i) {
      const auto& r = ranges[i];
      one_segment = r.space == f.space && r.segment == f.segment;
      low = std::min(low, r.offset);
      high = std::max(high, r.offset);
      longest = std::max(longest, r.length);
      any |= r.offset ^ f.offset;  // the bits in which offsets differ
    }
    // Offsets all aligned alike (4 KiB pieces) leave their low bits out.
    const auto shift = any == 0 ? 0u : static_cast<unsigned>(std::countr_zero(any));
    const auto length_bits = static_cast<unsigned>(std::bit_width(longest));
    const auto bits = static_cast<unsigned>(std::bit_width((high - low) >> shift)) + length_bits;
    if (!one_segment || bits > 63) {
      std::sort(ranges.begin(), ranges.end(), before);
    } else {
      // Key: the offset from the lowest (its common low bits out), then
      // the length.
      const std::size_t n = ranges.size();
      scratch.resize(2 * n);
      const std::span<std::uint64_t> keys{scratch.data(), n};
      for (std::size_t i = 0; i < n; ++i) {
        keys[i] = ((ranges[i].offset - low) >> shift) << length_bits | ranges[i].length;
      }
      detail::radix_sort(keys, {scratch.data() + n, n}, bits);
      const std::uint64_t length_mask = (std::uint64_t{1} << length_bits) - 1;
      for (std::size_t i = 1; i < n; ++i) {  // as below
        const std::uint64_t gap = ((keys[i] >> length_bits) - (keys[i - 1] >> length_bits))
                                  << shift;
        if (gap < (keys[i - 1] & length_mask)) return true;
      }
      return false;
    }
  }
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    const auto& a = ranges[i - 1];
    const auto& b = ranges[i];
    // Sorted by start: a range overlaps an earlier one iff it overlaps its
    // predecessor, given no earlier pair overlaps (checked in order).
    if (a.space == b.space && a.segment == b.segment && b.offset - a.offset < a.length) {
      return true;
    }
  }
  return false;
}

/// The same, with scratch memory of its own.
inline bool destinations_overlap(std::span<destination_range> ranges) {
  std::vector<std::uint64_t> scratch;
  return destinations_overlap(ranges, scratch);
}

}  // namespace kvlink
