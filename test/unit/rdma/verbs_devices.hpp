// Shared by the RDMA unit tests: whether this machine has verbs devices
// (the tests that expect "no device" are skipped where it has).
#pragma once

#include <filesystem>
#include <system_error>

namespace kvlink_test {

// True when the kernel exposes at least one verbs device to this process.
inline bool machine_has_verbs_devices() {
  std::error_code ec;
  std::filesystem::directory_iterator it{"/sys/class/infiniband_verbs", ec};
  if (ec) return false;
  for (; it != std::filesystem::directory_iterator{}; ++it) {
    if (it->path().filename().string().rfind("uverbs", 0) == 0) return true;
  }
  return false;
}

}  // namespace kvlink_test
