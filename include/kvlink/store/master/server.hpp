// The store master as a server: master_service (store/master/service.hpp)
// behind a TCP listener that speaks the store wire (store/wire/protocol.hpp),
// an optional HTTP endpoint (/health, /metrics, /segments), an optional
// metadata server with Mooncake's HTTP protocol (store/master/metadata.hpp,
// server_options::metadata_listen) and the timers that keep the pool
// healthy (liveness, reclaim, eviction). The
// `kvlink-master` program (tools/kvlink_master.cpp) is this plus a command
// line; tests run it in-process.
//
//   asio::io_context io{2};
//   kvlink::store::server_options opt;
//   opt.listen = "127.0.0.1:0";
//   kvlink::store::master_server master{io.get_executor(), {}, opt};
//   master.listen();                        // throws std::system_error with context
//   std::thread t{[&] { io.run(); }};
//   ... clients connect to master.local_address() ...
//   master.async_close([] { /* every handler done */ });
//
// A connection: the engine's handshake (control::server_handshake, the
// bounded max_handshake_message, the challenge when there is a secret; the
// master's own instance id) within handshake_timeout; the hello's role must
// be "store". The welcome is control::make_welcome(master instance) plus
//   "store": {"known": bool, "client": u64, "heartbeat_ms": N,
//             "timeout_ms": N, "max_body": N, "records": bool}
// ("records": whether puts write object records, master_config::object_records)
// (and "session" with a secret, as the engine's). Then frames: each request
// is handled on the connection's strand in arrival order and its reply
// queued; replies go out in order from a write queue while the next
// requests are read, up to max_body bytes queued (then reading waits).
// Different connections run in parallel on the executor's threads. A header
// of another version is answered protocol_version_mismatch, one announcing
// a body over max_body message_too_large, and the connection closed after;
// a bad magic closes it at once; a body that does not decode is answered
// malformed_message and the connection closed.
//
// The SSD tier: tasks for disk holders (object_table's disk tasks, made by
// eviction, gets and removes) go out as disk_task frames (id 0, never
// answered) on the connection the holder last spoke on, queued with its
// replies; those for a holder without a connection end at once (counted):
// a store's object is evicted without a disk by the next round, a load
// frees its range and the next get asks again; a drop is lost (the
// holder's manifest may bring that key back later).
//
// Timers, each on its own strand so that none waits behind request
// processing: liveness (marks suspect and gone clients), reclaim (puts that
// never ended) and eviction (evictor::run_once, one shard step per lock).
// Give the executor two threads or more: an eviction round runs on one.
//
// Every failure a peer causes is logged once per peer and kind (bounded),
// counted in /metrics, and never crashes or throws.
#pragma once

#include <kvlink/control/handshake.hpp>
#include <kvlink/control/socket.hpp>
#include <kvlink/core/address.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/detail/erased_handler.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/store/master/http.hpp>
#include <kvlink/store/master/metadata.hpp>
#include <kvlink/store/master/service.hpp>
#include <kvlink/store/wire/protocol.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/read.hpp>
#include <asio/steady_timer.hpp>
#include <asio/strand.hpp>
#include <asio/write.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvlink::store {

/// The master's HTTP routes: GET /health (200 "ok"), GET /metrics
/// (Prometheus text), GET /segments (JSON), and mooncake_master's
/// GET /get_all_segments (the mounted segments' names, one per line: SGLang
/// polls it until it is not empty) and GET /metrics/summary (one line of
/// text for people); another method 405, another path 404. The query
/// string is ignored.
inline http_answer route_http(const master_service& svc, std::string_view method,
                              std::string_view target) {
  if (const auto q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
  const bool known = target == "/health" || target == "/metrics" || target == "/segments" ||
                     target == "/get_all_segments" || target == "/metrics/summary";
  if (!known) return {404, "text/plain; charset=utf-8", "not found\n"};
  if (method != "GET") return {405, "text/plain; charset=utf-8", "method not allowed\n"};
  if (target == "/health") return {200, "text/plain; charset=utf-8", "ok\n"};
  if (target == "/metrics") return {200, "text/plain; version=0.0.4", svc.metrics_text()};
  // Names come from clients: bytes that are not UTF-8 are replaced, never thrown on.
  const auto segments = svc.segments_json();
  if (target == "/get_all_segments") {
    std::string names;
    for (const auto& s : segments) {
      // As a JSON string without its quotes: a newline in a name stays "\n".
      const auto q = s.at("name").dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      names.append(q, 1, q.size() - 2);
      names += '\n';
    }
    return {200, "text/plain; charset=utf-8", std::move(names)};
  }
  if (target == "/metrics/summary") return {200, "text/plain; charset=utf-8", svc.summary_text()};
  return {200, "application/json",
          segments.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"};
}

class master_server {
 public:
  using executor_type = asio::any_io_executor;

  /// Throws std::invalid_argument (cfg) or std::system_error (options, an
  /// unreadable secret file), with context.
  master_server(const executor_type& ex, master_config cfg, server_options opt)
      : impl_{std::make_shared<impl>(ex, std::move(cfg), checked(std::move(opt)))} {}

  master_server(const master_server&) = delete;
  master_server& operator=(const master_server&) = delete;

  /// Closes without waiting when async_close was not called: handlers still
  /// pending keep what they use alive.
  ~master_server() {
    if (impl_) impl_->start_close({});
  }

  /// Binds the listen addresses and starts accepting and the timers. Throws
  /// std::system_error with the address ("kvlink-master: bind(0.0.0.0:50051):
  /// Address already in use").
  void listen() {
    impl_->bind_all();
    impl_->serve();
  }

  /// listen() in two steps, for a master that stands for election
  /// (store/master/election.hpp): bind() takes the addresses (so a standby
  /// knows the one it will lead on and holds it; nothing is accepted),
  /// serve() starts accepting and the timers. serve() after async_close
  /// does nothing.
  void bind() { impl_->bind_all(); }
  void serve() { impl_->serve(); }

  /// host:port clients connect to (the real port when 0 was asked for).
  std::string local_address() const { return impl_->address; }
  /// host:port of the HTTP endpoint, "" when off.
  std::string http_address() const { return impl_->http_address; }
  /// host:port of the metadata server, "" when off; engines use
  /// "http://<it>/metadata".
  std::string metadata_address() const { return impl_->metadata_address; }
  /// The metadata server's table (empty when it is off).
  const metadata_table& metadata() const noexcept { return impl_->metadata; }
  /// The master's instance id (its handshake identity).
  const instance_id& instance() const noexcept { return impl_->self; }

  master_service& service() noexcept { return impl_->service; }
  object_table& objects() noexcept { return impl_->service.objects(); }

  /// Stops accepting, closes every connection and stops the timers;
  /// completes (signature void()) once every handler of the server has
  /// finished. Never completes inside this call. Calling it again is fine
  /// (each call completes).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_close(Token&& token = {}) {
    return asio::async_initiate<Token, void()>(
        [](auto handler, std::shared_ptr<impl> self) {
          auto io = self->ex;
          self->start_close(kvlink::detail::erased_handler<void()>(std::move(handler), io));
        },
        token, impl_);
  }

 private:
  struct connection {
    explicit connection(const asio::any_io_executor& s) : strand{s}, socket{s}, drained{s} {}
    asio::any_io_executor strand;
    asio::ip::tcp::socket socket;
    asio::steady_timer drained;  // woken when a write completes
    std::deque<std::string> out;
    std::size_t queued = 0;
    bool writing = false;
    bool failed = false;
    std::string peer;
  };

  struct impl;

  // Counts a pending handler of the server; async_close completes when the
  // last one goes.
  class activity {
   public:
    explicit activity(std::shared_ptr<impl> s) : s_{std::move(s)} {
      s_->active.fetch_add(1, std::memory_order_acq_rel);
    }
    activity(activity&&) noexcept = default;
    activity& operator=(activity&&) = delete;
    ~activity() {
      if (s_ && s_->active.fetch_sub(1, std::memory_order_acq_rel) == 1 && s_->closing.load()) {
        s_->finish_close();
      }
    }

   private:
    std::shared_ptr<impl> s_;
  };

  enum class tick { liveness, reclaim, eviction };
  enum class listener { store, http, metadata };

  struct impl : std::enable_shared_from_this<impl> {
    impl(const executor_type& e, master_config cfg, server_options opt)
        : ex{e},
          service{std::move(cfg), opt},
          guard{load_secret(opt)},
          self{make_instance_id()},
          acceptor{asio::make_strand(e)},
          http_acceptor{asio::make_strand(e)},
          metadata_acceptor{asio::make_strand(e)},
          metadata{opt.metadata_max_value, opt.metadata_capacity},
          liveness_timer{asio::make_strand(e)},
          reclaim_timer{asio::make_strand(e)},
          eviction_timer{asio::make_strand(e)} {
      auth.guard = &guard;
      auth.self = self;
    }

    const server_options& opt() const noexcept { return service.options(); }

    void bind_all() {
      address = bind(acceptor, opt().listen);
      if (!opt().http_listen.empty()) http_address = bind(http_acceptor, opt().http_listen);
      if (!opt().metadata_listen.empty()) {
        metadata_address = bind(metadata_acceptor, opt().metadata_listen);
      }
      if (!guard.enabled() && !acceptor.local_endpoint().address().is_loopback()) {
        kvlink::detail::log(
            "store master listening on {} without authentication: any process that reaches it "
            "can mount, read and remove objects (set store_auth_secret, store_auth_secret_file "
            "or KVLINK_STORE_AUTH_SECRET)",
            address);
      }
    }

    void serve() {
      {
        std::lock_guard lock{mu};
        if (close_started || serving) return;
        serving = true;
      }
      auto me = shared_from_this();
      spawn(acceptor.get_executor(), accept_loop(me, listener::store, activity{me}));
      if (!http_address.empty()) {
        spawn(http_acceptor.get_executor(), accept_loop(me, listener::http, activity{me}));
      }
      if (!metadata_address.empty()) {
        spawn(metadata_acceptor.get_executor(), accept_loop(me, listener::metadata, activity{me}));
      }
      spawn(liveness_timer.get_executor(), tick_loop(me, tick::liveness, activity{me}));
      spawn(reclaim_timer.get_executor(), tick_loop(me, tick::reclaim, activity{me}));
      spawn(eviction_timer.get_executor(), tick_loop(me, tick::eviction, activity{me}));
    }

    static void spawn(const asio::any_io_executor& where, asio::awaitable<void> a) {
      asio::co_spawn(where, std::move(a), asio::detached);
    }

    static std::string bind(asio::ip::tcp::acceptor& acc, const std::string& where) {
      std::string_view host;
      std::uint16_t port = 0;
      if (!split_host_port(where, host, port)) {
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("kvlink-master: '{}' is not host:port", where));
      }
      asio::ip::tcp::resolver resolver(acc.get_executor());
      std::error_code ec;
      const auto results = resolver.resolve(std::string(host), std::to_string(port),
                                            asio::ip::tcp::resolver::passive, ec);
      if (ec || results.empty()) {
        throw std::system_error(ec ? ec : make_error_code(errc::invalid_argument),
                                fmt::format("kvlink-master: cannot resolve '{}'", where));
      }
      const auto ep = results.begin()->endpoint();
      acc.open(ep.protocol(), ec);
      if (!ec) acc.set_option(asio::socket_base::reuse_address(true), ec);
      if (!ec) acc.bind(ep, ec);
      if (!ec) acc.listen(asio::socket_base::max_listen_connections, ec);
      if (ec) throw std::system_error(ec, fmt::format("kvlink-master: bind({})", where));
      return control::format_endpoint(acc.local_endpoint());
    }

    static control::peer_guard load_secret(const server_options& o) {
      if (!o.auth_secret.empty()) return control::peer_guard(o.auth_secret);
      if (o.auth_secret_file.empty()) return {};
      std::ifstream in(o.auth_secret_file, std::ios::binary);
      std::string secret((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) {
        secret.pop_back();
      }
      if (secret.empty()) {
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("kvlink-master: store_auth_secret_file '{}' cannot "
                                            "be read or is empty",
                                            o.auth_secret_file));
      }
      return control::peer_guard(std::move(secret));
    }

    // ---- closing ------------------------------------------------------

    void start_close(kvlink::detail::erased_handler<void()> h) {
      std::vector<std::shared_ptr<connection>> open;
      bool first = false;
      {
        std::lock_guard lock{mu};
        if (h) on_closed.push_back(std::move(h));
        if (!close_started) {
          close_started = first = true;
          closing.store(true);
          for (auto& [id, weak] : connections) {
            if (auto c = weak.lock()) open.push_back(std::move(c));
          }
        }
      }
      if (first) {
        auto me = shared_from_this();
        const auto on = [&](const asio::any_io_executor& where, auto f) {
          asio::post(where, [f = std::move(f), a = activity{me}]() mutable { f(); });
        };
        on(acceptor.get_executor(), [me] {
          std::error_code ignored;
          me->acceptor.close(ignored);
        });
        on(http_acceptor.get_executor(), [me] {
          std::error_code ignored;
          me->http_acceptor.close(ignored);
        });
        on(metadata_acceptor.get_executor(), [me] {
          std::error_code ignored;
          me->metadata_acceptor.close(ignored);
        });
        on(liveness_timer.get_executor(), [me] { me->liveness_timer.cancel(); });
        on(reclaim_timer.get_executor(), [me] { me->reclaim_timer.cancel(); });
        on(eviction_timer.get_executor(), [me] { me->eviction_timer.cancel(); });
        for (auto& c : open) {
          on(c->strand, [c] {
            std::error_code ignored;
            c->socket.close(ignored);
            c->drained.cancel();
          });
        }
      }
      if (active.load(std::memory_order_acquire) == 0) finish_close();
    }

    void finish_close() {
      std::vector<kvlink::detail::erased_handler<void()>> done;
      {
        std::lock_guard lock{mu};
        done.swap(on_closed);
      }
      for (auto& h : done) h.complete();
    }

    // Registers an open connection so that closing reaches it; false when
    // the server is closing (the caller drops it).
    bool track(const std::shared_ptr<connection>& c, std::uint64_t& id) {
      std::lock_guard lock{mu};
      if (close_started) return false;
      id = ++next_connection;
      connections.emplace(id, c);
      return true;
    }
    void untrack(std::uint64_t id) {
      std::lock_guard lock{mu};
      connections.erase(id);
    }

    // The connection a client spoke on last: where its disk tasks go.
    void bind_client(std::uint64_t client, const std::shared_ptr<connection>& c) {
      std::lock_guard lock{mu};
      by_client[client] = c;
    }
    void unbind_client(std::uint64_t client, const std::shared_ptr<connection>& c) {
      std::lock_guard lock{mu};
      const auto it = by_client.find(client);
      if (it != by_client.end() && it->second.lock() == c) by_client.erase(it);
    }
    std::shared_ptr<connection> connection_of(std::uint64_t client) {
      std::lock_guard lock{mu};
      const auto it = by_client.find(client);
      return it == by_client.end() ? nullptr : it->second.lock();
    }

    // Logs a line once per key (a peer and what went wrong), for the first
    // few thousand keys.
    template <class... Args>
    void log_once(const std::string& key, fmt::format_string<Args...> f, Args&&... args) {
      {
        std::lock_guard lock{mu};
        if (logged.size() >= 4096 || !logged.insert(key).second) return;
      }
      kvlink::detail::log(f, std::forward<Args>(args)...);
    }

    executor_type ex;
    master_service service;
    control::peer_guard guard;
    instance_id self;
    control::server_auth auth;
    asio::ip::tcp::acceptor acceptor;
    asio::ip::tcp::acceptor http_acceptor;
    asio::ip::tcp::acceptor metadata_acceptor;
    metadata_table metadata;
    std::string address;
    std::string http_address;
    std::string metadata_address;
    asio::steady_timer liveness_timer;
    asio::steady_timer reclaim_timer;
    asio::steady_timer eviction_timer;

    std::atomic<std::int64_t> active{0};
    std::atomic<bool> closing{false};
    std::mutex mu;
    std::vector<kvlink::detail::erased_handler<void()>> on_closed;             // mu
    bool close_started = false;                                                // mu
    bool serving = false;                                                      // mu
    std::unordered_map<std::uint64_t, std::weak_ptr<connection>> connections;  // mu
    std::uint64_t next_connection = 0;                                         // mu
    std::unordered_map<std::uint64_t, std::weak_ptr<connection>> by_client;    // mu
    std::set<std::string> logged;                                              // mu
  };

  static server_options checked(server_options o) {
    std::string what;
    if (auto ec = o.validate(&what)) {
      throw std::system_error(ec, "kvlink-master: invalid options: " + what);
    }
    return o;
  }

  // ---- accepting ------------------------------------------------------

  static asio::awaitable<void> accept_loop(std::shared_ptr<impl> self, listener which, activity a) {
    (void)a;
    auto& acc = which == listener::store  ? self->acceptor
                : which == listener::http ? self->http_acceptor
                                          : self->metadata_acceptor;
    for (;;) {
      auto c = std::make_shared<connection>(asio::make_strand(self->ex));
      auto [ec] = co_await acc.async_accept(c->socket, control::use_nothrow);
      if (self->closing.load() || !acc.is_open()) co_return;
      if (ec) {
        // EMFILE and friends: back off instead of spinning on the error.
        self->log_once("accept " + ec.message(), "store master: accept failed: {}", ec.message());
        asio::steady_timer pause(acc.get_executor(), std::chrono::milliseconds(50));
        co_await pause.async_wait(control::use_nothrow);
        continue;
      }
      std::error_code rec;
      const auto from = c->socket.remote_endpoint(rec);
      c->peer = rec ? std::string("?") : control::format_endpoint(from);
      const std::string host = rec ? std::string("?") : from.address().to_string();
      std::uint64_t id = 0;
      auto& open = self->service.open_connections();
      const bool room = open.fetch_add(1) < static_cast<std::int64_t>(self->opt().max_connections);
      if (!room || !self->track(c, id)) {
        open.fetch_sub(1);
        if (!room) {
          self->service.refused_connections().fetch_add(1, std::memory_order_relaxed);
          self->log_once("refused max_connections",
                         "store master: refused a connection from {}: store_max_connections ({}) "
                         "reached (logged once)",
                         host, self->opt().max_connections);
        }
        std::error_code ignored;
        c->socket.close(ignored);
        continue;
      }
      auto strand = c->strand;
      if (which != listener::store) {
        impl::spawn(strand, serve_http(self, c, id, which == listener::metadata, activity{self}));
      } else {
        impl::spawn(strand, serve_client(self, c, id, activity{self}));
      }
    }
  }

  // ---- a store client's connection --------------------------------------

  static asio::awaitable<void> serve_client(std::shared_ptr<impl> self,
                                            std::shared_ptr<connection> c, std::uint64_t id,
                                            activity a) {
    (void)a;
    master_service& svc = self->service;
    master_service::attachment att;
    if (co_await admit(self, c, att)) {
      self->bind_client(att.session.client->id, c);
      std::vector<unsigned char> body;
      for (;;) {
        wire::header_bytes hb{};
        auto [rec, n] =
            co_await asio::async_read(c->socket, asio::buffer(hb), control::use_nothrow);
        (void)n;
        if (rec) break;
        wire::frame_header fh;
        const std::error_code hec = wire::decode_header(hb, self->opt().max_body, fh);
        if (hec == errc::protocol_version_mismatch || hec == errc::message_too_large) {
          self->log_once(c->peer + " header " + hec.message(),
                         "store master: client {} at {}: frame refused ({}: version {}, body {} "
                         "bytes); closing",
                         att.session.client->id, c->peer, hec.message(), fh.version,
                         fh.body_length);
          enqueue(self, c, master_service::header_refusal(fh, hec));
          break;
        }
        if (hec) {
          self->log_once(c->peer + " header",
                         "store master: client {} at {}: not a store frame ({}); closing",
                         att.session.client->id, c->peer, hec.message());
          break;
        }
        // The body grows with what arrives, not with what the header announced.
        body.clear();
        bool failed = false;
        while (body.size() < fh.body_length) {
          const std::size_t have = body.size();
          const std::size_t step = std::min<std::size_t>(fh.body_length - have, 64u << 10);
          body.resize(have + step);
          auto [bec, bn] = co_await asio::async_read(
              c->socket, asio::buffer(body.data() + have, step), control::use_nothrow);
          (void)bn;
          if (bec) {
            failed = true;
            break;
          }
        }
        if (failed) break;
        bool close = false;
        std::string reply = svc.handle_frame(att.session, fh, body, master_clock::now(), close);
        if (body.capacity() > (1u << 20)) body = {};  // a big request's buffer is not kept
        enqueue(self, c, std::move(reply));
        send_disk_tasks(self);
        if (close) {
          self->log_once(c->peer + " body",
                         "store master: client {} at {}: a {} request did not decode; closing",
                         att.session.client->id, c->peer, wire::to_string(fh.kind()));
          break;
        }
        // Backpressure: a client that does not read its replies stops being read.
        while (c->queued > self->opt().max_body && !c->failed && !self->closing.load()) {
          c->drained.expires_at(asio::steady_timer::time_point::max());
          co_await c->drained.async_wait(control::use_nothrow);
        }
        if (c->failed) break;
      }
      // Replies already queued go out (a refusal included) before the close.
      while (c->writing && !c->failed && !self->closing.load()) {
        c->drained.expires_at(asio::steady_timer::time_point::max());
        co_await c->drained.async_wait(control::use_nothrow);
      }
      self->unbind_client(att.session.client->id, c);
      svc.detach_client(att.session);
    }
    std::error_code ignored;
    c->socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    c->socket.close(ignored);
    self->untrack(id);
    svc.open_connections().fetch_sub(1);
  }

  // The handshake and the welcome; false when the connection is refused.
  static asio::awaitable<bool> admit(std::shared_ptr<impl> self, std::shared_ptr<connection> c,
                                     master_service::attachment& att) {
    control::hello h;
    control::session_keys keys;
    control::watchdog dog(c->strand, c->socket, self->opt().handshake_timeout);
    std::error_code ec = co_await control::server_handshake(
        c->socket, control::max_handshake_message, self->auth, h, keys);
    if (!ec && h.r != control::role::store) {
      ec = errc::invalid_argument;
      const nlohmann::json refusal = control::make_error(ec, "this is a store master");
      if (!dog.fired()) (void)co_await control::server_answer(c->socket, refusal);
    }
    if (ec) {
      self->service.failed_handshakes().fetch_add(1, std::memory_order_relaxed);
      if (ec != errc::peer_closed || dog.fired()) {
        self->log_once(c->peer + " handshake " + ec.message(),
                       "store master: handshake with {} failed: {}", c->peer,
                       dog.fired() ? std::string("timed out") : ec.message());
      }
      co_return false;
    }
    att = self->service.attach_client(h.instance, h.address, master_clock::now());
    nlohmann::json welcome = control::make_welcome(self->self);
    if (self->guard.enabled()) welcome["session"] = keys.session;
    welcome["store"] = {{"known", att.known},
                        {"client", att.session.client->id},
                        {"heartbeat_ms", self->opt().heartbeat_interval.count()},
                        {"timeout_ms", self->opt().liveness_timeout.count()},
                        {"max_body", self->opt().max_body},
                        {"records", self->service.objects().config().object_records}};
    const std::error_code wec = co_await control::server_answer(c->socket, welcome);
    if (wec || dog.fired()) {
      self->service.detach_client(att.session);
      co_return false;
    }
    control::tune_socket(c->socket, {});
    co_return true;
  }

  // Sends the SSD tier's tasks (master_service::take_disk_frames) on their
  // holders' connections, each on its connection's strand.
  static void send_disk_tasks(const std::shared_ptr<impl>& self) {
    for (auto& f : self->service.take_disk_frames()) {
      auto c = self->connection_of(f.client);
      if (!c) {
        self->service.undeliverable(f);
        continue;
      }
      asio::post(c->strand, [self, c, bytes = std::move(f.bytes), a = activity{self}]() mutable {
        enqueue(self, c, std::move(bytes));
      });
    }
  }

  // Queues a reply; the write loop sends the queue in order.
  static void enqueue(const std::shared_ptr<impl>& self, const std::shared_ptr<connection>& c,
                      std::string bytes) {
    if (c->failed) return;
    c->queued += bytes.size();
    c->out.push_back(std::move(bytes));
    if (!c->writing) {
      c->writing = true;
      impl::spawn(c->strand, write_loop(self, c, activity{self}));
    }
  }

  static asio::awaitable<void> write_loop(std::shared_ptr<impl> self, std::shared_ptr<connection> c,
                                          activity a) {
    (void)self;
    (void)a;
    while (!c->out.empty()) {
      const std::string front = std::move(c->out.front());
      c->out.pop_front();
      auto [ec, n] =
          co_await asio::async_write(c->socket, asio::buffer(front), control::use_nothrow);
      (void)n;
      c->queued -= front.size();
      if (ec) {
        c->failed = true;
        c->out.clear();
        c->queued = 0;
        std::error_code ignored;
        c->socket.close(ignored);
        break;
      }
      c->drained.cancel();
    }
    c->writing = false;
    c->drained.cancel();
  }

  // ---- HTTP -------------------------------------------------------------

  static constexpr std::size_t max_http_request = 8192;

  // One request per connection (the answer closes it): the head, up to
  // max_http_request bytes; for the metadata server a PUT's body of
  // Content-Length bytes (no more than store_metadata_max_value; "Expect:
  // 100-continue" answered first). The whole exchange runs under the
  // handshake timeout, so a silent or slow client cannot hold a connection.
  static asio::awaitable<void> serve_http(std::shared_ptr<impl> self, std::shared_ptr<connection> c,
                                          std::uint64_t id, bool metadata, activity a) {
    (void)a;
    {
      control::watchdog dog(c->strand, c->socket, self->opt().handshake_timeout);
      std::string request;
      std::array<char, 4096> buf{};
      bool ok = true;
      std::size_t end = std::string::npos;
      while ((end = request.find("\r\n\r\n")) == std::string::npos &&
             request.size() <= max_http_request) {
        auto [ec, n] = co_await c->socket.async_read_some(asio::buffer(buf), control::use_nothrow);
        if (ec) {
          ok = false;
          break;
        }
        request.append(buf.data(), n);
      }
      if (ok) {
        constexpr std::string_view text = "text/plain; charset=utf-8";
        http_answer answer{400, std::string(text), "bad request\n"};
        std::optional<http_request> req;
        if (end != std::string::npos && end + 4 <= max_http_request) {
          req = parse_http_head(std::string_view(request).substr(0, end + 4));
        }
        if (req && !metadata) {
          answer = route_http(self->service, req->method, req->target);
        } else if (req && req->chunked) {
          answer = {411, std::string(text), "send the body with a Content-Length\n"};
        } else if (req && req->content_length > self->metadata.max_value()) {
          answer = {413, std::string(text),
                    fmt::format("a value over {} bytes (store_metadata_max_value)\n",
                                self->metadata.max_value())};
        } else if (req) {
          const auto want = static_cast<std::size_t>(req->content_length);
          std::string body = request.substr(end + 4);
          if (body.size() < want && req->expect_continue) {
            constexpr std::string_view cont = "HTTP/1.1 100 Continue\r\n\r\n";
            auto [cec, cn] =
                co_await asio::async_write(c->socket, asio::buffer(cont), control::use_nothrow);
            (void)cn;
            ok = !cec;
          }
          while (ok && body.size() < want) {
            auto [ec, n] =
                co_await c->socket.async_read_some(asio::buffer(buf), control::use_nothrow);
            if (ec) ok = false;
            body.append(buf.data(), n);
          }
          if (ok) {
            body.resize(want);  // bytes after the body (a pipelined request) are dropped
            req->body = body;
            answer = route_metadata(self->metadata, self->opt().metadata_token, *req);
          }
        }
        if (ok) {
          const std::string response = format_http(answer);
          auto [wec, wn] =
              co_await asio::async_write(c->socket, asio::buffer(response), control::use_nothrow);
          (void)wec;
          (void)wn;
        }
      }
    }
    std::error_code ignored;
    c->socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    c->socket.close(ignored);
    self->untrack(id);
    self->service.open_connections().fetch_sub(1);
  }

  // ---- timers -----------------------------------------------------------

  static asio::awaitable<void> tick_loop(std::shared_ptr<impl> self, tick which, activity a) {
    (void)a;
    const server_options& o = self->opt();
    asio::steady_timer& t = which == tick::liveness  ? self->liveness_timer
                            : which == tick::reclaim ? self->reclaim_timer
                                                     : self->eviction_timer;
    const std::chrono::milliseconds every =
        which == tick::liveness
            ? std::clamp(std::min(o.heartbeat_interval, o.suspect_after / 4),
                         std::chrono::milliseconds{5}, std::chrono::milliseconds{1000})
        : which == tick::reclaim ? o.reclaim_interval
                                 : o.eviction_interval;
    for (;;) {
      if (self->closing.load()) co_return;
      t.expires_after(every);
      auto [ec] = co_await t.async_wait(control::use_nothrow);
      (void)ec;
      if (self->closing.load()) co_return;
      const master_time now = master_clock::now();
      switch (which) {
        case tick::liveness:
          self->service.check_liveness(now);
          break;
        case tick::reclaim:
          self->service.reclaim(now);
          break;
        case tick::eviction:
          self->service.evict(now);
          send_disk_tasks(self);
          break;
      }
    }
  }

  std::shared_ptr<impl> impl_;
};

}  // namespace kvlink::store
