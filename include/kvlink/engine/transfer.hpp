// The transfer state machine: start (validate every request, plan slices,
// hand them to the peers' data paths), stop (first error wins: drop what was
// not sent, wait for what is in flight), fence (what does not drain within
// fence_timeout has its carrier closed) and complete (the handler runs once,
// after the last slice is resolved; a notification, if any, goes first).
//
// Transports report each slice through slice_done(), from any strand: the
// report is carried to the engine's strand, where every transfer's state
// lives (TCP lanes run on strands of their own; RDMA and the fake transport
// on the engine's, where it is a direct call).
#pragma once

#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/detail/erased_handler.hpp>
#include <kvlink/engine/notify.hpp>
#include <kvlink/engine/peer.hpp>
#include <kvlink/memory/staging.hpp>
#include <kvlink/planner/slice_planner.hpp>
#include <kvlink/transport/transport.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <system_error>
#include <unordered_map>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/defer.hpp>
#include <asio/dispatch.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <asio/strand.hpp>

namespace kvlink {

/// Per-call options of async_submit_transfer.
struct transfer_options {
  /// Deadline of this transfer, counted from submission. nullopt: the
  /// engine's config.transfer_deadline; zero: no deadline.
  std::optional<std::chrono::milliseconds> deadline{};
  /// Sent to the peer(s) of the transfer once it has completed successfully,
  /// so the peer receives it only after the data is visible in its memory
  /// (a WRITE's bytes are placed and acknowledged before it is sent). The
  /// transfer's handler runs once the notification is handed to the kernel;
  /// if it cannot be sent the transfer completes with that error (the data
  /// did arrive). Not sent when the transfer fails.
  std::optional<notification> notify{};
  /// End-to-end CRC32C of every slice's payload (TCP; a mismatch fails the
  /// transfer with errc::checksum_mismatch and is never acknowledged as
  /// written). nullopt: the engine's config.checksums.
  std::optional<bool> checksum{};
};

namespace detail {

struct staged_slice;

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool reuse_ops = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool reuse_ops = false;
#else
inline constexpr bool reuse_ops = true;
#endif
#else
inline constexpr bool reuse_ops = true;
#endif

/// One transfer's state. Strand-only, except `stopping`, which transports
/// read from their strands while they hold one of its slices.
struct transfer_op {
  std::uint64_t id = 0;
  erased_handler<void(std::error_code, transfer_result)> handler;
  asio::cancellation_slot slot;
  std::size_t pending = 0;  // slices handed to paths and not yet resolved
  std::error_code error;
  transfer_result result;
  std::atomic<bool> stopping{false};
  std::chrono::steady_clock::time_point start;
  // When it fails with deadline_exceeded (transfers keeps one timer for all).
  std::optional<std::chrono::steady_clock::time_point> deadline;
  std::optional<asio::steady_timer> fence;
  std::vector<std::shared_ptr<data_path>> paths;   // paths that carry its slices
  std::vector<std::shared_ptr<peer_state>> peers;  // peers it moves data with
  std::vector<segment_id> local_segments;          // pinned until it completes
  std::optional<notification> notify{};
  // Device memory through staging: the slices staged for it, and, on a
  // staged slice's carrier (the transfer its path sees), that slice.
  std::vector<std::unique_ptr<staged_slice>> staged;
  staged_slice* carrier_of = nullptr;

  /// Back to a fresh op's state, the lists' capacity kept (transfers
  /// reuses completed ops).
  void reset() {
    id = 0;
    handler = {};
    slot = {};
    pending = 0;
    error = {};
    result = {};
    stopping.store(false, std::memory_order_relaxed);
    start = {};
    deadline.reset();
    fence.reset();
    paths.clear();
    peers.clear();
    local_segments.clear();
    notify.reset();
    staged.clear();
    carrier_of = nullptr;
  }
};

/// A slice of device memory whose transport does not reach it: it borrows a
/// pinned chunk (memory/staging.hpp), is copied device -> chunk before a
/// WRITE is sent and chunk -> device after a READ arrived, and counts as
/// resolved only once that copy finished. Its path sees `carrier` as its
/// transfer, so the path's report comes back to this slice.
struct staged_slice {
  enum class step { waiting, copying, on_path, done };
  transfer_op carrier;
  transfer_op* parent = nullptr;
  std::shared_ptr<data_path> path;
  std::size_t lane = 0;
  slice_ref ref;  // as planned: `local` is the device memory
  std::int32_t device = -1;
  std::byte* chunk = nullptr;
  step at = step::waiting;
};

class transfers : public std::enable_shared_from_this<transfers> {
 public:
  using strand_type = asio::strand<asio::any_io_executor>;
  using handler = erased_handler<void(std::error_code, transfer_result)>;
  using peer_lookup = std::function<std::shared_ptr<peer_state>(peer_id)>;
  /// The staging region of a device as a registered local segment (for
  /// transports that need local registration: RDMA); 0 for none.
  using staging_segment_fn = std::function<std::uint64_t(std::int32_t device)>;

  struct settings {
    plan_policy policy;
    std::chrono::milliseconds default_deadline{0};
    std::chrono::milliseconds fence_timeout{0};
    std::uint64_t max_notification = 0;
    bool checksums = false;
  };

  /// `pins` pins the local segments a transfer uses until it completes, so
  /// that unregistering one waits for it (transport_host::pin / unpin).
  transfers(strand_type strand, settings s, const segment_registry& registry,
            std::shared_ptr<remote_segment_cache> cache, peer_lookup find_peer,
            transport_host& pins, std::shared_ptr<staging_pool> staging = nullptr,
            staging_segment_fn staging_segment = nullptr)
      : strand_(std::move(strand)),
        settings_(s),
        registry_(registry),
        cache_(std::move(cache)),
        find_peer_(std::move(find_peer)),
        pins_(pins),
        staging_(std::move(staging)),
        staging_segment_(std::move(staging_segment)),
        deadlines_(strand_) {}

  std::uint64_t next_id() noexcept { return next_id_.fetch_add(1, std::memory_order_relaxed); }

  /// Strand-only: starts a transfer (the handler runs later, never in here).
  void start(std::uint64_t id, std::vector<transfer_request> reqs, transfer_options opts, handler h,
             asio::cancellation_slot slot) {
    transfer_op* op = nullptr;
    if (!spare_ops_.empty()) {  // a completed op and its map node, reused
      auto node = std::move(spare_ops_.back());
      spare_ops_.pop_back();
      node.key() = id;
      op = node.mapped().get();
      ops_.insert(std::move(node));
    } else {
      auto owned = std::make_unique<transfer_op>();
      op = owned.get();
      ops_.emplace(id, std::move(owned));
    }
    op->id = id;
    op->handler = std::move(h);
    op->slot = slot;
    op->start = std::chrono::steady_clock::now();
    op->result.requests = static_cast<std::uint32_t>(reqs.size());
    op->notify = std::move(opts.notify);
    if (op->notify &&
        op->notify->id.size() + op->notify->payload.size() > settings_.max_notification) {
      op->error = errc::message_too_large;
      complete(op);
      return;
    }

    // Validate everything before anything moves: a bad request fails the
    // whole batch with nothing transferred.
    std::vector<group> groups = std::move(scratch_.groups);
    std::vector<slice> slices = std::move(scratch_.slices);
    lookups seen;
    seen.spare = std::move(scratch_.items);
    seen.spare.clear();
    seen.spare.reserve(reqs.size());
    // However start() returns, the lists go back to scratch_, empty.
    struct recycle {
      scratch& to;
      std::vector<group>& groups;
      std::vector<slice>& slices;
      ~recycle() {
        if (!groups.empty()) to.items = std::move(groups.front().items);
        to.items.clear();
        groups.clear();  // lets go of the peers
        to.groups = std::move(groups);
        to.slices = std::move(slices);
        to.slices.clear();
      }
    } recycled{scratch_, groups, slices};
    bool device_memory = false;
    for (const auto& r : reqs) {
      if (auto ec = validate(r, groups, device_memory, seen)) {
        op->error = ec;
        complete(op);
        return;
      }
    }
    // No two requests may write the same bytes (destinations_overlap, in the
    // planner): checked once over the whole batch, across peers.
    if (reqs.size() > 1 && overlapping(groups)) {
      op->error = errc::overlapping_destinations;
      complete(op);
      return;
    }
    // The local memory it uses stays registered until it completes:
    // unregistering a segment stops the transfers that use it and waits.
    // Pinned only once a slice leaves this call: what is moved right here
    // (copy_now) is done before this strand could run an unregistration.
    bool pinned = false;
    auto pin_locals = [&]() -> bool {
      pinned = true;
      for (const auto& g : groups) {
        segment_id last{};
        for (const auto& item : g.items) {
          if (item.local_segment == last) continue;
          last = item.local_segment;
          if (std::find(op->local_segments.begin(), op->local_segments.end(), item.local_segment) ==
              op->local_segments.end()) {
            if (!pins_.pin(item.local_segment)) return false;  // validated on this strand
            op->local_segments.push_back(item.local_segment);
          }
        }
      }
      return true;
    };
    const bool checksum = opts.checksum.value_or(settings_.checksums);
    for (auto& g : groups) {
      plan_stats stats;
      auto policy = settings_.policy;
      if (g.device_only) policy.slice_size = g.p->path->device_slice_size(policy.slice_size);
      if (auto ec = plan_slices(g.items, g.p->path->lane_weights(), policy, slices, &stats)) {
        // Earlier groups may already be queued on their paths: stop() fences them.
        op->error = ec;
        if (op->pending == 0) {
          complete(op);
        } else {
          stop(op, ec);
        }
        return;
      }
      op->result.slices += stats.slices;
      auto ref_of = [&](const slice& s) {
        return slice_ref{op,
                         reinterpret_cast<std::byte*>(s.local_addr),
                         s.length,
                         s.remote_segment.value(),
                         s.remote_offset,
                         s.op,
                         0,
                         s.local_segment.value(),
                         checksum};
      };
      // A small group the path can move right here (shm into mapped shared
      // memory) is moved before anything else runs on this strand: no slice
      // of it is queued, reported or counted down.
      if (!device_memory && !checksum && stats.bytes <= g.p->path->copy_now_max()) {
        auto& refs = scratch_.refs;
        refs.clear();
        for (const auto& s : slices) refs.push_back(ref_of(s));
        if (const auto moved = g.p->path->copy_now(refs)) {
          op->result.bytes += *moved;
          op->result.lanes += stats.lanes_used;
          if (op->notify) op->peers.push_back(std::move(g.p));  // told once all is done
          continue;
        }
      }
      if (!pinned && !pin_locals()) {
        op->error = errc::not_registered;
        if (op->pending == 0) {
          complete(op);
        } else {
          stop(op, op->error);
        }
        return;
      }
      op->peers.push_back(g.p);
      op->paths.push_back(g.p->path);
      auto& used = scratch_.lanes_used;
      used.assign(g.p->path->lane_weights().size(), 0);
      const bool stage = device_memory && staging_;
      for (const auto& s : slices) {
        const slice_ref ref = ref_of(s);
        ++op->pending;
        if (used[s.lane] == 0) {
          used[s.lane] = 1;
          ++op->result.lanes;
        }
        if (stage) {
          const auto seg = registry_.get(s.local_segment);
          if (seg && seg->memory.kind == memory_kind::device &&
              !(g.p->carrier ? g.p->carrier->reaches_segment(*seg)
                             : g.p->reaches.contains(memory_kind::device))) {
            stage_slice(op, g.p->path, s.lane, ref, seg->memory.device);
            continue;
          }
        }
        g.p->path->enqueue(s.lane, ref);
      }
    }
    if (op->pending == 0) {  // an empty batch, or every group moved right here
      complete(op);
      return;
    }
    const auto deadline = opts.deadline.value_or(settings_.default_deadline);
    if (deadline.count() > 0) op->deadline = op->start + deadline;
    // Kick the paths last. A path may resolve slices in pump() (shm copies
    // small batches right there), so the op may be gone when it returns:
    // the paths are held here, not read from the op.
    if (op->paths.size() == 1) {
      const auto p = op->paths.front();
      p->pump();
    } else {
      auto paths = op->paths;
      for (auto& p : paths) p->pump();
    }
    // Its deadline counts from its start; the timer is set only for a
    // transfer still under way (nothing of it can complete before this
    // handler returns: reports from other strands are posted here).
    if (auto* o = find(id); o != nullptr && o->deadline && !stopping(o)) arm_deadline(*o->deadline);
  }

  /// Strand-only: the caller's cancellation.
  void cancel(std::uint64_t id) {
    if (auto* op = find(id)) stop(op, errc::cancelled);
  }

  /// Strand-only: a local segment is being unregistered: the transfers that
  /// use it stop with `ec` (their pins on it go when they complete).
  void stop_using(segment_id local, std::error_code ec) {
    std::vector<std::uint64_t> ids;
    for (const auto& [id, op] : ops_) {
      if (std::find(op->local_segments.begin(), op->local_segments.end(), local) !=
          op->local_segments.end()) {
        ids.push_back(id);
      }
    }
    for (auto id : ids) {
      if (auto* op = find(id)) stop(op, ec);
    }
  }

  /// From any strand: a slice finished.
  void slice_done(transfer_op* op, std::uint64_t bytes, std::error_code ec) {
    if (strand_.running_in_this_thread()) {
      on_slice_done(op, bytes, ec);
      return;
    }
    asio::dispatch(strand_, [self = shared_from_this(), op, bytes, ec] {
      self->on_slice_done(op, bytes, ec);
    });
  }

  /// From any strand: several slices finished; one hop to the strand.
  void slices_done(std::span<const slice_report> done) {
    if (strand_.running_in_this_thread()) {
      for (const auto& d : done) on_slice_done(d.op, d.bytes, d.ec, d.slices);
      return;
    }
    asio::defer(strand_, [self = shared_from_this(),
                          v = std::vector<slice_report>(done.begin(), done.end())] {
      for (const auto& d : v) self->on_slice_done(d.op, d.bytes, d.ec, d.slices);
    });
  }

  static bool stopping(const transfer_op* op) noexcept {
    return op->stopping.load(std::memory_order_acquire);
  }

 private:
  struct group {
    std::shared_ptr<peer_state> p;
    std::vector<plan_request> items;
    bool device_only = true;  // every item's local memory is device memory the path reaches
  };

  transfer_op* find(std::uint64_t id) {
    auto it = ops_.find(id);
    return it == ops_.end() ? nullptr : it->second.get();
  }

  // What validate() looked up for the requests before this one in the same
  // batch. A batch is mostly thousands of requests from one local segment
  // to one segment of one peer (tensor parallelism's 4 KiB pieces), so the
  // registry, the peer table and the remote cache are asked once per run of
  // equal keys instead of once per request (each is a lock, and the cache
  // entry a copy). What they said holds for the whole batch, as if every
  // request had been looked up at the first one's instant.
  struct lookups {
    bool have_local = false;
    segment_info local;
    peer_id peer{};
    peer_state* p = nullptr;
    std::size_t group = 0;
    bool have_remote = false;
    segment_id remote{};
    bool remote_known = false;  // in the cache: remote_length and granted hold
    std::uint64_t remote_length = 0;
    access granted = access::none;
    std::vector<plan_request> spare;  // the first group's list, with room for the batch
  };

  // Everything a request says is checked here, before anything is sent: the
  // peer never sees a frame the initiator could have refused.
  std::error_code validate(const transfer_request& r, std::vector<group>& groups,
                           bool& device_memory, lookups& seen) {
    if (r.op != opcode::read && r.op != opcode::write) return errc::invalid_argument;
    if (r.length == 0 || r.local == nullptr) return errc::invalid_argument;
    const auto addr = reinterpret_cast<std::uintptr_t>(r.local);
    if (r.length > std::numeric_limits<std::uintptr_t>::max() - addr) {
      return errc::invalid_argument;  // local + length wraps around
    }
    // Another request inside the local segment of the one before.
    if (!seen.have_local || addr < seen.local.base || addr >= seen.local.end() ||
        !detail::range_in_bounds(addr - seen.local.base, r.length, seen.local.length)) {
      seen.have_local = false;
      if (auto ec = registry_.locate(r.local, r.length, seen.local)) return ec;
      seen.have_local = true;
    }
    const segment_info& local = seen.local;
    device_memory = device_memory || local.memory.kind == memory_kind::device;
    if (seen.p == nullptr || r.remote.peer != seen.peer) {
      seen.p = nullptr;
      seen.have_remote = false;
      auto p = find_peer_(r.remote.peer);
      if (!p) return errc::unknown_peer;
      if (!p->alive.load(std::memory_order_relaxed) || !p->path) {
        return p->failure ? p->failure : errc::peer_closed;
      }
      auto g = std::find_if(groups.begin(), groups.end(), [&](const group& x) { return x.p == p; });
      if (g == groups.end()) {
        groups.push_back({std::move(p), {}, true});
        g = std::prev(groups.end());
        if (groups.size() == 1) g->items = std::move(seen.spare);
      }
      seen.peer = r.remote.peer;
      seen.p = g->p.get();
      seen.group = static_cast<std::size_t>(g - groups.begin());
    }
    const peer_state& p = *seen.p;
    // The cached descriptor catches mistakes early; an id the cache does not
    // know yet (registered a moment ago) is left to the target, which checks
    // every access anyway.
    if (!seen.have_remote || r.remote.segment != seen.remote) {
      seen.remote = r.remote.segment;
      seen.remote_known =
          cache_->limits(p.instance, r.remote.segment, seen.remote_length, seen.granted);
      seen.have_remote = true;
    }
    if (seen.remote_known) {
      if (const errc e = detail::check_segment_access(
              seen.remote_length, seen.granted, r.remote_offset, r.length, required_access(r.op));
          e != errc{}) {
        return e;
      }
    } else if (!r.remote.segment.valid()) {
      return errc::not_registered;
    }
    group& g = groups[seen.group];
    // Device memory the path reaches itself (not staged through chunks of
    // the configured slice size).
    g.device_only =
        g.device_only && local.memory.kind == memory_kind::device &&
        (p.carrier ? p.carrier->reaches_segment(local) : p.reaches.contains(memory_kind::device));
    g.items.push_back(
        plan_request{r.op, addr, local.id, r.remote.segment, r.remote_offset, r.length});
    return {};
  }

  // WRITEs' ranges in each peer's segments, READs' ranges in local memory.
  bool overlapping(const std::vector<group>& groups) {
    auto& ranges = scratch_.ranges;
    ranges.clear();
    for (const auto& g : groups) {
      for (const auto& item : g.items) {
        if (item.op == opcode::write) {
          ranges.push_back({reinterpret_cast<std::uintptr_t>(g.p.get()),
                            item.remote_segment.value(), item.remote_offset, item.length});
        } else {
          ranges.push_back({0, 0, item.local_addr, item.length});
        }
      }
    }
    return destinations_overlap(ranges, scratch_.keys);
  }

  // `slices` of op's slices finished (more than one: all of them succeeded).
  void on_slice_done(transfer_op* op, std::uint64_t bytes, std::error_code ec,
                     std::uint32_t slices = 1) {
    if (op->carrier_of != nullptr) {  // a staged slice's carrier carries that one slice
      staged_done(op->carrier_of, bytes, ec);
      return;
    }
    op->result.bytes += bytes;
    op->pending -= slices;
    if (ec && !op->stopping) {
      stop(op, ec);  // may complete the op
      return;
    }
    if (op->pending == 0) complete(op);
  }

  /// First error wins: drop what was not sent, then wait for what is in
  /// flight (or fence it after fence_timeout).
  void stop(transfer_op* op, std::error_code ec) {
    if (op->stopping.load(std::memory_order_relaxed)) return;
    op->stopping.store(true, std::memory_order_release);
    if (!op->error) op->error = ec;
    std::size_t dropped = 0;
    for (auto& p : op->paths) dropped += p->drop_queued(op);
    for (auto& st : op->staged) {
      st->carrier.stopping.store(true, std::memory_order_release);
      // Waiting for a chunk or a copy: resolved when that comes back.
      if (st->at == staged_slice::step::on_path && st->path->drop_queued(&st->carrier) > 0) {
        release_chunk(*st);
        st->at = staged_slice::step::done;
        ++dropped;
      }
    }
    op->pending -= dropped;
    if (op->pending == 0) {
      complete(op);
      return;
    }
    op->fence.emplace(strand_);
    op->fence->expires_after(settings_.fence_timeout);
    op->fence->async_wait([w = weak_from_this(), id = op->id](std::error_code fec) {
      if (fec) return;
      if (auto self = w.lock()) self->fence(id);
    });
  }

  /// In-flight slices did not drain in time: their paths stop what carries
  /// them, which resolves them.
  void fence(std::uint64_t id) {
    auto* op = find(id);
    if (!op) return;
    auto paths = op->paths;
    for (auto& p : paths) {
      if (find(id) == nullptr) return;
      // Other transfers on what is closed fail too: their peer stopped answering.
      if (p->has_in_flight(op)) p->fence(op, errc::peer_closed);
    }
    std::vector<std::pair<std::shared_ptr<data_path>, transfer_op*>> carriers;
    if (auto* o = find(id)) {
      for (auto& st : o->staged) {
        if (st->at == staged_slice::step::on_path) carriers.emplace_back(st->path, &st->carrier);
      }
    }
    for (auto& [p, carrier] : carriers) {
      if (find(id) == nullptr) return;
      if (p->has_in_flight(carrier)) p->fence(carrier, errc::peer_closed);
    }
  }

  // ----------------------------------------------------------------- staging

  /// Strand-only: `ref` (local device memory) goes through a staging chunk.
  void stage_slice(transfer_op* op, std::shared_ptr<data_path> path, std::size_t lane,
                   const slice_ref& ref, std::int32_t device) {
    auto st = std::make_unique<staged_slice>();
    auto* sp = st.get();
    sp->carrier.id = op->id;
    sp->carrier.carrier_of = sp;
    sp->parent = op;
    sp->path = std::move(path);
    sp->lane = lane;
    sp->ref = ref;
    sp->device = device;
    op->staged.push_back(std::move(st));
    // The op outlives its staged slices (each counts in op->pending), and
    // `self` keeps this object alive until the chunk arrives.
    staging_->acquire(device, strand_, [self = shared_from_this(), sp](std::byte* chunk) {
      self->on_chunk(sp, chunk);
    });
  }

  void on_chunk(staged_slice* sp, std::byte* chunk) {
    sp->chunk = chunk;
    if (chunk == nullptr) {
      finish_staged(sp, 0, errc::device_error);
      return;
    }
    if (stopping(sp->parent)) {
      finish_staged(sp, 0, errc::cancelled);
      return;
    }
    if (sp->ref.kind == opcode::read) {
      send_staged(sp);
      return;
    }
    sp->at = staged_slice::step::copying;
    staging_->copy(sp->device, chunk, memory_desc{}, sp->ref.local,
                   memory_desc{memory_kind::device, sp->device},
                   static_cast<std::size_t>(sp->ref.length), strand_,
                   [self = shared_from_this(), sp](std::error_code ec) {
                     if (ec) {
                       self->finish_staged(sp, 0, ec);
                     } else if (stopping(sp->parent)) {
                       self->finish_staged(sp, 0, errc::cancelled);
                     } else {
                       self->send_staged(sp);
                     }
                   });
  }

  void send_staged(staged_slice* sp) {
    sp->at = staged_slice::step::on_path;
    slice_ref r = sp->ref;
    r.op = &sp->carrier;
    r.local = sp->chunk;
    r.local_segment = staging_segment_ ? staging_segment_(sp->device) : 0;
    sp->path->enqueue(sp->lane, r);
    sp->path->pump();
  }

  /// The path resolved a staged slice's carrier.
  void staged_done(staged_slice* sp, std::uint64_t bytes, std::error_code ec) {
    if (ec || sp->ref.kind == opcode::write) {
      finish_staged(sp, ec ? 0 : bytes, ec);
      return;
    }
    // A READ's bytes are in the chunk: into device memory before it counts.
    sp->at = staged_slice::step::copying;
    staging_->copy(sp->device, sp->ref.local, memory_desc{memory_kind::device, sp->device},
                   sp->chunk, memory_desc{}, static_cast<std::size_t>(bytes), strand_,
                   [self = shared_from_this(), sp, bytes](std::error_code cec) {
                     self->finish_staged(sp, cec ? 0 : bytes, cec);
                   });
  }

  void release_chunk(staged_slice& st) {
    if (st.chunk != nullptr) staging_->release(st.device, st.chunk);
    st.chunk = nullptr;
  }

  void finish_staged(staged_slice* sp, std::uint64_t bytes, std::error_code ec) {
    release_chunk(*sp);
    sp->at = staged_slice::step::done;
    on_slice_done(sp->parent, bytes, ec);
  }

  // ---------------------------------------------------------------- deadlines

  // One timer for every transfer's deadline, set to the earliest one it
  // knows of. A transfer that completes leaves it be: when it fires, the
  // transfers past their deadline stop, and it is set again for the
  // earliest of the rest. With no transfer left it is cancelled, so that an
  // idle engine holds no pending wait (an io_context run to completion
  // returns).
  void arm_deadline(std::chrono::steady_clock::time_point at) {
    if (deadline_armed_ && deadline_at_ <= at) return;
    deadline_armed_ = true;
    deadline_at_ = at;
    deadlines_.expires_at(at);  // a wait for a later instant ends, aborted
    deadlines_.async_wait([w = weak_from_this()](std::error_code ec) {
      if (ec) return;
      if (auto self = w.lock()) self->deadlines_due();
    });
  }

  void deadlines_due() {
    deadline_armed_ = false;
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::uint64_t> due;
    std::optional<std::chrono::steady_clock::time_point> next;
    for (const auto& [id, op] : ops_) {
      if (!op->deadline || stopping(op.get())) continue;
      if (*op->deadline <= now) {
        due.push_back(id);
      } else if (!next || *op->deadline < *next) {
        next = op->deadline;
      }
    }
    for (const auto id : due) {
      if (auto* op = find(id)) stop(op, errc::deadline_exceeded);
    }
    if (next && !ops_.empty()) arm_deadline(*next);
  }

  void complete(transfer_op* op) {
    auto it = ops_.find(op->id);
    if (it == ops_.end()) return;
    auto node = ops_.extract(it);
    if (ops_.empty() && deadline_armed_) {
      deadline_armed_ = false;
      deadlines_.cancel();
    }
    auto& owned = node.mapped();
    if (owned->slot.is_connected()) owned->slot.clear();
    owned->result.duration = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - owned->start);
    auto h = std::move(owned->handler);
    const auto ec = owned->error;
    const auto result = owned->result;
    auto notify = std::move(owned->notify);
    std::vector<std::shared_ptr<peer_state>> peers;
    if (!ec && notify) peers = std::move(owned->peers);
    const auto until = owned->deadline;
    // Nothing of it touches local memory any more.
    for (const auto seg : owned->local_segments) pins_.unpin(seg);
    // Its state is let go before the upcall; the op (its lists' room) and
    // its map node serve a later transfer. Not under AddressSanitizer, so
    // that a use of an op after its completion stays a finding there.
    owned->reset();
    if (reuse_ops && spare_ops_.size() < max_spare_ops) spare_ops_.push_back(std::move(node));
    if (ec || !notify || peers.empty()) {
      h.complete(ec, result);
      return;
    }
    // The data is in place: now the notification, then the handler. A peer
    // that stopped reading its control connection must not hold the handler
    // past the transfer's deadline (the notification may still go out later;
    // it touches no memory of the caller's).
    struct fan_in {
      handler h;
      transfer_result result;
      std::size_t remaining;
      std::error_code first;
      std::optional<asio::steady_timer> timer;
      void finish(std::error_code ec) {
        if (timer) timer->cancel();
        h.complete(ec, result);  // once: an empty handler does nothing
      }
    };
    auto state = std::make_shared<fan_in>(fan_in{std::move(h), result, peers.size(), {}, {}});
    if (until) {
      state->timer.emplace(strand_, *until);
      state->timer->async_wait([state](std::error_code tec) {
        if (!tec && state->remaining > 0) state->finish(errc::deadline_exceeded);
      });
    }
    const auto msg = control::make_notify(notify->id, notify->payload);
    for (auto& p : peers) {
      auto done = [state](std::error_code sec) {
        if (sec && !state->first) state->first = sec;
        if (--state->remaining == 0) state->finish(state->first);
      };
      if (!p->alive.load() || !p->control) {
        done(p->failure ? p->failure : errc::peer_closed);
      } else {
        p->control->send(msg, done);
      }
    }
  }

  strand_type strand_;
  settings settings_;
  const segment_registry& registry_;
  std::shared_ptr<remote_segment_cache> cache_;
  peer_lookup find_peer_;
  transport_host& pins_;
  std::shared_ptr<staging_pool> staging_;  // null: no device runtime
  staging_segment_fn staging_segment_;
  std::atomic<std::uint64_t> next_id_{1};
  // Strand-only lists start() fills and empties, kept from one transfer to
  // the next (cleared, capacity kept): a batch of 10^5 requests then neither
  // allocates nor faults in megabytes each time. They keep about 160 bytes
  // per request of the largest batch seen.
  struct scratch {
    std::vector<plan_request> items;  // the first peer's requests
    std::vector<slice> slices;
    std::vector<destination_range> ranges;
    std::vector<std::uint64_t> keys;  // destinations_overlap's
    std::vector<group> groups;        // empty between transfers
    std::vector<char> lanes_used;
    std::vector<slice_ref> refs;  // a group offered to copy_now()
  };
  scratch scratch_;
  using op_map = std::unordered_map<std::uint64_t, std::unique_ptr<transfer_op>>;
  op_map ops_;  // strand-only
  // Completed ops in their map nodes, ready for the next transfers (a
  // transfer then allocates neither its state nor its node).
  static constexpr std::size_t max_spare_ops = 64;
  std::vector<op_map::node_type> spare_ops_;
  asio::steady_timer deadlines_;
  bool deadline_armed_ = false;
  std::chrono::steady_clock::time_point deadline_at_{};
};

}  // namespace detail
}  // namespace kvlink
