// Fuzzes the store master's object table and evictor
// (include/kvlink/store/master/objects.hpp, eviction.hpp) with programs of
// operations: mount and unmount of up to 4 segments, put_start (16 keys,
// sizes, 1-3 replicas, chain parents, pins), put_end, put_revoke, get,
// exists, remove (forced or not), remove_all, reclaim, eviction, adopt (an
// object a segment's owner announces after a master restart, anywhere in
// the segment), and the clock moving on. Each operation is 4 bytes.
//
// Asserts after every operation, besides "no crash, no hang, no exception":
// - stats agree with what lookups see: objects = keys found (complete or in
//   progress), in_progress = keys in progress;
// - used <= capacity, and used = the segments' used bytes;
// - every complete object's replicas lie on distinct mounted segments,
//   inside them, and no two replicas of live objects overlap;
// and at the end that nothing leaked: with everything removed and every
// discarded put released, nothing is allocated.
#include <kvlink/store/master/eviction.hpp>
#include <kvlink/store/master/objects.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "fuzz_check.hpp"

namespace {

namespace st = kvlink::store;
using kvlink::segment_id;
using kvlink::store_errc;

st::master_time at(std::int64_t ms) { return st::master_time{std::chrono::milliseconds{ms}}; }

constexpr int key_count = 16;
const std::array<std::string, key_count> keys = [] {
  std::array<std::string, key_count> k;
  for (int i = 0; i < key_count; ++i) k[static_cast<std::size_t>(i)] = "key" + std::to_string(i);
  return k;
}();

// Reads lookups without granting a lease: a lease ending in the past.
constexpr std::int64_t probe_time = -1'000'000'000;

void check(st::object_table& t) {
  std::uint64_t found = 0;
  std::uint64_t in_progress = 0;
  std::map<std::uint64_t, std::uint64_t> capacity;  // segment -> capacity
  std::uint64_t seg_used = 0;
  for (const auto& s : t.segments().stats()) {
    capacity[s.id.value()] = s.capacity;
    seg_used += s.used;
    KVLINK_FUZZ_CHECK(s.used <= s.capacity);
  }
  // (segment, offset) -> end of every complete replica.
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::uint64_t> ranges;
  for (const auto& k : keys) {
    st::object_info info;
    const auto ec = t.get(k, at(probe_time), info);
    if (ec == store_errc::object_in_progress) {
      ++found;
      ++in_progress;
      continue;
    }
    if (ec) {
      KVLINK_FUZZ_CHECK(ec == store_errc::object_not_found);
      continue;
    }
    ++found;
    KVLINK_FUZZ_CHECK(!info.replicas.empty());
    for (std::size_t i = 0; i < info.replicas.size(); ++i) {
      const auto& r = info.replicas[i];
      KVLINK_FUZZ_CHECK(r.length == info.size && r.status == st::replica_status::complete);
      const auto cap = capacity.find(r.segment.value());
      KVLINK_FUZZ_CHECK(cap != capacity.end());
      // Its bytes and its record (store/wire/record.hpp).
      const std::uint64_t taken =
          t.segments().rounded(st::wire::object_footprint(r.length, k.size()));
      KVLINK_FUZZ_CHECK(r.offset + taken <= cap->second);
      for (std::size_t j = 0; j < i; ++j) KVLINK_FUZZ_CHECK(info.replicas[j].segment != r.segment);
      const auto [it, fresh] =
          ranges.emplace(std::pair{r.segment.value(), r.offset}, r.offset + taken);
      KVLINK_FUZZ_CHECK(fresh);
      if (it != ranges.begin()) {
        const auto prev = std::prev(it);
        if (prev->first.first == r.segment.value()) KVLINK_FUZZ_CHECK(prev->second <= r.offset);
      }
      const auto next = std::next(it);
      if (next != ranges.end() && next->first.first == r.segment.value()) {
        KVLINK_FUZZ_CHECK(it->second <= next->first.second);
      }
    }
  }
  const auto s = t.stats();
  KVLINK_FUZZ_CHECK(s.objects == found);
  KVLINK_FUZZ_CHECK(s.in_progress == in_progress);
  KVLINK_FUZZ_CHECK(s.used <= s.capacity);
  KVLINK_FUZZ_CHECK(s.used == seg_used);
  KVLINK_FUZZ_CHECK(s.segments == capacity.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  st::master_config cfg;
  cfg.alignment = 256;
  st::object_table t{cfg};
  st::evictor ev{t, 4};
  std::array<segment_id, 4> segs{};
  std::int64_t now = 0;
  st::replica_list w;
  for (std::size_t i = 0; i + 4 <= size; i += 4) {
    const std::uint8_t op = data[i] % 15;
    const std::uint8_t a = data[i + 1];
    const std::uint8_t b = data[i + 2];
    const std::uint8_t c = data[i + 3];
    const std::string& key = keys[a % key_count];
    const std::uint64_t writer = 1 + (b & 1);
    switch (op) {
      case 0: {  // mount
        auto& id = segs[a % 4];
        if (!id.valid()) {
          const std::uint64_t sz = (std::uint64_t{b} + 1) * 1024;
          KVLINK_FUZZ_CHECK(!t.mount_segment({1 + (a % 4u), "s", sz, c % 2 ? "h1" : "h2"}, id));
        }
        break;
      }
      case 1: {  // unmount
        auto& id = segs[a % 4];
        if (id.valid()) {
          KVLINK_FUZZ_CHECK(!t.unmount_segment(id));
          KVLINK_FUZZ_CHECK(t.unmount_segment(id) == store_errc::segment_not_found);
          id = segment_id{};
        }
        break;
      }
      case 2:
      case 3: {  // put_start
        st::put_options opt;
        opt.replicas = 1 + c % 3;
        opt.hard_pin = (c & 0x10) != 0 && (c & 0x20) != 0;
        opt.soft_pin = (c & 0x40) != 0;
        const std::string& parent = keys[(a / 16) % key_count];
        if ((c & 0x80) != 0 && parent != key) opt.parent = parent;
        const std::array<segment_id, 1> pref{segs[b % 4]};
        if ((c & 0x08) != 0) opt.preferred = pref;
        const auto ec = t.put_start(key, 1 + std::uint64_t{b} * 37, writer, opt, at(now), w);
        if (!ec) {
          KVLINK_FUZZ_CHECK(w.size() >= 1 && w.size() <= opt.replicas);
        } else {
          KVLINK_FUZZ_CHECK(w.empty());
          KVLINK_FUZZ_CHECK(ec == store_errc::no_space || ec == store_errc::invalid_params ||
                            ec == store_errc::object_already_exists ||
                            ec == store_errc::object_in_progress);
        }
        break;
      }
      case 4:
        (void)t.put_end(key, writer, at(now));
        break;
      case 5:
        (void)t.put_revoke(key, writer, at(now));
        break;
      case 6: {  // get: a lease
        st::object_info info;
        if (!t.get(key, at(now), info)) {
          KVLINK_FUZZ_CHECK(info.lease_until == at(now + cfg.lease_ttl.count()) ||
                            info.lease_until > at(now));
          // Leased: an unforced remove is refused.
          KVLINK_FUZZ_CHECK(t.remove(key, at(now)) == store_errc::object_has_lease ||
                            t.remove(key, at(now)) == store_errc::object_hard_pinned);
        }
        break;
      }
      case 7:
        (void)t.exists(key, at(now));
        break;
      case 8:
        (void)t.remove(key, at(now), (b & 1) != 0);
        break;
      case 9:
        if (b == 0) (void)t.remove_all(at(now), (c & 1) != 0);
        break;
      case 10:
        (void)t.reclaim(at(now));
        break;
      case 11:  // the clock moves: up to ~11 min
        now += std::int64_t{b} * std::int64_t{c} * 10 + 1;
        break;
      case 12:
        (void)ev.run_once(at(now));
        break;
      case 13:
        (void)t.evict_from_shard(a, at(now), 1 + b % 8, c, (b & 0x80) != 0);
        break;
      case 14: {  // adopt: taken back whole, or refused with a reason
        const auto ec = t.adopt(segs[b % 4], key, std::uint64_t{c} * 64, 1 + std::uint64_t{a} * 53);
        KVLINK_FUZZ_CHECK(!ec || ec == store_errc::object_already_exists ||
                          ec == store_errc::invalid_params || ec == store_errc::segment_not_found);
        st::object_info info;
        if (!ec)
          KVLINK_FUZZ_CHECK(!t.describe(key, info) && info.size == 1 + std::uint64_t{a} * 53);
        break;
      }
    }
    check(t);
  }
  // Nothing leaked.
  (void)t.remove_all(at(now), true);
  (void)t.reclaim(at(now + 3'600'000));
  (void)t.reclaim(at(now + 7'200'000));
  (void)t.remove_all(at(now + 7'200'000), true);
  const auto s = t.stats();
  KVLINK_FUZZ_CHECK(s.objects == 0 && s.in_progress == 0 && s.used == 0 && s.reserved == 0);
  return 0;
}
