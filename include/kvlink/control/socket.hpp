// Socket helpers of the control plane, used by the handshake, the control
// channel and the TCP transport's lanes: what a socket error means to a
// user, the options every connection gets, and a watchdog that closes a
// socket whose set-up step takes too long.
#pragma once

#include <kvlink/core/address.hpp>
#include <kvlink/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <system_error>

#include <asio/any_io_executor.hpp>
#include <asio/error.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/steady_timer.hpp>

namespace kvlink::control {

/// Maps socket-level failures to what a user can act on: a peer that went
/// away is errc::peer_closed; anything else keeps its system error.
inline std::error_code map_socket_error(std::error_code ec) {
  if (ec == asio::error::eof || ec == asio::error::connection_reset ||
      ec == asio::error::broken_pipe || ec == asio::error::connection_aborted ||
      ec == asio::error::not_connected) {
    return errc::peer_closed;
  }
  return ec;
}

/// The options every connection of an engine gets.
struct socket_options {
  bool nodelay = true;
  std::uint64_t buffer = 0;  ///< SO_SNDBUF/SO_RCVBUF bytes; 0 = the kernel's default
};

/// Applies TCP_NODELAY and the buffer sizes.
inline void tune_socket(asio::ip::tcp::socket& s, const socket_options& o) {
  std::error_code ignored;
  s.set_option(asio::ip::tcp::no_delay{o.nodelay}, ignored);
  if (o.buffer > 0) {
    const int v = static_cast<int>(std::min<std::uint64_t>(o.buffer, 1u << 30));
    s.set_option(asio::socket_base::send_buffer_size{v}, ignored);
    s.set_option(asio::socket_base::receive_buffer_size{v}, ignored);
  }
}

/// "1.2.3.4:5" / "[::1]:5".
inline std::string format_endpoint(const asio::ip::tcp::endpoint& ep) {
  return join_host_port(ep.address().to_string(), ep.port());
}

/// Closes a socket if a set-up step (connect, handshake) takes longer than
/// its timeout. Disarmed when destroyed; fired() says whether it closed the
/// socket (so the step's error is a timeout, not what the socket said).
class watchdog {
 public:
  watchdog(const asio::any_io_executor& ex, asio::ip::tcp::socket& s,
           std::chrono::milliseconds timeout)
      : timer_(ex), state_(std::make_shared<state>(state{&s, true, false})) {
    timer_.expires_after(timeout);
    timer_.async_wait([st = state_](std::error_code ec) {
      if (ec || !st->active) return;
      st->fired = true;
      std::error_code ignored;
      st->socket->close(ignored);
    });
  }
  ~watchdog() {
    state_->active = false;
    timer_.cancel();
  }
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  bool fired() const noexcept { return state_->fired; }

 private:
  struct state {
    asio::ip::tcp::socket* socket;
    bool active;
    bool fired;
  };
  asio::steady_timer timer_;
  std::shared_ptr<state> state_;
};

}  // namespace kvlink::control
