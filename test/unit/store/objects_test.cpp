// Tests for include/kvlink/store/master/objects.hpp (and segments.hpp): the
// master's object table with an injected clock.
#include <kvlink/store/master/objects.hpp>

#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "../../support/store_time.hpp"
#include <doctest/doctest.h>

using kvlink::segment_id;
using kvlink::store_errc;
using namespace kvlink::store;
using std::chrono::milliseconds;

namespace {

using kvlink_test::at;

constexpr std::uint64_t kib = 1024;

segment_id mount(object_table& t, std::uint64_t client, std::string name, std::uint64_t size,
                 std::string host = "") {
  segment_id id;
  REQUIRE_FALSE(t.mount_segment({client, std::move(name), size, std::move(host)}, id));
  REQUIRE(id.valid());
  return id;
}

// A put from start to end.
void put(object_table& t, std::string_view key, std::uint64_t size, master_time now,
         const put_options& opt = {}, std::uint64_t writer = 7) {
  replica_list where;
  REQUIRE_FALSE(t.put_start(key, size, writer, opt, now, where));
  REQUIRE_FALSE(t.put_end(key, writer, now));
}

}  // namespace

TEST_CASE("object_table: the per-object record stays compact") {
  CHECK(sizeof(kvlink::store::detail::object_meta) <= 64);
}

TEST_CASE("object_table: segments are mounted and refused as they should") {
  object_table t;
  segment_id id;
  CHECK(t.mount_segment({0, "a", 1 << 20, ""}, id) == store_errc::invalid_params);
  CHECK(t.mount_segment({1, "a", 10, ""}, id) == store_errc::invalid_params);
  const segment_id a = mount(t, 1, "a", 1 << 20);
  CHECK(t.mount_segment({1, "a", 1 << 20, ""}, id) == store_errc::segment_already_exists);
  const segment_id b = mount(t, 2, "a", 1 << 20);  // another client may use the name
  CHECK(a != b);
  CHECK(t.stats().capacity == 2u << 20);
  CHECK(t.stats().segments == 2);
  CHECK(t.unmount_segment(segment_id{999}) == store_errc::segment_not_found);
  CHECK_FALSE(t.unmount_segment(a));
  CHECK(t.unmount_segment(a) == store_errc::segment_not_found);
  CHECK(t.stats().capacity == 1u << 20);
  const segment_id c = mount(t, 1, "a", 1 << 20);  // the name is free again; ids are new
  CHECK(c != a);
  CHECK(t.unmount_client(1) == 1);
  CHECK(t.segments().segments_of(2) == std::vector<segment_id>{b});
}

TEST_CASE("object_table: put_start checks its arguments") {
  object_table t;
  replica_list w;
  CHECK(t.put_start("k", 100, 7, {}, at(0), w) == store_errc::no_space);  // no segment yet
  mount(t, 1, "s", 64 * kib);
  CHECK(t.put_start("", 100, 7, {}, at(0), w) == store_errc::invalid_key);
  CHECK(t.put_start(std::string(4097, 'k'), 100, 7, {}, at(0), w) == store_errc::invalid_key);
  CHECK(t.put_start("k", 0, 7, {}, at(0), w) == store_errc::invalid_params);
  CHECK(t.put_start("k", 64 * kib + 1, 7, {}, at(0), w) == store_errc::invalid_params);
  CHECK(t.put_start("k", 100, 0, {}, at(0), w) == store_errc::invalid_params);
  CHECK(t.put_start("k", 100, 7, {.replicas = 0}, at(0), w) == store_errc::invalid_params);
  CHECK(t.put_start("k", 100, 7, {.replicas = 9}, at(0), w) == store_errc::invalid_params);
  CHECK(t.put_start("k", 100, 7, {.parent = "k"}, at(0), w) == store_errc::invalid_params);
  CHECK(t.put_start("k", 100, 7, {.parent = std::string(5000, 'p')}, at(0), w) ==
        store_errc::invalid_key);
  CHECK(t.stats().objects == 0);
  CHECK(t.stats().used == 0);
  // The longest key and the largest object (with its record) are fine.
  const std::uint64_t largest = 64 * kib - wire::record_size(4096);
  CHECK(t.put_start(std::string(4096, 'k'), largest + 1, 7, {}, at(0), w) ==
        store_errc::invalid_params);
  CHECK_FALSE(t.put_start(std::string(4096, 'k'), largest, 7, {}, at(0), w));
  CHECK(w.size() == 1);
  object_info info;
  CHECK(t.get("x", at(0), info) == store_errc::object_not_found);
  CHECK(t.get("", at(0), info) == store_errc::invalid_key);
}

TEST_CASE("object_table: first writer wins; a put is invisible until it ends") {
  object_table t;
  const segment_id s = mount(t, 1, "s", 1 << 20);
  replica_list w;
  REQUIRE_FALSE(t.put_start("k", 1000, 7, {}, at(0), w));
  REQUIRE(w.size() == 1);
  CHECK(w[0].segment == s);
  CHECK(w[0].length == 1000);
  CHECK(w[0].status == replica_status::processing);
  CHECK(t.stats().used == 1024 + 64);  // rounded to the 64-byte alignment, and its record
  CHECK(t.stats().in_progress == 1);
  replica_list w2;
  CHECK(t.put_start("k", 1000, 8, {}, at(10), w2) == store_errc::object_in_progress);
  CHECK(w2.empty());
  object_info info;
  CHECK(t.get("k", at(10), info) == store_errc::object_in_progress);
  CHECK(t.exists("k", at(10)) == store_errc::object_in_progress);
  CHECK(t.put_end("k", 8, at(20)) == store_errc::illegal_client);
  CHECK(t.put_revoke("k", 8, at(20)) == store_errc::illegal_client);
  CHECK(t.put_end("nope", 7, at(20)) == store_errc::object_not_found);
  REQUIRE_FALSE(t.put_end("k", 7, at(20)));
  CHECK_FALSE(t.put_end("k", 7, at(21)));  // ending twice is harmless
  CHECK(t.stats().in_progress == 0);
  CHECK(t.put_start("k", 1000, 8, {}, at(30), w2) == store_errc::object_already_exists);
  CHECK(t.put_start("k", 1000, 7, {}, at(30), w2) == store_errc::object_already_exists);
  CHECK(t.put_revoke("k", 7, at(30)) == store_errc::object_already_exists);
  REQUIRE_FALSE(t.get("k", at(40), info));
  CHECK(info.size == 1000);
  CHECK(info.lease_until == at(40 + 10'000));
  REQUIRE(info.replicas.size() == 1);
  CHECK(info.replicas[0].segment == w[0].segment);
  CHECK(info.replicas[0].offset == w[0].offset);
  CHECK(info.replicas[0].status == replica_status::complete);
  CHECK_FALSE(t.exists("k", at(40)));
  CHECK(t.stats().objects == 1);
}

TEST_CASE("object_table: put_revoke frees the space at once") {
  object_table t;
  mount(t, 1, "s", 4 * kib);
  replica_list w;
  REQUIRE_FALSE(t.put_start("a", 4 * kib - 64, 7, {}, at(0), w));  // with its record: 4 KiB
  CHECK(t.put_start("b", 1, 7, {}, at(0), w) == store_errc::no_space);
  REQUIRE_FALSE(t.put_revoke("a", 7, at(1)));
  CHECK(t.stats().used == 0);
  CHECK(t.stats().objects == 0);
  CHECK(t.put_revoke("a", 7, at(1)) == store_errc::object_not_found);
  CHECK_FALSE(t.put_start("b", 4 * kib - 64, 7, {}, at(2), w));
}

TEST_CASE("object_table: leases hold off removal until they run out") {
  object_table t;
  mount(t, 1, "s", 1 << 20);
  put(t, "k", 100, at(0));
  CHECK_FALSE(t.remove("k", at(1)));  // no read yet: no lease
  put(t, "k", 100, at(2));
  object_info info;
  REQUIRE_FALSE(t.get("k", at(1000), info));
  CHECK(t.remove("k", at(5000)) == store_errc::object_has_lease);
  REQUIRE_FALSE(t.get("k", at(6000), info));  // extends the lease
  CHECK(info.lease_until == at(16'000));
  REQUIRE_FALSE(t.get("k", at(100), info));  // never shortens it
  CHECK(info.lease_until == at(16'000));
  CHECK(t.remove("k", at(15'999)) == store_errc::object_has_lease);
  CHECK_FALSE(t.remove("k", at(16'000)));
  CHECK(t.remove("k", at(16'000)) == store_errc::object_not_found);
  // Forced, it goes at once.
  put(t, "k", 100, at(20'000));
  REQUIRE_FALSE(t.get("k", at(20'000), info));
  CHECK_FALSE(t.remove("k", at(20'001), true));
  CHECK(t.stats().used == 0);
}

TEST_CASE("object_table: exists grants a lease when configured to") {
  master_config with;
  master_config without;
  without.lease_on_exists = false;
  for (const bool lease : {true, false}) {
    object_table t{lease ? with : without};
    mount(t, 1, "s", 1 << 20);
    put(t, "k", 100, at(0));
    CHECK_FALSE(t.exists("k", at(10)));
    CHECK((t.remove("k", at(20)) == store_errc::object_has_lease) == lease);
  }
}

TEST_CASE("object_table: batch exists gives per-key results in input order") {
  object_table t;
  mount(t, 1, "s", 1 << 20);
  put(t, "a", 100, at(0));
  replica_list w;
  REQUIRE_FALSE(t.put_start("p", 100, 7, {}, at(0), w));
  const std::vector<std::string_view> keys{"a", "missing", "", "p", "a"};
  std::vector<std::int32_t> out(keys.size(), 99);
  t.exists(keys, at(1), out);
  CHECK(out == std::vector<std::int32_t>{1, 0, -400, 0, 1});
}

TEST_CASE("object_table: pins") {
  object_table t;
  mount(t, 1, "s", 1 << 20);
  put(t, "h", 100, at(0), {.hard_pin = true});
  CHECK(t.remove("h", at(1)) == store_errc::object_hard_pinned);
  CHECK(kvlink::mooncake_code(store_errc::object_hard_pinned) == -706);
  CHECK(t.remove_all(at(1)) == 0);
  CHECK_FALSE(t.remove("h", at(1), true));
  // A soft pin does not stop removal (only eviction).
  put(t, "s", 100, at(0), {.soft_pin = true});
  CHECK_FALSE(t.remove("s", at(1)));
}

TEST_CASE("object_table: remove and remove_all") {
  object_table t;
  mount(t, 1, "s", 1 << 20);
  for (int i = 0; i < 10; ++i) put(t, std::string("k").append(std::to_string(i)), 100, at(0));
  replica_list w;
  REQUIRE_FALSE(t.put_start("inprog", 100, 7, {}, at(0), w));
  object_info info;
  REQUIRE_FALSE(t.get("k0", at(0), info));
  CHECK(t.remove("inprog", at(1)) == store_errc::object_in_progress);
  CHECK(t.remove("", at(1)) == store_errc::invalid_key);
  CHECK(t.remove_all(at(1)) == 9);  // k0 is leased, inprog in progress
  CHECK(t.stats().objects == 2);
  CHECK(t.remove_all(at(1), true) == 1);  // forced: the lease too, never a put in progress
  CHECK(t.stats().objects == 1);
  // A forced remove of a put in progress discards it: its space waits.
  CHECK_FALSE(t.remove("inprog", at(2), true));
  CHECK(t.stats().objects == 0);
  CHECK(t.stats().used == 128 + 64);  // its record's too
  CHECK(t.stats().reserved == 128 + 64);
  CHECK(t.put_end("inprog", 7, at(3)) == store_errc::object_not_found);
  CHECK(t.reclaim(at(599'999)).released == 0);
  CHECK(t.reclaim(at(600'000)).released == 1);
  CHECK(t.stats().used == 0);
  CHECK(t.stats().reserved == 0);
}

TEST_CASE("object_table: puts that never end are discarded at 30 s, released at 10 min") {
  object_table t;
  mount(t, 1, "s", 1 << 20);
  replica_list w;
  REQUIRE_FALSE(t.put_start("a", 1000, 7, {}, at(0), w));
  REQUIRE_FALSE(t.put_start("b", 1000, 7, {}, at(5'000), w));
  auto r = t.reclaim(at(29'999));
  CHECK(r.discarded == 0);
  r = t.reclaim(at(30'000));
  CHECK(r.discarded == 1);  // a, not b
  CHECK(t.stats().objects == 1);
  const std::uint64_t each = wire::object_footprint(1000, 1);  // 1088: its record too
  CHECK(t.stats().used == 2 * each);                           // a's space is still reserved
  CHECK(t.put_end("a", 7, at(30'001)) == store_errc::object_not_found);
  // The key is free again for anyone.
  CHECK_FALSE(t.put_start("a", 1000, 8, {}, at(30'002), w));
  CHECK(t.stats().used == 3 * each);
  // A second put of a key whose put went stale preempts it.
  CHECK(t.put_start("b", 1000, 8, {}, at(34'999), w) == store_errc::object_in_progress);
  REQUIRE_FALSE(t.put_start("b", 1000, 8, {}, at(35'000), w));
  CHECK(t.put_end("b", 7, at(35'001)) == store_errc::illegal_client);
  CHECK_FALSE(t.put_end("b", 8, at(35'001)));
  CHECK(t.stats().reserved == 2 * each);
  // a's first put released, b's first not yet; the new a (30.002 s) discarded.
  r = t.reclaim(at(600'000));
  CHECK(r.released == 1);
  CHECK(r.released_bytes == each);
  CHECK(r.discarded == 1);
  r = t.reclaim(at(605'000));  // b's first released
  CHECK(r.released == 1);
  CHECK(r.discarded == 0);
  CHECK(t.stats().reserved == each);
  CHECK(t.reclaim(at(630'001)).released == 0);
  CHECK(t.reclaim(at(630'002)).released == 1);
  CHECK(t.stats().reserved == 0);
  CHECK(t.stats().used == each);  // b
}

TEST_CASE("object_table: replicas go to distinct segments, preferred and same host first") {
  object_table t;
  const segment_id a = mount(t, 1, "a", 1 << 20, "h1");
  const segment_id b = mount(t, 2, "b", 1 << 20, "h2");
  const segment_id c = mount(t, 3, "c", 1 << 20, "h2");
  for (int i = 0; i < 50; ++i) {
    replica_list w;
    REQUIRE_FALSE(
        t.put_start(std::string("k").append(std::to_string(i)), 100, 7, {.replicas = 3}, at(0), w));
    REQUIRE(w.size() == 3);
    std::set<segment_id> distinct;
    for (const auto& r : w) distinct.insert(r.segment);
    CHECK(distinct.size() == 3);
  }
  // More replicas than segments: best effort, still distinct.
  replica_list w;
  REQUIRE_FALSE(t.put_start("five", 100, 7, {.replicas = 5}, at(0), w));
  CHECK(w.size() == 3);
  // Preferred segments first, in order.
  const std::vector<segment_id> pref{c, a};
  REQUIRE_FALSE(t.put_start("pref", 100, 7, {.replicas = 2, .preferred = pref}, at(0), w));
  REQUIRE(w.size() == 2);
  CHECK(w[0].segment == c);
  CHECK(w[1].segment == a);
  // The writer's host next.
  for (int i = 0; i < 20; ++i) {
    REQUIRE_FALSE(t.put_start(std::string("h").append(std::to_string(i)), 100, 7,
                              {.replicas = 2, .host = "h2"}, at(0), w));
    REQUIRE(w.size() == 2);
    CHECK((w[0].segment == b || w[0].segment == c));
    CHECK((w[1].segment == b || w[1].segment == c));
  }
  for (int i = 0; i < 20; ++i) {
    REQUIRE_FALSE(t.put_start(std::string("host1-").append(std::to_string(i)), 100, 7,
                              {.host = "h1"}, at(0), w));
    CHECK(w[0].segment == a);
  }
  // A preferred segment that is full or unknown is passed over.
  const std::vector<segment_id> unknown{segment_id{12345}};
  REQUIRE_FALSE(t.put_start("u", 100, 7, {.preferred = unknown}, at(0), w));
  CHECK(w.size() == 1);
}

TEST_CASE("object_table: random placement spreads, most_free fills the emptiest first") {
  {
    object_table t;
    std::vector<segment_id> segs;
    for (int i = 0; i < 4; ++i)
      segs.push_back(mount(t, 1, std::string("s").append(std::to_string(i)), 1 << 20));
    std::set<segment_id> used;
    for (int i = 0; i < 64; ++i) {
      replica_list w;
      REQUIRE_FALSE(t.put_start(std::string("k").append(std::to_string(i)), 100, 7, {}, at(0), w));
      used.insert(w[0].segment);
    }
    CHECK(used.size() == 4);
  }
  {
    master_config cfg;
    cfg.placement = "most_free";
    object_table t{cfg};
    const segment_id small = mount(t, 1, "small", 64 * kib);
    const segment_id big = mount(t, 1, "big", 256 * kib);
    replica_list w;
    // The big one until both have the same free bytes, then alternating.
    for (int i = 0; i < 48; ++i) {
      REQUIRE_FALSE(
          t.put_start(std::string("k").append(std::to_string(i)), 4 * kib - 64, 7, {}, at(0), w));
      CHECK(w[0].segment == big);
    }
    const auto st = t.segments().stats();
    REQUIRE(st.size() == 2);
    for (const auto& s : st) CHECK(s.capacity - s.used == 64 * kib);
    (void)small;
  }
  master_config bad;
  bad.placement = "nearest";
  CHECK_THROWS_AS(object_table{bad}, std::invalid_argument);
}

TEST_CASE("object_table: unmount drops its replicas; objects with none left disappear") {
  object_table t;
  const segment_id a = mount(t, 1, "a", 1 << 20);
  const segment_id b = mount(t, 2, "b", 1 << 20);
  const std::vector<segment_id> ab{a, b};
  put(t, "both", 100, at(0), {.replicas = 2, .preferred = ab});
  put(t, "only_a", 100, at(0), {.preferred = ab});
  replica_list w;
  REQUIRE_FALSE(t.put_start("writing_a", 100, 7, {.preferred = ab}, at(0), w));
  REQUIRE(w[0].segment == a);
  unmount_report r;
  REQUIRE_FALSE(t.unmount_segment(a, &r));
  CHECK(r.replicas_dropped == 3);
  CHECK(r.objects_lost == 2);
  object_info info;
  CHECK(t.get("only_a", at(1), info) == store_errc::object_not_found);
  CHECK(t.put_end("writing_a", 7, at(1)) == store_errc::object_not_found);
  REQUIRE_FALSE(t.get("both", at(1), info));
  REQUIRE(info.replicas.size() == 1);
  CHECK(info.replicas[0].segment == b);
  CHECK(t.stats().objects == 1);
  CHECK(t.stats().capacity == 1u << 20);
  CHECK(t.stats().used == 128 + 64);
  // The survivor is removed from b's allocator as usual.
  CHECK_FALSE(t.remove("both", at(20'000)));
  CHECK(t.stats().used == 0);
  CHECK(t.unmount_client(2) == 1);
  CHECK(t.stats().capacity == 0);
}

TEST_CASE("object_table: objects a segment's owner announces after a restart come back") {
  object_table t;
  segment_id a;
  // Mounted closed: nothing is allocated in it before the objects are back.
  REQUIRE_FALSE(t.mount_segment({1, "a", 1 << 20, ""}, a, false));
  replica_list w;
  CHECK(t.put_start("new", 100, 7, {}, at(0), w) == store_errc::no_space);
  CHECK_FALSE(t.adopt(a, "k1", 0, 1000));
  CHECK_FALSE(t.adopt(a, "k2", 4096, 4096));
  // Ranges that are not free or not aligned, sizes and keys out of bounds.
  CHECK(t.adopt(a, "k3", 512, 100) == store_errc::invalid_params);     // inside k1's
  CHECK(t.adopt(a, "k3", 4100, 10) == store_errc::invalid_params);     // not aligned
  CHECK(t.adopt(a, "k3", 1 << 20, 10) == store_errc::invalid_params);  // past the end
  CHECK(t.adopt(a, "k3", 8192, 0) == store_errc::invalid_params);
  CHECK(t.adopt(a, "", 8192, 10) == store_errc::invalid_key);
  CHECK(t.adopt(segment_id{99}, "k3", 0, 10) == store_errc::segment_not_found);
  t.segments().open(a);
  object_info info;
  REQUIRE_FALSE(t.get("k1", at(0), info));
  CHECK(info.size == 1000);
  REQUIRE(info.replicas.size() == 1);
  CHECK(info.replicas[0].segment == a);
  CHECK(info.replicas[0].offset == 0);
  CHECK(t.stats().objects == 2);
  CHECK(t.stats().used == wire::object_footprint(1000, 2) + wire::object_footprint(4096, 2));
  // First writer wins: a put of an announced key is refused, and puts land
  // around the announced ranges.
  CHECK(t.put_start("k1", 10, 7, {}, at(0), w) == store_errc::object_already_exists);
  REQUIRE_FALSE(t.put_start("new", 100, 7, {}, at(0), w));
  CHECK((w[0].offset >= 4096 + wire::object_footprint(4096, 2) ||
         w[0].offset + wire::object_footprint(100, 3) <= 4096));
  CHECK(w[0].offset >= wire::object_footprint(1000, 2));

  // The same object from a second owner: a second replica. Another size, or
  // a key whose put is in progress: refused.
  const segment_id b = mount(t, 2, "b", 1 << 20);
  CHECK_FALSE(t.adopt(b, "k1", 8192, 1000));
  REQUIRE_FALSE(t.get("k1", at(0), info));
  REQUIRE(info.replicas.size() == 2);
  CHECK(info.replicas[1].segment == b);
  CHECK(info.replicas[1].offset == 8192);
  CHECK(t.adopt(b, "k1", 16384, 1000) == store_errc::object_already_exists);  // same segment
  CHECK(t.adopt(b, "k2", 16384, 999) == store_errc::object_already_exists);
  CHECK(t.adopt(b, "new", 16384, 100) == store_errc::object_already_exists);
  CHECK(t.stats().objects == 3);
  // Removing it frees both replicas' ranges, records included.
  const auto used = t.stats().used;
  CHECK_FALSE(t.remove("k1", at(100'000)));
  CHECK(t.stats().used == used - 2 * wire::object_footprint(1000, 2));
  // The owner of a's segment gone: k2 goes with it.
  CHECK_FALSE(t.unmount_segment(a));
  CHECK(t.get("k2", at(0), info) == store_errc::object_not_found);
}

TEST_CASE("object_table: without object records an object takes its own bytes only") {
  master_config cfg;
  cfg.object_records = false;
  object_table t{cfg};
  mount(t, 1, "s", 4 * kib);
  replica_list w;
  REQUIRE_FALSE(t.put_start("a", 4 * kib, 7, {}, at(0), w));  // the whole segment
  CHECK(t.stats().used == 4 * kib);
  CHECK(t.put_start("b", 1, 7, {}, at(0), w) == store_errc::no_space);
  REQUIRE_FALSE(t.put_end("a", 7, at(0)));
  CHECK_FALSE(t.remove("a", at(0)));
  CHECK(t.stats().used == 0);
}

// ---- the SSD tier: replicas on clients' disks -------------------------

namespace {

// Two CLOCK turns over every shard, evicting whatever may go.
evict_step evict_everything(object_table& t, master_time now) {
  evict_step sum;
  for (int turn = 0; turn < 2; ++turn) {
    for (std::size_t s = 0; s < shard_count; ++s) {
      const evict_step st = t.evict_from_shard(s, now, 1u << 20, UINT64_MAX, false);
      sum.freed += st.freed;
      sum.evicted += st.evicted;
      sum.demoting += st.demoting;
      sum.demoted += st.demoted;
    }
  }
  return sum;
}

std::vector<disk_task> tasks_of(object_table& t) {
  std::vector<disk_task> out;
  t.take_disk_tasks(out);
  return out;
}

}  // namespace

TEST_CASE("object_table: eviction sends objects to a disk, a get loads them back") {
  object_table t;
  const segment_id seg = mount(t, 1, "s", 1 << 20);
  t.mount_disk(1, 1 << 30);
  CHECK(t.has_disk(1));
  CHECK(t.stats().disks == 1);
  put(t, "a", 1000, at(0));
  put(t, "b", 2000, at(0));
  object_info where_a;
  REQUIRE_FALSE(t.describe("a", where_a));
  const std::uint64_t used = t.stats().used;

  // First round: both go to client 1's disk; nothing is freed yet and both
  // stay readable from memory.
  const evict_step first = evict_everything(t, at(100));
  CHECK(first.demoted == 2);
  CHECK(first.freed == 0);
  CHECK(first.demoting > 0);
  CHECK(t.stats().used == used);
  auto tasks = tasks_of(t);
  REQUIRE(tasks.size() == 2);
  for (const auto& task : tasks) {
    CHECK(task.what == disk_task::kind::store);
    CHECK(task.client == 1);
    CHECK(task.segment == seg.value());
    CHECK(task.size == (task.key == "a" ? 1000u : 2000u));
  }
  object_info info;
  CHECK_FALSE(t.get("a", at(100), info));
  CHECK(evict_everything(t, at(20'000)).demoted == 0);  // under way: not again
  CHECK(tasks_of(t).empty());

  // Reports: a mismatched one is refused, the real ones land.
  CHECK(t.disk_stored("a", 2, seg.value(), where_a.replicas[0].offset, true) ==
        store_errc::object_not_found);
  CHECK(t.disk_stored("a", 1, seg.value(), where_a.replicas[0].offset + 64, true) ==
        store_errc::object_not_found);
  for (const auto& task : tasks) {
    CHECK_FALSE(t.disk_stored(task.key, 1, task.segment, task.offset, true));
  }
  CHECK(t.disk_stored("a", 1, seg.value(), where_a.replicas[0].offset, true) ==
        store_errc::object_not_found);  // once
  CHECK(t.stats().disk_replicas == 2);
  REQUIRE_FALSE(t.describe("a", info));
  CHECK(info.replicas.size() == 1);  // readers see memory replicas only

  // Second round: memory freed, the objects stay on the disk.
  const evict_step second = evict_everything(t, at(30'000));
  CHECK(second.evicted == 2);
  CHECK(second.demoted == 0);
  CHECK(t.stats().used == 0);
  CHECK(t.stats().objects == 2);
  CHECK_FALSE(t.exists("a", at(30'000)));
  REQUIRE_FALSE(t.describe("a", info));
  CHECK(info.size == 1000);
  CHECK(info.replicas.empty());

  // A get starts a load into the holder's segment; readers wait for it.
  CHECK(t.get("a", at(31'000), info) == store_errc::object_loading);
  tasks = tasks_of(t);
  REQUIRE(tasks.size() == 1);
  CHECK(tasks[0].what == disk_task::kind::load);
  CHECK(tasks[0].client == 1);
  CHECK(tasks[0].key == "a");
  CHECK(tasks[0].size == 1000);
  CHECK(tasks[0].segment == seg.value());
  CHECK(t.get("a", at(31'001), info) == store_errc::object_loading);
  CHECK(tasks_of(t).empty());  // one load at a time
  CHECK(t.stats().used > 0);
  CHECK(t.disk_loaded("a", 2, tasks[0].segment, tasks[0].offset, true, at(31'001)) ==
        store_errc::object_not_found);
  CHECK_FALSE(t.disk_loaded("a", 1, tasks[0].segment, tasks[0].offset, true, at(31'001)));
  // Loaded under a read lease: eviction leaves it for the reader's next ask
  // (without it, a pool evicting hard pushed it out again first).
  CHECK(evict_everything(t, at(31'002)).evicted == 0);
  REQUIRE_FALSE(t.get("a", at(31'002), info));
  REQUIRE(info.replicas.size() == 1);
  CHECK(info.replicas[0].offset == tasks[0].offset);
  CHECK(info.size == 1000);

  // On the disk still: the next eviction frees its memory without a store.
  CHECK(evict_everything(t, at(60'000)).evicted == 1);
  CHECK(tasks_of(t).empty());
  CHECK(t.stats().used == 0);

  // remove deletes the disk copies.
  CHECK_FALSE(t.remove("a", at(60'000)));
  CHECK(t.remove_all(at(60'000)) == 1);
  tasks = tasks_of(t);
  REQUIRE(tasks.size() == 2);
  std::set<std::string> dropped;
  for (const auto& task : tasks) {
    CHECK(task.what == disk_task::kind::drop);
    CHECK(task.client == 1);
    dropped.insert(task.key);
  }
  CHECK(dropped == std::set<std::string>{"a", "b"});
  CHECK(t.stats().objects == 0);
  CHECK(t.stats().disk_replicas == 0);
}

TEST_CASE("object_table: a failed disk copy leaves the object to plain eviction") {
  object_table t;
  const segment_id seg = mount(t, 1, "s", 1 << 20);
  const segment_id other = mount(t, 2, "s", 1 << 20);
  t.mount_disk(1, 1 << 30);
  std::vector<segment_id> only_1{seg}, only_2{other};
  put(t, "mine", 1000, at(0), {.preferred = only_1});
  put(t, "theirs", 1000, at(0), {.preferred = only_2});  // client 2 has no disk
  const evict_step r = evict_everything(t, at(100));
  CHECK(r.demoted == 1);
  CHECK(r.evicted == 1);
  object_info info;
  CHECK(t.get("theirs", at(100), info) == store_errc::object_not_found);
  auto tasks = tasks_of(t);
  REQUIRE(tasks.size() == 1);
  CHECK(tasks[0].key == "mine");
  CHECK_FALSE(t.disk_stored("mine", 1, tasks[0].segment, tasks[0].offset, false));
  CHECK(t.stats().disk_replicas == 0);
  CHECK(evict_everything(t, at(200)).evicted == 1);  // no second try
  CHECK(tasks_of(t).empty());
  CHECK(t.get("mine", at(200), info) == store_errc::object_not_found);
  // A disk that failed a write (read only) gets no more objects.
  t.mount_disk(1, 1 << 30, false);
  CHECK(t.has_disk(1));
  CHECK_FALSE(t.accepting_disk(1));
  CHECK(t.stats().disks_accepting == 0);
  put(t, "later", 1000, at(300), {.preferred = only_1});
  CHECK(evict_everything(t, at(400)).evicted == 1);
  CHECK(tasks_of(t).empty());
}

TEST_CASE("object_table: disk manifests, drops, failed loads and a holder that leaves") {
  object_table t;
  const segment_id seg = mount(t, 1, "s", 1 << 20);
  CHECK(t.disk_adopt("k", 100, 1) == store_errc::client_not_found);  // no disk mounted
  t.mount_disk(1, 1 << 30);
  CHECK(t.disk_adopt("", 100, 1) == store_errc::invalid_key);
  CHECK(t.disk_adopt("k", 0, 1) == store_errc::invalid_params);
  CHECK_FALSE(t.disk_adopt("k", 100, 1));
  CHECK_FALSE(t.disk_adopt("k", 100, 1));  // the same again: nothing new
  CHECK(t.disk_adopt("k", 101, 1) == store_errc::object_already_exists);
  put(t, "m", 500, at(0));
  CHECK_FALSE(t.disk_adopt("m", 500, 1));  // a memory object gains the disk replica
  CHECK(t.stats().disk_replicas == 2);
  CHECK(t.stats().objects == 2);
  object_info info;
  replica_list w;
  CHECK(t.put_start("k", 100, 7, {}, at(0), w) == store_errc::object_already_exists);

  // The disk lost "k" on its own (its space eviction): gone.
  CHECK_FALSE(t.disk_dropped("k", 1));
  CHECK(t.disk_dropped("k", 1) == store_errc::object_not_found);
  CHECK(t.get("k", at(0), info) == store_errc::object_not_found);
  CHECK(t.stats().disk_replicas == 1);

  // A load that fails loses an object whose disk copy was its last.
  CHECK_FALSE(t.disk_adopt("d", 300, 1));
  CHECK(t.get("d", at(0), info) == store_errc::object_loading);
  auto tasks = tasks_of(t);
  REQUIRE(tasks.size() == 1);
  CHECK_FALSE(t.disk_loaded("d", 1, tasks[0].segment, tasks[0].offset, false, at(0)));
  CHECK(t.get("d", at(0), info) == store_errc::object_not_found);
  CHECK(t.stats().reserved > 0);  // the range waits out put_release_timeout

  // A load nobody reports is given up by reclaim; a get tries again.
  CHECK_FALSE(t.disk_adopt("e", 300, 1));
  CHECK(t.get("e", at(0), info) == store_errc::object_loading);
  tasks = tasks_of(t);
  REQUIRE(tasks.size() == 1);
  CHECK(t.reclaim(at(29'000)).disk_tasks_given_up == 0);
  CHECK(t.reclaim(at(30'000)).disk_tasks_given_up == 1);
  CHECK(t.disk_loaded("e", 1, tasks[0].segment, tasks[0].offset, true, at(30'001)) ==
        store_errc::object_not_found);
  CHECK(t.get("e", at(30'001), info) == store_errc::object_loading);
  CHECK(tasks_of(t).size() == 1);

  // The load's segment goes: the load ends with it, and a holder without a
  // segment cannot load.
  CHECK_FALSE(t.unmount_segment(seg));
  CHECK(t.reclaim(at(200'000)).disk_tasks_given_up == 0);
  CHECK(t.get("e", at(200'000), info) == store_errc::no_space);
  CHECK(tasks_of(t).empty());

  // The disk leaves: its objects with it ("m" lost its memory with the segment).
  CHECK(t.stats().objects == 2);
  CHECK(t.unmount_disk(1) == 2);
  CHECK(t.stats().objects == 0);
  CHECK(t.stats().disk_replicas == 0);
  CHECK_FALSE(t.has_disk(1));
  CHECK(t.unmount_disk(1) == 0);
}

TEST_CASE("object_table: tasks that never reach their holder end at once") {
  object_table t;
  mount(t, 1, "s", 1 << 20);
  t.mount_disk(1, 1 << 30);
  put(t, "a", 1000, at(0));
  CHECK(evict_everything(t, at(100)).demoted == 1);
  auto tasks = tasks_of(t);
  REQUIRE(tasks.size() == 1);
  CHECK(t.demoting_bytes() > 0);
  t.disk_task_undelivered(tasks[0]);
  CHECK(t.demoting_bytes() == 0);                    // eviction no longer waits for it
  CHECK(evict_everything(t, at(200)).evicted == 1);  // and frees it without a disk
  CHECK(tasks_of(t).empty());
  put(t, "a", 1000, at(300));
  CHECK_FALSE(t.disk_adopt("a", 1000, 1));  // on the disk and in memory
  CHECK(evict_everything(t, at(300)).evicted == 1);
  // A load: its range is freed, the object stays on the disk.
  object_info info;
  CHECK(t.get("a", at(400), info) == store_errc::object_loading);
  tasks = tasks_of(t);
  REQUIRE(tasks.size() == 1);
  t.disk_task_undelivered(tasks[0]);
  CHECK(t.stats().objects == 1);
  CHECK(t.stats().disk_replicas == 1);
  CHECK(t.stats().used == 0);  // the range is free at once: nobody writes into it
  CHECK(t.stats().reserved == 0);
  CHECK(t.get("a", at(500), info) == store_errc::object_loading);  // asks its holder again
  CHECK(tasks_of(t).size() == 1);
}

TEST_CASE("object_table: removing an object a disk holder is copying keeps its range") {
  object_table t;
  mount(t, 1, "s", 1 << 20);
  t.mount_disk(1, 1 << 30);
  put(t, "a", 1000, at(0));
  CHECK(evict_everything(t, at(100)).demoted == 1);
  auto tasks = tasks_of(t);
  REQUIRE(tasks.size() == 1);
  CHECK_FALSE(t.remove("a", at(100)));
  CHECK(t.stats().reserved > 0);  // the holder may still be reading it
  CHECK(t.disk_stored("a", 1, tasks[0].segment, tasks[0].offset, true) ==
        store_errc::object_not_found);  // the holder deletes its copy
  // Held by a load: the same.
  CHECK_FALSE(t.disk_adopt("b", 100, 1));
  object_info info;
  CHECK(t.get("b", at(200), info) == store_errc::object_loading);
  const std::uint64_t reserved = t.stats().reserved;
  CHECK_FALSE(t.remove("b", at(200)));
  CHECK(t.stats().reserved > reserved);
  tasks = tasks_of(t);
  REQUIRE(tasks.size() == 2);  // the load, then the drop
  CHECK(tasks[1].what == disk_task::kind::drop);
  CHECK(t.reclaim(at(700'000)).released == 2);
  CHECK(t.stats().reserved == 0);
  CHECK(t.stats().used == 0);
}
