// The handshake, written once for every connection an engine opens or
// accepts: the connecting side sends a hello, the accepting side answers
// with a welcome (a control connection's welcome carries the descriptor) or
// an error, after which the connection belongs to the engine's control
// channel or to a transport's lane.
//
//   hello     {"type": "hello", "protocol": 2, "instance": "<hex>",
//              "role": "control" | "lane", "transport": "tcp", "lane": 0,
//              "expect": "<hex>", "address": "host:port", "nonce": "<hex>"}
//   challenge {"type": "challenge", "instance": "<hex>", "nonce": "<hex>",
//              "proof": "<hex>"}          (only when the engine has a secret)
//   response  {"type": "response", "proof": "<hex>",
//              "session": "<hex>", "bind": "<hex>"}  (session, bind: lanes)
//   welcome   {"type": "welcome", "protocol": 2, "instance": "<hex>",
//              "descriptor": {...}, "session": "<hex>"}  (control connections)
//   error     {"type": "error", "code": N, "message": "..."}
//
// With a shared secret (control/guard.hpp) both sides prove they know it
// before the welcome: no descriptor leaves an engine and no lane is accepted
// otherwise, and an engine with a secret talks only to engines with it.
//
// The protocol field is checked before anything else, so a peer of another
// version gets protocol_version_mismatch, never "malformed". Every message is
// bounded (max_message) before it is read. Works over any Asio stream (a TCP
// socket today): read_message()/write_message() are the only I/O.
#pragma once

#include <kvlink/control/descriptor.hpp>
#include <kvlink/control/guard.hpp>
#include <kvlink/control/message.hpp>
#include <kvlink/control/socket.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/version.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>
#include <asio/connect.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/read.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>
#include <nlohmann/json.hpp>

namespace kvlink::control {

/// co_await without exceptions: [error_code, results...].
///
/// Arguments of a co_await'ed call are named variables here, never
/// temporaries: g++ 12 destroys some temporaries inside co_await too early.
inline constexpr auto use_nothrow = asio::experimental::as_tuple(asio::use_awaitable);

/// Sends one message.
template <class Stream>
asio::awaitable<std::error_code> write_message(Stream& s, const nlohmann::json& msg) {
  const std::string bytes = encode_message(msg);
  auto [ec, n] = co_await asio::async_write(s, asio::buffer(bytes), use_nothrow);
  (void)n;
  co_return ec ? map_socket_error(ec) : std::error_code{};
}

/// Reads one message of at most `max` body bytes (message_too_large above,
/// malformed_message for a bad prefix or body). The body is read in chunks,
/// so memory grows with what arrives, not with what the prefix announced.
template <class Stream>
asio::awaitable<std::error_code> read_message(Stream& s, std::uint64_t max, nlohmann::json& out) {
  prefix_bytes prefix{};
  auto [ec, n] = co_await asio::async_read(s, asio::buffer(prefix), use_nothrow);
  (void)n;
  if (ec) co_return map_socket_error(ec);
  std::uint32_t len = 0;
  if (auto dec = decode_prefix(prefix, max, len)) co_return dec;
  std::string body;
  while (body.size() < len) {
    const std::size_t have = body.size();
    const std::size_t step = std::min<std::size_t>(len - have, 64u << 10);
    body.resize(have + step);
    auto [ec2, n2] =
        co_await asio::async_read(s, asio::buffer(body.data() + have, step), use_nothrow);
    (void)n2;
    if (ec2) co_return map_socket_error(ec2);
  }
  co_return parse_message(body, out);
}

/// Bound on the messages an accepting side reads before authentication (a
/// hello, a response): small, so that unauthenticated connections hold
/// little memory.
inline constexpr std::uint64_t max_handshake_message = 16u << 10;

/// What a connection is for: an engine's control connection, a transport's
/// lane, or a store client's connection to a store master
/// (store/master/server.hpp), which an engine refuses.
enum class role { control, lane, store };

inline const char* to_string(role r) noexcept {
  switch (r) {
    case role::control:
      return "control";
    case role::lane:
      return "lane";
    case role::store:
      return "store";
  }
  return "control";
}

/// The first message on every connection, from the connecting side.
struct hello {
  unsigned protocol = protocol_version;
  instance_id instance{};
  role r = role::control;
  std::string transport = "tcp";  ///< lanes: the transport they belong to
  std::uint32_t lane = 0;
  /// A lane names the instance it expects: if the peer restarted between the
  /// control handshake and this connection, the lane is refused.
  std::optional<instance_id> expect;
  std::string address;  ///< the sender's own listen address, if it told
  /// The sender's nonce: it has a secret and expects a challenge.
  std::optional<nonce> client_nonce;
};

inline nlohmann::json to_json(const hello& h) {
  nlohmann::json j{{"type", "hello"},
                   {"protocol", h.protocol},
                   {"instance", to_string(h.instance)},
                   {"role", to_string(h.r)},
                   {"lane", h.lane}};
  if (h.r == role::lane) j["transport"] = h.transport;
  if (h.expect) j["expect"] = to_string(*h.expect);
  if (!h.address.empty()) j["address"] = h.address;
  if (h.client_nonce) j["nonce"] = hex_of(*h.client_nonce);
  return j;
}

/// Convenience for the common hellos.
inline nlohmann::json make_hello(unsigned protocol, const instance_id& self, role r,
                                 std::uint32_t lane = 0,
                                 std::optional<instance_id> expect = std::nullopt,
                                 std::string_view address = {},
                                 std::string_view transport = "tcp") {
  hello h;
  h.protocol = protocol;
  h.instance = self;
  h.r = r;
  h.lane = lane;
  h.expect = expect;
  h.address = std::string(address);
  h.transport = std::string(transport);
  return to_json(h);
}

/// Parses a hello. The protocol field is read first, so a peer of another
/// version is told so (protocol_version_mismatch), not that its message is
/// malformed.
inline std::error_code parse_hello(const nlohmann::json& j, hello& h) {
  std::string type;
  if (!j.is_object() || !get_field(j, "type", type) || type != "hello" ||
      !get_field(j, "protocol", h.protocol)) {
    return errc::malformed_message;
  }
  if (h.protocol != protocol_version) return errc::protocol_version_mismatch;
  std::string inst;
  std::string r;
  if (!get_field(j, "instance", inst) || !get_field(j, "role", r) ||
      !get_field(j, "lane", h.lane)) {
    return errc::malformed_message;
  }
  const auto id = parse_instance_id(inst);
  if (!id || !id->valid() || (r != "control" && r != "lane" && r != "store")) {
    return errc::malformed_message;
  }
  h.instance = *id;
  h.r = r == "control" ? role::control : r == "lane" ? role::lane : role::store;
  if (const auto t = j.find("transport"); t != j.end()) {
    if (!t->is_string() || t->get_ref<const std::string&>().empty() ||
        t->get_ref<const std::string&>().size() > 32) {
      return errc::malformed_message;
    }
    h.transport = t->get<std::string>();
  }
  if (const auto e = j.find("expect"); e != j.end()) {
    if (!e->is_string()) return errc::malformed_message;
    const auto ex = parse_instance_id(e->get<std::string>());
    if (!ex) return errc::malformed_message;
    h.expect = *ex;
  }
  if (const auto a = j.find("address"); a != j.end()) {
    if (!a->is_string() || a->get_ref<const std::string&>().size() > 256) {
      return errc::malformed_message;
    }
    h.address = a->get<std::string>();
  }
  if (const auto n = j.find("nonce"); n != j.end()) {
    nonce value{};
    if (!n->is_string() || !parse_hex(n->get_ref<const std::string&>(), value)) {
      return errc::malformed_message;
    }
    h.client_nonce = value;
  }
  return {};
}

/// The accepting side's answer; `descriptor` for control connections.
inline nlohmann::json make_welcome(const instance_id& self,
                                   const peer_descriptor* descriptor = nullptr) {
  nlohmann::json j{
      {"type", "welcome"}, {"protocol", protocol_version}, {"instance", to_string(self)}};
  if (descriptor != nullptr) j["descriptor"] = to_json(*descriptor);
  return j;
}

inline nlohmann::json make_welcome(const peer_descriptor& d) {
  return make_welcome(d.instance, &d);
}

/// What the connecting side brings to the authentication.
struct client_auth {
  const peer_guard* guard = nullptr;  ///< null or without a secret: none
  /// Lanes: the session they belong to (from the control connection's welcome).
  std::string session;
  digest session_key{};
};

/// What a control connection's handshake established (with a secret).
struct session_keys {
  std::string session;
  digest key{};
};

/// The connecting side: sends `h` and reads the answer into `welcome`,
/// answering a challenge when there is one. An "error" answer becomes its
/// error code; a welcome of another protocol version is
/// protocol_version_mismatch; a peer whose proof is wrong, or that does not
/// ask for one while we have a secret (or asks while we have none), is
/// authentication_failed. `established` gets a control connection's session.
template <class Stream>
asio::awaitable<std::error_code> client_handshake(Stream& s, hello h, std::uint64_t max_message,
                                                  const client_auth& auth, nlohmann::json& welcome,
                                                  session_keys* established = nullptr) {
  const bool secret = auth.guard != nullptr && auth.guard->enabled();
  if (secret) h.client_nonce = peer_guard::make_nonce();
  const nlohmann::json hello_msg = to_json(h);
  if (auto ec = co_await write_message(s, hello_msg)) co_return ec;
  if (auto ec = co_await read_message(s, max_message, welcome)) co_return ec;
  auto type = welcome.value("type", std::string{});
  nonce server_nonce{};
  if (type == "challenge") {
    std::string inst, n, proof;
    digest their{};
    if (!get_field(welcome, "instance", inst) || !get_field(welcome, "nonce", n) ||
        !get_field(welcome, "proof", proof) || !parse_hex(n, server_nonce) ||
        !parse_hex(proof, their) || !parse_instance_id(inst)) {
      co_return errc::malformed_message;
    }
    if (!secret) co_return errc::authentication_failed;  // it wants a secret we do not have
    const auto server = *parse_instance_id(inst);
    const auto expected =
        auth.guard->server_proof(*h.client_nonce, server_nonce, h.instance, to_string(h.r), h.lane);
    if (!peer_guard::same(their, expected)) co_return errc::authentication_failed;
    nlohmann::json response{
        {"type", "response"},
        {"proof", hex_of(auth.guard->client_proof(*h.client_nonce, server_nonce, server))}};
    if (h.r == role::lane) {
      response["session"] = auth.session;
      response["bind"] = hex_of(peer_guard::lane_binding(auth.session_key, server_nonce, h.lane));
    }
    if (auto ec = co_await write_message(s, response)) co_return ec;
    if (auto ec = co_await read_message(s, max_message, welcome)) co_return ec;
    type = welcome.value("type", std::string{});
  } else if (secret && type == "welcome") {
    co_return errc::authentication_failed;  // it does not authenticate: not ours to trust
  }
  if (type == "error") co_return error_from_message(welcome);
  if (type != "welcome") co_return errc::malformed_message;
  unsigned proto = 0;
  if (!get_field(welcome, "protocol", proto)) co_return errc::malformed_message;
  if (proto != protocol_version) co_return errc::protocol_version_mismatch;
  if (secret && established != nullptr && h.r != role::lane) {
    if (!get_field(welcome, "session", established->session)) co_return errc::malformed_message;
    established->key = auth.guard->session_key(*h.client_nonce, server_nonce);
  }
  co_return std::error_code{};
}

/// Connects `s` to the first of `endpoints` that answers, tunes it, and runs
/// the connecting side of the handshake, all within `timeout`: a peer that
/// does not answer in time is peer_unreachable, as is one that refuses.
template <class Endpoints>
asio::awaitable<std::error_code> dial(asio::ip::tcp::socket& s, const Endpoints& endpoints,
                                      std::chrono::milliseconds timeout,
                                      const socket_options& options, hello h,
                                      std::uint64_t max_message, const client_auth& auth,
                                      nlohmann::json& welcome,
                                      session_keys* established = nullptr) {
  watchdog dog(s.get_executor(), s, timeout);
  auto [ec, ep] = co_await asio::async_connect(s, endpoints, use_nothrow);
  (void)ep;
  if (ec) co_return std::error_code{errc::peer_unreachable};  // refused, or timed out
  tune_socket(s, options);
  const auto hec =
      co_await client_handshake(s, std::move(h), max_message, auth, welcome, established);
  if (hec && dog.fired()) co_return std::error_code{errc::peer_unreachable};
  co_return hec;
}

/// The accepting side's part: what it has, what it found.
struct server_auth {
  const peer_guard* guard = nullptr;  ///< null or without a secret: none
  instance_id self{};
  /// A lane's session key by session id (nullopt: no such session).
  std::function<std::optional<digest>(const std::string&)> session_key;
};

/// The accepting side: reads and checks the hello and, with a secret, runs
/// the challenge. On error the peer is sent an "error" answer (best effort)
/// and the code is returned; the caller closes the connection. A control
/// connection's new session goes to `established`.
template <class Stream>
asio::awaitable<std::error_code> server_handshake(Stream& s, std::uint64_t max_message,
                                                  const server_auth& auth, hello& out,
                                                  session_keys& established) {
  nlohmann::json msg;
  std::error_code ec = co_await read_message(s, max_message, msg);
  if (!ec) ec = parse_hello(msg, out);
  if (!ec && auth.guard != nullptr && auth.guard->enabled()) {
    if (!out.client_nonce) {
      ec = errc::authentication_failed;  // no secret on the other side
    } else {
      const nonce mine = peer_guard::make_nonce();
      const nlohmann::json challenge{
          {"type", "challenge"},
          {"protocol", protocol_version},
          {"instance", to_string(auth.self)},
          {"nonce", hex_of(mine)},
          {"proof", hex_of(auth.guard->server_proof(*out.client_nonce, mine, out.instance,
                                                    to_string(out.r), out.lane))}};
      ec = co_await write_message(s, challenge);
      nlohmann::json response;
      if (!ec) ec = co_await read_message(s, max_message, response);
      std::string proof;
      digest theirs{};
      if (!ec && (response.value("type", std::string{}) != "response" ||
                  !get_field(response, "proof", proof) || !parse_hex(proof, theirs))) {
        ec = errc::malformed_message;
      }
      if (!ec &&
          !peer_guard::same(theirs, auth.guard->client_proof(*out.client_nonce, mine, auth.self))) {
        ec = errc::authentication_failed;
      }
      if (!ec && out.r == role::lane) {
        // The lane proves it belongs to a session that authenticated.
        std::string session, bind;
        digest bound{};
        const auto key = get_field(response, "session", session) && auth.session_key
                             ? auth.session_key(session)
                             : std::nullopt;
        if (!key || !get_field(response, "bind", bind) || !parse_hex(bind, bound) ||
            !peer_guard::same(bound, peer_guard::lane_binding(*key, mine, out.lane))) {
          ec = errc::authentication_failed;
        }
      }
      if (!ec && out.r != role::lane) {
        established.session = peer_guard::make_session_id();
        established.key = auth.guard->session_key(*out.client_nonce, mine);
      }
    }
  }
  if (ec && ec != errc::peer_closed) {
    const nlohmann::json refusal = make_error(ec);  // named: see use_nothrow above
    (void)co_await write_message(s, refusal);
  }
  co_return ec;
}

/// The accepting side's answer (a welcome, or an error the caller decided on).
template <class Stream>
asio::awaitable<std::error_code> server_answer(Stream& s, const nlohmann::json& answer) {
  co_return co_await write_message(s, answer);
}

}  // namespace kvlink::control
