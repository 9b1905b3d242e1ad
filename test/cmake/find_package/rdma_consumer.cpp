// Links through kvlink::rdma: libibverbs' headers and library must come with
// it, and kvlink/rdma.hpp puts the RDMA transport in the program. A machine
// without RDMA devices is fine: the engine says why it has no RDMA and serves
// over TCP; what is checked is that the program builds, links, loads and
// makes an engine whose transports name rdma.
#include <kvlink/rdma.hpp>

#include <cstdio>
#include <string>

#include <asio/io_context.hpp>

int main() {
  asio::io_context io;
  kvlink::rdma_engine eng{io.get_executor()};
  const std::string offer = eng.transports();
  std::printf("kvlink %s: transports %s\n", kvlink::version_string, offer.c_str());
  return offer.find("rdma") == std::string::npos ? 1 : 0;
}
