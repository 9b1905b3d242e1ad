// The engine a Python kvlink.Engine holds: a kvlink::engine on an io_context
// of its own, run by one I/O thread, plus what Python needs beside it:
//  - the local segments by address (Mooncake names memory by address, and
//    read_bytes/write_bytes check their range against them);
//  - a notification pump: one receive is always pending on the engine, and
//    what arrives goes to a waiting Python receiver or a bounded queue (when
//    the queue is full the pump pauses and the engine's own bound applies).
//
// One I/O thread, on purpose: cancellation signals are emitted by posting to
// the io_context (operation::cancel), which is then serialised with every
// handler of the engine. Thread safety: every member may be called from any
// thread; none takes the GIL, except through the callback runner.
#pragma once

#include <kvlink/engine.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "operation.hpp"
#include <asio/bind_cancellation_slot.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/use_future.hpp>
#include <fmt/format.h>

namespace kvlink::python {

/// A segment this engine registered.
struct local_segment {
  segment_id id;
  std::uintptr_t base = 0;
  std::uint64_t length = 0;
  access granted = access::none;
};

class host {
 public:
  /// Notifications kept for Python receivers before the pump pauses.
  static constexpr std::size_t max_queued_notifications = 4096;

  /// Starts the engine (binds cfg.listen) and its I/O thread. Throws
  /// std::system_error as kvlink::engine's constructor does.
  explicit host(config cfg)
      : work_(asio::make_work_guard(io_)),
        engine_(std::make_unique<engine>(io_.get_executor(), std::move(cfg))) {
    // Threads start once the engine exists: a constructor that throws leaves none.
    runner_ = callback_runner::start();
    io_thread_ = std::thread([this] { io_.run(); });
    arm_receive();
  }

  /// Closes first (see close()).
  ~host() { close(); }

  host(const host&) = delete;
  host& operator=(const host&) = delete;

  /// Closes the engine: pending operations complete with errc::cancelled,
  /// Python receivers get nothing; then the threads end. Returns once no
  /// transfer touches registered memory. Idempotent. Call it without the
  /// GIL, and not from a done-callback (the binding refuses both).
  void close() {
    std::lock_guard once{close_mutex_};  // a second caller returns once the first is done
    {
      std::unique_lock lock{life_};
      if (closing_) return;
      closing_ = true;
    }
    // No new operation starts from here; those started complete on close.
    engine_->async_close(asio::use_future).wait();
    std::unique_ptr<engine> e;
    {
      std::unique_lock lock{life_};
      e = std::move(engine_);
    }
    e.reset();  // outside the lock: the pump may be waiting for it on the I/O thread
    work_.reset();
    io_thread_.join();
    close_inbox();
    runner_->stop();
  }

  bool closed() const {
    std::shared_lock lock{life_};
    return closing_;
  }

  const std::shared_ptr<callback_runner>& runner() const noexcept { return runner_; }
  asio::io_context& io() noexcept { return io_; }

  /// Calls f(engine&) unless the engine is closed (then errc::cancelled).
  /// The engine's initiating functions only post: this never blocks long.
  template <class F>
  std::error_code with_engine(F&& f) {
    std::shared_lock lock{life_};
    if (closing_ || !engine_) return errc::cancelled;
    f(*engine_);
    return {};
  }

  /// A new operation of this engine.
  std::shared_ptr<operation> make_operation(std::string what) {
    return std::make_shared<operation>(std::move(what), runner_, io_);
  }

  // ------------------------------------------------------ registration

  /// Registers [base, base + length) and remembers it by address. `memory`:
  /// as the caller states it (device memory), else host unless the engine's
  /// device runtime finds device memory there. `what` says why it failed,
  /// ending with the error's message.
  segment_id register_segment(std::uintptr_t base, std::uint64_t length, access granted,
                              memory_desc memory, std::error_code& ec, std::string* what) {
    segment_id id;
    std::error_code rec;
    std::string why;
    ec = with_engine([&](engine& e) {
      // The registering call itself is synchronous and thread-safe; the
      // throwing overload is the one that says why.
      try {
        id = e.register_segment(reinterpret_cast<void*>(base), length, granted, memory);
      } catch (const std::system_error& x) {
        rec = x.code();
        why = x.what();
      }
    });
    if (!ec) ec = rec;
    if (!ec && id.valid()) {
      std::lock_guard lock{segments_mutex_};
      segments_[base] = local_segment{id, base, length, granted};
    } else if (ec && what != nullptr) {
      // what() of the engine's error ends with the code's message already.
      *what = why.empty() ? fmt::format("register {:#x} ({} bytes): {}", base, length, ec.message())
                          : why;
    }
    return id;
  }

  /// Unregisters segment `id`; completes once no peer's access touches it.
  std::shared_ptr<operation> unregister_segment(segment_id id, std::error_code& ec) {
    auto op = make_operation(fmt::format("unregister segment {}", id.value()));
    {
      std::lock_guard lock{segments_mutex_};
      auto it = std::find_if(segments_.begin(), segments_.end(),
                             [id](const auto& kv) { return kv.second.id == id; });
      if (it == segments_.end()) {
        ec = errc::not_registered;
        return nullptr;
      }
      // Forgotten now: new local uses through this binding fail at once.
      segments_.erase(it);
    }
    ec = with_engine([&](engine& e) { e.async_unregister_segment(id, finish_op{op}); });
    return ec ? nullptr : op;
  }

  /// The segment registered at exactly `base`.
  std::optional<local_segment> segment_at(std::uintptr_t base) const {
    std::lock_guard lock{segments_mutex_};
    auto it = segments_.find(base);
    if (it == segments_.end()) return std::nullopt;
    return it->second;
  }

  /// The segment that holds all of [addr, addr + length).
  std::optional<local_segment> segment_holding(std::uintptr_t addr, std::uint64_t length) const {
    std::lock_guard lock{segments_mutex_};
    auto it = segments_.upper_bound(addr);
    if (it == segments_.begin()) return std::nullopt;
    --it;
    const auto& s = it->second;
    if (addr - s.base > s.length || length > s.length - (addr - s.base)) return std::nullopt;
    return s;
  }

  std::vector<local_segment> segments() const {
    std::lock_guard lock{segments_mutex_};
    std::vector<local_segment> out;
    for (const auto& kv : segments_) out.push_back(kv.second);
    return out;
  }

  // ----------------------------------------------------- notifications

  /// Takes the oldest arrived notification, waiting up to `timeout` (nullopt:
  /// no limit). nullopt when it timed out or the engine closed. No GIL.
  std::optional<notification> receive(std::optional<std::chrono::nanoseconds> timeout,
                                      bool* closed = nullptr) {
    std::unique_lock lock{inbox_mutex_};
    const auto ready = [this] { return !inbox_.empty() || inbox_closed_; };
    if (timeout) {
      if (!inbox_cv_.wait_for(lock, *timeout, ready)) return std::nullopt;
    } else {
      inbox_cv_.wait(lock, ready);
    }
    if (closed != nullptr) *closed = inbox_.empty() && inbox_closed_;
    return take_locked(lock);
  }

  /// Every notification that has arrived, without waiting.
  std::vector<notification> drain() {
    std::vector<notification> out;
    std::unique_lock lock{inbox_mutex_};
    while (auto n = take_locked(lock, false)) out.push_back(std::move(*n));
    rearm_if_paused(lock);
    return out;
  }

  /// Hands the next notification to `deliver`, called on the callback
  /// thread (nullopt: the engine closed). Returns a ticket for cancel_waiter.
  std::uint64_t receive_async(std::function<void(std::optional<notification>)> deliver) {
    std::unique_lock lock{inbox_mutex_};
    const std::uint64_t ticket = next_ticket_++;
    if (auto n = take_locked(lock)) {
      runner_->post([d = std::move(deliver), n = std::move(*n)]() mutable { d(std::move(n)); });
    } else if (inbox_closed_) {
      runner_->post([d = std::move(deliver)] { d(std::nullopt); });
    } else {
      waiters_.push_back(waiter{ticket, std::move(deliver)});
    }
    return ticket;
  }

  /// Withdraws a receive_async that has not been served; false if it was.
  bool cancel_waiter(std::uint64_t ticket) {
    std::lock_guard lock{inbox_mutex_};
    auto it = std::find_if(waiters_.begin(), waiters_.end(),
                           [ticket](const waiter& w) { return w.ticket == ticket; });
    if (it == waiters_.end()) return false;
    auto w = std::move(*it);
    waiters_.erase(it);
    // Its callable holds Python objects: let it go on the callback thread.
    runner_->post([d = std::move(w.deliver)] { (void)d; });
    return true;
  }

  /// Puts back a notification that an async receiver abandoned after it was
  /// handed over, at the front, so nothing is lost and the order holds.
  void put_back(notification n) {
    std::lock_guard lock{inbox_mutex_};
    if (!waiters_.empty()) {  // a receiver came meanwhile: it is next in line
      auto w = std::move(waiters_.front());
      waiters_.pop_front();
      runner_->post([d = std::move(w.deliver), n = std::move(n)]() mutable { d(std::move(n)); });
      return;
    }
    inbox_.push_front(std::move(n));
    inbox_cv_.notify_one();
  }

 private:
  struct waiter {
    std::uint64_t ticket;
    std::function<void(std::optional<notification>)> deliver;
  };

  // One receive is pending on the engine while the queue has room.
  void arm_receive() {
    const auto ec = with_engine([this](engine& e) {
      e.async_receive_notification(
          [this](std::error_code rec, notification n) { on_notification(rec, std::move(n)); });
    });
    if (ec) close_inbox();
  }

  // On the I/O thread.
  void on_notification(std::error_code ec, notification n) {
    std::unique_lock lock{inbox_mutex_};
    if (ec) {  // the engine closed
      armed_ = false;
      lock.unlock();
      close_inbox();
      return;
    }
    if (!waiters_.empty()) {
      auto w = std::move(waiters_.front());
      waiters_.pop_front();
      runner_->post([d = std::move(w.deliver), n = std::move(n)]() mutable { d(std::move(n)); });
    } else {
      inbox_.push_back(std::move(n));
      inbox_cv_.notify_one();
    }
    armed_ = inbox_.size() < max_queued_notifications;
    const bool again = armed_;
    lock.unlock();
    if (again) arm_receive();
  }

  std::optional<notification> take_locked(std::unique_lock<std::mutex>& lock, bool rearm = true) {
    if (inbox_.empty()) return std::nullopt;
    auto n = std::move(inbox_.front());
    inbox_.pop_front();
    if (rearm) rearm_if_paused(lock);
    return n;
  }

  // Resumes a paused pump. Called with the inbox lock held; releases and
  // retakes it around the engine call.
  void rearm_if_paused(std::unique_lock<std::mutex>& lock) {
    if (armed_ || inbox_closed_ || inbox_.size() >= max_queued_notifications) return;
    armed_ = true;
    lock.unlock();
    arm_receive();
    lock.lock();
  }

  void close_inbox() {
    std::deque<waiter> waiters;
    {
      std::lock_guard lock{inbox_mutex_};
      inbox_closed_ = true;
      waiters.swap(waiters_);
    }
    inbox_cv_.notify_all();
    for (auto& w : waiters) runner_->post([d = std::move(w.deliver)] { d(std::nullopt); });
  }

  // Members in construction order; close() tears them down explicitly.
  std::mutex close_mutex_;
  std::shared_ptr<callback_runner> runner_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  mutable std::shared_mutex life_;  // guards engine_ and closing_
  bool closing_ = false;
  std::unique_ptr<engine> engine_;
  std::thread io_thread_;

  mutable std::mutex segments_mutex_;
  std::map<std::uintptr_t, local_segment> segments_;  // by base address

  std::mutex inbox_mutex_;
  std::condition_variable inbox_cv_;
  std::deque<notification> inbox_;
  std::deque<waiter> waiters_;
  bool armed_ = true;  // a receive is pending on the engine
  bool inbox_closed_ = false;
  std::uint64_t next_ticket_ = 1;
};

}  // namespace kvlink::python
