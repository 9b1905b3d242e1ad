// The same-host transport's settings: its struct and its rows of the
// settings table (core/settings.hpp). kvlink::config (engine/config.hpp)
// holds one as `config.shm`.
#pragma once

#include <kvlink/core/settings.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <system_error>

namespace kvlink {

struct shm_config {
  /// Copy lanes per peer: each a strand of its own, so an io_context run by
  /// N threads copies on up to min(N, lanes) cores.
  std::uint32_t lanes = 2;

  friend bool operator==(const shm_config&, const shm_config&) = default;
};

inline constexpr std::array shm_settings{
    setting_row<shm_config>{"shm_lanes", "KVLINK_SHM_LANES", setting_kind::count,
                            &shm_config::lanes,
                            "same-host copy lanes per peer; slices are striped over them"},
};

/// The same-host transport's own rules; the first broken one is
/// invalid_argument with `what` naming the setting.
inline std::error_code validate(const shm_config& c, std::string* what = nullptr) {
  using detail::fail;
  if (c.lanes == 0) return fail(what, "shm_lanes: must be at least 1");
  if (c.lanes > 64) return fail(what, "shm_lanes: at most 64");
  return {};
}

}  // namespace kvlink
