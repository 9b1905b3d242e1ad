// The TCP transport's target side: serves the lanes a peer opened to this
// engine.
//
// Reads a header, checks (segment, offset, length) and the access granted
// against the registry *before* touching memory, then reads the payload
// straight into the segment (WRITE) or sends it straight from the segment
// (READ). A rejected WRITE's payload is drained into a scratch buffer and
// answered with an error status; a frame that cannot be trusted (bad magic
// or version, unknown type, a length above max_frame_payload) closes the
// connection. Segments are pinned while a frame touches them, so
// unregistration waits for it.
//
// Runs on the executor of its socket (a strand of its own: close() and
// holds() are posted there by the transport); pins through a
// transport_host, which it keeps alive while it may still unpin.
#pragma once

#include <kvlink/core/crc32c.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/tcp/frame.hpp>
#include <kvlink/transport/transport.hpp>

#include <algorithm>
#include <deque>
#include <memory>
#include <vector>

#include <asio/buffer.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>

namespace kvlink::tcp {

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

  /// `lease` (optional) is held until the connection closes.
  lane_server(asio::ip::tcp::socket socket, const segment_registry& registry, transport_host& host,
              std::uint64_t max_frame_payload, std::shared_ptr<void> lease = nullptr)
      : socket_(std::move(socket)),
        registry_(registry),
        keep_(host.keep_alive()),
        host_(host),
        max_payload_(max_frame_payload),
        lease_(std::move(lease)) {}

  using executor_type = asio::ip::tcp::socket::executor_type;
  /// Where every call to the server is made.
  executor_type get_executor() noexcept { return socket_.get_executor(); }

  void start() { read_header(); }

  void close() {
    if (closed_) return;
    closed_ = true;
    std::error_code ignored;
    socket_.shutdown(asio::socket_base::shutdown_both, ignored);
    socket_.close(ignored);
    lease_.reset();
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

  /// Whether a frame of this connection holds (pins) the segment: a WRITE
  /// being read into it, or a READ response not yet written from it.
  bool holds(segment_id seg) const noexcept {
    if (pinned_read_ && pinned_read_segment_ == seg) return true;
    return std::any_of(out_.begin(), out_.end(),
                       [seg](const response& r) { return r.pinned && r.segment == seg; });
  }

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
      if (!host_.pin(seg)) {  // unregistered since the check
        drain(h, errc::not_registered);
        return;
      }
      pinned_read_ = true;
      pinned_read_segment_ = seg;
      asio::async_read(
          socket_, asio::buffer(dst, static_cast<std::size_t>(h.length)),
          [self = shared_from_this(), h, dst](std::error_code rec, std::size_t) {
            if (self->closed_) return;
            // The bytes placed are checked while still pinned; a
            // mismatch is answered, never acknowledged as written.
            const bool bad = !rec && (h.flags & frame_flag_checksum) != 0 &&
                             crc32c(dst, static_cast<std::size_t>(h.length)) != h.checksum;
            self->pinned_read_ = false;
            self->host_.unpin(segment_id{h.segment});
            if (rec) {
              self->close();
              return;
            }
            self->respond(frame_type::write_ack, h,
                          bad ? std::error_code{errc::checksum_mismatch} : std::error_code{},
                          nullptr, segment_id{}, false);
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
    } else if (!host_.pin(seg)) {  // unregistered since the check
      respond(frame_type::read_response, h, errc::not_registered, nullptr, segment_id{}, false);
    } else {
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
    if (type == frame_type::read_response && !status && (req.flags & frame_flag_checksum) != 0) {
      h.flags = frame_flag_checksum;
      h.checksum = crc32c(payload, static_cast<std::size_t>(h.length));
    }
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
  std::shared_ptr<transport_host> keep_;  // the host outlives the server's handlers
  transport_host& host_;
  std::uint64_t max_payload_;
  std::shared_ptr<void> lease_;
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
