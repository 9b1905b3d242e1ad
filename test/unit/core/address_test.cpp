// Tests of include/kvlink/core/address.hpp: the one host:port parser.
#include <kvlink/core/address.hpp>

#include <cstdint>
#include <string_view>

#include <doctest/doctest.h>

TEST_CASE("split_host_port: hosts, IPv4, bracketed IPv6, ports 0..65535") {
  struct good {
    std::string_view text, host;
    std::uint16_t port;
  };
  for (const auto& g :
       {good{"127.0.0.1:17001", "127.0.0.1", 17001}, good{"0.0.0.0:0", "0.0.0.0", 0},
        good{"localhost:65535", "localhost", 65535}, good{"[::1]:80", "::1", 80},
        good{"[fe80::1%eth0]:1", "fe80::1%eth0", 1},
        good{"decode-3.cluster:17001", "decode-3.cluster", 17001}}) {
    CAPTURE(g.text);
    std::string_view host;
    std::uint16_t port = 7;
    REQUIRE(kvlink::split_host_port(g.text, host, port));
    CHECK(host == g.host);
    CHECK(port == g.port);
  }
  for (const char* bad : {"", "localhost", ":80", "host:", "host:65536", "host:8o", "::1:80",
                          "[::1]", "[]:80", "[::1:80", "host :80", "host:123456", "no-port-here"}) {
    CAPTURE(bad);
    std::string_view host = "unchanged";
    std::uint16_t port = 7;
    CHECK_FALSE(kvlink::split_host_port(bad, host, port));
    CHECK(host == "unchanged");  // outputs untouched on failure
    CHECK(port == 7);
  }
}

TEST_CASE("join_host_port brackets IPv6 and round-trips") {
  CHECK(kvlink::join_host_port("10.0.0.1", 17001) == "10.0.0.1:17001");
  CHECK(kvlink::join_host_port("::1", 80) == "[::1]:80");
  std::string_view host;
  std::uint16_t port = 0;
  const auto text = kvlink::join_host_port("fe80::2", 9);
  REQUIRE(kvlink::split_host_port(text, host, port));
  CHECK(host == "fe80::2");
  CHECK(port == 9);
}
