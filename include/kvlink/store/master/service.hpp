// The store master's request handling, without I/O: the clients it knows,
// where their segments are served, and the answer to one decoded frame.
// store/master/server.hpp puts sockets around it; the fuzz target
// test/fuzz/store_wire.cpp feeds it frames directly.
//
//   kvlink::store::master_service svc{{}, {}};
//   auto now = kvlink::store::master_clock::now();
//   auto att = svc.attach_client(kvlink::make_instance_id(), "10.0.0.1:17001", now);
//   // ... for each frame received on that client's connection:
//   bool close = false;
//   std::string reply = svc.handle_frame(att.session, header, body, now, close);
//   // ... send reply; stop reading when close is set; at the end:
//   svc.detach_client(att.session);
//
// Clients. A store client is known by its engine's instance id (the hello's
// `instance`), which is stable for its life; the master gives each instance
// a u64 client id the first time it sees it and keeps it while it runs, so a
// client that reconnects is the same writer and the same segment owner.
// Every frame refreshes its last-seen time. check_liveness() (the server's
// timer) marks a client suspect after suspect_after without a frame (it is
// still served) and declares it gone after liveness_timeout: its segments
// are unmounted (the replicas on them dropped, objects left without one
// vanish) and it is no longer known. A gone client that speaks again is
// taken back, unknown: its heartbeat answers known = 0 and it remounts, as
// Mooncake's NEED_REMOUNT. A closed connection does not make a client gone:
// it may reconnect within the timeout and find itself known.
//
// Rebuilding. A client that remounts (this master came up empty, or had
// declared it gone) sends with each mount the objects its segment holds
// (their records checked: store/wire/record.hpp); the segment is mounted
// closed, the objects are taken back (object_table::adopt: complete,
// readable, a second replica when another owner announced the same key),
// then it opens for allocations. Eviction waits rebuild_grace after such a
// mount: the first segments back may be full on their own.
//
// Thread-safe: handle_frame may run for many sessions at once (the object
// table shards its locks); one session's frames are handled one at a time.
// Locks, in order: clients_mu_ (attach, detach, revive, mount, liveness),
// then the object table's, then segments_mu_ (the segment address book).
#pragma once

#include <kvlink/core/address.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/settings.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/store/error.hpp>
#include <kvlink/store/master/config.hpp>
#include <kvlink/store/master/eviction.hpp>
#include <kvlink/store/master/objects.hpp>
#include <kvlink/store/wire/leader.hpp>
#include <kvlink/store/wire/protocol.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvlink::store {

/// The master server's own settings (the object table's are master_config).
struct server_options {
  /// Where clients connect: "host:port" (port 0 = any free port).
  std::string listen = "0.0.0.0:50051";
  /// The HTTP endpoint (/health, /metrics, /segments): "host:port", "" = off.
  std::string http_listen{};
  /// The metadata server with Mooncake's HTTP protocol (metadata.hpp):
  /// "host:port", "" = off. Engines then use "http://host:port/metadata".
  std::string metadata_listen{};
  /// Bearer token the metadata server requires ("" = none).
  std::string metadata_token{};
  /// Largest value the metadata server keeps.
  std::uint64_t metadata_max_value = 16u << 20;
  /// Bytes of keys and values the metadata server keeps in all.
  std::uint64_t metadata_capacity = 1ull << 30;
  /// Shared secret clients must prove they know; "" = none (logged).
  std::string auth_secret{};
  /// A file holding the secret (instead of auth_secret).
  std::string auth_secret_file{};
  /// How often clients are told to send a heartbeat.
  std::chrono::milliseconds heartbeat_interval{1000};
  /// A client without a frame this long is suspect (logged, counted, served).
  std::chrono::milliseconds suspect_after{3000};
  /// A client without a frame this long is gone: its segments are unmounted.
  std::chrono::milliseconds liveness_timeout{10000};
  /// A connection must finish its handshake within this.
  std::chrono::milliseconds handshake_timeout{5000};
  /// Largest frame body accepted (and the most reply bytes queued per connection).
  std::uint32_t max_body = wire::default_max_body;
  /// Open connections (clients and HTTP) beyond this are refused.
  std::uint64_t max_connections = 4096;
  /// How often puts that never ended are reclaimed (object_table::reclaim).
  std::chrono::milliseconds reclaim_interval{1000};
  /// How often the evictor looks whether the pool needs room.
  std::chrono::milliseconds eviction_interval{10};
  /// No eviction for this long after a mount that took objects back (a
  /// master that came up empty while its clients mount again one by one:
  /// the first segments back may be full on their own).
  std::chrono::milliseconds rebuild_grace{5000};
  /// Stand for election among masters through etcd (election.hpp):
  /// "etcd://host:2379[,host:2379]" or "host:2379;host:2379"; "" = off (this
  /// master serves alone).
  std::string ha_etcd{};
  /// The cluster the masters lead; clients name the same one.
  std::string ha_cluster{wire::default_cluster};
  /// The leader's etcd lease: a leader that died is replaced this long after.
  std::chrono::milliseconds ha_leader_ttl{5000};
  /// The address clients dial when this master leads; "" = the one it
  /// listens on (which must then not be a wildcard like 0.0.0.0).
  std::string ha_advertise{};

  /// invalid_argument, with `what` saying why, for values out of range.
  std::error_code validate(std::string* what = nullptr) const {
    std::string_view host;
    std::uint16_t port = 0;
    if (!split_host_port(listen, host, port)) {
      return kvlink::detail::fail(what, "store_listen: \"" + listen + "\" is not host:port");
    }
    if (!http_listen.empty() && !split_host_port(http_listen, host, port)) {
      return kvlink::detail::fail(what,
                                  "store_http_listen: \"" + http_listen + "\" is not host:port");
    }
    if (!metadata_listen.empty() && !split_host_port(metadata_listen, host, port)) {
      return kvlink::detail::fail(
          what, "store_metadata_listen: \"" + metadata_listen + "\" is not host:port");
    }
    if (metadata_max_value == 0 || metadata_capacity < metadata_max_value) {
      return kvlink::detail::fail(what,
                                  "store_metadata_max_value must be > 0 and "
                                  "store_metadata_capacity >= store_metadata_max_value");
    }
    if (!auth_secret.empty() && !auth_secret_file.empty()) {
      return kvlink::detail::fail(
          what, "store_auth_secret and store_auth_secret_file: set one, not both");
    }
    if (heartbeat_interval.count() <= 0 || suspect_after.count() <= 0 ||
        liveness_timeout <= suspect_after || handshake_timeout.count() <= 0 ||
        reclaim_interval.count() <= 0 || eviction_interval.count() <= 0 ||
        rebuild_grace.count() < 0) {
      return kvlink::detail::fail(what,
                                  "intervals and timeouts must be > 0 and store_liveness_timeout > "
                                  "store_suspect_after");
    }
    if (!ha_etcd.empty()) {
      std::vector<std::string> endpoints;
      if (!wire::parse_etcd_endpoints(ha_etcd, endpoints)) {
        return kvlink::detail::fail(what, "store_ha_etcd: \"" + ha_etcd +
                                              "\" is not etcd://host:port[,host:port] or "
                                              "host:port[;host:port]");
      }
      if (ha_cluster.empty() || ha_cluster.find_first_of("/\n\r\t ") != std::string::npos) {
        return kvlink::detail::fail(what, "store_ha_cluster: a name without '/' or spaces");
      }
      if (ha_leader_ttl < std::chrono::seconds(1)) {
        return kvlink::detail::fail(what, "store_ha_leader_ttl: at least 1 s");
      }
      if (!ha_advertise.empty() &&
          (!split_host_port(ha_advertise, host, port) || host.empty() || port == 0)) {
        return kvlink::detail::fail(
            what, "store_ha_advertise: \"" + ha_advertise + "\" is not host:port with a port");
      }
    }
    if (max_body < 1024 || max_connections == 0) {
      return kvlink::detail::fail(what,
                                  "store_max_body must be >= 1024, store_max_connections > 0");
    }
    return {};
  }
};

inline constexpr std::array server_settings{
    setting_row<server_options>{"store_listen", "KVLINK_STORE_LISTEN", setting_kind::text,
                                &server_options::listen,
                                "where store clients connect: host:port (port 0 = any)"},
    setting_row<server_options>{"store_http_listen", "KVLINK_STORE_HTTP_LISTEN", setting_kind::text,
                                &server_options::http_listen,
                                "HTTP endpoint for /health, /metrics, /segments: host:port, "
                                "\"\" = off"},
    setting_row<server_options>{"store_metadata_listen", "KVLINK_STORE_METADATA_LISTEN",
                                setting_kind::text, &server_options::metadata_listen,
                                "metadata server with Mooncake's HTTP protocol (engines use "
                                "http://host:port/metadata): host:port, \"\" = off"},
    setting_row<server_options>{"store_metadata_token", "KVLINK_STORE_METADATA_TOKEN",
                                setting_kind::text, &server_options::metadata_token,
                                "bearer token the metadata server requires (\"\" = none)", true},
    setting_row<server_options>{"store_metadata_max_value", "KVLINK_STORE_METADATA_MAX_VALUE",
                                setting_kind::size, &server_options::metadata_max_value,
                                "largest value the metadata server keeps, in bytes"},
    setting_row<server_options>{"store_metadata_capacity", "KVLINK_STORE_METADATA_CAPACITY",
                                setting_kind::size, &server_options::metadata_capacity,
                                "bytes of keys and values the metadata server keeps in all"},
    setting_row<server_options>{"store_auth_secret", "KVLINK_STORE_AUTH_SECRET", setting_kind::text,
                                &server_options::auth_secret,
                                "shared secret every client must prove it knows (\"\" = none)",
                                true},
    setting_row<server_options>{"store_auth_secret_file", "KVLINK_STORE_AUTH_SECRET_FILE",
                                setting_kind::text, &server_options::auth_secret_file,
                                "file holding the shared secret (instead of store_auth_secret)"},
    setting_row<server_options>{"store_heartbeat_interval", "KVLINK_STORE_HEARTBEAT_INTERVAL",
                                setting_kind::duration, &server_options::heartbeat_interval,
                                "how often clients are told to send a heartbeat"},
    setting_row<server_options>{"store_suspect_after", "KVLINK_STORE_SUSPECT_AFTER",
                                setting_kind::duration, &server_options::suspect_after,
                                "a client silent this long is suspect (logged, still served)"},
    setting_row<server_options>{"store_liveness_timeout", "KVLINK_STORE_LIVENESS_TIMEOUT",
                                setting_kind::duration, &server_options::liveness_timeout,
                                "a client silent this long is gone: its segments are unmounted "
                                "(Mooncake client_ttl)"},
    setting_row<server_options>{"store_handshake_timeout", "KVLINK_STORE_HANDSHAKE_TIMEOUT",
                                setting_kind::duration, &server_options::handshake_timeout,
                                "a connection must finish its handshake within this"},
    setting_row<server_options>{"store_max_body", "KVLINK_STORE_MAX_BODY", setting_kind::size,
                                &server_options::max_body,
                                "largest request body accepted, in bytes (also the reply "
                                "backlog of one connection)"},
    setting_row<server_options>{"store_max_connections", "KVLINK_STORE_MAX_CONNECTIONS",
                                setting_kind::count, &server_options::max_connections,
                                "open connections beyond this are refused"},
    setting_row<server_options>{"store_reclaim_interval", "KVLINK_STORE_RECLAIM_INTERVAL",
                                setting_kind::duration, &server_options::reclaim_interval,
                                "how often puts that never ended are discarded and released"},
    setting_row<server_options>{"store_eviction_interval", "KVLINK_STORE_EVICTION_INTERVAL",
                                setting_kind::duration, &server_options::eviction_interval,
                                "how often the evictor checks whether the pool needs room"},
    setting_row<server_options>{"store_rebuild_grace", "KVLINK_STORE_REBUILD_GRACE",
                                setting_kind::duration, &server_options::rebuild_grace,
                                "no eviction for this long after a client mounted a segment with "
                                "objects to take back (a master rebuilding its pool)"},
    setting_row<server_options>{"store_ha_etcd", "KVLINK_STORE_HA_ETCD", setting_kind::text,
                                &server_options::ha_etcd,
                                "stand for election among masters through etcd: "
                                "etcd://host:2379[,host:2379] (\"\" = serve alone)"},
    setting_row<server_options>{"store_ha_cluster", "KVLINK_STORE_HA_CLUSTER", setting_kind::text,
                                &server_options::ha_cluster,
                                "the cluster masters lead and clients name (Mooncake cluster_id)"},
    setting_row<server_options>{"store_ha_leader_ttl", "KVLINK_STORE_HA_LEADER_TTL",
                                setting_kind::duration, &server_options::ha_leader_ttl,
                                "the leader's etcd lease: a dead leader is replaced this long "
                                "after (at least 1 s)"},
    setting_row<server_options>{"store_ha_advertise", "KVLINK_STORE_HA_ADVERTISE",
                                setting_kind::text, &server_options::ha_advertise,
                                "address clients dial when this master leads (\"\" = "
                                "store_listen's, which must not be a wildcard)"},
};

/// Everything a master program is configured with.
struct master_server_config {
  master_config store{};
  server_options server{};
};

/// The rows of master_settings and server_settings over master_server_config
/// (apply_json, apply_env, describe_settings).
inline std::vector<basic_setting<master_server_config>> master_server_setting_table() {
  std::vector<basic_setting<master_server_config>> out;
  lift_settings(out, "store", &master_server_config::store, master_settings);
  lift_settings(out, "server", &master_server_config::server, server_settings);
  return out;
}

/// One client as the master knows it.
struct client_record {
  std::uint64_t id = 0;
  instance_id instance{};
  std::atomic<std::int64_t> last_seen_ms{0};
  std::atomic<bool> alive{true};  // false once declared gone, until it speaks again
  // Guarded by the service's clients_mu_:
  std::string address;  // its engine's address, from its latest hello
  std::string host;     // the host part of it
  std::uint32_t connections = 0;
  bool suspect = false;
};

/// What a connection's frames are handled with.
struct session_state {
  std::shared_ptr<client_record> client;
};

/// The host part of "host:port" ("" when it is not one).
inline std::string host_of(std::string_view address) {
  std::string_view host;
  std::uint16_t port = 0;
  if (!split_host_port(address, host, port)) return {};
  return std::string(host);
}

class master_service {
 public:
  struct attachment {
    session_state session;
    bool known = false;  ///< the master knew this instance alive (its segments are mounted)
  };

  struct liveness_report {
    std::size_t suspected = 0;  ///< clients that became suspect now
    std::size_t gone = 0;       ///< clients declared gone now
  };

  /// Throws std::invalid_argument when cfg.validate() fails.
  master_service(master_config cfg, server_options opt)
      : opt_{std::move(opt)}, table_{std::move(cfg)}, evictor_{table_} {}

  master_service(const master_service&) = delete;
  master_service& operator=(const master_service&) = delete;

  object_table& objects() noexcept { return table_; }
  const object_table& objects() const noexcept { return table_; }
  const server_options& options() const noexcept { return opt_; }

  // ---- clients --------------------------------------------------------

  /// A connection of `instance` passed the handshake; `address` is its
  /// hello's engine address. known: the instance was alive here already.
  attachment attach_client(const instance_id& instance, std::string_view address, master_time now) {
    std::lock_guard lock{clients_mu_};
    const std::string key = to_string(instance);
    attachment a;
    auto it = by_instance_.find(key);
    std::shared_ptr<client_record> rec;
    if (it == by_instance_.end()) {
      rec = std::make_shared<client_record>();
      rec->id = next_client_++;
      rec->instance = instance;
      rec->alive.store(false);
      by_instance_.emplace(key, rec);
    } else {
      rec = it->second;
    }
    a.known = rec->alive.load();
    if (!a.known) {
      rec->alive.store(true);
      rec->suspect = false;
    }
    if (!address.empty() || !a.known) {
      rec->address = std::string(address);
      rec->host = host_of(address);
    }
    rec->last_seen_ms.store(ms(now));
    ++rec->connections;
    a.session.client = rec;
    return a;
  }

  /// A connection closed. The client stays known until its liveness timeout.
  void detach_client(session_state& s) {
    if (!s.client) return;
    std::lock_guard lock{clients_mu_};
    if (s.client->connections > 0) --s.client->connections;
    s.client.reset();
  }

  /// Marks suspects and drops gone clients (see the file comment).
  liveness_report check_liveness(master_time now) {
    liveness_report r;
    const std::int64_t t = ms(now);
    std::lock_guard lock{clients_mu_};
    for (auto& [key, rec] : by_instance_) {
      if (!rec->alive.load()) continue;
      const std::int64_t idle = t - rec->last_seen_ms.load();
      if (idle >= opt_.liveness_timeout.count()) {
        rec->alive.store(false);
        rec->suspect = false;
        const std::size_t segments = table_.unmount_client(rec->id);
        forget_segments_of(rec->id);
        ++r.gone;
        clients_gone_.fetch_add(1, std::memory_order_relaxed);
        kvlink::detail::log(
            "client {} (instance {}, {}) gone: no frame for {} ms; {} segment(s) unmounted",
            rec->id, key, rec->address.empty() ? "no address" : rec->address, idle, segments);
      } else if (idle >= opt_.suspect_after.count()) {
        if (!rec->suspect) {
          rec->suspect = true;
          ++r.suspected;
          suspect_events_.fetch_add(1, std::memory_order_relaxed);
          kvlink::detail::log(
              "client {} (instance {}) suspect: no frame for {} ms (gone after {} ms)", rec->id,
              key, idle, opt_.liveness_timeout.count());
        }
      } else {
        rec->suspect = false;
      }
    }
    return r;
  }

  /// Clients alive, and how many of them are suspect.
  std::pair<std::size_t, std::size_t> client_counts() const {
    std::lock_guard lock{clients_mu_};
    std::size_t alive = 0, suspect = 0;
    for (const auto& [key, rec] : by_instance_) {
      if (!rec->alive.load()) continue;
      ++alive;
      if (rec->suspect) ++suspect;
    }
    return {alive, suspect};
  }

  // ---- periodic work --------------------------------------------------

  reclaim_report reclaim(master_time now) {
    const reclaim_report r = table_.reclaim(now);
    reclaimed_.fetch_add(r.discarded, std::memory_order_relaxed);
    disk_given_up_.fetch_add(r.disk_tasks_given_up, std::memory_order_relaxed);
    released_bytes_.fetch_add(r.released_bytes, std::memory_order_relaxed);
    return r;
  }

  /// One eviction round when the pool is above its watermark or a put
  /// failed for space (evictor::run_once: per-shard steps, never a long lock).
  eviction_report evict(master_time now) {
    const std::int64_t t = now.time_since_epoch().count();
    const std::int64_t last = last_adoption_ms_.load(std::memory_order_relaxed);
    if (last != never && t - last < opt_.rebuild_grace.count()) return {};
    const eviction_report r = evictor_.run_once(now);
    if (r.ran) {
      eviction_rounds_.fetch_add(1, std::memory_order_relaxed);
      evicted_.fetch_add(r.evicted, std::memory_order_relaxed);
      evicted_bytes_.fetch_add(r.freed, std::memory_order_relaxed);
    }
    return r;
  }

  // ---- frames ---------------------------------------------------------

  /// The reply to one request frame of `s`'s client (its last-seen time is
  /// refreshed first). Sets `close` when the connection must be closed
  /// after the reply (a body that does not decode). Never throws on peer
  /// input (only std::bad_alloc). The reply's status: ok; invalid_argument
  /// for an unknown type (or a reply sent as a request); malformed_message
  /// for a body that does not decode; a store_errc for a whole-request
  /// failure (mount, unmount, segment_info). Batches answer per key, in
  /// the request's order, and never fail as a whole for one bad key.
  std::string handle_frame(session_state& s, const wire::frame_header& h,
                           std::span<const unsigned char> body, master_time now, bool& close) {
    close = false;
    const bool was_alive = touch(*s.client, now);
    const std::uint16_t type = h.type;
    const std::size_t slot = h.is_reply() || !wire::known_type(type) ? 0 : type;
    requests_[slot].fetch_add(1, std::memory_order_relaxed);
    if (slot == 0) {
      wire::writer w(static_cast<wire::message_type>(type & ~wire::reply_bit), h.id, true);
      w.status(errc::invalid_argument);
      return w.take();
    }
    const auto kind = static_cast<wire::message_type>(type);
    wire::reader r(body);
    wire::writer w(kind, h.id, true);
    const std::uint64_t client = s.client->id;
    std::error_code dec;
    switch (kind) {
      case wire::message_type::heartbeat:
        if (!(dec = r.finish())) {
          w.status({});
          w.u8(was_alive ? 1 : 0);
        }
        break;
      case wire::message_type::mount: {
        wire::mount_request m;
        if ((dec = m.decode(r))) break;
        segment_id id;
        wire::code_list taken;
        const std::error_code ec = mount(*s.client, m, id, taken, now);
        count_error(ec);
        w.status(ec);
        if (!ec) {
          w.u64(id.value());
          taken.encode(w);
        }
        break;
      }
      case wire::message_type::adopt: {
        wire::adopt_request a;
        if ((dec = a.decode(r))) break;
        wire::code_list taken;
        const std::error_code ec = adopt(*s.client, a, taken, now);
        count_error(ec);
        w.status(ec);
        if (!ec) taken.encode(w);
        break;
      }
      case wire::message_type::unmount: {
        const std::uint64_t id = r.u64();
        if ((dec = r.finish())) break;
        const std::error_code ec = unmount(client, segment_id{id});
        count_error(ec);
        w.status(ec);
        break;
      }
      case wire::message_type::segment_info: {
        const std::uint64_t id = r.u64();
        if ((dec = r.finish())) break;
        std::lock_guard lock{segments_mu_};
        const auto it = locations_.find(id);
        if (it == locations_.end()) {
          count_error(store_errc::segment_not_found);
          w.status(store_errc::segment_not_found);
          break;
        }
        w.status({});
        wire::segment_location loc{it->second.client, it->second.address, it->second.engine_segment,
                                   it->second.size, it->second.host};
        loc.encode(w);
        break;
      }
      case wire::message_type::put_start: {
        wire::put_start_request req;
        if ((dec = req.decode(r))) break;
        keys_[slot].fetch_add(req.keys.size(), std::memory_order_relaxed);
        std::vector<segment_id> preferred;
        preferred.reserve(req.preferred.size());
        for (const auto p : req.preferred) preferred.emplace_back(p);
        const std::string host = host_copy(*s.client);
        put_options opt;
        opt.replicas = req.replicas;
        opt.preferred = preferred;
        opt.host = host;
        opt.soft_pin = (req.flags & wire::put_start_request::flag_soft_pin) != 0;
        opt.soft_pin_ttl = std::chrono::milliseconds{req.soft_pin_ms};
        opt.hard_pin = (req.flags & wire::put_start_request::flag_hard_pin) != 0;
        wire::placement_list out;
        out.entries.resize(req.keys.size());
        replica_list where;
        for (std::size_t i = 0; i < req.keys.size(); ++i) {
          opt.parent = req.parents[i];
          const auto ec = table_.put_start(req.keys[i], req.sizes[i], client, opt, now, where);
          auto& e = out.entries[i];
          e.code = code_of(ec);
          if (ec) continue;
          e.count = static_cast<std::uint8_t>(std::min(where.size(), e.replicas.size()));
          for (std::size_t k = 0; k < e.count; ++k) {
            e.replicas[k] = {where[k].segment.value(), where[k].offset};
          }
        }
        w.status({});
        out.encode(w, false);
        break;
      }
      case wire::message_type::put_end:
      case wire::message_type::put_revoke:
      case wire::message_type::exists:
      case wire::message_type::remove: {
        wire::key_batch b;
        if ((dec = b.decode(r, kind == wire::message_type::remove))) break;
        keys_[slot].fetch_add(b.keys.size(), std::memory_order_relaxed);
        wire::code_list out;
        out.codes.resize(b.keys.size());
        for (std::size_t i = 0; i < b.keys.size(); ++i) {
          std::error_code ec;
          switch (kind) {
            case wire::message_type::put_end:
              ec = table_.put_end(b.keys[i], client, now);
              break;
            case wire::message_type::put_revoke:
              ec = table_.put_revoke(b.keys[i], client, now);
              break;
            case wire::message_type::exists:
              ec = table_.exists(b.keys[i], now);
              break;
            default:
              ec = table_.remove(b.keys[i], now, b.force);
              break;
          }
          out.codes[i] = code_of(ec);
        }
        w.status({});
        out.encode(w);
        break;
      }
      case wire::message_type::get:
      case wire::message_type::replicas: {
        wire::key_batch b;
        if ((dec = b.decode(r, false))) break;
        keys_[slot].fetch_add(b.keys.size(), std::memory_order_relaxed);
        const bool lease = kind == wire::message_type::get;
        wire::placement_list out;
        out.entries.resize(b.keys.size());
        object_info info;
        for (std::size_t i = 0; i < b.keys.size(); ++i) {
          const auto ec =
              lease ? table_.get(b.keys[i], now, info) : table_.describe(b.keys[i], info);
          auto& e = out.entries[i];
          e.code = code_of(ec);
          if (ec) continue;
          e.size = info.size;
          const auto left = (info.lease_until - now).count();
          e.lease_ms =
              lease ? static_cast<std::uint32_t>(std::clamp<std::int64_t>(left, 0, UINT32_MAX)) : 0;
          e.count = static_cast<std::uint8_t>(std::min(info.replicas.size(), e.replicas.size()));
          for (std::size_t k = 0; k < e.count; ++k) {
            e.replicas[k] = {info.replicas[k].segment.value(), info.replicas[k].offset};
          }
        }
        w.status({});
        out.encode(w, true);
        break;
      }
      case wire::message_type::remove_all: {
        const std::uint8_t force = r.u8();
        if (force > 1) r.fail();
        if ((dec = r.finish())) break;
        const std::size_t n = table_.remove_all(now, force == 1);
        w.status({});
        w.u64(n);
        break;
      }
      case wire::message_type::disk_mount: {
        const std::uint64_t capacity = r.u64();
        const std::uint8_t accepting = r.u8();
        if (accepting > 1) r.fail();
        if ((dec = r.finish())) break;
        table_.mount_disk(client, capacity, accepting == 1);
        kvlink::detail::log("client {}: disk {} ({} bytes)", client,
                            capacity == 0    ? "left the SSD tier"
                            : accepting == 1 ? "in the SSD tier"
                                             : "in the SSD tier, read only (it failed a write)",
                            capacity);
        w.status({});
        break;
      }
      case wire::message_type::disk_report: {
        wire::disk_entries req;
        if ((dec = req.decode(r, true))) break;
        keys_[slot].fetch_add(req.entries.size(), std::memory_order_relaxed);
        wire::code_list out;
        out.codes.resize(req.entries.size());
        for (std::size_t i = 0; i < req.entries.size(); ++i) {
          const auto& e = req.entries[i];
          const bool ok = e.code == 0;
          std::error_code ec;
          switch (static_cast<wire::disk_report_kind>(e.kind)) {
            case wire::disk_report_kind::adopt:
              ec = table_.disk_adopt(e.key, e.size, client);
              break;
            case wire::disk_report_kind::stored:
              ec = table_.disk_stored(e.key, client, e.segment, e.offset, ok);
              break;
            case wire::disk_report_kind::loaded:
              ec = table_.disk_loaded(e.key, client, e.segment, e.offset, ok, now);
              break;
            case wire::disk_report_kind::dropped:
              ec = table_.disk_dropped(e.key, client);
              break;
          }
          disk_reports_[e.kind - 1u].fetch_add(1, std::memory_order_relaxed);
          if (!ok) disk_failures_.fetch_add(1, std::memory_order_relaxed);
          out.codes[i] = code_of(ec);
        }
        w.status({});
        out.encode(w);
        break;
      }
      case wire::message_type::disk_task:  // the master's to send, not a client's
        w.status(errc::invalid_argument);
        break;
      case wire::message_type::stats: {
        if ((dec = r.finish())) break;
        const pool_stats p = table_.stats();
        w.status({});
        wire::stats_reply{p.capacity, p.used, p.objects, p.in_progress, p.reserved, p.segments}
            .encode(w);
        break;
      }
    }
    if (dec) {
      malformed_.fetch_add(1, std::memory_order_relaxed);
      close = true;
      wire::writer bad(kind, h.id, true);
      bad.status(dec);
      return bad.take();
    }
    return w.take();
  }

  /// The SSD tier's tasks waiting for their disk holders, as disk_task
  /// frames (id 0, at most about 1 MiB of body each) with the client each
  /// is for. The server sends them on those clients' connections; a task
  /// it cannot send is handed back (undeliverable) and ends at once.
  struct disk_frame {
    std::uint64_t client = 0;
    std::string bytes;
    std::vector<disk_task> tasks;  ///< what the frame carries
  };
  std::vector<disk_frame> take_disk_frames() {
    std::vector<disk_frame> frames;
    std::vector<disk_task> tasks;
    table_.take_disk_tasks(tasks);
    if (tasks.empty()) return frames;
    std::stable_sort(tasks.begin(), tasks.end(),
                     [](const disk_task& a, const disk_task& b) { return a.client < b.client; });
    std::size_t i = 0;
    while (i < tasks.size()) {
      const std::uint64_t client = tasks[i].client;
      wire::disk_entries body;
      std::size_t bytes = 0;
      const std::size_t from = i;
      for (; i < tasks.size() && tasks[i].client == client && bytes < (1u << 20); ++i) {
        const disk_task& t = tasks[i];
        body.entries.push_back(
            {static_cast<std::uint8_t>(t.what), t.key, t.size, t.segment, t.offset, 0});
        bytes += 27 + t.key.size();
        disk_tasks_[static_cast<std::size_t>(t.what) - 1u].fetch_add(1, std::memory_order_relaxed);
      }
      wire::writer w(wire::message_type::disk_task, 0, false);
      body.encode(w, false);
      frames.push_back({client, w.take(),
                        std::vector<disk_task>(std::make_move_iterator(tasks.begin() + from),
                                               std::make_move_iterator(tasks.begin() + i))});
    }
    return frames;
  }

  /// A frame the server could not deliver (its holder has no connection):
  /// its stores and loads end now (object_table::disk_task_undelivered),
  /// so their bytes do not hold up eviction until reclaim gives them up.
  void undeliverable(const disk_frame& f) {
    disk_unsent_.fetch_add(f.tasks.size(), std::memory_order_relaxed);
    for (const disk_task& t : f.tasks) table_.disk_task_undelivered(t);
  }

  /// The reply to a frame whose header decode_header() refused with `ec`
  /// (protocol_version_mismatch, message_too_large): same type and id, the
  /// error as its status. The connection is closed after it.
  static std::string header_refusal(const wire::frame_header& h, std::error_code ec) {
    wire::writer w(static_cast<wire::message_type>(h.type & ~wire::reply_bit), h.id, true);
    w.status(ec);
    return w.take();
  }

  // ---- observation ----------------------------------------------------

  /// Connections open, as the server counts them (for /metrics).
  std::atomic<std::int64_t>& open_connections() noexcept { return connections_; }
  std::atomic<std::uint64_t>& refused_connections() noexcept { return refused_; }
  std::atomic<std::uint64_t>& failed_handshakes() noexcept { return failed_handshakes_; }

  /// Every mounted segment, with where its bytes are served.
  nlohmann::json segments_json() const {
    nlohmann::json out = nlohmann::json::array();
    const auto all = table_.segments().stats();
    std::lock_guard lock{segments_mu_};
    for (const auto& s : all) {
      nlohmann::json j{{"id", s.id.value()},
                       {"client", s.client},
                       {"name", s.name},
                       {"host", s.host},
                       {"capacity", s.capacity},
                       {"used", s.used},
                       {"largest_free", s.largest_free},
                       {"free_ranges", s.free_ranges}};
      if (const auto it = locations_.find(s.id.value()); it != locations_.end()) {
        j["address"] = it->second.address;
        j["engine_segment"] = it->second.engine_segment;
      }
      out.push_back(std::move(j));
    }
    return out;
  }

  /// One line for people (mooncake_master's /metrics/summary): capacity
  /// and use in GiB (2^30 B), objects, segments and clients.
  std::string summary_text() const {
    const auto [alive, suspect] = client_counts();
    const pool_stats p = table_.stats();
    constexpr double gib = 1024.0 * 1024.0 * 1024.0;
    return fmt::format(
        "Storage: {:.2f} / {:.2f} GiB ({:.1f}%) | Objects: {} ({} puts in progress) | "
        "Segments: {} | Clients: {} alive, {} suspect\n",
        static_cast<double>(p.used) / gib, static_cast<double>(p.capacity) / gib,
        p.capacity ? 100.0 * static_cast<double>(p.used) / static_cast<double>(p.capacity) : 0.0,
        p.objects, p.in_progress, p.segments, alive, suspect);
  }

  /// The Prometheus text exposition of the master's state and counters.
  std::string metrics_text() const {
    std::string o;
    const auto gauge = [&o](std::string_view name, std::string_view help, std::uint64_t v) {
      fmt::format_to(std::back_inserter(o), "# HELP {0} {1}\n# TYPE {0} gauge\n{0} {2}\n", name,
                     help, v);
    };
    const auto counter = [&o](std::string_view name, std::string_view help, std::uint64_t v) {
      fmt::format_to(std::back_inserter(o), "# HELP {0} {1}\n# TYPE {0} counter\n{0} {2}\n", name,
                     help, v);
    };
    const auto [alive, suspect] = client_counts();
    const pool_stats p = table_.stats();
    gauge("kvlink_store_clients", "Clients the master knows alive.", alive);
    gauge("kvlink_store_suspect_clients", "Alive clients silent for store_suspect_after.", suspect);
    gauge("kvlink_store_connections", "Open connections (store clients and HTTP).",
          static_cast<std::uint64_t>(std::max<std::int64_t>(connections_.load(), 0)));
    gauge("kvlink_store_segments", "Mounted segments.", p.segments);
    gauge("kvlink_store_capacity_bytes", "Bytes of all mounted segments.", p.capacity);
    gauge("kvlink_store_used_bytes", "Bytes allocated in the segments.", p.used);
    gauge("kvlink_store_reserved_bytes", "Bytes of discarded puts not yet reused.", p.reserved);
    gauge("kvlink_store_objects", "Objects, puts in progress included.", p.objects);
    gauge("kvlink_store_puts_in_progress", "Puts started and not ended.", p.in_progress);
    o += "# HELP kvlink_store_requests_total Requests by type.\n";
    o += "# TYPE kvlink_store_requests_total counter\n";
    for (std::uint16_t t = 0; t <= wire::last_type; ++t) {
      fmt::format_to(std::back_inserter(o), "kvlink_store_requests_total{{type=\"{}\"}} {}\n",
                     t == 0 ? "unknown" : wire::to_string(static_cast<wire::message_type>(t)),
                     requests_[t].load(std::memory_order_relaxed));
    }
    o += "# HELP kvlink_store_keys_total Keys in batch requests by type.\n";
    o += "# TYPE kvlink_store_keys_total counter\n";
    for (const std::uint16_t t : std::initializer_list<std::uint16_t>{5, 6, 7, 8, 9, 10, 13}) {
      fmt::format_to(std::back_inserter(o), "kvlink_store_keys_total{{type=\"{}\"}} {}\n",
                     wire::to_string(static_cast<wire::message_type>(t)),
                     keys_[t].load(std::memory_order_relaxed));
    }
    o += "# HELP kvlink_store_errors_total Per-key and per-request errors by store code.\n";
    o += "# TYPE kvlink_store_errors_total counter\n";
    for (std::size_t i = 0; i < error_codes.size(); ++i) {
      fmt::format_to(std::back_inserter(o), "kvlink_store_errors_total{{code=\"{}\"}} {}\n",
                     error_codes[i].name, errors_[i].load(std::memory_order_relaxed));
    }
    counter("kvlink_store_malformed_frames_total", "Frames whose body did not decode.",
            malformed_.load());
    counter("kvlink_store_refused_connections_total", "Connections refused at max_connections.",
            refused_.load());
    counter("kvlink_store_failed_handshakes_total", "Handshakes that failed or timed out.",
            failed_handshakes_.load());
    counter("kvlink_store_eviction_rounds_total", "Eviction rounds that ran.",
            eviction_rounds_.load());
    counter("kvlink_store_evicted_objects_total", "Objects evicted.", evicted_.load());
    counter("kvlink_store_evicted_bytes_total", "Bytes freed by eviction.", evicted_bytes_.load());
    counter("kvlink_store_reclaimed_puts_total", "Puts discarded for never ending.",
            reclaimed_.load());
    counter("kvlink_store_released_bytes_total", "Bytes of discarded puts reused.",
            released_bytes_.load());
    counter("kvlink_store_adopted_objects_total",
            "Objects taken back from their owners' records at a mount (a master that came up "
            "empty).",
            adopted_.load());
    counter("kvlink_store_suspect_events_total", "Times a client became suspect.",
            suspect_events_.load());
    counter("kvlink_store_clients_gone_total", "Clients declared gone.", clients_gone_.load());
    gauge("kvlink_store_disks", "Clients with a disk in the SSD tier.", p.disks);
    gauge("kvlink_store_disks_accepting", "Disks eviction may send objects to (not failed).",
          p.disks_accepting);
    gauge("kvlink_store_disk_replicas", "Objects' replicas on clients' disks.", p.disk_replicas);
    gauge("kvlink_store_demoting_bytes", "Bytes being copied to disks by eviction.",
          table_.demoting_bytes());
    o += "# HELP kvlink_store_disk_tasks_total Tasks sent to disk holders by kind.\n";
    o += "# TYPE kvlink_store_disk_tasks_total counter\n";
    for (std::size_t k = 0; k < disk_tasks_.size(); ++k) {
      fmt::format_to(std::back_inserter(o), "kvlink_store_disk_tasks_total{{kind=\"{}\"}} {}\n",
                     std::array{"store", "load", "drop"}[k], disk_tasks_[k].load());
    }
    o += "# HELP kvlink_store_disk_reports_total Disk holders' reports by kind.\n";
    o += "# TYPE kvlink_store_disk_reports_total counter\n";
    for (std::size_t k = 0; k < disk_reports_.size(); ++k) {
      fmt::format_to(std::back_inserter(o), "kvlink_store_disk_reports_total{{kind=\"{}\"}} {}\n",
                     std::array{"adopt", "stored", "loaded", "dropped"}[k],
                     disk_reports_[k].load());
    }
    counter("kvlink_store_disk_failures_total", "Stores and loads their holders reported failed.",
            disk_failures_.load());
    counter("kvlink_store_disk_tasks_unsent_total",
            "Disk tasks dropped: their holder had no connection.", disk_unsent_.load());
    counter("kvlink_store_disk_tasks_given_up_total",
            "Stores and loads never reported within store_put_discard_timeout.",
            disk_given_up_.load());
    return o;
  }

 private:
  struct location {
    std::uint64_t client = 0;
    std::string address;
    std::uint64_t engine_segment = 0;
    std::uint64_t size = 0;
    std::string host;
  };

  struct error_name {
    store_errc code;
    std::string_view name;
  };
  static constexpr std::array<error_name, 20> error_codes{{
      {store_errc::internal_error, "internal_error"},
      {store_errc::buffer_overflow, "buffer_overflow"},
      {store_errc::segment_not_found, "segment_not_found"},
      {store_errc::segment_already_exists, "segment_already_exists"},
      {store_errc::client_not_found, "client_not_found"},
      {store_errc::no_space, "no_space"},
      {store_errc::invalid_key, "invalid_key"},
      {store_errc::invalid_params, "invalid_params"},
      {store_errc::illegal_client, "illegal_client"},
      {store_errc::object_in_progress, "object_in_progress"},
      {store_errc::object_not_found, "object_not_found"},
      {store_errc::object_already_exists, "object_already_exists"},
      {store_errc::object_has_lease, "object_has_lease"},
      {store_errc::lease_expired, "lease_expired"},
      {store_errc::transfer_failed, "transfer_failed"},
      {store_errc::checksum_mismatch, "checksum_mismatch"},
      {store_errc::rpc_failed, "rpc_failed"},
      {store_errc::rpc_timeout, "rpc_timeout"},
      {store_errc::object_hard_pinned, "object_hard_pinned"},
      {store_errc::object_loading, "object_loading"},
  }};

  static std::int64_t ms(master_time t) noexcept { return t.time_since_epoch().count(); }

  void count_error(std::error_code ec) noexcept {
    if (!ec || ec.category() != store_error_category()) return;
    for (std::size_t i = 0; i < error_codes.size(); ++i) {
      if (static_cast<int>(error_codes[i].code) == ec.value()) {
        errors_[i].fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
  }

  // A per-key code: 0, or a store_errc value (internal_error for anything else).
  std::uint32_t code_of(std::error_code ec) noexcept {
    if (!ec) return 0;
    if (ec.category() != store_error_category()) ec = store_errc::internal_error;
    count_error(ec);
    return static_cast<std::uint32_t>(ec.value());
  }

  // Refreshes the client's last-seen time; takes back a gone client.
  // Whether it was alive before.
  bool touch(client_record& c, master_time now) {
    c.last_seen_ms.store(ms(now));
    if (c.alive.load()) return true;
    std::lock_guard lock{clients_mu_};
    if (c.alive.load()) return true;
    c.alive.store(true);
    c.suspect = false;
    kvlink::detail::log(
        "client {} (instance {}) is back after it was declared gone: it must remount", c.id,
        to_string(c.instance));
    return false;
  }

  std::string host_copy(const client_record& c) const {
    std::lock_guard lock{clients_mu_};
    return c.host;
  }

  // Under clients_mu_ so that a client declared gone meanwhile mounts nothing.
  // The objects the owner found in the segment (this master came up empty,
  // or forgot the client) are taken back before anything is allocated in
  // it; one code per object in `taken`.
  std::error_code mount(const client_record& c, const wire::mount_request& m, segment_id& out,
                        wire::code_list& taken, master_time now) {
    std::lock_guard lock{clients_mu_};
    if (c.address.empty()) return store_errc::invalid_params;  // nobody could reach its bytes
    segment_desc d{c.id, std::string(m.name), m.size, c.host};
    if (auto ec = table_.mount_segment(d, out, m.objects.empty() && m.open)) return ec;
    take_back(c, out, m.objects, m.open, taken, now);
    std::lock_guard seg{segments_mu_};
    locations_[out.value()] = location{c.id, c.address, m.engine_segment, m.size, c.host};
    return {};
  }

  // More objects of a segment this client mounted closed; segment_not_found,
  // illegal_client (another's), invalid_params (it is open already: its
  // space may be handed out, so nothing found in it can be trusted now).
  std::error_code adopt(const client_record& c, const wire::adopt_request& a,
                        wire::code_list& taken, master_time now) {
    std::lock_guard lock{clients_mu_};
    {
      std::lock_guard seg{segments_mu_};
      const auto it = locations_.find(a.segment);
      if (it == locations_.end()) return store_errc::segment_not_found;
      if (it->second.client != c.id) return store_errc::illegal_client;
    }
    if (table_.segments().is_open(segment_id{a.segment})) return store_errc::invalid_params;
    take_back(c, segment_id{a.segment}, a.objects, a.open, taken, now);
    return {};
  }

  // Adopts `objects` into a closed segment, then opens it when `open`.
  void take_back(const client_record& c, segment_id seg,
                 const std::vector<wire::mount_request::found>& objects, bool open,
                 wire::code_list& taken, master_time now) {
    taken.codes.resize(objects.size());
    std::uint64_t adopted = 0;
    for (std::size_t i = 0; i < objects.size(); ++i) {
      const auto& o = objects[i];
      const auto ec = table_.adopt(seg, o.key, o.offset, o.size);
      taken.codes[i] = code_of(ec);
      adopted += ec ? 0 : 1;
    }
    if (open) table_.segments().open(seg);
    if (objects.empty()) return;
    adopted_.fetch_add(adopted, std::memory_order_relaxed);
    last_adoption_ms_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    kvlink::detail::log(
        "store master: client {} announced {} object(s) of segment {}: {} taken "
        "back{}",
        c.id, objects.size(), seg.value(), adopted,
        open ? "" : " (more to come: the segment stays closed)");
  }

  std::error_code unmount(std::uint64_t client, segment_id id) {
    {
      std::lock_guard lock{segments_mu_};
      const auto it = locations_.find(id.value());
      if (it == locations_.end()) return store_errc::segment_not_found;
      if (it->second.client != client) return store_errc::illegal_client;
      locations_.erase(it);
    }
    return table_.unmount_segment(id);
  }

  void forget_segments_of(std::uint64_t client) {
    std::lock_guard lock{segments_mu_};
    std::erase_if(locations_, [&](const auto& kv) { return kv.second.client == client; });
  }

  const server_options opt_;
  object_table table_;
  evictor evictor_;

  mutable std::mutex clients_mu_;
  std::unordered_map<std::string, std::shared_ptr<client_record>> by_instance_;  // clients_mu_
  std::uint64_t next_client_ = 1;                                                // clients_mu_

  mutable std::mutex segments_mu_;
  std::map<std::uint64_t, location> locations_;  // segment id -> owner; segments_mu_

  std::array<std::atomic<std::uint64_t>, wire::last_type + 1> requests_{};  // [0]: unknown types
  std::array<std::atomic<std::uint64_t>, wire::last_type + 1> keys_{};
  std::array<std::atomic<std::uint64_t>, error_codes.size()> errors_{};
  std::array<std::atomic<std::uint64_t>, 3> disk_tasks_{};    // by disk_task::kind - 1
  std::array<std::atomic<std::uint64_t>, 4> disk_reports_{};  // by disk_report_kind - 1
  std::atomic<std::uint64_t> disk_failures_{0};
  std::atomic<std::uint64_t> disk_unsent_{0};
  std::atomic<std::uint64_t> disk_given_up_{0};
  std::atomic<std::uint64_t> malformed_{0}, refused_{0}, failed_handshakes_{0};
  std::atomic<std::uint64_t> eviction_rounds_{0}, evicted_{0}, evicted_bytes_{0};
  std::atomic<std::uint64_t> reclaimed_{0}, released_bytes_{0};
  std::atomic<std::uint64_t> adopted_{0};  // objects taken back from owners' records
  static constexpr std::int64_t never = INT64_MIN;
  std::atomic<std::int64_t> last_adoption_ms_{never};  // master_time of the last such mount
  std::atomic<std::uint64_t> suspect_events_{0}, clients_gone_{0};
  std::atomic<std::int64_t> connections_{0};
};

}  // namespace kvlink::store
