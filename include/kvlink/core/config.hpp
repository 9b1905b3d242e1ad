// kvlink's settings: one struct, one table.
//
// `config` holds every tunable of the engines. config_table() is the single
// source of each setting's JSON name, environment variable, unit, default
// (the member initialiser) and one-line doc; JSON and environment parsing,
// to_json() and describe() are all driven by it, so a setting added to the
// struct and the table is parsed, printed and documented everywhere.
//
//   auto j = nlohmann::json::parse(R"({"slice_size": "4MiB", "tcp_lanes": 4})");
//   kvlink::config c = kvlink::config_from_json(j);  // throws std::system_error
//   std::error_code ec;
//   c = kvlink::config_from_env(c, ec);  // KVLINK_SLICE_SIZE=... etc. override
//   std::puts(kvlink::describe(c).c_str());
//
// Units: sizes are bytes and accept "KiB/MiB/GiB/TiB" (2^10, 2^20, 2^30,
// 2^40) and "KB/MB/GB/TB" (10^3, 10^6, 10^9, 10^12), case-insensitive,
// optionally with a space and a decimal fraction that must come to whole
// bytes ("1.5KiB" = 1536). A bare "k", "M" or "G" is rejected: it could mean
// either. Durations are milliseconds and accept "ms", "s", "min", "h".
//
// No I/O (other than reading environment variables), no Asio.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/detail/text.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlink {

/// Every tunable of the engines, with its default. See config_table() for
/// units, environment variables and docs; validate() for the rules.
struct config {
  /// host:port the engine listens on (handshake + TCP lanes); port 0 = any.
  std::string listen = "127.0.0.1:0";
  /// TCP connections per peer.
  std::uint32_t tcp_lanes = 2;
  /// Bytes; planner slice size.
  std::uint64_t slice_size = 1 << 20;
  /// Bytes; a tail slice shorter than this is merged into the previous one.
  std::uint64_t min_chunk = 64 << 10;
  /// Bytes; slice cut points fall on multiples of this (power of two).
  std::uint64_t alignment = 1;
  /// Slices in flight per lane.
  std::uint32_t max_inflight_per_lane = 32;
  /// Bytes, SO_SNDBUF/SO_RCVBUF; 0 = kernel default.
  std::uint64_t socket_buffer = 4 << 20;
  bool tcp_nodelay = true;
  /// Per transfer; 0 = none.
  std::chrono::milliseconds transfer_deadline{30000};
  std::chrono::milliseconds connect_timeout{5000};
  /// How long a cancelled transfer waits for in-flight slices before closing
  /// their lanes.
  std::chrono::milliseconds fence_timeout{2000};
  /// Bytes; bound on a handshake/control message.
  std::uint64_t max_control_message = 1 << 20;
  /// Bytes; largest data-frame payload a target accepts.
  std::uint64_t max_frame_payload = 64 << 20;
  /// Bytes; bound on a notification payload.
  std::uint32_t max_notification = 4096;
  /// RDMA engine: may fall back to TCP for peers without RDMA.
  bool allow_tcp_fallback = true;
  /// Comma-separated device names; empty = all.
  std::string rdma_devices{};
  /// -1 = pick a RoCEv2 GID automatically.
  std::int32_t rdma_gid_index = -1;
  std::uint32_t rdma_qps_per_endpoint = 2;
  /// Outstanding work requests per QP.
  std::uint32_t rdma_max_wr = 256;

  friend bool operator==(const config&, const config&) = default;
};

/// How a setting's value is written and parsed.
enum class setting_kind : std::uint8_t {
  size,      ///< bytes; integer or "4MiB"-style string
  count,     ///< non-negative integer
  index,     ///< signed integer
  duration,  ///< milliseconds; integer or "250ms"/"2s"-style string
  boolean,   ///< true/false (env: 1/0, true/false, yes/no, on/off)
  text,      ///< string
};

/// The unit column for a kind: "bytes", "count", "index", "ms", "bool", "string".
constexpr std::string_view unit_of(setting_kind k) noexcept {
  switch (k) {
    case setting_kind::size:
      return "bytes";
    case setting_kind::count:
      return "count";
    case setting_kind::index:
      return "index";
    case setting_kind::duration:
      return "ms";
    case setting_kind::boolean:
      return "bool";
    case setting_kind::text:
      return "string";
  }
  return "";
}

/// The member a setting lives in. Settings are read and written generically
/// through it (get_setting / set_setting).
using setting_field = std::variant<std::string config::*, bool config::*, std::uint32_t config::*,
                                   std::int32_t config::*, std::uint64_t config::*,
                                   std::chrono::milliseconds config::*>;

/// One row of the settings table: the single source of names, env vars,
/// units, defaults (read from a default `config`) and docs.
struct setting_info {
  std::string_view name;  ///< JSON key, e.g. "slice_size"
  std::string_view env;   ///< environment variable, e.g. "KVLINK_SLICE_SIZE" (NUL-terminated)
  std::string_view unit;  ///< "bytes", "ms", "count", "bool", "string", "index"
  std::string_view doc;   ///< one line
  setting_kind kind;
  setting_field field;
};

namespace detail {

constexpr setting_info make_setting(std::string_view name, std::string_view env, setting_kind kind,
                                    setting_field field, std::string_view doc) noexcept {
  return setting_info{name, env, unit_of(kind), doc, kind, field};
}

// Same order as the members of `config`. Env names are literals, hence
// NUL-terminated, so env.data() may be passed to getenv.
inline constexpr std::array settings_table{
    make_setting("listen", "KVLINK_LISTEN", setting_kind::text, &config::listen,
                 "host:port to listen on for handshakes and TCP lanes; port 0 = any free port"),
    make_setting("tcp_lanes", "KVLINK_TCP_LANES", setting_kind::count, &config::tcp_lanes,
                 "TCP connections per peer; slices are striped over them"),
    make_setting("slice_size", "KVLINK_SLICE_SIZE", setting_kind::size, &config::slice_size,
                 "size the planner cuts requests into"),
    make_setting("min_chunk", "KVLINK_MIN_CHUNK", setting_kind::size, &config::min_chunk,
                 "a tail slice shorter than this is merged into the previous slice"),
    make_setting("alignment", "KVLINK_ALIGNMENT", setting_kind::size, &config::alignment,
                 "slice cut points fall on multiples of this (power of two)"),
    make_setting("max_inflight_per_lane", "KVLINK_MAX_INFLIGHT_PER_LANE", setting_kind::count,
                 &config::max_inflight_per_lane, "slices in flight per lane"),
    make_setting("socket_buffer", "KVLINK_SOCKET_BUFFER", setting_kind::size,
                 &config::socket_buffer, "SO_SNDBUF/SO_RCVBUF of each lane; 0 = kernel default"),
    make_setting("tcp_nodelay", "KVLINK_TCP_NODELAY", setting_kind::boolean, &config::tcp_nodelay,
                 "set TCP_NODELAY on every connection"),
    make_setting("transfer_deadline", "KVLINK_TRANSFER_DEADLINE", setting_kind::duration,
                 &config::transfer_deadline, "deadline of each transfer; 0 = none"),
    make_setting("connect_timeout", "KVLINK_CONNECT_TIMEOUT", setting_kind::duration,
                 &config::connect_timeout, "limit on connecting to a peer, handshake included"),
    make_setting(
        "fence_timeout", "KVLINK_FENCE_TIMEOUT", setting_kind::duration, &config::fence_timeout,
        "how long a cancelled transfer waits for in-flight slices before closing their lanes"),
    make_setting("max_control_message", "KVLINK_MAX_CONTROL_MESSAGE", setting_kind::size,
                 &config::max_control_message, "bound on a handshake or control message"),
    make_setting("max_frame_payload", "KVLINK_MAX_FRAME_PAYLOAD", setting_kind::size,
                 &config::max_frame_payload, "largest data-frame payload a target accepts"),
    make_setting("max_notification", "KVLINK_MAX_NOTIFICATION", setting_kind::size,
                 &config::max_notification, "bound on a notification payload"),
    make_setting("allow_tcp_fallback", "KVLINK_ALLOW_TCP_FALLBACK", setting_kind::boolean,
                 &config::allow_tcp_fallback, "RDMA engine: may use TCP for peers without RDMA"),
    make_setting("rdma_devices", "KVLINK_RDMA_DEVICES", setting_kind::text, &config::rdma_devices,
                 "comma-separated RDMA device names to use; empty = all"),
    make_setting("rdma_gid_index", "KVLINK_RDMA_GID_INDEX", setting_kind::index,
                 &config::rdma_gid_index, "GID table index; -1 = pick a RoCEv2 GID automatically"),
    make_setting("rdma_qps_per_endpoint", "KVLINK_RDMA_QPS_PER_ENDPOINT", setting_kind::count,
                 &config::rdma_qps_per_endpoint, "RDMA queue pairs per peer and NIC"),
    make_setting("rdma_max_wr", "KVLINK_RDMA_MAX_WR", setting_kind::count, &config::rdma_max_wr,
                 "outstanding work requests per queue pair"),
};

inline constexpr std::string_view size_units_help =
    "a whole number of bytes, optionally with a unit: B, KiB, MiB, GiB, TiB (2^10..2^40) or KB, "
    "MB, GB, TB (10^3..10^12), e.g. \"4MiB\"";
inline constexpr std::string_view duration_units_help =
    "a whole number of milliseconds, optionally with a unit: ms, s, min, h, e.g. \"250ms\", \"2s\"";

constexpr std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

struct unit_scale {
  std::string_view suffix;  // compared case-insensitively; "" = no unit
  std::uint64_t multiplier;
};

inline constexpr std::array<unit_scale, 10> size_units{{
    {"", 1},
    {"b", 1},
    {"kib", std::uint64_t{1} << 10},
    {"mib", std::uint64_t{1} << 20},
    {"gib", std::uint64_t{1} << 30},
    {"tib", std::uint64_t{1} << 40},
    {"kb", 1'000},
    {"mb", 1'000'000},
    {"gb", 1'000'000'000},
    {"tb", 1'000'000'000'000},
}};

inline constexpr std::array<unit_scale, 5> duration_units{{
    {"", 1},
    {"ms", 1},
    {"s", 1'000},
    {"min", 60'000},
    {"h", 3'600'000},
}};

// "<digits>[.<digits>][ ]<unit>" -> digits * unit, exact and overflow-checked
// (the result must be a whole number and at most `max`). 128-bit arithmetic
// keeps every intermediate exact: the integer part is capped at 2^64 before
// scaling, the fraction at 18 digits, multipliers at 10^12.
inline std::optional<std::uint64_t> parse_scaled(std::string_view text,
                                                 std::span<const unit_scale> units,
                                                 std::uint64_t max) {
  __extension__ typedef unsigned __int128 u128;
  text = trim(text);
  std::size_t i = 0;
  u128 whole = 0;
  const std::size_t int_begin = i;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    whole = whole * 10 + static_cast<unsigned>(text[i] - '0');
    if (whole > max) return std::nullopt;
  }
  if (i == int_begin) return std::nullopt;
  u128 frac = 0;
  u128 frac_scale = 1;
  if (i < text.size() && text[i] == '.') {
    ++i;
    const std::size_t frac_begin = i;
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
      if (i - frac_begin >= 18) return std::nullopt;
      frac = frac * 10 + static_cast<unsigned>(text[i] - '0');
      frac_scale *= 10;
    }
    if (i == frac_begin) return std::nullopt;
  }
  const std::string_view suffix = trim(text.substr(i));
  for (const unit_scale& u : units) {
    if (!iequals(suffix, u.suffix)) continue;
    const u128 frac_part = frac * u.multiplier;
    if (frac_part % frac_scale != 0) return std::nullopt;  // not a whole number
    const u128 total = whole * u.multiplier + frac_part / frac_scale;
    if (total > max) return std::nullopt;
    return static_cast<std::uint64_t>(total);
  }
  return std::nullopt;
}

inline std::optional<bool> parse_bool(std::string_view text) noexcept {
  text = trim(text);
  for (std::string_view t : {"1", "true", "yes", "on"}) {
    if (iequals(text, t)) return true;
  }
  for (std::string_view f : {"0", "false", "no", "off"}) {
    if (iequals(text, f)) return false;
  }
  return std::nullopt;
}

inline std::optional<std::int64_t> parse_int(std::string_view text) noexcept {
  text = trim(text);
  if (!text.empty() && text.front() == '+') return std::nullopt;  // from_chars rejects it too
  std::int64_t v = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || p != text.data() + text.size() || text.empty()) return std::nullopt;
  return v;
}

inline std::optional<std::uint64_t> parse_unsigned(std::string_view text) noexcept {
  text = trim(text);
  if (text.empty() || text.front() < '0' || text.front() > '9') return std::nullopt;
  std::uint64_t v = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || p != text.data() + text.size()) return std::nullopt;
  return v;
}

// "host:port" or "[v6]:port" with a decimal port 0..65535.
inline bool split_host_port(std::string_view s, std::string_view& host,
                            std::uint16_t& port) noexcept {
  const std::size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return false;
  const std::string_view p = s.substr(colon + 1);
  if (p.empty() || p.size() > 5) return false;
  std::uint32_t v = 0;
  for (char c : p) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<std::uint32_t>(c - '0');
  }
  if (v > 65535) return false;
  std::string_view h = s.substr(0, colon);
  if (h.front() == '[') {
    if (h.size() < 3 || h.back() != ']') return false;
    h = h.substr(1, h.size() - 2);
  } else if (h.find(':') != std::string_view::npos) {
    return false;  // an IPv6 address needs brackets
  }
  if (h.find_first_of(" \t[]") != std::string_view::npos) return false;
  host = h;
  port = static_cast<std::uint16_t>(v);
  return true;
}

inline std::string json_type_name(const nlohmann::json& j) {
  if (j.is_number_unsigned() || j.is_number_integer()) return "integer";
  if (j.is_number_float()) return "floating-point number";
  return j.type_name();
}

// The value of a non-negative JSON integer, whichever of nlohmann's two
// integer types holds it (json(std::int64_t{5}) is number_integer).
inline std::optional<std::uint64_t> json_unsigned(const nlohmann::json& j) {
  if (j.is_number_unsigned()) return j.get<std::uint64_t>();
  if (j.is_number_integer() && j.get<std::int64_t>() >= 0) {
    return static_cast<std::uint64_t>(j.get<std::int64_t>());
  }
  return std::nullopt;
}

// Stores an unsigned value into a u64 or u32 member (range-checked).
inline std::error_code store_unsigned(config& c, const setting_info& s, std::uint64_t v,
                                      std::string* what) {
  if (auto* p = std::get_if<std::uint64_t config::*>(&s.field)) {
    c.*(*p) = v;
    return {};
  }
  if (auto* p = std::get_if<std::uint32_t config::*>(&s.field)) {
    if (v > std::numeric_limits<std::uint32_t>::max()) {
      return fail(what, std::string{s.name} + ": " + std::to_string(v) +
                            " is out of range (at most 4294967295)");
    }
    c.*(*p) = static_cast<std::uint32_t>(v);
    return {};
  }
  return fail(what, std::string{s.name} + ": not an unsigned setting");
}

inline std::error_code store_signed(config& c, const setting_info& s, std::int64_t v,
                                    std::string* what) {
  if (auto* p = std::get_if<std::int32_t config::*>(&s.field)) {
    if (v < std::numeric_limits<std::int32_t>::min() ||
        v > std::numeric_limits<std::int32_t>::max()) {
      return fail(what, std::string{s.name} + ": " + std::to_string(v) +
                            " is out of range (a 32-bit signed integer)");
    }
    c.*(*p) = static_cast<std::int32_t>(v);
    return {};
  }
  return fail(what, std::string{s.name} + ": not a signed setting");
}

inline std::error_code store_duration(config& c, const setting_info& s, std::uint64_t ms,
                                      std::string* what) {
  if (auto* p = std::get_if<std::chrono::milliseconds config::*>(&s.field)) {
    if (ms >
        static_cast<std::uint64_t>(std::numeric_limits<std::chrono::milliseconds::rep>::max())) {
      return fail(what, std::string{s.name} + ": " + std::to_string(ms) + " ms is out of range");
    }
    c.*(*p) = std::chrono::milliseconds{static_cast<std::chrono::milliseconds::rep>(ms)};
    return {};
  }
  return fail(what, std::string{s.name} + ": not a duration setting");
}

inline std::error_code store_bool(config& c, const setting_info& s, bool v, std::string* what) {
  if (auto* p = std::get_if<bool config::*>(&s.field)) {
    c.*(*p) = v;
    return {};
  }
  return fail(what, std::string{s.name} + ": not a boolean setting");
}

inline std::error_code store_text(config& c, const setting_info& s, std::string v,
                                  std::string* what) {
  if (auto* p = std::get_if<std::string config::*>(&s.field)) {
    c.*(*p) = std::move(v);
    return {};
  }
  return fail(what, std::string{s.name} + ": not a string setting");
}

inline std::string known_setting_names() {
  std::string out;
  for (const setting_info& s : settings_table) {
    if (!out.empty()) out += ", ";
    out += s.name;
  }
  return out;
}

}  // namespace detail

/// The settings table, in the order of the members of `config`.
inline std::span<const setting_info> config_table() noexcept { return detail::settings_table; }

/// The row named `name` (the JSON key), or nullptr.
inline const setting_info* find_setting(std::string_view name) noexcept {
  for (const setting_info& s : detail::settings_table) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

/// Parses a byte count: "512", "512B", "4MiB", "4 MiB", "1GB", "1.5KiB"
/// (see the top of this file for the units). nullopt for anything else,
/// including a fraction that is not a whole number of bytes, a bare "k"/"M"/
/// "G" (ambiguous) and values above 2^64 - 1 ("99999999999GiB").
inline std::optional<std::uint64_t> parse_size(std::string_view text) {
  return detail::parse_scaled(text, detail::size_units, std::numeric_limits<std::uint64_t>::max());
}

/// Parses a duration into milliseconds: "250" (ms), "250ms", "2s", "1.5s",
/// "5min", "1h". nullopt for anything else, sub-millisecond results and
/// values beyond what std::chrono::milliseconds holds.
inline std::optional<std::chrono::milliseconds> parse_duration(std::string_view text) {
  const auto v = detail::parse_scaled(
      text, detail::duration_units,
      static_cast<std::uint64_t>(std::numeric_limits<std::chrono::milliseconds::rep>::max()));
  if (!v) return std::nullopt;
  return std::chrono::milliseconds{static_cast<std::chrono::milliseconds::rep>(*v)};
}

/// For people, not for parsing back: binary units (KiB = 2^10 bytes, ...),
/// whole numbers when exact ("4 MiB", "512 B"), else two decimals
/// ("1.50 GiB").
inline std::string format_size(std::uint64_t bytes) {
  static constexpr std::array<std::string_view, 7> names{"B",   "KiB", "MiB", "GiB",
                                                         "TiB", "PiB", "EiB"};
  std::size_t u = 0;
  while (u + 1 < names.size() && bytes >> (10 * (u + 1)) != 0) ++u;
  if (u == 0) return std::to_string(bytes) + " B";
  const std::uint64_t unit = std::uint64_t{1} << (10 * u);
  if (bytes % unit == 0) return std::to_string(bytes / unit) + " " + std::string{names[u]};
  double v = static_cast<double>(bytes) / static_cast<double>(unit);
  if (v >= 1023.995 && u + 1 < names.size()) {  // would print as "1024.00": use the next unit
    ++u;
    v /= 1024.0;
  }
  std::array<char, 32> buf{};
  const auto r = std::to_chars(buf.data(), buf.data() + buf.size(), v, std::chars_format::fixed, 2);
  return std::string(buf.data(), r.ptr) + " " + std::string{names[u]};
}

/// Reads one setting as JSON: sizes and counts as unsigned integers, durations
/// as integer milliseconds, booleans and strings as themselves.
inline nlohmann::json get_setting(const config& c, const setting_info& s) {
  return std::visit(
      [&c](auto member) -> nlohmann::json {
        const auto& v = c.*member;
        if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::chrono::milliseconds>) {
          return v.count();
        } else {
          return v;
        }
      },
      s.field);
}

/// Sets one setting from JSON. Sizes take integers (bytes) or strings with a
/// unit; durations integers (ms) or strings with a unit; counts and indexes
/// integers; booleans booleans; text strings. Wrong type or out of range ->
/// invalid_argument, with `what` naming the setting and the reason.
inline std::error_code set_setting(config& c, const setting_info& s, const nlohmann::json& v,
                                   std::string* what = nullptr) {
  using detail::fail;
  const std::string name{s.name};
  const auto wrong_type = [&](std::string_view expected) {
    return fail(
        what, name + ": expected " + std::string{expected} + ", got " + detail::json_type_name(v));
  };
  const auto negative = [&] {
    return fail(what, name + ": must not be negative, got " + v.dump());
  };
  const std::optional<std::uint64_t> u = detail::json_unsigned(v);
  switch (s.kind) {
    case setting_kind::size:
      if (u) return detail::store_unsigned(c, s, *u, what);
      if (v.is_number_integer()) return negative();
      if (v.is_string()) {
        const auto& str = v.get_ref<const std::string&>();
        const auto bytes = parse_size(str);
        if (!bytes) {
          return fail(what, name + ": \"" + str + "\" is not a size: expected " +
                                std::string{detail::size_units_help});
        }
        return detail::store_unsigned(c, s, *bytes, what);
      }
      return wrong_type("an integer number of bytes or a string such as \"4MiB\"");
    case setting_kind::count:
      if (u) return detail::store_unsigned(c, s, *u, what);
      if (v.is_number_integer()) return negative();
      return wrong_type("a non-negative integer");
    case setting_kind::index:
      if (v.is_number_unsigned()) {
        if (*u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          return fail(what, name + ": " + v.dump() + " is out of range (a 32-bit signed integer)");
        }
        return detail::store_signed(c, s, static_cast<std::int64_t>(*u), what);
      }
      if (v.is_number_integer()) return detail::store_signed(c, s, v.get<std::int64_t>(), what);
      return wrong_type("an integer");
    case setting_kind::duration:
      if (u) return detail::store_duration(c, s, *u, what);
      if (v.is_number_integer()) return negative();
      if (v.is_string()) {
        const auto& str = v.get_ref<const std::string&>();
        const auto d = parse_duration(str);
        if (!d) {
          return fail(what, name + ": \"" + str + "\" is not a duration: expected " +
                                std::string{detail::duration_units_help});
        }
        return detail::store_duration(c, s, static_cast<std::uint64_t>(d->count()), what);
      }
      return wrong_type("an integer number of milliseconds or a string such as \"250ms\"");
    case setting_kind::boolean:
      if (v.is_boolean()) return detail::store_bool(c, s, v.get<bool>(), what);
      return wrong_type("true or false");
    case setting_kind::text:
      if (v.is_string()) return detail::store_text(c, s, v.get<std::string>(), what);
      return wrong_type("a string");
  }
  return fail(what, name + ": unknown setting kind");
}

/// Sets one setting from text (an environment variable, a command line).
/// Same units as JSON strings; counts and indexes decimal; booleans 1/0,
/// true/false, yes/no, on/off (case-insensitive); text taken verbatim.
inline std::error_code set_setting_text(config& c, const setting_info& s, std::string_view text,
                                        std::string* what = nullptr) {
  using detail::fail;
  const std::string name{s.name};
  const auto bad = [&](std::string_view expected) {
    return fail(what, name + ": \"" + std::string{text} + "\" is not " + std::string{expected});
  };
  switch (s.kind) {
    case setting_kind::size: {
      const auto bytes = parse_size(text);
      if (!bytes)
        return bad(std::string{"a size: expected "} + std::string{detail::size_units_help});
      return detail::store_unsigned(c, s, *bytes, what);
    }
    case setting_kind::count: {
      const auto n = detail::parse_unsigned(text);
      if (!n) return bad("a non-negative integer");
      return detail::store_unsigned(c, s, *n, what);
    }
    case setting_kind::index: {
      const auto n = detail::parse_int(text);
      if (!n) return bad("an integer");
      return detail::store_signed(c, s, *n, what);
    }
    case setting_kind::duration: {
      const auto d = parse_duration(text);
      if (!d)
        return bad(std::string{"a duration: expected "} + std::string{detail::duration_units_help});
      return detail::store_duration(c, s, static_cast<std::uint64_t>(d->count()), what);
    }
    case setting_kind::boolean: {
      const auto b = detail::parse_bool(text);
      if (!b) return bad("a boolean (1/0, true/false, yes/no, on/off)");
      return detail::store_bool(c, s, *b, what);
    }
    case setting_kind::text:
      return detail::store_text(c, s, std::string{text}, what);
  }
  return fail(what, name + ": unknown setting kind");
}

/// Checks the rules the engines rely on; the first broken one is reported as
/// invalid_argument with `what` naming the setting(s) and the reason:
///  - listen is "host:port" or "[v6]:port", port 0..65535;
///  - tcp_lanes, max_inflight_per_lane, rdma_qps_per_endpoint, rdma_max_wr >= 1;
///  - slice_size >= 1, min_chunk <= slice_size;
///  - alignment a power of two dividing slice_size;
///  - slice_size + min_chunk - 1 (the largest slice after a short tail is
///    merged) <= max_frame_payload, so a peer with the same settings accepts
///    every slice we send;
///  - socket_buffer <= INT_MAX (setsockopt takes an int);
///  - no negative durations; connect_timeout > 0;
///  - max_control_message >= 1, max_notification <= max_control_message
///    (a notification travels inside a control message);
///  - rdma_devices: no empty or blank names; rdma_gid_index >= -1.
inline std::error_code validate(const config& c, std::string* what = nullptr) {
  using detail::fail;
  std::string_view host;
  std::uint16_t port = 0;
  if (!detail::split_host_port(c.listen, host, port)) {
    return fail(what, "listen: \"" + c.listen +
                          "\" is not host:port (e.g. \"0.0.0.0:17001\", \"[::1]:0\")");
  }
  if (c.tcp_lanes == 0) return fail(what, "tcp_lanes: must be at least 1");
  if (c.slice_size == 0) return fail(what, "slice_size: must be at least 1 byte");
  if (c.min_chunk > c.slice_size) {
    return fail(what, "min_chunk (" + std::to_string(c.min_chunk) +
                          ") must not exceed slice_size (" + std::to_string(c.slice_size) + ")");
  }
  if (c.alignment == 0 || (c.alignment & (c.alignment - 1)) != 0) {
    return fail(what, "alignment: " + std::to_string(c.alignment) + " is not a power of two");
  }
  if (c.slice_size % c.alignment != 0) {
    return fail(what, "alignment (" + std::to_string(c.alignment) + ") must divide slice_size (" +
                          std::to_string(c.slice_size) + ")");
  }
  if (c.max_inflight_per_lane == 0) return fail(what, "max_inflight_per_lane: must be at least 1");
  if (c.slice_size > c.max_frame_payload ||
      (c.min_chunk > 0 && c.min_chunk - 1 > c.max_frame_payload - c.slice_size)) {
    return fail(what, "max_frame_payload (" + std::to_string(c.max_frame_payload) +
                          ") must be at least slice_size + min_chunk - 1, the largest slice the "
                          "planner sends");
  }
  if (c.socket_buffer > static_cast<std::uint64_t>(INT_MAX)) {
    return fail(what, "socket_buffer: " + std::to_string(c.socket_buffer) +
                          " exceeds the largest SO_SNDBUF/SO_RCVBUF value (2147483647)");
  }
  if (c.transfer_deadline.count() < 0) return fail(what, "transfer_deadline: must not be negative");
  if (c.connect_timeout.count() <= 0) return fail(what, "connect_timeout: must be positive");
  if (c.fence_timeout.count() < 0) return fail(what, "fence_timeout: must not be negative");
  if (c.max_control_message == 0) return fail(what, "max_control_message: must be at least 1 byte");
  if (c.max_notification > c.max_control_message) {
    return fail(what, "max_notification (" + std::to_string(c.max_notification) +
                          ") must not exceed max_control_message (" +
                          std::to_string(c.max_control_message) + ")");
  }
  if (!c.rdma_devices.empty()) {
    std::string_view rest = c.rdma_devices;
    while (true) {
      const std::size_t comma = rest.find(',');
      const std::string_view dev = rest.substr(0, comma);
      if (dev.empty() || dev.find_first_of(" \t") != std::string_view::npos) {
        return fail(what, "rdma_devices: \"" + c.rdma_devices +
                              "\" must be device names separated by commas, without spaces or "
                              "empty names");
      }
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }
  if (c.rdma_gid_index < -1) {
    return fail(what, "rdma_gid_index: " + std::to_string(c.rdma_gid_index) +
                          " is invalid (-1 = automatic, else a GID table index)");
  }
  if (c.rdma_qps_per_endpoint == 0) return fail(what, "rdma_qps_per_endpoint: must be at least 1");
  if (c.rdma_max_wr == 0) return fail(what, "rdma_max_wr: must be at least 1");
  return {};
}

/// Applies the keys of the JSON object `j` on top of `base`, then
/// validate()s the result. Unknown keys, wrong types, out-of-range values or
/// a result that fails validate() -> invalid_argument with `what` saying
/// which key and why; `base` is returned unchanged in that case.
inline config config_from_json(const nlohmann::json& j, std::error_code& ec,
                               std::string* what = nullptr, config base = {}) {
  if (!j.is_object()) {
    ec = detail::fail(what, "config JSON must be an object, got " + detail::json_type_name(j));
    return base;
  }
  config c = base;
  for (const auto& [key, value] : j.items()) {
    const setting_info* s = find_setting(key);
    if (s == nullptr) {
      ec = detail::fail(
          what, "unknown setting \"" + key + "\" (known: " + detail::known_setting_names() + ")");
      return base;
    }
    ec = set_setting(c, *s, value, what);
    if (ec) return base;
  }
  ec = validate(c, what);
  if (ec) return base;
  return c;
}

/// Throwing form for set-up code: std::system_error carrying
/// invalid_argument and the message.
inline config config_from_json(const nlohmann::json& j, config base = {}) {
  std::error_code ec;
  std::string what;
  config c = config_from_json(j, ec, &what, std::move(base));
  if (ec) throw std::system_error(ec, "kvlink config: " + what);
  return c;
}

/// std::getenv, the default source for config_from_env.
inline const char* default_getenv(const char* name) { return std::getenv(name); }

/// Each set KVLINK_<NAME> variable (see config_table()) overrides `base`;
/// then the result is validate()d. An empty variable sets a string setting
/// to "" and is an error for the others. On error `base` is returned
/// unchanged and `what` names the variable and the reason (for a validate()
/// failure: the rule and the variables that were applied). `get_env` is
/// injectable for tests.
inline config config_from_env(
    config base, std::error_code& ec, std::string* what = nullptr,
    const std::function<const char*(const char*)>& get_env = default_getenv) {
  config c = base;
  for (const setting_info& s : config_table()) {
    const char* value = get_env(s.env.data());
    if (value == nullptr) continue;
    std::string why;
    ec = set_setting_text(c, s, value, &why);
    if (ec) {
      ec = detail::fail(what, std::string{s.env} + ": " + why);
      return base;
    }
  }
  std::string why;
  ec = validate(c, &why);
  if (ec) {
    // The rule may involve several settings: say which variables were applied.
    std::string applied;
    for (const setting_info& s : config_table()) {
      if (get_env(s.env.data()) == nullptr) continue;
      applied += applied.empty() ? "" : ", ";
      applied += s.env;
    }
    ec = detail::fail(what, why + " (after applying " + applied + ")");
    return base;
  }
  return c;
}

/// Throwing form of config_from_env for set-up code.
inline config config_from_env(config base = {}) {
  std::error_code ec;
  std::string what;
  config c = config_from_env(std::move(base), ec, &what);
  if (ec) throw std::system_error(ec, "kvlink config: " + what);
  return c;
}

/// Every setting as a JSON object keyed by name (sizes in bytes, durations in
/// ms): config_from_json(to_json(c)) == c for any valid c.
inline nlohmann::json to_json(const config& c) {
  nlohmann::json j = nlohmann::json::object();
  for (const setting_info& s : config_table()) j[std::string{s.name}] = get_setting(c, s);
  return j;
}

/// An aligned text table, one setting per line: name, value, unit, env var,
/// doc. Sizes of 1 KiB and more also show a binary-unit form.
inline std::string describe(const config& c) {
  struct row {
    std::string cols[5];
  };
  std::vector<row> rows;
  rows.push_back(row{{"setting", "value", "unit", "env", "doc"}});
  for (const setting_info& s : config_table()) {
    const nlohmann::json v = get_setting(c, s);
    std::string value = v.dump();  // strings come out quoted, so "" shows an empty one
    if (s.kind == setting_kind::size && v.get<std::uint64_t>() >= 1024) {
      value += " (" + format_size(v.get<std::uint64_t>()) + ")";
    }
    rows.push_back(row{{std::string{s.name}, std::move(value), std::string{s.unit},
                        std::string{s.env}, std::string{s.doc}}});
  }
  std::size_t width[4] = {};
  for (const row& r : rows) {
    for (std::size_t i = 0; i < 4; ++i) width[i] = std::max(width[i], r.cols[i].size());
  }
  std::string out;
  for (const row& r : rows) {
    for (std::size_t i = 0; i < 4; ++i) {
      out += r.cols[i];
      out.append(width[i] - r.cols[i].size() + 2, ' ');
    }
    out += r.cols[4];
    out += '\n';
  }
  return out;
}

}  // namespace kvlink
