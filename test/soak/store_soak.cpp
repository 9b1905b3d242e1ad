// kvlink_store_soak: random store operations for a while, with faults on
// the clients' connections to the master, every byte verified.
//
//   kvlink_store_soak [--seconds N] [--seed S]     (defaults: 30 s, seed 1)
//
// One master (kvlink::store::master_server) and three clients in this
// process, each client with its own engine; two mount a segment, one is a
// pure requester. Every client reaches the master through the
// fault-injecting proxy (test/support/fault_proxy.hpp); now and then a
// fault (reset, truncate, delay, a black hole longer than the request
// timeout) is set on the master connections for a moment and cleared. The
// data between clients flows straight between their engines.
//
// Each client runs a loop of random operations: put a new key (1 B to
// 256 KiB of a pattern drawn for it, sometimes 2 replicas), get a key it
// knows was put (the bytes must match the pattern exactly), exists, remove.
// During faults an operation may fail, with a store or engine error; it
// must never hang (each is waited for with a bound), and a put or get that
// succeeds must be right. Every put is hard-pinned: eviction is not what
// is tested here, loss through faults is. A key whose put or remove failed
// may exist all the same (the answer was lost, not the request): the
// client removes it once the faults are cleared, as a user would. At the
// end, with the faults cleared, every key whose put succeeded and was not
// removed must still be readable with its exact bytes: nothing
// acknowledged is lost (the liveness timeout is longer than any fault, so
// no client is declared gone).
//
// Prints operations, failures during faults, faults injected, objects
// evicted, corrupted objects, lost objects and hangs (and, when something
// went wrong, what failed and the master's counters and peaks). Exit
// status 0 when there were no corrupted or lost objects and no hang, and
// when operations failed only while a fault was set (or just after); 1
// otherwise.
#include <kvlink/engine.hpp>
#include <kvlink/store/client/client.hpp>
#include <kvlink/store/master/server.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fault_proxy.hpp"
#include "test_support.hpp"
#include <asio/io_context.hpp>
#include <asio/use_future.hpp>

namespace {

using namespace std::chrono_literals;
namespace store = kvlink::store;

constexpr std::uint64_t max_object = 256u << 10;
constexpr auto op_bound = 60s;  // an operation not done by then is a hang

struct totals {
  std::atomic<std::uint64_t> ops{0}, puts{0}, gets{0}, failed_in_fault{0}, failed_clean{0};
  std::atomic<std::uint64_t> corrupted{0}, hangs{0}, cleanups{0};
};

struct member {
  member(asio::io_context& io, const std::string& master, std::uint64_t mount)
      : eng(io.get_executor(), kvlink::config{.listen = "127.0.0.1:0", .transports = "tcp"}),
        work(max_object),
        pool(mount),
        client(eng, {.master = master,
                     .request_timeout = std::chrono::milliseconds(1500),
                     .reconnect_interval = std::chrono::milliseconds(100)}) {
    eng.register_segment(work.data(), work.size());
  }
  kvlink::engine eng;
  std::vector<std::byte> work;
  std::vector<std::byte> pool;
  store::client client;
};

// The value of an unlabelled metric in the master's Prometheus text; 0
// when absent.
std::uint64_t metric(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.size() > name.size() && line.compare(0, name.size(), name) == 0 &&
        line[name.size()] == ' ') {
      return std::strtoull(line.c_str() + name.size() + 1, nullptr, 10);
    }
  }
  return 0;
}

// Waits for `f` within op_bound; false (a hang) if it does not finish.
template <class T>
bool wait(std::future<T>& f) {
  return f.wait_for(op_bound) == std::future_status::ready;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 30;
  std::uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--seconds") seconds = std::atof(argv[i + 1]);
    if (a == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
  }
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  std::vector<std::thread> runners;
  for (int i = 0; i < 2; ++i) runners.emplace_back([&io] { io.run(); });

  store::server_options opt;
  opt.listen = "127.0.0.1:0";
  opt.liveness_timeout = 20s;  // longer than any fault: nobody is declared gone
  opt.suspect_after = 5s;
  // No eviction may take a kept object: every put is hard-pinned. A put
  // cut off by a fault keeps its space until the master discards it and
  // reuses the space (put_discard_timeout, put_release_timeout after its
  // start: 1 s and 2 s here, reclaimed every 200 ms, so within the 3 s the
  // faults settle), and a fault that resets every connection cuts hundreds
  // (2026-11-28, one run: 800 puts in progress at once, 101 MB of the
  // 134 MB pool held for them, 174 objects evicted, kept ones among them,
  // before the puts were pinned). Objects of failed puts and removes are
  // removed once the faults clear, or pinned leftovers would fill the pool.
  opt.reclaim_interval = 200ms;
  store::master_config mc;
  mc.lease_ttl = 2s;
  mc.put_discard_timeout = 1s;
  mc.put_release_timeout = 2s;
  auto master = std::make_unique<store::master_server>(io.get_executor(), mc, opt);
  master->listen();
  auto proxy = std::make_unique<kvlink_test::fault_proxy>(master->local_address());

  std::vector<std::unique_ptr<member>> members;
  members.push_back(std::make_unique<member>(io, proxy->address(), 64u << 20));
  members.push_back(std::make_unique<member>(io, proxy->address(), 64u << 20));
  members.push_back(std::make_unique<member>(io, proxy->address(), 0));
  for (auto& m : members) {
    if (!m->pool.empty())
      m->client.async_mount(m->pool.data(), m->pool.size(), asio::use_future).get();
  }

  totals t;
  std::atomic<bool> faulty{false};  // a fault is set (or was, within the last 3 s)
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> faults{0};
  // When the chaos thread last cleared its faults (steady clock, ns).
  std::atomic<std::int64_t> last_clear{0};
  // Keys each client put (and still believes are there), with their pattern.
  struct known {
    std::uint64_t size = 0, seed = 0;
  };
  std::vector<std::map<std::string, known>> kept(members.size());

  std::thread chaos([&] {
    std::mt19937_64 g{seed * 7 + 1};
    while (!stop.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300 + g() % 700));
      if (stop.load()) break;
      faulty = true;
      kvlink_test::fault f;
      switch (g() % 4) {
        case 0:
          f = kvlink_test::fault::reset(g() % 4096);
          break;
        case 1:
          f = kvlink_test::fault::truncate(g() % 4096);
          break;
        case 2:
          f = kvlink_test::fault::delay(std::chrono::milliseconds(50 + g() % 200));
          break;
        default:
          f = kvlink_test::fault::black_hole();  // longer than the request timeout
          break;
      }
      const auto id = proxy->add_fault(f);
      ++faults;
      std::this_thread::sleep_for(std::chrono::milliseconds(200 + g() % 1800));
      proxy->remove_fault(id);
      // Black-holed connections stay open: cut them, as a peer would time out.
      proxy->add_fault(kvlink_test::fault::reset(0));
      std::this_thread::sleep_for(50ms);
      proxy->clear_faults();
      last_clear = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count();
      std::this_thread::sleep_for(3s);  // operations in flight settle
      faulty = false;
    }
  });

  // The pool's peaks, for the report when something went wrong.
  struct {
    std::atomic<std::uint64_t> used{0}, reserved{0}, objects{0}, in_progress{0};
  } peak;
  std::thread sampler([&] {
    const auto keep_max = [](std::atomic<std::uint64_t>& a, std::uint64_t v) {
      if (v > a.load()) a = v;
    };
    while (!stop.load()) {
      const std::string text = master->service().metrics_text();
      keep_max(peak.used, metric(text, "kvlink_store_used_bytes"));
      keep_max(peak.reserved, metric(text, "kvlink_store_reserved_bytes"));
      keep_max(peak.objects, metric(text, "kvlink_store_objects"));
      keep_max(peak.in_progress, metric(text, "kvlink_store_puts_in_progress"));
      std::this_thread::sleep_for(50ms);
    }
  });

  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::thread> users;
  for (std::size_t c = 0; c < members.size(); ++c) {
    users.emplace_back([&, c] {
      auto& m = *members[c];
      std::mt19937_64 g{seed * 1000 + c};
      std::uint64_t next = 0, kept_bytes = 0;
      std::vector<std::string> doubtful;  // failed puts and removes, to remove
      while (std::chrono::steady_clock::now() < end) {
        const bool during = faulty.load();
        auto& mine = kept[c];
        const auto pick = g() % 10;
        bool failed = false;
        const char* what = "";
        std::string failed_key, failure;
        const auto began = std::chrono::steady_clock::now();
        if (!doubtful.empty() && !during && pick < 3) {
          // A key whose put or remove failed may exist on the master all
          // the same (its answer was lost): remove it, as a user would,
          // or the forgotten (pinned) objects fill the pool.
          const std::string key = doubtful.back();
          auto f = m.client.async_remove(key, true, asio::use_future);
          if (!wait(f)) {
            ++t.hangs;
            break;
          }
          try {
            f.get();
            doubtful.pop_back();
          } catch (const std::system_error& e) {
            if (e.code() == kvlink::store_errc::object_not_found) {
              doubtful.pop_back();  // never completed, or removed already
            } else if (e.code() == kvlink::store_errc::object_in_progress) {
              // Its put has not ended: the master discards it soon. Try
              // the others first.
              doubtful.pop_back();
              doubtful.insert(doubtful.begin(), key);
            } else {
              failed = true;
              what = "remove (clean-up)";
              failed_key = key;
              failure = e.what();
            }
          }
          ++t.cleanups;
        } else if (mine.empty() || (pick < 4 && kept_bytes < (6u << 20))) {
          const std::string key =
              std::string("c").append(std::to_string(c)).append("/").append(std::to_string(next++));
          const known k{1 + g() % max_object, g()};
          kvlink_test::fill_pattern(m.work.data(), k.size, k.seed, 0);
          store::put_config pc;
          pc.replicas = g() % 3 == 0 ? 2 : 1;
          pc.hard_pin = true;  // no eviction: what is kept must stay
          auto f = m.client.async_put(key, m.work.data(), k.size, pc, {}, asio::use_future);
          if (!wait(f)) {
            ++t.hangs;
            break;
          }
          try {
            f.get();
            mine[key] = k;
            kept_bytes += k.size;
            ++t.puts;
          } catch (const std::system_error& e) {
            doubtful.push_back(key);
            failed = true;
            what = "put";
            failed_key = key;
            failure = e.what();
          }
        } else {
          auto it = mine.begin();
          std::advance(it, static_cast<std::ptrdiff_t>(g() % mine.size()));
          if (pick < 8) {
            auto f = m.client.async_get(it->first, m.work.data(), m.work.size(), asio::use_future);
            if (!wait(f)) {
              ++t.hangs;
              break;
            }
            try {
              const auto size = f.get();
              ++t.gets;
              if (size != it->second.size ||
                  !kvlink_test::is_pattern(m.work.data(), size, it->second.seed, 0)) {
                ++t.corrupted;
                std::fprintf(stderr, "corrupted: %s\n", it->first.c_str());
              }
            } catch (const std::system_error& e) {
              failed = true;
              what = "get";
              failed_key = it->first;
              failure = e.what();
            }
          } else if (pick == 8) {
            auto f = m.client.async_exists(it->first, asio::use_future);
            if (!wait(f)) {
              ++t.hangs;
              break;
            }
            try {
              (void)f.get();
            } catch (const std::system_error& e) {
              failed = true;
              what = "exists";
              failed_key = it->first;
              failure = e.what();
            }
          } else {
            auto f = m.client.async_remove(it->first, true, asio::use_future);
            if (!wait(f)) {
              ++t.hangs;
              break;
            }
            // Not kept any more, whatever the answer; a failed remove
            // is done again later (the key may still be there).
            try {
              f.get();
            } catch (const std::system_error& e) {
              doubtful.push_back(it->first);
              failed = true;
              what = "remove";
              failed_key = it->first;
              failure = e.what();
            }
            kept_bytes -= it->second.size;
            mine.erase(it);
          }
        }
        ++t.ops;
        if (failed) {
          if (during || faulty.load()) {
            ++t.failed_in_fault;
          } else {
            ++t.failed_clean;
            // Say which operation, and how long after the last fault was
            // cleared: the 3 s settling time may be too short, or the
            // failure has nothing to do with the faults.
            const auto ms = [](auto d) {
              return static_cast<long long>(
                  std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
            };
            std::fprintf(stderr,
                         "failed without a fault: %s %s: %s (began %lld ms after the last fault "
                         "was cleared, took %lld ms)\n",
                         what, failed_key.c_str(), failure.c_str(),
                         ms(began - std::chrono::steady_clock::time_point(
                                        std::chrono::nanoseconds(last_clear.load()))),
                         ms(std::chrono::steady_clock::now() - began));
          }
        }
      }
    });
  }
  for (auto& u : users) u.join();
  stop = true;
  chaos.join();
  sampler.join();
  proxy->clear_faults();

  // Nothing acknowledged is lost: every kept key, read by another client.
  std::uint64_t lost = 0, checked = 0;
  for (std::size_t c = 0; c < members.size(); ++c) {
    auto& reader = *members[(c + 1) % members.size()];
    for (const auto& [key, k] : kept[c]) {
      ++checked;
      std::error_code ec;
      std::uint64_t size = 0;
      for (int attempt = 0; attempt < 50; ++attempt) {
        auto f =
            reader.client.async_get(key, reader.work.data(), reader.work.size(), asio::use_future);
        if (!wait(f)) {
          ++t.hangs;
          break;
        }
        try {
          size = f.get();
          ec = {};
        } catch (const std::system_error& e) {
          ec = e.code();
        }
        if (ec != kvlink::store_errc::rpc_failed && ec != kvlink::store_errc::rpc_timeout) break;
        std::this_thread::sleep_for(100ms);  // still reconnecting after the last fault
      }
      if (ec) {
        ++lost;
        std::fprintf(stderr, "lost: %s (%s)\n", key.c_str(), ec.message().c_str());
      } else if (size != k.size || !kvlink_test::is_pattern(reader.work.data(), size, k.seed, 0)) {
        ++t.corrupted;
        std::fprintf(stderr, "corrupted at the end: %s\n", key.c_str());
      }
    }
  }
  const std::uint64_t evicted =
      metric(master->service().metrics_text(), "kvlink_store_evicted_objects_total");
  if (lost > 0 || t.failed_clean.load() > 0 || evicted > 0) {
    std::fprintf(stderr,
                 "master: at most %llu bytes used (%llu of them reserved by discarded puts), "
                 "%llu objects, %llu puts in progress, sampled every 50 ms\n",
                 static_cast<unsigned long long>(peak.used.load()),
                 static_cast<unsigned long long>(peak.reserved.load()),
                 static_cast<unsigned long long>(peak.objects.load()),
                 static_cast<unsigned long long>(peak.in_progress.load()));
    // What the master did that could explain it: its pool, evictions,
    // discarded puts, errors by code.
    std::fprintf(stderr, "master: %s", master->service().summary_text().c_str());
    std::istringstream metrics(master->service().metrics_text());
    for (std::string line; std::getline(metrics, line);) {
      if (line.empty() || line[0] == '#') continue;
      if (line.find("evict") != std::string::npos || line.find("reclaimed") != std::string::npos ||
          line.find("released") != std::string::npos || line.find("gone") != std::string::npos ||
          (line.find("errors_total") != std::string::npos && line.back() != '0')) {
        std::fprintf(stderr, "master: %s\n", line.c_str());
      }
    }
  }
  for (auto& m : members) m->client.async_close(asio::use_future).get();
  members.clear();
  proxy.reset();
  master->async_close(asio::use_future).get();
  master.reset();
  guard.reset();
  for (auto& r : runners) r.join();

  std::printf(
      "store soak: %llu ops (%llu puts, %llu gets, %llu clean-up removes), %llu objects "
      "evicted, %llu faults; failed during faults %llu, failed without a fault %llu; %llu kept "
      "objects checked at the end: %llu lost, %llu corrupted; %llu hangs\n",
      static_cast<unsigned long long>(t.ops.load()), static_cast<unsigned long long>(t.puts.load()),
      static_cast<unsigned long long>(t.gets.load()),
      static_cast<unsigned long long>(t.cleanups.load()), static_cast<unsigned long long>(evicted),
      static_cast<unsigned long long>(faults.load()),
      static_cast<unsigned long long>(t.failed_in_fault.load()),
      static_cast<unsigned long long>(t.failed_clean.load()),
      static_cast<unsigned long long>(checked), static_cast<unsigned long long>(lost),
      static_cast<unsigned long long>(t.corrupted.load()),
      static_cast<unsigned long long>(t.hangs.load()));
  const bool ok = lost == 0 && t.corrupted.load() == 0 && t.hangs.load() == 0 &&
                  t.failed_clean.load() == 0 && t.puts.load() > 0 && t.gets.load() > 0;
  return ok ? 0 : 1;
}
