// Tests of include/kvlink/engine/listener.hpp and the engine's resource
// bounds against slow or hostile peers: connections that never finish their
// handshake are closed, connections are limited per remote address (so one
// address cannot take every file descriptor), control messages announced
// large and sent slowly hold no memory, and unread notifications are
// bounded in bytes. The targets that need their own file descriptor limit
// or a memory reading run as kvlink_test_peer children.
#include <kvlink/engine.hpp>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../../support/peer_process.hpp"
#include "../../support/test_support.hpp"
#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/connect.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>
#include <doctest/doctest.h>

namespace {

using namespace std::chrono_literals;
using kvlink_test::peer_process;
using kvlink_test::run_until;

asio::ip::tcp::endpoint endpoint_of(const std::string& address) {
  std::string_view host;
  std::uint16_t port = 0;
  REQUIRE(kvlink::split_host_port(address, host, port));
  return {asio::ip::make_address(std::string(host)), port};
}

// A connection from `source` (a loopback address of our choosing).
asio::ip::tcp::socket open_from(asio::io_context& io, const std::string& source,
                                const asio::ip::tcp::endpoint& to) {
  asio::ip::tcp::socket s{io};
  s.open(asio::ip::tcp::v4());
  s.bind({asio::ip::make_address(source), 0});
  std::error_code ec;
  s.connect(to, ec);
  REQUIRE_MESSAGE(!ec, ec.message());
  return s;
}

// Whether the other side closed `s` (EOF or reset) within `limit`.
bool closed_by_peer(asio::ip::tcp::socket& s, std::chrono::milliseconds limit) {
  s.non_blocking(true);
  const auto until = std::chrono::steady_clock::now() + limit;
  std::array<char, 64> b{};
  while (std::chrono::steady_clock::now() < until) {
    std::error_code ec;
    const auto n = s.read_some(asio::buffer(b), ec);
    if (ec == asio::error::would_block) {
      std::this_thread::sleep_for(5ms);
      continue;
    }
    if (ec) return true;  // eof, reset
    (void)n;              // an error reply: keep reading until the close
  }
  return false;
}

kvlink::config quick() {
  kvlink::config c;
  c.fence_timeout = 200ms;
  c.connect_timeout = 2s;
  return c;
}

}  // namespace

TEST_CASE("connections that never finish their handshake are closed after handshake_timeout") {
  asio::io_context io;
  auto cfg = quick();
  cfg.handshake_timeout = 300ms;
  kvlink::tcp_engine target{io.get_executor(), cfg};
  const auto to = endpoint_of(target.local_address());
  std::vector<asio::ip::tcp::socket> idle;
  for (int i = 0; i < 200; ++i) idle.push_back(open_from(io, "127.0.0.1", to));
  // A slow hello: one byte, then nothing.
  asio::write(idle[0], asio::buffer("K", 1));
  const auto t0 = std::chrono::steady_clock::now();
  std::thread runner([&io] { io.run_for(3s); });
  int closed = 0;
  for (auto& s : idle) closed += closed_by_peer(s, 3s) ? 1 : 0;
  const auto took = std::chrono::steady_clock::now() - t0;
  runner.join();
  CHECK(closed == 200);
  CHECK(took < 2s);
}

TEST_CASE("one remote address cannot take every connection: limits per address and in total") {
  // The target runs with 256 file descriptors; a hostile client from
  // 127.0.0.2 opens more connections than that and holds them (its
  // handshakes never finish within the test). A well-behaved engine from
  // 127.0.0.1 still connects and moves bytes.
  peer_process target{
      {"--size", "1048576", "--nofile", "256", "--config", R"({"handshake_timeout": "60s"})"}};
  asio::io_context io;
  const auto to = endpoint_of(target.address());
  std::vector<asio::ip::tcp::socket> hostile;
  for (int i = 0; i < 300; ++i) {
    asio::ip::tcp::socket s{io};
    s.open(asio::ip::tcp::v4());
    s.bind({asio::ip::make_address("127.0.0.2"), 0});
    std::error_code ec;
    s.connect(to, ec);  // the kernel accepts into the backlog; the target then refuses
    if (!ec) hostile.push_back(std::move(s));
  }
  std::this_thread::sleep_for(300ms);
  kvlink::tcp_engine good{io.get_executor(), quick()};
  std::vector<std::byte> mem(1u << 20);
  good.register_segment(mem.data(), mem.size());
  std::optional<std::pair<std::error_code, kvlink::peer>> c;
  good.async_connect(target.address(),
                     [&](std::error_code ec, kvlink::peer p) { c.emplace(ec, p); });
  REQUIRE(run_until(
      io, [&] { return c.has_value(); }, 30s));
  REQUIRE_MESSAGE(!c->first, c->first.message());
  kvlink_test::fill_pattern(mem.data(), mem.size(), 5, 0);
  std::optional<std::error_code> w;
  good.async_submit_transfer(
      std::vector<kvlink::transfer_request>{
          {kvlink::opcode::write, mem.data(), c->second.segment(0), 0, mem.size()}},
      [&](std::error_code ec, kvlink::transfer_result) { w = ec; });
  REQUIRE(run_until(
      io, [&] { return w.has_value(); }, 30s));
  CHECK_FALSE(*w);
  CHECK(target.command("CHECK 0 1048576 5") == "OK");
  // And the hostile address got at most its share: the rest were closed.
  int refused = 0;
  for (auto& s : hostile) refused += closed_by_peer(s, 20ms) ? 1 : 0;
  MESSAGE("hostile connections refused: " << refused << " of " << hostile.size());
  CHECK(refused > 0);
}

TEST_CASE("control messages announced large and sent slowly hold no memory") {
  // 400 connections each complete a handshake, announce a 1 MiB control
  // message and send one byte of it. The target buffers what arrived (and
  // at most max_control_buffer in all), not what was announced.
  peer_process target{{"--size", "4096"}};
  const auto rss = [&] { return std::stoull(target.command("RSS")); };
  asio::io_context io;
  const auto to = endpoint_of(target.address());
  const auto before = rss();
  std::vector<asio::ip::tcp::socket> stalled;
  for (int i = 0; i < 400; ++i) {
    auto s = open_from(io, "127.0.0.1", to);
    const auto hello = kvlink::control::make_hello(
        kvlink::protocol_version, kvlink::instance_id{1, static_cast<std::uint64_t>(i + 1)},
        kvlink::control::role::control);
    asio::write(s, asio::buffer(kvlink::control::encode_message(hello)));
    nlohmann::json welcome;
    kvlink::control::prefix_bytes prefix{};
    asio::read(s, asio::buffer(prefix));
    std::uint32_t len = 0;
    REQUIRE_FALSE(kvlink::control::decode_prefix(prefix, 1u << 20, len));
    std::string body(len, '\0');
    asio::read(s, asio::buffer(body));
    const auto announce = kvlink::control::encode_prefix(1u << 20);
    asio::write(s, asio::buffer(announce));
    asio::write(s, asio::buffer("{", 1));
    stalled.push_back(std::move(s));
  }
  std::this_thread::sleep_for(500ms);
  const auto after = rss();
  MESSAGE("target RSS " << before << " KiB before, " << after << " KiB with 400 stalled 1 MiB "
                        << "messages");
  CHECK(after < before + 96 * 1024);              // was about 400 MiB more
  CHECK(target.command("CHECK 0 16 1") == "OK");  // still serving
}

TEST_CASE("unread notifications are bounded in bytes; the sender is refused beyond") {
  asio::io_context io;
  auto tcfg = quick();
  tcfg.max_notification_bytes = 256u << 10;
  kvlink::tcp_engine target{io.get_executor(), tcfg};
  kvlink::tcp_engine sender{io.get_executor(), quick()};
  std::optional<kvlink::peer> p;
  sender.async_connect(target.local_address(), [&](std::error_code ec, kvlink::peer x) {
    REQUIRE_FALSE(ec);
    p = x;
  });
  REQUIRE(run_until(io, [&] { return p.has_value(); }));
  const std::string payload(4000, 'n');
  int sent = 0;
  for (int i = 0; i < 1000 && p->connected(); ++i) {
    std::optional<std::error_code> r;
    sender.async_send_notification(*p, kvlink::notification{"n", payload},
                                   [&](std::error_code ec) { r = ec; });
    REQUIRE(run_until(io, [&] { return r.has_value(); }));
    if (*r) break;
    ++sent;
    for (int k = 0; k < 3; ++k) io.poll();
  }
  REQUIRE(run_until(
      io, [&] { return !p->connected(); }, 10s));  // refused, not buffered
  // What the target kept fits the bound.
  std::uint64_t kept = 0;
  for (;;) {
    std::optional<std::pair<std::error_code, kvlink::notification>> n;
    asio::cancellation_signal sig;
    target.async_receive_notification(asio::bind_cancellation_slot(
        sig.slot(), [&](std::error_code ec, kvlink::notification x) { n.emplace(ec, x); }));
    for (int k = 0; k < 20 && !n; ++k) io.run_one_for(1ms);
    if (!n) {
      sig.emit(asio::cancellation_type::terminal);
      REQUIRE(run_until(io, [&] { return n.has_value(); }));
      break;
    }
    kept += n->second.id.size() + n->second.payload.size();
  }
  MESSAGE("sent " << sent << " notifications of 4 KB; the target kept " << kept << " bytes");
  CHECK(kept <= tcfg.max_notification_bytes);
  CHECK(kept > 0);
}
