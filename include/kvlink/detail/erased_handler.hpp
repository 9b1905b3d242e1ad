// A move-only, type-erased completion handler. The engine's initiating
// functions are thin templates that wrap whatever handler the completion
// token produced into one of these and forward to non-template code (the
// {fmt} "format -> vformat" idea applied to Asio), which keeps compile times
// and code size down.
//
// Contract (Asio's): while the operation is pending, outstanding work is
// counted on the handler's associated executor; complete() frees the erased
// state before the upcall and never invokes the handler inline: it is posted
// to the handler's associated executor (default: the I/O executor given at
// construction).
#pragma once

#include <memory>
#include <tuple>
#include <utility>

#include <asio/associated_executor.hpp>
#include <asio/defer.hpp>
#include <asio/executor_work_guard.hpp>

namespace kvlink::detail {

template <class Signature>
class erased_handler;

template <class... Args>
class erased_handler<void(Args...)> {
  struct base {
    virtual ~base() = default;
    virtual void post(Args... args) = 0;
  };

  template <class Handler, class IoExecutor>
  struct impl final : base {
    using executor_type = asio::associated_executor_t<Handler, IoExecutor>;

    impl(Handler&& h, const IoExecutor& io)
        : work_(asio::get_associated_executor(h, io)), handler_(std::move(h)) {}

    void post(Args... args) override {
      // Move everything out of *this: the caller destroys the erased state
      // right after this returns, before the handler runs.
      auto work = std::move(work_);
      auto ex = work.get_executor();
      // defer: the handler continues this call, so from a thread running
      // its io_context it runs there next rather than waking another thread
      // (a wake-up costs microseconds; a small transfer costs less).
      asio::defer(ex, [h = std::move(handler_), w = std::move(work),
                       a = std::make_tuple(std::move(args)...)]() mutable {
        w.reset();
        std::apply(std::move(h), std::move(a));
      });
    }

    asio::executor_work_guard<executor_type> work_;
    Handler handler_;
  };

 public:
  erased_handler() = default;

  template <class Handler, class IoExecutor>
  erased_handler(Handler&& h, const IoExecutor& io)
      : impl_(std::make_unique<impl<std::decay_t<Handler>, IoExecutor>>(std::forward<Handler>(h),
                                                                        io)) {}

  erased_handler(erased_handler&&) noexcept = default;
  erased_handler& operator=(erased_handler&&) noexcept = default;

  explicit operator bool() const noexcept { return impl_ != nullptr; }

  /// Posts the handler with `args`; the erased state is gone once this
  /// returns. Calling it on an empty handler does nothing.
  void complete(Args... args) {
    if (auto p = std::move(impl_)) {
      p->post(std::move(args)...);
    }
  }

 private:
  std::unique_ptr<base> impl_;
};

}  // namespace kvlink::detail
