// The device layer's settings: which device runtime an engine uses for
// device (GPU) memory and how much pinned staging it keeps. kvlink::config
// (engine/config.hpp) holds one as `config.device`.
#pragma once

#include <kvlink/core/settings.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <system_error>

namespace kvlink {

struct device_config {
  /// The device runtime (memory/device.hpp): "auto" = CUDA when this
  /// program has it (kvlink/cuda.hpp, kvlink::cuda) and a GPU is present,
  /// else none; "none"; "cuda"; "emulated" (the CPU-only stand-in for tests
  /// and CI: never chosen by "auto").
  std::string runtime = "auto";
  /// Bytes of one staging chunk (pinned host memory a device slice passes
  /// through when its transport cannot reach device memory); 0 = the largest
  /// slice the planner cuts (slice_size + min_chunk - 1).
  std::uint64_t staging_chunk = 0;
  /// Bytes of pinned staging memory per device and engine (chunks in
  /// flight at once = staging_bytes / staging_chunk, at least 2).
  std::uint64_t staging_bytes = 32u << 20;

  friend bool operator==(const device_config&, const device_config&) = default;
};

inline constexpr std::array device_settings{
    setting_row<device_config>{
        "device", "KVLINK_DEVICE", setting_kind::text, &device_config::runtime,
        "device runtime for GPU memory: auto (CUDA when present), none, cuda, emulated (a "
        "CPU-only stand-in for tests; never chosen by auto)"},
    setting_row<device_config>{"staging_chunk", "KVLINK_STAGING_CHUNK", setting_kind::size,
                               &device_config::staging_chunk,
                               "pinned staging chunk for device memory a transport cannot reach; "
                               "0 = the largest slice (slice_size + min_chunk - 1)"},
    setting_row<device_config>{"staging_bytes", "KVLINK_STAGING_BYTES", setting_kind::size,
                               &device_config::staging_bytes,
                               "pinned staging memory per device and engine"},
};

/// The device settings' own rules; the first broken one is invalid_argument
/// with `what` naming the setting.
inline std::error_code validate(const device_config& c, std::string* what = nullptr) {
  using detail::fail;
  if (c.runtime.empty()) return fail(what, "device: empty (auto, none, cuda or emulated)");
  for (const char ch : c.runtime) {
    if (!((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_')) {
      return fail(what, "device: \"" + c.runtime +
                            "\" is not a runtime name (auto, none, cuda, "
                            "emulated)");
    }
  }
  if (c.staging_chunk != 0 && c.staging_chunk < 4096) {
    return fail(what, "staging_chunk: at least 4 KiB (or 0 for the largest slice)");
  }
  if (c.staging_chunk > (1ull << 30)) return fail(what, "staging_chunk: at most 1 GiB");
  if (c.staging_bytes < (64u << 10)) return fail(what, "staging_bytes: at least 64 KiB");
  if (c.staging_bytes > (64ull << 30)) return fail(what, "staging_bytes: at most 64 GiB");
  return {};
}

}  // namespace kvlink
