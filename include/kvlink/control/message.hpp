// The control channel: length-prefixed JSON messages over TCP, used for the
// handshake (hello / welcome / error), segment updates and notifications.
//
// Frame: 8-byte prefix, little-endian: u32 magic 0x4B564C43 ("KVLC"), u32
// body length; then the body, a JSON object with a "type" string. The magic
// never changes across protocol versions, so a peer of another version still
// parses the hello and gets a clear protocol_version_mismatch back instead of
// garbage. Bodies larger than the configured bound are refused before any
// allocation (errc::message_too_large).
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/version.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

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

/// Parses a body: it must be a JSON object with a string "type".
inline std::error_code parse_message(std::string_view body, nlohmann::json& out) {
  out = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (out.is_discarded() || !out.is_object() || !out.contains("type") || !out["type"].is_string()) {
    return errc::malformed_message;
  }
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

// ---------------------------------------------------------------- descriptor

/// What a peer tells others about itself: versioned, instance-stamped.
struct peer_descriptor {
  unsigned protocol = protocol_version;
  instance_id instance{};
  std::string tcp_address;                               ///< host:port of its listener
  std::vector<remote_segment_info> segments;             ///< ordered by id
  nlohmann::json transports = nlohmann::json::object();  ///< per-transport details
};

inline nlohmann::json segments_to_json(const std::vector<remote_segment_info>& segs) {
  auto arr = nlohmann::json::array();
  for (const auto& s : segs) {
    nlohmann::json js{{"id", s.id.value()},
                      {"base", s.base},
                      {"length", s.length},
                      {"access", to_string(s.granted)}};
    if (!s.rkeys.empty()) js["rkeys"] = s.rkeys;
    arr.push_back(std::move(js));
  }
  return arr;
}

inline std::error_code segments_from_json(const nlohmann::json& arr,
                                          std::vector<remote_segment_info>& out) {
  if (!arr.is_array()) return errc::malformed_message;
  out.clear();
  out.reserve(arr.size());
  for (const auto& js : arr) {
    if (!js.is_object()) return errc::malformed_message;
    remote_segment_info s;
    std::uint64_t id = 0;
    std::string acc;
    if (!get_field(js, "id", id) || id == 0 || !get_field(js, "base", s.base) ||
        !get_field(js, "length", s.length) || !get_field(js, "access", acc)) {
      return errc::malformed_message;
    }
    const auto a = parse_access(acc);
    if (!a) return errc::malformed_message;
    s.id = segment_id{id};
    s.granted = *a;
    if (const auto it = js.find("rkeys"); it != js.end()) {
      if (!it->is_array()) return errc::malformed_message;
      for (const auto& k : *it) {
        if (!k.is_number_unsigned() || k.get<std::uint64_t>() > 0xffffffffu)
          return errc::malformed_message;
        s.rkeys.push_back(k.get<std::uint32_t>());
      }
    }
    out.push_back(std::move(s));
  }
  return {};
}

inline nlohmann::json to_json(const peer_descriptor& d) {
  return {{"protocol", d.protocol},
          {"instance", to_string(d.instance)},
          {"tcp_address", d.tcp_address},
          {"segments", segments_to_json(d.segments)},
          {"transports", d.transports}};
}

inline std::error_code from_json(const nlohmann::json& j, peer_descriptor& d) {
  if (!j.is_object()) return errc::malformed_message;
  std::string inst;
  if (!get_field(j, "protocol", d.protocol)) return errc::malformed_message;
  if (d.protocol != protocol_version) return errc::protocol_version_mismatch;
  if (!get_field(j, "instance", inst) || !get_field(j, "tcp_address", d.tcp_address)) {
    return errc::malformed_message;
  }
  const auto parsed = parse_instance_id(inst);
  if (!parsed || !parsed->valid()) return errc::malformed_message;
  d.instance = *parsed;
  const auto segs = j.find("segments");
  if (segs == j.end()) return errc::malformed_message;
  if (auto ec = segments_from_json(*segs, d.segments)) return ec;
  if (const auto t = j.find("transports"); t != j.end()) {
    if (!t->is_object()) return errc::malformed_message;
    d.transports = *t;
  }
  return {};
}

// ---------------------------------------------------------------- handshake

enum class role { control, lane };

/// First message on every connection, from the connecting side.
inline nlohmann::json make_hello(unsigned protocol, const instance_id& self, role r,
                                 std::uint32_t lane = 0,
                                 std::optional<instance_id> expect = std::nullopt,
                                 std::string_view address = {}) {
  nlohmann::json j{{"type", "hello"},
                   {"protocol", protocol},
                   {"instance", to_string(self)},
                   {"role", r == role::control ? "control" : "lane"},
                   {"lane", lane}};
  // A lane names the instance it expects: if the peer restarted between the
  // control handshake and this connection, the lane is refused.
  if (expect) j["expect"] = to_string(*expect);
  // Where the sender itself listens, so the receiver can connect back.
  if (!address.empty()) j["address"] = std::string(address);
  return j;
}

struct hello {
  unsigned protocol = 0;
  instance_id instance{};
  role r = role::control;
  std::uint32_t lane = 0;
  std::optional<instance_id> expect;
  std::string address;  ///< the sender's own listen address, if it told
};

/// Parses a hello. The protocol field is read first, so a peer of another
/// version is told so (protocol_version_mismatch), not that its message is
/// malformed.
inline std::error_code parse_hello(const nlohmann::json& j, hello& h) {
  if (j.value("type", std::string{}) != "hello" || !get_field(j, "protocol", h.protocol)) {
    return errc::malformed_message;
  }
  if (h.protocol != protocol_version) return errc::protocol_version_mismatch;
  std::string inst;
  std::string r;
  if (!get_field(j, "instance", inst) || !get_field(j, "role", r) ||
      !get_field(j, "lane", h.lane)) {
    return errc::malformed_message;
  }
  const auto id = parse_instance_id(inst);
  if (!id || !id->valid() || (r != "control" && r != "lane")) return errc::malformed_message;
  h.instance = *id;
  h.r = r == "control" ? role::control : role::lane;
  if (const auto e = j.find("expect"); e != j.end()) {
    if (!e->is_string()) return errc::malformed_message;
    const auto ex = parse_instance_id(e->get<std::string>());
    if (!ex) return errc::malformed_message;
    h.expect = *ex;
  }
  if (const auto a = j.find("address"); a != j.end()) {
    if (!a->is_string() || a->get_ref<const std::string&>().size() > 256)
      return errc::malformed_message;
    h.address = a->get<std::string>();
  }
  return {};
}

inline nlohmann::json make_welcome(const peer_descriptor& d) {
  return {{"type", "welcome"}, {"protocol", d.protocol}, {"descriptor", to_json(d)}};
}

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
  if (v < 1 || v > static_cast<int>(errc::instance_changed)) return errc::malformed_message;
  return static_cast<errc>(v);
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
