// Tests of include/kvlink/core/settings.hpp: the units of sizes and
// durations (the table machinery itself is tested through kvlink::config,
// test/unit/engine/config_test.cpp).
#include <kvlink/core/settings.hpp>

#include <chrono>
#include <cstdint>
#include <optional>

#include <doctest/doctest.h>

using namespace std::chrono_literals;

TEST_CASE("parse_size") {
  using kvlink::parse_size;
  CHECK(parse_size("512") == 512u);
  CHECK(parse_size("0") == 0u);
  CHECK(parse_size("512B") == 512u);
  CHECK(parse_size("512 b") == 512u);
  CHECK(parse_size("4MiB") == 4194304u);
  CHECK(parse_size("4 MiB") == 4194304u);
  CHECK(parse_size(" 4mib ") == 4194304u);
  CHECK(parse_size("64KiB") == 65536u);
  CHECK(parse_size("1GiB") == 1073741824u);
  CHECK(parse_size("2TiB") == 2199023255552u);
  CHECK(parse_size("1KB") == 1000u);
  CHECK(parse_size("1MB") == 1000000u);
  CHECK(parse_size("1GB") == 1000000000u);
  CHECK(parse_size("3TB") == 3000000000000u);
  CHECK(parse_size("1.5KiB") == 1536u);
  CHECK(parse_size("1.25 GB") == 1250000000u);
  CHECK(parse_size("18446744073709551615") == 18446744073709551615u);
  CHECK(parse_size("1.000000000000000000KiB") == 1024u);          // 18 fraction digits
  CHECK(parse_size("1.0000000000000000000KiB") == std::nullopt);  // 19: too many
  // Rejected: ambiguous or unknown units, signs, junk, fractions of a byte, overflow.
  for (const char* bad : {"",
                          " ",
                          "k",
                          "1k",
                          "1K",
                          "1M",
                          "1G",
                          "1 m",
                          "4XB",
                          "MiB",
                          "-1",
                          "+1",
                          "1.",
                          ".5KiB",
                          "1.5",
                          "1.3KiB",
                          "1..2",
                          "1 2",
                          "0x10",
                          "1MiBs",
                          "18446744073709551616",
                          "99999999999GiB",
                          "16777216TiB",
                          "99999999999999999999999999999999"}) {
    CAPTURE(bad);
    CHECK(parse_size(bad) == std::nullopt);
  }
}

TEST_CASE("parse_duration") {
  using kvlink::parse_duration;
  CHECK(parse_duration("250") == 250ms);
  CHECK(parse_duration("250ms") == 250ms);
  CHECK(parse_duration("2s") == 2000ms);
  CHECK(parse_duration("2 S") == 2000ms);
  CHECK(parse_duration("1.5s") == 1500ms);
  CHECK(parse_duration("5min") == 300000ms);
  CHECK(parse_duration("1h") == 3600000ms);
  CHECK(parse_duration("0") == 0ms);
  CHECK(parse_duration("9223372036854775807ms") == std::chrono::milliseconds::max());
  for (const char* bad : {"", "s", "5m", "5us", "1.0005s", "-1s", "2 days", "9223372036854775808",
                          "99999999999999999h"}) {
    CAPTURE(bad);
    CHECK(parse_duration(bad) == std::nullopt);
  }
}

TEST_CASE("format_size") {
  using kvlink::format_size;
  CHECK(format_size(0) == "0 B");
  CHECK(format_size(512) == "512 B");
  CHECK(format_size(1023) == "1023 B");
  CHECK(format_size(1024) == "1 KiB");
  CHECK(format_size(4u << 20) == "4 MiB");
  CHECK(format_size(1536) == "1.50 KiB");
  CHECK(format_size(3u << 29) == "1.50 GiB");
  CHECK(format_size((1u << 20) - 1) == "1.00 MiB");  // not "1024.00 KiB"
  CHECK(format_size(std::uint64_t{1} << 60) == "1 EiB");
  CHECK(format_size(18446744073709551615u) == "16.00 EiB");
  // Exact outputs parse back.
  for (std::uint64_t v : {std::uint64_t{512}, std::uint64_t{1024}, std::uint64_t{1536},
                          std::uint64_t{4} << 20, std::uint64_t{3} << 40}) {
    CHECK(kvlink::parse_size(format_size(v)) == v);
  }
}
