// What the engine needs of a one-sided transport that runs beside TCP (RDMA
// verbs: rdma/transport.hpp). The engine keeps TCP for the handshake, the
// control channel and peers the fabric cannot reach; the fabric registers
// memory with its devices, describes itself in the peer descriptor, builds a
// data path to a peer that offers it too, and answers the connection
// requests such paths send over the control channel.
//
// Everything runs on the engine's strand except register_memory(),
// unregister_memory() and rkeys(), which may be called from any thread.
#pragma once

#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/detail/transfer_op.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlink::detail {

/// A fabric's data path to one peer. Besides carrying slices it takes the
/// peer's replies to the connection requests it sent.
class fabric_path : public lane_base {
 public:
  virtual void on_control(const nlohmann::json& msg) = 0;
};

/// What a path needs from the engine to reach its peer.
struct path_context {
  instance_id peer;
  std::shared_ptr<remote_segment_cache> cache;
  /// Sends a message over the peer's control channel.
  std::function<void(const nlohmann::json&)> send;
  /// Called once when the path fails for good (the peer is gone).
  std::function<void(std::error_code)> on_failure;
};

class fabric {
 public:
  virtual ~fabric() = default;

  /// "rdma": the key of its entry in the peer descriptor's transports.
  virtual std::string_view name() const noexcept = 0;
  /// Whether it has a usable device; when not, why not.
  virtual bool available() const noexcept = 0;
  virtual const std::string& unavailable_reason() const noexcept = 0;
  /// Starts completion polling (once, after construction).
  virtual void start() = 0;
  /// Its descriptor entry (devices, GIDs and why, MTUs).
  virtual nlohmann::json describe() const = 0;

  /// Registers memory with every device; `what` gets the failing call on
  /// error ("ibv_reg_mr(segment 3 on rxe0): Cannot allocate memory").
  virtual std::error_code register_memory(segment_id id, void* base, std::uint64_t length,
                                          access granted, std::string& what) = 0;
  /// Deregisters; once it returns no device reads or writes the memory.
  virtual void unregister_memory(segment_id id) = 0;
  /// Remote keys of a segment, one per device in descriptor order.
  virtual std::vector<std::uint32_t> rkeys(segment_id id) const = 0;

  /// Whether a peer whose descriptor entry is `remote` can be reached; when
  /// not, `why` says so.
  virtual bool reachable(const nlohmann::json& remote, std::string& why) const = 0;
  /// A path to that peer. Connects lazily: nothing happens on the wire until
  /// the first slice is queued.
  virtual std::shared_ptr<fabric_path> make_path(const nlohmann::json& remote, transport_host& host,
                                                 path_context ctx) = 0;

  /// Target side: a request from a peer's path over the control channel
  /// `session` (an opaque key); returns the reply to send, if any.
  virtual std::optional<nlohmann::json> on_request(const void* session,
                                                   const nlohmann::json& msg) = 0;
  /// The control channel `session` closed: drop what was set up for it.
  virtual void session_closed(const void* session) = 0;

  /// Stops polling and releases the devices' queue pairs.
  virtual void shutdown() = 0;
};

}  // namespace kvlink::detail
