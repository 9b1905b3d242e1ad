// Tests of include/kvlink/core/crc32c.hpp: known values, the hardware and
// table paths agree, continuation, and a flipped bit always changes it.
#include <kvlink/core/crc32c.hpp>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <doctest/doctest.h>

TEST_CASE("crc32c: known values") {
  const std::string nine = "123456789";
  CHECK(kvlink::crc32c(nine.data(), nine.size()) == 0xE3069283u);
  CHECK(kvlink::crc32c_portable(nine.data(), nine.size()) == 0xE3069283u);
  CHECK(kvlink::crc32c(nullptr, 0) == 0u);
  std::vector<unsigned char> zeros(32, 0);
  CHECK(kvlink::crc32c(zeros.data(), zeros.size()) == 0x8A9136AAu);  // RFC 3720 B.4
  std::vector<unsigned char> ones(32, 0xFF);
  CHECK(kvlink::crc32c(ones.data(), ones.size()) == 0x62A8AB43u);
}

TEST_CASE("crc32c: every length and alignment agrees with the table path; continuation") {
  std::mt19937_64 g{3};
  std::vector<unsigned char> buf(4096 + 16);
  for (auto& b : buf) b = static_cast<unsigned char>(g());
  for (std::size_t off = 0; off < 16; ++off) {
    for (std::size_t len : {0u, 1u, 7u, 8u, 9u, 63u, 64u, 1000u, 4096u}) {
      CAPTURE(off);
      CAPTURE(len);
      const auto whole = kvlink::crc32c(buf.data() + off, len);
      CHECK(whole == kvlink::crc32c_portable(buf.data() + off, len));
      const auto half = len / 2;
      CHECK(kvlink::crc32c(buf.data() + off + half, len - half,
                           kvlink::crc32c(buf.data() + off, half)) == whole);
    }
  }
  const auto base = kvlink::crc32c(buf.data(), 4096);
  for (int bit = 0; bit < 4096 * 8; bit += 97) {
    buf[static_cast<std::size_t>(bit / 8)] ^= static_cast<unsigned char>(1u << (bit % 8));
    CHECK(kvlink::crc32c(buf.data(), 4096) != base);
    buf[static_cast<std::size_t>(bit / 8)] ^= static_cast<unsigned char>(1u << (bit % 8));
  }
}
