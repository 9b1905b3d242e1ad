#include <kvlink/planner/slice_planner.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include <doctest/doctest.h>

namespace {

using kvlink::opcode;
using kvlink::plan_policy;
using kvlink::plan_request;
using kvlink::plan_stats;
using kvlink::segment_id;
using kvlink::slice;

constexpr std::uint64_t kib = 1024;
constexpr std::uint64_t mib = 1024 * 1024;

plan_request req(std::uintptr_t local, std::uint64_t remote, std::uint64_t len,
                 opcode op = opcode::write, std::uint64_t lseg = 1, std::uint64_t rseg = 2) {
  return plan_request{op, local, segment_id{lseg}, segment_id{rseg}, remote, len};
}

std::vector<slice> plan(const std::vector<plan_request>& reqs, const std::vector<double>& weights,
                        const plan_policy& policy = {}, plan_stats* stats = nullptr) {
  std::vector<slice> out;
  const std::error_code ec = kvlink::plan_slices(reqs, weights, policy, out, stats);
  REQUIRE_FALSE(ec);
  return out;
}

std::vector<std::uint64_t> lengths(const std::vector<slice>& s) {
  std::vector<std::uint64_t> v;
  for (const auto& x : s) v.push_back(x.length);
  return v;
}

std::vector<std::uint64_t> lane_bytes(const std::vector<slice>& s, std::size_t lanes) {
  std::vector<std::uint64_t> b(lanes, 0);
  for (const auto& x : s) b.at(x.lane) += x.length;
  return b;
}

bool same(const slice& a, const slice& b) {
  return a.request == b.request && a.lane == b.lane && a.op == b.op &&
         a.local_addr == b.local_addr && a.local_segment == b.local_segment &&
         a.remote_segment == b.remote_segment && a.remote_offset == b.remote_offset &&
         a.length == b.length;
}

bool same(const std::vector<slice>& a, const std::vector<slice>& b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](auto& x, auto& y) { return same(x, y); });
}

}  // namespace

TEST_CASE("one request shorter than a slice is one slice with its fields") {
  const std::vector<plan_request> reqs{req(0x10000, 4096, 300 * kib, opcode::read, 7, 9)};
  plan_stats st;
  const auto out = plan(reqs, {1.0, 1.0}, {}, &st);
  REQUIRE(out.size() == 1);
  CHECK(out[0].request == 0);
  CHECK(out[0].lane == 0);
  CHECK(out[0].op == opcode::read);
  CHECK(out[0].local_addr == 0x10000);
  CHECK(out[0].local_segment == segment_id{7});
  CHECK(out[0].remote_segment == segment_id{9});
  CHECK(out[0].remote_offset == 4096);
  CHECK(out[0].length == 300 * kib);
  CHECK(st.runs == 1);
  CHECK(st.slices == 1);
  CHECK(st.lanes_used == 1);
  CHECK(st.bytes == 300 * kib);
}

TEST_CASE("an exact multiple of the slice size is cut into full slices over every lane") {
  const std::vector<plan_request> reqs{req(0x100000, 0, 4 * mib)};
  plan_stats st;
  const auto out = plan(reqs, {1, 1, 1, 1}, {}, &st);
  REQUIRE(out.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(out[i].length == mib);
    CHECK(out[i].remote_offset == i * mib);
    CHECK(out[i].local_addr == 0x100000 + i * mib);
    CHECK(out[i].lane == i);  // equal weights: fewest bytes first, ties to the lowest index
    CHECK(out[i].request == 0);
  }
  CHECK(st.lanes_used == 4);
}

TEST_CASE("a tail shorter than min_chunk joins the previous slice") {
  const plan_policy p{.slice_size = mib, .min_chunk = 64 * kib, .alignment = 1};
  CHECK(lengths(plan({req(0, 0, 3 * mib + 32 * kib)}, {1}, p)) ==
        std::vector<std::uint64_t>{mib, mib, mib + 32 * kib});
  // A tail of exactly min_chunk stays on its own.
  CHECK(lengths(plan({req(0, 0, 3 * mib + 64 * kib)}, {1}, p)) ==
        std::vector<std::uint64_t>{mib, mib, mib, 64 * kib});
  // min_chunk 0: never merged, slices never exceed slice_size.
  CHECK(lengths(plan({req(0, 0, 2 * mib + 1)}, {1}, {.slice_size = mib, .min_chunk = 0})) ==
        std::vector<std::uint64_t>{mib, mib, 1});
  // A run only a little longer than one slice is one slice.
  CHECK(lengths(plan({req(0, 0, mib + 10)}, {1}, p)) == std::vector<std::uint64_t>{mib + 10});
}

TEST_CASE("interior cuts fall on aligned remote offsets") {
  const plan_policy p{.slice_size = mib, .min_chunk = 64 * kib, .alignment = 4 * kib};
  const auto out = plan({req(0x7000'0000, 100, 3 * mib)}, {1, 1}, p);
  // Cuts at 1, 2 and 3 MiB; the 100-byte tail past 3 MiB joins the last slice.
  CHECK(lengths(out) == std::vector<std::uint64_t>{mib - 100, mib, mib + 100});
  CHECK(out[1].remote_offset == mib);
  CHECK(out[2].remote_offset == 2 * mib);
  // Local addresses follow the remote offsets one to one.
  CHECK(out[1].local_addr == 0x7000'0000 + mib - 100);
  CHECK(out[2].local_addr == 0x7000'0000 + 2 * mib - 100);
}

TEST_CASE("a short unaligned head is extended to the next aligned cut") {
  const plan_policy p{.slice_size = mib, .min_chunk = 64 * kib, .alignment = mib};
  const auto out = plan({req(0, mib - 4 * kib, 3 * mib)}, {1}, p);
  CHECK(lengths(out) == std::vector<std::uint64_t>{mib + 4 * kib, mib, mib - 4 * kib});
  CHECK(out[1].remote_offset == 2 * mib);
  CHECK(out[2].remote_offset == 3 * mib);
}

TEST_CASE("when extending the head would leave a short tail, bounds win over the short head") {
  const plan_policy p{.slice_size = mib, .min_chunk = 512 * kib, .alignment = mib};
  // Extending the 4 KiB head to 2 MiB would leave a 510 KiB tail (< min_chunk);
  // the whole rest (1 MiB + 514 KiB) exceeds slice_size + min_chunk, so the
  // head stays short and the rest is one slice of 1 MiB + 510 KiB.
  const auto out = plan({req(0, mib - 4 * kib, mib + 514 * kib)}, {1}, p);
  CHECK(lengths(out) == std::vector<std::uint64_t>{4 * kib, mib + 510 * kib});
  CHECK(out[1].remote_offset == mib);
  // If the whole rest fits in slice_size + min_chunk, it is one slice.
  CHECK(lengths(plan({req(0, mib - 4 * kib, mib + 200 * kib)}, {1}, p)) ==
        std::vector<std::uint64_t>{mib + 200 * kib});
}

TEST_CASE("adjacent requests contiguous on both sides coalesce into one run") {
  plan_stats st;
  const auto out = plan({req(1000, 0, 100 * kib), req(1000 + 100 * kib, 100 * kib, 100 * kib),
                         req(1000 + 200 * kib, 200 * kib, 100 * kib)},
                        {1, 1}, {}, &st);
  REQUIRE(out.size() == 1);
  CHECK(out[0].length == 300 * kib);
  CHECK(out[0].request == 0);
  CHECK(st.runs == 1);
  CHECK(st.bytes == 300 * kib);

  // A coalesced run longer than a slice is cut across request boundaries.
  const auto big = plan({req(0, 0, 700 * kib), req(700 * kib, 700 * kib, 700 * kib)}, {1, 1});
  CHECK(lengths(big) == std::vector<std::uint64_t>{mib, 376 * kib});
  CHECK(big[1].request == 0);
}

TEST_CASE("requests are not coalesced unless everything matches") {
  const std::uint64_t l = 64 * kib;
  auto runs_of = [](const std::vector<plan_request>& reqs) {
    plan_stats st;
    const auto out = plan(reqs, {1}, {}, &st);
    CHECK(st.slices == out.size());
    return st.runs;
  };
  SUBCASE("only the local side contiguous") {
    CHECK(runs_of({req(0, 0, l), req(l, l + 4096, l)}) == 2);
  }
  SUBCASE("only the remote side contiguous") {
    CHECK(runs_of({req(0, 0, l), req(l + 4096, l, l)}) == 2);
  }
  SUBCASE("different opcode") {
    CHECK(runs_of({req(0, 0, l, opcode::write), req(l, l, l, opcode::read)}) == 2);
  }
  SUBCASE("different local segment") {
    CHECK(runs_of({req(0, 0, l, opcode::write, 1, 2), req(l, l, l, opcode::write, 3, 2)}) == 2);
  }
  SUBCASE("different remote segment") {
    CHECK(runs_of({req(0, 0, l, opcode::write, 1, 2), req(l, l, l, opcode::write, 1, 3)}) == 2);
  }
  SUBCASE("contiguous but not adjacent in input order: no sorting") {
    const auto out = plan({req(0, 0, l), req(10 * mib, 10 * mib, l), req(l, l, l)}, {1});
    REQUIRE(out.size() == 3);
    CHECK(out[0].request == 0);
    CHECK(out[1].request == 1);
    CHECK(out[2].request == 2);
  }
  SUBCASE("backwards contiguity does not merge") {
    CHECK(runs_of({req(l, l, l), req(0, 0, l)}) == 2);
  }
}

TEST_CASE("the second run's slices name its first request") {
  const auto out = plan({req(0, 0, 10), req(100, 100, 10), req(110, 110, 10)}, {1});
  REQUIRE(out.size() == 2);
  CHECK(out[0].request == 0);
  CHECK(out[1].request == 1);
  CHECK(out[1].length == 20);
}

TEST_CASE("lanes get bytes in proportion to their weights") {
  SUBCASE("1:1") {
    const auto out = plan({req(0, 0, 8 * mib)}, {1, 1});
    CHECK(lane_bytes(out, 2) == std::vector<std::uint64_t>{4 * mib, 4 * mib});
    // Alternating, so both lanes work from the start.
    CHECK(out[0].lane == 0);
    CHECK(out[1].lane == 1);
  }
  SUBCASE("3:1") {
    const auto out = plan({req(0, 0, 8 * mib)}, {3, 1});
    CHECK(lane_bytes(out, 2) == std::vector<std::uint64_t>{6 * mib, 2 * mib});
  }
  SUBCASE("1:0.5:0.25") {
    CHECK(lane_bytes(plan({req(0, 0, 7 * mib)}, {1, 0.5, 0.25}), 3) ==
          std::vector<std::uint64_t>{4 * mib, 2 * mib, mib});
    CHECK(lane_bytes(plan({req(0, 0, 70 * mib)}, {1, 0.5, 0.25}), 3) ==
          std::vector<std::uint64_t>{40 * mib, 20 * mib, 10 * mib});
  }
  SUBCASE("one large request uses every lane of a weighted set") {
    plan_stats st;
    plan({req(0, 0, 100 * mib)}, {1, 0.5, 0.25, 2, 1, 1, 0.3, 0.7, 1, 1.5}, {}, &st);
    CHECK(st.lanes_used == 10);
  }
  SUBCASE("weights are relative: scaling them changes nothing") {
    const std::vector<plan_request> reqs{req(0, 0, 5 * mib + 3), req(1 << 30, 1 << 30, 777 * kib)};
    CHECK(same(plan(reqs, {1, 2, 3}), plan(reqs, {10, 20, 30})));
  }
}

TEST_CASE("the fixed-size and the generic stripers choose the same lanes") {
  std::mt19937_64 rng{11};
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<double> w(5);
    for (auto& x : w) x = std::uniform_real_distribution<double>{0.01, 1.0}(rng);
    kvlink::detail::fixed_striper<8> fixed{w};
    kvlink::detail::lane_striper generic{w};
    for (int i = 0; i < 200; ++i) {
      const std::uint64_t len = std::uniform_int_distribution<std::uint64_t>{1, 2 * mib}(rng);
      REQUIRE(fixed.pick(len) == generic.pick(len));
    }
    CHECK(fixed.lanes_used() == generic.lanes_used());
  }
}

TEST_CASE("impossible input: errc::invalid_argument, nothing touched") {
  const std::vector<plan_request> good{req(0, 0, 100)};
  const std::vector<double> one{1.0};
  constexpr auto u64_max = std::numeric_limits<std::uint64_t>::max();
  constexpr auto nan = std::numeric_limits<double>::quiet_NaN();
  constexpr auto inf = std::numeric_limits<double>::infinity();

  struct bad_case {
    const char* name;
    std::vector<plan_request> reqs;
    std::vector<double> weights;
    plan_policy policy;
  };
  const std::vector<bad_case> cases{
      {"no lanes", good, {}, {}},
      {"too many lanes", good, std::vector<double>(kvlink::max_plan_lanes + 1, 1.0), {}},
      {"zero weight", good, {1.0, 0.0}, {}},
      {"negative weight", good, {-1.0}, {}},
      {"NaN weight", good, {1.0, nan}, {}},
      {"infinite weight", good, {inf}, {}},
      {"weights summing to infinity", good, {1e308, 1e308}, {}},
      {"zero-length request", {req(0, 0, 100), req(100, 100, 0)}, one, {}},
      {"local end overflows",
       {req(std::numeric_limits<std::uintptr_t>::max() - 10, 0, 11)},
       one,
       {}},
      {"remote end overflows", {req(0, u64_max - 10, 11)}, one, {}},
      {"total length overflows", {req(0, 0, u64_max / 2 + 1), req(0, 0, u64_max / 2 + 1)}, one, {}},
      {"slice_size 0", good, one, {.slice_size = 0, .min_chunk = 0}},
      {"min_chunk > slice_size", good, one, {.slice_size = 4096, .min_chunk = 4097}},
      {"alignment 0", good, one, {.slice_size = 4096, .min_chunk = 0, .alignment = 0}},
      {"alignment not a power of two",
       good,
       one,
       {.slice_size = 4096 * 3, .min_chunk = 0, .alignment = 3}},
      {"alignment not dividing slice_size",
       good,
       one,
       {.slice_size = 4096, .min_chunk = 0, .alignment = 8192}},
      {"more than 2^32-1 slices", {req(0, 0, u64_max / 2)}, one, {.slice_size = 1, .min_chunk = 0}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    std::vector<slice> out{slice{42, 3, opcode::read, 5, segment_id{6}, segment_id{7}, 8, 9}};
    const auto before = out;
    plan_stats st{1, 2, 3, 4};
    const std::error_code ec = kvlink::plan_slices(c.reqs, c.weights, c.policy, out, &st);
    CHECK(ec == kvlink::errc::invalid_argument);
    CHECK(same(out, before));
    CHECK(st.runs == 1);
    CHECK(st.slices == 2);
    CHECK(st.lanes_used == 3);
    CHECK(st.bytes == 4);
    CHECK_FALSE(kvlink::explain_plan_error(c.reqs, c.weights, c.policy).empty());
  }
  CHECK(kvlink::explain_plan_error(good, one, {}).empty());
  CHECK(kvlink::explain_plan_error(good, {}, {}).find("lane") != std::string_view::npos);
  const std::vector<plan_request> empty_req{req(0, 0, 0)};
  CHECK(kvlink::explain_plan_error(empty_req, one, {}).find("length 0") != std::string_view::npos);
}

TEST_CASE("edge input that is valid") {
  SUBCASE("no requests: success, empty plan") {
    std::vector<slice> out{slice{}};
    plan_stats st{1, 1, 1, 1};
    CHECK_FALSE(kvlink::plan_slices({}, std::vector<double>{1.0}, {}, out, &st));
    CHECK(out.empty());
    CHECK(st.runs == 0);
    CHECK(st.slices == 0);
    CHECK(st.lanes_used == 0);
    CHECK(st.bytes == 0);
  }
  SUBCASE("a request ending exactly at the top of the remote address space") {
    constexpr auto u64_max = std::numeric_limits<std::uint64_t>::max();
    const auto out = plan({req(0, u64_max - 3 * mib, 3 * mib)}, {1, 1},
                          {.slice_size = mib, .min_chunk = 0, .alignment = mib});
    // The start is 1 byte below a MiB boundary and min_chunk is 0: a 1-byte head.
    CHECK(lengths(out) == std::vector<std::uint64_t>{1, mib, mib, mib - 1});
    CHECK(out.back().remote_offset + out.back().length == u64_max);
  }
  SUBCASE("slice_size 1") {
    CHECK(lengths(plan({req(0, 0, 3)}, {1}, {.slice_size = 1, .min_chunk = 1})) ==
          std::vector<std::uint64_t>{1, 1, 1});
  }
}

namespace {

// An independent model of the coalescing rule.
struct ref_run {
  std::uint32_t first;
  opcode op;
  std::uint64_t lseg, rseg;
  std::uintptr_t local;
  std::uint64_t remote;
  std::uint64_t length;
};

std::vector<ref_run> ref_runs(const std::vector<plan_request>& reqs) {
  std::vector<ref_run> runs;
  for (std::uint32_t i = 0; i < reqs.size(); ++i) {
    const auto& r = reqs[i];
    if (!runs.empty()) {
      auto& b = runs.back();
      if (b.op == r.op && b.lseg == r.local_segment.value() && b.rseg == r.remote_segment.value() &&
          b.local + b.length == r.local_addr && b.remote + b.length == r.remote_offset) {
        b.length += r.length;
        continue;
      }
    }
    runs.push_back({i, r.op, r.local_segment.value(), r.remote_segment.value(), r.local_addr,
                    r.remote_offset, r.length});
  }
  return runs;
}

void check_plan(const std::vector<plan_request>& reqs, const std::vector<double>& weights,
                const plan_policy& p) {
  std::vector<slice> out;
  plan_stats st;
  REQUIRE_FALSE(kvlink::plan_slices(reqs, weights, p, out, &st));

  // Determinism: the same input into a vector holding garbage.
  std::vector<slice> again(7, slice{1, 2, opcode::read, 3, segment_id{4}, segment_id{5}, 6, 7});
  REQUIRE_FALSE(kvlink::plan_slices(reqs, weights, p, again, nullptr));
  REQUIRE(same(out, again));

  const auto runs = ref_runs(reqs);
  CHECK(st.runs == runs.size());
  CHECK(st.slices == out.size());

  // Walk the slices run by run: each run is covered exactly once, in order,
  // with local and remote moving together, and nothing else is covered.
  std::size_t k = 0;
  std::uint64_t total = 0, max_slice = 0;
  for (const auto& run : runs) {
    std::uint64_t covered = 0;
    std::size_t first_k = k;
    while (covered < run.length) {
      REQUIRE(k < out.size());
      const slice& s = out[k];
      REQUIRE(s.request == run.first);
      REQUIRE(s.op == run.op);
      REQUIRE(s.local_segment.value() == run.lseg);
      REQUIRE(s.remote_segment.value() == run.rseg);
      REQUIRE(s.remote_offset == run.remote + covered);
      REQUIRE(s.local_addr == run.local + covered);
      REQUIRE(s.length > 0);
      REQUIRE(s.length <= run.length - covered);  // never past the run's end
      REQUIRE(s.length <= p.slice_size + p.min_chunk);
      REQUIRE(s.lane < weights.size());
      if (k != first_k) REQUIRE(s.remote_offset % p.alignment == 0);  // interior cut
      covered += s.length;
      max_slice = std::max(max_slice, s.length);
      ++k;
    }
    const std::size_t n = k - first_k;
    if (n > 1) {
      CHECK(out[k - 1].length >= p.min_chunk);  // tails are merged
      for (std::size_t i = first_k + 1; i + 1 < k; ++i) REQUIRE(out[i].length == p.slice_size);
    }
    if (run.length <= p.slice_size) CHECK(n == 1);
    total += run.length;
  }
  CHECK(k == out.size());
  CHECK(st.bytes == total);

  // Striping: every lane within one (largest) slice of its weight share.
  double weight_sum = 0;
  for (double w : weights) weight_sum += w;
  const auto bytes = lane_bytes(out, weights.size());
  std::uint32_t used = 0;
  for (std::size_t l = 0; l < weights.size(); ++l) {
    const double share = weights[l] / weight_sum * static_cast<double>(total);
    const double dev = std::abs(static_cast<double>(bytes[l]) - share);
    CAPTURE(l);
    CAPTURE(weights[l]);
    CHECK(dev <= static_cast<double>(max_slice) * (1 + 1e-9));
    if (share > static_cast<double>(max_slice)) CHECK(bytes[l] > 0);
    used += bytes[l] > 0 ? 1 : 0;
  }
  CHECK(st.lanes_used == used);
  const bool equal_weights =
      std::all_of(weights.begin(), weights.end(), [&](double w) { return w == weights[0]; });
  if (equal_weights && out.size() >= weights.size()) CHECK(used == weights.size());
}

}  // namespace

TEST_CASE("property: random inputs are covered exactly once, within bounds, striped by weight") {
  for (std::uint64_t seed = 1; seed <= 3000; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 rng{seed};
    auto uni = [&](std::uint64_t lo, std::uint64_t hi) {
      return std::uniform_int_distribution<std::uint64_t>{lo, hi}(rng);
    };

    // Policy: alignment a power of two, slice_size a multiple of it.
    plan_policy p;
    p.alignment = std::uint64_t{1} << uni(0, 16);
    p.slice_size = p.alignment * uni(1, uni(0, 1) ? 4 : 64);
    p.min_chunk = uni(0, 3) == 0 ? 0 : uni(0, p.slice_size);

    // Lanes: 1..12 (covers the fixed 1/2/4/8 stripers and the generic one).
    const std::size_t lanes = uni(1, 12);
    std::vector<double> weights(lanes, 1.0);
    switch (uni(0, 2)) {
      case 0:
        break;  // equal
      case 1:
        for (auto& w : weights) w = std::uniform_real_distribution<double>{0.1, 4.0}(rng);
        break;
      default:
        for (auto& w : weights)
          w = std::pow(10.0, std::uniform_real_distribution<double>{-3, 0}(rng));
    }

    // Requests: runs of contiguous pieces, jumps, op and segment changes,
    // sometimes near the top of the address space.
    const std::size_t n = uni(1, 200);
    std::vector<plan_request> reqs;
    std::uintptr_t local = uni(0, 1) ? uni(0, std::uint64_t{1} << 40) : 0;
    std::uint64_t remote = uni(0, 4) == 0 ? std::numeric_limits<std::uint64_t>::max() / 2 +
                                                uni(0, std::uint64_t{1} << 62)
                                          : uni(0, std::uint64_t{1} << 40);
    opcode op = opcode::write;
    std::uint64_t lseg = 1, rseg = 2;
    const std::uint64_t max_len = std::max<std::uint64_t>(1, p.slice_size * uni(1, 3));
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t len = uni(1, max_len);
      if (remote > std::numeric_limits<std::uint64_t>::max() - len - (std::uint64_t{1} << 32)) {
        remote = uni(0, 1 << 20);
      }
      reqs.push_back({op, local, segment_id{lseg}, segment_id{rseg}, remote, len});
      local += len;
      remote += len;
      switch (uni(0, 9)) {  // what the next request does
        case 0:
          local += uni(1, 4096);  // gap on the local side only
          break;
        case 1:
          remote += uni(1, 4096);  // gap on the remote side only
          break;
        case 2:
          op = op == opcode::write ? opcode::read : opcode::write;
          break;
        case 3:
          lseg = uni(1, 3);
          break;
        case 4:
          rseg = uni(1, 3);
          break;
        default:
          break;  // contiguous: coalesces (unless a segment id came back the same)
      }
    }
    check_plan(reqs, weights, p);
  }
}

TEST_CASE("property: one large run per plan uses every lane in proportion") {
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 rng{seed * 7919};
    const std::size_t lanes = std::uniform_int_distribution<std::size_t>{1, 16}(rng);
    std::vector<double> weights(lanes);
    for (auto& w : weights) w = std::uniform_real_distribution<double>{0.25, 1.0}(rng);
    const plan_policy p{.slice_size = 64 * kib, .min_chunk = 4 * kib, .alignment = 4 * kib};
    // At least 8 slices per lane: every lane's share is several slices.
    const std::uint64_t len = std::uniform_int_distribution<std::uint64_t>{
        lanes * 32 * 64 * kib, lanes * 64 * 64 * kib}(rng);
    plan_stats st;
    plan({req(0, std::uniform_int_distribution<std::uint64_t>{0, 1 << 20}(rng), len)}, weights, p,
         &st);
    CHECK(st.lanes_used == lanes);
    check_plan({req(0, 0, len)}, weights, p);
  }
}

TEST_CASE("destinations_overlap: a shared byte in one space and segment, never touching ranges") {
  using kvlink::destination_range;
  const auto overlap = [](std::vector<destination_range> v) {
    return kvlink::destinations_overlap(v);
  };
  CHECK_FALSE(overlap({}));
  CHECK_FALSE(overlap({{1, 1, 0, 100}}));
  CHECK_FALSE(overlap({{1, 1, 100, 100}, {1, 1, 0, 100}}));        // touching
  CHECK(overlap({{1, 1, 100, 100}, {1, 1, 0, 101}}));              // one byte
  CHECK(overlap({{1, 1, 0, 1000}, {1, 1, 10, 1}}));                // inside
  CHECK(overlap({{1, 1, 0, 10}, {1, 1, 20, 5}, {1, 1, 5, 100}}));  // not adjacent in input
  CHECK(overlap({{1, 1, 7, 3}, {1, 1, 7, 3}}));                    // the same range twice
  CHECK_FALSE(overlap({{1, 1, 0, 100}, {1, 2, 0, 100}}));          // another segment
  CHECK_FALSE(overlap({{1, 1, 0, 100}, {2, 1, 0, 100}}));          // another peer
  CHECK_FALSE(overlap({{0, 0, 0x1000, 16}, {0, 0, 0x1010, 16}}));  // local, touching
  CHECK(overlap({{0, 0, 0x1000, 17}, {0, 0, 0x1010, 16}}));
  // A long range that covers a later one that its successor does not.
  CHECK(overlap({{1, 1, 0, 1000}, {1, 1, 10, 5}, {1, 1, 500, 5}}));
  CHECK(overlap({{1, 1, ~0ull - 10, 10}, {1, 1, ~0ull - 5, 5}}));  // at the top of the range

  // 10^5 disjoint ranges, shuffled, and one more that overlaps the middle.
  std::vector<destination_range> many;
  for (std::uint64_t i = 0; i < 100000; ++i) many.push_back({1, 3, i * 4096, 4096});
  std::mt19937_64 g{5};
  std::shuffle(many.begin(), many.end(), g);
  CHECK_FALSE(overlap(many));
  many.push_back({1, 3, 50000 * 4096 + 4095, 2});
  CHECK(overlap(many));
}

TEST_CASE(
    "destinations_overlap: large batches (radix-sorted keys) agree with a sort of the ranges") {
  using kvlink::destination_range;
  // The answer of the rule itself: sort by (space, segment, offset), look
  // at neighbours.
  const auto reference = [](std::vector<destination_range> v) {
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
      return std::tie(a.space, a.segment, a.offset) < std::tie(b.space, b.segment, b.offset);
    });
    for (std::size_t i = 1; i < v.size(); ++i) {
      if (v[i].space == v[i - 1].space && v[i].segment == v[i - 1].segment &&
          v[i].offset - v[i - 1].offset < v[i - 1].length) {
        return true;
      }
    }
    return false;
  };
  std::mt19937_64 g{11};
  std::vector<std::uint64_t> scratch;  // kept from one call to the next, as the engine does
  int overlapping = 0;
  for (int round = 0; round < 200; ++round) {
    // Pieces of varying lengths laid out in order with gaps (or not), then
    // perhaps one moved onto another, then shuffled.
    const std::size_t n = 1024 + g() % 3000;
    const std::uint64_t base = round % 4 == 0 ? ~0ull - (n << 22) : (g() % (1ull << 40));
    std::vector<destination_range> v;
    std::uint64_t at = base;
    for (std::size_t i = 0; i < n; ++i) {
      // Every seventh round aligned to 256 bytes (keys without those bits).
      const std::uint64_t align = round % 7 == 0 ? 256 : 1;
      const std::uint64_t len = align * (1 + g() % (round % 3 == 0 ? 8192 : 64));
      v.push_back({7, 9, at, len});
      at += len + align * (g() % 2 == 0 ? 0 : g() % 100);
    }
    if (round % 2 == 0) {
      auto& victim = v[g() % n];
      const auto& onto = v[g() % n];
      victim.offset = onto.offset + g() % onto.length;  // shares at least one byte, or itself
      if (&victim == &onto) victim.length = onto.length;
    }
    if (round % 5 == 0 && round % 4 != 0) {
      v[g() % n].length = 1ull << 40;  // long: covers far pieces, or not (std::sort's path)
    }
    std::shuffle(v.begin(), v.end(), g);
    const bool want = reference(v);
    overlapping += want ? 1 : 0;
    auto copy = v;
    INFO("round " << round);
    CHECK(kvlink::destinations_overlap(copy, scratch) == want);
    CHECK(kvlink::destinations_overlap(v) == want);
  }
  CHECK(overlapping > 50);  // both answers were asked for
  CHECK(overlapping < 190);

  // Ranges near the top of the address space, and one past another's end
  // by one byte (touching) or inside it.
  std::vector<destination_range> top;
  for (std::uint64_t i = 0; i < 2000; ++i) top.push_back({0, 0, ~0ull - (i + 1) * 64, 64});
  std::shuffle(top.begin(), top.end(), g);
  CHECK_FALSE(kvlink::destinations_overlap(top, scratch));
  top.push_back({0, 0, ~0ull - 64 * 1000 + 63, 1});
  CHECK(kvlink::destinations_overlap(top, scratch));

  // Two segments (std::sort's path): the same offsets do not overlap.
  std::vector<destination_range> two;
  for (std::uint64_t i = 0; i < 3000; ++i) two.push_back({1, i % 2, (i / 2) * 4096, 4096});
  std::shuffle(two.begin(), two.end(), g);
  CHECK_FALSE(kvlink::destinations_overlap(two, scratch));
  two.push_back({1, 1, 4096 * 10 + 1, 4096});
  CHECK(kvlink::destinations_overlap(two, scratch));
}
