// Control messages: length-prefixed JSON over a stream, used for the
// handshake (control/handshake.hpp), descriptor updates, notifications and
// transports' own requests (control/channel.hpp carries them).
//
// Frame: 8-byte prefix, little-endian: u32 magic 0x4B564C43 ("KVLC"), u32
// body length; then the body, a JSON object with a "type" string. The magic
// never changes across protocol versions, so a peer of another version still
// parses the hello and gets a clear protocol_version_mismatch back instead of
// garbage. Bodies larger than the configured bound are refused before any
// allocation (errc::message_too_large).
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/version.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include <nlohmann/json.hpp>

namespace kvlink::control {

inline constexpr std::uint32_t message_magic = 0x4B564C43u;
inline constexpr std::size_t prefix_size = 8;

using prefix_bytes = std::array<unsigned char, prefix_size>;

inline prefix_bytes encode_prefix(std::uint32_t body_length) noexcept {
  prefix_bytes p{};
  for (std::size_t i = 0; i < 4; ++i) {
    p[i] = static_cast<unsigned char>((message_magic >> (8 * i)) & 0xffu);
    p[4 + i] = static_cast<unsigned char>((body_length >> (8 * i)) & 0xffu);
  }
  return p;
}

/// Checks a received prefix and yields the body length. Wrong magic:
/// malformed_message; longer than `max_body`: message_too_large.
inline std::error_code decode_prefix(const prefix_bytes& p, std::uint64_t max_body,
                                     std::uint32_t& body_length) noexcept {
  std::uint32_t magic = 0;
  std::uint32_t len = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    magic |= static_cast<std::uint32_t>(p[i]) << (8 * i);
    len |= static_cast<std::uint32_t>(p[4 + i]) << (8 * i);
  }
  if (magic != message_magic) {
    return errc::malformed_message;
  }
  if (len == 0 || len > max_body) {
    return len == 0 ? std::error_code{errc::malformed_message}
                    : std::error_code{errc::message_too_large};
  }
  body_length = len;
  return {};
}

/// Prefix + serialized body, ready to send.
inline std::string encode_message(const nlohmann::json& body) {
  std::string text = body.dump();
  const auto prefix = encode_prefix(static_cast<std::uint32_t>(text.size()));
  std::string out(prefix_size + text.size(), '\0');
  std::memcpy(out.data(), prefix.data(), prefix_size);
  std::memcpy(out.data() + prefix_size, text.data(), text.size());
  return out;
}

/// How deeply a control message may nest: deeper is malformed. (Copying a
/// JSON value recurses once per level, so a peer's 150 KB of brackets would
/// otherwise overflow the stack wherever a message is copied.)
inline constexpr int max_message_depth = 32;

/// Parses a body: it must be a JSON object with a string "type", nested at
/// most max_message_depth levels.
inline std::error_code parse_message(std::string_view body, nlohmann::json& out) {
  bool too_deep = false;
  out = nlohmann::json::parse(
      body,
      [&too_deep](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > max_message_depth) too_deep = true;
        return !too_deep;  // discard the rest once too deep
      },
      /*allow_exceptions=*/false);
  if (too_deep || out.is_discarded() || !out.is_object()) return errc::malformed_message;
  const auto type = out.find("type");
  if (type == out.end() || !type->is_string()) return errc::malformed_message;
  return {};
}

// ---------------------------------------------------------------- values

inline std::string to_string(access a) {
  switch (a) {
    case access::none:
      return "";
    case access::remote_read:
      return "r";
    case access::remote_write:
      return "w";
    case access::remote_read_write:
      return "rw";
  }
  return "";
}

inline std::optional<access> parse_access(std::string_view s) {
  if (s.empty()) return access::none;
  if (s == "r") return access::remote_read;
  if (s == "w") return access::remote_write;
  if (s == "rw") return access::remote_read_write;
  return std::nullopt;
}

/// Typed field getters that never throw: a missing or mistyped field makes
/// the whole message malformed.
template <class T>
bool get_field(const nlohmann::json& j, const char* key, T& out) {
  const auto it = j.find(key);
  if (it == j.end()) return false;
  if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string()) return false;
    out = it->template get<std::string>();
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) return false;
    out = it->template get<bool>();
  } else {
    static_assert(std::is_unsigned_v<T>);
    if (!it->is_number_unsigned()) return false;
    const auto v = it->template get<std::uint64_t>();
    if (v > std::numeric_limits<T>::max()) return false;
    out = static_cast<T>(v);
  }
  return true;
}

// ---------------------------------------------------------------- errors

/// An error reply: a stable code name plus a human-readable message.
inline nlohmann::json make_error(std::error_code ec, std::string_view detail = {}) {
  std::string msg = ec.message();
  if (!detail.empty()) {
    msg += ": ";
    msg += detail;
  }
  return {{"type", "error"},
          {"code", ec.category() == error_category() ? ec.value()
                                                     : static_cast<int>(errc::malformed_message)},
          {"protocol", protocol_version},
          {"message", msg}};
}

/// Turns an "error" reply into an error code (unknown codes: malformed).
inline std::error_code error_from_message(const nlohmann::json& j) {
  const auto it = j.find("code");
  if (it == j.end() || !it->is_number_integer()) return errc::malformed_message;
  const auto v = it->get<std::int64_t>();
  if (v < 1 || v > static_cast<int>(errc_last)) return errc::malformed_message;
  return static_cast<errc>(v);
}

// ---------------------------------------------------------------- transports

/// A transport's own control message (an RDMA path asking the target's RDMA
/// transport for queue pairs, its answer): the engine routes it by the
/// "transport" field and never looks inside `body`.
inline nlohmann::json make_transport_message(std::string_view transport, nlohmann::json body) {
  return {{"type", "transport"}, {"transport", std::string(transport)}, {"body", std::move(body)}};
}

/// Reads a "transport" message: false when it lacks a transport name or an
/// object body.
inline bool parse_transport_message(const nlohmann::json& j, std::string& transport,
                                    const nlohmann::json*& body) {
  const auto b = j.find("body");
  if (!get_field(j, "transport", transport) || b == j.end() || !b->is_object()) return false;
  body = &*b;
  return true;
}

// ---------------------------------------------------------------- notifications

/// Payload bytes travel hex-encoded (JSON strings must be UTF-8).
inline std::string to_hex(std::string_view bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out(bytes.size() * 2, '0');
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    out[2 * i] = digits[b >> 4];
    out[2 * i + 1] = digits[b & 15];
  }
  return out;
}

inline std::optional<std::string> from_hex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out(hex.size() / 2, '\0');
  for (std::size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]);
    const int lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out[i] = static_cast<char>((hi << 4) | lo);
  }
  return out;
}

inline nlohmann::json make_notify(std::string_view id, std::string_view payload) {
  return {{"type", "notify"}, {"id", std::string(id)}, {"payload", to_hex(payload)}};
}

/// Parses a "notify" message; id + payload must fit in `max_bytes`.
inline std::error_code parse_notify(const nlohmann::json& j, std::uint64_t max_bytes,
                                    std::string& id, std::string& payload) {
  std::string hex;
  if (!get_field(j, "id", id) || !get_field(j, "payload", hex)) return errc::malformed_message;
  auto bytes = from_hex(hex);
  if (!bytes) return errc::malformed_message;
  if (id.size() + bytes->size() > max_bytes) return errc::message_too_large;
  payload = std::move(*bytes);
  return {};
}

}  // namespace kvlink::control
