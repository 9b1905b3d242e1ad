// Links through kvlink::rdma: libibverbs' headers and library must come with
// it. A machine without RDMA devices is fine (an empty list, or none at all);
// what is checked is that the program builds, links and loads.
#include <kvlink/version.hpp>

#include <cstdio>

#include <infiniband/verbs.h>

int main() {
  int n = 0;
  ibv_device** devices = ibv_get_device_list(&n);
  std::printf("kvlink %s: %d RDMA device(s)\n", kvlink::version_string, devices ? n : 0);
  if (devices != nullptr) {
    ibv_free_device_list(devices);
  }
  return 0;
}
