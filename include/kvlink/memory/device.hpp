// The device layer: the few operations kvlink needs from a GPU runtime.
//
// Device memory is memory the CPU cannot touch: a transport that cannot
// reach it (transport::reaches()) moves its bytes through pinned host
// staging with the device's copy engine (engine/staging.hpp). A runtime
// classifies pointers (host, device N, managed, VMM) and finds their
// allocation, allocates pinned host and device memory, copies
// asynchronously on a stream per device (completion posted on an executor:
// no thread blocked per copy), exports an allocation for another process on
// this host and imports one, and hands out a dma-buf fd for a range (RDMA
// GPUDirect).
//
// Two implementations: `cuda` (memory/cuda/, kvlink/cuda.hpp, link
// kvlink::cuda; the driver is loaded at run time, so a CUDA build runs on a
// machine without one) and `emulated` (memory/emulated.hpp: device memory is
// a memfd mapped PROT_NONE where the user sees it, reachable only through
// its own copy engine; for tests and CI). Headers that bring a runtime add
// it to device_catalog::global(); an engine takes the one config.device
// names (device_catalog::select).
//
//   auto rt = kvlink::device_catalog::global().find("emulated");
//   kvlink::device_buffer buf{rt, /*device=*/0, 1 << 20};     // device memory
//   auto stream = rt->open_stream(0, io.get_executor(), ec, what);
//   stream->async_copy(buf.data(), {memory_kind::device, 0}, host, {}, n, done);
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/memory/config.hpp>
#include <kvlink/memory/copy_engine.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <fmt/format.h>

namespace kvlink {

/// What a pointer is, as a device runtime sees it.
struct pointer_info {
  /// host (ordinary, pinned or managed memory: the CPU may touch it) or
  /// device N.
  memory_desc memory{};
  bool managed = false;  ///< unified/managed memory (reported as host)
  bool vmm = false;      ///< a VMM mapping (cuMemCreate/cuMemMap: expandable segments)
  /// The device allocation holding the pointer: [base, base + size). 0 for
  /// host memory.
  std::uintptr_t base = 0;
  std::uint64_t size = 0;
};

/// An allocation made shareable with another process on this host.
struct exported_memory {
  /// "memfd" (emulated), "ipc" (a legacy CUDA IPC handle in `handle`),
  /// "fd" (a VMM allocation's POSIX fd).
  std::string method;
  /// Opaque bytes the importer needs (the IPC handle); may be empty.
  std::vector<std::uint8_t> handle;
  /// A descriptor in the exporting process that an importer duplicates
  /// (pidfd_getfd); -1 when the method needs none. Owned by the runtime: it
  /// stays open while the allocation lives.
  int fd = -1;
  std::int32_t device = -1;
  std::uint64_t size = 0;  ///< bytes of the whole allocation
};

/// A device's copy engine for one executor: copies between host and device
/// memory of this process, in any direction, asynchronously. `done` is
/// posted on the stream's executor, never run inside async_copy, once every
/// byte is at dst (or with why not: device_error, invalid_argument for a
/// pointer of another device runtime, out_of_bounds for a range running
/// past its allocation). Copies on one stream complete in order.
/// Thread safety: async_copy may be called from any thread.
class device_stream : public copy_engine {
 public:
  /// The device it copies on.
  virtual std::int32_t device() const noexcept = 0;
};

/// A GPU runtime, or its emulation. Thread safety: every member may be
/// called from any thread.
class device_runtime {
 public:
  virtual ~device_runtime() = default;

  /// "cuda", "emulated".
  virtual std::string_view name() const noexcept = 0;
  /// Usable here; when not, why not ("no CUDA driver (libcuda.so.1: ...)").
  virtual bool available() const noexcept = 0;
  virtual std::string unavailable_reason() const = 0;
  virtual int device_count() const noexcept = 0;
  /// About how fast one copy runs, in GB/s (10^9 B/s): between two device
  /// allocations (`between_devices`), else between device and pinned host
  /// memory. A nominal figure that sizes how many bytes of copies a
  /// transport keeps queued (shm/transport.hpp), not a measurement.
  virtual double copy_rate_hint(bool between_devices) const noexcept {
    (void)between_devices;
    return 50.0;
  }

  /// What `p` is: device memory of this runtime (with its allocation), or
  /// host memory (anything else, managed memory included).
  virtual pointer_info classify(const void* p) const noexcept = 0;

  /// Pinned (page-locked) host memory for staging; `what` says the failing
  /// call. null on failure.
  virtual void* allocate_pinned(std::size_t n, std::error_code& ec, std::string& what) = 0;
  virtual void free_pinned(void* p) noexcept = 0;
  /// Device memory (tests, benches, users' own CI). null on failure.
  virtual void* allocate(std::int32_t device, std::size_t n, std::error_code& ec,
                         std::string& what) = 0;
  virtual void free(void* p) noexcept = 0;

  /// A stream on `device` whose completions are posted on `ex`.
  virtual std::shared_ptr<device_stream> open_stream(std::int32_t device, asio::any_io_executor ex,
                                                     std::error_code& ec, std::string& what) = 0;

  /// Exports the allocation holding `p` for another process on this host
  /// (offsets inside it are the caller's: classify(p).base is where it
  /// starts). not_registered when `p` is not device memory of this runtime;
  /// invalid_argument with `what` when the allocation cannot be exported.
  virtual std::error_code export_memory(const void* p, exported_memory& out, std::string& what) = 0;
  /// Maps an allocation another process exported; `fd` is this process's
  /// duplicate of m.fd (taken over: closed by close_imported or on
  /// failure), -1 when m.method needs none. Returns where it starts here
  /// (device memory: reached with a stream, like this process's own).
  virtual void* import_memory(const exported_memory& m, int fd, std::error_code& ec,
                              std::string& what) = 0;
  virtual void close_imported(void* p) noexcept = 0;

  /// A dma-buf fd for [p, p + n) (RDMA GPUDirect registration with
  /// ibv_reg_dmabuf_mr): the fd covers whole pages; `offset` is where p
  /// lies in it. -1 with ec and `what` when the runtime or driver cannot.
  virtual int dmabuf_fd(const void* p, std::uint64_t n, std::uint64_t& offset, std::error_code& ec,
                        std::string& what) = 0;
};

/// The device runtimes this program has: kvlink/memory/emulated.hpp adds
/// "emulated", kvlink/cuda.hpp adds "cuda". Each runtime is made once and
/// shared (device memory is process-wide).
class device_catalog {
 public:
  using factory = std::function<std::shared_ptr<device_runtime>()>;

  static device_catalog& global() {
    static device_catalog c;
    return c;
  }

  /// Adds a runtime (made on first use). Returns true so that a header can
  /// add one from an inline variable's initializer.
  bool add(std::string name, factory make) {
    std::lock_guard lock{mutex_};
    for (auto& e : entries_) {
      if (e.name == name) {
        e.make = std::move(make);
        e.made.reset();
        return true;
      }
    }
    entries_.push_back(entry{std::move(name), std::move(make), nullptr});
    return true;
  }

  /// The runtime named `name`, or null when this program does not have it.
  std::shared_ptr<device_runtime> find(std::string_view name) {
    std::lock_guard lock{mutex_};
    for (auto& e : entries_) {
      if (e.name != name) continue;
      if (!e.made) e.made = e.make();
      return e.made;
    }
    return nullptr;
  }

  /// "emulated, cuda".
  std::string names() const {
    std::lock_guard lock{mutex_};
    std::string out;
    for (const auto& e : entries_) out += (out.empty() ? "" : ", ") + e.name;
    return out.empty() ? "none" : out;
  }

  /// The runtime config.device asks for: null for "none", and for "auto"
  /// when no CUDA runtime is both here and available (never the emulated
  /// one). A named runtime this program lacks, or one that is not
  /// available, is invalid_argument / no_device with `what` saying why.
  std::shared_ptr<device_runtime> select(const device_config& c, std::error_code& ec,
                                         std::string& what) {
    ec = {};
    if (c.runtime == "none") return nullptr;
    if (c.runtime == "auto") {
      auto rt = find("cuda");
      return rt && rt->available() ? rt : nullptr;
    }
    auto rt = find(c.runtime);
    if (!rt) {
      ec = errc::invalid_argument;
      what = fmt::format(
          "config.device names '{}', which this program does not have (it has: {}){}", c.runtime,
          names(), c.runtime == "cuda" ? "; include <kvlink/cuda.hpp> and link kvlink::cuda" : "");
      return nullptr;
    }
    if (!rt->available()) {
      ec = errc::no_device;
      what = fmt::format("config.device '{}' is not usable here: {}", c.runtime,
                         rt->unavailable_reason());
      return nullptr;
    }
    return rt;
  }

 private:
  struct entry {
    std::string name;
    factory make;
    std::shared_ptr<device_runtime> made;
  };
  mutable std::mutex mutex_;
  std::vector<entry> entries_;
};

namespace detail {

/// Memory a runtime allocated, freed with it (RAII; move-only): the body of
/// device_buffer and pinned_buffer.
class runtime_allocation {
 public:
  runtime_allocation(runtime_allocation&& o) noexcept
      : rt_(std::move(o.rt_)),
        data_(std::exchange(o.data_, nullptr)),
        size_(o.size_),
        pinned_(o.pinned_) {}
  runtime_allocation& operator=(runtime_allocation&& o) noexcept {
    if (this != &o) {
      reset();
      rt_ = std::move(o.rt_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = o.size_;
      pinned_ = o.pinned_;
    }
    return *this;
  }
  ~runtime_allocation() { reset(); }

  std::byte* data() const noexcept { return static_cast<std::byte*>(data_); }
  std::size_t size() const noexcept { return size_; }

 protected:
  runtime_allocation() = default;
  /// Throws std::system_error with the failing call.
  runtime_allocation(std::shared_ptr<device_runtime> rt, bool pinned, std::int32_t device,
                     std::size_t n)
      : rt_(std::move(rt)), size_(n), pinned_(pinned) {
    std::error_code ec;
    std::string what;
    data_ = pinned ? rt_->allocate_pinned(n, ec, what) : rt_->allocate(device, n, ec, what);
    if (!data_) {
      throw std::system_error(
          ec, std::string("kvlink: ") + (pinned ? "pinned" : "device") + " allocation: " + what);
    }
  }

 private:
  void reset() noexcept {
    if (data_ && pinned_) rt_->free_pinned(data_);
    if (data_ && !pinned_) rt_->free(data_);
    data_ = nullptr;
  }
  std::shared_ptr<device_runtime> rt_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  bool pinned_ = false;
};

}  // namespace detail

/// Device memory owned by a runtime (RAII; move-only).
class device_buffer : public detail::runtime_allocation {
 public:
  device_buffer() = default;
  /// Throws std::system_error with the failing call.
  device_buffer(std::shared_ptr<device_runtime> rt, std::int32_t device, std::size_t n)
      : runtime_allocation(std::move(rt), false, device, n) {}
};

/// Pinned host memory owned by a runtime (RAII; move-only).
class pinned_buffer : public detail::runtime_allocation {
 public:
  pinned_buffer() = default;
  /// Throws std::system_error with the failing call.
  pinned_buffer(std::shared_ptr<device_runtime> rt, std::size_t n)
      : runtime_allocation(std::move(rt), true, -1, n) {}
};

}  // namespace kvlink
