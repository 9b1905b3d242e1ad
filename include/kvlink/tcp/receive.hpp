// kvlink::tcp::receive_all: a payload received straight into its pieces
// with the socket's receive low-water mark (SO_RCVLOWAT) raised to the
// bytes still to come, so that the receiving thread is woken once per
// `low_water` bytes instead of once per segment that arrives.
//
// Why: over loopback the sender's core delivers each segment and wakes the
// receiver (a futex and, in a VM, an inter-processor interrupt); with a
// receiver that drains the socket as fast as it fills, a 1 MiB vector frame
// cost a dozen wake-ups. The mark is never above what is still to come, so
// every receive ends; Linux also wakes the reader before the mark when the
// receive window is about to close or memory is short (tcp_epollin_ready).
// Each receive tries the socket first (asio's speculative read under the
// reactor's lock), so no readiness is lost between a read and its wait.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/buffer.hpp>
#include <sys/socket.h>

namespace kvlink::tcp {

/// The socket's SO_RCVLOWAT as last set through it (1: the kernel's
/// default); one per socket, used on the socket's strand only.
class low_water_mark {
 public:
  /// Sets the mark to `bytes` (at least 1; at most a quarter of the
  /// socket's receive buffer as it was at the first call, so that kernels
  /// before 5.7, which wake no reader below the mark even with the window
  /// closed, cannot wait forever) unless it is there already. An error is
  /// no reason to stop (without it every arrival wakes).
  template <class Socket>
  void set(Socket& s, std::size_t bytes) {
    if (!s.is_open()) return;
    if (cap_ == 0) {
      int buf = 0;
      socklen_t len = sizeof buf;
      const bool known =
          ::getsockopt(s.native_handle(), SOL_SOCKET, SO_RCVBUF, &buf, &len) == 0 && buf > 0;
      cap_ = known ? std::max<std::size_t>(static_cast<std::size_t>(buf) / 4, 1) : 1;
    }
    bytes = std::clamp<std::size_t>(bytes, 1, cap_);
    if (bytes == now_) return;
    const int v = static_cast<int>(std::min<std::size_t>(bytes, 1u << 30));
    if (::setsockopt(s.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0) now_ = bytes;
  }
  std::size_t get() const noexcept { return now_; }

 private:
  std::size_t now_ = 1;
  std::size_t cap_ = 0;  // 0: not known yet
};

/// The most bytes one receive of a payload waits for before it wakes.
inline constexpr std::size_t low_water = 256u << 10;

/// Receives `rest` bytes into `bufs` from index `at` on (the buffer there
/// advanced past what arrives), each receive waiting for at most
/// `low_water` bytes, then sets the mark back to 1 and calls done(ec) from
/// the completion of the last receive (never inside this call). `s`,
/// `bufs` and `mark` must outlive the operation (`done` holds their owner).
/// An error (end of stream, a bad destination: EFAULT) ends it with that
/// error at once, the mark left as it is (the socket is done with).
template <class Socket, class Done>
void receive_all(Socket& s, std::vector<asio::mutable_buffer>& bufs, std::size_t at,
                 std::size_t rest, low_water_mark& mark, Done done) {
  mark.set(s, std::min(rest, low_water));
  s.async_read_some(std::span<const asio::mutable_buffer>(bufs).subspan(at),
                    [&s, &bufs, &mark, at, rest, done = std::move(done)](std::error_code ec,
                                                                         std::size_t n) mutable {
                      if (ec || n >= rest) {
                        if (!ec) mark.set(s, 1);
                        done(ec);
                        return;
                      }
                      rest -= n;
                      while (n > 0) {
                        auto& b = bufs[at];
                        if (n < b.size()) {
                          b += n;
                          break;
                        }
                        n -= b.size();
                        ++at;
                      }
                      receive_all(s, bufs, at, rest, mark, std::move(done));
                    });
}

}  // namespace kvlink::tcp
