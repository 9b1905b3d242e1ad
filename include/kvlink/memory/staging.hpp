// Pinned staging for device memory that a transport cannot reach directly.
//
// A staging_pool holds, per device, a stream of the device's copy engine and
// a region of pinned host memory cut into equal chunks. A device slice that
// travels over a host-only transport (TCP, RDMA without GPUDirect) borrows a
// chunk: a WRITE is copied device -> chunk, then sent from the chunk; a READ
// lands in the chunk, then is copied chunk -> device. Chunks come back in
// turn; a slice that finds none waits (its `ready` runs when one is
// released), so the pinned memory in use is bounded and the copies of slice
// n+1 overlap the wire time of slice n.
//
// Thread safety: every member may be called from any thread. Callbacks are
// posted on the executor the caller names, never run inside the call.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/memory/device.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/post.hpp>
#include <fmt/format.h>

namespace kvlink {

class staging_pool {
 public:
  using ready_fn = std::function<void(std::byte* chunk)>;

  /// `chunk` bytes per chunk, `bytes` of pinned memory per device (at least
  /// two chunks). Streams post their completions on `io`.
  staging_pool(std::shared_ptr<device_runtime> rt, asio::any_io_executor io, std::uint64_t chunk,
               std::uint64_t bytes)
      : rt_(std::move(rt)),
        io_(std::move(io)),
        chunk_(chunk),
        chunks_(static_cast<std::size_t>(std::max<std::uint64_t>(2, bytes / chunk))) {}

  staging_pool(const staging_pool&) = delete;
  staging_pool& operator=(const staging_pool&) = delete;

  ~staging_pool() {
    // Streams first: a copy under way finishes before the memory goes.
    for (auto& [d, s] : devices_) s.stream.reset();
    for (auto& [d, s] : devices_) {
      if (s.region) rt_->free_pinned(s.region);
    }
  }

  device_runtime& runtime() const noexcept { return *rt_; }
  std::shared_ptr<device_runtime> runtime_ptr() const noexcept { return rt_; }
  std::uint64_t chunk_size() const noexcept { return chunk_; }
  std::size_t chunks_per_device() const noexcept { return chunks_; }

  /// Makes device `device`'s stream and pinned chunks (once); `what` says
  /// the failing call.
  std::error_code prepare(std::int32_t device, std::string& what) {
    std::lock_guard lock{mutex_};
    return prepare_locked(device, what);
  }

  /// Device `device`'s pinned region (null before prepare()).
  std::pair<std::byte*, std::uint64_t> region(std::int32_t device) const {
    std::lock_guard lock{mutex_};
    auto it = devices_.find(device);
    if (it == devices_.end()) return {nullptr, 0};
    return {it->second.region, chunk_ * chunks_};
  }

  /// A chunk of `device`'s staging for `ready`, posted on `ex`: at once when
  /// one is free, else when one is released. With no staging for the device
  /// (prepare() failed), `ready` gets null.
  void acquire(std::int32_t device, asio::any_io_executor ex, ready_fn ready) {
    std::byte* chunk = nullptr;
    {
      std::lock_guard lock{mutex_};
      std::string what;
      if (!prepare_locked(device, what)) {
        auto& s = devices_.at(device);
        if (s.free.empty()) {
          s.waiters.push_back(waiter{std::move(ex), std::move(ready)});
          return;
        }
        chunk = s.free.back();
        s.free.pop_back();
      }
    }
    asio::post(ex, [ready = std::move(ready), chunk] { ready(chunk); });
  }

  /// Gives a chunk back (to the first waiter, if any).
  void release(std::int32_t device, std::byte* chunk) {
    std::unique_lock lock{mutex_};
    auto it = devices_.find(device);
    if (it == devices_.end() || chunk == nullptr) return;
    auto& s = it->second;
    if (s.waiters.empty()) {
      s.free.push_back(chunk);
      return;
    }
    auto w = std::move(s.waiters.front());
    s.waiters.pop_front();
    lock.unlock();
    asio::post(w.ex, [ready = std::move(w.ready), chunk] { ready(chunk); });
  }

  /// Copies `n` bytes on `device`'s stream; `done` posted on `ex`.
  void copy(std::int32_t device, void* dst, memory_desc dst_memory, const void* src,
            memory_desc src_memory, std::size_t n, asio::any_io_executor ex,
            copy_engine::done_fn done) {
    std::shared_ptr<device_stream> stream;
    {
      std::lock_guard lock{mutex_};
      std::string what;
      if (!prepare_locked(device, what)) stream = devices_.at(device).stream;
    }
    if (!stream) {
      asio::post(ex, [done = std::move(done)] { done(errc::device_error); });
      return;
    }
    stream->async_copy(dst, dst_memory, src, src_memory, n,
                       [ex = std::move(ex), done = std::move(done)](std::error_code ec) mutable {
                         asio::post(ex, [done = std::move(done), ec] { done(ec); });
                       });
  }

 private:
  struct waiter {
    asio::any_io_executor ex;
    ready_fn ready;
  };
  struct per_device {
    std::shared_ptr<device_stream> stream;
    std::byte* region = nullptr;
    std::vector<std::byte*> free;
    std::deque<waiter> waiters;
    std::error_code failed;
    std::string failed_what;
  };

  std::error_code prepare_locked(std::int32_t device, std::string& what) {
    auto [it, fresh] = devices_.try_emplace(device);
    auto& s = it->second;
    if (!fresh) {
      if (s.failed) what = s.failed_what;
      return s.failed;
    }
    std::error_code ec;
    s.stream = rt_->open_stream(device, io_, ec, what);
    if (s.stream) {
      s.region = static_cast<std::byte*>(rt_->allocate_pinned(chunk_ * chunks_, ec, what));
    }
    if (!s.stream || !s.region) {
      s.stream.reset();
      s.failed = ec ? ec : make_error_code(errc::device_error);
      s.failed_what = what = fmt::format("staging for {} device {}: {}", rt_->name(), device, what);
      return s.failed;
    }
    s.free.reserve(chunks_);
    for (std::size_t i = chunks_; i-- > 0;) s.free.push_back(s.region + i * chunk_);
    return {};
  }

  std::shared_ptr<device_runtime> rt_;
  asio::any_io_executor io_;
  std::uint64_t chunk_;
  std::size_t chunks_;
  mutable std::mutex mutex_;
  std::map<std::int32_t, per_device> devices_;
};

}  // namespace kvlink
