// kvlink-master: the store master as a program (include/kvlink/store/master/server.hpp).
//
//   kvlink-master --listen 0.0.0.0:50051 --http 0.0.0.0:8080 --config master.json
//                 --threads 4 --auth-secret-file /etc/kvlink/secret
//                 --metadata-listen 0.0.0.0:8090                      (one line)
//
// Settings come from, in increasing precedence: the defaults, --config (a
// JSON object of settings), KVLINK_STORE_* environment variables, and the
// flags above. `kvlink-master --help` lists every setting. When it is ready
// it prints one line, "kvlink-master: listening on ADDR (http ADDR|off)", to
// stdout, after "kvlink-master: metadata server on http://ADDR/metadata"
// when that is on; SIGINT or SIGTERM closes it cleanly (exit 0).
//
// mooncake_master's flag names are accepted too, with its units, for what
// kvlink's master does (a deployment's command line carries over):
//   --port / --rpc_port N, --rpc_address H   -> store_listen H:N
//   --metrics_port N                         -> store_http_listen 0.0.0.0:N
//   --rpc_thread_num / --max_threads N       -> --threads
//   --default_kv_lease_ttl, --default_kv_soft_pin_ttl, --max_kv_soft_pin_ttl
//                  (milliseconds, or with a unit: 500ms, 5s, 30m, 1h)
//   --client_ttl S (seconds)                 -> store_liveness_timeout
//   --eviction_high_watermark_ratio R, --eviction_ratio R (0..1) -> percents
//   --allow_evict_soft_pinned_objects B      -> store_evict_soft_pinned
//   --put_start_discard_timeout_sec S, --put_start_release_timeout_sec S
//   --config_path F                          -> --config (JSON only)
//   --enable_http_metadata_server[=B], --http_metadata_server_host H,
//   --http_metadata_server_port N (0.0.0.0, 8080) -> store_metadata_listen H:N
//   --enable_ha, --etcd_endpoints "h:2379;h:2379" (or --ha_backend_type etcd
//   --ha_backend_connstring ...), --cluster_id C  -> store_ha_etcd, store_ha_cluster
// --print-settings prints the settings in effect and exits.
//
// Several masters for one pool (store_ha_etcd, --ha-etcd): each binds its
// address, prints "kvlink-master: standing for election in cluster C as
// ADDR", and the one elected (store/master/election.hpp) prints
// "kvlink-master: leading cluster C; listening on ADDR (http ADDR|off)" and
// serves. Clients name etcd instead of a master ("etcd://h:2379"). A leader
// that loses the leadership (etcd unreachable for half the lease, its key
// gone) stops serving and exits with status 3; a supervisor starts it again
// as a standby. SIGINT or SIGTERM on the leader hands over at once (its
// lease revoked).
#include <kvlink/core/settings.hpp>
#include <kvlink/store/master/election.hpp>
#include <kvlink/store/master/server.hpp>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/address.hpp>
#include <asio/signal_set.hpp>
#include <nlohmann/json.hpp>

namespace {

namespace store = kvlink::store;

int fail(const std::string& what) {
  std::cerr << "kvlink-master: " << what << "\n";
  return 2;
}

// gflags-style durations: milliseconds, or a number with a unit (ms, s, m, h).
std::optional<std::chrono::milliseconds> parse_duration(const std::string& text) {
  std::int64_t n = 0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, n);
  if (ec != std::errc{} || n < 0) return std::nullopt;
  const std::string_view unit(p, static_cast<std::size_t>(end - p));
  std::int64_t scale = 0;
  if (unit.empty() || unit == "ms") scale = 1;
  if (unit == "s") scale = 1000;
  if (unit == "m") scale = 60'000;
  if (unit == "h") scale = 3'600'000;
  if (scale == 0 || n > INT64_MAX / scale) return std::nullopt;
  return std::chrono::milliseconds{n * scale};
}

// A ratio in [0, 1] as a whole percent.
std::optional<std::uint32_t> ratio_percent(double r) {
  if (!(r >= 0.0 && r <= 1.0)) return std::nullopt;
  return static_cast<std::uint32_t>(std::lround(r * 100.0));
}

// mooncake_master's flags, each set only when given.
struct mooncake_flags {
  std::optional<unsigned> port, metrics_port, threads;
  std::string rpc_address = "0.0.0.0";
  std::optional<std::string> lease_ttl, soft_pin_ttl, max_soft_pin_ttl;
  std::optional<std::uint64_t> client_ttl_s, discard_s, release_s;
  std::optional<double> high_watermark, eviction_ratio;
  std::optional<bool> evict_soft_pinned;
  bool metadata_server = false;
  std::string metadata_host = "0.0.0.0";
  unsigned metadata_port = 8080;
  bool enable_ha = false;
  std::string etcd_endpoints, ha_backend_type = "etcd", ha_connstring;
  std::optional<std::string> cluster_id;

  void add_to(CLI::App& app) {
    auto* g = app.add_option_group("mooncake_master's flags",
                                   "the same settings under mooncake_master's names and units");
    g->add_option("--port,--rpc_port", port, "store clients' port on --rpc_address (50051)");
    g->add_option("--rpc_address", rpc_address, "address the port is on (0.0.0.0)");
    g->add_option("--metrics_port", metrics_port, "HTTP /health /metrics /segments on 0.0.0.0:N");
    g->add_option("--rpc_thread_num,--max_threads", threads, "I/O threads (as --threads)");
    g->add_option("--default_kv_lease_ttl", lease_ttl, "read lease: ms, or 5s, 30m, ...");
    g->add_option("--default_kv_soft_pin_ttl", soft_pin_ttl, "soft pin time: ms, or 30m, ...");
    g->add_option("--max_kv_soft_pin_ttl", max_soft_pin_ttl, "longest soft pin: ms, or 24h, ...");
    g->add_option("--client_ttl", client_ttl_s, "seconds a silent client keeps its segments");
    g->add_option("--eviction_high_watermark_ratio", high_watermark, "eviction starts (0.90)");
    g->add_option("--eviction_ratio", eviction_ratio, "share one eviction round frees (0.05)");
    g->add_option("--allow_evict_soft_pinned_objects", evict_soft_pinned,
                  "evict soft-pinned objects when nothing else is left (true)");
    g->add_option("--put_start_discard_timeout_sec", discard_s, "unfinished puts discarded (30)");
    g->add_option("--put_start_release_timeout_sec", release_s, "their space reused (600)");
    g->add_flag("--enable_http_metadata_server", metadata_server,
                "serve Mooncake's HTTP metadata protocol (store_metadata_listen)");
    g->add_option("--http_metadata_server_host", metadata_host, "its address (0.0.0.0)");
    g->add_option("--http_metadata_server_port", metadata_port, "its port (8080)");
    g->add_flag("--enable_ha", enable_ha, "stand for election through etcd (store_ha_etcd)");
    g->add_option("--etcd_endpoints", etcd_endpoints, "etcd for --enable_ha: h:2379;h:2379");
    g->add_option("--ha_backend_type", ha_backend_type, "etcd (the only one kvlink has)");
    g->add_option("--ha_backend_connstring", ha_connstring, "as --etcd_endpoints");
    g->add_option("--cluster_id", cluster_id, "store_ha_cluster (mooncake_cluster)");
  }

  // Applies what was given onto cfg and *threads; "" or what is wrong.
  std::string apply(store::master_server_config& cfg, unsigned* threads_out) const {
    if (port) {
      if (*port > 65535) return "--port: " + std::to_string(*port) + " is not a port";
      cfg.server.listen = rpc_address + ":" + std::to_string(*port);
    }
    if (metrics_port) {
      if (*metrics_port > 65535) return "--metrics_port: not a port";
      cfg.server.http_listen = "0.0.0.0:" + std::to_string(*metrics_port);
    }
    if (threads) *threads_out = *threads;
    if (metadata_server) {
      if (metadata_port > 65535) return "--http_metadata_server_port: not a port";
      cfg.server.metadata_listen = metadata_host + ":" + std::to_string(metadata_port);
    }
    const std::pair<const std::optional<std::string>*, std::chrono::milliseconds*> durations[] = {
        {&lease_ttl, &cfg.store.lease_ttl},
        {&soft_pin_ttl, &cfg.store.soft_pin_ttl},
        {&max_soft_pin_ttl, &cfg.store.max_soft_pin_ttl}};
    for (const auto& [text, out] : durations) {
      if (!*text) continue;
      const auto d = parse_duration(**text);
      if (!d) return "\"" + **text + "\" is not a duration (ms, or a number with ms, s, m or h)";
      *out = *d;
    }
    if (client_ttl_s) {
      cfg.server.liveness_timeout = std::chrono::seconds{*client_ttl_s};
      // kvlink calls a client suspect before it is gone (Mooncake has no
      // such state): keep that moment before the end.
      if (cfg.server.suspect_after >= cfg.server.liveness_timeout) {
        cfg.server.suspect_after = cfg.server.liveness_timeout / 2;
      }
      if (cfg.server.heartbeat_interval >= cfg.server.suspect_after) {
        cfg.server.heartbeat_interval = cfg.server.suspect_after / 2;
      }
    }
    if (high_watermark) {
      const auto p = ratio_percent(*high_watermark);
      if (!p) return "--eviction_high_watermark_ratio: a ratio between 0 and 1";
      cfg.store.eviction_high_watermark = *p;
    }
    if (eviction_ratio) {
      const auto p = ratio_percent(*eviction_ratio);
      if (!p) return "--eviction_ratio: a ratio between 0 and 1";
      cfg.store.eviction_share = *p;
    }
    if (evict_soft_pinned) cfg.store.evict_soft_pinned = *evict_soft_pinned;
    if (enable_ha) {
      if (ha_backend_type != "etcd") {
        return "--ha_backend_type " + ha_backend_type + ": kvlink elects masters through etcd only";
      }
      const std::string& where = ha_connstring.empty() ? etcd_endpoints : ha_connstring;
      if (where.empty()) return "--enable_ha needs --etcd_endpoints (or --ha_backend_connstring)";
      cfg.server.ha_etcd = where;
    }
    if (cluster_id) cfg.server.ha_cluster = *cluster_id;
    if (discard_s) cfg.store.put_discard_timeout = std::chrono::seconds{*discard_s};
    if (release_s) cfg.store.put_release_timeout = std::chrono::seconds{*release_s};
    return {};
  }
};

}  // namespace

int main(int argc, char** argv) {
  const auto table = store::master_server_setting_table();
  store::master_server_config cfg;

  std::string listen, http, metadata, config_file, secret_file;
  unsigned threads = 0;
  CLI::App app{
      "kvlink-master: the kvlink store's master (object metadata and space "
      "allocation; clients move the bytes)"};
  app.add_option("--listen", listen, "where store clients connect, host:port (store_listen)");
  app.add_option("--http", http,
                 "HTTP endpoint for /health /metrics /segments (store_http_listen)");
  app.add_option("--metadata-listen", metadata,
                 "metadata server for engines (http://ADDR/metadata), host:port "
                 "(store_metadata_listen)");
  app.add_option("--config", config_file, "JSON file with settings (see below)");
  app.add_option("--threads", threads, "I/O threads (default: hardware threads, at least 2)");
  app.add_option("--auth-secret-file", secret_file,
                 "file holding the shared secret (store_auth_secret_file)");
  std::string ha_etcd;
  app.add_option("--ha-etcd", ha_etcd,
                 "stand for election among masters through etcd, etcd://host:2379[,host:2379] "
                 "(store_ha_etcd)");
  bool print_settings = false;
  app.add_flag("--print-settings", print_settings, "print the settings in effect and exit");
  mooncake_flags mc;
  mc.add_to(app);
  auto* config_path = app.get_option("--config");
  app.add_option("--config_path", config_file, "as --config (mooncake_master's name; JSON)")
      ->excludes(config_path);
  app.footer("Settings (JSON key in --config, environment variable, default):\n" +
             kvlink::describe_settings<store::master_server_config>(table, cfg));
  CLI11_PARSE(app, argc, argv);

  std::string what;
  // Mooncake's master and clients take the cluster from here too.
  cfg.server.ha_cluster = store::wire::cluster_or_default({});
  if (!config_file.empty()) {
    std::ifstream in(config_file);
    if (!in) return fail("cannot read --config " + config_file);
    const auto j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded()) return fail(config_file + ": not JSON");
    if (kvlink::apply_json<store::master_server_config>(table, j, cfg, &what)) {
      return fail(config_file + ": " + what);
    }
  }
  if (kvlink::apply_env<store::master_server_config>(table, cfg, kvlink::default_getenv, &what)) {
    return fail(what);
  }
  if (!listen.empty() && mc.port) return fail("--listen and --port/--rpc_port: give one");
  if (!http.empty() && mc.metrics_port) return fail("--http and --metrics_port: give one");
  if (!metadata.empty() && mc.metadata_server) {
    return fail("--metadata-listen and --enable_http_metadata_server: give one");
  }
  if (const auto why = mc.apply(cfg, &threads); !why.empty()) return fail(why);
  if (!metadata.empty()) cfg.server.metadata_listen = metadata;
  if (!listen.empty()) cfg.server.listen = listen;
  if (!http.empty()) cfg.server.http_listen = http;
  if (!ha_etcd.empty()) cfg.server.ha_etcd = ha_etcd;
  if (!secret_file.empty()) {
    cfg.server.auth_secret_file = secret_file;
    cfg.server.auth_secret.clear();
  }
  if (cfg.store.validate()) return fail("invalid store settings (see --help for their ranges)");
  if (cfg.server.validate(&what)) return fail(what);
  if (threads == 0) threads = std::max(2u, std::thread::hardware_concurrency());
  if (print_settings) {
    std::cout << kvlink::describe_settings<store::master_server_config>(table, cfg) << "threads "
              << threads << "\n";
    return 0;
  }

  std::atomic<int> status{0};
  try {
    asio::io_context io{static_cast<int>(threads)};
    store::master_server master{io.get_executor(), cfg.store, cfg.server};
    asio::signal_set signals{io, SIGINT, SIGTERM};
    const auto announce = [&master](const std::string& lead) {
      if (!master.metadata_address().empty()) {
        std::printf("kvlink-master: metadata server on http://%s/metadata\n",
                    master.metadata_address().c_str());
      }
      std::printf("kvlink-master: %slistening on %s (http %s)\n", lead.c_str(),
                  master.local_address().c_str(),
                  master.http_address().empty() ? "off" : master.http_address().c_str());
      std::fflush(stdout);
    };
    std::shared_ptr<store::leader_election> election;
    if (cfg.server.ha_etcd.empty()) {
      master.listen();
      signals.async_wait([&master](std::error_code ec, int) {
        if (ec) return;
        master.async_close([] {});
      });
      announce("");
    } else {
      master.bind();
      store::leader_election::options eo;
      store::wire::parse_etcd_endpoints(cfg.server.ha_etcd, eo.endpoints);
      eo.cluster = cfg.server.ha_cluster;
      eo.ttl = cfg.server.ha_leader_ttl;
      eo.address =
          cfg.server.ha_advertise.empty() ? master.local_address() : cfg.server.ha_advertise;
      std::string_view host;
      std::uint16_t port = 0;
      kvlink::split_host_port(eo.address, host, port);
      std::error_code not_ip;
      const auto ip = asio::ip::make_address(std::string(host), not_ip);
      if (host.empty() || (!not_ip && ip.is_unspecified())) {
        return fail("store_listen " + master.local_address() +
                    " is a wildcard: give store_ha_advertise (--config) or "
                    "KVLINK_STORE_HA_ADVERTISE, the address clients dial");
      }
      election = std::make_shared<store::leader_election>(io.get_executor(), eo);
      std::printf("kvlink-master: standing for election in cluster %s as %s\n", eo.cluster.c_str(),
                  eo.address.c_str());
      std::fflush(stdout);
      const std::string cluster = eo.cluster;
      election->start(
          [&master, &announce, cluster] {
            master.serve();
            announce("leading cluster " + cluster + "; ");
          },
          [&master, &signals, &status, election](std::string why) {
            std::fprintf(stderr,
                         "kvlink-master: lost the leadership (%s); closing, exit "
                         "status 3\n",
                         why.c_str());
            status = 3;
            std::error_code ignored;
            signals.cancel(ignored);
            master.async_close([election] { election->resign([] {}); });
          });
      signals.async_wait([&master, election](std::error_code ec, int) {
        if (ec) return;
        // Stop serving first, then let a standby take over at once.
        master.async_close([election] { election->resign([] {}); });
      });
    }
    std::vector<std::thread> pool;
    for (unsigned i = 1; i < threads; ++i) pool.emplace_back([&io] { io.run(); });
    io.run();
    for (auto& t : pool) t.join();
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  return status.load();
}
