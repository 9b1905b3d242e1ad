// Tests for include/kvlink/store/master/service.hpp: the master's answer to
// one frame, its client registry and liveness, and its settings, without I/O.
#include <kvlink/core/instance.hpp>
#include <kvlink/store/master/service.hpp>

#include <chrono>
#include <set>
#include <string>
#include <vector>

#include "../../support/store_time.hpp"
#include <doctest/doctest.h>

using namespace std::chrono_literals;
using kvlink::errc;
using kvlink::store_errc;
namespace store = kvlink::store;
namespace wire = kvlink::store::wire;

namespace {

using kvlink_test::at;

struct answer {
  wire::frame_header header;
  std::string body;
  bool close = false;
};

answer handle(store::master_service& svc, store::session_state& s, std::uint16_t type,
              const std::string& body, std::int64_t now = 0) {
  wire::frame_header h;
  h.type = type;
  h.id = 42;
  h.body_length = static_cast<std::uint32_t>(body.size());
  answer a;
  const std::string bytes =
      svc.handle_frame(s, h,
                       std::span<const unsigned char>(
                           reinterpret_cast<const unsigned char*>(body.data()), body.size()),
                       at(now), a.close);
  REQUIRE(bytes.size() >= wire::header_size);
  wire::header_bytes hb{};
  std::copy_n(bytes.begin(), wire::header_size, hb.begin());
  REQUIRE(!wire::decode_header(hb, UINT32_MAX, a.header));
  a.body = bytes.substr(wire::header_size);
  CHECK(a.header.id == 42);
  CHECK(a.header.body_length == a.body.size());
  return a;
}

// The body of a request built by `fill` (its header dropped).
template <class F>
std::string body_of(F&& fill) {
  wire::writer w(wire::message_type::heartbeat, 0, false);
  fill(w);
  return w.take().substr(wire::header_size);
}

constexpr auto t_put_start = static_cast<std::uint16_t>(wire::message_type::put_start);
constexpr auto t_mount = static_cast<std::uint16_t>(wire::message_type::mount);
constexpr auto t_heartbeat = static_cast<std::uint16_t>(wire::message_type::heartbeat);

}  // namespace

TEST_CASE("master service: unknown types, replies and bad bodies") {
  store::master_service svc{{}, {}};
  auto att = svc.attach_client(kvlink::make_instance_id(), "h:1", at(0));
  CHECK_FALSE(att.known);

  auto a = handle(svc, att.session, 77, "");
  wire::reader r1(a.body);
  CHECK(r1.status() == errc::invalid_argument);
  CHECK_FALSE(a.close);

  a = handle(svc, att.session, t_heartbeat | wire::reply_bit, "");
  wire::reader r2(a.body);
  CHECK(r2.status() == errc::invalid_argument);

  a = handle(svc, att.session, t_heartbeat, "x");  // a heartbeat has no body
  wire::reader r3(a.body);
  CHECK(r3.status() == errc::malformed_message);
  CHECK(a.close);
}

TEST_CASE("master service: put_start takes replicas, pins and parents per key") {
  store::master_config cfg;
  store::master_service svc{cfg, {}};
  auto att = svc.attach_client(kvlink::make_instance_id(), "10.0.0.1:5", at(0));
  for (const char* name : {"s0", "s1"}) {
    const auto a = handle(svc, att.session, t_mount, body_of([&](wire::writer& w) {
                            wire::mount_request{name, 1 << 20, 0, {}}.encode(w);
                          }));
    wire::reader r(a.body);
    REQUIRE(!r.status());
  }
  const auto a = handle(svc, att.session, t_put_start, body_of([](wire::writer& w) {
                          wire::put_start_request req;
                          req.replicas = 2;
                          req.flags = wire::put_start_request::flag_hard_pin;
                          req.keys = {"parent", "child", "self"};
                          req.sizes = {100, 100, 100};
                          req.parents = {"", "parent", "self"};
                          req.encode(w);
                        }));
  wire::reader r(a.body);
  REQUIRE(!r.status());
  wire::placement_list pl;
  REQUIRE(!pl.decode(r, false));
  REQUIRE(pl.entries.size() == 3);
  CHECK(pl.entries[0].code == 0);
  CHECK(pl.entries[0].count == 2);
  CHECK(pl.entries[0].replicas[0].segment != pl.entries[0].replicas[1].segment);
  CHECK(pl.entries[1].code == 0);
  CHECK(pl.entries[2].code == static_cast<std::uint32_t>(store_errc::invalid_params));
  // Hard-pinned: a plain remove is refused.
  store::object_table& t = svc.objects();
  REQUIRE(!t.put_end("parent", att.session.client->id, at(0)));
  CHECK(t.remove("parent", at(1'000'000)) == store_errc::object_hard_pinned);
}

TEST_CASE("master service: a mount with objects takes them back; eviction waits for the rebuild") {
  store::master_config cfg;
  cfg.eviction_high_watermark = 50;
  store::server_options opt;
  opt.rebuild_grace = 5s;
  store::master_service svc{cfg, opt};
  auto att = svc.attach_client(kvlink::make_instance_id(), "10.0.0.1:5", at(0));
  // A segment of 64 KiB whose owner found three objects (48 KiB) and one
  // that overlaps another: the first three come back, the fourth does not.
  const auto a = handle(
      svc, att.session, t_mount, body_of([](wire::writer& w) {
        wire::mount_request{
            "s",
            64 << 10,
            0,
            {{"k1", 0, 16000}, {"k2", 16384, 16000}, {"k3", 32768, 16000}, {"k4", 8192, 100}}}
            .encode(w);
      }),
      1000);
  wire::reader r(a.body);
  REQUIRE(!r.status());
  (void)r.u64();
  wire::code_list taken;
  REQUIRE(!taken.decode(r));
  CHECK(taken.codes == std::vector<std::uint32_t>{
                           0, 0, 0, static_cast<std::uint32_t>(store_errc::invalid_params)});
  store::object_table& t = svc.objects();
  store::object_info info;
  REQUIRE(!t.get("k2", at(1000), info));
  CHECK(info.size == 16000);
  CHECK(info.replicas[0].offset == 16384);
  CHECK(t.get("k4", at(1000), info) == store_errc::object_not_found);
  // Above the watermark (75 %), but the pool is being rebuilt: nothing goes
  // until rebuild_grace after that mount.
  CHECK_FALSE(svc.evict(at(1000 + 4999)).ran);
  CHECK(t.stats().objects == 3);
  CHECK(svc.evict(at(1000 + 5000 + 20'000)).ran);  // past the reads' leases too
  for (int i = 0; i < 8 && t.stats().objects == 3; ++i) (void)svc.evict(at(26'000 + i));
  CHECK(t.stats().objects < 3);
}

TEST_CASE("master service: the SSD tier's messages and the tasks it sends") {
  store::master_config cfg;
  cfg.eviction_high_watermark = 50;
  store::master_service svc{cfg, {}};
  auto owner = svc.attach_client(kvlink::make_instance_id(), "10.0.0.1:5", at(0));
  auto other = svc.attach_client(kvlink::make_instance_id(), "10.0.0.2:5", at(0));
  const auto disk_mount = static_cast<std::uint16_t>(wire::message_type::disk_mount);
  const auto disk_report = static_cast<std::uint16_t>(wire::message_type::disk_report);
  const auto disk_task = static_cast<std::uint16_t>(wire::message_type::disk_task);
  auto a = handle(svc, owner.session, t_mount, body_of([](wire::writer& w) {
                    wire::mount_request{"s", 64 << 10, 0, {}}.encode(w);
                  }));
  wire::reader rm(a.body);
  REQUIRE(!rm.status());
  const std::uint64_t seg = rm.u64();
  a = handle(svc, owner.session, disk_mount, body_of([](wire::writer& w) {
               w.u64(1u << 30);
               w.u8(1);
             }));
  wire::reader r0(a.body);
  CHECK_FALSE(r0.status());
  CHECK(r0.finish() == std::error_code{});
  CHECK(svc.objects().has_disk(owner.session.client->id));
  // A client may not send tasks; a report's body is checked.
  a = handle(svc, other.session, disk_task, "");
  wire::reader r1(a.body);
  CHECK(r1.status() == errc::invalid_argument);
  a = handle(svc, other.session, disk_report, body_of([](wire::writer& w) {
               w.u32(1);
               w.u8(9);  // no such kind
             }));
  CHECK(a.close);
  // Its manifest: taken, except for a client without a disk.
  const auto manifest = body_of([](wire::writer& w) {
    wire::disk_entries{{{1, "m1", 1000, 0, 0, 0}, {1, "m2", 2000, 0, 0, 0}}}.encode(w, true);
  });
  a = handle(svc, owner.session, disk_report, manifest);
  wire::reader r2(a.body);
  REQUIRE(!r2.status());
  wire::code_list codes;
  REQUIRE(!codes.decode(r2));
  CHECK(codes.codes == std::vector<std::uint32_t>{0, 0});
  a = handle(svc, other.session, disk_report, manifest);
  wire::reader r3(a.body);
  REQUIRE(!r3.status());
  REQUIRE(!codes.decode(r3));
  CHECK(codes.codes ==
        std::vector<std::uint32_t>(2, static_cast<std::uint32_t>(store_errc::client_not_found)));
  // A get of a disk-only object answers object_loading and sends its
  // holder one load task in a disk_task frame.
  a = handle(svc, other.session, static_cast<std::uint16_t>(wire::message_type::get),
             body_of([](wire::writer& w) {
               wire::key_batch{false, {"m1"}}.encode(w, false);
             }));
  wire::reader r4(a.body);
  REQUIRE(!r4.status());
  wire::placement_list pl;
  REQUIRE(!pl.decode(r4, true));
  CHECK(pl.entries[0].code == static_cast<std::uint32_t>(store_errc::object_loading));
  auto frames = svc.take_disk_frames();
  REQUIRE(frames.size() == 1);
  CHECK(frames[0].client == owner.session.client->id);
  CHECK(frames[0].tasks.size() == 1);
  wire::header_bytes hb{};
  std::copy_n(frames[0].bytes.begin(), wire::header_size, hb.begin());
  wire::frame_header th;
  REQUIRE(!wire::decode_header(hb, UINT32_MAX, th));
  CHECK(th.kind() == wire::message_type::disk_task);
  CHECK_FALSE(th.is_reply());
  CHECK(th.id == 0);
  wire::reader rt(std::string_view(frames[0].bytes).substr(wire::header_size));
  wire::disk_entries tasks;
  REQUIRE(!tasks.decode(rt, false));
  REQUIRE(tasks.entries.size() == 1);
  CHECK(tasks.entries[0].kind == static_cast<std::uint8_t>(wire::disk_task_kind::load));
  CHECK(tasks.entries[0].key == "m1");
  CHECK(tasks.entries[0].size == 1000);
  CHECK(tasks.entries[0].segment == seg);
  // The load's report makes it readable.
  const std::string loaded_key(tasks.entries[0].key);
  const std::uint64_t loaded_at = tasks.entries[0].offset;
  a = handle(svc, owner.session, disk_report, body_of([&](wire::writer& w) {
               wire::disk_entries{{{3, loaded_key, 1000, seg, loaded_at, 0}}}.encode(w, true);
             }));
  wire::reader r5(a.body);
  REQUIRE(!r5.status());
  REQUIRE(!codes.decode(r5));
  CHECK(codes.codes == std::vector<std::uint32_t>{0});
  store::object_info info;
  CHECK_FALSE(svc.objects().get("m1", at(0), info));
  const std::string metrics = svc.metrics_text();
  CHECK(metrics.find("kvlink_store_disks 1\n") != std::string::npos);
  CHECK(metrics.find("kvlink_store_disk_replicas 2\n") != std::string::npos);
  CHECK(metrics.find("kvlink_store_disk_tasks_total{kind=\"load\"} 1\n") != std::string::npos);
  CHECK(metrics.find("kvlink_store_disk_reports_total{kind=\"adopt\"} 4\n") != std::string::npos);
  // A write failed there: read only. Its objects stay readable.
  a = handle(svc, owner.session, disk_mount, body_of([](wire::writer& w) {
               w.u64(1u << 30);
               w.u8(0);
             }));
  CHECK(svc.metrics_text().find("kvlink_store_disks_accepting 0\n") != std::string::npos);
  CHECK(svc.objects().get("m2", at(0), info) == store_errc::object_loading);
  CHECK(svc.take_disk_frames().size() == 1);  // its load
  a = handle(svc, owner.session, disk_mount, body_of([](wire::writer& w) {
               w.u64(1);
               w.u8(2);  // not a flag
             }));
  CHECK(a.close);
  // The disk leaves: "m2", on it only, goes with it.
  a = handle(svc, owner.session, disk_mount, body_of([](wire::writer& w) {
               w.u64(0);
               w.u8(0);
             }));
  CHECK(svc.objects().get("m2", at(0), info) == store_errc::object_not_found);
  CHECK_FALSE(svc.objects().get("m1", at(0), info));  // in memory still
}

TEST_CASE("master service: a segment announced over several frames stays closed until the last") {
  store::master_config cfg;
  store::master_service svc{cfg, {}};
  auto att = svc.attach_client(kvlink::make_instance_id(), "10.0.0.1:5", at(0));
  auto other = svc.attach_client(kvlink::make_instance_id(), "10.0.0.2:5", at(0));
  constexpr auto t_adopt = static_cast<std::uint16_t>(wire::message_type::adopt);
  const auto codes_of = [](const std::string& body, std::uint64_t* segment) {
    wire::reader r(body);
    REQUIRE(!r.status());
    if (segment != nullptr) *segment = r.u64();
    wire::code_list c;
    REQUIRE(!c.decode(r));
    return c.codes;
  };
  // 64 KiB, mounted closed with one object; k2 comes in an adopt frame.
  std::uint64_t seg = 0;
  auto a = handle(svc, att.session, t_mount, body_of([](wire::writer& w) {
                    wire::mount_request{"s", 64 << 10, 0, {{"k1", 0, 16000}}, false}.encode(w);
                  }));
  CHECK(codes_of(a.body, &seg) == std::vector<std::uint32_t>{0});
  store::object_table& t = svc.objects();
  CHECK_FALSE(t.segments().is_open(kvlink::segment_id{seg}));
  // Closed: nothing is placed in it meanwhile (no space anywhere).
  store::replica_list where;
  CHECK(t.put_start("new", 100, other.session.client->id, {}, at(1), where) ==
        store_errc::no_space);
  // Not its segment: refused.
  a = handle(svc, other.session, t_adopt, body_of([&](wire::writer& w) {
               wire::adopt_request{seg, {{"k9", 32768, 10}}, true}.encode(w);
             }));
  wire::reader rr(a.body);
  CHECK(rr.status() == store_errc::illegal_client);
  a = handle(svc, att.session, t_adopt, body_of([&](wire::writer& w) {
               wire::adopt_request{seg + 100, {}, true}.encode(w);
             }));
  wire::reader rn(a.body);
  CHECK(rn.status() == store_errc::segment_not_found);
  // The last frame: k2 back (k3 overlaps k1: refused), then the segment opens.
  a = handle(svc, att.session, t_adopt, body_of([&](wire::writer& w) {
               wire::adopt_request{seg, {{"k2", 16384, 16000}, {"k3", 100, 10}}, true}.encode(w);
             }));
  CHECK(codes_of(a.body, nullptr) ==
        std::vector<std::uint32_t>{0, static_cast<std::uint32_t>(store_errc::invalid_params)});
  CHECK(t.segments().is_open(kvlink::segment_id{seg}));
  store::object_info info;
  REQUIRE(!t.get("k1", at(2), info));
  REQUIRE(!t.get("k2", at(2), info));
  CHECK(info.replicas[0].offset == 16384);
  CHECK(t.get("k3", at(2), info) == store_errc::object_not_found);
  REQUIRE(!t.put_start("new", 100, other.session.client->id, {}, at(3), where));
  {  // never over the objects taken back
    const auto foot = kvlink::store::wire::object_footprint(16000, 2);
    const auto a0 = where[0].offset;
    const auto a1 = a0 + kvlink::store::wire::object_footprint(100, 3);
    CHECK(a0 >= foot);
    CHECK((a1 <= 16384 || a0 >= 16384 + foot));
  }
  // Open now: a late adopt could land on space handed out meanwhile.
  a = handle(svc, att.session, t_adopt, body_of([&](wire::writer& w) {
               wire::adopt_request{seg, {{"k4", 49152, 10}}, true}.encode(w);
             }));
  wire::reader ro(a.body);
  CHECK(ro.status() == store_errc::invalid_params);
  // A flag byte other than 0 or 1 does not decode.
  std::string bad = body_of([&](wire::writer& w) { wire::adopt_request{seg, {}, true}.encode(w); });
  bad.back() = 2;
  a = handle(svc, att.session, t_adopt, bad);
  wire::reader rb(a.body);
  CHECK(rb.status() == errc::malformed_message);
}

TEST_CASE("master service: a client without an address mounts nothing") {
  store::master_service svc{{}, {}};
  auto att = svc.attach_client(kvlink::make_instance_id(), "", at(0));
  const auto a = handle(svc, att.session, t_mount, body_of([](wire::writer& w) {
                          wire::mount_request{"s", 1 << 20, 0, {}}.encode(w);
                        }));
  wire::reader r(a.body);
  CHECK(r.status() == store_errc::invalid_params);
}

TEST_CASE("master service: liveness on made-up time") {
  store::server_options opt;
  opt.suspect_after = 100ms;
  opt.liveness_timeout = 300ms;
  store::master_service svc{{}, opt};
  const auto inst = kvlink::make_instance_id();
  auto att = svc.attach_client(inst, "h:1", at(0));
  const auto id = att.session.client->id;
  {
    const auto a = handle(svc, att.session, t_mount, body_of([](wire::writer& w) {
                            wire::mount_request{"s", 1 << 20, 0, {}}.encode(w);
                          }));
    wire::reader r(a.body);
    REQUIRE(!r.status());
  }
  CHECK(svc.check_liveness(at(50)).suspected == 0);
  CHECK(svc.check_liveness(at(150)).suspected == 1);
  CHECK(svc.check_liveness(at(200)).suspected == 0);  // logged once
  CHECK(svc.client_counts() == std::pair<std::size_t, std::size_t>{1, 1});
  // Any frame refreshes it.
  auto hb = handle(svc, att.session, t_heartbeat, "", 250);
  wire::reader r1(hb.body);
  REQUIRE(!r1.status());
  CHECK(r1.u8() == 1);
  CHECK(svc.check_liveness(at(300)).gone == 0);
  CHECK(svc.client_counts() == std::pair<std::size_t, std::size_t>{1, 0});
  CHECK(svc.check_liveness(at(600)).gone == 1);
  CHECK(svc.objects().stats().segments == 0);
  // Its connection speaks again: taken back unknown, same id.
  hb = handle(svc, att.session, t_heartbeat, "", 700);
  wire::reader r2(hb.body);
  REQUIRE(!r2.status());
  CHECK(r2.u8() == 0);
  svc.detach_client(att.session);
  auto again = svc.attach_client(inst, "h:1", at(710));
  CHECK(again.known);
  CHECK(again.session.client->id == id);
}

TEST_CASE("master service: every setting has a unique name and environment variable") {
  const auto table = store::master_server_setting_table();
  std::set<std::string> names, envs;
  for (const auto& s : table) {
    CHECK(names.insert(std::string(s.name)).second);
    CHECK(envs.insert(std::string(s.env)).second);
    CHECK(std::string(s.env).rfind("KVLINK_STORE_", 0) == 0);
  }
  store::master_server_config c;
  std::string what;
  CHECK(!kvlink::apply_json<store::master_server_config>(
      table, nlohmann::json{{"store_listen", "127.0.0.1:1"}, {"store_liveness_timeout", "20s"}}, c,
      &what));
  CHECK(c.server.listen == "127.0.0.1:1");
  CHECK(c.server.liveness_timeout == 20000ms);
  CHECK(!c.server.validate());
  c.server.suspect_after = 30s;
  CHECK(c.server.validate(&what));
  CHECK(what.find("store_liveness_timeout") != std::string::npos);
}

TEST_CASE("server_options: election settings are checked, each named in its error") {
  store::server_options o;
  o.listen = "127.0.0.1:0";
  std::string what;
  o.ha_etcd = "etcd://127.0.0.1:2379,127.0.0.1:2380";
  CHECK(!o.validate());
  o.ha_etcd = "127.0.0.1:2379;http://127.0.0.1:2380";  // mooncake_master's --etcd_endpoints
  CHECK(!o.validate());
  o.ha_etcd = "etcd://nohostport";
  CHECK(o.validate(&what));
  CHECK(what.find("store_ha_etcd") != std::string::npos);
  o.ha_etcd = "127.0.0.1:2379";
  o.ha_cluster = "a/b";
  CHECK(o.validate(&what));
  CHECK(what.find("store_ha_cluster") != std::string::npos);
  o.ha_cluster = "prod";
  o.ha_leader_ttl = 500ms;
  CHECK(o.validate(&what));
  CHECK(what.find("store_ha_leader_ttl") != std::string::npos);
  o.ha_leader_ttl = 2s;
  o.ha_advertise = "10.0.0.1";  // no port
  CHECK(o.validate(&what));
  CHECK(what.find("store_ha_advertise") != std::string::npos);
  o.ha_advertise = "10.0.0.1:50051";
  CHECK(!o.validate());
  // Without store_ha_etcd the others are not looked at.
  o.ha_etcd.clear();
  o.ha_cluster.clear();
  CHECK(!o.validate());
}
