// The TCP transport's target side: serves the lanes a peer opened to this
// engine.
//
// Reads a header, checks (segment, offset, length) and the access granted
// against the registry *before* touching memory, then reads the payload
// straight into the segment (WRITE) or sends it straight from the segment
// (READ). After a READ request or a small WRITE (small_frame), headers are
// read through a read-ahead buffer (read_ahead bytes): one receive brings
// the next header and whatever follows it, so small frames (4 KiB pieces)
// cost one system call for several of them instead of two each; payload
// bytes that came with it are copied into place (after the check), the rest
// of a payload is read straight into it. After a large WRITE only the next
// header is read. A rejected WRITE's payload is drained into a scratch
// buffer and answered with an error status; a frame that cannot be trusted
// (bad magic or version, unknown type, a length above max_frame_payload)
// closes the connection. Segments are pinned while a frame touches them, so
// unregistration waits for it.
//
// Device memory (a segment of memory_kind::device) is never touched by the
// CPU or a syscall: its frames pass through a pinned chunk of the target's
// staging pool (transport_env::target_staging). A WRITE's payload is read
// into the chunk, its checksum checked there (a mismatch is answered and
// nothing is copied), then copied to the device; it is acknowledged only
// once that copy finished ("complete means visible"). A READ is copied
// device -> chunk, then sent from the chunk. The next frame is read while a
// chunk's copy runs, so several copies may be in flight; responses still go
// out in request order (the initiator's lane expects them so), a response
// waiting for its copy holding back those behind it. The segment stays
// pinned until its copy finished, the chunk is given back once nothing uses
// it (after the copy of a WRITE, after the send of a READ), also when the
// connection closes meanwhile (a copy in flight gives back its own). A frame
// longer than a chunk (a peer with longer slices) gets pinned memory of its
// own, one such frame at a time: no header is read until it is done. A
// frame on device memory when this engine has no staging is answered with
// errc::device_error.
//
// A vector frame (tcp/frame.hpp: many pieces of one segment) is checked
// whole before any memory is touched: its piece table is read, every piece
// checked against the registry, the segment pinned once; a WRITE's payload
// is then read straight into the pieces (one scatter receive: what the
// read-ahead holds is copied first), a READ's answer written straight from
// them (one gather write with the other responses), with one answer per
// frame. A frame whose pieces fail a check is refused whole (its payload
// drained) with the first failure; the initiator sends its pieces again one
// frame each. Device segments refuse vector frames (device_error): staging
// serves them frame by frame.
//
// Runs on the executor of its socket (a strand of its own: close() and
// holds() are posted there by the transport, copy and chunk completions are
// posted there by the staging pool); pins through a transport_host, which
// it keeps alive while it may still unpin, and keeps its staging pool alive
// while a copy or a chunk of its may be outstanding.
#pragma once

#include <kvlink/core/crc32c.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/memory/device.hpp>
#include <kvlink/memory/staging.hpp>
#include <kvlink/tcp/frame.hpp>
#include <kvlink/tcp/receive.hpp>
#include <kvlink/tcp/send.hpp>
#include <kvlink/transport/transport.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <span>
#include <vector>

#include <asio/buffer.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
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
  /// Buffers one gather write of responses may take (more responses wait
  /// for the next one).
  static constexpr std::size_t max_write_buffers = 1024;
  static constexpr std::uint64_t max_deferred_payload = 64u << 10;
  /// Bytes one receive of a header may bring (the header and what follows)
  /// after a frame of at most small_frame bytes.
  static constexpr std::size_t read_ahead = 32u << 10;
  static constexpr std::uint64_t small_frame = 16u << 10;
  /// Bytes of the longest piece table.
  static constexpr std::size_t max_table = max_vector_pieces * piece_entry_size;

  /// `lease` (optional) is held until the connection closes. `staging`
  /// (null: no device runtime) serves frames on device segments.
  lane_server(asio::ip::tcp::socket socket, const segment_registry& registry, transport_host& host,
              std::uint64_t max_frame_payload, std::shared_ptr<void> lease = nullptr,
              std::shared_ptr<staging_pool> staging = nullptr)
      : staging_(std::move(staging)),
        socket_(std::move(socket)),
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
    // closed, nothing reads segment memory for them any more. So are the
    // chunks and pins of staged frames, except those a copy or a chunk is
    // awaited for: their callback gives them back once the copy finished.
    for (auto& r : out_) {
      if (r.st) {
        if (!r.st->busy) release(*r.st);
      } else if (r.pinned) {
        host_.unpin(r.segment);
      }
    }
    out_.clear();
    if (pinned_read_) {
      host_.unpin(pinned_read_segment_);
      pinned_read_ = false;
    }
    if (incoming_ && !incoming_->busy) release(*incoming_);
    incoming_.reset();
  }

  bool closed() const noexcept { return closed_; }

  /// Whether a frame of this connection holds (pins) the segment: a WRITE
  /// being read into it, or a READ response not yet written from it.
  bool holds(segment_id seg) const noexcept {
    if (pinned_read_ && pinned_read_segment_ == seg) return true;
    if (incoming_ && incoming_->pinned && incoming_->segment == seg) return true;
    return std::any_of(out_.begin(), out_.end(), [seg](const response& r) {
      return r.st ? r.st->pinned && r.st->segment == seg : r.pinned && r.segment == seg;
    });
  }

 private:
  // A frame on device memory, served through staging memory.
  struct staged {
    frame_header req;
    segment_id segment{};
    std::int32_t device = -1;
    std::byte* memory = nullptr;  // the device bytes the frame names
    std::byte* chunk = nullptr;   // a chunk of the pool, or big's memory
    pinned_buffer big;            // a frame longer than a chunk
    frame_bytes header{};         // its response, once ready
    std::uint64_t length = 0;     // that response's payload bytes (from `chunk`)
    bool oversize = false;        // longer than a chunk
    bool pinned = false;          // holds a pin on `segment`
    bool busy = false;            // a chunk or a copy is awaited: its callback cleans up
    bool ready = false;           // its response may be written
  };

  struct response {
    frame_bytes header;
    const std::byte* payload = nullptr;
    std::uint64_t length = 0;
    segment_id segment{};
    bool pinned = false;
    std::shared_ptr<staged> st;              // a frame on device memory: header and payload there
    std::vector<asio::const_buffer> pieces;  // a vector READ's payload (else `payload`)
  };

  // A checked piece of a vector frame: where its bytes are.
  struct span {
    std::byte* data = nullptr;
    std::size_t length = 0;
  };

  // Serves the frames whose headers the read-ahead holds, in a loop on this
  // call's stack (a frame served from the read-ahead calls read_header()
  // again: that call only asks the loop for one more round), then starts a
  // receive. The loop is bounded by the read-ahead's bytes: each round uses
  // up a header at least.
  void read_header() {
    if (serving_) {
      again_ = true;
      return;
    }
    serving_ = true;
    do {
      again_ = false;
      next_frame();
    } while (again_);
    serving_ = false;
  }

  void next_frame() {
    if (closed_ || stalled_) return;
    if (out_.size() >= max_pending_responses) {
      paused_ = true;  // resumed by the writer
      return;
    }
    if (ahead_end_ - ahead_pos_ >= frame_header_size) {
      std::memcpy(in_.data(), ahead_.data() + ahead_pos_, frame_header_size);
      ahead_pos_ += frame_header_size;
      on_header({});
      return;
    }
    // A partial header moves to the front; the receive appends to it.
    if (ahead_.empty()) ahead_.resize(read_ahead);
    const std::size_t keep = ahead_end_ - ahead_pos_;
    if (keep > 0 && ahead_pos_ > 0) std::memmove(ahead_.data(), ahead_.data() + ahead_pos_, keep);
    ahead_pos_ = 0;
    ahead_end_ = keep;
    // After a small frame, read ahead (more small ones likely follow);
    // after a large one, only as much as a header and a piece table, so
    // that most of its successor's payload goes straight into place.
    const std::size_t room =
        small_ ? ahead_.size() - ahead_end_ : frame_header_size + max_table - keep;
    asio::async_read(socket_, asio::buffer(ahead_.data() + ahead_end_, room),
                     asio::transfer_at_least(frame_header_size - keep),
                     [self = shared_from_this()](std::error_code ec, std::size_t n) {
                       if (self->closed_) return;
                       if (ec) {
                         self->on_header(ec);
                         return;
                       }
                       self->ahead_end_ += n;
                       self->read_header();
                     });
  }

  // Reads exactly n bytes of the stream into dst: first what the read-ahead
  // holds, the rest from the socket straight into dst. done(ec) runs on the
  // strand: inside this call when the read-ahead held all n bytes (a small
  // frame's payload: no hop through the strand's queue per frame; every
  // caller calls read_exact last), else when the receive completes.
  template <class Done>
  void read_exact(std::byte* dst, std::size_t n, Done done) {
    const std::size_t from = std::min(n, ahead_end_ - ahead_pos_);
    if (from > 0) {
      std::memcpy(dst, ahead_.data() + ahead_pos_, from);
      ahead_pos_ += from;
    }
    if (from == n) {
      done(std::error_code{});
      return;
    }
    if (n - from <= small_frame) {  // a table, or a short rest: no mark
      asio::async_read(
          socket_, asio::buffer(dst + from, n - from),
          [done = std::move(done)](std::error_code ec, std::size_t) mutable { done(ec); });
      return;
    }
    // A payload: woken once per low_water bytes (tcp/receive.hpp).
    scatter_.clear();
    scatter_.emplace_back(dst + from, n - from);
    receive_all(socket_, scatter_, 0, n - from, mark_, std::move(done));
  }

  void on_header(std::error_code ec) {
    if (closed_) return;
    if (ec) {
      close();
      return;
    }
    frame_header h;
    if (decode(in_.data(), h) ||
        (h.type != frame_type::write_request && h.type != frame_type::read_request &&
         !is_vector(h.type)) ||
        h.length > max_payload_ || h.status != 0) {
      close();  // cannot trust the stream any more
      return;
    }
    // Only a large WRITE's payload follows its header; READ requests are
    // headers alone, however much they ask for.
    small_ = (h.type != frame_type::write_request && h.type != frame_type::write_vector) ||
             h.length <= small_frame;
    if (is_vector(h.type)) {
      if (table_.empty()) table_.resize(max_table);
      read_exact(table_.data(), static_cast<std::size_t>(h.offset) * piece_entry_size,
                 [self = shared_from_this(), h](std::error_code rec) {
                   if (self->closed_) return;
                   if (rec) {
                     self->close();
                     return;
                   }
                   self->on_table(h);
                 });
      return;
    }
    const segment_id seg{h.segment};
    memory_desc memory;
    if (h.type == frame_type::write_request) {
      std::byte* dst = nullptr;
      auto check = h.length == 0 ? std::error_code{errc::invalid_argument}
                                 : registry_.check_remote_access(seg, h.offset, h.length,
                                                                 access::remote_write, dst, memory);
      if (!check && memory.kind == memory_kind::device && !staging_) check = errc::device_error;
      if (check) {
        drain(h, check);
        return;
      }
      if (!host_.pin(seg)) {  // unregistered since the check
        drain(h, errc::not_registered);
        return;
      }
      if (memory.kind == memory_kind::device) {
        write_staged(h, memory.device, dst);
        return;
      }
      pinned_read_ = true;
      pinned_read_segment_ = seg;
      read_exact(dst, static_cast<std::size_t>(h.length),
                 [self = shared_from_this(), h, dst](std::error_code rec) {
                   if (self->closed_) return;
                   // The bytes placed are checked while still pinned; a
                   // mismatch is answered, never acknowledged as written.
                   const bool bad = !rec && (h.flags & frame_flag_checksum) != 0 &&
                                    crc32c(dst, static_cast<std::size_t>(h.length)) != h.checksum;
                   self->placed(h, rec, bad);
                 });
      return;
    }
    std::byte* src = nullptr;
    auto check = h.length == 0 ? std::error_code{errc::invalid_argument}
                               : registry_.check_remote_access(seg, h.offset, h.length,
                                                               access::remote_read, src, memory);
    if (!check && memory.kind == memory_kind::device && !staging_) check = errc::device_error;
    if (check) {
      respond(frame_type::read_response, h, check, nullptr, segment_id{}, false);
    } else if (!host_.pin(seg)) {  // unregistered since the check
      respond(frame_type::read_response, h, errc::not_registered, nullptr, segment_id{}, false);
    } else if (memory.kind == memory_kind::device) {
      read_staged(h, memory.device, src);
    } else {
      respond(frame_type::read_response, h, {}, src, seg, true);
    }
    read_header();
  }

  // A host WRITE's payload was received into its segment (`rec`: how the
  // receive ended; `bad`: its checksum failed): unpinned, answered, and the
  // next header read.
  void placed(const frame_header& h, std::error_code rec, bool bad) {
    pinned_read_ = false;
    host_.unpin(segment_id{h.segment});
    if (rec) {
      close();
      return;
    }
    respond(frame_type::write_ack, h,
            bad ? std::error_code{errc::checksum_mismatch} : std::error_code{}, nullptr,
            segment_id{}, false);
    read_header();
  }

  // ------------------------------------------------------------ vector frames

  // A vector frame's piece table is in table_: every piece is checked, the
  // segment pinned once, then the pieces are served together.
  void on_table(const frame_header& h) {
    const auto count = static_cast<std::size_t>(h.offset);
    if (decode_pieces(table_.data(), count, h.length, pieces_.data())) {
      close();  // cannot trust the stream any more
      return;
    }
    const bool write = h.type == frame_type::write_vector;
    const segment_id seg{h.segment};
    std::error_code check;
    spans_.clear();
    // The segment is looked up once for the frame (the pin below catches
    // an unregistration since); each piece is checked against it, in order.
    const auto info = registry_.get(seg);
    if (!info) check = errc::not_registered;
    const access needed = write ? access::remote_write : access::remote_read;
    for (std::size_t i = 0; info && i < count; ++i) {
      const auto& piece = pieces_[i];
      if (const errc e = detail::check_segment_access(info->length, info->granted, piece.offset,
                                                      piece.length, needed);
          e != errc{}) {
        check = e;
        break;
      }
      // Staging serves device memory one frame at a time.
      if (info->memory.kind == memory_kind::device) {
        check = errc::device_error;
        break;
      }
      spans_.push_back(
          span{reinterpret_cast<std::byte*>(info->base + static_cast<std::uintptr_t>(piece.offset)),
               static_cast<std::size_t>(piece.length)});
    }
    if (!check && !host_.pin(seg)) check = errc::not_registered;  // unregistered since
    if (!write) {
      if (check) {
        respond(frame_type::read_response, h, check, nullptr, segment_id{}, false);
      } else {
        respond_pieces(h, seg);
      }
      read_header();
      return;
    }
    if (check) {
      drain(h, check);
      return;
    }
    pinned_read_ = true;
    pinned_read_segment_ = seg;
    read_scattered([self = shared_from_this(), h](std::error_code rec) {
      if (self->closed_) return;
      // The bytes placed are checked while still pinned, as one run.
      bool bad = false;
      if (!rec && (h.flags & frame_flag_checksum) != 0) {
        std::uint32_t crc = 0;
        for (const auto& p : self->spans_) crc = crc32c(p.data, p.length, crc);
        bad = crc != h.checksum;
      }
      self->placed(h, rec, bad);
    });
  }

  // Reads the payload of a vector WRITE into spans_: what the read-ahead
  // holds is copied, the rest received straight into the pieces in one
  // scatter read. done(ec) runs as read_exact's does.
  template <class Done>
  void read_scattered(Done done) {
    std::size_t i = 0;
    std::size_t part = 0;  // bytes of spans_[i] already placed
    while (i < spans_.size() && ahead_end_ > ahead_pos_) {
      const std::size_t n = std::min(spans_[i].length - part, ahead_end_ - ahead_pos_);
      std::memcpy(spans_[i].data + part, ahead_.data() + ahead_pos_, n);
      ahead_pos_ += n;
      part += n;
      if (part == spans_[i].length) {
        ++i;
        part = 0;
      }
    }
    if (i == spans_.size()) {
      done(std::error_code{});
      return;
    }
    scatter_.clear();
    scatter_.emplace_back(spans_[i].data + part, spans_[i].length - part);
    std::size_t rest = scatter_.back().size();
    for (++i; i < spans_.size(); ++i) {
      scatter_.emplace_back(spans_[i].data, spans_[i].length);
      rest += spans_[i].length;
    }
    // Woken once per low_water bytes, not per segment (tcp/receive.hpp).
    receive_all(socket_, scatter_, 0, rest, mark_, std::move(done));
  }

  // Answers a vector READ whose pieces (spans_) passed: one header, the
  // pieces sent straight from the segment, pinned until written.
  void respond_pieces(const frame_header& req, segment_id seg) {
    response r{{}, nullptr, req.length, seg, true, nullptr, {}};
    r.pieces.reserve(spans_.size());
    for (const auto& p : spans_) r.pieces.emplace_back(p.data, p.length);
    r.header = encode(response_header(frame_type::read_response, req, {}, r.pieces));
    out_.push_back(std::move(r));
    send_or_defer(req.length);
  }

  // ------------------------------------------------------------ staging

  std::shared_ptr<staged> make_staged(const frame_header& h, std::int32_t device,
                                      std::byte* memory) {
    auto st = std::make_shared<staged>();
    st->req = h;
    st->segment = segment_id{h.segment};
    st->device = device;
    st->memory = memory;
    st->oversize = h.length > staging_->chunk_size();
    st->pinned = true;  // pinned by on_header
    return st;
  }

  // Gives back what a staged frame holds: its chunk and its pin.
  void release(staged& st) {
    if (st.big.data() != nullptr) {
      st.big = pinned_buffer{};
    } else if (st.chunk != nullptr) {
      staging_->release(st.device, st.chunk);
    }
    st.chunk = nullptr;
    if (st.pinned) {
      st.pinned = false;
      host_.unpin(st.segment);
    }
  }

  // Gets `st` its staging memory, then runs next(ok) on the strand (never
  // inside this call; not at all once closed: the chunk goes back). A frame
  // longer than a chunk gets pinned memory of its own; ok is false when
  // there is none (the pool has no staging for the device, or the
  // allocation failed).
  template <class Next>
  void with_chunk(const std::shared_ptr<staged>& st, Next next) {
    st->busy = true;
    auto ready = [self = shared_from_this(), st, next](std::byte* chunk) mutable {
      st->busy = false;
      if (st->big.data() == nullptr) st->chunk = chunk;
      if (self->closed_) {
        self->release(*st);
        return;
      }
      next(st->chunk != nullptr);
    };
    if (!st->oversize) {
      staging_->acquire(st->device, get_executor(), std::move(ready));
      return;
    }
    try {
      st->big = pinned_buffer{staging_->runtime_ptr(), static_cast<std::size_t>(st->req.length)};
      st->chunk = st->big.data();
    } catch (const std::exception&) {
      st->chunk = nullptr;  // answered with device_error
    }
    asio::post(get_executor(),
               [ready = std::move(ready), chunk = st->chunk]() mutable { ready(chunk); });
  }

  // The response of a staged frame, ready to be written.
  void set_ready(staged& st, frame_type type, std::error_code status) {
    const auto h = response_header(type, st.req, status, st.chunk);
    st.header = encode(h);
    st.length = h.length;
    st.ready = true;
  }

  // Lets the next header be read after a frame longer than a chunk.
  void unstall() {
    if (!stalled_) return;
    stalled_ = false;
    read_header();
  }

  // A WRITE into device memory (pinned, checked): payload -> chunk -> device,
  // then the acknowledgement.
  void write_staged(const frame_header& h, std::int32_t device, std::byte* dst) {
    auto st = make_staged(h, device, dst);
    incoming_ = st;
    with_chunk(st, [self = shared_from_this(), st](bool ok) { self->on_write_chunk(st, ok); });
  }

  void on_write_chunk(const std::shared_ptr<staged>& st, bool ok) {
    if (!ok) {  // no staging: the payload is read and dropped, the error answered
      incoming_.reset();
      release(*st);
      drain(st->req, errc::device_error);
      return;
    }
    read_exact(
        st->chunk, static_cast<std::size_t>(st->req.length),
        [self = shared_from_this(), st](std::error_code ec) { self->on_write_payload(st, ec); });
  }

  void on_write_payload(const std::shared_ptr<staged>& st, std::error_code ec) {
    if (closed_) return;  // close() gave back its chunk and pin
    incoming_.reset();
    if (ec) {
      release(*st);
      close();
      return;
    }
    const auto& h = st->req;
    out_.push_back(response{{}, nullptr, 0, segment_id{}, false, st, {}});
    // Checked in the chunk: a corrupted payload never reaches the device.
    if ((h.flags & frame_flag_checksum) != 0 &&
        crc32c(st->chunk, static_cast<std::size_t>(h.length)) != h.checksum) {
      release(*st);
      set_ready(*st, frame_type::write_ack, errc::checksum_mismatch);
      write();
      read_header();
      return;
    }
    st->busy = true;
    staging_->copy(
        st->device, st->memory, memory_desc{memory_kind::device, st->device}, st->chunk,
        memory_desc{}, static_cast<std::size_t>(h.length), get_executor(),
        [self = shared_from_this(), st](std::error_code cec) { self->on_write_copied(st, cec); });
    // The next frame arrives while this one is copied (one frame longer than
    // a chunk at a time: its memory is not the pool's).
    if (st->oversize) stalled_ = true;
    read_header();
  }

  void on_write_copied(const std::shared_ptr<staged>& st, std::error_code ec) {
    st->busy = false;
    release(*st);  // the bytes are in device memory (or the copy failed)
    if (closed_) return;
    // Complete means visible: acknowledged only now.
    set_ready(*st, frame_type::write_ack, ec ? errc::device_error : std::error_code{});
    write();
    if (st->oversize) unstall();
  }

  // A READ of device memory (pinned, checked): device -> chunk, then sent
  // from the chunk.
  void read_staged(const frame_header& h, std::int32_t device, std::byte* src) {
    auto st = make_staged(h, device, src);
    out_.push_back(response{{}, nullptr, 0, segment_id{}, false, st, {}});
    if (st->oversize) stalled_ = true;  // until its response is written
    with_chunk(st, [self = shared_from_this(), st](bool ok) { self->on_read_chunk(st, ok); });
  }

  void on_read_chunk(const std::shared_ptr<staged>& st, bool ok) {
    if (!ok) {
      release(*st);
      set_ready(*st, frame_type::read_response, errc::device_error);
      write();
      return;
    }
    st->busy = true;
    staging_->copy(
        st->device, st->chunk, memory_desc{}, st->memory,
        memory_desc{memory_kind::device, st->device}, static_cast<std::size_t>(st->req.length),
        get_executor(),
        [self = shared_from_this(), st](std::error_code ec) { self->on_read_copied(st, ec); });
  }

  void on_read_copied(const std::shared_ptr<staged>& st, std::error_code ec) {
    st->busy = false;
    if (closed_ || ec) {
      release(*st);
      if (!closed_) {
        set_ready(*st, frame_type::read_response, errc::device_error);
        write();
      }
      return;
    }
    // The bytes are in the chunk: the segment is not touched any more.
    st->pinned = false;
    host_.unpin(st->segment);
    set_ready(*st, frame_type::read_response, {});
    write();
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
    read_exact(scratch_.data(), n, [self = shared_from_this(), h, why, n](std::error_code ec) {
      if (self->closed_) return;
      if (ec) {
        self->close();
        return;
      }
      self->drain_left_ -= n;
      self->drain_step(h, why);
    });
  }

  // The response to `req`; a READ's payload (checksummed when asked) is
  // `payload`, its buffers in order.
  static frame_header response_header(frame_type type, const frame_header& req,
                                      std::error_code status,
                                      std::span<const asio::const_buffer> payload) {
    frame_header h;
    h.type = type;
    h.tag = req.tag;
    h.segment = req.segment;
    h.offset = req.offset;
    h.status = error_to_status(status);
    h.length = (type == frame_type::read_response && !status) ? req.length : 0;
    if (type == frame_type::read_response && !status && (req.flags & frame_flag_checksum) != 0) {
      h.flags = frame_flag_checksum;
      for (const auto& b : payload) h.checksum = crc32c(b.data(), b.size(), h.checksum);
    }
    return h;
  }

  // ... with one run of `req.length` bytes at `payload`.
  static frame_header response_header(frame_type type, const frame_header& req,
                                      std::error_code status, const std::byte* payload) {
    const asio::const_buffer one(payload, static_cast<std::size_t>(req.length));
    return response_header(type, req, status, std::span(&one, 1));
  }

  void respond(frame_type type, const frame_header& req, std::error_code status,
               const std::byte* payload, segment_id seg, bool pinned) {
    const auto h = response_header(type, req, status, payload);
    out_.push_back(response{encode(h), payload, h.length, seg, pinned, nullptr, {}});
    send_or_defer(req.length);
  }

  // Writes the responses queued, or puts that off while more requests wait.
  void send_or_defer(std::uint64_t length) {
    // After a small frame, when the next request is already waiting in the
    // socket, answer it together with this one: one send for a run of small
    // frames instead of one each. The read loop is about to take that
    // request, so the flush is only put off, never skipped; bounded by
    // max_deferred_responses. Large frames are answered at once: their
    // answer costs little next to their payload, and delaying it would delay
    // the initiator by a whole frame.
    if (!writing_ && out_.size() < max_deferred_responses && length <= max_deferred_payload) {
      // The read-ahead holding the next header is enough (no ioctl).
      if (ahead_end_ - ahead_pos_ >= frame_header_size) return;
      std::error_code ec;
      if (socket_.available(ec) >= frame_header_size && !ec) return;
    }
    write();
  }

  void write() {
    if (writing_ || closed_ || out_.empty()) return;
    bufs_.clear();
    batch_ = 0;
    // In request order: a staged frame whose copy runs holds back the rest.
    for (const auto& r : out_) {
      if (batch_ == 64 || (batch_ > 0 && bufs_.size() + r.pieces.size() > max_write_buffers)) {
        break;
      }
      if (r.st) {
        if (!r.st->ready) break;
        bufs_.emplace_back(r.st->header.data(), r.st->header.size());
        if (r.st->length > 0) {
          bufs_.emplace_back(r.st->chunk, static_cast<std::size_t>(r.st->length));
        }
      } else {
        bufs_.emplace_back(r.header.data(), r.header.size());
        if (!r.pieces.empty()) {
          bufs_.insert(bufs_.end(), r.pieces.begin(), r.pieces.end());
        } else if (r.length > 0) {
          bufs_.emplace_back(r.payload, static_cast<std::size_t>(r.length));
        }
      }
      ++batch_;
    }
    if (batch_ == 0) return;
    writing_ = true;
    send_all(socket_, bufs_, 0, gather_, [self = shared_from_this()](std::error_code ec) {
      self->writing_ = false;
      if (self->closed_) return;
      if (ec) {
        self->close();
        return;
      }
      bool oversize = false;
      for (std::size_t i = 0; i < self->batch_; ++i) {
        auto& r = self->out_.front();
        if (r.st) {
          oversize = oversize || r.st->oversize;
          self->release(*r.st);  // written from its chunk: the chunk goes back
        } else if (r.pinned) {
          self->host_.unpin(r.segment);
        }
        self->out_.pop_front();
      }
      if (self->paused_ && self->out_.size() < max_pending_responses / 2) {
        self->paused_ = false;
        self->read_header();
      }
      self->write();
      if (oversize) self->unstall();  // a READ longer than a chunk was sent
    });
  }

  // First: the chunks of copies still in flight when the server goes
  // belong to it.
  std::shared_ptr<staging_pool> staging_;
  asio::ip::tcp::socket socket_;
  const segment_registry& registry_;
  std::shared_ptr<transport_host> keep_;  // the host outlives the server's handlers
  transport_host& host_;
  std::uint64_t max_payload_;
  std::shared_ptr<void> lease_;
  frame_bytes in_{};
  std::vector<std::byte> ahead_;  // the read-ahead: [ahead_pos_, ahead_end_) not yet used
  std::size_t ahead_pos_ = 0;
  std::size_t ahead_end_ = 0;
  bool small_ = true;     // the last frame was small: read ahead
  bool serving_ = false;  // read_header()'s loop is on the stack
  bool again_ = false;    // ... and is asked for one more round
  std::deque<response> out_;
  std::vector<asio::const_buffer> bufs_;
  gather_state gather_;  // send_all's iovecs
  std::size_t batch_ = 0;
  std::vector<std::byte> scratch_;
  std::uint64_t drain_left_ = 0;
  std::vector<std::byte> table_;  // a vector frame's piece table, max_table bytes
  std::array<frame_piece, max_vector_pieces> pieces_{};
  std::vector<span> spans_;                    // its pieces, checked
  std::vector<asio::mutable_buffer> scatter_;  // the part of them a receive fills
  low_water_mark mark_;                        // the socket's SO_RCVLOWAT
  segment_id pinned_read_segment_{};
  std::shared_ptr<staged> incoming_;  // a staged WRITE whose payload is being read
  bool pinned_read_ = false;
  bool writing_ = false;
  bool paused_ = false;
  bool stalled_ = false;  // a frame longer than a chunk is being served
  bool closed_ = false;
};

}  // namespace kvlink::tcp
