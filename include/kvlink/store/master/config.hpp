// The store master's settings and its clock.
//
// master_config holds what the master's logic (object table, segment table,
// eviction) is tuned with; master_settings is its row table (JSON name,
// environment variable, unit, doc) for kvlink::setting_row's machinery, so
// the master program parses and documents it like the engine's config.
// Defaults are Mooncake's (lease 10 s, soft pin 30 min up to 24 h, discard
// 30 s, release 10 min, high watermark 90 %, evict 5 %).
//
// master_clock is the time every operation of the object table is given
// (`now`): a steady clock in milliseconds. Tests pass made-up time points,
// so expiry is deterministic; nothing in store/master/ reads a clock itself.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/settings.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace kvlink::store {

/// A steady clock with millisecond ticks: what `now` arguments are.
struct master_clock {
  using rep = std::int64_t;
  using period = std::milli;
  using duration = std::chrono::milliseconds;
  using time_point = std::chrono::time_point<master_clock>;
  static constexpr bool is_steady = true;
  static time_point now() noexcept {
    return time_point{
        std::chrono::duration_cast<duration>(std::chrono::steady_clock::now().time_since_epoch())};
  }
};
using master_time = master_clock::time_point;

/// How put_start picks segments for replicas, after the request's preferred
/// segments and, when it names a host, that host's segments.
enum class placement_policy : std::uint8_t {
  random,     ///< from a random segment on (Mooncake's default)
  most_free,  ///< the segments with the most free bytes first
};

/// "random" or "most_free"; nothing else.
inline std::error_code parse_placement(std::string_view text, placement_policy& out) {
  if (text == "random") {
    out = placement_policy::random;
  } else if (text == "most_free") {
    out = placement_policy::most_free;
  } else {
    return kvlink::errc::invalid_argument;
  }
  return {};
}

struct master_config {
  /// Longest key in bytes.
  std::uint64_t max_key_size = 4096;
  /// Every allocation in a segment starts at, and is rounded up to, a
  /// multiple of this (a power of two, at least 64: the object records of
  /// store/wire/record.hpp lie at multiples of 64).
  std::uint64_t alignment = 64;
  /// Read lease granted by get (and by exists when lease_on_exists).
  std::chrono::milliseconds lease_ttl{10'000};
  /// Whether exists grants a read lease, as Mooncake's ExistKey does.
  bool lease_on_exists = true;
  /// Whether objects carry a record after their bytes (store/wire/record.hpp)
  /// that lets a restarted master take them back from their owners. Off:
  /// a master restart forgets every object; puts move one slice less per
  /// object, its checksum is not computed, and objects of a batch lie next
  /// to each other (transfers coalesce). Told to clients in the welcome.
  bool object_records = true;
  /// Soft pin time when a put asks for a soft pin without a time; the most a
  /// put may ask for.
  std::chrono::milliseconds soft_pin_ttl{30 * 60'000};
  std::chrono::milliseconds max_soft_pin_ttl{24 * 3'600'000};
  /// A put not ended this long after put_start is discarded: its key is free
  /// again and put_end fails. Its space stays reserved (its writer may still
  /// be writing into it) until put_release_timeout after put_start.
  std::chrono::milliseconds put_discard_timeout{30'000};
  std::chrono::milliseconds put_release_timeout{600'000};
  /// Eviction starts when the pool is this full (percent of its bytes) or
  /// an allocation failed, and then frees this share of the pool (percent).
  std::uint32_t eviction_high_watermark = 90;
  std::uint32_t eviction_share = 5;
  /// Whether soft-pinned objects are evicted when nothing else is.
  bool evict_soft_pinned = true;
  /// "random" or "most_free" (see placement_policy).
  std::string placement = "random";
  /// Seed of random placement: the same seed places the same way.
  std::uint64_t placement_seed = 1;

  /// invalid_argument when a value is out of range (alignment not a power
  /// of two, a watermark above 100, release before discard, ...).
  std::error_code validate() const {
    placement_policy p{};
    if (max_key_size == 0 || max_key_size > 65535 || alignment < 64 ||
        (alignment & (alignment - 1)) != 0 || lease_ttl.count() < 0 || soft_pin_ttl.count() < 0 ||
        max_soft_pin_ttl < soft_pin_ttl || put_discard_timeout.count() <= 0 ||
        put_release_timeout < put_discard_timeout || eviction_high_watermark > 100 ||
        eviction_share == 0 || eviction_share > 100 || parse_placement(placement, p)) {
      return kvlink::errc::invalid_argument;
    }
    return {};
  }
};

inline constexpr std::array master_settings{
    setting_row<master_config>{"store_max_key_size", "KVLINK_STORE_MAX_KEY_SIZE",
                               setting_kind::size, &master_config::max_key_size,
                               "longest key accepted, in bytes (at most 65535)"},
    setting_row<master_config>{"store_alignment", "KVLINK_STORE_ALIGNMENT", setting_kind::size,
                               &master_config::alignment,
                               "allocations in a segment are aligned to and rounded up to this "
                               "(a power of two)"},
    setting_row<master_config>{"store_lease_ttl", "KVLINK_STORE_LEASE_TTL", setting_kind::duration,
                               &master_config::lease_ttl,
                               "read lease a get grants: the object is not evicted or removed "
                               "meanwhile (Mooncake default_kv_lease_ttl)"},
    setting_row<master_config>{"store_lease_on_exists", "KVLINK_STORE_LEASE_ON_EXISTS",
                               setting_kind::boolean, &master_config::lease_on_exists,
                               "whether exists grants a read lease too, as Mooncake's ExistKey"},
    setting_row<master_config>{"store_object_records", "KVLINK_STORE_OBJECT_RECORDS",
                               setting_kind::boolean, &master_config::object_records,
                               "objects carry a record their owners announce to a restarted "
                               "master (no object lost); off: a restart forgets every object, "
                               "puts are cheaper"},
    setting_row<master_config>{"store_soft_pin_ttl", "KVLINK_STORE_SOFT_PIN_TTL",
                               setting_kind::duration, &master_config::soft_pin_ttl,
                               "soft pin time of a put that asks for one without a time"},
    setting_row<master_config>{"store_max_soft_pin_ttl", "KVLINK_STORE_MAX_SOFT_PIN_TTL",
                               setting_kind::duration, &master_config::max_soft_pin_ttl,
                               "longest soft pin a put may ask for (longer ones are cut)"},
    setting_row<master_config>{"store_put_discard_timeout", "KVLINK_STORE_PUT_DISCARD_TIMEOUT",
                               setting_kind::duration, &master_config::put_discard_timeout,
                               "a put not ended this long after its start is discarded"},
    setting_row<master_config>{"store_put_release_timeout", "KVLINK_STORE_PUT_RELEASE_TIMEOUT",
                               setting_kind::duration, &master_config::put_release_timeout,
                               "the space of a discarded put is reused this long after its start"},
    setting_row<master_config>{"store_eviction_high_watermark",
                               "KVLINK_STORE_EVICTION_HIGH_WATERMARK", setting_kind::count,
                               &master_config::eviction_high_watermark,
                               "percent of the pool's bytes in use at which eviction starts"},
    setting_row<master_config>{"store_eviction_share", "KVLINK_STORE_EVICTION_SHARE",
                               setting_kind::count, &master_config::eviction_share,
                               "percent of the pool's bytes one eviction round frees"},
    setting_row<master_config>{"store_evict_soft_pinned", "KVLINK_STORE_EVICT_SOFT_PINNED",
                               setting_kind::boolean, &master_config::evict_soft_pinned,
                               "whether soft-pinned objects are evicted when nothing else is"},
    setting_row<master_config>{"store_placement", "KVLINK_STORE_PLACEMENT", setting_kind::text,
                               &master_config::placement,
                               "how replicas are placed after preferred and same-host segments: "
                               "random or most_free"},
    setting_row<master_config>{"store_placement_seed", "KVLINK_STORE_PLACEMENT_SEED",
                               setting_kind::count, &master_config::placement_seed,
                               "seed of random placement"},
};

/// master_settings lifted for the settings machinery (apply_json,
/// apply_env, describe_settings), component "store".
inline std::vector<basic_setting<master_config>> master_setting_table() {
  std::vector<basic_setting<master_config>> out;
  lift_settings(out, "store", master_settings);
  return out;
}

}  // namespace kvlink::store
