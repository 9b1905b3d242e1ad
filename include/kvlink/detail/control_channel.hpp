// A control connection after its handshake: a queue of outgoing messages
// (one write at a time, in order) and a read loop handing each incoming JSON
// message to a callback. Used on both sides: the initiator's connection to a
// peer and the target's accepted one. Runs on the engine's strand.
#pragma once

#include <kvlink/control/message.hpp>
#include <kvlink/tcp/lane.hpp>

#include <deque>
#include <functional>
#include <memory>
#include <string>

#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>

namespace kvlink::detail {

class control_channel : public std::enable_shared_from_this<control_channel> {
 public:
  using message_fn = std::function<void(const nlohmann::json&)>;
  using closed_fn = std::function<void(std::error_code)>;

  control_channel(asio::ip::tcp::socket socket, std::uint64_t max_message)
      : socket_(std::move(socket)), max_message_(max_message) {}

  /// Starts reading. `on_message` gets each well-formed message; the first
  /// error (peer gone, malformed or oversized message) closes the channel and
  /// is reported once through `on_closed`.
  void start(message_fn on_message, closed_fn on_closed) {
    on_message_ = std::move(on_message);
    on_closed_ = std::move(on_closed);
    read_prefix();
  }

  /// Queues a message. `done`, if given, runs once: with no error when the
  /// message has been handed to the kernel, or with the channel's error.
  void send(const nlohmann::json& message, std::function<void(std::error_code)> done = nullptr) {
    if (closed_) {
      if (done) done(errc::peer_closed);
      return;
    }
    out_.push_back(outgoing{control::encode_message(message), std::move(done)});
    write();
  }

  void close(std::error_code why = errc::peer_closed) {
    if (closed_) return;
    closed_ = true;
    std::error_code ignored;
    socket_.shutdown(asio::socket_base::shutdown_both, ignored);
    socket_.close(ignored);
    auto pending = std::move(out_);
    out_.clear();
    on_message_ = nullptr;
    for (auto& o : pending) {
      if (o.done) o.done(why);
    }
    if (auto cb = std::move(on_closed_)) cb(why);
  }

  bool closed() const noexcept { return closed_; }

 private:
  void read_prefix() {
    asio::async_read(
        socket_, asio::buffer(prefix_),
        [self = shared_from_this()](std::error_code ec, std::size_t) {
          if (self->closed_) return;
          if (ec) {
            self->close(tcp::map_socket_error(ec));
            return;
          }
          std::uint32_t len = 0;
          if (auto dec = control::decode_prefix(self->prefix_, self->max_message_, len)) {
            self->close(dec);
            return;
          }
          self->body_.resize(len);
          asio::async_read(self->socket_, asio::buffer(self->body_),
                           [self](std::error_code rec, std::size_t) {
                             if (self->closed_) return;
                             if (rec) {
                               self->close(tcp::map_socket_error(rec));
                               return;
                             }
                             nlohmann::json msg;
                             if (auto pec = control::parse_message(self->body_, msg)) {
                               self->close(pec);
                               return;
                             }
                             if (self->on_message_) self->on_message_(msg);
                             if (!self->closed_) self->read_prefix();
                           });
        });
  }

  void write() {
    if (writing_ || closed_ || out_.empty()) return;
    writing_ = true;
    asio::async_write(socket_, asio::buffer(out_.front().bytes),
                      [self = shared_from_this()](std::error_code ec, std::size_t) {
                        self->writing_ = false;
                        if (self->closed_) return;
                        if (ec) {
                          self->close(tcp::map_socket_error(ec));
                          return;
                        }
                        auto done = std::move(self->out_.front().done);
                        self->out_.pop_front();
                        if (done) done({});
                        self->write();
                      });
  }

  asio::ip::tcp::socket socket_;
  std::uint64_t max_message_;
  control::prefix_bytes prefix_{};
  std::string body_;
  struct outgoing {
    std::string bytes;
    std::function<void(std::error_code)> done;
  };
  std::deque<outgoing> out_;
  message_fn on_message_;
  closed_fn on_closed_;
  bool writing_ = false;
  bool closed_ = false;
};

}  // namespace kvlink::detail
