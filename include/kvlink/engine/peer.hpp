// A connected peer: the engine's state about it (peer_state) and the cheap,
// copyable handle users hold (kvlink::peer).
#pragma once

#include <kvlink/control/channel.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/transport/transport.hpp>

#include <atomic>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

namespace kvlink {

class engine;

namespace detail {

class engine_core;

struct peer_state {
  peer_id id;
  instance_id instance;
  std::string address;                      ///< where it was reached (host:port)
  std::string name;                         ///< the name it was connected by (p2p: its address)
  std::string transport;                    ///< the transport that carries its data
  std::string transport_reason;             ///< why that one (and not the others)
  memory_kinds reaches{memory_kind::host};  ///< what that transport reads and writes directly
  const ::kvlink::transport* carrier = nullptr;  ///< that transport (lives as long as the engine)
  std::shared_ptr<remote_segment_cache> cache;
  std::atomic<bool> alive{true};
  // Strand-only from here.
  std::shared_ptr<control::channel> control;
  std::shared_ptr<data_path> path;
  std::error_code failure;
};

}  // namespace detail

/// A connected peer, as the local engine sees it: a cheap, copyable handle.
class peer {
 public:
  peer() = default;

  bool valid() const noexcept { return state_ != nullptr; }
  peer_id id() const noexcept { return state_ ? state_->id : peer_id{}; }
  instance_id instance() const noexcept { return state_ ? state_->instance : instance_id{}; }
  /// The address it was reached at (host:port).
  const std::string& address() const { return checked().address; }
  /// The name it was connected by (async_connect's argument; with the p2p
  /// backend, its address).
  const std::string& name() const { return checked().name; }
  /// Which transport carries its data ("rdma", "tcp", ...): the first of the
  /// engine's config.transports that both engines can use.
  const std::string& transport() const { return checked().transport; }
  /// Why that transport: its name, and for each preferred transport passed
  /// over, why ("tcp (rdma: the peer offers no rdma)").
  const std::string& transport_reason() const { return checked().transport_reason; }
  /// False once its connections were lost or closed.
  bool connected() const noexcept {
    return state_ && state_->alive.load(std::memory_order_acquire);
  }

  /// Its segments as last announced (ordered by id). Registrations the peer
  /// makes later are pushed to this engine over the control channel.
  std::vector<remote_segment_info> segments() const {
    const auto& s = checked();
    return s.cache->segments(s.instance);
  }

  /// The `index`-th of segments(); throws std::out_of_range.
  remote_segment segment(std::size_t index) const {
    const auto segs = segments();
    if (index >= segs.size()) {
      throw std::out_of_range(fmt::format("kvlink: peer {} has {} segments, no segment #{}",
                                          address(), segs.size(), index));
    }
    return remote_segment{id(), segs[index].id};
  }

  /// A segment of this peer by its id (learned out of band, say). Not
  /// checked here: the target checks every access.
  remote_segment segment(segment_id sid) const noexcept { return remote_segment{id(), sid}; }

 private:
  friend class detail::engine_core;
  friend class engine;
  explicit peer(std::shared_ptr<detail::peer_state> s) : state_(std::move(s)) {}
  const detail::peer_state& checked() const {
    if (!state_) throw std::logic_error("kvlink: empty peer handle");
    return *state_;
  }
  std::shared_ptr<detail::peer_state> state_;
};

}  // namespace kvlink
