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

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_hw(std::uint32_t c,
                                                                 const unsigned char* p,
                                                                 std::size_t n) {
  std::uint64_t c64 = c;
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
