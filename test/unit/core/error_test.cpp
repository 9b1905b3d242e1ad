#include <kvlink/core/error.hpp>

#include <set>

#include <doctest/doctest.h>

TEST_CASE("errc converts to std::error_code with kvlink's category") {
  std::error_code ec = kvlink::errc::out_of_bounds;
  CHECK(ec);
  CHECK(ec == kvlink::errc::out_of_bounds);
  CHECK(ec != kvlink::errc::not_registered);
  CHECK(std::string{ec.category().name()} == "kvlink");
  CHECK(ec.message().find("outside") != std::string::npos);
}

TEST_CASE("every errc has its own, non-generic message") {
  std::set<std::string> seen;
  for (int v = 1; v <= static_cast<int>(kvlink::errc_last); ++v) {
    auto msg = kvlink::make_error_code(static_cast<kvlink::errc>(v)).message();
    CHECK(msg != "unknown kvlink error");
    CHECK(seen.insert(msg).second);
  }
  CHECK(kvlink::make_error_code(static_cast<kvlink::errc>(999)).message() ==
        "unknown kvlink error");
}

TEST_CASE("errc values are stable: new codes are appended") {
  // Peers send these numbers (shm refusals, TCP acknowledgements).
  CHECK(static_cast<int>(kvlink::errc::not_registered) == 1);
  CHECK(static_cast<int>(kvlink::errc::name_not_found) == 23);
  CHECK(static_cast<int>(kvlink::errc::remote_memory_fault) == 24);
  CHECK(static_cast<int>(kvlink::errc::overlapping_destinations) == 25);
  CHECK(static_cast<int>(kvlink::errc::unsigned_entry) == 26);
  CHECK(static_cast<int>(kvlink::errc::device_error) == 27);
  CHECK(kvlink::errc_last == kvlink::errc::device_error);
}
