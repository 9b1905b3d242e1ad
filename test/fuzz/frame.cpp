// Fuzzes the TCP transport's data-frame decoders (include/kvlink/tcp/frame.hpp)
// the way both ends of a lane read them: the input is a stream of bytes cut into
// 48-byte headers, each decoded with kvlink::tcp::decode(); a vector frame's
// header is followed by its piece table, decoded with decode_pieces(); the
// status field of every header (and the input's first two bytes) goes through
// status_to_error().
//
// Asserts, besides "no crash, no hang, no read outside the 48 bytes" (each
// header is decoded from a heap buffer of exactly frame_header_size bytes, so
// ASan sees any read past it):
// - decode() fails exactly when the magic, the version, the type or the flags
//   are wrong, with malformed_message / protocol_version_mismatch /
//   malformed_message / malformed_message, or when a vector frame's piece
//   count is outside 1..max_vector_pieces or above its length (malformed);
// - decode_pieces() accepts a table exactly when every length is at least 1
//   and they add up to the header's length (summed without overflow here),
//   reads every entry as written, and encode() of each entry writes it back;
// - a header decode() accepts is re-encoded by encode() byte for byte (every
//   field of the wire format is kept), and decoding that gives the same fields;
// - status_to_error(s) is success for 0, the kvlink::errc s for 1..errc_last and
//   malformed_message above, and error_to_status() maps it back.
#include <kvlink/core/error.hpp>
#include <kvlink/tcp/frame.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <system_error>
#include <vector>

#include "fuzz_check.hpp"

namespace {

namespace tcp = kvlink::tcp;
using kvlink::errc;

std::uint64_t le(const std::byte* p, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

void check_status(std::uint16_t s) {
  const std::error_code e = tcp::status_to_error(s);
  const auto last = static_cast<std::uint16_t>(kvlink::errc_last);
  if (s == 0) {
    KVLINK_FUZZ_CHECK(!e);
    KVLINK_FUZZ_CHECK(tcp::error_to_status(e) == 0);
    return;
  }
  KVLINK_FUZZ_CHECK(static_cast<bool>(e));
  KVLINK_FUZZ_CHECK(e.category() == kvlink::error_category());
  KVLINK_FUZZ_CHECK(!e.message().empty());
  if (s <= last) {
    KVLINK_FUZZ_CHECK(e.value() == static_cast<int>(s));
    KVLINK_FUZZ_CHECK(tcp::error_to_status(e) == s);
  } else {
    KVLINK_FUZZ_CHECK(e == errc::malformed_message);
    KVLINK_FUZZ_CHECK(tcp::error_to_status(e) ==
                      static_cast<std::uint16_t>(errc::malformed_message));
  }
}

// A vector frame's piece table of `count` entries, `total` bytes in all.
void check_pieces(const std::byte* in, std::size_t count, std::uint64_t total) {
  std::vector<tcp::frame_piece> pieces(count);
  const std::error_code ec = tcp::decode_pieces(in, count, total, pieces.data());
  unsigned __int128 sum = 0;
  bool positive = true;
  for (std::size_t i = 0; i < count; ++i) {
    const auto length = le(in + i * tcp::piece_entry_size + 8, 8);
    positive = positive && length >= 1;
    sum += length;
  }
  const bool valid = positive && sum == total;
  KVLINK_FUZZ_CHECK(!ec == valid);
  if (ec) {
    KVLINK_FUZZ_CHECK(ec == errc::malformed_message);
    return;
  }
  for (std::size_t i = 0; i < count; ++i) {
    KVLINK_FUZZ_CHECK(pieces[i].offset == le(in + i * tcp::piece_entry_size, 8));
    KVLINK_FUZZ_CHECK(pieces[i].length == le(in + i * tcp::piece_entry_size + 8, 8));
    std::array<std::byte, tcp::piece_entry_size> again{};
    tcp::encode(pieces[i], again.data());
    KVLINK_FUZZ_CHECK(std::memcmp(again.data(), in + i * tcp::piece_entry_size, again.size()) == 0);
  }
}

// Returns the piece count when `in` is a vector frame decode() accepted.
std::size_t check_header(const std::byte* in) {
  tcp::frame_header h;
  const std::error_code ec = tcp::decode(in, h);

  // What the format says about these bytes, read independently.
  std::error_code expected;
  const auto type = le(in + 5, 1);
  if (le(in, 4) != tcp::frame_magic) {
    expected = errc::malformed_message;
  } else if (le(in + 4, 1) != tcp::frame_version) {
    expected = errc::protocol_version_mismatch;
  } else if (type < 1 || type > 6) {
    expected = errc::malformed_message;
  } else if ((le(in + 40, 4) & ~std::uint64_t{tcp::frame_known_flags}) != 0) {
    expected = errc::malformed_message;  // flags this version does not know
  } else if ((type == 5 || type == 6) &&
             (le(in + 24, 8) < 1 || le(in + 24, 8) > tcp::max_vector_pieces ||
              le(in + 32, 8) < le(in + 24, 8))) {
    expected = errc::malformed_message;  // a vector frame's piece count
  }
  KVLINK_FUZZ_CHECK(ec == expected);
  if (ec) return 0;

  KVLINK_FUZZ_CHECK(static_cast<std::uint64_t>(h.type) == type);
  KVLINK_FUZZ_CHECK(h.status == le(in + 6, 2));
  KVLINK_FUZZ_CHECK(h.tag == le(in + 8, 8));
  KVLINK_FUZZ_CHECK(h.segment == le(in + 16, 8));
  KVLINK_FUZZ_CHECK(h.offset == le(in + 24, 8));
  KVLINK_FUZZ_CHECK(h.length == le(in + 32, 8));
  KVLINK_FUZZ_CHECK(h.flags == le(in + 40, 4));
  KVLINK_FUZZ_CHECK(h.checksum == le(in + 44, 4));

  // Round trip: what decode accepted, encode writes back unchanged.
  const tcp::frame_bytes again = tcp::encode(h);
  KVLINK_FUZZ_CHECK(std::memcmp(again.data(), in, tcp::frame_header_size) == 0);
  tcp::frame_header h2;
  KVLINK_FUZZ_CHECK(!tcp::decode(again.data(), h2));
  KVLINK_FUZZ_CHECK(h2.type == h.type && h2.status == h.status && h2.tag == h.tag &&
                    h2.segment == h.segment && h2.offset == h.offset && h2.length == h.length &&
                    h2.flags == h.flags && h2.checksum == h.checksum);

  check_status(h.status);
  return tcp::is_vector(h.type) ? static_cast<std::size_t>(h.offset) : 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A lane reads headers back to back (tcp/lane.hpp, tcp/lane_server.hpp),
  // a vector frame's piece table after its header.
  for (std::size_t pos = 0; pos + tcp::frame_header_size <= size;) {
    const auto buf = std::make_unique<std::byte[]>(tcp::frame_header_size);
    std::memcpy(buf.get(), data + pos, tcp::frame_header_size);
    const std::size_t count = check_header(buf.get());
    pos += tcp::frame_header_size;
    const std::size_t table = count * tcp::piece_entry_size;
    if (count == 0 || pos + table > size) continue;
    const auto entries = std::make_unique<std::byte[]>(table);
    std::memcpy(entries.get(), data + pos, table);
    check_pieces(entries.get(), count, le(buf.get() + 32, 8));
    pos += table;
  }
  if (size >= 2) {
    check_status(static_cast<std::uint16_t>(data[0] | (data[1] << 8)));
  }
  return 0;
}
