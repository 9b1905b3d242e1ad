// The settings-table machinery: one table per component (engine, tcp,
// rdma, ...), each row the single source of a setting's JSON name,
// environment variable, unit, default (the member initialiser) and one-line
// doc. A whole configuration (kvlink::config, engine/config.hpp) lifts the
// rows of its components into one table; parsing JSON and environment
// variables, printing and documenting are all driven by it.
//
//   struct my_config { std::uint64_t chunk = 4 << 20; };
//   inline constexpr std::array my_rows{kvlink::setting_row<my_config>{
//       "my_chunk", "KVLINK_MY_CHUNK", kvlink::setting_kind::size, &my_config::chunk,
//       "bytes per chunk"}};
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

/// The member of a component's config struct a row describes.
template <class Owner>
using setting_member =
    std::variant<std::string Owner::*, bool Owner::*, std::uint32_t Owner::*, std::int32_t Owner::*,
                 std::uint64_t Owner::*, std::chrono::milliseconds Owner::*>;

/// A setting's storage inside one configuration object.
using setting_ref = std::variant<std::string*, bool*, std::uint32_t*, std::int32_t*, std::uint64_t*,
                                 std::chrono::milliseconds*>;

/// One row of a component's table. `env` must be a string literal (it is
/// passed to getenv as a C string).
template <class Owner>
struct setting_row {
  std::string_view name;  ///< JSON key, e.g. "tcp_lanes"
  std::string_view env;   ///< environment variable, e.g. "KVLINK_TCP_LANES"
  setting_kind kind;
  setting_member<Owner> member;
  std::string_view doc;  ///< one line
  bool secret = false;   ///< never printed (describe() says whether it is set)
};

/// One setting of a whole configuration `Config`: a component's row, lifted
/// so that it reaches its member from the top-level object.
template <class Config>
struct basic_setting {
  std::string_view name;       ///< JSON key
  std::string_view env;        ///< environment variable (NUL-terminated)
  std::string_view unit;       ///< "bytes", "ms", "count", "bool", "string", "index"
  std::string_view doc;        ///< one line
  setting_kind kind;           ///< how it is parsed and printed
  std::string_view component;  ///< "engine", "tcp", "rdma", ...
  std::function<setting_ref(Config&)> ref;
  bool secret = false;  ///< never printed (describe() says whether it is set)
};

/// Appends the rows of the component `Owner`, which lives in `Config` at
/// `where`, to `out`.
template <class Config, class Owner, std::size_t N>
void lift_settings(std::vector<basic_setting<Config>>& out, std::string_view component,
                   Owner Config::*where, const std::array<setting_row<Owner>, N>& rows) {
  for (const auto& r : rows) {
    out.push_back(basic_setting<Config>{r.name, r.env, unit_of(r.kind), r.doc, r.kind, component,
                                        [where, m = r.member](Config& c) -> setting_ref {
                                          Owner& o = c.*where;
                                          return std::visit(
                                              [&o](auto p) -> setting_ref { return &(o.*p); }, m);
                                        },
                                        r.secret});
  }
}

/// For a component that is the top-level struct itself.
template <class Config, std::size_t N>
void lift_settings(std::vector<basic_setting<Config>>& out, std::string_view component,
                   const std::array<setting_row<Config>, N>& rows) {
  for (const auto& r : rows) {
    out.push_back(basic_setting<Config>{r.name, r.env, unit_of(r.kind), r.doc, r.kind, component,
                                        [m = r.member](Config& c) -> setting_ref {
                                          return std::visit(
                                              [&c](auto p) -> setting_ref { return &(c.*p); }, m);
                                        },
                                        r.secret});
  }
}

namespace detail {

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

// Stores a parsed value into the setting's storage (range-checked).
inline std::error_code store(const setting_ref& ref, std::string_view name, std::uint64_t v,
                             std::string* what) {
  if (auto* const* p = std::get_if<std::uint64_t*>(&ref)) {
    **p = v;
    return {};
  }
  if (auto* const* p = std::get_if<std::uint32_t*>(&ref)) {
    if (v > std::numeric_limits<std::uint32_t>::max()) {
      return fail(what, std::string{name} + ": " + std::to_string(v) +
                            " is out of range (at most 4294967295)");
    }
    **p = static_cast<std::uint32_t>(v);
    return {};
  }
  return fail(what, std::string{name} + ": not an unsigned setting");
}

inline std::error_code store_signed(const setting_ref& ref, std::string_view name, std::int64_t v,
                                    std::string* what) {
  if (auto* const* p = std::get_if<std::int32_t*>(&ref)) {
    if (v < std::numeric_limits<std::int32_t>::min() ||
        v > std::numeric_limits<std::int32_t>::max()) {
      return fail(what, std::string{name} + ": " + std::to_string(v) +
                            " is out of range (a 32-bit signed integer)");
    }
    **p = static_cast<std::int32_t>(v);
    return {};
  }
  return fail(what, std::string{name} + ": not a signed setting");
}

inline std::error_code store_duration(const setting_ref& ref, std::string_view name,
                                      std::uint64_t ms, std::string* what) {
  if (auto* const* p = std::get_if<std::chrono::milliseconds*>(&ref)) {
    if (ms >
        static_cast<std::uint64_t>(std::numeric_limits<std::chrono::milliseconds::rep>::max())) {
      return fail(what, std::string{name} + ": " + std::to_string(ms) + " ms is out of range");
    }
    **p = std::chrono::milliseconds{static_cast<std::chrono::milliseconds::rep>(ms)};
    return {};
  }
  return fail(what, std::string{name} + ": not a duration setting");
}

inline std::error_code store_bool(const setting_ref& ref, std::string_view name, bool v,
                                  std::string* what) {
  if (auto* const* p = std::get_if<bool*>(&ref)) {
    **p = v;
    return {};
  }
  return fail(what, std::string{name} + ": not a boolean setting");
}

inline std::error_code store_text(const setting_ref& ref, std::string_view name, std::string v,
                                  std::string* what) {
  if (auto* const* p = std::get_if<std::string*>(&ref)) {
    **p = std::move(v);
    return {};
  }
  return fail(what, std::string{name} + ": not a string setting");
}

}  // namespace detail

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
template <class Config>
nlohmann::json get_setting(const Config& c, const basic_setting<Config>& s) {
  // ref() needs a non-const object to hand out pointers; nothing is written.
  const setting_ref ref = s.ref(const_cast<Config&>(c));
  return std::visit(
      [](auto* p) -> nlohmann::json {
        if constexpr (std::is_same_v<std::decay_t<decltype(*p)>, std::chrono::milliseconds>) {
          return p->count();
        } else {
          return *p;
        }
      },
      ref);
}

/// Sets one setting from JSON. Sizes take integers (bytes) or strings with a
/// unit; durations integers (ms) or strings with a unit; counts and indexes
/// integers; booleans booleans; text strings. Wrong type or out of range ->
/// invalid_argument, with `what` naming the setting and the reason.
template <class Config>
std::error_code set_setting(Config& c, const basic_setting<Config>& s, const nlohmann::json& v,
                            std::string* what = nullptr) {
  using detail::fail;
  const std::string name{s.name};
  const setting_ref ref = s.ref(c);
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
      if (u) return detail::store(ref, s.name, *u, what);
      if (v.is_number_integer()) return negative();
      if (v.is_string()) {
        const auto& str = v.get_ref<const std::string&>();
        const auto bytes = parse_size(str);
        if (!bytes) {
          return fail(what, name + ": \"" + str + "\" is not a size: expected " +
                                std::string{detail::size_units_help});
        }
        return detail::store(ref, s.name, *bytes, what);
      }
      return wrong_type("an integer number of bytes or a string such as \"4MiB\"");
    case setting_kind::count:
      if (u) return detail::store(ref, s.name, *u, what);
      if (v.is_number_integer()) return negative();
      return wrong_type("a non-negative integer");
    case setting_kind::index:
      if (v.is_number_unsigned()) {
        if (*u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          return fail(what, name + ": " + v.dump() + " is out of range (a 32-bit signed integer)");
        }
        return detail::store_signed(ref, s.name, static_cast<std::int64_t>(*u), what);
      }
      if (v.is_number_integer()) {
        return detail::store_signed(ref, s.name, v.get<std::int64_t>(), what);
      }
      return wrong_type("an integer");
    case setting_kind::duration:
      if (u) return detail::store_duration(ref, s.name, *u, what);
      if (v.is_number_integer()) return negative();
      if (v.is_string()) {
        const auto& str = v.get_ref<const std::string&>();
        const auto d = parse_duration(str);
        if (!d) {
          return fail(what, name + ": \"" + str + "\" is not a duration: expected " +
                                std::string{detail::duration_units_help});
        }
        return detail::store_duration(ref, s.name, static_cast<std::uint64_t>(d->count()), what);
      }
      return wrong_type("an integer number of milliseconds or a string such as \"250ms\"");
    case setting_kind::boolean:
      if (v.is_boolean()) return detail::store_bool(ref, s.name, v.get<bool>(), what);
      return wrong_type("true or false");
    case setting_kind::text:
      if (v.is_string()) return detail::store_text(ref, s.name, v.get<std::string>(), what);
      return wrong_type("a string");
  }
  return fail(what, name + ": unknown setting kind");
}

/// Sets one setting from text (an environment variable, a command line).
/// Same units as JSON strings; counts and indexes decimal; booleans 1/0,
/// true/false, yes/no, on/off (case-insensitive); text taken verbatim.
template <class Config>
std::error_code set_setting_text(Config& c, const basic_setting<Config>& s, std::string_view text,
                                 std::string* what = nullptr) {
  using detail::fail;
  const std::string name{s.name};
  const setting_ref ref = s.ref(c);
  const auto bad = [&](std::string_view expected) {
    return fail(what, name + ": \"" + std::string{text} + "\" is not " + std::string{expected});
  };
  switch (s.kind) {
    case setting_kind::size: {
      const auto bytes = parse_size(text);
      if (!bytes) {
        return bad(std::string{"a size: expected "} + std::string{detail::size_units_help});
      }
      return detail::store(ref, s.name, *bytes, what);
    }
    case setting_kind::count: {
      const auto n = detail::parse_unsigned(text);
      if (!n) return bad("a non-negative integer");
      return detail::store(ref, s.name, *n, what);
    }
    case setting_kind::index: {
      const auto n = detail::parse_int(text);
      if (!n) return bad("an integer");
      return detail::store_signed(ref, s.name, *n, what);
    }
    case setting_kind::duration: {
      const auto d = parse_duration(text);
      if (!d) {
        return bad(std::string{"a duration: expected "} + std::string{detail::duration_units_help});
      }
      return detail::store_duration(ref, s.name, static_cast<std::uint64_t>(d->count()), what);
    }
    case setting_kind::boolean: {
      const auto b = detail::parse_bool(text);
      if (!b) return bad("a boolean (1/0, true/false, yes/no, on/off)");
      return detail::store_bool(ref, s.name, *b, what);
    }
    case setting_kind::text:
      return detail::store_text(ref, s.name, std::string{text}, what);
  }
  return fail(what, name + ": unknown setting kind");
}

/// The row named `name` (the JSON key) of `table`, or nullptr.
template <class Config>
const basic_setting<Config>* find_setting_in(std::span<const basic_setting<Config>> table,
                                             std::string_view name) noexcept {
  for (const auto& s : table) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

/// Applies the keys of the JSON object `j` on top of `base` (unknown keys,
/// wrong types and out-of-range values are invalid_argument with `what`
/// saying which key and why); the caller validates the result.
template <class Config>
std::error_code apply_json(std::span<const basic_setting<Config>> table, const nlohmann::json& j,
                           Config& c, std::string* what) {
  if (!j.is_object()) {
    return detail::fail(what, "config JSON must be an object, got " + detail::json_type_name(j));
  }
  for (const auto& [key, value] : j.items()) {
    const auto* s = find_setting_in(table, key);
    if (s == nullptr) {
      std::string known;
      for (const auto& row : table) {
        if (!known.empty()) known += ", ";
        known += row.name;
      }
      return detail::fail(what, "unknown setting \"" + key + "\" (known: " + known + ")");
    }
    if (auto ec = set_setting(c, *s, value, what)) return ec;
  }
  return {};
}

/// std::getenv, the default source of environment variables.
inline const char* default_getenv(const char* name) { return std::getenv(name); }

/// Applies each set environment variable of `table` to `c`; on error `what`
/// names the variable and the reason. `applied` (when given) collects the
/// names of the variables that were set.
template <class Config>
std::error_code apply_env(std::span<const basic_setting<Config>> table, Config& c,
                          const std::function<const char*(const char*)>& get_env, std::string* what,
                          std::string* applied = nullptr) {
  for (const auto& s : table) {
    const char* value = get_env(s.env.data());
    if (value == nullptr) continue;
    if (applied != nullptr) {
      *applied += applied->empty() ? "" : ", ";
      *applied += s.env;
    }
    std::string why;
    if (set_setting_text(c, s, value, &why)) {
      return detail::fail(what, std::string{s.env} + ": " + why);
    }
  }
  return {};
}

/// Every setting of `table` as a JSON object keyed by name (sizes in bytes,
/// durations in ms).
template <class Config>
nlohmann::json settings_to_json(std::span<const basic_setting<Config>> table, const Config& c) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& s : table) j[std::string{s.name}] = get_setting(c, s);
  return j;
}

/// An aligned text table, one setting per line: name, value, unit, env var,
/// doc. Sizes of 1 KiB and more also show a binary-unit form.
template <class Config>
std::string describe_settings(std::span<const basic_setting<Config>> table, const Config& c) {
  struct row {
    std::string cols[5];
  };
  std::vector<row> rows;
  rows.push_back(row{{"setting", "value", "unit", "env", "doc"}});
  for (const auto& s : table) {
    const nlohmann::json v = get_setting(c, s);
    std::string value = v.dump();  // strings come out quoted, so "" shows an empty one
    if (s.secret && v.is_string() && !v.get_ref<const std::string&>().empty()) {
      value = "(set, not shown)";
    }
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
