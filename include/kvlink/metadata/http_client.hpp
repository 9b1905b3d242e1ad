// The small HTTP/1.1 client the store backends share (metadata/etcd.hpp
// talks to etcd's JSON gateway with it, metadata/http.hpp to Mooncake's
// metadata server): one persistent connection per `connection`, requests
// one at a time, Content-Length, chunked and read-until-close bodies, a
// body streamed to a callback as it arrives (etcd's watch), a timeout on
// every step, optional TLS through a context that metadata/tls.hpp makes
// (OpenSSL stays out of programs that do not include it).
//
//   http::connection c(strand, "127.0.0.1", 2379, nullptr);
//   http::request req{"POST", "/v3/kv/range", {}, R"({"key":"Zm9v"})"};
//   http::response resp;
//   std::error_code ec = co_await c.exchange(req, resp, 3s);
//
// Everything runs on the executor given to the connection (the engine's
// strand): no thread, no blocking call. Not thread-safe; one exchange at a
// time per connection.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/detail/text.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>
#include <asio/connect.hpp>
#include <asio/error.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>

namespace kvlink::detail::http {

inline constexpr auto nothrow = asio::experimental::as_tuple(asio::use_awaitable);

// ---------------------------------------------------------------- text

/// Base64 (RFC 4648, padded), what etcd's gateway uses for keys and values.
inline std::string base64_encode(std::string_view in) {
  static constexpr char table[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    const std::uint32_t v = (std::uint32_t{static_cast<unsigned char>(in[i])} << 16) |
                            (std::uint32_t{static_cast<unsigned char>(in[i + 1])} << 8) |
                            std::uint32_t{static_cast<unsigned char>(in[i + 2])};
    out += table[(v >> 18) & 63];
    out += table[(v >> 12) & 63];
    out += table[(v >> 6) & 63];
    out += table[v & 63];
  }
  if (const std::size_t left = in.size() - i; left > 0) {
    std::uint32_t v = std::uint32_t{static_cast<unsigned char>(in[i])} << 16;
    if (left == 2) v |= std::uint32_t{static_cast<unsigned char>(in[i + 1])} << 8;
    out += table[(v >> 18) & 63];
    out += table[(v >> 12) & 63];
    out += left == 2 ? table[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

/// Decodes padded or unpadded base64; nullopt for anything else.
inline std::optional<std::string> base64_decode(std::string_view in) {
  const auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  while (!in.empty() && in.back() == '=') in.remove_suffix(1);
  if (in.size() % 4 == 1) return std::nullopt;
  std::string out;
  out.reserve(in.size() * 3 / 4);
  std::uint32_t acc = 0;
  int bits = 0;
  for (const char c : in) {
    const int v = value(c);
    if (v < 0) return std::nullopt;
    acc = (acc << 6) | static_cast<std::uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xffu);
    }
  }
  return out;
}

/// Percent-encodes a query value: everything but RFC 3986's unreserved
/// characters (A-Z a-z 0-9 - . _ ~).
inline std::string query_escape(std::string_view in) {
  static constexpr char hex[] = "0123456789ABCDEF";
  std::string out;
  for (const char c : in) {
    const auto u = static_cast<unsigned char>(c);
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
        c == '.' || c == '_' || c == '~') {
      out += c;
    } else {
      out += '%';
      out += hex[u >> 4];
      out += hex[u & 15];
    }
  }
  return out;
}

// ---------------------------------------------------------------- messages

struct header {
  std::string name;
  std::string value;
};

struct request {
  std::string method = "GET";
  std::string target = "/";  ///< path and query
  std::vector<header> headers{};
  std::string body{};
};

struct response {
  int status = 0;
  std::vector<header> headers{};
  std::string body{};  ///< empty when the body was streamed to a callback

  /// The first header called `name` (case-insensitive), or nullptr.
  const std::string* find(std::string_view name) const {
    for (const auto& h : headers) {
      if (iequals(h.name, name)) return &h.value;
    }
    return nullptr;
  }
};

struct limits {
  std::size_t max_head = 64 << 10;  ///< status line and headers
  std::size_t max_body = 64 << 20;  ///< a whole body (not a streamed one)
};

// ---------------------------------------------------------------- parsing

namespace parse {

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

inline bool has_token(std::string_view list, std::string_view token) {
  for (const auto& item : split_list(list)) {
    if (iequals(trim(item), token)) return true;
  }
  return false;
}

}  // namespace parse

/// Parses the status line and headers at the start of `in`. `complete` is
/// false (and nothing is consumed) while the blank line that ends them has
/// not arrived. Errors: malformed_message; message_too_large past `max_head`.
inline std::error_code parse_head(std::string_view in, std::size_t max_head, response& out,
                                  std::size_t& consumed, bool& complete) {
  complete = false;
  consumed = 0;
  const std::size_t end = in.find("\r\n\r\n");
  if (end == std::string_view::npos) {
    return in.size() > max_head ? std::error_code{errc::message_too_large} : std::error_code{};
  }
  if (end + 4 > max_head) return errc::message_too_large;
  std::string_view head = in.substr(0, end + 2);
  std::size_t eol = head.find("\r\n");
  const std::string_view status_line = head.substr(0, eol);
  // "HTTP/1.1 200 OK"
  if (status_line.rfind("HTTP/1.", 0) != 0 || status_line.size() < 12 || status_line[8] != ' ') {
    return errc::malformed_message;
  }
  int status = 0;
  const auto digits = status_line.substr(9, 3);
  const auto [p, e] = std::from_chars(digits.data(), digits.data() + digits.size(), status);
  if (e != std::errc{} || p != digits.data() + 3 || status < 100 || status > 999) {
    return errc::malformed_message;
  }
  out = response{};
  out.status = status;
  const bool http10 = status_line[7] == '0';
  head.remove_prefix(eol + 2);
  while (!head.empty()) {
    eol = head.find("\r\n");
    const std::string_view line = head.substr(0, eol);
    head.remove_prefix(eol + 2);
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) return errc::malformed_message;
    out.headers.push_back(header{std::string(line.substr(0, colon)),
                                 std::string(parse::trim(line.substr(colon + 1)))});
  }
  if (http10 && out.find("connection") == nullptr) {
    out.headers.push_back(header{"Connection", "close"});  // 1.0 closes unless it says otherwise
  }
  consumed = end + 4;
  complete = true;
  return {};
}

/// Decodes a response body after its head: by Content-Length, chunked, or
/// until the connection closes. Pure; fed whatever bytes arrived.
class body_reader {
 public:
  enum class framing : std::uint8_t { none, length, chunked, until_close };

  /// Chooses the framing from the head (and whether the request was HEAD).
  std::error_code start(const response& head, bool head_request) {
    done_ = false;
    left_ = 0;
    step_ = chunk_step::size;
    const auto* conn = head.find("connection");
    keep_alive_ = conn == nullptr || !parse::has_token(*conn, "close");
    if (head_request || head.status / 100 == 1 || head.status == 204 || head.status == 304) {
      mode_ = framing::none;
      done_ = true;
      return {};
    }
    if (const auto* te = head.find("transfer-encoding")) {
      if (!parse::has_token(*te, "chunked")) return errc::malformed_message;
      mode_ = framing::chunked;
      return {};
    }
    if (const auto* cl = head.find("content-length")) {
      std::uint64_t n = 0;
      const auto [p, e] = std::from_chars(cl->data(), cl->data() + cl->size(), n);
      if (e != std::errc{} || p != cl->data() + cl->size()) return errc::malformed_message;
      mode_ = framing::length;
      left_ = n;
      done_ = n == 0;
      return {};
    }
    mode_ = framing::until_close;
    keep_alive_ = false;
    return {};
  }

  /// Moves body bytes from the front of `in` to `out` (consumed bytes are
  /// erased from `in`); done() once the body is complete.
  std::error_code feed(std::string& in, std::string& out) {
    switch (mode_) {
      case framing::none:
        return {};
      case framing::until_close:
        out += in;
        in.clear();
        return {};
      case framing::length: {
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(left_, in.size()));
        out.append(in, 0, n);
        in.erase(0, n);
        left_ -= n;
        done_ = left_ == 0;
        return {};
      }
      case framing::chunked:
        return feed_chunked(in, out);
    }
    return {};
  }

  /// The connection closed: whether that ends the body cleanly.
  bool ended_by_close() {
    if (mode_ != framing::until_close) return done_;
    done_ = true;
    return true;
  }

  bool done() const noexcept { return done_; }
  /// Whether the connection may carry another request afterwards.
  bool keep_alive() const noexcept { return keep_alive_; }

 private:
  enum class chunk_step : std::uint8_t { size, data, data_end, trailers };

  std::error_code feed_chunked(std::string& in, std::string& out) {
    std::size_t pos = 0;
    while (!done_) {
      if (step_ == chunk_step::size || step_ == chunk_step::trailers) {
        const std::size_t eol = in.find("\r\n", pos);
        if (eol == std::string::npos) {
          if (in.size() - pos > 4096) return errc::malformed_message;  // a size line, not data
          break;
        }
        const std::string_view line(in.data() + pos, eol - pos);
        pos = eol + 2;
        if (step_ == chunk_step::trailers) {
          if (line.empty()) done_ = true;  // trailers (ignored) end with a blank line
          continue;
        }
        const std::string_view size_text = parse::trim(line.substr(0, line.find(';')));
        std::uint64_t n = 0;
        const auto [p, e] =
            std::from_chars(size_text.data(), size_text.data() + size_text.size(), n, 16);
        if (size_text.empty() || e != std::errc{} || p != size_text.data() + size_text.size()) {
          return errc::malformed_message;
        }
        left_ = n;
        step_ = n == 0 ? chunk_step::trailers : chunk_step::data;
        continue;
      }
      if (step_ == chunk_step::data) {
        const std::size_t n =
            static_cast<std::size_t>(std::min<std::uint64_t>(left_, in.size() - pos));
        out.append(in, pos, n);
        pos += n;
        left_ -= n;
        if (left_ > 0) break;
        step_ = chunk_step::data_end;
        continue;
      }
      // data_end: the CRLF after a chunk's data
      if (in.size() - pos < 2) break;
      if (in.compare(pos, 2, "\r\n") != 0) return errc::malformed_message;
      pos += 2;
      step_ = chunk_step::size;
    }
    in.erase(0, pos);
    return {};
  }

  framing mode_ = framing::none;
  chunk_step step_ = chunk_step::size;
  std::uint64_t left_ = 0;
  bool done_ = false;
  bool keep_alive_ = true;
};

/// "METHOD target HTTP/1.1" with Host, Content-Length and the request's headers.
inline std::string serialize(const request& req, std::string_view host_header) {
  std::string out;
  out.reserve(128 + req.body.size());
  out += req.method;
  out += ' ';
  out += req.target;
  out += " HTTP/1.1\r\nHost: ";
  out += host_header;
  out += "\r\n";
  for (const auto& h : req.headers) {
    out += h.name;
    out += ": ";
    out += h.value;
    out += "\r\n";
  }
  if (!req.body.empty() || req.method == "POST" || req.method == "PUT") {
    out += "Content-Length: ";
    out += std::to_string(req.body.size());
    out += "\r\n";
  }
  out += "\r\n";
  out += req.body;
  return out;
}

// ---------------------------------------------------------------- streams

/// A connected byte stream: plain TCP, or TLS (metadata/tls.hpp).
class stream {
 public:
  virtual ~stream() = default;
  /// Connects to one of `endpoints` (and runs the TLS handshake).
  virtual asio::awaitable<std::error_code> connect(
      const asio::ip::tcp::resolver::results_type& endpoints) = 0;
  virtual asio::awaitable<std::size_t> read_some(asio::mutable_buffer b, std::error_code& ec) = 0;
  virtual asio::awaitable<std::error_code> write_all(asio::const_buffer b) = 0;
  /// Makes every pending operation finish (with an error); idempotent.
  virtual void close() noexcept = 0;
};

class tcp_stream final : public stream {
 public:
  explicit tcp_stream(const asio::any_io_executor& ex) : socket_(ex) {}

  asio::awaitable<std::error_code> connect(
      const asio::ip::tcp::resolver::results_type& endpoints) override {
    auto [ec, ep] = co_await asio::async_connect(socket_, endpoints, nothrow);
    (void)ep;
    if (!ec) {
      std::error_code ignored;
      socket_.set_option(asio::ip::tcp::no_delay{true}, ignored);
    }
    co_return ec;
  }
  asio::awaitable<std::size_t> read_some(asio::mutable_buffer b, std::error_code& ec) override {
    auto [e, n] = co_await socket_.async_read_some(b, nothrow);
    ec = e;
    co_return n;
  }
  asio::awaitable<std::error_code> write_all(asio::const_buffer b) override {
    auto [e, n] = co_await asio::async_write(socket_, b, nothrow);
    (void)n;
    co_return e;
  }
  void close() noexcept override {
    std::error_code ignored;
    socket_.close(ignored);
  }

 private:
  asio::ip::tcp::socket socket_;
};

/// The TLS files of a store connection.
struct tls_files {
  std::string ca;    ///< PEM CA bundle; empty = the system's default paths
  std::string cert;  ///< PEM client certificate chain; empty = none
  std::string key;   ///< its private key
};

/// What metadata/tls.hpp provides: a loaded TLS client context that makes
/// streams checking the server's certificate against `host`.
class tls_context {
 public:
  virtual ~tls_context() = default;
  virtual std::shared_ptr<stream> make_stream(const asio::any_io_executor& ex,
                                              const std::string& host) = 0;
};

/// Loads `files` into a context (reads the files: a set-up step). nullptr
/// with `what` set on failure.
using tls_loader = std::shared_ptr<tls_context> (*)(const tls_files& files, std::string& what);

/// The program's TLS support: set by including <kvlink/metadata/tls.hpp>
/// (and linking kvlink::tls); null without it.
inline tls_loader& tls_support() noexcept {
  static tls_loader loader = nullptr;
  return loader;
}

// ---------------------------------------------------------------- connection

/// Closes a stream if a step takes longer than its timeout.
class stream_timer {
 public:
  stream_timer(const asio::any_io_executor& ex, const std::shared_ptr<stream>& s,
               std::chrono::milliseconds timeout)
      : timer_(ex), state_(std::make_shared<state>()) {
    state_->target = s;
    timer_.expires_after(timeout);
    timer_.async_wait([st = state_](std::error_code ec) {
      if (ec || !st->active) return;
      st->fired = true;
      if (auto target = st->target.lock()) target->close();
    });
  }
  ~stream_timer() { disarm(); }
  stream_timer(const stream_timer&) = delete;
  stream_timer& operator=(const stream_timer&) = delete;

  void disarm() {
    state_->active = false;
    timer_.cancel();
  }
  bool fired() const noexcept { return state_->fired; }

 private:
  struct state {
    std::weak_ptr<stream> target;
    bool active = true;
    bool fired = false;
  };
  asio::steady_timer timer_;
  std::shared_ptr<state> state_;
};

/// One persistent HTTP/1.1 connection to host:port, opened when first
/// needed and again after it closed.
class connection {
 public:
  /// Called with each piece of a streamed body; false stops reading.
  using body_fn = std::function<bool(std::string_view)>;

  connection(asio::any_io_executor ex, std::string host, std::uint16_t port,
             std::shared_ptr<tls_context> tls, limits lim = {})
      : ex_(std::move(ex)),
        host_(std::move(host)),
        port_(port),
        tls_(std::move(tls)),
        limits_(lim) {
    host_header_ = host_.find(':') != std::string::npos ? "[" + host_ + "]" : host_;
    host_header_ += ":" + std::to_string(port_);
  }
  ~connection() { close(); }
  connection(const connection&) = delete;
  connection& operator=(const connection&) = delete;

  /// "host:port", for messages.
  const std::string& where() const noexcept { return host_header_; }

  /// Sends `req` and reads the response into `out`. With `on_body`, the
  /// body is handed to it as it arrives (out.body stays empty) and
  /// `timeout` bounds connecting, sending and the head only; otherwise it
  /// bounds each step of the whole exchange. A reused connection that the
  /// server had closed is reopened and the request sent once more. Errors:
  /// the socket's (connection_refused, ...), asio::error::timed_out,
  /// malformed_message, message_too_large; on any error the connection is
  /// closed.
  asio::awaitable<std::error_code> exchange(const request& req, response& out,
                                            std::chrono::milliseconds timeout,
                                            body_fn on_body = {}) {
    for (int attempt = 0;; ++attempt) {
      if (shut_) co_return std::error_code{asio::error::operation_aborted};
      const bool reused = stream_ != nullptr;
      bool got_bytes = false;
      const std::error_code ec = co_await exchange_once(req, out, timeout, on_body, got_bytes);
      if (!ec) co_return ec;
      close();
      // Only a kept-alive connection the server had closed meanwhile is
      // worth one more try; a server that does not answer is not.
      if (!(reused && !got_bytes && attempt == 0 && ec != asio::error::timed_out)) co_return ec;
    }
  }

  /// Closes the connection; a pending exchange finishes with an error.
  void close() noexcept {
    if (stream_) stream_->close();
    stream_.reset();
    in_.clear();
  }

  bool is_open() const noexcept { return stream_ != nullptr; }
  /// Whether a streamed body is being read.
  bool streaming() const noexcept { return streaming_; }

  /// Closes it for good: pending and later exchanges fail (operation_aborted).
  void shutdown() noexcept {
    shut_ = true;
    close();
  }

 private:
  asio::awaitable<std::error_code> open(std::chrono::milliseconds timeout) {
    std::shared_ptr<stream> s;
    if (tls_) {
      s = tls_->make_stream(ex_, host_);
    } else {
      s = std::make_shared<tcp_stream>(ex_);
    }
    stream_timer timer(ex_, s, timeout);
    asio::ip::tcp::resolver resolver(ex_);
    const std::string port_text = std::to_string(port_);
    auto [rec, eps] = co_await resolver.async_resolve(host_, port_text, nothrow);
    if (rec) co_return rec;
    if (timer.fired()) co_return asio::error::timed_out;
    const std::error_code ec = co_await s->connect(eps);
    if (timer.fired()) co_return asio::error::timed_out;
    if (ec) co_return ec;
    if (shut_) co_return std::error_code{asio::error::operation_aborted};
    stream_ = std::move(s);
    in_.clear();
    co_return std::error_code{};
  }

  asio::awaitable<std::error_code> exchange_once(const request& req, response& out,
                                                 std::chrono::milliseconds timeout,
                                                 const body_fn& on_body, bool& got_bytes) {
    if (!stream_) {
      if (auto ec = co_await open(timeout)) co_return ec;
    }
    const auto s = stream_;  // keeps it alive across a close() while suspended
    stream_timer timer(ex_, s, timeout);
    const std::string bytes = serialize(req, host_header_);
    const asio::const_buffer out_bytes(bytes.data(), bytes.size());
    if (auto ec = co_await s->write_all(out_bytes)) {
      co_return timer.fired() ? std::error_code{asio::error::timed_out} : ec;
    }
    // The head.
    bool complete = false;
    std::size_t consumed = 0;
    for (;;) {
      if (auto ec = parse_head(in_, limits_.max_head, out, consumed, complete)) co_return ec;
      if (complete) break;
      const std::error_code ec = co_await read_more(*s);
      if (ec) co_return timer.fired() ? std::error_code{asio::error::timed_out} : ec;
      got_bytes = true;
    }
    got_bytes = true;
    in_.erase(0, consumed);
    body_reader body;
    if (auto ec = body.start(out, req.method == "HEAD")) co_return ec;
    if (on_body) timer.disarm();  // a stream may be quiet for as long as it likes
    streaming_ = static_cast<bool>(on_body);
    struct not_streaming {
      bool& flag;
      ~not_streaming() { flag = false; }
    } reset_flag{streaming_};
    std::string piece;
    for (;;) {
      piece.clear();
      if (auto ec = body.feed(in_, piece)) co_return ec;
      if (!piece.empty()) {
        if (on_body) {
          if (!on_body(piece)) co_return std::error_code{errc::cancelled};
        } else {
          if (out.body.size() + piece.size() > limits_.max_body) co_return errc::message_too_large;
          out.body += piece;
        }
      }
      if (body.done()) break;
      const std::error_code ec = co_await read_more(*s);
      if (ec == asio::error::eof && body.ended_by_close()) {
        close();
        co_return std::error_code{};
      }
      if (ec) co_return timer.fired() ? std::error_code{asio::error::timed_out} : ec;
    }
    if (!body.keep_alive()) close();
    co_return std::error_code{};
  }

  asio::awaitable<std::error_code> read_more(stream& s) {
    std::array<char, 16384> chunk{};
    std::error_code ec;
    const asio::mutable_buffer into(chunk.data(), chunk.size());
    const std::size_t n = co_await s.read_some(into, ec);
    if (n > 0) in_.append(chunk.data(), n);
    if (ec && n > 0) ec = {};
    co_return ec;
  }

  asio::any_io_executor ex_;
  std::string host_;
  std::uint16_t port_;
  std::string host_header_;
  std::shared_ptr<tls_context> tls_;
  limits limits_;
  std::shared_ptr<stream> stream_;
  std::string in_;
  bool shut_ = false;
  bool streaming_ = false;
};

/// Connections to one host:port, reused: an exchange takes an idle one or
/// opens another, so that several coroutines may talk to the server at once.
class pool {
 public:
  pool(asio::any_io_executor ex, std::string host, std::uint16_t port,
       std::shared_ptr<tls_context> tls, std::size_t max_idle = 4)
      : ex_(std::move(ex)),
        host_(std::move(host)),
        port_(port),
        tls_(std::move(tls)),
        max_idle_(max_idle) {
    // Appended piece by piece: g++ 12 at -O3 takes `":" + std::to_string(port_)`
    // for an overlapping memcpy (-Wrestrict, a false positive; issue 28).
    const bool v6 = host_.find(':') != std::string::npos;
    if (v6) where_ += '[';
    where_ += host_;
    if (v6) where_ += ']';
    where_ += ':';
    where_ += std::to_string(port_);
  }
  pool(const pool&) = delete;
  pool& operator=(const pool&) = delete;
  ~pool() { shutdown(); }

  /// connection::exchange on a connection of the pool (a new one for a
  /// streamed body, which it holds for as long as it lasts).
  asio::awaitable<std::error_code> exchange(const request& req, response& out,
                                            std::chrono::milliseconds timeout,
                                            connection::body_fn on_body = {}) {
    if (shut_) co_return std::error_code{asio::error::operation_aborted};
    std::shared_ptr<connection> c;
    if (!on_body && !idle_.empty()) {
      c = std::move(idle_.back());
      idle_.pop_back();
    } else {
      c = std::make_shared<connection>(ex_, host_, port_, tls_);
    }
    busy_.push_back(c);
    const std::error_code ec = co_await c->exchange(req, out, timeout, std::move(on_body));
    std::erase(busy_, c);
    if (!ec && !shut_ && c->is_open() && idle_.size() < max_idle_) idle_.push_back(std::move(c));
    co_return ec;
  }

  /// Closes the idle connections (the next exchange opens a new one).
  void close_idle() {
    for (auto& c : idle_) c->close();
    idle_.clear();
  }

  /// Closes every connection for good: exchanges in progress and later
  /// ones fail (operation_aborted).
  void shutdown() {
    shut_ = true;
    for (auto& c : busy_) c->shutdown();
    for (auto& c : idle_) c->shutdown();
    busy_.clear();
    idle_.clear();
  }

  /// Ends the streamed exchanges in progress (the others keep going).
  void abort_streams() {
    for (auto& c : busy_) {
      if (c->streaming()) c->shutdown();
    }
  }

  const std::string& where() const noexcept { return where_; }

 private:
  asio::any_io_executor ex_;
  std::string host_;
  std::uint16_t port_;
  std::shared_ptr<tls_context> tls_;
  std::size_t max_idle_;
  std::string where_;
  std::vector<std::shared_ptr<connection>> idle_;
  std::vector<std::shared_ptr<connection>> busy_;
  bool shut_ = false;
};

}  // namespace kvlink::detail::http
