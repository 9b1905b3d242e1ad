// The conformance suite (test/conformance/suite.hpp) over RDMA verbs: two
// engines in one process, inside a soft-RoCE VM, their data over the VM's
// rxe devices (rxe loops a host's own traffic back). Run by
// run-rdma-tests.sh on host 2 after the two-host scenarios.
#include <kvlink/rdma.hpp>

#include <cstdlib>
#include <string>

#include "../../conformance/suite.hpp"
#include <doctest/doctest.h>

namespace conformance {

kvlink::config base_config() {
  kvlink::config c;
  const char* self = std::getenv("KVLINK_SELF0");
  c.listen = std::string(self && *self ? self : "127.0.0.1") + ":0";
  c.transports = "rdma";  // RDMA or nothing: no silent TCP
  c.fence_timeout = 500ms;
  c.connect_timeout = 5s;
  return c;
}
std::string expected_transport() { return "rdma"; }
// Emulated rxe moves about 20 MB/s: keep the suite to a few MiB per transfer.
std::uint64_t max_transfer() { return 4u << 20; }

}  // namespace conformance
