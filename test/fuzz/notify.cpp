// Fuzzes what a peer's control session carries besides the handshake
// (include/kvlink/control/message.hpp): notifications and transport
// envelopes. The input is one message body (what follows the 8-byte prefix),
// parsed with control::parse_message() as the engine does, then given to
// parse_notify() (with the engine's default bound, config.max_notification =
// 4096, and with a small one so the size check is reached),
// parse_transport_message(), and from_hex() on its strings; the raw input
// also goes through from_hex() as it is.
//
// Asserts, besides "no crash, no hang, no exception, no out-of-bounds read":
// - from_hex() accepts exactly an even number of hex digits, and to_hex() of
//   what it gives is the same text in lowercase;
// - parse_notify() succeeds exactly when "id" and "payload" are strings, the
//   payload is hex and id + payload bytes fit the bound (message_too_large
//   when they do not, malformed_message otherwise); what it gives back is the
//   id and the decoded payload, and make_notify() of them parses to the same;
// - parse_transport_message() succeeds exactly when "transport" is a string
//   and "body" an object, points at that body, and reads back what
//   make_transport_message() writes.
#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include "fuzz_check.hpp"
#include <nlohmann/json.hpp>

namespace {

using kvlink_fuzz::all_hex;

namespace control = kvlink::control;
using kvlink::errc;
using json = nlohmann::json;

std::optional<std::string> check_from_hex(std::string_view text) {
  auto bytes = control::from_hex(text);
  KVLINK_FUZZ_CHECK(bytes.has_value() == (text.size() % 2 == 0 && all_hex(text)));
  if (bytes) {
    KVLINK_FUZZ_CHECK(bytes->size() == text.size() / 2);
    KVLINK_FUZZ_CHECK(control::to_hex(*bytes) == kvlink_fuzz::lower_hex(text));
  }
  return bytes;
}

void check_notify(const json& msg, std::uint64_t max) {
  std::string id, payload;
  const std::error_code ec = control::parse_notify(msg, max, id, payload);

  std::string want_id, hex;
  std::error_code expected = errc::malformed_message;
  std::optional<std::string> bytes;
  if (control::get_field(msg, "id", want_id) && control::get_field(msg, "payload", hex)) {
    bytes = check_from_hex(hex);
    if (bytes) {
      expected = want_id.size() + bytes->size() > max ? std::error_code{errc::message_too_large}
                                                      : std::error_code{};
    }
  }
  KVLINK_FUZZ_CHECK(ec == expected);
  if (ec) return;
  KVLINK_FUZZ_CHECK(id == want_id && payload == *bytes);
  KVLINK_FUZZ_CHECK(id.size() + payload.size() <= max);

  std::string id2, payload2;
  KVLINK_FUZZ_CHECK(!control::parse_notify(control::make_notify(id, payload), max, id2, payload2));
  KVLINK_FUZZ_CHECK(id2 == id && payload2 == payload);
}

void check_transport(const json& msg) {
  std::string name;
  const json* body = nullptr;
  const bool ok = control::parse_transport_message(msg, name, body);
  const auto t = msg.find("transport");
  const auto b = msg.find("body");
  KVLINK_FUZZ_CHECK(ok == (t != msg.end() && t->is_string() && b != msg.end() && b->is_object()));
  if (!ok) return;
  KVLINK_FUZZ_CHECK(body == &*b && name == t->get<std::string>());

  std::string name2;
  const json* body2 = nullptr;
  const json again = control::make_transport_message(name, *body);
  KVLINK_FUZZ_CHECK(control::parse_transport_message(again, name2, body2));
  KVLINK_FUZZ_CHECK(name2 == name && body2 != nullptr && *body2 == *body);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view raw(reinterpret_cast<const char*>(data), size);
  // libFuzzer hands over an exactly-sized heap copy: ASan sees any overread.
  (void)check_from_hex(raw);

  json msg;
  if (control::parse_message(raw, msg)) return 0;  // the session closes
  check_notify(msg, 4096);                         // kvlink::config::max_notification
  check_notify(msg, 8);
  check_transport(msg);
  for (const char* key : {"id", "payload"}) {
    std::string text;
    if (control::get_field(msg, key, text)) (void)check_from_hex(text);
  }
  return 0;
}
