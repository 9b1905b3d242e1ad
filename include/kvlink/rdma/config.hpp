// The RDMA transport's settings: its struct and its rows of the settings
// table (core/settings.hpp). kvlink::config (engine/config.hpp) holds one
// as `config.rdma`. Plain data: no verbs headers here.
#pragma once

#include <kvlink/core/settings.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>

namespace kvlink {

struct rdma_config {
  /// Comma-separated device names; empty = all.
  std::string devices{};
  /// -1 = pick a RoCEv2 GID automatically.
  std::int32_t gid_index = -1;
  std::uint32_t qps_per_endpoint = 2;
  /// Outstanding work requests per QP.
  std::uint32_t max_wr = 256;
  /// Work requests per ibv_post_send chain; only the last is signaled.
  std::uint32_t chain = 16;

  friend bool operator==(const rdma_config&, const rdma_config&) = default;
};

inline constexpr std::array rdma_settings{
    setting_row<rdma_config>{"rdma_devices", "KVLINK_RDMA_DEVICES", setting_kind::text,
                             &rdma_config::devices,
                             "comma-separated RDMA device names to use; empty = all"},
    setting_row<rdma_config>{"rdma_gid_index", "KVLINK_RDMA_GID_INDEX", setting_kind::index,
                             &rdma_config::gid_index,
                             "GID table index; -1 = pick a RoCEv2 GID automatically"},
    setting_row<rdma_config>{"rdma_qps_per_endpoint", "KVLINK_RDMA_QPS_PER_ENDPOINT",
                             setting_kind::count, &rdma_config::qps_per_endpoint,
                             "RDMA queue pairs per peer and NIC"},
    setting_row<rdma_config>{"rdma_max_wr", "KVLINK_RDMA_MAX_WR", setting_kind::count,
                             &rdma_config::max_wr, "outstanding work requests per queue pair"},
    setting_row<rdma_config>{
        "rdma_chain", "KVLINK_RDMA_CHAIN", setting_kind::count, &rdma_config::chain,
        "work requests posted as one chain (one ibv_post_send, one signaled completion); a "
        "chain also ends at 256 KiB; 1 = each slice posted and signaled on its own"},
};

/// The RDMA transport's own rules; the first broken one is invalid_argument
/// with `what` naming the setting.
inline std::error_code validate(const rdma_config& c, std::string* what = nullptr) {
  using detail::fail;
  if (!c.devices.empty()) {
    std::string_view rest = c.devices;
    while (true) {
      const std::size_t comma = rest.find(',');
      const std::string_view dev = rest.substr(0, comma);
      if (dev.empty() || dev.find_first_of(" \t") != std::string_view::npos) {
        return fail(what, "rdma_devices: \"" + c.devices +
                              "\" must be device names separated by commas, without spaces or "
                              "empty names");
      }
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }
  if (c.gid_index < -1) {
    return fail(what, "rdma_gid_index: " + std::to_string(c.gid_index) +
                          " is invalid (-1 = automatic, else a GID table index)");
  }
  if (c.qps_per_endpoint == 0) return fail(what, "rdma_qps_per_endpoint: must be at least 1");
  if (c.max_wr == 0) return fail(what, "rdma_max_wr: must be at least 1");
  if (c.chain == 0) return fail(what, "rdma_chain: must be at least 1");
  return {};
}

}  // namespace kvlink
