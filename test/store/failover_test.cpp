// Masters standing for election through a real etcd (Debian's etcd-server,
// started here on loopback): kvlink-master processes with --ha-etcd and
// kvlink_store_peer clients that name etcd, not a master. The leader is
// SIGKILLed under load, stopped cleanly, and cut from its key; every put
// acknowledged before is read back with its bytes. Exits 77 (skipped)
// without an etcd binary, unless KVLINK_REQUIRE_ETCD=1.
#define DOCTEST_CONFIG_IMPLEMENT
#include <kvlink/store/wire/leader.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "../metadata/harness.hpp"
#include "processes.hpp"
#include <doctest/doctest.h>
#include <sys/wait.h>

#ifndef KVLINK_MASTER_PATH
#error "KVLINK_MASTER_PATH and KVLINK_STORE_PEER_PATH are set by test/store/CMakeLists.txt"
#endif

namespace {

using namespace kvlink_store_test;
using kvlink_meta::etcd_cluster;

// A master standing for election in `cluster` (short heartbeats and a 2 s
// leader lease, so the tests see a dead leader replaced within seconds).
struct candidate {
  candidate(const std::string& etcd, const std::string& cluster)
      : config(R"({"store_heartbeat_interval": "100ms", "store_suspect_after": "400ms",
                   "store_liveness_timeout": "1500ms", "store_ha_leader_ttl": "2s",
                   "store_ha_cluster": ")" +
               cluster + "\"}"),
        proc(KVLINK_MASTER_PATH,
             {"--listen", "127.0.0.1:0", "--ha-etcd", etcd, "--config", config.path},
             "kvlink-master: standing for election in cluster " + cluster + " as ") {
    address = proc.address();
  }
  temp_file config;
  peer_process proc;
  std::string address;
};

struct cluster_of_masters {
  cluster_of_masters(const etcd_cluster& e, int n) : etcd(e) {
    std::random_device rd;
    name = "failover" + std::to_string(rd() % 1000000);
    for (int i = 0; i < n; ++i) masters.push_back(std::make_unique<candidate>(e.url(), name));
  }

  // The leader's address as etcd holds it ("" none).
  std::string leader_in_etcd() const {
    nlohmann::json out;
    const nlohmann::json range{
        {"key", kvlink::detail::http::base64_encode(kvlink::store::wire::leader_key(name))}};
    if (kvlink_meta::etcd_call(etcd.endpoint(0), "/v3/kv/range", range, out)) return {};
    const auto kvs = out.value("kvs", nlohmann::json::array());
    if (kvs.empty()) return {};
    return kvlink::detail::http::base64_decode(kvs[0].value("value", std::string{})).value_or("");
  }

  // Waits until etcd names one of the masters other than `not_this`;
  // returns its index (-1 after `limit`).
  int wait_leader(const std::string& not_this = {}, std::chrono::seconds limit = 20s) const {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      const auto l = leader_in_etcd();
      if (!l.empty() && l != not_this) {
        for (std::size_t i = 0; i < masters.size(); ++i) {
          if (masters[i] && masters[i]->address == l) return static_cast<int>(i);
        }
      }
      std::this_thread::sleep_for(20ms);
    }
    return -1;
  }

  std::string url() const { return etcd.url(); }

  const etcd_cluster& etcd;
  std::string name;
  std::vector<std::unique_ptr<candidate>> masters;
};

peer_process follower(const cluster_of_masters& c, std::uint64_t mount = 64u << 20) {
  return peer_process(KVLINK_STORE_PEER_PATH,
                      {"--master", c.url(), "--cluster", c.name, "--mount", std::to_string(mount)},
                      "READY ");
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

TEST_CASE("store failover: the leader SIGKILLed under load, twice: a standby leads, nothing lost") {
  kvlink_meta::temp_dir dir;
  etcd_cluster etcd(dir.path, {});
  cluster_of_masters c(etcd, 3);
  const int first = c.wait_leader();
  REQUIRE(first >= 0);
  // The leader says so on its own stdout; standbys say nothing more.
  CHECK(c.masters[static_cast<std::size_t>(first)]->proc.read_line(10s).rfind(
            "kvlink-master: leading cluster " + c.name + "; listening on " +
                c.masters[static_cast<std::size_t>(first)]->address,
            0) == 0);
  auto a = follower(c);
  auto d = follower(c);
  auto w1 = follower(c, 8u << 20);
  auto w2 = follower(c, 0);
  auto r = follower(c, 0);
  std::vector<double> elected, serving;
  const auto out = put_get_load(w1, w2, r, [&] {
    for (int round = 0; round < 2; ++round) {
      std::this_thread::sleep_for(1500ms);
      // (No REQUIRE in here: the load's threads must be joined.)
      const int lead = c.wait_leader();
      if (lead < 0) {
        FAIL_CHECK("no leader before round " << round);
        return;
      }
      const std::string was = c.masters[static_cast<std::size_t>(lead)]->address;
      const auto t0 = std::chrono::steady_clock::now();
      c.masters[static_cast<std::size_t>(lead)].reset();  // SIGKILL
      const int next = c.wait_leader(was);
      if (next < 0) {
        FAIL_CHECK("no new leader within 20 s of round " << round);
        return;
      }
      elected.push_back(seconds_since(t0));
      // Served again: a put through the new leader (a client of its own).
      auto probe = follower(c, 0);
      CHECK(until(probe, "PUT probe-" + std::to_string(round) + " 100 1", "OK", 20s) == "OK");
      serving.push_back(seconds_since(t0));
      CHECK(probe.finish() == 0);
      // The killed one comes back as a standby.
      c.masters[static_cast<std::size_t>(lead)] = std::make_unique<candidate>(c.url(), c.name);
    }
    std::this_thread::sleep_for(1500ms);
  });
  CHECK(out.bad_reads == 0);
  REQUIRE(out.acked > 50);
  for (std::size_t i = 0; i < elected.size(); ++i) {
    MESSAGE("failover " << i + 1 << ": a new leader in etcd after " << elected[i]
                        << " s, a put served after " << serving[i] << " s (leader lease 2 s)");
  }
  MESSAGE(out.acked << " puts acknowledged, " << out.reads << " gets");
  for (const auto& e : out.lost_examples) MESSAGE(e);
  CHECK(out.lost == 0);
  for (auto* p : {&a, &d, &w1, &w2, &r}) CHECK(p->finish() == 0);
}

TEST_CASE("store failover: a leader stopped with SIGTERM hands over at once and exits 0") {
  kvlink_meta::temp_dir dir;
  etcd_cluster etcd(dir.path, {});
  cluster_of_masters c(etcd, 2);
  const int first = c.wait_leader();
  REQUIRE(first >= 0);
  auto a = follower(c);
  REQUIRE(a.command("PUT kept 50000 3") == "OK");
  const std::string was = c.masters[static_cast<std::size_t>(first)]->address;
  const auto t0 = std::chrono::steady_clock::now();
  c.masters[static_cast<std::size_t>(first)]->proc.signal(SIGTERM);
  // Its lease is revoked: the standby leads at once (well before the 2 s
  // lease would have run out on its own).
  const int next = c.wait_leader(was, 20s);
  REQUIRE(next >= 0);
  MESSAGE("handed over in " << seconds_since(t0) << " s");
  CHECK(next != first);
  CHECK(c.masters[static_cast<std::size_t>(first)]->proc.finish(20s) == 0);
  // The object comes back from its owner's records.
  CHECK(until(a, "GET kept 3", "OK", 20s) == "OK 50000");
  CHECK(a.finish() == 0);
}

TEST_CASE("store failover: a leader whose key is taken from it stops serving and exits 3") {
  kvlink_meta::temp_dir dir;
  etcd_cluster etcd(dir.path, {});
  cluster_of_masters c(etcd, 2);
  const int first = c.wait_leader();
  REQUIRE(first >= 0);
  const std::string was = c.masters[static_cast<std::size_t>(first)]->address;
  auto a = follower(c);
  REQUIRE(a.command("PUT mine 4096 5") == "OK");
  // Someone deletes the leader's key: the standby takes it; the old leader
  // sees its key name another and gives up.
  nlohmann::json out;
  const nlohmann::json del{
      {"key", kvlink::detail::http::base64_encode(kvlink::store::wire::leader_key(c.name))}};
  REQUIRE(!kvlink_meta::etcd_call(etcd.endpoint(0), "/v3/kv/deleterange", del, out));
  const int next = c.wait_leader(was);
  REQUIRE(next >= 0);
  CHECK(c.masters[static_cast<std::size_t>(first)]->proc.finish(20s) == 3);
  CHECK(until(a, "GET mine 5", "OK", 20s) == "OK 4096");
  CHECK(a.finish() == 0);
}

// Runs kvlink-master with `args` to its end; its exit status and what it
// wrote (stdout and stderr).
std::pair<int, std::string> run_master(const std::string& args) {
  const std::string cmd = std::string(KVLINK_MASTER_PATH) + " " + args + " 2>&1 </dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string text;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) text.append(buf, n);
  const int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, text};
}

TEST_CASE("store failover: bad election settings are refused with a message") {
  kvlink_meta::temp_dir dir;
  etcd_cluster etcd(dir.path, {});
  // A wildcard address names nothing clients can dial.
  auto [st, text] = run_master("--listen 0.0.0.0:0 --ha-etcd " + etcd.url());
  CHECK(st == 2);
  CHECK(text.find("wildcard") != std::string::npos);
  std::tie(st, text) = run_master("--listen 127.0.0.1:0 --ha-etcd etcd://nohostport");
  CHECK(st == 2);
  CHECK(text.find("store_ha_etcd") != std::string::npos);
  std::tie(st, text) =
      run_master("--listen 127.0.0.1:0 --enable_ha --ha_backend_type redis --etcd_endpoints " +
                 etcd.endpoint(0));
  CHECK(st == 2);
  CHECK(text.find("etcd only") != std::string::npos);
  std::tie(st, text) = run_master("--listen 127.0.0.1:0 --enable_ha");
  CHECK(st == 2);
  CHECK(text.find("--etcd_endpoints") != std::string::npos);
}

int main(int argc, char** argv) {
  if (kvlink_meta::etcd_binary().empty()) return kvlink_meta::without_etcd();
  doctest::Context context(argc, argv);
  return context.run();
}
