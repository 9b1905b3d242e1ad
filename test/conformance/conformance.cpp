// The conformance suite over one transport, chosen at run time by
// KVLINK_CONFORMANCE_TRANSPORT (ctest runs it once per transport):
//   fake  the fake in-process transport (memcpy between engines,
//         test/support/fake_transport.hpp): the engine's contract without a
//         network;
//   tcp   TCP, two engines on loopback;
//   shm   the same-host transport, two engines in one process (cross-memory
//         attach to our own pid takes the same kernel path as to another
//         process's; test/unit/shm runs two).
// One executable for the three: the suite and the engine are compiled once.
#include <kvlink/engine.hpp>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "fake_transport.hpp"
#include "suite.hpp"
#include "test_support.hpp"
#include <doctest/doctest.h>

namespace conformance {

namespace {
std::string transport_under_test() {
  const char* t = std::getenv("KVLINK_CONFORMANCE_TRANSPORT");
  const std::string name = t != nullptr ? t : "";
  if (name != "fake" && name != "tcp" && name != "shm") {
    throw std::invalid_argument(
        "set KVLINK_CONFORMANCE_TRANSPORT to fake, tcp or shm (ctest does)");
  }
  return name;
}
}  // namespace

kvlink::config base_config() {
  static const std::string name = transport_under_test();
  if (name == "fake") {
    static const bool added = (kvlink_test::add_fake_transport(), true);
    (void)added;
  }
  kvlink::config c;
  c.transports = name;
  c.fence_timeout = 200ms;
  c.connect_timeout = 5s;
  return c;
}
std::string expected_transport() { return transport_under_test(); }
// Under ThreadSanitizer (several times slower per byte; large transfers add
// no interleavings) 16 MiB: the suite fills and compares whole buffers.
std::uint64_t max_transfer() { return kvlink_test::under_thread_sanitizer ? 16u << 20 : 64u << 20; }

}  // namespace conformance
