// The TCP transport's settings: its struct and its rows of the settings
// table (core/settings.hpp). kvlink::config (engine/config.hpp) holds one
// as `config.tcp`; the JSON names and environment variables are those of the
// whole table ("tcp_lanes", KVLINK_TCP_LANES).
#pragma once

#include <kvlink/core/settings.hpp>
#include <kvlink/tcp/frame.hpp>

#include <array>
#include <climits>
#include <cstdint>
#include <string>
#include <system_error>

namespace kvlink {

struct tcp_config {
  /// TCP connections per peer.
  std::uint32_t lanes = 2;
  /// Slices in flight per lane.
  std::uint32_t max_inflight_per_lane = 32;
  /// Bytes, SO_SNDBUF/SO_RCVBUF; 0 = kernel default.
  std::uint64_t socket_buffer = 4 << 20;
  bool nodelay = true;
  /// Bytes; largest data-frame payload a target accepts.
  std::uint64_t max_frame_payload = 64 << 20;
  /// Most pieces one vector frame carries (tcp/frame.hpp), as target (what
  /// it advertises) and as initiator; 0 or 1: none.
  std::uint32_t vector_pieces = 256;

  friend bool operator==(const tcp_config&, const tcp_config&) = default;
};

inline constexpr std::array tcp_settings{
    setting_row<tcp_config>{"tcp_lanes", "KVLINK_TCP_LANES", setting_kind::count,
                            &tcp_config::lanes,
                            "TCP connections per peer; slices are striped over them"},
    setting_row<tcp_config>{"max_inflight_per_lane", "KVLINK_MAX_INFLIGHT_PER_LANE",
                            setting_kind::count, &tcp_config::max_inflight_per_lane,
                            "slices in flight per lane"},
    setting_row<tcp_config>{"socket_buffer", "KVLINK_SOCKET_BUFFER", setting_kind::size,
                            &tcp_config::socket_buffer,
                            "SO_SNDBUF/SO_RCVBUF of each lane; 0 = kernel default"},
    setting_row<tcp_config>{"tcp_nodelay", "KVLINK_TCP_NODELAY", setting_kind::boolean,
                            &tcp_config::nodelay, "set TCP_NODELAY on every connection"},
    setting_row<tcp_config>{"max_frame_payload", "KVLINK_MAX_FRAME_PAYLOAD", setting_kind::size,
                            &tcp_config::max_frame_payload,
                            "largest data-frame payload a target accepts"},
    setting_row<tcp_config>{"tcp_vector_pieces", "KVLINK_TCP_VECTOR_PIECES", setting_kind::count,
                            &tcp_config::vector_pieces,
                            "most small slices one TCP frame carries (0 or 1: a frame each)"},
};

/// The TCP transport's own rules; the first broken one is invalid_argument
/// with `what` naming the setting.
inline std::error_code validate(const tcp_config& c, std::string* what = nullptr) {
  using detail::fail;
  if (c.lanes == 0) return fail(what, "tcp_lanes: must be at least 1");
  if (c.max_inflight_per_lane == 0) return fail(what, "max_inflight_per_lane: must be at least 1");
  if (c.vector_pieces > tcp::max_vector_pieces) {
    return fail(what, "tcp_vector_pieces: " + std::to_string(c.vector_pieces) +
                          " exceeds the most a frame may carry (" +
                          std::to_string(tcp::max_vector_pieces) + ")");
  }
  if (c.socket_buffer > static_cast<std::uint64_t>(INT_MAX)) {
    return fail(what, "socket_buffer: " + std::to_string(c.socket_buffer) +
                          " exceeds the largest SO_SNDBUF/SO_RCVBUF value (2147483647)");
  }
  return {};
}

}  // namespace kvlink
