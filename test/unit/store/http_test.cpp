// Tests for include/kvlink/store/master/http.hpp: request heads parsed, or
// refused, and answers formatted.
#include <kvlink/store/master/http.hpp>

#include <string>

#include <doctest/doctest.h>

using kvlink::store::format_http;
using kvlink::store::http_answer;
using kvlink::store::parse_http_head;

TEST_CASE("parse_http_head: the request line and the headers the routes use") {
  const auto r = parse_http_head(
      "PUT /metadata?key=a%20b HTTP/1.1\r\nHost: x\r\ncontent-length:  12 \r\n"
      "AUTHORIZATION: Bearer t0\r\nExpect: 100-Continue\r\n\r\n");
  REQUIRE(r);
  CHECK(r->method == "PUT");
  CHECK(r->target == "/metadata?key=a%20b");
  CHECK(r->content_length == 12);
  CHECK(r->authorization == "Bearer t0");
  CHECK(r->expect_continue);
  CHECK_FALSE(r->chunked);

  const auto g = parse_http_head("GET /health HTTP/1.0\r\n\r\n");
  REQUIRE(g);
  CHECK(g->method == "GET");
  CHECK(g->content_length == 0);
  CHECK(g->authorization.empty());
  CHECK_FALSE(g->expect_continue);

  const auto c = parse_http_head("PUT /m HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
  REQUIRE(c);
  CHECK(c->chunked);
  // The same length twice is fine.
  CHECK(parse_http_head("PUT /m HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n"));
}

TEST_CASE("parse_http_head: what is not an HTTP/1.x request is refused") {
  for (const char* bad : {
           "",
           "GET /health\r\n\r\n",                             // no version
           "GET /health HTTP/2\r\n\r\n",                      // not 1.x
           " /x HTTP/1.1\r\n\r\n",                            // no method
           "GET  HTTP/1.1\r\n\r\n",                           // no target
           "GET /x HTTP/1.1\r\nno colon here\r\n\r\n",        // a header without ':'
           "GET /x HTTP/1.1\r\n: empty name\r\n\r\n",         // a header without a name
           "PUT /x HTTP/1.1\r\nContent-Length: 12a\r\n\r\n",  // not a number
           "PUT /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n",   // negative
           "PUT /x HTTP/1.1\r\nContent-Length: 1234567890123456789\r\n\r\n",  // 19 digits
           "PUT /x HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
           "GET /x HTTP/1.1\r\nHost: x",      // a head that does not end
           "GET /x HTTP/1.1\r\nHost: x\r\n",  // nor does this one (no empty line)
       }) {
    INFO(bad);
    CHECK_FALSE(parse_http_head(bad));
  }
}

TEST_CASE("format_http: status, reason, length, and the connection closed") {
  CHECK(format_http(http_answer{200, "application/json", "{}"}) ==
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
        "Connection: close\r\n\r\n{}");
  CHECK(format_http({401, "text/plain", ""}).starts_with("HTTP/1.1 401 Unauthorized\r\n"));
  CHECK(format_http({411, "text/plain", ""}).starts_with("HTTP/1.1 411 Length Required\r\n"));
  CHECK(format_http({413, "text/plain", ""}).starts_with("HTTP/1.1 413 Content Too Large\r\n"));
  CHECK(format_http({507, "text/plain", ""}).starts_with("HTTP/1.1 507 Insufficient Storage\r\n"));
}
