// Fuzzes the handshake messages (include/kvlink/control/handshake.hpp) as the
// engine reads them: the input is one message body (what follows the 8-byte
// prefix), parsed with control::parse_message() (nlohmann's non-throwing
// parse), then given to parse_hello() (the accepting side), to
// error_from_message() (the connecting side's "error" answer), and its hex
// fields to the decoders the challenge/response steps use (parse_hex for
// nonces, proofs and lane bindings; parse_instance_id for instance ids).
//
// Asserts, besides "no crash, no hang, no exception, no out-of-bounds read":
// - parse_hello(): a "hello" whose "protocol" is an unsigned number other than
//   protocol_version is protocol_version_mismatch whatever else it holds; a
//   hello it accepts has the current protocol, a valid instance id matching
//   the text, a role, a transport of 1..32 characters and an address of at
//   most 256; writing it with to_json() and parsing that gives the same hello;
// - error_from_message() always gives a kvlink error in 1..errc_last: the code
//   the message names when it is one, malformed_message otherwise, and reads
//   back every error make_error() writes;
// - parse_hex<N>() / parse_instance_id() accept exactly 2N / 32 hex digits and
//   give back the same digits (lowercase) when written again.
#include <kvlink/control/guard.hpp>
#include <kvlink/control/handshake.hpp>
#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/version.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>

#include "fuzz_check.hpp"
#include <nlohmann/json.hpp>

namespace {

using kvlink_fuzz::all_hex;

namespace control = kvlink::control;
using kvlink::errc;
using json = nlohmann::json;

template <std::size_t N>
void check_hex(const std::string& text) {
  std::array<unsigned char, N> out{};
  const bool ok = control::parse_hex(text, out);
  KVLINK_FUZZ_CHECK(ok == (text.size() == 2 * N && all_hex(text)));
  if (ok) KVLINK_FUZZ_CHECK(control::hex_of(out) == kvlink_fuzz::lower_hex(text));
}

void check_instance(const std::string& text) {
  const auto id = kvlink::parse_instance_id(text);
  KVLINK_FUZZ_CHECK(id.has_value() == (text.size() == 32 && all_hex(text)));
  if (id) KVLINK_FUZZ_CHECK(kvlink::to_string(*id) == kvlink_fuzz::lower_hex(text));
}

// Every string field of a handshake message through the hex decoders.
void check_fields(const json& msg) {
  for (const char* key : {"instance", "expect", "nonce", "proof", "session", "bind"}) {
    std::string text;
    if (!control::get_field(msg, key, text)) continue;
    check_instance(text);
    check_hex<std::tuple_size_v<control::nonce>>(text);
    check_hex<std::tuple_size_v<control::digest>>(text);
    check_hex<16>(text);  // a session id (peer_guard::make_session_id)
  }
}

void check_hello(const json& msg) {
  control::hello h;
  const std::error_code ec = control::parse_hello(msg, h);
  KVLINK_FUZZ_CHECK(!ec || ec == errc::malformed_message || ec == errc::protocol_version_mismatch);

  // The protocol is read first: another version is never "malformed".
  const auto p = msg.find("protocol");
  if (msg.value("type", std::string{}) == "hello" && p != msg.end() && p->is_number_unsigned() &&
      p->get<std::uint64_t>() <= std::numeric_limits<unsigned>::max() &&
      p->get<std::uint64_t>() != kvlink::protocol_version) {
    KVLINK_FUZZ_CHECK(ec == errc::protocol_version_mismatch);
  }
  if (ec) return;

  KVLINK_FUZZ_CHECK(h.protocol == kvlink::protocol_version);
  KVLINK_FUZZ_CHECK(h.instance.valid());
  KVLINK_FUZZ_CHECK(kvlink::parse_instance_id(msg.at("instance").get<std::string>()) == h.instance);
  KVLINK_FUZZ_CHECK(h.r == control::role::control || h.r == control::role::lane);
  KVLINK_FUZZ_CHECK(!h.transport.empty() && h.transport.size() <= 32);
  KVLINK_FUZZ_CHECK(h.address.size() <= 256);

  // Written again and parsed, it is the same hello (to_json() leaves the
  // transport out of a control hello: it is a lane's business).
  control::hello h2;
  KVLINK_FUZZ_CHECK(!control::parse_hello(control::to_json(h), h2));
  KVLINK_FUZZ_CHECK(h2.protocol == h.protocol && h2.instance == h.instance && h2.r == h.r &&
                    h2.lane == h.lane && h2.expect == h.expect && h2.address == h.address &&
                    h2.client_nonce == h.client_nonce);
  if (h.r == control::role::lane) KVLINK_FUZZ_CHECK(h2.transport == h.transport);
}

void check_error(const json& msg) {
  const std::error_code ec = control::error_from_message(msg);
  KVLINK_FUZZ_CHECK(ec.category() == kvlink::error_category());
  KVLINK_FUZZ_CHECK(ec.value() >= 1 && ec.value() <= static_cast<int>(kvlink::errc_last));
  KVLINK_FUZZ_CHECK(!ec.message().empty());
  const auto c = msg.find("code");
  if (c != msg.end() && c->is_number_integer() && c->get<std::int64_t>() >= 1 &&
      c->get<std::int64_t>() <= static_cast<std::int64_t>(kvlink::errc_last)) {
    KVLINK_FUZZ_CHECK(ec.value() == c->get<std::int64_t>());
  } else {
    KVLINK_FUZZ_CHECK(ec == errc::malformed_message);
  }
  // What we would answer with this error reads back as the same error.
  KVLINK_FUZZ_CHECK(control::error_from_message(control::make_error(ec, "fuzz")) == ec);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // libFuzzer hands over an exactly-sized heap copy: ASan sees any overread.
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  json msg;
  if (control::parse_message(body, msg)) return 0;  // the connection closes

  check_hello(msg);
  check_error(msg);
  check_fields(msg);

  // The connecting side's view of a welcome (client_handshake()).
  unsigned proto = 0;
  if (control::get_field(msg, "protocol", proto)) {
    KVLINK_FUZZ_CHECK(msg.at("protocol").get<std::uint64_t>() == proto);
  }
  return 0;
}
