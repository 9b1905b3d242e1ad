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

TEST_CASE("crc32c: the three-stream path (3 x 8 KiB blocks) agrees with the table path") {
  std::mt19937_64 g{5};
  const std::size_t block = 3 * kvlink::detail::crc32c_lane;
  std::vector<unsigned char> buf(3 * block + 64);
  for (auto& b : buf) b = static_cast<unsigned char>(g());
  for (std::size_t off : {0u, 1u, 5u}) {
    for (std::size_t len :
         {block - 1, block, block + 1, block + 8, 2 * block - 3, 2 * block, 3 * block + 13}) {
      CAPTURE(off);
      CAPTURE(len);
      const auto whole = kvlink::crc32c(buf.data() + off, len, 0xDEADBEEF);
      CHECK(whole == kvlink::crc32c_portable(buf.data() + off, len, 0xDEADBEEF));
      const std::size_t cut = len / 3;
      CHECK(kvlink::crc32c(buf.data() + off + cut, len - cut,
                           kvlink::crc32c(buf.data() + off, cut, 0xDEADBEEF)) == whole);
    }
  }
  // Shifting a state over a lane of zeros is feeding it a lane of zeros.
  std::vector<unsigned char> zeros(kvlink::detail::crc32c_lane, 0);
  for (std::uint32_t state : {0x1u, 0x80000000u, 0x12345678u, 0xFFFFFFFFu}) {
    CHECK(kvlink::detail::crc32c_shift_lane(state) ==
          kvlink::detail::crc32c_soft(state, zeros.data(), zeros.size()));
  }
}
