// The conformance suite over the same-host transport (two engines in one
// process: cross-memory attach to our own pid takes the same kernel path as
// to another process's; test/unit/engine/same_host_test.cpp runs two).
#include <kvlink/engine.hpp>

#include "suite.hpp"
#include <doctest/doctest.h>

namespace conformance {

kvlink::config base_config() {
  kvlink::config c;
  c.transports = "shm";
  c.fence_timeout = 200ms;
  c.connect_timeout = 5s;
  return c;
}
std::string expected_transport() { return "shm"; }
std::uint64_t max_transfer() { return 64u << 20; }

}  // namespace conformance
