// Fuzzes the store master's wire (include/kvlink/store/wire/protocol.hpp)
// and its dispatch (master_service::handle_frame, store/master/service.hpp)
// without sockets.
//
// 1. The whole input through decode_header and every message decoder: no
//    crash, no read past the input; what decodes encodes back to the same
//    bytes (the formats have one encoding). The input as a segment's memory
//    scanned for object records (store/wire/record.hpp), and as the start
//    of an SSD tier file (store/tier/disk_record.hpp): its header, then a
//    record header at every 64 bytes under the file's salt.
// 2. The input as a program of frames, [u8 who/clock][u16 type][u16 length]
//    [body], each handled for one of two clients against one object table
//    (one segment of client A mounted first): every reply is a well-formed
//    frame with the request's id and type | reply_bit, opening with a status
//    that decodes; an ok reply's body decodes exactly as its type says, with
//    one result per key of the request; the pool's books stay consistent.
// 3. The input as an HTTP request (store/master/http.hpp, metadata.hpp): its
//    head parsed, its rest a body; routed to the master's endpoints and to
//    the metadata server over a small table: a known status, the table
//    within its capacity, and a stored value read back as it was put.
#include <kvlink/core/instance.hpp>
#include <kvlink/store/master/http.hpp>
#include <kvlink/store/master/metadata.hpp>
#include <kvlink/store/master/server.hpp>
#include <kvlink/store/master/service.hpp>
#include <kvlink/store/tier/disk_record.hpp>
#include <kvlink/store/wire/protocol.hpp>
#include <kvlink/store/wire/record.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "fuzz_check.hpp"

namespace {

namespace st = kvlink::store;
namespace wire = kvlink::store::wire;

std::string body_bytes(wire::writer& w) { return w.take().substr(wire::header_size); }

template <class Msg, class... Args>
void round_trip(std::string_view in, Args... args) {
  wire::reader r(in);
  Msg m;
  if (m.decode(r, args...)) return;
  wire::writer w(wire::message_type::heartbeat, 0, false);
  m.encode(w, args...);
  KVLINK_FUZZ_CHECK(body_bytes(w) == in);
}

// The input as a segment's memory: decode_record reads only what it is
// given, and scan_records finds only records whose bytes check out, within
// the memory, in offset order, then (wiping) finds nothing new again.
void records(std::string_view in) {
  std::string mem(in);
  auto* base = reinterpret_cast<std::byte*>(mem.data());
  wire::object_record rec;
  if (wire::decode_record({base, mem.size()}, 64, rec)) {
    KVLINK_FUZZ_CHECK(rec.key.size() <= 64 && rec.size != 0);
    std::string again(wire::record_size(rec.key.size()), '\0');
    KVLINK_FUZZ_CHECK(wire::encode_record(rec.key, rec.size, rec.body_crc,
                                          {reinterpret_cast<std::byte*>(again.data()),
                                           again.size()}) == again.size());
  }
  std::uint64_t last = 0;
  std::size_t found = 0;
  (void)wire::scan_records(base, mem.size(), 64, true, false, [&](const wire::found_object& f) {
    KVLINK_FUZZ_CHECK(f.offset >= last && f.offset % wire::record_alignment == 0);
    KVLINK_FUZZ_CHECK(f.size <= mem.size() - f.offset);
    KVLINK_FUZZ_CHECK(wire::object_footprint(f.size, f.key.size()) -
                          wire::record_size(f.key.size()) + wire::record_header_size +
                          f.key.size() <=
                      mem.size() - f.offset);
    KVLINK_FUZZ_CHECK(kvlink::crc32c(base + f.offset, f.size) ==
                      wire::detail::get_u32(base + f.offset + wire::record_offset(f.size) + 12));
    last = f.offset + wire::record_offset(f.size);
    ++found;
  });
  std::size_t again = 0;
  (void)wire::scan_records(base, mem.size(), 64, true, false,
                           [&](const wire::found_object&) { ++again; });
  KVLINK_FUZZ_CHECK(again == found);
}

// The input as the start of an SSD tier file: what decodes is within the
// input, keeps the format's bounds and encodes back to the same bytes.
void disk_file(std::string_view in) {
  namespace tier = kvlink::store::tier;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(in.data()), in.size());
  tier::disk_file_header h;
  std::uint64_t salt = 0;
  if (tier::decode_file_header(bytes, h) == tier::file_header_status::ok) {
    KVLINK_FUZZ_CHECK(tier::disk_block_valid(h.block));
    std::byte again[tier::disk_file_header_size];
    KVLINK_FUZZ_CHECK(tier::encode_file_header(h, again));
    KVLINK_FUZZ_CHECK(std::memcmp(again, bytes.data(), sizeof again) == 0);
    salt = h.salt;
  }
  for (std::size_t at = 0; at + tier::disk_record_header_size <= bytes.size(); at += 64) {
    tier::disk_record r;
    if (!tier::decode_record_header(salt, bytes.subspan(at), r)) continue;
    KVLINK_FUZZ_CHECK(!r.key.empty() && r.key.size() <= tier::disk_max_key);
    KVLINK_FUZZ_CHECK(tier::disk_record_header_size + r.key.size() <= bytes.size() - at);
    KVLINK_FUZZ_CHECK(r.kind != tier::disk_record_kind::removal || r.size == 0);
    std::string again(tier::disk_record_header_size + r.key.size(), '\0');
    KVLINK_FUZZ_CHECK(tier::encode_record_header(
        salt, r, {reinterpret_cast<std::byte*>(again.data()), again.size()}));
    KVLINK_FUZZ_CHECK(std::memcmp(again.data(), bytes.data() + at,
                                  tier::disk_record_header_size + r.key.size()) == 0);
  }
}

void decoders(std::string_view in) {
  if (in.size() >= wire::header_size) {
    wire::header_bytes hb{};
    for (std::size_t i = 0; i < wire::header_size; ++i) {
      hb[i] = static_cast<unsigned char>(in[i]);
    }
    wire::frame_header h;
    if (!wire::decode_header(hb, wire::default_max_body, h)) {
      KVLINK_FUZZ_CHECK(wire::encode_header(h) == hb);
      KVLINK_FUZZ_CHECK(h.body_length <= wire::default_max_body);
    }
  }
  round_trip<wire::key_batch>(in, false);
  round_trip<wire::key_batch>(in, true);
  round_trip<wire::code_list>(in);
  round_trip<wire::put_start_request>(in);
  round_trip<wire::placement_list>(in, false);
  round_trip<wire::placement_list>(in, true);
  round_trip<wire::mount_request>(in);
  round_trip<wire::adopt_request>(in);
  round_trip<wire::segment_location>(in);
  round_trip<wire::stats_reply>(in);
  round_trip<wire::disk_entries>(in, true);
  round_trip<wire::disk_entries>(in, false);
  records(in);
  disk_file(in);
  wire::reader r(in);
  std::string_view text;
  (void)r.status(&text);
}

// How many keys a request carries, when its body decodes (else -1).
long keys_of(wire::message_type t, std::span<const unsigned char> body) {
  wire::reader r(body);
  switch (t) {
    case wire::message_type::put_start: {
      wire::put_start_request q;
      return q.decode(r) ? -1 : static_cast<long>(q.keys.size());
    }
    case wire::message_type::put_end:
    case wire::message_type::put_revoke:
    case wire::message_type::get:
    case wire::message_type::replicas:
    case wire::message_type::exists:
    case wire::message_type::remove: {
      wire::key_batch b;
      return b.decode(r, t == wire::message_type::remove) ? -1 : static_cast<long>(b.keys.size());
    }
    case wire::message_type::disk_report: {
      wire::disk_entries d;
      return d.decode(r, true) ? -1 : static_cast<long>(d.entries.size());
    }
    default:
      return 0;
  }
}

void check_reply(const std::string& reply, const wire::frame_header& req,
                 std::span<const unsigned char> body, bool close) {
  KVLINK_FUZZ_CHECK(reply.size() >= wire::header_size);
  wire::header_bytes hb{};
  for (std::size_t i = 0; i < wire::header_size; ++i) {
    hb[i] = static_cast<unsigned char>(reply[i]);
  }
  wire::frame_header h;
  KVLINK_FUZZ_CHECK(!wire::decode_header(hb, UINT32_MAX, h));
  KVLINK_FUZZ_CHECK(h.id == req.id);
  KVLINK_FUZZ_CHECK(h.type == (req.type | wire::reply_bit));
  KVLINK_FUZZ_CHECK(h.body_length == reply.size() - wire::header_size);
  wire::reader r(std::string_view(reply).substr(wire::header_size));
  const std::error_code status = r.status();
  KVLINK_FUZZ_CHECK(r.ok());
  const bool known = !req.is_reply() && wire::known_type(req.type);
  const long keys = known ? keys_of(req.kind(), body) : 0;
  if (close) KVLINK_FUZZ_CHECK(status == kvlink::errc::malformed_message);
  if (known && keys < 0) KVLINK_FUZZ_CHECK(close);
  if (status) {
    KVLINK_FUZZ_CHECK(!r.finish());  // nothing after an error's status
    return;
  }
  KVLINK_FUZZ_CHECK(known && !close);
  switch (req.kind()) {
    case wire::message_type::heartbeat:
      KVLINK_FUZZ_CHECK(r.u8() <= 1);
      KVLINK_FUZZ_CHECK(!r.finish());
      break;
    case wire::message_type::mount: {
      (void)r.u64();
      wire::code_list taken;  // one code per object announced with the mount
      KVLINK_FUZZ_CHECK(!taken.decode(r));
      wire::reader q(body);
      wire::mount_request m;
      KVLINK_FUZZ_CHECK(!m.decode(q));
      KVLINK_FUZZ_CHECK(taken.codes.size() == m.objects.size());
      break;
    }
    case wire::message_type::adopt: {
      wire::code_list taken;  // one code per object announced
      KVLINK_FUZZ_CHECK(!taken.decode(r));
      wire::reader q(body);
      wire::adopt_request a;
      KVLINK_FUZZ_CHECK(!a.decode(q));
      KVLINK_FUZZ_CHECK(taken.codes.size() == a.objects.size());
      break;
    }
    case wire::message_type::remove_all:
      (void)r.u64();
      KVLINK_FUZZ_CHECK(!r.finish());
      break;
    case wire::message_type::unmount:
    case wire::message_type::disk_mount:
      KVLINK_FUZZ_CHECK(!r.finish());
      break;
    case wire::message_type::segment_info: {
      wire::segment_location l;
      KVLINK_FUZZ_CHECK(!l.decode(r));
      break;
    }
    case wire::message_type::put_start:
    case wire::message_type::get:
    case wire::message_type::replicas: {
      const bool sized = req.kind() != wire::message_type::put_start;
      wire::placement_list p;
      KVLINK_FUZZ_CHECK(!p.decode(r, sized));
      KVLINK_FUZZ_CHECK(static_cast<long>(p.entries.size()) == keys);
      for (const auto& e : p.entries) KVLINK_FUZZ_CHECK(e.code != 0 || e.count >= 1);
      // A description grants no lease.
      if (req.kind() == wire::message_type::replicas) {
        for (const auto& e : p.entries) KVLINK_FUZZ_CHECK(e.lease_ms == 0);
      }
      break;
    }
    case wire::message_type::stats: {
      wire::stats_reply s;
      KVLINK_FUZZ_CHECK(!s.decode(r));
      KVLINK_FUZZ_CHECK(s.used <= s.capacity);
      break;
    }
    default: {
      wire::code_list c;
      KVLINK_FUZZ_CHECK(!c.decode(r));
      KVLINK_FUZZ_CHECK(static_cast<long>(c.codes.size()) == keys);
      break;
    }
  }
}

void dispatch(const std::uint8_t* data, std::size_t size) {
  st::master_config cfg;
  cfg.alignment = 64;
  cfg.max_key_size = 64;
  st::server_options opt;
  opt.suspect_after = std::chrono::milliseconds{100};
  opt.liveness_timeout = std::chrono::milliseconds{1000};
  st::master_service svc{cfg, opt};
  std::int64_t clock = 0;
  const auto now = [&clock] { return st::master_time{std::chrono::milliseconds{clock}}; };
  auto a = svc.attach_client(kvlink::instance_id{1, 1}, "10.0.0.1:1", now());
  auto b = svc.attach_client(kvlink::instance_id{2, 2}, "", now());
  kvlink::segment_id seg;
  KVLINK_FUZZ_CHECK(
      !svc.objects().mount_segment({a.session.client->id, "s", 1 << 16, "10.0.0.1"}, seg));
  std::uint64_t id = 0;
  std::size_t i = 0;
  while (i + 5 <= size) {
    const std::uint8_t who = data[i];
    const auto type = static_cast<std::uint16_t>(data[i + 1] | (data[i + 2] << 8));
    std::size_t len = static_cast<std::size_t>(data[i + 3] | (data[i + 4] << 8));
    i += 5;
    len = std::min(len, size - i);
    clock += (who >> 1) * 7;
    wire::frame_header h;
    h.type = type;
    h.id = ++id;
    h.body_length = static_cast<std::uint32_t>(len);
    const std::span<const unsigned char> body(data + i, len);
    i += len;
    st::session_state& s = (who & 1) ? b.session : a.session;
    if (!s.client) continue;
    bool close = false;
    const std::string reply = svc.handle_frame(s, h, body, now(), close);
    check_reply(reply, h, body, close);
    if ((who & 0xF0) == 0xF0) svc.check_liveness(now());
    if ((who & 0xF8) == 0xE8) svc.reclaim(now());
    if ((who & 0xF8) == 0xE0) svc.evict(now());
    const st::pool_stats p = svc.objects().stats();
    KVLINK_FUZZ_CHECK(p.used <= p.capacity);
    KVLINK_FUZZ_CHECK(p.in_progress <= p.objects);
    KVLINK_FUZZ_CHECK(p.disk_replicas <= p.objects * 2);  // two clients, one disk each
    KVLINK_FUZZ_CHECK(p.disks <= 2);
    // The SSD tier's tasks: frames for a client that has a disk (or had:
    // drops outlive it), entries a disk_task decodes.
    for (const auto& f : svc.take_disk_frames()) {
      KVLINK_FUZZ_CHECK(f.client == a.session.client->id ||
                        (b.session.client && f.client == b.session.client->id));
      KVLINK_FUZZ_CHECK(f.bytes.size() >= wire::header_size);
      wire::header_bytes fh{};
      std::memcpy(fh.data(), f.bytes.data(), wire::header_size);
      wire::frame_header th;
      KVLINK_FUZZ_CHECK(!wire::decode_header(fh, UINT32_MAX, th));
      KVLINK_FUZZ_CHECK(th.kind() == wire::message_type::disk_task && !th.is_reply());
      wire::reader tr(std::string_view(f.bytes).substr(wire::header_size));
      wire::disk_entries tasks;
      KVLINK_FUZZ_CHECK(!tasks.decode(tr, false));
      KVLINK_FUZZ_CHECK(tasks.entries.size() == f.tasks.size() && !f.tasks.empty());
      if ((who & 0x0C) == 0x0C) svc.undeliverable(f);  // the holder had no connection
    }
  }
  (void)kvlink::store::route_http(svc, "GET", "/metrics");
  (void)kvlink::store::route_http(svc, "GET", "/segments");
  (void)kvlink::store::route_http(svc, "GET", "/get_all_segments");
  (void)kvlink::store::route_http(svc, "GET", "/metrics/summary");
  svc.detach_client(a.session);
  svc.detach_client(b.session);
}

void http(std::string_view in) {
  const std::size_t end = in.find("\r\n\r\n");
  if (end == std::string_view::npos) {
    KVLINK_FUZZ_CHECK(!st::parse_http_head(in));
    return;
  }
  auto req = st::parse_http_head(in.substr(0, end + 4));
  if (!req) return;
  req->body = in.substr(end + 4);
  st::metadata_table table(64, 256);
  (void)table.put("seed", "value");
  for (const std::string_view token : {std::string_view{}, std::string_view{"t0ken"}}) {
    const auto a = st::route_metadata(table, token, *req);
    KVLINK_FUZZ_CHECK(a.status == 200 || a.status == 400 || a.status == 401 || a.status == 404 ||
                      a.status == 405 || a.status == 413 || a.status == 507);
    KVLINK_FUZZ_CHECK(table.bytes() <= 256);
    if (a.status == 200 && req->method == "PUT") {
      // What was stored reads back as it was sent.
      auto get = *req;
      get.method = "GET";
      const auto back = st::route_metadata(table, token, get);
      KVLINK_FUZZ_CHECK(back.status == 200 && back.body == req->body);
    }
    KVLINK_FUZZ_CHECK(st::format_http(a).starts_with("HTTP/1.1 "));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  decoders(std::string_view(reinterpret_cast<const char*>(data), size));
  dispatch(data, size);
  http(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
