// The metadata seam: where an engine publishes its descriptor and finds its
// peers. The embedded default is peer to peer (metadata/p2p.hpp): a peer is
// named by its address, its descriptor comes with the handshake, and later
// changes travel over the control channels. A cluster store (etcd, Mooncake's
// HTTP metadata server) is another backend behind the same interface:
// publish under a name, resolve a name, withdraw, and watch peers' changes.
//
// Threads: every member is called on the engine's strand; handlers and
// watch callbacks run there too.
#pragma once

#include <kvlink/control/descriptor.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/detail/erased_handler.hpp>

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlink {

/// Where to reach a peer found by name.
struct resolved_peer {
  std::string address;  ///< host:port of its listener
  /// Its descriptor when the backend has one (a store); nullopt when the
  /// handshake brings it (p2p).
  std::optional<control::peer_descriptor> descriptor;
};

class metadata_backend {
 public:
  using resolve_handler = std::function<void(std::error_code, resolved_peer)>;
  using change_fn = std::function<void(const instance_id&, std::vector<remote_segment_info>)>;

  virtual ~metadata_backend() = default;

  /// "p2p", "etcd", ...
  virtual std::string_view name() const noexcept = 0;
  /// Publishes (or republishes, after segments changed) this engine's descriptor.
  virtual void publish(const control::peer_descriptor& self) = 0;
  /// Withdraws it (clean shutdown).
  virtual void withdraw() = 0;
  /// Finds a peer by name; the handler runs later, never inside the call.
  virtual void resolve(std::string name, resolve_handler h) = 0;
  /// Calls `on_change` with a peer's new segment list whenever it changes.
  /// One callback for all peers, set once by the engine.
  virtual void watch(change_fn on_change) = 0;
  /// A message a peer sent over its control channel that belongs to the
  /// backend (p2p carries descriptor updates this way); others ignore it.
  virtual void on_peer_message(const instance_id& from, const nlohmann::json& msg) {
    (void)from;
    (void)msg;
  }
};

}  // namespace kvlink
