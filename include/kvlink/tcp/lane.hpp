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

/// Whether [p, p + n) can be read by this process, found without faulting:
/// the kernel copies it (process_vm_readv on ourselves), in chunks.
inline bool readable(const std::byte* p, std::uint64_t n) {
  thread_local std::array<std::byte, 64u << 10> scratch;
  for (std::uint64_t done = 0; done < n;) {
    const auto len = static_cast<std::size_t>(std::min<std::uint64_t>(n - done, scratch.size()));
    iovec local{scratch.data(), len};
    iovec remote{const_cast<std::byte*>(p + done), len};
    const auto got = ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0);
    if (got <= 0) return false;
    done += static_cast<std::uint64_t>(got);
  }
  return true;
}

// ------------------------------------------------------------------ lane

class lane final : public std::enable_shared_from_this<lane> {
 public:
  static constexpr std::size_t max_batch_frames = 64;
  static constexpr std::uint64_t max_batch_bytes = 8u << 20;
  /// READ responses whose payload is at most this long are received with
  /// the responses around them (into the lane's buffer, then copied).
  static constexpr std::uint64_t small_read = 16u << 10;
  /// Bytes one receive of responses may bring.
  static constexpr std::size_t recv_capacity = 64u << 10;

  using broken_fn = std::function<void(std::deque<slice_ref>)>;

  /// `on_failure`: the lane failed for good (the peer is gone). `on_broken`:
  /// our own memory broke the stream; the slices to carry on another
  /// connection are handed over (when not given, they fail like the rest).
  lane(asio::ip::tcp::socket socket, transport_host& host, std::size_t window,
       std::function<void(std::error_code)> on_failure, broken_fn on_broken = nullptr)
      : socket_(std::move(socket)),
        keep_(host.keep_alive()),
        host_(host),
        window_(std::max<std::size_t>(window, 1)),
        on_failure_(std::move(on_failure)),
        on_broken_(std::move(on_broken)) {
    send_headers_.reserve(max_batch_frames);
    send_bufs_.reserve(2 * max_batch_frames);
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
    std::erase_if(queue_, [this](const slice_ref& s) {
      if (!host_.stopping(s.op)) return false;
      host_.slice_done(s.op, 0, errc::cancelled);
      return true;
    });
  }

  /// Whether it holds (queued or in flight) a slice of `op`.
  bool carries(const detail::transfer_op* op) const {
    const auto of_op = [op](const slice_ref& s) { return s.op == op; };
    return std::any_of(inflight_.begin(), inflight_.end(), of_op) ||
           std::any_of(queue_.begin(), queue_.end(), of_op);
  }

  /// Sends what the window allows. Call after enqueue().
  void pump() {
    if (writing_ || failed_) return;
    send_headers_.clear();
    send_bufs_.clear();
    std::uint64_t bytes = 0;
    while (!queue_.empty() && inflight_.size() < window_ &&
           send_headers_.size() < max_batch_frames && bytes < max_batch_bytes) {
      slice_ref s = queue_.front();
      queue_.pop_front();
      if (host_.stopping(s.op)) {  // never sent: nothing touches its memory
        host_.slice_done(s.op, 0, errc::cancelled);
        continue;
      }
      s.tag = next_tag_++;
      frame_header h;
      h.type = s.kind == opcode::write ? frame_type::write_request : frame_type::read_request;
      h.tag = s.tag;
      h.segment = s.segment;
      h.offset = s.offset;
      h.length = s.length;
      if (s.checksum) {
        h.flags = frame_flag_checksum;
        if (s.kind == opcode::write)
          h.checksum = crc32c(s.local, static_cast<std::size_t>(s.length));
      }
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
    inflight_.clear();
    queue_.clear();
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
  // whose buffer faulted, when known; otherwise every slice is probed.
  void local_fault(const std::uint64_t* culprit) {
    if (failed_) return;
    failed_ = true;
    failure_ = errc::peer_closed;  // for slices that arrive after: the path redials
    std::error_code ignored;
    socket_.shutdown(asio::socket_base::shutdown_both, ignored);
    socket_.close(ignored);
    std::deque<slice_ref> all = std::move(inflight_);
    for (auto& s : queue_) all.push_back(s);
    inflight_.clear();
    queue_.clear();
    std::deque<slice_ref> survivors;
    for (auto& s : all) {
      const bool bad = (culprit != nullptr && s.tag == *culprit) || !readable(s.local, s.length);
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
    for (const auto& s : inflight_) {
      want += frame_header_size;
      if (s.kind == opcode::read) {
        if (s.length > small_read) break;
        want += static_cast<std::size_t>(s.length);
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
    std::uint32_t checksum = 0;  // the response's, when the slice asked
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
    const bool bad = c.slice.checksum && crc32c(c.from, c.length) != c.checksum;
    done_.push_back(bad ? slice_report{c.slice.op, 0, errc::checksum_mismatch}
                        : slice_report{c.slice.op, c.slice.length, {}});
    return true;
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
      if (inflight_.empty() || h.tag != inflight_.front().tag) {
        broken(errc::malformed_message);  // a response nobody asked for
        return;
      }
      slice_ref s = inflight_.front();
      const auto expected =
          s.kind == opcode::write ? frame_type::write_ack : frame_type::read_response;
      const auto status = status_to_error(h.status);
      if (h.type != expected || (status && h.length != 0) ||
          (!status && s.kind == opcode::read && h.length != s.length) ||
          (!status && s.kind == opcode::read && s.checksum &&
           (h.flags & frame_flag_checksum) == 0)) {
        broken(errc::malformed_message);
        return;
      }
      if (s.kind == opcode::read && !status) {
        const std::size_t len = static_cast<std::size_t>(s.length);
        const std::size_t in_buf = have_ - pos - frame_header_size;
        if (in_buf >= len) {  // the whole payload is here: copied with the others
          pos += frame_header_size;
          copies_.push_back(placed_read{s, base + pos, len, true, h.checksum});
          pos += len;
          inflight_.pop_front();
          continue;
        }
        // The rest of the payload follows: what came is copied into place,
        // the rest read straight into the caller's memory.
        pos += frame_header_size;
        if (in_buf > 0) copies_.push_back(placed_read{s, base + pos, in_buf, false, 0});
        const bool head_ok = place_reads();
        have_ = 0;
        if (!head_ok) {
          const auto culprit = s.tag;
          local_fault(&culprit);
          return;
        }
        // Reported once the rest arrived: the acknowledgements before it now.
        flush_done();
        // The checksum of the part that came, continued over the rest.
        const std::uint32_t head_crc = s.checksum ? crc32c(base + pos, in_buf) : 0;
        receiving_ = true;
        asio::async_read(socket_, asio::buffer(s.local + in_buf, len - in_buf),
                         [self = shared_from_this(), crc = h.checksum, in_buf, head_crc](
                             std::error_code rec, std::size_t) {
                           self->receiving_ = false;
                           if (self->failed_) return;
                           if (is_bad_address(rec)) {
                             // The destination of the READ being received.
                             const auto culprit = self->inflight_.front().tag;
                             self->local_fault(&culprit);
                             return;
                           }
                           if (rec) {
                             self->fail(control::map_socket_error(rec));
                             return;
                           }
                           const auto done = self->inflight_.front();
                           self->inflight_.pop_front();
                           // With a checksum, a corrupted payload is never
                           // reported as read (its bytes are in place, though).
                           const bool bad = done.checksum &&
                                            crc32c(done.local + in_buf,
                                                   static_cast<std::size_t>(done.length) - in_buf,
                                                   head_crc) != crc;
                           self->host_.slice_done(
                               done.op, bad ? 0 : done.length,
                               bad ? std::error_code{errc::checksum_mismatch} : std::error_code{});
                           self->pump();
                           self->receive();
                         });
        return;
      }
      pos += frame_header_size;
      inflight_.pop_front();
      done_.push_back(slice_report{s.op, status ? 0 : s.length, status});
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
  std::deque<slice_ref> queue_;            // planned, not yet sent
  std::deque<slice_ref> inflight_;         // sent, response pending, in send order
  std::vector<frame_bytes> send_headers_;  // headers of the write in progress
  std::vector<asio::const_buffer> send_bufs_;
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
