#include <kvlink/engine/config.hpp>

#include <cctype>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <system_error>

#include <doctest/doctest.h>

using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

std::string upper(std::string_view s) {
  std::string out{s};
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

// A getenv backed by a map, for config_from_env.
struct fake_env {
  std::map<std::string, std::string> vars;
  const char* operator()(const char* name) const {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  }
};

// A config that differs from the defaults in every setting.
kvlink::config all_changed() {
  kvlink::config c;
  c.listen = "[::1]:17001";
  c.transports = "rdma,tcp";
  c.advertise = "10.0.0.5:17001";
  c.handshake_timeout = 700ms;
  c.checksums = true;
  c.max_notification_bytes = 1 << 20;
  c.max_control_buffer = 8 << 20;
  c.max_connections = 100;
  c.max_connections_per_address = 10;
  c.auth_secret = "s3cret";  // (auth_secret_file: see below, one of the two at a time)
  c.tcp.lanes = 7;
  c.tcp.vector_pieces = 16;
  c.slice_size = 2 << 20;
  c.min_chunk = 128 << 10;
  c.alignment = 4096;
  c.tcp.max_inflight_per_lane = 9;
  c.tcp.socket_buffer = 0;
  c.tcp.nodelay = false;
  c.transfer_deadline = 0ms;
  c.connect_timeout = 1500ms;
  c.fence_timeout = 10ms;
  c.max_control_message = 3 << 20;
  c.tcp.max_frame_payload = 16 << 20;
  c.max_notification = 100;
  c.allow_tcp_fallback = false;
  c.rdma.devices = "mlx5_0,mlx5_1";
  c.rdma.gid_index = 3;
  c.rdma.qps_per_endpoint = 4;
  c.rdma.max_wr = 1024;
  c.rdma.chain = 4;
  c.shm.lanes = 5;
  c.device.runtime = "emulated";
  c.device.staging_chunk = 4 << 20;
  c.device.staging_bytes = 64 << 20;
  c.shm.max_copy = 1 << 20;
  c.shm.prefault = 0;
  c.shm.ring_max = 0;
  c.name = "decode-3";
  c.metadata.url = "etcd://10.0.0.1:2379,10.0.0.2:2379";
  c.metadata.prefix = "cluster-a/engines/";
  c.metadata.lease_ttl = 5000ms;
  c.metadata.poll_interval = 250ms;
  c.metadata.timeout = 1500ms;
  c.metadata.user = "kvlink";
  c.metadata.password = "pw";  // (metadata_password_file: see below)
  c.metadata.token = "t0ken";
  c.metadata.tls_ca = "/etc/kvlink/ca.pem";
  c.metadata.tls_cert = "/etc/kvlink/client.pem";
  c.metadata.tls_key = "/etc/kvlink/client-key.pem";
  return c;
}

}  // namespace

TEST_CASE("config table has one consistent row per config field") {
  const auto table = kvlink::config_table();
  const json j = kvlink::to_json(kvlink::config{});
  CHECK(j.size() == table.size());
  CHECK(table.size() == 51);  // settings of kvlink::config and its sections

  std::set<std::string_view> names, envs;
  for (const auto& s : table) {
    CAPTURE(s.name);
    CHECK(names.insert(s.name).second);
    CHECK(envs.insert(s.env).second);
    CHECK(s.env == "KVLINK_" + upper(s.name));
    CHECK(s.env.data()[s.env.size()] == '\0');  // passed to getenv as a C string
    CHECK(s.unit == kvlink::unit_of(s.kind));
    CHECK_FALSE(s.doc.empty());
    CHECK(j.contains(std::string{s.name}));
    CHECK(kvlink::find_setting(s.name) == &s);
  }
  CHECK(kvlink::find_setting("nope") == nullptr);
  // Each component's rows, in order: the engine's, then each transport's.
  CHECK(kvlink::find_setting("listen")->component == "engine");
  CHECK(kvlink::find_setting("tcp_lanes")->component == "tcp");
  CHECK(kvlink::find_setting("max_frame_payload")->component == "tcp");
  CHECK(kvlink::find_setting("rdma_max_wr")->component == "rdma");
  CHECK(kvlink::find_setting("metadata")->component == "metadata");
  CHECK(kvlink::find_setting("metadata_lease_ttl")->component == "metadata");

  // Every field is reachable through the table: changing each one changes
  // exactly the JSON of its own row.
  const kvlink::config changed = all_changed();
  const json jc = kvlink::to_json(changed);
  kvlink::config with_file;
  with_file.auth_secret_file = "/run/secrets/kvlink";
  with_file.metadata.password_file = "/run/secrets/etcd";
  const json jf = kvlink::to_json(with_file);
  for (const auto& s : table) {
    CAPTURE(s.name);
    const auto& changed_json =
        s.name == "auth_secret_file" || s.name == "metadata_password_file" ? jf : jc;
    CHECK(changed_json.at(std::string{s.name}) != j.at(std::string{s.name}));
  }
}

TEST_CASE("secrets are never printed, and one source of the secret at a time") {
  kvlink::config c;
  c.auth_secret = "hunter2";
  const auto text = kvlink::describe(c);
  CHECK(text.find("hunter2") == std::string::npos);
  CHECK(text.find("(set, not shown)") != std::string::npos);
  CHECK(kvlink::find_setting("auth_secret")->secret);
  CHECK_FALSE(kvlink::find_setting("auth_secret_file")->secret);
  c.auth_secret_file = "/run/secrets/kvlink";
  std::string what;
  CHECK(kvlink::validate(c, &what) == kvlink::errc::invalid_argument);
  CHECK(what.find("auth_secret") != std::string::npos);
}

TEST_CASE("defaults are valid and to_json uses bytes and milliseconds") {
  const kvlink::config c;
  CHECK_FALSE(kvlink::validate(c));
  const json j = kvlink::to_json(c);
  CHECK(j.at("slice_size") == 1048576);
  CHECK(j.at("transfer_deadline") == 30000);
  CHECK(j.at("listen") == "127.0.0.1:0");
  CHECK(j.at("tcp_nodelay") == true);
  CHECK(j.at("rdma_gid_index") == -1);
  CHECK(j.at("rdma_devices") == "");
}

TEST_CASE("JSON round trip") {
  const kvlink::config c = all_changed();
  REQUIRE_FALSE(kvlink::validate(c));
  CHECK(kvlink::config_from_json(kvlink::to_json(c)) == c);
  // Through text as well: parsed integers are unsigned, built ones signed.
  CHECK(kvlink::config_from_json(json::parse(kvlink::to_json(c).dump())) == c);
  CHECK(kvlink::config_from_json(kvlink::to_json(kvlink::config{})) == kvlink::config{});
}

TEST_CASE("JSON accepts units and keeps unspecified settings from base") {
  kvlink::config base;
  base.tcp.lanes = 5;
  const json j = json::parse(R"({
    "slice_size": "4MiB", "min_chunk": "64 KiB", "socket_buffer": "1MB",
    "max_frame_payload": "1GB", "transfer_deadline": "2s", "fence_timeout": "250ms",
    "connect_timeout": 700, "rdma_gid_index": 2, "tcp_nodelay": false, "alignment": 512
  })");
  const kvlink::config c = kvlink::config_from_json(j, base);
  CHECK(c.slice_size == 4u << 20);
  CHECK(c.min_chunk == 64u << 10);
  CHECK(c.tcp.socket_buffer == 1'000'000);
  CHECK(c.tcp.max_frame_payload == 1'000'000'000);
  CHECK(c.transfer_deadline == 2000ms);
  CHECK(c.fence_timeout == 250ms);
  CHECK(c.connect_timeout == 700ms);
  CHECK(c.rdma.gid_index == 2);
  CHECK_FALSE(c.tcp.nodelay);
  CHECK(c.alignment == 512);
  CHECK(c.tcp.lanes == 5);  // from base
  CHECK(c.listen == "127.0.0.1:0");
}

TEST_CASE("JSON errors name the key and the reason") {
  const auto error_of = [](const char* text) {
    std::error_code ec;
    std::string what;
    kvlink::config base;
    base.tcp.lanes = 3;
    const kvlink::config c = kvlink::config_from_json(json::parse(text), ec, &what, base);
    CHECK(ec == kvlink::errc::invalid_argument);
    CHECK(c == base);  // unchanged on error
    return what;
  };
  CHECK(error_of(R"({"slice_sise": 1})").find("unknown setting \"slice_sise\"") !=
        std::string::npos);
  CHECK(error_of(R"({"slice_size": true})").find("slice_size: expected") != std::string::npos);
  CHECK(error_of(R"({"slice_size": -1})").find("slice_size: must not be negative") !=
        std::string::npos);
  CHECK(error_of(R"({"slice_size": 1.5})").find("floating-point") != std::string::npos);
  CHECK(error_of(R"({"slice_size": "4XB"})").find("\"4XB\" is not a size") != std::string::npos);
  CHECK(error_of(R"({"slice_size": "99999999999GiB"})").find("slice_size") != std::string::npos);
  CHECK(error_of(R"({"tcp_lanes": "2"})")
            .find("tcp_lanes: expected a non-negative integer, got string") != std::string::npos);
  CHECK(error_of(R"({"tcp_lanes": 4294967296})").find("tcp_lanes: 4294967296 is out of range") !=
        std::string::npos);
  CHECK(error_of(R"({"max_notification": "8GiB"})").find("max_notification") != std::string::npos);
  CHECK(error_of(R"({"rdma_gid_index": 3000000000})").find("rdma_gid_index") != std::string::npos);
  CHECK(error_of(R"({"rdma_gid_index": -2147483649})").find("rdma_gid_index") != std::string::npos);
  CHECK(error_of(R"({"tcp_nodelay": 1})").find("tcp_nodelay: expected true or false") !=
        std::string::npos);
  CHECK(error_of(R"({"listen": 17001})").find("listen: expected a string") != std::string::npos);
  CHECK(error_of(R"({"transfer_deadline": "5us"})").find("transfer_deadline") != std::string::npos);
  CHECK(error_of(R"({"transfer_deadline": -5})").find("transfer_deadline: must not be negative") !=
        std::string::npos);
  CHECK(error_of(R"({"transfer_deadline": null})").find("transfer_deadline: expected") !=
        std::string::npos);
  CHECK(error_of(R"([1, 2])").find("must be an object") != std::string::npos);
  // Each value parses but the result breaks a rule: validate()'s message.
  CHECK(error_of(R"({"tcp_lanes": 0})").find("tcp_lanes") != std::string::npos);
  CHECK(error_of(R"({"min_chunk": "2MiB"})").find("min_chunk") != std::string::npos);

  std::string what;
  try {
    (void)kvlink::config_from_json(json::parse(R"({"bogus": 1})"));
    FAIL("no exception");
  } catch (const std::system_error& e) {
    CHECK(e.code() == kvlink::errc::invalid_argument);
    what = e.what();
  }
  CHECK(what.find("bogus") != std::string::npos);
}

TEST_CASE("environment overrides base through an injected getenv") {
  fake_env env;
  env.vars = {{"KVLINK_SLICE_SIZE", "2MiB"},
              {"KVLINK_TCP_LANES", "8"},
              {"KVLINK_TCP_NODELAY", "off"},
              {"KVLINK_TRANSFER_DEADLINE", "1.5s"},
              {"KVLINK_RDMA_GID_INDEX", "-1"},
              {"KVLINK_RDMA_DEVICES", "mlx5_2"},
              {"KVLINK_LISTEN", "0.0.0.0:17001"},
              {"KVLINK_MAX_NOTIFICATION", "1KiB"},
              {"SLICE_SIZE", "7"},
              {"KVLINK_slice_size", "7"}};
  kvlink::config base;
  base.tcp.max_inflight_per_lane = 11;
  base.rdma.gid_index = 4;
  std::error_code ec;
  std::string what;
  const kvlink::config c = kvlink::config_from_env(base, ec, &what, env);
  REQUIRE_MESSAGE(!ec, what);
  CHECK(c.slice_size == 2u << 20);
  CHECK(c.tcp.lanes == 8);
  CHECK_FALSE(c.tcp.nodelay);
  CHECK(c.transfer_deadline == 1500ms);
  CHECK(c.rdma.gid_index == -1);
  CHECK(c.rdma.devices == "mlx5_2");
  CHECK(c.listen == "0.0.0.0:17001");
  CHECK(c.max_notification == 1024);
  CHECK(c.tcp.max_inflight_per_lane == 11);  // not in the environment: from base

  // No variables: base comes back.
  CHECK(kvlink::config_from_env(base, ec, &what, fake_env{}) == base);
  CHECK_FALSE(ec);

  // An empty string setting clears it.
  base.rdma.devices = "mlx5_0";
  CHECK(kvlink::config_from_env(base, ec, &what, fake_env{{{"KVLINK_RDMA_DEVICES", ""}}})
            .rdma.devices.empty());
  CHECK_FALSE(ec);
}

TEST_CASE("environment errors name the variable") {
  const auto error_of = [](std::string var, std::string value) {
    std::error_code ec;
    std::string what;
    const kvlink::config c =
        kvlink::config_from_env(kvlink::config{}, ec, &what, fake_env{{{var, value}}});
    CHECK(ec == kvlink::errc::invalid_argument);
    CHECK(c == kvlink::config{});
    CHECK(what.find(var) != std::string::npos);
    return what;
  };
  CHECK(error_of("KVLINK_TCP_LANES", "two").find("not a non-negative integer") !=
        std::string::npos);
  CHECK(error_of("KVLINK_TCP_LANES", "-1").find("not a non-negative integer") != std::string::npos);
  CHECK(error_of("KVLINK_TCP_LANES", "").find("not a non-negative integer") != std::string::npos);
  CHECK(error_of("KVLINK_TCP_LANES", "0").find("tcp_lanes: must be at least 1") !=
        std::string::npos);
  CHECK(error_of("KVLINK_TCP_NODELAY", "maybe").find("not a boolean") != std::string::npos);
  CHECK(error_of("KVLINK_SLICE_SIZE", "1k").find("not a size") != std::string::npos);
  CHECK(error_of("KVLINK_RDMA_GID_INDEX", "1x").find("not an integer") != std::string::npos);
  CHECK(error_of("KVLINK_RDMA_GID_INDEX", "-2").find("rdma_gid_index") != std::string::npos);
  CHECK(error_of("KVLINK_CONNECT_TIMEOUT", "forever").find("not a duration") != std::string::npos);
}

TEST_CASE("boolean and integer text forms") {
  kvlink::config c;
  const auto* nodelay = kvlink::find_setting("tcp_nodelay");
  REQUIRE(nodelay != nullptr);
  for (const char* t : {"1", "true", "TRUE", "yes", "On", " on "}) {
    c.tcp.nodelay = false;
    CHECK_FALSE(kvlink::set_setting_text(c, *nodelay, t));
    CHECK(c.tcp.nodelay);
  }
  for (const char* f : {"0", "false", "No", "OFF"}) {
    c.tcp.nodelay = true;
    CHECK_FALSE(kvlink::set_setting_text(c, *nodelay, f));
    CHECK_FALSE(c.tcp.nodelay);
  }
  const auto* lanes = kvlink::find_setting("tcp_lanes");
  REQUIRE(lanes != nullptr);
  CHECK_FALSE(kvlink::set_setting_text(c, *lanes, "4294967295"));
  CHECK(c.tcp.lanes == 4294967295u);
  CHECK(kvlink::set_setting_text(c, *lanes, "4294967296") == kvlink::errc::invalid_argument);
  CHECK(kvlink::set_setting_text(c, *lanes, "+3") == kvlink::errc::invalid_argument);
  CHECK(kvlink::set_setting_text(c, *lanes, "3.0") == kvlink::errc::invalid_argument);
  CHECK(kvlink::set_setting_text(c, *lanes, "99999999999999999999999") ==
        kvlink::errc::invalid_argument);
  CHECK(c.tcp.lanes == 4294967295u);  // failed sets leave the value alone
}

TEST_CASE("validate rejects what the engines cannot use") {
  const auto rejects = [](auto mutate, std::string_view key) {
    kvlink::config c;
    mutate(c);
    std::string what;
    CHECK(kvlink::validate(c, &what) == kvlink::errc::invalid_argument);
    CAPTURE(what);
    CHECK(what.find(key) != std::string::npos);
  };
  rejects([](kvlink::config& c) { c.tcp.lanes = 0; }, "tcp_lanes");
  rejects([](kvlink::config& c) { c.slice_size = 0; }, "slice_size");
  rejects([](kvlink::config& c) { c.min_chunk = c.slice_size + 1; }, "min_chunk");
  rejects([](kvlink::config& c) { c.alignment = 0; }, "alignment");
  rejects([](kvlink::config& c) { c.alignment = 3; }, "alignment");
  rejects([](kvlink::config& c) { c.alignment = 2u << 20; },
          "alignment");  // does not divide slice_size
  rejects([](kvlink::config& c) { c.tcp.max_inflight_per_lane = 0; }, "max_inflight_per_lane");
  rejects([](kvlink::config& c) { c.tcp.max_frame_payload = c.slice_size - 1; },
          "max_frame_payload");
  rejects([](kvlink::config& c) { c.tcp.max_frame_payload = c.slice_size + c.min_chunk - 2; },
          "max_frame_payload");
  rejects([](kvlink::config& c) { c.tcp.socket_buffer = std::uint64_t{1} << 31; }, "socket_buffer");
  rejects([](kvlink::config& c) { c.transfer_deadline = -1ms; }, "transfer_deadline");
  rejects([](kvlink::config& c) { c.connect_timeout = 0ms; }, "connect_timeout");
  rejects([](kvlink::config& c) { c.fence_timeout = -1ms; }, "fence_timeout");
  rejects([](kvlink::config& c) { c.max_control_message = 0; }, "max_control_message");
  rejects(
      [](kvlink::config& c) {
        c.max_notification = static_cast<std::uint32_t>(c.max_control_message + 1);
      },
      "max_notification");
  rejects([](kvlink::config& c) { c.rdma.devices = "mlx5_0,,mlx5_1"; }, "rdma_devices");
  rejects([](kvlink::config& c) { c.rdma.devices = "mlx5_0, mlx5_1"; }, "rdma_devices");
  // Not `= ","`: g++ 12 at -O3 inlines that one-character assignment into a
  // memcpy and reports a -Wrestrict overlap that cannot happen (GCC bug
  // 105329; issue 28: the Release build failed here). The string is the same.
  rejects([](kvlink::config& c) { c.rdma.devices = std::string(1, ','); }, "rdma_devices");
  rejects([](kvlink::config& c) { c.rdma.gid_index = -2; }, "rdma_gid_index");
  for (const char* bad : {"10.0.0.5", ":80", "[::1"}) {
    CAPTURE(bad);
    rejects([bad](kvlink::config& c) { c.advertise = bad; }, "advertise");
  }
  for (const char* bad : {",", "rdma,,tcp", "tcp,tcp", "rdma, tcp", "tcp,"}) {
    CAPTURE(bad);
    rejects([bad](kvlink::config& c) { c.transports = bad; }, "transports");
  }
  rejects([](kvlink::config& c) { c.rdma.qps_per_endpoint = 0; }, "rdma_qps_per_endpoint");
  rejects([](kvlink::config& c) { c.device.runtime = ""; }, "device");
  rejects([](kvlink::config& c) { c.device.runtime = "cu da"; }, "device");
  rejects([](kvlink::config& c) { c.device.staging_chunk = 100; }, "staging_chunk");
  rejects([](kvlink::config& c) { c.device.staging_chunk = 64 << 10; }, "staging_chunk");
  rejects([](kvlink::config& c) { c.device.staging_bytes = 1024; }, "staging_bytes");
  rejects([](kvlink::config& c) { c.shm.max_copy = 100; }, "shm_max_copy");
  rejects([](kvlink::config& c) { c.shm.ring_max = (64u << 10) + 1; }, "shm_ring_max");
  rejects([](kvlink::config& c) { c.rdma.max_wr = 0; }, "rdma_max_wr");
  rejects([](kvlink::config& c) { c.rdma.chain = 0; }, "rdma_chain");
  for (const char* bad : {"", "localhost", ":80", "host:", "host:65536", "host:8o", "::1:80",
                          "[::1]", "[]:80", "[::1:80", "host :80"}) {
    CAPTURE(bad);
    rejects([bad](kvlink::config& c) { c.listen = bad; }, "listen");
  }

  // Boundaries that are fine.
  const auto accepts = [](auto mutate) {
    kvlink::config c;
    mutate(c);
    std::string what;
    CHECK_MESSAGE(!kvlink::validate(c, &what), what);
  };
  accepts([](kvlink::config& c) {
    c.min_chunk = c.slice_size;
    c.tcp.max_frame_payload = 2 * c.slice_size - 1;
  });
  accepts([](kvlink::config& c) {
    c.min_chunk = 0;
    c.tcp.max_frame_payload = c.slice_size;
  });
  accepts([](kvlink::config& c) { c.alignment = c.slice_size; });
  accepts([](kvlink::config& c) {
    c.tcp.socket_buffer = 2147483647;
    c.transfer_deadline = 0ms;
    c.fence_timeout = 0ms;
  });
  accepts([](kvlink::config& c) {
    c.max_notification = static_cast<std::uint32_t>(c.max_control_message);
  });
  accepts([](kvlink::config& c) {
    c.rdma.devices = "mlx5_0";
    c.rdma.gid_index = 0;
  });
  for (const char* good : {"0.0.0.0:0", "localhost:65535", "[::1]:17001", "[fe80::1%eth0]:1"}) {
    CAPTURE(good);
    accepts([good](kvlink::config& c) { c.listen = good; });
  }
}

TEST_CASE("describe lists every setting with its value, unit and env var") {
  kvlink::config c;
  c.slice_size = 4u << 20;
  const std::string text = kvlink::describe(c);
  for (const auto& s : kvlink::config_table()) {
    CAPTURE(s.name);
    CHECK(text.find(std::string{s.name}) != std::string::npos);
    CHECK(text.find(std::string{s.env}) != std::string::npos);
    CHECK(text.find(std::string{s.doc}) != std::string::npos);
  }
  CHECK(text.find("4194304 (4 MiB)") != std::string::npos);
  CHECK(text.find("\"127.0.0.1:0\"") != std::string::npos);
  // Aligned: the env column starts at the same offset on every line.
  std::set<std::size_t> env_columns;
  std::size_t lines = 0;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t eol = text.find('\n', pos);
    const std::string_view line{text.data() + pos, eol - pos};
    if (lines > 0) env_columns.insert(line.find("KVLINK_"));
    ++lines;
    pos = eol + 1;
  }
  CHECK(lines == kvlink::config_table().size() + 1);  // plus the header
  CHECK(env_columns.size() == 1);
}
