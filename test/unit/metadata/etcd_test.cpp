// The pure parts of the etcd backend; the backend itself runs against a
// real etcd in test/metadata (ctest label metadata).
#include <kvlink/metadata/etcd.hpp>

#include <string>

#include <doctest/doctest.h>

TEST_CASE("etcd: the key range of a prefix, and int64 fields written as strings") {
  CHECK(kvlink::detail::prefix_range_end("kvlink/engines/") == "kvlink/engines0");
  CHECK(kvlink::detail::prefix_range_end("a") == "b");
  CHECK(kvlink::detail::prefix_range_end(std::string("a\xff", 2)) == "b");
  CHECK(kvlink::detail::prefix_range_end(std::string("\xff", 1)) == std::string(1, '\0'));

  const auto j = nlohmann::json::parse(R"({"revision": "42", "ID": 7, "bad": "x1", "neg": "-3"})");
  CHECK(kvlink::detail::json_int64(j, "revision") == 42);
  CHECK(kvlink::detail::json_int64(j, "ID") == 7);
  CHECK(kvlink::detail::json_int64(j, "bad") == 0);
  CHECK(kvlink::detail::json_int64(j, "neg") == -3);
  CHECK(kvlink::detail::json_int64(j, "missing") == 0);
}
