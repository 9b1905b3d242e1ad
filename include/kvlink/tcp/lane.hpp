// The TCP transport's lanes: one persistent connection each.
//
// Initiator side (`lane`): slices queue up per lane and are sent back to back
// (many in flight, up to a window), headers and payloads gathered into one
// write straight from the caller's memory. Responses come back in order on
// the same connection; write acknowledgements are read in bulk, read
// responses' payloads are read straight into the caller's memory. The lane
// never reads past the response it expects next, so no payload byte is ever
// staged in a buffer of ours.
//
// Target side (`lane_server`): reads a header, checks (segment, offset,
// length) and the access granted against the registry *before* touching
// memory, then reads the payload straight into the segment (WRITE) or sends
// it straight from the segment (READ). A rejected WRITE's payload is drained
// into a scratch buffer and answered with an error status; a frame that
// cannot be trusted (bad magic or version, unknown type, a length above
// max_frame_payload) closes the connection.
//
// Both run on the engine's strand; they report to a transport_host.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/detail/transfer_op.hpp>
#include <kvlink/tcp/frame.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include <asio/buffer.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>

namespace kvlink::tcp {

/// Maps socket-level failures to what a user can act on.
inline std::error_code map_socket_error(std::error_code ec) {
  if (ec == asio::error::eof || ec == asio::error::connection_reset ||
      ec == asio::error::broken_pipe || ec == asio::error::connection_aborted ||
      ec == asio::error::not_connected) {
    return errc::peer_closed;
  }
  return ec;
}

/// Applies the configured socket options (TCP_NODELAY, buffer sizes).
inline void tune_socket(asio::ip::tcp::socket& s, bool nodelay, std::uint64_t buffer_bytes) {
  std::error_code ignored;
  s.set_option(asio::ip::tcp::no_delay{nodelay}, ignored);
  if (buffer_bytes > 0) {
    const int v = static_cast<int>(std::min<std::uint64_t>(buffer_bytes, 1u << 30));
    s.set_option(asio::socket_base::send_buffer_size{v}, ignored);
    s.set_option(asio::socket_base::receive_buffer_size{v}, ignored);
  }
}

// ------------------------------------------------------------------ lane

class lane final : public detail::lane_base, public std::enable_shared_from_this<lane> {
 public:
  static constexpr std::size_t max_batch_frames = 64;
  static constexpr std::uint64_t max_batch_bytes = 8u << 20;

  lane(asio::ip::tcp::socket socket, detail::transport_host& host, std::size_t window,
       std::function<void(std::error_code)> on_failure)
      : socket_(std::move(socket)),
        host_(host),
        window_(std::max<std::size_t>(window, 1)),
        on_failure_(std::move(on_failure)) {
    send_headers_.reserve(max_batch_frames);
    send_bufs_.reserve(2 * max_batch_frames);
  }

  /// Starts the receive loop (it also notices a peer that goes away while
  /// the lane is idle).
  void start() override { receive(); }

  bool failed() const noexcept { return failed_; }
  std::size_t queued() const noexcept { return queue_.size(); }
  std::size_t in_flight() const noexcept { return inflight_.size(); }

  /// Queues a slice; it is sent when the window has room.
  void enqueue(const detail::slice_ref& s) override { queue_.push_back(s); }

  /// Sends what the window allows. Call after enqueue().
  void pump() override {
    if (writing_ || failed_) return;
    send_headers_.clear();
    send_bufs_.clear();
    std::uint64_t bytes = 0;
    while (!queue_.empty() && inflight_.size() < window_ &&
           send_headers_.size() < max_batch_frames && bytes < max_batch_bytes) {
      detail::slice_ref s = queue_.front();
      queue_.pop_front();
      s.tag = next_tag_++;
      frame_header h;
      h.type = s.kind == opcode::write ? frame_type::write_request : frame_type::read_request;
      h.tag = s.tag;
      h.segment = s.segment;
      h.offset = s.offset;
      h.length = s.length;
      send_headers_.push_back(encode(h));
      send_bufs_.emplace_back(send_headers_.back().data(), frame_header_size);
      if (s.kind == opcode::write) {
        send_bufs_.emplace_back(s.local, static_cast<std::size_t>(s.length));
        bytes += s.length;
      }
      inflight_.push_back(s);
    }
    if (send_bufs_.empty()) return;
    writing_ = true;
    asio::async_write(socket_, send_bufs_,
                      [self = shared_from_this()](std::error_code ec, std::size_t) {
                        self->writing_ = false;
                        if (ec) {
                          self->fail(map_socket_error(ec));
                          return;
                        }
                        self->pump();
                      });
  }

  /// Removes queued (not yet sent) slices of `op`; returns how many. They are
  /// not reported through slice_done: the caller accounts for them.
  std::size_t drop_queued(const detail::transfer_op* op) override {
    const auto before = queue_.size();
    std::erase_if(queue_, [op](const detail::slice_ref& s) { return s.op == op; });
    return before - queue_.size();
  }

  bool has_in_flight(const detail::transfer_op* op) const override {
    return std::any_of(inflight_.begin(), inflight_.end(),
                       [op](const auto& s) { return s.op == op; });
  }

  /// Closes the connection and resolves every queued and in-flight slice
  /// with `ec`. Once the socket is closed the kernel no longer reads from or
  /// writes to any slice's memory, so reporting them done here is safe.
  void fail(std::error_code ec) override {
    if (failed_) return;
    failed_ = true;
    std::error_code ignored;
    socket_.shutdown(asio::socket_base::shutdown_both, ignored);
    socket_.close(ignored);
    auto inflight = std::move(inflight_);
    auto queue = std::move(queue_);
    inflight_.clear();
    queue_.clear();
    for (const auto& s : inflight) host_.slice_done(s.op, 0, ec);
    for (const auto& s : queue) host_.slice_done(s.op, 0, ec);
    if (on_failure_) {
      auto cb = std::move(on_failure_);
      cb(ec);
    }
  }

 private:
  void receive() {
    if (failed_ || receiving_) return;
    // Read at most the headers of the responses expected next, up to and
    // including the first READ response (whose payload follows its header):
    // never past the next payload.
    std::size_t want = 0;
    for (const auto& s : inflight_) {
      ++want;
      if (s.kind == opcode::read || want == recv_buf_.size()) break;
    }
    want = std::max<std::size_t>(want, 1);
    const std::size_t cap = want * frame_header_size - have_;
    const std::size_t at_least = frame_header_size - have_;
    receiving_ = true;
    asio::async_read(socket_, asio::buffer(recv_buf_.data()->data() + have_, cap),
                     asio::transfer_at_least(at_least),
                     [self = shared_from_this()](std::error_code ec, std::size_t n) {
                       self->receiving_ = false;
                       self->on_headers(ec, n);
                     });
  }

  void on_headers(std::error_code ec, std::size_t n) {
    if (failed_) return;
    if (ec) {
      fail(map_socket_error(ec));
      return;
    }
    have_ += n;
    std::byte* base = recv_buf_.data()->data();
    std::size_t pos = 0;
    while (have_ - pos >= frame_header_size) {
      frame_header h;
      if (auto dec = decode(base + pos, h)) {
        fail(dec);
        return;
      }
      pos += frame_header_size;
      if (inflight_.empty() || h.tag != inflight_.front().tag) {
        fail(errc::malformed_message);  // a response nobody asked for
        return;
      }
      detail::slice_ref s = inflight_.front();
      const auto expected =
          s.kind == opcode::write ? frame_type::write_ack : frame_type::read_response;
      const auto status = status_to_error(h.status);
      if (h.type != expected || (status && h.length != 0) ||
          (!status && s.kind == opcode::read && h.length != s.length)) {
        fail(errc::malformed_message);
        return;
      }
      if (s.kind == opcode::read && !status) {
        // The payload follows: straight into the caller's memory. By
        // construction this header was the last one read.
        if (pos != have_) {
          fail(errc::malformed_message);
          return;
        }
        have_ = 0;
        receiving_ = true;
        asio::async_read(socket_, asio::buffer(s.local, static_cast<std::size_t>(s.length)),
                         [self = shared_from_this()](std::error_code rec, std::size_t) {
                           self->receiving_ = false;
                           if (self->failed_) return;
                           if (rec) {
                             self->fail(map_socket_error(rec));
                             return;
                           }
                           const auto done = self->inflight_.front();
                           self->inflight_.pop_front();
                           self->host_.slice_done(done.op, done.length, {});
                           self->pump();
                           self->receive();
                         });
        return;
      }
      inflight_.pop_front();
      host_.slice_done(s.op, status ? 0 : s.length, status);
      if (failed_) return;
    }
    if (pos > 0 && have_ > pos) std::memmove(base, base + pos, have_ - pos);
    have_ -= pos;
    pump();
    receive();
  }

  asio::ip::tcp::socket socket_;
  detail::transport_host& host_;
  std::size_t window_;
  std::function<void(std::error_code)> on_failure_;
  std::deque<detail::slice_ref> queue_;     // planned, not yet sent
  std::deque<detail::slice_ref> inflight_;  // sent, response pending, in send order
  std::vector<frame_bytes> send_headers_;   // headers of the write in progress
  std::vector<asio::const_buffer> send_bufs_;
  std::array<frame_bytes, 64> recv_buf_{};
  std::size_t have_ = 0;  // bytes of a partial header at the start of recv_buf_
  std::uint64_t next_tag_ = 1;
  bool writing_ = false;
  bool receiving_ = false;
  bool failed_ = false;
};

// ------------------------------------------------------------------ server

class lane_server : public std::enable_shared_from_this<lane_server> {
 public:
  /// Responses waiting to be written before the server stops reading new
  /// requests: a client that never reads its responses cannot make the
  /// target buffer without bound.
  static constexpr std::size_t max_pending_responses = 1024;
  static constexpr std::size_t drain_chunk = 256u << 10;
  static constexpr std::size_t max_deferred_responses = 32;
  static constexpr std::uint64_t max_deferred_payload = 64u << 10;

  lane_server(asio::ip::tcp::socket socket, const segment_registry& registry,
              detail::transport_host& host, std::uint64_t max_frame_payload)
      : socket_(std::move(socket)),
        registry_(registry),
        host_(host),
        max_payload_(max_frame_payload) {}

  void start() { read_header(); }

  void close() {
    if (closed_) return;
    closed_ = true;
    std::error_code ignored;
    socket_.shutdown(asio::socket_base::shutdown_both, ignored);
    socket_.close(ignored);
    // Pins of responses not yet written are released here: the socket is
    // closed, nothing reads segment memory for them any more.
    for (auto& r : out_) {
      if (r.pinned) host_.unpin(r.segment);
    }
    out_.clear();
    if (pinned_read_) {
      host_.unpin(pinned_read_segment_);
      pinned_read_ = false;
    }
  }

  bool closed() const noexcept { return closed_; }

 private:
  struct response {
    frame_bytes header;
    const std::byte* payload = nullptr;
    std::uint64_t length = 0;
    segment_id segment{};
    bool pinned = false;
  };

  void read_header() {
    if (closed_) return;
    if (out_.size() >= max_pending_responses) {
      paused_ = true;  // resumed by the writer
      return;
    }
    asio::async_read(
        socket_, asio::buffer(in_),
        [self = shared_from_this()](std::error_code ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(std::error_code ec) {
    if (closed_) return;
    if (ec) {
      close();
      return;
    }
    frame_header h;
    if (decode(in_.data(), h) ||
        (h.type != frame_type::write_request && h.type != frame_type::read_request) ||
        h.length > max_payload_ || h.status != 0) {
      close();  // cannot trust the stream any more
      return;
    }
    const segment_id seg{h.segment};
    if (h.type == frame_type::write_request) {
      std::byte* dst = nullptr;
      const auto check = h.length == 0 ? std::error_code{errc::invalid_argument}
                                       : registry_.check_remote_access(seg, h.offset, h.length,
                                                                       access::remote_write, dst);
      if (check) {
        drain(h, check);
        return;
      }
      host_.pin(seg);
      pinned_read_ = true;
      pinned_read_segment_ = seg;
      asio::async_read(socket_, asio::buffer(dst, static_cast<std::size_t>(h.length)),
                       [self = shared_from_this(), h](std::error_code rec, std::size_t) {
                         if (self->closed_) return;
                         self->pinned_read_ = false;
                         self->host_.unpin(segment_id{h.segment});
                         if (rec) {
                           self->close();
                           return;
                         }
                         self->respond(frame_type::write_ack, h, {}, nullptr, segment_id{}, false);
                         self->read_header();
                       });
      return;
    }
    std::byte* src = nullptr;
    const auto check = h.length == 0 ? std::error_code{errc::invalid_argument}
                                     : registry_.check_remote_access(seg, h.offset, h.length,
                                                                     access::remote_read, src);
    if (check) {
      respond(frame_type::read_response, h, check, nullptr, segment_id{}, false);
    } else {
      host_.pin(seg);
      respond(frame_type::read_response, h, {}, src, seg, true);
    }
    read_header();
  }

  // Reads and discards a rejected WRITE's payload (bounded by
  // max_frame_payload), then answers with the error.
  void drain(const frame_header& h, std::error_code why) {
    if (scratch_.empty()) scratch_.resize(drain_chunk);
    drain_left_ = h.length;
    drain_step(h, why);
  }

  void drain_step(const frame_header& h, std::error_code why) {
    if (drain_left_ == 0) {
      respond(frame_type::write_ack, h, why, nullptr, segment_id{}, false);
      read_header();
      return;
    }
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(drain_left_, scratch_.size()));
    asio::async_read(socket_, asio::buffer(scratch_.data(), n),
                     [self = shared_from_this(), h, why](std::error_code ec, std::size_t got) {
                       if (self->closed_) return;
                       if (ec) {
                         self->close();
                         return;
                       }
                       self->drain_left_ -= got;
                       self->drain_step(h, why);
                     });
  }

  void respond(frame_type type, const frame_header& req, std::error_code status,
               const std::byte* payload, segment_id seg, bool pinned) {
    frame_header h;
    h.type = type;
    h.tag = req.tag;
    h.segment = req.segment;
    h.offset = req.offset;
    h.status = error_to_status(status);
    h.length = (type == frame_type::read_response && !status) ? req.length : 0;
    out_.push_back(response{encode(h), payload, h.length, seg, pinned});
    // After a small frame, when the next request is already waiting in the
    // socket, answer it together with this one: one send for a run of small
    // frames instead of one each. The read loop is about to take that
    // request, so the flush is only put off, never skipped; bounded by
    // max_deferred_responses. Large frames are answered at once: their
    // answer costs little next to their payload, and delaying it would delay
    // the initiator by a whole frame.
    if (!writing_ && out_.size() < max_deferred_responses && req.length <= max_deferred_payload) {
      std::error_code ec;
      if (socket_.available(ec) >= frame_header_size && !ec) return;
    }
    write();
  }

  void write() {
    if (writing_ || closed_ || out_.empty()) return;
    bufs_.clear();
    batch_ = 0;
    for (const auto& r : out_) {
      if (batch_ == 64) break;
      bufs_.emplace_back(r.header.data(), r.header.size());
      if (r.length > 0) bufs_.emplace_back(r.payload, static_cast<std::size_t>(r.length));
      ++batch_;
    }
    writing_ = true;
    asio::async_write(socket_, bufs_, [self = shared_from_this()](std::error_code ec, std::size_t) {
      self->writing_ = false;
      if (self->closed_) return;
      if (ec) {
        self->close();
        return;
      }
      for (std::size_t i = 0; i < self->batch_; ++i) {
        if (self->out_.front().pinned) self->host_.unpin(self->out_.front().segment);
        self->out_.pop_front();
      }
      if (self->paused_ && self->out_.size() < max_pending_responses / 2) {
        self->paused_ = false;
        self->read_header();
      }
      self->write();
    });
  }

  asio::ip::tcp::socket socket_;
  const segment_registry& registry_;
  detail::transport_host& host_;
  std::uint64_t max_payload_;
  frame_bytes in_{};
  std::deque<response> out_;
  std::vector<asio::const_buffer> bufs_;
  std::size_t batch_ = 0;
  std::vector<std::byte> scratch_;
  std::uint64_t drain_left_ = 0;
  segment_id pinned_read_segment_{};
  bool pinned_read_ = false;
  bool writing_ = false;
  bool paused_ = false;
  bool closed_ = false;
};

}  // namespace kvlink::tcp
