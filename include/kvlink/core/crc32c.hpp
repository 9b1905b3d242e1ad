// CRC32C (Castagnoli), the checksum of kvlink's optional end-to-end payload
// checks: the SSE4.2 crc32 instruction where the CPU has it (found once, at
// run time), a table-driven fallback elsewhere. Both give the same value.
//
//   std::uint32_t c = kvlink::crc32c(data, size);        // whole buffer
//   c = kvlink::crc32c(more, n, c);                       // continued
//
// crc32c("123456789") == 0xE3069283. No I/O, no Asio.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kvlink {

namespace detail {

inline const std::array<std::array<std::uint32_t, 256>, 8>& crc32c_tables() {
  static const auto tables = [] {
    std::array<std::array<std::uint32_t, 256>, 8> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i) {
      for (std::size_t k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
    }
    return t;
  }();
  return tables;
}

// Slicing-by-8 over the raw (not inverted) state.
inline std::uint32_t crc32c_soft(std::uint32_t c, const unsigned char* p, std::size_t n) {
  const auto& t = crc32c_tables();
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
        t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

// Multiplication modulo the CRC32C polynomial, bit-reflected (x^0 is bit
// 31): shifting a raw state over n zero bytes is multiplying it by
// x^(8n) mod P. Slow (a bit at a time); used to build the tables below.
constexpr std::uint32_t crc32c_multmodp(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if ((a & m) != 0) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) != 0 ? (b >> 1) ^ 0x82F63B78u : b >> 1;
  }
  return p;
}

// x^(8n) mod P.
constexpr std::uint32_t crc32c_x8n(std::uint64_t n) noexcept {
  std::uint32_t x2k = 1u << 30;  // x^1
  std::uint32_t p = 1u << 31;    // x^0
  n *= 8;
  while (n != 0) {
    if ((n & 1) != 0) p = crc32c_multmodp(x2k, p);
    x2k = crc32c_multmodp(x2k, x2k);
    n >>= 1;
  }
  return p;
}

// The hardware path runs three independent streams over blocks of
// 3 x crc32c_lane bytes (the crc32 instruction's latency is three times its
// issue interval, so one stream leaves two thirds of it idle) and joins them
// by shifting a state over crc32c_lane zero bytes: a linear map of the
// state, one table per state byte.
inline constexpr std::size_t crc32c_lane = 8192;

inline const std::array<std::array<std::uint32_t, 256>, 4>& crc32c_shift_tables() {
  static const auto tables = [] {
    std::array<std::array<std::uint32_t, 256>, 4> t{};
    const std::uint32_t k = crc32c_x8n(crc32c_lane);
    for (std::uint32_t i = 0; i < 4; ++i) {
      for (std::uint32_t b = 0; b < 256; ++b) t[i][b] = crc32c_multmodp(k, b << (8 * i));
    }
    return t;
  }();
  return tables;
}

// The raw state `c` shifted over crc32c_lane zero bytes.
inline std::uint32_t crc32c_shift_lane(std::uint32_t c) noexcept {
  const auto& t = crc32c_shift_tables();
  return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_hw(std::uint32_t c,
                                                                 const unsigned char* p,
                                                                 std::size_t n) {
  std::uint64_t c64 = c;
  if (n >= 3 * crc32c_lane) {
    while (n >= 3 * crc32c_lane) {
      std::uint64_t c1 = 0, c2 = 0;
      const unsigned char* p1 = p + crc32c_lane;
      const unsigned char* p2 = p + 2 * crc32c_lane;
      for (std::size_t i = 0; i < crc32c_lane; i += 8) {
        std::uint64_t w0, w1, w2;
        std::memcpy(&w0, p + i, 8);
        std::memcpy(&w1, p1 + i, 8);
        std::memcpy(&w2, p2 + i, 8);
        c64 = _mm_crc32_u64(c64, w0);
        c1 = _mm_crc32_u64(c1, w1);
        c2 = _mm_crc32_u64(c2, w2);
      }
      std::uint32_t joined =
          crc32c_shift_lane(static_cast<std::uint32_t>(c64)) ^ static_cast<std::uint32_t>(c1);
      joined = crc32c_shift_lane(joined) ^ static_cast<std::uint32_t>(c2);
      c64 = joined;
      p += 3 * crc32c_lane;
      n -= 3 * crc32c_lane;
    }
  }
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c64);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

inline bool crc32c_hw_available() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace detail

/// CRC32C of [data, data + size), continuing from `crc` (0 to start).
inline std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  const std::uint32_t c = ~crc;
#if defined(__x86_64__)
  if (detail::crc32c_hw_available()) return ~detail::crc32c_hw(c, p, size);
#endif
  return ~detail::crc32c_soft(c, p, size);
}

/// The table-driven result, whatever the CPU (for tests).
inline std::uint32_t crc32c_portable(const void* data, std::size_t size, std::uint32_t crc = 0) {
  return ~detail::crc32c_soft(~crc, static_cast<const unsigned char*>(data), size);
}

}  // namespace kvlink
