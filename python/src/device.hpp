// Device (GPU) memory from Python: synchronous copies through a device
// runtime's copy engine (the CPU cannot touch device memory), the runtime an
// engine's config names, and kvlink.DeviceBuffer: device memory of a runtime
// with __cuda_array_interface__, for tests and CI ("emulated": no GPU needed).
//
// The runtimes are those of this module's device catalog: "emulated"
// always, "cuda" when the module was built with kvlink::cuda
// (KVLINK_PYTHON_WITH_CUDA).
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/memory/config.hpp>
#include <kvlink/memory/device.hpp>
#include <kvlink/memory/emulated.hpp>
#if KVLINK_PYTHON_WITH_CUDA && __has_include(<kvlink/cuda.hpp>)
#include <kvlink/cuda.hpp>
#define KVLINK_PYTHON_HAS_CUDA 1
#else
#define KVLINK_PYTHON_HAS_CUDA 0
#endif

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "errors.hpp"
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <fmt/format.h>
#include <pybind11/pybind11.h>

namespace kvlink::python {

namespace py = pybind11;

/// Copies between host memory and device memory of one device, waiting for
/// each: a stream of the runtime whose completions the calling thread runs.
/// Thread safety: any thread; one copy at a time. Call without the GIL.
class device_copier {
 public:
  device_copier(std::shared_ptr<device_runtime> rt, std::int32_t device)
      : rt_(std::move(rt)), device_(device) {}
  device_copier(const device_copier&) = delete;
  device_copier& operator=(const device_copier&) = delete;

  /// `to_device`: host `src` -> device `dst`; else device `src` -> host `dst`.
  std::error_code copy(void* dst, const void* src, std::size_t n, bool to_device,
                       std::string& what) {
    std::lock_guard lock{mutex_};
    std::error_code ec;
    if (!stream_) {
      stream_ = rt_->open_stream(device_, io_.get_executor(), ec, what);
      if (!stream_) return ec;
    }
    const memory_desc dev{memory_kind::device, device_};
    const memory_desc host{};
    std::optional<std::error_code> done;
    io_.restart();
    // Held while the copy runs: run_one() waits for its completion instead
    // of returning at once for want of work.
    auto work = asio::make_work_guard(io_);
    stream_->async_copy(dst, to_device ? dev : host, src, to_device ? host : dev, n,
                        [&done](std::error_code e) { done = e; });
    while (!done) io_.run_one();
    if (*done) {
      what = fmt::format("{} copy of {} bytes on {} device {}",
                         to_device ? "host-to-device" : "device-to-host", n, rt_->name(), device_);
    }
    return *done;
  }

 private:
  std::shared_ptr<device_runtime> rt_;
  std::int32_t device_;
  std::mutex mutex_;
  asio::io_context io_;
  std::shared_ptr<device_stream> stream_;  // after io_: closed before it
};

/// The runtime `name` names (as config.device does: "auto" is CUDA where
/// present). null for "none" and for "auto" without a GPU; kvlink.Error
/// saying `who` asked for a runtime this module lacks or one not usable here.
inline std::shared_ptr<device_runtime> runtime_named(const std::string& name,
                                                     std::string_view who) {
  device_config c;
  c.runtime = name;
  std::string what;
  std::error_code ec = validate(c, &what);
  std::shared_ptr<device_runtime> rt;
  if (!ec) rt = device_catalog::global().select(c, ec, what);
  if (ec) raise_error_text(ec, who, fmt::format("{}: {} [{}]", who, what, error_name(ec)));
  return rt;
}

/// kvlink.DeviceBuffer: `nbytes` of device memory of a runtime, filled and
/// read only through its copy engine (a test and CI aid: with "emulated"
/// any CPU access faults, as with a GPU's memory).
class py_device_buffer {
 public:
  py_device_buffer(std::uint64_t nbytes, std::int32_t device, const std::string& runtime) {
    rt_ = runtime_named(runtime, fmt::format("DeviceBuffer(runtime='{}')", runtime));
    if (!rt_) {
      raise_error_text(errc::no_device, "DeviceBuffer",
                       fmt::format("DeviceBuffer: runtime '{}' finds no GPU runtime here "
                                   "(this module has: {}); use runtime='emulated' in tests",
                                   runtime, device_catalog::global().names()));
    }
    if (nbytes == 0) {
      raise_error_text(errc::invalid_argument, "DeviceBuffer", "DeviceBuffer: nbytes must be > 0");
    }
    buf_ = translate("DeviceBuffer", [&] {
      return device_buffer{rt_, device, static_cast<std::size_t>(nbytes)};
    });
    device_ = device;
    copier_ = std::make_unique<device_copier>(rt_, device);
  }

  std::uintptr_t ptr() const noexcept { return reinterpret_cast<std::uintptr_t>(buf_.data()); }
  std::uint64_t nbytes() const noexcept { return buf_.size(); }
  std::int32_t device() const noexcept { return device_; }
  std::string runtime() const { return std::string(rt_->name()); }

  /// Copies `data` (any contiguous buffer) to [offset, offset + len).
  void write(std::uint64_t offset, py::handle data) {
    Py_buffer view;
    if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_ANY_CONTIGUOUS) != 0) {
      throw py::error_already_set();
    }
    const auto n = static_cast<std::uint64_t>(view.len);
    std::error_code ec;
    std::string what;
    if (!in_bounds(offset, n)) {
      PyBuffer_Release(&view);
      raise_error_text(errc::out_of_bounds, "DeviceBuffer.write",
                       fmt::format("DeviceBuffer.write({}, {} bytes): the buffer has {} bytes",
                                   offset, n, nbytes()));
    }
    {
      py::gil_scoped_release nogil;  // the view pins the source meanwhile
      ec = copier_->copy(buf_.data() + offset, view.buf, n, true, what);
    }
    PyBuffer_Release(&view);
    if (ec) raise_error(ec, "DeviceBuffer.write: " + what);
  }

  /// The bytes at [offset, offset + n).
  py::bytes read(std::uint64_t offset, std::uint64_t n) {
    if (!in_bounds(offset, n)) {
      raise_error_text(errc::out_of_bounds, "DeviceBuffer.read",
                       fmt::format("DeviceBuffer.read({}, {} bytes): the buffer has {} bytes",
                                   offset, n, nbytes()));
    }
    // The bytes object is filled in place: no second copy.
    py::bytes out(nullptr, static_cast<py::ssize_t>(n));
    char* dst = PyBytes_AS_STRING(out.ptr());
    std::error_code ec;
    std::string what;
    {
      py::gil_scoped_release nogil;  // `out` is ours alone until returned
      ec = copier_->copy(dst, buf_.data() + offset, n, false, what);
    }
    if (ec) raise_error(ec, "DeviceBuffer.read: " + what);
    return out;
  }

  /// Version 3 of the CUDA Array Interface: one dimension of bytes.
  py::dict cuda_array_interface() const {
    py::dict d;
    d["shape"] = py::make_tuple(nbytes());
    d["typestr"] = "|u1";
    d["data"] = py::make_tuple(ptr(), false);
    d["strides"] = py::none();
    d["version"] = 3;
    return d;
  }

  std::string repr() const {
    return fmt::format("DeviceBuffer(nbytes={}, device={}, runtime='{}', ptr={:#x})", nbytes(),
                       device_, rt_->name(), ptr());
  }

 private:
  bool in_bounds(std::uint64_t offset, std::uint64_t n) const noexcept {
    return offset <= nbytes() && n <= nbytes() - offset;
  }

  std::shared_ptr<device_runtime> rt_;
  device_buffer buf_;  // freed before the runtime it came from
  std::int32_t device_ = 0;
  std::unique_ptr<device_copier> copier_;  // first to go: no copy outlives the buffer
};

}  // namespace kvlink::python
