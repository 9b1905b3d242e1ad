// Leader election among store masters through etcd (server_options::ha_etcd,
// mooncake_master's --enable_ha --etcd_endpoints): several kvlink-master
// processes stand for one cluster; one leads and serves clients, the others
// wait. No operation log: a master that takes over starts empty and the
// clients rebuild it (they mount again with the objects their segments
// hold, store/wire/record.hpp), as after a restart.
//
//   auto e = std::make_shared<kvlink::store::leader_election>(io.get_executor(), opts);
//   e->start([&] { master.serve(); },                      // elected
//            [&](std::string why) { /* stop serving, exit */ });
//
// How (etcd v3's JSON gateway, through kvlink's etcd client):
// - Campaign: grant a lease of `ttl`, then one transaction: if the key
//   wire::leader_key(cluster) does not exist, put our address under the
//   lease (we lead), else read it (who leads). A standby revokes its lease
//   and watches the key from the revision it read; when the key is deleted
//   (the leader resigned, or its lease expired: it stopped, hung or lost
//   etcd) it tries again. The watch is closed and the key read again every
//   `resync` as well, so a watch that etcd dropped silently cannot keep a
//   standby waiting.
// - Leading: keepalive every ttl/3 and read the key after each: our value
//   under our lease, or we lost it. A leader that cannot confirm its lease
//   within ttl/2 (etcd away, a partition, a process stopped long enough)
//   gives the leadership up before etcd can hand it to another: `lost`
//   runs with why, and the master must stop serving (kvlink-master closes
//   and exits with status 3 for its supervisor to start it as a standby).
// - Resign (a clean shutdown): revoke the lease, so the key goes and a
//   standby takes over at once instead of after the TTL.
//
// Every etcd call runs on this object's strand; start() and resign() may be
// called from any thread.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/metadata/etcd.hpp>
#include <kvlink/store/wire/leader.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <asio/strand.hpp>
#include <nlohmann/json.hpp>

namespace kvlink::store {

class leader_election : public std::enable_shared_from_this<leader_election> {
 public:
  struct options {
    std::vector<std::string> endpoints;  ///< etcd's client endpoints, host:port
    std::string cluster{wire::default_cluster};
    std::string address;  ///< what clients dial when this master leads
    /// The leader's lease: how long a dead leader keeps its key.
    std::chrono::milliseconds ttl{5000};
    /// A standby reads the key again this often even when its watch is quiet.
    std::chrono::milliseconds resync{10000};
    std::string user{}, password{};  ///< etcd authentication, when on
  };

  leader_election(const asio::any_io_executor& ex, options o)
      : strand_(asio::make_strand(ex)),
        o_(std::move(o)),
        key_(wire::leader_key(o_.cluster)),
        etcd_(strand_, {o_.endpoints, nullptr, o_.user, o_.password, call_timeout(o_.ttl)}),
        timer_(strand_),
        resync_(strand_) {}

  /// Stands for election: `elected` runs once when this master leads,
  /// `lost` (with why) when it no longer does or cannot know; neither runs
  /// after resign() or shutdown().
  void start(std::function<void()> elected, std::function<void(std::string)> lost) {
    asio::co_spawn(strand_, run(shared_from_this(), std::move(elected), std::move(lost)),
                   asio::detached);
  }

  /// Gives the leadership up (revokes the lease, bounded by the call
  /// timeout) or stops campaigning; `done` runs after.
  void resign(std::function<void()> done) {
    asio::co_spawn(
        strand_,
        [self = shared_from_this(), done = std::move(done)]() -> asio::awaitable<void> {
          self->stopped_ = true;
          self->timer_.cancel();
          self->resync_.cancel();
          self->etcd_.close_watch();
          if (self->lease_ != 0) {
            nlohmann::json out;
            std::string what;
            const nlohmann::json body{{"ID", std::to_string(self->lease_)}};
            (void)co_await self->etcd_.call("/v3/lease/revoke", body, out, what);
            self->lease_ = 0;
          }
          self->etcd_.shutdown();
          done();
        },
        asio::detached);
  }

  /// The address of the leader last seen ("" none yet); strand-only.
  const std::string& leader() const noexcept { return leader_; }

 private:
  static std::chrono::milliseconds call_timeout(std::chrono::milliseconds ttl) {
    return std::max(std::chrono::milliseconds(200), ttl / 3);
  }

  static asio::awaitable<void> run(std::shared_ptr<leader_election> self,
                                   std::function<void()> elected,
                                   std::function<void(std::string)> lost) {
    if (!co_await self->campaign()) co_return;
    elected();
    std::string why = co_await self->hold();
    if (!self->stopped_) lost(std::move(why));
  }

  asio::awaitable<void> pause(std::chrono::milliseconds d) {
    timer_.expires_after(d);
    auto [ec] = co_await timer_.async_wait(kvlink::detail::http::nothrow);
    (void)ec;
  }

  // Until this master leads (true) or the election is stopped (false).
  asio::awaitable<bool> campaign() {
    auto backoff = std::chrono::milliseconds(100);
    std::string down;  // the last etcd failure logged ("" while etcd answers)
    auto failed = [&](const std::string& what) {
      if (down != what) {
        kvlink::detail::log("store election: etcd at {} fails: {}; trying again", etcd_.endpoint(),
                            what);
        down = what;
      }
    };
    while (!stopped_) {
      nlohmann::json out;
      std::string what;
      if (lease_ == 0) {
        const auto secs = std::max<std::int64_t>(
            1,
            (std::chrono::duration_cast<std::chrono::milliseconds>(o_.ttl).count() + 999) / 1000);
        const nlohmann::json grant{{"TTL", std::to_string(secs)}};
        if (co_await etcd_.call("/v3/lease/grant", grant, out, what)) {
          failed(what);
          co_await pause(backoff);
          backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
          continue;
        }
        lease_ = kvlink::detail::json_int64(out, "ID");
        if (lease_ == 0) {
          failed("no lease granted: " + out.dump());
          co_await pause(backoff);
          continue;
        }
      }
      const std::string key = kvlink::detail::http::base64_encode(key_);
      const nlohmann::json txn{
          {"compare", {{{"key", key}, {"target", "CREATE"}, {"create_revision", "0"}}}},
          {"success",
           {{{"request_put",
              {{"key", key},
               {"value", kvlink::detail::http::base64_encode(o_.address)},
               {"lease", std::to_string(lease_)}}}}}},
          {"failure", {{{"request_range", {{"key", key}}}}}}};
      if (co_await etcd_.call("/v3/kv/txn", txn, out, what)) {
        failed(what);
        co_await pause(backoff);
        backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
        continue;
      }
      down.clear();
      backoff = std::chrono::milliseconds(100);
      if (out.value("succeeded", false)) {
        leader_ = o_.address;
        last_ok_ = std::chrono::steady_clock::now();
        kvlink::detail::log("store election: {} leads cluster \"{}\" (etcd key {})", o_.address,
                            o_.cluster, key_);
        co_return !stopped_;
      }
      // Someone leads: who, and from which revision to watch.
      std::string now_leading;
      std::int64_t rev = 0;
      if (const auto h = out.find("header"); h != out.end()) {
        rev = kvlink::detail::json_int64(*h, "revision");
      }
      const auto responses = out.value("responses", nlohmann::json::array());
      if (!responses.empty()) {
        const auto range = responses[0].value("response_range", nlohmann::json::object());
        const auto kvs = range.value("kvs", nlohmann::json::array());
        if (!kvs.empty()) {
          now_leading = kvlink::detail::http::base64_decode(kvs[0].value("value", std::string{}))
                            .value_or("(not base64)");
        }
      }
      if (now_leading != leader_) {
        leader_ = now_leading;
        kvlink::detail::log("store election: {} stands by; {} leads cluster \"{}\"", o_.address,
                            leader_.empty() ? std::string("nobody") : leader_, o_.cluster);
      }
      // Our lease is not needed while we wait (a new one per attempt).
      {
        nlohmann::json ignored;
        const nlohmann::json revoke{{"ID", std::to_string(lease_)}};
        (void)co_await etcd_.call("/v3/lease/revoke", revoke, ignored, what);
        lease_ = 0;
      }
      if (stopped_) break;
      co_await wait_for_delete(rev);
    }
    co_return false;
  }

  // Watches the key from rev + 1 until it is deleted, the watch breaks, or
  // `resync` passes.
  asio::awaitable<void> wait_for_delete(std::int64_t rev) {
    const nlohmann::json create{{"create_request",
                                 {{"key", kvlink::detail::http::base64_encode(key_)},
                                  {"start_revision", std::to_string(rev + 1)}}}};
    bool deleted = false;
    auto on_message = [&deleted](const nlohmann::json& j) {
      const auto r = j.value("result", nlohmann::json::object());
      for (const auto& e : r.value("events", nlohmann::json::array())) {
        if (e.value("type", std::string{}) == "DELETE") deleted = true;
      }
      return !deleted;
    };
    resync_.expires_after(o_.resync);
    resync_.async_wait([self = shared_from_this()](std::error_code ec) {
      if (!ec) self->etcd_.close_watch();
    });
    std::string what;
    const auto started = std::chrono::steady_clock::now();
    const auto ec = co_await etcd_.watch(create, on_message, what);
    resync_.cancel();
    // A watch that broke at once (etcd away): do not spin on it.
    if (ec && !deleted && std::chrono::steady_clock::now() - started < std::chrono::seconds(1)) {
      co_await pause(std::chrono::milliseconds(200));
    }
  }

  // While this master leads; returns why it no longer does.
  asio::awaitable<std::string> hold() {
    const auto period = std::max(std::chrono::milliseconds(50), o_.ttl / 3);
    const auto limit = o_.ttl / 2;
    std::string failure;
    while (!stopped_) {
      co_await pause(failure.empty() ? period : std::chrono::milliseconds(100));
      if (stopped_) break;
      const auto sent = std::chrono::steady_clock::now();
      nlohmann::json out;
      std::string what;
      const nlohmann::json keepalive{{"ID", std::to_string(lease_)}};
      std::error_code ec = co_await etcd_.call("/v3/lease/keepalive", keepalive, out, what);
      if (!ec) {
        const auto& r = out.contains("result") ? out["result"] : out;
        if (kvlink::detail::json_int64(r, "TTL") <= 0) {
          lease_ = 0;
          co_return "its etcd lease expired";
        }
        const nlohmann::json range{{"key", kvlink::detail::http::base64_encode(key_)}};
        ec = co_await etcd_.call("/v3/kv/range", range, out, what);
      }
      if (!ec) {
        const auto kvs = out.value("kvs", nlohmann::json::array());
        if (kvs.empty()) co_return "its key " + key_ + " was deleted";
        const auto value = kvlink::detail::http::base64_decode(kvs[0].value("value", std::string{}))
                               .value_or("(not base64)");
        if (value != o_.address || kvlink::detail::json_int64(kvs[0], "lease") != lease_) {
          co_return "its key " + key_ + " now names " + value;
        }
        last_ok_ = sent;
        failure.clear();
        continue;
      }
      failure = what;
      if (std::chrono::steady_clock::now() - last_ok_ >= limit) {
        co_return "etcd did not confirm its lease for " +
            std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now() - last_ok_)
                               .count()) +
            " ms (" + failure + ")";
      }
    }
    co_return std::string{};
  }

  asio::strand<asio::any_io_executor> strand_;
  options o_;
  std::string key_;
  kvlink::detail::etcd_client etcd_;
  asio::steady_timer timer_;
  asio::steady_timer resync_;
  std::int64_t lease_ = 0;
  std::string leader_;
  bool stopped_ = false;
  std::chrono::steady_clock::time_point last_ok_{};
};

}  // namespace kvlink::store
