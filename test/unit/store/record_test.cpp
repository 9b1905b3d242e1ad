// Object records (include/kvlink/store/wire/record.hpp): what a writer puts
// after an object's bytes and what a segment's owner finds again.
#include <kvlink/core/crc32c.hpp>
#include <kvlink/store/wire/record.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <doctest/doctest.h>

namespace {

namespace rw = kvlink::store::wire;

// A segment's memory with objects written as a writer does: the bytes, then
// the record after them.
struct memory {
  explicit memory(std::size_t n) : bytes(n) {}
  std::byte* base() { return bytes.data(); }
  void object(std::uint64_t at, const std::string& key, std::uint64_t size, char fill) {
    for (std::uint64_t i = 0; i < size; ++i) {
      bytes[at + i] = static_cast<std::byte>(fill + static_cast<char>(i % 7));
    }
    const auto crc = kvlink::crc32c(base() + at, size);
    REQUIRE(rw::encode_record(key, size, crc,
                              {base() + at + rw::record_offset(size),
                               rw::record_size(key.size())}) == rw::record_size(key.size()));
  }
  std::vector<rw::found_object> scan(bool wipe = true, bool wipe_all = false,
                                     std::uint64_t* cleared = nullptr) {
    std::vector<rw::found_object> out;
    const auto n = rw::scan_records(base(), bytes.size(), 4096, wipe, wipe_all,
                                    [&](const rw::found_object& f) { out.push_back(f); });
    if (cleared) *cleared = n;
    return out;
  }
  std::vector<std::byte> bytes;
};

}  // namespace

TEST_CASE("object record: sizes, encode and decode, tampering refused") {
  CHECK(rw::record_size(1) == 64);
  CHECK(rw::record_size(32) == 64);
  CHECK(rw::record_size(33) == 128);
  CHECK(rw::record_offset(1) == 64);
  CHECK(rw::record_offset(4096) == 4096);
  CHECK(rw::object_footprint(4096, 20) == 4096 + 64);
  CHECK(rw::object_footprint(0, 20) == 0);
  CHECK(rw::object_footprint(UINT64_MAX - 10, 20) == 0);  // overflow

  std::vector<std::byte> buf(rw::record_size(5));
  CHECK(rw::encode_record("hello", 12345, 0xABCD1234u, buf) == 64);
  CHECK(rw::encode_record("hello", 12345, 0, {buf.data(), 63}) == 0);  // too short
  rw::object_record r;
  REQUIRE(rw::decode_record(buf, 4096, r));
  CHECK(r.key == "hello");
  CHECK(r.size == 12345);
  CHECK(r.body_crc == 0xABCD1234u);
  CHECK_FALSE(rw::decode_record(buf, 4, r));                  // key over the bound
  CHECK_FALSE(rw::decode_record({buf.data(), 36}, 4096, r));  // cut in the key
  for (std::size_t i : {0u, 8u, 12u, 16u, 24u, 28u, 33u}) {   // any byte of it changed
    auto bad = buf;
    bad[i] ^= std::byte{1};
    CHECK_FALSE(rw::decode_record(bad, 4096, r));
  }
}

TEST_CASE("object record: a scan finds objects whose bytes check out, clears the others") {
  memory m(1 << 16);
  m.object(0, "first", 100, 'a');
  m.object(4096, std::string(200, 'k'), 5000, 'b');  // a key longer than one record unit
  m.object(12288, "torn", 3000, 'c');
  m.object(20480, "last", 64, 'd');
  m.bytes[12288 + 1500] ^= std::byte{0xFF};  // a put that never finished
  std::uint64_t cleared = 0;
  auto found = m.scan(true, false, &cleared);
  REQUIRE(found.size() == 3);
  CHECK(found[0].key == "first");
  CHECK(found[0].offset == 0);
  CHECK(found[0].size == 100);
  CHECK(found[1].key == std::string(200, 'k'));
  CHECK(found[1].offset == 4096);
  CHECK(found[1].size == 5000);
  CHECK(found[2].key == "last");
  CHECK(found[2].offset == 20480);
  CHECK(cleared == 1);
  // The torn one's record is gone for good: repairing the byte brings
  // nothing back.
  m.bytes[12288 + 1500] ^= std::byte{0xFF};
  CHECK(m.scan().size() == 3);

  // An object written over by a later one (its space freed and reused): the
  // old record stays, its bytes no longer match.
  m.object(0, "over", 4000, 'e');  // covers "first" and its record
  found = m.scan(true, false, &cleared);
  REQUIRE(found.size() == 3);
  CHECK(found[0].key == "over");
  m.object(4096 + 64, "inside", 1000, 'f');  // inside the long key's object
  found = m.scan(true, false, &cleared);
  REQUIRE(found.size() == 3);  // over, inside, last
  CHECK(found[1].key == "inside");
  CHECK(cleared == 1);  // the long key's record: its bytes changed

  // A segment mounted fresh clears every record.
  found = m.scan(false, true, &cleared);
  CHECK(found.empty());
  CHECK(cleared == 3);
  CHECK(m.scan().empty());
}

TEST_CASE("object record: records that claim bytes before the segment or past its end") {
  memory m(4096);
  // A record at offset 64 claiming 1000 bytes before it.
  std::vector<std::byte> rec(64);
  REQUIRE(rw::encode_record("x", 1000, 0, rec) == 64);
  std::copy(rec.begin(), rec.end(), m.bytes.begin() + 64);
  // A record whose key runs past the memory's end.
  std::vector<std::byte> long_rec(128);
  REQUIRE(rw::encode_record(std::string(40, 'y'), 10, 0, long_rec) == 128);
  std::copy(long_rec.begin(), long_rec.begin() + 64, m.bytes.end() - 64);
  std::uint64_t cleared = 0;
  CHECK(m.scan(true, false, &cleared).empty());
  CHECK(cleared == 2);
}
