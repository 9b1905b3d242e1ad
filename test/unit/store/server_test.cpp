// Tests for include/kvlink/store/master/server.hpp: an in-process master on
// 127.0.0.1:0 and raw clients that speak the store wire (the engine's
// handshake through control::dial, then frames written by hand). No engine:
// the master never touches the bytes.
#include <kvlink/control/handshake.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/store/master/server.hpp>
#include <kvlink/store/wire/protocol.hpp>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/use_future.hpp>
#include <asio/write.hpp>
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

using namespace std::chrono_literals;
using kvlink::errc;
using kvlink::store_errc;
namespace store = kvlink::store;
namespace wire = kvlink::store::wire;
namespace control = kvlink::control;

namespace {

constexpr auto op_timeout = 5s;

store::master_config small_config() {
  store::master_config c;
  c.alignment = 64;
  return c;
}

store::server_options test_options() {
  store::server_options o;
  o.listen = "127.0.0.1:0";
  o.http_listen = "127.0.0.1:0";
  o.handshake_timeout = 2000ms;
  return o;
}

// A master on two I/O threads; closed (and waited for) at the end.
struct running_master {
  explicit running_master(store::server_options opt = test_options(),
                          store::master_config cfg = small_config())
      : server{std::make_unique<store::master_server>(io.get_executor(), cfg, opt)} {
    server->listen();
    for (int i = 0; i < 2; ++i) threads.emplace_back([this] { io.run(); });
  }
  ~running_master() {
    std::promise<void> closed;
    server->async_close([&closed] { closed.set_value(); });
    const bool done = closed.get_future().wait_for(op_timeout) == std::future_status::ready;
    CHECK(done);
    server.reset();
    guard.reset();
    io.stop();
    for (auto& t : threads) t.join();
  }
  running_master(const running_master&) = delete;
  running_master& operator=(const running_master&) = delete;

  asio::io_context io{2};
  asio::executor_work_guard<asio::io_context::executor_type> guard{io.get_executor()};
  std::unique_ptr<store::master_server> server;
  std::vector<std::thread> threads;
};

// Waits for an asynchronous operation started by `start(done)`; on timeout
// the socket is closed (which completes the operation) and timed_out returned.
std::error_code wait_io(asio::ip::tcp::socket& s,
                        const std::function<void(std::function<void(std::error_code)>)>& start) {
  auto p = std::make_shared<std::promise<std::error_code>>();
  auto f = p->get_future();
  start([p](std::error_code ec) { p->set_value(ec); });
  if (f.wait_for(op_timeout) != std::future_status::ready) {
    asio::post(s.get_executor(), [&s] {
      std::error_code ignored;
      s.close(ignored);
    });
    f.wait();
    return std::make_error_code(std::errc::timed_out);
  }
  return f.get();
}

std::error_code read_exact(asio::ip::tcp::socket& s, void* p, std::size_t n) {
  return wait_io(s, [&](std::function<void(std::error_code)> done) {
    asio::async_read(s, asio::buffer(p, n), [done](std::error_code ec, std::size_t) { done(ec); });
  });
}

std::error_code write_all(asio::ip::tcp::socket& s, const std::string& bytes) {
  return wait_io(s, [&](std::function<void(std::error_code)> done) {
    asio::async_write(s, asio::buffer(bytes),
                      [done](std::error_code ec, std::size_t) { done(ec); });
  });
}

struct test_client {
  explicit test_client(asio::io_context& io) : socket{io} {}
  asio::ip::tcp::socket socket;
  nlohmann::json welcome;
  std::uint64_t next_id = 1;
  const nlohmann::json& store() const { return welcome.at("store"); }
};

struct connect_args {
  kvlink::instance_id instance = kvlink::make_instance_id();
  std::string engine_address = "127.0.0.1:17001";
  const control::peer_guard* guard = nullptr;
  control::role role = control::role::store;
};

std::error_code connect(asio::io_context& io, const std::string& address, test_client& c,
                        const connect_args& args) {
  std::string_view host;
  std::uint16_t port = 0;
  REQUIRE(kvlink::split_host_port(address, host, port));
  asio::ip::tcp::resolver resolver(io);
  const auto endpoints = resolver.resolve(std::string(host), std::to_string(port));
  control::hello h;
  h.instance = args.instance;
  h.r = args.role;
  h.address = args.engine_address;
  auto fut = asio::co_spawn(
      io,
      [&c, endpoints, h, guard = args.guard]() -> asio::awaitable<std::error_code> {
        control::client_auth auth;
        auth.guard = guard;
        control::session_keys keys;
        const control::socket_options sockopts;
        const auto ec =
            co_await control::dial(c.socket, endpoints, std::chrono::milliseconds{3000}, sockopts,
                                   h, control::max_handshake_message, auth, c.welcome, &keys);
        co_return ec;
      },
      asio::use_future);
  return fut.get();
}

struct reply {
  std::error_code ec;  // of the I/O
  wire::frame_header header;
  std::string body;
};

reply round_trip(test_client& c, const std::string& frame) {
  reply r;
  if ((r.ec = write_all(c.socket, frame))) return r;
  wire::header_bytes hb{};
  if ((r.ec = read_exact(c.socket, hb.data(), hb.size()))) return r;
  if ((r.ec = wire::decode_header(hb, UINT32_MAX, r.header))) return r;
  r.body.resize(r.header.body_length);
  if (!r.body.empty()) r.ec = read_exact(c.socket, r.body.data(), r.body.size());
  return r;
}

reply call(test_client& c, wire::message_type t, const std::function<void(wire::writer&)>& fill) {
  const std::uint64_t id = c.next_id++;
  wire::writer w(t, id, false);
  fill(w);
  reply r = round_trip(c, w.take());
  if (!r.ec) {
    CHECK(r.header.id == id);
    CHECK(r.header.type == (static_cast<std::uint16_t>(t) | wire::reply_bit));
  }
  return r;
}

// Whether the server closed the connection (EOF) within the timeout.
bool closed_by_server(test_client& c) {
  char byte = 0;
  const auto ec = read_exact(c.socket, &byte, 1);
  return ec == asio::error::eof || ec == asio::error::connection_reset;
}

std::error_code status_of(wire::reader& r) { return r.status(); }

std::uint64_t mount(test_client& c, std::string_view name, std::uint64_t size,
                    std::uint64_t engine_segment = 0) {
  const auto r = call(c, wire::message_type::mount, [&](wire::writer& w) {
    wire::mount_request{name, size, engine_segment, {}}.encode(w);
  });
  REQUIRE(!r.ec);
  wire::reader rd(r.body);
  REQUIRE(!status_of(rd));
  const std::uint64_t id = rd.u64();
  wire::code_list taken;  // the objects announced with the mount: none
  REQUIRE(!taken.decode(rd));
  CHECK(taken.codes.empty());
  return id;
}

std::vector<std::uint32_t> codes(test_client& c, wire::message_type t,
                                 const std::vector<std::string_view>& keys, bool force = false) {
  const auto r = call(c, t, [&](wire::writer& w) {
    wire::key_batch b;
    b.force = force;
    b.keys = keys;
    b.encode(w, t == wire::message_type::remove);
  });
  REQUIRE(!r.ec);
  wire::reader rd(r.body);
  REQUIRE(!status_of(rd));
  wire::code_list out;
  REQUIRE(!out.decode(rd));
  return out.codes;
}

wire::placement_list put_start(test_client& c, const std::vector<std::string_view>& keys,
                               const std::vector<std::uint64_t>& sizes) {
  const auto r = call(c, wire::message_type::put_start, [&](wire::writer& w) {
    wire::put_start_request req;
    req.keys = keys;
    req.sizes = sizes;
    req.parents.assign(keys.size(), {});
    req.encode(w);
  });
  REQUIRE(!r.ec);
  wire::reader rd(r.body);
  REQUIRE(!status_of(rd));
  wire::placement_list out;
  REQUIRE(!out.decode(rd, false));
  return out;
}

wire::placement_list get(test_client& c, const std::vector<std::string_view>& keys) {
  const auto r = call(c, wire::message_type::get, [&](wire::writer& w) {
    wire::key_batch b;
    b.keys = keys;
    b.encode(w, false);
  });
  REQUIRE(!r.ec);
  wire::reader rd(r.body);
  REQUIRE(!status_of(rd));
  wire::placement_list out;
  REQUIRE(!out.decode(rd, true));
  return out;
}

bool heartbeat(test_client& c) {
  const auto r = call(c, wire::message_type::heartbeat, [](wire::writer&) {});
  REQUIRE(!r.ec);
  wire::reader rd(r.body);
  REQUIRE(!status_of(rd));
  const bool known = rd.u8() == 1;
  REQUIRE(!rd.finish());
  return known;
}

std::uint32_t code(store_errc e) { return static_cast<std::uint32_t>(e); }

// GET (or `method`) `path` from the HTTP endpoint: status line and body.
// One raw HTTP exchange: the status line and the body of the answer.
std::pair<std::string, std::string> http_raw(asio::io_context& io, const std::string& address,
                                             const std::string& request) {
  std::string_view host;
  std::uint16_t port = 0;
  REQUIRE(kvlink::split_host_port(address, host, port));
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address(std::string(host)), port});
  REQUIRE(!write_all(s, request));
  std::string all;
  std::array<char, 4096> buf{};
  for (;;) {
    std::error_code ec;
    const std::size_t n = s.read_some(asio::buffer(buf), ec);
    all.append(buf.data(), n);
    if (ec) break;
  }
  // An interim "100 Continue" comes before the answer.
  if (all.starts_with("HTTP/1.1 100 Continue\r\n\r\n")) all.erase(0, 25);
  const auto eol = all.find("\r\n");
  const auto head_end = all.find("\r\n\r\n");
  REQUIRE(eol != std::string::npos);
  REQUIRE(head_end != std::string::npos);
  return {all.substr(0, eol), all.substr(head_end + 4)};
}

std::pair<std::string, std::string> http_get(asio::io_context& io, const std::string& address,
                                             const std::string& path,
                                             const std::string& method = "GET") {
  return http_raw(io, address, method + " " + path + " HTTP/1.1\r\nHost: x\r\n\r\n");
}

}  // namespace

TEST_CASE(
    "master server: the welcome names the client, and a reconnect within the timeout is "
    "known") {
  running_master m;
  connect_args a;
  test_client c1(m.io);
  REQUIRE(!connect(m.io, m.server->local_address(), c1, a));
  CHECK(c1.welcome.at("type") == "welcome");
  CHECK(c1.welcome.at("instance") == kvlink::to_string(m.server->instance()));
  CHECK(c1.store().at("known") == false);
  const auto id = c1.store().at("client").get<std::uint64_t>();
  CHECK(id >= 1);
  CHECK(c1.store().at("heartbeat_ms") == 1000);
  CHECK(c1.store().at("timeout_ms") == 10000);
  CHECK(c1.store().at("max_body") == wire::default_max_body);
  CHECK(heartbeat(c1));
  c1.socket.close();

  test_client c2(m.io);
  REQUIRE(!connect(m.io, m.server->local_address(), c2, a));
  CHECK(c2.store().at("known") == true);
  CHECK(c2.store().at("client") == id);

  test_client other(m.io);
  REQUIRE(!connect(m.io, m.server->local_address(), other, connect_args{}));
  CHECK(other.store().at("known") == false);
  CHECK(other.store().at("client") != id);
}

TEST_CASE("master server: a shared secret is proven both ways") {
  auto opt = test_options();
  opt.auth_secret = "s3cret";
  running_master m(opt);
  const control::peer_guard right("s3cret");
  const control::peer_guard wrong("other");

  test_client ok(m.io);
  connect_args a;
  a.guard = &right;
  REQUIRE(!connect(m.io, m.server->local_address(), ok, a));
  CHECK(ok.welcome.contains("session"));
  CHECK(heartbeat(ok));

  test_client bad(m.io);
  a.guard = &wrong;
  CHECK(connect(m.io, m.server->local_address(), bad, a) == errc::authentication_failed);

  test_client none(m.io);
  a.guard = nullptr;
  CHECK(connect(m.io, m.server->local_address(), none, a) == errc::authentication_failed);

  // A client with a secret refuses a master without one.
  running_master open;
  test_client lonely(open.io);
  a.guard = &right;
  CHECK(connect(open.io, open.server->local_address(), lonely, a) == errc::authentication_failed);
}

TEST_CASE("master server: only role store is admitted") {
  running_master m;
  test_client c(m.io);
  connect_args a;
  a.role = control::role::control;
  CHECK(connect(m.io, m.server->local_address(), c, a) == errc::invalid_argument);
}

TEST_CASE("master server: bad frames are answered or closed, never crash it") {
  running_master m;
  const auto addr = m.server->local_address();

  SUBCASE("another protocol version is answered, then closed") {
    test_client c(m.io);
    REQUIRE(!connect(m.io, addr, c, connect_args{}));
    wire::frame_header h;
    h.version = wire::protocol_version + 1;
    h.type = static_cast<std::uint16_t>(wire::message_type::heartbeat);
    h.id = 77;
    const auto hb = wire::encode_header(h);
    REQUIRE(!write_all(c.socket, std::string(hb.begin(), hb.end())));
    wire::header_bytes got{};
    REQUIRE(!read_exact(c.socket, got.data(), got.size()));
    wire::frame_header rh;
    REQUIRE(!wire::decode_header(got, UINT32_MAX, rh));
    CHECK(rh.id == 77);
    std::string body(rh.body_length, '\0');
    REQUIRE(!read_exact(c.socket, body.data(), body.size()));
    wire::reader rd(body);
    CHECK(rd.status() == errc::protocol_version_mismatch);
    CHECK(closed_by_server(c));
  }
  SUBCASE("a body over max_body is answered message_too_large, then closed") {
    test_client c(m.io);
    REQUIRE(!connect(m.io, addr, c, connect_args{}));
    wire::frame_header h;
    h.type = static_cast<std::uint16_t>(wire::message_type::get);
    h.body_length = wire::default_max_body + 1;
    h.id = 5;
    const auto hb = wire::encode_header(h);
    const auto r = round_trip(c, std::string(hb.begin(), hb.end()));
    REQUIRE(!r.ec);
    wire::reader rd(r.body);
    CHECK(rd.status() == errc::message_too_large);
    CHECK(closed_by_server(c));
  }
  SUBCASE("a bad magic closes the connection") {
    test_client c(m.io);
    REQUIRE(!connect(m.io, addr, c, connect_args{}));
    REQUIRE(!write_all(c.socket, std::string(wire::header_size, 'x')));
    CHECK(closed_by_server(c));
  }
  SUBCASE("a body that does not decode is answered malformed_message, then closed") {
    test_client c(m.io);
    REQUIRE(!connect(m.io, addr, c, connect_args{}));
    const auto r = call(c, wire::message_type::get, [](wire::writer& w) {
      w.u32(1000);  // a thousand keys announced, none there
    });
    REQUIRE(!r.ec);
    wire::reader rd(r.body);
    CHECK(rd.status() == errc::malformed_message);
    CHECK(closed_by_server(c));
  }
  SUBCASE("an unknown type is answered invalid_argument and the connection stays") {
    test_client c(m.io);
    REQUIRE(!connect(m.io, addr, c, connect_args{}));
    wire::frame_header h;
    h.type = 999;
    h.id = 9;
    const auto hb = wire::encode_header(h);
    const auto r = round_trip(c, std::string(hb.begin(), hb.end()));
    REQUIRE(!r.ec);
    CHECK(r.header.id == 9);
    wire::reader rd(r.body);
    CHECK(rd.status() == errc::invalid_argument);
    CHECK(heartbeat(c));
  }
  SUBCASE("garbage instead of a hello") {
    asio::ip::tcp::socket s(m.io);
    std::string_view host;
    std::uint16_t port = 0;
    REQUIRE(kvlink::split_host_port(addr, host, port));
    s.connect({asio::ip::make_address(std::string(host)), port});
    REQUIRE(!write_all(s, std::string(64, '\xff')));
    char byte = 0;
    std::error_code ec;
    // The engine's error answer, then EOF; never a hang.
    while (!ec) ec = read_exact(s, &byte, 1);
    CHECK(ec != std::errc::timed_out);
  }
  // The server still serves.
  test_client after(m.io);
  REQUIRE(!connect(m.io, addr, after, connect_args{}));
  CHECK(heartbeat(after));
}

TEST_CASE("master server: mount, put, get, exists, remove with per-key codes in order") {
  running_master m;
  const auto addr = m.server->local_address();
  test_client a(m.io), b(m.io);
  connect_args aa;
  aa.engine_address = "127.0.0.1:17001";
  connect_args ba;
  ba.engine_address = "127.0.0.1:17002";
  REQUIRE(!connect(m.io, addr, a, aa));
  REQUIRE(!connect(m.io, addr, b, ba));
  const auto a_id = a.store().at("client").get<std::uint64_t>();

  const std::uint64_t seg = mount(a, "seg0", 1 << 20, 7);
  {
    const auto r = call(a, wire::message_type::segment_info, [&](wire::writer& w) { w.u64(seg); });
    REQUIRE(!r.ec);
    wire::reader rd(r.body);
    REQUIRE(!rd.status());
    wire::segment_location loc;
    REQUIRE(!loc.decode(rd));
    CHECK(loc.client == a_id);
    CHECK(loc.address == "127.0.0.1:17001");
    CHECK(loc.engine_segment == 7);
    CHECK(loc.size == (1u << 20));
    CHECK(loc.host == "127.0.0.1");
  }

  const auto placed = put_start(a, {"k1", "", "k2", "k3"}, {4096, 10, 0, 100});
  REQUIRE(placed.entries.size() == 4);
  CHECK(placed.entries[0].code == 0);
  CHECK(placed.entries[1].code == code(store_errc::invalid_key));
  CHECK(placed.entries[2].code == code(store_errc::invalid_params));
  CHECK(placed.entries[3].code == 0);
  REQUIRE(placed.entries[0].count == 1);
  CHECK(placed.entries[0].replicas[0].segment == seg);

  CHECK(codes(b, wire::message_type::exists, {"k1", "nope"}) ==
        std::vector<std::uint32_t>{code(store_errc::object_in_progress),
                                   code(store_errc::object_not_found)});
  // Only the writer ends or revokes its put.
  CHECK(codes(b, wire::message_type::put_end, {"k1"}) ==
        std::vector<std::uint32_t>{code(store_errc::illegal_client)});
  CHECK(codes(b, wire::message_type::put_revoke, {"k1"}) ==
        std::vector<std::uint32_t>{code(store_errc::illegal_client)});
  CHECK(codes(a, wire::message_type::put_end, {"k1", "missing"}) ==
        std::vector<std::uint32_t>{0, code(store_errc::object_not_found)});
  CHECK(codes(a, wire::message_type::put_revoke, {"k3"}) == std::vector<std::uint32_t>{0});

  // A second client sees the first one's object.
  const auto got = get(b, {"missing", "k1", "k3"});
  REQUIRE(got.entries.size() == 3);
  CHECK(got.entries[0].code == code(store_errc::object_not_found));
  CHECK(got.entries[1].code == 0);
  CHECK(got.entries[1].size == 4096);
  CHECK(got.entries[1].lease_ms > 0);
  CHECK(got.entries[1].lease_ms <= 10000);
  REQUIRE(got.entries[1].count == 1);
  CHECK(got.entries[1].replicas[0] == placed.entries[0].replicas[0]);
  CHECK(got.entries[2].code == code(store_errc::object_not_found));
  CHECK(codes(b, wire::message_type::exists, {"k1"}) == std::vector<std::uint32_t>{0});

  // A first put wins.
  const auto again = put_start(b, {"k1"}, {4096});
  CHECK(again.entries[0].code == code(store_errc::object_already_exists));

  {
    const auto r = call(b, wire::message_type::stats, [](wire::writer&) {});
    wire::reader rd(r.body);
    REQUIRE(!rd.status());
    wire::stats_reply st;
    REQUIRE(!st.decode(rd));
    CHECK(st.segments == 1);
    CHECK(st.objects == 1);
    CHECK(st.capacity == (1u << 20));
    CHECK(st.used == 4096 + 64);  // its record too (store/wire/record.hpp)
  }

  CHECK(codes(b, wire::message_type::remove, {"k1"}) ==
        std::vector<std::uint32_t>{code(store_errc::object_has_lease)});
  CHECK(codes(b, wire::message_type::remove, {"k1", "k1"}, true) ==
        std::vector<std::uint32_t>{0, code(store_errc::object_not_found)});
  CHECK(codes(b, wire::message_type::exists, {"k1"}) ==
        std::vector<std::uint32_t>{code(store_errc::object_not_found)});

  REQUIRE(put_start(a, {"x", "y"}, {64, 64}).entries[1].code == 0);
  REQUIRE(codes(a, wire::message_type::put_end, {"x", "y"}) == std::vector<std::uint32_t>{0, 0});
  {
    const auto r = call(b, wire::message_type::remove_all, [](wire::writer& w) { w.u8(1); });
    wire::reader rd(r.body);
    REQUIRE(!rd.status());
    CHECK(rd.u64() == 2);
  }

  // Only the owner unmounts.
  {
    const auto r = call(b, wire::message_type::unmount, [&](wire::writer& w) { w.u64(seg); });
    wire::reader rd(r.body);
    CHECK(rd.status() == store_errc::illegal_client);
  }
  {
    const auto r = call(a, wire::message_type::unmount, [&](wire::writer& w) { w.u64(seg); });
    wire::reader rd(r.body);
    CHECK(!rd.status());
  }
  {
    const auto r = call(a, wire::message_type::segment_info, [&](wire::writer& w) { w.u64(seg); });
    wire::reader rd(r.body);
    CHECK(rd.status() == store_errc::segment_not_found);
  }
  CHECK(put_start(a, {"z"}, {64}).entries[0].code == code(store_errc::no_space));
}

TEST_CASE("master server: a silent client becomes suspect, then gone with its objects") {
  auto opt = test_options();
  opt.suspect_after = 150ms;
  opt.liveness_timeout = 500ms;
  running_master m(opt);
  const auto addr = m.server->local_address();
  connect_args aa;
  test_client a(m.io), b(m.io);
  REQUIRE(!connect(m.io, addr, a, aa));
  REQUIRE(!connect(m.io, addr, b, connect_args{}));
  const auto a_id = a.store().at("client").get<std::uint64_t>();
  mount(a, "seg0", 1 << 16);
  REQUIRE(put_start(a, {"k"}, {128}).entries[0].code == 0);
  REQUIRE(codes(a, wire::message_type::put_end, {"k"}) == std::vector<std::uint32_t>{0});

  // A reconnect within the timeout is known, and its objects stay.
  a.socket.close();
  std::this_thread::sleep_for(100ms);
  test_client a2(m.io);
  REQUIRE(!connect(m.io, addr, a2, aa));
  CHECK(a2.store().at("known") == true);
  CHECK(a2.store().at("client") == a_id);
  a2.socket.close();

  // Silent from now on; b keeps beating.
  bool suspect_seen = false;
  bool gone = false;
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!gone && std::chrono::steady_clock::now() < deadline) {
    CHECK(heartbeat(b));
    if (m.server->service().client_counts().second == 1) suspect_seen = true;
    gone = get(b, {"k"}).entries[0].code == code(store_errc::object_not_found);
    std::this_thread::sleep_for(30ms);
  }
  CHECK(suspect_seen);
  REQUIRE(gone);
  CHECK(m.server->service().client_counts().first == 1);  // b
  CHECK(m.server->objects().stats().segments == 0);
  const auto http = http_get(m.io, m.server->http_address(), "/metrics");
  CHECK(http.second.find("kvlink_store_clients_gone_total 1") != std::string::npos);
  CHECK(http.second.find("kvlink_store_suspect_events_total 1") != std::string::npos);

  // It comes back unknown, with the same client id.
  test_client a3(m.io);
  REQUIRE(!connect(m.io, addr, a3, aa));
  CHECK(a3.store().at("known") == false);
  CHECK(a3.store().at("client") == a_id);
}

TEST_CASE(
    "master server: HTTP /health, /metrics, /segments, /get_all_segments, /metrics/summary, 404") {
  running_master m;
  test_client a(m.io);
  REQUIRE(!connect(m.io, m.server->local_address(), a, connect_args{}));
  const auto seg = mount(a, "seg0", 1 << 16, 3);
  REQUIRE(put_start(a, {"k"}, {128}).entries[0].code == 0);
  const auto http = m.server->http_address();
  // A name that is not UTF-8 (from a client) is shown replaced, not thrown on.
  mount(a, "bad\xff", 1 << 16);
  REQUIRE(!http.empty());

  const auto health = http_get(m.io, http, "/health");
  CHECK(health.first == "HTTP/1.1 200 OK");
  CHECK(health.second == "ok\n");

  const auto metrics = http_get(m.io, http, "/metrics");
  CHECK(metrics.first == "HTTP/1.1 200 OK");
  for (const char* line :
       {"kvlink_store_clients 1\n", "kvlink_store_segments 2\n", "kvlink_store_objects 1\n",
        "kvlink_store_puts_in_progress 1\n", "kvlink_store_capacity_bytes 131072\n",
        "kvlink_store_requests_total{type=\"put_start\"} 1\n",
        "kvlink_store_keys_total{type=\"put_start\"} 1\n",
        "kvlink_store_errors_total{code=\"object_not_found\"} 0\n",
        "# TYPE kvlink_store_evicted_objects_total counter\n"}) {
    INFO(line);
    CHECK(metrics.second.find(line) != std::string::npos);
  }

  const auto segments = http_get(m.io, http, "/segments");
  CHECK(segments.first == "HTTP/1.1 200 OK");
  const auto j = nlohmann::json::parse(segments.second);
  REQUIRE(j.is_array());
  REQUIRE(j.size() == 2);
  CHECK(j[0].at("id") == seg);
  CHECK(j[0].at("engine_segment") == 3);
  CHECK(j[0].at("address") == "127.0.0.1:17001");

  // mooncake_master's: the names one per line, and a line for people.
  const auto names = http_get(m.io, http, "/get_all_segments");
  CHECK(names.first == "HTTP/1.1 200 OK");
  CHECK(names.second == "seg0\nbad\ufffd\n");
  const auto summary = http_get(m.io, http, "/metrics/summary?verbose=1");
  CHECK(summary.first == "HTTP/1.1 200 OK");
  CHECK(summary.second.find("Objects: 1 (1 puts in progress) | Segments: 2 | Clients: 1 alive") !=
        std::string::npos);
  CHECK(summary.second.find("/ 0.00 GiB") != std::string::npos);

  CHECK(http_get(m.io, http, "/nope").first == "HTTP/1.1 404 Not Found");
  CHECK(http_get(m.io, http, "/get_all_segments", "POST").first ==
        "HTTP/1.1 405 Method Not Allowed");
  CHECK(http_get(m.io, http, "/health", "POST").first == "HTTP/1.1 405 Method Not Allowed");
}

TEST_CASE("master server: the metadata server keeps values for engines (Mooncake's protocol)") {
  auto opt = test_options();
  CHECK(running_master(opt).server->metadata_address().empty());  // off by default
  opt.metadata_listen = "127.0.0.1:0";
  opt.metadata_max_value = 1 << 20;
  opt.metadata_token = "t0ken";
  running_master m(opt);
  const auto md = m.server->metadata_address();
  REQUIRE(!md.empty());
  const std::string auth = "Authorization: Bearer t0ken\r\n";
  const auto put = [&](const std::string& key, const std::string& value, bool expect) {
    return http_raw(m.io, md,
                    "PUT /metadata?key=" + key + " HTTP/1.1\r\nHost: x\r\n" + auth +
                        "Content-Length: " + std::to_string(value.size()) + "\r\n" +
                        (expect ? "Expect: 100-continue\r\n" : "") + "\r\n" + value);
  };
  const auto get = [&](const std::string& key, const std::string& method = "GET") {
    return http_raw(m.io, md,
                    method + " /metadata?key=" + key + " HTTP/1.1\r\nHost: x\r\n" + auth + "\r\n");
  };
  CHECK(get("seg%2Fa").first == "HTTP/1.1 404 Not Found");
  CHECK(put("seg%2Fa", "{\"v\":1}", false).first == "HTTP/1.1 200 OK");
  CHECK(get("seg/a") == std::pair<std::string, std::string>{"HTTP/1.1 200 OK", "{\"v\":1}"});
  // A value of 300 KiB, its body after "100 Continue" (as curl sends one).
  std::string big(300 << 10, 'x');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>('a' + i % 26);
  CHECK(put("big", big, true).first == "HTTP/1.1 200 OK");
  CHECK(get("big").second == big);
  CHECK(m.server->metadata().size() == 2);
  // Over the limit: 413, nothing kept; no token: 401; no key: 400.
  // (answered from the head: a client that sent "Expect: 100-continue" never sends the body)
  CHECK(http_raw(m.io, md,
                 "PUT /metadata?key=huge HTTP/1.1\r\n" + auth +
                     "Content-Length: 1048577\r\nExpect: 100-continue\r\n\r\n")
            .first == "HTTP/1.1 413 Content Too Large");
  CHECK(http_get(m.io, md, "/metadata?key=seg/a").first == "HTTP/1.1 401 Unauthorized");
  CHECK(get("").first == "HTTP/1.1 400 Bad Request");
  CHECK(http_raw(m.io, md,
                 "PUT /metadata?key=c HTTP/1.1\r\n" + auth +
                     "Transfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n")
            .first == "HTTP/1.1 411 Length Required");
  CHECK(http_raw(m.io, md, "garbage\r\n\r\n").first == "HTTP/1.1 400 Bad Request");
  CHECK(get("seg/a", "DELETE").first == "HTTP/1.1 200 OK");
  CHECK(get("seg/a").first == "HTTP/1.1 404 Not Found");
  CHECK(m.server->metadata().size() == 1);
  // The master's own endpoint does not serve it, and the metadata port
  // serves nothing else.
  CHECK(http_get(m.io, m.server->http_address(), "/metadata?key=big").first ==
        "HTTP/1.1 404 Not Found");
  CHECK(get("big").first == "HTTP/1.1 200 OK");
  CHECK(http_get(m.io, md, "/health").first == "HTTP/1.1 404 Not Found");
}

TEST_CASE("master server: connections beyond max_connections are refused") {
  auto opt = test_options();
  opt.max_connections = 2;
  running_master m(opt);
  const auto addr = m.server->local_address();
  test_client a(m.io), b(m.io), c(m.io);
  REQUIRE(!connect(m.io, addr, a, connect_args{}));
  REQUIRE(!connect(m.io, addr, b, connect_args{}));
  CHECK(connect(m.io, addr, c, connect_args{}));
  CHECK(m.server->service().refused_connections().load() >= 1);
  CHECK(heartbeat(a));
}

TEST_CASE("master server: listen errors carry the address") {
  running_master m;
  auto opt = test_options();
  opt.listen = m.server->local_address();  // taken
  asio::io_context io;
  store::master_server second(io.get_executor(), small_config(), opt);
  try {
    second.listen();
    FAIL("listen on a taken address succeeded");
  } catch (const std::system_error& e) {
    CHECK(std::string(e.what()).find(opt.listen) != std::string::npos);
  }
  opt.listen = "nonsense";
  CHECK_THROWS_AS(store::master_server(io.get_executor(), small_config(), opt), std::system_error);
}
