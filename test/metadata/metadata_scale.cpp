// kvlink_metadata_scale: many engines' descriptors in etcd, one engine
// watching them. A child process runs N lightweight publishers (the etcd
// backend alone, each with its own lease and connection, publishing a
// descriptor of 8 segments); this process runs one kvlink engine on the
// same etcd and measures
//   - the time until all N descriptors are in etcd (the publishers say) and
//     until the watching engine can resolve every name;
//   - the time for one change (a publisher's new segment list) to reach the
//     watching engine, over --changes changes;
//   - the watching engine's memory per cached peer (its RSS growth / N).
//
//   kvlink_metadata_scale [--publishers 1000] [--changes 20] [--ttl 10s]
//
// It starts its own etcd (Debian's etcd-server) on loopback; exit 77 when
// there is none. Exit 1 when a name or a change never arrives.
#include <kvlink/engine.hpp>
#include <kvlink/metadata/etcd.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../support/process_stats.hpp"
#include "harness.hpp"
#include <asio/executor_work_guard.hpp>
#include <asio/strand.hpp>
#include <asio/use_future.hpp>

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;  // CLOCK_MONOTONIC: one clock for both processes

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now().time_since_epoch())
      .count();
}

kvlink::control::peer_descriptor descriptor(std::size_t i, std::uint64_t seq, std::size_t segs) {
  kvlink::control::peer_descriptor d;
  d.instance = kvlink::make_instance_id();
  d.name = "pub-" + std::to_string(i);
  d.address = "10.0." + std::to_string(i / 250) + "." + std::to_string(i % 250) + ":17001";
  d.seq = seq;
  for (std::size_t s = 0; s < segs; ++s) {
    d.segments.push_back({kvlink::segment_id{s + 1}, 0x7f0000000000ull + (s << 30), 1ull << 30,
                          kvlink::access::remote_read_write, nlohmann::json::object()});
  }
  d.transports = {{"tcp", nlohmann::json::object()}};
  return d;
}

// The child: N publishers, then a change every 200 ms.
int publishers(const std::string& url, std::size_t n, std::size_t changes,
               std::chrono::milliseconds ttl) {
  kvlink::metadata_url u;
  if (kvlink::parse_metadata_url(url, u)) return 2;
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  std::vector<std::shared_ptr<kvlink::etcd_metadata>> pubs;
  std::vector<asio::strand<asio::io_context::executor_type>> strands;
  std::vector<kvlink::control::peer_descriptor> descs;
  std::printf("START %lld\n", static_cast<long long>(now_ns()));
  std::fflush(stdout);
  for (std::size_t i = 0; i < n; ++i) {
    kvlink::etcd_metadata::options o;
    o.url = url;
    o.endpoints = u.endpoints;
    o.self_name = "pub-" + std::to_string(i);
    o.ttl = ttl;
    o.follow = false;
    strands.push_back(asio::make_strand(io));
    auto p = std::make_shared<kvlink::etcd_metadata>(strands.back(), std::move(o));
    descs.push_back(descriptor(i, 1, 8));
    p->publish(descs.back());
    p->watch([](const kvlink::metadata_event&) {});
    pubs.push_back(std::move(p));
  }
  const auto t0 = clock_type::now();
  std::thread runner([&io] { io.run(); });
  for (;;) {
    std::promise<std::size_t> count;
    // (each publisher is strand-only; a count that is a moment stale is fine)
    asio::post(io, [&] {
      std::size_t done = 0;
      for (const auto& p : pubs) done += p->published() ? 1 : 0;
      count.set_value(done);
    });
    if (count.get_future().get() == n) break;
    std::this_thread::sleep_for(5ms);
  }
  std::printf(
      "PUBLISHED %lld\n",
      static_cast<long long>(
          std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - t0).count()));
  std::fflush(stdout);
  std::this_thread::sleep_for(1s);
  for (std::size_t c = 0; c < changes; ++c) {
    const std::size_t i = (c * 37) % n;
    auto d = descs[i];
    d.seq += 1;
    d.segments.pop_back();  // a segment unregistered
    descs[i] = d;
    std::printf("CHANGED %s %llu %lld\n", d.name.c_str(), static_cast<unsigned long long>(d.seq),
                static_cast<long long>(now_ns()));
    std::fflush(stdout);
    asio::post(strands[i], [p = pubs[i], d] { p->publish(d); });
    std::this_thread::sleep_for(200ms);
  }
  std::printf("DONE\n");
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::hours(1));  // until killed
  work.reset();
  io.stop();
  runner.join();
  return 0;
}

bool parse_duration_ms(const char* text, std::chrono::milliseconds& out) {
  const auto d = kvlink::parse_duration(text ? text : "");
  if (!d) return false;
  out = *d;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = 1000, changes = 20;
  std::chrono::milliseconds ttl = 10s;
  std::string role, url;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--publishers") {
      n = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (a == "--changes") {
      changes = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (a == "--ttl") {
      if (!parse_duration_ms(argv[i + 1], ttl)) return 2;
    } else if (a == "--role") {
      role = argv[i + 1];
    } else if (a == "--etcd") {
      url = argv[i + 1];
    } else {
      std::fprintf(stderr,
                   "usage: kvlink_metadata_scale [--publishers N] [--changes K] [--ttl D]\n");
      return 2;
    }
  }
  if (n == 0) return 2;
  if (role == "publishers") return publishers(url, n, changes, ttl);

  if (kvlink_meta::etcd_binary().empty()) return kvlink_meta::without_etcd();
  kvlink_meta::temp_dir dir;
  kvlink_meta::etcd_cluster etcd(dir.path, {});
  url = etcd.url();

  // The watching engine, its io_context on a thread of its own.
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  kvlink::config cfg{.listen = "127.0.0.1:0"};
  cfg.name = "watcher";
  cfg.metadata.url = url;
  cfg.metadata.lease_ttl = ttl;
  auto engine = std::make_unique<kvlink::tcp_engine>(io.get_executor(), cfg);
  std::thread runner([&io] { io.run(); });
  const auto resolve = [&](const std::string& name) {
    return engine->async_resolve(name, asio::use_future).get();
  };
  std::this_thread::sleep_for(500ms);
  const std::uint64_t rss0 = kvlink_test::rss_kib();

  char self[4096];
  const auto len = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return 1;
  self[len] = '\0';
  kvlink_meta::process child(
      {self, "--role", "publishers", "--etcd", url, "--publishers", std::to_string(n), "--changes",
       std::to_string(changes), "--ttl", std::to_string(ttl.count()) + "ms"},
      "");
  const std::string start = child.read_line(60s);
  if (start.rfind("START ", 0) != 0) {
    std::fprintf(stderr, "the publishers said '%s'\n", start.c_str());
    return 1;
  }
  const std::int64_t t_start = std::stoll(start.substr(6));
  // Every name visible to the watcher (in reverse: the last started first).
  std::size_t next = n;
  while (next > 0) {
    try {
      resolve("pub-" + std::to_string(next - 1));
      --next;
    } catch (const std::system_error&) {
      if (std::chrono::nanoseconds(now_ns() - t_start) > 120s) {
        std::fprintf(stderr, "pub-%zu never became visible\n", next - 1);
        return 1;
      }
      std::this_thread::sleep_for(2ms);
    }
  }
  const double visible_s = static_cast<double>(now_ns() - t_start) / 1e9;
  const std::string published = child.read_line(120s);
  const double published_s =
      published.rfind("PUBLISHED ", 0) == 0 ? std::stod(published.substr(10)) / 1e3 : -1.0;
  std::this_thread::sleep_for(300ms);
  const std::uint64_t rss1 = kvlink_test::rss_kib();

  // Changes: from the publisher's call to publish() to the watcher's cache.
  std::vector<double> latencies_ms;
  for (;;) {
    const std::string line = child.read_line(60s);
    if (line == "DONE") break;
    if (line.rfind("CHANGED ", 0) != 0) {
      std::fprintf(stderr, "the publishers said '%s'\n", line.c_str());
      return 1;
    }
    char name[64];
    unsigned long long seq = 0;
    long long t = 0;
    if (std::sscanf(line.c_str(), "CHANGED %63s %llu %lld", name, &seq, &t) != 3) return 1;
    for (;;) {
      const auto rp = resolve(name);
      if (rp.descriptor && rp.descriptor->seq >= seq) break;
      if (std::chrono::nanoseconds(now_ns() - t) > 30s) {
        std::fprintf(stderr, "the change of %s never arrived\n", name);
        return 1;
      }
      std::this_thread::sleep_for(200us);
    }
    latencies_ms.push_back(static_cast<double>(now_ns() - t) / 1e6);
  }
  std::sort(latencies_ms.begin(), latencies_ms.end());
  const auto value_size =
      kvlink::detail::encode_entry(descriptor(0, 1, 8), kvlink::control::peer_guard{}).size();

  std::printf(
      "kvlink_metadata_scale: %zu publishers (descriptors of 8 segments, %zu B), one "
      "watching engine, etcd on loopback\n",
      n, value_size);
  std::printf("  all published (etcd acknowledged every put): %.2f s\n", published_s);
  std::printf("  all visible to the watching engine:          %.2f s\n", visible_s);
  if (!latencies_ms.empty()) {
    std::printf("  one change to the watcher: median %.1f ms, max %.1f ms (%zu changes)\n",
                latencies_ms[latencies_ms.size() / 2], latencies_ms.back(), latencies_ms.size());
  }
  std::printf("  watcher memory per cached peer: %.2f KiB (RSS %llu -> %llu KiB)\n",
              static_cast<double>(rss1 - std::min(rss0, rss1)) / static_cast<double>(n),
              static_cast<unsigned long long>(rss0), static_cast<unsigned long long>(rss1));
  child.kill_now();
  engine.reset();
  work.reset();
  io.stop();
  runner.join();
  return 0;
}
