// The HTTP metadata backend (config.metadata = "http://host:port/metadata"):
// the protocol of Mooncake's simple metadata server, so that deployments
// that run one (mooncake_http_metadata_server, or mooncake_master
// --enable_http_metadata_server) keep it:
//
//   GET    <url>?key=<percent-encoded key>        200 + the value | 404
//   PUT    <url>?key=<key>   body: the value       200
//   DELETE <url>?key=<key>                         200 | 404
//   ("Authorization: Bearer <metadata_token>" on each, when set)
//
// That server keeps values and nothing else: no leases, no watches, no
// listing. So this backend
// - publishes the descriptor (metadata/store.hpp) under <prefix><name> with
//   a "beat" counter it writes again every TTL/3, and deletes it on a clean
//   shutdown;
// - resolves a name with a GET, and reads the descriptors of the names it
//   resolved again every metadata_poll_interval: a new instance, new
//   segments, a key that stayed away (404) for a TTL, or a beat that did
//   not move for a TTL (an engine that died without deleting its key) become
//   events, measured on this engine's clock only (a server that was away
//   gives every entry a fresh TTL when it is back);
// - when the server cannot be reached: connected peers keep working,
//   lookups fail with metadata_unavailable, and it retries.
#pragma once

#include <kvlink/control/descriptor.hpp>
#include <kvlink/control/guard.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/metadata/backend.hpp>
#include <kvlink/metadata/http_client.hpp>
#include <kvlink/metadata/store.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <nlohmann/json.hpp>

namespace kvlink {

class http_metadata final : public metadata_backend,
                            public std::enable_shared_from_this<http_metadata> {
 public:
  struct options {
    std::string url;  ///< config.metadata, for messages
    std::string host;
    std::uint16_t port = 80;
    std::string path = "/metadata";
    std::string prefix = "kvlink/engines/";
    std::string self_name;
    std::chrono::milliseconds ttl{10000};
    std::chrono::milliseconds poll{1000};
    std::chrono::milliseconds timeout{3000};
    std::string token;  ///< bearer token; empty = none
    std::shared_ptr<detail::http::tls_context> tls;
    control::peer_guard guard;
    std::size_t max_value = 1 << 20;
    std::function<void(const nlohmann::json&)> broadcast;
  };

  http_metadata(asio::any_io_executor strand, options o)
      : strand_(std::move(strand)),
        o_(std::move(o)),
        pool_(strand_, o_.host, o_.port, o_.tls),
        dir_(o_.guard, o_.max_value, o_.self_name),
        outage_(o_.url),
        wake_(strand_),
        poll_(strand_) {}

  std::string_view name() const noexcept override { return "http"; }

  /// Set-up, blocking (a private io_context): checks that the server
  /// answers and publishes `self`. Errors: metadata_unavailable with `what`.
  std::error_code start(const control::peer_descriptor& self, std::string& what) {
    asio::io_context io;
    std::error_code result;
    want_ = self;
    const std::string value = encode(self);
    asio::co_spawn(
        io,
        [this, &io, &result, &what, value]() -> asio::awaitable<void> {
          detail::http::pool p(io.get_executor(), o_.host, o_.port, o_.tls);
          detail::http::response resp;
          const std::string key = detail::key_of(o_.prefix, o_.self_name);
          std::error_code ec = co_await send(p, "GET", key, {}, resp, what);
          if (!ec && resp.status == 200) {
            control::peer_descriptor old;
            if (!detail::decode_entry(resp.body, o_.guard, o_.max_value, old) &&
                old.instance != want_.instance) {
              detail::log(
                  "{}: taking the name \"{}\" over from instance {} at {} (a restart, "
                  "or two engines given the same name)",
                  o_.url, o_.self_name, to_string(old.instance), old.address);
            }
          }
          if (!ec) ec = co_await send(p, "PUT", key, value, resp, what);
          if (!ec && resp.status != 200) {
            what = "PUT " + key + ": HTTP " + std::to_string(resp.status) + " " + resp.body;
            ec = errc::metadata_unavailable;
          }
          p.shutdown();
          result = ec;
        },
        asio::detached);
    io.run();
    if (!result) next_beat_ = std::chrono::steady_clock::now() + o_.ttl / 3;
    return result;
  }

  void publish(const control::peer_descriptor& self) override {
    if (o_.broadcast) o_.broadcast(control::make_segments(self.segments, self.seq));
    if (stopped_ || (self.seq != 0 && self.seq <= want_.seq)) return;
    want_ = self;
    dirty_ = true;
    wake_.cancel();
  }

  void withdraw(std::function<void()> done) override {
    if (stopped_) {
      done();
      return;
    }
    stopped_ = true;
    wake_.cancel();
    poll_.cancel();
    auto once = detail::bounded_once(strand_, std::chrono::seconds(2), std::move(done));
    asio::co_spawn(
        strand_,
        [self = shared_from_this(), once]() -> asio::awaitable<void> {
          detail::http::response resp;
          std::string what;
          const std::string key = detail::key_of(self->o_.prefix, self->o_.self_name);
          co_await self->send(self->pool_, "DELETE", key, {}, resp, what);
          self->pool_.shutdown();
          (*once)();
        },
        asio::detached);
  }

  void resolve(std::string name, resolve_handler h) override {
    if (name.empty() || stopped_) {
      const std::error_code ec = stopped_ ? errc::cancelled : errc::invalid_argument;
      asio::post(strand_, [h = std::move(h), ec] { h(ec, resolved_peer{}); });
      return;
    }
    asio::co_spawn(
        strand_,
        [self = shared_from_this(), name = std::move(name),
         h = std::move(h)]() mutable -> asio::awaitable<void> {
          detail::http::response resp;
          std::string what;
          const std::string key = detail::key_of(self->o_.prefix, name);
          const std::error_code ec = co_await self->send(self->pool_, "GET", key, {}, resp, what);
          resolved_peer rp;
          if (ec || (resp.status != 200 && resp.status != 404)) {
            self->outage_.down(ec ? what : "GET: HTTP " + std::to_string(resp.status));
            h(errc::metadata_unavailable, std::move(rp));
            co_return;
          }
          const auto dead = self->dead_.find(name);
          if (resp.status == 404 || (dead != self->dead_.end() && dead->second == resp.body)) {
            h(errc::name_not_found, std::move(rp));  // absent, or left by an engine that died
            co_return;
          }
          self->followed_.insert(name);
          self->dir_.put(name, resp.body);
          const std::error_code dec = self->dir_.lookup(name, resp.body, rp);
          h(dec, std::move(rp));  // rp filled first
        },
        asio::detached);
  }

  void watch(change_fn on_change) override {
    on_change_ = std::move(on_change);
    dir_.on_change([this](const metadata_event& e) {
      if (on_change_) on_change_(e);
    });
    if (running_ || stopped_) return;
    running_ = true;
    asio::co_spawn(strand_, keep_published(shared_from_this()), asio::detached);
    asio::co_spawn(strand_, keep_polling(shared_from_this()), asio::detached);
  }

  void on_peer_message(const instance_id& from, const nlohmann::json& msg) override {
    metadata_event e;
    if (on_change_ && segments_event(from, msg, e)) on_change_(e);
  }

 private:
  std::string encode(const control::peer_descriptor& d) {
    return detail::encode_entry(d, o_.guard, nlohmann::json{{"beat", ++beat_}});
  }

  asio::awaitable<std::error_code> send(detail::http::pool& p, const char* method,
                                        const std::string& key, std::string body,
                                        detail::http::response& resp, std::string& what) {
    detail::http::request req;
    req.method = method;
    req.target = o_.path + "?key=" + detail::http::query_escape(key);
    req.body = std::move(body);
    if (req.method == "PUT") req.headers.push_back({"Content-Type", "application/json"});
    if (!o_.token.empty()) req.headers.push_back({"Authorization", "Bearer " + o_.token});
    const std::error_code ec = co_await p.exchange(req, resp, o_.timeout);
    if (ec) {
      what = p.where() + ": " + ec.message();
      p.close_idle();
      co_return std::error_code{errc::metadata_unavailable};
    }
    if (resp.status == 401 || resp.status == 403) {
      what = p.where() + ": HTTP " + std::to_string(resp.status) +
             " (the server wants another metadata_token)";
      co_return std::error_code{errc::authentication_failed};
    }
    co_return std::error_code{};
  }

  // Writes the descriptor when it changed and its beat every TTL/3.
  static asio::awaitable<void> keep_published(std::shared_ptr<http_metadata> self) {
    auto backoff = std::chrono::milliseconds(100);
    while (!self->stopped_) {
      const auto now = std::chrono::steady_clock::now();
      if (self->dirty_ || now >= self->next_beat_) {
        self->dirty_ = false;
        const std::string value = self->encode(self->want_);
        detail::http::response resp;
        std::string what;
        const std::string key = detail::key_of(self->o_.prefix, self->o_.self_name);
        std::error_code ec = co_await self->send(self->pool_, "PUT", key, value, resp, what);
        if (!ec && resp.status != 200) {
          what = "PUT: HTTP " + std::to_string(resp.status) + " " + resp.body.substr(0, 200);
          ec = errc::metadata_unavailable;
        }
        if (self->stopped_) break;
        if (ec) {
          self->dirty_ = true;
          self->outage_.down(what);
          self->wake_.expires_after(backoff);
          backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(2));
          co_await self->wake_.async_wait(detail::http::nothrow);
          continue;
        }
        self->outage_.up("\"" + self->o_.self_name + "\" published");
        backoff = std::chrono::milliseconds(100);
        self->next_beat_ = std::chrono::steady_clock::now() + self->o_.ttl / 3;
      }
      if (self->dirty_) continue;
      self->wake_.expires_at(self->next_beat_);
      co_await self->wake_.async_wait(detail::http::nothrow);
    }
  }

  // Reads the followed names again every poll interval.
  static asio::awaitable<void> keep_polling(std::shared_ptr<http_metadata> self) {
    while (!self->stopped_) {
      self->poll_.expires_after(self->o_.poll);
      co_await self->poll_.async_wait(detail::http::nothrow);
      if (self->stopped_) break;
      const std::vector<std::string> names(self->followed_.begin(), self->followed_.end());
      bool reached = true;
      const auto now = std::chrono::steady_clock::now();
      for (const auto& name : names) {
        detail::http::response resp;
        std::string what;
        const std::string key = detail::key_of(self->o_.prefix, name);
        const std::error_code ec = co_await self->send(self->pool_, "GET", key, {}, resp, what);
        if (self->stopped_) co_return;
        if (ec || (resp.status != 200 && resp.status != 404)) {
          self->outage_.down(ec ? what : "GET: HTTP " + std::to_string(resp.status));
          reached = false;
          break;  // keep what we know; try again next round
        }
        if (resp.status == 404) {
          // Gone, unless it comes back within a TTL (a server that
          // restarted empty gets every live engine's value again by then).
          const auto [at, fresh] = self->missing_since_.try_emplace(name, now);
          if (!fresh && now - at->second > self->o_.ttl) {
            self->missing_since_.erase(at);
            self->dead_.erase(name);
            self->followed_.erase(name);
            self->dir_.remove(name);
          }
          continue;
        }
        self->missing_since_.erase(name);
        if (const auto d = self->dead_.find(name); d != self->dead_.end()) {
          if (d->second == resp.body) continue;  // still the value of an engine that died
          self->dead_.erase(d);
        }
        self->dir_.put(name, resp.body);
      }
      if (!reached) {
        self->was_away_ = true;
        continue;
      }
      if (self->was_away_) {
        // Nobody could refresh anything while the server was away.
        self->was_away_ = false;
        self->dir_.touch_all(now);
        for (auto& [name, since] : self->missing_since_) since = now;
      }
      // A beat that did not move for a TTL: the engine died without
      // deleting its key.
      const auto before = std::chrono::steady_clock::now() - self->o_.ttl;
      for (const auto& name : self->dir_.unchanged_since(before)) {
        if (const auto* e = self->dir_.find(name)) self->dead_[name] = e->value;
        self->followed_.erase(name);
        self->dir_.remove(name);
      }
    }
  }

  asio::any_io_executor strand_;
  options o_;
  detail::http::pool pool_;
  detail::peer_directory dir_;
  detail::outage_log outage_;
  asio::steady_timer wake_;
  asio::steady_timer poll_;
  change_fn on_change_;
  control::peer_descriptor want_;
  std::uint64_t beat_ = 0;
  std::chrono::steady_clock::time_point next_beat_{};
  std::set<std::string> followed_;           ///< names resolved, read again each poll
  std::map<std::string, std::string> dead_;  ///< name -> the stale value it left
  std::map<std::string, std::chrono::steady_clock::time_point> missing_since_;  ///< 404 since
  bool was_away_ = false;  ///< a poll round failed since the last good one
  bool dirty_ = false;
  bool running_ = false;
  bool stopped_ = false;
};

}  // namespace kvlink
