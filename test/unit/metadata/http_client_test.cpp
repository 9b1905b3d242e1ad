#include <kvlink/metadata/http_client.hpp>

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "../../support/test_support.hpp"
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read_until.hpp>
#include <asio/steady_timer.hpp>
#include <asio/write.hpp>
#include <doctest/doctest.h>

namespace http = kvlink::detail::http;
using namespace std::chrono_literals;

TEST_CASE("base64 and query escaping") {
  const std::vector<std::string> samples{"",     "f",     "fo",     "foo",
                                         "foob", "fooba", "foobar", std::string("\0\xff\x10", 3)};
  for (const auto& s : samples) {
    CAPTURE(s);
    const auto back = http::base64_decode(http::base64_encode(s));
    REQUIRE(back);
    CHECK(*back == s);
  }
  CHECK(http::base64_encode("foobar") == "Zm9vYmFy");
  CHECK(http::base64_encode("kv/") == "a3Yv");
  CHECK(*http::base64_decode("a3YveA") == "kv/x");  // unpadded
  CHECK_FALSE(http::base64_decode("a3Y*"));
  CHECK_FALSE(http::base64_decode("a"));
  CHECK(http::query_escape("kvlink/engines/decode 3&x=é") ==
        "kvlink%2Fengines%2Fdecode%203%26x%3D%C3%A9");
}

TEST_CASE("response heads: status, headers, limits") {
  http::response r;
  std::size_t used = 0;
  bool complete = false;
  const std::string head = "HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\nX-A:  b \r\n\r\nabc";
  CHECK_FALSE(http::parse_head(head.substr(0, 20), 1024, r, used, complete));
  CHECK_FALSE(complete);
  REQUIRE_FALSE(http::parse_head(head, 1024, r, used, complete));
  REQUIRE(complete);
  CHECK(r.status == 404);
  CHECK(used == head.size() - 3);
  REQUIRE(r.find("x-a"));
  CHECK(*r.find("X-A") == "b");
  CHECK(http::parse_head("HTTP/1.1 2x0 OK\r\n\r\n", 1024, r, used, complete) ==
        kvlink::errc::malformed_message);
  CHECK(http::parse_head("SSH-2.0-x\r\n\r\n", 1024, r, used, complete) ==
        kvlink::errc::malformed_message);
  CHECK(http::parse_head(std::string(2000, 'x'), 1024, r, used, complete) ==
        kvlink::errc::message_too_large);
  // HTTP/1.0 closes unless it says otherwise.
  REQUIRE_FALSE(http::parse_head("HTTP/1.0 200 OK\r\n\r\n", 1024, r, used, complete));
  http::body_reader b;
  REQUIRE_FALSE(b.start(r, false));
  CHECK_FALSE(b.keep_alive());
}

TEST_CASE("chunked bodies decode the same however the bytes are split") {
  const std::string wire =
      "4\r\nWiki\r\n7;ext=1\r\npedia i\r\nB\r\nn \r\nchunks.\r\n0\r\nTrailer: x\r\n\r\n";
  http::response head;
  head.status = 200;
  head.headers.push_back({"Transfer-Encoding", "chunked"});
  for (std::size_t step = 1; step <= wire.size(); ++step) {
    CAPTURE(step);
    http::body_reader b;
    REQUIRE_FALSE(b.start(head, false));
    std::string in, out;
    for (std::size_t at = 0; at < wire.size() && !b.done(); at += step) {
      in += wire.substr(at, step);
      REQUIRE_FALSE(b.feed(in, out));
    }
    CHECK(b.done());
    CHECK(out == "Wikipedia in \r\nchunks.");
    CHECK(b.keep_alive());
  }
  http::body_reader bad;
  REQUIRE_FALSE(bad.start(head, false));
  std::string in = "zz\r\n", out;
  CHECK(bad.feed(in, out) == kvlink::errc::malformed_message);
}

namespace {

// A scripted HTTP server on loopback: answers each request with the next
// scripted response ("HANG": never answer; "CLOSE": close the connection).
struct script_server {
  asio::io_context& io;
  asio::ip::tcp::acceptor acceptor;
  std::deque<std::string> script;
  std::vector<std::string> requests;
  int connections = 0;

  explicit script_server(asio::io_context& ctx)
      : io(ctx), acceptor(ctx, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)) {
    asio::co_spawn(io, accept_loop(), asio::detached);
  }
  std::uint16_t port() const { return acceptor.local_endpoint().port(); }

  asio::awaitable<void> accept_loop() {
    for (;;) {
      auto [ec, s] = co_await acceptor.async_accept(http::nothrow);
      if (ec) co_return;
      ++connections;
      asio::co_spawn(io, serve(std::make_shared<asio::ip::tcp::socket>(std::move(s))),
                     asio::detached);
    }
  }

  asio::awaitable<void> serve(std::shared_ptr<asio::ip::tcp::socket> s) {
    std::string buf;
    for (;;) {
      auto [ec, n] =
          co_await asio::async_read_until(*s, asio::dynamic_buffer(buf), "\r\n\r\n", http::nothrow);
      if (ec) co_return;
      std::string req = buf.substr(0, n);
      buf.erase(0, n);
      const auto cl = req.find("Content-Length: ");
      if (cl != std::string::npos) {
        const std::size_t len = std::stoul(req.substr(cl + 16));
        while (buf.size() < len) {
          char tmp[4096];
          auto [rec, m] = co_await s->async_read_some(asio::buffer(tmp), http::nothrow);
          if (rec) co_return;
          buf.append(tmp, m);
        }
        req += buf.substr(0, len);
        buf.erase(0, len);
      }
      requests.push_back(req);
      if (script.empty()) co_return;
      const std::string answer = script.front();
      script.pop_front();
      if (answer == "HANG") {
        asio::steady_timer t(io, 10s);
        co_await t.async_wait(http::nothrow);
        co_return;
      }
      if (answer == "CLOSE") co_return;
      // Dribble it out in small pieces.
      for (std::size_t at = 0; at < answer.size(); at += 7) {
        const std::string piece = answer.substr(at, 7);
        auto [wec, w] = co_await asio::async_write(*s, asio::buffer(piece), http::nothrow);
        (void)w;
        if (wec) co_return;
      }
      if (answer.find("Connection: close") != std::string::npos ||
          answer.rfind("HTTP/1.0", 0) == 0) {
        co_return;
      }
    }
  }
};

struct exchange_result {
  std::error_code ec;
  http::response resp;
  std::string streamed;
  bool done = false;
};

void run_exchange(asio::io_context& io, http::connection& c, const http::request& req,
                  exchange_result& out, std::chrono::milliseconds timeout, bool stream = false) {
  out = exchange_result{};
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        http::connection::body_fn sink;
        if (stream) {
          sink = [&out](std::string_view piece) {
            out.streamed.append(piece);
            return true;
          };
        }
        out.ec = co_await c.exchange(req, out.resp, timeout, sink);
        out.done = true;
      },
      asio::detached);
  REQUIRE(kvlink_test::run_until(
      io, [&] { return out.done; }, 30s));
}

}  // namespace

TEST_CASE("connection: keep-alive, chunked streams, a closed idle connection, timeouts") {
  asio::io_context io;
  script_server server(io);
  http::connection c(io.get_executor(), "127.0.0.1", server.port(), nullptr);
  http::request req{"POST", "/v3/kv/range", {{"Content-Type", "application/json"}}, "{\"k\":1}"};
  exchange_result r;

  // Two requests, one connection.
  server.script = {"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
                   "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"};
  run_exchange(io, c, req, r, 2s);
  CHECK_FALSE(r.ec);
  CHECK(r.resp.status == 200);
  CHECK(r.resp.body == "hello");
  run_exchange(io, c, req, r, 2s);
  CHECK_FALSE(r.ec);
  CHECK(r.resp.body == "abc");
  CHECK(server.connections == 1);
  REQUIRE(server.requests.size() == 2);
  CHECK(server.requests[0].rfind("POST /v3/kv/range HTTP/1.1\r\n", 0) == 0);
  CHECK(server.requests[0].find("Content-Length: 7\r\n") != std::string::npos);
  CHECK(server.requests[0].find("\r\n\r\n{\"k\":1}") != std::string::npos);

  // A streamed body goes to the callback as it comes.
  server.script = {
      "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
      "6\r\n{\"a\":1\r\n2\r\n}\n\r\n6\r\n{\"b\":2\r\n2\r\n}\n\r\n0\r\n\r\n"};
  run_exchange(io, c, req, r, 2s, true);
  CHECK_FALSE(r.ec);
  CHECK(r.streamed == "{\"a\":1}\n{\"b\":2}\n");
  CHECK(r.resp.body.empty());

  // The server drops the connection without answering: the request is sent
  // again once, on a new connection.
  server.script = {"CLOSE", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"};
  const int before = server.connections;
  run_exchange(io, c, req, r, 2s);
  CHECK_FALSE(r.ec);
  CHECK(r.resp.body == "ok");
  CHECK(server.connections == before + 1);

  // A body that ends with the connection (HTTP/1.0).
  server.script = {"HTTP/1.0 200 OK\r\n\r\nuntil close"};
  run_exchange(io, c, req, r, 2s);
  CHECK_FALSE(r.ec);
  CHECK(r.resp.body == "until close");
  CHECK_FALSE(c.is_open());

  // No answer: timed out, within about the timeout.
  server.script = {"HANG"};
  const auto t0 = std::chrono::steady_clock::now();
  run_exchange(io, c, req, r, 300ms);
  CHECK(r.ec == asio::error::timed_out);
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);

  // Garbage instead of HTTP.
  server.script = {"SSH-2.0-OpenSSH\r\n\r\n"};
  run_exchange(io, c, req, r, 2s);
  CHECK(r.ec == kvlink::errc::malformed_message);

  // Nobody listening.
  const auto port = server.port();
  server.acceptor.close();
  http::connection gone(io.get_executor(), "127.0.0.1", port, nullptr);
  run_exchange(io, gone, req, r, 2s);
  CHECK(r.ec == asio::error::connection_refused);
}
