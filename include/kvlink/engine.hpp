// kvlink's engine: registration, peers and awaitable transfers.
//
// An engine lives on an executor the caller supplies. It registers local
// memory as segments, listens for peers, connects to peers (a handshake that
// learns their segments), and moves batches of bytes with one initiating
// function, async_submit_transfer():
//
//   asio::io_context io;
//   kvlink::tcp_engine eng{io.get_executor(), kvlink::config{.listen = "127.0.0.1:0"}};
//   auto seg = eng.register_segment(buf, len, kvlink::access::remote_read_write);
//   kvlink::peer p = co_await eng.async_connect("127.0.0.1:17001", asio::use_awaitable);
//   std::vector<kvlink::transfer_request> reqs{
//       {kvlink::opcode::write, buf, p.segment(0), 0, len}};
//   kvlink::transfer_result r = co_await eng.async_submit_transfer(reqs, asio::use_awaitable);
//
// (examples/tcp_loopback.cpp is the whole program.) kvlink::rdma_engine
// (rdma/transport.hpp) is the same engine with RDMA verbs beside TCP.
//
// The completion contract, which every transport keeps:
// - A transfer completes once every byte is at its destination and visible
//   there: a WRITE after the target has placed the data in its memory and
//   acknowledged it, a READ once the data is in local memory.
// - The request span is copied before the initiating function returns.
// - The first error wins. The handler runs exactly once, never from inside
//   the initiating function, and never while a slice of the transfer may
//   still read or write the caller's memory: after an error, a cancellation
//   or the deadline, slices not yet sent are dropped and slices in flight are
//   drained; slices that do not drain within `fence_timeout` have their
//   connections closed (which stops the kernel from touching their memory)
//   before the handler runs. So the caller may free or reuse its buffers the
//   moment the handler is called, whatever the outcome.
// - Cancellation: the handler's associated cancellation slot (terminal and
//   partial cancellation; e.g. asio::bind_cancellation_slot, awaitable
//   operators, asio::cancel_after on Asio >= 1.31) stops the transfer as
//   above with errc::cancelled. Bytes already written stay written.
//
// Thread safety: an engine's methods may be called from any thread. Its
// internal state lives on a strand of the executor. Destroy the engine from a
// thread that is not running its handlers at that moment (with one thread
// running the io_context, anywhere); memory registered with it may be freed
// once the destructor returns.
#pragma once

#include <kvlink/control/message.hpp>
#include <kvlink/core/config.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/detail/control_channel.hpp>
#include <kvlink/detail/erased_handler.hpp>
#include <kvlink/detail/fabric.hpp>
#include <kvlink/detail/transfer_op.hpp>
#include <kvlink/planner/slice_planner.hpp>
#include <kvlink/tcp/lane.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/associated_cancellation_slot.hpp>
#include <asio/async_result.hpp>
#include <asio/awaitable.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/connect.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <asio/strand.hpp>
#include <asio/use_awaitable.hpp>
#include <fmt/format.h>

namespace kvlink {

/// A small message between engines: a request id and payload bytes, at most
/// config.max_notification bytes together. `from` and `from_address` are
/// filled in on receipt (the sender's instance and listen address).
struct notification {
  std::string id;
  std::string payload;
  instance_id from{};
  std::string from_address{};
};

/// Per-call options of async_submit_transfer.
struct transfer_options {
  /// Deadline of this transfer, counted from submission. nullopt: the
  /// engine's config.transfer_deadline; zero: no deadline.
  std::optional<std::chrono::milliseconds> deadline{};
  /// Sent to the peer(s) of the transfer once it has completed successfully,
  /// so the peer receives it only after the data is visible in its memory
  /// (a WRITE's bytes are placed and acknowledged before it is sent). The
  /// transfer's handler runs once the notification is handed to the kernel;
  /// if it cannot be sent the transfer completes with that error (the data
  /// did arrive). Not sent when the transfer fails.
  std::optional<notification> notify{};
};

namespace detail {

template <class Transport>
class engine_core;

struct peer_state {
  peer_id id;
  instance_id instance;
  std::string address;
  std::string transport;
  std::shared_ptr<remote_segment_cache> cache;
  std::atomic<bool> alive{true};
  // Strand-only from here.
  std::shared_ptr<control_channel> control;
  std::vector<std::shared_ptr<lane_base>> lanes;
  std::shared_ptr<fabric_path> path;  // set when a fabric (RDMA) carries its data
  std::vector<double> weights;
  std::error_code failure;
};

struct transfer_op {
  std::uint64_t id = 0;
  erased_handler<void(std::error_code, transfer_result)> handler;
  asio::cancellation_slot slot;
  std::size_t pending = 0;  // slices handed to lanes and not yet resolved
  std::error_code error;
  transfer_result result;
  bool stopping = false;
  std::chrono::steady_clock::time_point start;
  std::optional<asio::steady_timer> deadline;
  std::optional<asio::steady_timer> fence;
  std::vector<std::shared_ptr<lane_base>> lanes;   // lanes that carry its slices
  std::vector<std::shared_ptr<peer_state>> peers;  // peers it moves data with
  std::optional<notification> notify{};
};

}  // namespace detail

template <class Transport, class Executor = asio::any_io_executor>
class basic_engine;

/// A connected peer, as the local engine sees it: a cheap, copyable handle.
class peer {
 public:
  peer() = default;

  bool valid() const noexcept { return state_ != nullptr; }
  peer_id id() const noexcept { return state_ ? state_->id : peer_id{}; }
  instance_id instance() const noexcept { return state_ ? state_->instance : instance_id{}; }
  /// The address it was reached at (host:port).
  const std::string& address() const { return checked().address; }
  /// Which transport carries its data: "rdma" or "tcp" (chosen at the
  /// handshake: RDMA when both engines have a usable device, TCP otherwise
  /// unless config.allow_tcp_fallback forbids it).
  const std::string& transport() const { return checked().transport; }
  /// False once its connections were lost or closed.
  bool connected() const noexcept {
    return state_ && state_->alive.load(std::memory_order_acquire);
  }

  /// Its segments as last announced (ordered by id). Registrations the peer
  /// makes later are pushed to this engine over the control channel.
  std::vector<remote_segment_info> segments() const {
    const auto& s = checked();
    return s.cache->segments(s.instance);
  }

  /// The `index`-th of segments(); throws std::out_of_range.
  remote_segment segment(std::size_t index) const {
    const auto segs = segments();
    if (index >= segs.size()) {
      throw std::out_of_range(fmt::format("kvlink: peer {} has {} segments, no segment #{}",
                                          address(), segs.size(), index));
    }
    return remote_segment{id(), segs[index].id};
  }

  /// A segment of this peer by its id (learned out of band, say). Not
  /// checked here: the target checks every access.
  remote_segment segment(segment_id sid) const noexcept { return remote_segment{id(), sid}; }

 private:
  template <class>
  friend class detail::engine_core;
  template <class, class>
  friend class basic_engine;
  explicit peer(std::shared_ptr<detail::peer_state> s) : state_(std::move(s)) {}
  const detail::peer_state& checked() const {
    if (!state_) throw std::logic_error("kvlink: empty peer handle");
    return *state_;
  }
  std::shared_ptr<detail::peer_state> state_;
};

/// The TCP transport, as a template argument of basic_engine. Its lanes are
/// in tcp/lane.hpp.
struct tcp_transport {
  static constexpr std::string_view name = "tcp";
  using lane_type = tcp::lane;
  using server_type = tcp::lane_server;
};

/// What basic_engine needs of a transport. A transport may also offer a
/// one-sided fabric beside TCP (rdma_transport does):
///   static std::shared_ptr<detail::fabric> make_fabric(const config&,
///                                                      asio::any_io_executor strand);
template <class T>
concept transport = requires {
  { T::name } -> std::convertible_to<std::string_view>;
  typename T::lane_type;
  typename T::server_type;
};

template <class T>
concept fabric_transport = transport<T> && requires(const config& c, asio::any_io_executor ex) {
  { T::make_fabric(c, ex) } -> std::convertible_to<std::shared_ptr<detail::fabric>>;
};

namespace detail {

inline constexpr auto use_nothrow = asio::experimental::as_tuple(asio::use_awaitable);

/// Closes a socket if a set-up step takes longer than its timeout.
class watchdog {
 public:
  watchdog(const asio::any_io_executor& ex, asio::ip::tcp::socket& s,
           std::chrono::milliseconds timeout)
      : timer_(ex), state_(std::make_shared<state>(state{&s, true, false})) {
    timer_.expires_after(timeout);
    timer_.async_wait([st = state_](std::error_code ec) {
      if (ec || !st->active) return;
      st->fired = true;
      std::error_code ignored;
      st->socket->close(ignored);
    });
  }
  ~watchdog() {
    state_->active = false;
    timer_.cancel();
  }
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  bool fired() const noexcept { return state_->fired; }

 private:
  struct state {
    asio::ip::tcp::socket* socket;
    bool active;
    bool fired;
  };
  asio::steady_timer timer_;
  std::shared_ptr<state> state_;
};

inline asio::awaitable<std::error_code> write_message(asio::ip::tcp::socket& s,
                                                      const nlohmann::json& msg) {
  const std::string bytes = control::encode_message(msg);
  auto [ec, n] = co_await asio::async_write(s, asio::buffer(bytes), use_nothrow);
  (void)n;
  co_return ec ? tcp::map_socket_error(ec) : std::error_code{};
}

inline asio::awaitable<std::error_code> read_message(asio::ip::tcp::socket& s, std::uint64_t max,
                                                     nlohmann::json& out) {
  control::prefix_bytes prefix{};
  auto [ec, n] = co_await asio::async_read(s, asio::buffer(prefix), use_nothrow);
  (void)n;
  if (ec) co_return tcp::map_socket_error(ec);
  std::uint32_t len = 0;
  if (auto dec = control::decode_prefix(prefix, max, len)) co_return dec;
  std::string body(len, '\0');
  auto [ec2, n2] = co_await asio::async_read(s, asio::buffer(body), use_nothrow);
  (void)n2;
  if (ec2) co_return tcp::map_socket_error(ec2);
  co_return control::parse_message(body, out);
}

/// Splits "host:port" / "[v6]:port".
inline std::error_code split_address(std::string_view text, std::string& host, std::string& port) {
  const auto colon = text.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == text.size()) return errc::invalid_argument;
  auto h = text.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (h.empty()) return errc::invalid_argument;
  host.assign(h);
  port.assign(text.substr(colon + 1));
  return {};
}

inline std::string format_endpoint(const asio::ip::tcp::endpoint& ep) {
  const auto a = ep.address();
  return a.is_v6() ? fmt::format("[{}]:{}", a.to_string(), ep.port())
                   : fmt::format("{}:{}", a.to_string(), ep.port());
}

// The engine's state. Shared so that pending handlers keep it alive after
// the engine object is gone; everything below `strand-only` is touched only
// on the strand.
template <class Transport>
class engine_core final : public transport_host,
                          public std::enable_shared_from_this<engine_core<Transport>> {
 public:
  using strand_type = asio::strand<asio::any_io_executor>;
  using transfer_handler = erased_handler<void(std::error_code, transfer_result)>;
  using connect_handler = erased_handler<void(std::error_code, peer)>;
  using plain_handler = erased_handler<void(std::error_code)>;
  using notification_handler = erased_handler<void(std::error_code, notification)>;

  engine_core(asio::any_io_executor ex, config cfg)
      : strand_(asio::make_strand(ex)),
        cfg_(std::move(cfg)),
        self_(make_instance_id()),
        cache_(std::make_shared<remote_segment_cache>()),
        acceptor_(strand_) {
    std::string what;
    if (auto ec = validate(cfg_, &what)) {
      throw std::system_error(ec, fmt::format("kvlink: invalid config: {}", what));
    }
    std::string host, port;
    if (split_address(cfg_.listen, host, port)) {
      throw std::system_error(
          make_error_code(errc::invalid_argument),
          fmt::format("kvlink: listen address '{}' is not host:port", cfg_.listen));
    }
    asio::ip::tcp::resolver resolver(strand_);
    std::error_code ec;
    const auto results = resolver.resolve(host, port, asio::ip::tcp::resolver::passive, ec);
    if (ec || results.empty()) {
      throw std::system_error(
          ec ? ec : make_error_code(errc::invalid_argument),
          fmt::format("kvlink: cannot resolve listen address '{}'", cfg_.listen));
    }
    const auto ep = results.begin()->endpoint();
    acceptor_.open(ep.protocol());
    acceptor_.set_option(asio::socket_base::reuse_address(true));
    acceptor_.bind(ep, ec);
    if (ec) throw std::system_error(ec, fmt::format("kvlink: bind({})", cfg_.listen));
    acceptor_.listen(asio::socket_base::max_listen_connections);
    local_address_ = format_endpoint(acceptor_.local_endpoint());
    if constexpr (fabric_transport<Transport>) {
      fabric_ = Transport::make_fabric(cfg_, asio::any_io_executor(strand_));
      if (fabric_ && !fabric_->available() && !cfg_.allow_tcp_fallback) {
        throw std::system_error(
            make_error_code(errc::no_device),
            fmt::format("kvlink: no usable {} device ({}) and config.allow_tcp_fallback is false",
                        fabric_->name(), fabric_->unavailable_reason()));
      }
    }
  }

  void start() {
    if (fabric_ && fabric_->available()) fabric_->start();
    asio::co_spawn(strand_, accept_loop(this->shared_from_this()), asio::detached);
  }

  /// The fabric beside TCP, if this engine has one (even when it found no
  /// device); nullptr for a TCP engine.
  const detail::fabric* fabric() const noexcept { return fabric_.get(); }

  // ------------------------------------------------------------ public API

  const config& cfg() const noexcept { return cfg_; }
  const std::string& local_address() const noexcept { return local_address_; }
  const instance_id& self() const noexcept { return self_; }
  segment_registry& registry() noexcept { return registry_; }
  strand_type& strand() noexcept { return strand_; }

  segment_id register_segment(const void* base, std::uint64_t length, access granted,
                              std::error_code& ec, std::string* what = nullptr) {
    const auto id = registry_.add(base, length, granted, ec);
    if (ec) return id;
    if (fabric_ && fabric_->available()) {
      std::string call;
      ec = fabric_->register_memory(id, const_cast<void*>(base), length, granted, call);
      if (ec) {
        (void)registry_.remove(id);
        if (what) *what = std::move(call);
        return segment_id{};
      }
    }
    announce_segments();
    return id;
  }

  /// Registration off the caller's executor: pinning gigabytes with every
  /// device takes a while. One short-lived thread per call.
  void register_segment_async(void* base, std::uint64_t length, access granted,
                              erased_handler<void(std::error_code, segment_id)> h) {
    std::thread([self = this->shared_from_this(), base, length, granted,
                 h = std::move(h)]() mutable {
      std::error_code ec;
      const auto id = self->register_segment(base, length, granted, ec);
      h.complete(ec, id);
    }).detach();
  }

  void unregister_segment(segment_id id, plain_handler h) {
    asio::post(strand_, [self = this->shared_from_this(), id, h = std::move(h)]() mutable {
      if (auto ec = self->registry_.remove(id)) {
        h.complete(ec);
        return;
      }
      // After deregistration no device touches the memory; TCP frames in
      // flight are waited for below.
      if (self->fabric_ && self->fabric_->available()) self->fabric_->unregister_memory(id);
      self->announce_segments_now();
      if (self->pins_[id] == 0) {
        self->pins_.erase(id);
        h.complete({});
      } else {
        self->unpin_waiters_.emplace(id, std::move(h));
      }
    });
  }

  void connect(std::string address, connect_handler h) {
    asio::co_spawn(strand_,
                   connect_impl(this->shared_from_this(), std::move(address), std::move(h)),
                   asio::detached);
  }

  void submit(std::uint64_t id, std::vector<transfer_request> reqs, transfer_options opts,
              transfer_handler h, asio::cancellation_slot slot) {
    asio::post(strand_, [self = this->shared_from_this(), id, reqs = std::move(reqs), opts,
                         h = std::move(h), slot]() mutable {
      self->start_transfer(id, std::move(reqs), opts, std::move(h), slot);
    });
  }

  std::uint64_t next_op_id() noexcept { return next_op_.fetch_add(1, std::memory_order_relaxed); }

  void cancel(std::uint64_t id) {
    asio::post(strand_, [self = this->shared_from_this(), id] {
      if (auto* op = self->find_op(id)) self->stop(op, errc::cancelled);
    });
  }

  /// Closes everything. Synchronous: see the class comment for the threading
  /// rule it relies on.
  void shutdown() {
    if (shut_) return;
    shut_ = true;
    std::error_code ignored;
    acceptor_.close(ignored);
    auto peers = peers_;
    for (auto& [pid, p] : peers) peer_failed(p, errc::cancelled);
    for (auto& w : servers_) {
      if (auto s = w.lock()) s->close();
    }
    servers_.clear();
    for (auto& s : sessions_) s->close(errc::cancelled);
    sessions_.clear();
    if (fabric_) fabric_->shutdown();
    auto waiters = std::move(notify_waiters_);
    notify_waiters_.clear();
    for (auto& w : waiters) w.handler.complete(errc::cancelled, notification{});
  }

  // ------------------------------------------------------------ notifications

  void send_notification(std::shared_ptr<peer_state> p, notification n, plain_handler h) {
    asio::post(strand_, [self = this->shared_from_this(), p = std::move(p), n = std::move(n),
                         h = std::move(h)]() mutable {
      if (n.id.size() + n.payload.size() > self->cfg_.max_notification) {
        h.complete(errc::message_too_large);
        return;
      }
      if (!p->alive.load() || !p->control) {
        h.complete(p->failure ? p->failure : errc::peer_closed);
        return;
      }
      auto shared = std::make_shared<plain_handler>(std::move(h));
      p->control->send(control::make_notify(n.id, n.payload),
                       [shared](std::error_code ec) { shared->complete(ec); });
    });
  }

  void receive_notification(std::uint64_t id, notification_handler h,
                            asio::cancellation_slot slot) {
    asio::post(strand_, [self = this->shared_from_this(), id, h = std::move(h), slot]() mutable {
      if (!self->received_.empty()) {
        auto n = std::move(self->received_.front());
        self->received_.pop_front();
        if (slot.is_connected()) slot.clear();
        h.complete({}, std::move(n));
        return;
      }
      if (self->shut_) {
        h.complete(errc::cancelled, notification{});
        return;
      }
      self->notify_waiters_.push_back(notify_waiter{id, std::move(h), slot});
    });
  }

  void cancel_receive(std::uint64_t id) {
    asio::post(strand_, [self = this->shared_from_this(), id] {
      auto it = std::find_if(self->notify_waiters_.begin(), self->notify_waiters_.end(),
                             [id](const auto& w) { return w.id == id; });
      if (it == self->notify_waiters_.end()) return;
      auto w = std::move(*it);
      self->notify_waiters_.erase(it);
      if (w.slot.is_connected()) w.slot.clear();
      w.handler.complete(errc::cancelled, notification{});
    });
  }

  // ------------------------------------------------------------ transport_host

  void slice_done(transfer_op* op, std::uint64_t bytes, std::error_code ec) override {
    op->result.bytes += bytes;
    --op->pending;
    if (ec && !op->stopping) {
      stop(op, ec);  // may complete the op
      return;
    }
    if (op->pending == 0) complete(op);
  }

  void pin(segment_id id) override { ++pins_[id]; }

  void unpin(segment_id id) override {
    auto it = pins_.find(id);
    if (it == pins_.end()) return;
    if (--it->second > 0) return;
    pins_.erase(it);
    auto [first, last] = unpin_waiters_.equal_range(id);
    std::vector<plain_handler> ready;
    for (auto w = first; w != last; ++w) ready.push_back(std::move(w->second));
    unpin_waiters_.erase(first, last);
    for (auto& h : ready) h.complete({});
  }

 private:
  // ------------------------------------------------------------ transfers

  transfer_op* find_op(std::uint64_t id) {
    auto it = ops_.find(id);
    return it == ops_.end() ? nullptr : it->second.get();
  }

  void start_transfer(std::uint64_t id, std::vector<transfer_request> reqs, transfer_options opts,
                      transfer_handler h, asio::cancellation_slot slot) {
    auto owned = std::make_unique<transfer_op>();
    auto* op = owned.get();
    op->id = id;
    op->handler = std::move(h);
    op->slot = slot;
    op->start = std::chrono::steady_clock::now();
    op->result.requests = static_cast<std::uint32_t>(reqs.size());
    op->notify = std::move(opts.notify);
    ops_.emplace(id, std::move(owned));
    if (op->notify && op->notify->id.size() + op->notify->payload.size() > cfg_.max_notification) {
      op->error = errc::message_too_large;
      complete(op);
      return;
    }

    // Validate everything before anything moves: a bad request fails the
    // whole batch with nothing transferred.
    struct group {
      std::shared_ptr<peer_state> p;
      std::vector<plan_request> items;
    };
    std::vector<group> groups;
    for (const auto& r : reqs) {
      if (auto ec = validate_request(r, groups)) {
        op->error = ec;
        complete(op);
        return;
      }
    }
    const plan_policy policy{cfg_.slice_size, cfg_.min_chunk, cfg_.alignment};
    std::vector<slice> slices;
    for (auto& g : groups) {
      plan_stats stats;
      if (auto ec = plan_slices(g.items, g.p->weights, policy, slices, &stats)) {
        // Nothing of this transfer was sent yet when the first group fails;
        // earlier groups were already handed to lanes, so stop() fences them.
        op->error = ec;
        if (op->pending == 0) {
          complete(op);
        } else {
          stop(op, ec);
        }
        return;
      }
      op->result.slices += stats.slices;
      op->peers.push_back(g.p);
      std::vector<bool> used(g.p->lanes.size(), false);
      for (const auto& s : slices) {
        auto& l = g.p->lanes[s.lane];
        l->enqueue(slice_ref{op, reinterpret_cast<std::byte*>(s.local_addr), s.length,
                             s.remote_segment.value(), s.remote_offset, s.op, 0,
                             s.local_segment.value()});
        ++op->pending;
        if (!used[s.lane]) {
          used[s.lane] = true;
          op->lanes.push_back(l);
        }
      }
    }
    op->result.lanes = static_cast<std::uint32_t>(op->lanes.size());
    if (op->pending == 0) {  // an empty batch
      complete(op);
      return;
    }
    const auto deadline = opts.deadline.value_or(cfg_.transfer_deadline);
    if (deadline.count() > 0) {
      op->deadline.emplace(strand_);
      op->deadline->expires_after(deadline);
      op->deadline->async_wait([w = this->weak_from_this(), id](std::error_code ec) {
        if (ec) return;
        if (auto self = w.lock()) {
          if (auto* o = self->find_op(id)) self->stop(o, errc::deadline_exceeded);
        }
      });
    }
    // Kick the lanes last: sends complete asynchronously, never in here.
    auto lanes = op->lanes;
    for (auto& l : lanes) l->pump();
  }

  std::error_code validate_request(const transfer_request& r, auto& groups) {
    if (r.length == 0 || r.local == nullptr) return errc::invalid_argument;
    segment_info local;
    if (auto ec = registry_.locate(r.local, r.length, local)) return ec;
    auto it = peers_.find(r.remote.peer.value());
    if (it == peers_.end()) return errc::unknown_peer;
    const auto& p = it->second;
    if (!p->alive.load(std::memory_order_relaxed))
      return p->failure ? p->failure : errc::peer_closed;
    // The cached descriptor catches mistakes early; an id the cache does not
    // know yet (registered a moment ago) is left to the target, which checks
    // every frame anyway.
    if (auto known = cache_->get(p->instance, r.remote.segment)) {
      if (auto ec = cache_->check(p->instance, r.remote.segment, r.remote_offset, r.length,
                                  required_access(r.op))) {
        return ec;
      }
    } else if (!r.remote.segment.valid()) {
      return errc::not_registered;
    }
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.p == p; });
    if (g == groups.end()) {
      groups.push_back({p, {}});
      g = std::prev(groups.end());
    }
    g->items.push_back(plan_request{r.op, reinterpret_cast<std::uintptr_t>(r.local), local.id,
                                    r.remote.segment, r.remote_offset, r.length});
    return {};
  }

  /// First error wins: drop what was not sent, then wait for what is in
  /// flight (or fence it after fence_timeout).
  void stop(transfer_op* op, std::error_code ec) {
    if (op->stopping) return;
    op->stopping = true;
    if (!op->error) op->error = ec;
    if (op->deadline) op->deadline->cancel();
    std::size_t dropped = 0;
    for (auto& l : op->lanes) dropped += l->drop_queued(op);
    op->pending -= dropped;
    if (op->pending == 0) {
      complete(op);
      return;
    }
    op->fence.emplace(strand_);
    op->fence->expires_after(cfg_.fence_timeout);
    op->fence->async_wait([w = this->weak_from_this(), id = op->id](std::error_code fec) {
      if (fec) return;
      if (auto self = w.lock()) self->fence(id);
    });
  }

  /// In-flight slices did not drain in time: close their connections, which
  /// resolves them (see tcp::lane::fail).
  void fence(std::uint64_t id) {
    auto* op = find_op(id);
    if (!op) return;
    auto lanes = op->lanes;
    for (auto& l : lanes) {
      if (find_op(id) == nullptr) return;
      // Other transfers on these lanes fail too: their peer stopped answering.
      if (l->has_in_flight(op)) l->fail(errc::peer_closed);
    }
  }

  void complete(transfer_op* op) {
    auto it = ops_.find(op->id);
    if (it == ops_.end()) return;
    auto owned = std::move(it->second);
    ops_.erase(it);
    if (owned->slot.is_connected()) owned->slot.clear();
    owned->result.duration = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - owned->start);
    auto h = std::move(owned->handler);
    const auto ec = owned->error;
    const auto result = owned->result;
    auto notify = std::move(owned->notify);
    auto peers = std::move(owned->peers);
    owned.reset();  // state freed before the upcall
    if (ec || !notify || peers.empty()) {
      h.complete(ec, result);
      return;
    }
    // The data is in place: now the notification, then the handler.
    struct fan_in {
      transfer_handler handler;
      transfer_result result;
      std::size_t remaining;
      std::error_code first;
    };
    auto state = std::make_shared<fan_in>(fan_in{std::move(h), result, peers.size(), {}});
    const auto msg = control::make_notify(notify->id, notify->payload);
    for (auto& p : peers) {
      auto done = [state](std::error_code sec) {
        if (sec && !state->first) state->first = sec;
        if (--state->remaining == 0) state->handler.complete(state->first, state->result);
      };
      if (!p->alive.load() || !p->control) {
        done(p->failure ? p->failure : errc::peer_closed);
      } else {
        p->control->send(msg, done);
      }
    }
  }

  void deliver(notification n) {
    if (!notify_waiters_.empty()) {
      auto w = std::move(notify_waiters_.front());
      notify_waiters_.pop_front();
      if (w.slot.is_connected()) w.slot.clear();
      w.handler.complete({}, std::move(n));
      return;
    }
    received_.push_back(std::move(n));
  }

  // ------------------------------------------------------------ peers

  void peer_failed(const std::shared_ptr<peer_state>& p, std::error_code ec) {
    if (!p->alive.exchange(false)) return;
    p->failure = ec;
    for (auto& l : p->lanes) l->fail(ec);
    if (p->control) p->control->close(ec);
  }

  // Registrations come in bursts at start-up (hundreds of regions): one
  // announcement, of the whole list as it is when it runs, serves them all.
  void announce_segments() {
    if (announce_pending_.exchange(true)) return;
    asio::post(strand_, [w = this->weak_from_this()] {
      if (auto self = w.lock()) {
        self->announce_pending_.store(false);
        self->announce_segments_now();
      }
    });
  }

  void announce_segments_now() {
    if (sessions_.empty()) return;
    const nlohmann::json msg{{"type", "segments"},
                             {"segments", control::segments_to_json(local_segments())}};
    std::erase_if(sessions_, [](const auto& s) { return s->closed(); });
    for (auto& s : sessions_) s->send(msg);
  }

  std::vector<remote_segment_info> local_segments() const {
    std::vector<remote_segment_info> out;
    const bool keys = fabric_ && fabric_->available();
    for (const auto& s : registry_.snapshot()) {
      out.push_back(
          remote_segment_info{s.id, static_cast<std::uint64_t>(s.base), s.length, s.granted,
                              keys ? fabric_->rkeys(s.id) : std::vector<std::uint32_t>{}});
    }
    return out;
  }

  control::peer_descriptor descriptor() const {
    control::peer_descriptor d;
    d.instance = self_;
    d.tcp_address = local_address_;
    d.segments = local_segments();
    d.transports = {{"tcp", {{"address", local_address_}, {"lanes", cfg_.tcp_lanes}}}};
    if (fabric_ && fabric_->available())
      d.transports[std::string(fabric_->name())] = fabric_->describe();
    return d;
  }

  // Opens one connection and runs the hello exchange on it.
  asio::awaitable<std::error_code> open_connection(asio::ip::tcp::socket& s,
                                                   const asio::ip::tcp::resolver::results_type& eps,
                                                   const nlohmann::json& hello,
                                                   nlohmann::json& reply) {
    watchdog dog(strand_, s, cfg_.connect_timeout);
    auto [ec, ep] = co_await asio::async_connect(s, eps, use_nothrow);
    (void)ep;
    if (ec) co_return std::error_code{errc::peer_unreachable};  // refused, or timed out
    tcp::tune_socket(s, cfg_.tcp_nodelay, cfg_.socket_buffer);
    if (auto wec = co_await write_message(s, hello))
      co_return dog.fired() ? errc::peer_unreachable : wec;
    if (auto rec = co_await read_message(s, cfg_.max_control_message, reply)) {
      co_return dog.fired() ? errc::peer_unreachable : rec;
    }
    const auto type = reply.value("type", std::string{});
    if (type == "error") co_return control::error_from_message(reply);
    if (type != "welcome") co_return errc::malformed_message;
    unsigned proto = 0;
    if (!control::get_field(reply, "protocol", proto)) co_return errc::malformed_message;
    if (proto != protocol_version) co_return errc::protocol_version_mismatch;
    co_return std::error_code{};
  }

  static asio::awaitable<void> connect_impl(std::shared_ptr<engine_core> self, std::string address,
                                            connect_handler h) {
    peer result;
    const auto ec = co_await self->do_connect(address, result);
    h.complete(ec, ec ? peer{} : result);
  }

  asio::awaitable<std::error_code> do_connect(const std::string& address, peer& out) {
    if (shut_) co_return errc::cancelled;
    std::string host, port;
    if (split_address(address, host, port)) co_return errc::invalid_argument;
    asio::ip::tcp::resolver resolver(strand_);
    auto [rec, eps] = co_await resolver.async_resolve(host, port, use_nothrow);
    if (rec || eps.empty()) co_return errc::peer_unreachable;

    asio::ip::tcp::socket control_socket(strand_);
    nlohmann::json welcome;
    if (auto ec = co_await open_connection(
            control_socket, eps,
            control::make_hello(protocol_version, self_, control::role::control, 0, std::nullopt,
                                local_address_),
            welcome)) {
      co_return ec;
    }
    control::peer_descriptor desc;
    if (auto ec = control::from_json(welcome.value("descriptor", nlohmann::json{}), desc))
      co_return ec;

    // Connections are reused: one live peer per instance.
    for (auto& [pid, p] : peers_) {
      if (p->instance == desc.instance && p->alive.load()) {
        out = peer{p};
        co_return std::error_code{};
      }
    }
    // The same address with another instance: the peer restarted. Drop what
    // we knew of the old one.
    for (auto& [pid, p] : peers_) {
      if (p->address == address && p->instance != desc.instance) {
        peer_failed(p, errc::instance_changed);
        cache_->drop_instance(p->instance);
      }
    }

    // The data transport, per peer: the fabric (RDMA) when both sides have a
    // usable device, TCP otherwise unless the config forbids falling back.
    bool use_fabric = false;
    if (fabric_) {
      std::string why;
      const auto entry = desc.transports.find(std::string(fabric_->name()));
      if (!fabric_->available()) {
        why = fabric_->unavailable_reason();
      } else if (entry == desc.transports.end()) {
        why = fmt::format("the peer offers no {} device", fabric_->name());
      } else {
        use_fabric = fabric_->reachable(*entry, why);
      }
      if (!use_fabric && !cfg_.allow_tcp_fallback) {
        co_return errc::transport_unavailable;
      }
    }

    auto p = std::make_shared<peer_state>();
    p->id = peer_id{next_peer_++};
    p->instance = desc.instance;
    p->address = address;
    p->transport = use_fabric ? std::string(fabric_->name()) : std::string("tcp");
    p->cache = cache_;
    for (auto& s : desc.segments) cache_->put(desc.instance, s);

    if (use_fabric) {
      co_return attach_fabric_peer(p, std::move(control_socket),
                                   desc.transports[std::string(fabric_->name())], out);
    }

    for (std::uint32_t i = 0; i < cfg_.tcp_lanes; ++i) {
      asio::ip::tcp::socket s(strand_);
      nlohmann::json reply;
      if (auto ec = co_await open_connection(
              s, eps,
              control::make_hello(protocol_version, self_, control::role::lane, i, desc.instance),
              reply)) {
        for (auto& l : p->lanes) l->fail(ec);
        co_return ec;
      }
      auto lane = std::make_shared<tcp::lane>(
          std::move(s), *this, cfg_.max_inflight_per_lane,
          [w = this->weak_from_this(), wp = std::weak_ptr<peer_state>(p)](std::error_code ec) {
            auto self = w.lock();
            auto pp = wp.lock();
            if (self && pp) self->peer_failed(pp, ec);
          });
      p->lanes.push_back(std::move(lane));
      p->weights.push_back(1.0);
    }
    if (shut_) {
      for (auto& l : p->lanes) l->fail(errc::cancelled);
      co_return errc::cancelled;
    }
    p->control =
        std::make_shared<control_channel>(std::move(control_socket), cfg_.max_control_message);
    peers_.emplace(p->id.value(), p);
    for (auto& l : p->lanes) l->start();
    start_control(p);
    out = peer{p};
    co_return std::error_code{};
  }

  // A peer whose data goes over the fabric: the control channel first (the
  // path sends its connection requests over it), then one path that stripes
  // slices over every rail.
  std::error_code attach_fabric_peer(const std::shared_ptr<peer_state>& p,
                                     asio::ip::tcp::socket control_socket,
                                     const nlohmann::json& remote, peer& out) {
    if (shut_) return errc::cancelled;
    p->control =
        std::make_shared<control_channel>(std::move(control_socket), cfg_.max_control_message);
    std::weak_ptr<peer_state> wp = p;
    std::weak_ptr<control_channel> wc = p->control;
    path_context ctx{p->instance, cache_,
                     [wc](const nlohmann::json& m) {
                       if (auto c = wc.lock()) c->send(m);
                     },
                     [w = this->weak_from_this(), wp](std::error_code ec) {
                       auto self = w.lock();
                       auto pp = wp.lock();
                       if (self && pp) self->peer_failed(pp, ec);
                     }};
    p->path = fabric_->make_path(remote, *this, std::move(ctx));
    p->lanes.push_back(p->path);
    p->weights.push_back(1.0);
    peers_.emplace(p->id.value(), p);
    p->path->start();
    start_control(p);
    out = peer{p};
    return {};
  }

  void start_control(const std::shared_ptr<peer_state>& p) {
    std::weak_ptr<peer_state> wp = p;
    p->control->start(
        [w = this->weak_from_this(), wp](const nlohmann::json& msg) {
          auto self = w.lock();
          auto pp = wp.lock();
          if (self && pp) self->on_peer_message(*pp, msg);
        },
        [w = this->weak_from_this(), wp](std::error_code ec) {
          auto self = w.lock();
          auto pp = wp.lock();
          if (self && pp) self->peer_failed(pp, ec);
        });
  }

  void on_peer_message(peer_state& p, const nlohmann::json& msg) {
    const auto type = msg.value("type", std::string{});
    if (p.path && type.starts_with(std::string(fabric_->name()) + "_")) {
      p.path->on_control(msg);
      return;
    }
    if (type == "segments") {
      std::vector<remote_segment_info> segs;
      const auto it = msg.find("segments");
      if (it == msg.end() || control::segments_from_json(*it, segs)) return;  // ignore a bad update
      cache_->drop_instance(p.instance);
      for (auto& s : segs) cache_->put(p.instance, std::move(s));
    }
    // Unknown message types are ignored: newer peers may send more.
  }

  // ------------------------------------------------------------ accepting

  static asio::awaitable<void> accept_loop(std::shared_ptr<engine_core> self) {
    for (;;) {
      asio::ip::tcp::socket s(self->strand_);
      auto [ec] = co_await self->acceptor_.async_accept(s, use_nothrow);
      if (self->shut_ || !self->acceptor_.is_open()) co_return;
      if (ec) {
        // EMFILE and friends: back off instead of spinning on the error.
        asio::steady_timer pause(self->strand_, std::chrono::milliseconds(50));
        co_await pause.async_wait(use_nothrow);
        continue;
      }
      asio::co_spawn(self->strand_, serve_connection(self, std::move(s)), asio::detached);
    }
  }

  static asio::awaitable<void> serve_connection(std::shared_ptr<engine_core> self,
                                                asio::ip::tcp::socket s) {
    nlohmann::json msg;
    control::hello hello;
    std::error_code ec;
    {
      watchdog dog(self->strand_, s, self->cfg_.connect_timeout);
      ec = co_await read_message(s, self->cfg_.max_control_message, msg);
      if (!ec) ec = control::parse_hello(msg, hello);
      if (!ec && hello.r == control::role::lane && hello.expect && *hello.expect != self->self_) {
        ec = errc::instance_changed;
      }
      if (ec) {
        if (!dog.fired() && s.is_open()) co_await write_message(s, control::make_error(ec));
        std::error_code ignored;
        s.close(ignored);
        co_return;
      }
      tcp::tune_socket(s, self->cfg_.tcp_nodelay, self->cfg_.socket_buffer);
      const auto reply = hello.r == control::role::control
                             ? control::make_welcome(self->descriptor())
                             : nlohmann::json{{"type", "welcome"},
                                              {"protocol", protocol_version},
                                              {"instance", to_string(self->self_)}};
      if (co_await write_message(s, reply) || dog.fired()) co_return;
    }
    if (self->shut_) co_return;
    if (hello.r == control::role::lane) {
      auto server = std::make_shared<typename Transport::server_type>(
          std::move(s), self->registry_, *self, self->cfg_.max_frame_payload);
      std::erase_if(self->servers_, [](const auto& w) { return w.expired(); });
      self->servers_.push_back(server);
      server->start();
      co_return;
    }
    auto session = std::make_shared<control_channel>(std::move(s), self->cfg_.max_control_message);
    std::erase_if(self->sessions_, [](const auto& x) { return x->closed(); });
    self->sessions_.push_back(session);
    std::weak_ptr<engine_core> weak = self;
    std::weak_ptr<control_channel> wsession = session;
    session->start(
        [weak, wsession, from = hello.instance, addr = hello.address](const nlohmann::json& m) {
          auto core = weak.lock();
          if (!core) return;
          if (m.value("type", std::string{}) != "notify") {
            // A fabric path's connection request; other types are ignored.
            if (core->fabric_ && core->fabric_->available()) {
              if (auto ch = wsession.lock()) {
                if (auto reply = core->fabric_->on_request(ch.get(), m)) ch->send(*reply);
              }
            }
            return;
          }
          notification n;
          if (control::parse_notify(m, core->cfg_.max_notification, n.id, n.payload)) {
            if (auto ch = wsession.lock()) ch->close(errc::malformed_message);
            return;
          }
          if (core->received_.size() >= max_queued_notifications) {
            // Nobody reads them: refuse to buffer without bound.
            if (auto ch = wsession.lock()) ch->close(errc::queue_full);
            return;
          }
          n.from = from;
          n.from_address = addr;
          core->deliver(std::move(n));
        },
        [weak, key = static_cast<const void*>(session.get())](std::error_code) {
          auto core = weak.lock();
          if (core && core->fabric_ && core->fabric_->available()) {
            core->fabric_->session_closed(key);
          }
        });
  }

  strand_type strand_;
  config cfg_;
  instance_id self_;
  segment_registry registry_;
  std::shared_ptr<remote_segment_cache> cache_;
  asio::ip::tcp::acceptor acceptor_;
  std::string local_address_;
  std::atomic<std::uint64_t> next_op_{1};
  std::atomic<bool> announce_pending_{false};
  // strand-only
  std::unordered_map<std::uint64_t, std::shared_ptr<peer_state>> peers_;
  std::uint64_t next_peer_ = 1;
  std::unordered_map<std::uint64_t, std::unique_ptr<transfer_op>> ops_;
  std::vector<std::weak_ptr<typename Transport::server_type>> servers_;
  std::vector<std::shared_ptr<control_channel>> sessions_;
  std::unordered_map<segment_id, std::size_t> pins_;
  std::multimap<segment_id, plain_handler> unpin_waiters_;
  struct notify_waiter {
    std::uint64_t id;
    notification_handler handler;
    asio::cancellation_slot slot;
  };
  static constexpr std::size_t max_queued_notifications = 1u << 16;
  std::deque<notification> received_;
  std::deque<notify_waiter> notify_waiters_;
  bool shut_ = false;
  std::shared_ptr<detail::fabric> fabric_;
};

}  // namespace detail

/// The engine. `Transport` picks the data path (tcp_transport); `Executor`
/// is the caller's executor, on which completion handlers run by default.
template <class Transport, class Executor>
class basic_engine {
  static_assert(transport<Transport>);

 public:
  using executor_type = Executor;

  /// Binds and starts listening on cfg.listen. Throws std::system_error
  /// (invalid config, address in use) with the reason in what().
  explicit basic_engine(const executor_type& ex, config cfg = {})
      : ex_(ex),
        core_(std::make_shared<detail::engine_core<Transport>>(asio::any_io_executor(ex),
                                                               std::move(cfg))) {
    core_->start();
  }

  ~basic_engine() {
    if (core_) core_->shutdown();
  }

  basic_engine(const basic_engine&) = delete;
  basic_engine& operator=(const basic_engine&) = delete;
  basic_engine(basic_engine&&) noexcept = default;
  basic_engine& operator=(basic_engine&&) = delete;

  executor_type get_executor() const noexcept { return ex_; }

  /// host:port peers connect to (the real port when config.listen asked for 0).
  const std::string& local_address() const noexcept { return core_->local_address(); }
  /// This run's instance id (a restarted engine gets a new one).
  instance_id instance() const noexcept { return core_->self(); }
  const config& get_config() const noexcept { return core_->cfg(); }

  /// Registers [base, base + length) so that peers may access it as `granted`
  /// allows, and so that it can be the local side of transfers. Connected
  /// peers learn of it through their control channel. Errors:
  /// invalid_argument (null, zero length), overlapping_registration.
  segment_id register_segment(void* base, std::uint64_t length, access granted,
                              std::error_code& ec) {
    return core_->register_segment(base, length, granted, ec);
  }
  /// As above; throws std::system_error.
  segment_id register_segment(void* base, std::uint64_t length,
                              access granted = access::remote_read_write) {
    std::error_code ec;
    std::string what;
    const auto id = core_->register_segment(base, length, granted, ec, &what);
    if (ec) {
      throw std::system_error(ec, fmt::format("kvlink: register_segment({}, {} bytes){}{}", base,
                                              length, what.empty() ? "" : ": ", what));
    }
    return id;
  }

  /// As register_segment(), run off the caller's executor (an RDMA engine
  /// pins the memory with every device, in parallel, which takes a while for
  /// gigabytes). Signature: void(std::error_code, segment_id).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_register_segment(void* base, std::uint64_t length, access granted,
                              Token&& token = asio::default_completion_token_t<executor_type>{}) {
    return asio::async_initiate<Token, void(std::error_code, segment_id)>(
        [this](auto handler, void* b, std::uint64_t len, access a) {
          core_->register_segment_async(
              b, len, a,
              detail::erased_handler<void(std::error_code, segment_id)>(std::move(handler), ex_));
        },
        token, base, length, granted);
  }

  /// Which data transports this engine offers peers: "tcp", or "rdma,tcp"
  /// when it has a usable RDMA device; with the reason when an RDMA engine
  /// found none ("tcp (rdma: no RDMA devices)").
  std::string transports() const {
    const auto* f = core_->fabric();
    if (!f) return "tcp";
    if (f->available()) return fmt::format("{},tcp", f->name());
    return fmt::format("tcp ({}: {})", f->name(), f->unavailable_reason());
  }

  /// Unregisters a segment. Completes, with signature void(std::error_code),
  /// once no peer's frame touches the segment any more: then its memory may
  /// be freed. New frames for it are refused from the moment it is called.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_unregister_segment(segment_id id,
                                Token&& token = asio::default_completion_token_t<executor_type>{}) {
    return asio::async_initiate<Token, void(std::error_code)>(
        [this](auto handler, segment_id sid) {
          core_->unregister_segment(
              sid, detail::erased_handler<void(std::error_code)>(std::move(handler), ex_));
        },
        token, id);
  }

  /// Connects to a peer's engine at "host:port" and performs the handshake.
  /// Signature: void(std::error_code, peer). Errors: peer_unreachable,
  /// protocol_version_mismatch, malformed_message, instance_changed.
  /// Connecting again to a live peer returns the same handle.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_connect(std::string address,
                     Token&& token = asio::default_completion_token_t<executor_type>{}) {
    return asio::async_initiate<Token, void(std::error_code, peer)>(
        [this](auto handler, std::string addr) {
          core_->connect(std::move(addr), detail::erased_handler<void(std::error_code, peer)>(
                                              std::move(handler), ex_));
        },
        token, std::move(address));
  }

  /// Moves a batch of requests. Signature: void(std::error_code,
  /// transfer_result). See the top of this file for what completion means.
  /// Errors: not_registered, out_of_bounds, access_denied (local or remote),
  /// invalid_argument, unknown_peer, peer_closed, deadline_exceeded,
  /// cancelled, malformed_message.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_submit_transfer(std::span<const transfer_request> requests, transfer_options options,
                             Token&& token = asio::default_completion_token_t<executor_type>{}) {
    return asio::async_initiate<Token, void(std::error_code, transfer_result)>(
        [this](auto handler, std::vector<transfer_request> reqs, transfer_options opts) {
          auto slot = asio::get_associated_cancellation_slot(handler);
          const auto id = core_->next_op_id();
          if (slot.is_connected()) {
            slot.assign([w = std::weak_ptr(core_), id](asio::cancellation_type type) {
              if ((type & (asio::cancellation_type::terminal | asio::cancellation_type::partial)) ==
                  asio::cancellation_type::none) {
                return;
              }
              if (auto c = w.lock()) c->cancel(id);
            });
          }
          core_->submit(id, std::move(reqs), opts,
                        detail::erased_handler<void(std::error_code, transfer_result)>(
                            std::move(handler), ex_),
                        slot);
        },
        token, std::vector<transfer_request>(requests.begin(), requests.end()), options);
  }

  /// Sends a standalone notification to `to` over its control channel.
  /// Signature: void(std::error_code); completes once the message is handed
  /// to the kernel. Errors: message_too_large (id + payload above
  /// config.max_notification), peer_closed, unknown_peer (empty handle).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_send_notification(const peer& to, notification n,
                               Token&& token = asio::default_completion_token_t<executor_type>{}) {
    return asio::async_initiate<Token, void(std::error_code)>(
        [this](auto handler, std::shared_ptr<detail::peer_state> p, notification msg) {
          detail::erased_handler<void(std::error_code)> h(std::move(handler), ex_);
          if (!p) {
            asio::post(core_->strand(),
                       [h = std::move(h)]() mutable { h.complete(errc::unknown_peer); });
            return;
          }
          core_->send_notification(std::move(p), std::move(msg), std::move(h));
        },
        token, to.state_, std::move(n));
  }

  /// Waits for the next notification from any peer (in arrival order; those
  /// that arrive while nobody waits are queued). Signature:
  /// void(std::error_code, notification). Cancellable (errc::cancelled);
  /// completes with errc::cancelled when the engine shuts down.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_receive_notification(
      Token&& token = asio::default_completion_token_t<executor_type>{}) {
    return asio::async_initiate<Token, void(std::error_code, notification)>(
        [this](auto handler) {
          auto slot = asio::get_associated_cancellation_slot(handler);
          const auto id = core_->next_op_id();
          if (slot.is_connected()) {
            slot.assign([w = std::weak_ptr(core_), id](asio::cancellation_type) {
              if (auto c = w.lock()) c->cancel_receive(id);
            });
          }
          core_->receive_notification(
              id,
              detail::erased_handler<void(std::error_code, notification)>(std::move(handler), ex_),
              slot);
        },
        token);
  }

  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_submit_transfer(std::span<const transfer_request> requests,
                             Token&& token = asio::default_completion_token_t<executor_type>{}) {
    return async_submit_transfer(requests, transfer_options{}, std::forward<Token>(token));
  }

 private:
  executor_type ex_;
  std::shared_ptr<detail::engine_core<Transport>> core_;
};

/// The engine over TCP, on any executor.
using tcp_engine = basic_engine<tcp_transport>;

}  // namespace kvlink
