// How the binding hands asynchronous results to Python.
//
// An `operation` is one asynchronous call of the engine (a transfer, a
// connect, a notification sent, an unregistration) as Python sees it: its
// handler runs on the engine's I/O thread and only stores the outcome and
// wakes waiters (no GIL there, ever); Python threads block on it with the GIL
// released, and asyncio registers a done-callback, which a `callback_runner`
// calls on a thread of its own with the GIL (so a busy interpreter never
// stalls the I/O thread).
#pragma once

#include <kvlink/engine.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include <asio/cancellation_signal.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <pybind11/pybind11.h>

namespace kvlink::python {

namespace py = pybind11;

/// Calls Python callables, with the GIL, on a thread of its own. post() is
/// thread-safe and never takes the GIL; stop() lets what is queued run, then
/// joins (call it without holding the GIL). The thread holds the runner, so
/// the last owner may let go of it from inside a callback.
class callback_runner {
  struct private_tag {};

 public:
  static std::shared_ptr<callback_runner> start() {
    auto r = std::make_shared<callback_runner>(private_tag{});
    r->thread_ = std::thread([r] { r->run(); });
    return r;
  }
  explicit callback_runner(private_tag) {}
  ~callback_runner() {
    // Last released by the thread itself once run() returned: it cannot join itself.
    if (thread_.joinable()) {
      if (on_runner_thread()) {
        thread_.detach();
      } else {
        thread_.join();
      }
    }
  }
  callback_runner(const callback_runner&) = delete;
  callback_runner& operator=(const callback_runner&) = delete;

  /// Queues `f`, which runs, and is destroyed, with the GIL held.
  void post(std::function<void()> f) {
    {
      std::lock_guard lock{mutex_};
      if (!stopping_) {
        queue_.push_back(std::move(f));
        cv_.notify_one();
        return;
      }
    }
    // Stopped: only reachable if an operation outlives its engine's close,
    // which close() rules out; run it here rather than lose it.
    py::gil_scoped_acquire gil;
    call(f);
    f = nullptr;
  }

  /// Lets the queued callbacks run and ends the thread; returns once it has
  /// (at once when called from a callback).
  void stop() {
    {
      std::lock_guard lock{mutex_};
      stopping_ = true;
    }
    cv_.notify_one();
    if (on_runner_thread()) return;
    std::unique_lock lock{mutex_};
    cv_.wait(lock, [this] { return finished_; });
  }

  bool on_runner_thread() const noexcept { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void run() {
    for (;;) {
      std::deque<std::function<void()>> batch;
      {
        std::unique_lock lock{mutex_};
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) {  // stopping, and everything ran
          finished_ = true;
          cv_.notify_all();
          return;
        }
        batch.swap(queue_);
      }
      py::gil_scoped_acquire gil;
      for (auto& f : batch) {
        call(f);
        f = nullptr;  // its captures go while the GIL is held
      }
    }
  }

  static void call(const std::function<void()>& f) {
    try {
      f();
    } catch (py::error_already_set& e) {
      // A callback's exception has nobody to go to: report it the way
      // Python reports one raised in __del__.
      e.discard_as_unraisable("kvlink done-callback");
    } catch (const std::exception& e) {
      PyErr_WarnEx(PyExc_RuntimeWarning, e.what(), 1);
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  bool finished_ = false;
  std::thread thread_;
};

/// One asynchronous call's outcome. Thread-safe. finish() is called once, by
/// the handler, on the I/O thread; everything else from Python threads.
class operation : public std::enable_shared_from_this<operation> {
 public:
  using value_type = std::variant<std::monostate, transfer_result, peer>;

  operation(std::string what, std::shared_ptr<callback_runner> runner, asio::io_context& io)
      : what_(std::move(what)), runner_(std::move(runner)), io_(io) {}

  /// What was asked ("write of 3 entries to 127.0.0.1:17001"), for messages.
  const std::string& what() const noexcept { return what_; }

  /// The slot the engine's initiating function connects its cancellation to.
  asio::cancellation_slot slot() { return signal_.slot(); }

  void finish(std::error_code ec, value_type v) {
    std::vector<py::object> callbacks;
    {
      std::lock_guard lock{mutex_};
      ec_ = ec;
      value_ = std::move(v);
      done_ = true;
      callbacks.swap(callbacks_);
    }
    cv_.notify_all();
    // Moving a py::object does not touch its reference count: no GIL needed.
    for (auto& cb : callbacks) runner_->post([f = std::move(cb)] { f(); });
  }

  bool done() const {
    std::lock_guard lock{mutex_};
    return done_;
  }

  /// Blocks until done or `timeout` passed; true when done. No GIL held.
  bool wait_for(std::chrono::nanoseconds timeout) {
    std::unique_lock lock{mutex_};
    return cv_.wait_for(lock, timeout, [this] { return done_; });
  }

  void wait() {
    std::unique_lock lock{mutex_};
    cv_.wait(lock, [this] { return done_; });
  }

  /// Asks the engine to stop the operation (terminal cancellation, emitted
  /// on the I/O thread, which alone touches the signal after initiation).
  /// It completes later, with errc::cancelled unless it finished first.
  void cancel() {
    std::lock_guard lock{mutex_};
    // While not done the engine, and so the io_context, is alive: close()
    // waits for every operation to finish.
    if (done_) return;
    asio::post(io_, [self = shared_from_this()] {
      self->signal_.emit(asio::cancellation_type::terminal);
    });
  }

  /// Calls `fn()` once done: at once, here, when already done (the caller
  /// holds the GIL), else from the callback thread.
  void add_done_callback(py::object fn) {
    {
      std::lock_guard lock{mutex_};
      if (!done_) {
        callbacks_.push_back(std::move(fn));
        return;
      }
    }
    fn();
  }

  /// The outcome; call once done.
  std::error_code error() const {
    std::lock_guard lock{mutex_};
    return ec_;
  }
  value_type value() const {
    std::lock_guard lock{mutex_};
    return value_;
  }

 private:
  const std::string what_;
  std::shared_ptr<callback_runner> runner_;
  asio::io_context& io_;
  asio::cancellation_signal signal_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::error_code ec_;
  value_type value_;
  std::vector<py::object> callbacks_;  // only with the GIL held, or moved out
};

/// A handler for the engine's initiating functions that finishes `op`.
struct finish_op {
  std::shared_ptr<operation> op;
  void operator()(std::error_code ec) const { op->finish(ec, std::monostate{}); }
  void operator()(std::error_code ec, transfer_result r) const { op->finish(ec, r); }
  void operator()(std::error_code ec, peer p) const { op->finish(ec, std::move(p)); }
};

// How long a blocking wait may sleep before it wakes up again: at most
// 200 ms (so that Python can run its signal handlers), at most what is left
// of `timeout` seconds since `start`; nullopt once that has passed.
inline std::optional<std::chrono::nanoseconds> next_step(
    std::chrono::steady_clock::time_point start, std::optional<double> timeout) {
  std::chrono::nanoseconds step = std::chrono::milliseconds(200);
  if (timeout) {
    const auto left =
        std::chrono::duration<double>(*timeout) - (std::chrono::steady_clock::now() - start);
    if (left.count() <= 0) return std::nullopt;
    step = std::min(step, std::chrono::duration_cast<std::chrono::nanoseconds>(left));
  }
  return step;
}

// Waits for `op` with the GIL released, waking up as next_step() says: a
// signal handler that raises (Ctrl-C) cancels the operation, waits for it to
// finish (nothing touches the caller's memory after that) and lets the
// exception through. True when done within `timeout` seconds.
inline bool wait_op(operation& op, std::optional<double> timeout) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const auto step = next_step(start, timeout);
    if (!step) return op.done();
    bool done = false;
    {
      py::gil_scoped_release nogil;
      done = op.wait_for(*step);
    }
    if (done) return true;
    if (PyErr_CheckSignals() != 0) {
      op.cancel();
      {
        py::gil_scoped_release nogil;
        op.wait();
      }
      throw py::error_already_set();
    }
  }
}

}  // namespace kvlink::python
