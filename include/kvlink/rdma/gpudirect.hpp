// How the RDMA transport registers device (GPU) memory, decided from what
// is known, with no I/O, so every branch is unit-tested on a machine with
// neither a GPU nor a NIC (test/unit/rdma/gpudirect_test.cpp):
//
//   1. dmabuf:  the device runtime gives a dma-buf fd for the range
//               (device_runtime::dmabuf_fd, whole pages) and libibverbs has
//               ibv_reg_dmabuf_mr (rdma-core 34+), which has not failed for
//               it: one fd, registered on every port's protection domain.
//   2. peermem: nvidia-peermem is loaded, so ibv_reg_mr takes the device
//               pointer itself (and has not failed for it).
//   3. staging: neither; the bytes go through pinned host staging with the
//               device's copy engine (engine/staging.hpp).
//
// The reason is one line for the log and the peer's description:
//   "dmabuf (fd covering [0x7f0000000000, +2097152), range at offset 4096)"
//   "staging (no dma-buf: the emulated device has no dma-buf export; no nvidia-peermem)"
//
//   kvlink::rdma::gpudirect_facts f{.device_memory = true, .dmabuf_fd = fd >= 0, ...};
//   auto choice = kvlink::rdma::choose_gpudirect(f);   // choice.method, choice.reason
//
// A registration that then fails is fed back (reg_dmabuf_error,
// reg_mr_error) and the choice asked again: it moves down the list.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

namespace kvlink::rdma {

enum class gpudirect_method : std::uint8_t {
  host,     ///< host memory: plain ibv_reg_mr
  dmabuf,   ///< ibv_reg_dmabuf_mr on the runtime's dma-buf fd
  peermem,  ///< ibv_reg_mr on the device pointer (nvidia-peermem)
  staging,  ///< no GPUDirect: pinned host staging and the copy engine
};

constexpr std::string_view to_string(gpudirect_method m) noexcept {
  switch (m) {
    case gpudirect_method::host:
      return "host";
    case gpudirect_method::dmabuf:
      return "dmabuf";
    case gpudirect_method::peermem:
      return "peermem";
    case gpudirect_method::staging:
      return "staging";
  }
  return "?";
}

/// What is known about registering one range for RDMA.
struct gpudirect_facts {
  /// The range is device memory (device_runtime::classify); false: host.
  bool device_memory = false;

  /// The runtime gave a dma-buf fd for the range: it covers
  /// [dmabuf_start, dmabuf_start + dmabuf_length), whole pages, and the
  /// range begins `dmabuf_offset` bytes into it.
  bool dmabuf_fd = false;
  std::uint64_t dmabuf_start = 0;
  std::uint64_t dmabuf_length = 0;
  std::uint64_t dmabuf_offset = 0;
  /// Why the runtime gave none (its `what`), when it did not.
  std::string dmabuf_error;

  /// libibverbs has ibv_reg_dmabuf_mr (rdma-core 34 or later).
  bool have_reg_dmabuf_mr = false;
  /// ibv_reg_dmabuf_mr was tried on the fd and failed with this errno.
  std::optional<int> reg_dmabuf_error;

  /// nvidia-peermem is loaded (peermem_loaded()).
  bool peermem = false;
  /// ibv_reg_mr on the device pointer was tried and failed with this errno.
  std::optional<int> reg_mr_error;
};

struct gpudirect_choice {
  gpudirect_method method = gpudirect_method::staging;
  std::string reason;  ///< one line: the method, then why
};

namespace detail {
inline std::string errno_text(int e) {
  return std::error_code(e, std::system_category()).message();
}
}  // namespace detail

/// dmabuf, else peermem, else staging (host memory: host), with the reason.
inline gpudirect_choice choose_gpudirect(const gpudirect_facts& f) {
  if (!f.device_memory) return {gpudirect_method::host, "host memory (ibv_reg_mr)"};

  // Why dma-buf is out, when it is.
  std::string no_dmabuf;
  if (!f.dmabuf_fd) {
    no_dmabuf = f.dmabuf_error.empty() ? "the device runtime gave no dma-buf fd" : f.dmabuf_error;
  } else if (!f.have_reg_dmabuf_mr) {
    no_dmabuf = "libibverbs has no ibv_reg_dmabuf_mr (needs rdma-core 34 or later)";
  } else if (f.reg_dmabuf_error) {
    no_dmabuf = "ibv_reg_dmabuf_mr: " + detail::errno_text(*f.reg_dmabuf_error);
  }
  if (no_dmabuf.empty()) {
    return {gpudirect_method::dmabuf,
            fmt::format("dmabuf (fd covering [{:#x}, +{}), range at offset {})", f.dmabuf_start,
                        f.dmabuf_length, f.dmabuf_offset)};
  }

  if (f.peermem && !f.reg_mr_error) {
    return {gpudirect_method::peermem,
            fmt::format("peermem (ibv_reg_mr on the device pointer; no dma-buf: {})", no_dmabuf)};
  }
  const std::string no_peermem =
      f.peermem ? "nvidia-peermem is loaded but ibv_reg_mr on the device pointer: " +
                      detail::errno_text(*f.reg_mr_error)
                : std::string{"no nvidia-peermem"};
  return {gpudirect_method::staging,
          fmt::format("staging (no dma-buf: {}; {})", no_dmabuf, no_peermem)};
}

/// Whether nvidia-peermem is loaded, read under `root` (a fake sysfs tree in
/// tests): /sys/kernel/mm/memory_peers/nv_mem/version (nvidia-peermem and
/// the older nv_peer_mem) or /sys/module/nvidia_peermem.
inline bool peermem_loaded(const std::filesystem::path& root = "/") {
  std::error_code ec;
  return std::filesystem::exists(root / "sys/kernel/mm/memory_peers/nv_mem/version", ec) ||
         std::filesystem::exists(root / "sys/module/nvidia_peermem", ec);
}

}  // namespace kvlink::rdma
