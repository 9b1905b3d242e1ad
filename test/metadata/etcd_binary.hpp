// Where the etcd tests find etcd, and what they return without it: kept
// apart from harness.hpp so a test's main() can decide to skip without
// compiling the engine.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <unistd.h>

namespace kvlink_meta {

/// The first `name` on $PATH (or /usr/bin, /usr/sbin); "" if none.
inline std::string which(const std::string& name) {
  std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  path += ":/usr/bin:/usr/sbin:/usr/local/bin";
  std::size_t at = 0;
  while (at <= path.size()) {
    const std::size_t colon = path.find(':', at);
    const std::string dir = path.substr(at, colon == std::string::npos ? colon : colon - at);
    if (!dir.empty()) {
      const std::string candidate = dir + "/" + name;
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  return {};
}

/// The etcd binary: $KVLINK_ETCD, or etcd on the path.
inline std::string etcd_binary() {
  if (const char* e = std::getenv("KVLINK_ETCD"); e != nullptr && *e != '\0') return e;
  return which("etcd");
}

/// What a test that needs etcd returns without one: 77 (ctest's skip), or
/// 1 with KVLINK_REQUIRE_ETCD=1 (CI, where etcd-server is installed).
inline int without_etcd() {
  const char* req = std::getenv("KVLINK_REQUIRE_ETCD");
  const bool required = req != nullptr && std::string_view(req) == "1";
  std::printf("%s: no etcd binary (apt-get install etcd-server, or set KVLINK_ETCD)\n",
              required ? "FAILED (KVLINK_REQUIRE_ETCD=1)" : "SKIPPED");
  return required ? 1 : 77;
}

}  // namespace kvlink_meta
