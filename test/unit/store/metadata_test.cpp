// Tests for include/kvlink/store/master/metadata.hpp: Mooncake's HTTP
// metadata protocol over the bounded table (the server's sockets are
// server_test.cpp's; engines publishing through it, test/metadata).
#include <kvlink/store/master/metadata.hpp>

#include <string>

#include <doctest/doctest.h>

using kvlink::store::http_request;
using kvlink::store::metadata_table;
using kvlink::store::route_metadata;

namespace {

kvlink::store::http_answer md_call(metadata_table& t, std::string_view method,
                                   std::string_view target, std::string_view body = {},
                                   std::string_view token = {}, std::string_view auth = {}) {
  http_request r;
  r.method = method;
  r.target = target;
  r.body = body;
  r.authorization = auth;
  return route_metadata(t, token, r);
}

}  // namespace

TEST_CASE("metadata server: GET, PUT and DELETE of a value under ?key=") {
  metadata_table t(1024, 1 << 20);
  CHECK(md_call(t, "GET", "/metadata?key=mooncake%2Fram%2Fhost-1").status == 404);
  CHECK(md_call(t, "PUT", "/metadata?key=mooncake%2Fram%2Fhost-1", "{\"a\":1}").status == 200);
  const auto got = md_call(t, "GET", "/metadata?x=1&key=mooncake/ram/host-1");
  CHECK(got.status == 200);
  CHECK(got.body == "{\"a\":1}");
  CHECK(got.content_type == "application/json");
  // A re-put replaces; the bytes held follow.
  CHECK(md_call(t, "PUT", "/metadata?key=mooncake/ram/host-1", "xy").status == 200);
  CHECK(md_call(t, "GET", "/metadata?key=mooncake/ram/host-1").body == "xy");
  CHECK(t.size() == 1);
  CHECK(t.bytes() == std::string("mooncake/ram/host-1").size() + 2);
  // '+' is a space, keys are trimmed, values are bytes (NUL included).
  CHECK(md_call(t, "PUT", "/metadata?key=+a+b%09", std::string_view("\0\xff", 2)).status == 200);
  CHECK(md_call(t, "GET", "/metadata?key=a%20b").body == std::string("\0\xff", 2));
  CHECK(md_call(t, "DELETE", "/metadata?key=a+b").status == 200);
  CHECK(md_call(t, "DELETE", "/metadata?key=a+b").status == 404);
  CHECK(md_call(t, "GET", "/metadata?key=a+b").status == 404);
  CHECK(t.size() == 1);
}

TEST_CASE("metadata server: bad requests get their status and change nothing") {
  metadata_table t(8, 50);
  CHECK(md_call(t, "PUT", "/metadata?key=k", "v").status == 200);
  CHECK(md_call(t, "GET", "/metadata").status == 400);
  CHECK(md_call(t, "GET", "/metadata?key=").status == 400);
  CHECK(md_call(t, "GET", "/metadata?key=%20%20").status == 400);
  CHECK(md_call(t, "GET", "/metadata?key=%zz").status == 400);
  CHECK(md_call(t, "GET", "/metadata?key=%4").status == 400);
  CHECK(md_call(t, "GET", "/metadata?key=k%").status == 400);
  CHECK(md_call(t, "GET", "/other?key=k").status == 404);
  CHECK(md_call(t, "POST", "/metadata?key=k", "v").status == 405);
  // A value over max_value: 413; the table full: 507 (a re-put of the same
  // size still fits).
  CHECK(md_call(t, "PUT", "/metadata?key=big", "123456789").status == 413);
  CHECK(md_call(t, "PUT", "/metadata?key=k2", "12345678").status == 200);
  CHECK(md_call(t, "PUT", "/metadata?key=k3", "12345678").status == 200);
  CHECK(md_call(t, "PUT", "/metadata?key=k4", "12345678").status == 200);
  CHECK(md_call(t, "PUT", "/metadata?key=k5", "12345678").status == 200);
  CHECK(t.bytes() == 2 + 4 * 10);
  const auto full = md_call(t, "PUT", "/metadata?key=k6", "12345678");
  CHECK(full.status == 507);
  CHECK(full.body.find("store_metadata_capacity") != std::string::npos);
  CHECK(md_call(t, "PUT", "/metadata?key=k5", "87654321").status == 200);
  CHECK(md_call(t, "GET", "/metadata?key=k5").body == "87654321");
  CHECK(md_call(t, "GET", "/metadata?key=k").body == "v");
  CHECK(t.size() == 5);
}

TEST_CASE("metadata server: with a token, requests without it are 401") {
  metadata_table t(1024, 1 << 20);
  CHECK(md_call(t, "PUT", "/metadata?key=k", "v", "t0ken").status == 401);
  CHECK(md_call(t, "PUT", "/metadata?key=k", "v", "t0ken", "Bearer nope").status == 401);
  CHECK(md_call(t, "PUT", "/metadata?key=k", "v", "t0ken", "Bearer t0ke").status == 401);
  CHECK(t.size() == 0);
  CHECK(md_call(t, "PUT", "/metadata?key=k", "v", "t0ken", "Bearer t0ken").status == 200);
  CHECK(md_call(t, "GET", "/metadata?key=k", {}, "t0ken").status == 401);
  CHECK(md_call(t, "GET", "/metadata?key=k", {}, "t0ken", "Bearer t0ken").body == "v");
}
