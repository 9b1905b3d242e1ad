// Tests of include/kvlink/memory/cuda/runtime.hpp where CUDA is not usable:
// a program built with kvlink::cuda starts without a driver (or without a
// GPU), every pointer is host memory and every device call fails with
// no_device and the reason. With a usable GPU these cases have nothing to
// check; device_test.cpp covers the runtime there (ctest cuda.memory), and
// against a fake driver everywhere (unit.memory.fake_cuda).
// KVLINK_TEST_CUDA_REASON, when set, is the reason expected.
#ifdef KVLINK_TEST_HAS_CUDA
#include <kvlink/cuda.hpp>

#include <cstdlib>
#include <string>
#include <system_error>
#include <vector>

#include <asio/io_context.hpp>
#include <doctest/doctest.h>

TEST_CASE("cuda runtime: without a driver or a GPU, it says why and every pointer is host") {
  auto rt = kvlink::cuda_device::get();
  REQUIRE(rt);
  CHECK(kvlink::device_catalog::global().find("cuda") == rt);
  if (rt->available()) {
    MESSAGE("CUDA is usable here (", rt->device_count(), " devices): nothing to check");
    return;
  }
  const auto reason = rt->unavailable_reason();
  MESSAGE("unavailable: ", reason);
  if (const char* expected = std::getenv("KVLINK_TEST_CUDA_REASON")) {
    CHECK(reason == expected);
  } else {
    CHECK((reason.rfind("no CUDA driver (libcuda.so.1: ", 0) == 0 || reason == "no CUDA device"));
  }
  CHECK(rt->device_count() == 0);
  CHECK(rt->driver_version() >= 0);

  std::vector<std::byte> host(4096);
  const auto info = rt->classify(host.data());
  CHECK(info.memory.kind == kvlink::memory_kind::host);
  CHECK_FALSE(info.managed);

  std::error_code ec;
  std::string what;
  CHECK(rt->allocate(0, 4096, ec, what) == nullptr);
  CHECK(ec == kvlink::errc::no_device);
  CHECK(what.find(reason) != std::string::npos);
  ec = {};
  CHECK(rt->allocate_pinned(4096, ec, what) == nullptr);
  CHECK(ec == kvlink::errc::no_device);
  ec = {};
  asio::io_context io;
  CHECK(rt->open_stream(0, io.get_executor(), ec, what) == nullptr);
  CHECK(ec == kvlink::errc::no_device);
  kvlink::exported_memory m;
  CHECK(rt->export_memory(host.data(), m, what) == kvlink::errc::not_registered);
  m.method = "ipc";
  m.device = 0;
  m.size = 4096;
  m.handle.assign(64, 0);
  ec = {};
  CHECK(rt->import_memory(m, -1, ec, what) == nullptr);
  CHECK(ec == kvlink::errc::no_device);
  std::uint64_t offset = 7;
  ec = {};
  CHECK(rt->dmabuf_fd(host.data(), host.size(), offset, ec, what) == -1);
  CHECK(ec == kvlink::errc::no_device);
  rt->free(host.data());  // none of these touch memory they do not own
  rt->free_pinned(host.data());
  rt->close_imported(host.data());

  // config.device: "auto" quietly picks none; "cuda" is an error saying why.
  kvlink::device_config c;
  ec = {};
  CHECK(kvlink::device_catalog::global().select(c, ec, what) == nullptr);
  CHECK_FALSE(ec);
  c.runtime = "cuda";
  CHECK(kvlink::device_catalog::global().select(c, ec, what) == nullptr);
  CHECK(ec == kvlink::errc::no_device);
  CHECK(what.find(reason) != std::string::npos);
}
#endif
