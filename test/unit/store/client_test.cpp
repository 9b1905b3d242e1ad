// kvlink::store::client against an in-process master (master_server) and
// engines on loopback: bytes checked where they arrive, errors by code,
// and 8 clients x 8 threads at once (run under ThreadSanitizer in CI). The
// same client against a kvlink-master process: test/store/store_test.cpp.
#include <kvlink/engine.hpp>
#include <kvlink/store/client/client.hpp>
#include <kvlink/store/master/server.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../../support/device_memory.hpp"
#include "../../support/fault_proxy.hpp"
#include "../../support/test_support.hpp"
#include <asio/experimental/as_tuple.hpp>
#include <asio/io_context.hpp>
#include <asio/use_future.hpp>
#include <doctest/doctest.h>

namespace {

// A completion handler that hands (error_code, values...) back through a
// future, errors as values: an exception thrown through a future is
// reference-counted inside libstdc++, which ThreadSanitizer does not see, so
// one handed between threads reads as a race there.
template <class... T>
struct no_throw {
  using result = std::tuple<std::error_code, T...>;
  std::shared_ptr<std::promise<result>> p = std::make_shared<std::promise<result>>();
  std::future<result> f = p->get_future();
  auto handler() const {
    return [p = p](std::error_code ec, T... v) { p->set_value(result{ec, std::move(v)...}); };
  }
  result get() { return f.get(); }
};

// The error of one operation that start(handler) starts.
template <class Start>
std::error_code error_of(Start start) {
  no_throw<> r;
  start(r.handler());
  return std::get<0>(r.get());
}

using kvlink_test::fill_pattern;
using kvlink_test::is_pattern;
namespace store = kvlink::store;

// An io_context run by `threads` threads, a master on it.
struct rig {
  explicit rig(std::size_t threads = 2, store::master_config cfg = {},
               store::server_options opt = {}) {
    opt.listen = "127.0.0.1:0";
    master.emplace(io.get_executor(), cfg, opt);
    master->listen();
    for (std::size_t i = 0; i < threads; ++i) runners.emplace_back([this] { io.run(); });
  }
  ~rig() {
    master->async_close(asio::use_future).get();
    work.reset();
    for (auto& t : runners) t.join();
  }
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  std::optional<store::master_server> master;
  std::vector<std::thread> runners;
};

// An engine, a client, a registered work buffer and (mount > 0) a segment
// in the pool.
struct member {
  // `master`: another address of the master (a proxy); "": its own.
  member(rig& r, std::uint64_t mount, std::uint64_t buffer = 1u << 20, std::string disk = {},
         std::uint64_t disk_capacity = 64u << 20, std::string master = {})
      : eng(r.io.get_executor(), kvlink::config{.listen = "127.0.0.1:0", .transports = "tcp"}),
        work(buffer),
        pool(mount),
        client(eng, {.master = master.empty() ? r.master->local_address() : master,
                     .disk_path = std::move(disk),
                     .disk_capacity = disk_capacity}) {
    eng.register_segment(work.data(), work.size());
    if (mount != 0) segment = client.async_mount(pool.data(), pool.size(), asio::use_future).get();
  }
  ~member() { client.async_close(asio::use_future).get(); }

  std::error_code put(const std::string& key, std::size_t off, std::uint64_t size,
                      std::uint64_t seed, store::put_config cfg = {}) {
    fill_pattern(work.data() + off, size, seed, 0);
    no_throw<> r;
    client.async_put(key, work.data() + off, size, cfg, {}, r.handler());
    return std::get<0>(r.get());
  }
  // The object's size, or the error.
  std::error_code get(const std::string& key, std::size_t off, std::uint64_t cap,
                      std::uint64_t& size) {
    no_throw<std::uint64_t> r;
    client.async_get(key, work.data() + off, cap, r.handler());
    const auto out = r.get();
    size = std::get<1>(out);
    return std::get<0>(out);
  }

  kvlink::engine eng;
  std::vector<std::byte> work;
  std::vector<std::byte> pool;
  store::client client;
  std::uint64_t segment = 0;
};

}  // namespace

TEST_CASE("store client: put, get, exists, remove between clients; bytes checked") {
  rig r;
  member a(r, 8u << 20);
  member b(r, 0);  // a pure requester
  REQUIRE(a.put("k1", 0, 100'000, 1) == std::error_code{});
  std::uint64_t size = 0;
  REQUIRE(b.get("k1", 0, b.work.size(), size) == std::error_code{});
  CHECK(size == 100'000);
  CHECK(is_pattern(b.work.data(), size, 1, 0));
  CHECK(b.client.async_exists("k1", asio::use_future).get());
  CHECK_FALSE(b.client.async_exists("nope", asio::use_future).get());
  // First writer wins; the object keeps its bytes.
  CHECK(b.put("k1", 0, 10, 2) == kvlink::store_errc::object_already_exists);
  REQUIRE(a.get("k1", 4096, 200'000, size) == std::error_code{});
  CHECK(is_pattern(a.work.data() + 4096, 100'000, 1, 0));
  // A buffer too small for the object.
  CHECK(b.get("k1", 0, 99'999, size) == kvlink::store_errc::buffer_overflow);
  // From a requester into a's segment.
  REQUIRE(b.put("k2", 0, 4096, 3) == std::error_code{});
  REQUIRE(a.get("k2", 0, 4096, size) == std::error_code{});
  CHECK(is_pattern(a.work.data(), 4096, 3, 0));
  // Read a moment ago: it holds a read lease (10 s), so only a forced remove takes it.
  CHECK(error_of([&](auto h) { b.client.async_remove("k1", false, h); }) ==
        kvlink::store_errc::object_has_lease);
  CHECK(b.client.async_exists("k1", asio::use_future).get());
  CHECK_NOTHROW(b.client.async_remove("k1", true, asio::use_future).get());
  CHECK_FALSE(b.client.async_exists("k1", asio::use_future).get());
  CHECK(b.get("k1", 0, b.work.size(), size) == kvlink::store_errc::object_not_found);
}

TEST_CASE("store client: bad input gets its error and leaves nothing behind") {
  rig r;
  member a(r, 1u << 20, 4u << 20);
  member b(r, 0);  // a requester: its puts go through the engine
  std::uint64_t size = 0;
  CHECK(a.put("", 0, 10, 1) == kvlink::store_errc::invalid_key);
  CHECK(a.put(std::string(5000, 'k'), 0, 10, 1) == kvlink::store_errc::invalid_key);
  CHECK(a.put("zero", 0, 0, 1) == kvlink::store_errc::invalid_params);
  CHECK(a.put("huge", 0, 2u << 20, 1) != std::error_code{});  // beyond any segment
  // Data outside registered memory: the engine refuses the transfer and the
  // put is revoked (the key is free again).
  std::vector<std::byte> loose(4096);
  CHECK(error_of([&](auto h) {
          b.client.async_put("loose", loose.data(), loose.size(), {}, {}, h);
        }) == kvlink::errc::not_registered);
  CHECK_FALSE(a.client.async_exists("loose", asio::use_future).get());
  // The same from the owner, whose put lands in its own segment (a copy,
  // not a transfer): refused alike, and so is a get into loose memory.
  CHECK(error_of([&](auto h) {
          a.client.async_put("loose", loose.data(), loose.size(), {}, {}, h);
        }) == kvlink::errc::not_registered);
  CHECK_FALSE(a.client.async_exists("loose", asio::use_future).get());
  CHECK(b.put("loose", 0, 4096, 5) == std::error_code{});
  CHECK(error_of([&](auto h) {
          a.client.async_get("loose", loose.data(), loose.size(),
                             [h](std::error_code ec, std::uint64_t) mutable { h(ec); });
        }) == kvlink::errc::not_registered);
  // A buffer running past the end of its registration: out_of_bounds.
  CHECK(error_of([&](auto h) {
          a.client.async_put("edge", a.work.data() + a.work.size() - 100, 4096, {}, {}, h);
        }) == kvlink::errc::out_of_bounds);
  // The pool full: no_space at once, as Mooncake's -200.
  // (big1 is read first: its read lease keeps the eviction that the failed
  // put asks for from taking it.)
  CHECK(a.put("big1", 0, 700u << 10, 6) == std::error_code{});
  REQUIRE(a.get("big1", 0, a.work.size(), size) == std::error_code{});
  CHECK(a.put("big2", 0, 700u << 10, 7) == kvlink::store_errc::no_space);
  CHECK(kvlink::mooncake_code(kvlink::store_errc::no_space) == -200);
  REQUIRE(a.get("big1", 0, a.work.size(), size) == std::error_code{});
  CHECK(is_pattern(a.work.data(), size, 6, 0));
}

TEST_CASE(
    "store client: a put whose master connection breaks at any step ends, or holds nothing "
    "soon after") {
  // No heartbeat within the test: the only frames on b's connection are
  // its put's, each one chunk the proxy holds back 500 ms. The connection
  // is reset while the proxy holds the step's frame: it never arrives (a
  // reset fault would forward it first, and b could read put_start's
  // answer and send put_end before the reset reached it).
  store::server_options opt;
  opt.heartbeat_interval = std::chrono::seconds(60);
  opt.suspect_after = std::chrono::seconds(120);
  opt.liveness_timeout = std::chrono::seconds(300);
  rig r(2, {}, opt);
  kvlink_test::fault_proxy proxy(r.master->local_address());
  member a(r, 1u << 20);
  member b(r, 0, 1u << 20, {}, 64u << 20, proxy.address());
  // Connected, and a's segment located (no segment_info on the way below).
  REQUIRE(b.put("warm", 0, 4096, 1) == std::error_code{});
  auto& table = r.master->objects();
  using namespace std::chrono_literals;
  // Waits up to 10 s for `done`.
  auto wait_for = [](auto done) {
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (!done() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(1ms);
    }
    return done();
  };
  // The steps: put_start on its way, its answer on its way, put_end on its
  // way, its answer on its way. The connection is reset there.
  const char* const steps[] = {"put_start sent", "put_start answered", "put_end sent",
                               "put_end answered"};
  for (int step = 0; step < 4; ++step) {
    const std::string at = steps[step];
    CAPTURE(at);
    const std::string key = "cut-" + std::to_string(step);
    const auto before = table.stats();
    const auto chunks = proxy.stats().delayed_chunks;
    proxy.set_fault(kvlink_test::fault::delay(500ms));
    kvlink_test::fill_pattern(b.work.data(), 64u << 10, 40 + step, 0);
    no_throw<> put;
    b.client.async_put(key, b.work.data(), 64u << 10, {}, {}, put.handler());
    REQUIRE(wait_for([&] {
      switch (step) {
        case 0:
          return proxy.stats().delayed_chunks > chunks;
        case 1:  // put_start and its answer held (the answer after the table counts it)
          return table.stats().in_progress > before.in_progress &&
                 proxy.stats().delayed_chunks > chunks + 1;
        case 2:
          return proxy.stats().delayed_chunks > chunks + 2;
        default:
          return table.stats().objects > before.objects &&
                 table.stats().in_progress == before.in_progress;
      }
    }));
    const auto connection = proxy.accepted() - 1;
    REQUIRE(proxy.reset_connection(connection));
    proxy.clear_faults();
    const auto ec = std::get<0>(put.get());
    if (step < 2) {
      // Never placed, or placed and its answer lost: failed, and the space
      // is given back once b is connected again (not after the master's
      // put_discard_timeout + put_release_timeout: 30 s + 10 min).
      CHECK(ec == kvlink::store_errc::rpc_failed);
      CHECK(wait_for([&] {
        const auto now = table.stats();
        return now.in_progress == before.in_progress && now.used == before.used &&
               now.objects == before.objects;
      }));
      // The same put again, at once: the give-back of the lost one never
      // takes it (b has it in flight, or it ended: object_already_exists).
      CHECK(b.put(key, 0, 64u << 10, 50 + step) == std::error_code{});
      std::this_thread::sleep_for(1500ms);  // settled by now (b's ticker: 100 ms)
      std::uint64_t size = 0;
      REQUIRE(a.get(key, 0, a.work.size(), size) == std::error_code{});
      CHECK(is_pattern(a.work.data(), size, 50 + step, 0));
    } else {
      // Written: put_end again on a new connection (the first may have
      // been done: a no-op), so the put succeeds.
      CHECK(ec == std::error_code{});
      std::uint64_t size = 0;
      REQUIRE(a.get(key, 0, a.work.size(), size) == std::error_code{});
      CHECK(size == (64u << 10));
      CHECK(is_pattern(a.work.data(), size, 40 + step, 0));
    }
    CHECK(table.stats().in_progress == before.in_progress);
    CHECK(proxy.accepted() > connection + 1);  // cut, and b connected again
    proxy.clear_faults();
  }
}

TEST_CASE("store client: a get whose read lease ran out before its read finished is refused") {
  // A lease of 0 ms has always run out by the time the bytes are in: the
  // master grants it when it answers, the read comes after.
  store::master_config cfg;
  cfg.lease_ttl = std::chrono::milliseconds{0};
  rig r(2, cfg);
  member a(r, 4u << 20);
  member b(r, 0);
  REQUIRE(a.put("leased", 0, 65'536, 11) == std::error_code{});
  std::uint64_t size = 1;
  CHECK(b.get("leased", 0, b.work.size(), size) == kvlink::store_errc::lease_expired);
  CHECK(size == 0);
  CHECK(kvlink::mooncake_code(kvlink::store_errc::lease_expired) == -707);
  // From its own segment too (a memcpy, no engine), and in a batch: per key.
  CHECK(a.get("leased", 0, a.work.size(), size) == kvlink::store_errc::lease_expired);
  const std::vector<std::string_view> keys{"leased", "missing"};
  const std::vector<void*> bufs{b.work.data(), b.work.data() + 65'536};
  const std::vector<std::uint64_t> caps{65'536, 65'536};
  std::vector<std::uint64_t> sizes(2, 7);
  std::vector<std::error_code> results(2);
  CHECK(error_of([&](auto h) { b.client.async_get_batch(keys, bufs, caps, sizes, results, h); }) ==
        std::error_code{});
  CHECK(results[0] == kvlink::store_errc::lease_expired);
  CHECK(results[1] == kvlink::store_errc::object_not_found);
  CHECK(sizes == std::vector<std::uint64_t>{0, 0});
  // The object itself is intact: a master with a lease to give serves it.
  CHECK(b.client.async_exists("leased", asio::use_future).get());
}

TEST_CASE("store client: replicas on distinct segments; batches with results in order") {
  rig r;
  member a(r, 4u << 20);
  member b(r, 4u << 20);
  member c(r, 0, 4u << 20);
  store::put_config two;
  two.replicas = 2;
  REQUIRE(c.put("r2", 0, 1u << 20, 9, two) == std::error_code{});
  // Both segments hold it: each has 1 MiB used.
  const auto st = c.client.async_stats(asio::use_future).get();
  CHECK(st.used >= 2u << 20);
  CHECK(st.segments == 2);

  constexpr std::size_t n = 64;
  std::vector<std::string> names(n);
  std::vector<std::string_view> keys(n);
  std::vector<const void*> data(n);
  std::vector<void*> bufs(n);
  std::vector<std::uint64_t> sizes(n), caps(n, 4096), got(n);
  std::vector<std::error_code> results(n);
  for (std::size_t i = 0; i < n; ++i) {
    names[i] = std::string("b").append(std::to_string(i));
    keys[i] = names[i];
    sizes[i] = 1 + i * 61;
    fill_pattern(c.work.data() + i * 4096, sizes[i], 100 + i, 0);
    data[i] = c.work.data() + i * 4096;
    bufs[i] = a.work.data() + i * 4096;
  }
  names[7] = "r2";  // exists already: fails alone
  keys[7] = names[7];
  c.client.async_put_batch(keys, data, sizes, results, {}, {}, asio::use_future).get();
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(results[i] == (i == 7 ? std::error_code{kvlink::store_errc::object_already_exists}
                                : std::error_code{}));
  }
  a.client.async_get_batch(keys, bufs, caps, got, results, asio::use_future).get();
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    if (i == 7) {
      CHECK(results[i] == kvlink::store_errc::buffer_overflow);  // r2 is 1 MiB
      CHECK(got[i] == 1u << 20);                                 // what a buffer must hold
      continue;
    }
    REQUIRE(results[i] == std::error_code{});
    CHECK(got[i] == sizes[i]);
    CHECK(is_pattern(a.work.data() + i * 4096, sizes[i], 100 + i, 0));
  }
  // Columns of different lengths: the batch fails as a whole.
  std::vector<std::error_code> short_results(1);
  CHECK(error_of([&](auto h) { c.client.async_exists_batch(keys, short_results, h); }) ==
        kvlink::errc::invalid_argument);
  // Read a moment ago (leased): a forced remove.
  c.client.async_remove_batch(keys, true, results, asio::use_future).get();
  for (std::size_t i = 0; i < n; ++i) CHECK(results[i] == std::error_code{});
  c.client.async_exists_batch(keys, results, asio::use_future).get();
  for (std::size_t i = 0; i < n; ++i) CHECK(results[i] == kvlink::store_errc::object_not_found);
}

TEST_CASE("store client: replica descriptions name each replica's owner and take no lease") {
  rig r;
  member a(r, 4u << 20);
  member b(r, 4u << 20);
  member c(r, 0);
  store::put_config two;
  two.replicas = 2;
  REQUIRE(c.put("two", 0, 300'000, 4, two) == std::error_code{});
  REQUIRE(c.put("one", 0, 1000, 5) == std::error_code{});
  const std::vector<std::string_view> keys{"two", "missing", "one", ""};
  std::vector<store::object_description> d(keys.size());
  c.client.async_describe_batch(keys, d, asio::use_future).get();
  REQUIRE(d[0].ec == std::error_code{});
  CHECK(d[0].size == 300'000);
  REQUIRE(d[0].replicas.size() == 2);
  std::set<std::string> owners;
  for (const auto& rep : d[0].replicas) {
    owners.insert(rep.address);
    CHECK(rep.host == "127.0.0.1");
    CHECK_FALSE(rep.local);
    CHECK(rep.offset + 300'000 <= 4u << 20);
  }
  CHECK(owners == std::set<std::string>{a.eng.local_address(), b.eng.local_address()});
  CHECK(d[1].ec == kvlink::store_errc::object_not_found);
  CHECK(d[1].replicas.empty());
  REQUIRE(d[2].ec == std::error_code{});
  CHECK(d[2].size == 1000);
  CHECK(d[2].replicas.size() == 1);
  CHECK(d[3].ec == kvlink::store_errc::invalid_key);
  // The replica of "one" is found where the description says: the bytes at
  // that offset of its owner's pool are the object's.
  const auto& one = d[2].replicas[0];
  member& owner = one.address == a.eng.local_address() ? a : b;
  CHECK(is_pattern(owner.pool.data() + one.offset, 1000, 5, 0));
  // Described from an owner: its own segment is local.
  std::vector<store::object_description> from_a(keys.size());
  a.client.async_describe_batch(keys, from_a, asio::use_future).get();
  std::size_t local = 0;
  for (const auto& rep : from_a[0].replicas) local += rep.local ? 1 : 0;
  CHECK(local == 1);
  // No lease was taken: a plain remove succeeds (after a get it is refused).
  CHECK(error_of([&](auto h) { c.client.async_remove("two", false, h); }) == std::error_code{});
  std::uint64_t size = 0;
  REQUIRE(c.get("one", 0, c.work.size(), size) == std::error_code{});
  CHECK(error_of([&](auto h) { c.client.async_remove("one", false, h); }) ==
        kvlink::store_errc::object_has_lease);
  // Columns of different lengths.
  std::vector<store::object_description> short_out(1);
  CHECK(error_of([&](auto h) { c.client.async_describe_batch(keys, short_out, h); }) ==
        kvlink::errc::invalid_argument);
}

TEST_CASE("store client: 8 clients x 8 threads at once") {
  rig r(4);
  constexpr std::size_t clients = 8, threads = 8, ops = 12, size = 2048;
  std::vector<std::unique_ptr<member>> m;
  for (std::size_t c = 0; c < clients; ++c) {
    // Puts from the first half of its buffer, gets into the second.
    m.push_back(std::make_unique<member>(r, 1u << 20, 2 * threads * ops * size));
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> users;
  for (std::size_t c = 0; c < clients; ++c) {
    for (std::size_t t = 0; t < threads; ++t) {
      users.emplace_back([&, c, t] {
        auto& me = *m[c];
        auto& other = *m[(c + 1) % clients];
        for (std::size_t i = 0; i < ops; ++i) {
          const std::string key =
              std::to_string(c) + "/" + std::to_string(t) + "/" + std::to_string(i);
          const std::size_t off = (t * ops + i) * size;
          const std::uint64_t seed = c * 10'000 + t * 100 + i;
          if (me.put(key, off, size, seed)) {
            ++failures;
            continue;
          }
          std::uint64_t got = 0;
          // Another client reads it back into its own slot.
          const std::size_t into = threads * ops * size + off;
          if (other.get(key, into, size, got) || got != size ||
              !is_pattern(other.work.data() + into, size, seed, 0)) {
            ++failures;
          }
        }
      });
    }
  }
  for (auto& u : users) u.join();
  CHECK(failures.load() == 0);
  const auto st = m[0]->client.async_stats(asio::use_future).get();
  CHECK(st.objects == clients * threads * ops);
}

TEST_CASE("store client: a full pool evicts under pressure; leased, pinned and chain heads stay") {
  rig r(2);
  member a(r, 1u << 20, 4u << 20);  // a 1 MiB pool
  member w(r, 0, 4u << 20);         // writers and readers
  constexpr std::uint64_t piece = 64u << 10;
  store::put_config hard;
  hard.hard_pin = true;
  REQUIRE(w.put("pinned", 0, piece, 1, hard) == std::error_code{});
  REQUIRE(w.put("head", 0, piece, 2) == std::error_code{});
  fill_pattern(w.work.data(), piece, 3, 0);
  REQUIRE_NOTHROW(
      w.client.async_put("tail", w.work.data(), piece, {}, "head", asio::use_future).get());
  REQUIRE(w.put("read", 0, piece, 4) == std::error_code{});
  std::uint64_t size = 0;
  REQUIRE(w.get("read", 0, piece, size) == std::error_code{});  // leased for 10 s
  // Writers fill the pool many times over while a reader checks "read". A
  // put may answer no_space (Mooncake's -200: back off) while eviction
  // makes room; it never hangs, and each is retried until it lands.
  std::atomic<int> lost{0}, puts{0}, no_space{0};
  std::vector<std::thread> users;
  for (std::size_t t = 0; t < 2; ++t) {
    users.emplace_back([&, t] {
      for (std::size_t i = 0; i < 24; ++i) {
        const std::string key =
            std::string("fill/").append(std::to_string(t)).append("/").append(std::to_string(i));
        const std::size_t off = (1 + t) * piece;
        for (int attempt = 0; attempt < 200; ++attempt) {
          const auto ec = w.put(key, off, piece, 100 + i);
          if (!ec) {
            ++puts;
            break;
          }
          if (ec != kvlink::store_errc::no_space) break;
          ++no_space;
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      }
    });
  }
  users.emplace_back([&] {
    for (int i = 0; i < 20; ++i) {
      if (!w.client.async_exists("read", asio::use_future).get()) ++lost;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  for (auto& u : users) u.join();
  MESSAGE("puts " << puts.load() << ", no_space answers " << no_space.load());
  CHECK(puts.load() == 48);  // 3 MiB through a 1 MiB pool: eviction made room
  CHECK(lost.load() == 0);
  CHECK(w.client.async_exists("pinned", asio::use_future).get());
  CHECK(w.client.async_exists("read", asio::use_future).get());
  REQUIRE(w.get("pinned", 0, piece, size) == std::error_code{});
  CHECK(is_pattern(w.work.data(), piece, 1, 0));
  // A chain's head outlives its tail: never the tail without the head.
  const bool tail = w.client.async_exists("tail", asio::use_future).get();
  const bool head = w.client.async_exists("head", asio::use_future).get();
  CHECK((!tail || head));
  // Hard-pinned: only a forced remove takes it.
  CHECK(error_of([&](auto h) { w.client.async_remove("pinned", false, h); }) ==
        kvlink::store_errc::object_hard_pinned);
}

// --- the SSD tier (store/tier/disk.hpp on the owning client)

namespace {

struct ssd_dir {
  std::string path;
  ssd_dir() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t != nullptr && *t != '\0' ? t : "/tmp") + "/kvlink-ssd-XXXXXX";
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~ssd_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

// Puts `count` objects of `piece` bytes (pattern seed 100 + i), each
// retried while the pool answers no_space (eviction makes room).
int fill(member& w, const std::string& prefix, int count, std::uint64_t piece) {
  int landed = 0;
  for (int i = 0; i < count; ++i) {
    const std::string key = prefix + std::to_string(i);
    for (int attempt = 0; attempt < 400; ++attempt) {
      const auto ec = w.put(key, 0, piece, 100 + static_cast<std::uint64_t>(i));
      if (!ec) {
        ++landed;
        break;
      }
      if (ec != kvlink::store_errc::no_space) {
        FAIL_CHECK("put " << key << ": " << ec.message());
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  return landed;
}

// Objects read back with their bytes; other answers must be object_not_found.
int read_back(member& w, const std::string& prefix, int count, std::uint64_t piece) {
  int good = 0;
  for (int i = 0; i < count; ++i) {
    const std::string key = prefix + std::to_string(i);
    std::uint64_t size = 0;
    std::fill_n(w.work.data(), piece, std::byte{0});
    const auto ec = w.get(key, 0, piece, size);
    if (ec) {
      CHECK_MESSAGE(ec == kvlink::store_errc::object_not_found, key << ": " << ec.message());
      continue;
    }
    CHECK(size == piece);
    const bool same = is_pattern(w.work.data(), piece, 100 + static_cast<std::uint64_t>(i), 0);
    CHECK_MESSAGE(same, key << ": other bytes");
    good += same ? 1 : 0;
  }
  return good;
}

}  // namespace

TEST_CASE(
    "store client: the SSD tier keeps what eviction takes, reads it back, survives a restart") {
  // Leases shorter than the default 10 s: each get leases what it read, and
  // a 1 MiB pool full of leased objects has no room to read others back.
  store::master_config cfg;
  cfg.lease_ttl = std::chrono::milliseconds(50);
  rig r(2, cfg);
  ssd_dir dir;
  constexpr std::uint64_t piece = 64u << 10;
  constexpr int count = 48;  // 3 MiB through a 1 MiB pool
  {
    member a(r, 1u << 20, 1u << 20, dir.path);  // the pool and its disk
    member w(r, 0, 1u << 20);                   // writer and reader
    REQUIRE(fill(w, "ssd/", count, piece) == count);
    // Nothing was lost: the objects eviction took went to a's disk and are
    // read back into its segment when asked for.
    CHECK(read_back(w, "ssd/", count, piece) == count);
    // And again, now that reading them back evicted others in turn.
    CHECK(read_back(w, "ssd/", count, piece) == count);
    const std::string metrics = r.master->service().metrics_text();
    MESSAGE(metrics.substr(metrics.find("kvlink_store_disk_tasks_total")));
    CHECK(metrics.find("kvlink_store_disks 1") != std::string::npos);
    CHECK(metrics.find("kvlink_store_disk_tasks_total{kind=\"store\"} 0") == std::string::npos);
    CHECK(metrics.find("kvlink_store_disk_tasks_total{kind=\"load\"} 0") == std::string::npos);
    CHECK(metrics.find("kvlink_store_disk_failures_total 0") != std::string::npos);
    // A removed object leaves the disk too (its drop task): not back after
    // the restart below.
    CHECK(error_of([&](auto h) { w.client.async_remove("ssd/0", true, h); }) == std::error_code{});
  }
  // The owner went (its segment and its disk left the pool): a new owner on
  // the same directory announces what the disk holds; every object that
  // went to the disk is readable again, with its bytes.
  member a(r, 1u << 20, 1u << 20, dir.path);
  member w(r, 0, 1u << 20);
  std::uint64_t size = 0;
  CHECK(w.get("ssd/0", 0, piece, size) == kvlink::store_errc::object_not_found);
  const int back = read_back(w, "ssd/", count, piece);
  MESSAGE(back << " of " << count << " objects back from the disk after the restart");
  CHECK(back >= count - 16);  // at most the segment's worth was never evicted
}

// --- device memory (KVLINK_TEST_DEVICE: the emulated device in unit.store,
// the CUDA runtime on the fake driver in unit.store.fake_cuda, a real GPU in
// cuda.store): buffers of device memory put from and got into, through this
// client's own segment (the device's stream) and a peer's (the engine), whole
// and in pieces, bytes read back through the device's copy engine.

namespace {

// KVLINK_TEST_TRANSPORT: tcp by default; shm (device memory exported to the
// other client's engine, or staged for its host memory).
std::string transport_under_test() {
  const char* v = std::getenv("KVLINK_TEST_TRANSPORT");
  return v && *v ? v : "tcp";
}

// An engine with the device runtime under test, a client, 1 MiB of device
// memory and 1 MiB of host memory registered, and (mount > 0) a host segment.
struct device_member {
  device_member(rig& r, std::uint64_t mount, std::shared_ptr<kvlink::device_runtime> rt)
      : eng(r.io.get_executor(),
            kvlink::config{.listen = "127.0.0.1:0",
                           .transports = transport_under_test(),
                           .device = {.runtime = kvlink_test::device_under_test()}}),
        dev(1u << 20, true, rt),
        host(1u << 20),
        pool(mount),
        client(eng, {.master = r.master->local_address()}) {
    eng.register_segment(dev.data(), dev.size());
    eng.register_segment(host.data(), host.size());
    if (mount != 0) client.async_mount(pool.data(), pool.size(), asio::use_future).get();
  }
  ~device_member() { client.async_close(asio::use_future).get(); }

  std::error_code put(const std::string& key, const void* data, std::uint64_t size) {
    no_throw<> r;
    client.async_put(key, data, size, {}, {}, r.handler());
    return std::get<0>(r.get());
  }
  std::error_code get(const std::string& key, void* buf, std::uint64_t cap, std::uint64_t& size) {
    no_throw<std::uint64_t> r;
    client.async_get(key, buf, cap, r.handler());
    const auto out = r.get();
    size = std::get<1>(out);
    return std::get<0>(out);
  }

  kvlink::engine eng;
  kvlink_test::test_memory dev;
  std::vector<std::byte> host;
  std::vector<std::byte> pool;
  store::client client;
};

std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  fill_pattern(v.data(), n, seed, 0);
  return v;
}

}  // namespace

TEST_CASE("store client: device memory through its own segment and a peer's, whole and in pieces") {
  const auto rt = kvlink_test::require_device_or_skip();
  rig r;
  device_member owner(r, 8u << 20, rt);  // holds the pool
  device_member other(r, 0, rt);         // holds none: every byte crosses the engine
  const auto a = pattern(300'001, 1), b = pattern(65'536, 2);
  owner.dev.write(0, a.data(), a.size());
  other.dev.write(4096, b.data(), b.size());

  // Whole objects: the owner's device -> its own segment (a stream copy),
  // the other's device -> the owner's segment (the engine).
  REQUIRE(owner.put("dev/a", owner.dev.data(), a.size()) == std::error_code{});
  REQUIRE(other.put("dev/b", other.dev.data() + 4096, b.size()) == std::error_code{});
  std::uint64_t size = 0;
  // Back into device memory both ways, and into host memory.
  REQUIRE(other.get("dev/a", other.dev.data() + 8192, 1u << 19, size) == std::error_code{});
  CHECK(size == a.size());
  CHECK(other.dev.read(8192, a.size()) == a);
  REQUIRE(owner.get("dev/b", owner.dev.data() + 500'000, 1u << 18, size) == std::error_code{});
  CHECK(size == b.size());
  CHECK(owner.dev.read(500'000, b.size()) == b);
  REQUIRE(owner.get("dev/a", owner.host.data(), owner.host.size(), size) == std::error_code{});
  CHECK(std::equal(a.begin(), a.end(), owner.host.begin()));
  // A device buffer too small: buffer_overflow, the object's size, nothing written.
  const auto before = owner.dev.read(600'000, 4096);
  CHECK(owner.get("dev/a", owner.dev.data() + 600'000, 4096, size) ==
        kvlink::store_errc::buffer_overflow);
  CHECK(size == a.size());
  CHECK(owner.dev.read(600'000, 4096) == before);

  // Pieces: one object gathered from device, host and device memory, and
  // scattered back over pieces of other sizes, on both clients.
  for (auto* m : {&owner, &other}) {
    const bool own = m == &owner;
    const std::string key = own ? "dev/pieces-own" : "dev/pieces-peer";
    const auto p0 = pattern(4096, own ? 10 : 20), p1 = pattern(1000, own ? 11 : 21),
               p2 = pattern(12'288, own ? 12 : 22);
    m->dev.write(100'000, p0.data(), p0.size());
    std::memcpy(m->host.data() + 7, p1.data(), p1.size());
    m->dev.write(200'000, p2.data(), p2.size());
    const std::vector<store::buffer_piece> pieces{{m->dev.data() + 100'000, p0.size()},
                                                  {m->host.data() + 7, p1.size()},
                                                  {m->dev.data() + 200'000, p2.size()}};
    const std::string_view keys[] = {key};
    const std::uint32_t counts[] = {3};
    std::error_code results[1];
    no_throw<> put;
    m->client.async_put_gather_batch(keys, pieces, counts, results, {}, {}, put.handler());
    REQUIRE(std::get<0>(put.get()) == std::error_code{});
    REQUIRE(results[0] == std::error_code{});
    std::vector<std::byte> whole = p0;
    whole.insert(whole.end(), p1.begin(), p1.end());
    whole.insert(whole.end(), p2.begin(), p2.end());
    // The whole object, read plainly by the other client.
    device_member& reader = own ? other : owner;
    REQUIRE(reader.get(key, reader.host.data() + 900'000, 100'000, size) == std::error_code{});
    CHECK(size == whole.size());
    CHECK(std::equal(whole.begin(), whole.end(), reader.host.begin() + 900'000));
    // Scattered over host 5000 B, device 8000 B, device 10'000 B (the last
    // filled only as far as the object goes: 4384 B; the rest untouched).
    const auto tail_before = m->dev.read(320'000 + 4384, 10'000 - 4384);
    const std::vector<store::buffer_piece> out{{m->host.data() + 10'000, 5000},
                                               {m->dev.data() + 300'000, 8000},
                                               {m->dev.data() + 320'000, 10'000}};
    std::uint64_t sizes[1] = {};
    no_throw<> get;
    m->client.async_get_scatter_batch(keys, out, counts, sizes, results, get.handler());
    REQUIRE(std::get<0>(get.get()) == std::error_code{});
    REQUIRE(results[0] == std::error_code{});
    CHECK(sizes[0] == whole.size());
    CHECK(std::equal(whole.begin(), whole.begin() + 5000, m->host.begin() + 10'000));
    const auto mid = m->dev.read(300'000, 8000);
    CHECK(std::equal(mid.begin(), mid.end(), whole.begin() + 5000));
    const auto last = m->dev.read(320'000, 4384);
    CHECK(std::equal(last.begin(), last.end(), whole.begin() + 13'000));
    CHECK(m->dev.read(320'000 + 4384, 10'000 - 4384) == tail_before);
    // Pieces holding fewer bytes than the object: buffer_overflow.
    const std::vector<store::buffer_piece> small{{m->dev.data() + 400'000, 4096},
                                                 {m->host.data() + 50'000, 4096}};
    const std::uint32_t two[] = {2};
    no_throw<> short_get;
    m->client.async_get_scatter_batch(keys, small, two, sizes, results, short_get.handler());
    REQUIRE(std::get<0>(short_get.get()) == std::error_code{});
    CHECK(results[0] == kvlink::store_errc::buffer_overflow);
    CHECK(sizes[0] == whole.size());
  }

  // Counts that do not add up to the pieces: the batch is refused.
  {
    const std::string_view keys[] = {"dev/bad"};
    const std::vector<store::buffer_piece> pieces{{owner.host.data(), 10}};
    const std::uint32_t counts[] = {2};
    std::error_code results[1];
    no_throw<> put;
    owner.client.async_put_gather_batch(keys, pieces, counts, results, {}, {}, put.handler());
    CHECK(std::get<0>(put.get()) == kvlink::errc::invalid_argument);
    const std::uint32_t none[] = {0};  // no bytes: the master's invalid_params
    no_throw<> empty;
    owner.client.async_put_gather_batch(keys, std::span<const store::buffer_piece>{}, none, results,
                                        {}, {}, empty.handler());
    CHECK(std::get<0>(empty.get()) == std::error_code{});
    CHECK(results[0] == kvlink::store_errc::invalid_params);
  }

  // The pool is host memory: mounting device memory is refused.
  kvlink_test::test_memory seg(1u << 20, true, rt);
  no_throw<std::uint64_t> mount;
  other.client.async_mount(seg.data(), seg.size(), mount.handler());
  CHECK(std::get<0>(mount.get()) == kvlink::errc::invalid_argument);
}
