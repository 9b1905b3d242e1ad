// kvlink's configuration: the engine's own settings plus one section per
// transport, and the whole settings table over them.
//
//   kvlink::config c{.listen = "0.0.0.0:17001", .transports = "rdma,tcp"};
//   c.tcp.lanes = 4;
//   c = kvlink::config_from_json(nlohmann::json::parse(R"({"slice_size": "4MiB"})"), c);
//   std::error_code ec;
//   c = kvlink::config_from_env(c, ec);  // KVLINK_SLICE_SIZE=... etc. override
//   std::puts(kvlink::describe(c).c_str());
//
// Each component keeps its settings with it (tcp/config.hpp, rdma/config.hpp,
// below the engine); config_table() lifts their rows into one table, the
// single source of every setting's JSON name, environment variable, unit,
// default and doc (core/settings.hpp has the machinery and the units).
#pragma once

#include <kvlink/core/address.hpp>
#include <kvlink/core/settings.hpp>
#include <kvlink/memory/config.hpp>
#include <kvlink/metadata/config.hpp>
#include <kvlink/rdma/config.hpp>
#include <kvlink/shm/config.hpp>
#include <kvlink/tcp/config.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlink {

/// Every tunable of an engine, with its default. See config_table() for
/// units, environment variables and docs; validate() for the rules.
struct config {
  /// host:port the engine listens on (handshake, control, TCP lanes); port 0 = any.
  std::string listen = "127.0.0.1:0";
  /// host:port peers are told to reach this engine at (port 0: the listening
  /// port); empty = the listen address, or for a wildcard listen address
  /// (0.0.0.0, [::]) the first up non-loopback interface's.
  std::string advertise{};
  /// What peers call this engine in a metadata store ("decode-3"); empty =
  /// its advertised host:port.
  std::string name{};
  /// Data transports in order of preference, e.g. "rdma,tcp"; empty = every
  /// transport this program has, in the library's order.
  std::string transports{};
  /// May a peer that no preferred transport reaches be served over TCP.
  bool allow_tcp_fallback = true;
  /// Bytes; planner slice size.
  std::uint64_t slice_size = 1 << 20;
  /// Bytes; a tail slice shorter than this is merged into the previous one.
  std::uint64_t min_chunk = 64 << 10;
  /// Bytes; slice cut points fall on multiples of this (power of two).
  std::uint64_t alignment = 1;
  /// End-to-end CRC32C of every slice's payload (TCP), unless a transfer's
  /// options say otherwise.
  bool checksums = false;
  /// Per transfer; 0 = none.
  std::chrono::milliseconds transfer_deadline{30000};
  std::chrono::milliseconds connect_timeout{5000};
  /// Bound on an inbound connection's handshake (then it is closed).
  std::chrono::milliseconds handshake_timeout{5000};
  /// How long a stopped transfer waits for in-flight slices before closing
  /// what carries them.
  std::chrono::milliseconds fence_timeout{2000};
  /// Bytes; bound on a handshake/control message.
  std::uint64_t max_control_message = 1 << 20;
  /// Bytes; bound on a notification (id + payload).
  std::uint32_t max_notification = 4096;
  /// Bytes; notifications kept while nobody receives them.
  std::uint64_t max_notification_bytes = 64 << 20;
  /// Bytes; control messages being received, all connections together.
  std::uint64_t max_control_buffer = 64 << 20;
  /// Inbound connections open at once (at most the file descriptor limit
  /// less 64).
  std::uint32_t max_connections = 4096;
  /// Inbound connections open at once from one remote address; at most half
  /// of the effective max_connections (the default: that half), so that one
  /// address cannot take every connection.
  std::uint32_t max_connections_per_address = 65535;
  /// Shared secret every peer must prove it knows (control/guard.hpp);
  /// empty = no authentication. Never printed.
  std::string auth_secret{};
  /// A file holding the shared secret (trailing newline ignored), instead
  /// of auth_secret.
  std::string auth_secret_file{};

  tcp_config tcp{};
  rdma_config rdma{};
  shm_config shm{};
  metadata_config metadata{};
  device_config device{};

  friend bool operator==(const config&, const config&) = default;
};

/// A row of the whole table.
using setting_info = basic_setting<config>;

inline constexpr std::array engine_settings{
    setting_row<config>{
        "listen", "KVLINK_LISTEN", setting_kind::text, &config::listen,
        "host:port to listen on for handshakes, control and TCP lanes; port 0 = any free port"},
    setting_row<config>{"advertise", "KVLINK_ADVERTISE", setting_kind::text, &config::advertise,
                        "host:port peers are told to reach this engine at; empty = the listen "
                        "address, or for 0.0.0.0/[::] the first non-loopback interface's"},
    setting_row<config>{"name", "KVLINK_NAME", setting_kind::text, &config::name,
                        "what peers call this engine in a metadata store (async_connect(name)); "
                        "empty = its advertised host:port"},
    setting_row<config>{"transports", "KVLINK_TRANSPORTS", setting_kind::text, &config::transports,
                        "data transports in order of preference, e.g. \"rdma,tcp\"; empty = all "
                        "this program has"},
    setting_row<config>{"allow_tcp_fallback", "KVLINK_ALLOW_TCP_FALLBACK", setting_kind::boolean,
                        &config::allow_tcp_fallback,
                        "peers no preferred transport reaches may be served over TCP"},
    setting_row<config>{"slice_size", "KVLINK_SLICE_SIZE", setting_kind::size, &config::slice_size,
                        "size the planner cuts requests into"},
    setting_row<config>{"min_chunk", "KVLINK_MIN_CHUNK", setting_kind::size, &config::min_chunk,
                        "a tail slice shorter than this is merged into the previous slice"},
    setting_row<config>{"alignment", "KVLINK_ALIGNMENT", setting_kind::size, &config::alignment,
                        "slice cut points fall on multiples of this (power of two)"},
    setting_row<config>{"checksums", "KVLINK_CHECKSUMS", setting_kind::boolean, &config::checksums,
                        "end-to-end CRC32C of every slice's payload over TCP; a mismatch fails "
                        "the transfer (checksum_mismatch)"},
    setting_row<config>{"transfer_deadline", "KVLINK_TRANSFER_DEADLINE", setting_kind::duration,
                        &config::transfer_deadline, "deadline of each transfer; 0 = none"},
    setting_row<config>{"connect_timeout", "KVLINK_CONNECT_TIMEOUT", setting_kind::duration,
                        &config::connect_timeout,
                        "limit on connecting to a peer, handshake included"},
    setting_row<config>{"handshake_timeout", "KVLINK_HANDSHAKE_TIMEOUT", setting_kind::duration,
                        &config::handshake_timeout,
                        "bound on an inbound connection's handshake; then it is closed"},
    setting_row<config>{"fence_timeout", "KVLINK_FENCE_TIMEOUT", setting_kind::duration,
                        &config::fence_timeout,
                        "how long a stopped transfer waits for in-flight slices before closing "
                        "what carries them"},
    setting_row<config>{"max_control_message", "KVLINK_MAX_CONTROL_MESSAGE", setting_kind::size,
                        &config::max_control_message, "bound on a handshake or control message"},
    setting_row<config>{"max_notification", "KVLINK_MAX_NOTIFICATION", setting_kind::size,
                        &config::max_notification, "bound on a notification (id + payload)"},
    setting_row<config>{"max_notification_bytes", "KVLINK_MAX_NOTIFICATION_BYTES",
                        setting_kind::size, &config::max_notification_bytes,
                        "notifications kept while nobody receives them; a peer sending more is "
                        "refused"},
    setting_row<config>{"max_control_buffer", "KVLINK_MAX_CONTROL_BUFFER", setting_kind::size,
                        &config::max_control_buffer,
                        "control-message bytes being received, all connections together"},
    setting_row<config>{"max_connections", "KVLINK_MAX_CONNECTIONS", setting_kind::count,
                        &config::max_connections,
                        "inbound connections open at once (at most the fd limit less 64)"},
    setting_row<config>{"max_connections_per_address", "KVLINK_MAX_CONNECTIONS_PER_ADDRESS",
                        setting_kind::count, &config::max_connections_per_address,
                        "inbound connections open at once from one remote address (at most half "
                        "of the effective max_connections)"},
    setting_row<config>{
        "auth_secret", "KVLINK_AUTH_SECRET", setting_kind::text, &config::auth_secret,
        "shared secret peers must prove they know; empty = no authentication", true},
    setting_row<config>{"auth_secret_file", "KVLINK_AUTH_SECRET_FILE", setting_kind::text,
                        &config::auth_secret_file,
                        "file holding the shared secret (instead of auth_secret)"},
};

/// The whole settings table: the engine's rows, then each transport's.
inline std::span<const setting_info> config_table() {
  static const std::vector<setting_info> table = [] {
    std::vector<setting_info> t;
    lift_settings(t, "engine", engine_settings);
    lift_settings(t, "tcp", &config::tcp, tcp_settings);
    lift_settings(t, "rdma", &config::rdma, rdma_settings);
    lift_settings(t, "shm", &config::shm, shm_settings);
    lift_settings(t, "metadata", &config::metadata, metadata_settings);
    lift_settings(t, "device", &config::device, device_settings);
    return t;
  }();
  return table;
}

/// The row named `name` (the JSON key), or nullptr.
inline const setting_info* find_setting(std::string_view name) noexcept {
  return find_setting_in(config_table(), name);
}

/// Checks the rules the engines rely on; the first broken one is reported as
/// invalid_argument with `what` naming the setting(s) and the reason:
///  - listen is "host:port" or "[v6]:port", port 0..65535 (core/address.hpp);
///  - advertise is empty or host:port;
///  - transports: names separated by commas, none empty or repeated;
///  - slice_size >= 1, min_chunk <= slice_size;
///  - alignment a power of two dividing slice_size;
///  - slice_size + min_chunk - 1 (the largest slice after a short tail is
///    merged) <= max_frame_payload, so a peer with the same settings accepts
///    every slice we send;
///  - no negative durations; connect_timeout, handshake_timeout > 0;
///  - max_connections, max_connections_per_address >= 1;
///    max_control_buffer >= max_control_message;
///    max_notification_bytes >= max_notification;
///  - max_control_message >= 1, max_notification <= max_control_message
///    (a notification travels inside a control message);
///  - at most one of auth_secret and auth_secret_file;
///  - name: at most 255 bytes, no control characters;
///  - each transport's own rules (tcp/config.hpp, rdma/config.hpp,
///    shm/config.hpp) and the
///    metadata settings' (metadata/config.hpp).
inline std::error_code validate(const config& c, std::string* what = nullptr) {
  using detail::fail;
  std::string_view host;
  std::uint16_t port = 0;
  if (!split_host_port(c.listen, host, port)) {
    return fail(what, "listen: \"" + c.listen +
                          "\" is not host:port (e.g. \"0.0.0.0:17001\", \"[::1]:0\")");
  }
  if (!c.advertise.empty() && !split_host_port(c.advertise, host, port)) {
    return fail(what,
                "advertise: \"" + c.advertise + "\" is not host:port (e.g. \"10.0.0.5:17001\")");
  }
  if (!c.transports.empty()) {
    const auto names = detail::split_list(c.transports);
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (names[i].empty() || names[i].find_first_of(" \t") != std::string::npos ||
          std::find(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(i), names[i]) !=
              names.begin() + static_cast<std::ptrdiff_t>(i)) {
        return fail(what, "transports: \"" + c.transports +
                              "\" must be transport names separated by commas (e.g. "
                              "\"rdma,tcp\"), without spaces, empty or repeated names");
      }
    }
  }
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
  if (auto ec = validate(c.tcp, what)) return ec;
  const std::uint64_t max_payload = c.tcp.max_frame_payload;
  if (c.slice_size > max_payload ||
      (c.min_chunk > 0 && c.min_chunk - 1 > max_payload - c.slice_size)) {
    return fail(what, "max_frame_payload (" + std::to_string(max_payload) +
                          ") must be at least slice_size + min_chunk - 1, the largest slice the "
                          "planner sends");
  }
  if (c.transfer_deadline.count() < 0) return fail(what, "transfer_deadline: must not be negative");
  if (c.connect_timeout.count() <= 0) return fail(what, "connect_timeout: must be positive");
  if (c.handshake_timeout.count() <= 0) return fail(what, "handshake_timeout: must be positive");
  if (c.max_connections == 0) return fail(what, "max_connections: must be at least 1");
  if (c.max_connections_per_address == 0) {
    return fail(what, "max_connections_per_address: must be at least 1");
  }
  if (c.max_control_buffer < c.max_control_message) {
    return fail(what, "max_control_buffer (" + std::to_string(c.max_control_buffer) +
                          ") must be at least max_control_message (" +
                          std::to_string(c.max_control_message) + ")");
  }
  if (c.max_notification_bytes < c.max_notification) {
    return fail(what, "max_notification_bytes must be at least max_notification");
  }
  if (c.fence_timeout.count() < 0) return fail(what, "fence_timeout: must not be negative");
  if (c.max_control_message == 0) return fail(what, "max_control_message: must be at least 1 byte");
  if (!c.auth_secret.empty() && !c.auth_secret_file.empty()) {
    return fail(what, "auth_secret and auth_secret_file: set one of them, not both");
  }
  if (c.max_notification > c.max_control_message) {
    return fail(what, "max_notification (" + std::to_string(c.max_notification) +
                          ") must not exceed max_control_message (" +
                          std::to_string(c.max_control_message) + ")");
  }
  if (c.name.size() > 255) return fail(what, "name: longer than 255 bytes");
  for (const char ch : c.name) {
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) {
      return fail(what, "name: must not contain control characters");
    }
  }
  if (auto ec = validate(c.metadata, what)) return ec;
  if (auto ec = validate(c.shm, what)) return ec;
  if (auto ec = validate(c.device, what)) return ec;
  if (c.device.staging_chunk != 0 && c.device.staging_chunk < c.slice_size + c.min_chunk - 1) {
    return fail(what, "staging_chunk (" + std::to_string(c.device.staging_chunk) +
                          ") must be 0 or at least slice_size + min_chunk - 1, the largest slice "
                          "the planner cuts");
  }
  return validate(c.rdma, what);
}

/// Reads one setting as JSON (sizes and counts as unsigned integers,
/// durations as integer milliseconds).
inline nlohmann::json get_setting(const config& c, const setting_info& s) {
  return get_setting<config>(c, s);
}

/// Applies the keys of the JSON object `j` on top of `base`, then
/// validate()s the result. Unknown keys, wrong types, out-of-range values or
/// a result that fails validate() -> invalid_argument with `what` saying
/// which key and why; `base` is returned unchanged in that case.
inline config config_from_json(const nlohmann::json& j, std::error_code& ec,
                               std::string* what = nullptr, config base = {}) {
  config c = base;
  ec = apply_json(config_table(), j, c, what);
  if (!ec) ec = validate(c, what);
  return ec ? base : c;
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
  std::string applied;
  ec = apply_env(config_table(), c, get_env, what, &applied);
  if (ec) return base;
  std::string why;
  ec = validate(c, &why);
  if (ec) {
    // The rule may involve several settings: say which variables were applied.
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
inline nlohmann::json to_json(const config& c) { return settings_to_json(config_table(), c); }

/// An aligned text table, one setting per line: name, value, unit, env var,
/// doc. Sizes of 1 KiB and more also show a binary-unit form.
inline std::string describe(const config& c) { return describe_settings(config_table(), c); }

}  // namespace kvlink
