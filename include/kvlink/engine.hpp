// kvlink's engine: registration, peers and awaitable transfers.
//
// An engine lives on an executor the caller supplies. It registers local
// memory as segments, listens for peers, connects to peers (a handshake that
// learns their segments and picks a transport), and moves batches of bytes
// with one initiating function, async_submit_transfer():
//
//   asio::io_context io;
//   kvlink::engine eng{io.get_executor(), kvlink::config{.listen = "127.0.0.1:0"}};
//   auto seg = eng.register_segment(buf, len, kvlink::access::remote_read_write);
//   kvlink::peer p = co_await eng.async_connect("127.0.0.1:17001", asio::use_awaitable);
//   std::vector<kvlink::transfer_request> reqs{
//       {kvlink::opcode::write, buf, p.segment(0), 0, len}};
//   kvlink::transfer_result r = co_await eng.async_submit_transfer(reqs, asio::use_awaitable);
//
// (examples/quick_start.cpp is the whole program.) kvlink::engine chooses
// its transport per peer at the handshake from config.transports ("rdma,tcp";
// empty = every transport this program has: shm for a peer on this host,
// rdma with kvlink/rdma.hpp, tcp). tcp_engine and rdma_engine
// (kvlink/rdma.hpp) are typed fronts over it whose only difference is that
// default ("tcp", "rdma,tcp"): a tcp_engine never uses shm unless its
// config.transports names it (examples/tcp_loopback.cpp).
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
//   connections closed (which stops the kernel or the device from touching
//   their memory) before the handler runs. So the caller may free or reuse
//   its buffers the moment the handler is called, whatever the outcome.
// - Cancellation: the handler's associated cancellation slot (terminal and
//   partial cancellation; e.g. asio::bind_cancellation_slot, awaitable
//   operators, asio::cancel_after on Asio >= 1.31) stops the transfer as
//   above with errc::cancelled. Bytes already written stay written.
//
// Thread safety. The io_context (or any executor) may be run by one thread
// or many. The engine's state (registry, peers, transfers) lives on a strand
// of it; each TCP lane, and each lane a peer opened to us, does its socket
// I/O on a strand of its own on the same executor, so an io_context run by
// N threads moves one engine's data on up to N cores (a peer with
// config.tcp.lanes >= N keeps them busy). Lanes report finished slices to
// the engine's strand, in order per lane; the completion contract and the
// fence rule are the same with one thread or many.
// - Every member may be called from any thread, concurrently:
//   register_segment() (the registry and the transports' registration are
//   thread-safe), every async_* initiating function (they post to the
//   strand; async_submit_transfer called from a thread running the
//   engine's executor while the strand is idle starts the transfer right
//   there, inside the strand, unless recent starts ran on other threads
//   than their submitters'), local_address(), instance(), get_config(),
//   transports() (immutable after construction). A peer handle's members
//   are safe from any thread too.
// - Completion handlers run on their associated executor (by default the
//   engine's executor), never inside the initiating call.
// - Destruction closes the engine on its strand and returns once nothing of
//   it touches registered memory any more. From a thread that is not running
//   the io_context it waits for that, running the io_context itself when no
//   other thread does. From inside a handler on an io_context run by one
//   thread (a coroutine on it, say) it closes at once. With an io_context run
//   by several threads, do not destroy the engine from one of its handlers
//   (another thread may be in the engine's handlers): co_await
//   async_close() there first, or destroy it from another thread. When the
//   io_context is stopped, destroy the engine after the threads that ran it
//   have returned from run(). async_close() completes once every
//   connection has closed on its strand and no transfer or peer access
//   touches registered memory any more.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/detail/decl.hpp>
#include <kvlink/detail/erased_handler.hpp>
#include <kvlink/engine/config.hpp>
#include <kvlink/engine/core.hpp>
#include <kvlink/engine/notify.hpp>
#include <kvlink/engine/peer.hpp>
#include <kvlink/engine/transfer.hpp>
#include <kvlink/engine/transports.hpp>
#include <kvlink/memory/emulated.hpp>
#include <kvlink/metadata/backend.hpp>
#include <kvlink/shm/transport.hpp>
#include <kvlink/tcp/transport.hpp>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/associated_cancellation_slot.hpp>
#include <asio/async_result.hpp>
#include <asio/post.hpp>
#include <fmt/format.h>

namespace kvlink {

namespace detail {
// Defined in <kvlink/engine/backends.hpp>: at the end of this header, or
// once per program with KVLINK_SEPARATE_COMPILATION (<kvlink/separate.hpp>).
KVLINK_DECL std::shared_ptr<transport> make_tcp_transport(const transport_env& env,
                                                          const config& cfg);
KVLINK_DECL std::shared_ptr<transport> make_shm_transport(const transport_env& env,
                                                          const config& cfg);
// The TCP transport is in every program that includes the engine.
inline const bool tcp_in_catalog = transport_catalog::global().add("tcp", 100, make_tcp_transport);
// So is the same-host transport, first: a peer on this host (same kernel,
// same PID namespace, and allowed to attach) gets one copy instead of TCP.
inline const bool shm_in_catalog = transport_catalog::global().add("shm", 20, make_shm_transport);
}  // namespace detail

/// The engine, its transports chosen at run time (config.transports). Not a
/// template: bindings and C code hold it as it is. Completion handlers run on
/// their associated executor, by default the executor given here.
class engine {
 public:
  using executor_type = asio::any_io_executor;

  /// Binds and starts listening on cfg.listen and makes the transports
  /// cfg.transports names (`default_transports` when it is empty; empty
  /// too: every transport this program has). Throws std::system_error:
  /// invalid config, address in use, a transport this program does not
  /// have (invalid_argument), no usable transport without TCP fallback
  /// (no_device); the reason is in what().
  explicit engine(const executor_type& ex, config cfg = {},
                  std::string_view default_transports = {})
      : ex_(ex),
        core_(std::make_shared<detail::engine_core>(ex, std::move(cfg), default_transports)) {
    core_->start();
  }

  /// Closes the engine (see "Thread safety" above); registered memory may
  /// be freed once it returns.
  ~engine() {
    if (core_) core_->close();
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;
  engine(engine&&) noexcept = default;
  engine& operator=(engine&&) = delete;

  executor_type get_executor() const noexcept { return ex_; }

  /// Closes the engine on its strand: peers fail with errc::cancelled,
  /// pending receives complete with errc::cancelled, the listener closes,
  /// and a metadata store is told that this engine is gone (bounded by a
  /// couple of seconds when it cannot be reached). Signature:
  /// void(std::error_code); completes once that has run, when registered
  /// memory may be freed. Idempotent; destruction then only releases the
  /// object.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_close(Token&& token = Token{}) {
    return asio::async_initiate<Token, void(std::error_code)>(
        [this](auto handler) {
          auto h = std::make_shared<detail::erased_handler<void(std::error_code)>>(
              std::move(handler), ex_);
          asio::post(core_->strand(), [c = core_, h]() mutable {
            c->shutdown();
            c->when_closed([h] { h->complete({}); });
          });
        },
        token);
  }

  /// host:port peers are told to connect to, in the descriptor and the
  /// hellos (the real port when config.listen asked for 0): config.advertise
  /// when set; else the listen address; for a wildcard listen address
  /// (0.0.0.0, [::]) the first up non-loopback interface's, said in a log line.
  const std::string& local_address() const noexcept { return core_->local_address(); }
  /// host:port the listener is bound to.
  const std::string& listen_address() const noexcept { return core_->listen_address(); }
  /// This run's instance id (a restarted engine gets a new one).
  instance_id instance() const noexcept { return core_->self(); }
  /// What peers call it: config.name, or its advertised address.
  const std::string& name() const noexcept { return core_->name(); }
  const config& get_config() const noexcept { return core_->cfg(); }

  /// Which data transports this engine offers peers, in order of preference
  /// ("rdma,tcp"), with the reason for each that is not usable here
  /// ("tcp (rdma: no usable RDMA device)").
  std::string transports() const { return core_->offer(); }

  /// The registered segment that holds [addr, addr + length) (its id,
  /// bounds, access and memory kind) in `out`: not_registered when none
  /// holds addr, out_of_bounds when the range runs past its end. Any
  /// thread.
  std::error_code find_segment(const void* addr, std::uint64_t length, segment_info& out) const {
    return core_->registry().locate(addr, length, out);
  }

  /// The device runtime config.device named (null: none): what a layer
  /// above uses to tell device memory from host memory (classify) and to
  /// copy between them on this host (open_stream), as the engine does.
  const std::shared_ptr<kvlink::device_runtime>& device_runtime() const noexcept {
    return core_->device();
  }

  /// Registers [base, base + length) so that peers may access it as `granted`
  /// allows, and so that it can be the local side of transfers. `memory`
  /// says where the bytes live (host memory). Connected peers learn of it
  /// through their control channel. Errors: invalid_argument (null, zero
  /// length, a memory kind no transport reaches), overlapping_registration,
  /// or a transport's registration error.
  segment_id register_segment(void* base, std::uint64_t length, access granted, std::error_code& ec,
                              memory_desc memory = {}) {
    return core_->register_segment(base, length, granted, memory, ec);
  }
  /// As above; throws std::system_error with the failing call in what().
  segment_id register_segment(void* base, std::uint64_t length,
                              access granted = access::remote_read_write, memory_desc memory = {}) {
    std::error_code ec;
    std::string what;
    const auto id = core_->register_segment(base, length, granted, memory, ec, &what);
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
                              Token&& token = Token{}) {
    return asio::async_initiate<Token, void(std::error_code, segment_id)>(
        [this](auto handler, void* b, std::uint64_t len, access a) {
          core_->register_segment_async(
              b, len, a, memory_desc{},
              detail::erased_handler<void(std::error_code, segment_id)>(std::move(handler), ex_));
        },
        token, base, length, granted);
  }

  /// Unregisters a segment. Completes, with signature void(std::error_code),
  /// once no peer's access touches the segment any more: then its memory may
  /// be freed. New accesses to it are refused from the moment it is called.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_unregister_segment(segment_id id, Token&& token = Token{}) {
    return asio::async_initiate<Token, void(std::error_code)>(
        [this](auto handler, segment_id sid) {
          core_->unregister_segment(
              sid, detail::erased_handler<void(std::error_code)>(std::move(handler), ex_));
        },
        token, id);
  }

  /// Connects to a peer's engine by name (with the p2p metadata backend,
  /// the name is its "host:port"; with a store, its config.name, e.g.
  /// "decode-3"), performs the handshake and picks the transport
  /// (peer::transport(), peer::transport_reason()). Signature:
  /// void(std::error_code, peer). Errors: invalid_argument (not a name the
  /// backend takes), name_not_found (no engine of that name in the store),
  /// metadata_unavailable (the store cannot be reached), peer_unreachable
  /// (also: the engine at the stored address is not that name),
  /// protocol_version_mismatch, malformed_message, instance_changed,
  /// transport_unavailable (no transport of ours reaches the peer, or only
  /// TCP and falling back to it is forbidden). Connecting again to a live
  /// peer returns the same handle. With a store, a peer's later segments
  /// arrive through its watch too, a peer that restarts (a new instance
  /// under its name) fails with instance_changed, and one whose entry goes
  /// away (withdrawn, or its lease expired) with peer_unreachable; connect
  /// again by name to reach the new instance.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_connect(std::string name, Token&& token = Token{}) {
    return asio::async_initiate<Token, void(std::error_code, peer)>(
        [this](auto handler, std::string n) {
          core_->connect(std::move(n), detail::erased_handler<void(std::error_code, peer)>(
                                           std::move(handler), ex_));
        },
        token, std::move(name));
  }

  /// Where async_connect(name) would go, without connecting: the peer's
  /// address and, from a metadata store, its descriptor as published (not
  /// authenticated: the handshake is what authenticates a peer). Signature:
  /// void(std::error_code, resolved_peer). Errors: invalid_argument,
  /// name_not_found, metadata_unavailable, cancelled (the engine closed).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_resolve(std::string name, Token&& token = Token{}) {
    return asio::async_initiate<Token, void(std::error_code, resolved_peer)>(
        [this](auto handler, std::string n) {
          auto h = std::make_shared<detail::erased_handler<void(std::error_code, resolved_peer)>>(
              std::move(handler), ex_);
          core_->resolve(std::move(n), [h](std::error_code ec, resolved_peer rp) {
            h->complete(ec, std::move(rp));
          });
        },
        token, std::move(name));
  }

  /// Moves a batch of requests. Signature: void(std::error_code,
  /// transfer_result). See the top of this file for what completion means.
  /// Errors: not_registered, out_of_bounds, access_denied (local or remote),
  /// invalid_argument, unknown_peer, peer_closed, deadline_exceeded,
  /// cancelled, malformed_message.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_submit_transfer(std::span<const transfer_request> requests, transfer_options options,
                             Token&& token = Token{}) {
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
          core_->submit(id, std::move(reqs), std::move(opts),
                        detail::erased_handler<void(std::error_code, transfer_result)>(
                            std::move(handler), ex_),
                        slot);
        },
        token, std::vector<transfer_request>(requests.begin(), requests.end()), std::move(options));
  }

  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_submit_transfer(std::span<const transfer_request> requests, Token&& token = Token{}) {
    return async_submit_transfer(requests, transfer_options{}, std::forward<Token>(token));
  }

  /// Sends a standalone notification to `to` over its control channel.
  /// Signature: void(std::error_code); completes once the message is handed
  /// to the kernel. Errors: message_too_large (id + payload above
  /// config.max_notification), peer_closed, unknown_peer (empty handle).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_send_notification(const peer& to, notification n, Token&& token = Token{}) {
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
  auto async_receive_notification(Token&& token = Token{}) {
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

 private:
  executor_type ex_;
  std::shared_ptr<detail::engine_core> core_;
};

/// Tags for the typed fronts: the transports an engine uses when
/// config.transports is empty.
struct tcp_transport {
  static constexpr std::string_view transports = "tcp";
};
/// RDMA verbs where both engines have a usable device, TCP otherwise. The
/// RDMA transport is in the program once kvlink/rdma.hpp is included (and
/// kvlink::rdma linked); without it such an engine refuses to start.
struct rdma_transport {
  static constexpr std::string_view transports = "rdma,tcp";
};

/// The engine as a typed front: `Transport` gives the default of
/// config.transports; `Executor` is the caller's executor, on which
/// completion handlers run by default, and whose default completion token
/// (if it has one, e.g. asio::use_awaitable_t<>::as_default_on_t<...>) the
/// initiating functions use when called without a token.
template <class Transport, class Executor = asio::any_io_executor>
class basic_engine : public engine {
  template <class T>
  using token_t = asio::default_completion_token_t<T>;

 public:
  using executor_type = Executor;

  explicit basic_engine(const executor_type& ex, config cfg = {})
      : engine(asio::any_io_executor(ex), std::move(cfg), Transport::transports), typed_ex_(ex) {}

  executor_type get_executor() const noexcept { return typed_ex_; }

  template <class Token = token_t<executor_type>>
  auto async_close(Token&& token = token_t<executor_type>{}) {
    return engine::async_close(std::forward<Token>(token));
  }
  template <class Token = token_t<executor_type>>
  auto async_register_segment(void* base, std::uint64_t length, access granted,
                              Token&& token = token_t<executor_type>{}) {
    return engine::async_register_segment(base, length, granted, std::forward<Token>(token));
  }
  template <class Token = token_t<executor_type>>
  auto async_unregister_segment(segment_id id, Token&& token = token_t<executor_type>{}) {
    return engine::async_unregister_segment(id, std::forward<Token>(token));
  }
  template <class Token = token_t<executor_type>>
  auto async_connect(std::string name, Token&& token = token_t<executor_type>{}) {
    return engine::async_connect(std::move(name), std::forward<Token>(token));
  }
  template <class Token = token_t<executor_type>>
  auto async_resolve(std::string name, Token&& token = token_t<executor_type>{}) {
    return engine::async_resolve(std::move(name), std::forward<Token>(token));
  }
  template <class Token = token_t<executor_type>>
  auto async_submit_transfer(std::span<const transfer_request> requests, transfer_options options,
                             Token&& token = token_t<executor_type>{}) {
    return engine::async_submit_transfer(requests, std::move(options), std::forward<Token>(token));
  }
  template <class Token = token_t<executor_type>>
  auto async_submit_transfer(std::span<const transfer_request> requests,
                             Token&& token = token_t<executor_type>{}) {
    return engine::async_submit_transfer(requests, transfer_options{}, std::forward<Token>(token));
  }
  template <class Token = token_t<executor_type>>
  auto async_send_notification(const peer& to, notification n,
                               Token&& token = token_t<executor_type>{}) {
    return engine::async_send_notification(to, std::move(n), std::forward<Token>(token));
  }
  template <class Token = token_t<executor_type>>
  auto async_receive_notification(Token&& token = token_t<executor_type>{}) {
    return engine::async_receive_notification(std::forward<Token>(token));
  }

 private:
  executor_type typed_ex_;
};

/// The engine over TCP, on any executor.
using tcp_engine = basic_engine<tcp_transport>;
/// The engine over RDMA verbs with TCP beside it (include kvlink/rdma.hpp).
using rdma_engine = basic_engine<rdma_transport>;

}  // namespace kvlink

#ifndef KVLINK_SEPARATE_COMPILATION
#include <kvlink/engine/backends.hpp>
#endif
