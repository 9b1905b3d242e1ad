// What this process holds, from /proc/self: resident memory and open file
// descriptors (the soak and many-peer tests, the test peer's RSS verb).
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include <dirent.h>

namespace kvlink_test {

/// VmRSS of this process in KiB (1 KiB = 1024 B); 0 when /proc cannot say.
inline std::uint64_t rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") {
      std::uint64_t v = 0;
      status >> v;
      return v;
    }
    status.ignore(4096, '\n');
  }
  return 0;
}

/// File descriptors open in this process (the one reading the folder included).
inline std::size_t open_fds() {
  std::size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n > 2 ? n - 2 : 0;  // "." and ".."
}

}  // namespace kvlink_test
