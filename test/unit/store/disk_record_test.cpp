// store/tier/disk_record.hpp: the SSD tier's file and record headers round
// trip, and everything that is not an intact header of this file is refused.
#include <kvlink/store/tier/disk_record.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <doctest/doctest.h>

namespace tier = kvlink::store::tier;

TEST_CASE("disk record: sizes and rounding") {
  CHECK(tier::record_body_offset(1, 512) == 512);
  CHECK(tier::record_body_offset(448, 512) == 512);
  CHECK(tier::record_body_offset(449, 512) == 1024);
  CHECK(tier::record_body_offset(45, 4096) == 4096);
  CHECK(tier::disk_record_bytes(4096, 45, 512) == 4608);
  CHECK(tier::disk_record_bytes(4096, 45, 4096) == 8192);
  CHECK(tier::disk_record_bytes(0, 3, 512) == 512);
  CHECK(tier::disk_record_bytes(UINT64_MAX - 10, 3, 512) == 0);
  CHECK(tier::disk_block_valid(512));
  CHECK(tier::disk_block_valid(4096));
  CHECK_FALSE(tier::disk_block_valid(256));
  CHECK_FALSE(tier::disk_block_valid(3000));
  CHECK_FALSE(tier::disk_block_valid(2u << 20));
}

TEST_CASE("disk record: the file header round trips; damage, other versions, other files") {
  std::vector<std::byte> b(512);
  const tier::disk_file_header h{tier::disk_format_version, 4096, 7, 0x1234'5678'9abc'def0ULL};
  REQUIRE(tier::encode_file_header(h, b));
  tier::disk_file_header out;
  REQUIRE(tier::decode_file_header(b, out) == tier::file_header_status::ok);
  CHECK(out.block == 4096);
  CHECK(out.number == 7);
  CHECK(out.salt == h.salt);
  CHECK_FALSE(tier::encode_file_header(tier::disk_file_header{1, 100, 1, 1}, b));  // bad block

  auto damaged = b;
  damaged[20] ^= std::byte{1};
  CHECK(tier::decode_file_header(damaged, out) == tier::file_header_status::corrupt);
  auto foreign = b;
  foreign[0] = std::byte{'X'};
  CHECK(tier::decode_file_header(foreign, out) == tier::file_header_status::not_a_tier_file);
  CHECK(tier::decode_file_header(std::span(b).first(10), out) ==
        tier::file_header_status::not_a_tier_file);
  // A later format: recognised as a tier file (so it is not deleted), refused.
  REQUIRE(tier::encode_file_header(tier::disk_file_header{2, 4096, 7, 1}, b));
  CHECK(tier::decode_file_header(b, out) == tier::file_header_status::other_version);
  CHECK(out.version == 2);
}

TEST_CASE("disk record: a record header round trips only under its file's salt") {
  const std::string key = "vllm@block/0042";
  std::vector<std::byte> b(tier::record_body_offset(key.size(), 512));
  const tier::disk_record r{tier::disk_record_kind::object, key, 4096, 99, 0xdeadbeef};
  REQUIRE(tier::encode_record_header(11, r, b));
  tier::disk_record out;
  REQUIRE(tier::decode_record_header(11, b, out));
  CHECK(out.kind == tier::disk_record_kind::object);
  CHECK(out.key == key);
  CHECK(out.size == 4096);
  CHECK(out.sequence == 99);
  CHECK(out.body_crc == 0xdeadbeef);
  CHECK_FALSE(tier::decode_record_header(12, b, out));  // another file's salt
  CHECK_FALSE(
      tier::decode_record_header(11, std::span(b).first(64 + key.size() - 1), out));  // key cut

  // Every single-bit flip of the header or key is refused.
  for (std::size_t i = 0; i < tier::disk_record_header_size + key.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      auto c = b;
      c[i] ^= static_cast<std::byte>(1 << bit);
      tier::disk_record o;
      if (tier::decode_record_header(11, c, o)) FAIL("accepted a flip at byte " << i);
    }
  }

  // What cannot be encoded.
  CHECK_FALSE(tier::encode_record_header(
      1, tier::disk_record{tier::disk_record_kind::object, "", 1, 1, 0}, b));
  CHECK_FALSE(tier::encode_record_header(
      1, tier::disk_record{tier::disk_record_kind::removal, key, 5, 1, 0}, b));
  const std::string long_key(tier::disk_max_key + 1, 'k');
  std::vector<std::byte> big(tier::record_body_offset(long_key.size(), 512));
  CHECK_FALSE(tier::encode_record_header(
      1, tier::disk_record{tier::disk_record_kind::object, long_key, 1, 1, 0}, big));
  CHECK_FALSE(tier::encode_record_header(1, r, std::span(b).first(40)));

  // A removal round trips with size 0.
  REQUIRE(tier::encode_record_header(
      3, tier::disk_record{tier::disk_record_kind::removal, key, 0, 100, 0}, b));
  REQUIRE(tier::decode_record_header(3, b, out));
  CHECK(out.kind == tier::disk_record_kind::removal);
  CHECK(out.size == 0);
}
