// A fake in-process transport, "fake": engines of one process move bytes
// between each other with the copy engine (memcpy), no sockets on the data
// path. It keeps the whole transport contract, so the conformance suite
// (test/conformance/) checks the engine above it without a network:
// - the target side runs on the target engine's strand: every access is
//   checked against the target's registry (segment, bounds, access) and
//   pins the segment, exactly as a TCP target does, and is unpinned after
//   its last byte;
// - the target's strand does the copying (as a remote NIC or a TCP receiver
//   does), in chunks (fake_settings::chunk), one chunk per handler, several
//   slices at once per path (fake_settings::window), so a cancellation, a
//   deadline or an unregistration lands while slices are in flight, and a
//   target whose strand stops running stops the copying;
// - the fence and failures stop a slice between two chunks: once a slice
//   is reported done, no byte of it is copied any more;
// - a target whose engine went away fails the path with peer_closed.
//
// Reachable only from the same process (its descriptor entry carries a
// per-process token). Use: kvlink_test::add_fake_transport(), then
// config.transports = "fake".
#pragma once

#include <kvlink/engine.hpp>
#include <kvlink/transport/transport.hpp>

#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <asio/post.hpp>
#include <nlohmann/json.hpp>

namespace kvlink_test {

struct fake_settings {
  static inline std::uint64_t chunk = 64u << 10;  // bytes copied per handler
  static inline std::size_t window = 4;           // slices copying at once per path
  /// Slices complete as they are pumped, all at once, without moving a
  /// byte or checking anything: the wire removed, so that what is left is
  /// the engine's own cost per request (bench/engine_bench.cpp). Never for
  /// tests of the contract.
  static inline bool instant = false;
};

class fake_transport;

// The engines of this process that have a fake transport, by instance.
class fake_directory {
 public:
  static fake_directory& get() {
    static fake_directory d;
    return d;
  }
  void add(const kvlink::instance_id& id, std::weak_ptr<fake_transport> t) {
    std::lock_guard lock{mutex_};
    map_[id] = std::move(t);
  }
  void remove(const kvlink::instance_id& id) {
    std::lock_guard lock{mutex_};
    map_.erase(id);
  }
  std::shared_ptr<fake_transport> find(const kvlink::instance_id& id) {
    std::lock_guard lock{mutex_};
    auto it = map_.find(id);
    return it == map_.end() ? nullptr : it->second.lock();
  }
  // Differs between processes: a peer in another process is not reachable.
  const std::string& token() const { return token_; }

 private:
  fake_directory() {
    std::random_device rd;
    token_ = std::to_string(rd()) + "-" + std::to_string(rd());
  }
  std::mutex mutex_;
  std::map<kvlink::instance_id, std::weak_ptr<fake_transport>> map_;
  std::string token_;
};

class fake_transport final : public kvlink::transport,
                             public std::enable_shared_from_this<fake_transport> {
 public:
  explicit fake_transport(kvlink::transport_env env) : env_(std::move(env)) {}

  std::string_view name() const noexcept override { return "fake"; }
  bool available() const noexcept override { return true; }
  std::string unavailable_reason() const override { return {}; }
  kvlink::memory_kinds reaches() const noexcept override { return {kvlink::memory_kind::host}; }

  void start() override { fake_directory::get().add(env_.self, weak_from_this()); }
  void shutdown() override {
    down_ = true;
    fake_directory::get().remove(env_.self);
  }

  nlohmann::json describe() const override { return {{"process", fake_directory::get().token()}}; }
  bool reachable(const nlohmann::json& entry, std::string& why) const override {
    if (entry.value("process", std::string{}) != fake_directory::get().token()) {
      why = "the peer is in another process";
      return false;
    }
    return true;
  }
  asio::awaitable<std::error_code> connect(kvlink::path_context ctx,
                                           std::shared_ptr<kvlink::data_path>& out) override;

  // Target side.
  const kvlink::transport_env& env() const noexcept { return env_; }
  bool down() const noexcept { return down_; }

 private:
  kvlink::transport_env env_;
  bool down_ = false;
};

class fake_path final : public kvlink::data_path, public std::enable_shared_from_this<fake_path> {
 public:
  fake_path(kvlink::transport_env env, std::weak_ptr<fake_transport> target,
            std::function<void(std::error_code)> on_failure)
      : env_(std::move(env)), target_(std::move(target)), on_failure_(std::move(on_failure)) {}

  std::span<const double> lane_weights() const noexcept override { return weights_; }
  void start() override {}
  void enqueue(std::size_t, const kvlink::slice_ref& s) override { queue_.push_back(s); }

  void pump() override {
    if (fake_settings::instant && !failed_) {
      done_.clear();
      for (const auto& s : queue_) kvlink::add_report(done_, s.op, s.length);
      queue_.clear();
      if (!done_.empty()) env_.host->slices_done(done_);
      return;
    }
    while (!failed_ && !queue_.empty() && active_.size() < fake_settings::window) {
      auto c = std::make_shared<copy>();
      c->s = queue_.front();
      queue_.pop_front();
      active_.push_back(c);
      begin(c);
    }
  }

  std::size_t drop_queued(const kvlink::detail::transfer_op* op) override {
    const auto before = queue_.size();
    std::erase_if(queue_, [op](const kvlink::slice_ref& s) { return s.op == op; });
    return before - queue_.size();
  }

  bool has_in_flight(const kvlink::detail::transfer_op* op) const override {
    for (const auto& c : active_) {
      if (c->s.op == op) return true;
    }
    return false;
  }

  void fence(const kvlink::detail::transfer_op* op, std::error_code ec) override {
    auto active = active_;
    for (auto& c : active) {
      if (c->s.op == op) finish(c, ec);
    }
  }

  void fail(std::error_code ec) override {
    if (failed_) return;
    failed_ = true;
    auto active = active_;
    for (auto& c : active) finish(c, ec);
    auto queue = std::move(queue_);
    queue_.clear();
    for (const auto& s : queue) env_.host->slice_done(s.op, 0, ec);
    if (auto cb = std::move(on_failure_)) cb(ec);
  }

 private:
  // One slice being copied. The target's strand copies (as a remote NIC or
  // a TCP receiver does the work); this side may stop it at any time. The
  // mutex makes "stopped" final: once finish() has taken it, no chunk of
  // the slice is copied any more.
  struct copy {
    kvlink::slice_ref s;
    std::mutex m;
    std::byte* remote = nullptr;
    std::uint64_t done = 0;  // target strand
    bool pinned = false;     // target strand
    bool stopped = false;    // under m
    bool reported = false;   // this side
  };

  void begin(const std::shared_ptr<copy>& c) {
    auto t = target_.lock();
    if (!t || t->down()) {
      fail(kvlink::errc::peer_closed);
      return;
    }
    asio::post(t->env().executor, [self = shared_from_this(), c, wt = target_] {
      auto tt = wt.lock();
      if (!tt || tt->down()) {
        self->report(c, kvlink::errc::peer_closed);
        return;
      }
      // Checked and pinned before any byte moves, as a target does.
      const auto ec = c->s.length == 0
                          ? std::error_code{kvlink::errc::invalid_argument}
                          : tt->env().registry->check_remote_access(
                                kvlink::segment_id{c->s.segment}, c->s.offset, c->s.length,
                                kvlink::required_access(c->s.kind), c->remote);
      if (ec) {
        self->report(c, ec);
        return;
      }
      if (!tt->env().host->pin(kvlink::segment_id{c->s.segment})) {
        self->report(c, kvlink::errc::not_registered);  // unregistered in between
        return;
      }
      c->pinned = true;
      self->step(tt, c);
    });
  }

  // On the target's strand: one chunk, then the next in a later handler.
  void step(const std::shared_ptr<fake_transport>& t, const std::shared_ptr<copy>& c) {
    std::error_code ec;
    {
      std::lock_guard lock{c->m};
      if (c->stopped || t->down()) {
        unpin(t, c);
        return;
      }
      const auto n = std::min<std::uint64_t>(fake_settings::chunk, c->s.length - c->done);
      std::byte* local = c->s.local + c->done;
      std::byte* remote = c->remote + c->done;
      if (c->s.kind == kvlink::opcode::write) {
        std::memcpy(remote, local, static_cast<std::size_t>(n));
      } else {
        std::memcpy(local, remote, static_cast<std::size_t>(n));
      }
      c->done += n;
      if (c->done < c->s.length) {
        asio::post(t->env().executor, [self = shared_from_this(), t, c] { self->step(t, c); });
        return;
      }
    }
    unpin(t, c);
    report(c, ec);
  }

  static void unpin(const std::shared_ptr<fake_transport>& t, const std::shared_ptr<copy>& c) {
    if (!c->pinned) return;
    c->pinned = false;
    if (!t->down()) t->env().host->unpin(kvlink::segment_id{c->s.segment});
  }

  // Back to this side's strand with the slice's outcome.
  void report(const std::shared_ptr<copy>& c, std::error_code ec) {
    asio::post(env_.executor, [self = shared_from_this(), c, ec] { self->finish(c, ec); });
  }

  void finish(const std::shared_ptr<copy>& c, std::error_code ec) {
    if (c->reported) return;
    c->reported = true;
    {
      std::lock_guard lock{c->m};  // waits for a chunk being copied right now
      c->stopped = true;
    }
    std::erase(active_, c);
    env_.host->slice_done(c->s.op, ec ? 0 : c->s.length, ec);
    pump();
  }

  kvlink::transport_env env_;
  std::weak_ptr<fake_transport> target_;
  std::function<void(std::error_code)> on_failure_;
  std::vector<double> weights_{1.0, 1.0};
  std::deque<kvlink::slice_ref> queue_;
  std::vector<kvlink::slice_report> done_;  // instant mode's reports
  std::vector<std::shared_ptr<copy>> active_;
  bool failed_ = false;
};

inline asio::awaitable<std::error_code> fake_transport::connect(
    kvlink::path_context ctx, std::shared_ptr<kvlink::data_path>& out) {
  auto target = fake_directory::get().find(ctx.peer);
  if (!target || target->down()) co_return kvlink::errc::transport_unavailable;
  out = std::make_shared<fake_path>(env_, target, std::move(ctx.on_failure));
  co_return std::error_code{};
}

/// Puts "fake" in this program's transport catalog (idempotent).
inline void add_fake_transport() {
  kvlink::transport_catalog::global().add(
      "fake", 10,
      [](const kvlink::transport_env& env, const kvlink::config&)
          -> std::shared_ptr<kvlink::transport> { return std::make_shared<fake_transport>(env); });
}

}  // namespace kvlink_test
