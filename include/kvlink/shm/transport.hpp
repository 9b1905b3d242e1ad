// The same-host transport ("shm"): one kernel copy between two processes'
// registered host memory with cross-memory attach (shm/cma.hpp), no socket,
// no staging. A peer is on the same host when its descriptor entry carries
// this kernel's boot id and this PID namespace, and we may attach to its
// process (a probe read at connect time); otherwise the reason says which
// of these failed, and the next transport (TCP) carries the data.
//
// Device memory (with a device runtime, env.device): a peer's device
// allocation is imported here and reached with our runtime's streams, one
// per device and lane (H2D, D2H, D2D); our device memory reaches the peer's
// private host memory through pinned chunks (device copy, then cross-memory
// attach; or the reverse), its shared memory with a stream copy into the
// mapping. A slice is reported only once its copy completed.
//
// Why cross-memory attach and not shared-memory segments: it reaches memory
// the user already has (a torch tensor, a vLLM KV cache pool) with no
// allocator of ours, at the speed of one memcpy for large slices (README:
// "Same-host transfers"); shared segments would need the memory to live in
// them. Small slices to private memory go through a ring instead (two
// memcpys, one per process: the kernel's copy pins every page of every
// piece, a third of a memcpy for scattered 4 KiB pieces).
//
// The protocol, over the control channel (engine.hpp's sessions):
//   initiator -> target  {"op":"prove","nonce":"<32 hex>"}
//   target -> initiator  {"op":"proved","at":<address of the nonce in its memory>}
//     the initiator reads it there: the pid it will write to is the peer's
//     process, not one a hostile descriptor named;
//   initiator -> target  {"op":"lease","segment":id[,"device":"<its runtime>"]}
//   target -> initiator  {"op":"granted","segment":id,"base":..,"length":..,"access":"rw"
//                         [,"fd":..,"fd_offset":..,"dev":..,"ino":..]   (shared memory)
//                         [,"device":{...}]}                           (device memory)
//                      | {"op":"refused","segment":id,"error":<errc>[,"why":"..."]}
//     a granted lease pins the segment on the target (unregistration waits
//     for it) until the initiator gives it back; a device segment is granted
//     only to a peer with the same device runtime, with its allocation's
//     export (shm/device.hpp), which the initiator imports and copies to
//     with its runtime's streams (a grant it cannot use it gives back at
//     once, "released");
//   target -> initiator  {"op":"release","segment":id}   (it is being unregistered)
//   initiator -> target  {"op":"released","segment":id}  once no copy of its
//     lanes touches the segment any more.
//   initiator -> target  {"op":"ring"}   (at its first small slice to private memory)
//   target -> initiator  {"op":"ring","version":1,"fd":..,"size":..,"dev":..,"ino":..,
//                         "doorbell":..,"answer":..,"slots":..,"slot_data":..,"max_pieces":..}
//                      | {"op":"ring","error":<errc>,"why":"..."}
//     slices of at most shm_ring_max bytes between our host memory and the
//     peer's private memory then go through that ring (shm/ring.hpp), which
//     the target copies in and out of inside the segments this session
//     holds leases on; without one they go by cross-memory attach.
// The target's session closing (the peer died) releases its leases and
// stops its ring. A peer that keeps a lease past fence_timeout is
// disconnected (transport::revoke).
//
// The peer's exit: the path watches its pidfd through the reactor and fails
// with peer_closed when the process exits; lanes look at that before each
// slice. A cross-memory call names the peer by its PID, so a lane also
// polls the pidfd itself before each one (a PID reused after the peer died
// must never receive its bytes); copies through a mapping need no poll.
//
// Small batches (host memory only, at most `inline_copy` bytes for a lane)
// are copied on the engine's strand when the path is pumped: the hop to a
// lane's strand and back cost more than the copy of a few 4 KiB pieces.
//
// Host slices go to the lanes in runs of `inline_copy` bytes, not one slice
// to each lane in turn as the planner stripes them: an io_context run by
// one thread copies one lane's batch after the other, and every other 4 KiB
// piece, then the ones between, copied slower than the pieces in order (a
// standalone copy of 1.5 * 10^5 scattered pieces on this project's 2-core
// VM: 6.0 against 6.4-6.6 GB/s).
//
// Where the lanes' batches run on the thread that plans (an io_context run
// by one thread), they only add bookkeeping: host slices into mapped shared
// memory are then copied as they are placed (copy_placed), a batch entry,
// a lane run and a report less per slice, and reported at pump(). One run
// in `probe_runs` still goes to a lane, which notes the thread it runs on;
// once a batch runs on another thread, the lanes copy beside the planning
// thread again.
//
// Trust: a process that may attach to ours could read and write all of our
// memory anyway (the kernel's ptrace rule); the bounds, access and lease
// rules are what keep an honest peer's copies inside registered memory.
#pragma once

#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/shm/cma.hpp>
#include <kvlink/shm/config.hpp>
#include <kvlink/shm/device.hpp>
#include <kvlink/shm/memory.hpp>
#include <kvlink/shm/ring.hpp>
#include <kvlink/transport/transport.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/post.hpp>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kvlink::shm {

/// What a path and its lanes share: the peer's process and whether the path
/// failed (lanes read it from their strands).
struct peer_process_state {
  std::int64_t pid = 0;
  pid_watch watch;
  std::atomic<bool> failed{false};
  std::atomic<int> failure{0};  // an errc value, once failed

  explicit peer_process_state(std::int64_t p) : pid(p), watch(p) {}

  /// The first failure wins; lanes report it for what they still hold.
  void mark_failed(std::error_code ec) noexcept {
    bool expected = false;
    if (failed.compare_exchange_strong(expected, true)) {
      failure.store(ec.category() == error_category() ? ec.value()
                                                      : static_cast<int>(errc::peer_closed));
    }
  }
};

/// What a path needs for device memory (memory/device.hpp); all empty
/// when the engine has no device runtime.
struct device_access {
  std::shared_ptr<device_runtime> rt;
  /// Pinned chunks for our device memory <-> the peer's private host
  /// memory (a device copy, then cross-memory attach; or the reverse).
  std::shared_ptr<staging_pool> staging;
  /// Our registered segments: a slice's local memory kind.
  const segment_registry* registry = nullptr;
};

/// One slice and where it lands: in the peer's address space (cross-memory
/// attach), in our mapping of the peer's shared memory (memcpy), or in the
/// peer's device memory imported here (a device copy).
struct copy_item {
  slice_ref s;
  std::uint64_t remote = 0;           // the peer's address; with `device`, its address here
  std::shared_ptr<peer_mapping> map;  // null: not mapped
  std::shared_ptr<imported_allocation> device;  // null: the peer's host memory
  memory_desc local_memory{};                   // s.local's kind

  /// Whether a device stream copies it.
  bool on_device() const noexcept {
    return device != nullptr || local_memory.kind == memory_kind::device;
  }
};

/// Empty batches (lists of copy_item) for a path's lanes to reuse; any
/// thread. It keeps up to `kept` lists, each with the room of the largest
/// batch it held (about 120 bytes per slice).
class batch_pool {
 public:
  std::vector<copy_item> take() {
    const std::lock_guard lock(mutex_);
    if (spare_.empty()) return {};
    auto v = std::move(spare_.back());
    spare_.pop_back();
    return v;
  }
  void give(std::vector<copy_item>&& v) {
    v.clear();  // lets go of mappings and imports outside the lock
    const std::lock_guard lock(mutex_);
    if (spare_.size() < kept) spare_.push_back(std::move(v));
  }

 private:
  static constexpr std::size_t kept = 4;
  std::mutex mutex_;
  std::vector<std::vector<copy_item>> spare_;
};

/// How many bytes of device copies a lane keeps queued on its streams:
/// about a third of a millisecond of copying at the runtime's nominal rate
/// for the path (copy_rate_hint; `between_devices`: both ends device
/// memory), at least 16 MiB and at most 512 MiB. A transfer that stops
/// finds the rest not yet started, and the copy engine does not wait while
/// completions are polled (a 16 MiB window between two allocations of an
/// H100 gave 95 GB/s of its 1.4 TB/s).
inline std::uint64_t device_copy_window(const device_runtime* rt, bool between_devices) noexcept {
  const double rate = rt != nullptr ? rt->copy_rate_hint(between_devices) : 0.0;
  const double bytes = rate * 1e9 * 350e-6;
  constexpr double lo = 16u << 20, hi = 512u << 20;
  return static_cast<std::uint64_t>(bytes < lo ? lo : bytes > hi ? hi : bytes);
}

/// Adjacent device slices (the planner's pieces of one request) go to a
/// stream as one copy of up to this many bytes: a copy costs microseconds
/// to start and complete whatever its size. Slices between two device
/// allocations go to lanes by the run of the peer's segment they fall in,
/// so that a run's slices meet in one lane.
inline constexpr std::uint64_t device_copy_run = 64u << 20;

/// A lane's batch of at most this many bytes, all of host memory, is copied
/// on the engine's strand where the path is pumped instead of on the lane's
/// (16 pieces of 4 KiB: tensor parallelism's single requests).
inline constexpr std::uint64_t inline_copy = 64u << 10;

/// While a path's copy lanes were last seen running on the thread that
/// plans (an io_context run by one thread), host slices into mapped shared
/// memory are copied as they are placed, but for one run of `inline_copy`
/// bytes in this many, which goes to a lane to see where it runs; a lane
/// batch seen on another thread turns that off for the next
/// `elsewhere_runs` batches.
inline constexpr std::uint64_t probe_runs = 32;
inline constexpr int elsewhere_runs = 8;

/// A copy lane: runs the batches its path hands it on a strand of its own,
/// one process_vm_{read,write}v per run of up to IOV_MAX slices of one
/// direction and at most `max_copy` bytes (a larger slice takes several
/// calls; memcpy likewise), and reports them in one go. Cancellation and
/// deadlines are looked at between calls, so a stopped transfer copies at
/// most about `max_copy` bytes per lane after it was stopped.
/// Slices touching device memory go to the lane's streams (one per device,
/// completions posted on the lane's strand), a window of them at a time,
/// and are reported once their copies completed; those between our device
/// memory and the peer's private host memory pass through a pinned chunk of
/// device_access::staging.
class lane : public std::enable_shared_from_this<lane> {
 public:
  using fatal_fn = std::function<void(std::error_code)>;

  lane(asio::any_io_executor ex, transport_host& host, std::shared_ptr<peer_process_state> peer,
       fatal_fn on_fatal, std::uint64_t max_copy = shm_config{}.max_copy, device_access dev = {})
      : ex_(std::move(ex)),
        host_(host),
        keep_(host.keep_alive()),
        peer_(std::move(peer)),
        on_fatal_(std::move(on_fatal)),
        max_copy_(std::max<std::uint64_t>(max_copy, 1)),
        dev_(std::move(dev)) {}

  const asio::any_io_executor& get_executor() const noexcept { return ex_; }

  /// On the lane's strand; a batch with no device slice touches no state
  /// of the lane, and may run on any strand (the path's inline copies).
  void run(const std::vector<copy_item>& batch) {
    std::vector<slice_report> done;
    run(batch, done);
  }

  /// The same, its reports gathered in `done` (cleared first; the caller's
  /// list, so that its room serves the next batch).
  void run(const std::vector<copy_item>& batch, std::vector<slice_report>& done) {
    done.clear();
    done.reserve(batch.size());
    std::vector<std::size_t> on_device;
    std::size_t i = 0;
    while (i < batch.size()) {
      if (peer_->failed.load(std::memory_order_acquire)) {
        const std::error_code ec = static_cast<errc>(peer_->failure.load());
        for (; i < batch.size(); ++i) done.push_back({batch[i].s.op, 0, ec});
        break;  // device slices set aside before this are refused in start_device
      }
      // Whether the peer's process exited is polled (a system call) before
      // each cross-memory run and device slice; copies through a mapping
      // rely on the path's watch, which sets peer_->failed.
      const bool mapped = batch[i].map && !batch[i].on_device();
      if (!mapped && peer_->watch.exited()) {
        fatal(errc::peer_closed);
        continue;  // reported above, as failed
      }
      if (batch[i].on_device()) {
        on_device.push_back(i++);
        continue;
      }
      if (mapped) {
        const auto& s = batch[i].s;
        // In pieces of max_copy: a transfer stopped meanwhile, or a peer
        // that exited, gets no more.
        std::byte* there = batch[i].map->segment() + s.offset;
        std::uint64_t off = 0;
        while (off < s.length && !host_.stopping(s.op) &&
               !peer_->failed.load(std::memory_order_acquire)) {
          const auto n = static_cast<std::size_t>(std::min(max_copy_, s.length - off));
          if (s.kind == opcode::read) {
            std::memcpy(s.local + off, there + off, n);
          } else {
            std::memcpy(there + off, s.local + off, n);
          }
          off += n;
        }
        std::error_code ec;
        if (off < s.length) {
          ec = host_.stopping(s.op) ? std::error_code{errc::cancelled}
                                    : std::error_code{static_cast<errc>(peer_->failure.load())};
        }
        add_report(done, s.op, off, ec);
        ++i;
        continue;
      }
      i = copy_run(batch, i, done);
    }
    if (!done.empty()) host_.slices_done(done);
    if (!on_device.empty()) start_device(batch, on_device);
  }

  /// On the lane's strand: runs `fn` once no device copy of this lane is
  /// under way (those it was given before have been reported).
  void when_idle(std::function<void()> fn) {
    if (busy_ == 0) {
      fn();
      return;
    }
    idle_waiters_.push_back(std::move(fn));
  }

 private:
  static std::error_code call_error(int err) {
    return err == ESRCH   ? std::error_code(errc::peer_closed)
           : err == EPERM ? std::error_code(errc::transport_unavailable)
                          : std::error_code(err, std::system_category());
  }

  void call_failed(int err, std::error_code ec) {
    if (err == EPERM) detail::log("shm: {}", cma::refusal_reason(err, peer_->pid));
    if (err == ESRCH || err == EPERM) fatal(ec);
  }

  // One slice larger than max_copy: a call per max_copy bytes, looking at
  // cancellation between them.
  void copy_large(const copy_item& item, std::vector<slice_report>& done) {
    const auto& s = item.s;
    const auto dir = s.kind == opcode::read ? cma::direction::read : cma::direction::write;
    std::uint64_t off = 0;
    while (off < s.length) {
      if (peer_->failed.load(std::memory_order_acquire)) {
        done.push_back({s.op, off, static_cast<errc>(peer_->failure.load())});
        return;
      }
      if (host_.stopping(s.op)) {
        done.push_back({s.op, off, errc::cancelled});
        return;
      }
      const auto n = static_cast<std::size_t>(std::min(max_copy_, s.length - off));
      iovec local{s.local + off, n};
      iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(item.remote + off)), n};
      const ssize_t got = cma::copy(static_cast<pid_t>(peer_->pid), dir, &local, 1, &remote, 1);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && errno != EFAULT) {
        const int err = errno;
        const auto ec = call_error(err);
        done.push_back({s.op, off, ec});
        call_failed(err, ec);
        return;
      }
      if (got <= 0 || static_cast<std::size_t>(got) < n) {  // a fault inside this piece
        done.push_back({s.op, off + static_cast<std::uint64_t>(std::max<ssize_t>(got, 0)),
                        fault_in(s, item.remote, dir)});
        return;
      }
      off += n;
    }
    add_report(done, s.op, s.length);
  }

  // The device slices of one batch, reported together once all are done.
  struct device_batch {
    std::vector<slice_report> reports;
    std::size_t left = 0;
  };
  // A device slice waiting for, or in, a stream copy.
  struct device_job {
    std::shared_ptr<device_batch> batch;
    copy_item item;
  };
  // A device slice through a pinned chunk: piece by piece, one chunk.
  struct staged_copy {
    std::shared_ptr<device_batch> batch;
    copy_item item;
    std::byte* chunk = nullptr;
    std::uint64_t at = 0;  // bytes of the slice done
  };

  void start_device(const std::vector<copy_item>& batch, const std::vector<std::size_t>& which) {
    auto b = std::make_shared<device_batch>();
    b->reports.reserve(which.size());
    b->left = which.size();
    busy_ += which.size();
    for (const auto k : which) {
      const auto& item = batch[k];
      if (item.device == nullptr && !item.map) {
        start_staged(b, item);  // our device memory <-> the peer's private memory
      } else {
        queue_.push_back(device_job{b, item});
      }
    }
    issue();
  }

  // The stream of `device`, opened on first use; null (logged once) when
  // the runtime cannot open one.
  device_stream* stream(std::int32_t device) {
    auto& s = streams_[device];
    if (!s && dev_.rt) {
      std::error_code ec;
      std::string what;
      s = dev_.rt->open_stream(device, ex_, ec, what);
      if (!s && !stream_refused_) {
        stream_refused_ = true;
        detail::log("shm: no {} stream on device {} ({}): device slices fail", dev_.rt->name(),
                    device, what);
      }
    }
    return s.get();
  }

  static std::int32_t device_of(const copy_item& c) noexcept {
    return c.local_memory.kind == memory_kind::device ? c.local_memory.device : c.device->device();
  }

  // The peer's end of a queued device slice: its device memory imported
  // here, or its shared memory mapped here.
  static std::byte* there_of(const copy_item& c) noexcept {
    return c.device ? reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(c.remote))
                    : c.map->segment() + c.s.offset;
  }

  std::uint64_t window_of(const copy_item& c) const noexcept {
    return c.device && c.local_memory.kind == memory_kind::device ? window_between_devices_
                                                                  : window_;
  }

  // Starts queued stream copies while the window allows; a run of queued
  // slices that continue each other on both ends (same batch, direction and
  // memory) becomes one copy.
  void issue() {
    while (!queue_.empty() && (in_stream_ == 0 || in_stream_ + queue_.front().item.s.length <=
                                                      window_of(queue_.front().item))) {
      std::vector<device_job> run;
      run.push_back(std::move(queue_.front()));
      queue_.pop_front();
      // A copy, not a reference: `run` grows below and moves its elements.
      const copy_item first = run.front().item;
      if (auto ec = refuse(first.s)) {
        settle(run.front().batch, {first.s.op, 0, ec});
        continue;
      }
      auto* st = stream(device_of(first));
      if (st == nullptr) {
        settle(run.front().batch, {first.s.op, 0, errc::device_error});
        continue;
      }
      std::byte* there = there_of(first);
      std::byte* local = first.s.local;
      std::uint64_t n = first.s.length;
      const auto window = window_of(first);
      while (!queue_.empty()) {
        const auto& next = queue_.front();
        const auto& c = next.item;
        if (next.batch != run.front().batch || c.s.op != first.s.op || c.s.kind != first.s.kind ||
            c.device != first.device || c.map != first.map ||
            !(c.local_memory == first.local_memory) || c.s.local != local + n ||
            there_of(c) != there + n || n + c.s.length > device_copy_run ||
            in_stream_ + n + c.s.length > window) {
          break;
        }
        n += c.s.length;
        run.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      const memory_desc there_memory =
          first.device ? memory_desc{memory_kind::device, first.device->device()} : memory_desc{};
      const auto local_memory = first.local_memory;
      const bool read = first.s.kind == opcode::read;
      in_stream_ += n;
      auto done = [self = shared_from_this(), run = std::move(run), n](std::error_code ec) {
        self->copied(run, n, ec);
      };
      const auto bytes = static_cast<std::size_t>(n);
      if (read) {
        st->async_copy(local, local_memory, there, there_memory, bytes, std::move(done));
      } else {
        st->async_copy(there, there_memory, local, local_memory, bytes, std::move(done));
      }
    }
  }

  // One stream copy of `n` bytes, the slices of `run`, completed.
  void copied(const std::vector<device_job>& run, std::uint64_t n, std::error_code ec) {
    in_stream_ -= n;
    for (const auto& job : run) {
      const auto& s = job.item.s;
      settle(job.batch, {s.op, ec ? 0 : s.length, ec});
    }
    issue();
  }

  // Why a device slice must not start now (its transfer stops, the peer
  // failed or exited), or nothing.
  std::error_code refuse(const slice_ref& s) {
    if (peer_->failed.load(std::memory_order_acquire)) {
      return static_cast<errc>(peer_->failure.load());
    }
    if (host_.stopping(s.op)) return errc::cancelled;
    if (peer_->watch.exited()) {
      fatal(errc::peer_closed);
      return errc::peer_closed;
    }
    return {};
  }

  // One device slice resolved: its batch reports when all of it is.
  void settle(const std::shared_ptr<device_batch>& b, slice_report r) {
    b->reports.push_back(r);
    if (--b->left == 0) host_.slices_done(b->reports);
    if (--busy_ == 0 && !idle_waiters_.empty()) {
      auto waiters = std::move(idle_waiters_);
      idle_waiters_.clear();
      for (auto& f : waiters) f();
    }
  }

  // ------------------------------------------- device <-> private host memory

  void start_staged(std::shared_ptr<device_batch> b, const copy_item& item) {
    auto st = std::make_shared<staged_copy>(staged_copy{std::move(b), item});
    if (!dev_.staging) {
      settle(st->batch, {item.s.op, 0, errc::device_error});
      return;
    }
    dev_.staging->acquire(item.local_memory.device, ex_,
                          [self = shared_from_this(), st](std::byte* chunk) {
                            st->chunk = chunk;
                            self->staged_next(st);
                          });
  }

  // The next piece of a staged slice: WRITE copies device -> chunk, then
  // the chunk to the peer (cross-memory attach); READ the reverse.
  void staged_next(const std::shared_ptr<staged_copy>& st) {
    const auto& s = st->item.s;
    if (st->chunk == nullptr) return staged_end(st, errc::device_error);
    if (st->at == s.length) return staged_end(st, {});
    if (auto ec = refuse(s)) return staged_end(st, ec);
    auto* dev_stream = stream(st->item.local_memory.device);
    if (dev_stream == nullptr) return staged_end(st, errc::device_error);
    const auto piece = std::min<std::uint64_t>(dev_.staging->chunk_size(), s.length - st->at);
    const auto remote = st->item.remote + st->at;
    std::byte* local = s.local + st->at;
    auto self = shared_from_this();
    if (s.kind == opcode::write) {
      dev_stream->async_copy(
          st->chunk, memory_desc{}, local, st->item.local_memory, static_cast<std::size_t>(piece),
          [self, st, piece, remote](std::error_code ec) {
            if (!ec) ec = self->refuse(st->item.s);
            if (!ec) {
              ec = self->cma_piece(cma::direction::write, st->chunk, remote, piece);
            }
            if (ec) return self->staged_end(st, ec);
            st->at += piece;
            self->staged_next(st);
          });
      return;
    }
    if (auto ec = cma_piece(cma::direction::read, st->chunk, remote, piece)) {
      return staged_end(st, ec);
    }
    dev_stream->async_copy(local, st->item.local_memory, st->chunk, memory_desc{},
                           static_cast<std::size_t>(piece), [self, st, piece](std::error_code ec) {
                             if (ec) return self->staged_end(st, ec);
                             st->at += piece;
                             self->staged_next(st);
                           });
  }

  void staged_end(const std::shared_ptr<staged_copy>& st, std::error_code ec) {
    if (st->chunk != nullptr) dev_.staging->release(st->item.local_memory.device, st->chunk);
    st->chunk = nullptr;
    const auto& s = st->item.s;
    settle(st->batch, {s.op, ec ? 0 : s.length, ec});
  }

  // One piece between a chunk and the peer's memory at `remote`. The chunk
  // is ours and always mapped: a fault is the peer's.
  std::error_code cma_piece(cma::direction dir, std::byte* chunk, std::uint64_t remote,
                            std::uint64_t n) {
    std::uint64_t at = 0;
    while (at < n) {
      iovec l{chunk + at, static_cast<std::size_t>(n - at)};
      iovec r{reinterpret_cast<void*>(static_cast<std::uintptr_t>(remote + at)),
              static_cast<std::size_t>(n - at)};
      const ssize_t got = cma::copy(static_cast<pid_t>(peer_->pid), dir, &l, 1, &r, 1);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && errno != EFAULT) {
        const int err = errno;
        if (err == ESRCH || err == EPERM) {
          if (err == EPERM) detail::log("shm: {}", cma::refusal_reason(err, peer_->pid));
          const std::error_code ec = err == ESRCH ? errc::peer_closed : errc::transport_unavailable;
          fatal(ec);
          return ec;
        }
        return {err, std::system_category()};
      }
      if (got <= 0) {
        detail::log(
            "shm: the peer's registered memory (pid {}, {} bytes at {:#x}) is not accessible: "
            "unmapped or freed without unregistering it first",
            peer_->pid, n - at, remote + at);
        return errc::remote_memory_fault;
      }
      at += static_cast<std::uint64_t>(got);
    }
    return {};
  }

  // Copies slices from `first` on, as many of one direction as one call
  // takes; returns where the next run starts.
  std::size_t copy_run(const std::vector<copy_item>& batch, std::size_t first,
                       std::vector<slice_report>& done) {
    const opcode kind = batch[first].s.kind;
    std::array<iovec, cma::max_iov> local{};
    std::array<iovec, cma::max_iov> remote{};
    std::array<std::size_t, cma::max_iov> which{};
    std::size_t n = 0;
    std::uint64_t bytes = 0;
    std::size_t i = first;
    for (; i < batch.size() && n < cma::max_iov && batch[i].s.kind == kind && !batch[i].map &&
           !batch[i].on_device();
         ++i) {
      const auto& s = batch[i].s;
      if (host_.stopping(s.op)) {
        done.push_back({s.op, 0, errc::cancelled});
        continue;
      }
      if (s.length > max_copy_) {
        if (n > 0) break;  // after this run
        copy_large(batch[i], done);
        return i + 1;
      }
      if (n > 0 && bytes + s.length > max_copy_) break;  // the next run
      bytes += s.length;
      local[n] = iovec{s.local, static_cast<std::size_t>(s.length)};
      remote[n] = iovec{reinterpret_cast<void*>(static_cast<std::uintptr_t>(batch[i].remote)),
                        static_cast<std::size_t>(s.length)};
      which[n++] = i;
    }
    const auto dir = kind == opcode::read ? cma::direction::read : cma::direction::write;
    std::size_t k = 0;  // slices of this run resolved so far
    while (k < n) {
      const ssize_t got =
          cma::copy(static_cast<pid_t>(peer_->pid), dir, &local[k], n - k, &remote[k], n - k);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && errno != EFAULT) {
        const int err = errno;
        const std::error_code ec = call_error(err);
        for (; k < n; ++k) done.push_back({batch[which[k]].s.op, 0, ec});
        call_failed(err, ec);
        break;
      }
      // Whole slices first; the one a fault stopped at failed.
      std::uint64_t left = got < 0 ? 0 : static_cast<std::uint64_t>(got);
      while (k < n && left >= local[k].iov_len) {
        left -= local[k].iov_len;
        add_report(done, batch[which[k]].s.op, local[k].iov_len);
        ++k;
      }
      if (k == n) break;
      const auto& bad = batch[which[k]].s;
      done.push_back({bad.op, 0, fault_in(bad, batch[which[k]].remote, dir)});
      ++k;
    }
    return i;
  }

  // A copy faulted inside this slice: ours (local_memory_fault) or the
  // peer's (remote_memory_fault)? Touches our range a byte per page, through
  // the same kernel path, which faults where the copy did.
  std::error_code fault_in(const slice_ref& s, std::uint64_t remote, cma::direction dir) const {
    const long page = ::sysconf(_SC_PAGESIZE);
    const auto step = static_cast<std::uint64_t>(page > 0 ? page : 4096);
    const pid_t self = ::getpid();
    for (std::uint64_t off = 0; off < s.length; off = off + step - (off % step)) {
      std::byte b{};
      iovec mine{&b, 1};
      iovec at{s.local + off, 1};
      if (::process_vm_readv(self, &mine, 1, &at, 1, 0) != 1) return errc::local_memory_fault;
      // A READ lands in our memory: it must be writable too (the same byte
      // back: the transfer owns these bytes until it completes).
      if (dir == cma::direction::read && ::process_vm_writev(self, &mine, 1, &at, 1, 0) != 1) {
        return errc::local_memory_fault;
      }
    }
    detail::log(
        "shm: the peer's registered memory (pid {}, {} bytes at {:#x}) is not accessible: "
        "unmapped or freed without unregistering it first",
        peer_->pid, s.length, remote);
    return errc::remote_memory_fault;
  }

  void fatal(std::error_code ec) {
    peer_->mark_failed(ec);
    // The path hears first, then the slices are reported (both reach the
    // engine's strand in that order): a transfer that fails with
    // peer_closed finds its peer disconnected.
    if (on_fatal_) on_fatal_(ec);
  }

  asio::any_io_executor ex_;
  transport_host& host_;
  std::shared_ptr<transport_host> keep_;
  std::shared_ptr<peer_process_state> peer_;
  fatal_fn on_fatal_;
  std::uint64_t max_copy_;
  device_access dev_;
  // Device slices (strand-only): waiting for the window, bytes in the
  // streams, and resolved-or-not count for when_idle.
  std::deque<device_job> queue_;
  std::uint64_t in_stream_ = 0;
  std::uint64_t window_ = device_copy_window(dev_.rt.get(), false);
  std::uint64_t window_between_devices_ = device_copy_window(dev_.rt.get(), true);
  std::size_t busy_ = 0;
  std::vector<std::function<void()>> idle_waiters_;
  bool stream_refused_ = false;
  // Last: destroyed first, each finishing the copies it was given.
  std::map<std::int32_t, std::shared_ptr<device_stream>> streams_;
};

/// The data path to one peer on this host, on the engine's strand: leases
/// on the peer's segments, and the lanes that copy.
class path final : public data_path, public std::enable_shared_from_this<path> {
 public:
  /// `dev`: our device runtime, staging and registry (empty: host memory only).
  path(asio::any_io_executor ex, transport_host& host, path_context ctx,
       std::shared_ptr<peer_process_state> peer, device_access dev = {})
      : ex_(std::move(ex)),
        host_(host),
        ctx_(std::move(ctx)),
        peer_(std::move(peer)),
        dev_(std::move(dev)) {}

  /// What transport_reason() adds for this peer (how its device memory is
  /// reached, when it is not); empty: nothing to say.
  void set_note(std::string n) { note_ = std::move(n); }
  std::string note() const override { return note_; }

  /// Makes the lanes (before the path is used); `cfg` gives the bytes per
  /// copy call and the pre-fault bound.
  void open(std::uint32_t count, const std::function<asio::any_io_executor()>& strand,
            const shm_config& cfg = {}) {
    cfg_ = cfg;
    for (std::uint32_t i = 0; i < count; ++i) {
      // A lane that finds the peer gone tells the path on the engine's strand.
      auto fatal = [w = weak_from_this(), ex = ex_](std::error_code ec) {
        asio::post(ex, [w, ec] {
          if (auto self = w.lock()) self->fail(ec);
        });
      };
      lanes_.push_back(
          std::make_shared<lane>(strand(), host_, peer_, std::move(fatal), cfg.max_copy, dev_));
    }
    weights_.assign(lanes_.size(), 1.0);
    outbox_.resize(lanes_.size());
    watch_exit();
  }

  std::span<const double> lane_weights() const noexcept override { return weights_; }
  // Device slices become stream copies (adjacent ones merged up to
  // device_copy_run): 1 MiB slices left an H100's device-to-device copies
  // at 0.18 of their rate, the engine's cost per slice deciding.
  std::uint64_t device_slice_size(std::uint64_t configured) const noexcept override {
    return std::max(configured, device_copy_run);
  }

  /// Proves the peer's process is the one its entry names.
  void start() override {
    std::random_device rd;
    for (auto& w : nonce_) w = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    ctx_.send({{"op", "prove"}, {"nonce", nonce_text()}});
  }

  void enqueue(std::size_t i, const slice_ref& s) override {
    if (failed_) {
      rejects_.push_back({s.op, 0, failure_});
      return;
    }
    if (proven_) {
      if (const auto it = leases_.find(s.segment); it != leases_.end()) {
        place(i, s, it->second);
        return;
      }
    }
    auto& w = waiting_[s.segment];
    w.push_back({i, s});
    if (w.size() == 1 && proven_) request(s.segment);
  }

  std::uint64_t copy_now_max() const noexcept override { return inline_copy; }

  /// Slices into or out of the peer's shared memory, mapped here under a
  /// lease we hold, each inside it: copied at once, as a lane would, without
  /// the hops to it and back. Anything else (no lease yet, private or device
  /// memory, a bound or access a slice breaks, a failed path) leaves all of
  /// them to enqueue(), which reports what is wrong.
  std::optional<std::uint64_t> copy_now(std::span<const slice_ref> slices) override {
    if (failed_ || peer_->failed.load(std::memory_order_acquire)) return std::nullopt;
    std::uint64_t bytes = 0;
    const lease* l = nullptr;
    std::uint64_t seg = 0;
    for (const auto& s : slices) {
      if (l == nullptr || s.segment != seg) {
        const auto it = leases_.find(s.segment);
        if (it == leases_.end() || !it->second.map || it->second.device) return std::nullopt;
        l = &it->second;
        seg = s.segment;
      }
      const errc e = detail::check_segment_access(
          l->length, l->granted, s.offset, s.length,
          s.kind == opcode::read ? access::remote_read : access::remote_write);
      if (e != errc{} || s.length > inline_copy - bytes) return std::nullopt;
      bytes += s.length;
    }
    std::byte* base = nullptr;
    std::uint64_t mapped = 0;
    for (const auto& s : slices) {
      if (base == nullptr || s.segment != mapped) {
        base = leases_.find(s.segment)->second.map->segment();
        mapped = s.segment;
      }
      std::byte* there = base + s.offset;
      if (s.kind == opcode::read) {
        std::memcpy(s.local, there, static_cast<std::size_t>(s.length));
      } else {
        std::memcpy(there, s.local, static_cast<std::size_t>(s.length));
      }
    }
    return bytes;
  }

  void pump() override {
    if (!placed_done_.empty()) {
      auto r = std::move(placed_done_);
      placed_done_.clear();
      host_.slices_done(r);
    }
    if (!rejects_.empty()) {
      auto r = std::move(rejects_);
      rejects_.clear();
      host_.slices_done(r);
    }
    for (std::size_t i = 0; i < outbox_.size() && !failed_; ++i) {
      if (outbox_[i].empty()) continue;
      auto batch = std::move(outbox_[i]);
      auto l = lanes_[i];
      if (copies_here(batch)) {
        // Its reports reach the engine before this returns. The lists are
        // taken out of the path while it runs and given back after, their
        // room kept for the next small batch.
        outbox_[i] = {};
        auto done = std::move(inline_done_);
        l->run(batch, done);
        done.clear();
        inline_done_ = std::move(done);
        if (outbox_[i].empty()) {
          batch.clear();
          outbox_[i] = std::move(batch);
        }
        continue;
      }
      outbox_[i] = std::move(batch);
      hand_out(i);
    }
    if (ring_ && !failed_) {
      const auto r = ring_;  // a hostile answer fails the path, which lets go of it
      r->pump();
    }
  }

  std::size_t drop_queued(const detail::transfer_op* op) override {
    std::size_t n = 0;
    for (auto& o : outbox_) {
      n += std::erase_if(o, [op](const copy_item& c) { return c.s.op == op; });
    }
    for (auto& [seg, w] : waiting_) {
      n += std::erase_if(w, [op](const auto& x) { return x.second.op == op; });
    }
    n += std::erase_if(rejects_, [op](const slice_report& r) { return r.op == op; });
    // Copied, not reported yet: they count as dropped (the transfer stops).
    std::erase_if(placed_done_, [op, &n](const slice_report& r) {
      if (r.op != op) return false;
      n += r.slices;
      return true;
    });
    if (ring_) n += ring_->drop(op);
    // Batches posted to lanes resolve its slices with cancelled; slots in
    // the ring finish.
    return n;
  }

  bool has_in_flight(const detail::transfer_op* op) const override {
    (void)op;
    return !lanes_.empty();  // batches posted to lanes finish on their own
  }

  /// A copy cannot be interrupted; each ends within one call of at most
  /// shm_max_copy bytes, after which the lane sees the transfer stopping.
  /// Slices in the ring wait for the peer's process to copy them: one that
  /// has not for fence_timeout no longer does (stopped, or stuck), and the
  /// path fails as a TCP connection to it would close.
  void fence(const detail::transfer_op* op, std::error_code ec) override {
    if (ring_ && ring_->in_flight(op)) {
      detail::log("shm: pid {} did not copy its ring's slots within fence_timeout: disconnecting",
                  peer_->pid);
      fail(ec);
    }
  }

  void fail(std::error_code ec) override {
    if (failed_) return;
    auto keep = shared_from_this();  // its owner may drop it when told below
    failed_ = true;
    failure_ = ec;
    peer_->mark_failed(ec);
    if (exit_watch_) {
      std::error_code ignored;
      exit_watch_->close(ignored);  // its wait ends, aborted
    }
    // Slices copied at placing succeeded; the rest fail.
    std::vector<slice_report> r = std::move(placed_done_);
    placed_done_.clear();
    r.insert(r.end(), rejects_.begin(), rejects_.end());
    rejects_.clear();
    for (auto& o : outbox_) {
      for (const auto& c : o) r.push_back({c.s.op, 0, ec});
      o.clear();
    }
    for (auto& [seg, w] : waiting_) {
      for (const auto& x : w) r.push_back({x.second.op, 0, ec});
    }
    waiting_.clear();
    if (auto ring = std::move(ring_)) ring->fail(ec);  // reports its slices itself
    leases_.clear();  // imported device memory closes once the copies holding it end
    lanes_.clear();   // posted batches hold their lane; they resolve as failed
    if (auto cb = std::move(ctx_.on_failure)) cb(ec);
    if (!r.empty()) host_.slices_done(r);
  }

  void on_message(const nlohmann::json& body) override {
    if (failed_ || !body.is_object()) return;
    const auto op = body.value("op", std::string{});
    if (op == "proved") {
      proved(body);
      return;
    }
    if (op == "ring") {
      ring_granted(body);
      return;
    }
    std::uint64_t seg = 0;
    if (!control::get_field(body, "segment", seg)) return;
    if (op == "granted") {
      granted(seg, body);
    } else if (op == "refused") {
      refused(seg, body);
    } else if (op == "release") {
      release(seg);
    }
    // Unknown ops are ignored: newer peers may send more.
  }

 private:
  struct lease {
    std::uint64_t base = 0;
    std::uint64_t length = 0;
    access granted = access::none;
    std::shared_ptr<peer_mapping> map;  // the peer's shared memory, mapped here
    // The peer's device memory, imported here, and where the segment lies in it.
    std::shared_ptr<imported_allocation> device;
    std::uint64_t device_offset = 0;
  };

  std::string nonce_text() const { return fmt::format("{:016x}{:016x}", nonce_[0], nonce_[1]); }

  // The peer's pidfd (a copy of it) in the reactor: readable once the
  // process exited; the path then fails with peer_closed. Without a pidfd
  // (kernels before 5.3) the control channel closing says it, later. A peer
  // in this very process (two engines of one program) exits with us: not
  // watched, so an io_context run to completion still returns.
  void watch_exit() {
    if (!peer_->watch.watching() || peer_->pid == static_cast<std::int64_t>(::getpid())) return;
    const int fd = ::fcntl(peer_->watch.fd(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return;
    exit_watch_.emplace(ex_);
    std::error_code ec;
    exit_watch_->assign(fd, ec);
    if (ec) {
      ::close(fd);
      exit_watch_.reset();
      return;
    }
    exit_watch_->async_wait(asio::posix::stream_descriptor::wait_read,
                            [w = weak_from_this()](std::error_code wec) {
                              if (wec) return;
                              if (auto self = w.lock()) self->fail(errc::peer_closed);
                            });
  }

  // A lane's batch copied right here: host memory only, and small.
  static bool copies_here(const std::vector<copy_item>& batch) {
    std::uint64_t bytes = 0;
    for (const auto& c : batch) {
      if (c.on_device()) return false;
      bytes += c.s.length;
      if (bytes > inline_copy) return false;
    }
    return true;
  }

  // A peer in another process, whose descriptors we can take: it is asked
  // for a ring; in this very process (two engines of one program) or
  // without a pidfd, slices stay with the lanes.
  void ask_ring() {
    if (!proven_ || !peer_->watch.watching() ||
        peer_->pid == static_cast<std::int64_t>(::getpid())) {
      ring_state_ = ring_state::refused;
      return;
    }
    ring_state_ = ring_state::asked;
    ctx_.send({{"op", "ring"}});
  }

  void ring_granted(const nlohmann::json& body) {
    if (ring_state_ != ring_state::asked) return;
    std::string why;
    if (const auto it = body.find("error"); it != body.end()) {
      (void)control::get_field(body, "why", why);
      why = "it refused (" + why.substr(0, 256) + ")";
    } else {
      auto fatal = [w = weak_from_this()](std::error_code ec) {
        if (auto self = w.lock()) self->fail(ec);
      };
      ring_ = ring_client::open(ex_, host_, body, peer_->watch.fd(), std::move(fatal), why);
    }
    if (!ring_) {
      ring_state_ = ring_state::refused;
      detail::log(
          "shm: no ring with pid {}: {}; small slices to its private memory use "
          "cross-memory attach",
          peer_->pid, why);
      return;
    }
    ring_state_ = ring_state::ready;
  }

  // With a device runtime, its name: the target grants device segments
  // only to a peer that can import them.
  void request(std::uint64_t seg) {
    nlohmann::json body{{"op", "lease"}, {"segment", seg}};
    if (dev_.rt) body["device"] = std::string(dev_.rt->name());
    ctx_.send(std::move(body));
  }

  void place(std::size_t i, const slice_ref& s, const lease& l) {
    const errc e = detail::check_segment_access(
        l.length, l.granted, s.offset, s.length,
        s.kind == opcode::read ? access::remote_read : access::remote_write);
    if (e != errc{}) {
      rejects_.push_back({s.op, 0, e});
      return;
    }
    const memory_desc local = local_memory(s);
    if (!l.map && !l.device && local.kind == memory_kind::host && s.length > 0 &&
        s.length <= cfg_.ring_max && ring_state_ != ring_state::refused) {
      if (ring_ && ring_->fits(s.length)) {
        ring_->add(s);
        return;
      }
      if (ring_state_ == ring_state::none) ask_ring();
    }
    std::uint64_t remote = l.base + s.offset;
    if (l.device) {
      remote = reinterpret_cast<std::uintptr_t>(l.device->base() + l.device_offset + s.offset);
      if (local.kind == memory_kind::device) {
        i = static_cast<std::size_t>((s.offset / device_copy_run) % outbox_.size());
      }
    } else if (local.kind == memory_kind::host) {
      // A run of inline_copy bytes to one lane, then the next lane's.
      if (run_bytes_ >= inline_copy) {
        run_bytes_ = 0;
        run_lane_ = run_lane_ + 1 < outbox_.size() ? run_lane_ + 1 : 0;
        // Copied right here while no other thread was seen copying, but
        // for one run in probe_runs, which a lane copies to find out.
        run_here_ = elsewhere_->load(std::memory_order_relaxed) == 0 && ++runs_ % probe_runs != 0;
      }
      run_bytes_ += s.length;
      i = run_lane_;
      if (run_here_ && l.map && copy_placed(s, *l.map)) return;
    }
    outbox_[i].push_back(copy_item{s, remote, l.map, l.device, local});
  }

  // A host slice into mapped shared memory copied as it is placed, on the
  // engine's strand, while it is at hand (no batch entry, no lane, no hop;
  // reported at pump()). Taken when the lanes' batches were last seen to
  // run on this very thread: an io_context run by one thread copies them
  // after the planning anyway, on the same core; with more threads the
  // lanes copy beside it.
  bool copy_placed(const slice_ref& s, const peer_mapping& map) {
    if (s.length > cfg_.max_copy || host_.stopping(s.op) ||
        peer_->failed.load(std::memory_order_acquire)) {
      return false;
    }
    std::byte* there = map.segment() + s.offset;
    if (s.kind == opcode::read) {
      std::memcpy(s.local, there, static_cast<std::size_t>(s.length));
    } else {
      std::memcpy(there, s.local, static_cast<std::size_t>(s.length));
    }
    add_report(placed_done_, s.op, s.length);
    return true;
  }

  // Posts outbox i to its lane. Where the lane runs it says whether
  // another thread copies for this engine: one that does counts for the
  // next elsewhere_runs batches.
  void hand_out(std::size_t i) {
    auto batch = std::move(outbox_[i]);
    outbox_[i] = spare_->take();
    asio::post(lanes_[i]->get_executor(),
               [l = lanes_[i], spare = spare_, seen = elsewhere_, by = std::this_thread::get_id(),
                batch = std::move(batch)]() mutable {
                 if (std::this_thread::get_id() != by) {
                   seen->store(elsewhere_runs, std::memory_order_relaxed);
                 } else if (int n = seen->load(std::memory_order_relaxed); n > 0) {
                   seen->compare_exchange_strong(n, n - 1, std::memory_order_relaxed);
                 }
                 l->run(batch);
                 spare->give(std::move(batch));
               });
  }

  // What a slice's local memory is: its registered segment says.
  memory_desc local_memory(const slice_ref& s) const {
    if (!dev_.rt) return {};
    if (dev_.registry != nullptr && s.local_segment != 0) {
      if (const auto seg = dev_.registry->get(segment_id{s.local_segment})) return seg->memory;
    }
    return dev_.rt->classify(s.local).memory;
  }

  void proved(const nlohmann::json& body) {
    if (proven_) return;
    std::uint64_t at = 0;
    if (const auto it = body.find("at"); it != body.end() && it->is_number_unsigned()) {
      at = it->get<std::uint64_t>();
    }
    std::array<char, 32> seen{};
    const auto want = nonce_text();
    const auto ec = cma::read(static_cast<pid_t>(peer_->pid), at, seen.data(), seen.size());
    if (ec || std::string_view(seen.data(), seen.size()) != want) {
      detail::log(
          "shm: the peer's process (pid {}) did not prove it is the peer ({}): its "
          "descriptor names another process; disconnecting",
          peer_->pid, ec ? ec.message() : std::string("the nonce differs"));
      fail(errc::authentication_failed);
      return;
    }
    proven_ = true;
    for (const auto& [seg, w] : waiting_) {
      if (!w.empty()) request(seg);
    }
  }

  void granted(std::uint64_t seg, const nlohmann::json& body) {
    lease l;
    std::string acc;
    if (!control::get_field(body, "base", l.base) ||
        !control::get_field(body, "length", l.length) || !control::get_field(body, "access", acc)) {
      refused_with(seg, errc::malformed_message);
      return;
    }
    const auto parsed = control::parse_access(acc);
    if (!parsed || l.base + l.length < l.base) {
      refused_with(seg, errc::malformed_message);
      return;
    }
    l.granted = *parsed;
    if (body.contains("device")) {
      if (const errc e = import_device(seg, body["device"], l); e != errc{}) {
        // Given back at once: the target must not wait for it.
        ctx_.send({{"op", "released"}, {"segment", seg}});
        refused_with(seg, e);
        return;
      }
    } else if (body.contains("fd")) {
      l.map = map_shared(seg, body, l);
    }
    leases_[seg] = l;
    const auto it = waiting_.find(seg);
    if (it == waiting_.end()) return;
    auto w = std::move(it->second);
    waiting_.erase(it);
    for (const auto& [i, s] : w) place(i, s, l);
    pump();
  }

  void refused(std::uint64_t seg, const nlohmann::json& body) {
    int e = static_cast<int>(errc::not_registered);
    if (const auto it = body.find("error"); it != body.end() && it->is_number_integer()) {
      const int v = it->get<int>();
      if (v > 0 && v <= static_cast<int>(errc_last)) e = v;
    }
    // The target's words, said once per reason (a device segment refused
    // to a peer that cannot import it, say).
    if (std::string why; control::get_field(body, "why", why) && !why.empty() &&
                         said_.insert(why).second && said_.size() < 64) {
      detail::log("shm: pid {} refused segment {}: {}", peer_->pid, seg, why.substr(0, 512));
    }
    refused_with(seg, static_cast<errc>(e));
  }

  void refused_with(std::uint64_t seg, errc e) {
    const auto it = waiting_.find(seg);
    if (it == waiting_.end()) return;
    for (const auto& x : it->second) rejects_.push_back({x.second.op, 0, e});
    waiting_.erase(it);
    pump();
  }

  // The peer's segment lives in its shared memory (shm/memory.hpp): map it
  // here, through a duplicate of its file descriptor, after checking the
  // file is the one it named, sealed against shrinking and large enough.
  // Null (with the reason logged once): copy with cross-memory attach.
  std::shared_ptr<peer_mapping> map_shared(std::uint64_t seg, const nlohmann::json& body,
                                           const lease& l) {
    std::uint64_t fd = 0, off = 0, dev = 0, ino = 0;
    std::string why;
    int local = -1;
    if (!control::get_field(body, "fd", fd) || !control::get_field(body, "fd_offset", off) ||
        !control::get_field(body, "dev", dev) || !control::get_field(body, "ino", ino) ||
        fd > static_cast<std::uint64_t>(INT_MAX) || l.length == 0) {
      why = "its grant is malformed";
    } else if (!peer_->watch.watching()) {
      why = "no pidfd for its process";
    } else {
#ifdef SYS_pidfd_getfd
      local =
          static_cast<int>(::syscall(SYS_pidfd_getfd, peer_->watch.fd(), static_cast<int>(fd), 0));
      if (local < 0) why = fmt::format("pidfd_getfd: {}", std::strerror(errno));
#else
      why = "this build has no pidfd_getfd";
#endif
    }
    std::shared_ptr<peer_mapping> out;
    if (local >= 0) {
      struct stat st {};
      const int seals = ::fcntl(local, F_GET_SEALS);
      const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
      const std::uint64_t start = off / page * page;
      if (::fstat(local, &st) != 0 || static_cast<std::uint64_t>(st.st_dev) != dev ||
          static_cast<std::uint64_t>(st.st_ino) != ino) {
        why = "its descriptor is not the file it named";
      } else if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
        why = "its file is not sealed against shrinking";
      } else if (off > static_cast<std::uint64_t>(st.st_size) ||
                 l.length > static_cast<std::uint64_t>(st.st_size) - off) {
        why = "its file is smaller than the segment";
      } else {
        const int prot =
            (static_cast<unsigned>(l.granted) & static_cast<unsigned>(access::remote_write)) != 0
                ? PROT_READ | PROT_WRITE
                : PROT_READ;
        const std::size_t len = static_cast<std::size_t>(off - start + l.length);
        // Page tables filled now, once, rather than a fault per page in the
        // first copies (shm_prefault).
        const int populate = l.length <= cfg_.prefault ? MAP_POPULATE : 0;
        void* p =
            ::mmap(nullptr, len, prot, MAP_SHARED | populate, local, static_cast<off_t>(start));
        if (p == MAP_FAILED) {
          why = fmt::format("mmap: {}", std::strerror(errno));
        } else {
          out = std::make_shared<peer_mapping>(p, len, off - start);
        }
      }
      ::close(local);
    }
    if (!out && !mapping_refused_) {
      mapping_refused_ = true;
      detail::log(
          "shm: segment {} of pid {} is in shared memory but cannot be mapped here ({}): "
          "copying with cross-memory attach",
          seg, peer_->pid, why);
    }
    return out;
  }

  // The peer's segment is device memory: import its allocation through our
  // runtime (once per allocation; the lease shares it). errc{} with
  // l.device set, or why not: malformed_message for a grant that is not
  // one (a field missing or wrong, a descriptor that is not the peer's, an
  // allocation smaller than the segment, a method we do not know or our
  // runtime says it cannot be), transport_unavailable where importing is
  // impossible (no device runtime here, another one, the runtime failed).
  errc import_device(std::uint64_t seg, const nlohmann::json& j, lease& l) {
    device_grant g;
    std::string why;
    errc e = parse_device_grant(j, l.length, g, why);
    if (e == errc{} && !dev_.rt) {
      e = errc::transport_unavailable;
      why = fmt::format(
          "it is {} device memory and this engine has no device runtime (config.device)",
          g.runtime);
    } else if (e == errc{} && g.runtime != dev_.rt->name()) {
      e = errc::transport_unavailable;
      why = fmt::format("it is {} device memory and this engine's runtime is {}", g.runtime,
                        dev_.rt->name());
    } else if (e == errc{} && g.memory.device >= dev_.rt->device_count()) {
      e = errc::malformed_message;
      why = fmt::format("its grant names device {} (this host has {})", g.memory.device,
                        dev_.rt->device_count());
    }
    int fd = -1;
    std::string key = "ipc:" + control::to_hex(std::string_view(
                                   reinterpret_cast<const char*>(g.memory.handle.data()),
                                   g.memory.handle.size()));
    if (e == errc{} && method_uses_fd(g.memory.method)) {
      if (!peer_->watch.watching()) {
        e = errc::transport_unavailable;
        why = "no pidfd for its process, so its descriptor cannot be duplicated";
      } else {
#ifdef SYS_pidfd_getfd
        fd = static_cast<int>(
            ::syscall(SYS_pidfd_getfd, peer_->watch.fd(), static_cast<int>(g.memory.fd), 0));
        if (fd < 0) {
          e = errc::malformed_message;
          why = fmt::format("pidfd_getfd of its descriptor {}: {}", g.memory.fd,
                            std::strerror(errno));
        }
#else
        e = errc::transport_unavailable;
        why = "this build has no pidfd_getfd";
#endif
      }
      struct stat st {};
      if (fd >= 0 && ::fstat(fd, &st) != 0) {
        e = errc::malformed_message;
        why = fmt::format("fstat of its descriptor: {}", std::strerror(errno));
      }
      key = fmt::format("fd:{}:{}", static_cast<std::uint64_t>(st.st_dev),
                        static_cast<std::uint64_t>(st.st_ino));
    }
    if (e == errc{}) {
      auto& cached = imports_[key];
      if (auto a = cached.lock(); a && a->size() >= g.offset + l.length) {
        l.device = std::move(a);  // another segment of an allocation imported before
      } else {
        std::error_code ec;
        std::string what;
        void* p = dev_.rt->import_memory(g.memory, fd, ec, what);  // takes fd over
        fd = -1;
        if (p == nullptr && (l.device = own_allocation(g, l))) {
          l.device_offset = g.offset;
          return errc{};
        }
        if (p == nullptr) {
          e = ec == errc::invalid_argument ? errc::malformed_message : errc::transport_unavailable;
          why = fmt::format("{} could not import it: {}", dev_.rt->name(), what);
        } else {
          l.device =
              std::make_shared<imported_allocation>(dev_.rt, p, g.memory.device, g.memory.size);
          cached = l.device;
        }
      }
    }
    if (fd >= 0) ::close(fd);
    std::erase_if(imports_, [](const auto& kv) { return kv.second.expired(); });
    if (e != errc{}) {
      const auto text =
          fmt::format("device segment {} of pid {} cannot be reached: {}", seg, peer_->pid, why);
      if (said_.insert(text).second && said_.size() < 64) detail::log("shm: {}", text);
      return e;
    }
    l.device_offset = g.offset;
    return errc{};
  }

  // Two engines of this process: the allocation the grant names is already
  // ours where our runtime knows it as the grant says (same device, same
  // offset); null otherwise. CUDA refuses to open an IPC handle in the
  // process that made it.
  std::shared_ptr<imported_allocation> own_allocation(const device_grant& g, const lease& l) const {
    if (peer_->pid != static_cast<std::int64_t>(::getpid())) return nullptr;
    const auto info = dev_.rt->classify(reinterpret_cast<const void*>(l.base));
    if (info.memory.kind != memory_kind::device || info.memory.device != g.memory.device ||
        l.base - info.base != g.offset || info.size < g.offset + l.length) {
      return nullptr;
    }
    return imported_allocation::own(reinterpret_cast<void*>(info.base), g.memory.device, info.size);
  }

  // The peer unregisters `seg`: no new copy may start on it, and it hears
  // back once every lane finished what it was given before.
  void release(std::uint64_t seg) {
    leases_.erase(seg);
    // Slices placed but not handed out yet ask for a new lease (refused).
    for (std::size_t i = 0; i < outbox_.size(); ++i) {
      std::vector<copy_item> keep;
      for (auto& c : outbox_[i]) {
        if (c.s.segment == seg) {
          waiting_[seg].push_back({i, c.s});
        } else {
          keep.push_back(c);
        }
      }
      outbox_[i] = std::move(keep);
    }
    if (ring_) {
      for (const auto& s : ring_->take_segment(seg)) waiting_[seg].push_back({0, s});
    }
    if (const auto it = waiting_.find(seg); it != waiting_.end() && !it->second.empty()) {
      request(seg);
    }
    auto left = std::make_shared<std::atomic<std::size_t>>(lanes_.size() + (ring_ ? 1 : 0));
    auto answer = [send = ctx_.send, seg] { send({{"op", "released"}, {"segment", seg}}); };
    if (lanes_.empty() && !ring_) {
      answer();
      return;
    }
    if (ring_) {
      // Its slots hold pieces of any segment: those out now finish first.
      ring_->when_through([left, answer] {
        if (left->fetch_sub(1) == 1) answer();
      });
    }
    for (auto& l : lanes_) {
      asio::post(l->get_executor(), [l, left, answer, ex = ex_] {
        l->when_idle([left, answer, ex] {
          if (left->fetch_sub(1) == 1) asio::post(ex, answer);
        });
      });
    }
  }

  asio::any_io_executor ex_;
  transport_host& host_;
  path_context ctx_;
  std::shared_ptr<peer_process_state> peer_;
  shm_config cfg_;
  device_access dev_;
  std::string note_;
  // Imported device allocations of the peer, by identity (the file's
  // device and inode, or the IPC handle): shared by the leases on their
  // segments and the copies in flight; closed when the last lets go.
  std::map<std::string, std::weak_ptr<imported_allocation>> imports_;
  std::set<std::string> said_;  // refusal reasons logged
  std::vector<std::shared_ptr<lane>> lanes_;
  std::vector<double> weights_;
  std::vector<std::vector<copy_item>> outbox_;
  std::size_t run_lane_ = 0;     // the lane host slices go to now,
  std::uint64_t run_bytes_ = 0;  // and the bytes it got since
  std::map<std::uint64_t, std::vector<std::pair<std::size_t, slice_ref>>> waiting_;
  std::vector<slice_report> rejects_;
  std::vector<slice_report> placed_done_;  // copy_placed()'s, until pump()
  // Whether the run host slices go to now is copied at once (copy_placed),
  // and the runs started so far.
  bool run_here_ = false;
  std::uint64_t runs_ = 0;
  // Above zero: a lane's batch ran on another thread than the one that
  // handed it out, within the last elsewhere_runs batches (hand_out). One
  // at first: the first transfer's lanes find out.
  std::shared_ptr<std::atomic<int>> elsewhere_ = std::make_shared<std::atomic<int>>(1);
  std::vector<slice_report> inline_done_;  // pump()'s reports of inline copies, kept for their room
  // Batches come back from the lanes empty, their room kept for the next
  // ones: a batch of thousands of small pieces is megabytes, and memory
  // that fresh faults in again, page by page (about 2,300 faults per
  // 151 MB of 4 KiB pieces before).
  std::shared_ptr<batch_pool> spare_ = std::make_shared<batch_pool>();
  std::unordered_map<std::uint64_t, lease> leases_;
  std::array<std::uint64_t, 2> nonce_{};
  bool proven_ = false;
  bool failed_ = false;
  bool mapping_refused_ = false;
  std::error_code failure_;
  // The ring for small slices to the peer's private memory: asked for at
  // the first such slice (which, like those until it is granted, goes to
  // the lanes), refused for good when the peer or this end cannot make one.
  enum class ring_state { none, asked, ready, refused };
  ring_state ring_state_ = ring_state::none;
  std::shared_ptr<ring_client> ring_;
  std::optional<asio::posix::stream_descriptor> exit_watch_;  // last: closed first
};

class transport final : public kvlink::transport, public std::enable_shared_from_this<transport> {
 public:
  transport(transport_env env, shm_config cfg)
      : env_(std::move(env)), cfg_(cfg), self_(host_identity::self()) {
    std::random_device rd;
    probe_->cookie = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    // The kernel must let a process attach to itself; a seccomp filter or a
    // kernel without cross-memory attach does not.
    std::uint64_t back = 0;
    if (self_.boot_id.empty() || self_.pid_ns.empty()) {
      why_not_ = "cannot read this host's boot id or PID namespace from /proc";
    } else if (auto ec = cma::read(static_cast<pid_t>(self_.pid),
                                   reinterpret_cast<std::uintptr_t>(&probe_->cookie), &back,
                                   sizeof back)) {
      why_not_ = cma::refusal_reason(ec.value(), self_.pid);
    }
  }

  std::string_view name() const noexcept override { return "shm"; }
  bool available() const noexcept override { return why_not_.empty(); }
  std::string unavailable_reason() const override { return why_not_; }
  /// With a device runtime, device memory too: ours through its streams,
  /// the peer's imported (export/import of its allocation).
  memory_kinds reaches() const noexcept override {
    if (env_.device) return {memory_kind::host, memory_kind::device};
    return {memory_kind::host};
  }
  bool local_only() const noexcept override { return true; }
  /// Rings stop (their waits end): an io_context's run can return.
  void shutdown() override {
    std::vector<std::shared_ptr<ring_server>> rings;
    {
      std::lock_guard lock{mutex_};
      for (auto& [s, st] : sessions_) {
        if (st.ring) rings.push_back(std::move(st.ring));
      }
    }
    for (auto& r : rings) r->stop();
  }
  ~transport() override { shutdown(); }

  nlohmann::json describe() const override {
    nlohmann::json d{
        {"boot_id", self_.boot_id}, {"pid_ns", self_.pid_ns},
        {"host", self_.host},       {"pid", self_.pid},
        {"uid", self_.uid},         {"probe", reinterpret_cast<std::uintptr_t>(&probe_->cookie)},
        {"cookie", probe_->cookie}};
    if (env_.device) d["device"] = std::string(env_.device->name());
    return d;
  }

  bool reachable(const nlohmann::json& entry, std::string& why) const override {
    if (!entry.is_object() || !entry.contains("boot_id") || !entry["boot_id"].is_string() ||
        !entry.contains("pid_ns") || !entry["pid_ns"].is_string() || !entry.contains("pid") ||
        !entry["pid"].is_number_integer() || !entry.contains("probe") ||
        !entry["probe"].is_number_unsigned() || !entry.contains("cookie") ||
        !entry["cookie"].is_number_unsigned()) {
      why = "the peer's shm entry is malformed";
      return false;
    }
    const auto host = entry.value("host", std::string{});
    if (entry["boot_id"].get<std::string>() != self_.boot_id) {
      why = fmt::format("the peer runs on another host ({}; boot ids differ)",
                        host.empty() ? "unnamed" : host);
      return false;
    }
    const auto ns = entry["pid_ns"].get<std::string>();
    if (ns != self_.pid_ns) {
      why = fmt::format(
          "the peer runs in another PID namespace ({} there, {} here: containers that do not "
          "share one cannot attach to each other's memory)",
          ns, self_.pid_ns);
      return false;
    }
    const auto pid = entry["pid"].get<std::int64_t>();
    if (pid <= 0) {
      why = "the peer's shm entry names no process";
      return false;
    }
    std::uint64_t seen = 0;
    if (auto ec = cma::read(static_cast<pid_t>(pid), entry["probe"].get<std::uint64_t>(), &seen,
                            sizeof seen)) {
      why = cma::refusal_reason(ec.value(), pid);
      return false;
    }
    if (seen != entry["cookie"].get<std::uint64_t>()) {
      why = cma::refusal_reason(EFAULT, pid);
      return false;
    }
    return true;
  }

  asio::awaitable<std::error_code> connect(path_context ctx,
                                           std::shared_ptr<data_path>& out) override {
    const auto pid = ctx.entry.value("pid", std::int64_t{0});
    auto peer = std::make_shared<peer_process_state>(pid);
    const auto note = device_note(ctx.entry);
    auto p = std::make_shared<path>(env_.executor, *env_.host, std::move(ctx), std::move(peer),
                                    device_access{env_.device, env_.staging, env_.registry});
    p->set_note(note);
    p->open(
        cfg_.lanes, [this] { return env_.io_strand(); }, cfg_);
    out = std::move(p);
    co_return std::error_code{};
  }

  // ---------------------------------------------------------------- target

  std::optional<nlohmann::json> on_request(const void* session,
                                           const nlohmann::json& body) override {
    if (!body.is_object()) return std::nullopt;
    const auto op = body.value("op", std::string{});
    if (op == "prove") {
      const auto it = body.find("nonce");
      if (it == body.end() || !it->is_string() || it->get_ref<const std::string&>().size() != 32) {
        return std::nullopt;
      }
      std::lock_guard lock{mutex_};
      auto& s = sessions_[session];
      if (!s.proof) s.proof = std::make_unique<std::array<char, 32>>();
      const auto& n = it->get_ref<const std::string&>();
      std::copy(n.begin(), n.end(), s.proof->begin());
      return nlohmann::json{{"op", "proved"},
                            {"at", reinterpret_cast<std::uintptr_t>(s.proof->data())}};
    }
    if (op == "ring") return ring(session);
    const auto seg = body.find("segment");
    if (seg == body.end() || !seg->is_number_unsigned()) return std::nullopt;
    const segment_id id{seg->get<std::uint64_t>()};
    if (op == "lease") return lease(session, id, body);
    if (op == "released") {
      bool held = false;
      {
        std::lock_guard lock{mutex_};
        if (const auto it = sessions_.find(session); it != sessions_.end()) {
          held = it->second.leases.erase(id.value()) != 0;
        }
      }
      if (held) env_.host->unpin(id);
    }
    return std::nullopt;
  }

  void session_closed(const void* session) override {
    std::set<std::uint64_t> held;
    std::shared_ptr<ring_server> ring;
    {
      std::lock_guard lock{mutex_};
      const auto it = sessions_.find(session);
      if (it == sessions_.end()) return;
      held = std::move(it->second.leases);
      ring = std::move(it->second.ring);
      sessions_.erase(it);
    }
    if (ring) ring->stop();
    for (const auto id : held) env_.host->unpin(segment_id{id});
  }

  /// Asks every peer holding a lease on the segment to give it back.
  void unregister_memory(segment_id id) override {
    for (const auto* s : holders(id)) {
      if (!env_.session_send ||
          !env_.session_send(s, "shm", {{"op", "release"}, {"segment", id.value()}})) {
        drop_lease(s, id);
      }
    }
  }

  /// A peer kept a lease past fence_timeout: it is disconnected, and the
  /// lease dropped (its process could still copy if it ran on; see above).
  void revoke(segment_id id) override {
    for (const auto* s : holders(id)) {
      detail::log(
          "shm: a peer kept segment {} past fence_timeout while it was being "
          "unregistered: disconnecting it",
          id.value());
      drop_lease(s, id);
      if (env_.session_close) env_.session_close(s, errc::deadline_exceeded);
    }
  }

 private:
  struct session_state {
    std::set<std::uint64_t> leases;
    std::unique_ptr<std::array<char, 32>> proof;  // the nonce its path sent, for it to read
    std::shared_ptr<ring_server> ring;            // made when its path asks
  };

  // The session's ring (made once): its grant, or why not. The ring copies
  // only inside segments the session holds a lease on, each pinned while a
  // slot's pieces touch it.
  nlohmann::json ring(const void* session) {
    std::lock_guard lock{mutex_};
    auto& st = sessions_[session];
    if (!st.ring) {
      std::string why;
      auto acquire = [w = weak_from_this(), session](std::uint64_t id, ring_segment& out) {
        const auto self = w.lock();
        return self ? self->ring_acquire(session, id, out) : errc::peer_closed;
      };
      auto release = [w = weak_from_this()](std::uint64_t id) {
        if (const auto self = w.lock()) self->env_.host->unpin(segment_id{id});
      };
      st.ring = ring_server::make(env_.io_strand(), ring_shape{}, std::move(acquire),
                                  std::move(release), why);
      if (!st.ring) {
        return nlohmann::json{
            {"op", "ring"}, {"error", static_cast<int>(errc::transport_unavailable)}, {"why", why}};
      }
      st.ring->start();
    }
    return st.ring->grant();
  }

  errc ring_acquire(const void* session, std::uint64_t id, ring_segment& out) {
    {
      std::lock_guard lock{mutex_};
      const auto it = sessions_.find(session);
      if (it == sessions_.end() || !it->second.leases.contains(id)) return errc::not_registered;
    }
    const auto seg = env_.registry->get(segment_id{id});
    if (!seg) return errc::not_registered;
    if (seg->memory.kind != memory_kind::host) return errc::transport_unavailable;
    if (!env_.host->pin(segment_id{id})) return errc::not_registered;
    out = {reinterpret_cast<std::byte*>(seg->base), seg->length, seg->granted};
    return errc{};
  }
  // A word peers read to check they may attach and that the pid is ours.
  struct probe_word {
    std::uint64_t cookie = 0;
  };

  // How the peer whose entry is `entry` reaches device memory, where it
  // cannot import the peer's: said in its transport_reason().
  std::string device_note(const nlohmann::json& entry) const {
    const auto it = entry.find("device");
    if (it == entry.end() || !it->is_string()) return {};
    const auto& theirs = it->get_ref<const std::string&>();
    if (env_.device && theirs == env_.device->name()) return {};
    return fmt::format(
        "device memory: the peer's ({}) cannot be imported here ({}); its device segments are "
        "refused over shm (transport_unavailable): reach them over tcp, which stages them",
        theirs,
        env_.device ? fmt::format("this engine's runtime is {}", env_.device->name())
                    : std::string("this engine has no device runtime: config.device"));
  }

  nlohmann::json lease(const void* session, segment_id id, const nlohmann::json& body) {
    const auto refuse = [&](errc e, std::string why = {}) {
      nlohmann::json r{{"op", "refused"}, {"segment", id.value()}, {"error", static_cast<int>(e)}};
      if (!why.empty()) r["why"] = std::move(why);
      return r;
    };
    const auto seg = env_.registry->get(id);
    if (!seg) return refuse(errc::not_registered);
    std::optional<device_grant> dev;
    if (seg->memory.kind == memory_kind::device) {
      // Its allocation, exported for a peer with the same runtime.
      std::string theirs;
      (void)control::get_field(body, "device", theirs);
      if (!env_.device) return refuse(errc::transport_unavailable, "no device runtime here");
      if (theirs != env_.device->name()) {
        return refuse(errc::transport_unavailable,
                      fmt::format("segment {} is {} device memory, which the peer cannot import "
                                  "({})",
                                  id.value(), env_.device->name(),
                                  theirs.empty() ? std::string("it has no device runtime")
                                                 : "its runtime is " + theirs));
      }
      dev.emplace();
      dev->runtime = std::string(env_.device->name());
      std::string what;
      if (auto ec = env_.device->export_memory(reinterpret_cast<const void*>(seg->base),
                                               dev->memory, what)) {
        return refuse(errc::transport_unavailable,
                      fmt::format("segment {} cannot be exported: {}", id.value(), what));
      }
      const auto info = env_.device->classify(reinterpret_cast<const void*>(seg->base));
      dev->offset = static_cast<std::uint64_t>(seg->base - info.base);
    } else if (seg->memory.kind != memory_kind::host) {
      return refuse(errc::transport_unavailable);
    }
    {
      std::lock_guard lock{mutex_};
      auto& s = sessions_[session];
      if (!s.leases.contains(id.value())) {
        if (!env_.host->pin(id)) return refuse(errc::not_registered);
        s.leases.insert(id.value());
      }
    }
    nlohmann::json grant{{"op", "granted"},
                         {"segment", id.value()},
                         {"base", static_cast<std::uint64_t>(seg->base)},
                         {"length", seg->length},
                         {"access", control::to_string(seg->granted)}};
    if (dev) {
      grant["device"] = to_json(*dev);
    } else if (const auto r = find_shared(seg->base, seg->length)) {
      // In shared memory: the peer may map it and copy with memcpy.
      grant["fd"] = static_cast<std::uint64_t>(r->fd);
      grant["fd_offset"] = static_cast<std::uint64_t>(seg->base - r->base);
      grant["dev"] = r->dev;
      grant["ino"] = r->ino;
    }
    return grant;
  }

  // The sessions holding a lease on `id`.
  std::vector<const void*> holders(segment_id id) {
    std::vector<const void*> out;
    std::lock_guard lock{mutex_};
    for (const auto& [s, st] : sessions_) {
      if (st.leases.contains(id.value())) out.push_back(s);
    }
    return out;
  }

  void drop_lease(const void* session, segment_id id) {
    bool held = false;
    {
      std::lock_guard lock{mutex_};
      if (const auto it = sessions_.find(session); it != sessions_.end()) {
        held = it->second.leases.erase(id.value()) != 0;
      }
    }
    if (held) env_.host->unpin(id);
  }

  transport_env env_;
  shm_config cfg_;
  host_identity self_;
  std::unique_ptr<probe_word> probe_ = std::make_unique<probe_word>();
  std::string why_not_;
  std::mutex mutex_;
  std::map<const void*, session_state> sessions_;
};

}  // namespace kvlink::shm
