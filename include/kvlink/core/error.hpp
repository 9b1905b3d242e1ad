// kvlink error codes.
//
// The data path reports failures as std::error_code: kvlink's own conditions
// live in kvlink::errc / kvlink::error_category(); errors from the operating
// system keep std::system_category() and verbs work-completion failures keep
// their own category (see rdma/). Every message says what went wrong and,
// where it helps, what to do about it.
#pragma once

#include <string>
#include <system_error>

namespace kvlink {

/// kvlink's error conditions. Zero is never used: a default-constructed
/// std::error_code means success.
enum class errc : int {
  not_registered = 1,         ///< memory or segment id not registered
  out_of_bounds,              ///< (offset, length) outside the segment
  access_denied,              ///< the segment does not grant this access
  overlapping_registration,   ///< new segment overlaps a registered one
  invalid_argument,           ///< a request or setting makes no sense
  peer_unreachable,           ///< could not connect to the peer
  peer_closed,                ///< the peer closed or lost the connection
  protocol_version_mismatch,  ///< the peer speaks another protocol version
  malformed_message,          ///< a frame or message failed validation
  deadline_exceeded,          ///< the transfer's deadline passed
  cancelled,                  ///< cancelled by the caller
  no_device,                  ///< no usable (RDMA) device on this machine
  queue_full,                 ///< too much work outstanding
  unknown_peer,               ///< the peer handle is stale or unknown
  message_too_large,          ///< a message exceeds the configured bound
  transport_unavailable,      ///< the transport is not offered by both peers
  instance_changed,           ///< the peer restarted: cached state is stale
  local_memory_fault,         ///< a local buffer of the transfer is not accessible memory
  checksum_mismatch,          ///< a payload arrived with a checksum that does not match
  authentication_failed,      ///< the peer did not prove it knows the shared secret
  limit_exceeded,             ///< a resource limit was reached (connections, buffers)
  metadata_unavailable,       ///< the metadata store (etcd, HTTP) cannot be reached
  name_not_found,             ///< no engine of that name is published in the metadata store
  remote_memory_fault,        ///< a peer's registered memory is not accessible (same-host copy)
  overlapping_destinations,   ///< two requests of one transfer write the same bytes
  unsigned_entry,             ///< a metadata entry is not signed with this cluster's secret
  device_error,               ///< a device runtime call or device copy failed
};

/// The largest errc value: status fields and error codes that peers send are
/// checked against it.
inline constexpr errc errc_last = errc::device_error;

namespace detail {

class error_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "kvlink"; }

  std::string message(int ev) const override {
    switch (static_cast<errc>(ev)) {
      case errc::not_registered:
        return "memory not registered: register the buffer (or check the "
               "segment id) before using it in a transfer";
      case errc::out_of_bounds:
        return "offset and length fall outside the registered segment";
      case errc::access_denied:
        return "the segment was not registered with the access this transfer "
               "needs (remote_read for READ, remote_write for WRITE)";
      case errc::overlapping_registration:
        return "the memory range overlaps a segment that is already "
               "registered: unregister it first or register disjoint ranges";
      case errc::invalid_argument:
        return "invalid argument";
      case errc::peer_unreachable:
        return "peer unreachable: check the address and that the peer is "
               "listening";
      case errc::peer_closed:
        return "the peer closed the connection or it was lost: reconnect with "
               "async_connect";
      case errc::protocol_version_mismatch:
        return "the peer speaks another kvlink protocol version: run the same "
               "kvlink release on both sides";
      case errc::malformed_message:
        return "malformed message: a frame or control message failed "
               "validation";
      case errc::deadline_exceeded:
        return "the transfer did not complete before its deadline";
      case errc::cancelled:
        return "the transfer was cancelled";
      case errc::no_device:
        return "no usable RDMA device found (is a NIC or soft-RoCE configured?)";
      case errc::queue_full:
        return "too much work outstanding: retry later or raise the limit";
      case errc::unknown_peer:
        return "unknown or stale peer handle: connect to the peer first";
      case errc::message_too_large:
        return "message larger than the configured bound";
      case errc::transport_unavailable:
        return "the requested transport is not available on both peers";
      case errc::instance_changed:
        return "the peer restarted (new instance id): cached segments were "
               "dropped, reconnect";
      case errc::local_memory_fault:
        return "a local buffer of the transfer is not accessible memory (unmapped, "
               "protected, or device memory a transport cannot reach): that transfer "
               "failed, the peer stays connected";
      case errc::checksum_mismatch:
        return "a payload's checksum did not match: the data was corrupted in transit "
               "and was not acknowledged";
      case errc::authentication_failed:
        return "authentication failed: both engines must be given the same shared secret "
               "(config.auth_secret, auth_secret_file or KVLINK_AUTH_SECRET); or the metadata "
               "store refused this engine's metadata_user/password or metadata_token";
      case errc::limit_exceeded:
        return "a resource limit was reached (connections, buffered control bytes or "
               "notifications): see the config settings max_* and the peer's log";
      case errc::metadata_unavailable:
        return "the metadata store (config.metadata) cannot be reached: lookups by name fail "
               "until it is back, connected peers keep working";
      case errc::name_not_found:
        return "no engine of that name is published in the metadata store: check the peer's "
               "config.name, that it has started, and that both engines use the same store and "
               "metadata_prefix";
      case errc::remote_memory_fault:
        return "the peer's registered memory is not accessible (it was unmapped or freed without "
               "being unregistered first): that transfer failed";
      case errc::overlapping_destinations:
        return "two requests of one transfer write the same bytes (WRITEs to overlapping ranges "
               "of a peer's segment, or READs into overlapping local memory): the requests run "
               "concurrently, so which bytes would land is undefined; nothing was moved. Submit "
               "them as separate transfers, in the order you need";
      case errc::unsigned_entry:
        return "the entry published under that name is not signed with this cluster's secret "
               "(written by someone without it, or the engines were given different "
               "auth_secret values): it was not used; a live owner republishes its signed entry "
               "within a lease TTL";
      case errc::device_error:
        return "a device (GPU) runtime call or device copy failed: see the log for the call and "
               "its error; the transfer that needed it failed";
    }
    return "unknown kvlink error";
  }
};

}  // namespace detail

/// The category of kvlink::errc. One instance per program.
inline const std::error_category& error_category() noexcept {
  static const detail::error_category_impl instance;
  return instance;
}

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace kvlink

template <>
struct std::is_error_code_enum<kvlink::errc> : std::true_type {};
