#include <kvlink/engine/config.hpp>
#include <kvlink/metadata/config.hpp>

#include <string>

#include <doctest/doctest.h>

using kvlink::metadata_url;

TEST_CASE("metadata URLs: p2p, etcd with several endpoints, Mooncake's HTTP server") {
  metadata_url u;
  REQUIRE_FALSE(kvlink::parse_metadata_url("p2p", u));
  CHECK(u.type == metadata_url::kind::p2p);

  REQUIRE_FALSE(kvlink::parse_metadata_url("etcd://10.0.0.1:2379", u));
  CHECK(u.type == metadata_url::kind::etcd);
  CHECK(u.endpoints == std::vector<std::string>{"10.0.0.1:2379"});

  REQUIRE_FALSE(kvlink::parse_metadata_url("etcd://a:2379,b:2379,[::1]:2379/", u));
  CHECK(u.endpoints == std::vector<std::string>{"a:2379", "b:2379", "[::1]:2379"});

  REQUIRE_FALSE(kvlink::parse_metadata_url("http://127.0.0.1:8080/metadata", u));
  CHECK(u.type == metadata_url::kind::http);
  CHECK_FALSE(u.tls);
  CHECK(u.endpoints == std::vector<std::string>{"127.0.0.1:8080"});
  CHECK(u.path == "/metadata");

  REQUIRE_FALSE(kvlink::parse_metadata_url("https://meta.example", u));
  CHECK(u.tls);
  CHECK(u.endpoints == std::vector<std::string>{"meta.example:443"});
  CHECK(u.path == "/");

  REQUIRE_FALSE(kvlink::parse_metadata_url("http://meta:80/a/b", u));
  CHECK(u.path == "/a/b");
}

TEST_CASE("bad metadata URLs are refused with the reason and the accepted forms") {
  for (const char* bad :
       {"", "etcd", "etcd://", "etcd://host", "etcd://a:2379,", "etcd://a:0", "redis://h:6379",
        "http://", "http://h:99999/x", "http://h:80/metadata?key=x", "host:2379"}) {
    CAPTURE(bad);
    metadata_url u;
    std::string what;
    CHECK(kvlink::parse_metadata_url(bad, u, &what) == kvlink::errc::invalid_argument);
    CHECK(what.find("metadata") != std::string::npos);
    CHECK(what.find("etcd://host:2379") != std::string::npos);
  }
}

TEST_CASE("metadata settings: rules and the whole config") {
  kvlink::metadata_config c;
  CHECK_FALSE(kvlink::validate(c));
  std::string what;

  c.lease_ttl = std::chrono::milliseconds(500);
  CHECK(kvlink::validate(c, &what) == kvlink::errc::invalid_argument);
  CHECK(what.find("metadata_lease_ttl") != std::string::npos);
  c = {};
  c.password = "pw";
  CHECK(kvlink::validate(c, &what) == kvlink::errc::invalid_argument);
  CHECK(what.find("metadata_user") != std::string::npos);
  c.user = "root";
  CHECK_FALSE(kvlink::validate(c));
  c.password_file = "/run/pw";
  CHECK(kvlink::validate(c, &what) == kvlink::errc::invalid_argument);
  c = {};
  c.tls_cert = "client.pem";
  CHECK(kvlink::validate(c, &what) == kvlink::errc::invalid_argument);
  CHECK(what.find("metadata_tls_key") != std::string::npos);
  c = {};
  c.prefix = "";
  CHECK(kvlink::validate(c, &what) == kvlink::errc::invalid_argument);

  // Through the engine's table: JSON names, env vars, secrets not printed.
  kvlink::config e;
  e = kvlink::config_from_json(nlohmann::json::parse(
      R"({"name": "decode-3", "metadata": "etcd://127.0.0.1:2379", "metadata_lease_ttl": "3s",
          "metadata_user": "root", "metadata_password": "hunter2"})"));
  CHECK(e.name == "decode-3");
  CHECK(e.metadata.url == "etcd://127.0.0.1:2379");
  CHECK(e.metadata.lease_ttl == std::chrono::seconds(3));
  const auto text = kvlink::describe(e);
  CHECK(text.find("hunter2") == std::string::npos);
  CHECK(kvlink::find_setting("metadata_password")->secret);
  CHECK(kvlink::find_setting("metadata_token")->secret);
  CHECK(kvlink::find_setting("metadata")->env == "KVLINK_METADATA");
  CHECK(kvlink::find_setting("name")->env == "KVLINK_NAME");
  CHECK(kvlink::config{}.metadata.url == "p2p");

  std::error_code ec;
  kvlink::config_from_json(nlohmann::json::parse(R"({"metadata": "zookeeper://x:1"})"), ec, &what);
  CHECK(ec == kvlink::errc::invalid_argument);
  CHECK(what.find("zookeeper") != std::string::npos);
  kvlink::config_from_json(nlohmann::json::parse(R"({"name": "a\u0001b"})"), ec, &what);
  CHECK(ec == kvlink::errc::invalid_argument);
  CHECK(what.find("name") != std::string::npos);
}
