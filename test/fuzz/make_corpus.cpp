// Writes the fuzz targets' seed corpora (test/fuzz/corpus/<target>/) from
// kvlink's own encoders, so the seeds are what an engine really sends:
// tcp::encode() frames, encode_message() of make_hello()/make_welcome()/
// make_notify()/make_error()/make_transport_message()/make_segments(), and a
// descriptor with tcp and rdma entries shaped as the transports' describe()
// and segment_key() write them; plus a few malformed inputs per target.
//
//   kvlink_fuzz_make_corpus test/fuzz/corpus
//
// Deterministic: fixed instance ids, nonces and keys, so running it again
// rewrites the same files.
#include <kvlink/control/descriptor.hpp>
#include <kvlink/control/guard.hpp>
#include <kvlink/control/handshake.hpp>
#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/store/tier/disk_record.hpp>
#include <kvlink/store/wire/protocol.hpp>
#include <kvlink/store/wire/record.hpp>
#include <kvlink/tcp/frame.hpp>
#include <kvlink/version.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#if defined(KVLINK_FUZZ_RDMA)
#include <kvlink/rdma/device.hpp>
#include <kvlink/rdma/transport.hpp>
#endif

namespace {

namespace control = kvlink::control;
namespace fs = std::filesystem;
using json = nlohmann::json;
using kvlink::errc;

fs::path root;
int written = 0;

void put(const std::string& target, const std::string& name, std::string_view bytes) {
  const fs::path dir = root / target;
  fs::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", (dir / name).c_str());
    std::exit(1);
  }
  ++written;
}

std::string body_of(const std::string& wire) { return wire.substr(control::prefix_size); }

std::string bytes_of(const kvlink::tcp::frame_header& h) {
  const auto b = kvlink::tcp::encode(h);
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

const kvlink::instance_id self{0x5e1f5e1f00c0ffeeULL, 0x0123456789abcdefULL};
const kvlink::instance_id peer{0x7ea7ea7ea7ea7ea7ULL, 0xfedcba9876543210ULL};

control::nonce fixed_nonce(unsigned char seed) {
  control::nonce n{};
  for (std::size_t i = 0; i < n.size(); ++i) n[i] = static_cast<unsigned char>(seed + 7 * i);
  return n;
}

// ------------------------------------------------------------------ frames

void frames() {
  using kvlink::tcp::frame_header;
  using kvlink::tcp::frame_type;
  const frame_header wr{frame_type::write_request, 0, 1, 1, 0, 4096};
  const frame_header rr{frame_type::read_request, 0, 2, 3, 1 << 20, 65536};
  const frame_header ack{frame_type::write_ack, 0, 1, 1, 0, 0};
  const frame_header resp{frame_type::read_response, 0, 2, 3, 1 << 20, 65536};
  const frame_header refused{frame_type::read_response,
                             kvlink::tcp::error_to_status(errc::out_of_bounds),
                             7,
                             3,
                             0xfffffffffff00000ULL,
                             0};
  const frame_header unknown_status{
      frame_type::write_ack,
      static_cast<std::uint16_t>(static_cast<int>(kvlink::errc_last) + 5),
      9,
      1,
      0,
      0};
  put("frame", "write_request", bytes_of(wr));
  put("frame", "read_request", bytes_of(rr));
  put("frame", "write_ack", bytes_of(ack));
  put("frame", "read_response", bytes_of(resp));
  put("frame", "read_response_out_of_bounds", bytes_of(refused));
  put("frame", "write_ack_unknown_status", bytes_of(unknown_status));
  put("frame", "stream_three", bytes_of(wr) + bytes_of(ack) + bytes_of(resp));

  std::string bad = bytes_of(wr);
  bad[0] = 'X';
  put("frame", "bad_magic", bad);
  bad = bytes_of(wr);
  bad[4] = 2;
  put("frame", "bad_version", bad);
  bad = bytes_of(wr);
  bad[5] = 0;
  put("frame", "bad_type_0", bad);
  bad[5] = 7;
  put("frame", "bad_type_7", bad);
  put("frame", "truncated", bytes_of(wr).substr(0, 39));

  // Vector frames: a header, then its piece table (and payloads, not read).
  const auto table = [](std::initializer_list<kvlink::tcp::frame_piece> pieces) {
    std::string out;
    for (const auto& p : pieces) {
      std::array<std::byte, kvlink::tcp::piece_entry_size> b{};
      kvlink::tcp::encode(p, b.data());
      out.append(reinterpret_cast<const char*>(b.data()), b.size());
    }
    return out;
  };
  const frame_header wv{frame_type::write_vector, 0, 4, 1, 3, 4096 + 4096 + 1};
  const frame_header rv{frame_type::read_vector, 0, 5, 1, 2, 8192};
  put("frame", "write_vector",
      bytes_of(wv) + table({{0, 4096}, {1 << 20, 4096}, {12345, 1}}) + bytes_of(ack));
  put("frame", "read_vector", bytes_of(rv) + table({{8192, 4096}, {0, 4096}}) + bytes_of(resp));
  put("frame", "vector_sum_short", bytes_of(rv) + table({{8192, 4096}, {0, 4095}}));
  put("frame", "vector_zero_piece", bytes_of(wv) + table({{0, 8193}, {0, 0}, {0, 0}}));
  frame_header too_many = rv;
  too_many.offset = kvlink::tcp::max_vector_pieces + 1;
  too_many.length = 1u << 20;
  put("frame", "vector_too_many", bytes_of(too_many));
}

// ------------------------------------------------------------------ descriptors

std::string gid_text(const char* ipv6) {
#if defined(KVLINK_FUZZ_RDMA)
  return kvlink::rdma::detail::gid_wire(*kvlink::rdma::parse_gid(ipv6));
#else
  (void)ipv6;
  return "0000:0000:0000:0000:0000:ffff:0a00:0001";
#endif
}

// An "rdma" entry as rdma::transport::describe() writes it: two ports.
json rdma_entry() {
  auto ports = json::array();
  ports.push_back({{"device", "mlx5_0"},
                   {"port", 1},
                   {"gid", gid_text("::ffff:10.0.0.1")},
                   {"gid_index", 3},
                   {"why", "RoCE v2 IPv4-mapped 10.0.0.1 on ens1f0"},
                   {"mtu", 4096U},
                   {"ipv4", "10.0.0.1"},
                   {"prefix", 24U}});
  ports.push_back({{"device", "mlx5_1"},
                   {"port", 1},
                   {"gid", gid_text("fe80::5054:ff:fe12:3456")},
                   {"gid_index", 0},
                   {"why", "IPv6 link-local fe80::5054:ff:fe12:3456 on ens1f1"},
                   {"mtu", 1024U},
                   {"ipv4", "10.0.1.1"},
                   {"prefix", 24U}});
  return {{"ports", std::move(ports)}};
}

control::peer_descriptor descriptor(bool with_rdma) {
  control::peer_descriptor d;
  d.instance = peer;
  d.address = "10.0.0.1:17001";
  kvlink::remote_segment_info a{kvlink::segment_id{1}, 0x7f0000000000ULL, 1ULL << 30,
                                kvlink::access::remote_read_write, json::object()};
  kvlink::remote_segment_info b{kvlink::segment_id{2}, 0x7f0040000000ULL, 65536,
                                kvlink::access::remote_read, json::object()};
  if (with_rdma) {
    a.keys["rdma"] = json::array({4660U, 4661U});
    b.keys["rdma"] = json::array({0x12345U, 0xffffffffU});
  }
  d.segments = {a, b};
  d.transports["tcp"] = {{"lanes", 2U}};  // tcp::transport::describe()
  if (with_rdma) d.transports["rdma"] = rdma_entry();
  return d;
}

void descriptors() {
  const auto full = descriptor(true);
  put("descriptor", "welcome_tcp_rdma",
      body_of(control::encode_message(control::make_welcome(full))));
  put("descriptor", "descriptor_tcp_rdma", control::to_json(full).dump());
  put("descriptor", "descriptor_tcp_only", control::to_json(descriptor(false)).dump());
  put("descriptor", "segments_update",
      body_of(control::encode_message(control::make_segments(full.segments))));
  put("descriptor", "rdma_entry", rdma_entry().dump());
  put("descriptor", "rdma_keys", full.segments[0].keys.dump());

  auto bad = control::to_json(full);
  bad["protocol"] = 1U;
  put("descriptor", "bad_protocol_1", bad.dump());
  bad = control::to_json(full);
  bad["instance"] = std::string(32, '0');
  put("descriptor", "bad_instance_zero", bad.dump());
  bad = control::to_json(full);
  bad["segments"][0]["id"] = 0U;
  put("descriptor", "bad_segment_id_0", bad.dump());
  bad = control::to_json(full);
  bad["segments"][1]["access"] = "x";
  put("descriptor", "bad_access", bad.dump());
  bad = control::to_json(full);
  bad["transports"]["rdma"]["ports"][0]["mtu"] = 1000U;
  put("descriptor", "bad_rdma_mtu", bad.dump());
  bad = control::to_json(full);
  bad["transports"]["rdma"]["ports"][1]["gid"] = "fe80:::1";
  put("descriptor", "bad_rdma_gid", bad.dump());
  bad = control::to_json(full);
  bad["segments"][0]["keys"]["rdma"][1] = 0x100000000ULL;
  put("descriptor", "bad_rkey_33_bits", bad.dump());
}

// ------------------------------------------------------------------ handshake

json hello_lane() {
  control::hello h;
  h.instance = self;
  h.r = control::role::lane;
  h.transport = "rdma";
  h.lane = 3;
  h.expect = peer;
  h.address = "10.0.0.2:17001";
  h.client_nonce = fixed_nonce(1);
  return control::to_json(h);
}

json challenge() {
  const control::peer_guard guard("fuzz secret");
  const auto client = fixed_nonce(1);
  const auto server = fixed_nonce(2);
  return {{"type", "challenge"},
          {"protocol", kvlink::protocol_version},
          {"instance", kvlink::to_string(peer)},
          {"nonce", control::hex_of(server)},
          {"proof", control::hex_of(guard.server_proof(client, server, self, "lane", 3))}};
}

json response() {
  const control::peer_guard guard("fuzz secret");
  const auto client = fixed_nonce(1);
  const auto server = fixed_nonce(2);
  const auto session_key = guard.session_key(client, server);
  return {{"type", "response"},
          {"proof", control::hex_of(guard.client_proof(client, server, peer))},
          {"session", "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"},
          {"bind", control::hex_of(control::peer_guard::lane_binding(session_key, server, 3))}};
}

void handshakes() {
  const auto hello = control::make_hello(kvlink::protocol_version, self, control::role::control, 0,
                                         std::nullopt, "10.0.0.2:17001");
  put("handshake", "hello_control", body_of(control::encode_message(hello)));
  put("handshake", "hello_lane_rdma", body_of(control::encode_message(hello_lane())));
  put("handshake", "hello_protocol_1", control::make_hello(1, self, control::role::control).dump());
  put("handshake", "hello_protocol_3",
      control::make_hello(3, self, control::role::lane, 1, peer).dump());
  put("handshake", "error_version",
      control::make_error(errc::protocol_version_mismatch, "this engine speaks protocol 2").dump());
  put("handshake", "error_auth", control::make_error(errc::authentication_failed).dump());
  put("handshake", "challenge", challenge().dump());
  put("handshake", "response_lane", response().dump());
  put("handshake", "welcome", control::make_welcome(peer).dump());

  auto bad = hello;
  bad["instance"] = "0123456789abcdef0123456789abcdeg";
  put("handshake", "bad_hello_instance", bad.dump());
  bad = hello;
  bad["role"] = "observer";
  put("handshake", "bad_hello_role", bad.dump());
  bad = hello_lane();
  bad["transport"] = std::string(33, 't');
  put("handshake", "bad_hello_transport_long", bad.dump());
  bad = hello_lane();
  bad["nonce"] = "abc";
  put("handshake", "bad_hello_nonce", bad.dump());
  put("handshake", "bad_error_code", R"({"type":"error","code":9999,"message":"?"})");
  put("handshake", "bad_error_negative", R"({"type":"error","code":-1})");
  put("handshake", "bad_not_object", R"(["hello",2])");
}

// ------------------------------------------------------------------ notifications

json rdma_connect() {
  return {
      {"type", "rdma_connect"},
      {"rail", 0U},
      {"gen", 1U},
      {"port", 0U},
      {"gid", gid_text("::ffff:10.0.0.2")},
      {"mtu", 4096U},
      {"qps", json::array({{{"qpn", 0x11U}, {"psn", 0xabcdeU}}, {{"qpn", 0x12U}, {"psn", 7U}}})}};
}

void notifications() {
  put("notify", "notify_text",
      body_of(control::encode_message(control::make_notify("req-1", "done"))));
  put("notify", "notify_binary",
      control::make_notify("kv/layer/17", std::string("\x00\x01\xfe\xff\x80", 5)).dump());
  put("notify", "notify_empty", control::make_notify("", "").dump());
  put("notify", "notify_over_small_bound",
      control::make_notify("request-42", "sixteen bytes!!!").dump());
  put("notify", "transport_rdma_connect",
      body_of(control::encode_message(control::make_transport_message("rdma", rdma_connect()))));
  put("notify", "transport_rdma_reject",
      control::make_transport_message("rdma", {{"type", "rdma_reject"},
                                               {"rail", 0U},
                                               {"gen", 1U},
                                               {"code", 9U},
                                               {"message", "no such port"}})
          .dump());
  put("notify", "bad_notify_odd_hex", R"({"type":"notify","id":"x","payload":"abc"})");
  put("notify", "bad_notify_not_hex", R"({"type":"notify","id":"x","payload":"zz"})");
  put("notify", "notify_upper_hex", R"({"type":"notify","id":"x","payload":"ABcd"})");
  put("notify", "bad_notify_no_id", R"({"type":"notify","payload":"00"})");
  put("notify", "bad_transport_body", R"({"type":"transport","transport":"rdma","body":[1]})");
}

// ------------------------------------------------------------------ control stream

void control_stream() {
  const auto hello = control::make_hello(kvlink::protocol_version, self, control::role::control, 0,
                                         std::nullopt, "10.0.0.2:17001");
  const auto welcome = control::make_welcome(descriptor(true));
  const auto notify = control::make_notify("req-1", "done");
  const auto segs = control::make_segments(descriptor(true).segments);
  const auto tm = control::make_transport_message("rdma", rdma_connect());
  put("control_message", "hello", control::encode_message(hello));
  put("control_message", "hello_lane", control::encode_message(hello_lane()));
  put("control_message", "welcome", control::encode_message(welcome));
  put("control_message", "challenge", control::encode_message(challenge()));
  put("control_message", "response", control::encode_message(response()));
  put("control_message", "error",
      control::encode_message(control::make_error(errc::protocol_version_mismatch)));
  put("control_message", "notify", control::encode_message(notify));
  put("control_message", "segments", control::encode_message(segs));
  put("control_message", "transport", control::encode_message(tm));
  put("control_message", "stream_session",
      control::encode_message(hello) + control::encode_message(notify) +
          control::encode_message(tm) + control::encode_message(segs));

  std::string bad = control::encode_message(hello);
  bad[0] = 'X';
  put("control_message", "bad_magic", bad);
  const auto zero = control::encode_prefix(0);
  put("control_message", "bad_zero_length",
      std::string(reinterpret_cast<const char*>(zero.data()), zero.size()));
  const auto huge = control::encode_prefix((1U << 20) + 1);
  put("control_message", "bad_too_large",
      std::string(reinterpret_cast<const char*>(huge.data()), huge.size()) + R"({"type":"x"})");
  put("control_message", "bad_truncated_body", control::encode_message(notify).substr(0, 20));
  auto frame_of = [](std::string_view text) {
    const auto p = control::encode_prefix(static_cast<std::uint32_t>(text.size()));
    return std::string(reinterpret_cast<const char*>(p.data()), p.size()) + std::string(text);
  };
  put("control_message", "bad_not_json", frame_of("{\"type\": \"hello\""));
  put("control_message", "bad_array", frame_of("[1,2,3]"));
  put("control_message", "bad_type_number", frame_of(R"({"type": 7})"));
}

}  // namespace

// ------------------------------------------------------------------ store wire

// store_wire.cpp reads a program of frames: [u8 who/clock][u16 type]
// [u16 length][body]; its first pass also decodes the whole input.
namespace wire = kvlink::store::wire;

std::string store_step(std::uint8_t who, wire::message_type t,
                       const std::function<void(wire::writer&)>& fill) {
  wire::writer w(t, 0, false);
  fill(w);
  const std::string body = w.take().substr(wire::header_size);
  std::string out;
  const auto type = static_cast<std::uint16_t>(t);
  out += static_cast<char>(who);
  out += static_cast<char>(type & 0xff);
  out += static_cast<char>(type >> 8);
  out += static_cast<char>(body.size() & 0xff);
  out += static_cast<char>((body.size() >> 8) & 0xff);
  return out + body;
}

void store_wire() {
  const auto keys = [](std::vector<std::string_view> k, bool force, bool with_force) {
    return [k, force, with_force](wire::writer& w) {
      wire::key_batch b;
      b.keys = k;
      b.force = force;
      b.encode(w, with_force);
    };
  };
  const auto puts = [](wire::writer& w) {
    wire::put_start_request q;
    q.replicas = 2;
    q.flags = wire::put_start_request::flag_soft_pin;
    q.keys = {"a", "b", "c"};
    q.sizes = {100, 4096, 0};
    q.parents = {"", "a", ""};
    q.encode(w);
  };
  using mt = wire::message_type;
  std::string p = store_step(0, mt::mount, [](wire::writer& w) {
    wire::mount_request{"seg1", 1 << 16, 3, {{"k", 0, 100}}}.encode(w);
  });
  p += store_step(0, mt::put_start, puts);
  p += store_step(0, mt::put_end, keys({"a", "b", "zz"}, false, false));
  p += store_step(1, mt::get, keys({"a", "b", "c"}, false, false));
  p += store_step(0, mt::replicas, keys({"a", "c"}, false, false));
  p += store_step(1, mt::exists, keys({"a", "nope"}, false, false));
  p += store_step(0x21, mt::remove, keys({"a", "b"}, true, true));
  p += store_step(0, mt::stats, [](wire::writer&) {});
  put("store_wire", "mount_put_get_remove", p);

  // A segment announced in two frames: mounted closed with one object, then
  // an adopt with another that opens it; then a put into it.
  std::string a = store_step(0, mt::mount, [](wire::writer& w) {
    wire::mount_request{"seg1", 1 << 16, 3, {{"k1", 0, 100}}, false}.encode(w);
  });
  a += store_step(0, mt::adopt, [](wire::writer& w) {
    wire::adopt_request{1, {{"k2", 1024, 200}}, true}.encode(w);
  });
  a += store_step(0, mt::put_start, puts);
  a += store_step(1, mt::get, keys({"k1", "k2"}, false, false));
  put("store_wire", "mount_closed_adopt", a);

  std::string q = store_step(1, mt::put_start, puts);
  q += store_step(0, mt::put_end, keys({"a"}, false, false));  // not the writer
  q += store_step(1, mt::put_revoke, keys({"a", "b"}, false, false));
  q += store_step(0, mt::segment_info, [](wire::writer& w) { w.u64(1); });
  q += store_step(1, mt::unmount, [](wire::writer& w) { w.u64(1); });
  q += store_step(0xF0, mt::heartbeat, [](wire::writer&) {});
  q += store_step(0xE8, mt::remove_all, [](wire::writer& w) { w.u8(1); });
  put("store_wire", "writers_owners_liveness", q);

  // The SSD tier: a disk for client A, objects evicted to it (the pool
  // over its watermark), reports of every kind, a get of a disk-only
  // object (a load), removals (drops), the disk leaving, and a disk_task
  // sent by a client (refused).
  const auto report = [](std::vector<wire::disk_entries::entry> e) {
    return [e](wire::writer& w) { wire::disk_entries{e}.encode(w, true); };
  };
  std::string d = store_step(0, mt::disk_mount, [](wire::writer& w) {
    w.u64(1u << 30);
    w.u8(1);
  });
  d += store_step(0, mt::put_start, [](wire::writer& w) {
    wire::put_start_request q;
    q.keys = {"big", "small"};
    q.sizes = {60000, 100};
    q.parents = {"", ""};
    q.encode(w);
  });
  d += store_step(0xE0, mt::put_end, keys({"big", "small"}, false, false));
  d += store_step(0, mt::disk_report,
                  report({{2, "big", 60000, 1, 0, 0}, {2, "small", 100, 1, 60032, 0}}));
  d += store_step(0xE0, mt::disk_report, report({{1, "x", 300, 0, 0, 0}, {4, "gone", 1, 0, 0, 0}}));
  d += store_step(1, mt::get, keys({"x", "big"}, false, false));
  d += store_step(0, mt::disk_report, report({{3, "x", 300, 1, 0, 0}, {3, "big", 1, 1, 64, 7}}));
  d += store_step(1, mt::remove, keys({"x", "big"}, true, true));
  d += store_step(0, mt::disk_mount, [](wire::writer& w) {
    w.u64(1u << 30);
    w.u8(0);
  });
  d += store_step(0xE8, mt::disk_mount, [](wire::writer& w) {
    w.u64(0);
    w.u8(0);
  });
  d += store_step(1, mt::disk_task, report({}));
  put("store_wire", "disk_tier", d);

  std::string bad = store_step(0, mt::get, [](wire::writer& w) { w.u32(1000); });
  bad += store_step(0, static_cast<mt>(99), [](wire::writer&) {});
  bad += store_step(0, static_cast<mt>(0x8001), [](wire::writer&) {});
  put("store_wire", "malformed_and_unknown", bad);

  // A segment's memory with two objects and their records (one intact, one
  // whose bytes were written over), for the record scan.
  {
    std::string seg(1024, '\0');
    auto* base = reinterpret_cast<std::byte*>(seg.data());
    const auto object = [&](std::uint64_t at, std::string_view key, std::uint64_t size) {
      for (std::uint64_t i = 0; i < size; ++i) seg[at + i] = static_cast<char>('a' + i % 26);
      const auto crc = kvlink::crc32c(base + at, size);
      wire::encode_record(key, size, crc,
                          {base + at + wire::record_offset(size), wire::record_size(key.size())});
    };
    object(0, "intact", 100);
    object(320, "torn", 200);
    seg[330] = 'X';
    put("store_wire", "segment_records", seg);
  }

  // The start of an SSD tier file: its header block, an object's record
  // and a removal's (store/tier/disk_record.hpp).
  {
    namespace tier = kvlink::store::tier;
    std::string file(4 * 512, '\0');  // header, object head, its bytes, a removal
    auto* base = reinterpret_cast<std::byte*>(file.data());
    tier::encode_file_header(tier::disk_file_header{tier::disk_format_version, 512, 1, 77},
                             {base, 512});
    const std::string body(100, 'v');
    tier::encode_record_header(
        77,
        tier::disk_record{tier::disk_record_kind::object, "block/1", body.size(), 1,
                          kvlink::crc32c(body.data(), body.size())},
        {base + 512, 512});
    file.replace(1024, body.size(), body);
    tier::encode_record_header(
        77, tier::disk_record{tier::disk_record_kind::removal, "block/0", 0, 2, 0},
        {base + 1536, 512});
    put("store_wire", "disk_file", file);
  }

  wire::writer frame(mt::exists, 7, false);
  keys({"key1", "key2"}, false, false)(frame);
  put("store_wire", "whole_frame", frame.take());

  // The same input is also read as an HTTP request (the metadata server).
  put("store_wire", "http_metadata_put",
      "PUT /metadata?key=mooncake%2Fram%2Fh1 HTTP/1.1\r\nHost: m\r\nContent-Length: 7\r\n"
      "Authorization: Bearer t0ken\r\nExpect: 100-continue\r\n\r\n{\"a\":1}");
  put("store_wire", "http_metadata_get",
      "GET /metadata?key=seed HTTP/1.1\r\nauthorization: Bearer t0ken\r\n\r\n");
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_ROOT (test/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  root = argv[1];
  frames();
  control_stream();
  handshakes();
  descriptors();
  notifications();
  store_wire();
  std::printf("%d seed files written under %s\n", written, root.c_str());
  return 0;
}
