// The copy-engine seam: asynchronous copies between memory kinds, one layer
// above the transports (as UCX keeps its per-memory-type copy endpoints
// above its transports). A transport reaches some memory kinds directly
// (transport::reaches()); a segment of another kind is moved through a
// staging buffer the transport does reach, filled or drained by a copy
// engine. Host memory needs none; the CUDA support adds a copy engine over
// cudaMemcpyAsync whose completion events are polled on the engine's strand.
//
//   kvlink::host_copy_engine copies{io.get_executor()};
//   copies.async_copy(dst, {}, src, {}, n, [](std::error_code ec) { ... });
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>

#include <cstddef>
#include <cstring>
#include <functional>
#include <system_error>
#include <utility>

#include <asio/any_io_executor.hpp>
#include <asio/post.hpp>

namespace kvlink {

class copy_engine {
 public:
  using done_fn = std::function<void(std::error_code)>;

  virtual ~copy_engine() = default;

  /// Whether it copies from memory of kind `from` to memory of kind `to`.
  virtual bool copies(memory_kind from, memory_kind to) const noexcept = 0;

  /// Copies `n` bytes from `src` to `dst`. `done` runs later on the copy
  /// engine's executor, never inside the call, once every byte is at `dst`
  /// (or with the reason it is not: invalid_argument for a pair of kinds it
  /// does not copy). Until then neither buffer may be freed.
  virtual void async_copy(void* dst, memory_desc dst_memory, const void* src,
                          memory_desc src_memory, std::size_t n, done_fn done) = 0;
};

/// Host to host: memcpy on the calling thread; completion posted.
class host_copy_engine final : public copy_engine {
 public:
  explicit host_copy_engine(asio::any_io_executor ex) : ex_(std::move(ex)) {}

  bool copies(memory_kind from, memory_kind to) const noexcept override {
    return from == memory_kind::host && to == memory_kind::host;
  }

  void async_copy(void* dst, memory_desc dst_memory, const void* src, memory_desc src_memory,
                  std::size_t n, done_fn done) override {
    std::error_code ec;
    if (!copies(src_memory.kind, dst_memory.kind)) {
      ec = errc::invalid_argument;
    } else if (n > 0) {
      std::memcpy(dst, src, n);
    }
    asio::post(ex_, [done = std::move(done), ec] { done(ec); });
  }

 private:
  asio::any_io_executor ex_;
};

}  // namespace kvlink
