// kvlink's vocabulary types: opcodes, access flags, strong ids, transfer
// requests and results. No I/O, no Asio: every layer includes this.
#pragma once

#include <chrono>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string_view>

namespace kvlink {

/// Direction of a one-sided transfer, seen from the initiator.
enum class opcode : std::uint8_t {
  read = 0,   ///< copy remote segment bytes into local memory
  write = 1,  ///< copy local memory into the remote segment
};

constexpr std::string_view to_string(opcode op) noexcept {
  return op == opcode::read ? "read" : "write";
}

/// What a registered segment lets remote peers do. Local use is always
/// allowed; these flags only gate what peers may do to it.
enum class access : std::uint8_t {
  none = 0,
  remote_read = 1,   ///< peers may READ from it
  remote_write = 2,  ///< peers may WRITE into it
  remote_read_write = 3,
};

constexpr access operator|(access a, access b) noexcept {
  return static_cast<access>(static_cast<std::uint8_t>(a) | static_cast<std::uint8_t>(b));
}
constexpr access operator&(access a, access b) noexcept {
  return static_cast<access>(static_cast<std::uint8_t>(a) & static_cast<std::uint8_t>(b));
}
/// True when `granted` includes every flag of `needed`.
constexpr bool allows(access granted, access needed) noexcept {
  return (granted & needed) == needed;
}
/// The access a target segment must grant for an operation.
constexpr access required_access(opcode op) noexcept {
  return op == opcode::read ? access::remote_read : access::remote_write;
}

/// Where a segment's bytes live. Device memory is found at registration by
/// the engine's device runtime (memory/device.hpp) and reached by a
/// transport directly (transport::reaches()) or through staging.
enum class memory_kind : std::uint8_t {
  host = 0,    ///< ordinary virtual memory of this process (managed memory included)
  device = 1,  ///< a device's memory: the CPU cannot touch it, a copy engine moves it
};

constexpr std::string_view to_string(memory_kind k) noexcept {
  switch (k) {
    case memory_kind::host:
      return "host";
    case memory_kind::device:
      return "device";
  }
  return "unknown";
}

/// A memory kind and, for device memory, which device (-1 for host memory).
struct memory_desc {
  memory_kind kind = memory_kind::host;
  std::int32_t device = -1;
  friend constexpr bool operator==(const memory_desc&, const memory_desc&) noexcept = default;
};

/// A set of memory kinds: what a transport reads and writes directly.
class memory_kinds {
 public:
  constexpr memory_kinds() noexcept = default;
  constexpr memory_kinds(std::initializer_list<memory_kind> kinds) noexcept {
    for (auto k : kinds) bits_ |= bit(k);
  }
  constexpr bool contains(memory_kind k) const noexcept { return (bits_ & bit(k)) != 0; }
  constexpr bool empty() const noexcept { return bits_ == 0; }
  friend constexpr bool operator==(memory_kinds, memory_kinds) noexcept = default;

 private:
  static constexpr std::uint32_t bit(memory_kind k) noexcept {
    return std::uint32_t{1} << static_cast<unsigned>(k);
  }
  std::uint32_t bits_ = 0;
};

/// Identifies a segment within one engine instance. A strong type: it cannot
/// be built from, or used as, a plain integer by accident, and it is never a
/// pointer. Ids are not reused by an engine instance.
class segment_id {
 public:
  constexpr segment_id() noexcept = default;
  constexpr explicit segment_id(std::uint64_t v) noexcept : value_{v} {}
  constexpr std::uint64_t value() const noexcept { return value_; }
  constexpr bool valid() const noexcept { return value_ != 0; }
  friend constexpr auto operator<=>(segment_id, segment_id) noexcept = default;

 private:
  std::uint64_t value_ = 0;  // 0: invalid
};

/// Identifies a connected peer within one local engine. Peers that restart
/// (new instance id) get a new peer_id.
class peer_id {
 public:
  constexpr peer_id() noexcept = default;
  constexpr explicit peer_id(std::uint64_t v) noexcept : value_{v} {}
  constexpr std::uint64_t value() const noexcept { return value_; }
  constexpr bool valid() const noexcept { return value_ != 0; }
  friend constexpr auto operator<=>(peer_id, peer_id) noexcept = default;

 private:
  std::uint64_t value_ = 0;  // 0: invalid
};

/// Identifies one run of an engine: a random 128-bit value drawn when the
/// engine starts. A peer that restarts comes back with a new instance id, so
/// state cached about the old one (segments, keys, connections) is dropped.
struct instance_id {
  std::uint64_t hi = 0;
  std::uint64_t lo = 0;
  constexpr bool valid() const noexcept { return (hi | lo) != 0; }
  friend constexpr auto operator<=>(const instance_id&, const instance_id&) noexcept = default;
};

/// A segment of a remote peer: what a transfer request targets.
struct remote_segment {
  peer_id peer;
  segment_id segment;
  friend constexpr bool operator==(const remote_segment&, const remote_segment&) noexcept = default;
};

/// One entry of a transfer batch. `local` must lie inside a segment registered
/// with the local engine; [remote_offset, remote_offset + length) must lie
/// inside `remote.segment`, which must grant required_access(op).
struct transfer_request {
  opcode op = opcode::write;
  void* local = nullptr;
  remote_segment remote{};
  std::uint64_t remote_offset = 0;
  std::uint64_t length = 0;
};

/// What a completed transfer did. Filled also when it failed (bytes moved
/// before the failure are counted in `bytes`).
struct transfer_result {
  std::uint64_t bytes = 0;               ///< payload bytes that reached their destination
  std::uint32_t requests = 0;            ///< requests submitted
  std::uint32_t slices = 0;              ///< slices the planner cut (after coalescing)
  std::uint32_t lanes = 0;               ///< distinct lanes that carried slices
  std::chrono::nanoseconds duration{0};  ///< from submission to completion

  /// Bandwidth in GB/s (10^9 bytes per second); 0 when no time elapsed.
  double gb_per_s() const noexcept {
    return duration.count() > 0 ? static_cast<double>(bytes) / static_cast<double>(duration.count())
                                : 0.0;
  }
};

}  // namespace kvlink

template <>
struct std::hash<kvlink::segment_id> {
  std::size_t operator()(kvlink::segment_id s) const noexcept {
    return std::hash<std::uint64_t>{}(s.value());
  }
};
template <>
struct std::hash<kvlink::peer_id> {
  std::size_t operator()(kvlink::peer_id p) const noexcept {
    return std::hash<std::uint64_t>{}(p.value());
  }
};
