// What every fuzz target shares: a check that aborts (libFuzzer keeps the
// input that made it fail) and the small text predicates the checks use.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#define KVLINK_FUZZ_CHECK(cond)                                                          \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (false)

namespace kvlink_fuzz {

/// Every character a hex digit (either case).
inline bool all_hex(std::string_view s) {
  for (const char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))) {
      return false;
    }
  }
  return true;
}

/// Hex digits A-F lowered, everything else as it is.
inline std::string lower_hex(std::string_view s) {
  std::string out(s);
  for (auto& c : out) {
    if (c >= 'A' && c <= 'F') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

}  // namespace kvlink_fuzz
