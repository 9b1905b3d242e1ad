#include <kvlink/core/segment_registry.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <set>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

// The registry never dereferences what it registers, so these tests use
// made-up addresses.

namespace {

using kvlink::access;
using kvlink::errc;
using kvlink::segment_id;

const void* at(std::uintptr_t a) { return reinterpret_cast<const void*>(a); }

constexpr std::uintptr_t top = std::numeric_limits<std::uintptr_t>::max();

segment_id must_add(kvlink::segment_registry& reg, std::uintptr_t base, std::uint64_t len,
                    access a = access::remote_read_write) {
  std::error_code ec;
  const segment_id id = reg.add(at(base), len, a, ec);
  REQUIRE_MESSAGE(!ec, ec.message());
  REQUIRE(id.valid());
  return id;
}

std::error_code add_error(kvlink::segment_registry& reg, std::uintptr_t base, std::uint64_t len) {
  std::error_code ec;
  const segment_id id = reg.add(at(base), len, access::remote_read, ec);
  CHECK_FALSE(id.valid());
  return ec;
}

}  // namespace

TEST_CASE("instance id text form") {
  const kvlink::instance_id id{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  CHECK(kvlink::to_string(id) == "0123456789abcdeffedcba9876543210");
  CHECK(kvlink::parse_instance_id("0123456789abcdeffedcba9876543210") == id);
  CHECK(kvlink::parse_instance_id("0123456789ABCDEFFEDCBA9876543210") == id);
  CHECK(kvlink::to_string(kvlink::instance_id{}) == std::string(32, '0'));
  CHECK(kvlink::parse_instance_id(std::string(32, '0')) == kvlink::instance_id{});
  CHECK(kvlink::parse_instance_id("") == std::nullopt);
  CHECK(kvlink::parse_instance_id("0123456789abcdeffedcba987654321") == std::nullopt);    // 31
  CHECK(kvlink::parse_instance_id("0123456789abcdeffedcba98765432100") == std::nullopt);  // 33
  CHECK(kvlink::parse_instance_id("0123456789abcdeffedcba987654321g") == std::nullopt);
  CHECK(kvlink::parse_instance_id("0x23456789abcdeffedcba9876543210") == std::nullopt);
  const kvlink::instance_id a = kvlink::make_instance_id(), b = kvlink::make_instance_id();
  CHECK(a.valid());
  CHECK(a != b);  // 2^-128 chance of a false failure
  CHECK(kvlink::parse_instance_id(kvlink::to_string(a)) == a);
}

TEST_CASE("add: ids start at 1, increase, are never reused") {
  kvlink::segment_registry reg;
  CHECK(reg.size() == 0);
  CHECK(reg.generation() == 0);
  const segment_id a = must_add(reg, 0x1000, 0x100);
  const segment_id b = must_add(reg, 0x2000, 0x100);
  CHECK(a == segment_id{1});
  CHECK(b == segment_id{2});
  CHECK(reg.generation() == 2);
  CHECK_FALSE(reg.remove(b));
  CHECK(reg.generation() == 3);
  CHECK(reg.remove(b) == errc::not_registered);
  CHECK(reg.remove(segment_id{99}) == errc::not_registered);
  CHECK(reg.remove(segment_id{}) == errc::not_registered);
  CHECK(reg.generation() == 3);                       // failed calls change nothing
  const segment_id c = must_add(reg, 0x2000, 0x100);  // same range again: new id
  CHECK(c == segment_id{3});
  CHECK(reg.size() == 2);
  CHECK_FALSE(reg.get(b).has_value());
  CHECK_FALSE(reg.contains(b));
  CHECK_FALSE(reg.contains(segment_id{}));
  CHECK(reg.contains(a));
  CHECK(reg.contains(c));
  REQUIRE(reg.get(c).has_value());
  CHECK(reg.get(c)->base == 0x2000);
  CHECK(reg.get(c)->length == 0x100);
  CHECK(reg.get(c)->granted == access::remote_read_write);
}

TEST_CASE("add: invalid arguments") {
  kvlink::segment_registry reg;
  CHECK(add_error(reg, 0x1000, 0) == errc::invalid_argument);
  CHECK(add_error(reg, 0, 0x100) == errc::invalid_argument);
  // Top of the address space: [base, base + length) must not wrap.
  CHECK(add_error(reg, top, 1) == errc::invalid_argument);
  CHECK(add_error(reg, top - 0xff, 0x100) == errc::invalid_argument);
  CHECK(add_error(reg, 0x1000, std::numeric_limits<std::uint64_t>::max()) ==
        errc::invalid_argument);
  CHECK(add_error(reg, 1, std::numeric_limits<std::uint64_t>::max()) == errc::invalid_argument);
  CHECK(reg.size() == 0);
  CHECK(reg.generation() == 0);
  // The largest range that fits ends exactly at the top.
  const segment_id hi = must_add(reg, top - 0x100, 0x100);
  CHECK(reg.get(hi)->end() == top);
  REQUIRE(reg.find(at(top - 1), 1).has_value());
  CHECK(reg.find(at(top - 1), 1)->id == hi);
  CHECK_FALSE(reg.find(at(top), 1).has_value());
  std::byte* p = nullptr;
  CHECK_FALSE(reg.check_remote_access(hi, 0xff, 1, access::remote_read, p));
  CHECK(reinterpret_cast<std::uintptr_t>(p) == top - 1);
}

TEST_CASE("add: overlaps are refused, adjacent segments are fine") {
  kvlink::segment_registry reg;
  const segment_id mid = must_add(reg, 0x1000, 0x1000);  // [0x1000, 0x2000)
  struct {
    std::uintptr_t base;
    std::uint64_t len;
    const char* what;
  } overlapping[] = {
      {0x0800, 0x0801, "left: ends one byte inside"},
      {0x1fff, 0x0100, "right: starts on the last byte"},
      {0x1000, 0x1000, "identical"},
      {0x1100, 0x0100, "contained"},
      {0x0800, 0x2000, "containing"},
      {0x1000, 0x0001, "first byte"},
      {0x0001, top - 0x1000, "huge"},
  };
  for (const auto& o : overlapping) {
    CAPTURE(o.what);
    CHECK(add_error(reg, o.base, o.len) == errc::overlapping_registration);
  }
  CHECK(reg.size() == 1);
  const segment_id left = must_add(reg, 0x0800, 0x0800);   // ends at 0x1000
  const segment_id right = must_add(reg, 0x2000, 0x0800);  // starts at 0x2000
  CHECK(reg.size() == 3);
  // A hole exactly between two segments fits; one byte more does not.
  const segment_id far = must_add(reg, 0x3000, 0x1000);
  CHECK(add_error(reg, 0x2800, 0x0801) == errc::overlapping_registration);
  CHECK(add_error(reg, 0x27ff, 0x0801) == errc::overlapping_registration);
  const segment_id gap = must_add(reg, 0x2800, 0x0800);
  const auto snap = reg.snapshot();
  REQUIRE(snap.size() == 5);
  CHECK(snap[0].id == mid);
  CHECK(snap[1].id == left);
  CHECK(snap[2].id == right);
  CHECK(snap[3].id == far);
  CHECK(snap[4].id == gap);
  CHECK(std::is_sorted(snap.begin(), snap.end(),
                       [](const auto& a, const auto& b) { return a.id < b.id; }));
}

TEST_CASE("find and locate at boundaries") {
  kvlink::segment_registry reg;
  const segment_id a = must_add(reg, 0x1000, 0x1000);  // [0x1000, 0x2000)
  const segment_id b = must_add(reg, 0x2000, 0x1000);  // [0x2000, 0x3000)
  const segment_id c = must_add(reg, 0x5000, 0x10);    // [0x5000, 0x5010)

  const auto id_of = [&](std::uintptr_t addr, std::uint64_t len) {
    const auto s = reg.find(at(addr), len);
    return s ? s->id : segment_id{};
  };
  CHECK(id_of(0x1000, 1) == a);
  CHECK(id_of(0x1000, 0x1000) == a);
  CHECK(id_of(0x1fff, 1) == a);
  CHECK(id_of(0x2000, 1) == b);  // adjacent: the end of a is b's first byte
  CHECK(id_of(0x2fff, 1) == b);
  CHECK(id_of(0x1800, 0) == a);  // length 0: the segment holding the byte
  CHECK(id_of(0x5000, 0x10) == c);
  CHECK_FALSE(id_of(0x0fff, 1).valid());
  CHECK_FALSE(id_of(0x0fff, 2).valid());  // starts before a: not_registered
  CHECK_FALSE(id_of(0x1fff, 2).valid());  // spans a and b: never one segment
  CHECK_FALSE(id_of(0x1000, 0x1001).valid());
  CHECK_FALSE(id_of(0x3000, 1).valid());
  CHECK_FALSE(id_of(0x5010, 0).valid());
  CHECK_FALSE(id_of(0x0, 1).valid());
  CHECK_FALSE(id_of(top, 1).valid());

  kvlink::segment_info out;
  CHECK(reg.locate(at(0x0fff), 1, out) == errc::not_registered);
  CHECK(reg.locate(at(0x3000), 1, out) == errc::not_registered);
  CHECK(reg.locate(at(0x4fff), 2, out) == errc::not_registered);
  CHECK(reg.locate(at(0x1fff), 2, out) == errc::out_of_bounds);
  CHECK(reg.locate(at(0x5008), 9, out) == errc::out_of_bounds);
  // addr + length wraps: still out_of_bounds, not a false hit.
  CHECK(reg.locate(at(0x5008), std::numeric_limits<std::uint64_t>::max(), out) ==
        errc::out_of_bounds);
  CHECK(out.id == segment_id{});  // untouched by failures
  CHECK_FALSE(reg.locate(at(0x5008), 8, out));
  CHECK(out.id == c);
  CHECK(out.base == 0x5000);
  CHECK(out.length == 0x10);

  CHECK_FALSE(reg.remove(a));
  CHECK(reg.locate(at(0x1000), 1, out) == errc::not_registered);
  CHECK(id_of(0x2000, 1) == b);
}

TEST_CASE("check_remote_access: every error, overflow-safe") {
  kvlink::segment_registry reg;
  const segment_id ro = must_add(reg, 0x10000, 0x1000, access::remote_read);
  const segment_id wo = must_add(reg, 0x20000, 0x1000, access::remote_write);
  const segment_id none = must_add(reg, 0x30000, 0x1000, access::none);
  const segment_id rw = must_add(reg, 0x40000, 0x1000, access::remote_read_write);
  constexpr std::uint64_t u64max = std::numeric_limits<std::uint64_t>::max();

  std::byte* p = nullptr;
  const auto check = [&](segment_id id, std::uint64_t off, std::uint64_t len, kvlink::access need) {
    return reg.check_remote_access(id, off, len, need, p);
  };
  CHECK(check(segment_id{77}, 0, 1, access::remote_read) == errc::not_registered);
  CHECK(check(segment_id{}, 0, 1, access::remote_read) == errc::not_registered);
  CHECK(check(ro, 0, 0x1001, access::remote_read) == errc::out_of_bounds);
  CHECK(check(ro, 0x1000, 1, access::remote_read) == errc::out_of_bounds);
  CHECK(check(ro, 0x1001, 0, access::remote_read) == errc::out_of_bounds);
  CHECK(check(ro, 1, u64max, access::remote_read) == errc::out_of_bounds);  // offset + length wraps
  CHECK(check(ro, u64max, 2, access::remote_read) == errc::out_of_bounds);
  CHECK(check(ro, u64max, u64max, access::remote_read) == errc::out_of_bounds);
  CHECK(check(ro, 0, 1, access::remote_write) == errc::access_denied);
  CHECK(check(wo, 0, 1, access::remote_read) == errc::access_denied);
  CHECK(check(none, 0, 1, access::remote_read) == errc::access_denied);
  CHECK(check(none, 0, 1, access::remote_write) == errc::access_denied);
  CHECK(check(ro, 0, 1, access::remote_read_write) == errc::access_denied);
  // Bounds are checked before access.
  CHECK(check(none, 0x1000, 1, access::remote_read) == errc::out_of_bounds);
  CHECK(p == nullptr);  // untouched by failures

  CHECK_FALSE(check(ro, 0, 0x1000, access::remote_read));
  CHECK(reinterpret_cast<std::uintptr_t>(p) == 0x10000);
  CHECK_FALSE(check(wo, 0xfff, 1, access::remote_write));
  CHECK(reinterpret_cast<std::uintptr_t>(p) == 0x20fff);
  CHECK_FALSE(check(rw, 0x800, 0x800, access::remote_read_write));
  CHECK(reinterpret_cast<std::uintptr_t>(p) == 0x40800);
  CHECK_FALSE(check(rw, 0x1000, 0, access::remote_read));  // empty range at the end
  CHECK(reinterpret_cast<std::uintptr_t>(p) == 0x41000);
  CHECK_FALSE(check(none, 0, 1, access::none));

  CHECK_FALSE(reg.remove(rw));
  CHECK(check(rw, 0, 1, access::remote_read) == errc::not_registered);
}

TEST_CASE("10^4 segments: every one found at its edges, gaps are not") {
  kvlink::segment_registry reg;
  constexpr std::size_t n = 10'000;
  constexpr std::uintptr_t stride = 0x3000;  // segment of 0x2000 then a gap of 0x1000
  // Insert in a scrambled order so the map sees more than appends.
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = (i * 7919) % n;  // 7919 is prime, coprime to n
  std::vector<segment_id> by_slot(n);
  for (std::size_t slot : order) by_slot[slot] = must_add(reg, 0x100000 + slot * stride, 0x2000);
  CHECK(reg.size() == n);
  for (std::size_t slot = 0; slot < n; ++slot) {
    const std::uintptr_t base = 0x100000 + slot * stride;
    const auto first = reg.find(at(base), 1);
    const auto last = reg.find(at(base + 0x1fff), 1);
    const auto whole = reg.find(at(base), 0x2000);
    if (!(first && last && whole && first->id == by_slot[slot] && last->id == by_slot[slot] &&
          whole->id == by_slot[slot])) {
      FAIL("segment " << slot << " not found");
    }
    kvlink::segment_info out;
    if (reg.locate(at(base + 0x2000), 1, out) != errc::not_registered ||
        reg.locate(at(base - 1), 1, out) != errc::not_registered ||
        reg.locate(at(base + 0x1000), 0x1001, out) != errc::out_of_bounds) {
      FAIL("wrong error around segment " << slot);
    }
  }
  // Remove every other one; the rest are still found, the removed are not.
  for (std::size_t slot = 0; slot < n; slot += 2) REQUIRE_FALSE(reg.remove(by_slot[slot]));
  CHECK(reg.size() == n / 2);
  std::size_t found = 0;
  for (std::size_t slot = 0; slot < n; ++slot) {
    const auto s = reg.find(at(0x100000 + slot * stride + 0x10), 0x10);
    if (s) {
      ++found;
      CHECK(s->id == by_slot[slot]);
      CHECK(slot % 2 == 1);
    }
  }
  CHECK(found == n / 2);
}

TEST_CASE("concurrent add/remove/find leaves a consistent registry") {
  kvlink::segment_registry reg;
  constexpr int threads = 4;
  constexpr int per_thread = 2000;
  constexpr std::uintptr_t region = 0x1000'0000;  // each thread owns its own region
  constexpr std::uintptr_t seg_len = 0x100;
  std::atomic<int> errors{0};
  std::vector<std::vector<segment_id>> kept(threads);

  // A fixed segment every thread keeps looking up.
  const segment_id shared = must_add(reg, 0x100, 0x100, access::remote_read);

  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const std::uintptr_t origin = region * static_cast<std::uintptr_t>(t + 1);
      for (int i = 0; i < per_thread; ++i) {
        const std::uintptr_t base = origin + static_cast<std::uintptr_t>(i) * 2 * seg_len;
        std::error_code ec;
        const segment_id id = reg.add(at(base), seg_len, access::remote_read_write, ec);
        if (ec || !id.valid()) ++errors;
        // An overlapping add fails however the threads interleave.
        std::error_code ec2;
        if (reg.add(at(base + 1), 1, access::none, ec2).valid() ||
            ec2 != errc::overlapping_registration) {
          ++errors;
        }
        const auto s = reg.find(at(base + seg_len - 1), 1);
        if (!s || s->id != id) ++errors;
        std::byte* p = nullptr;
        if (reg.check_remote_access(shared, 0, 0x100, access::remote_read, p) ||
            reinterpret_cast<std::uintptr_t>(p) != 0x100) {
          ++errors;
        }
        if (i % 3 == 0) {
          if (reg.remove(id)) ++errors;
          if (reg.find(at(base), 1)) ++errors;
        } else {
          kept[static_cast<std::size_t>(t)].push_back(id);
        }
        (void)reg.snapshot().size();
        (void)reg.generation();
      }
    });
  }
  for (auto& th : pool) th.join();
  CHECK(errors.load() == 0);

  std::size_t expected = 1;
  std::set<segment_id> all_ids{shared};
  for (const auto& ids : kept) {
    expected += ids.size();
    all_ids.insert(ids.begin(), ids.end());
  }
  CHECK(all_ids.size() == expected);  // no id handed out twice
  CHECK(reg.size() == expected);
  const auto snap = reg.snapshot();
  REQUIRE(snap.size() == expected);
  for (const auto& s : snap) CHECK(all_ids.count(s.id) == 1);
  // Every add and remove, successful ones only, bumped the generation once.
  const std::size_t removed = threads * ((per_thread + 2) / 3);
  CHECK(reg.generation() == 1 + threads * per_thread + removed);
  // Ids are 1..(adds) with none reused: the largest is the number of adds.
  CHECK(all_ids.rbegin()->value() == static_cast<std::uint64_t>(1 + threads * per_thread));
}

TEST_CASE("remote_segment_cache: put, get, erase, drop_instance, check, limits") {
  kvlink::remote_segment_cache cache;
  const kvlink::instance_id p1{1, 1}, p2{2, 2};
  CHECK(cache.size() == 0);
  CHECK_FALSE(cache.get(p1, segment_id{1}).has_value());
  CHECK(cache.check(p1, segment_id{1}, 0, 1, access::remote_read) == errc::not_registered);

  const auto keys = [](std::vector<std::uint32_t> rkeys) {
    return nlohmann::json{{"rdma", std::move(rkeys)}};
  };
  const auto g0 = cache.generation();
  cache.put(p1, {segment_id{2}, 0xa000, 0x1000, access::remote_write, keys({11, 12})});
  cache.put(p1, {segment_id{1}, 0xb000, 0x100, access::remote_read, nlohmann::json::object()});
  cache.put(p2, {segment_id{1}, 0xc000, 0x800, access::remote_read_write, keys({21})});
  CHECK(cache.generation() == g0 + 3);  // every change moves it
  CHECK(cache.size() == 3);
  REQUIRE(cache.get(p1, segment_id{2}).has_value());
  CHECK(cache.get(p1, segment_id{2})->keys == keys({11, 12}));
  CHECK(cache.get(p1, segment_id{1})->base == 0xb000);
  CHECK(cache.get(p2, segment_id{1})->base == 0xc000);  // same id, other instance
  CHECK_FALSE(cache.get(p2, segment_id{2}).has_value());

  const auto segs = cache.segments(p1);
  REQUIRE(segs.size() == 2);
  CHECK(segs[0].id == segment_id{1});  // ordered by id
  CHECK(segs[1].id == segment_id{2});
  CHECK(cache.segments(kvlink::instance_id{9, 9}).empty());

  // Replace.
  cache.put(p1, {segment_id{1}, 0xb000, 0x200, access::remote_read_write, keys({5})});
  CHECK(cache.size() == 3);
  CHECK(cache.get(p1, segment_id{1})->length == 0x200);
  CHECK(cache.get(p1, segment_id{1})->keys == keys({5}));

  // check: same rules as the target side.
  constexpr std::uint64_t u64max = std::numeric_limits<std::uint64_t>::max();
  CHECK_FALSE(cache.check(p1, segment_id{2}, 0, 0x1000, access::remote_write));
  CHECK_FALSE(cache.check(p1, segment_id{2}, 0x1000, 0, access::remote_write));
  CHECK(cache.check(p1, segment_id{2}, 0, 1, access::remote_read) == errc::access_denied);
  CHECK(cache.check(p1, segment_id{2}, 0xfff, 2, access::remote_write) == errc::out_of_bounds);
  CHECK(cache.check(p1, segment_id{2}, 1, u64max, access::remote_write) == errc::out_of_bounds);
  CHECK(cache.check(p1, segment_id{2}, u64max, 1, access::remote_write) == errc::out_of_bounds);
  CHECK(cache.check(p1, segment_id{3}, 0, 1, access::remote_write) == errc::not_registered);
  CHECK(cache.check(kvlink::instance_id{9, 9}, segment_id{2}, 0, 1, access::remote_write) ==
        errc::not_registered);

  // limits: length and access only, of the entry of that instance.
  std::uint64_t length = 0;
  kvlink::access granted = access::none;
  CHECK(cache.limits(p1, segment_id{2}, length, granted));
  CHECK(length == 0x1000);
  CHECK(granted == access::remote_write);
  CHECK(cache.limits(p2, segment_id{1}, length, granted));
  CHECK(length == 0x800);
  CHECK(granted == access::remote_read_write);
  CHECK_FALSE(cache.limits(p2, segment_id{2}, length, granted));
  CHECK_FALSE(cache.limits(kvlink::instance_id{9, 9}, segment_id{1}, length, granted));
  CHECK(length == 0x800);  // untouched when not cached

  // Erase.
  CHECK(cache.erase(p1, segment_id{2}));
  CHECK_FALSE(cache.erase(p1, segment_id{2}));
  CHECK_FALSE(cache.erase(kvlink::instance_id{9, 9}, segment_id{1}));
  CHECK(cache.size() == 2);
  CHECK(cache.check(p1, segment_id{2}, 0, 1, access::remote_write) == errc::not_registered);

  // A restarted peer: everything of that instance goes, others stay.
  cache.drop_instance(p1);
  CHECK(cache.size() == 1);
  CHECK(cache.segments(p1).empty());
  CHECK_FALSE(cache.get(p1, segment_id{1}).has_value());
  CHECK(cache.get(p2, segment_id{1}).has_value());
  cache.drop_instance(p1);  // idempotent
  CHECK(cache.size() == 1);

  // A peer's new segment list replaces all of its entries at once.
  const auto g1 = cache.generation();
  cache.replace(p2, {{segment_id{4}, 0xd000, 0x10, access::remote_read, keys({7})},
                     {segment_id{5}, 0xe000, 0x20, access::remote_write, keys({8})}});
  CHECK(cache.generation() > g1);
  CHECK_FALSE(cache.get(p2, segment_id{1}).has_value());
  REQUIRE(cache.segments(p2).size() == 2);
  CHECK(cache.get(p2, segment_id{5})->keys == keys({8}));
  cache.replace(p2, {});
  CHECK(cache.size() == 0);
}

TEST_CASE("segment_registry records where the memory lives") {
  kvlink::segment_registry reg;
  std::error_code ec;
  const auto a = reg.add(reinterpret_cast<void*>(0x10000), 0x1000, access::none, ec);
  REQUIRE_FALSE(ec);
  CHECK(reg.get(a)->memory == kvlink::memory_desc{});
  CHECK(reg.get(a)->memory.kind == kvlink::memory_kind::host);
  CHECK(kvlink::to_string(kvlink::memory_kind::host) == "host");
  const kvlink::memory_kinds host_only{kvlink::memory_kind::host};
  CHECK(host_only.contains(kvlink::memory_kind::host));
  CHECK(kvlink::memory_kinds{}.empty());
  CHECK_FALSE(kvlink::memory_kinds{}.contains(kvlink::memory_kind::host));
}

TEST_CASE("remote_segment_cache is safe to use from several threads") {
  kvlink::remote_segment_cache cache;
  constexpr int threads = 4;
  constexpr std::uint64_t per_thread = 1000;
  std::atomic<int> errors{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const kvlink::instance_id inst{static_cast<std::uint64_t>(t) + 1, 0};
      for (std::uint64_t i = 1; i <= per_thread; ++i) {
        cache.put(inst, {segment_id{i}, i * 0x1000, 0x1000, access::remote_read, {}});
        if (cache.check(inst, segment_id{i}, 0, 0x1000, access::remote_read)) ++errors;
        if (i % 2 == 0 && !cache.erase(inst, segment_id{i})) ++errors;
        (void)cache.size();
      }
    });
  }
  for (auto& th : pool) th.join();
  CHECK(errors.load() == 0);
  CHECK(cache.size() == threads * per_thread / 2);
  for (int t = 0; t < threads; ++t) {
    const auto segs = cache.segments(kvlink::instance_id{static_cast<std::uint64_t>(t) + 1, 0});
    CHECK(segs.size() == per_thread / 2);
  }
}
