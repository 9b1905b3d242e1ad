// kvlink's log lines: one line on stderr, prefixed "kvlink: ", for what a
// user must know and cannot get from an error code (which RDMA GID was
// picked, a listener without authentication, a refused connection, a bad
// local buffer). KVLINK_QUIET=1 silences them.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace kvlink::detail {

inline bool log_quiet() {
  const char* q = std::getenv("KVLINK_QUIET");
  return q != nullptr && *q != '\0' && std::string_view{q} != "0";
}

template <class... Args>
void log(fmt::format_string<Args...> f, Args&&... args) {
  if (log_quiet()) return;
  std::string line = "kvlink: " + fmt::format(f, std::forward<Args>(args)...) + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace kvlink::detail
