// Engine-internal state shared by the engine and its transports: one
// transfer's completion counter, and the slices that transports carry.
// Everything here is touched only on the engine's strand.
#pragma once

#include <kvlink/core/types.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <system_error>

namespace kvlink::detail {

struct transfer_op;

/// One slice as a transport sees it: where the local bytes are, where they go
/// on the peer, and the transfer it belongs to.
struct slice_ref {
  transfer_op* op = nullptr;
  std::byte* local = nullptr;
  std::uint64_t length = 0;
  std::uint64_t segment = 0;
  std::uint64_t offset = 0;
  opcode kind = opcode::write;
  std::uint64_t tag = 0;            ///< set by the lane when the slice is sent
  std::uint64_t local_segment = 0;  ///< the registered segment holding `local`
};

/// What transports report to (the engine core implements it).
class transport_host {
 public:
  /// A slice finished: `bytes` reached their destination, or `ec` says why
  /// not. Called exactly once per slice handed to a transport, on the strand,
  /// only once the transport no longer touches the slice's local memory.
  virtual void slice_done(transfer_op* op, std::uint64_t bytes, std::error_code ec) = 0;
  /// Target side: a validated frame is about to touch (pin) or has finished
  /// touching (unpin) a registered segment. Unregistration waits for pins.
  virtual void pin(segment_id id) = 0;
  virtual void unpin(segment_id id) = 0;

 protected:
  ~transport_host() = default;
};

/// What the engine needs of a lane: a path that carries slices to one peer
/// (a TCP connection, or an RDMA path over several rails and queue pairs).
/// Everything is called on the engine's strand.
class lane_base {
 public:
  virtual ~lane_base() = default;
  /// Starts receiving (called once the peer is set up).
  virtual void start() = 0;
  /// Queues a slice; pump() sends what the lane's window allows.
  virtual void enqueue(const slice_ref& s) = 0;
  virtual void pump() = 0;
  /// Removes queued (not yet sent) slices of `op`; returns how many. They are
  /// not reported through slice_done: the caller accounts for them.
  virtual std::size_t drop_queued(const transfer_op* op) = 0;
  virtual bool has_in_flight(const transfer_op* op) const = 0;
  /// Stops the lane for good: every queued and in-flight slice is reported
  /// done with `ec`, each only once nothing touches its memory any more.
  virtual void fail(std::error_code ec) = 0;
};

}  // namespace kvlink::detail
