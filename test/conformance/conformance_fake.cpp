// The conformance suite over the fake in-process transport (memcpy between
// engines, test/support/fake_transport.hpp): the engine's contract without a
// network.
#include "fake_transport.hpp"
#include "suite.hpp"
#include <doctest/doctest.h>

namespace conformance {

kvlink::config base_config() {
  static const bool added = (kvlink_test::add_fake_transport(), true);
  (void)added;
  kvlink::config c;
  c.transports = "fake";
  c.fence_timeout = 200ms;
  c.connect_timeout = 5s;
  return c;
}
std::string expected_transport() { return "fake"; }
std::uint64_t max_transfer() { return 64u << 20; }

}  // namespace conformance
