// The on-disk format of the SSD tier (store/tier/disk.hpp): pure encoding and
// decoding, no I/O, so it is fuzzed (test/fuzz/store_wire.cpp) and tested on
// its own.
//
// A tier directory holds files kvlink-<16 hex digits>.kvd, numbered in the
// order they were started; each is written by appending records and never
// rewritten. A file opens with one block (its `block` bytes, at least 512)
// holding the file header:
//   u64 magic "KVLDISK1"
//   u32 format version (1)
//   u32 block: records start at multiples of it (O_DIRECT's alignment)
//   u64 file number
//   u64 salt: random, mixed into every record's header checksum, so the
//       bytes of an object that happen to look like a record (an object
//       holding a tier file) never pass for one
//   u32 crc32c of the 32 bytes before it
// Then records, each at a multiple of `block` and taking a whole number of
// blocks:
//   u64 magic "KVLDREC1"
//   u32 kind: 1 an object, 2 a removal of the key (so a restart does not
//       bring it back)
//   u32 key length (1 .. 65535)
//   u64 object size (0 for a removal)
//   u64 sequence number, increasing over the whole directory: the highest
//       record of a key says what the key is
//   u32 crc32c of the object's bytes
//   u32 crc32c of the salt, these 36 bytes and the key
//   key bytes from offset 64, zeros to the next block; the object's bytes
//   from there (record_body_offset), zeros to the block after them
// (so the object's bytes lie block-aligned in the file, and a read or a
// write moves them straight between the file and the caller's memory).
// All little-endian. The bytes are checked against their checksum at every
// read, so a record torn by a crash (its header written, its bytes not) is
// never returned; a scan after a restart trusts only headers whose checksum
// holds.
#pragma once

#include <kvlink/core/byte_order.hpp>
#include <kvlink/core/crc32c.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

namespace kvlink::store::tier {

inline constexpr std::uint64_t disk_file_magic = 0x314B5349444C564BULL;    // "KVLDISK1"
inline constexpr std::uint64_t disk_record_magic = 0x31434552444C564BULL;  // "KVLDREC1"
inline constexpr std::uint32_t disk_format_version = 1;
inline constexpr std::size_t disk_file_header_size = 36;
inline constexpr std::size_t disk_record_header_size = 64;
inline constexpr std::uint64_t disk_min_block = 512;
inline constexpr std::uint64_t disk_max_block = 1u << 20;
inline constexpr std::size_t disk_max_key = 65535;

enum class disk_record_kind : std::uint32_t { object = 1, removal = 2 };

/// A tier file's header.
struct disk_file_header {
  std::uint32_t version = disk_format_version;
  std::uint64_t block = 0;
  std::uint64_t number = 0;
  std::uint64_t salt = 0;
};

/// A record's header read back (key points into the bytes decoded).
struct disk_record {
  disk_record_kind kind = disk_record_kind::object;
  std::string_view key;
  std::uint64_t size = 0;
  std::uint64_t sequence = 0;
  std::uint32_t body_crc = 0;
};

namespace detail {
inline std::uint32_t disk_header_crc(std::uint64_t salt, const std::byte* p,
                                     std::string_view key) noexcept {
  std::byte s[8];
  kvlink::detail::put_u64(s, salt);
  std::uint32_t c = kvlink::crc32c(s, 8);
  c = kvlink::crc32c(p, 36, c);
  return kvlink::crc32c(key.data(), key.size(), c);
}
}  // namespace detail

/// `n` rounded up to `block` (a power of two); 0 when that overflows.
constexpr std::uint64_t disk_round(std::uint64_t n, std::uint64_t block) noexcept {
  if (n > UINT64_MAX - (block - 1)) return 0;
  return (n + block - 1) & ~(block - 1);
}

/// Where a record's object bytes start, from the record's start, in a file
/// of blocks of `block` bytes.
constexpr std::uint64_t record_body_offset(std::size_t key_size, std::uint64_t block) noexcept {
  return disk_round(disk_record_header_size + key_size, block);
}

/// The bytes a record of an object of `size` bytes under a key of
/// `key_size` bytes takes in a file of blocks of `block` bytes; 0 when that
/// overflows.
constexpr std::uint64_t disk_record_bytes(std::uint64_t size, std::size_t key_size,
                                          std::uint64_t block) noexcept {
  const std::uint64_t body = record_body_offset(key_size, block);
  if (size > UINT64_MAX - body) return 0;
  return disk_round(body + size, block);
}

/// Whether `block` is one a tier file may have: a power of two in
/// [disk_min_block, disk_max_block].
constexpr bool disk_block_valid(std::uint64_t block) noexcept {
  return block >= disk_min_block && block <= disk_max_block && (block & (block - 1)) == 0;
}

/// Writes a file header into `out` (at least disk_file_header_size bytes;
/// the rest of the block is the caller's, zeroed). False when `out` is too
/// short or the block invalid.
inline bool encode_file_header(const disk_file_header& h, std::span<std::byte> out) noexcept {
  if (out.size() < disk_file_header_size || !disk_block_valid(h.block)) return false;
  std::byte* p = out.data();
  kvlink::detail::put_u64(p, disk_file_magic);
  kvlink::detail::put_u32(p + 8, h.version);
  kvlink::detail::put_u32(p + 12, static_cast<std::uint32_t>(h.block));
  kvlink::detail::put_u64(p + 16, h.number);
  kvlink::detail::put_u64(p + 24, h.salt);
  kvlink::detail::put_u32(p + 32, kvlink::crc32c(p, 32));
  return true;
}

/// What decode_file_header found.
enum class file_header_status { ok, not_a_tier_file, other_version, corrupt };

/// Reads the file header `in` opens with.
inline file_header_status decode_file_header(std::span<const std::byte> in,
                                             disk_file_header& out) noexcept {
  if (in.size() < disk_file_header_size) return file_header_status::not_a_tier_file;
  const std::byte* p = in.data();
  if (kvlink::detail::get_u64(p) != disk_file_magic) return file_header_status::not_a_tier_file;
  if (kvlink::crc32c(p, 32) != kvlink::detail::get_u32(p + 32)) return file_header_status::corrupt;
  disk_file_header h;
  h.version = kvlink::detail::get_u32(p + 8);
  h.block = kvlink::detail::get_u32(p + 12);
  h.number = kvlink::detail::get_u64(p + 16);
  h.salt = kvlink::detail::get_u64(p + 24);
  if (h.version != disk_format_version) {
    out = h;
    return file_header_status::other_version;
  }
  if (!disk_block_valid(h.block)) return file_header_status::corrupt;
  out = h;
  return file_header_status::ok;
}

/// Fills `out` (at least disk_record_header_size + key.size() bytes) with a
/// record's header, its key and zeros after them. False, nothing written,
/// when the key is empty or longer than disk_max_key, `out` too short, or a
/// removal has a size.
inline bool encode_record_header(std::uint64_t salt, const disk_record& r,
                                 std::span<std::byte> out) noexcept {
  if (r.key.empty() || r.key.size() > disk_max_key ||
      out.size() < disk_record_header_size + r.key.size()) {
    return false;
  }
  if (r.kind == disk_record_kind::removal && r.size != 0) return false;
  std::byte* p = out.data();
  std::memset(p, 0, out.size());
  kvlink::detail::put_u64(p, disk_record_magic);
  kvlink::detail::put_u32(p + 8, static_cast<std::uint32_t>(r.kind));
  kvlink::detail::put_u32(p + 12, static_cast<std::uint32_t>(r.key.size()));
  kvlink::detail::put_u64(p + 16, r.size);
  kvlink::detail::put_u64(p + 24, r.sequence);
  kvlink::detail::put_u32(p + 32, r.body_crc);
  std::memcpy(p + disk_record_header_size, r.key.data(), r.key.size());
  kvlink::detail::put_u32(p + 36, detail::disk_header_crc(salt, p, r.key));
  return true;
}

/// Reads the record header `in` opens with (`in` holds at least the header
/// and the key). False (out unchanged) unless it is a whole, intact header
/// of this file (its salt): magic, a known kind, a key of 1..disk_max_key
/// bytes within `in`, a removal of size 0, reserved bytes zero, the
/// checksum. out.key points into `in`.
inline bool decode_record_header(std::uint64_t salt, std::span<const std::byte> in,
                                 disk_record& out) noexcept {
  if (in.size() < disk_record_header_size) return false;
  const std::byte* p = in.data();
  if (kvlink::detail::get_u64(p) != disk_record_magic) return false;
  const std::uint32_t kind = kvlink::detail::get_u32(p + 8);
  if (kind != 1 && kind != 2) return false;
  const std::uint32_t key_size = kvlink::detail::get_u32(p + 12);
  if (key_size == 0 || key_size > disk_max_key || key_size > in.size() - disk_record_header_size) {
    return false;
  }
  const std::uint64_t size = kvlink::detail::get_u64(p + 16);
  if (kind == 2 && size != 0) return false;
  for (std::size_t i = 40; i < disk_record_header_size; ++i) {
    if (p[i] != std::byte{0}) return false;
  }
  const std::string_view key(reinterpret_cast<const char*>(p + disk_record_header_size), key_size);
  if (detail::disk_header_crc(salt, p, key) != kvlink::detail::get_u32(p + 36)) return false;
  out = disk_record{static_cast<disk_record_kind>(kind), key, size, kvlink::detail::get_u64(p + 24),
                    kvlink::detail::get_u32(p + 32)};
  return true;
}

}  // namespace kvlink::store::tier
