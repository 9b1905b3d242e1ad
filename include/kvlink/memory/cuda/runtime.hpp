// The CUDA device runtime (memory/device.hpp) over the CUDA driver API,
// which is loaded at run time (memory/cuda/driver.hpp): a program built
// with kvlink::cuda starts everywhere, and where there is no driver or no
// GPU the runtime says so (available() false, unavailable_reason()) and
// every pointer is host memory.
//
// Every call runs in the device's primary context (the one the CUDA
// runtime, PyTorch and friends use), pushed for the call and popped after,
// so kvlink never changes which context a user's thread has current. A
// stream is one non-blocking CUDA stream; a copy is cuMemcpyAsync (unified
// addressing: every direction) followed by an event from the stream's
// pool, and a poller on the stream's executor queries the oldest event,
// busy while copies are outstanding (with a back-off of at most 50 us) and
// idle when none are: no thread is ever blocked on a copy.
//
//   auto rt = kvlink::cuda_device::get();          // or the catalog's "cuda"
//   if (!rt->available()) std::puts(rt->unavailable_reason().c_str());
//   kvlink::device_buffer buf{rt, 0, 64 << 20};
//
// Export: memory from cuMemAlloc (cudaMalloc) as a legacy IPC handle
// ("ipc"); a VMM mapping (cuMemCreate + cuMemMap: PyTorch's expandable
// segments) as a POSIX fd ("fd") when it was created with
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; stream-ordered pool memory
// (cudaMallocAsync) is refused with the reason.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/memory/cuda/driver.hpp>
#include <kvlink/memory/device.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <cuda.h>
#include <fmt/format.h>
#include <unistd.h>

namespace kvlink {

class cuda_device final : public device_runtime, public std::enable_shared_from_this<cuda_device> {
 public:
  /// The process's CUDA runtime (the catalog's "cuda"): the driver is
  /// loaded on the first call.
  static std::shared_ptr<cuda_device> get() {
    static const auto instance = std::shared_ptr<cuda_device>(new cuda_device());
    return instance;
  }

  ~cuda_device() override {
    if (!available_) return;
    std::lock_guard lock{mutex_};
    for (auto& [fd_base, e] : exports_) ::close(e.fd);
    for (std::size_t d = 0; d < contexts_.size(); ++d) {
      if (contexts_[d] != nullptr) (void)drv_.primary_ctx_release(devices_[d]);
    }
  }
  cuda_device(const cuda_device&) = delete;
  cuda_device& operator=(const cuda_device&) = delete;

  std::string_view name() const noexcept override { return "cuda"; }
  bool available() const noexcept override { return available_; }
  std::string unavailable_reason() const override { return reason_; }
  int device_count() const noexcept override { return static_cast<int>(devices_.size()); }
  // Measured on an H100: ~1.4 TB/s device to device, ~55 GB/s to and from
  // pinned host memory; the nominal figures stay below.
  double copy_rate_hint(bool between_devices) const noexcept override {
    return between_devices ? 1000.0 : 50.0;
  }

  /// The driver's version (12080 for 12.8), 0 when unavailable.
  int driver_version() const noexcept { return driver_version_; }

  pointer_info classify(const void* p) const noexcept override {
    pointer_info info;
    if (!available_ || p == nullptr) return info;
    auto a = attributes(p);
    if (!a.ok || a.managed || a.type != CU_MEMORYTYPE_DEVICE) {
      info.managed = a.ok && a.managed;
      return info;
    }
    info.memory = memory_desc{memory_kind::device, a.ordinal};
    info.vmm = a.vmm;
    info.base = static_cast<std::uintptr_t>(a.start);
    info.size = a.size;
    return info;
  }

  void* allocate_pinned(std::size_t n, std::error_code& ec, std::string& what) override {
    if (!usable(ec, what)) return nullptr;
    context_scope scope{*this, 0, ec, what};
    if (ec) return nullptr;
    void* p = nullptr;
    // PORTABLE: pinned for every context, so a stream of any device copies
    // from it at full speed.
    if (const auto r =
            drv_.mem_host_alloc(&p, std::max<std::size_t>(n, 1), CU_MEMHOSTALLOC_PORTABLE);
        r != CUDA_SUCCESS) {
      ec = drv_.fail(r, fmt::format("cuMemHostAlloc({} bytes, PORTABLE)", n), what);
      return nullptr;
    }
    return p;
  }

  void free_pinned(void* p) noexcept override {
    if (!available_ || p == nullptr) return;
    std::error_code ec;
    std::string what;
    context_scope scope{*this, 0, ec, what};
    if (!ec) (void)drv_.mem_free_host(p);
  }

  void* allocate(std::int32_t device, std::size_t n, std::error_code& ec,
                 std::string& what) override {
    if (!usable(ec, what) || !valid_device(device, n, ec, what)) return nullptr;
    context_scope scope{*this, device, ec, what};
    if (ec) return nullptr;
    CUdeviceptr p = 0;
    if (const auto r = drv_.mem_alloc(&p, n); r != CUDA_SUCCESS) {
      ec = drv_.fail(r, fmt::format("cuMemAlloc({} bytes on device {})", n, device), what);
      return nullptr;
    }
    std::lock_guard lock{mutex_};
    allocs_.emplace(p, own_alloc{device, n, 0});
    return to_pointer(p);
  }

  /// A VMM allocation (cuMemCreate + cuMemAddressReserve + cuMemMap, as
  /// PyTorch's expandable segments make): rounded up to the device's
  /// granularity; exportable as an fd when `shareable`. Freed with free().
  void* allocate_vmm(std::int32_t device, std::size_t n, bool shareable, std::error_code& ec,
                     std::string& what) {
    if (!usable(ec, what) || !valid_device(device, n, ec, what)) return nullptr;
    context_scope scope{*this, device, ec, what};
    if (ec) return nullptr;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.requestedHandleTypes =
        shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    std::size_t granularity = 0;
    if (const auto r = drv_.mem_get_allocation_granularity(&granularity, &prop,
                                                           CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        r != CUDA_SUCCESS) {
      ec = drv_.fail(r, "cuMemGetAllocationGranularity", what);
      return nullptr;
    }
    const std::size_t size = (n + granularity - 1) / granularity * granularity;
    CUmemGenericAllocationHandle handle = 0;
    if (const auto r = drv_.mem_create(&handle, size, &prop, 0); r != CUDA_SUCCESS) {
      ec = drv_.fail(r, fmt::format("cuMemCreate({} bytes on device {})", size, device), what);
      return nullptr;
    }
    const CUdeviceptr p = map_handle(handle, size, device, ec, what);
    if (p == 0) {
      (void)drv_.mem_release(handle);
      return nullptr;
    }
    std::lock_guard lock{mutex_};
    allocs_.emplace(p, own_alloc{device, size, handle});
    return to_pointer(p);
  }

  void free(void* p) noexcept override {
    if (!available_) return;
    own_alloc a{};
    {
      std::lock_guard lock{mutex_};
      auto it = allocs_.find(to_address(p));
      if (it == allocs_.end()) return;
      a = it->second;
      allocs_.erase(it);
      forget_export_locked(to_address(p));
    }
    std::error_code ec;
    std::string what;
    context_scope scope{*this, a.device, ec, what};
    if (ec) return;
    if (a.vmm_handle != 0) {
      unmap_handle(to_address(p), a.size, a.vmm_handle);
    } else if (const auto r = drv_.mem_free(to_address(p)); r != CUDA_SUCCESS) {
      drv_.fail(r, "cuMemFree", what);
    }
  }

  class stream;

  std::shared_ptr<device_stream> open_stream(std::int32_t device, asio::any_io_executor ex,
                                             std::error_code& ec, std::string& what) override;

  std::error_code export_memory(const void* p, exported_memory& out, std::string& what) override {
    const auto a = available_ ? attributes(p) : attrs{};
    if (!a.ok || a.managed || a.type != CU_MEMORYTYPE_DEVICE) {
      what = fmt::format("{} is not CUDA device memory", p);
      return errc::not_registered;
    }
    std::error_code ec;
    context_scope scope{*this, a.ordinal, ec, what};
    if (ec) return ec;
    out.device = a.ordinal;
    out.size = a.size;
    out.handle.clear();
    out.fd = -1;
    if (a.ipc_capable) {
      CUipcMemHandle h{};
      if (const auto r = drv_.ipc_get_mem_handle(&h, a.start); r != CUDA_SUCCESS) {
        return drv_.fail(r, fmt::format("cuIpcGetMemHandle({:#x})", a.start), what);
      }
      out.method = "ipc";
      const auto* bytes = reinterpret_cast<const std::uint8_t*>(&h);
      out.handle.assign(bytes, bytes + sizeof h);
      return {};
    }
    if (!a.vmm) {
      what = fmt::format(
          "the allocation holding {} is neither cuMemAlloc memory (legacy IPC) nor a VMM "
          "mapping (fd export): stream-ordered pool memory (cudaMallocAsync) is shared through "
          "its pool, which kvlink does not do",
          p);
      return errc::invalid_argument;
    }
    return export_vmm(p, a, out, what);
  }

  void* import_memory(const exported_memory& m, int fd, std::error_code& ec,
                      std::string& what) override {
    auto fail = [&](std::error_code e, std::string w) -> void* {
      if (fd >= 0) ::close(fd);
      ec = e;
      what = std::move(w);
      return nullptr;
    };
    if (!available_) return fail(errc::no_device, "cannot import device memory: " + reason_);
    if (m.device < 0 || m.device >= device_count() || m.size == 0) {
      return fail(errc::invalid_argument,
                  fmt::format("cannot import {} bytes of '{}' memory on device {} (this process "
                              "has CUDA devices 0..{})",
                              m.size, m.method, m.device, device_count() - 1));
    }
    context_scope scope{*this, m.device, ec, what};
    if (ec) return fail(ec, what);
    if (m.method == "ipc") {
      if (fd >= 0) ::close(fd);
      fd = -1;
      CUipcMemHandle h{};
      if (m.handle.size() != sizeof h) {
        return fail(errc::invalid_argument, fmt::format("a CUDA IPC handle has {} bytes, not {}",
                                                        sizeof h, m.handle.size()));
      }
      std::memcpy(&h, m.handle.data(), sizeof h);
      CUdeviceptr p = 0;
      if (const auto r = drv_.ipc_open_mem_handle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
          r != CUDA_SUCCESS) {
        return fail(drv_.fail(r, "cuIpcOpenMemHandle", what), what);
      }
      std::lock_guard lock{mutex_};
      imported_.emplace(p, own_alloc{m.device, m.size, 0});
      return to_pointer(p);
    }
    if (m.method == "fd") {
      if (fd < 0) return fail(errc::invalid_argument, "an 'fd' import needs the descriptor");
      CUmemGenericAllocationHandle handle = 0;
      const auto r = drv_.mem_import_from_shareable_handle(
          &handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      ::close(fd);  // the handle holds the memory now
      fd = -1;
      if (r != CUDA_SUCCESS) {
        return fail(drv_.fail(r, "cuMemImportFromShareableHandle", what), what);
      }
      CUmemAllocationProp prop{};
      std::size_t granularity = 0;
      if (const auto q = drv_.mem_get_allocation_properties_from_handle(&prop, handle);
          q != CUDA_SUCCESS) {
        (void)drv_.mem_release(handle);
        return fail(drv_.fail(q, "cuMemGetAllocationPropertiesFromHandle", what), what);
      }
      if (const auto q = drv_.mem_get_allocation_granularity(&granularity, &prop,
                                                             CU_MEM_ALLOC_GRANULARITY_MINIMUM);
          q != CUDA_SUCCESS) {
        (void)drv_.mem_release(handle);
        return fail(drv_.fail(q, "cuMemGetAllocationGranularity", what), what);
      }
      const std::size_t size = (m.size + granularity - 1) / granularity * granularity;
      const CUdeviceptr p = map_handle(handle, size, m.device, ec, what);
      if (p == 0) {
        (void)drv_.mem_release(handle);
        return fail(ec, what);
      }
      std::lock_guard lock{mutex_};
      imported_.emplace(p, own_alloc{m.device, size, handle});
      return to_pointer(p);
    }
    return fail(errc::invalid_argument,
                fmt::format("the CUDA runtime imports 'ipc' and 'fd' memory, not '{}'", m.method));
  }

  void close_imported(void* p) noexcept override {
    if (!available_) return;
    own_alloc a{};
    {
      std::lock_guard lock{mutex_};
      auto it = imported_.find(to_address(p));
      if (it == imported_.end()) return;
      a = it->second;
      imported_.erase(it);
    }
    std::error_code ec;
    std::string what;
    context_scope scope{*this, a.device, ec, what};
    if (ec) return;
    if (a.vmm_handle != 0) {
      unmap_handle(to_address(p), a.size, a.vmm_handle);
    } else if (const auto r = drv_.ipc_close_mem_handle(to_address(p)); r != CUDA_SUCCESS) {
      drv_.fail(r, "cuIpcCloseMemHandle", what);
    }
  }

  int dmabuf_fd(const void* p, std::uint64_t n, std::uint64_t& offset, std::error_code& ec,
                std::string& what) override {
    offset = 0;
    if (!usable(ec, what)) return -1;
    const auto a = attributes(p);
    if (!a.ok || a.managed || a.type != CU_MEMORYTYPE_DEVICE) {
      ec = errc::not_registered;
      what = fmt::format("{} is not CUDA device memory (no dma-buf for it)", p);
      return -1;
    }
    const auto addr = to_address(p);
    if (n == 0 || n > a.size - (addr - a.start)) {
      ec = errc::out_of_bounds;
      what = fmt::format("[{}, +{}) runs past its allocation [{:#x}, +{})", p, n, a.start, a.size);
      return -1;
    }
    int supported = 0;
    if (const auto r = drv_.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                                                 devices_[static_cast<std::size_t>(a.ordinal)]);
        r != CUDA_SUCCESS || supported == 0) {
      ec = errc::invalid_argument;
      what = fmt::format(
          "CUDA device {} has no dma-buf support (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: "
          "needs the open kernel modules, or a newer driver and kernel)",
          a.ordinal);
      return -1;
    }
    // dma-buf ranges are whole host pages; an allocation (cuMemAlloc: 2 MiB
    // aligned pages of the device's address space; VMM: granularity) holds
    // the pages around its own bytes.
    const auto page = static_cast<CUdeviceptr>(::sysconf(_SC_PAGESIZE));
    const CUdeviceptr start = addr / page * page;
    const CUdeviceptr end = (addr + n + page - 1) / page * page;
    context_scope scope{*this, a.ordinal, ec, what};
    if (ec) return -1;
    int fd = -1;
    if (const auto r = drv_.mem_get_handle_for_address_range(
            &fd, start, end - start, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
        r != CUDA_SUCCESS) {
      ec = drv_.fail(r,
                     fmt::format("cuMemGetHandleForAddressRange([{:#x}, +{}), DMA_BUF_FD)", start,
                                 end - start),
                     what);
      return -1;
    }
    offset = addr - start;
    return fd;
  }

 private:
  friend class stream;

  // What cuPointerGetAttributes says of one pointer.
  struct attrs {
    bool ok = false;
    unsigned type = 0;  // CUmemorytype; 0 for memory CUDA does not know
    int ordinal = -1;
    bool managed = false;
    bool ipc_capable = false;
    bool vmm = false;
    CUdeviceptr start = 0;
    std::uint64_t size = 0;
  };

  // Memory this runtime mapped (allocate, allocate_vmm, import_memory).
  struct own_alloc {
    std::int32_t device = 0;
    std::uint64_t size = 0;
    CUmemGenericAllocationHandle vmm_handle = 0;  // 0: cuMemAlloc or IPC memory
  };

  // An fd exported for a VMM allocation, kept open while it lives.
  struct export_entry {
    int fd = -1;
    CUmemGenericAllocationHandle handle = 0;
  };

  // The device's primary context made current for a scope, the caller's
  // context restored after.
  class context_scope {
   public:
    context_scope(const cuda_device& rt, std::int32_t device, std::error_code& ec,
                  std::string& what) noexcept
        : rt_(rt) {
      CUcontext ctx = rt.context(device, ec, what);
      if (ctx == nullptr) return;
      if (const auto r = rt.drv_.ctx_push_current(ctx); r != CUDA_SUCCESS) {
        ec = rt.drv_.fail(r, "cuCtxPushCurrent", what);
        return;
      }
      pushed_ = true;
    }
    ~context_scope() {
      CUcontext popped = nullptr;
      if (pushed_) (void)rt_.drv_.ctx_pop_current(&popped);
    }
    context_scope(const context_scope&) = delete;
    context_scope& operator=(const context_scope&) = delete;

   private:
    const cuda_device& rt_;
    bool pushed_ = false;
  };

  cuda_device() {
    if (!drv_.load(reason_)) return;
    if (const auto r = drv_.init(0); r != CUDA_SUCCESS) {
      reason_ = r == CUDA_ERROR_NO_DEVICE ? std::string{"no CUDA device"}
                                          : "cuInit: " + drv_.error_text(r);
      return;
    }
    (void)drv_.driver_get_version(&driver_version_);
    int count = 0;
    if (const auto r = drv_.device_get_count(&count); r != CUDA_SUCCESS) {
      reason_ = "cuDeviceGetCount: " + drv_.error_text(r);
      return;
    }
    if (count <= 0) {
      reason_ = "no CUDA device";
      return;
    }
    for (int i = 0; i < count; ++i) {
      CUdevice d = 0;
      if (const auto r = drv_.device_get(&d, i); r != CUDA_SUCCESS) {
        reason_ = fmt::format("cuDeviceGet({}): {}", i, drv_.error_text(r));
        devices_.clear();
        return;
      }
      devices_.push_back(d);
    }
    contexts_.assign(devices_.size(), nullptr);
    available_ = true;
  }

  static void* to_pointer(CUdeviceptr p) noexcept {
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
  }
  static CUdeviceptr to_address(const void* p) noexcept {
    return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
  }

  bool usable(std::error_code& ec, std::string& what) const {
    if (available_) return true;
    ec = errc::no_device;
    what = "the CUDA runtime is not usable here: " + reason_;
    return false;
  }

  bool valid_device(std::int32_t device, std::size_t n, std::error_code& ec,
                    std::string& what) const {
    if (device >= 0 && device < device_count() && n > 0) return true;
    ec = errc::invalid_argument;
    what = fmt::format("CUDA allocation of {} bytes on device {} (this process has devices 0..{})",
                       n, device, device_count() - 1);
    return false;
  }

  // The device's primary context, retained on first use (until the runtime
  // goes). null with ec when the device is not one of ours.
  CUcontext context(std::int32_t device, std::error_code& ec, std::string& what) const noexcept {
    if (device < 0 || device >= device_count()) {
      ec = errc::invalid_argument;
      what = fmt::format("CUDA device {} (this process has devices 0..{})", device,
                         device_count() - 1);
      return nullptr;
    }
    std::lock_guard lock{mutex_};
    auto& ctx = contexts_[static_cast<std::size_t>(device)];
    if (ctx == nullptr) {
      if (const auto r = drv_.primary_ctx_retain(&ctx, devices_[static_cast<std::size_t>(device)]);
          r != CUDA_SUCCESS) {
        ctx = nullptr;
        ec = drv_.fail(r, fmt::format("cuDevicePrimaryCtxRetain(device {})", device), what);
      }
    }
    return ctx;
  }

  attrs attributes(const void* p) const noexcept {
    attrs a;
    unsigned type = 0;
    int ordinal = -1;
    // Booleans are written as the driver likes (bool or unsigned): zeroed
    // 8-byte slots read the same either way.
    unsigned long long managed = 0;
    unsigned long long ipc_capable = 0;
    unsigned long long mempool = 0;
    CUdeviceptr start = 0;
    std::size_t size = 0;
    CUpointer_attribute which[] = {
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE,      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        CU_POINTER_ATTRIBUTE_IS_MANAGED,       CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE};
    void* data[] = {&type, &ordinal, &managed, &ipc_capable, &start, &size, &mempool};
    static_assert(std::size(which) == std::size(data));
    auto query = [&] {
      return drv_.pointer_get_attributes(static_cast<unsigned>(std::size(which)), which, data,
                                         to_address(p));
    };
    // Memory CUDA does not know is no error: every attribute stays null.
    // No context is needed with unified addressing; should a driver want
    // one, ask again in device 0's (not at first: it costs GPU memory).
    auto r = query();
    if (r == CUDA_ERROR_INVALID_CONTEXT) {
      std::error_code ec;
      std::string what;
      context_scope scope{*this, 0, ec, what};
      r = query();
    }
    if (r != CUDA_SUCCESS) return a;
    a.ok = true;
    a.type = type;
    a.ordinal = ordinal;
    a.managed = managed != 0;
    a.ipc_capable = ipc_capable != 0;
    a.start = start;
    a.size = size;
    if (a.type == CU_MEMORYTYPE_DEVICE && !a.managed && !a.ipc_capable && mempool == 0) {
      // Neither cuMemAlloc nor pool memory: a VMM mapping has an allocation
      // handle behind it.
      CUmemGenericAllocationHandle h = 0;
      if (drv_.mem_retain_allocation_handle(&h, const_cast<void*>(p)) == CUDA_SUCCESS) {
        a.vmm = true;
        (void)drv_.mem_release(h);
        // The allocation is the one mapping that holds p, not the reserved
        // range around it (expandable segments reserve far more than they
        // map). Drivers before these attributes keep the range's values.
        CUdeviceptr map_base = 0;
        std::size_t map_size = 0;
        // CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR and _MAPPING_SIZE, by value:
        // early CUDA 12 headers may lack the names.
        CUpointer_attribute mapping[] = {static_cast<CUpointer_attribute>(19),
                                         static_cast<CUpointer_attribute>(18)};
        void* out[] = {&map_base, &map_size};
        if (drv_.pointer_get_attributes(2, mapping, out, to_address(p)) == CUDA_SUCCESS &&
            map_base != 0 && map_size != 0) {
          a.start = map_base;
          a.size = map_size;
        }
      }
    }
    return a;
  }

  // Reserves address space for `handle` and maps it read-write for
  // `device`. 0 with ec on failure (the handle is the caller's).
  CUdeviceptr map_handle(CUmemGenericAllocationHandle handle, std::size_t size, std::int32_t device,
                         std::error_code& ec, std::string& what) {
    CUdeviceptr p = 0;
    if (const auto r = drv_.mem_address_reserve(&p, size, 0, 0, 0); r != CUDA_SUCCESS) {
      ec = drv_.fail(r, fmt::format("cuMemAddressReserve({} bytes)", size), what);
      return 0;
    }
    if (const auto r = drv_.mem_map(p, size, 0, handle, 0); r != CUDA_SUCCESS) {
      ec = drv_.fail(r, "cuMemMap", what);
      (void)drv_.mem_address_free(p, size);
      return 0;
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (const auto r = drv_.mem_set_access(p, size, &access, 1); r != CUDA_SUCCESS) {
      ec = drv_.fail(r, "cuMemSetAccess", what);
      (void)drv_.mem_unmap(p, size);
      (void)drv_.mem_address_free(p, size);
      return 0;
    }
    return p;
  }

  void unmap_handle(CUdeviceptr p, std::uint64_t size, CUmemGenericAllocationHandle h) noexcept {
    std::string what;
    if (const auto r = drv_.mem_unmap(p, size); r != CUDA_SUCCESS) drv_.fail(r, "cuMemUnmap", what);
    if (const auto r = drv_.mem_address_free(p, size); r != CUDA_SUCCESS) {
      drv_.fail(r, "cuMemAddressFree", what);
    }
    if (const auto r = drv_.mem_release(h); r != CUDA_SUCCESS) drv_.fail(r, "cuMemRelease", what);
  }

  // An fd for the VMM allocation behind `p`. The fd is cached per mapping
  // (and handle: a new allocation at the same address gets a new one) and
  // closed when this runtime frees the allocation or goes.
  std::error_code export_vmm(const void* p, const attrs& a, exported_memory& out,
                             std::string& what) {
    CUmemGenericAllocationHandle h = 0;
    if (const auto r = drv_.mem_retain_allocation_handle(&h, const_cast<void*>(p));
        r != CUDA_SUCCESS) {
      return drv_.fail(r, "cuMemRetainAllocationHandle", what);
    }
    CUmemAllocationProp prop{};
    if (const auto r = drv_.mem_get_allocation_properties_from_handle(&prop, h);
        r != CUDA_SUCCESS) {
      (void)drv_.mem_release(h);
      return drv_.fail(r, "cuMemGetAllocationPropertiesFromHandle", what);
    }
    if ((prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
      (void)drv_.mem_release(h);
      what = fmt::format(
          "the VMM allocation holding {} was created without "
          "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (cuMemCreate's requestedHandleTypes), so it "
          "cannot be shared with another process",
          p);
      return errc::invalid_argument;
    }
    std::lock_guard lock{mutex_};
    auto it = exports_.find(a.start);
    if (it != exports_.end() && it->second.handle != h) {
      ::close(it->second.fd);
      exports_.erase(it);
      it = exports_.end();
    }
    if (it == exports_.end()) {
      int fd = -1;
      if (const auto r = drv_.mem_export_to_shareable_handle(
              &fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
          r != CUDA_SUCCESS) {
        (void)drv_.mem_release(h);
        return drv_.fail(r, "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)", what);
      }
      it = exports_.emplace(a.start, export_entry{fd, h}).first;
    }
    (void)drv_.mem_release(h);
    out.method = "fd";
    out.fd = it->second.fd;
    return {};
  }

  void forget_export_locked(CUdeviceptr base) noexcept {
    auto it = exports_.find(base);
    if (it == exports_.end()) return;
    ::close(it->second.fd);
    exports_.erase(it);
  }

  detail::cuda_driver drv_;
  bool available_ = false;
  std::string reason_;
  int driver_version_ = 0;
  std::vector<CUdevice> devices_;
  mutable std::mutex mutex_;
  mutable std::vector<CUcontext> contexts_;  // primary contexts, retained on first use
  std::map<CUdeviceptr, own_alloc> allocs_;
  std::map<CUdeviceptr, own_alloc> imported_;
  std::map<CUdeviceptr, export_entry> exports_;
};

/// Copies on one CUDA stream; completions polled on the executor. Handlers
/// run in the order the copies were started on an executor that runs one
/// handler at a time (an io_context run by one thread, a strand).
class cuda_device::stream final : public device_stream,
                                  public std::enable_shared_from_this<cuda_device::stream> {
 public:
  stream(std::shared_ptr<cuda_device> rt, std::int32_t device, CUstream s, asio::any_io_executor ex)
      : rt_(std::move(rt)), device_(device), stream_(s), ex_(ex), timer_(std::move(ex)) {}

  ~stream() override {
    std::error_code ec;
    std::string what;
    context_scope scope{*rt_, device_, ec, what};
    if (ec) return;
    // Nothing may still write into a buffer after its stream is gone.
    (void)rt_->drv_.stream_synchronize(stream_);
    for (auto& p : pending_) {
      if (p.event != nullptr) (void)rt_->drv_.event_destroy(p.event);
    }
    for (auto* e : events_) (void)rt_->drv_.event_destroy(e);
    (void)rt_->drv_.stream_destroy(stream_);
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  std::int32_t device() const noexcept override { return device_; }

  bool copies(memory_kind from, memory_kind to) const noexcept override {
    (void)from;
    (void)to;
    return true;  // unified addressing: every direction
  }

  void async_copy(void* dst, memory_desc dst_memory, const void* src, memory_desc src_memory,
                  std::size_t n, done_fn done) override {
    pending_copy c{nullptr, std::move(done), {}};
    std::string what;
    if (check(dst, dst_memory, n, c.ec, what) && check(src, src_memory, n, c.ec, what) && n > 0) {
      context_scope scope{*rt_, device_, c.ec, what};
      std::lock_guard lock{mutex_};
      if (!c.ec) enqueue_locked(dst, src, n, c, what);
      push_locked(std::move(c));
      return;
    }
    std::lock_guard lock{mutex_};
    push_locked(std::move(c));
  }

 private:
  // One copy in flight: its event (null for a copy that failed or had
  // nothing to do) and its handler.
  struct pending_copy {
    CUevent event;
    done_fn done;
    std::error_code ec;
  };

  // Device memory said to be device memory, with its n bytes inside its
  // allocation. Host memory is the driver's to check.
  bool check(const void* p, memory_desc m, std::size_t n, std::error_code& ec,
             std::string& what) const {
    if (m.kind != memory_kind::device) return true;
    const auto a = rt_->attributes(p);
    if (!a.ok || a.managed || a.type != CU_MEMORYTYPE_DEVICE) {
      ec = errc::invalid_argument;
      what = fmt::format("{} is not CUDA device memory", p);
      return false;
    }
    const auto off = to_address(p) - a.start;
    if (n > a.size - off) {
      ec = errc::out_of_bounds;
      what = fmt::format("[{}, +{}) runs past its allocation [{:#x}, +{})", p, n, a.start, a.size);
      return false;
    }
    return true;
  }

  void enqueue_locked(void* dst, const void* src, std::size_t n, pending_copy& c,
                      std::string& what) {
    auto& drv = rt_->drv_;
    if (const auto r = drv.memcpy_async(to_address(dst), to_address(src), n, stream_);
        r != CUDA_SUCCESS) {
      c.ec = drv.fail(r, fmt::format("cuMemcpyAsync({} bytes)", n), what);
      return;
    }
    CUevent e = nullptr;
    if (!events_.empty()) {
      e = events_.back();
      events_.pop_back();
    } else if (const auto r = drv.event_create(&e, CU_EVENT_DISABLE_TIMING); r != CUDA_SUCCESS) {
      // The copy is queued; without an event, wait for it by the stream.
      c.ec = drv.fail(r, "cuEventCreate", what);
      (void)drv.stream_synchronize(stream_);
      return;
    }
    if (const auto r = drv.event_record(e, stream_); r != CUDA_SUCCESS) {
      c.ec = drv.fail(r, "cuEventRecord", what);
      events_.push_back(e);
      (void)drv.stream_synchronize(stream_);
      return;
    }
    c.event = e;
  }

  void push_locked(pending_copy c) {
    pending_.push_back(std::move(c));
    if (polling_) return;
    polling_ = true;
    backoff_ = {};
    asio::post(ex_, [self = shared_from_this()] { self->poll(); });
  }

  // Completes every copy whose event has fired, oldest first, then polls
  // again while copies remain: at once after progress, else after a
  // doubling back-off of at most 50 us.
  void poll() {
    std::vector<pending_copy> ready;
    bool again = false;
    {
      std::error_code ec;
      std::string what;
      context_scope scope{*rt_, device_, ec, what};
      std::lock_guard lock{mutex_};
      while (!pending_.empty()) {
        auto& c = pending_.front();
        if (c.event != nullptr) {
          const auto r = ec ? CUDA_SUCCESS : rt_->drv_.event_query(c.event);
          if (r == CUDA_ERROR_NOT_READY) break;
          if (ec) {
            c.ec = ec;
          } else if (r != CUDA_SUCCESS) {
            c.ec = rt_->drv_.fail(r, "cuEventQuery", what);
          }
          events_.push_back(c.event);
          c.event = nullptr;
        }
        ready.push_back(std::move(c));
        pending_.pop_front();
      }
      again = polling_ = !pending_.empty();
      if (!ready.empty()) {
        backoff_ = {};
      } else {
        backoff_ = std::min<std::chrono::microseconds>(
            std::max<std::chrono::microseconds>(backoff_ * 2, std::chrono::microseconds{1}),
            std::chrono::microseconds{50});
      }
    }
    for (auto& c : ready) c.done(c.ec);
    if (!again) return;
    if (backoff_.count() == 0) {
      asio::post(ex_, [self = shared_from_this()] { self->poll(); });
    } else {
      timer_.expires_after(backoff_);
      timer_.async_wait([self = shared_from_this()](std::error_code) { self->poll(); });
    }
  }

  std::shared_ptr<cuda_device> rt_;  // first: the driver outlives the stream
  std::int32_t device_;
  CUstream stream_;
  asio::any_io_executor ex_;
  asio::steady_timer timer_;  // the poller's back-off; used by the poll chain only
  std::mutex mutex_;
  std::deque<pending_copy> pending_;
  std::vector<CUevent> events_;  // the pool: recorded events come back here
  bool polling_ = false;         // a poll is posted or waiting
  std::chrono::microseconds backoff_{0};
};

inline std::shared_ptr<device_stream> cuda_device::open_stream(std::int32_t device,
                                                               asio::any_io_executor ex,
                                                               std::error_code& ec,
                                                               std::string& what) {
  if (!usable(ec, what)) return nullptr;
  context_scope scope{*this, device, ec, what};
  if (ec) return nullptr;
  CUstream s = nullptr;
  if (const auto r = drv_.stream_create(&s, CU_STREAM_NON_BLOCKING); r != CUDA_SUCCESS) {
    ec = drv_.fail(r, fmt::format("cuStreamCreate(device {}, NON_BLOCKING)", device), what);
    return nullptr;
  }
  return std::make_shared<stream>(shared_from_this(), device, s, std::move(ex));
}

}  // namespace kvlink
