// The engine's state: its config, strand, registry of local segments, the
// run-time set of transports, the metadata backend, the listener, the
// peers, the transfers and the notification inbox, and how they meet:
// registration (and the pins that make unregistration wait), connecting to
// a peer (resolve, handshake, choose a transport, make its data path), the
// control messages both ways, and shutdown.
//
// Shared (std::shared_ptr) so that pending handlers keep it alive after the
// engine object is gone. Members marked strand-only are touched only on the
// strand; the public shell (engine.hpp) posts there.
#pragma once

#include <kvlink/control/channel.hpp>
#include <kvlink/control/descriptor.hpp>
#include <kvlink/control/handshake.hpp>
#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/detail/decl.hpp>
#include <kvlink/detail/erased_handler.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/engine/config.hpp>
#include <kvlink/engine/listener.hpp>
#include <kvlink/engine/notify.hpp>
#include <kvlink/engine/peer.hpp>
#include <kvlink/engine/transfer.hpp>
#include <kvlink/engine/transports.hpp>
#include <kvlink/metadata/backend.hpp>
#include <kvlink/metadata/config.hpp>
#include <kvlink/metadata/etcd.hpp>
#include <kvlink/metadata/http.hpp>
#include <kvlink/metadata/http_client.hpp>
#include <kvlink/metadata/p2p.hpp>
#include <kvlink/transport/set.hpp>
#include <kvlink/transport/transport.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/defer.hpp>
#include <asio/detached.hpp>
#include <asio/dispatch.hpp>
#include <asio/execution/outstanding_work.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/prefer.hpp>
#include <asio/steady_timer.hpp>
#include <asio/strand.hpp>
#include <asio/use_awaitable.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvlink::detail {

// A started etcd or HTTP metadata backend (ec and what say why not).
// Defined in <kvlink/engine/backends.hpp>, which <kvlink/engine.hpp>
// includes (or <kvlink/separate.hpp>, with KVLINK_SEPARATE_COMPILATION).
KVLINK_DECL std::shared_ptr<metadata_backend> start_etcd_metadata(
    asio::any_io_executor ex, etcd_metadata::options o, const control::peer_descriptor& self,
    std::error_code& ec, std::string& what);
KVLINK_DECL std::shared_ptr<metadata_backend> start_http_metadata(
    asio::any_io_executor ex, http_metadata::options o, const control::peer_descriptor& self,
    std::error_code& ec, std::string& what);

class engine_core final : public transport_host,
                          public connection_owner,
                          public std::enable_shared_from_this<engine_core> {
 public:
  using strand_type = asio::strand<asio::any_io_executor>;
  using transfer_handler = erased_handler<void(std::error_code, transfer_result)>;
  using connect_handler = erased_handler<void(std::error_code, peer)>;
  using plain_handler = erased_handler<void(std::error_code)>;
  using register_handler = erased_handler<void(std::error_code, segment_id)>;
  using notification_handler = erased_handler<void(std::error_code, notification)>;

  /// Validates `cfg`, binds the listener and makes the transports
  /// (`default_transports` when cfg.transports is empty). Throws
  /// std::system_error with the reason.
  engine_core(asio::any_io_executor ex, config cfg, std::string_view default_transports)
      : strand_(asio::make_strand(ex)),
        cfg_(checked(std::move(cfg))),
        self_(make_instance_id()),
        cache_(std::make_shared<remote_segment_cache>()),
        guard_(load_secret(cfg_)),
        listener_(strand_, cfg_.listen,
                  listener::limits{cfg_.handshake_timeout,
                                   {cfg_.tcp.nodelay, cfg_.tcp.socket_buffer},
                                   cfg_.max_connections,
                                   cfg_.max_connections_per_address}),
        control_budget_(std::make_shared<control::byte_budget>(cfg_.max_control_buffer)) {
    server_auth_ = control::server_auth{
        &guard_, self_, [this](const std::string& id) -> std::optional<control::digest> {
          const auto it = session_keys_.find(id);
          if (it == session_keys_.end()) return std::nullopt;
          return it->second;
        }};
    transport_env env{asio::any_io_executor(strand_),
                      this,
                      &registry_,
                      self_,
                      cfg_.connect_timeout,
                      cfg_.max_control_message,
                      &guard_,
                      strand_.get_inner_executor()};
    // The transports live no longer than the engine.
    env.session_send = [this](const void* session, std::string_view name, nlohmann::json body) {
      for (const auto& s : sessions_) {
        if (s.get() != session || s->closed()) continue;
        s->send(control::make_transport_message(name, std::move(body)));
        return true;
      }
      return false;
    };
    env.session_close = [this](const void* session, std::error_code why) {
      for (const auto& s : sessions_) {
        if (s.get() == session) s->close(why);
      }
    };
    std::string what;
    {
      // The device runtime (config.device) and its staging: one pool for
      // our transfers, one for serving peers' accesses (so the two sides
      // never wait for each other's chunks).
      std::error_code dec;
      device_ = device_catalog::global().select(cfg_.device, dec, what);
      if (dec) throw std::system_error(dec, "kvlink: " + what);
      if (device_) {
        const auto chunk = cfg_.device.staging_chunk != 0
                               ? cfg_.device.staging_chunk
                               : cfg_.slice_size + (cfg_.min_chunk > 0 ? cfg_.min_chunk - 1 : 0);
        const auto half = std::max<std::uint64_t>(cfg_.device.staging_bytes / 2, 2 * chunk);
        staging_ =
            std::make_shared<staging_pool>(device_, strand_.get_inner_executor(), chunk, half);
        target_staging_ =
            std::make_shared<staging_pool>(device_, strand_.get_inner_executor(), chunk, half);
        env.device = device_;
        env.target_staging = target_staging_;
        env.staging = staging_;
      }
    }
    std::vector<std::shared_ptr<transport>> made;
    const std::string wanted =
        cfg_.transports.empty() ? std::string(default_transports) : cfg_.transports;
    if (auto ec = transport_catalog::global().make(wanted, env, cfg_, made, what)) {
      throw std::system_error(ec, "kvlink: " + what);
    }
    set_ = transport_set(std::move(made), cfg_.allow_tcp_fallback);
    std::string why;
    if (!set_.usable(why)) {
      const bool refused_tcp = !cfg_.allow_tcp_fallback && set_.find("tcp") != nullptr;
      throw std::system_error(
          make_error_code(errc::no_device),
          fmt::format("kvlink: no usable transport ({}){}", why,
                      refused_tcp ? " and config.allow_tcp_fallback is false" : ""));
    }
    advertised_ = advertised_address();
    if (!guard_.enabled()) {
      std::string_view host;
      std::uint16_t port = 0;
      split_host_port(listen_address(), host, port);
      std::error_code aec;
      const auto a = asio::ip::make_address(std::string(host), aec);
      if (aec || !a.is_loopback()) {
        log("listening on {} without authentication: any process that reaches it can read and "
            "write every registered segment (set config.auth_secret, auth_secret_file or "
            "KVLINK_AUTH_SECRET on every engine)",
            listen_address());
      }
    }
    transfers_ = std::make_shared<transfers>(
        strand_,
        transfers::settings{plan_policy{cfg_.slice_size, cfg_.min_chunk, cfg_.alignment},
                            cfg_.transfer_deadline, cfg_.fence_timeout, cfg_.max_notification,
                            cfg_.checksums},
        registry_, cache_, [this](peer_id id) { return find_peer(id); }, *this, staging_,
        [this](std::int32_t device) { return staging_segment(device); });
    name_ = cfg_.name.empty() ? advertised_ : cfg_.name;
    metadata_ = make_metadata();
  }

  /// Starts the transports, the listener and the metadata backend (once).
  void start() {
    for (const auto& t : set_.all()) {
      if (t->available()) t->start();
    }
    listener_.start(shared_from_this());
    metadata_->watch([w = weak_from_this()](const metadata_event& e) {
      if (auto self = w.lock()) self->on_metadata_event(e);
    });
    metadata_->publish(descriptor());
  }

  const config& cfg() const noexcept { return cfg_; }
  /// The address peers are told (descriptor, hellos): config.advertise, or
  /// the listen address, or for a wildcard one the first interface's.
  const std::string& local_address() const noexcept { return advertised_; }
  /// The address the listener is bound to.
  const std::string& listen_address() const noexcept { return listener_.local_address(); }
  const instance_id& self() const noexcept { return self_; }
  /// What peers call this engine: config.name, or its advertised address.
  const std::string& name() const noexcept { return name_; }
  strand_type& strand() noexcept { return strand_; }
  std::string offer() const { return set_.offer(); }
  std::uint64_t next_op_id() noexcept { return transfers_->next_id(); }

  // ------------------------------------------------------------ registration

  /// Any thread.
  segment_id register_segment(const void* base, std::uint64_t length, access granted,
                              memory_desc memory, std::error_code& ec,
                              std::string* what = nullptr) {
    std::string why;
    if (auto dec = classify(base, length, memory, why)) {
      ec = dec;
      if (what) *what = std::move(why);
      return {};
    }
    // Device memory no transport reaches is staged (memory/staging.hpp).
    if (!(memory.kind == memory_kind::device && device_) && !set_.reaches(memory.kind, why)) {
      ec = errc::invalid_argument;
      if (what) *what = std::move(why);
      return {};
    }
    const auto id = registry_.add(base, length, granted, ec, memory);
    if (ec) return id;
    const auto seg = *registry_.get(id);
    std::vector<transport*> done;
    for (const auto& t : set_.all()) {
      if (!t->available() || !t->reaches().contains(memory.kind)) continue;
      std::string call;
      if (auto rec = t->register_memory(seg, call)) {
        for (auto* d : done) d->unregister_memory(id);
        (void)registry_.remove(id);
        ec = rec;
        if (what) *what = std::move(call);
        return segment_id{};
      }
      done.push_back(t.get());
    }
    announce_segments();
    return id;
  }

  /// Strand-only: device `device`'s staging region as a local segment that
  /// peers may not access, for transports that need local memory
  /// registered (RDMA); 0 when none of ours does, or it failed.
  std::uint64_t staging_segment(std::int32_t device) {
    if (set_.find("rdma") == nullptr || !staging_) return 0;
    auto [it, fresh] = staging_segments_.try_emplace(device, 0);
    if (!fresh) return it->second;
    std::string what;
    if (staging_->prepare(device, what)) return 0;
    const auto [base, length] = staging_->region(device);
    std::error_code ec;
    const auto id = register_segment(base, length, access::none, memory_desc{}, ec, &what);
    if (ec)
      log("staging for device {} not registered ({}): device slices over RDMA fail", device, what);
    it->second = id.value();
    return it->second;
  }

  /// This engine's registered segments (thread-safe lookups).
  const segment_registry& registry() const noexcept { return registry_; }

  /// The engine's device runtime (null: none).
  const std::shared_ptr<device_runtime>& device() const noexcept { return device_; }

  /// What the memory at `base` is: host memory stays host unless the device
  /// runtime says it is device memory; device memory must lie inside one
  /// allocation; memory stated as device needs a runtime that agrees.
  std::error_code classify(const void* base, std::uint64_t length, memory_desc& memory,
                           std::string& why) const {
    if (!device_) {
      if (memory.kind == memory_kind::device) {
        why = fmt::format(
            "{} is stated to be device memory, but this engine has no device runtime "
            "(config.device is '{}'; set it to cuda or emulated)",
            base, cfg_.device.runtime);
        return errc::invalid_argument;
      }
      return {};
    }
    const auto info = device_->classify(base);
    if (info.memory.kind != memory_kind::device) {
      if (memory.kind == memory_kind::device) {
        why = fmt::format("{} is stated to be device memory, but the {} runtime says it is not",
                          base, device_->name());
        return errc::invalid_argument;
      }
      return {};
    }
    const auto addr = reinterpret_cast<std::uintptr_t>(base);
    if (length > info.size - (addr - info.base)) {
      why = fmt::format(
          "[{}, +{}) runs past the end of its device allocation ({:#x}, {} bytes): register "
          "ranges inside one allocation",
          base, length, info.base, info.size);
      return errc::invalid_argument;
    }
    memory = info.memory;
    return {};
  }

  /// Registration off the caller's executor: pinning gigabytes with every
  /// device takes a while. One short-lived thread per call.
  void register_segment_async(void* base, std::uint64_t length, access granted, memory_desc memory,
                              register_handler h) {
    std::thread([self = shared_from_this(), base, length, granted, memory,
                 h = std::move(h)]() mutable {
      std::error_code ec;
      const auto id = self->register_segment(base, length, granted, memory, ec);
      h.complete(ec, id);
    }).detach();
  }

  /// Completes once nothing touches the segment's memory any more:
  /// - new accesses are refused from now on (it leaves the registry);
  /// - our transfers that use it as local memory stop (not_registered) and
  ///   are waited for, under the fence rule;
  /// - peers' accesses in progress are waited for, at most fence_timeout;
  ///   then the transports close what still holds the segment
  ///   (transport::revoke).
  void unregister_segment(segment_id id, plain_handler h) {
    asio::post(strand_, [self = shared_from_this(), id, h = std::move(h)]() mutable {
      if (auto ec = self->registry_.remove(id)) {
        h.complete(ec);
        return;
      }
      self->transfers_->stop_using(id, errc::not_registered);
      // After deregistration no device touches the memory.
      for (const auto& t : self->set_.all()) {
        if (t->available()) t->unregister_memory(id);
      }
      self->publish_descriptor();
      // Pins taken from now on are refused (the registry no longer holds
      // it; pin() checks under pins_mutex_), so the count only goes down.
      if (self->pin_count(id) == 0) {
        self->forget_pins(id);
        h.complete({});
        return;
      }
      self->unpin_waiters_.emplace(id, std::move(h));
      self->waiting(1);
      // The last unpin may have run on another strand in between (before
      // it could see the waiter).
      self->release_unpin_waiters(id);
      if (!self->unpin_waiters_.contains(id)) return;
      auto timer = std::make_shared<asio::steady_timer>(self->strand_, self->cfg_.fence_timeout);
      timer->async_wait([w = self->weak_from_this(), id, timer](std::error_code ec) {
        auto me = w.lock();
        if (ec || !me || !me->unpin_waiters_.contains(id)) return;
        // A peer that stopped reading holds it: close what it holds.
        for (const auto& t : me->set_.all()) {
          if (t->available()) t->revoke(id);
        }
      });
    });
  }

  // ------------------------------------------------------------ peers

  void connect(std::string name, connect_handler h) {
    asio::co_spawn(strand_, connect_impl(shared_from_this(), std::move(name), std::move(h)),
                   asio::detached);
  }

  // ------------------------------------------------------------ transfers

  void submit(std::uint64_t id, std::vector<transfer_request> reqs, transfer_options opts,
              transfer_handler h, asio::cancellation_slot slot) {
    // A start that could not run right here and then ran on another thread
    // means threads take turns in the strand: the next submits defer,
    // queued behind the running handler on this thread, so that several
    // starts run in one pass through the strand instead of two threads
    // taking turns in it for each. A start queued behind work of this same
    // thread (several transfers in flight on one thread) does not count.
    const auto busy = busy_submits_.load(std::memory_order_relaxed);
    auto run = [self = shared_from_this(), id, reqs = std::move(reqs), opts = std::move(opts),
                h = std::move(h), slot, from = &thread_mark]() mutable {
      if (from != &thread_mark) {  // queued, and run by another thread
        self->busy_submits_.store(busy_defers, std::memory_order_relaxed);
      }
      self->transfers_->start(id, std::move(reqs), std::move(opts), std::move(h), slot);
    };
    if (busy > 0) {
      busy_submits_.store(busy - 1, std::memory_order_relaxed);
      asio::defer(strand_, std::move(run));
      return;
    }
    // dispatch: from a thread running the engine's io_context while the
    // strand is idle (the usual case: a handler that submits the next
    // transfer), the transfer starts right here, inside the strand, without
    // a hand-off; otherwise it queues behind what the strand already holds.
    asio::dispatch(strand_, std::move(run));
  }

  void cancel(std::uint64_t id) {
    asio::post(strand_, [self = shared_from_this(), id] { self->transfers_->cancel(id); });
  }

  // ------------------------------------------------------------ notifications

  void send_notification(std::shared_ptr<peer_state> p, notification n, plain_handler h) {
    asio::post(strand_, [self = shared_from_this(), p = std::move(p), n = std::move(n),
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
    asio::post(strand_, [self = shared_from_this(), id, h = std::move(h), slot]() mutable {
      self->inbox_.receive(id, std::move(h), slot);
    });
  }

  void cancel_receive(std::uint64_t id) {
    asio::post(strand_, [self = shared_from_this(), id] { self->inbox_.cancel(id); });
  }

  // ------------------------------------------------------------ lifecycle

  /// Closes everything, on the strand, and returns once that has run (see
  /// engine.hpp, "Thread safety", for when each path below is taken).
  void close() {
    auto* ioc = io_context_of(strand_.get_inner_executor());
    if (ioc == nullptr && strand_.running_in_this_thread()) {
      // Inside one of the engine's handlers on another kind of executor:
      // it cannot wait here; connections close on their strands
      // (engine::async_close says when that is over).
      shutdown();
      return;
    }
    if (ioc != nullptr && (ioc->stopped() || ioc->get_executor().running_in_this_thread())) {
      // Nobody runs the io_context (stopped), or this thread is the one
      // running it, inside another handler (one thread: nobody else can be
      // in the engine's handlers now; a pool must close on the strand,
      // engine::async_close): connections close right here.
      shutdown_inline();
      return;
    }
    auto state = std::make_shared<close_state>();
    asio::post(strand_, [self = shared_from_this(), state] {
      self->shutdown();
      self->when_closed([state] { state->set(); });
    });
    if (ioc == nullptr) {
      state->wait();  // a thread pool or another executor runs it
      return;
    }
    // This thread is not running the io_context: maybe nobody is (a test
    // driving it by hand), so run it until the shutdown has run.
    while (!state->done()) {
      if (ioc->stopped()) {
        shutdown_inline();  // idempotent: the posted one then does nothing
        return;
      }
      ioc->run_one_for(std::chrono::milliseconds(1));
    }
  }

  /// Closes everything. Strand-only (or with no handler of the engine able
  /// to run, see close()); idempotent.
  void shutdown() {
    if (shut_.exchange(true)) return;
    listener_.close();
    auto peers = peers_;
    for (auto& [pid, p] : peers) peer_failed(p, errc::cancelled);
    auto sessions = std::move(sessions_);
    sessions_.clear();
    for (auto& s : sessions) s->close(errc::cancelled);
    for (const auto& t : set_.all()) t->shutdown();
    inbox_.close();
    metadata_->withdraw([w = weak_from_this()] {
      if (auto self = w.lock()) self->withdrawn();
    });
  }

  /// shutdown() where no handler of the engine can run concurrently (see
  /// close()): connections on other strands are closed from here too.
  void shutdown_inline() {
    auto& flag = detail::closing_inline();
    const bool was = flag;
    flag = true;
    shutdown();
    flag = was;
  }

  /// Runs `fn` once the metadata backend has withdrawn this engine (at
  /// once with p2p; a store is told within a short bound). Strand-only,
  /// after shutdown().
  void when_withdrawn(std::function<void()> fn) {
    if (withdrawn_) {
      fn();
      return;
    }
    withdraw_waiters_.push_back(std::move(fn));
  }

  /// Runs `fn` once closing is over: the store withdrawn, and nothing
  /// touches registered memory any more (no pin left: the connections that
  /// run on strands of their own have closed, every transfer completed).
  /// Strand-only, after shutdown().
  void when_closed(std::function<void()> fn) {
    when_withdrawn([w = weak_from_this(), fn = std::move(fn)]() mutable {
      auto self = w.lock();
      if (!self || self->pins_total() == 0) {
        fn();
        return;
      }
      self->close_waiters_.push_back(std::move(fn));
      self->waiting(1);
      self->release_unpin_waiters(segment_id{});  // the last unpin may have run in between
    });
  }

  /// Finds a peer by name through the metadata backend (no connection).
  void resolve(std::string name, std::function<void(std::error_code, resolved_peer)> h) {
    asio::post(strand_,
               [self = shared_from_this(), name = std::move(name), h = std::move(h)]() mutable {
                 if (self->shut_) {
                   h(errc::cancelled, resolved_peer{});
                   return;
                 }
                 self->metadata_->resolve(std::move(name), std::move(h));
               });
  }

  // ------------------------------------------------------------ transport_host

  void slice_done(transfer_op* op, std::uint64_t bytes, std::error_code ec) override {
    transfers_->slice_done(op, bytes, ec);
  }

  void slices_done(std::span<const slice_report> done) override { transfers_->slices_done(done); }

  bool stopping(const transfer_op* op) const noexcept override { return transfers::stopping(op); }

  // Pins come from the engine's strand (local segments of transfers) and
  // from the transports' strands (a peer's access being served): a mutex,
  // held for a map update. A pin is refused once the segment left the
  // registry, which unregister_segment() does before it counts the pins.
  // A segment's count stays in pins_ at zero while it is registered (no
  // allocation per transfer); unregistering it lets it go (forget_pins).
  bool pin(segment_id id) override {
    std::lock_guard lock{pins_mutex_};
    if (!registry_.contains(id)) return false;
    if (pins_[id]++ == 0) ++pinned_segments_;
    return true;
  }

  // The last unpin of a segment wakes the engine's strand only when an
  // unregistration or a close waits: a target serving frames unpins after
  // almost every one, from its lanes' strands. waiting_ and the counts share
  // the mutex, so a waiter added after the check re-checks the counts itself.
  void unpin(segment_id id) override {
    {
      std::lock_guard lock{pins_mutex_};
      auto it = pins_.find(id);
      if (it == pins_.end() || it->second == 0) return;
      if (--it->second > 0) return;
      --pinned_segments_;
      if (waiting_ == 0) return;
    }
    if (strand_.running_in_this_thread()) {
      release_unpin_waiters(id);
      return;
    }
    asio::post(strand_, [w = weak_from_this(), id] {
      if (auto self = w.lock()) self->release_unpin_waiters(id);
    });
  }

  std::shared_ptr<transport_host> keep_alive() override {
    return std::shared_ptr<transport_host>(shared_from_this(), static_cast<transport_host*>(this));
  }

  // Strand-only: counts waiters in or out (unpin reads the count).
  void waiting(std::ptrdiff_t n) {
    std::lock_guard lock{pins_mutex_};
    waiting_ = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(waiting_) + n);
  }

  std::size_t pins_total() const {
    std::lock_guard lock{pins_mutex_};
    return pinned_segments_;
  }

  // An unregistered segment's count, once at zero (it stays there: pin()
  // refuses it).
  void forget_pins(segment_id id) {
    std::lock_guard lock{pins_mutex_};
    if (const auto it = pins_.find(id); it != pins_.end() && it->second == 0) pins_.erase(it);
  }

  std::size_t pin_count(segment_id id) const {
    std::lock_guard lock{pins_mutex_};
    const auto it = pins_.find(id);
    return it == pins_.end() ? 0 : it->second;
  }

  // Strand-only: completes the unregistrations of `id` once no pin is left,
  // and a close once no pin at all is left.
  void release_unpin_waiters(segment_id id) {
    if (!close_waiters_.empty() && pins_total() == 0) {
      // In a handler of their own that holds the engine: the caller (a
      // transfer completing) still runs after this, and a closed engine may
      // be destroyed by the thread that waited for it.
      auto waiters = std::move(close_waiters_);
      close_waiters_.clear();
      waiting(-static_cast<std::ptrdiff_t>(waiters.size()));
      asio::post(strand_, [self = shared_from_this(), waiters = std::move(waiters)] {
        for (const auto& fn : waiters) fn();
      });
    }
    if (pin_count(id) != 0) return;
    auto [first, last] = unpin_waiters_.equal_range(id);
    if (first != last) forget_pins(id);  // an unregistration waited for it
    std::vector<plain_handler> ready;
    for (auto w = first; w != last; ++w) ready.push_back(std::move(w->second));
    unpin_waiters_.erase(first, last);
    waiting(-static_cast<std::ptrdiff_t>(ready.size()));
    for (auto& h : ready) h.complete({});
  }

  // ------------------------------------------------------------ connection_owner

  const control::server_auth& server_auth() const override { return server_auth_; }

  std::error_code admit(const control::hello& h, const control::session_keys& session,
                        nlohmann::json& answer) override {
    if (shut_) return errc::peer_closed;
    if (h.r == control::role::store) return errc::invalid_argument;  // not a store master
    if (h.r == control::role::control) {
      const auto d = descriptor();
      answer = control::make_welcome(d);
      if (!session.session.empty()) answer["session"] = session.session;
      return {};
    }
    if (h.expect && *h.expect != self_) return errc::instance_changed;
    const auto* t = set_.find(h.transport);
    if (t == nullptr || !t->available()) return errc::transport_unavailable;
    answer = control::make_welcome(self_);
    return {};
  }

  void adopt(asio::ip::tcp::socket socket, control::hello h, control::session_keys session,
             std::shared_ptr<void> lease) override {
    if (shut_) return;
    if (h.r == control::role::lane) {
      if (auto* t = set_.find(h.transport)) t->accept_lane(std::move(socket), h, std::move(lease));
      return;
    }
    start_session(std::move(socket), std::move(h), std::move(session), std::move(lease));
  }

 private:
  struct close_state {
    std::mutex m;
    std::condition_variable cv;
    bool finished = false;
    void set() {
      std::lock_guard lock{m};
      finished = true;
      cv.notify_all();
    }
    bool done() {
      std::lock_guard lock{m};
      return finished;
    }
    void wait() {
      std::unique_lock lock{m};
      cv.wait(lock, [this] { return finished; });
    }
  };

  // The io_context behind an executor, if it is one.
  static asio::io_context* io_context_of(const asio::any_io_executor& ex) {
    using plain = asio::io_context::executor_type;
    using tracked =
        decltype(asio::prefer(std::declval<plain>(), asio::execution::outstanding_work.tracked));
    if (const auto* e = ex.target<plain>()) return &e->context();
    if (const auto* e = ex.target<tracked>()) return &e->context();
    return nullptr;
  }

  std::string advertised_address() const {
    const auto& bound = listener_.local_address();
    std::string_view host, bhost;
    std::uint16_t port = 0, bport = 0;
    split_host_port(bound, bhost, bport);
    if (!cfg_.advertise.empty() && split_host_port(cfg_.advertise, host, port)) {
      return join_host_port(host, port == 0 ? bport : port);
    }
    if (!is_unspecified_host(bhost)) return bound;
    auto ip = first_interface_address();
    const bool found = !ip.empty();
    if (!found) ip = "127.0.0.1";
    auto out = join_host_port(ip, bport);
    log("listening on {}; peers are told {} ({}; set config.advertise to choose)", bound, out,
        found ? "the first non-loopback interface" : "no interface is up but loopback");
    return out;
  }

  // The shared secret from the config, a file, or nothing.
  static control::peer_guard load_secret(const config& cfg) {
    if (!cfg.auth_secret.empty()) return control::peer_guard(cfg.auth_secret);
    if (cfg.auth_secret_file.empty()) return {};
    std::ifstream in(cfg.auth_secret_file, std::ios::binary);
    std::string secret((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
    if (!in.good() && !in.eof()) secret.clear();
    if (secret.empty()) {
      throw std::system_error(
          make_error_code(errc::invalid_argument),
          fmt::format("kvlink: auth_secret_file '{}' cannot be read or is empty",
                      cfg.auth_secret_file));
    }
    return control::peer_guard(std::move(secret));
  }

  static config checked(config cfg) {
    std::string what;
    if (auto ec = validate(cfg, &what)) {
      throw std::system_error(ec, fmt::format("kvlink: invalid config: {}", what));
    }
    return cfg;
  }

  std::shared_ptr<peer_state> find_peer(peer_id id) const {
    auto it = peers_.find(id.value());
    return it == peers_.end() ? nullptr : it->second;
  }

  void peer_failed(const std::shared_ptr<peer_state>& p, std::error_code ec) {
    if (!p->alive.exchange(false)) return;
    p->failure = ec;
    if (p->path) p->path->fail(ec);
    if (p->control) p->control->close(ec);
    forget_seq(p->instance);
  }

  // Stops following an instance's segment lists once no live peer has it.
  void forget_seq(const instance_id& inst) {
    for (const auto& [pid, q] : peers_) {
      if (q->instance == inst && q->alive.load()) return;
    }
    if (connecting_.contains(inst)) return;
    known_seq_.erase(inst);
  }

  // Registrations come in bursts at start-up (hundreds of regions): one
  // publication, of the whole list as it is when it runs, serves them all.
  void announce_segments() {
    if (announce_pending_.exchange(true)) return;
    asio::post(strand_, [w = weak_from_this()] {
      if (auto self = w.lock()) {
        self->announce_pending_.store(false);
        if (!self->shut_) self->publish_descriptor();
      }
    });
  }

  std::vector<remote_segment_info> local_segments() const {
    std::vector<remote_segment_info> out;
    for (const auto& s : registry_.snapshot()) {
      remote_segment_info r{s.id, static_cast<std::uint64_t>(s.base), s.length, s.granted,
                            nlohmann::json::object()};
      for (const auto& t : set_.all()) {
        if (!t->available()) continue;
        auto key = t->segment_key(s.id);
        if (!key.is_null()) r.keys[std::string(t->name())] = std::move(key);
      }
      out.push_back(std::move(r));
    }
    return out;
  }

  control::peer_descriptor descriptor() const {
    control::peer_descriptor d;
    d.instance = self_;
    d.address = local_address();
    d.name = name_;
    d.seq = publish_seq_;
    d.segments = local_segments();
    for (const auto& t : set_.all()) {
      if (t->available()) d.transports[std::string(t->name())] = t->describe();
    }
    return d;
  }

  // A new publication of this engine's descriptor (strand-only).
  void publish_descriptor() {
    ++publish_seq_;
    metadata_->publish(descriptor());
  }

  void withdrawn() {
    withdrawn_ = true;
    auto waiters = std::move(withdraw_waiters_);
    withdraw_waiters_.clear();
    for (auto& w : waiters) w();
  }

  // The backend config.metadata names. A store is reached (and this engine
  // published in it) before the constructor returns: a store that cannot be
  // reached is an error naming it.
  std::shared_ptr<metadata_backend> make_metadata() {
    auto bcast = [this](const nlohmann::json& m) { broadcast(m); };
    const auto& mc = cfg_.metadata;
    metadata_url u;
    parse_metadata_url(mc.url, u);  // validated with the config
    if (u.type == metadata_url::kind::p2p) {
      return std::make_shared<p2p_metadata>(asio::any_io_executor(strand_), bcast);
    }
    std::shared_ptr<http::tls_context> tls;
    if (u.tls || !mc.tls_ca.empty() || !mc.tls_cert.empty()) {
      if (http::tls_support() == nullptr) {
        throw std::system_error(
            make_error_code(errc::invalid_argument),
            fmt::format("kvlink: metadata store {}: TLS is asked for (https or metadata_tls_*) "
                        "but this program has none: #include <kvlink/metadata/tls.hpp> and link "
                        "kvlink::tls (libssl-dev)",
                        mc.url));
      }
      std::string why;
      tls = http::tls_support()(http::tls_files{mc.tls_ca, mc.tls_cert, mc.tls_key}, why);
      if (!tls) {
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("kvlink: metadata store {}: {}", mc.url, why));
      }
    }
    publish_seq_ = 1;
    const auto mine = descriptor();
    std::string what;
    std::error_code ec;
    std::shared_ptr<metadata_backend> made;
    if (u.type == metadata_url::kind::etcd) {
      etcd_metadata::options o;
      o.url = mc.url;
      o.endpoints = u.endpoints;
      o.prefix = mc.prefix;
      o.self_name = name_;
      o.ttl = mc.lease_ttl;
      o.timeout = mc.timeout;
      o.user = mc.user;
      o.password = load_password(mc);
      o.tls = tls;
      o.guard = guard_;
      o.max_value = cfg_.max_control_message;
      o.broadcast = bcast;
      made = start_etcd_metadata(asio::any_io_executor(strand_), std::move(o), mine, ec, what);
    } else {
      http_metadata::options o;
      o.url = mc.url;
      std::string_view host;
      std::uint16_t port = 0;
      split_host_port(u.endpoints.front(), host, port);
      o.host = std::string(host);
      o.port = port;
      o.path = u.path;
      o.prefix = mc.prefix;
      o.self_name = name_;
      o.ttl = mc.lease_ttl;
      o.poll = mc.poll_interval;
      o.timeout = mc.timeout;
      o.token = mc.token;
      o.tls = tls;
      o.guard = guard_;
      o.max_value = cfg_.max_control_message;
      o.broadcast = bcast;
      made = start_http_metadata(asio::any_io_executor(strand_), std::move(o), mine, ec, what);
    }
    if (ec == errc::metadata_unavailable) {
      throw std::system_error(
          ec, fmt::format("kvlink: metadata store {} unreachable: {}", mc.url, what));
    }
    if (ec) throw std::system_error(ec, fmt::format("kvlink: metadata store {}: {}", mc.url, what));
    return made;
  }

  static std::string load_password(const metadata_config& mc) {
    if (!mc.password.empty() || mc.password_file.empty()) return mc.password;
    std::ifstream in(mc.password_file, std::ios::binary);
    std::string pw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    while (!pw.empty() && (pw.back() == '\n' || pw.back() == '\r')) pw.pop_back();
    if (pw.empty()) {
      throw std::system_error(
          make_error_code(errc::invalid_argument),
          fmt::format("kvlink: metadata_password_file '{}' cannot be read or is empty",
                      mc.password_file));
    }
    return pw;
  }

  // What the metadata backend saw change (strand-only): a name that now
  // holds another instance fails our peers of the old one (instance_changed);
  // a name that went away (withdrawn, or its lease expired) fails them with
  // peer_unreachable; a newer segment list of a peer replaces the cached one.
  void on_metadata_event(const metadata_event& e) {
    if (shut_) return;
    if (e.what == metadata_event::kind::withdrawn) {
      auto peers = peers_;
      for (auto& [pid, p] : peers) {
        if (p->alive.load() && !e.name.empty() && p->name == e.name &&
            (!e.instance.valid() || p->instance == e.instance)) {
          peer_failed(p, errc::peer_unreachable);
        }
      }
      return;
    }
    if (!e.name.empty()) {
      auto peers = peers_;
      for (auto& [pid, p] : peers) {
        if (p->alive.load() && p->name == e.name && p->instance != e.instance) {
          const auto old = p->instance;
          peer_failed(p, errc::instance_changed);
          cache_->drop_instance(old);
        }
      }
    }
    const auto it = known_seq_.find(e.instance);
    if (it == known_seq_.end()) return;             // not a peer of ours
    if (e.seq != 0 && e.seq <= it->second) return;  // older than what we have
    if (e.seq != 0) it->second = e.seq;
    cache_->replace(e.instance, e.segments);
  }

  // A peer made us refuse something: said once per (limit, peer).
  void refused(const std::string& peer, std::string_view limit) {
    if (refusals_logged_.insert(std::string(limit) + " " + peer).second) {
      log("refused {}: {} reached (logged once per peer)", peer.empty() ? "a peer" : peer, limit);
    }
  }

  void broadcast(const nlohmann::json& msg) {
    std::erase_if(sessions_, [](const auto& s) { return s->closed(); });
    for (auto& s : sessions_) s->send(msg);
  }

  // ------------------------------------------------------------ connecting

  static asio::awaitable<void> connect_impl(std::shared_ptr<engine_core> self, std::string name,
                                            connect_handler h) {
    peer result;
    const auto ec = co_await self->do_connect(name, result);
    h.complete(ec, ec ? peer{} : result);
  }

  asio::awaitable<std::error_code> resolve_name(const std::string& name, resolved_peer& out) {
    auto [ec, r] = co_await asio::async_initiate<decltype(control::use_nothrow),
                                                 void(std::error_code, resolved_peer)>(
        [this](auto handler, std::string n) {
          metadata_->resolve(
              std::move(n),
              [h = std::make_shared<decltype(handler)>(std::move(handler))](
                  std::error_code e, resolved_peer rp) mutable { (*h)(e, std::move(rp)); });
        },
        control::use_nothrow, name);
    out = std::move(r);
    co_return ec;
  }

  asio::awaitable<std::error_code> do_connect(const std::string& name, peer& out) {
    if (shut_) co_return errc::cancelled;
    resolved_peer where;
    if (auto ec = co_await resolve_name(name, where)) co_return ec;
    std::string_view host;
    std::uint16_t port = 0;
    if (!split_host_port(where.address, host, port)) co_return errc::invalid_argument;
    asio::ip::tcp::resolver resolver(strand_);
    const std::string host_text(host), port_text = std::to_string(port);
    auto [rec, eps] = co_await resolver.async_resolve(host_text, port_text, control::use_nothrow);
    if (rec || eps.empty()) co_return errc::peer_unreachable;

    asio::ip::tcp::socket control_socket(strand_);
    nlohmann::json welcome;
    control::hello hello;
    hello.instance = self_;
    hello.r = control::role::control;
    hello.address = local_address();
    const control::socket_options options{cfg_.tcp.nodelay, cfg_.tcp.socket_buffer};
    const control::client_auth auth{&guard_, {}, {}};
    control::session_keys session;
    if (auto ec = co_await control::dial(control_socket, eps, cfg_.connect_timeout, options, hello,
                                         cfg_.max_control_message, auth, welcome, &session)) {
      co_return ec;
    }
    control::peer_descriptor desc;
    if (auto ec = control::from_json(welcome.value("descriptor", nlohmann::json{}), desc)) {
      co_return ec;
    }
    // A store only says where a name is; the engine there says (after the
    // authentication) who it is.
    if (metadata_->name() != "p2p" && desc.name != name) {
      log("the metadata store says \"{}\" is at {}, but the engine there is \"{}\" (a stale "
          "entry, or an engine that took over the address)",
          name, where.address, desc.name);
      co_return errc::peer_unreachable;
    }

    // Connections are reused: one live peer per instance.
    for (auto& [pid, p] : peers_) {
      if (p->instance == desc.instance && p->alive.load()) {
        out = peer{p};
        co_return std::error_code{};
      }
    }
    // The same name with another instance: the peer restarted. Drop what
    // we knew of the old one.
    for (auto& [pid, p] : peers_) {
      if (p->name == name && p->instance != desc.instance) {
        peer_failed(p, errc::instance_changed);
        cache_->drop_instance(p->instance);
      }
    }

    // The data transport, per peer: the first of ours both sides can use.
    const auto choice = set_.choose(desc.transports);
    if (!choice.chosen) co_return choice.error;

    std::error_code eec;
    const auto endpoint = control_socket.remote_endpoint(eec);
    if (eec) co_return errc::peer_closed;
    auto p = std::make_shared<peer_state>();
    p->id = peer_id{next_peer_++};
    p->instance = desc.instance;
    p->address = where.address;
    p->name = name;
    p->transport = std::string(choice.chosen->name());
    p->transport_reason = choice.reason;
    p->reaches = choice.chosen->reaches();
    p->carrier = choice.chosen;
    p->cache = cache_;
    cache_->replace(desc.instance, desc.segments);
    // Segment lists that arrive while the data path connects are kept.
    auto& seen = known_seq_[desc.instance];
    seen = std::max(seen, desc.seq);
    connecting_.insert(desc.instance);
    struct connected_guard {
      engine_core* core;
      instance_id inst;
      ~connected_guard() {
        core->connecting_.erase(core->connecting_.find(inst));
        core->forget_seq(inst);
      }
    } done_connecting{this, desc.instance};
    p->control = std::make_shared<control::channel>(std::move(control_socket),
                                                    cfg_.max_control_message, control_budget_);

    std::weak_ptr<peer_state> wp = p;
    std::weak_ptr<control::channel> wc = p->control;
    path_context ctx{desc.instance,
                     desc.transports[p->transport],
                     endpoint,
                     cache_,
                     [wc, name = p->transport](nlohmann::json body) {
                       if (auto c = wc.lock()) {
                         c->send(control::make_transport_message(name, std::move(body)));
                       }
                     },
                     [w = weak_from_this(), wp](std::error_code ec) {
                       auto self = w.lock();
                       auto pp = wp.lock();
                       if (self && pp) self->peer_failed(pp, ec);
                     },
                     std::move(session)};
    std::shared_ptr<data_path> path;
    if (auto ec = co_await choice.chosen->connect(std::move(ctx), path)) {
      p->control->close(ec);
      co_return ec;
    }
    if (shut_) {
      path->fail(errc::cancelled);
      p->control->close(errc::cancelled);
      co_return errc::cancelled;
    }
    if (auto note = path->note(); !note.empty()) p->transport_reason += "; " + note;
    p->path = std::move(path);
    peers_.emplace(p->id.value(), p);
    p->path->start();
    start_control(p);
    out = peer{p};
    co_return std::error_code{};
  }

  void start_control(const std::shared_ptr<peer_state>& p) {
    std::weak_ptr<peer_state> wp = p;
    p->control->start(
        [w = weak_from_this(), wp](const nlohmann::json& msg) {
          auto self = w.lock();
          auto pp = wp.lock();
          if (self && pp) self->on_peer_message(*pp, msg);
        },
        [w = weak_from_this(), wp](std::error_code ec) {
          auto self = w.lock();
          auto pp = wp.lock();
          if (self && pp) self->peer_failed(pp, ec);
        });
  }

  // A message on our connection to a peer: answers for our path, or
  // descriptor updates for the metadata backend.
  void on_peer_message(peer_state& p, const nlohmann::json& msg) {
    if (msg.value("type", std::string{}) == "transport") {
      std::string name;
      const nlohmann::json* body = nullptr;
      if (control::parse_transport_message(msg, name, body) && name == p.transport && p.path) {
        p.path->on_message(*body);
      }
      return;
    }
    metadata_->on_peer_message(p.instance, msg);
    // Unknown message types are ignored: newer peers may send more.
  }

  // ------------------------------------------------------------ sessions

  // A peer's control connection to us: its notifications and its paths'
  // requests to our transports.
  void start_session(asio::ip::tcp::socket socket, control::hello h, control::session_keys keys,
                     std::shared_ptr<void> lease) {
    // A peer listening on a wildcard address is reached at the address it
    // connected from.
    std::string_view host;
    std::uint16_t port = 0;
    if (split_host_port(h.address, host, port) && is_unspecified_host(host)) {
      std::error_code ec;
      const auto from = socket.remote_endpoint(ec);
      if (!ec) h.address = join_host_port(from.address().to_string(), port);
    }
    auto session = std::make_shared<control::channel>(std::move(socket), cfg_.max_control_message,
                                                      control_budget_, std::move(lease));
    std::erase_if(sessions_, [](const auto& x) { return x->closed(); });
    sessions_.push_back(session);
    std::weak_ptr<engine_core> weak = weak_from_this();
    std::weak_ptr<control::channel> wsession = session;
    session->start(
        [weak, wsession, from = h.instance, addr = h.address](const nlohmann::json& m) {
          auto core = weak.lock();
          auto ch = wsession.lock();
          if (core && ch) core->on_session_message(*ch, from, addr, m);
        },
        [weak, key = static_cast<const void*>(session.get()), id = keys.session,
         addr = h.address](std::error_code ec) {
          if (auto core = weak.lock()) {
            if (ec == errc::limit_exceeded) core->refused(addr, "max_control_buffer");
            for (const auto& t : core->set_.all()) t->session_closed(key);
            if (!id.empty()) core->session_keys_.erase(id);  // its lanes are refused from now
          }
        });
    if (!keys.session.empty()) session_keys_[keys.session] = keys.key;
  }

  void on_session_message(control::channel& ch, const instance_id& from, const std::string& addr,
                          const nlohmann::json& m) {
    const auto type = m.value("type", std::string{});
    if (type == "notify") {
      notification n;
      if (control::parse_notify(m, cfg_.max_notification, n.id, n.payload)) {
        ch.close(errc::malformed_message);
        return;
      }
      if (inbox_.full(n.id.size() + n.payload.size(), cfg_.max_notification_bytes)) {
        // Nobody reads them: refuse to buffer without bound.
        refused(addr, "max_notification_bytes");
        ch.close(errc::limit_exceeded);
        return;
      }
      n.from = from;
      n.from_address = addr;
      inbox_.deliver(std::move(n));
      return;
    }
    if (type == "transport") {
      std::string name;
      const nlohmann::json* body = nullptr;
      if (!control::parse_transport_message(m, name, body)) return;
      auto* t = set_.find(name);
      if (t == nullptr || !t->available()) return;
      if (auto reply = t->on_request(&ch, *body)) {
        ch.send(control::make_transport_message(name, std::move(*reply)));
      }
    }
    // Other types are ignored: newer peers may send more.
  }

  strand_type strand_;
  config cfg_;
  std::shared_ptr<device_runtime> device_;                  // config.device; null: none
  std::shared_ptr<staging_pool> staging_;                   // our transfers' device slices
  std::shared_ptr<staging_pool> target_staging_;            // peers' accesses to device segments
  std::map<std::int32_t, std::uint64_t> staging_segments_;  // strand-only
  instance_id self_;
  segment_registry registry_;
  std::shared_ptr<remote_segment_cache> cache_;
  control::peer_guard guard_;
  control::server_auth server_auth_;
  listener listener_;
  std::shared_ptr<control::byte_budget> control_budget_;
  std::string advertised_;
  transport_set set_;
  std::shared_ptr<transfers> transfers_;
  std::shared_ptr<metadata_backend> metadata_;
  std::string name_;
  std::atomic<bool> announce_pending_{false};
  /// Submits left to defer since a queued start ran on another thread
  /// than the one that submitted it (submit()).
  std::atomic<std::uint32_t> busy_submits_{0};
  static constexpr std::uint32_t busy_defers = 64;
  /// Its address tells threads apart (submit()).
  static inline thread_local char thread_mark = 0;
  // strand-only
  std::unordered_map<std::uint64_t, std::shared_ptr<peer_state>> peers_;
  std::uint64_t next_peer_ = 1;
  std::vector<std::shared_ptr<control::channel>> sessions_;
  std::unordered_map<std::string, control::digest> session_keys_;  // session id -> key
  std::set<std::string> refusals_logged_;
  mutable std::mutex pins_mutex_;
  std::unordered_map<segment_id, std::size_t> pins_;  // guarded by pins_mutex_
  std::size_t pinned_segments_ = 0;  // entries of pins_ above zero; guarded by pins_mutex_
  std::size_t waiting_ = 0;          // unpin_waiters_ + close_waiters_; guarded by pins_mutex_
  std::vector<std::function<void()>> close_waiters_;  // when_closed()
  std::multimap<segment_id, plain_handler> unpin_waiters_;
  notification_inbox inbox_;
  std::uint64_t publish_seq_ = 0;
  std::map<instance_id, std::uint64_t> known_seq_;  // peers' instances -> newest seq applied
  std::multiset<instance_id> connecting_;           // instances whose connect is in progress
  bool withdrawn_ = false;
  std::vector<std::function<void()>> withdraw_waiters_;
  std::atomic<bool> shut_{false};
};

}  // namespace kvlink::detail
