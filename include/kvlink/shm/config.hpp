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
  /// Bytes one copy call moves at most (one process_vm_writev/readv, one
  /// memcpy): a lane looks at cancellation and deadlines between calls, so
  /// this bounds how much a stopped transfer still copies (a few ms at
  /// memcpy speed), at the price of a call per max_copy bytes.
  std::uint64_t max_copy = std::uint64_t{4} << 20;
  /// A peer's segment in shared memory (shm::shared_memory) up to this size
  /// is mapped with its page tables filled (MAP_POPULATE), once, when the
  /// first transfer leases it: the first copy into it then runs at memcpy
  /// speed instead of about 1-2 GB/s of page faults (0.16-0.2 s per GiB
  /// here). Zero: never. The same bound is shared_memory::allocate's default
  /// for pre-faulting its own pages.
  std::uint64_t prefault = std::uint64_t{1} << 30;
  /// Slices up to this size between our host memory and a peer's private
  /// memory go through a ring the peer copies out of (shm/ring.hpp): two
  /// memcpys on two cores instead of a cross-memory attach that pins every
  /// page of every piece. Zero: never; at most 64 KiB (a ring slot).
  std::uint64_t ring_max = std::uint64_t{32} << 10;

  friend bool operator==(const shm_config&, const shm_config&) = default;
};

inline constexpr std::array shm_settings{
    setting_row<shm_config>{"shm_lanes", "KVLINK_SHM_LANES", setting_kind::count,
                            &shm_config::lanes,
                            "same-host copy lanes per peer; slices are striped over them"},
    setting_row<shm_config>{"shm_max_copy", "KVLINK_SHM_MAX_COPY", setting_kind::size,
                            &shm_config::max_copy,
                            "bytes one same-host copy call moves at most; cancellation and "
                            "deadlines take effect between calls"},
    setting_row<shm_config>{"shm_prefault", "KVLINK_SHM_PREFAULT", setting_kind::size,
                            &shm_config::prefault,
                            "a peer's shared-memory segment up to this size is mapped with its "
                            "pages pre-faulted (0: never)"},
    setting_row<shm_config>{"shm_ring_max", "KVLINK_SHM_RING_MAX", setting_kind::size,
                            &shm_config::ring_max,
                            "slices up to this size to or from a peer's private memory go "
                            "through a ring the peer copies (0: never; at most 64 KiB)"},
};

/// The same-host transport's own rules; the first broken one is
/// invalid_argument with `what` naming the setting.
inline std::error_code validate(const shm_config& c, std::string* what = nullptr) {
  using detail::fail;
  if (c.lanes == 0) return fail(what, "shm_lanes: must be at least 1");
  if (c.lanes > 64) return fail(what, "shm_lanes: at most 64");
  if (c.max_copy < 4096) return fail(what, "shm_max_copy: at least 4 KiB");
  if (c.ring_max > (64u << 10)) return fail(what, "shm_ring_max: at most 64 KiB (a ring slot)");
  return {};
}

}  // namespace kvlink
