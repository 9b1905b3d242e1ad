// The TCP transport's data frame: a fixed 48-byte header, little-endian on
// the wire whatever the host, followed by `length` payload bytes for
// write_request and read_response frames.
//
//   offset size field
//        0    4 magic     0x4B564C44 ("KVLD" read as a little-endian u32)
//        4    1 version   frame_version
//        5    1 type      frame_type
//        6    2 status    0 = ok, else a kvlink::errc value (responses only)
//        8    8 tag       per-lane sequence number, echoed by the response
//       16    8 segment   target segment id
//       24    8 offset    byte offset inside the segment (vector frames: piece count)
//       32    8 length    payload bytes (requested bytes for read_request)
//       40    4 flags     bit 0: checksum (a CRC32C of the payload is checked)
//       44    4 checksum  CRC32C of the payload this frame carries, when flagged
//
// Vector frames (write_vector, read_vector) carry many pieces of one
// segment: `offset` holds the piece count (1 .. max_vector_pieces) and
// `length` the bytes of all pieces together; a table of that many 16-byte
// entries follows the header, each (offset u64, length u64), lengths at
// least 1 and summing to `length`; then, for write_vector, the pieces'
// payloads back to back in table order. The answer is one write_ack or one
// read_response (its payload the pieces back to back) for the whole frame,
// its status the first check that failed (a frame refused by a check
// touched no memory; one with a bad checksum was placed, never acknowledged).
// A peer sends them only to a target that advertised them (its tcp
// descriptor entry: "vector", the most pieces a frame may carry), so the
// version stays 2: older targets never see one.
//
// Checksums: a write_request with the flag carries its payload's CRC32C;
// the target checks the bytes it placed and answers checksum_mismatch (the
// write is not acknowledged as done). A read_request with the flag asks the
// target for the CRC32C of the bytes it sends, in the read_response, which
// the initiator checks after placing them. A vector frame's checksum covers
// its payload as one run of bytes (the pieces in table order).
//
// Nothing is ever sent as a raw struct: encode() and decode() write and read
// each field explicitly, so the layout does not depend on the compiler.
#pragma once

#include <kvlink/core/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <system_error>

namespace kvlink::tcp {

inline constexpr std::uint32_t frame_magic = 0x4B564C44u;
inline constexpr std::uint8_t frame_version = 2;
inline constexpr std::size_t frame_header_size = 48;

/// Bits of frame_header::flags.
inline constexpr std::uint32_t frame_flag_checksum = 1u;
inline constexpr std::uint32_t frame_known_flags = frame_flag_checksum;

enum class frame_type : std::uint8_t {
  write_request = 1,  ///< initiator -> target, payload follows
  read_request = 2,   ///< initiator -> target, no payload
  write_ack = 3,      ///< target -> initiator, no payload, sent after the data is in memory
  read_response = 4,  ///< target -> initiator, payload follows when status is 0
  write_vector = 5,   ///< initiator -> target, piece table then payloads follow
  read_vector = 6,    ///< initiator -> target, piece table follows
};

/// The most pieces a vector frame may carry (what a target advertises).
inline constexpr std::size_t max_vector_pieces = 256;
inline constexpr std::size_t piece_entry_size = 16;

inline constexpr bool is_vector(frame_type t) noexcept {
  return t == frame_type::write_vector || t == frame_type::read_vector;
}

/// One entry of a vector frame's piece table.
struct frame_piece {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

struct frame_header {
  frame_type type = frame_type::write_request;
  std::uint16_t status = 0;
  std::uint64_t tag = 0;
  std::uint64_t segment = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::uint32_t flags = 0;
  std::uint32_t checksum = 0;
};

using frame_bytes = std::array<std::byte, frame_header_size>;

namespace byte_order {
template <class T>
constexpr void put_le(std::byte* p, T v) noexcept {
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    p[i] = static_cast<std::byte>((static_cast<std::uint64_t>(v) >> (8 * i)) & 0xffu);
  }
}
template <class T>
constexpr T get_le(const std::byte* p) noexcept {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  }
  return static_cast<T>(v);
}
}  // namespace byte_order

constexpr void encode(const frame_header& h, std::byte* out) noexcept {
  byte_order::put_le<std::uint32_t>(out + 0, frame_magic);
  byte_order::put_le<std::uint8_t>(out + 4, frame_version);
  byte_order::put_le<std::uint8_t>(out + 5, static_cast<std::uint8_t>(h.type));
  byte_order::put_le<std::uint16_t>(out + 6, h.status);
  byte_order::put_le<std::uint64_t>(out + 8, h.tag);
  byte_order::put_le<std::uint64_t>(out + 16, h.segment);
  byte_order::put_le<std::uint64_t>(out + 24, h.offset);
  byte_order::put_le<std::uint64_t>(out + 32, h.length);
  byte_order::put_le<std::uint32_t>(out + 40, h.flags);
  byte_order::put_le<std::uint32_t>(out + 44, h.checksum);
}

constexpr frame_bytes encode(const frame_header& h) noexcept {
  frame_bytes b{};
  encode(h, b.data());
  return b;
}

/// Parses a header. A wrong magic, an unknown version or type gives
/// errc::malformed_message (errc::protocol_version_mismatch for the version;
/// flags this version does not know, and a vector frame's piece count outside
/// 1..max_vector_pieces or above its length, are malformed too):
/// the stream cannot be trusted any more and the connection must close.
/// Semantic checks (segment, bounds, access) are the receiver's business.
inline std::error_code decode(const std::byte* in, frame_header& h) noexcept {
  if (byte_order::get_le<std::uint32_t>(in) != frame_magic) {
    return errc::malformed_message;
  }
  if (byte_order::get_le<std::uint8_t>(in + 4) != frame_version) {
    return errc::protocol_version_mismatch;
  }
  const auto type = byte_order::get_le<std::uint8_t>(in + 5);
  if (type < 1 || type > 6) {
    return errc::malformed_message;
  }
  h.type = static_cast<frame_type>(type);
  h.status = byte_order::get_le<std::uint16_t>(in + 6);
  h.tag = byte_order::get_le<std::uint64_t>(in + 8);
  h.segment = byte_order::get_le<std::uint64_t>(in + 16);
  h.offset = byte_order::get_le<std::uint64_t>(in + 24);
  h.length = byte_order::get_le<std::uint64_t>(in + 32);
  h.flags = byte_order::get_le<std::uint32_t>(in + 40);
  h.checksum = byte_order::get_le<std::uint32_t>(in + 44);
  if ((h.flags & ~frame_known_flags) != 0) return errc::malformed_message;
  // A vector frame's piece count; each piece has a byte at least.
  if (is_vector(h.type) && (h.offset < 1 || h.offset > max_vector_pieces || h.length < h.offset)) {
    return errc::malformed_message;
  }
  return {};
}

constexpr void encode(const frame_piece& p, std::byte* out) noexcept {
  byte_order::put_le<std::uint64_t>(out + 0, p.offset);
  byte_order::put_le<std::uint64_t>(out + 8, p.length);
}

/// Parses a vector frame's piece table: `count` entries at `in`, whose
/// lengths must each be at least 1 and add up to `total` (the header's
/// length); else errc::malformed_message (the connection must close).
/// Offsets are the receiver's to check, like a header's.
inline std::error_code decode_pieces(const std::byte* in, std::size_t count, std::uint64_t total,
                                     frame_piece* out) noexcept {
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < count; ++i) {
    out[i].offset = byte_order::get_le<std::uint64_t>(in + i * piece_entry_size);
    out[i].length = byte_order::get_le<std::uint64_t>(in + i * piece_entry_size + 8);
    if (out[i].length == 0 || out[i].length > total - sum) return errc::malformed_message;
    sum += out[i].length;
  }
  if (sum != total) return errc::malformed_message;
  return {};
}

/// The status field carries kvlink::errc values; anything else a peer puts
/// there is reported as a malformed message rather than trusted.
inline std::error_code status_to_error(std::uint16_t status) noexcept {
  if (status == 0) {
    return {};
  }
  if (status > static_cast<std::uint16_t>(errc_last)) {
    return errc::malformed_message;
  }
  return static_cast<errc>(status);
}

inline std::uint16_t error_to_status(std::error_code ec) noexcept {
  if (!ec) {
    return 0;
  }
  if (ec.category() == error_category()) {
    return static_cast<std::uint16_t>(ec.value());
  }
  return static_cast<std::uint16_t>(errc::malformed_message);
}

}  // namespace kvlink::tcp
