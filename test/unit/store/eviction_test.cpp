// Tests for include/kvlink/store/master/eviction.hpp: what eviction frees,
// what it must keep, and that it never stalls or deadlocks the table.
#include <kvlink/store/master/eviction.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../support/store_time.hpp"
#include <doctest/doctest.h>

using kvlink::segment_id;
using kvlink::store_errc;
using namespace kvlink::store;
using std::chrono::milliseconds;

namespace {

using kvlink_test::at;

constexpr std::uint64_t unit = 4096;  // one object
// An object's bytes: with its record (store/wire/record.hpp) it takes one unit.
constexpr std::uint64_t object_size = unit - 1024;

// A pool of `units` objects of 4 KiB in one segment.
std::unique_ptr<object_table> make_table(std::uint64_t units, master_config cfg = {}) {
  cfg.alignment = unit;
  auto t = std::make_unique<object_table>(cfg);
  segment_id id;
  REQUIRE_FALSE(t->mount_segment({1, "s", units * unit, ""}, id));
  return t;
}

void put(object_table& t, const std::string& key, master_time now, const put_options& opt = {}) {
  replica_list w;
  REQUIRE_FALSE(t.put_start(key, object_size, 7, opt, now, w));
  REQUIRE_FALSE(t.put_end(key, 7, now));
}

// Appended, not "prefix + to_string": g++ 12 at -O3 reports a -Wrestrict
// overlap that cannot happen in operator+(const char*, string&&) (GCC bug
// 105329), which breaks a Release build with KVLINK_WERROR.
std::string key(const char* prefix, int i) { return std::string(prefix).append(std::to_string(i)); }

}  // namespace

TEST_CASE("evictor: nothing below the watermark unless a put failed") {
  auto tp = make_table(100);
  object_table& t = *tp;
  evictor ev{t};
  for (int i = 0; i < 89; ++i) put(t, key("k", i), at(0));
  CHECK_FALSE(ev.above_watermark());
  CHECK_FALSE(ev.run_once(at(1)).ran);
  put(t, "k89", at(0));
  CHECK(ev.above_watermark());  // 90 %
  const auto r = ev.run_once(at(1));
  CHECK(r.ran);
  CHECK(r.target == 5 * unit);  // 90 - 90 + 5 %
  CHECK(r.freed >= r.target);
  CHECK(r.evicted == 5);
  CHECK(t.stats().objects == 85);
  CHECK_FALSE(ev.run_once(at(2)).ran);
}

TEST_CASE("evictor: leased, pinned and in-progress objects survive") {
  master_config cfg;
  cfg.lease_on_exists = false;  // the checks below do not lease
  auto tp = make_table(100, cfg);
  object_table& t = *tp;
  evictor ev{t};
  object_info info;
  replica_list w;
  for (int i = 0; i < 20; ++i) {
    put(t, key("leased", i), at(0));
    REQUIRE_FALSE(t.get(key("leased", i), at(100), info));  // lease until 10.1 s
  }
  for (int i = 0; i < 20; ++i) put(t, key("hard", i), at(0), {.hard_pin = true});
  for (int i = 0; i < 20; ++i) put(t, key("soft", i), at(0), {.soft_pin = true});
  for (int i = 0; i < 20; ++i) {
    REQUIRE_FALSE(t.put_start(key("writing", i), object_size, 7, {}, at(0), w));
  }
  for (int i = 0; i < 15; ++i) put(t, key("plain", i), at(0));
  // 95 % full: 10 % to free, and only the 15 plain objects may go.
  const auto r = ev.run_once(at(200));
  CHECK(r.ran);
  CHECK(r.target == 10 * unit);
  CHECK(r.evicted == 10);
  CHECK_FALSE(r.soft_pinned);
  for (int i = 0; i < 20; ++i) {
    CHECK_FALSE(t.exists(key("leased", i), at(300)));
    CHECK_FALSE(t.exists(key("hard", i), at(300)));
    CHECK_FALSE(t.exists(key("soft", i), at(300)));
    CHECK(t.exists(key("writing", i), at(300)) == store_errc::object_in_progress);
  }
  // Now only soft-pinned objects may go: the second pass takes them.
  for (int i = 0; i < 15; ++i) (void)t.remove(key("plain", i), at(300), true);
  for (int i = 0; i < 15; ++i) put(t, key("hard2-", i), at(300), {.hard_pin = true});
  const auto r2 = ev.run_once(at(400));
  CHECK(r2.ran);
  CHECK(r2.soft_pinned);
  CHECK(r2.evicted == 10);
  for (int i = 0; i < 20; ++i) {
    CHECK_FALSE(t.exists(key("hard", i), at(500)));
    CHECK_FALSE(t.exists(key("leased", i), at(500)));
    CHECK(t.exists(key("writing", i), at(500)) == store_errc::object_in_progress);
  }
}

TEST_CASE("evictor: soft-pinned objects stay when evict_soft_pinned is off") {
  master_config cfg;
  cfg.evict_soft_pinned = false;
  auto tp = make_table(100, cfg);
  object_table& t = *tp;
  evictor ev{t};
  for (int i = 0; i < 95; ++i) put(t, key("soft", i), at(0), {.soft_pin = true});
  const auto r = ev.run_once(at(1));
  CHECK(r.ran);
  CHECK(r.evicted == 0);
  CHECK(t.stats().objects == 95);
  // A soft pin runs out (30 min by default): then they go like any object.
  const auto r2 = ev.run_once(at(30 * 60'000));
  CHECK(r2.evicted == 10);
}

TEST_CASE("evictor: chain tails go before their prefixes") {
  master_config cfg;
  cfg.eviction_share = 10;
  auto tp = make_table(20, cfg);
  object_table& t = *tp;
  evictor ev{t};
  master_config no_lease = cfg;
  // Two chains of 9: c0 <- c1 <- ... <- c8 and d0 <- ... <- d8.
  for (const char* chain : {"c", "d"}) {
    for (int i = 0; i < 9; ++i) {
      const std::string parent = i == 0 ? std::string{} : key(chain, i - 1);
      put(t, key(chain, i), at(0), {.parent = parent});
    }
  }
  // 18 of 20 is 90 %: each round frees 2 objects (10 %), and must take tails.
  int left = 18;
  for (int round = 0; round < 3; ++round) {
    const auto r = ev.run_once(at(1 + round));
    REQUIRE(r.ran);
    CHECK(r.evicted == 2);
    left -= 2;
    // Each chain is still a prefix: c0..c(n-1) present, the rest absent.
    // (exists grants leases that end at 10 s; the rounds run at 1..3 ms
    // after and before them, so check with objects' status only.)
    int present = 0;
    for (const char* chain : {"c", "d"}) {
      int n = 0;
      while (n < 9 && !t.exists(key(chain, n), at(-20'000))) ++n;
      for (int i = n; i < 9; ++i) {
        CHECK(t.exists(key(chain, i), at(-20'000)) == store_errc::object_not_found);
      }
      present += n;
    }
    CHECK(present == left);
    // Back to 90 % with hard-pinned filler so the next round runs.
    for (int i = 0; i < 2; ++i) put(t, key("fill", round * 2 + i), at(0), {.hard_pin = true});
  }
  (void)no_lease;
}

TEST_CASE("evictor: a full pool answers no_space at once") {
  auto tp = make_table(50);
  object_table& t = *tp;
  evictor ev{t};
  object_info info;
  for (int i = 0; i < 50; ++i) {
    put(t, key("k", i), at(0));
    REQUIRE_FALSE(t.get(key("k", i), at(0), info));  // leased until 10 s
  }
  replica_list w;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(t.put_start("new", object_size, 7, {}, at(1), w) == store_errc::no_space);
  CHECK(kvlink::mooncake_code(store_errc::no_space) == -200);
  const auto r = ev.run_once(at(2));  // nothing may go: it returns at once
  CHECK(r.ran);
  CHECK(r.evicted == 0);
  CHECK(t.put_start("new", object_size, 7, {}, at(3), w) == store_errc::no_space);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds{2});
  // The leases run out: the failed put asked for eviction, which now frees.
  const auto r2 = ev.run_once(at(10'000));
  CHECK(r2.evicted >= 1);
  CHECK_FALSE(t.put_start("new", object_size, 7, {}, at(10'001), w));
}

TEST_CASE("evictor: recently read objects get a second chance") {
  master_config cfg;
  cfg.lease_ttl = milliseconds{0};  // reads mark objects, leases do not protect them
  auto tp = make_table(1000, cfg);
  object_table& t = *tp;
  evictor ev{t};
  for (int i = 0; i < 950; ++i) put(t, key("k", i), at(0));
  // put_end marks new objects: one turn of the clock clears the marks.
  for (std::size_t s = 0; s < shard_count; ++s) {
    (void)t.evict_from_shard(s, at(0), std::size_t{1} << 20, 0, false);
  }
  object_info info;
  for (int i = 0; i < 950; i += 2) REQUIRE_FALSE(t.get(key("k", i), at(1), info));  // hot
  const auto r = ev.run_once(at(2));
  REQUIRE(r.ran);
  CHECK(r.evicted == 100);  // 95 % full: 95 - 90 + 5 %
  for (int i = 0; i < 950; i += 2) CHECK_FALSE(t.exists(key("k", i), at(3)));
}

TEST_CASE("evictor: 8 threads of writers, readers, eviction and reclaim; nothing leased lost") {
  auto tp = make_table(512);
  object_table& t = *tp;
  evictor ev{t};
  std::atomic<std::int64_t> clock{0};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> puts{0}, gets{0}, lost{0}, evicted{0};
  auto writer = [&](int id) {
    std::mt19937 rng{static_cast<unsigned>(id)};
    replica_list w;
    const auto me = static_cast<std::uint64_t>(id + 1);
    // Until eviction has run a little too, however the threads are scheduled.
    for (int i = 0; i < 20000 || (evicted.load() == 0 && i < 4'000'000); ++i) {
      if (i >= 20000) std::this_thread::yield();
      const std::string k = key("k", static_cast<int>(rng() % 2000));
      const auto now = at(clock.load());
      const std::string parent = rng() % 4 == 0 ? key("k", static_cast<int>(rng() % 2000)) : "";
      const auto ec = t.put_start(k, unit * (1 + rng() % 2) - 1024, me,
                                  {.replicas = 1, .parent = parent == k ? "" : parent}, now, w);
      if (!ec) {
        if (rng() % 8 == 0) {
          (void)t.put_revoke(k, me, now);
        } else if (rng() % 16 != 0) {  // the others are left for reclaim
          (void)t.put_end(k, me, now);
          puts.fetch_add(1);
        }
      }
      if (rng() % 4 == 0) (void)t.remove(key("k", static_cast<int>(rng() % 2000)), now);
    }
  };
  auto reader = [&](int id) {
    std::mt19937 rng{static_cast<unsigned>(100 + id)};
    object_info info;
    std::vector<std::string> keys(8);
    std::vector<std::string_view> views(8);
    std::vector<std::int32_t> out(8);
    for (int i = 0; i < 40000; ++i) {
      // Half the keys are read (and leased), half never: those may go.
      const std::string k = key("k", static_cast<int>(rng() % 1000));
      if (!t.get(k, at(clock.load()), info)) {
        gets.fetch_add(1);
        // Leased: neither eviction nor an unforced remove may take it now.
        const auto now = at(clock.load());
        if (now < info.lease_until && t.exists(k, now)) lost.fetch_add(1);
      }
      if (i % 64 == 0) {
        for (std::size_t j = 0; j < keys.size(); ++j) {
          keys[j] = key("k", static_cast<int>(rng() % 2000));
          views[j] = keys[j];
        }
        t.exists(views, at(clock.load()), out);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back(writer, i);
  for (int i = 0; i < 3; ++i) threads.emplace_back(reader, i);
  threads.emplace_back([&] {
    while (!stop.load()) {
      const std::int64_t now = clock.fetch_add(50) + 50;  // leases (10 s) run out
      evicted.fetch_add(ev.run_once(at(now)).evicted);
      (void)t.reclaim(at(now));
      std::this_thread::yield();
    }
  });
  for (std::size_t i = 0; i < 7; ++i) threads[i].join();
  stop = true;
  threads.back().join();
  CHECK(lost.load() == 0);
  CHECK(puts.load() > 0);
  CHECK(gets.load() > 0);
  CHECK(evicted.load() > 0);
  // Nothing leaked: once everything is removed and every discarded put
  // released, the pool is empty.
  const std::int64_t end = clock.load();
  (void)t.remove_all(at(end), true);
  (void)t.reclaim(at(end + 700'000));  // discards the puts left in progress
  (void)t.reclaim(at(end + 2'000'000));
  (void)t.remove_all(at(end + 2'000'000), true);
  CHECK(t.stats().objects == 0);
  CHECK(t.stats().in_progress == 0);
  CHECK(t.stats().used == 0);
  CHECK(t.stats().reserved == 0);
}
