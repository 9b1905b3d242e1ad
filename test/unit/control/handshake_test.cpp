// Tests of include/kvlink/control/handshake.hpp and descriptor.hpp: hellos
// and descriptors on the wire, refused when malformed or of another
// version; the handshake over a real socket pair.
#include <kvlink/control/handshake.hpp>

#include <optional>
#include <string>
#include <system_error>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <doctest/doctest.h>

using json = nlohmann::json;
namespace control = kvlink::control;

TEST_CASE("hello: round trip, every field") {
  control::hello h;
  h.instance = kvlink::instance_id{1, 2};
  h.r = control::role::lane;
  h.transport = "rdma";
  h.lane = 3;
  h.expect = kvlink::instance_id{4, 5};
  h.address = "10.0.0.1:17001";
  control::hello back;
  REQUIRE_FALSE(control::parse_hello(control::to_json(h), back));
  CHECK(back.instance == h.instance);
  CHECK(back.r == control::role::lane);
  CHECK(back.transport == "rdma");
  CHECK(back.lane == 3);
  CHECK(back.expect == h.expect);
  CHECK(back.address == h.address);
  // A control hello carries no transport: the default is tcp.
  control::hello c;
  REQUIRE_FALSE(
      control::parse_hello(control::make_hello(kvlink::protocol_version, kvlink::instance_id{7, 7},
                                               control::role::control),
                           c));
  CHECK(c.r == control::role::control);
  CHECK(c.transport == "tcp");
  CHECK_FALSE(c.expect.has_value());
}

TEST_CASE("hello: another version is a version mismatch, broken ones are malformed") {
  auto good = control::make_hello(kvlink::protocol_version, kvlink::instance_id{1, 1},
                                  control::role::lane, 0, std::nullopt, {}, "tcp");
  control::hello h;
  auto v = good;
  v["protocol"] = kvlink::protocol_version + 1;
  v["role"] = "nonsense";  // the version is read first
  CHECK(control::parse_hello(v, h) == kvlink::errc::protocol_version_mismatch);
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, json>>{{"instance", "zz"},
                                                 {"instance", std::string(32, '0')},
                                                 {"role", "boss"},
                                                 {"lane", -1},
                                                 {"transport", ""},
                                                 {"transport", std::string(33, 't')},
                                                 {"transport", 5},
                                                 {"expect", 7},
                                                 {"address", std::string(300, 'a')},
                                                 {"type", "welcome"}}) {
    const std::string field = key;  // named: clang 14 captures no structured bindings
    CAPTURE(field);
    auto bad = good;
    bad[key] = value;
    CHECK(control::parse_hello(bad, h) == kvlink::errc::malformed_message);
  }
}

TEST_CASE("descriptor: round trip with per-transport entries and opaque keys") {
  control::peer_descriptor d;
  d.instance = kvlink::instance_id{9, 8};
  d.address = "[::1]:17001";
  d.segments.push_back({kvlink::segment_id{1}, 0x1000, 4096, kvlink::access::remote_read,
                        json{{"rdma", {1, 2}}, {"shm", "any opaque value"}}});
  d.segments.push_back(
      {kvlink::segment_id{2}, 0x9000, 64, kvlink::access::remote_read_write, json::object()});
  d.transports = {{"tcp", {{"lanes", 2}}}, {"rdma", {{"ports", json::array()}}}};
  control::peer_descriptor back;
  REQUIRE_FALSE(control::from_json(control::to_json(d), back));
  CHECK(back.instance == d.instance);
  CHECK(back.address == d.address);
  CHECK(back.segments == d.segments);
  CHECK(back.transports == d.transports);

  auto j = control::to_json(d);
  j["protocol"] = kvlink::protocol_version + 1;
  CHECK(control::from_json(j, back) == kvlink::errc::protocol_version_mismatch);
  j = control::to_json(d);
  j["segments"][0]["keys"] = 5;
  CHECK(control::from_json(j, back) == kvlink::errc::malformed_message);
  j = control::to_json(d);
  j["segments"][0]["id"] = 0;
  CHECK(control::from_json(j, back) == kvlink::errc::malformed_message);
  j = control::to_json(d);
  j["transports"] = "tcp";
  CHECK(control::from_json(j, back) == kvlink::errc::malformed_message);
  j = control::to_json(d);
  j.erase("address");
  CHECK(control::from_json(j, back) == kvlink::errc::malformed_message);
}

TEST_CASE("transport messages: the engine routes by name and never looks inside") {
  const auto m = control::make_transport_message("rdma", {{"type", "rdma_connect"}, {"rail", 1}});
  std::string name;
  const json* body = nullptr;
  REQUIRE(control::parse_transport_message(m, name, body));
  CHECK(name == "rdma");
  CHECK((*body)["rail"] == 1);
  CHECK_FALSE(control::parse_transport_message({{"type", "transport"}, {"body", {}}}, name, body));
  CHECK_FALSE(control::parse_transport_message(
      {{"type", "transport"}, {"transport", "rdma"}, {"body", 3}}, name, body));
}

namespace {

// One handshake over a real loopback connection: `server` answers with a
// welcome (or refuses), each side with its own secret (empty: none).
struct exchange_result {
  std::error_code client, server;
  json welcome;
  control::hello seen;
  control::session_keys client_session, server_session;
};

exchange_result exchange(const control::hello& hello, bool server_refuses, std::uint64_t max,
                         const std::string& client_secret = {},
                         const std::string& server_secret = {}) {
  asio::io_context io;
  asio::ip::tcp::acceptor acc{io, {asio::ip::make_address("127.0.0.1"), 0}};
  const auto ep = acc.local_endpoint();
  const control::peer_guard cguard =
      client_secret.empty() ? control::peer_guard{} : control::peer_guard{client_secret};
  const control::peer_guard sguard =
      server_secret.empty() ? control::peer_guard{} : control::peer_guard{server_secret};
  exchange_result r;
  int done = 0;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        asio::ip::tcp::socket s{io};
        co_await acc.async_accept(s, asio::use_awaitable);
        const control::server_auth auth{&sguard, kvlink::instance_id{3, 3}, nullptr};
        r.server = co_await control::server_handshake(s, max, auth, r.seen, r.server_session);
        if (!r.server) {
          // Named, not a temporary inside co_await: g++ 12 destroys those wrongly.
          json answer = server_refuses ? control::make_error(kvlink::errc::instance_changed)
                                       : control::make_welcome(kvlink::instance_id{3, 3});
          if (!r.server_session.session.empty()) answer["session"] = r.server_session.session;
          co_await control::server_answer(s, answer);
        }
        ++done;
      },
      asio::detached);
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        asio::ip::tcp::socket s{io};
        const std::array<asio::ip::tcp::endpoint, 1> eps{ep};
        const control::client_auth auth{&cguard, {}, {}};
        r.client = co_await control::dial(s, eps, std::chrono::seconds(5), {}, hello, 1 << 20, auth,
                                          r.welcome, &r.client_session);
        ++done;
      },
      asio::detached);
  while (done < 2) io.run_one();
  return r;
}

control::hello control_hello() {
  control::hello h;
  h.instance = kvlink::instance_id{1, 1};
  return h;
}

}  // namespace

TEST_CASE("handshake over a socket: welcome, error replies, oversized hellos") {
  const auto hello = control_hello();
  auto ok = exchange(hello, false, 1 << 20);
  CHECK_FALSE(ok.client);
  CHECK_FALSE(ok.server);
  CHECK(ok.welcome["instance"] == kvlink::to_string(kvlink::instance_id{3, 3}));
  CHECK(ok.seen.instance == kvlink::instance_id{1, 1});
  CHECK_FALSE(ok.seen.client_nonce.has_value());  // no secret, no nonce

  auto refused = exchange(hello, true, 1 << 20);
  CHECK(refused.client == kvlink::errc::instance_changed);

  auto old = hello;
  old.protocol = kvlink::protocol_version - 1;
  auto mismatch = exchange(old, false, 1 << 20);
  CHECK(mismatch.server == kvlink::errc::protocol_version_mismatch);
  CHECK(mismatch.client == kvlink::errc::protocol_version_mismatch);  // told, not dropped

  auto big = exchange(hello, false, 16);  // the server allows 16-byte messages
  CHECK(big.server == kvlink::errc::message_too_large);
  CHECK(big.client == kvlink::errc::message_too_large);
}

TEST_CASE("authentication: the same secret passes both ways and agrees on a session key") {
  auto r = exchange(control_hello(), false, 1 << 20, "s3cret", "s3cret");
  REQUIRE_FALSE(r.client);
  REQUIRE_FALSE(r.server);
  CHECK(r.seen.client_nonce.has_value());
  CHECK_FALSE(r.server_session.session.empty());
  CHECK(r.client_session.session == r.server_session.session);
  CHECK(control::peer_guard::same(r.client_session.key, r.server_session.key));
  // A second run: fresh nonces, another session key.
  auto r2 = exchange(control_hello(), false, 1 << 20, "s3cret", "s3cret");
  REQUIRE_FALSE(r2.client);
  CHECK_FALSE(control::peer_guard::same(r.client_session.key, r2.client_session.key));
}

TEST_CASE("authentication: a wrong or missing secret on either side is refused") {
  auto wrong = exchange(control_hello(), false, 1 << 20, "s3cret", "other");
  CHECK(wrong.client == kvlink::errc::authentication_failed);  // the server's proof is wrong
  CHECK(wrong.welcome.value("descriptor", json{}).is_null());
  auto none_here = exchange(control_hello(), false, 1 << 20, "", "s3cret");
  CHECK(none_here.server == kvlink::errc::authentication_failed);
  CHECK(none_here.client == kvlink::errc::authentication_failed);
  auto none_there = exchange(control_hello(), false, 1 << 20, "s3cret", "");
  CHECK(none_there.client == kvlink::errc::authentication_failed);  // it does not authenticate
}

TEST_CASE("authentication: proofs bind nonces, instances, roles and lanes") {
  const control::peer_guard g{"k"};
  const auto a = control::peer_guard::make_nonce();
  const auto b = control::peer_guard::make_nonce();
  const kvlink::instance_id i1{1, 1}, i2{2, 2};
  CHECK(control::peer_guard::same(g.server_proof(a, b, i1, "lane", 0),
                                  g.server_proof(a, b, i1, "lane", 0)));
  CHECK_FALSE(control::peer_guard::same(g.server_proof(a, b, i1, "lane", 0),
                                        g.server_proof(b, a, i1, "lane", 0)));
  CHECK_FALSE(control::peer_guard::same(g.server_proof(a, b, i1, "lane", 0),
                                        g.server_proof(a, b, i2, "lane", 0)));
  CHECK_FALSE(control::peer_guard::same(g.server_proof(a, b, i1, "lane", 0),
                                        g.server_proof(a, b, i1, "lane", 1)));
  CHECK_FALSE(control::peer_guard::same(g.server_proof(a, b, i1, "lane", 0),
                                        g.server_proof(a, b, i1, "control", 0)));
  CHECK_FALSE(control::peer_guard::same(g.client_proof(a, b, i1),
                                        control::peer_guard{"K"}.client_proof(a, b, i1)));
  const auto key = g.session_key(a, b);
  CHECK_FALSE(control::peer_guard::same(control::peer_guard::lane_binding(key, b, 0),
                                        control::peer_guard::lane_binding(key, a, 0)));
}

TEST_CASE("messages nested deeper than max_message_depth are malformed, however deep") {
  // Copying a JSON value recurses once per level: a peer's 400 KB of
  // brackets used to overflow the stack wherever a message was copied.
  for (const std::size_t depth : {std::size_t{33}, std::size_t{1000}, std::size_t{200000}}) {
    CAPTURE(depth);
    std::string body = R"({"type":"segments","segments":[{"id":1,"keys":{"x":)";
    body.append(depth, '[');
    body.append(depth, ']');
    body += "}}]}";
    json out;
    CHECK(control::parse_message(body, out) == kvlink::errc::malformed_message);
  }
  std::string fine = R"({"type":"t","v":)";
  fine.append(30, '[');
  fine.append(30, ']');
  fine += "}";
  json out;
  CHECK_FALSE(control::parse_message(fine, out));
}
