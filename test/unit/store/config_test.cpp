// Tests for include/kvlink/store/master/config.hpp: defaults, validation and
// the settings table.
#include <kvlink/store/master/config.hpp>

#include <chrono>
#include <string>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

using namespace kvlink::store;
using std::chrono::milliseconds;

TEST_CASE("master_config: Mooncake's defaults, and validation") {
  const master_config c;
  CHECK_FALSE(c.validate());
  CHECK(c.lease_ttl == milliseconds{10'000});
  CHECK(c.put_discard_timeout == milliseconds{30'000});
  CHECK(c.put_release_timeout == milliseconds{600'000});
  CHECK(c.eviction_high_watermark == 90);
  CHECK(c.eviction_share == 5);
  CHECK(c.max_key_size == 4096);
  auto bad = [](auto change) {
    master_config m;
    change(m);
    return m.validate() == kvlink::errc::invalid_argument;
  };
  CHECK(bad([](master_config& m) { m.alignment = 48; }));
  CHECK(bad([](master_config& m) { m.max_key_size = 0; }));
  CHECK(bad([](master_config& m) { m.max_key_size = 70'000; }));
  CHECK(bad([](master_config& m) { m.eviction_high_watermark = 101; }));
  CHECK(bad([](master_config& m) { m.eviction_share = 0; }));
  CHECK(bad([](master_config& m) { m.put_release_timeout = milliseconds{1}; }));
  CHECK(bad([](master_config& m) { m.placement = "closest"; }));
  CHECK(bad([](master_config& m) { m.max_soft_pin_ttl = milliseconds{1}; }));
}

TEST_CASE("master_config: parsed through the settings table") {
  const auto table = master_setting_table();
  master_config c;
  std::string what;
  const auto j = nlohmann::json::parse(R"({"store_lease_ttl": "5s",
      "store_eviction_high_watermark": 95, "store_placement": "most_free",
      "store_alignment": "4KiB", "store_put_release_timeout": "10min"})");
  REQUIRE_FALSE(kvlink::apply_json<master_config>(table, j, c, &what));
  CHECK(c.lease_ttl == milliseconds{5'000});
  CHECK(c.eviction_high_watermark == 95);
  CHECK(c.placement == "most_free");
  CHECK(c.alignment == 4096);
  CHECK_FALSE(c.validate());
  placement_policy p{};
  CHECK_FALSE(parse_placement(c.placement, p));
  CHECK(p == placement_policy::most_free);
  CHECK(kvlink::apply_json<master_config>(table, nlohmann::json::parse(R"({"store_x": 1})"), c,
                                          &what) == kvlink::errc::invalid_argument);
  CHECK(what.find("store_x") != std::string::npos);
}

TEST_CASE("master_clock: milliseconds of a steady clock") {
  const auto a = master_clock::now();
  const auto b = master_clock::now();
  CHECK(b >= a);
  static_assert(master_clock::is_steady);
}
