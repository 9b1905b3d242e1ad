// The TCP transport: `config.tcp.lanes` persistent connections per peer,
// each a lane (tcp/lane.hpp) the planner stripes slices over; the target
// serves them with lane_server (tcp/lane_server.hpp). Lanes connect to the
// peer's listener (where the control connection went) and introduce
// themselves with a lane hello naming the instance they expect, so a peer
// that restarted in between refuses them.
//
// Reaches host memory; device memory goes through staging on both sides
// (the engine stages the initiator's, lane_server the target's). Publishes no per-segment key: a
// TCP target checks every frame against its registry, by segment id.
#pragma once

#include <kvlink/control/handshake.hpp>
#include <kvlink/control/socket.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/tcp/config.hpp>
#include <kvlink/tcp/lane.hpp>
#include <kvlink/tcp/lane_server.hpp>
#include <kvlink/transport/transport.hpp>

#include <algorithm>
#include <array>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <nlohmann/json.hpp>
#include <unistd.h>

namespace kvlink::tcp {

/// Runs `fn` on `io`'s executor: directly when closing inline, else posted.
template <class IoObject, class Fn>
void on_strand_of(const std::shared_ptr<IoObject>& io, Fn&& fn) {
  if (detail::closing_inline()) {
    fn();
    return;
  }
  asio::post(io->get_executor(), std::forward<Fn>(fn));
}

/// The data path to one peer: its lanes, equally weighted, each on a strand
/// of its own. The path itself lives on the engine's strand: it collects the
/// slices the engine enqueues and hands each lane its share in one post per
/// pump(). A lane that fails fails the path (the peer is reported lost),
/// except when our own memory broke its stream (a local buffer that is not
/// accessible): then the lane is dialed again and carries the slices it had.
class path final : public data_path, public std::enable_shared_from_this<path> {
 public:
  /// Opens lane `index` of the path; on_broken is the path's to set.
  using dial_fn = std::function<asio::awaitable<std::error_code>(
      std::uint32_t index, lane::broken_fn on_broken, std::shared_ptr<lane>& out)>;

  path(asio::any_io_executor ex, transport_host& host, dial_fn dial,
       std::function<void(std::error_code)> on_failure)
      : ex_(std::move(ex)),
        host_(host),
        dial_(std::move(dial)),
        on_failure_(std::move(on_failure)) {}

  /// Opens the lanes (once, before the path is used).
  asio::awaitable<std::error_code> open(std::uint32_t count) {
    for (std::uint32_t i = 0; i < count; ++i) {
      std::shared_ptr<lane> l;
      if (auto ec = co_await dial_(i, broken_handler(i), l)) {
        for (auto& x : lanes_) on_strand_of(x, [x, ec] { x->fail(ec); });
        co_return ec;
      }
      lanes_.push_back(std::move(l));
    }
    weights_.assign(lanes_.size(), 1.0);
    outbox_.resize(lanes_.size());
    pending_.resize(lanes_.size());
    redialing_.assign(lanes_.size(), false);
    co_return std::error_code{};
  }

  std::span<const double> lane_weights() const noexcept override { return weights_; }
  void start() override {
    for (auto& l : lanes_) on_strand_of(l, [l] { l->start(); });
  }
  void enqueue(std::size_t i, const slice_ref& s) override {
    if (redialing_[i]) {
      pending_[i].push_back(s);
    } else {
      outbox_[i].push_back(s);
    }
  }
  void pump() override {
    for (std::size_t i = 0; i < outbox_.size(); ++i) {
      if (outbox_[i].empty()) continue;
      auto batch = std::move(outbox_[i]);
      outbox_[i] = {};
      if (failed_) {  // failed since the engine checked: never sent
        for (const auto& s : batch) host_.slice_done(s.op, 0, failure_);
        continue;
      }
      auto l = lanes_[i];
      on_strand_of(l, [l, batch = std::move(batch)] {
        for (const auto& s : batch) l->enqueue(s);
        l->pump();
      });
    }
  }
  std::size_t drop_queued(const detail::transfer_op* op) override {
    std::size_t n = 0;
    for (std::size_t i = 0; i < outbox_.size(); ++i) {
      n += std::erase_if(outbox_[i], [op](const slice_ref& s) { return s.op == op; });
      n += std::erase_if(pending_[i], [op](const slice_ref& s) { return s.op == op; });
    }
    // What the lanes hold they resolve themselves (errc::cancelled).
    for (std::size_t i = 0; i < lanes_.size(); ++i) {
      if (redialing_[i]) continue;
      auto l = lanes_[i];
      on_strand_of(l, [l] { l->purge(); });
    }
    return n;
  }
  bool has_in_flight(const detail::transfer_op* op) const override {
    (void)op;
    return !lanes_.empty();  // the lanes know; fence() asks them
  }
  /// Closing a lane's socket is the only way to stop the kernel from
  /// touching its slices' memory: the lanes carrying `op` close.
  void fence(const detail::transfer_op* op, std::error_code ec) override {
    for (std::size_t i = 0; i < lanes_.size(); ++i) {
      if (redialing_[i]) continue;
      auto l = lanes_[i];
      on_strand_of(l, [l, op, ec] {
        if (l->carries(op)) l->fail(ec);
      });
    }
  }
  void fail(std::error_code ec) override {
    if (failed_) return;
    failed_ = true;
    failure_ = ec;
    auto lanes = std::move(lanes_);
    lanes_.clear();  // the lanes no longer keep the engine alive through us
    for (std::size_t i = 0; i < lanes.size(); ++i) {
      if (!redialing_[i]) {
        auto l = lanes[i];
        on_strand_of(l, [l, ec] { l->fail(ec); });
      }
      auto pending = std::move(pending_[i]);
      pending_[i].clear();
      auto queued = std::move(outbox_[i]);
      outbox_[i].clear();
      for (const auto& s : pending) host_.slice_done(s.op, 0, ec);
      for (const auto& s : queued) host_.slice_done(s.op, 0, ec);
    }
    if (auto cb = std::move(on_failure_)) cb(ec);
  }

 private:
  lane::broken_fn broken_handler(std::uint32_t i) {
    // Called on the lane's strand; the path lives on the engine's.
    std::weak_ptr<transport_host> host = host_.keep_alive();
    return [w = weak_from_this(), ex = ex_, host, i](std::deque<slice_ref> survivors) {
      asio::post(ex, [w, host, i, survivors = std::move(survivors)]() mutable {
        if (auto self = w.lock()) {
          self->redial(i, std::move(survivors));
        } else if (auto h = host.lock()) {  // the path is gone: nobody carries them
          for (const auto& s : survivors) h->slice_done(s.op, 0, errc::peer_closed);
        }
      });
    };
  }

  // Lane `i` broke on a local buffer: a new connection carries its slices.
  void redial(std::uint32_t i, std::deque<slice_ref> survivors) {
    if (failed_) {
      for (const auto& s : survivors) host_.slice_done(s.op, 0, errc::peer_closed);
      return;
    }
    redialing_[i] = true;
    for (auto& s : outbox_[i]) pending_[i].push_back(s);
    outbox_[i].clear();
    for (auto& s : survivors) pending_[i].push_back(s);
    asio::co_spawn(
        ex_,
        [self = shared_from_this(), i]() -> asio::awaitable<void> {
          std::shared_ptr<lane> l;
          const auto ec = co_await self->dial_(i, self->broken_handler(i), l);
          if (self->failed_) {
            if (l) on_strand_of(l, [l] { l->fail(errc::cancelled); });
            co_return;
          }
          if (ec) {
            self->redialing_[i] = false;
            self->fail(ec);
            co_return;
          }
          self->lanes_[i] = l;
          self->redialing_[i] = false;
          auto pending = std::move(self->pending_[i]);
          self->pending_[i].clear();
          on_strand_of(l, [l, pending = std::move(pending)] {
            for (const auto& s : pending) l->enqueue(s);
            l->start();
            l->pump();
          });
        },
        asio::detached);
  }

  asio::any_io_executor ex_;
  transport_host& host_;
  dial_fn dial_;
  std::function<void(std::error_code)> on_failure_;
  std::vector<std::shared_ptr<lane>> lanes_;
  std::vector<double> weights_;
  std::vector<std::vector<slice_ref>> outbox_;  // enqueued, not yet handed to the lane
  std::vector<std::deque<slice_ref>> pending_;  // a redialing lane's slices
  std::vector<bool> redialing_;
  std::error_code failure_;
  bool failed_ = false;
};

class transport final : public kvlink::transport, public std::enable_shared_from_this<transport> {
 public:
  transport(transport_env env, tcp_config cfg) : env_(std::move(env)), cfg_(cfg) {}

  std::string_view name() const noexcept override { return "tcp"; }
  bool available() const noexcept override { return true; }
  std::string unavailable_reason() const override { return {}; }
  memory_kinds reaches() const noexcept override { return {memory_kind::host}; }
  const tcp_config& cfg() const noexcept { return cfg_; }
  control::socket_options socket_options() const noexcept {
    return {cfg_.nodelay, cfg_.socket_buffer};
  }

  void shutdown() override {
    for (auto& w : servers_) {
      if (auto s = w.lock()) on_strand_of(s, [s] { s->close(); });
    }
    servers_.clear();
  }

  /// Closing the connection is what releases a peer's hold on the memory:
  /// close() unpins what its frames held.
  void revoke(segment_id id) override {
    for (auto& w : servers_) {
      if (auto s = w.lock()) {
        on_strand_of(s, [s, id] {
          if (s->holds(id)) s->close();
        });
      }
    }
  }

  /// Bytes one vector frame may carry at most (and never more than a
  /// target takes in a frame).
  static constexpr std::uint64_t max_vector_bytes = 1u << 20;

  nlohmann::json describe() const override {
    nlohmann::json d{{"lanes", cfg_.lanes}};
    if (cfg_.vector_pieces > 1) {
      d["vector"] = cfg_.vector_pieces;
      d["vector_bytes"] = std::min(max_vector_bytes, cfg_.max_frame_payload);
    }
    return d;
  }

  /// What a peer's tcp entry says it takes in vector frames, within what
  /// this engine sends (none from a peer that does not say).
  vector_limits peer_vectors(const nlohmann::json& entry) const {
    vector_limits v;
    const auto pieces = entry.find("vector");
    const auto bytes = entry.find("vector_bytes");
    if (cfg_.vector_pieces < 2 || pieces == entry.end() || bytes == entry.end() ||
        !pieces->is_number_unsigned() || !bytes->is_number_unsigned()) {
      return v;
    }
    v.pieces = static_cast<std::size_t>(std::min<std::uint64_t>(
        {pieces->get<std::uint64_t>(), cfg_.vector_pieces, max_vector_pieces}));
    v.bytes = std::min(bytes->get<std::uint64_t>(), max_vector_bytes);
    return v;
  }

  bool reachable(const nlohmann::json& entry, std::string& why) const override {
    if (!entry.is_object()) {
      why = "the peer's tcp entry is malformed";
      return false;
    }
    return true;
  }

  asio::awaitable<std::error_code> connect(path_context ctx,
                                           std::shared_ptr<data_path>& out) override {
    // One lane that fails for good fails the path once; its owner hears of
    // it on the engine's strand (lanes fail on their own).
    auto on_failure = std::make_shared<std::function<void(std::error_code)>>(ctx.on_failure);
    auto fail_once = [on_failure](std::error_code ec) {
      if (auto cb = std::move(*on_failure)) cb(ec);
    };
    auto lane_failed = [fail_once, ex = env_.executor](std::error_code ec) {
      asio::post(ex, [fail_once, ec] { fail_once(ec); });
    };
    const auto vectors = ctx.entry.is_object() ? peer_vectors(ctx.entry) : vector_limits{};
    auto dial = [w = weak_from_this(), endpoint = ctx.endpoint, peer = ctx.peer,
                 session = ctx.session, lane_failed,
                 vectors](std::uint32_t i, lane::broken_fn on_broken,
                          std::shared_ptr<lane>& l) -> asio::awaitable<std::error_code> {
      auto self = w.lock();
      if (!self) co_return errc::cancelled;
      co_return co_await self->dial_lane(endpoint, peer, session, i, lane_failed,
                                         std::move(on_broken), vectors, l);
    };
    auto p = std::make_shared<path>(env_.executor, *env_.host, std::move(dial), fail_once);
    if (auto ec = co_await p->open(cfg_.lanes)) co_return ec;
    out = std::move(p);
    co_return std::error_code{};
  }

  void accept_lane(asio::ip::tcp::socket socket, const control::hello& h,
                   std::shared_ptr<void> lease) override {
    (void)h;
    control::tune_socket(socket, socket_options());
    // The connection moves to a strand of its own: served lanes of one or
    // many initiators run on as many cores as run the io_context.
    std::error_code ec;
    const auto protocol = socket.local_endpoint(ec).protocol();
    const auto fd = ec ? -1 : socket.release(ec);
    if (ec || fd < 0) {
      std::error_code ignored;
      socket.close(ignored);
      return;
    }
    asio::ip::tcp::socket own(env_.io_strand());
    own.assign(protocol, fd, ec);
    if (ec) {
      ::close(fd);
      return;
    }
    auto server = std::make_shared<lane_server>(std::move(own), *env_.registry, *env_.host,
                                                cfg_.max_frame_payload, std::move(lease),
                                                env_.target_staging);
    std::erase_if(servers_, [](const auto& w) { return w.expired(); });
    servers_.push_back(server);
    on_strand_of(server, [server] { server->start(); });
  }

 private:
  // Connects lane `i` to the peer's listener and introduces it.
  asio::awaitable<std::error_code> dial_lane(asio::ip::tcp::endpoint endpoint, instance_id peer,
                                             control::session_keys session, std::uint32_t i,
                                             std::function<void(std::error_code)> on_failure,
                                             lane::broken_fn on_broken, vector_limits vectors,
                                             std::shared_ptr<lane>& out) {
    asio::ip::tcp::socket s(env_.io_strand());  // the lane's own strand
    nlohmann::json welcome;
    const std::array<asio::ip::tcp::endpoint, 1> eps{endpoint};
    control::hello hello;
    hello.instance = env_.self;
    hello.r = control::role::lane;
    hello.transport = "tcp";
    hello.lane = i;
    hello.expect = peer;
    const control::client_auth auth{env_.guard, session.session, session.key};
    const auto options = socket_options();
    if (auto ec = co_await control::dial(s, eps, env_.connect_timeout, options, hello,
                                         env_.max_control_message, auth, welcome)) {
      co_return ec;
    }
    out = std::make_shared<lane>(std::move(s), *env_.host, cfg_.max_inflight_per_lane,
                                 std::move(on_failure), std::move(on_broken), vectors);
    co_return std::error_code{};
  }

  transport_env env_;
  tcp_config cfg_;
  std::vector<std::weak_ptr<lane_server>> servers_;
};

}  // namespace kvlink::tcp
