// Links through kvlink::cuda: the CUDA toolkit's headers come with it and
// kvlink/cuda.hpp puts the CUDA device runtime in the program's device
// catalog. Nothing CUDA is linked: the program starts on a machine without
// a driver, where the runtime says why it is not usable.
#include <kvlink/cuda.hpp>
#include <kvlink/version.hpp>

#include <cstdio>

int main() {
  auto rt = kvlink::device_catalog::global().find("cuda");
  if (!rt) return 1;
  if (rt->available()) {
    std::printf("kvlink %s: CUDA with %d device(s)\n", kvlink::version_string, rt->device_count());
  } else {
    std::printf("kvlink %s: CUDA not usable here: %s\n", kvlink::version_string,
                rt->unavailable_reason().c_str());
  }
  return rt->available() || !rt->unavailable_reason().empty() ? 0 : 1;
}
