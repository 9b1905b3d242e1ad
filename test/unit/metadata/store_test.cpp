#include <kvlink/core/instance.hpp>
#include <kvlink/metadata/store.hpp>

#include <string>
#include <vector>

#include <doctest/doctest.h>

namespace {

kvlink::control::peer_descriptor sample(std::string name, kvlink::instance_id inst,
                                        std::uint64_t seq, std::size_t segments) {
  kvlink::control::peer_descriptor d;
  d.instance = inst;
  d.address = "10.0.0.7:17001";
  d.name = std::move(name);
  d.seq = seq;
  for (std::size_t i = 0; i < segments; ++i) {
    d.segments.push_back({kvlink::segment_id{i + 1}, 0x1000 * (i + 1), 4096,
                          kvlink::access::remote_read_write, nlohmann::json::object()});
  }
  d.transports = {{"tcp", nlohmann::json::object()}};
  return d;
}

}  // namespace

TEST_CASE("stored values: the descriptor, signed under the shared secret, never the secret") {
  const kvlink::control::peer_guard secret("s3cret");
  const kvlink::control::peer_guard none;
  const auto d = sample("decode-3", kvlink::instance_id{1, 2}, 4, 2);

  const std::string signed_text = kvlink::detail::encode_entry(d, secret);
  CHECK(signed_text.find("s3cret") == std::string::npos);
  CHECK(signed_text.find("\"sig\"") != std::string::npos);
  kvlink::control::peer_descriptor back;
  REQUIRE_FALSE(kvlink::detail::decode_entry(signed_text, secret, 1 << 20, back));
  CHECK(back.name == "decode-3");
  CHECK(back.seq == 4);
  CHECK(back.instance == d.instance);
  CHECK(back.segments == d.segments);

  // Another secret, no signature, or a changed field: refused.
  CHECK(kvlink::detail::decode_entry(signed_text, kvlink::control::peer_guard("other"), 1 << 20,
                                     back) == kvlink::errc::authentication_failed);
  const std::string plain = kvlink::detail::encode_entry(d, none);
  CHECK(plain.find("\"sig\"") == std::string::npos);
  CHECK(kvlink::detail::decode_entry(plain, secret, 1 << 20, back) ==
        kvlink::errc::authentication_failed);
  std::string tampered = signed_text;
  tampered.replace(tampered.find("10.0.0.7"), 8, "10.6.6.6");
  CHECK(kvlink::detail::decode_entry(tampered, secret, 1 << 20, back) ==
        kvlink::errc::authentication_failed);
  // Without a secret, any well-formed value is taken (signed or not).
  CHECK_FALSE(kvlink::detail::decode_entry(signed_text, none, 1 << 20, back));
  CHECK_FALSE(kvlink::detail::decode_entry(plain, none, 1 << 20, back));

  // Extra fields (the HTTP backend's beat) are signed with the rest.
  const std::string beat = kvlink::detail::encode_entry(d, secret, {{"beat", 7}});
  nlohmann::json whole;
  REQUIRE_FALSE(kvlink::detail::decode_entry(beat, secret, 1 << 20, back, &whole));
  CHECK(whole.at("beat") == 7);
  std::string beat2 = beat;
  beat2.replace(beat2.find("\"beat\":7"), 8, "\"beat\":8");
  CHECK(kvlink::detail::decode_entry(beat2, secret, 1 << 20, back) ==
        kvlink::errc::authentication_failed);

  // Garbage and oversize values.
  CHECK(kvlink::detail::decode_entry("not json", none, 1 << 20, back) ==
        kvlink::errc::malformed_message);
  CHECK(kvlink::detail::decode_entry(std::string(100, '['), none, 1 << 20, back) ==
        kvlink::errc::malformed_message);
  CHECK(kvlink::detail::decode_entry(plain, none, 10, back) == kvlink::errc::message_too_large);
}

TEST_CASE("the peer directory turns store changes into events") {
  const kvlink::control::peer_guard none;
  kvlink::detail::peer_directory dir(none, 1 << 20, "self");
  std::vector<kvlink::metadata_event> seen;
  dir.on_change([&seen](const kvlink::metadata_event& e) { seen.push_back(e); });

  const kvlink::instance_id first{1, 1}, second{2, 2};
  CHECK(dir.put("decode-3", kvlink::detail::encode_entry(sample("decode-3", first, 1, 1), none)));
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].what == kvlink::metadata_event::kind::published);
  CHECK(seen[0].name == "decode-3");
  CHECK(seen[0].instance == first);
  CHECK(seen[0].segments.size() == 1);

  // The same text again (a resync): nothing new.
  CHECK(dir.put("decode-3", kvlink::detail::encode_entry(sample("decode-3", first, 1, 1), none)));
  CHECK(seen.size() == 1);

  // New segments, then a new instance under the name.
  dir.put("decode-3", kvlink::detail::encode_entry(sample("decode-3", first, 2, 2), none));
  REQUIRE(seen.size() == 2);
  CHECK(seen[1].seq == 2);
  CHECK(seen[1].segments.size() == 2);
  dir.put("decode-3", kvlink::detail::encode_entry(sample("decode-3", second, 1, 0), none));
  REQUIRE(seen.size() == 3);
  CHECK(seen[2].instance == second);

  kvlink::resolved_peer rp;
  REQUIRE_FALSE(dir.resolve("decode-3", rp));
  CHECK(rp.address == "10.0.0.7:17001");
  REQUIRE(rp.descriptor);
  CHECK(rp.descriptor->instance == second);
  CHECK(dir.resolve("nobody", rp) == kvlink::errc::name_not_found);

  // A value under the wrong name, or garbage: ignored, the entry kept.
  CHECK_FALSE(
      dir.put("decode-3", kvlink::detail::encode_entry(sample("other", first, 9, 0), none)));
  CHECK_FALSE(dir.put("decode-3", "garbage"));
  CHECK(seen.size() == 3);
  REQUIRE(dir.find("decode-3"));
  CHECK(dir.find("decode-3")->instance == second);

  // Our own entry makes no event.
  dir.put("self", kvlink::detail::encode_entry(sample("self", first, 1, 0), none));
  CHECK(seen.size() == 3);

  // Gone from the store.
  dir.remove("decode-3");
  REQUIRE(seen.size() == 4);
  CHECK(seen[3].what == kvlink::metadata_event::kind::withdrawn);
  CHECK(seen[3].instance == second);
  dir.remove("decode-3");
  CHECK(seen.size() == 4);

  // After a full read without it, an entry is missing, and goes only if it
  // stays away.
  dir.put("a", kvlink::detail::encode_entry(sample("a", first, 1, 0), none));
  dir.put("b", kvlink::detail::encode_entry(sample("b", second, 1, 0), none));
  seen.clear();
  dir.mark_missing({"self"});
  CHECK(dir.any_missing());
  dir.put("a", kvlink::detail::encode_entry(sample("a", first, 1, 0), none));  // came back
  dir.sweep_missing();
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].name == "b");
  CHECK(dir.find("a") != nullptr);
  CHECK(dir.find("b") == nullptr);
}
