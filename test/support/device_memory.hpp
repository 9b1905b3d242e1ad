// Test memory of either kind: host bytes, or device memory of the runtime
// under test (KVLINK_TEST_DEVICE: "emulated" by default, "cuda" in the
// tests labelled cuda), filled and read back only through the device's
// copy engine, as a user of a real GPU would.
#pragma once

#include <kvlink/memory/device.hpp>
#include <kvlink/memory/emulated.hpp>
#ifdef KVLINK_TEST_HAS_CUDA
#include <kvlink/cuda.hpp>
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>

namespace kvlink_test {

/// The device runtime the test runs on: KVLINK_TEST_DEVICE, or "emulated".
inline std::string device_under_test() {
  const char* v = std::getenv("KVLINK_TEST_DEVICE");
  return v && *v ? v : "emulated";
}

/// The runtime under test, or null with `why` (missing, unavailable).
inline std::shared_ptr<kvlink::device_runtime> device_runtime_under_test(std::string& why) {
  const auto name = device_under_test();
  auto rt = kvlink::device_catalog::global().find(name);
  if (!rt) {
    why = "this test program has no '" + name + "' device runtime";
    return nullptr;
  }
  if (!rt->available()) {
    why = "the '" + name + "' device runtime is not usable here: " + rt->unavailable_reason();
    return nullptr;
  }
  return rt;
}

/// Exits with 77 (ctest: skipped) when the runtime under test cannot run
/// here: a test labelled cuda without a GPU reports skipped, never passed.
inline std::shared_ptr<kvlink::device_runtime> require_device_or_skip() {
  std::string why;
  auto rt = device_runtime_under_test(why);
  if (!rt) {
    std::fprintf(stderr, "SKIPPED: %s\n", why.c_str());
    std::exit(77);
  }
  return rt;
}

/// Synchronous copy through a stream of `rt` (tests only).
inline std::error_code device_copy(kvlink::device_runtime& rt, std::int32_t device, void* dst,
                                   const void* src, std::size_t n) {
  asio::io_context io;
  std::error_code ec;
  std::string what;
  auto s = rt.open_stream(device, io.get_executor(), ec, what);
  if (!s) return ec;
  std::optional<std::error_code> done;
  // The completion comes from the stream's thread: without work the
  // io_context would stop before it is posted, and never run it. (A
  // stream counts its copies as work; this guard does not rely on it.)
  auto work = asio::make_work_guard(io);
  s->async_copy(dst, {}, src, {}, n, [&](std::error_code e) {
    done = e;
    work.reset();
  });
  io.run();
  return done ? *done : make_error_code(kvlink::errc::device_error);
}

/// `n` bytes of host or device memory.
class test_memory {
 public:
  test_memory(std::size_t n, bool device, std::shared_ptr<kvlink::device_runtime> rt,
              std::int32_t dev = 0)
      : n_(n), rt_(std::move(rt)), dev_(dev) {
    if (device) {
      buf_.emplace(rt_, dev, n);
    } else {
      host_.resize(n);
    }
  }
  std::byte* data() { return buf_ ? buf_->data() : host_.data(); }
  std::size_t size() const { return n_; }
  bool device() const { return buf_.has_value(); }

  void write(std::size_t offset, const std::byte* src, std::size_t n) {
    if (n == 0) return;  // src may be null: no copy of nothing
    if (!buf_) {
      std::memcpy(host_.data() + offset, src, n);
      return;
    }
    const auto ec = device_copy(*rt_, dev_, buf_->data() + offset, src, n);
    if (ec) throw std::system_error(ec, "test_memory::write");
  }
  std::vector<std::byte> read(std::size_t offset, std::size_t n) {
    std::vector<std::byte> out(n);
    if (n == 0) return out;  // out.data() may be null
    if (!buf_) {
      std::memcpy(out.data(), host_.data() + offset, n);
      return out;
    }
    const auto ec = device_copy(*rt_, dev_, out.data(), buf_->data() + offset, n);
    if (ec) throw std::system_error(ec, "test_memory::read");
    return out;
  }
  std::vector<std::byte> snapshot() { return read(0, n_); }

 private:
  std::size_t n_;
  std::shared_ptr<kvlink::device_runtime> rt_;
  std::int32_t dev_;
  std::vector<std::byte> host_;
  std::optional<kvlink::device_buffer> buf_;
};

}  // namespace kvlink_test
