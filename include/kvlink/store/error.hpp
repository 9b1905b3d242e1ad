// The store's error codes (master and clients).
//
// kvlink::store_errc values are Mooncake Store's ErrorCode values negated
// (no_space = 200 is Mooncake's NO_AVAILABLE_HANDLE = -200), so that a
// Mooncake user's checks carry over through mooncake_code(); the few
// conditions Mooncake has no code for are numbered from 10000 and
// mooncake_code() gives the nearest Mooncake code for them (documented on
// each). Zero is never used: a default std::error_code means success.
#pragma once

#include <cstdint>
#include <string>
#include <system_error>

namespace kvlink {

/// The store's error conditions.
enum class store_errc : int {
  internal_error = 1,            ///< a bug or a broken invariant (Mooncake INTERNAL_ERROR -1)
  buffer_overflow = 10,          ///< the caller's buffer is too small (-10)
  segment_not_found = 101,       ///< no mounted segment of that id (-101)
  segment_already_exists = 102,  ///< this client already mounted a segment of that name (-102)
  client_not_found = 103,        ///< the client is unknown to the master (-103)
  no_space = 200,                ///< no segment has room (NO_AVAILABLE_HANDLE -200: back off)
  invalid_key = 400,             ///< a key empty or longer than the bound (-400)
  invalid_params = 600,          ///< a size, count or setting out of range (-600)
  illegal_client = 601,          ///< this client may not do that (not the writer) (-601)
  object_in_progress = 703,      ///< the object's put has not ended (REPLICA_IS_NOT_READY -703)
  object_not_found = 704,        ///< no such object (-704)
  object_already_exists = 705,   ///< the key was written already: first writer wins (-705)
  object_has_lease = 706,        ///< the object is being read (holds a read lease) (-706)
  lease_expired = 707,           ///< the read lease ran out before the read finished (-707)
  transfer_failed = 800,         ///< moving the bytes failed (TRANSFER_FAIL -800)
  checksum_mismatch = 801,       ///< the bytes read do not match their checksum (-801)
  rpc_failed = 900,              ///< the master could not be reached (RPC_FAIL -900)
  rpc_timeout = 901,             ///< the master did not answer in time (-901)
  // kvlink only, from 10000 on:
  object_hard_pinned = 10001,  ///< the object is hard-pinned (Mooncake: OBJECT_HAS_LEASE -706)
  object_loading = 10002,      ///< on its holder's disk, being read back (Mooncake: -703)
};

namespace detail {

class store_error_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "kvlink.store"; }

  std::string message(int ev) const override {
    switch (static_cast<store_errc>(ev)) {
      case store_errc::internal_error:
        return "internal error in the store (a bug: please report it with the master's log)";
      case store_errc::buffer_overflow:
        return "the buffer is smaller than the object: give a buffer of at least its size";
      case store_errc::segment_not_found:
        return "no mounted segment of that id (it was unmounted or its client is gone)";
      case store_errc::segment_already_exists:
        return "this client already mounted a segment of that name: unmount it first";
      case store_errc::client_not_found:
        return "the master does not know this client: remount its segments";
      case store_errc::no_space:
        return "no space in the pool for this object (every segment full and nothing "
               "evictable now): back off and retry later";
      case store_errc::invalid_key:
        return "invalid key: keys are non-empty and at most max_key_size bytes";
      case store_errc::invalid_params:
        return "invalid parameters: sizes must be > 0 and fit the largest segment, replica "
               "counts 1..max_replicas";
      case store_errc::illegal_client:
        return "this client may not do that: only the writer of a put ends or revokes it";
      case store_errc::object_in_progress:
        return "the object's put has not ended yet: it is invisible until put_end";
      case store_errc::object_not_found:
        return "no such object (never written, removed, evicted or lost with its segments)";
      case store_errc::object_already_exists:
        return "the object exists already: objects are immutable and the first writer wins";
      case store_errc::object_has_lease:
        return "the object is being read (it holds a read lease): retry after the lease or "
               "remove with force";
      case store_errc::lease_expired:
        return "the read lease ran out before the read finished: the bytes may have been "
               "replaced, read again";
      case store_errc::transfer_failed:
        return "moving the object's bytes failed";
      case store_errc::checksum_mismatch:
        return "the bytes read do not match the object's checksum";
      case store_errc::rpc_failed:
        return "the master cannot be reached";
      case store_errc::rpc_timeout:
        return "the master did not answer in time";
      case store_errc::object_hard_pinned:
        return "the object is hard-pinned: it is never evicted and only a forced remove "
               "deletes it";
      case store_errc::object_loading:
        return "the object is on its holder's disk and being read back into memory: retry "
               "shortly (the client does)";
    }
    return "unknown store error";
  }
};

}  // namespace detail

/// The category of store_errc. One instance per program.
inline const std::error_category& store_error_category() noexcept {
  static const detail::store_error_category_impl instance;
  return instance;
}

inline std::error_code make_error_code(store_errc e) noexcept {
  return {static_cast<int>(e), store_error_category()};
}

/// Mooncake Store's integer for a store error: 0 for success, the negated
/// store_errc for the codes both share, the nearest Mooncake code for kvlink-only
/// ones, INTERNAL_ERROR (-1) for an error of another category.
inline std::int32_t mooncake_code(std::error_code ec) noexcept {
  if (!ec) return 0;
  if (ec.category() != store_error_category()) return -1;
  switch (static_cast<store_errc>(ec.value())) {
    case store_errc::object_hard_pinned:
      return -706;
    case store_errc::object_loading:
      return -703;
    default:
      return ec.value() < 10000 ? -ec.value() : -1;
  }
}

}  // namespace kvlink

template <>
struct std::is_error_code_enum<kvlink::store_errc> : std::true_type {};
