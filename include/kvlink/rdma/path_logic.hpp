// The decisions of the RDMA data path, kept apart from verbs so that they are
// unit-tested without devices:
// - rail_health: one rail's state (idle -> connecting -> active; any ->
//   paused on failure, with an exponential backoff before it may connect
//   again), guarded by a generation so that a late reply to an abandoned
//   connection attempt is ignored.
// - classify(): what a failed work completion says about the rail.
// - slice_fate(): whether a slice that failed on a rail is retried elsewhere.
// - pick_qp(): which queue pair takes the next slice.
// - keep_waiting(): whether queued slices may wait for a rail to come back.
// - chain_limits: when a chain of work requests (one ibv_post_send, its last
//   work request signaled) ends.
// - retired_by(): how many work requests of a queue pair a completion ends.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <system_error>

#include <infiniband/verbs.h>

namespace kvlink::rdma {

enum class rail_state : std::uint8_t {
  idle,        ///< no queue pairs; connects when work arrives
  connecting,  ///< queue pairs created, waiting for the peer's answer
  active,      ///< carries slices
  paused,      ///< failed; may connect again once its backoff has passed
};

constexpr std::string_view to_string(rail_state s) noexcept {
  switch (s) {
    case rail_state::idle:
      return "idle";
    case rail_state::connecting:
      return "connecting";
    case rail_state::active:
      return "active";
    case rail_state::paused:
      return "paused";
  }
  return "?";
}

class rail_health {
 public:
  using duration = std::chrono::milliseconds;

  explicit rail_health(duration base_backoff = duration{100},
                       duration max_backoff = duration{5000}) noexcept
      : base_(base_backoff), max_(max_backoff) {}

  rail_state state() const noexcept { return state_; }
  bool usable() const noexcept { return state_ == rail_state::active; }
  /// Bumped by every connection attempt.
  std::uint32_t generation() const noexcept { return gen_; }
  /// Failures since the rail was last active.
  unsigned failures() const noexcept { return failures_; }
  std::error_code last_error() const noexcept { return last_error_; }

  /// idle -> connecting. Returns the attempt's generation; nullopt in any
  /// other state (a paused rail first waits out its backoff: resume()).
  std::optional<std::uint32_t> begin_connect() noexcept {
    if (state_ != rail_state::idle) return std::nullopt;
    state_ = rail_state::connecting;
    return ++gen_;
  }

  /// connecting -> active when `gen` is the current attempt; false (and no
  /// change) for a stale or unexpected answer.
  bool connected(std::uint32_t gen) noexcept {
    if (state_ != rail_state::connecting || gen != gen_) return false;
    state_ = rail_state::active;
    failures_ = 0;
    return true;
  }

  /// The rail failed (a connection attempt of generation `gen`, or the
  /// active rail). Returns the backoff before it may connect again, or
  /// nullopt if `gen` is stale or the rail is already paused or idle.
  /// `counts` = false for a failure that says nothing about the rail (one
  /// bad request broke its queue pair): it may reconnect at once.
  std::optional<duration> failed(std::uint32_t gen, std::error_code ec,
                                 bool counts = true) noexcept {
    if (gen != gen_ || (state_ != rail_state::connecting && state_ != rail_state::active)) {
      return std::nullopt;
    }
    state_ = rail_state::paused;
    last_error_ = ec;
    if (!counts) return duration{0};
    ++failures_;
    return backoff();
  }

  /// paused -> idle once the backoff has passed.
  bool resume() noexcept {
    if (state_ != rail_state::paused) return false;
    state_ = rail_state::idle;
    return true;
  }

  /// The backoff after the current number of failures: base * 2^(n-1),
  /// at most max.
  duration backoff() const noexcept {
    if (failures_ == 0) return duration{0};
    const unsigned shift = std::min(failures_ - 1, 20u);
    const auto d = base_ * (std::int64_t{1} << shift);
    return std::min<duration>(d, max_);
  }

 private:
  rail_state state_ = rail_state::idle;
  std::uint32_t gen_ = 0;
  unsigned failures_ = 0;
  std::error_code last_error_;
  duration base_;
  duration max_;
};

/// What a failed work completion means.
enum class failure_kind : std::uint8_t {
  rail,     ///< the path is broken (retries exhausted, transport error): try another rail
  request,  ///< this request is wrong (remote access, protection): retrying cannot help
  flushed,  ///< the queue pair was already in error; the request itself did nothing wrong
};

constexpr failure_kind classify(ibv_wc_status s) noexcept {
  switch (s) {
    case IBV_WC_WR_FLUSH_ERR:
      return failure_kind::flushed;
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
    case IBV_WC_MW_BIND_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_OP_ERR:
      return failure_kind::request;
    default:
      return failure_kind::rail;
  }
}

/// A slice whose work request failed or was flushed: retried on another rail
/// unless the request itself was wrong, its transfer is stopping, or it has
/// been posted `max_tries` times already.
enum class slice_fate : std::uint8_t { retry, fail };

constexpr slice_fate fate_of(failure_kind k, unsigned tries, unsigned max_tries,
                             bool transfer_stopping) noexcept {
  if (k == failure_kind::request || transfer_stopping || tries >= max_tries) {
    return slice_fate::fail;
  }
  return slice_fate::retry;
}

/// One queue pair as pick_qp() sees it.
struct qp_load {
  bool usable = false;            ///< its rail is active
  std::uint32_t outstanding = 0;  ///< work requests posted, not completed
  std::uint32_t max_outstanding = 0;
  std::uint64_t bytes = 0;  ///< bytes of those work requests
  bool cq_full = false;     ///< its completion queue has no room
};

/// The usable queue pair with room that has the fewest bytes outstanding
/// (the first such on ties), so consecutive slices spread over every rail
/// and queue pair; nullopt when none has room.
inline std::optional<std::size_t> pick_qp(std::span<const qp_load> qps) noexcept {
  std::optional<std::size_t> best;
  for (std::size_t i = 0; i < qps.size(); ++i) {
    const auto& q = qps[i];
    if (!q.usable || q.cq_full || q.outstanding >= q.max_outstanding) continue;
    if (!best || q.bytes < qps[*best].bytes) best = i;
  }
  return best;
}

/// Whether slices queued on a path may wait: some rail is active or
/// connecting, or a paused rail has failed only once (it gets one more
/// attempt after its backoff). Otherwise they fail with the last error.
inline bool keep_waiting(std::span<const rail_health* const> rails) noexcept {
  return std::any_of(rails.begin(), rails.end(), [](const rail_health* r) {
    return r->state() == rail_state::active || r->state() == rail_state::connecting ||
           r->state() == rail_state::idle ||
           (r->state() == rail_state::paused && r->failures() <= 1);
  });
}

/// Work requests staged for one queue pair go out as one chain: one
/// ibv_post_send() call, only the last one signaled. A chain ends once it
/// holds `max_wrs` work requests or `max_bytes` bytes, so small slices share
/// a completion and large ones keep one each (their completions are few
/// already, and a long chain of them would hold back progress and the
/// retries of a failed rail).
struct chain_limits {
  std::uint32_t max_wrs = 16;
  std::uint64_t max_bytes = 256ull << 10;  // KiB = 2^10 B

  /// Whether a chain of `wrs` work requests carrying `bytes` must end here.
  constexpr bool full(std::size_t wrs, std::uint64_t bytes) const noexcept {
    return wrs >= max_wrs || bytes >= max_bytes;
  }
};

/// How many of a queue pair's work requests, oldest first in `posted`, a
/// completion for `wr_id` ends: its position + 1 (an RC queue pair completes
/// in order, so every one posted before it has completed, unsignaled ones
/// without a completion of their own), or 0 when it is not there (a stale
/// completion of a queue pair torn down already). `id_of` gives an element's
/// wr_id.
template <class Posted, class IdOf>
std::size_t retired_by(const Posted& posted, std::uint64_t wr_id, IdOf id_of) {
  std::size_t n = 0;
  for (const auto& p : posted) {
    ++n;
    if (id_of(p) == wr_id) return n;
  }
  return 0;
}

}  // namespace kvlink::rdma
