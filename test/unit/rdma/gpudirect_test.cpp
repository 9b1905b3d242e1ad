// Tests of include/kvlink/rdma/gpudirect.hpp: every branch of the choice
// between dma-buf, nvidia-peermem and staging for device memory, the
// reasons it gives, and the nvidia-peermem probe on fake sysfs trees.
#include <kvlink/rdma/gpudirect.hpp>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>

#include <doctest/doctest.h>
#include <unistd.h>

namespace rdma = kvlink::rdma;
using rdma::gpudirect_method;

namespace {

// Device memory with a dma-buf fd and ibv_reg_dmabuf_mr: the best case.
rdma::gpudirect_facts dmabuf_ready() {
  rdma::gpudirect_facts f;
  f.device_memory = true;
  f.dmabuf_fd = true;
  f.dmabuf_start = 0x7f0000000000;
  f.dmabuf_length = 2u << 20;
  f.dmabuf_offset = 4096;
  f.have_reg_dmabuf_mr = true;
  return f;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("gpudirect: host memory is registered as host memory") {
  rdma::gpudirect_facts f;
  f.peermem = true;  // irrelevant for host memory
  const auto c = rdma::choose_gpudirect(f);
  CHECK(c.method == gpudirect_method::host);
  CHECK(contains(c.reason, "host memory"));
}

TEST_CASE("gpudirect: dma-buf first, with the range its fd covers") {
  auto f = dmabuf_ready();
  f.peermem = true;  // dma-buf wins over peermem
  const auto c = rdma::choose_gpudirect(f);
  CHECK(c.method == gpudirect_method::dmabuf);
  CHECK(c.reason == "dmabuf (fd covering [0x7f0000000000, +2097152), range at offset 4096)");
  CHECK(rdma::to_string(c.method) == "dmabuf");
}

TEST_CASE("gpudirect: without a dma-buf fd, peermem, saying why not dma-buf") {
  auto f = dmabuf_ready();
  f.dmabuf_fd = false;
  f.dmabuf_error = "CUDA device 0 has no dma-buf support";
  f.peermem = true;
  const auto c = rdma::choose_gpudirect(f);
  CHECK(c.method == gpudirect_method::peermem);
  CHECK(c.reason ==
        "peermem (ibv_reg_mr on the device pointer; no dma-buf: CUDA device 0 has no dma-buf "
        "support)");
  // No reason from the runtime: a generic one.
  f.dmabuf_error.clear();
  CHECK(contains(rdma::choose_gpudirect(f).reason, "no dma-buf: the device runtime gave no"));
}

TEST_CASE("gpudirect: an fd but no ibv_reg_dmabuf_mr in libibverbs") {
  auto f = dmabuf_ready();
  f.have_reg_dmabuf_mr = false;
  auto c = rdma::choose_gpudirect(f);
  CHECK(c.method == gpudirect_method::staging);
  CHECK(contains(c.reason, "no ibv_reg_dmabuf_mr"));
  CHECK(contains(c.reason, "no nvidia-peermem"));
  f.peermem = true;
  c = rdma::choose_gpudirect(f);
  CHECK(c.method == gpudirect_method::peermem);
  CHECK(contains(c.reason, "no ibv_reg_dmabuf_mr"));
}

TEST_CASE("gpudirect: ibv_reg_dmabuf_mr failed: peermem, else staging") {
  auto f = dmabuf_ready();
  f.reg_dmabuf_error = EOPNOTSUPP;
  auto c = rdma::choose_gpudirect(f);
  CHECK(c.method == gpudirect_method::staging);
  CHECK(contains(c.reason, "ibv_reg_dmabuf_mr: Operation not supported"));
  f.peermem = true;
  c = rdma::choose_gpudirect(f);
  CHECK(c.method == gpudirect_method::peermem);
  CHECK(contains(c.reason, "ibv_reg_dmabuf_mr: Operation not supported"));
}

TEST_CASE("gpudirect: peermem loaded but ibv_reg_mr failed: staging with both reasons") {
  auto f = dmabuf_ready();
  f.dmabuf_fd = false;
  f.dmabuf_error = "no dma-buf for you";
  f.peermem = true;
  f.reg_mr_error = EFAULT;
  const auto c = rdma::choose_gpudirect(f);
  CHECK(c.method == gpudirect_method::staging);
  CHECK(c.reason ==
        "staging (no dma-buf: no dma-buf for you; nvidia-peermem is loaded but ibv_reg_mr on the "
        "device pointer: Bad address)");
}

TEST_CASE("gpudirect: the emulated device goes through staging") {
  rdma::gpudirect_facts f;
  f.device_memory = true;
  f.dmabuf_error =
      "the emulated device has no dma-buf export (RDMA moves its memory through staging)";
  f.have_reg_dmabuf_mr = true;
  const auto c = rdma::choose_gpudirect(f);
  CHECK(c.method == gpudirect_method::staging);
  CHECK(c.reason ==
        "staging (no dma-buf: the emulated device has no dma-buf export (RDMA moves its memory "
        "through staging); no nvidia-peermem)");
  CHECK(rdma::to_string(c.method) == "staging");
}

TEST_CASE("gpudirect: nvidia-peermem found in sysfs by either of its marks") {
  const auto root =
      std::filesystem::temp_directory_path() / ("kvlink-gpudirect-" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root / "sys/module/ib_core");
  CHECK_FALSE(rdma::peermem_loaded(root));
  std::filesystem::create_directories(root / "sys/module/nvidia_peermem");
  CHECK(rdma::peermem_loaded(root));
  std::filesystem::remove_all(root / "sys/module/nvidia_peermem");
  CHECK_FALSE(rdma::peermem_loaded(root));
  std::filesystem::create_directories(root / "sys/kernel/mm/memory_peers/nv_mem");
  std::ofstream{root / "sys/kernel/mm/memory_peers/nv_mem/version"} << "1.3\n";
  CHECK(rdma::peermem_loaded(root));
  std::filesystem::remove_all(root);
  CHECK_FALSE(rdma::peermem_loaded(root));
}
