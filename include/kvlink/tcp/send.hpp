// kvlink::tcp::send_all: a gathered write of many buffers in sendmsg calls
// of up to `send_quantum` bytes and IOV_MAX buffers each.
//
// Why: asio's async_write hands the kernel at most 64 buffers and 64 KiB per
// sendmsg (asio::detail::max_iov_len, asio::default_max_transfer_size). A
// vector frame of 256 pieces of 4 KiB is 258 buffers and 1 MiB, so each such
// frame took 16 calls, each paying the system call and TCP's per-call work
// and, over loopback, the receiver's processing and wake-up run on the
// sender's core. One call per `send_quantum` (256 KiB, the receivers'
// low-water mark: tcp/receive.hpp) cut that by four, and did better than
// larger calls too: a sender that fills its socket buffer in one call and
// then waits for room (4 MiB calls: 1 MiB slices at 2.3-2.8 GiB/s against
// 3.0-3.8 with asio's writes, this VM) leaves both cores idle in turn, while
// calls of the quantum, each followed by a turn of the io_context (the
// acknowledgements read, the other lanes served), kept 1 MiB slices at
// 3.7-4.5 GiB/s.
#pragma once

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/buffer.hpp>
#include <asio/error.hpp>
#include <asio/post.hpp>
#include <asio/socket_base.hpp>
#include <sys/socket.h>
#include <sys/uio.h>

namespace kvlink::tcp {

/// Buffers one sendmsg is given at most (the kernel refuses more).
inline constexpr std::size_t max_send_iov = IOV_MAX;
/// Bytes one sendmsg is given at most.
inline constexpr std::size_t send_quantum = 256u << 10;

/// What send_all keeps between its system calls: the iovec array it hands
/// the kernel. One per socket, used on the socket's strand only.
struct gather_state {
  std::vector<iovec> iov;
};

/// Writes every byte of `bufs` (from index `at` on; the buffer there is
/// advanced past what was written) to `s`, then calls done(ec) from the
/// socket's executor, never inside this call. The first sendmsg is made in
/// here; each next one after a turn of the executor (posted), or, when the
/// socket's buffer is full, once the socket is writable (through its
/// reactor). An error ends it with that error at once (EFAULT for a buffer
/// the kernel could not read; EPIPE or ECONNRESET for a peer gone; no
/// SIGPIPE). `s`, `bufs` and `state` must outlive the operation (`done`
/// holds their owner); nothing else may write to `s` meanwhile.
template <class Socket, class Done>
void send_all(Socket& s, std::vector<asio::const_buffer>& bufs, std::size_t at, gather_state& state,
              Done done) {
  while (at < bufs.size() && bufs[at].size() == 0) ++at;
  if (at == bufs.size()) {
    asio::post(s.get_executor(), [d = std::move(done)]() mutable { d(std::error_code{}); });
    return;
  }
  // Up to the quantum, the last buffer cut short there.
  state.iov.clear();
  std::size_t bytes = 0;
  for (std::size_t i = at; i < bufs.size() && state.iov.size() < max_send_iov; ++i) {
    const std::size_t len = std::min(bufs[i].size(), send_quantum - bytes);
    state.iov.push_back(iovec{const_cast<void*>(bufs[i].data()), len});
    bytes += len;
    if (bytes == send_quantum) break;
  }
  msghdr msg{};
  msg.msg_iov = state.iov.data();
  msg.msg_iovlen = state.iov.size();
  ssize_t sent = 0;
  do {
    sent = ::sendmsg(s.native_handle(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
    const std::error_code ec(errno, asio::error::get_system_category());
    asio::post(s.get_executor(), [ec, d = std::move(done)]() mutable { d(ec); });
    return;
  }
  if (sent <= 0) {  // the socket's buffer is full: on once it has room
    s.async_wait(asio::socket_base::wait_write,
                 [&s, &bufs, &state, at, done = std::move(done)](std::error_code ec) mutable {
                   if (ec) {  // the wait's own error (the socket closed under it)
                     done(ec);
                     return;
                   }
                   send_all(s, bufs, at, state, std::move(done));
                 });
    return;
  }
  // Past what was written (and the empty buffers after it).
  for (auto left = static_cast<std::size_t>(sent); left > 0;) {
    auto& b = bufs[at];
    if (left < b.size()) {
      b += left;
      break;
    }
    left -= b.size();
    ++at;
  }
  while (at < bufs.size() && bufs[at].size() == 0) ++at;
  if (at == bufs.size()) {  // all written: one post, the completion
    asio::post(s.get_executor(), [d = std::move(done)]() mutable { d(std::error_code{}); });
    return;
  }
  asio::post(s.get_executor(), [&s, &bufs, &state, at, done = std::move(done)]() mutable {
    send_all(s, bufs, at, state, std::move(done));
  });
}

}  // namespace kvlink::tcp
