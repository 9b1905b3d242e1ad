// kvlink: the library's version, in one place. CMake reads the three numbers
// below with a regular expression; keep the `#define` lines as they are.
#pragma once

#define KVLINK_VERSION_MAJOR 0
#define KVLINK_VERSION_MINOR 1
#define KVLINK_VERSION_PATCH 0

#define KVLINK_VERSION \
  (KVLINK_VERSION_MAJOR * 10000 + KVLINK_VERSION_MINOR * 100 + KVLINK_VERSION_PATCH)

namespace kvlink {

/// The library version as "MAJOR.MINOR.PATCH".
inline constexpr const char* version_string = "0.1.0";

/// Version of the wire protocol (handshake messages and data frames). Peers
/// with a different protocol version refuse each other with
/// errc::protocol_version_mismatch. Independent of the library version.
inline constexpr unsigned protocol_version = 2;

}  // namespace kvlink
