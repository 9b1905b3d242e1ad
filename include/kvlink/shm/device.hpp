// Device memory over the same-host transport (shm/transport.hpp).
//
// A target grants a lease on a device segment with what its runtime's
// export_memory() gives (memory/device.hpp): the grant's "device" object,
//
//   {"runtime": "emulated", "method": "memfd", "handle": "<hex>", "fd": 12,
//    "index": 0, "size": 4194304, "offset": 4096}
//
// (`fd` is the descriptor's number in the target's process, absent when the
// method needs none; `offset` is where the segment starts inside the
// allocation). The initiator duplicates the descriptor with pidfd_getfd(2),
// imports the allocation through its own runtime of the same name and
// copies with that runtime's streams; an imported_allocation is shared by
// the leases on segments of one allocation and the copies in flight, and
// closed (close_imported) when the last of them lets go.
//
//   device_grant g;
//   if (auto e = parse_device_grant(body["device"], segment_length, g, why); e != errc{}) ...
//   auto a = std::make_shared<imported_allocation>(rt, rt->import_memory(g.memory, fd, ec, what),
//                                                  g.memory.device, g.memory.size);
#pragma once

#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/memory/device.hpp>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvlink::shm {

/// A device segment's grant: the exported allocation and where the segment
/// lies in it.
struct device_grant {
  std::string runtime;       ///< the exporting runtime's name ("emulated", "cuda")
  exported_memory memory;    ///< fd: the descriptor's number in the target
  std::uint64_t offset = 0;  ///< the segment's byte 0 inside the allocation
};

/// Whether `method` passes a descriptor the importer duplicates.
inline bool method_uses_fd(std::string_view method) noexcept {
  return method == "memfd" || method == "fd";
}

/// The grant's "device" object.
inline nlohmann::json to_json(const device_grant& g) {
  const auto& m = g.memory;
  nlohmann::json j{
      {"runtime", g.runtime},
      {"method", m.method},
      {"handle", control::to_hex(std::string_view(reinterpret_cast<const char*>(m.handle.data()),
                                                  m.handle.size()))},
      {"index", static_cast<std::uint64_t>(m.device < 0 ? 0 : m.device)},
      {"size", m.size},
      {"offset", g.offset}};
  if (m.fd >= 0) j["fd"] = static_cast<std::uint64_t>(m.fd);
  return j;
}

/// Reads a grant's "device" object for a segment of `length` bytes:
/// malformed_message (with `why`) unless every field is there and
/// well-formed, the method is one kvlink knows ("memfd", "fd": with a
/// descriptor; "ipc": with a handle) and the allocation holds the segment.
inline errc parse_device_grant(const nlohmann::json& j, std::uint64_t length, device_grant& out,
                               std::string& why) {
  std::string hex;
  std::uint64_t index = 0;
  if (!j.is_object() || !control::get_field(j, "runtime", out.runtime) ||
      !control::get_field(j, "method", out.memory.method) ||
      !control::get_field(j, "handle", hex) || !control::get_field(j, "index", index) ||
      !control::get_field(j, "size", out.memory.size) ||
      !control::get_field(j, "offset", out.offset)) {
    why = "its device grant lacks a field or has one of the wrong type";
    return errc::malformed_message;
  }
  const auto bytes = control::from_hex(hex);
  if (!bytes || bytes->size() > 4096) {
    why = "its device grant's handle is not hex (or is too long)";
    return errc::malformed_message;
  }
  out.memory.handle.assign(bytes->begin(), bytes->end());
  if (index > static_cast<std::uint64_t>(INT32_MAX)) {
    why = fmt::format("its device grant names device {}", index);
    return errc::malformed_message;
  }
  out.memory.device = static_cast<std::int32_t>(index);
  out.memory.fd = -1;
  if (j.contains("fd")) {
    std::uint64_t fd = 0;
    if (!control::get_field(j, "fd", fd) || fd > static_cast<std::uint64_t>(INT_MAX)) {
      why = "its device grant's descriptor is not a descriptor number";
      return errc::malformed_message;
    }
    out.memory.fd = static_cast<int>(fd);
  }
  if (method_uses_fd(out.memory.method)) {
    if (out.memory.fd < 0) {
      why = fmt::format("its device grant's method '{}' comes without a descriptor",
                        out.memory.method);
      return errc::malformed_message;
    }
  } else if (out.memory.method == "ipc") {
    if (out.memory.handle.empty()) {
      why = "its device grant's method 'ipc' comes without a handle";
      return errc::malformed_message;
    }
  } else {
    why = fmt::format("its device grant's method '{}' is none kvlink knows (memfd, fd, ipc)",
                      out.memory.method);
    return errc::malformed_message;
  }
  if (out.offset > out.memory.size || length > out.memory.size - out.offset) {
    why = fmt::format(
        "its device grant's allocation ({} bytes) does not hold the segment ({} bytes at {})",
        out.memory.size, length, out.offset);
    return errc::malformed_message;
  }
  return errc{};
}

/// A peer's device allocation imported here (RAII: close_imported when the
/// last holder, a lease or a copy in flight, lets go). Move-only.
class imported_allocation {
 public:
  imported_allocation(std::shared_ptr<device_runtime> rt, void* base, std::int32_t device,
                      std::uint64_t size) noexcept
      : rt_(std::move(rt)), base_(base), device_(device), size_(size) {}
  /// The peer is this process and the allocation is already ours: nothing
  /// was imported and nothing is closed (CUDA refuses to open an IPC handle
  /// in the process that made it).
  static std::shared_ptr<imported_allocation> own(void* base, std::int32_t device,
                                                  std::uint64_t size) {
    return std::make_shared<imported_allocation>(nullptr, base, device, size);
  }
  imported_allocation(const imported_allocation&) = delete;
  imported_allocation& operator=(const imported_allocation&) = delete;
  ~imported_allocation() {
    if (base_ != nullptr && rt_) rt_->close_imported(base_);
  }

  /// Where the allocation starts here (device memory: reached with a stream).
  std::byte* base() const noexcept { return static_cast<std::byte*>(base_); }
  std::int32_t device() const noexcept { return device_; }
  std::uint64_t size() const noexcept { return size_; }

 private:
  std::shared_ptr<device_runtime> rt_;
  void* base_;
  std::int32_t device_;
  std::uint64_t size_;
};

}  // namespace kvlink::shm
