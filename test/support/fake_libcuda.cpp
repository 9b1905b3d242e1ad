// A fake libcuda.so.1 for CI: the few driver functions kvlink's CUDA runtime
// (include/kvlink/memory/cuda/) resolves, over host memory, so that its
// code (loading the driver, contexts, pointer attributes, allocation,
// streams and the event poller, IPC and VMM export and import) runs on
// machines without a GPU. ctest cuda.memory.fake puts its directory first
// in LD_LIBRARY_PATH and runs the device tests with KVLINK_TEST_DEVICE=cuda.
//
// What it fakes, and how:
// - one device (FAKE_CUDA_DEVICES=0: cuInit says CUDA_ERROR_NO_DEVICE);
// - device memory is a memfd mapped PROT_NONE where the user sees it (the
//   CPU cannot touch it, as on a GPU: a transport that tries fails as it
//   would there) and read-write at a private address cuMemcpyAsync uses;
// - copies are memcpy at cuMemcpyAsync; an event turns complete only on
//   its third query, so the poller waits and backs off as on a GPU;
// - an IPC handle holds the exporter's pid and memfd: cuIpcOpenMemHandle
//   takes the fd with pidfd_getfd, and refuses a handle of its own process
//   (CUDA_ERROR_INVALID_CONTEXT), as the driver does;
// - no dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0).
// Not a model of CUDA's performance or of its error behaviour beyond this.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string_view>
#include <vector>

#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr std::size_t granularity = 2u << 20;

struct region {
  std::size_t size = 0;
  int fd = -1;           // the memfd behind device memory; -1 for host
  void* view = nullptr;  // device memory's read-write mapping (for copies)
  bool device = true;
  bool ipc_capable = false;  // cuMemAlloc memory
  bool imported = false;     // cuIpcOpenMemHandle
  CUmemGenericAllocationHandle vmm = 0;
};

struct vmm_alloc {
  int fd = -1;
  std::size_t size = 0;
  unsigned long long handle_types = 0;
  int refs = 1;
};

struct ipc_payload {
  std::uint32_t magic;
  std::int32_t pid;
  std::int32_t fd;
  std::uint64_t size;
};

std::mutex mutex;
std::map<std::uintptr_t, region> regions;
std::map<CUmemGenericAllocationHandle, vmm_alloc> vmm_allocs;
CUmemGenericAllocationHandle next_handle = 1;
std::map<CUevent, int> event_queries;  // queries left before the event completes
thread_local std::vector<CUcontext> ctx_stack;

int device_count() {
  const char* e = std::getenv("FAKE_CUDA_DEVICES");
  return e != nullptr ? std::atoi(e) : 1;
}

// The region holding `p`, or null.
std::pair<const std::uintptr_t, region>* find(std::uintptr_t p) {
  auto it = regions.upper_bound(p);
  if (it == regions.begin()) return nullptr;
  --it;
  return p - it->first < it->second.size ? &*it : nullptr;
}

// Maps `fd` PROT_NONE (at `at` when given) for the user and read-write
// for the copies: the user's address, or null.
void* map_fd(int fd, std::size_t size, void*& view, void* at = nullptr) {
  void* p = ::mmap(at, size, PROT_NONE, MAP_SHARED | (at ? MAP_FIXED : 0), fd, 0);
  if (p == MAP_FAILED) return nullptr;
  view = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (view == MAP_FAILED) {
    ::munmap(p, size);
    return nullptr;
  }
  return p;
}

// Where the copy engine reaches `p`: its view for device memory.
void* reach(CUdeviceptr p) {
  std::lock_guard lock{mutex};
  const auto* r = find(static_cast<std::uintptr_t>(p));
  if (r == nullptr || r->second.view == nullptr) return reinterpret_cast<void*>(p);
  return static_cast<char*>(r->second.view) + (p - r->first);
}

int new_memfd(std::size_t size) {
  const int fd = ::memfd_create("fake-cuda", MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

CUresult CUDAAPI init(unsigned) { return device_count() > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE; }
CUresult CUDAAPI driver_get_version(int* v) {
  *v = 12080;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI device_get_count(int* n) {
  *n = device_count();
  return CUDA_SUCCESS;
}
CUresult CUDAAPI device_get(CUdevice* d, int i) {
  if (i < 0 || i >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
  *d = i;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI device_get_attribute(int* v, CUdevice_attribute, CUdevice) {
  *v = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI get_error_name(CUresult r, const char** s) {
  switch (r) {
    case CUDA_ERROR_INVALID_VALUE:
      *s = "CUDA_ERROR_INVALID_VALUE";
      return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY:
      *s = "CUDA_ERROR_OUT_OF_MEMORY";
      return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_SUPPORTED:
      *s = "CUDA_ERROR_NOT_SUPPORTED";
      return CUDA_SUCCESS;
    default:
      *s = "CUDA_ERROR_UNKNOWN";
      return CUDA_SUCCESS;
  }
}
CUresult CUDAAPI get_error_string(CUresult, const char** s) {
  *s = "fake driver error";
  return CUDA_SUCCESS;
}
CUresult CUDAAPI primary_ctx_retain(CUcontext* c, CUdevice d) {
  *c = reinterpret_cast<CUcontext>(static_cast<std::uintptr_t>(0x1000 + d));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI primary_ctx_release(CUdevice) { return CUDA_SUCCESS; }
CUresult CUDAAPI ctx_push(CUcontext c) {
  ctx_stack.push_back(c);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI ctx_pop(CUcontext* c) {
  if (ctx_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (c != nullptr) *c = ctx_stack.back();
  ctx_stack.pop_back();
  return CUDA_SUCCESS;
}
// Calls that need a current context check for one, as the driver does.
bool no_context() { return ctx_stack.empty(); }

CUresult CUDAAPI pointer_get_attributes(unsigned n, CUpointer_attribute* which, void** data,
                                        CUdeviceptr ptr) {
  // Stricter than CUDA (which needs no context here), so that kvlink's
  // retry in a context of its own runs.
  if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard lock{mutex};
  const auto* r = find(static_cast<std::uintptr_t>(ptr));
  for (unsigned i = 0; i < n; ++i) {
    switch (which[i]) {
      case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *static_cast<unsigned*>(data[i]) = r == nullptr
                                               ? 0u
                                               : (r->second.device ? unsigned{CU_MEMORYTYPE_DEVICE}
                                                                   : unsigned{CU_MEMORYTYPE_HOST});
        break;
      case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *static_cast<int*>(data[i]) = r == nullptr ? -2 : 0;
        break;
      case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *static_cast<bool*>(data[i]) = false;
        break;
      case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        *static_cast<bool*>(data[i]) = r != nullptr && r->second.ipc_capable;
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        *static_cast<CUdeviceptr*>(data[i]) = r == nullptr ? 0 : r->first;
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
        *static_cast<std::size_t*>(data[i]) = r == nullptr ? 0 : r->second.size;
        break;
      case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        *static_cast<void**>(data[i]) = nullptr;
        break;
      default:
        return CUDA_ERROR_INVALID_VALUE;
    }
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_alloc(CUdeviceptr* p, std::size_t n) {
  if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
  const int fd = new_memfd(n);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  void* view = nullptr;
  void* m = map_fd(fd, n, view);
  if (m == nullptr) {
    ::close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  std::lock_guard lock{mutex};
  regions[reinterpret_cast<std::uintptr_t>(m)] = region{n, fd, view, true, true, false, 0};
  *p = reinterpret_cast<std::uintptr_t>(m);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_free(CUdeviceptr p) {
  std::lock_guard lock{mutex};
  auto it = regions.find(static_cast<std::uintptr_t>(p));
  if (it == regions.end() || !it->second.ipc_capable || it->second.imported) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  ::munmap(reinterpret_cast<void*>(it->first), it->second.size);
  ::munmap(it->second.view, it->second.size);
  ::close(it->second.fd);
  regions.erase(it);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_host_alloc(void** p, std::size_t n, unsigned) {
  if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
  void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard lock{mutex};
  regions[reinterpret_cast<std::uintptr_t>(m)] = region{n, -1, nullptr, false, false, false, 0};
  *p = m;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_free_host(void* p) {
  std::lock_guard lock{mutex};
  auto it = regions.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == regions.end() || it->second.device) return CUDA_ERROR_INVALID_VALUE;
  ::munmap(p, it->second.size);
  regions.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI stream_create(CUstream* s, unsigned) {
  if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
  *s = reinterpret_cast<CUstream>(new char);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI stream_destroy(CUstream s) {
  delete reinterpret_cast<char*>(s);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI stream_synchronize(CUstream) { return CUDA_SUCCESS; }
CUresult CUDAAPI event_create(CUevent* e, unsigned) {
  if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
  *e = reinterpret_cast<CUevent>(new char);
  std::lock_guard lock{mutex};
  event_queries[*e] = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI event_destroy(CUevent e) {
  std::lock_guard lock{mutex};
  event_queries.erase(e);
  delete reinterpret_cast<char*>(e);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI event_record(CUevent e, CUstream) {
  if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard lock{mutex};
  event_queries[e] = 2;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI event_query(CUevent e) {
  if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard lock{mutex};
  auto& left = event_queries[e];
  if (left == 0) return CUDA_SUCCESS;
  --left;
  return CUDA_ERROR_NOT_READY;
}
CUresult CUDAAPI memcpy_async(CUdeviceptr dst, CUdeviceptr src, std::size_t n, CUstream) {
  if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
  std::memmove(reach(dst), reach(src), n);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI ipc_get_mem_handle(CUipcMemHandle* h, CUdeviceptr p) {
  std::lock_guard lock{mutex};
  auto it = regions.find(static_cast<std::uintptr_t>(p));
  if (it == regions.end() || !it->second.ipc_capable) return CUDA_ERROR_INVALID_VALUE;
  const ipc_payload payload{0x6b766c6b, ::getpid(), it->second.fd, it->second.size};
  std::memset(h, 0, sizeof *h);
  std::memcpy(h, &payload, sizeof payload);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI ipc_open_mem_handle(CUdeviceptr* p, CUipcMemHandle h, unsigned) {
  if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
  ipc_payload payload{};
  std::memcpy(&payload, &h, sizeof payload);
  if (payload.magic != 0x6b766c6b) return CUDA_ERROR_INVALID_VALUE;
  if (payload.pid == static_cast<std::int32_t>(::getpid())) return CUDA_ERROR_INVALID_CONTEXT;
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, payload.pid, 0));
  if (pidfd < 0) return CUDA_ERROR_INVALID_VALUE;
  const int fd = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, payload.fd, 0));
  ::close(pidfd);
  if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
  void* view = nullptr;
  void* m = map_fd(fd, payload.size, view);
  if (m == nullptr) {
    ::close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  std::lock_guard lock{mutex};
  regions[reinterpret_cast<std::uintptr_t>(m)] =
      region{payload.size, fd, view, true, true, true, 0};
  *p = reinterpret_cast<std::uintptr_t>(m);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI ipc_close_mem_handle(CUdeviceptr p) {
  std::lock_guard lock{mutex};
  auto it = regions.find(static_cast<std::uintptr_t>(p));
  if (it == regions.end() || !it->second.imported) return CUDA_ERROR_INVALID_VALUE;
  ::munmap(reinterpret_cast<void*>(it->first), it->second.size);
  ::munmap(it->second.view, it->second.size);
  ::close(it->second.fd);
  regions.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_create(CUmemGenericAllocationHandle* h, std::size_t size,
                            const CUmemAllocationProp* prop, unsigned long long) {
  if (size % granularity != 0) return CUDA_ERROR_INVALID_VALUE;
  const int fd = new_memfd(size);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard lock{mutex};
  *h = next_handle++;
  vmm_allocs[*h] =
      vmm_alloc{fd, size, static_cast<unsigned long long>(prop->requestedHandleTypes), 1};
  return CUDA_SUCCESS;
}
CUresult release_locked(CUmemGenericAllocationHandle h) {
  auto it = vmm_allocs.find(h);
  if (it == vmm_allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  if (--it->second.refs == 0) {
    ::close(it->second.fd);
    vmm_allocs.erase(it);
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_release(CUmemGenericAllocationHandle h) {
  std::lock_guard lock{mutex};
  return release_locked(h);
}
CUresult CUDAAPI mem_retain_allocation_handle(CUmemGenericAllocationHandle* h, void* addr) {
  std::lock_guard lock{mutex};
  const auto* r = find(reinterpret_cast<std::uintptr_t>(addr));
  if (r == nullptr || r->second.vmm == 0) return CUDA_ERROR_INVALID_VALUE;
  *h = r->second.vmm;
  ++vmm_allocs[*h].refs;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_get_allocation_properties_from_handle(CUmemAllocationProp* prop,
                                                           CUmemGenericAllocationHandle h) {
  std::lock_guard lock{mutex};
  auto it = vmm_allocs.find(h);
  if (it == vmm_allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  *prop = CUmemAllocationProp{};
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = 0;
  prop->requestedHandleTypes = static_cast<CUmemAllocationHandleType>(it->second.handle_types);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_get_allocation_granularity(std::size_t* g, const CUmemAllocationProp*,
                                                CUmemAllocationGranularity_flags) {
  *g = granularity;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_export_to_shareable_handle(void* out, CUmemGenericAllocationHandle h,
                                                CUmemAllocationHandleType type,
                                                unsigned long long) {
  std::lock_guard lock{mutex};
  auto it = vmm_allocs.find(h);
  if (it == vmm_allocs.end() || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
      (it->second.handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *static_cast<int*>(out) = ::fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_import_from_shareable_handle(CUmemGenericAllocationHandle* h, void* handle,
                                                  CUmemAllocationHandleType type) {
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  const int fd =
      ::fcntl(static_cast<int>(reinterpret_cast<std::intptr_t>(handle)), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
  const auto size = static_cast<std::size_t>(::lseek(fd, 0, SEEK_END));
  std::lock_guard lock{mutex};
  *h = next_handle++;
  vmm_allocs[*h] = vmm_alloc{fd, size, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1};
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_address_reserve(CUdeviceptr* p, std::size_t size, std::size_t, CUdeviceptr,
                                     unsigned long long) {
  void* m = ::mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = reinterpret_cast<std::uintptr_t>(m);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_address_free(CUdeviceptr p, std::size_t size) {
  return ::munmap(reinterpret_cast<void*>(p), size) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult CUDAAPI mem_map(CUdeviceptr p, std::size_t size, std::size_t offset,
                         CUmemGenericAllocationHandle h, unsigned long long) {
  std::lock_guard lock{mutex};
  auto it = vmm_allocs.find(h);
  if (it == vmm_allocs.end() || offset != 0 || size > it->second.size) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  void* view = nullptr;
  if (map_fd(it->second.fd, size, view, reinterpret_cast<void*>(p)) == nullptr) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  ++it->second.refs;  // a mapping holds the allocation, as on CUDA
  regions[static_cast<std::uintptr_t>(p)] = region{size, -1, view, true, false, false, h};
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_unmap(CUdeviceptr p, std::size_t size) {
  std::lock_guard lock{mutex};
  auto it = regions.find(static_cast<std::uintptr_t>(p));
  if (it == regions.end() || it->second.vmm == 0) return CUDA_ERROR_INVALID_VALUE;
  const auto h = it->second.vmm;
  ::munmap(it->second.view, size);
  regions.erase(it);
  // Back to reserved address space.
  ::mmap(reinterpret_cast<void*>(p), size, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return release_locked(h);
}
CUresult CUDAAPI mem_set_access(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI mem_get_handle_for_address_range(void*, CUdeviceptr, std::size_t,
                                                  CUmemRangeHandleType, unsigned long long) {
  return CUDA_ERROR_NOT_SUPPORTED;
}

struct entry {
  std::string_view name;
  void* fn;
};

template <class F>
void* fn(F f) {
  return reinterpret_cast<void*>(f);
}

const entry table[] = {
    {"cuInit", fn(init)},
    {"cuDriverGetVersion", fn(driver_get_version)},
    {"cuDeviceGetCount", fn(device_get_count)},
    {"cuDeviceGet", fn(device_get)},
    {"cuDeviceGetAttribute", fn(device_get_attribute)},
    {"cuGetErrorName", fn(get_error_name)},
    {"cuGetErrorString", fn(get_error_string)},
    {"cuDevicePrimaryCtxRetain", fn(primary_ctx_retain)},
    {"cuDevicePrimaryCtxRelease", fn(primary_ctx_release)},
    {"cuCtxPushCurrent", fn(ctx_push)},
    {"cuCtxPopCurrent", fn(ctx_pop)},
    {"cuPointerGetAttributes", fn(pointer_get_attributes)},
    {"cuMemAlloc", fn(mem_alloc)},
    {"cuMemFree", fn(mem_free)},
    {"cuMemHostAlloc", fn(mem_host_alloc)},
    {"cuMemFreeHost", fn(mem_free_host)},
    {"cuStreamCreate", fn(stream_create)},
    {"cuStreamDestroy", fn(stream_destroy)},
    {"cuStreamSynchronize", fn(stream_synchronize)},
    {"cuEventCreate", fn(event_create)},
    {"cuEventDestroy", fn(event_destroy)},
    {"cuEventRecord", fn(event_record)},
    {"cuEventQuery", fn(event_query)},
    {"cuMemcpyAsync", fn(memcpy_async)},
    {"cuIpcGetMemHandle", fn(ipc_get_mem_handle)},
    {"cuIpcOpenMemHandle", fn(ipc_open_mem_handle)},
    {"cuIpcCloseMemHandle", fn(ipc_close_mem_handle)},
    {"cuMemCreate", fn(mem_create)},
    {"cuMemRelease", fn(mem_release)},
    {"cuMemRetainAllocationHandle", fn(mem_retain_allocation_handle)},
    {"cuMemGetAllocationPropertiesFromHandle", fn(mem_get_allocation_properties_from_handle)},
    {"cuMemGetAllocationGranularity", fn(mem_get_allocation_granularity)},
    {"cuMemExportToShareableHandle", fn(mem_export_to_shareable_handle)},
    {"cuMemImportFromShareableHandle", fn(mem_import_from_shareable_handle)},
    {"cuMemAddressReserve", fn(mem_address_reserve)},
    {"cuMemAddressFree", fn(mem_address_free)},
    {"cuMemMap", fn(mem_map)},
    {"cuMemUnmap", fn(mem_unmap)},
    {"cuMemSetAccess", fn(mem_set_access)},
    {"cuMemGetHandleForAddressRange", fn(mem_get_handle_for_address_range)},
};

}  // namespace

extern "C" __attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(
    const char* symbol, void** pfn, int, cuuint64_t, CUdriverProcAddressQueryResult* status) {
  for (const auto& e : table) {
    if (e.name == symbol) {
      *pfn = e.fn;
      if (status != nullptr) *status = CU_GET_PROC_ADDRESS_SUCCESS;
      return CUDA_SUCCESS;
    }
  }
  *pfn = nullptr;
  if (status != nullptr) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_ERROR_NOT_FOUND;
}
