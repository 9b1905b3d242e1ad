// The CUDA driver API, loaded at run time: dlopen("libcuda.so.1") and one
// cuGetProcAddress per function, so that a program built with kvlink::cuda
// links nothing CUDA and starts (with host memory only) on a machine that
// has no driver. Every function is asked for with the ABI of CUDA 12.0
// (driver_abi), so any driver from 12.0 on serves; the PFN typedefs below
// are the versions CUDA 12.0 resolves to.
//
// Only memory/cuda/ headers include CUDA headers (style rule 1).
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/detail/log.hpp>

#include <string>
#include <string_view>
#include <system_error>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <fmt/format.h>

#if CUDA_VERSION < 12000
#error "kvlink::cuda needs the headers of CUDA 12.0 or later (cuGetProcAddress_v2)"
#endif

// X(member, "symbol", PFN typedef): every driver function kvlink calls.
#define KVLINK_CUDA_DRIVER_FUNCTIONS(X)                                                     \
  X(init, "cuInit", PFN_cuInit_v2000)                                                       \
  X(driver_get_version, "cuDriverGetVersion", PFN_cuDriverGetVersion_v2020)                 \
  X(device_get_count, "cuDeviceGetCount", PFN_cuDeviceGetCount_v2000)                       \
  X(device_get, "cuDeviceGet", PFN_cuDeviceGet_v2000)                                       \
  X(device_get_attribute, "cuDeviceGetAttribute", PFN_cuDeviceGetAttribute_v2000)           \
  X(get_error_name, "cuGetErrorName", PFN_cuGetErrorName_v6000)                             \
  X(get_error_string, "cuGetErrorString", PFN_cuGetErrorString_v6000)                       \
  X(primary_ctx_retain, "cuDevicePrimaryCtxRetain", PFN_cuDevicePrimaryCtxRetain_v7000)     \
  X(primary_ctx_release, "cuDevicePrimaryCtxRelease", PFN_cuDevicePrimaryCtxRelease_v11000) \
  X(ctx_push_current, "cuCtxPushCurrent", PFN_cuCtxPushCurrent_v4000)                       \
  X(ctx_pop_current, "cuCtxPopCurrent", PFN_cuCtxPopCurrent_v4000)                          \
  X(pointer_get_attributes, "cuPointerGetAttributes", PFN_cuPointerGetAttributes_v7000)     \
  X(mem_alloc, "cuMemAlloc", PFN_cuMemAlloc_v3020)                                          \
  X(mem_free, "cuMemFree", PFN_cuMemFree_v3020)                                             \
  X(mem_host_alloc, "cuMemHostAlloc", PFN_cuMemHostAlloc_v2020)                             \
  X(mem_free_host, "cuMemFreeHost", PFN_cuMemFreeHost_v2000)                                \
  X(stream_create, "cuStreamCreate", PFN_cuStreamCreate_v2000)                              \
  X(stream_destroy, "cuStreamDestroy", PFN_cuStreamDestroy_v4000)                           \
  X(stream_synchronize, "cuStreamSynchronize", PFN_cuStreamSynchronize_v2000)               \
  X(event_create, "cuEventCreate", PFN_cuEventCreate_v2000)                                 \
  X(event_destroy, "cuEventDestroy", PFN_cuEventDestroy_v4000)                              \
  X(event_record, "cuEventRecord", PFN_cuEventRecord_v2000)                                 \
  X(event_query, "cuEventQuery", PFN_cuEventQuery_v2000)                                    \
  X(memcpy_async, "cuMemcpyAsync", PFN_cuMemcpyAsync_v4000)                                 \
  X(ipc_get_mem_handle, "cuIpcGetMemHandle", PFN_cuIpcGetMemHandle_v4010)                   \
  X(ipc_open_mem_handle, "cuIpcOpenMemHandle", PFN_cuIpcOpenMemHandle_v11000)               \
  X(ipc_close_mem_handle, "cuIpcCloseMemHandle", PFN_cuIpcCloseMemHandle_v4010)             \
  X(mem_create, "cuMemCreate", PFN_cuMemCreate_v10020)                                      \
  X(mem_release, "cuMemRelease", PFN_cuMemRelease_v10020)                                   \
  X(mem_retain_allocation_handle, "cuMemRetainAllocationHandle",                            \
    PFN_cuMemRetainAllocationHandle_v11000)                                                 \
  X(mem_get_allocation_properties_from_handle, "cuMemGetAllocationPropertiesFromHandle",    \
    PFN_cuMemGetAllocationPropertiesFromHandle_v10020)                                      \
  X(mem_get_allocation_granularity, "cuMemGetAllocationGranularity",                        \
    PFN_cuMemGetAllocationGranularity_v10020)                                               \
  X(mem_export_to_shareable_handle, "cuMemExportToShareableHandle",                         \
    PFN_cuMemExportToShareableHandle_v10020)                                                \
  X(mem_import_from_shareable_handle, "cuMemImportFromShareableHandle",                     \
    PFN_cuMemImportFromShareableHandle_v10020)                                              \
  X(mem_address_reserve, "cuMemAddressReserve", PFN_cuMemAddressReserve_v10020)             \
  X(mem_address_free, "cuMemAddressFree", PFN_cuMemAddressFree_v10020)                      \
  X(mem_map, "cuMemMap", PFN_cuMemMap_v10020)                                               \
  X(mem_unmap, "cuMemUnmap", PFN_cuMemUnmap_v10020)                                         \
  X(mem_set_access, "cuMemSetAccess", PFN_cuMemSetAccess_v10020)                            \
  X(mem_get_handle_for_address_range, "cuMemGetHandleForAddressRange",                      \
    PFN_cuMemGetHandleForAddressRange_v11070)

namespace kvlink::detail {

/// The driver's entry points. Not copyable: one per cuda_device.
class cuda_driver {
 public:
  /// The CUDA version whose ABI every function is asked for.
  static constexpr int driver_abi = 12000;

  cuda_driver() = default;
  cuda_driver(const cuda_driver&) = delete;
  cuda_driver& operator=(const cuda_driver&) = delete;
  // The library stays loaded until the process ends: unloading a driver
  // that other code in the process may also use is never safe.
  ~cuda_driver() = default;

  /// Loads libcuda.so.1 and resolves every function. false with `why`
  /// ("no CUDA driver (libcuda.so.1: ...)") when it cannot.
  bool load(std::string& why) {
    ::dlerror();
    lib_ = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) {
      // dlerror() names the file itself ("libcuda.so.1: cannot open ...").
      const char* e = ::dlerror();
      std::string text = e != nullptr ? e : "libcuda.so.1: not found";
      if (text.rfind("libcuda.so.1", 0) != 0) text = "libcuda.so.1: " + text;
      why = "no CUDA driver (" + text + ")";
      return false;
    }
    // cuGetProcAddress_v2 (CUDA 12.0) is the only symbol taken with dlsym.
    auto* get_proc =
        reinterpret_cast<PFN_cuGetProcAddress_v12000>(::dlsym(lib_, "cuGetProcAddress_v2"));
    if (get_proc == nullptr) {
      why =
          "the CUDA driver is older than CUDA 12.0 (libcuda.so.1 has no cuGetProcAddress_v2); "
          "kvlink needs a driver of 525 or later";
      return false;
    }
#define KVLINK_CUDA_RESOLVE(member, symbol, pfn)                                               \
  {                                                                                            \
    void* fn = nullptr;                                                                        \
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;               \
    const CUresult r = get_proc(symbol, &fn, driver_abi, CU_GET_PROC_ADDRESS_DEFAULT, &found); \
    if (r != CUDA_SUCCESS || fn == nullptr || found != CU_GET_PROC_ADDRESS_SUCCESS) {          \
      why = fmt::format("the CUDA driver (libcuda.so.1) lacks {} (cuGetProcAddress: {}, {})",  \
                        symbol, static_cast<int>(r), static_cast<int>(found));                 \
      return false;                                                                            \
    }                                                                                          \
    member = reinterpret_cast<pfn>(fn);                                                        \
  }
    KVLINK_CUDA_DRIVER_FUNCTIONS(KVLINK_CUDA_RESOLVE)
#undef KVLINK_CUDA_RESOLVE
    return true;
  }

  /// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
  std::string error_text(CUresult r) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (get_error_name == nullptr || get_error_name(r, &name) != CUDA_SUCCESS || name == nullptr) {
      return fmt::format("CUresult {}", static_cast<int>(r));
    }
    if (get_error_string == nullptr || get_error_string(r, &text) != CUDA_SUCCESS ||
        text == nullptr) {
      return name;
    }
    return fmt::format("{} ({})", name, text);
  }

  /// A failed driver call: logs it and returns device_error with `what` =
  /// "<call>: <CUresult name> (<text>)".
  std::error_code fail(CUresult r, std::string_view call, std::string& what) const {
    what = fmt::format("{}: {}", call, error_text(r));
    log("cuda: {}", what);
    return errc::device_error;
  }

#define KVLINK_CUDA_MEMBER(member, symbol, pfn) pfn member = nullptr;
  KVLINK_CUDA_DRIVER_FUNCTIONS(KVLINK_CUDA_MEMBER)
#undef KVLINK_CUDA_MEMBER

 private:
  void* lib_ = nullptr;
};

}  // namespace kvlink::detail
