// The metadata seam: where an engine publishes its descriptor and finds its
// peers. The embedded default is peer to peer (metadata/p2p.hpp): a peer is
// named by its address, its descriptor comes with the handshake, and later
// changes travel over the control channels. A cluster store is another
// backend behind the same interface (metadata/etcd.hpp, metadata/http.hpp):
// publish under a name, resolve a name, withdraw, and watch peers' changes.
//
// What a store says is a hint, never a credential: the engine still runs the
// authenticated handshake with whatever address a name resolves to, and
// keeps the peer only if it says (authenticated) that it is that name.
//
// Threads: every member is called on the engine's strand; handlers and
// watch callbacks run there too.
#pragma once

#include <kvlink/control/descriptor.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/detail/erased_handler.hpp>

#include <cstdint>
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

/// A change the backend saw in a peer's descriptor.
struct metadata_event {
  enum class kind : std::uint8_t {
    published,  ///< (re)published: maybe a new instance under the name, maybe new segments
    withdrawn,  ///< gone from the store: withdrawn, or its lease expired
  };
  kind what = kind::published;
  std::string name;        ///< "" when the backend does not know it (p2p)
  instance_id instance{};  ///< the instance it is about (withdrawn: the one that was there)
  std::uint64_t seq = 0;   ///< the descriptor's seq; 0 = unordered
  std::vector<remote_segment_info> segments;  ///< published: the segment list as it is now
};

class metadata_backend {
 public:
  using resolve_handler = std::function<void(std::error_code, resolved_peer)>;
  using change_fn = std::function<void(const metadata_event&)>;

  virtual ~metadata_backend() = default;

  /// "p2p", "etcd", "http".
  virtual std::string_view name() const noexcept = 0;
  /// Publishes (or republishes, after segments changed) this engine's descriptor.
  virtual void publish(const control::peer_descriptor& self) = 0;
  /// Withdraws it (clean shutdown) and stops watching. `done` runs once the
  /// store has been told, or after a short bound when it cannot be; it may
  /// run inside the call.
  virtual void withdraw(std::function<void()> done) = 0;
  /// Finds a peer by name; the handler runs later, never inside the call.
  /// Errors: invalid_argument (not a name this backend takes),
  /// name_not_found, metadata_unavailable.
  virtual void resolve(std::string name, resolve_handler h) = 0;
  /// Calls `on_change` for every change it sees in peers' descriptors. One
  /// callback for all peers, set once by the engine.
  virtual void watch(change_fn on_change) = 0;
  /// A message a peer sent over its control channel that belongs to the
  /// backend (descriptor updates travel this way); others ignore it.
  virtual void on_peer_message(const instance_id& from, const nlohmann::json& msg) {
    (void)from;
    (void)msg;
  }
};

/// Reads a "segments" control message (control::make_segments) into a
/// published event; false for anything else or a malformed one (the target
/// checks every access anyway, so dropping it is safe).
inline bool segments_event(const instance_id& from, const nlohmann::json& msg,
                           metadata_event& out) {
  if (msg.value("type", std::string{}) != "segments") return false;
  const auto it = msg.find("segments");
  if (it == msg.end()) return false;
  out = metadata_event{};
  out.instance = from;
  if (control::segments_from_json(*it, out.segments)) return false;
  if (msg.contains("seq") && !control::get_field(msg, "seq", out.seq)) return false;
  return true;
}

}  // namespace kvlink
