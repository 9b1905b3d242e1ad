// kvlink-master: the store master as a program (include/kvlink/store/master/server.hpp).
//
//   kvlink-master --listen 0.0.0.0:50051 --http 0.0.0.0:8080 --config master.json
//                 --threads 4 --auth-secret-file /etc/kvlink/secret   (one line)
//
// Settings come from, in increasing precedence: the defaults, --config (a
// JSON object of settings), KVLINK_STORE_* environment variables, and the
// flags above. `kvlink-master --help` lists every setting. When it is ready
// it prints one line, "kvlink-master: listening on ADDR (http ADDR|off)", to
// stdout; SIGINT or SIGTERM closes it cleanly (exit 0).
#include <kvlink/core/settings.hpp>
#include <kvlink/store/master/server.hpp>

#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <asio/io_context.hpp>
#include <asio/signal_set.hpp>
#include <nlohmann/json.hpp>

namespace {

namespace store = kvlink::store;

int fail(const std::string& what) {
  std::cerr << "kvlink-master: " << what << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const auto table = store::master_server_setting_table();
  store::master_server_config cfg;

  std::string listen, http, config_file, secret_file;
  unsigned threads = 0;
  CLI::App app{
      "kvlink-master: the kvlink store's master (object metadata and space "
      "allocation; clients move the bytes)"};
  app.add_option("--listen", listen, "where store clients connect, host:port (store_listen)");
  app.add_option("--http", http,
                 "HTTP endpoint for /health /metrics /segments (store_http_listen)");
  app.add_option("--config", config_file, "JSON file with settings (see below)");
  app.add_option("--threads", threads, "I/O threads (default: hardware threads, at least 2)");
  app.add_option("--auth-secret-file", secret_file,
                 "file holding the shared secret (store_auth_secret_file)");
  app.footer("Settings (JSON key in --config, environment variable, default):\n" +
             kvlink::describe_settings<store::master_server_config>(table, cfg));
  CLI11_PARSE(app, argc, argv);

  std::string what;
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
  if (!listen.empty()) cfg.server.listen = listen;
  if (!http.empty()) cfg.server.http_listen = http;
  if (!secret_file.empty()) {
    cfg.server.auth_secret_file = secret_file;
    cfg.server.auth_secret.clear();
  }
  if (cfg.store.validate()) return fail("invalid store settings (see --help for their ranges)");
  if (cfg.server.validate(&what)) return fail(what);
  if (threads == 0) threads = std::max(2u, std::thread::hardware_concurrency());

  try {
    asio::io_context io{static_cast<int>(threads)};
    store::master_server master{io.get_executor(), cfg.store, cfg.server};
    master.listen();
    asio::signal_set signals{io, SIGINT, SIGTERM};
    signals.async_wait([&master](std::error_code ec, int) {
      if (ec) return;
      master.async_close([] {});
    });
    std::printf("kvlink-master: listening on %s (http %s)\n", master.local_address().c_str(),
                master.http_address().empty() ? "off" : master.http_address().c_str());
    std::fflush(stdout);
    std::vector<std::thread> pool;
    for (unsigned i = 1; i < threads; ++i) pool.emplace_back([&io] { io.run(); });
    io.run();
    for (auto& t : pool) t.join();
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  return 0;
}
