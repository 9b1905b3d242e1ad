// The definitions of the engine's built-in transports' factories (TCP,
// same-host shared memory) and of the starts of its etcd and HTTP metadata
// backends, which engine.hpp and engine/core.hpp declare: included at the
// end of <kvlink/engine.hpp> in a header-only build (the default), and by
// <kvlink/separate.hpp> alone with KVLINK_SEPARATE_COMPILATION (see there).
#pragma once

#include <kvlink/detail/decl.hpp>
#include <kvlink/engine.hpp>

#include <memory>
#include <string>
#include <system_error>
#include <utility>

namespace kvlink::detail {

KVLINK_DECL std::shared_ptr<transport> make_tcp_transport(const transport_env& env,
                                                          const config& cfg) {
  return std::make_shared<tcp::transport>(env, cfg.tcp);
}

KVLINK_DECL std::shared_ptr<transport> make_shm_transport(const transport_env& env,
                                                          const config& cfg) {
  return std::make_shared<shm::transport>(env, cfg.shm);
}

KVLINK_DECL std::shared_ptr<metadata_backend> start_etcd_metadata(
    asio::any_io_executor ex, etcd_metadata::options o, const control::peer_descriptor& self,
    std::error_code& ec, std::string& what) {
  auto b = std::make_shared<etcd_metadata>(std::move(ex), std::move(o));
  ec = b->start(self, what);
  return b;
}

KVLINK_DECL std::shared_ptr<metadata_backend> start_http_metadata(
    asio::any_io_executor ex, http_metadata::options o, const control::peer_descriptor& self,
    std::error_code& ec, std::string& what) {
  auto b = std::make_shared<http_metadata>(std::move(ex), std::move(o));
  ec = b->start(self, what);
  return b;
}

}  // namespace kvlink::detail
