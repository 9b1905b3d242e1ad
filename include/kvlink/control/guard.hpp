// Peer authentication: a shared secret, proven both ways by a challenge and
// response before any descriptor leaves an engine and before any lane is
// accepted (control/handshake.hpp runs the exchange). HMAC-SHA-256 from
// libsodium (crypto_auth_hmacsha256), keyed with the secret; nonces of 32
// random bytes from both sides, so a recorded exchange replayed later fails.
//
//   connecting side            accepting side
//   hello {nonce: Nc}   --->
//                       <---   challenge {instance: I_s, nonce: Ns,
//                                         proof: H(K, "server", Nc, Ns, hello)}
//   (checks the proof)
//   response {proof: H(K, "client", Nc, Ns, I_s),
//             lanes: session, bind: H(S, "lane", Ns, lane)}  --->
//                       <---   welcome {session} / error authentication_failed
//
// S = H(K, "session", Nc, Ns) is the session key of a control connection,
// known to both ends and never sent; a lane proves it belongs to that
// session with it, so a lane cannot be opened by someone who did not take
// part in the session's handshake, even with the secret of another one.
// Nothing is encrypted: the secret keeps strangers out, not eavesdroppers.
#pragma once

#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include <sodium.h>

namespace kvlink::control {

using digest = std::array<unsigned char, crypto_auth_hmacsha256_BYTES>;
using nonce = std::array<unsigned char, 32>;

template <std::size_t N>
std::string hex_of(const std::array<unsigned char, N>& bytes) {
  return to_hex(std::string_view(reinterpret_cast<const char*>(bytes.data()), N));
}

/// Reads exactly N bytes of hex; false for anything else.
template <std::size_t N>
bool parse_hex(std::string_view text, std::array<unsigned char, N>& out) {
  if (text.size() != 2 * N) return false;
  const auto bytes = from_hex(text);
  if (!bytes || bytes->size() != N) return false;
  std::memcpy(out.data(), bytes->data(), N);
  return true;
}

class peer_guard {
 public:
  /// No secret: authentication is off.
  peer_guard() = default;
  /// Authentication with `secret` (not empty).
  explicit peer_guard(std::string secret) : secret_(std::move(secret)) {
    if (sodium_init() < 0) throw std::runtime_error("kvlink: libsodium failed to initialize");
  }

  bool enabled() const noexcept { return !secret_.empty(); }

  static nonce make_nonce() {
    if (sodium_init() < 0) throw std::runtime_error("kvlink: libsodium failed to initialize");
    nonce n{};
    randombytes_buf(n.data(), n.size());
    return n;
  }
  static std::string make_session_id() {
    std::array<unsigned char, 16> id{};
    randombytes_buf(id.data(), id.size());
    return hex_of(id);
  }

  /// The accepting side proves it knows the secret, bound to this hello.
  digest server_proof(const nonce& client, const nonce& server, const instance_id& from,
                      std::string_view role, std::uint32_t lane) const {
    return mac(secret_, "kvlink/auth/server", client, server,
               to_string(from) + "/" + std::string(role) + "/" + std::to_string(lane));
  }
  /// The connecting side proves it, bound to the accepting side's instance.
  digest client_proof(const nonce& client, const nonce& server, const instance_id& to) const {
    return mac(secret_, "kvlink/auth/client", client, server, to_string(to));
  }
  /// The session key of a control connection (never sent).
  digest session_key(const nonce& client, const nonce& server) const {
    return mac(secret_, "kvlink/auth/session", client, server, {});
  }
  /// A lane's proof that it belongs to the session keyed `session_key`.
  static digest lane_binding(const digest& session_key, const nonce& server, std::uint32_t lane) {
    const std::string_view key(reinterpret_cast<const char*>(session_key.data()),
                               session_key.size());
    return mac(key, "kvlink/auth/lane", nonce{}, server, std::to_string(lane));
  }

  /// A MAC of `data` under the secret, domain-separated by `label`: what an
  /// engine publishes in a metadata store carries one, so that peers that
  /// share the secret can tell it from a forgery (metadata/store.hpp).
  digest sign(std::string_view label, std::string_view data) const {
    return mac(secret_, label, nonce{}, nonce{}, data);
  }

  /// Constant-time comparison.
  static bool same(const digest& a, const digest& b) noexcept {
    return sodium_memcmp(a.data(), b.data(), a.size()) == 0;
  }

 private:
  static digest mac(std::string_view key, std::string_view label, const nonce& a, const nonce& b,
                    std::string_view extra) {
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, reinterpret_cast<const unsigned char*>(key.data()),
                                key.size());
    auto update = [&st](const void* p, std::size_t n) {
      const std::uint64_t len = n;  // length-prefixed: no two inputs hash alike
      crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(&len), sizeof len);
      crypto_auth_hmacsha256_update(&st, static_cast<const unsigned char*>(p), n);
    };
    update(label.data(), label.size());
    update(a.data(), a.size());
    update(b.data(), b.size());
    update(extra.data(), extra.size());
    digest out{};
    crypto_auth_hmacsha256_final(&st, out.data());
    return out;
  }

  std::string secret_;
};

}  // namespace kvlink::control
