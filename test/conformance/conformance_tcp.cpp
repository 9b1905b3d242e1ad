// The conformance suite over TCP (two engines on loopback).
#include <kvlink/engine.hpp>

#include "suite.hpp"
#include <doctest/doctest.h>

namespace conformance {

kvlink::config base_config() {
  kvlink::config c;
  c.transports = "tcp";
  c.fence_timeout = 200ms;
  c.connect_timeout = 5s;
  return c;
}
std::string expected_transport() { return "tcp"; }
std::uint64_t max_transfer() { return 64u << 20; }

}  // namespace conformance
