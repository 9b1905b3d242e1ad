// Tests of the RDMA data path's decisions (include/kvlink/rdma/path_logic.hpp),
// the peer-descriptor helpers of include/kvlink/rdma/transport.hpp
// (parse_remote_ports, pair_ports) and kvlink::rdma_engine on a machine
// without RDMA devices (TCP fallback, or a clean errc::no_device). No device
// is needed.
#include <kvlink/rdma.hpp>
#include <kvlink/rdma/path_logic.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "../../support/test_support.hpp"
#include "verbs_devices.hpp"
#include <asio/io_context.hpp>
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

namespace rdma = kvlink::rdma;
using namespace std::chrono_literals;
using json = nlohmann::json;
using rdma::failure_kind;
using rdma::rail_health;
using rdma::rail_state;
using rdma::slice_fate;

namespace {

const std::error_code rail_error = rdma::make_wc_error(IBV_WC_RETRY_EXC_ERR);

// A rail_health brought to `active`; returns its generation.
std::uint32_t make_active(rail_health& r) {
  const auto gen = r.begin_connect();
  REQUIRE(gen.has_value());
  REQUIRE(r.connected(*gen));
  REQUIRE(r.state() == rail_state::active);
  return *gen;
}

}  // namespace

// ------------------------------------------------------------- rail_health

TEST_CASE("rail_health: idle -> connecting -> active, guarded by the generation") {
  rail_health r;
  CHECK(r.state() == rail_state::idle);
  CHECK_FALSE(r.usable());
  CHECK(r.generation() == 0);
  CHECK(r.failures() == 0);
  CHECK(r.backoff() == 0ms);

  // connected() before any attempt: no change.
  CHECK_FALSE(r.connected(0));
  CHECK(r.state() == rail_state::idle);

  const auto g1 = r.begin_connect();
  REQUIRE(g1.has_value());
  CHECK(*g1 == 1);
  CHECK(r.generation() == 1);
  CHECK(r.state() == rail_state::connecting);
  CHECK_FALSE(r.usable());

  // Only idle may begin a connection attempt.
  CHECK_FALSE(r.begin_connect().has_value());
  CHECK(r.generation() == 1);

  // A stale generation does not connect it.
  CHECK_FALSE(r.connected(*g1 + 1));
  CHECK_FALSE(r.connected(0));
  CHECK(r.state() == rail_state::connecting);

  CHECK(r.connected(*g1));
  CHECK(r.state() == rail_state::active);
  CHECK(r.usable());

  // Only from connecting: a second answer changes nothing.
  CHECK_FALSE(r.connected(*g1));
  CHECK(r.state() == rail_state::active);
  CHECK_FALSE(r.begin_connect().has_value());
  CHECK_FALSE(r.resume());
  CHECK(r.state() == rail_state::active);
}

TEST_CASE("rail_health: failures pause with an exponential, capped backoff") {
  rail_health r{100ms, 1000ms};
  const std::chrono::milliseconds expect[] = {100ms,  200ms,  400ms,  800ms,
                                              1000ms, 1000ms, 1000ms, 1000ms};
  unsigned n = 0;
  for (const auto want : expect) {
    ++n;
    CAPTURE(n);
    const auto gen = r.begin_connect();
    REQUIRE(gen.has_value());
    const auto backoff = r.failed(*gen, rail_error);
    REQUIRE(backoff.has_value());
    CHECK(*backoff == want);
    CHECK(r.backoff() == want);
    CHECK(r.state() == rail_state::paused);
    CHECK_FALSE(r.usable());
    CHECK(r.failures() == n);
    CHECK(r.last_error() == rail_error);
    // A paused rail first waits out its backoff.
    CHECK_FALSE(r.begin_connect().has_value());
    // Failing again while paused: ignored, no extra failure counted.
    CHECK_FALSE(r.failed(*gen, rail_error).has_value());
    CHECK(r.failures() == n);
    CHECK(r.resume());
    CHECK(r.state() == rail_state::idle);
    CHECK_FALSE(r.resume());
    // Failing while idle: ignored.
    CHECK_FALSE(r.failed(r.generation(), rail_error).has_value());
    CHECK(r.state() == rail_state::idle);
  }

  // Many failures: the shift is bounded, the backoff stays at max.
  for (int i = 0; i < 40; ++i) {
    const auto gen = r.begin_connect();
    REQUIRE(gen.has_value());
    REQUIRE(r.failed(*gen, rail_error) == std::optional{1000ms});
    REQUIRE(r.resume());
  }
  CHECK(r.failures() == 48);
  CHECK(r.backoff() == 1000ms);

  // Connecting resets the count.
  const auto gen = r.begin_connect();
  REQUIRE(gen.has_value());
  CHECK(r.connected(*gen));
  CHECK(r.failures() == 0);
  CHECK(r.backoff() == 0ms);
  // The active rail fails: the first failure again, base backoff.
  const auto b = r.failed(*gen, rail_error);
  REQUIRE(b.has_value());
  CHECK(*b == 100ms);
  CHECK(r.failures() == 1);
}

TEST_CASE("rail_health: default backoff is 100 ms doubling up to 5 s") {
  rail_health r;
  std::vector<std::chrono::milliseconds> got;
  for (int i = 0; i < 8; ++i) {
    const auto gen = r.begin_connect();
    REQUIRE(gen.has_value());
    const auto b = r.failed(*gen, rail_error);
    REQUIRE(b.has_value());
    got.push_back(*b);
    REQUIRE(r.resume());
  }
  const std::vector<std::chrono::milliseconds> want{100ms,  200ms,  400ms,  800ms,
                                                    1600ms, 3200ms, 5000ms, 5000ms};
  CHECK(got == want);
}

TEST_CASE("rail_health: a stale generation's failure is ignored") {
  rail_health r{50ms, 400ms};
  const auto g1 = make_active(r);
  CHECK_FALSE(r.failed(g1 + 1, rail_error).has_value());
  CHECK_FALSE(r.failed(g1 - 1, rail_error).has_value());
  CHECK(r.state() == rail_state::active);
  CHECK(r.failures() == 0);
  CHECK_FALSE(r.last_error());

  REQUIRE(r.failed(g1, rail_error) == std::optional{50ms});
  REQUIRE(r.resume());
  const auto g2 = r.begin_connect();
  REQUIRE(g2.has_value());
  CHECK(*g2 == g1 + 1);
  // The old attempt's failure arriving late does not touch the new one.
  CHECK_FALSE(r.failed(g1, rail_error).has_value());
  CHECK(r.state() == rail_state::connecting);
  CHECK(r.failures() == 1);
}

TEST_CASE("rail_health: a failure that does not count gives no backoff") {
  rail_health r{100ms, 5000ms};
  // Two counted failures first.
  for (int i = 0; i < 2; ++i) {
    const auto gen = r.begin_connect();
    REQUIRE(gen.has_value());
    REQUIRE(r.failed(*gen, rail_error).has_value());
    REQUIRE(r.resume());
  }
  REQUIRE(r.failures() == 2);

  const auto gen = r.begin_connect();
  REQUIRE(gen.has_value());
  const std::error_code bad_request = rdma::make_wc_error(IBV_WC_REM_ACCESS_ERR);
  const auto b = r.failed(*gen, bad_request, /*counts=*/false);
  REQUIRE(b.has_value());
  CHECK(*b == 0ms);
  CHECK(r.state() == rail_state::paused);
  CHECK(r.failures() == 2);  // not incremented
  CHECK(r.last_error() == bad_request);
  CHECK(r.resume());

  // From active, too; connected() had reset the count.
  const auto g = make_active(r);
  CHECK(r.failures() == 0);
  REQUIRE(r.failed(g, bad_request, false) == std::optional{0ms});
  CHECK(r.failures() == 0);
  CHECK(r.backoff() == 0ms);
  CHECK(r.state() == rail_state::paused);
}

TEST_CASE("rail_health: a late reply to an abandoned attempt is ignored") {
  rail_health r{10ms, 100ms};
  const auto g1 = r.begin_connect();
  REQUIRE(g1.has_value());
  // The attempt times out (counted as a failure), the rail backs off and
  // tries again.
  REQUIRE(r.failed(*g1, make_error_code(kvlink::errc::deadline_exceeded)).has_value());
  REQUIRE(r.resume());
  const auto g2 = r.begin_connect();
  REQUIRE(g2.has_value());
  CHECK(*g2 != *g1);
  // Now the peer's answer to the first attempt arrives.
  CHECK_FALSE(r.connected(*g1));
  CHECK(r.state() == rail_state::connecting);
  CHECK_FALSE(r.usable());
  CHECK(r.failures() == 1);
  // The answer to the current attempt connects it.
  CHECK(r.connected(*g2));
  CHECK(r.usable());
  CHECK(r.failures() == 0);
  // A late reply while active changes nothing either.
  CHECK_FALSE(r.connected(*g1));
  CHECK(r.state() == rail_state::active);
}

TEST_CASE("rail_state names") {
  CHECK(rdma::to_string(rail_state::idle) == "idle");
  CHECK(rdma::to_string(rail_state::connecting) == "connecting");
  CHECK(rdma::to_string(rail_state::active) == "active");
  CHECK(rdma::to_string(rail_state::paused) == "paused");
}

// ------------------------------------------------------- classify, fate_of

TEST_CASE("classify: what a failed work completion says about the rail") {
  CHECK(rdma::classify(IBV_WC_WR_FLUSH_ERR) == failure_kind::flushed);

  for (const auto s :
       {IBV_WC_REM_ACCESS_ERR, IBV_WC_LOC_PROT_ERR, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_ACCESS_ERR,
        IBV_WC_MW_BIND_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_OP_ERR}) {
    CAPTURE(ibv_wc_status_str(s));
    CHECK(rdma::classify(s) == failure_kind::request);
  }
  for (const auto s :
       {IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_LOC_QP_OP_ERR, IBV_WC_BAD_RESP_ERR,
        IBV_WC_REM_ABORT_ERR, IBV_WC_FATAL_ERR, IBV_WC_RESP_TIMEOUT_ERR, IBV_WC_GENERAL_ERR}) {
    CAPTURE(ibv_wc_status_str(s));
    CHECK(rdma::classify(s) == failure_kind::rail);
  }
  static_assert(rdma::classify(IBV_WC_RETRY_EXC_ERR) == failure_kind::rail);
}

TEST_CASE("fate_of: retry unless wrong request, stopping transfer or out of tries") {
  constexpr unsigned max_tries = 3;
  for (const auto k : {failure_kind::rail, failure_kind::flushed}) {
    CAPTURE(static_cast<int>(k));
    CHECK(rdma::fate_of(k, 1, max_tries, false) == slice_fate::retry);
    CHECK(rdma::fate_of(k, 2, max_tries, false) == slice_fate::retry);
    CHECK(rdma::fate_of(k, 3, max_tries, false) == slice_fate::fail);
    CHECK(rdma::fate_of(k, 4, max_tries, false) == slice_fate::fail);
    CHECK(rdma::fate_of(k, 1, max_tries, true) == slice_fate::fail);
    CHECK(rdma::fate_of(k, 0, 0, false) == slice_fate::fail);
  }
  CHECK(rdma::fate_of(failure_kind::request, 1, max_tries, false) == slice_fate::fail);
  CHECK(rdma::fate_of(failure_kind::request, 0, 100, false) == slice_fate::fail);
  CHECK(rdma::fate_of(failure_kind::request, 1, max_tries, true) == slice_fate::fail);
  // Straight from a completion status.
  CHECK(rdma::fate_of(rdma::classify(IBV_WC_REM_ACCESS_ERR), 1, 4, false) == slice_fate::fail);
  CHECK(rdma::fate_of(rdma::classify(IBV_WC_WR_FLUSH_ERR), 1, 4, false) == slice_fate::retry);
  CHECK(rdma::fate_of(rdma::classify(IBV_WC_RNR_RETRY_EXC_ERR), 1, 4, false) == slice_fate::retry);
}

// ----------------------------------------------------------------- pick_qp

TEST_CASE("pick_qp: the usable queue pair with room and the fewest bytes") {
  using rdma::qp_load;
  auto qp = [](bool usable, std::uint32_t out, std::uint32_t max, std::uint64_t bytes,
               bool cq_full) {
    qp_load q;
    q.usable = usable;
    q.outstanding = out;
    q.max_outstanding = max;
    q.bytes = bytes;
    q.cq_full = cq_full;
    return q;
  };

  SUBCASE("none") {
    CHECK_FALSE(rdma::pick_qp({}).has_value());
    const std::vector<qp_load> qps{qp(false, 0, 8, 0, false), qp(true, 8, 8, 100, false),
                                   qp(true, 0, 8, 0, true), qp(true, 0, 0, 0, false)};
    CHECK_FALSE(rdma::pick_qp(qps).has_value());
    // A default qp_load is not usable.
    const std::vector<qp_load> defaults(3);
    CHECK_FALSE(rdma::pick_qp(defaults).has_value());
  }
  SUBCASE("least bytes wins") {
    const std::vector<qp_load> qps{qp(true, 3, 8, 300, false), qp(true, 5, 8, 200, false),
                                   qp(true, 1, 8, 250, false)};
    CHECK(rdma::pick_qp(qps) == std::optional<std::size_t>{1});
  }
  SUBCASE("skips unusable, full and cq_full even when they have fewer bytes") {
    const std::vector<qp_load> qps{qp(false, 0, 8, 0, false), qp(true, 8, 8, 10, false),
                                   qp(true, 0, 8, 5, true), qp(true, 2, 8, 900, false),
                                   qp(true, 7, 8, 800, false)};
    CHECK(rdma::pick_qp(qps) == std::optional<std::size_t>{4});
  }
  SUBCASE("first on ties") {
    const std::vector<qp_load> qps{qp(false, 0, 8, 0, false), qp(true, 1, 8, 64, false),
                                   qp(true, 0, 8, 64, false), qp(true, 0, 8, 64, false)};
    CHECK(rdma::pick_qp(qps) == std::optional<std::size_t>{1});
  }
}

TEST_CASE("pick_qp: equal slices spread evenly over 2 rails x 2 queue pairs") {
  constexpr std::uint64_t slice = 1 << 20;
  constexpr std::size_t n = 64;
  std::vector<rdma::qp_load> qps(4);
  for (auto& q : qps) {
    q.usable = true;
    q.max_outstanding = 256;
  }
  std::array<std::size_t, 4> count{};
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < n; ++i) {
    const auto pick = rdma::pick_qp(qps);
    REQUIRE(pick.has_value());
    ++qps[*pick].outstanding;
    qps[*pick].bytes += slice;
    ++count[*pick];
    order.push_back(*pick);
  }
  for (std::size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(count[i] == n / 4);
    CHECK(qps[i].bytes == n / 4 * slice);
  }
  // Consecutive slices go round every queue pair (first on ties).
  for (std::size_t i = 0; i < n; ++i) CHECK(order[i] == i % 4);

  // One rail (queue pairs 2 and 3) goes down: the rest go to the other rail only.
  qps[2].usable = qps[3].usable = false;
  for (std::size_t i = 0; i < 8; ++i) {
    const auto pick = rdma::pick_qp(qps);
    REQUIRE(pick.has_value());
    CHECK(*pick < 2);
    qps[*pick].bytes += slice;
    ++count[*pick];
  }
  CHECK(count[0] == n / 4 + 4);
  CHECK(count[1] == n / 4 + 4);
}

TEST_CASE("pick_qp: a queue pair at max_outstanding takes nothing until one completes") {
  std::vector<rdma::qp_load> qps(2);
  for (auto& q : qps) {
    q.usable = true;
    q.max_outstanding = 2;
  }
  // Second QP is heavy in bytes but the first fills up.
  qps[1].bytes = 1000;
  for (int i = 0; i < 2; ++i) {
    const auto p = rdma::pick_qp(qps);
    REQUIRE(p == std::optional<std::size_t>{0});
    ++qps[0].outstanding;
    qps[0].bytes += 10;
  }
  REQUIRE(rdma::pick_qp(qps) == std::optional<std::size_t>{1});
  qps[1].outstanding = 2;
  CHECK_FALSE(rdma::pick_qp(qps).has_value());
  --qps[0].outstanding;  // one completes
  qps[0].bytes -= 10;
  CHECK(rdma::pick_qp(qps) == std::optional<std::size_t>{0});
  qps[0].cq_full = true;  // but its completion queue is full
  CHECK_FALSE(rdma::pick_qp(qps).has_value());
}

// ------------------------------------------------------------ keep_waiting

TEST_CASE("keep_waiting: while some rail may still carry the slices") {
  auto check = [](std::vector<rail_health*> rails) {
    std::vector<const rail_health*> c(rails.begin(), rails.end());
    return rdma::keep_waiting(std::span<const rail_health* const>(c));
  };
  auto paused_with = [](rail_health& r, unsigned failures) {
    for (unsigned i = 0; i < failures; ++i) {
      if (r.state() == rail_state::paused) REQUIRE(r.resume());
      const auto gen = r.begin_connect();
      REQUIRE(gen.has_value());
      REQUIRE(r.failed(*gen, rail_error).has_value());
    }
    REQUIRE(r.state() == rail_state::paused);
    REQUIRE(r.failures() == failures);
  };

  CHECK_FALSE(check({}));

  rail_health idle;
  rail_health connecting;
  REQUIRE(connecting.begin_connect().has_value());
  rail_health active;
  make_active(active);
  rail_health once;
  paused_with(once, 1);
  rail_health twice;
  paused_with(twice, 2);
  rail_health thrice;
  paused_with(thrice, 3);

  CHECK(check({&idle}));
  CHECK(check({&connecting}));
  CHECK(check({&active}));
  CHECK(check({&once}));
  CHECK_FALSE(check({&twice}));
  CHECK_FALSE(check({&twice, &thrice}));
  CHECK(check({&twice, &thrice, &once}));
  CHECK(check({&twice, &thrice, &active}));
  CHECK(check({&thrice, &connecting}));
  CHECK(check({&idle, &twice}));

  // A paused rail whose failure did not count may connect again at once.
  rail_health uncounted;
  const auto gen = uncounted.begin_connect();
  REQUIRE(gen.has_value());
  REQUIRE(uncounted.failed(*gen, rail_error, false).has_value());
  CHECK(check({&uncounted, &twice}));

  // The once-failed rail reconnects and fails again: no more waiting.
  REQUIRE(once.resume());
  const auto g = once.begin_connect();
  REQUIRE(g.has_value());
  CHECK(check({&once, &twice}));  // connecting
  REQUIRE(once.failed(*g, rail_error).has_value());
  CHECK_FALSE(check({&once, &twice}));
}

// ------------------------------------------------- chains and retirement

TEST_CASE("chain_limits: a chain ends at its work-request count or its bytes") {
  const rdma::chain_limits c{16, 256 << 10};
  CHECK_FALSE(c.full(1, 4096));
  CHECK_FALSE(c.full(15, 15 * 4096));
  CHECK(c.full(16, 16 * 4096));  // 4 KiB pieces: 16 share a completion
  CHECK_FALSE(c.full(3, 3 * 65536));
  CHECK(c.full(4, 4 * 65536));  // 64 KiB slices: 4 per chain
  CHECK(c.full(1, 1 << 20));    // a 1 MiB slice keeps its own completion
  const rdma::chain_limits one{1};
  CHECK(one.full(1, 1));  // rdma_chain = 1: each slice signaled on its own
  CHECK(rdma::chain_limits{}.max_wrs == 16);
  CHECK(rdma::chain_limits{}.max_bytes == 256 << 10);
}

TEST_CASE("retired_by: a completion ends every work request up to its own") {
  const std::deque<std::uint64_t> posted{7, 8, 9, 12, 13};
  const auto id = [](std::uint64_t x) { return x; };
  CHECK(rdma::retired_by(posted, 7, id) == 1);
  CHECK(rdma::retired_by(posted, 9, id) == 3);
  CHECK(rdma::retired_by(posted, 13, id) == 5);
  CHECK(rdma::retired_by(posted, 10, id) == 0);  // stale: not this queue pair's
  CHECK(rdma::retired_by(std::deque<std::uint64_t>{}, 1, id) == 0);
}

namespace {

// A toy of path's chained posting over queue pairs of one rail: slices are
// staged per queue pair (pick_qp), posted as chains whose last work request
// alone is signaled (chain_limits), and completed in order per queue pair;
// a completion retires retired_by() work requests. On an error the failing
// one and the rest of that queue pair go back to the queue.
struct chain_sim {
  struct wr {
    std::size_t slice = 0;
    std::uint64_t id = 0;
    bool signaled = false;
  };
  struct qp {
    std::deque<wr> posted;
    std::vector<wr> staged;
  };
  std::vector<qp> qps;
  std::deque<std::size_t> queue;
  std::vector<unsigned> ended;  // per slice
  std::vector<unsigned> tries;
  rdma::chain_limits limits;
  std::uint32_t max_wr;
  std::uint64_t next_id = 0;
  std::size_t posts = 0;  // ibv_post_send calls

  chain_sim(std::size_t n_qps, std::size_t n_slices, std::uint32_t chain, std::uint32_t max)
      : qps(n_qps), ended(n_slices), tries(n_slices), limits{chain}, max_wr(max) {
    for (std::size_t i = 0; i < n_slices; ++i) queue.push_back(i);
  }

  void post(qp& q) {
    if (q.staged.empty()) return;
    q.staged.back().signaled = true;
    for (const auto& w : q.staged) q.posted.push_back(w);
    q.staged.clear();
    ++posts;
  }

  void pump() {
    while (!queue.empty()) {
      std::vector<rdma::qp_load> loads(qps.size());
      for (std::size_t i = 0; i < qps.size(); ++i) {
        loads[i] = {true, static_cast<std::uint32_t>(qps[i].posted.size() + qps[i].staged.size()),
                    max_wr, (qps[i].posted.size() + qps[i].staged.size()) * 4096, false};
      }
      const auto pick = rdma::pick_qp(loads);
      if (!pick) break;
      auto& q = qps[*pick];
      const auto s = queue.front();
      queue.pop_front();
      ++tries[s];
      q.staged.push_back({s, ++next_id, false});
      if (limits.full(q.staged.size(), q.staged.size() * 4096)) post(q);
    }
    for (auto& q : qps) post(q);
    // Never an unsignaled work request last on a queue pair.
    for (const auto& q : qps) {
      if (!q.posted.empty()) CHECK(q.posted.back().signaled);
    }
  }

  // The device completes queue pair i's oldest signaled work request.
  void complete(std::size_t i) {
    auto& q = qps[i];
    const auto it =
        std::find_if(q.posted.begin(), q.posted.end(), [](const wr& w) { return w.signaled; });
    REQUIRE(it != q.posted.end());
    const auto n = rdma::retired_by(q.posted, it->id, [](const wr& w) { return w.id; });
    REQUIRE(n == static_cast<std::size_t>(it - q.posted.begin()) + 1);
    for (std::size_t k = 0; k < n; ++k) {
      ++ended[q.posted.front().slice];
      q.posted.pop_front();
    }
  }

  // Queue pair i's work request at `pos` (signaled or not) fails: those
  // before it are done, it and the rest are retried (in their order).
  void fail_at(std::size_t i, std::size_t pos) {
    auto& q = qps[i];
    REQUIRE(pos < q.posted.size());
    const auto n = rdma::retired_by(q.posted, q.posted[pos].id, [](const wr& w) { return w.id; });
    REQUIRE(n == pos + 1);
    for (std::size_t k = 0; k + 1 < n; ++k) {
      ++ended[q.posted.front().slice];
      q.posted.pop_front();
    }
    for (auto it = q.posted.rbegin(); it != q.posted.rend(); ++it) queue.push_front(it->slice);
    q.posted.clear();
  }

  bool idle() const {
    if (!queue.empty()) return false;
    for (const auto& q : qps)
      if (!q.posted.empty() || !q.staged.empty()) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("chained posting: one post and one completion per chain, every slice ends once") {
  chain_sim s{2, 2000, 16, 256};
  s.pump();
  // 2 x 256 posted as chains of 16: 32 posts; 16 completions retire them all.
  CHECK(s.posts == 32);
  CHECK(s.queue.size() == 2000 - 512);
  int completions = 0;
  while (!s.idle()) {
    for (std::size_t i = 0; i < s.qps.size(); ++i) {
      if (!s.qps[i].posted.empty()) {
        s.complete(i);
        ++completions;
      }
    }
    s.pump();
  }
  // One per 16 slices, but for the last pass's shorter chains.
  CHECK(completions >= 2000 / 16);
  CHECK(completions <= 2000 / 16 + 2);
  for (std::size_t i = 0; i < s.ended.size(); ++i) {
    CAPTURE(i);
    CHECK(s.ended[i] == 1);
    CHECK(s.tries[i] == 1);
  }
}

TEST_CASE("chained posting: an error on an unsignaled work request in mid-chain") {
  chain_sim s{2, 100, 16, 32};
  s.pump();
  // Queue pair 0's 6th work request fails: 5 done, the rest retried.
  s.fail_at(0, 5);
  s.pump();
  while (!s.idle()) {
    for (std::size_t i = 0; i < s.qps.size(); ++i) {
      if (!s.qps[i].posted.empty()) s.complete(i);
    }
    s.pump();
  }
  unsigned retried = 0;
  for (std::size_t i = 0; i < s.ended.size(); ++i) {
    CAPTURE(i);
    CHECK(s.ended[i] == 1);
    if (s.tries[i] == 2) ++retried;
  }
  CHECK(retried == 32 - 5);
}

TEST_CASE("chained posting: rdma_chain = 1 posts and signals each slice") {
  chain_sim s{2, 40, 1, 8};
  s.pump();
  CHECK(s.posts == 16);
  for (const auto& q : s.qps)
    for (const auto& w : q.posted) CHECK(w.signaled);
}

// -------------------------------------- fan-in / retry accounting simulation

namespace {

// A toy of path's bookkeeping: rails with one queue pair each, slices queued,
// posted through pick_qp(), completed one per rail per step, and on a rail
// failure the failing slice gets the failure's status, the rest of that
// rail's slices are flushed, and each is retried or failed by fate_of().
struct sim {
  struct slice_rec {
    unsigned tries = 0;
    unsigned ended = 0;  // how many times it was reported done or failed
    bool done = false;
    bool failed = false;
    std::error_code ec;
  };
  struct rail_rec {
    rail_health health{std::chrono::milliseconds{10}, std::chrono::milliseconds{100}};
    std::uint32_t gen = 0;
    std::deque<std::size_t> posted;
  };

  std::vector<slice_rec> slices;
  std::vector<rail_rec> rails;
  std::deque<std::size_t> queue;
  unsigned max_tries;
  std::uint64_t slice_bytes = 4096;
  std::uint32_t max_wr;

  sim(std::size_t n_rails, std::size_t n_slices, std::uint32_t max_wr_per_qp)
      : slices(n_slices),
        rails(n_rails),
        max_tries(static_cast<unsigned>(n_rails) + 1),
        max_wr(max_wr_per_qp) {
    for (auto& r : rails) r.gen = make_active(r.health);
    for (std::size_t i = 0; i < n_slices; ++i) queue.push_back(i);
  }

  void end(std::size_t s, std::error_code ec) {
    auto& rec = slices[s];
    ++rec.ended;
    (ec ? rec.failed : rec.done) = true;
    rec.ec = ec;
  }

  std::vector<const rail_health*> health() const {
    std::vector<const rail_health*> out;
    for (const auto& r : rails) out.push_back(&r.health);
    return out;
  }

  void pump() {
    while (!queue.empty()) {
      std::vector<rdma::qp_load> qps(rails.size());
      for (std::size_t i = 0; i < rails.size(); ++i) {
        qps[i].usable = rails[i].health.usable();
        qps[i].outstanding = static_cast<std::uint32_t>(rails[i].posted.size());
        qps[i].max_outstanding = max_wr;
        qps[i].bytes = rails[i].posted.size() * slice_bytes;
      }
      const auto pick = rdma::pick_qp(qps);
      if (!pick) break;
      const auto s = queue.front();
      queue.pop_front();
      ++slices[s].tries;
      rails[*pick].posted.push_back(s);
    }
    // Nothing can carry them any more: they fail with the last error.
    const auto h = health();
    if (!queue.empty() && !rdma::keep_waiting(std::span<const rail_health* const>(h))) {
      std::error_code last;
      for (const auto& r : rails) {
        if (r.health.last_error()) last = r.health.last_error();
      }
      for (const auto s : queue) end(s, last);
      queue.clear();
    }
  }

  // Rail `r` fails: its oldest work request with `status`, the rest flushed.
  void fail_rail(std::size_t r, ibv_wc_status status) {
    auto& rail = rails[r];
    auto posted = std::move(rail.posted);
    rail.posted.clear();
    const auto ec = rdma::make_wc_error(status);
    bool first = true;
    for (const auto s : posted) {
      const auto st = first ? status : IBV_WC_WR_FLUSH_ERR;
      first = false;
      const auto kind = rdma::classify(st);
      if (rdma::fate_of(kind, slices[s].tries, max_tries, false) == slice_fate::retry) {
        queue.push_back(s);
      } else {
        end(s, rdma::make_wc_error(st));
      }
    }
    REQUIRE(
        rail.health.failed(rail.gen, ec, rdma::classify(status) == failure_kind::rail).has_value());
  }

  // Brings a paused rail back (its backoff is taken as passed).
  void reconnect(std::size_t r) {
    auto& rail = rails[r];
    REQUIRE(rail.health.resume());
    const auto gen = rail.health.begin_connect();
    REQUIRE(gen.has_value());
    rail.gen = *gen;
    REQUIRE(rail.health.connected(rail.gen));
  }

  // One completion (success) per rail.
  void complete_one_each() {
    for (auto& r : rails) {
      if (r.posted.empty()) continue;
      const auto s = r.posted.front();
      r.posted.pop_front();
      end(s, {});
    }
  }

  bool all_ended() const {
    for (const auto& s : slices)
      if (s.ended == 0) return false;
    return true;
  }
  bool none_in_flight() const {
    if (!queue.empty()) return false;
    for (const auto& r : rails)
      if (!r.posted.empty()) return false;
    return true;
  }
  void check_each_ended_once() const {
    for (std::size_t i = 0; i < slices.size(); ++i) {
      CAPTURE(i);
      CHECK(slices[i].ended == 1);
      CHECK(slices[i].done != slices[i].failed);
      if (slices[i].done) CHECK(slices[i].tries >= 1);
      CHECK(slices[i].tries <= max_tries);
    }
  }
};

}  // namespace

TEST_CASE("retry accounting: one of 3 rails fails mid-way, every slice ends once") {
  sim s{3, 12, 4};
  s.pump();
  // 12 slices over 3 rails: 4 each, round robin.
  for (const auto& r : s.rails) CHECK(r.posted.size() == 4);
  CHECK(s.queue.empty());

  s.complete_one_each();  // 3 done
  s.complete_one_each();  // 6 done
  // Rail 1 breaks with two slices still on it.
  REQUIRE(s.rails[1].posted.size() == 2);
  s.fail_rail(1, IBV_WC_RETRY_EXC_ERR);
  CHECK(s.rails[1].health.state() == rail_state::paused);
  CHECK(s.rails[1].health.failures() == 1);
  CHECK(s.queue.size() == 2);  // both retried: one rail error, one flushed
  s.pump();
  CHECK(s.queue.empty());
  CHECK(s.rails[1].posted.empty());  // nothing goes to the paused rail

  for (int step = 0; step < 20 && !s.all_ended(); ++step) {
    s.complete_one_each();
    s.pump();
  }
  REQUIRE(s.all_ended());
  CHECK(s.none_in_flight());
  s.check_each_ended_once();
  std::size_t done = 0, retried = 0;
  for (const auto& rec : s.slices) {
    done += rec.done;
    retried += rec.tries > 1;
  }
  CHECK(done == 12);
  CHECK(retried == 2);
}

TEST_CASE("retry accounting: a bad request fails alone, flushed ones retry, no backoff") {
  sim s{3, 12, 4};
  s.pump();
  s.complete_one_each();
  REQUIRE(s.rails[0].posted.size() == 3);
  const auto bad = s.rails[0].posted.front();
  s.fail_rail(0, IBV_WC_REM_ACCESS_ERR);
  CHECK(s.slices[bad].failed);
  CHECK(s.slices[bad].ec == rdma::make_wc_error(IBV_WC_REM_ACCESS_ERR));
  CHECK(s.queue.size() == 2);
  CHECK(s.rails[0].health.failures() == 0);  // says nothing about the rail
  CHECK(s.rails[0].health.backoff() == 0ms);
  s.reconnect(0);
  for (int step = 0; step < 20 && !s.all_ended(); ++step) {
    s.pump();
    s.complete_one_each();
  }
  REQUIRE(s.all_ended());
  CHECK(s.none_in_flight());
  s.check_each_ended_once();
  std::size_t done = 0, failed = 0;
  for (const auto& rec : s.slices) {
    done += rec.done;
    failed += rec.failed;
  }
  CHECK(failed == 1);
  CHECK(done == 11);
}

TEST_CASE("retry accounting: rails that keep failing stop a slice after rails + 1 posts") {
  sim s{3, 12, 4};
  // Every rail fails whatever is posted to it and is reconnected at once.
  for (int round = 0; round < 10 && !s.all_ended(); ++round) {
    s.pump();
    for (std::size_t r = 0; r < s.rails.size(); ++r) {
      if (s.rails[r].posted.empty()) continue;
      s.fail_rail(r, IBV_WC_RETRY_EXC_ERR);
      s.reconnect(r);
    }
  }
  REQUIRE(s.all_ended());
  CHECK(s.none_in_flight());
  s.check_each_ended_once();
  for (std::size_t i = 0; i < s.slices.size(); ++i) {
    CAPTURE(i);
    CHECK(s.slices[i].failed);
    CHECK(s.slices[i].tries == s.max_tries);
    CHECK(s.slices[i].tries == 4);
  }
}

TEST_CASE("retry accounting: every rail down twice, queued slices fail with the last error") {
  sim s{3, 12, 2};
  s.pump();  // 6 posted, 6 queued
  CHECK(s.queue.size() == 6);
  // Every rail fails; the retried slices wait for rails that failed only once.
  for (std::size_t r = 0; r < 3; ++r) s.fail_rail(r, IBV_WC_RETRY_EXC_ERR);
  s.pump();
  CHECK(s.queue.size() == 12);
  // Each rail reconnects and fails again, with nothing posted on it.
  for (std::size_t r = 0; r < 3; ++r) {
    REQUIRE(s.rails[r].health.resume());
    const auto gen = s.rails[r].health.begin_connect();
    REQUIRE(gen.has_value());
    s.rails[r].gen = *gen;
    s.fail_rail(r, IBV_WC_RETRY_EXC_ERR);
    s.pump();
    CHECK(s.all_ended() == (r == 2));
  }
  REQUIRE(s.all_ended());
  CHECK(s.none_in_flight());
  s.check_each_ended_once();
  for (const auto& rec : s.slices) {
    CHECK(rec.failed);
    CHECK(rec.ec == rdma::make_wc_error(IBV_WC_RETRY_EXC_ERR));
  }
}

// ------------------------------------------------------ parse_remote_ports

namespace {

// Numbers as the peer writes them: unsigned (as a parsed descriptor has them too).
json port_json(std::string gid, json mtu = 1024u, std::string ipv4 = "10.77.1.2",
               json prefix = 24u) {
  return json{{"device", "rxe0"}, {"gid", gid}, {"mtu", mtu}, {"ipv4", ipv4}, {"prefix", prefix}};
}

}  // namespace

TEST_CASE("parse_remote_ports: valid entries") {
  std::vector<rdma::remote_port> out;
  std::string why;

  const json entry{{"ports",
                    {port_json("::ffff:10.77.1.2"),
                     port_json("0000:0000:0000:0000:0000:ffff:0a4d:0202", 4096u, "10.77.2.2", 16u),
                     json{{"gid", "fe80::1"}, {"mtu", 256u}}}}};
  REQUIRE_MESSAGE(rdma::parse_remote_ports(entry, out, why), why);
  REQUIRE(out.size() == 3);

  CHECK(out[0].device == "rxe0");
  CHECK(rdma::is_ipv4_mapped(out[0].gid));
  CHECK(rdma::format_gid(out[0].gid) == "10.77.1.2");
  CHECK(out[0].mtu == 1024);
  CHECK(out[0].ipv4 == "10.77.1.2");
  CHECK(out[0].prefix == 24);

  CHECK(rdma::format_gid(out[1].gid) == "10.77.2.2");
  CHECK(out[1].mtu == 4096);
  CHECK(out[1].ipv4 == "10.77.2.2");
  CHECK(out[1].prefix == 16);

  // Optional fields may be missing.
  CHECK(rdma::is_link_local(out[2].gid));
  CHECK(out[2].mtu == 256);
  CHECK(out[2].device.empty());
  CHECK(out[2].ipv4.empty());
  CHECK(out[2].prefix == 0);

  // As it arrives over the wire (parsed text).
  const json wire = json::parse(
      R"({"ports":[{"device":"mlx5_1","gid":"::ffff:10.77.2.2","mtu":2048,"ipv4":"10.77.2.2",)"
      R"("prefix":24},{"gid":"fe80:0000:0000:0000:5054:00ff:fe12:3456","mtu":1024}]})");
  REQUIRE_MESSAGE(rdma::parse_remote_ports(wire, out, why), why);
  REQUIRE(out.size() == 2);
  CHECK(out[0].device == "mlx5_1");
  CHECK(rdma::format_gid(out[0].gid) == "10.77.2.2");
  CHECK(out[0].mtu == 2048);
  CHECK(out[0].prefix == 24);
  CHECK(rdma::is_link_local(out[1].gid));
  CHECK(out[1].gid == rdma::parse_gid("fe80::5054:ff:fe12:3456"));

  // Every MTU the verbs know.
  for (const unsigned mtu : {256u, 512u, 1024u, 2048u, 4096u}) {
    CAPTURE(mtu);
    REQUIRE(
        rdma::parse_remote_ports(json{{"ports", {port_json("::ffff:10.0.0.1", mtu)}}}, out, why));
    CHECK(out.at(0).mtu == static_cast<int>(mtu));
  }

  // 64 ports is the most.
  json many = json::array();
  for (int i = 0; i < 64; ++i) many.push_back(port_json("::ffff:10.0.0." + std::to_string(i + 1)));
  CHECK(rdma::parse_remote_ports(json{{"ports", many}}, out, why));
  CHECK(out.size() == 64);

  // A prefix out of range is dropped, not an error.
  REQUIRE(rdma::parse_remote_ports(json{{"ports", {port_json("::ffff:10.0.0.1", 1024u, "", 33u)}}},
                                   out, why));
  CHECK(out.at(0).prefix == 0);
}

TEST_CASE("parse_remote_ports: malformed entries are refused with a reason") {
  auto refused = [](const json& entry) {
    std::vector<rdma::remote_port> out{rdma::remote_port{}};
    std::string why;
    const bool ok = rdma::parse_remote_ports(entry, out, why);
    CHECK_FALSE(why.empty());
    return !ok;
  };
  json too_many = json::array();
  for (int i = 0; i < 65; ++i) too_many.push_back(port_json("::ffff:10.0.0.1"));

  CHECK(refused(json::array()));
  CHECK(refused(json{1, 2, 3}));
  CHECK(refused(json("ports")));
  CHECK(refused(json(nullptr)));
  CHECK(refused(json::object()));
  CHECK(refused(json{{"ports", json::array()}}));
  CHECK(refused(json{{"ports", json::object()}}));
  CHECK(refused(json{{"ports", "::ffff:10.77.1.2"}}));
  CHECK(refused(json{{"ports", too_many}}));
  CHECK(refused(json{{"ports", {42}}}));
  CHECK(refused(json{{"ports", {port_json("::ffff:10.77.1.2", 1000u)}}}));
  CHECK(refused(json{{"ports", {port_json("::ffff:10.77.1.2", 8192u)}}}));
  CHECK(refused(json{{"ports", {port_json("::ffff:10.77.1.2", 0u)}}}));
  CHECK(refused(json{{"ports", {port_json("::ffff:10.77.1.2", -1024)}}}));
  CHECK(refused(json{{"ports", {port_json("::ffff:10.77.1.2", "1024")}}}));
  CHECK(refused(json{{"ports", {port_json("::ffff:10.77.1.2", 1024.5)}}}));
  CHECK(refused(json{{"ports", {port_json("::ffff:10.77.1.2", 4294968320ULL)}}}));
  CHECK(refused(json{{"ports", {port_json("10.77.1.2")}}}));
  CHECK(refused(json{{"ports", {port_json("not a gid")}}}));
  CHECK(refused(json{{"ports", {port_json("")}}}));
  CHECK(refused(json{{"ports", {port_json("0000:0000:0000:0000:0000:ffff:0a4d:0202:0000")}}}));
  CHECK(refused(json{{"ports", {json{{"mtu", 1024u}}}}}));
  CHECK(refused(json{{"ports", {json{{"gid", "::ffff:10.77.1.2"}}}}}));
  CHECK(refused(json{{"ports", {json{{"gid", 5}, {"mtu", 1024u}}}}}));
  // One bad port spoils the entry.
  CHECK(refused(json{{"ports", {port_json("::ffff:10.77.1.2"), port_json("zzz")}}}));

  // And the output holds nothing on failure... at least not stale ports
  // from an earlier call: it is cleared first.
  std::vector<rdma::remote_port> out(5);
  std::string why;
  CHECK_FALSE(rdma::parse_remote_ports(json::object(), out, why));
  CHECK(out.empty());
}

// -------------------------------------------------------------- pair_ports

namespace {

rdma::remote_port rport(std::string ipv4, int prefix = 24) {
  rdma::remote_port p;
  p.ipv4 = std::move(ipv4);
  p.prefix = prefix;
  return p;
}

}  // namespace

TEST_CASE("pair_ports: same subnet first, else by index") {
  using local_list = std::vector<std::pair<std::string, int>>;
  const local_list local{{"10.77.1.1", 24}, {"10.77.2.1", 24}};

  // Remote listed in reverse subnet order: paired by subnet.
  CHECK(rdma::pair_ports(local, {rport("10.77.2.2"), rport("10.77.1.2")}) ==
        std::vector<std::size_t>{1, 0});
  CHECK(rdma::pair_ports(local, {rport("10.77.1.2"), rport("10.77.2.2")}) ==
        std::vector<std::size_t>{0, 1});

  // No subnet in common: by index, modulo the peer's count.
  CHECK(rdma::pair_ports(local, {rport("192.168.0.1"), rport("192.168.1.1")}) ==
        std::vector<std::size_t>{0, 1});
  CHECK(rdma::pair_ports(local, {rport("192.168.0.1")}) == std::vector<std::size_t>{0, 0});
  const local_list four{{"10.1.0.1", 24}, {"10.2.0.1", 24}, {"10.3.0.1", 24}, {"10.4.0.1", 24}};
  CHECK(rdma::pair_ports(four, {rport("172.16.0.1"), rport("172.16.1.1"), rport("172.16.2.1")}) ==
        std::vector<std::size_t>{0, 1, 2, 0});

  // Only one local port finds its subnet; the other falls back to its index.
  CHECK(rdma::pair_ports(local, {rport("192.168.0.1"), rport("10.77.1.9")}) ==
        std::vector<std::size_t>{1, 1});

  // Remote ports without an IPv4 address: by index.
  CHECK(rdma::pair_ports(local, {rport(""), rport("")}) == std::vector<std::size_t>{0, 1});

  // A local prefix of 0 (unknown) never matches a subnet: by index.
  const local_list no_prefix{{"10.77.1.1", 0}, {"10.77.2.1", 0}};
  CHECK(rdma::pair_ports(no_prefix, {rport("10.77.2.2"), rport("10.77.1.2")}) ==
        std::vector<std::size_t>{0, 1});
  // Nor does an out-of-range one, or a local port without an address.
  CHECK(rdma::pair_ports(local_list{{"10.77.1.1", 33}, {"", 24}},
                         {rport("10.77.2.2"), rport("10.77.1.2")}) ==
        std::vector<std::size_t>{0, 1});

  // The prefix decides what "same subnet" means.
  const local_list wide{{"10.77.1.1", 16}, {"10.77.2.1", 16}};
  CHECK(rdma::pair_ports(wide, {rport("10.99.0.1"), rport("10.77.200.1")}) ==
        std::vector<std::size_t>{1, 1});
  const local_list host{{"10.77.1.1", 32}, {"10.77.1.2", 32}};
  CHECK(rdma::pair_ports(host, {rport("10.77.1.2"), rport("10.77.1.1")}) ==
        std::vector<std::size_t>{1, 0});
  CHECK(rdma::pair_ports(host, {rport("10.77.1.3"), rport("10.77.1.4")}) ==
        std::vector<std::size_t>{0, 1});

  // No local ports: no pairs.
  CHECK(rdma::pair_ports({}, {rport("10.77.1.2")}).empty());
}

// ------------------------------------------------------- rdma_engine, no device

namespace {

kvlink::config loopback_config() {
  kvlink::config c;
  c.listen = "127.0.0.1:0";
  c.connect_timeout = 5s;
  c.fence_timeout = 200ms;
  return c;
}

}  // namespace

TEST_CASE("rdma_engine: falls back to TCP without a device and moves bytes intact") {
  const bool have_device = kvlink_test::machine_has_verbs_devices();
  asio::io_context io;

  {
    // Default config constructs.
    kvlink::rdma_engine plain{io.get_executor()};
    CHECK_FALSE(plain.local_address().empty());
  }

  kvlink::rdma_engine target{io.get_executor(), loopback_config()};
  kvlink::rdma_engine initiator{io.get_executor(), loopback_config()};
  for (const auto* e : {&target, &initiator}) {
    const std::string t = e->transports();
    CAPTURE(t);
    if (have_device) {
      CHECK(t.rfind("rdma,tcp", 0) == 0);
    } else {
      CHECK(t.rfind("tcp (rdma:", 0) == 0);
      CHECK(t.back() == ')');
      CHECK(t.size() > std::string_view{"tcp (rdma: )"}.size());
    }
  }

  constexpr std::size_t size = 1 << 20;
  std::vector<std::byte> remote_mem(size), local_mem(size);

  // Registration off the caller's executor: completes on the io_context with a valid id.
  std::optional<std::pair<std::error_code, kvlink::segment_id>> reg;
  target.async_register_segment(
      remote_mem.data(), remote_mem.size(), kvlink::access::remote_read_write,
      [&](std::error_code ec, kvlink::segment_id id) { reg.emplace(ec, id); });
  REQUIRE(kvlink_test::run_until(
      io, [&] { return reg.has_value(); }, 30s));
  REQUIRE_MESSAGE(!reg->first, reg->first.message());
  const kvlink::segment_id remote_seg = reg->second;
  CHECK(remote_seg.valid());

  std::optional<std::pair<std::error_code, kvlink::segment_id>> lreg;
  initiator.async_register_segment(
      local_mem.data(), local_mem.size(), kvlink::access::remote_read_write,
      [&](std::error_code ec, kvlink::segment_id id) { lreg.emplace(ec, id); });
  REQUIRE(kvlink_test::run_until(
      io, [&] { return lreg.has_value(); }, 30s));
  REQUIRE_MESSAGE(!lreg->first, lreg->first.message());
  CHECK(lreg->second.valid());
  // The same range again overlaps.
  std::error_code overlap;
  initiator.register_segment(local_mem.data(), 4096, kvlink::access::remote_read_write, overlap);
  CHECK(overlap);

  std::optional<std::pair<std::error_code, kvlink::peer>> conn;
  initiator.async_connect(target.local_address(),
                          [&](std::error_code ec, kvlink::peer p) { conn.emplace(ec, p); });
  REQUIRE(kvlink_test::run_until(
      io, [&] { return conn.has_value(); }, 30s));
  REQUIRE_MESSAGE(!conn->first, conn->first.message());
  kvlink::peer peer = conn->second;
  REQUIRE(peer.connected());
  CHECK(peer.transport() == (have_device ? "rdma" : "tcp"));
  REQUIRE(peer.segments().size() == 1);
  CHECK(peer.segments()[0].id == remote_seg);
  CHECK(peer.segments()[0].length == size);

  auto run = [&](std::vector<kvlink::transfer_request> reqs) {
    std::optional<std::pair<std::error_code, kvlink::transfer_result>> out;
    initiator.async_submit_transfer(
        reqs, kvlink::transfer_options{},
        [&](std::error_code ec, kvlink::transfer_result r) { out.emplace(ec, r); });
    REQUIRE(kvlink_test::run_until(
        io, [&] { return out.has_value(); }, 60s));
    return *out;
  };

  // WRITE 1 MiB with a pattern, to the segment id that async_register_segment returned.
  kvlink_test::fill_pattern(local_mem.data(), size, 11, 0);
  std::memset(remote_mem.data(), 0, size);
  auto w = run({kvlink::transfer_request{kvlink::opcode::write, local_mem.data(),
                                         peer.segment(remote_seg), 0, size}});
  REQUIRE_MESSAGE(!w.first, w.first.message());
  CHECK(w.second.bytes == size);
  CHECK(w.second.requests == 1);
  CHECK(kvlink_test::is_pattern(remote_mem.data(), size, 11, 0));
  CHECK(std::memcmp(remote_mem.data(), local_mem.data(), size) == 0);

  // READ part of it back at an offset.
  kvlink_test::fill_pattern(remote_mem.data(), size, 12, 0);
  std::memset(local_mem.data(), 0, size);
  constexpr std::uint64_t off = 12345, len = 300000;
  auto r = run({kvlink::transfer_request{kvlink::opcode::read, local_mem.data() + 7,
                                         peer.segment(0), off, len}});
  REQUIRE_MESSAGE(!r.first, r.first.message());
  CHECK(r.second.bytes == len);
  CHECK(kvlink_test::is_pattern(local_mem.data() + 7, len, 12, off));
  CHECK(std::all_of(local_mem.begin(), local_mem.begin() + 7,
                    [](std::byte b) { return b == std::byte{0}; }));
  CHECK(std::all_of(local_mem.begin() + 7 + len, local_mem.end(),
                    [](std::byte b) { return b == std::byte{0}; }));

  // An id that was never registered is refused by the target.
  auto bad = run({kvlink::transfer_request{
      kvlink::opcode::write, local_mem.data(),
      peer.segment(kvlink::segment_id{remote_seg.value() + 100}), 0, 4096}});
  CHECK(bad.first);
}

TEST_CASE("rdma_engine: allow_tcp_fallback = false without a device is errc::no_device") {
  if (kvlink_test::machine_has_verbs_devices()) {
    MESSAGE("this machine has verbs devices: the no-device case is not tested here");
    return;
  }
  asio::io_context io;
  kvlink::config c = loopback_config();
  c.allow_tcp_fallback = false;
  bool threw = false;
  try {
    kvlink::rdma_engine eng{io.get_executor(), c};
    FAIL("rdma_engine without a device and without TCP fallback was constructed: "
         << eng.transports());
  } catch (const std::system_error& e) {
    threw = true;
    CHECK(e.code() == kvlink::errc::no_device);
    CHECK(&e.code().category() == &kvlink::error_category());
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("allow_tcp_fallback") != std::string::npos);
    CHECK(what.find("rdma") != std::string::npos);
  }
  CHECK(threw);

  // The listen port was released: a fallback-allowed engine still starts.
  c.allow_tcp_fallback = true;
  kvlink::rdma_engine ok{io.get_executor(), c};
  CHECK(ok.transports().rfind("tcp (rdma:", 0) == 0);
}
