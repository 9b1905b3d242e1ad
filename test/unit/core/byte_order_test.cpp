// Tests of include/kvlink/core/byte_order.hpp: little-endian whatever the
// buffer's alignment, and what is put reads back.
#include <kvlink/core/byte_order.hpp>

#include <cstddef>
#include <cstdint>

#include <doctest/doctest.h>

TEST_CASE("byte order: little-endian at any offset, round trips") {
  std::byte b[16] = {};
  kvlink::detail::put_u32(b + 1, 0x11223344u);
  CHECK(b[1] == std::byte{0x44});
  CHECK(b[4] == std::byte{0x11});
  CHECK(kvlink::detail::get_u32(b + 1) == 0x11223344u);
  kvlink::detail::put_u64(b + 3, 0x0102030405060708ULL);
  CHECK(b[3] == std::byte{0x08});
  CHECK(b[10] == std::byte{0x01});
  CHECK(kvlink::detail::get_u64(b + 3) == 0x0102030405060708ULL);
  CHECK(b[0] == std::byte{0});
  CHECK(b[11] == std::byte{0});
}
