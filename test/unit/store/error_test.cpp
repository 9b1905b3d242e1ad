// Tests for include/kvlink/store/error.hpp: Mooncake's integers and messages.
#include <kvlink/store/error.hpp>

#include <string>
#include <system_error>

#include <doctest/doctest.h>

using kvlink::mooncake_code;
using kvlink::store_errc;

TEST_CASE("store_errc: Mooncake's integers") {
  CHECK(mooncake_code({}) == 0);
  CHECK(mooncake_code(store_errc::internal_error) == -1);
  CHECK(mooncake_code(store_errc::buffer_overflow) == -10);
  CHECK(mooncake_code(store_errc::segment_not_found) == -101);
  CHECK(mooncake_code(store_errc::segment_already_exists) == -102);
  CHECK(mooncake_code(store_errc::no_space) == -200);
  CHECK(mooncake_code(store_errc::invalid_key) == -400);
  CHECK(mooncake_code(store_errc::invalid_params) == -600);
  CHECK(mooncake_code(store_errc::illegal_client) == -601);
  CHECK(mooncake_code(store_errc::object_in_progress) == -703);
  CHECK(mooncake_code(store_errc::object_not_found) == -704);
  CHECK(mooncake_code(store_errc::object_already_exists) == -705);
  CHECK(mooncake_code(store_errc::object_has_lease) == -706);
  CHECK(mooncake_code(store_errc::lease_expired) == -707);
  CHECK(mooncake_code(store_errc::transfer_failed) == -800);
  CHECK(mooncake_code(store_errc::checksum_mismatch) == -801);
  CHECK(mooncake_code(store_errc::rpc_failed) == -900);
  CHECK(mooncake_code(store_errc::rpc_timeout) == -901);
  CHECK(mooncake_code(store_errc::object_hard_pinned) == -706);
  CHECK(mooncake_code(store_errc::object_loading) == -703);
  CHECK(mooncake_code(std::make_error_code(std::errc::io_error)) == -1);
}

TEST_CASE("store_errc: category and messages") {
  const std::error_code ec = store_errc::no_space;
  CHECK(std::string(ec.category().name()) == "kvlink.store");
  CHECK(ec.message().find("back off") != std::string::npos);
  CHECK(std::error_code(store_errc::object_not_found).message().find("no such object") == 0);
  CHECK(ec.category().message(12345) == "unknown store error");
}
