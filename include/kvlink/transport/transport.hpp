// What a transport is to the engine, and what the engine is to a transport.
//
// A transport (tcp/, rdma/, shm/; later CUDA IPC) moves the
// slices the planner cut to one peer's memory and back. It registers memory
// with its devices, describes itself in the peer descriptor (its entry under
// "transports" and an opaque key per segment under "keys"), says whether a
// peer's entry is reachable and why not, builds a data path to a peer,
// takes inbound connections that name it, answers its peers' control
// requests, and shuts down. Everything above it (slicing, striping over
// lanes, completion fan-in, deadlines, the fence, notifications) lives once,
// in the engine.
//
// Threads: the engine calls every member of a transport and of a data path
// on its strand, except register_memory(), unregister_memory() and
// segment_key(), which may be called from any thread. What a path does I/O
// on is its own business: TCP gives each lane (and each served lane) a
// strand of its own on the engine's executor (transport_env::io), so an
// io_context run by N threads moves data on up to N cores. The
// transport_host calls are made from any of those strands.
#pragma once

#include <kvlink/control/handshake.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/memory/device.hpp>
#include <kvlink/memory/staging.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/strand.hpp>
#include <nlohmann/json.hpp>

namespace kvlink {

namespace detail {
struct transfer_op;  // the engine's state of one transfer: an opaque key to transports

/// Whether the calling thread is closing an engine inline: its close() runs
/// where no handler of the engine can run concurrently or before the
/// caller frees its memory (inside the one thread that runs its io_context,
/// or with the io_context stopped). Transports then close their
/// connections directly instead of on the connections' strands.
inline bool& closing_inline() noexcept {
  thread_local bool flag = false;
  return flag;
}
}  // namespace detail

/// One slice as a transport sees it: where the local bytes are, where they go
/// on the peer, and the transfer it belongs to.
struct slice_ref {
  detail::transfer_op* op = nullptr;
  std::byte* local = nullptr;
  std::uint64_t length = 0;
  std::uint64_t segment = 0;  ///< the peer's segment id
  std::uint64_t offset = 0;   ///< offset inside that segment
  opcode kind = opcode::write;
  std::uint64_t tag = 0;            ///< set by the transport when the slice is sent
  std::uint64_t local_segment = 0;  ///< the registered local segment holding `local`
  /// Check the payload end to end with a CRC32C (transports that can; TCP).
  bool checksum = false;
};

/// Finished slices of one transfer, for transport_host::slices_done: one
/// slice, or `slices` of them that all succeeded (`bytes`: theirs in all; a
/// transport that resolves thousands of small slices at once reports them
/// as one). A failed slice is reported alone.
struct slice_report {
  detail::transfer_op* op = nullptr;
  std::uint64_t bytes = 0;
  std::error_code ec;
  std::uint32_t slices = 1;
};

/// Adds a successful slice of `op` to `done`: to its last report when that
/// is of the same transfer and succeeded too, else as a report of its own.
inline void add_report(std::vector<slice_report>& done, detail::transfer_op* op,
                       std::uint64_t bytes, std::error_code ec = {}) {
  if (!ec && !done.empty()) {
    auto& last = done.back();
    if (last.op == op && !last.ec && last.slices < std::numeric_limits<std::uint32_t>::max()) {
      last.bytes += bytes;
      ++last.slices;
      return;
    }
  }
  done.push_back({op, bytes, ec});
}

/// The engine, as its transports see it. Every member may be called from
/// any thread.
class transport_host {
 public:
  /// A slice finished: `bytes` reached their destination, or `ec` says why
  /// not. Called exactly once per slice handed to a path, only once the
  /// transport no longer touches the slice's local memory.
  virtual void slice_done(detail::transfer_op* op, std::uint64_t bytes, std::error_code ec) = 0;
  /// Several slices finished (one hop to the engine's strand for all).
  virtual void slices_done(std::span<const slice_report> done) {
    for (const auto& d : done) {
      slice_done(d.op, d.bytes, d.ec);
      for (std::uint32_t i = 1; i < d.slices; ++i) slice_done(d.op, 0, d.ec);
    }
  }
  /// Whether the slice's transfer is stopping (failed, cancelled, past its
  /// deadline): a transport retries nothing for it, and may resolve its
  /// slices not yet sent with errc::cancelled instead of sending them. Valid
  /// while the transport holds one of the transfer's slices.
  virtual bool stopping(const detail::transfer_op* op) const noexcept = 0;
  /// Target side: a peer's validated access is about to touch (pin) or has
  /// finished touching (unpin) a registered segment. Unregistration waits
  /// until no pin is left. pin() is false when the segment is being
  /// unregistered (it was checked, then removed, on another thread): the
  /// access must be refused (not_registered), and not unpinned.
  [[nodiscard]] virtual bool pin(segment_id id) = 0;
  virtual void unpin(segment_id id) = 0;
  /// Keeps the host alive: a path or lane whose handlers may run after the
  /// engine closed holds it (null: the host outlives its transports).
  virtual std::shared_ptr<transport_host> keep_alive() { return nullptr; }

 protected:
  ~transport_host() = default;
};

/// A transport's data path to one peer: one or more lanes (TCP connections;
/// an RDMA path is one lane that spreads over rails itself) that the planner
/// stripes slices over, in proportion to their weights.
class data_path {
 public:
  virtual ~data_path() = default;
  /// One weight per lane; the planner gives each lane its share of a batch.
  virtual std::span<const double> lane_weights() const noexcept = 0;
  /// The slice size for requests whose local memory is device memory
  /// (`configured`: config.slice_size). A path whose copies cost about the
  /// same per slice whatever its size (shm's device streams) asks for
  /// larger ones: the per-slice cost of the engine decides there.
  virtual std::uint64_t device_slice_size(std::uint64_t configured) const noexcept {
    return configured;
  }
  /// Groups of at most this many bytes may be offered to copy_now() (0:
  /// this path copies nothing on the engine's strand by itself).
  virtual std::uint64_t copy_now_max() const noexcept { return 0; }
  /// Moves `slices` (one transfer's, host memory on this side, no checksum)
  /// right here, on the engine's strand, when this path can move every one
  /// of them at once without waiting (shm: memcpy into the peer's mapped
  /// shared memory): returns their bytes, and the transfer counts them as
  /// done. nullopt: it cannot; nothing was moved, and the slices take the
  /// usual way (enqueue(), pump(), slice_done).
  virtual std::optional<std::uint64_t> copy_now(std::span<const slice_ref> slices) {
    (void)slices;
    return std::nullopt;
  }
  /// Starts receiving (once, after the path was made).
  virtual void start() = 0;
  /// Queues a slice on a lane; pump() sends what the lanes' windows allow.
  virtual void enqueue(std::size_t lane, const slice_ref& s) = 0;
  virtual void pump() = 0;
  /// `op` is stopping: removes its queued (not yet sent) slices. Those it
  /// removes here are counted in the result and not reported through
  /// slice_done (the caller accounts for them); a path whose lanes run on
  /// strands of their own resolves the ones they hold later, through
  /// slice_done with errc::cancelled.
  virtual std::size_t drop_queued(const detail::transfer_op* op) = 0;
  /// Whether slices of `op` may be in flight (true when the path cannot
  /// tell from the engine's strand).
  virtual bool has_in_flight(const detail::transfer_op* op) const = 0;
  /// The fence: `op`'s in-flight slices did not drain in time. Stop whatever
  /// carries them; each is reported through slice_done once nothing can
  /// touch its memory any more (possibly after this returns).
  virtual void fence(const detail::transfer_op* op, std::error_code ec) = 0;
  /// Stops the path for good: every queued and in-flight slice is reported
  /// with `ec`, each only once nothing touches its memory (possibly after
  /// this returns).
  virtual void fail(std::error_code ec) = 0;
  /// A message the peer's transport sent back over the control channel
  /// (answers to this path's requests).
  virtual void on_message(const nlohmann::json& body) { (void)body; }
  /// What the peer's transport_reason() adds about this path (shm: the
  /// peer's device memory cannot be imported here, and what happens to it);
  /// empty: nothing. Read once, when the path was made.
  virtual std::string note() const { return {}; }
};

/// What a transport needs to make a path to one peer.
struct path_context {
  instance_id peer;
  /// The peer's entry for this transport in its descriptor.
  nlohmann::json entry;
  /// Where the engine's control connection reached the peer: transports that
  /// connect through the peer's listener (TCP lanes) go there.
  asio::ip::tcp::endpoint endpoint;
  /// The peer's segments as announced, with their keys.
  std::shared_ptr<const remote_segment_cache> cache;
  /// Sends a message to the peer's transport of the same name, over the
  /// control channel (answers come back through data_path::on_message).
  std::function<void(nlohmann::json)> send;
  /// Called once when the path fails for good (the peer is gone).
  std::function<void(std::error_code)> on_failure;
  /// With authentication: the control connection's session, which this
  /// path's own connections (TCP lanes) prove they belong to.
  control::session_keys session;
};

/// What every transport gets from its engine.
struct transport_env {
  /// The engine's strand: every call but the memory ones runs on it.
  asio::any_io_executor executor;
  transport_host* host = nullptr;
  /// Target side: checks every (segment, offset, length, access) a peer asks for.
  const segment_registry* registry = nullptr;
  instance_id self{};
  std::chrono::milliseconds connect_timeout{5000};
  std::uint64_t max_control_message = 1 << 20;
  /// The shared secret connections prove (null or without one: none).
  const control::peer_guard* guard = nullptr;
  /// The executor the engine was given (its strand runs on it): transports
  /// make strands of their own on it for their I/O. Empty: use `executor`.
  asio::any_io_executor io{};

  /// Target side: sends `body` to the peer's transport named `transport` over
  /// the control session `session` (the key on_request was given); false
  /// when that session is gone. Strand-only.
  std::function<bool(const void* session, std::string_view transport, nlohmann::json body)>
      session_send{};
  /// Target side: closes the control session `session` (a peer that broke
  /// the transport's rules, or kept memory past fence_timeout). Strand-only.
  std::function<void(const void* session, std::error_code why)> session_close{};

  /// The engine's device runtime (config.device; null: none). A transport
  /// whose reaches() lacks memory_kind::device serves its peers' accesses
  /// to device segments through `target_staging` (a WRITE lands in a pinned
  /// chunk, then is copied to the device; it is acknowledged only after
  /// that copy finished).
  std::shared_ptr<device_runtime> device{};
  std::shared_ptr<staging_pool> target_staging{};
  /// The initiator side's staging (the engine stages local device slices
  /// itself for transports that do not reach device memory; one that does,
  /// shm, may borrow chunks here for the combinations it cannot copy
  /// directly).
  std::shared_ptr<staging_pool> staging{};

  /// A new strand for one connection's I/O (the engine's strand without `io`).
  asio::any_io_executor io_strand() const {
    return io ? asio::any_io_executor(asio::make_strand(io)) : executor;
  }
};

class transport {
 public:
  virtual ~transport() = default;

  /// Its name: the key of its descriptor entry, what peer::transport() says.
  virtual std::string_view name() const noexcept = 0;
  /// Usable on this machine; when not, why not (no device, ...).
  virtual bool available() const noexcept = 0;
  virtual std::string unavailable_reason() const = 0;
  /// The memory kinds it reads and writes directly.
  virtual memory_kinds reaches() const noexcept = 0;
  /// Whether it reads and writes this registered local segment directly;
  /// when not, the engine moves the segment's slices through staging
  /// (RDMA reaches device memory only where GPUDirect registered it).
  virtual bool reaches_segment(const segment_info& seg) const {
    return reaches().contains(seg.memory.kind);
  }
  /// Reaches only peers on the same host (shm): passing it over for a peer
  /// elsewhere makes no TCP a fallback (config.allow_tcp_fallback is about
  /// network transports).
  virtual bool local_only() const noexcept { return false; }
  /// Starts background work (completion polling), once.
  virtual void start() {}
  /// Stops everything; its paths fail. Called once, on the strand.
  virtual void shutdown() = 0;

  /// Registers memory with its devices (any thread). `what` gets the failing
  /// call on error ("ibv_reg_mr(segment 3 on rxe0): Cannot allocate memory").
  virtual std::error_code register_memory(const segment_info& seg, std::string& what) {
    (void)seg;
    (void)what;
    return {};
  }
  /// Deregisters; once it returns no device of its reads or writes the memory.
  virtual void unregister_memory(segment_id id) { (void)id; }
  /// Unregistration waited fence_timeout for peers' accesses to a segment:
  /// close whatever still holds it (a peer's connection that stopped
  /// reading), which releases its pins (possibly after this returns).
  virtual void revoke(segment_id id) { (void)id; }
  /// What peers need to address the segment through it (null: nothing).
  virtual nlohmann::json segment_key(segment_id id) const {
    (void)id;
    return nullptr;
  }

  /// Its descriptor entry.
  virtual nlohmann::json describe() const = 0;
  /// Whether a peer whose entry is `entry` can be reached; when not, `why`.
  virtual bool reachable(const nlohmann::json& entry, std::string& why) const = 0;
  /// Makes a data path to a peer (TCP opens its lanes here; RDMA connects
  /// lazily, on the first slice).
  virtual asio::awaitable<std::error_code> connect(path_context ctx,
                                                   std::shared_ptr<data_path>& out) = 0;

  /// An inbound connection whose hello named this transport (after the
  /// engine's handshake answered it). `lease` counts it among the engine's
  /// open connections: hold it until the connection closes. The default
  /// refuses it.
  virtual void accept_lane(asio::ip::tcp::socket socket, const control::hello& h,
                           std::shared_ptr<void> lease) {
    (void)h;
    (void)lease;
    std::error_code ignored;
    socket.close(ignored);
  }
  /// A request from a peer's path over the control session `session` (an
  /// opaque key); returns the answer to send back, if any.
  virtual std::optional<nlohmann::json> on_request(const void* session,
                                                   const nlohmann::json& body) {
    (void)session;
    (void)body;
    return std::nullopt;
  }
  /// The control session `session` closed: drop what was set up for it.
  virtual void session_closed(const void* session) { (void)session; }
};

}  // namespace kvlink
