// The peer-to-peer metadata backend, kvlink's embedded default
// (config.metadata = "p2p"): a peer's name is its address ("host:port"),
// its descriptor arrives with the handshake's welcome, and an engine whose
// segments change sends its new segment list ("segments") to every peer
// that connected to it, over their control sessions. No store, no lease:
// a peer that goes away is noticed when its connections close.
#pragma once

#include <kvlink/control/descriptor.hpp>
#include <kvlink/core/address.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/metadata/backend.hpp>

#include <functional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/post.hpp>
#include <nlohmann/json.hpp>

namespace kvlink {

class p2p_metadata final : public metadata_backend {
 public:
  /// `broadcast` sends a message to every peer connected to this engine
  /// (its accepted control sessions).
  p2p_metadata(asio::any_io_executor ex, std::function<void(const nlohmann::json&)> broadcast)
      : ex_(std::move(ex)), broadcast_(std::move(broadcast)) {}

  std::string_view name() const noexcept override { return "p2p"; }

  /// Peers that connect later get the descriptor in their handshake; those
  /// connected now get the new segment list.
  void publish(const control::peer_descriptor& self) override {
    broadcast_(control::make_segments(self.segments, self.seq));
  }

  void withdraw(std::function<void()> done) override { done(); }

  /// The name must be "host:port" (core/address.hpp); anything else is
  /// invalid_argument.
  void resolve(std::string name, resolve_handler h) override {
    std::string_view host;
    std::uint16_t port = 0;
    std::error_code ec;
    if (!split_host_port(name, host, port)) ec = errc::invalid_argument;
    asio::post(ex_, [h = std::move(h), ec, name = std::move(name)]() mutable {
      h(ec, resolved_peer{ec ? std::string{} : std::move(name), std::nullopt});
    });
  }

  void watch(change_fn on_change) override { on_change_ = std::move(on_change); }

  /// "segments" from a peer: its segment list as it is now. A malformed one
  /// is ignored (the target checks every access anyway).
  void on_peer_message(const instance_id& from, const nlohmann::json& msg) override {
    metadata_event e;
    if (!on_change_ || !segments_event(from, msg, e)) return;
    on_change_(e);
  }

 private:
  asio::any_io_executor ex_;
  std::function<void(const nlohmann::json&)> broadcast_;
  change_fn on_change_;
};

}  // namespace kvlink
