// The store master's protocol: what clients and the master say to each other
// after the handshake (store/wire/handshake.hpp), as binary frames.
//
// Why binary and not the engine's JSON control messages: a store client
// sends tens of thousands of requests a second (a put is two of them, a get
// one), most of them batches of many keys. A fixed-layout frame with
// length-prefixed fields is encoded into one buffer and decoded in place
// (keys are string_views into the received frame, one vector per batch, no
// allocation per key), so the master's cost per key is a hash lookup, not a
// JSON parse. The handshake stays JSON: it runs once per connection and
// shares the engine's bounded reader.
//
// Frame: a 24-byte header, little-endian:
//   u32 magic 0x534C564B ("KVLS")   never changes across versions
//   u16 version (protocol_version)  a master answers another version with
//                                   protocol_version_mismatch
//   u16 type (message_type; a reply is its request's type | reply_bit)
//   u32 body length                 bounded by the receiver before reading
//   u32 reserved, 0
//   u64 request id                  a reply carries its request's id
// then the body. Body fields are little-endian integers; a string is a u16
// length and its bytes; a list is a u32 count and its items. A reply body
// opens with a status: u8 category (0 ok, 1 kvlink::errc, 2 store_errc),
// u32 value and, when not ok, a string message; the rest of the body is
// there only when the status is ok. Per-key results in batch replies are
// store_errc values (0: done), in the order of the request's keys.
//
// Decoders never trust a count or a length: each is checked against the
// bytes that remain before anything is read or reserved, and a body must be
// consumed exactly (malformed_message otherwise). test/fuzz/store_wire.cpp
// fuzzes every decoder.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/store/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace kvlink::store::wire {

inline constexpr std::uint32_t frame_magic = 0x534C564Bu;  // "KVLS"
// 2: objects take their record's bytes too (store/wire/record.hpp), and a
// mount carries the objects its owner found in the segment.
// 3: a mount may leave its segment closed, and adopt announces further
// objects of it (a segment holds more than one frame's worth).
// 4: the SSD tier: disk_mount, disk_report, and disk_task frames the master
// sends unasked.
inline constexpr std::uint16_t protocol_version = 4;
inline constexpr std::size_t header_size = 24;
inline constexpr std::uint16_t reply_bit = 0x8000;
/// Default bound of a frame's body (both directions).
inline constexpr std::uint32_t default_max_body = 64u << 20;
/// The most keys one batch may carry.
inline constexpr std::uint32_t max_batch = 1u << 20;
/// The most replicas one object may have on the wire (object table: 8).
inline constexpr std::uint8_t max_wire_replicas = 8;

enum class message_type : std::uint16_t {
  heartbeat = 1,     ///< {} -> {u8 known}
  mount = 2,         ///< {str name, u64 size, u64 engine segment, [str key, u64 offset, u64 size],
                     ///<  u8 open} -> {u64 segment, [u32 code]}: the objects found in it, taken
                     ///< back or not; open 0: no allocation in it until an adopt opens it
  unmount = 3,       ///< {u64 segment} -> {}
  segment_info = 4,  ///< {u64 segment} -> {u64 client, str address, u64 engine segment,
                     ///<                   u64 size, str host}
  put_start = 5,     ///< {options, [key, u64 size, str parent]} -> [code, replicas]
  put_end = 6,       ///< {[key]} -> [code]
  put_revoke = 7,    ///< {[key]} -> [code]
  get = 8,           ///< {[key]} -> [code, u64 size, u32 lease ms, replicas]
  exists = 9,        ///< {[key]} -> [code]
  remove = 10,       ///< {u8 force, [key]} -> [code]
  remove_all = 11,   ///< {u8 force} -> {u64 removed}
  stats = 12,        ///< {} -> {u64 capacity, used, objects, in_progress, reserved, segments}
  replicas = 13,     ///< {[key]} -> [code, u64 size, u32 0, replicas]: get's answer, no lease
  adopt = 14,        ///< {u64 segment, [str key, u64 offset, u64 size], u8 open} -> [u32 code]:
                     ///< more objects of a segment mounted closed; open 1 ends its announcement
  disk_mount = 15,   ///< {u64 capacity, u8 accepting} -> {}: this client's disk joins the SSD
                     ///< tier (capacity 0: leaves; accepting 0: read only, no new objects)
  disk_report = 16,  ///< {[u8 kind, str key, u64 size, u64 segment, u64 offset, u32 code]}
                     ///< -> [u32 code]: what the disk holds or did (disk_report_kind)
  disk_task = 17,    ///< master -> client, unasked (id 0, no reply):
                     ///< {[u8 kind, str key, u64 size, u64 segment, u64 offset]}
};

/// The highest message type.
inline constexpr std::uint16_t last_type = 17;
inline constexpr bool known_type(std::uint16_t t) noexcept { return t >= 1 && t <= last_type; }

inline const char* to_string(message_type t) noexcept {
  switch (t) {
    case message_type::heartbeat:
      return "heartbeat";
    case message_type::mount:
      return "mount";
    case message_type::unmount:
      return "unmount";
    case message_type::segment_info:
      return "segment_info";
    case message_type::put_start:
      return "put_start";
    case message_type::put_end:
      return "put_end";
    case message_type::put_revoke:
      return "put_revoke";
    case message_type::get:
      return "get";
    case message_type::exists:
      return "exists";
    case message_type::remove:
      return "remove";
    case message_type::remove_all:
      return "remove_all";
    case message_type::stats:
      return "stats";
    case message_type::replicas:
      return "replicas";
    case message_type::adopt:
      return "adopt";
    case message_type::disk_mount:
      return "disk_mount";
    case message_type::disk_report:
      return "disk_report";
    case message_type::disk_task:
      return "disk_task";
  }
  return "unknown";
}

struct frame_header {
  std::uint16_t version = protocol_version;
  std::uint16_t type = 0;
  std::uint32_t body_length = 0;
  std::uint64_t id = 0;

  bool is_reply() const noexcept { return (type & reply_bit) != 0; }
  message_type kind() const noexcept { return static_cast<message_type>(type & ~reply_bit); }
};

using header_bytes = std::array<unsigned char, header_size>;

namespace detail {
inline void put_le(unsigned char* p, std::uint64_t v, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>((v >> (8 * i)) & 0xffu);
}
inline std::uint64_t get_le(const unsigned char* p, std::size_t n) noexcept {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}
}  // namespace detail

inline header_bytes encode_header(const frame_header& h) noexcept {
  header_bytes b{};
  detail::put_le(b.data(), frame_magic, 4);
  detail::put_le(b.data() + 4, h.version, 2);
  detail::put_le(b.data() + 6, h.type, 2);
  detail::put_le(b.data() + 8, h.body_length, 4);
  detail::put_le(b.data() + 12, 0, 4);
  detail::put_le(b.data() + 16, h.id, 8);
  return b;
}

/// Checks a received header: wrong magic or reserved bits: malformed_message;
/// another version: protocol_version_mismatch (`out.version` says which);
/// a body over `max_body`: message_too_large. The type is not checked here
/// (a receiver answers an unknown request type with invalid_argument).
inline std::error_code decode_header(std::span<const unsigned char, header_size> b,
                                     std::uint32_t max_body, frame_header& out) noexcept {
  if (detail::get_le(b.data(), 4) != frame_magic || detail::get_le(b.data() + 12, 4) != 0) {
    return errc::malformed_message;
  }
  out.version = static_cast<std::uint16_t>(detail::get_le(b.data() + 4, 2));
  out.type = static_cast<std::uint16_t>(detail::get_le(b.data() + 6, 2));
  out.body_length = static_cast<std::uint32_t>(detail::get_le(b.data() + 8, 4));
  out.id = detail::get_le(b.data() + 16, 8);
  if (out.version != protocol_version) return errc::protocol_version_mismatch;
  if (out.body_length > max_body) return errc::message_too_large;
  return {};
}

/// Appends fields to a frame: construct with the header's fields, append the
/// body, take bytes() (the header's length is filled in then).
class writer {
 public:
  writer(message_type type, std::uint64_t id, bool reply) {
    buf_.resize(header_size);
    type_ = static_cast<std::uint16_t>(static_cast<std::uint16_t>(type) | (reply ? reply_bit : 0));
    id_ = id;
  }

  void u8(std::uint8_t v) { buf_.push_back(static_cast<char>(v)); }
  void u16(std::uint16_t v) { le(v, 2); }
  void u32(std::uint32_t v) { le(v, 4); }
  void u64(std::uint64_t v) { le(v, 8); }
  /// A string of at most 65535 bytes (longer ones are cut: callers bound
  /// keys and names before).
  void str(std::string_view s) {
    const auto n = s.size() > 0xffffu ? std::size_t{0xffffu} : s.size();
    u16(static_cast<std::uint16_t>(n));
    buf_.append(s.data(), n);
  }
  /// A reply's status (see the file comment).
  void status(std::error_code ec) {
    if (!ec) {
      u8(0);
      u32(0);
      return;
    }
    u8(ec.category() == store_error_category() ? 2 : 1);
    u32(static_cast<std::uint32_t>(ec.value()));
    str(ec.message());
  }

  std::size_t body_size() const noexcept { return buf_.size() - header_size; }

  /// The whole frame. The writer is spent.
  std::string take() {
    frame_header h;
    h.type = type_;
    h.id = id_;
    h.body_length = static_cast<std::uint32_t>(buf_.size() - header_size);
    const auto hb = encode_header(h);
    std::memcpy(buf_.data(), hb.data(), header_size);
    return std::move(buf_);
  }

 private:
  void le(std::uint64_t v, std::size_t n) {
    char b[8];
    for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xffu);
    buf_.append(b, n);
  }
  std::string buf_;
  std::uint16_t type_ = 0;
  std::uint64_t id_ = 0;
};

/// Reads fields from a body. Any read past the end sets the failed state
/// and yields zeros; check ok()/finish() once at the end.
class reader {
 public:
  explicit reader(std::span<const unsigned char> body) noexcept
      : p_{body.data()}, end_{body.data() + body.size()} {}
  explicit reader(std::string_view body) noexcept
      : reader(std::span<const unsigned char>(reinterpret_cast<const unsigned char*>(body.data()),
                                              body.size())) {}

  std::uint8_t u8() noexcept { return static_cast<std::uint8_t>(le(1)); }
  std::uint16_t u16() noexcept { return static_cast<std::uint16_t>(le(2)); }
  std::uint32_t u32() noexcept { return static_cast<std::uint32_t>(le(4)); }
  std::uint64_t u64() noexcept { return le(8); }
  std::string_view str() noexcept {
    const std::size_t n = u16();
    if (!take(n)) return {};
    const auto* s = reinterpret_cast<const char*>(p_ - n);
    return {s, n};
  }
  /// A list count: at most `max` and at most the items that the bytes left
  /// can hold at `min_item` bytes each (so reserve(count) is bounded by what
  /// arrived).
  std::uint32_t count(std::uint32_t max, std::size_t min_item) noexcept {
    const std::uint32_t n = u32();
    if (!ok_) return 0;
    if (n > max || (min_item != 0 && n > remaining() / min_item)) {
      ok_ = false;
      return 0;
    }
    return n;
  }
  /// A reply's status: {} when ok; otherwise the error, its message in `message`.
  std::error_code status(std::string_view* message = nullptr) noexcept {
    const auto cat = u8();
    const auto value = u32();
    if (!ok_ || cat == 0) {
      if (value != 0) ok_ = false;
      return {};
    }
    const auto text = str();
    if (message != nullptr) *message = text;
    if (cat == 2) return {static_cast<int>(value), store_error_category()};
    if (cat == 1) return {static_cast<int>(value), error_category()};
    ok_ = false;
    return {};
  }

  bool ok() const noexcept { return ok_; }
  std::size_t remaining() const noexcept { return static_cast<std::size_t>(end_ - p_); }
  /// malformed_message unless every read succeeded and the body is consumed.
  std::error_code finish() const noexcept {
    return ok_ && p_ == end_ ? std::error_code{} : std::error_code{errc::malformed_message};
  }
  void fail() noexcept { ok_ = false; }

 private:
  bool take(std::size_t n) noexcept {
    if (!ok_ || remaining() < n) {
      ok_ = false;
      return false;
    }
    p_ += n;
    return true;
  }
  std::uint64_t le(std::size_t n) noexcept {
    if (!take(n)) return 0;
    return detail::get_le(p_ - n, n);
  }

  const unsigned char* p_;
  const unsigned char* end_;
  bool ok_ = true;
};

// ---- messages ------------------------------------------------------------
// Each request and reply is a struct with encode(writer&) and
// decode(reader&) -> error_code. Views (string_view, span) point into the
// frame they were decoded from and live as long as it.

/// One replica as the wire carries it: the master's segment id and the
/// offset of the object in it.
struct wire_replica {
  std::uint64_t segment = 0;
  std::uint64_t offset = 0;
  friend bool operator==(const wire_replica&, const wire_replica&) = default;
};

namespace detail {
inline void encode_replicas(writer& w, std::span<const wire_replica> r) {
  w.u8(static_cast<std::uint8_t>(r.size()));
  for (const auto& x : r) {
    w.u64(x.segment);
    w.u64(x.offset);
  }
}
inline void decode_replicas(reader& r, std::uint8_t& n, std::array<wire_replica, 8>& out) {
  n = r.u8();
  if (n > max_wire_replicas) {
    r.fail();
    n = 0;
    return;
  }
  for (std::uint8_t i = 0; i < n; ++i) {
    out[i].segment = r.u64();
    out[i].offset = r.u64();
  }
}
}  // namespace detail

/// A batch of keys: put_end, put_revoke, get, exists, remove.
struct key_batch {
  bool force = false;  ///< remove only
  std::vector<std::string_view> keys;

  void encode(writer& w, bool with_force) const {
    if (with_force) w.u8(force ? 1 : 0);
    w.u32(static_cast<std::uint32_t>(keys.size()));
    for (const auto k : keys) w.str(k);
  }
  std::error_code decode(reader& r, bool with_force) {
    if (with_force) {
      const auto f = r.u8();
      if (f > 1) r.fail();
      force = f == 1;
    }
    const auto n = r.count(max_batch, 2);
    keys.clear();
    keys.reserve(n);
    for (std::uint32_t i = 0; i < n && r.ok(); ++i) keys.push_back(r.str());
    return r.finish();
  }
};

/// Per-key results: put_end, put_revoke, exists, remove replies.
struct code_list {
  std::vector<std::uint32_t> codes;

  void encode(writer& w) const {
    w.u32(static_cast<std::uint32_t>(codes.size()));
    for (const auto c : codes) w.u32(c);
  }
  std::error_code decode(reader& r) {
    const auto n = r.count(max_batch, 4);
    codes.resize(n);
    for (std::uint32_t i = 0; i < n; ++i) codes[i] = r.u32();
    return r.finish();
  }
};

struct put_start_request {
  static constexpr std::uint8_t flag_soft_pin = 1;
  static constexpr std::uint8_t flag_hard_pin = 2;

  std::uint8_t replicas = 1;
  std::uint8_t flags = 0;
  std::uint32_t soft_pin_ms = 0;         ///< 0: the master's default
  std::vector<std::uint64_t> preferred;  ///< segments tried first
  std::vector<std::string_view> keys;    ///< columns: keys[i], sizes[i], parents[i]
  std::vector<std::uint64_t> sizes;
  std::vector<std::string_view> parents;  ///< "" none

  void encode(writer& w) const {
    w.u8(replicas);
    w.u8(flags);
    w.u32(soft_pin_ms);
    w.u32(static_cast<std::uint32_t>(preferred.size()));
    for (const auto s : preferred) w.u64(s);
    w.u32(static_cast<std::uint32_t>(keys.size()));
    for (std::size_t i = 0; i < keys.size(); ++i) {
      w.str(keys[i]);
      w.u64(sizes[i]);
      w.str(i < parents.size() ? parents[i] : std::string_view{});
    }
  }
  std::error_code decode(reader& r) {
    replicas = r.u8();
    flags = r.u8();
    soft_pin_ms = r.u32();
    if (replicas == 0 || replicas > max_wire_replicas || (flags & ~3u) != 0) r.fail();
    const auto np = r.count(64, 8);
    preferred.resize(np);
    for (auto& s : preferred) s = r.u64();
    const auto n = r.count(max_batch, 12);
    keys.clear();
    sizes.clear();
    parents.clear();
    keys.reserve(n);
    sizes.reserve(n);
    parents.reserve(n);
    for (std::uint32_t i = 0; i < n && r.ok(); ++i) {
      keys.push_back(r.str());
      sizes.push_back(r.u64());
      parents.push_back(r.str());
    }
    return r.finish();
  }
};

/// Per key: a code and, when 0, the replicas to write (put_start) or to
/// read (get, with the object's size and the lease left).
struct placement_list {
  struct entry {
    std::uint32_t code = 0;
    std::uint64_t size = 0;      ///< get only
    std::uint32_t lease_ms = 0;  ///< get only: the lease left when the master answered
    std::uint8_t count = 0;
    std::array<wire_replica, 8> replicas{};
    std::span<const wire_replica> list() const noexcept { return {replicas.data(), count}; }
  };
  std::vector<entry> entries;

  void encode(writer& w, bool with_size) const {
    w.u32(static_cast<std::uint32_t>(entries.size()));
    for (const auto& e : entries) {
      w.u32(e.code);
      if (e.code != 0) continue;
      if (with_size) {
        w.u64(e.size);
        w.u32(e.lease_ms);
      }
      detail::encode_replicas(w, e.list());
    }
  }
  std::error_code decode(reader& r, bool with_size) {
    const auto n = r.count(max_batch, 4);
    entries.resize(n);
    for (std::uint32_t i = 0; i < n && r.ok(); ++i) {
      auto& e = entries[i];
      e = entry{};
      e.code = r.u32();
      if (e.code != 0) continue;
      if (with_size) {
        e.size = r.u64();
        e.lease_ms = r.u32();
      }
      detail::decode_replicas(r, e.count, e.replicas);
    }
    return r.finish();
  }
};

struct mount_request {
  /// An object its owner found in the segment (a record whose bytes check
  /// out) for a master that came up empty to take back.
  struct found {
    std::string_view key;
    std::uint64_t offset = 0;
    std::uint64_t size = 0;
  };
  std::string_view name;
  std::uint64_t size = 0;
  std::uint64_t engine_segment = 0;  ///< the segment's id in its owner's engine
  std::vector<found> objects;
  /// false: the segment stays closed to allocations until an adopt_request
  /// with open (its owner has more objects to announce than one frame holds).
  bool open = true;
  void encode(writer& w) const {
    w.str(name);
    w.u64(size);
    w.u64(engine_segment);
    encode_found(w, objects);
    w.u8(open ? 1 : 0);
  }
  std::error_code decode(reader& r) {
    name = r.str();
    size = r.u64();
    engine_segment = r.u64();
    decode_found(r, objects);
    open = decode_flag(r);
    return r.finish();
  }

  /// The bytes one object adds to a mount or adopt body.
  static std::size_t found_bytes(std::size_t key_size) noexcept { return 2 + key_size + 16; }
  static void encode_found(writer& w, const std::vector<found>& objects) {
    w.u32(static_cast<std::uint32_t>(objects.size()));
    for (const auto& o : objects) {
      w.str(o.key);
      w.u64(o.offset);
      w.u64(o.size);
    }
  }
  /// A u8 that must be 0 or 1.
  static bool decode_flag(reader& r) {
    const auto f = r.u8();
    if (f > 1) r.fail();
    return f == 1;
  }
  static void decode_found(reader& r, std::vector<found>& objects) {
    const auto n = r.count(max_batch, 18);
    objects.resize(n);
    for (std::uint32_t i = 0; i < n; ++i) {
      objects[i].key = r.str();
      objects[i].offset = r.u64();
      objects[i].size = r.u64();
    }
  }
};

/// More objects of a segment its owner mounted closed (mount_request::open
/// false); `open` ends the announcement and opens the segment.
struct adopt_request {
  std::uint64_t segment = 0;
  std::vector<mount_request::found> objects;
  bool open = true;
  void encode(writer& w) const {
    w.u64(segment);
    mount_request::encode_found(w, objects);
    w.u8(open ? 1 : 0);
  }
  std::error_code decode(reader& r) {
    segment = r.u64();
    mount_request::decode_found(r, objects);
    open = mount_request::decode_flag(r);
    return r.finish();
  }
};

/// segment_info's reply: where a segment's bytes are served.
struct segment_location {
  std::uint64_t client = 0;
  std::string_view address;  ///< the owner's engine address (host:port)
  std::uint64_t engine_segment = 0;
  std::uint64_t size = 0;
  std::string_view host;
  void encode(writer& w) const {
    w.u64(client);
    w.str(address);
    w.u64(engine_segment);
    w.u64(size);
    w.str(host);
  }
  std::error_code decode(reader& r) {
    client = r.u64();
    address = r.str();
    engine_segment = r.u64();
    size = r.u64();
    host = r.str();
    return r.finish();
  }
};

struct stats_reply {
  std::uint64_t capacity = 0, used = 0, objects = 0, in_progress = 0, reserved = 0, segments = 0;
  void encode(writer& w) const {
    for (const auto v : {capacity, used, objects, in_progress, reserved, segments}) w.u64(v);
  }
  std::error_code decode(reader& r) {
    for (auto* v : {&capacity, &used, &objects, &in_progress, &reserved, &segments}) *v = r.u64();
    return r.finish();
  }
};

// ---- the SSD tier --------------------------------------------------------

/// What a disk_report entry says.
enum class disk_report_kind : std::uint8_t {
  adopt = 1,    ///< the disk holds the object (its manifest, after a mount)
  stored = 2,   ///< a store task ended (code 0: copied to the disk)
  loaded = 3,   ///< a load task ended (code 0: the range holds the object)
  dropped = 4,  ///< the disk let the object go (its own space eviction)
};

/// What a disk_task entry asks (object_table's disk_task::kind).
enum class disk_task_kind : std::uint8_t { store = 1, load = 2, drop = 3 };

/// disk_report's request and disk_task's body: entries of the same shape
/// (a task's carries no code).
struct disk_entries {
  struct entry {
    std::uint8_t kind = 0;
    std::string_view key;
    std::uint64_t size = 0;
    std::uint64_t segment = 0;
    std::uint64_t offset = 0;
    std::uint32_t code = 0;  ///< reports only
  };
  std::vector<entry> entries;

  void encode(writer& w, bool with_code) const {
    w.u32(static_cast<std::uint32_t>(entries.size()));
    for (const auto& e : entries) {
      w.u8(e.kind);
      w.str(e.key);
      w.u64(e.size);
      w.u64(e.segment);
      w.u64(e.offset);
      if (with_code) w.u32(e.code);
    }
  }
  /// Kinds outside 1..4 (reports) or 1..3 (tasks) do not decode.
  std::error_code decode(reader& r, bool with_code) {
    const auto n = r.count(max_batch, with_code ? 31 : 27);
    entries.clear();
    entries.reserve(n);
    const std::uint8_t last = with_code ? 4 : 3;
    for (std::uint32_t i = 0; i < n && r.ok(); ++i) {
      entry e;
      e.kind = r.u8();
      if (e.kind == 0 || e.kind > last) r.fail();
      e.key = r.str();
      e.size = r.u64();
      e.segment = r.u64();
      e.offset = r.u64();
      if (with_code) e.code = r.u32();
      entries.push_back(e);
    }
    return r.finish();
  }
};

}  // namespace kvlink::store::wire
