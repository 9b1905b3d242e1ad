// The object record: a few bytes a writer puts in the pool right after an
// object's bytes, so that the owner of a segment can tell which objects its
// memory holds without the master. When a master comes up empty (it
// restarted, or a standby took over), every owner scans its segments for
// records and announces what it finds with its mount; the master rebuilds
// its table from those announcements, so a completed put survives its
// master.
//
// An object of `size` bytes under `key` takes object_footprint(size, key)
// bytes of its segment: the bytes, rounded up to record_alignment, then the
// record (record_size(key.size()) bytes):
//   u64 magic "KVLREC01"
//   u32 key length
//   u32 crc32c of the object's bytes
//   u64 object size
//   u32 crc32c of the record's first 24 bytes and the key
//   u32 reserved, 0
//   key bytes, zero padding to record_alignment
// little-endian. The record is written in the same transfer as the bytes
// (no order between them), so a record alone proves nothing: the owner
// accepts it only when the bytes before it match its checksum. That also
// rejects records of objects whose space was freed and written over by a
// later put, and puts that never finished. Records of removed objects whose
// bytes are intact come back (immutable objects: the same key, the same
// bytes) unless the owner wiped them (scan's `wipe`).
//
// Nothing here trusts the memory it reads: decode() checks every length
// against the bytes that remain; test/fuzz/store_wire.cpp fuzzes it.
#pragma once

#include <kvlink/core/byte_order.hpp>
#include <kvlink/core/crc32c.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

namespace kvlink::store::wire {

/// Records start at multiples of this (a segment's allocation alignment is
/// a multiple of it: master_config::validate).
inline constexpr std::uint64_t record_alignment = 64;
inline constexpr std::uint64_t record_magic = 0x31304345524C564BULL;  // "KVLREC01"
inline constexpr std::size_t record_header_size = 32;

/// `n` rounded up to record_alignment; 0 when that overflows.
constexpr std::uint64_t record_round(std::uint64_t n) noexcept {
  if (n > UINT64_MAX - (record_alignment - 1)) return 0;
  return (n + record_alignment - 1) & ~(record_alignment - 1);
}

/// The bytes of the record of a key of `key_size` bytes.
constexpr std::uint64_t record_size(std::size_t key_size) noexcept {
  return record_round(record_header_size + key_size);
}

/// Where the record of an object of `size` bytes starts, from the object's
/// start.
constexpr std::uint64_t record_offset(std::uint64_t size) noexcept { return record_round(size); }

/// The bytes an object of `size` under a key of `key_size` bytes takes in a
/// segment (before the allocator's own rounding); 0 when that overflows.
constexpr std::uint64_t object_footprint(std::uint64_t size, std::size_t key_size) noexcept {
  const std::uint64_t body = record_round(size);
  const std::uint64_t rec = record_size(key_size);
  if (body == 0 || body > UINT64_MAX - rec) return 0;
  return body + rec;
}

/// A record read back.
struct object_record {
  std::string_view key;
  std::uint64_t size = 0;
  std::uint32_t body_crc = 0;
};

namespace detail {
using kvlink::detail::get_u32;
using kvlink::detail::get_u64;
using kvlink::detail::put_u32;
using kvlink::detail::put_u64;
inline std::uint32_t header_crc(const std::byte* p, std::string_view key) noexcept {
  return kvlink::crc32c(key.data(), key.size(), kvlink::crc32c(p, 24));
}
}  // namespace detail

/// Writes the record of `key` (an object of `size` bytes whose crc32c is
/// `body_crc`) to `out`, which holds at least record_size(key.size())
/// bytes; returns the bytes written (0, nothing written, when `out` is too
/// short or the key longer than 65535 bytes).
inline std::size_t encode_record(std::string_view key, std::uint64_t size, std::uint32_t body_crc,
                                 std::span<std::byte> out) noexcept {
  const std::uint64_t n = record_size(key.size());
  if (key.size() > 65535 || out.size() < n) return 0;
  std::byte* p = out.data();
  std::memset(p, 0, n);
  detail::put_u64(p, record_magic);
  detail::put_u32(p + 8, static_cast<std::uint32_t>(key.size()));
  detail::put_u32(p + 12, body_crc);
  detail::put_u64(p + 16, size);
  std::memcpy(p + record_header_size, key.data(), key.size());
  detail::put_u32(p + 24, detail::header_crc(p, key));
  return n;
}

/// Whether `in` opens with a record magic (cheap: the scan's first test).
inline bool has_record_magic(std::span<const std::byte> in) noexcept {
  return in.size() >= 8 && detail::get_u64(in.data()) == record_magic;
}

/// Reads the record `in` opens with. False (out unchanged) when it is not a
/// whole, intact record: no magic, a key longer than `max_key` or than the
/// bytes that remain, a header checksum that does not match, a size of 0.
/// out.key points into `in`.
inline bool decode_record(std::span<const std::byte> in, std::size_t max_key,
                          object_record& out) noexcept {
  if (in.size() < record_header_size || !has_record_magic(in)) return false;
  const std::byte* p = in.data();
  const std::uint32_t key_size = detail::get_u32(p + 8);
  if (key_size == 0 || key_size > max_key || key_size > in.size() - record_header_size) {
    return false;
  }
  const std::uint64_t size = detail::get_u64(p + 16);
  if (size == 0 || detail::get_u32(p + 28) != 0) return false;
  const std::string_view key(reinterpret_cast<const char*>(p + record_header_size), key_size);
  if (detail::header_crc(p, key) != detail::get_u32(p + 24)) return false;
  out = object_record{key, size, detail::get_u32(p + 12)};
  return true;
}

/// An object a scan found: its bytes are [offset, offset + size) of the
/// segment, its record right after them.
struct found_object {
  std::string_view key;  ///< points into the segment
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
};

/// Scans a segment's memory for records whose object's bytes match their
/// checksum and calls `found(found_object)` for each, in offset order.
/// Records that do not hold (a torn put, bytes written over) have their
/// magic cleared when `wipe` is true, so no later scan looks at them again;
/// with `wipe_all`, every record is cleared (a segment mounted fresh must
/// not bring back objects of an earlier life). Returns how many records
/// were cleared.
template <class Found>
std::uint64_t scan_records(std::byte* base, std::uint64_t size, std::size_t max_key, bool wipe,
                           bool wipe_all, Found&& found) {
  std::uint64_t cleared = 0;
  // Offsets are the segment's (allocations start at multiples of the
  // alignment from its base), not addresses.
  for (std::uint64_t at = 0; size >= record_header_size && at <= size - record_header_size;
       at += record_alignment) {
    const std::span<const std::byte> rest(base + at, size - at);
    if (!has_record_magic(rest)) continue;
    object_record rec;
    bool good = decode_record(rest, max_key, rec);
    const std::uint64_t body = good ? record_offset(rec.size) : 0;
    if (good) good = body != 0 && at >= body;
    if (good) good = kvlink::crc32c(base + (at - body), rec.size) == rec.body_crc;
    if (!good || wipe_all) {
      if (wipe || wipe_all) {
        std::memset(base + at, 0, 8);
        ++cleared;
      }
      continue;
    }
    found(found_object{rec.key, at - body, rec.size});
    at += record_size(rec.key.size()) - record_alignment;
  }
  return cleared;
}

}  // namespace kvlink::store::wire
