// The TCP transport's initiator side: one lane is one persistent
// connection to a peer's engine.
//
// Slices queue up per lane and are sent back to back (many in flight, up to
// a window), headers and payloads gathered into one write straight from the
// caller's memory. Responses come back in order on the same connection and
// are read in bulk: one receive takes the write acknowledgements and the
// small READ responses (payloads of at most small_read bytes) expected
// next, up to recv_capacity bytes, and stops at the header of a large READ
// response, whose payload is then read straight into the caller's memory.
// The small payloads that came with a receive are copied into place
// together, in one process_vm_writev on this process (the kernel copies and
// answers EFAULT for a destination that is not writable: that READ fails
// with errc::local_memory_fault and the stream goes on, since its bytes were
// already taken from it). A response shorter than expected (an error
// status) may let a receive take part of a large payload: that part is
// copied the same way and the rest read straight into place.
//
// To a peer that takes vector frames (tcp/frame.hpp), a run of small slices
// queued back to back for one remote segment, of one kind and checksum
// setting, travels as one frame: one header, one piece table, the payloads
// gathered into the same write; one answer, a READ's payload scattered
// into place (received in bulk with the other responses when it is small,
// else read straight into the destinations in one scatter receive). The
// window counts frames. A vector frame the target refuses (the first check
// that failed, device memory) sends its slices again one frame each, so
// that each gets its own answer; after a device_error the lane no longer
// vectors to that segment. A checksum_mismatch fails every slice of the
// frame, as it fails a frame of one.
//
// A fault in our own memory (a local buffer unmapped or protected after its
// registration: the kernel answers EFAULT) breaks the stream but says
// nothing about the peer: the slices whose buffers are not readable fail
// with errc::local_memory_fault, the others go back to the path
// (on_broken), which opens a new connection for them.
//
// Runs on the executor of its socket (a strand of its own: every call from
// outside is posted there by the path); reports to a transport_host from
// that strand, and keeps the host alive while it may still report.
#pragma once

#include <kvlink/control/socket.hpp>
#include <kvlink/core/crc32c.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/tcp/frame.hpp>
#include <kvlink/tcp/receive.hpp>
#include <kvlink/tcp/send.hpp>
#include <kvlink/transport/transport.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include <asio/buffer.hpp>
#include <asio/error.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>
#include <sys/uio.h>
#include <unistd.h>

namespace kvlink::tcp {

/// EFAULT from the kernel: a buffer of ours was not accessible.
inline bool is_bad_address(std::error_code ec) {
  return ec.value() == EFAULT && (ec.category() == asio::error::get_system_category() ||
                                  ec.category() == std::system_category());
}

/// Whether [p, p + n) can be read by this process (and, with `write`,
/// written), found without faulting: the kernel copies its bytes out
/// (process_vm_readv on ourselves), and back in for `write`
/// (process_vm_writev), in chunks. `write` is for the destinations of our
/// own READs only, which nothing else may touch meanwhile.
inline bool accessible(std::byte* p, std::uint64_t n, bool write) {
  thread_local std::array<std::byte, 64u << 10> scratch;
  for (std::uint64_t done = 0; done < n;) {
    const auto len = static_cast<std::size_t>(std::min<std::uint64_t>(n - done, scratch.size()));
    iovec local{scratch.data(), len};
    iovec remote{p + done, len};
    const auto want = static_cast<ssize_t>(len);
    if (::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0) != want ||
        (write && ::process_vm_writev(::getpid(), &local, 1, &remote, 1, 0) != want)) {
      return false;
    }
    done += len;
  }
  return true;
}

// ------------------------------------------------------------------ lane

/// What a lane's peer takes: vector frames of up to `pieces` pieces (0 or
/// 1: none) and `bytes` bytes.
struct vector_limits {
  std::size_t pieces = 0;
  std::uint64_t bytes = 0;
};

class lane final : public std::enable_shared_from_this<lane> {
 public:
  static constexpr std::size_t max_batch_frames = 64;
  static constexpr std::uint64_t max_batch_bytes = 8u << 20;
  /// Vector frames one write may carry (their piece tables are the lane's).
  static constexpr std::size_t max_batch_tables = 16;
  /// READ responses whose payload is at most this long are received with
  /// the responses around them (into the lane's buffer, then copied).
  static constexpr std::uint64_t small_read = 16u << 10;
  /// Bytes one receive of responses may bring.
  static constexpr std::size_t recv_capacity = 64u << 10;
  /// Slices at most this long may travel in vector frames.
  static constexpr std::uint64_t vector_piece = 64u << 10;

  using broken_fn = std::function<void(std::deque<slice_ref>)>;

 private:
  // A frame sent, its answer pending: its slices are the first `count` of
  // inflight_ (all with its tag).
  struct sent_frame {
    std::uint64_t tag = 0;
    std::size_t count = 1;
    std::uint64_t length = 0;  // payload bytes of all its slices
    opcode kind = opcode::write;
    bool checksum = false;
  };

 public:
  /// `on_failure`: the lane failed for good (the peer is gone). `on_broken`:
  /// our own memory broke the stream; the slices to carry on another
  /// connection are handed over (when not given, they fail like the rest).
  lane(asio::ip::tcp::socket socket, transport_host& host, std::size_t window,
       std::function<void(std::error_code)> on_failure, broken_fn on_broken = nullptr,
       vector_limits vectors = {})
      : socket_(std::move(socket)),
        keep_(host.keep_alive()),
        host_(host),
        window_(std::max<std::size_t>(window, 1)),
        on_failure_(std::move(on_failure)),
        on_broken_(std::move(on_broken)),
        vectors_{std::min(vectors.pieces, max_vector_pieces), vectors.bytes} {
    send_headers_.reserve(max_batch_frames);
    send_bufs_.reserve(2 * max_batch_frames);
    if (vectors_.pieces > 1) send_tables_.resize(max_batch_tables);
    recv_buf_.resize(recv_capacity);
  }

  /// Starts the receive loop (it also notices a peer that goes away while
  /// the lane is idle).
  void start() { receive(); }

  using executor_type = asio::ip::tcp::socket::executor_type;
  /// Where every call to the lane is made.
  executor_type get_executor() noexcept { return socket_.get_executor(); }

  bool failed() const noexcept { return failed_; }

  /// Queues a slice; it is sent when the window has room. A lane that has
  /// failed (before its path heard of it) resolves it at once.
  void enqueue(const slice_ref& s) {
    if (failed_) {
      host_.slice_done(s.op, 0, failure_);
      return;
    }
    queue_.push_back(s);
  }

  /// Resolves the queued slices of transfers that are stopping with
  /// errc::cancelled (they were never sent).
  void purge() {
    const auto cancel = [this](const slice_ref& s) {
      if (!host_.stopping(s.op)) return false;
      host_.slice_done(s.op, 0, errc::cancelled);
      return true;
    };
    std::erase_if(retry_, cancel);
    std::erase_if(queue_, cancel);
  }

  /// Whether it holds (queued or in flight) a slice of `op`.
  bool carries(const detail::transfer_op* op) const {
    const auto of_op = [op](const slice_ref& s) { return s.op == op; };
    return std::any_of(inflight_.begin(), inflight_.end(), of_op) ||
           std::any_of(retry_.begin(), retry_.end(), of_op) ||
           std::any_of(queue_.begin(), queue_.end(), of_op);
  }

  /// Sends what the window allows. Call after enqueue().
  void pump() {
    if (writing_ || failed_) return;
    send_headers_.clear();
    send_bufs_.clear();
    std::uint64_t bytes = 0;
    std::size_t tables = 0;  // piece tables of this write, in send_tables_
    while ((!retry_.empty() || !queue_.empty()) && frames_.size() < window_ &&
           send_headers_.size() < max_batch_frames && bytes < max_batch_bytes &&
           tables < max_batch_tables) {
      const bool again = !retry_.empty();  // refused in a vector: one frame each
      auto& from = again ? retry_ : queue_;
      slice_ref s = from.front();
      from.pop_front();
      if (host_.stopping(s.op)) {  // never sent: nothing touches its memory
        host_.slice_done(s.op, 0, errc::cancelled);
        continue;
      }
      s.tag = next_tag_++;
      inflight_.push_back(s);
      const std::size_t count = again ? 1 : gather(s);
      sent_frame f{s.tag, count, 0, s.kind, s.checksum};
      frame_header h;
      h.tag = s.tag;
      h.segment = s.segment;
      h.type =
          count == 1
              ? (s.kind == opcode::write ? frame_type::write_request : frame_type::read_request)
              : (s.kind == opcode::write ? frame_type::write_vector : frame_type::read_vector);
      h.offset = count == 1 ? s.offset : count;
      send_headers_.emplace_back();
      send_bufs_.emplace_back(send_headers_.back().data(), frame_header_size);
      // A vector's piece table (in the lane's storage for this write), then
      // the payloads; filled in one pass over the frame's slices.
      std::byte* table = count == 1 ? nullptr : send_tables_[tables++].data();
      if (table != nullptr) send_bufs_.emplace_back(table, count * piece_entry_size);
      std::uint32_t crc = 0;
      for (std::size_t k = 0; k < count; ++k) {
        const auto& p = inflight_[inflight_.size() - count + k];
        if (table != nullptr) encode(frame_piece{p.offset, p.length}, table + k * piece_entry_size);
        f.length += p.length;
        if (p.kind != opcode::write) continue;
        if (p.checksum) crc = crc32c(p.local, static_cast<std::size_t>(p.length), crc);
        send_bufs_.emplace_back(p.local, static_cast<std::size_t>(p.length));
        bytes += p.length;
      }
      h.length = f.length;
      if (s.checksum) {
        h.flags = frame_flag_checksum;
        h.checksum = crc;  // WRITE: its payload's; READ: asked for
      }
      encode(h, send_headers_.back().data());
      frames_.push_back(f);
    }
    if (send_bufs_.empty()) return;
    writing_ = true;
    send_all(socket_, send_bufs_, 0, gather_, [self = shared_from_this()](std::error_code ec) {
      self->writing_ = false;
      if (is_bad_address(ec)) {
        self->local_fault(nullptr);
        return;
      }
      if (ec) {
        self->fail(control::map_socket_error(ec));
        return;
      }
      self->pump();
    });
  }

  /// Closes the connection and resolves every queued and in-flight slice
  /// with `ec`. Once the socket is closed the kernel no longer reads from or
  /// writes to any slice's memory, so reporting them done here is safe.
  void fail(std::error_code ec) {
    if (failed_) return;
    failed_ = true;
    failure_ = ec;
    std::error_code ignored;
    socket_.shutdown(asio::socket_base::shutdown_both, ignored);
    socket_.close(ignored);
    auto inflight = std::move(inflight_);
    auto queue = std::move(queue_);
    for (const auto& s : retry_) queue.push_front(s);
    inflight_.clear();
    queue_.clear();
    retry_.clear();
    frames_.clear();
    // The path hears first: the engine marks the peer lost before the
    // transfers these slices belong to complete (both reach the engine's
    // strand in this order), so a handler that sees peer_closed also sees
    // the peer disconnected.
    if (on_failure_) {
      auto cb = std::move(on_failure_);
      cb(ec);
    }
    std::vector<slice_report> lost;
    lost.reserve(inflight.size() + queue.size());
    for (const auto& s : inflight) lost.push_back(slice_report{s.op, 0, ec});
    for (const auto& s : queue) lost.push_back(slice_report{s.op, 0, ec});
    if (!lost.empty()) host_.slices_done(lost);
  }

 private:
  // The stream broke on our own memory. `culprit`: the tag of the slice
  // whose buffer faulted, when known (a frame of its own); otherwise every
  // slice is probed (a WRITE's source must be readable, a READ's
  // destination writable).
  void local_fault(const std::uint64_t* culprit) {
    if (failed_) return;
    failed_ = true;
    failure_ = errc::peer_closed;  // for slices that arrive after: the path redials
    std::error_code ignored;
    socket_.shutdown(asio::socket_base::shutdown_both, ignored);
    socket_.close(ignored);
    std::deque<slice_ref> all = std::move(inflight_);
    for (auto& s : retry_) all.push_back(s);
    for (auto& s : queue_) all.push_back(s);
    inflight_.clear();
    retry_.clear();
    queue_.clear();
    frames_.clear();
    std::deque<slice_ref> survivors;
    for (auto& s : all) {
      const bool bad = (culprit != nullptr && s.tag == *culprit) ||
                       !accessible(s.local, s.length, s.kind == opcode::read);
      if (bad) {
        detail::log("{} of {} bytes at {} failed: the local buffer is not accessible memory",
                    s.kind == opcode::write ? "WRITE" : "READ", s.length,
                    static_cast<const void*>(s.local));
        host_.slice_done(s.op, 0, errc::local_memory_fault);
      } else {
        s.tag = 0;
        survivors.push_back(s);
      }
    }
    if (on_broken_) {
      auto cb = std::move(on_broken_);
      on_failure_ = nullptr;
      cb(std::move(survivors));
      return;
    }
    for (const auto& s : survivors) host_.slice_done(s.op, 0, errc::peer_closed);
    if (auto cb = std::move(on_failure_)) cb(errc::peer_closed);
  }

  void receive() {
    if (failed_ || receiving_) return;
    // The responses expected next: acknowledgements and small READ
    // responses whole, up to and including the header of the first large
    // READ response (its payload goes straight into place).
    std::size_t want = 0;
    for (const auto& f : frames_) {
      want += frame_header_size;
      if (f.kind == opcode::read) {
        if (f.length > small_read) break;
        want += static_cast<std::size_t>(f.length);
      }
      if (want >= recv_buf_.size()) break;
    }
    want = std::clamp<std::size_t>(want, frame_header_size, recv_buf_.size());
    if (want <= have_) want = std::min(have_ + frame_header_size, recv_buf_.size());
    const std::size_t at_least = have_ < frame_header_size ? frame_header_size - have_ : 1;
    receiving_ = true;
    asio::async_read(socket_, asio::buffer(recv_buf_.data() + have_, want - have_),
                     asio::transfer_at_least(at_least),
                     [self = shared_from_this()](std::error_code ec, std::size_t n) {
                       self->receiving_ = false;
                       self->on_headers(ec, n);
                     });
  }

  // Write acknowledgements and READs received together are reported
  // together.
  void flush_done() {
    if (done_.empty()) return;
    host_.slices_done(done_);
    done_.clear();
  }

  // A READ payload (or its first part) that came in the lane's buffer,
  // waiting to be copied into place.
  struct placed_read {
    slice_ref slice;
    const std::byte* from = nullptr;
    std::size_t length = 0;
    bool whole = true;           // the whole payload (else its first part)
    std::uint32_t checksum = 0;  // the response's, when `verify`
    bool verify = false;         // check `from` against `checksum` (a frame of its own)
    bool corrupt = false;        // its vector frame failed its checksum
  };

  // Copies the payloads of copies_ into place, as few system calls as the
  // kernel allows, and reports the whole ones (into done_). A destination
  // the kernel cannot write fails that READ alone (local_memory_fault).
  // Returns false when the first part of a payload failed to copy (the
  // caller's slice at the front of the in-flight list).
  bool place_reads() {
    bool ok = true;
    std::size_t i = 0;
    while (i < copies_.size()) {
      std::array<iovec, 64> from{};
      std::array<iovec, 64> to{};
      std::size_t n = 0;
      for (; n < from.size() && i + n < copies_.size(); ++n) {
        const auto& c = copies_[i + n];
        from[n] = iovec{const_cast<std::byte*>(c.from), c.length};
        to[n] = iovec{c.slice.local, c.length};
      }
      std::size_t copied = 0;
      const auto got = ::process_vm_writev(::getpid(), from.data(), n, to.data(), n, 0);
      if (got < 0 && (errno == ENOSYS || errno == EPERM)) {
        // Cross-memory attach is not allowed here (a seccomp filter): copy
        // ourselves; every destination is registered memory of this process.
        for (std::size_t k = 0; k < n; ++k)
          std::memcpy(to[k].iov_base, from[k].iov_base, to[k].iov_len);
        copied = n;
      } else {
        // Whole entries copied; the one the kernel stopped in failed.
        std::size_t bytes = got > 0 ? static_cast<std::size_t>(got) : 0;
        while (copied < n && bytes >= to[copied].iov_len) bytes -= to[copied++].iov_len;
      }
      for (std::size_t k = 0; k < copied; ++k) settle(copies_[i + k], true);
      if (copied < n) {
        ok = settle(copies_[i + copied], false) && ok;
        ++copied;
      }
      i += copied;
    }
    copies_.clear();
    return ok;
  }

  bool settle(const placed_read& c, bool copied) {
    if (!c.whole) return copied;  // its rest is read next, or the lane breaks
    if (!copied) {
      detail::log("READ of {} bytes into {} failed: the local buffer is not accessible memory",
                  c.slice.length, static_cast<const void*>(c.slice.local));
      done_.push_back(slice_report{c.slice.op, 0, errc::local_memory_fault});
      return true;
    }
    // With a checksum, a corrupted payload is never reported as read (its
    // bytes are in place, though). Checked on the bytes received.
    const bool bad = c.corrupt || (c.verify && crc32c(c.from, c.length) != c.checksum);
    if (bad) {
      done_.push_back(slice_report{c.slice.op, 0, errc::checksum_mismatch});
    } else {
      add_report(done_, c.slice.op, c.slice.length);
    }
    return true;
  }

  // A READ response (`f`, at the front) whose payload did not all come
  // with the last receive: the `in_buf` bytes at `head` that did are copied
  // into place, the rest read straight into the slices' memory, in one
  // scatter receive.
  void receive_rest(const frame_header& h, const sent_frame& f, const std::byte* head,
                    std::size_t in_buf) {
    scatter_.clear();
    std::size_t rest = 0;  // bytes still to receive
    std::size_t left = in_buf;
    const std::byte* at = head;
    for (std::size_t k = 0; k < f.count; ++k) {
      const slice_ref& s = inflight_[k];
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(left, s.length));
      if (n > 0) copies_.push_back(placed_read{s, at, n, false, 0, false, false});
      at += n;
      left -= n;
      if (n < s.length) {
        scatter_.emplace_back(s.local + n, static_cast<std::size_t>(s.length) - n);
        rest += scatter_.back().size();
      }
    }
    // The checksum of the part that came, continued over the rest.
    const std::uint32_t head_crc = f.checksum ? crc32c(head, in_buf) : 0;
    const bool head_ok = place_reads();
    have_ = 0;
    if (!head_ok) {  // which slice of a vector frame: probed
      local_fault(f.count == 1 ? &f.tag : nullptr);
      return;
    }
    // Reported once the rest arrived: the acknowledgements before it now.
    flush_done();
    receiving_ = true;
    // Woken once per low_water bytes, not per segment (tcp/receive.hpp).
    receive_all(
        socket_, scatter_, 0, rest, mark_,
        [self = shared_from_this(), crc = h.checksum, in_buf, head_crc](std::error_code rec) {
          self->receiving_ = false;
          if (self->failed_) return;
          const sent_frame front = self->frames_.front();
          if (is_bad_address(rec)) {  // a destination of the READ being received
            self->local_fault(front.count == 1 ? &front.tag : nullptr);
            return;
          }
          if (rec) {
            self->fail(control::map_socket_error(rec));
            return;
          }
          self->frames_.pop_front();
          // With a checksum, a corrupted payload is never reported as read
          // (its bytes are in place, though).
          bool bad = false;
          if (front.checksum) {
            std::uint32_t c = head_crc;
            std::size_t skip = in_buf;
            for (std::size_t k = 0; k < front.count; ++k) {
              const slice_ref& s = self->inflight_[k];
              const auto n = static_cast<std::size_t>(s.length);
              const std::size_t from = std::min(skip, n);
              c = crc32c(s.local + from, n - from, c);
              skip -= from;
            }
            bad = c != crc;
          }
          for (std::size_t k = 0; k < front.count; ++k) {
            const slice_ref s = self->inflight_.front();
            self->inflight_.pop_front();
            add_report(self->done_, s.op, bad ? 0 : s.length,
                       bad ? std::error_code{errc::checksum_mismatch} : std::error_code{});
          }
          self->flush_done();
          self->pump();
          self->receive();
        });
  }

  void on_headers(std::error_code ec, std::size_t n) {
    if (failed_) return;
    if (ec) {
      fail(control::map_socket_error(ec));
      return;
    }
    struct flush_at_exit {
      lane* l;
      ~flush_at_exit() { l->flush_done(); }
    } flush{this};  // before any other report (fail() reports the rest after them)
    have_ += n;
    std::byte* base = recv_buf_.data();
    std::size_t pos = 0;
    // Fails the lane after placing and reporting what was read before.
    const auto broken = [this](std::error_code why) {
      (void)place_reads();
      fail(why);
    };
    while (have_ - pos >= frame_header_size) {
      frame_header h;
      if (auto dec = decode(base + pos, h)) {
        broken(dec);
        return;
      }
      if (frames_.empty() || h.tag != frames_.front().tag) {
        broken(errc::malformed_message);  // a response nobody asked for
        return;
      }
      const sent_frame f = frames_.front();
      const auto expected =
          f.kind == opcode::write ? frame_type::write_ack : frame_type::read_response;
      const auto status = status_to_error(h.status);
      if (h.type != expected || (status && h.length != 0) ||
          (!status && f.kind == opcode::read && h.length != f.length) ||
          (!status && f.kind == opcode::read && f.checksum &&
           (h.flags & frame_flag_checksum) == 0)) {
        broken(errc::malformed_message);
        return;
      }
      pos += frame_header_size;
      if (status && f.count > 1 && status != errc::checksum_mismatch) {
        // Refused whole: its slices go again, a frame each, for answers of
        // their own; device memory is then served one frame at a time.
        frames_.pop_front();
        const auto seg = inflight_.front().segment;
        if (status == errc::device_error &&
            std::find(no_vector_.begin(), no_vector_.end(), seg) == no_vector_.end()) {
          no_vector_.push_back(seg);
        }
        for (std::size_t k = 0; k < f.count; ++k) {
          retry_.push_back(inflight_.front());
          inflight_.pop_front();
        }
        continue;
      }
      if (f.kind == opcode::read && !status) {
        const auto len = static_cast<std::size_t>(f.length);
        const std::size_t in_buf = have_ - pos;
        if (in_buf >= len) {  // the whole payload is here: copied with the others
          const bool corrupt = f.count > 1 && f.checksum && crc32c(base + pos, len) != h.checksum;
          for (std::size_t k = 0; k < f.count; ++k) {
            const slice_ref s = inflight_.front();
            inflight_.pop_front();
            const auto len_k = static_cast<std::size_t>(s.length);
            copies_.push_back(placed_read{s, base + pos, len_k, true, h.checksum,
                                          f.count == 1 && s.checksum, corrupt});
            pos += len_k;
          }
          frames_.pop_front();
          continue;
        }
        receive_rest(h, f, base + pos, in_buf);
        return;
      }
      frames_.pop_front();
      for (std::size_t k = 0; k < f.count; ++k) {
        const slice_ref s = inflight_.front();
        inflight_.pop_front();
        add_report(done_, s.op, status ? 0 : s.length, status);
      }
    }
    (void)place_reads();
    if (pos > 0 && have_ > pos) std::memmove(base, base + pos, have_ - pos);
    have_ -= pos;
    pump();
    receive();
  }

  asio::ip::tcp::socket socket_;
  std::shared_ptr<transport_host> keep_;  // the host outlives the lane's handlers
  transport_host& host_;
  std::size_t window_;
  std::function<void(std::error_code)> on_failure_;
  broken_fn on_broken_;
  // Takes the slices queued behind `s` (just put in flight, the last of
  // inflight_) that may share its vector frame into flight with its tag;
  // returns how many slices the frame carries.
  std::size_t gather(const slice_ref& s) {
    if (vectors_.pieces < 2 || s.length > vector_piece ||
        std::find(no_vector_.begin(), no_vector_.end(), s.segment) != no_vector_.end()) {
      return 1;
    }
    std::size_t count = 1;
    std::uint64_t bytes = s.length;
    while (count < vectors_.pieces && !queue_.empty()) {
      slice_ref p = queue_.front();
      if (p.kind != s.kind || p.segment != s.segment || p.checksum != s.checksum ||
          p.length > vector_piece || bytes + p.length > vectors_.bytes) {
        break;
      }
      queue_.pop_front();
      if (host_.stopping(p.op)) {
        host_.slice_done(p.op, 0, errc::cancelled);
        continue;
      }
      p.tag = s.tag;
      inflight_.push_back(p);
      ++count;
      bytes += p.length;
    }
    return count;
  }

  std::deque<slice_ref> queue_;            // planned, not yet sent
  std::deque<slice_ref> retry_;            // refused in a vector frame: sent again, a frame each
  std::deque<slice_ref> inflight_;         // sent, response pending, in send order
  std::deque<sent_frame> frames_;          // the frames of inflight_, in send order
  std::vector<frame_bytes> send_headers_;  // headers of the write in progress
  std::vector<std::array<std::byte, max_vector_pieces * piece_entry_size>> send_tables_;
  std::vector<asio::const_buffer> send_bufs_;
  gather_state gather_;  // send_all's iovecs
  vector_limits vectors_;
  std::vector<std::uint64_t> no_vector_;       // segments served a frame at a time
  std::vector<asio::mutable_buffer> scatter_;  // the rest of a READ payload being received
  low_water_mark mark_;                        // the socket's SO_RCVLOWAT
  std::vector<slice_report> done_;   // acknowledged or read, reported at the end of on_headers
  std::vector<placed_read> copies_;  // READ payloads received, to copy into place
  std::vector<std::byte> recv_buf_;  // responses received, recv_capacity bytes
  std::size_t have_ = 0;             // bytes of a partial response at the start of recv_buf_
  std::uint64_t next_tag_ = 1;
  bool writing_ = false;
  bool receiving_ = false;
  bool failed_ = false;
  std::error_code failure_;
};

}  // namespace kvlink::tcp
