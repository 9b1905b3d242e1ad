#include <kvlink/core/types.hpp>

#include <type_traits>

#include <doctest/doctest.h>

TEST_CASE("segment ids are strong types") {
  static_assert(!std::is_convertible_v<std::uint64_t, kvlink::segment_id>);
  static_assert(!std::is_convertible_v<kvlink::segment_id, std::uint64_t>);
  static_assert(!std::is_convertible_v<kvlink::peer_id, kvlink::segment_id>);
  kvlink::segment_id a{3}, b{4};
  CHECK(a < b);
  CHECK(a != b);
  CHECK_FALSE(kvlink::segment_id{}.valid());
  CHECK(std::hash<kvlink::segment_id>{}(a) ==
        std::hash<kvlink::segment_id>{}(kvlink::segment_id{3}));
}

TEST_CASE("access flags") {
  using kvlink::access;
  CHECK(kvlink::allows(access::remote_read_write, access::remote_read));
  CHECK(kvlink::allows(access::remote_read_write, access::remote_write));
  CHECK_FALSE(kvlink::allows(access::remote_read, access::remote_write));
  CHECK((access::remote_read | access::remote_write) == access::remote_read_write);
  CHECK(kvlink::required_access(kvlink::opcode::read) == access::remote_read);
  CHECK(kvlink::required_access(kvlink::opcode::write) == access::remote_write);
}

TEST_CASE("transfer_result bandwidth is in GB/s (10^9 B/s)") {
  kvlink::transfer_result r;
  r.bytes = 2'000'000'000;
  r.duration = std::chrono::seconds{1};
  CHECK(r.gb_per_s() == doctest::Approx(2.0));
  CHECK(kvlink::transfer_result{}.gb_per_s() == 0.0);
}
