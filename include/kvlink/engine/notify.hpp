// Notifications: small messages between engines (a request id and payload
// bytes), sent over the control channel after a transfer's data, or alone
// ("free your blocks"). This room is the receiving side: the queue of
// arrived notifications and the waiters of async_receive_notification().
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/detail/erased_handler.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <system_error>

#include <asio/cancellation_signal.hpp>

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

namespace detail {

/// Arrived notifications and those waiting for one. Strand-only.
class notification_inbox {
 public:
  using handler = erased_handler<void(std::error_code, notification)>;

  /// Notifications kept while nobody waits, at most; and in bytes, the
  /// engine's config.max_notification_bytes. A peer that sends more is
  /// refused (its channel closed with limit_exceeded).
  static constexpr std::size_t max_queued = 1u << 16;

  /// Whether one more of `bytes` (id + payload) would go over the bounds.
  bool full(std::uint64_t bytes, std::uint64_t max_bytes) const noexcept {
    return queued_.size() >= max_queued || queued_bytes_ + bytes > max_bytes;
  }

  /// Hands `n` to the oldest waiter, or queues it.
  void deliver(notification n) {
    if (!waiters_.empty()) {
      auto w = std::move(waiters_.front());
      waiters_.pop_front();
      if (w.slot.is_connected()) w.slot.clear();
      w.h.complete({}, std::move(n));
      return;
    }
    queued_bytes_ += n.id.size() + n.payload.size();
    queued_.push_back(std::move(n));
  }

  /// Completes at once with the oldest queued notification, or waits.
  void receive(std::uint64_t id, handler h, asio::cancellation_slot slot) {
    if (!queued_.empty()) {
      auto n = std::move(queued_.front());
      queued_.pop_front();
      queued_bytes_ -= n.id.size() + n.payload.size();
      if (slot.is_connected()) slot.clear();
      h.complete({}, std::move(n));
      return;
    }
    if (closed_) {
      h.complete(errc::cancelled, notification{});
      return;
    }
    waiters_.push_back(waiter{id, std::move(h), slot});
  }

  /// A waiter's cancellation: it completes with errc::cancelled.
  void cancel(std::uint64_t id) {
    auto it = std::find_if(waiters_.begin(), waiters_.end(),
                           [id](const waiter& w) { return w.id == id; });
    if (it == waiters_.end()) return;
    auto w = std::move(*it);
    waiters_.erase(it);
    if (w.slot.is_connected()) w.slot.clear();
    w.h.complete(errc::cancelled, notification{});
  }

  /// The engine shuts down: every waiter completes with errc::cancelled.
  void close() {
    closed_ = true;
    auto waiters = std::move(waiters_);
    waiters_.clear();
    for (auto& w : waiters) w.h.complete(errc::cancelled, notification{});
  }

 private:
  struct waiter {
    std::uint64_t id;
    handler h;
    asio::cancellation_slot slot;
  };
  std::deque<notification> queued_;
  std::uint64_t queued_bytes_ = 0;
  std::deque<waiter> waiters_;
  bool closed_ = false;
};

}  // namespace detail
}  // namespace kvlink
