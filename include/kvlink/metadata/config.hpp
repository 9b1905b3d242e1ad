// The metadata backends' settings: their struct, their rows of the settings
// table (core/settings.hpp) and the one parser of the `metadata` URL.
// kvlink::config (engine/config.hpp) holds one as `config.metadata`.
//
//   "p2p"                                   peer to peer (the default): a name is "host:port"
//   "etcd://10.0.0.1:2379,10.0.0.2:2379"    etcd v3 (its JSON gateway), any of these endpoints
//   "http://10.0.0.1:8080/metadata"         Mooncake's HTTP metadata server ("https://" too)
//
// TLS to etcd is on when metadata_tls_ca or metadata_tls_cert is set (and
// needs <kvlink/metadata/tls.hpp> and kvlink::tls in the program). Plain
// data and pure parsing: no I/O, no Asio.
#pragma once

#include <kvlink/core/address.hpp>
#include <kvlink/core/settings.hpp>
#include <kvlink/detail/text.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace kvlink {

struct metadata_config {
  /// Where engines publish and find each other: "p2p", "etcd://...", "http://...".
  std::string url = "p2p";
  /// Prefix of every key this engine writes or reads in the store.
  std::string prefix = "kvlink/engines/";
  /// etcd: the lease's TTL (whole seconds, rounded up); HTTP: how long a
  /// descriptor that stopped being refreshed counts as alive.
  std::chrono::milliseconds lease_ttl{10000};
  /// HTTP: how often the descriptors of this engine's peers are read again.
  std::chrono::milliseconds poll_interval{1000};
  /// Bound on one request to the store (connecting included).
  std::chrono::milliseconds timeout{3000};
  /// etcd user (its auth must be enabled); empty = no authentication.
  std::string user{};
  /// etcd password of `user`. Never printed.
  std::string password{};
  /// A file holding the password (trailing newline ignored), instead of `password`.
  std::string password_file{};
  /// HTTP: bearer token sent as "Authorization: Bearer <token>" (Mooncake's
  /// MC_METADATA_HTTP_TOKEN). Never printed.
  std::string token{};
  /// PEM file of the CA that signed the store's certificate (TLS on).
  std::string tls_ca{};
  /// PEM client certificate (chain) and its key, for stores that ask for one.
  std::string tls_cert{};
  std::string tls_key{};

  friend bool operator==(const metadata_config&, const metadata_config&) = default;
};

inline constexpr std::array metadata_settings{
    setting_row<metadata_config>{
        "metadata", "KVLINK_METADATA", setting_kind::text, &metadata_config::url,
        "where engines publish and find each other: \"p2p\" (a peer's name is its host:port), "
        "\"etcd://host:2379[,host:2379...]\" or Mooncake's \"http://host:port/metadata\""},
    setting_row<metadata_config>{"metadata_prefix", "KVLINK_METADATA_PREFIX", setting_kind::text,
                                 &metadata_config::prefix,
                                 "prefix of the keys engines publish under in the store"},
    setting_row<metadata_config>{
        "metadata_lease_ttl", "KVLINK_METADATA_LEASE_TTL", setting_kind::duration,
        &metadata_config::lease_ttl,
        "etcd lease TTL (whole seconds): an engine that stops refreshing it is reported gone "
        "(peer_unreachable) within about this long; HTTP: the same bound, by polling"},
    setting_row<metadata_config>{"metadata_poll_interval", "KVLINK_METADATA_POLL_INTERVAL",
                                 setting_kind::duration, &metadata_config::poll_interval,
                                 "HTTP store: how often peers' descriptors are read again"},
    setting_row<metadata_config>{"metadata_timeout", "KVLINK_METADATA_TIMEOUT",
                                 setting_kind::duration, &metadata_config::timeout,
                                 "bound on one request to the metadata store, connecting included"},
    setting_row<metadata_config>{"metadata_user", "KVLINK_METADATA_USER", setting_kind::text,
                                 &metadata_config::user,
                                 "etcd user name; empty = no etcd authentication"},
    setting_row<metadata_config>{"metadata_password", "KVLINK_METADATA_PASSWORD",
                                 setting_kind::text, &metadata_config::password,
                                 "etcd password of metadata_user", true},
    setting_row<metadata_config>{"metadata_password_file", "KVLINK_METADATA_PASSWORD_FILE",
                                 setting_kind::text, &metadata_config::password_file,
                                 "file holding the etcd password (instead of metadata_password)"},
    setting_row<metadata_config>{
        "metadata_token", "KVLINK_METADATA_TOKEN", setting_kind::text, &metadata_config::token,
        "HTTP store: bearer token (Mooncake's MC_METADATA_HTTP_TOKEN)", true},
    setting_row<metadata_config>{"metadata_tls_ca", "KVLINK_METADATA_TLS_CA", setting_kind::text,
                                 &metadata_config::tls_ca,
                                 "PEM CA file the store's certificate is checked against; setting "
                                 "it (or metadata_tls_cert) turns TLS on for etcd"},
    setting_row<metadata_config>{"metadata_tls_cert", "KVLINK_METADATA_TLS_CERT",
                                 setting_kind::text, &metadata_config::tls_cert,
                                 "PEM client certificate (chain) presented to the store"},
    setting_row<metadata_config>{"metadata_tls_key", "KVLINK_METADATA_TLS_KEY", setting_kind::text,
                                 &metadata_config::tls_key, "PEM private key of metadata_tls_cert"},
};

/// The `metadata` URL, parsed.
struct metadata_url {
  enum class kind : std::uint8_t { p2p, etcd, http };
  kind type = kind::p2p;
  bool tls = false;                    ///< https:// (HTTP); etcd: decided by the TLS files
  std::vector<std::string> endpoints;  ///< host:port, one or more (etcd), exactly one (HTTP)
  std::string path;                    ///< HTTP: the path, e.g. "/metadata"
};

/// Parses config.metadata; invalid_argument with `what` saying why.
inline std::error_code parse_metadata_url(std::string_view text, metadata_url& out,
                                          std::string* what = nullptr) {
  using detail::fail;
  out = metadata_url{};
  if (text == "p2p") return {};
  const auto bad = [&](std::string_view why) {
    return fail(what, "metadata: \"" + std::string(text) + "\" " + std::string(why) +
                          " (expected \"p2p\", \"etcd://host:2379[,host:2379...]\" or "
                          "\"http://host:port/metadata\")");
  };
  const auto host_port_ok = [](std::string_view hp) {
    std::string_view host;
    std::uint16_t port = 0;
    return split_host_port(hp, host, port) && !host.empty() && port != 0;
  };
  if (text.rfind("etcd://", 0) == 0) {
    out.type = metadata_url::kind::etcd;
    std::string_view rest = text.substr(7);
    if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
    for (auto& ep : detail::split_list(rest)) {
      if (!host_port_ok(ep)) return bad("has an endpoint that is not host:port");
      out.endpoints.push_back(std::move(ep));
    }
    if (out.endpoints.empty()) return bad("names no endpoint");
    return {};
  }
  const bool http = text.rfind("http://", 0) == 0;
  const bool https = text.rfind("https://", 0) == 0;
  if (http || https) {
    out.type = metadata_url::kind::http;
    out.tls = https;
    std::string_view rest = text.substr(https ? 8 : 7);
    const std::size_t slash = rest.find('/');
    std::string hp(rest.substr(0, slash));
    if (hp.find(':') == std::string::npos || (hp.front() == '[' && hp.back() == ']')) {
      hp += https ? ":443" : ":80";
    }
    if (!host_port_ok(hp)) return bad("has no valid host[:port]");
    if (rest.find_first_of("?# \t") != std::string_view::npos) {
      return bad("must be a plain URL (the key is added as ?key=...)");
    }
    out.endpoints.push_back(std::move(hp));
    out.path = slash == std::string_view::npos ? "/" : std::string(rest.substr(slash));
    return {};
  }
  return bad("is not a metadata URL");
}

/// The metadata settings' own rules; the first broken one is
/// invalid_argument with `what` naming the setting:
///  - metadata parses (parse_metadata_url);
///  - metadata_prefix is not empty and has no control characters;
///  - metadata_lease_ttl >= 1 s; metadata_poll_interval, metadata_timeout > 0;
///  - at most one of metadata_password and metadata_password_file, and
///    either needs metadata_user;
///  - metadata_tls_cert and metadata_tls_key come together.
inline std::error_code validate(const metadata_config& c, std::string* what = nullptr) {
  using detail::fail;
  metadata_url u;
  if (auto ec = parse_metadata_url(c.url, u, what)) return ec;
  if (c.prefix.empty()) return fail(what, "metadata_prefix: must not be empty");
  for (const char ch : c.prefix) {
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) {
      return fail(what, "metadata_prefix: must not contain control characters");
    }
  }
  if (c.lease_ttl < std::chrono::seconds(1)) {
    return fail(what, "metadata_lease_ttl: must be at least 1s");
  }
  if (c.poll_interval.count() <= 0) return fail(what, "metadata_poll_interval: must be positive");
  if (c.timeout.count() <= 0) return fail(what, "metadata_timeout: must be positive");
  if (!c.password.empty() && !c.password_file.empty()) {
    return fail(what, "metadata_password and metadata_password_file: set one of them, not both");
  }
  if ((!c.password.empty() || !c.password_file.empty()) && c.user.empty()) {
    return fail(what, "metadata_password: needs metadata_user");
  }
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    return fail(what, "metadata_tls_cert and metadata_tls_key: set both or neither");
  }
  return {};
}

}  // namespace kvlink
