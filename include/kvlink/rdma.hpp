// kvlink with RDMA verbs: the engine (engine.hpp) plus the RDMA transport
// (rdma/transport.hpp) in this program's transport catalog. Link
// kvlink::rdma (libibverbs).
//
//   asio::io_context io;
//   kvlink::rdma_engine eng{io.get_executor(), kvlink::config{.listen = "10.0.0.1:0"}};
//   eng.transports();   // "rdma,tcp"; "tcp (rdma: no usable RDMA device ...)" without one
//   auto seg = co_await eng.async_register_segment(buf, len, kvlink::access::remote_read_write,
//                                                  asio::use_awaitable);
//   kvlink::peer p = co_await eng.async_connect("10.0.0.2:17001", asio::use_awaitable);
//   p.transport();      // "rdma" when both sides have a usable device, else "tcp"
//
// Any engine may name it: kvlink::engine with config.transports = "rdma,tcp".
#pragma once

#include <kvlink/detail/coroutines.hpp>
#include <kvlink/engine.hpp>
#include <kvlink/rdma/transport.hpp>

namespace kvlink::detail {

inline const bool rdma_in_catalog = transport_catalog::global().add(
    "rdma", 50, [](const transport_env& env, const config& cfg) -> std::shared_ptr<transport> {
      return std::make_shared<rdma::transport>(env, cfg.rdma);
    });

}  // namespace kvlink::detail
