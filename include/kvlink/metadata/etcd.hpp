// The etcd metadata backend (config.metadata = "etcd://host:2379[,host:2379...]"):
// a client of etcd v3's JSON gateway (/v3/kv/range, /v3/kv/put,
// /v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke, /v3/watch,
// /v3/auth/authenticate; keys and values in base64) over the HTTP client of
// metadata/http_client.hpp, on the engine's strand.
//
// - Publishing: the engine's descriptor (metadata/store.hpp) under
//   <prefix><name>, attached to a lease of metadata_lease_ttl that is kept
//   alive every TTL/3; written again when segments change; the lease is
//   revoked (so the key goes) on a clean shutdown. An engine that stops
//   (killed, hung, cut off from etcd) loses its key within the TTL.
// - Watching: every key under the prefix is read once, then watched from
//   the next revision; the directory of peers it keeps answers lookups (a
//   name it does not hold is read from etcd, so one published a moment ago
//   is found) and turns changes into events for the engine (a new instance
//   under a name, new segments, a key that went away).
// - Faults: each request tries the endpoints in turn until one answers. If
//   none does, connected peers keep working, lookups by name fail with
//   metadata_unavailable, and the backend retries (backing off to 2 s):
//   when etcd is back it publishes again, under a new lease if the old one
//   is gone, and reads the whole prefix again (names that stay absent for a
//   TTL after that are reported gone). A leader change is retried like an
//   unreachable endpoint.
// - Security: user/password (a token from /v3/auth/authenticate, renewed
//   when etcd says it is invalid) and TLS with client certificates (the
//   TLS files of metadata/config.hpp, via metadata/tls.hpp). What is
//   written is the descriptor alone, signed when a shared secret is set.
//   Anyone who may write to etcd can overwrite or delete a key: the owner
//   sees its own key change (through the watch, or with each keepalive when
//   it follows nobody) and writes its signed entry again at once, so the
//   name is back within a lease TTL; a lookup that meanwhile finds an entry
//   not signed with the secret fails with unsigned_entry (and says so, with
//   the name), not name_not_found.
#pragma once

#include <kvlink/control/descriptor.hpp>
#include <kvlink/control/guard.hpp>
#include <kvlink/core/address.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/metadata/backend.hpp>
#include <kvlink/metadata/http_client.hpp>
#include <kvlink/metadata/store.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <functional>
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
#include <asio/use_awaitable.hpp>
#include <nlohmann/json.hpp>

namespace kvlink {

namespace detail {

/// The end of the key range that holds every key starting with `prefix`.
inline std::string prefix_range_end(std::string prefix) {
  while (!prefix.empty()) {
    auto& last = prefix.back();
    if (static_cast<unsigned char>(last) != 0xff) {
      last = static_cast<char>(static_cast<unsigned char>(last) + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

/// etcd writes int64 fields as JSON strings ("revision": "42").
inline std::int64_t json_int64(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (!it->is_string()) return 0;
  const auto& s = it->get_ref<const std::string&>();
  std::int64_t v = 0;
  const auto [p, e] = std::from_chars(s.data(), s.data() + s.size(), v);
  return e == std::errc{} && p == s.data() + s.size() ? v : 0;
}

/// gRPC status codes, as etcd's gateway reports them ({"code": 14, ...}).
namespace grpc_code {
inline constexpr int invalid_argument = 3;
inline constexpr int deadline_exceeded = 4;
inline constexpr int not_found = 5;
inline constexpr int failed_precondition = 9;
inline constexpr int unavailable = 14;
inline constexpr int unauthenticated = 16;
}  // namespace grpc_code

/// The requests of etcd's JSON gateway, tried on each endpoint in turn,
/// with the auth token added (and renewed). Runs on the executor given.
class etcd_client {
 public:
  struct options {
    std::vector<std::string> endpoints;  ///< host:port
    std::shared_ptr<http::tls_context> tls;
    std::string user;
    std::string password;
    std::chrono::milliseconds timeout{3000};
  };

  etcd_client(asio::any_io_executor ex, options o) : ex_(std::move(ex)), o_(std::move(o)) {
    for (const auto& hp : o_.endpoints) {
      std::string_view host;
      std::uint16_t port = 0;
      split_host_port(hp, host, port);
      pools_.push_back(std::make_unique<http::pool>(ex_, std::string(host), port, o_.tls));
    }
  }

  /// POSTs `body` to `path`. On success `out` is etcd's answer. Errors:
  /// metadata_unavailable (no endpoint answered; `what` says how each
  /// failed); authentication_failed (etcd refused the user or password);
  /// otherwise invalid_argument with etcd's message in `what` and its gRPC
  /// code in `*code`.
  asio::awaitable<std::error_code> call(std::string path, nlohmann::json body, nlohmann::json& out,
                                        std::string& what, int* code = nullptr,
                                        std::chrono::milliseconds timeout = {}) {
    if (timeout.count() <= 0) timeout = o_.timeout;
    what.clear();
    if (code) *code = 0;
    bool reauthed = false;
    std::string failures;
    const std::string text = body.dump();
    for (std::size_t tried = 0; tried < o_.endpoints.size();) {
      if (shut_) co_return std::error_code{errc::cancelled};
      if (!o_.user.empty() && token_.empty() && path != "/v3/auth/authenticate") {
        std::string why;
        const std::error_code aec = co_await authenticate(why, timeout);
        if (aec == errc::authentication_failed) {
          what = why;
          co_return aec;
        }
        if (aec) {
          note(failures, why);
          ++tried;
          continue;
        }
      }
      const std::size_t index = current_;
      http::pool& conn = *pools_[index];
      http::request req;
      req.method = "POST";
      req.target = path;
      req.body = text;
      req.headers.push_back({"Content-Type", "application/json"});
      if (!token_.empty() && path != "/v3/auth/authenticate") {
        req.headers.push_back({"Authorization", token_});
      }
      http::response resp;
      const std::error_code ec = co_await conn.exchange(req, resp, timeout);
      if (ec) {
        conn.close_idle();
        note(failures, conn.where() + ": " + ec.message());
        rotate(index);
        ++tried;
        continue;
      }
      nlohmann::json j = nlohmann::json::parse(resp.body, nullptr, false);
      if (j.is_discarded() || !j.is_object()) {
        note(failures, conn.where() + ": HTTP " + std::to_string(resp.status) +
                           " with a body that is not JSON (is this etcd's client port?)");
        rotate(index);
        ++tried;
        continue;
      }
      int c = 0;
      std::string message;
      error_of(j, resp.status, c, message);
      if (c == 0 && resp.status == 200) {
        out = std::move(j);
        co_return std::error_code{};
      }
      if (c == grpc_code::unauthenticated && !o_.user.empty() && !reauthed) {
        token_.clear();  // expired or revoked: get a new one, same endpoint
        reauthed = true;
        continue;
      }
      if (c == grpc_code::unavailable || c == grpc_code::deadline_exceeded || c == 0) {
        const std::string why = message.empty() ? "HTTP " + std::to_string(resp.status) : message;
        note(failures, conn.where() + ": " + why);
        rotate(index);
        ++tried;
        continue;
      }
      what = message;
      if (code) *code = c;
      co_return std::error_code{c == grpc_code::unauthenticated ? errc::authentication_failed
                                                                : errc::invalid_argument};
    }
    what = failures;
    co_return std::error_code{errc::metadata_unavailable};
  }

  /// Opens a watch (POST /v3/watch with `create`) on the current endpoint
  /// and hands each message to `on_message` until the stream ends, it
  /// returns false, or close_watch() is called. The error says why it ended.
  asio::awaitable<std::error_code> watch(nlohmann::json create,
                                         std::function<bool(const nlohmann::json&)> on_message,
                                         std::string& what) {
    what.clear();
    if (shut_) co_return std::error_code{errc::cancelled};
    if (!o_.user.empty() && token_.empty()) {
      if (auto aec = co_await authenticate(what, o_.timeout)) co_return aec;
    }
    const std::size_t index = current_;
    http::pool& conn = *pools_[index];
    http::request req;
    req.method = "POST";
    req.target = "/v3/watch";
    req.body = create.dump();
    req.headers.push_back({"Content-Type", "application/json"});
    if (!token_.empty()) req.headers.push_back({"Authorization", token_});
    http::response resp;
    std::string line;
    std::string stop_reason;
    auto sink = [&](std::string_view piece) {
      line.append(piece.data(), piece.size());
      std::size_t start = 0;
      for (;;) {
        const std::size_t nl = line.find('\n', start);
        if (nl == std::string::npos) break;
        const std::string_view one(line.data() + start, nl - start);
        start = nl + 1;
        if (one.find_first_not_of(" \r\t") == std::string_view::npos) continue;
        nlohmann::json j = nlohmann::json::parse(one, nullptr, false);
        if (j.is_discarded()) {
          stop_reason = "a watch message that is not JSON";
          return false;
        }
        if (resp.status != 200 || j.contains("error")) {
          int c = 0;
          error_of(j, resp.status, c, stop_reason);
          if (c == grpc_code::unauthenticated) token_.clear();
          if (stop_reason.empty()) stop_reason = "HTTP " + std::to_string(resp.status);
          return false;
        }
        if (!on_message(j)) {
          stop_reason = "stopped";
          return false;
        }
      }
      line.erase(0, start);
      return line.size() <= (64u << 20);
    };
    const std::error_code ec = co_await conn.exchange(req, resp, o_.timeout, sink);
    if (!stop_reason.empty()) {
      what = conn.where() + ": " + stop_reason;
    } else if (ec) {
      what = conn.where() + ": " + ec.message();
      rotate(index);
    } else {
      what = conn.where() + ": the watch stream ended";
    }
    co_return ec ? ec : std::error_code{errc::peer_closed};
  }

  /// Ends a watch in progress.
  void close_watch() {
    for (auto& p : pools_) p->abort_streams();
  }

  /// Closes every connection; pending and later calls fail (cancelled).
  void shutdown() {
    shut_ = true;
    for (auto& p : pools_) p->shutdown();
  }

  const std::string& endpoint() const { return o_.endpoints[current_]; }

 private:
  // etcd's error body: {"error": "...", "message": "...", "code": 14} for
  // unary calls, {"error": {"grpc_code": 14, "message": "..."}} in streams.
  static void error_of(const nlohmann::json& j, int status, int& code, std::string& message) {
    code = 0;
    message.clear();
    const nlohmann::json* e = &j;
    if (const auto it = j.find("error"); it != j.end() && it->is_object()) e = &*it;
    if (const auto c = e->find("code"); c != e->end() && c->is_number_integer()) {
      code = c->get<int>();
    }
    if (const auto c = e->find("grpc_code"); c != e->end() && c->is_number_integer()) {
      code = c->get<int>();
    }
    if (const auto m = e->find("message"); m != e->end() && m->is_string()) {
      message = m->get<std::string>();
    } else if (const auto m2 = j.find("error"); m2 != j.end() && m2->is_string()) {
      message = m2->get<std::string>();
    }
    if (code == 0 && status != 200 && status != 0) code = status >= 500 ? 0 : -1;
  }

  static void note(std::string& failures, const std::string& why) {
    if (!failures.empty()) failures += "; ";
    failures += why;
  }

  asio::awaitable<std::error_code> authenticate(std::string& why,
                                                std::chrono::milliseconds timeout) {
    nlohmann::json out;
    int code = 0;
    const nlohmann::json body{{"name", o_.user}, {"password", o_.password}};
    const std::string path = "/v3/auth/authenticate";
    const std::error_code ec = co_await call(path, body, out, why, &code, timeout);
    if (ec == errc::invalid_argument || ec == errc::authentication_failed) {
      why = "etcd refused user \"" + o_.user + "\": " + why;
      co_return std::error_code{errc::authentication_failed};
    }
    if (ec) co_return ec;
    token_ = out.value("token", std::string{});
    if (token_.empty()) {
      why = "etcd gave no token for user \"" + o_.user + "\" (is its auth enabled?)";
      co_return std::error_code{errc::authentication_failed};
    }
    co_return std::error_code{};
  }

  void rotate(std::size_t from) {
    if (current_ == from && o_.endpoints.size() > 1) current_ = (from + 1) % o_.endpoints.size();
  }

  asio::any_io_executor ex_;
  options o_;
  std::vector<std::unique_ptr<http::pool>> pools_;
  std::size_t current_ = 0;
  std::string token_;
  bool shut_ = false;
};

}  // namespace detail

class etcd_metadata final : public metadata_backend,
                            public std::enable_shared_from_this<etcd_metadata> {
 public:
  struct options {
    std::string url;                     ///< config.metadata, for messages
    std::vector<std::string> endpoints;  ///< host:port
    std::string prefix = "kvlink/engines/";
    std::string self_name;
    std::chrono::milliseconds ttl{10000};
    std::chrono::milliseconds timeout{3000};
    std::string user;
    std::string password;
    std::shared_ptr<detail::http::tls_context> tls;
    control::peer_guard guard;
    std::size_t max_value = 1 << 20;  ///< bound on a stored descriptor
    /// Sends a message to every peer connected to this engine (segment
    /// updates travel this way too, as with p2p).
    std::function<void(const nlohmann::json&)> broadcast;
    /// False: publish only, follow nobody (a lightweight publisher).
    bool follow = true;
  };

  etcd_metadata(asio::any_io_executor strand, options o)
      : strand_(std::move(strand)),
        o_(std::move(o)),
        client_(strand_, client_options(o_)),
        dir_(o_.guard, o_.max_value, o_.self_name),
        outage_(o_.url),
        wake_(strand_),
        sweep_(strand_) {}

  std::string_view name() const noexcept override { return "etcd"; }

  /// Set-up, blocking (a private io_context; never the engine's strand):
  /// checks that etcd answers and takes the user, grants the lease and
  /// publishes `self`, so that peers find the engine once its constructor
  /// returns. Errors: metadata_unavailable, authentication_failed,
  /// invalid_argument, with `what` naming the store and the reason.
  std::error_code start(const control::peer_descriptor& self, std::string& what) {
    asio::io_context io;
    std::error_code result;
    const std::string value = detail::encode_entry(self, o_.guard);
    asio::co_spawn(
        io,
        [this, &io, &result, &what, &self, value]() -> asio::awaitable<void> {
          detail::etcd_client c(io.get_executor(), client_options(o_));
          nlohmann::json out;
          int code = 0;
          const std::string key = detail::key_of(o_.prefix, o_.self_name);
          // Who holds the name now (a previous run of this engine, or
          // another engine given the same name).
          nlohmann::json range{{"key", detail::http::base64_encode(key)}};
          std::error_code ec = co_await c.call("/v3/kv/range", range, out, what, &code);
          if (!ec) {
            const auto kvs = out.value("kvs", nlohmann::json::array());
            if (!kvs.empty() && kvs[0].is_object()) {
              control::peer_descriptor old;
              const auto text = detail::http::base64_decode(kvs[0].value("value", std::string{}));
              if (text && !detail::decode_entry(*text, o_.guard, o_.max_value, old) &&
                  old.instance != self.instance) {
                detail::log(
                    "{}: taking the name \"{}\" over from instance {} at {} (a restart, "
                    "or two engines given the same name)",
                    o_.url, o_.self_name, to_string(old.instance), old.address);
              }
            }
            ec = co_await grant(c, what);
          }
          if (!ec) ec = co_await put(c, value, what);
          c.shutdown();
          result = ec;
        },
        asio::detached);
    io.run();
    if (!result) {
      published_ = value;
      published_seq_ = self.seq;
      want_ = value;
      want_seq_ = self.seq;
    }
    return result;
  }

  void publish(const control::peer_descriptor& self) override {
    if (o_.broadcast) o_.broadcast(control::make_segments(self.segments, self.seq));
    if (stopped_ || (self.seq != 0 && self.seq <= want_seq_)) return;
    want_ = detail::encode_entry(self, o_.guard);
    want_seq_ = self.seq;
    wake_.cancel();
  }

  void withdraw(std::function<void()> done) override {
    if (stopped_) {
      done();
      return;
    }
    stopped_ = true;
    wake_.cancel();
    sweep_.cancel();
    client_.close_watch();
    const std::int64_t lease = lease_;
    if (lease == 0) {
      client_.shutdown();
      done();
      return;
    }
    // Revoking the lease deletes the key. Bounded: a store that does not
    // answer lets the lease expire instead.
    auto once = detail::bounded_once(strand_, std::chrono::seconds(2), std::move(done));
    asio::co_spawn(
        strand_,
        [self = shared_from_this(), lease, once]() -> asio::awaitable<void> {
          nlohmann::json out;
          std::string what;
          const nlohmann::json body{{"ID", std::to_string(lease)}};
          const auto t =
              std::min<std::chrono::milliseconds>(self->o_.timeout, std::chrono::seconds(2));
          co_await self->client_.call("/v3/lease/revoke", body, out, what, nullptr, t);
          self->client_.shutdown();
          (*once)();
        },
        asio::detached);
  }

  void resolve(std::string name, resolve_handler h) override {
    if (name.empty()) {
      asio::post(strand_, [h = std::move(h)] { h(errc::invalid_argument, resolved_peer{}); });
      return;
    }
    resolved_peer cached;
    if (stopped_ || (live_ && !dir_.resolve(name, cached))) {
      const auto ec = stopped_ ? std::error_code{errc::cancelled} : std::error_code{};
      asio::post(strand_, [h = std::move(h), ec, cached = std::move(cached)]() mutable {
        h(ec, std::move(cached));
      });
      return;
    }
    // Not in the directory (published a moment ago, or not at all), or not
    // watching (etcd away, or catching up): ask etcd itself.
    asio::co_spawn(
        strand_,
        [self = shared_from_this(), name = std::move(name),
         h = std::move(h)]() mutable -> asio::awaitable<void> {
          nlohmann::json out;
          std::string what;
          const nlohmann::json body{
              {"key", detail::http::base64_encode(detail::key_of(self->o_.prefix, name))}};
          const std::error_code ec = co_await self->client_.call("/v3/kv/range", body, out, what);
          resolved_peer rp;
          if (ec) {
            self->outage_.down(what);
            h(errc::metadata_unavailable, std::move(rp));
            co_return;
          }
          const auto kvs = out.value("kvs", nlohmann::json::array());
          if (kvs.empty() || !kvs[0].is_object()) {
            h(errc::name_not_found, std::move(rp));
            co_return;
          }
          const auto text = detail::http::base64_decode(kv_value(kvs[0]));
          const std::error_code dec =
              text ? self->dir_.lookup(name, *text, rp) : std::error_code{errc::name_not_found};
          h(dec, std::move(rp));
        },
        asio::detached);
  }

  /// Sets the callback and starts keeping the descriptor published and the
  /// directory current (on the strand).
  void watch(change_fn on_change) override {
    on_change_ = std::move(on_change);
    dir_.on_change([this](const metadata_event& e) {
      if (on_change_) on_change_(e);
    });
    if (running_ || stopped_) return;
    running_ = true;
    asio::co_spawn(strand_, keep_published(shared_from_this()), asio::detached);
    if (o_.follow) asio::co_spawn(strand_, keep_watching(shared_from_this()), asio::detached);
  }

  void on_peer_message(const instance_id& from, const nlohmann::json& msg) override {
    metadata_event e;
    if (on_change_ && segments_event(from, msg, e)) on_change_(e);
  }

  /// Test hooks (strand-only): the names known, whether the watch is live,
  /// whether the latest descriptor is in etcd.
  std::size_t known() const noexcept { return dir_.size(); }
  bool watching() const noexcept { return live_; }
  bool published() const noexcept { return lease_ != 0 && !want_.empty() && published_ == want_; }

 private:
  static detail::etcd_client::options client_options(const options& o) {
    return {o.endpoints, o.tls, o.user, o.password, o.timeout};
  }

  std::int64_t ttl_seconds() const {
    return std::max<std::int64_t>(1, (o_.ttl.count() + 999) / 1000);
  }

  asio::awaitable<std::error_code> grant(detail::etcd_client& c, std::string& what) {
    nlohmann::json out;
    const nlohmann::json body{{"TTL", std::to_string(ttl_seconds())}};
    const std::error_code ec = co_await c.call("/v3/lease/grant", body, out, what);
    if (ec) co_return ec;
    lease_ = detail::json_int64(out, "ID");
    if (lease_ == 0) {
      what = "etcd granted no lease: " + out.value("error", std::string{});
      co_return std::error_code{errc::metadata_unavailable};
    }
    next_keepalive_ = std::chrono::steady_clock::now() + o_.ttl / 3;
    co_return std::error_code{};
  }

  static std::string kv_value(const nlohmann::json& kv) {
    return kv.is_object() ? kv.value("value", std::string{}) : std::string{};
  }

  // Our own key as etcd holds it (kv from a read or a watch event; null: the
  // key is gone). Anything but the value we wrote, under our lease, is
  // someone else's write (anyone with access to etcd may write there): it is
  // replaced by our signed entry at once, so that the name stays resolvable
  // by every engine that shares the secret.
  void check_own_key(const nlohmann::json* kv) {
    // Also while a put is in flight (nothing published yet): that put's
    // answer must not count as published (foreign_ moved).
    if (stopped_ || lease_ == 0) return;
    std::string how;
    if (kv == nullptr) {
      how = "deleted";
    } else {
      const auto v = detail::http::base64_decode(kv_value(*kv));
      const bool ours = v && (*v == published_ || *v == want_);
      if (!ours) {
        how = "overwritten";
      } else if (detail::json_int64(*kv, "lease") != lease_) {
        how = "detached from its lease";
      }
    }
    if (how.empty()) return;
    detail::log("{}: the entry of \"{}\" was {} by someone else: publishing its signed entry again",
                o_.url, o_.self_name, how);
    ++foreign_;
    published_.clear();
    wake_.cancel();
  }

  asio::awaitable<std::error_code> put(detail::etcd_client& c, const std::string& value,
                                       std::string& what) {
    nlohmann::json out;
    int code = 0;
    const nlohmann::json body{
        {"key", detail::http::base64_encode(detail::key_of(o_.prefix, o_.self_name))},
        {"value", detail::http::base64_encode(value)},
        {"lease", std::to_string(lease_)}};
    const std::error_code ec = co_await c.call("/v3/kv/put", body, out, what, &code);
    if (ec && code == detail::grpc_code::not_found) lease_ = 0;  // the lease is gone
    co_return ec;
  }

  // Keeps the lease alive and the latest descriptor written.
  static asio::awaitable<void> keep_published(std::shared_ptr<etcd_metadata> self) {
    auto backoff = std::chrono::milliseconds(100);
    while (!self->stopped_) {
      std::error_code ec;
      std::string what;
      if (self->lease_ == 0) {
        ec = co_await self->grant(self->client_, what);
        if (!ec) {
          self->published_.clear();  // the key went with the old lease
          if (self->ever_lost_) {
            detail::log("{}: \"{}\" registered again under a new lease", self->o_.url,
                        self->o_.self_name);
          }
        }
      }
      if (!ec && !self->stopped_ && self->published_ != self->want_) {
        const std::string value = self->want_;
        const std::uint64_t foreign = self->foreign_;
        ec = co_await self->put(self->client_, value, what);
        if (!ec && self->foreign_ == foreign) self->published_ = value;
        if (ec && self->lease_ == 0) {
          detail::log(
              "{}: the lease of \"{}\" is gone (etcd lost it, or this engine was cut off "
              "longer than metadata_lease_ttl): registering again",
              self->o_.url, self->o_.self_name);
          self->ever_lost_ = true;
          continue;
        }
      }
      if (!ec && !self->stopped_ && self->lease_ != 0 &&
          std::chrono::steady_clock::now() >= self->next_keepalive_) {
        nlohmann::json out;
        const nlohmann::json body{{"ID", std::to_string(self->lease_)}};
        ec = co_await self->client_.call("/v3/lease/keepalive", body, out, what);
        if (!ec) {
          const auto& r = out.contains("result") ? out["result"] : out;
          if (detail::json_int64(r, "TTL") <= 0) {
            detail::log(
                "{}: the lease of \"{}\" expired (etcd lost it, or this engine was cut "
                "off longer than metadata_lease_ttl): registering again",
                self->o_.url, self->o_.self_name);
            self->lease_ = 0;
            self->ever_lost_ = true;
            continue;
          }
          self->next_keepalive_ = std::chrono::steady_clock::now() + self->o_.ttl / 3;
          // Following nobody, it has no watch to see its own key change:
          // it looks at it with each keepalive (a TTL/3 apart).
          if (!self->o_.follow) {
            const nlohmann::json range{{"key", detail::http::base64_encode(detail::key_of(
                                                   self->o_.prefix, self->o_.self_name))}};
            nlohmann::json got;
            if (!co_await self->client_.call("/v3/kv/range", range, got, what)) {
              const auto kvs = got.value("kvs", nlohmann::json::array());
              self->check_own_key(kvs.empty() ? nullptr : &kvs[0]);
              if (self->published_ != self->want_) continue;
            }
          }
        }
      }
      if (self->stopped_) break;
      if (ec) {
        if (ec == errc::cancelled) break;
        self->outage_.down(what);
        self->wake_.expires_after(backoff);
        backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(2));
        co_await self->wake_.async_wait(detail::http::nothrow);
        continue;
      }
      self->outage_.up("\"" + self->o_.self_name + "\" published");
      backoff = std::chrono::milliseconds(100);
      if (self->published_ != self->want_) continue;
      self->wake_.expires_at(self->next_keepalive_);
      co_await self->wake_.async_wait(detail::http::nothrow);
    }
  }

  // Reads the prefix, then follows it with a watch; again after any break.
  static asio::awaitable<void> keep_watching(std::shared_ptr<etcd_metadata> self) {
    auto backoff = std::chrono::milliseconds(50);
    asio::steady_timer pause(self->strand_);
    const std::string prefix = self->o_.prefix;
    const std::string range_end = detail::prefix_range_end(prefix);
    while (!self->stopped_) {
      nlohmann::json out;
      std::string what;
      const nlohmann::json range{{"key", detail::http::base64_encode(prefix)},
                                 {"range_end", detail::http::base64_encode(range_end)}};
      std::error_code ec = co_await self->client_.call("/v3/kv/range", range, out, what);
      if (!ec && !self->stopped_) {
        std::set<std::string> present;
        const nlohmann::json* own = nullptr;
        const auto kvs = out.value("kvs", nlohmann::json::array());
        for (const auto& kv : kvs) {
          std::string name;
          std::string value;
          if (self->read_kv(kv, name, value)) {
            present.insert(name);
            if (name == self->o_.self_name) own = &kv;
            self->dir_.put(name, std::move(value));
          }
        }
        self->check_own_key(own);
        self->dir_.mark_missing(present);
        if (self->dir_.any_missing()) self->arm_sweep();
        const std::int64_t rev =
            detail::json_int64(out.value("header", nlohmann::json::object()), "revision");
        self->live_ = true;
        backoff = std::chrono::milliseconds(50);
        const nlohmann::json create{{"create_request",
                                     {{"key", detail::http::base64_encode(prefix)},
                                      {"range_end", detail::http::base64_encode(range_end)},
                                      {"start_revision", std::to_string(rev + 1)}}}};
        std::weak_ptr<etcd_metadata> weak = self;
        auto on_message = [weak](const nlohmann::json& j) {
          auto me = weak.lock();
          return me && me->on_watch_message(j);
        };
        ec = co_await self->client_.watch(create, on_message, what);
        self->live_ = false;
      }
      if (self->stopped_) break;
      if (ec && ec != errc::peer_closed) self->outage_.down(what);
      pause.expires_after(backoff);
      backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(2));
      co_await pause.async_wait(detail::http::nothrow);
    }
    self->live_ = false;
  }

  bool read_kv(const nlohmann::json& kv, std::string& name, std::string& value) const {
    if (!kv.is_object()) return false;
    const auto key = detail::http::base64_decode(kv.value("key", std::string{}));
    if (!key || key->rfind(o_.prefix, 0) != 0) return false;
    name = key->substr(o_.prefix.size());
    const auto v = detail::http::base64_decode(kv.value("value", std::string{}));
    if (!v) return false;
    value = *v;
    return true;
  }

  // One message of the watch stream; false ends the stream (then the
  // prefix is read again).
  bool on_watch_message(const nlohmann::json& j) {
    if (stopped_) return false;
    const auto it = j.find("result");
    if (it == j.end() || !it->is_object()) return true;
    const auto& r = *it;
    if (r.value("canceled", false) || detail::json_int64(r, "compact_revision") != 0) return false;
    for (const auto& ev : r.value("events", nlohmann::json::array())) {
      if (!ev.is_object()) continue;
      const auto kv = ev.value("kv", nlohmann::json::object());
      const auto key = detail::http::base64_decode(kv.value("key", std::string{}));
      if (!key || key->rfind(o_.prefix, 0) != 0) continue;
      const std::string name = key->substr(o_.prefix.size());
      const bool deleted = ev.value("type", std::string{"PUT"}) == "DELETE";
      if (name == o_.self_name) check_own_key(deleted ? nullptr : &kv);
      if (deleted) {
        dir_.remove(name);
        continue;
      }
      const auto v = detail::http::base64_decode(kv.value("value", std::string{}));
      if (v) dir_.put(name, *v);
    }
    return !stopped_;
  }

  // Names absent from a full read are reported gone a TTL later if they
  // have not come back (after an outage, live engines register again
  // within that time).
  void arm_sweep() {
    sweep_.expires_after(o_.ttl);
    sweep_.async_wait([w = weak_from_this()](std::error_code ec) {
      auto self = w.lock();
      if (ec || !self || self->stopped_) return;
      self->dir_.sweep_missing();
    });
  }

  asio::any_io_executor strand_;
  options o_;
  detail::etcd_client client_;
  detail::peer_directory dir_;
  detail::outage_log outage_;
  asio::steady_timer wake_;
  asio::steady_timer sweep_;
  change_fn on_change_;
  std::int64_t lease_ = 0;
  std::chrono::steady_clock::time_point next_keepalive_{};
  // Writes by someone else seen on our key (check_own_key).
  std::uint64_t foreign_ = 0;
  std::string want_;  ///< the value to publish
  std::uint64_t want_seq_ = 0;
  std::string published_;  ///< the value in etcd under the current lease
  std::uint64_t published_seq_ = 0;
  bool live_ = false;  ///< the directory follows etcd (watch open)
  bool running_ = false;
  bool stopped_ = false;
  bool ever_lost_ = false;
};

}  // namespace kvlink
