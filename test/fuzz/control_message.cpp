// Fuzzes the control-message framing (include/kvlink/control/message.hpp) as it
// comes off the wire: the input is a byte stream of 8-byte prefixes, each
// followed by its body, read the way control::read_message() and
// control::channel do: decode_prefix() with the engine's default bound
// (config.max_control_message, 1 MiB), then parse_message() on the body; a
// message that parses is handed to the decoder the engine would give it by
// its "type" (notify, transport, segments, error, hello, welcome).
//
// Asserts, besides "no crash, no hang, no exception, no out-of-bounds read"
// (every prefix and body is copied into a buffer of exactly its size):
// - decode_prefix() fails exactly for a wrong magic (malformed_message), a
//   zero length (malformed_message) or a length above the bound
//   (message_too_large), and otherwise yields the prefix's length;
// - parse_message() accepts exactly JSON objects with a string "type", and
//   fails with malformed_message otherwise;
// - a parsed message survives encode_message(): its prefix decodes to the
//   body's length, and the body parses back to the same JSON text;
// - the per-type decoders answer with an error code or false, never throw.
#include <kvlink/control/descriptor.hpp>
#include <kvlink/control/handshake.hpp>
#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "fuzz_check.hpp"
#include <nlohmann/json.hpp>

namespace {

namespace control = kvlink::control;
using kvlink::errc;
using json = nlohmann::json;

constexpr std::uint64_t max_body = 1 << 20;  // kvlink::config::max_control_message
constexpr std::uint64_t max_notify = 4096;   // kvlink::config::max_notification
constexpr std::size_t max_messages = 16;     // per input: keeps one run short

std::uint32_t le32(const unsigned char* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}

// What the engine does with a message of each type (engine/core.hpp:
// on_session_message, on_peer_message; metadata/p2p.hpp; control/handshake.hpp).
void dispatch(const json& msg) {
  const auto type = msg.value("type", std::string{});
  if (type == "notify") {
    std::string id, payload;
    if (!control::parse_notify(msg, max_notify, id, payload)) {
      KVLINK_FUZZ_CHECK(id.size() + payload.size() <= max_notify);
    }
  } else if (type == "transport") {
    std::string name;
    const json* body = nullptr;
    if (control::parse_transport_message(msg, name, body)) {
      KVLINK_FUZZ_CHECK(body != nullptr && body->is_object());
    }
  } else if (type == "segments") {
    std::vector<kvlink::remote_segment_info> segs;
    const auto it = msg.find("segments");
    if (it != msg.end()) (void)control::segments_from_json(*it, segs);
  } else if (type == "error") {
    const std::error_code ec = control::error_from_message(msg);
    KVLINK_FUZZ_CHECK(ec && ec.category() == kvlink::error_category());
  } else if (type == "hello") {
    control::hello h;
    (void)control::parse_hello(msg, h);
  } else if (type == "welcome") {
    unsigned proto = 0;
    (void)control::get_field(msg, "protocol", proto);
    control::peer_descriptor d;
    (void)control::from_json(msg.value("descriptor", json{}), d);
  } else if (type == "challenge" || type == "response") {
    std::string text;
    control::nonce n{};
    control::digest dg{};
    if (control::get_field(msg, "nonce", text)) (void)control::parse_hex(text, n);
    if (control::get_field(msg, "proof", text)) (void)control::parse_hex(text, dg);
    if (control::get_field(msg, "bind", text)) (void)control::parse_hex(text, dg);
    if (control::get_field(msg, "instance", text)) (void)kvlink::parse_instance_id(text);
  }
}

// Returns false when the connection would be closed.
bool one_message(const std::uint8_t* data, std::size_t size, std::size_t& pos) {
  if (size - pos < control::prefix_size) return false;  // the peer closed
  control::prefix_bytes prefix{};
  std::memcpy(prefix.data(), data + pos, control::prefix_size);
  pos += control::prefix_size;

  std::uint32_t len = 0;
  const std::error_code pec = control::decode_prefix(prefix, max_body, len);
  const std::uint32_t raw_len = le32(prefix.data() + 4);
  std::error_code expected;
  if (le32(prefix.data()) != control::message_magic || raw_len == 0) {
    expected = errc::malformed_message;
  } else if (raw_len > max_body) {
    expected = errc::message_too_large;
  }
  KVLINK_FUZZ_CHECK(pec == expected);
  if (pec) return false;
  KVLINK_FUZZ_CHECK(len == raw_len);
  if (size - pos < len) return false;  // the peer closed in the middle of a body

  // read_message() reads the body into a buffer of exactly its length.
  const auto body = std::make_unique<char[]>(len);
  std::memcpy(body.get(), data + pos, len);
  pos += len;
  json msg;
  const std::error_code ec = control::parse_message(std::string_view(body.get(), len), msg);
  if (ec) {
    KVLINK_FUZZ_CHECK(ec == errc::malformed_message);
    return false;
  }
  const auto t = msg.find("type");
  KVLINK_FUZZ_CHECK(msg.is_object() && t != msg.end() && t->is_string());

  // What we would send back parses into the same message.
  const std::string wire = control::encode_message(msg);
  KVLINK_FUZZ_CHECK(wire.size() > control::prefix_size);
  control::prefix_bytes p2{};
  std::memcpy(p2.data(), wire.data(), control::prefix_size);
  std::uint32_t len2 = 0;
  KVLINK_FUZZ_CHECK(!control::decode_prefix(p2, max_body * 8, len2));
  KVLINK_FUZZ_CHECK(len2 == wire.size() - control::prefix_size);
  json again;
  KVLINK_FUZZ_CHECK(
      !control::parse_message(std::string_view(wire).substr(control::prefix_size), again));
  KVLINK_FUZZ_CHECK(again.dump() == msg.dump());

  dispatch(msg);
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::size_t pos = 0;
  for (std::size_t n = 0; n < max_messages && one_message(data, size, pos); ++n) {
  }
  return 0;
}
