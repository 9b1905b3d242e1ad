// kvlink with CUDA: the CUDA device runtime (memory/cuda/runtime.hpp) in
// this program's device catalog as "cuda", which config.device "auto"
// picks where a GPU is present. Link kvlink::cuda (the toolkit's headers
// and libdl: the driver, libcuda.so.1, is loaded at run time, so the
// program also runs, with host memory only, where there is none).
//
//   auto rt = kvlink::device_catalog::global().find("cuda");
//   rt->available();            // false here: rt->unavailable_reason() says why
//   kvlink::device_buffer buf{rt, 0, 64 << 20};
#pragma once

#include <kvlink/memory/cuda/runtime.hpp>
#include <kvlink/memory/device.hpp>

#include <memory>

namespace kvlink::detail {

inline const bool cuda_device_in_catalog = device_catalog::global().add(
    "cuda", [] { return std::shared_ptr<device_runtime>(cuda_device::get()); });

}  // namespace kvlink::detail
