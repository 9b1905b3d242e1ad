// Text form and generation of kvlink::instance_id (declared in types.hpp).
//
// An instance id travels in the peer descriptor as 32 lowercase hex digits:
// the 16 digits of `hi` followed by the 16 digits of `lo`. No I/O, no Asio.
#pragma once

#include <kvlink/core/types.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>

namespace kvlink {

/// 32 lowercase hex digits, `hi` first. parse_instance_id() reads it back.
inline std::string to_string(const instance_id& id) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (std::size_t i = 0; i < 16; ++i) {
    const unsigned shift = static_cast<unsigned>(60 - 4 * i);
    out[i] = digits[(id.hi >> shift) & 0xfU];
    out[16 + i] = digits[(id.lo >> shift) & 0xfU];
  }
  return out;
}

/// Parses exactly 32 hex digits (either case, no prefix, no spaces). nullopt
/// for anything else, so a malformed descriptor is rejected rather than read
/// as a different instance. The all-zero id parses (it is merely not valid()).
inline std::optional<instance_id> parse_instance_id(std::string_view text) {
  if (text.size() != 32) return std::nullopt;
  instance_id id;
  for (std::size_t i = 0; i < 32; ++i) {
    const char c = text[i];
    std::uint64_t v = 0;
    if (c >= '0' && c <= '9') {
      v = static_cast<std::uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v = static_cast<std::uint64_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v = static_cast<std::uint64_t>(c - 'A' + 10);
    } else {
      return std::nullopt;
    }
    std::uint64_t& half = i < 16 ? id.hi : id.lo;
    half = (half << 4) | v;
  }
  return id;
}

/// A fresh random instance id (never the invalid all-zero value). Drawn from
/// std::random_device once per engine start; not on any hot path.
inline instance_id make_instance_id() {
  std::random_device rd;
  auto draw64 = [&rd] {
    std::uint64_t v = 0;
    for (int i = 0; i < 2; ++i) v = (v << 32) | static_cast<std::uint64_t>(rd());
    return v;
  };
  instance_id id;
  do {
    id.hi = draw64();
    id.lo = draw64();
  } while (!id.valid());
  return id;
}

}  // namespace kvlink
