// A control connection after its handshake: a queue of outgoing messages
// (one write at a time, in order) and a read loop handing each incoming
// message to a callback. Both ends use it: the initiator's connection to a
// peer and the target's accepted one. Generic over the stream (a TCP socket
// today), so an authenticated or encrypted stream can carry it unchanged.
// Runs on the executor of its stream (the engine's strand).
#pragma once

#include <kvlink/control/message.hpp>
#include <kvlink/control/socket.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <system_error>

#include <asio/buffer.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>
#include <nlohmann/json.hpp>

namespace kvlink::control {

/// Bytes that may be held at once, shared by many connections: control
/// messages being received take from it until they are handled, so that
/// peers that send large messages slowly cannot make the engine hold more.
class byte_budget {
 public:
  explicit byte_budget(std::uint64_t limit) : limit_(limit) {}
  /// Takes `n` bytes if that keeps the total within the limit.
  bool take(std::uint64_t n) {
    auto used = used_.load(std::memory_order_relaxed);
    do {
      if (n > limit_ || used > limit_ - n) return false;
    } while (!used_.compare_exchange_weak(used, used + n, std::memory_order_relaxed));
    return true;
  }
  void give(std::uint64_t n) { used_.fetch_sub(n, std::memory_order_relaxed); }
  std::uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  std::uint64_t limit() const { return limit_; }

 private:
  std::uint64_t limit_;
  std::atomic<std::uint64_t> used_{0};
};

template <class Stream>
class basic_channel : public std::enable_shared_from_this<basic_channel<Stream>> {
 public:
  using message_fn = std::function<void(const nlohmann::json&)>;
  using closed_fn = std::function<void(std::error_code)>;

  /// `budget` (optional) bounds the bytes of messages being received over
  /// every channel that shares it; `lease` (optional) is held until the
  /// channel closes (the listener's count of open connections).
  basic_channel(Stream stream, std::uint64_t max_message,
                std::shared_ptr<byte_budget> budget = nullptr,
                std::shared_ptr<void> lease = nullptr)
      : stream_(std::move(stream)),
        max_message_(max_message),
        budget_(std::move(budget)),
        lease_(std::move(lease)) {}

  ~basic_channel() { release(); }

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
    out_.push_back(outgoing{encode_message(message), std::move(done)});
    write();
  }

  /// Closes the stream; queued messages complete with `why`.
  void close(std::error_code why = errc::peer_closed) {
    if (closed_) return;
    closed_ = true;
    std::error_code ignored;
    stream_.shutdown(asio::socket_base::shutdown_both, ignored);
    stream_.close(ignored);
    release();
    lease_.reset();
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
    asio::async_read(stream_, asio::buffer(prefix_),
                     [self = this->shared_from_this()](std::error_code ec, std::size_t) {
                       if (self->closed_) return;
                       if (ec) {
                         self->close(map_socket_error(ec));
                         return;
                       }
                       std::uint32_t len = 0;
                       if (auto dec = decode_prefix(self->prefix_, self->max_message_, len)) {
                         self->close(dec);
                         return;
                       }
                       if (self->budget_) {
                         if (!self->budget_->take(len)) {
                           self->close(errc::limit_exceeded);
                           return;
                         }
                         self->held_ = len;
                       }
                       self->body_.clear();
                       self->read_body(len);
                     });
  }

  // The body in chunks: memory grows with what arrives, not with what the
  // prefix announced.
  void read_body(std::size_t len) {
    static constexpr std::size_t chunk = 64u << 10;
    const std::size_t have = body_.size();
    const std::size_t step = std::min(len - have, chunk);
    body_.resize(have + step);
    asio::async_read(stream_, asio::buffer(body_.data() + have, step),
                     [self = this->shared_from_this(), len](std::error_code ec, std::size_t) {
                       if (self->closed_) return;
                       if (ec) {
                         self->close(map_socket_error(ec));
                         return;
                       }
                       if (self->body_.size() < len) {
                         self->read_body(len);
                         return;
                       }
                       nlohmann::json msg;
                       const auto pec = parse_message(self->body_, msg);
                       self->body_.clear();
                       self->body_.shrink_to_fit();
                       self->release();
                       if (pec) {
                         self->close(pec);
                         return;
                       }
                       if (self->on_message_) self->on_message_(msg);
                       if (!self->closed_) self->read_prefix();
                     });
  }

  void release() {
    if (held_ > 0 && budget_) budget_->give(held_);
    held_ = 0;
  }

  void write() {
    if (writing_ || closed_ || out_.empty()) return;
    writing_ = true;
    asio::async_write(stream_, asio::buffer(out_.front().bytes),
                      [self = this->shared_from_this()](std::error_code ec, std::size_t) {
                        self->writing_ = false;
                        if (self->closed_) return;
                        if (ec) {
                          self->close(map_socket_error(ec));
                          return;
                        }
                        auto done = std::move(self->out_.front().done);
                        self->out_.pop_front();
                        if (done) done({});
                        self->write();
                      });
  }

  Stream stream_;
  std::uint64_t max_message_;
  std::shared_ptr<byte_budget> budget_;
  std::shared_ptr<void> lease_;
  std::uint64_t held_ = 0;  // taken from budget_ for the message being read
  prefix_bytes prefix_{};
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

/// The control channel over a TCP socket, as the engine uses it.
using channel = basic_channel<asio::ip::tcp::socket>;

}  // namespace kvlink::control
