// engine.hpp's built-in transports (TCP, same-host shared memory) and its
// etcd and HTTP metadata backends, compiled in one translation unit instead
// of in every one that includes the engine.
//
// kvlink is header-only: every translation unit of a program that includes
// <kvlink/engine.hpp> compiles these (the engine makes them from its
// config), and a program of many such files pays for that many times over.
// Opt in, as with Asio's separate compilation: define
// KVLINK_SEPARATE_COMPILATION in every translation unit of the program (a
// compile definition of the target, never in some files only), and include
// this header in exactly one of them:
//
//   // kvlink_engine.cpp, built with -DKVLINK_SEPARATE_COMPILATION like the rest
//   #include <kvlink/separate.hpp>
//
// kvlink's own tests are built so (test/CMakeLists.txt); its examples,
// benches, tools and Python module are header-only, as a user builds them.
#pragma once

#ifndef KVLINK_SEPARATE_COMPILATION
#error "<kvlink/separate.hpp> is for programs built with KVLINK_SEPARATE_COMPILATION"
#endif

#include <kvlink/engine.hpp>

#include <memory>
#include <string>
#include <system_error>
#include <utility>

namespace kvlink::detail {

std::shared_ptr<transport> make_tcp_transport(const transport_env& env, const config& cfg) {
  return std::make_shared<tcp::transport>(env, cfg.tcp);
}

std::shared_ptr<transport> make_shm_transport(const transport_env& env, const config& cfg) {
  return std::make_shared<shm::transport>(env, cfg.shm);
}

std::shared_ptr<metadata_backend> start_etcd_metadata(asio::any_io_executor ex,
                                                      etcd_metadata::options o,
                                                      const control::peer_descriptor& self,
                                                      std::error_code& ec, std::string& what) {
  auto b = std::make_shared<etcd_metadata>(std::move(ex), std::move(o));
  ec = b->start(self, what);
  return b;
}

std::shared_ptr<metadata_backend> start_http_metadata(asio::any_io_executor ex,
                                                      http_metadata::options o,
                                                      const control::peer_descriptor& self,
                                                      std::error_code& ec, std::string& what) {
  auto b = std::make_shared<http_metadata>(std::move(ex), std::move(o));
  ec = b->start(self, what);
  return b;
}

}  // namespace kvlink::detail
