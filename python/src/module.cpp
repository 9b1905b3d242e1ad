// kvlink._kvlink: the C++ side of the Python package `kvlink`.
//
// Thin on purpose: python/kvlink/__init__.py gives the Pythonic API (pinned
// buffers, asyncio, the config as keyword arguments) and kvlink/mooncake.py
// the Mooncake-compatible one; this file gives them an engine with its own
// I/O thread (host.hpp), operations Python can wait for or be called back
// from (operation.hpp), batches read from lists and arrays (requests.hpp)
// and errors as kvlink.Error (errors.hpp); device memory (GPU, or the
// emulated device in CI) is registered like host memory and reached only
// through its runtime's copy engine (device.hpp, kvlink.DeviceBuffer).
//
// The GIL: every call that waits (a transfer, a connect, an unregistration,
// a receive) waits with the GIL released, on a condition variable, waking
// every 200 ms only to let Python run its signal handlers. The I/O thread
// never takes the GIL.

#include <kvlink/engine.hpp>
#include <kvlink/version.hpp>

#include "device.hpp"
#include "errors.hpp"
#include "host.hpp"
#include "operation.hpp"
#include "requests.hpp"
#include "store.hpp"
#if KVLINK_PYTHON_WITH_RDMA
#include <kvlink/rdma.hpp>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>

namespace kvlink::python {
namespace {

using namespace std::chrono_literals;

std::string access_name(access a) {
  switch (a) {
    case access::none:
      return "none";
    case access::remote_read:
      return "read";
    case access::remote_write:
      return "write";
    case access::remote_read_write:
      return "read_write";
  }
  return "none";
}

access parse_access(const std::string& s) {
  if (s == "none") return access::none;
  if (s == "read") return access::remote_read;
  if (s == "write") return access::remote_write;
  if (s == "read_write") return access::remote_read_write;
  throw py::value_error(
      fmt::format("access: '{}' is not one of 'none', 'read', 'write', 'read_write'", s));
}

/// What Python sees of a segment, local or remote.
struct segment_view {
  std::uint64_t id = 0;
  std::uint64_t base = 0;
  std::uint64_t length = 0;
  std::string access;
};

/// The operation's value, or kvlink.Error. Call once done.
py::object op_result(const operation& op) {
  if (const auto ec = op.error()) raise_error(ec, op.what());
  return std::visit(
      [](auto&& v) -> py::object {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::monostate>) {
          return py::none();
        } else {
          return py::cast(v);
        }
      },
      op.value());
}

/// What a Python kvlink._kvlink.Engine is: the host, and the refusal to
/// close it where that would deadlock.
class py_engine {
 public:
  explicit py_engine(const std::string& config_json) {
    const auto j = nlohmann::json::parse(config_json, nullptr, false);
    if (j.is_discarded()) raise_error(errc::invalid_argument, "engine config: not JSON");
    std::error_code ec;
    std::string what;
    const config cfg = config_from_json(j, ec, &what);
    if (ec) raise_error(ec, "engine config: " + what);
    host_ = translate("kvlink engine", [&] { return std::make_shared<host>(cfg); });
    // The engine took the same runtime from the catalog (one per process).
    std::error_code dec;
    device_ = device_catalog::global().select(cfg.device, dec, what);
  }

  ~py_engine() {
    // Closing waits for the I/O and callback threads, and callbacks need
    // the GIL: never hold it here.
    if (!host_) return;
    if (PyGILState_Check() != 0) {
      py::gil_scoped_release nogil;
      host_.reset();
    } else {
      host_.reset();
    }
  }

  py_engine(const py_engine&) = delete;
  py_engine& operator=(const py_engine&) = delete;

  void close() {
    if (host_->runner()->on_runner_thread()) {
      throw py::value_error(
          "kvlink: Engine.close() from a done-callback would wait for itself; close it from "
          "another thread");
    }
    py::gil_scoped_release nogil;
    host_->close();
  }

  host& h() {
    if (host_->closed()) raise_error(errc::cancelled, "kvlink: the engine is closed");
    return *host_;
  }

  template <class F>
  auto with_engine(std::string_view what, F&& f) {
    using R = decltype(f(std::declval<engine&>()));
    if constexpr (std::is_void_v<R>) {
      if (auto ec = h().with_engine(f)) raise_error(ec, what);
    } else {
      R r{};
      if (auto ec = h().with_engine([&](engine& e) { r = f(e); })) raise_error(ec, what);
      return r;
    }
  }

  // ------------------------------------------------------------- info

  std::string local_address() {
    return with_engine("local_address", [](engine& e) { return e.local_address(); });
  }
  std::string listen_address() {
    return with_engine("listen_address", [](engine& e) { return e.listen_address(); });
  }
  std::string transports() {
    return with_engine("transports", [](engine& e) { return e.transports(); });
  }
  std::string instance() {
    return with_engine("instance", [](engine& e) { return to_string(e.instance()); });
  }
  std::string config_json() {
    return with_engine("config", [](engine& e) { return to_json(e.get_config()).dump(); });
  }
  /// The device runtime's name ("cuda", "emulated"), None without one.
  std::optional<std::string> device_runtime_name() const {
    if (!device_) return std::nullopt;
    return std::string(device_->name());
  }

  // ----------------------------------------------------- registration

  /// `device`: the memory is stated to be device memory (of that device;
  /// -1: whichever the runtime finds); None: host memory unless the
  /// engine's device runtime finds device memory there.
  std::uint64_t register_segment(std::uintptr_t base, std::uint64_t length,
                                 const std::string& granted, std::optional<std::int32_t> device) {
    const access a = parse_access(granted);
    memory_desc memory{};
    if (device) memory = memory_desc{memory_kind::device, *device};
    std::error_code ec;
    std::string what;
    const segment_id id = h().register_segment(base, length, a, memory, ec, &what);
    if (ec) raise_error_text(ec, "register", fmt::format("{} [{}]", what, error_name(ec)));
    return id.value();
  }

  std::shared_ptr<operation> unregister_async(std::uint64_t id) {
    std::error_code ec;
    auto op = h().unregister_segment(segment_id{id}, ec);
    if (ec) raise_error(ec, fmt::format("unregister segment {}", id));
    return op;
  }

  std::vector<segment_view> segments() {
    std::vector<segment_view> out;
    for (const auto& s : h().segments()) out.push_back(view_of(s));
    return out;
  }

  std::optional<segment_view> segment_at(std::uintptr_t base) {
    if (auto s = h().segment_at(base)) return view_of(*s);
    return std::nullopt;
  }

  std::optional<segment_view> segment_holding(std::uintptr_t addr, std::uint64_t length) {
    if (auto s = h().segment_holding(addr, length)) return view_of(*s);
    return std::nullopt;
  }

  // ---------------------------------------------------------- peers

  std::shared_ptr<operation> connect_async(const std::string& name) {
    auto op = h().make_operation("connect to " + name);
    with_engine("connect to " + name, [&](engine& e) {
      e.async_connect(name, asio::bind_cancellation_slot(op->slot(), finish_op{op}));
    });
    return op;
  }

  // -------------------------------------------------------- transfers

  std::shared_ptr<operation> submit(int op_code, const peer& p, py::handle local, py::handle remote,
                                    py::handle lengths, py::handle segments, py::handle notify_id,
                                    py::handle notify_payload,
                                    std::optional<std::int64_t> deadline_ms,
                                    std::optional<bool> checksum) {
    if (!p.valid()) raise_error(errc::unknown_peer, "transfer");
    const opcode op = op_code == 0 ? opcode::read : opcode::write;
    batch_columns b{u64_column::from(local, "local"),
                    u64_column::from(remote, segments.is_none() ? "peer addresses" : "offsets"),
                    u64_column::from(lengths, "lengths"), std::nullopt};
    if (!segments.is_none()) b.segments = u64_column::from(segments, "segments");
    transfer_options opts;
    if (deadline_ms) {
      if (*deadline_ms < 0) throw py::value_error("deadline: must not be negative");
      opts.deadline = std::chrono::milliseconds(*deadline_ms);
    }
    opts.checksum = checksum;
    if (!notify_id.is_none()) {
      opts.notify = notification{py::cast<std::string>(notify_id), bytes_of(notify_payload)};
    }
    std::vector<transfer_request> reqs;
    std::string what;
    std::error_code ec;
    bool built = false;
    std::shared_ptr<operation> result;
    {
      py::gil_scoped_release nogil;  // the columns are only read here
      ec = build_requests(op, p, b, reqs, what);
      built = !ec;
      if (built) {
        result = h_nogil().make_operation(
            fmt::format("{} of {} entries with {}", to_string(op), reqs.size(), p.address()));
        ec = h_nogil().with_engine([&](engine& e) {
          e.async_submit_transfer(reqs, std::move(opts),
                                  asio::bind_cancellation_slot(result->slot(), finish_op{result}));
        });
        if (ec) what = "transfer";
      }
    }
    // build_requests says the whole of what is wrong with an entry (a peer
    // address is the remote side, not a buffer to register here).
    if (ec && !built) raise_error_text(ec, what, fmt::format("{} [{}]", what, error_name(ec)));
    if (ec) raise_error(ec, what);
    return result;
  }

  // ---------------------------------------------------- notifications

  std::shared_ptr<operation> send_notification_async(const peer& p, const std::string& id,
                                                     py::handle payload) {
    auto op = h().make_operation(
        fmt::format("notification '{}' to {}", id, p.valid() ? p.address() : std::string("?")));
    notification n{id, bytes_of(payload)};
    with_engine("send notification",
                [&](engine& e) { e.async_send_notification(p, std::move(n), finish_op{op}); });
    return op;
  }

  py::object receive(std::optional<double> timeout) {
    host& hh = h();
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const auto step = next_step(start, timeout);
      if (!step) return py::none();
      std::optional<notification> n;
      bool closed = false;
      {
        py::gil_scoped_release nogil;
        n = hh.receive(*step, &closed);
      }
      if (n) return py::cast(std::move(*n));
      if (closed) raise_error(errc::cancelled, "receive notification: the engine closed");
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

  std::uint64_t receive_async(py::function deliver) {
    // `deliver` is called on the callback thread, with the GIL.
    return h().receive_async([d = std::move(deliver)](std::optional<notification> n) {
      if (n) {
        d(py::cast(std::move(*n)));
      } else {
        d(py::none());
      }
    });
  }

  bool cancel_receive(std::uint64_t ticket) { return h().cancel_waiter(ticket); }
  void put_back(notification n) { h().put_back(std::move(n)); }
  std::vector<notification> drain() { return h().drain(); }

  // ---------------------------------------------- bytes in local memory

  py::bytes read_bytes(std::uintptr_t addr, std::uint64_t length) {
    if (!h().segment_holding(addr, length)) {
      raise_error(errc::not_registered,
                  fmt::format("read_bytes({:#x}, {}): not inside memory registered with this "
                              "engine",
                              addr, length));
    }
    if (auto* c = copier_for(addr)) {  // device memory: only its copy engine reaches it
      py::bytes out(nullptr, static_cast<py::ssize_t>(length));
      char* dst = PyBytes_AS_STRING(out.ptr());
      std::error_code ec;
      std::string what;
      {
        py::gil_scoped_release nogil;
        ec = c->copy(dst, reinterpret_cast<const void*>(addr), length, false, what);
      }
      if (ec) raise_error(ec, "read_bytes: " + what);
      return out;
    }
    return py::bytes(reinterpret_cast<const char*>(addr), static_cast<py::ssize_t>(length));
  }

  void write_bytes(std::uintptr_t addr, const py::buffer& data, std::optional<std::uint64_t> n) {
    const auto view = data.request();
    const auto have = static_cast<std::uint64_t>(view.size * view.itemsize);
    const std::uint64_t length = n.value_or(have);
    if (length > have) {
      raise_error(errc::invalid_argument,
                  fmt::format("write_bytes: {} bytes asked, the data has {}", length, have));
    }
    if (!h().segment_holding(addr, length)) {
      raise_error(errc::not_registered,
                  fmt::format("write_bytes({:#x}, {}): not inside memory registered with this "
                              "engine",
                              addr, length));
    }
    if (auto* c = copier_for(addr)) {  // device memory: only its copy engine reaches it
      std::error_code ec;
      std::string what;
      {
        py::gil_scoped_release nogil;  // `view` pins the source meanwhile
        ec = c->copy(reinterpret_cast<void*>(addr), view.ptr, length, true, what);
      }
      if (ec) raise_error(ec, "write_bytes: " + what);
      return;
    }
    std::memcpy(reinterpret_cast<void*>(addr), view.ptr, length);
  }

 private:
  // host_ is set for the engine's life; closed() is checked where it matters.
  host& h_nogil() { return *host_; }

  static std::string bytes_of(py::handle o) {
    if (PyUnicode_Check(o.ptr())) return py::cast<std::string>(o);
    const auto view = py::reinterpret_borrow<py::buffer>(o).request();
    return std::string(static_cast<const char*>(view.ptr),
                       static_cast<std::size_t>(view.size * view.itemsize));
  }

  static segment_view view_of(const local_segment& s) {
    return segment_view{s.id.value(), s.base, s.length, access_name(s.granted)};
  }

  /// The copier of the device whose memory `addr` is; null for host memory.
  device_copier* copier_for(std::uintptr_t addr) {
    if (!device_) return nullptr;
    const auto info = device_->classify(reinterpret_cast<const void*>(addr));
    if (info.memory.kind != memory_kind::device) return nullptr;
    std::lock_guard lock{copiers_mutex_};
    auto& c = copiers_[info.memory.device];
    if (!c) c = std::make_unique<device_copier>(device_, info.memory.device);
    return c.get();
  }

  std::shared_ptr<host> host_;
  std::shared_ptr<device_runtime> device_;  // config.device's runtime; null: none
  std::mutex copiers_mutex_;
  std::map<std::int32_t, std::unique_ptr<device_copier>> copiers_;  // by device
};

// ------------------------------------------------------------ config

std::string config_table_json() {
  nlohmann::json rows = nlohmann::json::array();
  const config defaults{};
  for (const auto& s : config_table()) {
    rows.push_back({{"name", s.name},
                    {"env", s.env},
                    {"unit", s.unit},
                    {"doc", s.doc},
                    {"component", s.component},
                    {"secret", s.secret},
                    {"default", s.secret ? nlohmann::json() : get_setting(defaults, s)}});
  }
  return rows.dump();
}

std::string normalize_config(const std::string& json_text, bool use_env) {
  const auto j = nlohmann::json::parse(json_text, nullptr, false);
  if (j.is_discarded()) raise_error(errc::invalid_argument, "config: not JSON");
  std::error_code ec;
  std::string what;
  config base;
  if (use_env) {
    base = config_from_env(base, ec, &what);
    if (ec) raise_error(ec, "config from the environment: " + what);
  }
  const config c = config_from_json(j, ec, &what, base);
  if (ec) raise_error(ec, "config: " + what);
  return to_json(c).dump();
}

std::string describe_config(const std::string& json_text) {
  return describe(config_from_json(nlohmann::json::parse(json_text)));
}

// ----------------------------------------------- page-aligned memory

std::uintptr_t map_pages(std::uint64_t length) {
  if (length == 0) raise_error(errc::invalid_argument, "allocate 0 bytes");
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    raise_error(std::error_code(errno, std::system_category()),
                fmt::format("mmap({} bytes)", length));
  }
  return reinterpret_cast<std::uintptr_t>(p);
}

void unmap_pages(std::uintptr_t addr, std::uint64_t length) {
  if (::munmap(reinterpret_cast<void*>(addr), length) != 0) {
    raise_error(std::error_code(errno, std::system_category()),
                fmt::format("munmap({:#x}, {} bytes)", addr, length));
  }
}

/// (address, bytes) of a C- or Fortran-contiguous buffer; the caller keeps a
/// memoryview of it for as long as the address is used.
py::tuple buffer_address(py::handle obj, bool writable) {
  Py_buffer view;
  const int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) throw py::error_already_set();
  const auto addr = reinterpret_cast<std::uintptr_t>(view.buf);
  const auto len = static_cast<std::uint64_t>(view.len);
  PyBuffer_Release(&view);
  return py::make_tuple(addr, len);
}

}  // namespace
}  // namespace kvlink::python

PYBIND11_MODULE(_kvlink, m) {
  namespace kp = kvlink::python;
  namespace py = pybind11;
  m.doc() = "kvlink's C++ engine; use the `kvlink` package, not this module";
  m.attr("__version__") =
      fmt::format("{}.{}.{}", KVLINK_VERSION_MAJOR, KVLINK_VERSION_MINOR, KVLINK_VERSION_PATCH);
  m.attr("HAS_RDMA") = static_cast<bool>(KVLINK_PYTHON_WITH_RDMA);
  m.attr("HAS_CUDA") = static_cast<bool>(KVLINK_PYTHON_HAS_CUDA);

  kp::error_type() = PyErr_NewExceptionWithDoc(
      "kvlink.Error",
      "A kvlink operation failed. Attributes: errc (the error's name: 'not_registered', "
      "'deadline_exceeded', ... or errno's 'ECONNREFUSED'), value, category, message, context, "
      "mooncake_code (Mooncake Store's integer for a store error, -1 for others).",
      PyExc_RuntimeError, nullptr);
  if (kp::error_type() == nullptr) throw py::error_already_set();
  m.attr("Error") = py::handle(kp::error_type());

  py::class_<kp::segment_view>(m, "SegmentInfo")
      .def_readonly("id", &kp::segment_view::id)
      .def_readonly("base", &kp::segment_view::base)
      .def_readonly("length", &kp::segment_view::length)
      .def_readonly("access", &kp::segment_view::access)
      .def("__repr__", [](const kp::segment_view& s) {
        return fmt::format("SegmentInfo(id={}, base={:#x}, length={}, access='{}')", s.id, s.base,
                           s.length, s.access);
      });

  py::class_<kvlink::transfer_result>(m, "TransferResult")
      .def_readonly("bytes", &kvlink::transfer_result::bytes)
      .def_readonly("requests", &kvlink::transfer_result::requests)
      .def_readonly("slices", &kvlink::transfer_result::slices)
      .def_readonly("lanes", &kvlink::transfer_result::lanes)
      .def_property_readonly("seconds",
                             [](const kvlink::transfer_result& r) {
                               return std::chrono::duration<double>(r.duration).count();
                             })
      .def_property_readonly("gb_per_s", &kvlink::transfer_result::gb_per_s)
      .def("__repr__", [](const kvlink::transfer_result& r) {
        return fmt::format(
            "TransferResult(bytes={}, requests={}, slices={}, lanes={}, "
            "seconds={:.6f})",
            r.bytes, r.requests, r.slices, r.lanes,
            std::chrono::duration<double>(r.duration).count());
      });

  py::class_<kvlink::notification>(m, "Notification")
      .def(py::init([](std::string id, py::bytes payload) {
             return kvlink::notification{std::move(id), std::string(payload)};
           }),
           py::arg("id"), py::arg("payload") = py::bytes())
      .def_readonly("id", &kvlink::notification::id)
      .def_property_readonly("payload",
                             [](const kvlink::notification& n) { return py::bytes(n.payload); })
      .def_readonly("sender", &kvlink::notification::from_address)
      .def_property_readonly("sender_instance",
                             [](const kvlink::notification& n) { return to_string(n.from); })
      .def("__repr__", [](const kvlink::notification& n) {
        return fmt::format("Notification(id='{}', {} payload bytes, sender='{}')", n.id,
                           n.payload.size(), n.from_address);
      });

  py::class_<kvlink::peer>(m, "Peer")
      .def_property_readonly("id", [](const kvlink::peer& p) { return p.id().value(); })
      .def_property_readonly("address", &kvlink::peer::address)
      .def_property_readonly("transport", &kvlink::peer::transport)
      .def_property_readonly("transport_reason", &kvlink::peer::transport_reason)
      .def_property_readonly("connected", &kvlink::peer::connected)
      .def_property_readonly("instance",
                             [](const kvlink::peer& p) { return to_string(p.instance()); })
      .def("segments",
           [](const kvlink::peer& p) {
             std::vector<kp::segment_view> out;
             for (const auto& s : p.segments()) {
               out.push_back(
                   kp::segment_view{s.id.value(), s.base, s.length, kp::access_name(s.granted)});
             }
             return out;
           })
      .def("__repr__", [](const kvlink::peer& p) {
        return p.valid() ? fmt::format("Peer('{}', transport='{}', connected={})", p.address(),
                                       p.transport(), p.connected() ? "True" : "False")
                         : std::string("Peer(<empty>)");
      });

  py::class_<kp::operation, std::shared_ptr<kp::operation>>(m, "Operation")
      .def_property_readonly("what", &kp::operation::what)
      .def("done", &kp::operation::done)
      .def("wait", &kp::wait_op, py::arg("timeout") = py::none())
      .def(
          "result",
          [](kp::operation& op, std::optional<double> timeout) {
            if (!kp::wait_op(op, timeout)) {
              kp::raise_error(kvlink::errc::deadline_exceeded,
                              fmt::format("{}: not done after {} s", op.what(), *timeout));
            }
            return kp::op_result(op);
          },
          py::arg("timeout") = py::none())
      .def("cancel", &kp::operation::cancel)
      .def("add_done_callback", &kp::operation::add_done_callback, py::arg("fn"))
      .def("__repr__", [](const kp::operation& op) {
        return fmt::format("Operation('{}', done={})", op.what(), op.done() ? "True" : "False");
      });

  py::class_<kp::py_engine>(m, "Engine")
      .def(py::init<const std::string&>(), py::arg("config_json"))
      .def("close", &kp::py_engine::close)
      .def_property_readonly("local_address", &kp::py_engine::local_address)
      .def_property_readonly("listen_address", &kp::py_engine::listen_address)
      .def_property_readonly("transports", &kp::py_engine::transports)
      .def_property_readonly("instance", &kp::py_engine::instance)
      .def("config_json", &kp::py_engine::config_json)
      .def_property_readonly("device_runtime", &kp::py_engine::device_runtime_name)
      .def("register", &kp::py_engine::register_segment, py::arg("address"), py::arg("length"),
           py::arg("access"), py::arg("device") = py::none())
      .def("unregister_async", &kp::py_engine::unregister_async, py::arg("segment"))
      .def("segments", &kp::py_engine::segments)
      .def("segment_at", &kp::py_engine::segment_at, py::arg("address"))
      .def("segment_holding", &kp::py_engine::segment_holding, py::arg("address"),
           py::arg("length"))
      .def("connect_async", &kp::py_engine::connect_async, py::arg("name"))
      .def("submit", &kp::py_engine::submit, py::arg("op"), py::arg("peer"), py::arg("local"),
           py::arg("remote"), py::arg("lengths"), py::arg("segments") = py::none(),
           py::arg("notify_id") = py::none(), py::arg("notify_payload") = py::bytes(),
           py::arg("deadline_ms") = py::none(), py::arg("checksum") = py::none())
      .def("send_notification_async", &kp::py_engine::send_notification_async, py::arg("peer"),
           py::arg("id"), py::arg("payload"))
      .def("receive", &kp::py_engine::receive, py::arg("timeout") = py::none())
      .def("receive_async", &kp::py_engine::receive_async, py::arg("deliver"))
      .def("cancel_receive", &kp::py_engine::cancel_receive, py::arg("ticket"))
      .def("put_back", &kp::py_engine::put_back, py::arg("notification"))
      .def("drain", &kp::py_engine::drain)
      .def("read_bytes", &kp::py_engine::read_bytes, py::arg("address"), py::arg("length"))
      .def("write_bytes", &kp::py_engine::write_bytes, py::arg("address"), py::arg("data"),
           py::arg("length") = py::none());

  m.def("config_table_json", &kp::config_table_json);
  m.def("normalize_config", &kp::normalize_config, py::arg("json"), py::arg("use_env"));
  m.def("describe_config", &kp::describe_config, py::arg("json"));
  m.def("transport_names", [] { return kvlink::transport_catalog::global().names(); });
  m.def("map_pages", &kp::map_pages, py::arg("length"));
  m.def("unmap_pages", &kp::unmap_pages, py::arg("address"), py::arg("length"));
  m.def("buffer_address", &kp::buffer_address, py::arg("obj"), py::arg("writable"));
  m.def("device_runtimes", [] { return kvlink::device_catalog::global().names(); });

  // The store client (store.hpp); kvlink.StoreClient is the Python around it.
  py::class_<kp::py_put_config>(m, "PutConfig")
      .def(py::init([](std::size_t replicas, std::vector<std::uint64_t> preferred, bool soft_pin,
                       bool hard_pin) {
             return kp::py_put_config{replicas, std::move(preferred), soft_pin, hard_pin};
           }),
           py::arg("replicas") = 1, py::arg("preferred") = std::vector<std::uint64_t>{},
           py::arg("soft_pin") = false, py::arg("hard_pin") = false)
      .def_readonly("replicas", &kp::py_put_config::replicas)
      .def_readonly("preferred", &kp::py_put_config::preferred)
      .def_readonly("soft_pin", &kp::py_put_config::soft_pin)
      .def_readonly("hard_pin", &kp::py_put_config::hard_pin);

  const auto codes = [](const std::vector<std::error_code>& results) {
    std::vector<std::int32_t> out;
    out.reserve(results.size());
    for (const auto& ec : results) out.push_back(kvlink::mooncake_code(ec));
    return out;
  };
  // A get batch's outcome per key: the bytes read, or Mooncake's code.
  auto sizes_or_codes = [](const kp::py_store::get_outcome& o) {
    std::vector<std::int64_t> out;
    out.reserve(o.results.size());
    for (std::size_t i = 0; i < o.results.size(); ++i) {
      out.push_back(o.results[i] ? kvlink::mooncake_code(o.results[i])
                                 : static_cast<std::int64_t>(o.sizes[i]));
    }
    return out;
  };
  py::class_<kp::py_store>(m, "StoreClient")
      .def(py::init<const std::string&, const std::string&, const std::string&, double, double,
                    const std::string&, std::uint64_t>(),
           py::arg("config_json"), py::arg("master"), py::arg("auth_secret"),
           py::arg("connect_timeout"), py::arg("request_timeout"), py::arg("disk_path") = "",
           py::arg("disk_capacity") = 0)
      .def("close", &kp::py_store::close)
      .def_property_readonly("local_address", &kp::py_store::local_address)
      .def_property_readonly("client_id", &kp::py_store::client_id)
      .def("connect", &kp::py_store::connect)
      .def("mount", &kp::py_store::mount, py::arg("address"), py::arg("size"))
      .def("register", &kp::py_store::register_buffer, py::arg("address"), py::arg("size"))
      .def("unregister", &kp::py_store::unregister_buffer, py::arg("segment"))
      .def(
          "put_batch",
          [codes](kp::py_store& s, py::handle keys, py::handle values, py::handle addresses,
                  py::handle sizes, const kp::py_put_config& cfg) {
            return codes(s.put(keys, values, addresses, sizes, cfg, "put_batch"));
          },
          py::arg("keys"), py::arg("values"), py::arg("addresses"), py::arg("sizes"),
          py::arg("config"))
      .def(
          "put",
          [](kp::py_store& s, const std::string& key, py::handle value, py::handle address,
             py::handle size, const kp::py_put_config& cfg) {
            const std::string what = fmt::format("put '{}'", key);
            py::list keys;
            keys.append(key);
            py::object values = py::none(), addresses = py::none(), sizes = py::none();
            if (!value.is_none()) {
              py::list v;
              v.append(value);
              values = v;
            } else {
              addresses = py::reinterpret_borrow<py::object>(address);
              sizes = py::reinterpret_borrow<py::object>(size);
            }
            const auto r = s.put(keys, values, addresses, sizes, cfg, what);
            if (r[0]) kp::raise_error(r[0], what);
          },
          py::arg("key"), py::arg("value"), py::arg("address"), py::arg("size"), py::arg("config"))
      .def(
          "get_batch",
          [sizes_or_codes](kp::py_store& s, py::handle keys, py::handle buffers,
                           py::handle addresses, py::handle capacities) {
            return sizes_or_codes(s.get(keys, buffers, addresses, capacities, "get_batch"));
          },
          py::arg("keys"), py::arg("buffers"), py::arg("addresses"), py::arg("capacities"))
      .def(
          "put_pieces",
          [codes](kp::py_store& s, py::handle keys, py::handle addresses, py::handle sizes,
                  py::handle counts, const kp::py_put_config& cfg) {
            return codes(s.put_pieces(keys, addresses, sizes, counts, cfg, "put_pieces"));
          },
          py::arg("keys"), py::arg("addresses"), py::arg("sizes"), py::arg("counts"),
          py::arg("config"))
      .def(
          "get_pieces",
          [sizes_or_codes](kp::py_store& s, py::handle keys, py::handle addresses, py::handle sizes,
                           py::handle counts) {
            return sizes_or_codes(s.get_pieces(keys, addresses, sizes, counts, "get_pieces"));
          },
          py::arg("keys"), py::arg("addresses"), py::arg("sizes"), py::arg("counts"))
      .def(
          "get_into",
          [](kp::py_store& s, const std::string& key, py::handle buffer, py::handle address,
             py::handle capacity) {
            const std::string what = fmt::format("get '{}'", key);
            py::list keys;
            keys.append(key);
            py::object buffers = py::none(), addresses = py::none(), caps = py::none();
            if (!buffer.is_none()) {
              py::list b;
              b.append(buffer);
              buffers = b;
            } else {
              addresses = py::reinterpret_borrow<py::object>(address);
              caps = py::reinterpret_borrow<py::object>(capacity);
            }
            const auto o = s.get(keys, buffers, addresses, caps, what);
            if (o.results[0] == kvlink::store_errc::buffer_overflow) {
              kp::raise_error_text(
                  o.results[0], what,
                  fmt::format("{}: the object has {} bytes, the buffer holds fewer [{}]", what,
                              o.sizes[0], kp::error_name(o.results[0])));
            }
            if (o.results[0]) kp::raise_error(o.results[0], what);
            return o.sizes[0];
          },
          py::arg("key"), py::arg("buffer"), py::arg("address"), py::arg("capacity"))
      .def("get_bytes", &kp::py_store::get_bytes, py::arg("key"), py::arg("guess"))
      .def(
          "get_size",
          [](kp::py_store& s, const std::string& key) {
            // A get into no memory: buffer_overflow tells the object's size.
            const std::string what = fmt::format("get_size '{}'", key);
            py::list keys, buffers;
            keys.append(key);
            buffers.append(py::bytearray());
            const auto o = s.get(keys, buffers, py::none(), py::none(), what);
            if (o.results[0] == kvlink::store_errc::buffer_overflow || !o.results[0]) {
              return o.sizes[0];
            }
            kp::raise_error(o.results[0], what);
          },
          py::arg("key"))
      .def(
          "exists_batch",
          [](kp::py_store& s, py::handle keys) {
            const auto r = s.keys_call(keys, true, false, "exists_batch");
            std::vector<std::int32_t> out;
            out.reserve(r.size());
            for (const auto& ec : r) {
              const bool absent = ec == kvlink::store_errc::object_not_found ||
                                  ec == kvlink::store_errc::object_in_progress;
              out.push_back(!ec ? 1 : absent ? 0 : kvlink::mooncake_code(ec));
            }
            return out;
          },
          py::arg("keys"))
      .def(
          "exists",
          [](kp::py_store& s, const std::string& key) {
            const std::string what = fmt::format("exists '{}'", key);
            py::list keys;
            keys.append(key);
            const auto r = s.keys_call(keys, true, false, what);
            if (!r[0]) return true;
            if (r[0] == kvlink::store_errc::object_not_found ||
                r[0] == kvlink::store_errc::object_in_progress) {
              return false;
            }
            kp::raise_error(r[0], what);
          },
          py::arg("key"))
      .def(
          "remove_batch",
          [codes](kp::py_store& s, py::handle keys, bool force) {
            return codes(s.keys_call(keys, false, force, "remove_batch"));
          },
          py::arg("keys"), py::arg("force"))
      .def(
          "remove",
          [](kp::py_store& s, const std::string& key, bool force) {
            const std::string what = fmt::format("remove '{}'", key);
            py::list keys;
            keys.append(key);
            const auto r = s.keys_call(keys, false, force, what);
            if (r[0]) kp::raise_error(r[0], what);
          },
          py::arg("key"), py::arg("force"))
      .def("remove_all", &kp::py_store::remove_all, py::arg("force"))
      .def("describe_batch", &kp::py_store::describe_batch, py::arg("keys"))
      .def("stats", &kp::py_store::stats);

  py::class_<kp::py_device_buffer>(m, "DeviceBuffer",
                                   "Device memory of a runtime, reached only through its copy "
                                   "engine: a test and CI aid (runtime 'emulated' needs no GPU)")
      .def(py::init<std::uint64_t, std::int32_t, const std::string&>(), py::arg("nbytes"),
           py::arg("device") = 0, py::arg("runtime") = "emulated")
      .def_property_readonly("ptr", &kp::py_device_buffer::ptr)
      .def_property_readonly("nbytes", &kp::py_device_buffer::nbytes)
      .def_property_readonly("device", &kp::py_device_buffer::device)
      .def_property_readonly("runtime", &kp::py_device_buffer::runtime)
      .def_property_readonly("__cuda_array_interface__",
                             &kp::py_device_buffer::cuda_array_interface)
      .def("write", &kp::py_device_buffer::write, py::arg("offset"), py::arg("data"))
      .def("read", &kp::py_device_buffer::read, py::arg("offset"), py::arg("n"))
      .def("__len__", &kp::py_device_buffer::nbytes)
      .def("__repr__", &kp::py_device_buffer::repr);
}
