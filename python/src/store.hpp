// What a Python kvlink.StoreClient is: a kvlink::store::client over an
// engine of its own (a host: its I/O thread, its callback thread), with
// batches read from Python columns and results handed back per key.
//
// Memory: the client moves bytes only between memory registered with its
// engine. A caller's buffer that lies inside memory registered through this
// client (StoreClient.register) is used in place; any other buffer goes
// through page-aligned staging memory registered for that one call (one
// memcpy each way), so that any buffer-protocol object works. Addresses
// (put_from / get_into by address) must lie in registered memory: they are
// never copied from or to blindly.
//
// Waiting: every call waits for its completion with the GIL released
// (wait_op: it wakes every 200 ms for Python's signal handlers and, on
// Ctrl-C, still waits for the operation before raising, so nothing touches
// the caller's memory afterwards). The waits are bounded by the client:
// request_timeout for each master round trip, the engine's transfer
// deadline for the bytes.
#pragma once

#include <kvlink/engine.hpp>
#include <kvlink/memory/device.hpp>
#include <kvlink/store/client/client.hpp>
#include <kvlink/store/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "host.hpp"
#include "operation.hpp"
#include "requests.hpp"
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <pybind11/pybind11.h>
#include <sys/mman.h>

namespace kvlink::python {

/// A contiguous buffer of a Python object, held while the store uses it.
/// Made and destroyed with the GIL held; its memory is read and written
/// without it.
class held_buffer {
 public:
  held_buffer(py::handle obj, bool writable, std::string_view what) {
    const int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
      PyErr_Clear();
      throw py::type_error(fmt::format(
          "{}: a {}contiguous buffer is needed (bytes-like, numpy array, memoryview), not {}", what,
          writable ? "writable " : "", Py_TYPE(obj.ptr())->tp_name));
    }
    held_ = true;
  }
  held_buffer(held_buffer&& o) noexcept : view_(o.view_), held_(std::exchange(o.held_, false)) {}
  held_buffer& operator=(held_buffer&&) = delete;
  held_buffer(const held_buffer&) = delete;
  held_buffer& operator=(const held_buffer&) = delete;
  ~held_buffer() {
    if (held_) PyBuffer_Release(&view_);
  }

  void* data() const noexcept { return view_.buf; }
  std::uint64_t size() const noexcept { return static_cast<std::uint64_t>(view_.len); }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

/// Page-aligned memory registered with the engine (no remote access) for
/// one call; unregistered and unmapped when destroyed. Needs no GIL.
class staging {
 public:
  staging(host& h, std::uint64_t size) : h_(h), size_(size) {
    if (size_ == 0) return;
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      ec_ = std::error_code(errno, std::system_category());
      what_ = fmt::format("staging memory: mmap({} bytes)", size_);
      return;
    }
    base_ = static_cast<std::byte*>(p);
    std::string why;
    seg_ = h_.register_segment(reinterpret_cast<std::uintptr_t>(base_), size_, access::none,
                               memory_desc{}, ec_, &why);
    if (ec_) what_ = "staging memory: " + why;
  }
  staging(const staging&) = delete;
  staging& operator=(const staging&) = delete;
  ~staging() {
    if (seg_.valid() && !ec_) {
      std::error_code ec;
      // Completes once no access of the engine touches it (then unmapped).
      if (auto op = h_.unregister_segment(seg_, ec)) op->wait();
    }
    if (base_ != nullptr) ::munmap(base_, size_);
  }

  /// Why it could not be made (with what()); empty when it was.
  std::error_code error() const noexcept { return ec_; }
  const std::string& what() const noexcept { return what_; }
  std::byte* data() const noexcept { return base_; }

 private:
  host& h_;
  std::uint64_t size_ = 0;
  std::byte* base_ = nullptr;
  segment_id seg_{};
  std::error_code ec_;
  std::string what_;
};

/// Placement of a put (store::put_config) as Python passes it.
struct py_put_config {
  std::size_t replicas = 1;
  std::vector<std::uint64_t> preferred;
  bool soft_pin = false;
  bool hard_pin = false;

  store::put_config get() const {
    store::put_config c;
    c.replicas = replicas;
    c.preferred = preferred;
    c.soft_pin = soft_pin;
    c.hard_pin = hard_pin;
    return c;
  }
};

class py_store {
 public:
  py_store(const std::string& config_json, const std::string& master, const std::string& secret,
           double connect_timeout, double request_timeout, const std::string& disk_path,
           std::uint64_t disk_capacity) {
    const auto j = nlohmann::json::parse(config_json, nullptr, false);
    if (j.is_discarded()) raise_error(errc::invalid_argument, "engine config: not JSON");
    std::error_code ec;
    std::string what;
    const config cfg = config_from_json(j, ec, &what);
    if (ec) raise_error(ec, "engine config: " + what);
    if (!(connect_timeout > 0) || !(request_timeout > 0)) {
      raise_error(errc::invalid_argument,
                  "StoreClient: connect_timeout and request_timeout must be > 0 seconds");
    }
    store::client_options opt;
    opt.master = master;
    opt.auth_secret = secret;
    opt.connect_timeout = to_ms(connect_timeout);
    opt.request_timeout = to_ms(request_timeout);
    opt.disk_path = disk_path;
    opt.disk_capacity = disk_capacity;
    host_ = translate("kvlink store client engine", [&] { return std::make_shared<host>(cfg); });
    // The SSD tier opens with the client: a directory it cannot use throws.
    translate("kvlink store client", [&] {
      try {
        (void)host_->with_engine(
            [&](engine& e) { client_ = std::make_unique<store::client>(e, std::move(opt)); });
      } catch (const std::invalid_argument& e) {
        throw std::system_error(make_error_code(errc::invalid_argument), e.what());
      }
    });
  }

  ~py_store() {
    // Closing waits for the engine's threads: never with the GIL.
    if (PyGILState_Check() != 0) {
      py::gil_scoped_release nogil;
      close_nogil();
    } else {
      close_nogil();
    }
  }
  py_store(const py_store&) = delete;
  py_store& operator=(const py_store&) = delete;

  /// Leaves the pool (this client's segments are unmounted), then closes
  /// the engine. Idempotent.
  void close() {
    py::gil_scoped_release nogil;
    close_nogil();
  }

  std::string local_address() {
    std::string out;
    if (auto ec = host_->with_engine([&](engine& e) { out = e.local_address(); })) {
      raise_error(ec, "local_address");
    }
    return out;
  }

  std::uint64_t client_id() {
    std::shared_lock lock{life_};
    return client_ ? client_->id() : 0;
  }

  void connect() {
    run("connect to the store master", [](store::client& c, auto done) {
      c.async_connect([done](std::error_code ec) { done(ec); });
    });
  }

  /// Gives [base, base + size) to the pool; the store's segment id.
  std::uint64_t mount(std::uintptr_t base, std::uint64_t size) {
    auto seg = std::make_shared<std::uint64_t>(0);
    run(fmt::format("mount {} bytes", size), [&](store::client& c, auto done) {
      c.async_mount(reinterpret_cast<void*>(base), size,
                    [done, seg](std::error_code ec, std::uint64_t s) {
                      *seg = s;
                      done(ec);
                    });
    });
    return *seg;
  }

  /// Registers [base, base + size) with the engine (local use only), so
  /// puts from and gets into it need no staging copy: host memory, or
  /// device memory of the engine's runtime (what it is, the runtime says).
  std::uint64_t register_buffer(std::uintptr_t base, std::uint64_t size) {
    std::error_code ec;
    std::string what;
    const auto id = h().register_segment(base, size, access::none, memory_desc{}, ec, &what);
    if (ec) raise_error_text(ec, "register", fmt::format("{} [{}]", what, error_name(ec)));
    return id.value();
  }

  void unregister_buffer(std::uint64_t id) {
    std::error_code ec;
    auto op = h().unregister_segment(segment_id{id}, ec);
    if (ec) raise_error(ec, fmt::format("unregister segment {}", id));
    wait_op(*op, std::nullopt);
    if (auto e = op->error()) raise_error(e, op->what());
  }

  // ------------------------------------------------------------- puts

  /// One result per key: {} or the key's error. `values`: a list of
  /// buffers, or None with `addresses` and `sizes` (registered memory).
  std::vector<std::error_code> put(py::handle keys, py::handle values, py::handle addresses,
                                   py::handle sizes, const py_put_config& pc,
                                   std::string_view what) {
    auto k = read_keys(keys, what);
    const std::size_t n = k.keys.size();
    std::vector<held_buffer> held;
    std::vector<const void*> data(n);
    std::vector<std::uint64_t> lens(n);
    if (!values.is_none()) {
      if (!addresses.is_none() || !sizes.is_none()) {
        throw py::type_error(
            fmt::format("{}: give values, or addresses and sizes, not both", what));
      }
      auto seq = sequence(values, "values", what);
      check_count(PySequence_Fast_GET_SIZE(seq.ptr()), n, "values", what);
      held.reserve(n);
      for (std::size_t i = 0; i < n; ++i) {
        held.emplace_back(PySequence_Fast_GET_ITEM(seq.ptr(), static_cast<Py_ssize_t>(i)), false,
                          fmt::format("{}: values[{}]", what, i));
        data[i] = held.back().data();
        lens[i] = held.back().size();
      }
    } else {
      read_addresses(addresses, sizes, n, data, lens, what);
    }
    std::vector<std::error_code> results(n);
    {
      py::gil_scoped_release nogil;
      // Buffers the engine does not know go through staging memory.
      std::vector<std::size_t> staged;
      std::uint64_t total = 0;
      if (!values.is_none()) {
        for (std::size_t i = 0; i < n; ++i) {
          if (!registered(data[i], lens[i])) {
            staged.push_back(i);
            total += lens[i];
          }
        }
      }
      staging st(*host_, total);
      if (st.error()) {
        py::gil_scoped_acquire gil;
        raise_error_text(st.error(), what,
                         fmt::format("{}: {} [{}]", what, st.what(), error_name(st.error())));
      }
      std::uint64_t off = 0;
      for (const auto i : staged) {
        std::memcpy(st.data() + off, data[i], lens[i]);
        data[i] = st.data() + off;
        off += lens[i];
      }
      const auto cfg = pc.get();
      run_nogil(std::string(what), [&](store::client& c, auto done) {
        c.async_put_batch(k.views, data, lens, results, cfg, {},
                          [done](std::error_code ec) { done(ec); });
      });
    }
    return results;
  }

  // ------------------------------------------------------------- gets

  /// sizes[i]: the bytes key i read (its size with buffer_overflow);
  /// results[i]: {} or its error.
  struct get_outcome {
    std::vector<std::uint64_t> sizes;
    std::vector<std::error_code> results;
  };

  get_outcome get(py::handle keys, py::handle buffers, py::handle addresses, py::handle capacities,
                  std::string_view what) {
    auto k = read_keys(keys, what);
    const std::size_t n = k.keys.size();
    std::vector<held_buffer> held;
    std::vector<const void*> cdata(n);
    std::vector<std::uint64_t> caps(n);
    if (!buffers.is_none()) {
      if (!addresses.is_none() || !capacities.is_none()) {
        throw py::type_error(
            fmt::format("{}: give buffers, or addresses and sizes, not both", what));
      }
      auto seq = sequence(buffers, "buffers", what);
      check_count(PySequence_Fast_GET_SIZE(seq.ptr()), n, "buffers", what);
      held.reserve(n);
      for (std::size_t i = 0; i < n; ++i) {
        held.emplace_back(PySequence_Fast_GET_ITEM(seq.ptr(), static_cast<Py_ssize_t>(i)), true,
                          fmt::format("{}: buffers[{}]", what, i));
        cdata[i] = held.back().data();
        caps[i] = held.back().size();
      }
    } else {
      read_addresses(addresses, capacities, n, cdata, caps, what);
    }
    std::vector<void*> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = const_cast<void*>(cdata[i]);
    get_outcome out{std::vector<std::uint64_t>(n), std::vector<std::error_code>(n)};
    {
      py::gil_scoped_release nogil;
      std::vector<std::size_t> staged;
      std::uint64_t total = 0;
      if (!buffers.is_none()) {
        for (std::size_t i = 0; i < n; ++i) {
          if (!registered(data[i], caps[i])) {
            staged.push_back(i);
            total += caps[i];
          }
        }
      }
      staging st(*host_, total);
      if (st.error()) {
        py::gil_scoped_acquire gil;
        raise_error_text(st.error(), what,
                         fmt::format("{}: {} [{}]", what, st.what(), error_name(st.error())));
      }
      std::vector<void*> targets = data;
      std::uint64_t off = 0;
      for (const auto i : staged) {
        targets[i] = st.data() + off;
        off += caps[i];
      }
      run_nogil(std::string(what), [&](store::client& c, auto done) {
        c.async_get_batch(k.views, targets, caps, out.sizes, out.results,
                          [done](std::error_code ec) { done(ec); });
      });
      for (const auto i : staged) {
        if (!out.results[i]) std::memcpy(data[i], targets[i], out.sizes[i]);
      }
    }
    return out;
  }

  // ----------------------------------------------------------- pieces

  /// Objects of several pieces each: key i's are the next counts[i]
  /// entries of the flat columns `addresses` / `sizes` (registered memory,
  /// host or device), in order. A put gathers them, a get scatters the
  /// object over them; no staging copy either way.
  struct pieces_in {
    std::vector<store::buffer_piece> pieces;
    std::vector<std::uint32_t> counts;
  };

  pieces_in read_pieces(py::handle addresses, py::handle sizes, py::handle counts, std::size_t n,
                        std::string_view what) {
    const auto a = u64_column::from(addresses, "addresses");
    const auto s = u64_column::from(sizes, "sizes");
    const auto c = u64_column::from(counts, "counts");
    if (a.scalar() || s.scalar() || c.scalar()) {
      throw py::type_error(fmt::format("{}: addresses, sizes and counts are lists", what));
    }
    check_count(static_cast<Py_ssize_t>(c.size()), n, "counts", what);
    if (s.size() != a.size()) {
      raise_error_text(
          make_error_code(errc::invalid_argument), what,
          fmt::format("{}: {} addresses, {} sizes [invalid_argument]", what, a.size(), s.size()));
    }
    pieces_in out;
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (c[i] > a.size())
        total = a.size() + 1;  // too many: refused below
      else
        total += c[i];
      out.counts.push_back(static_cast<std::uint32_t>(std::min<std::uint64_t>(c[i], UINT32_MAX)));
    }
    if (total != a.size()) {
      raise_error_text(make_error_code(errc::invalid_argument), what,
                       fmt::format("{}: the counts add up to {}, not to the {} pieces given "
                                   "[invalid_argument]",
                                   what, total, a.size()));
    }
    out.pieces.reserve(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (s[i] != 0 && !registered(reinterpret_cast<const void*>(a[i]), s[i])) {
        raise_error_text(make_error_code(errc::not_registered), what,
                         fmt::format("{}: piece {} ({:#x}, {} bytes) is not inside memory "
                                     "registered with this client (StoreClient.register) "
                                     "[not_registered]",
                                     what, i, a[i], s[i]));
      }
      out.pieces.push_back({reinterpret_cast<void*>(a[i]), s[i]});
    }
    return out;
  }

  std::vector<std::error_code> put_pieces(py::handle keys, py::handle addresses, py::handle sizes,
                                          py::handle counts, const py_put_config& pc,
                                          std::string_view what) {
    auto k = read_keys(keys, what);
    const auto in = read_pieces(addresses, sizes, counts, k.keys.size(), what);
    std::vector<std::error_code> results(k.keys.size());
    const auto cfg = pc.get();
    run(std::string(what), [&](store::client& c, auto done) {
      c.async_put_gather_batch(k.views, in.pieces, in.counts, results, cfg, {},
                               [done](std::error_code ec) { done(ec); });
    });
    return results;
  }

  get_outcome get_pieces(py::handle keys, py::handle addresses, py::handle sizes, py::handle counts,
                         std::string_view what) {
    auto k = read_keys(keys, what);
    const auto in = read_pieces(addresses, sizes, counts, k.keys.size(), what);
    const std::size_t n = k.keys.size();
    get_outcome out{std::vector<std::uint64_t>(n), std::vector<std::error_code>(n)};
    run(std::string(what), [&](store::client& c, auto done) {
      c.async_get_scatter_batch(k.views, in.pieces, in.counts, out.sizes, out.results,
                                [done](std::error_code ec) { done(ec); });
    });
    return out;
  }

  /// One object as bytes: read into staging memory of `guess` bytes, then,
  /// when the object is larger, again into memory of its size.
  py::bytes get_bytes(const std::string& key, std::uint64_t guess) {
    const std::string what = fmt::format("get '{}'", key);
    std::uint64_t capacity = std::max<std::uint64_t>(guess, 1);
    // An object is immutable, but it may be removed and put again larger
    // between two attempts: a few attempts, then the error.
    for (int attempt = 0;; ++attempt) {
      std::string out;
      std::vector<std::uint64_t> sizes(1);
      std::vector<std::error_code> results(1);
      {
        py::gil_scoped_release nogil;
        staging st(*host_, capacity);
        if (st.error()) {
          py::gil_scoped_acquire gil;
          raise_error_text(st.error(), what,
                           fmt::format("{}: {} [{}]", what, st.what(), error_name(st.error())));
        }
        const std::vector<std::string_view> keys{key};
        const std::vector<void*> targets{st.data()};
        const std::vector<std::uint64_t> caps{capacity};
        run_nogil(what, [&](store::client& c, auto done) {
          c.async_get_batch(keys, targets, caps, sizes, results,
                            [done](std::error_code e) { done(e); });
        });
        if (!results[0]) out.assign(reinterpret_cast<const char*>(st.data()), sizes[0]);
      }
      if (!results[0]) return py::bytes(out);
      if (results[0] == store_errc::buffer_overflow && sizes[0] > capacity && attempt < 3) {
        capacity = sizes[0];
        continue;
      }
      raise_error(results[0], what);
    }
  }

  // ------------------------------------------------- exists and remove

  std::vector<std::error_code> keys_call(py::handle keys, bool exists, bool force,
                                         std::string_view what) {
    auto k = read_keys(keys, what);
    std::vector<std::error_code> results(k.keys.size());
    py::gil_scoped_release nogil;
    run_nogil(std::string(what), [&](store::client& c, auto done) {
      if (exists) {
        c.async_exists_batch(k.views, results, [done](std::error_code ec) { done(ec); });
      } else {
        c.async_remove_batch(k.views, force, results, [done](std::error_code ec) { done(ec); });
      }
    });
    return results;
  }

  // One dict per key, in input order: {"code": 0, "size": n, "replicas":
  // [{"segment", "offset", "address", "host", "local"}]} or {"code": the
  // Mooncake code, "error": the error's name}.
  py::list describe_batch(py::handle keys) {
    auto k = read_keys(keys, "describe_batch");
    std::vector<store::object_description> d(k.keys.size());
    {
      py::gil_scoped_release nogil;
      run_nogil("describe_batch", [&](store::client& c, auto done) {
        c.async_describe_batch(k.views, d, [done](std::error_code ec) { done(ec); });
      });
    }
    py::list out;
    for (const auto& one : d) {
      py::dict e;
      if (one.ec) {
        e["code"] = mooncake_code(one.ec);
        e["error"] = error_name(one.ec);
        out.append(e);
        continue;
      }
      e["code"] = 0;
      e["size"] = one.size;
      py::list reps;
      for (const auto& r : one.replicas) {
        py::dict x;
        x["segment"] = r.segment;
        x["offset"] = r.offset;
        x["address"] = r.address;
        x["host"] = r.host;
        x["local"] = r.local;
        reps.append(x);
      }
      e["replicas"] = reps;
      out.append(e);
    }
    return out;
  }

  std::uint64_t remove_all(bool force) {
    auto n = std::make_shared<std::uint64_t>(0);
    run("remove_all", [&](store::client& c, auto done) {
      c.async_remove_all(force, [done, n](std::error_code ec, std::uint64_t r) {
        *n = r;
        done(ec);
      });
    });
    return *n;
  }

  py::dict stats() {
    auto s = std::make_shared<store::wire::stats_reply>();
    run("stats", [&](store::client& c, auto done) {
      c.async_stats([done, s](std::error_code ec, store::wire::stats_reply r) {
        *s = r;
        done(ec);
      });
    });
    py::dict d;
    d["capacity"] = s->capacity;
    d["used"] = s->used;
    d["objects"] = s->objects;
    d["in_progress"] = s->in_progress;
    d["reserved"] = s->reserved;
    d["segments"] = s->segments;
    return d;
  }

 private:
  struct key_columns {
    std::vector<std::string> keys;
    std::vector<std::string_view> views;
  };

  static std::chrono::milliseconds to_ms(double seconds) {
    // At most a year: larger values would overflow the clock's arithmetic.
    const double ms = std::min(seconds * 1000.0, 365.0 * 86400.0 * 1000.0);
    return std::chrono::milliseconds(static_cast<std::int64_t>(ms + 0.5));
  }

  static py::object sequence(py::handle h, const char* name, std::string_view what) {
    if (PyUnicode_Check(h.ptr()) || PyBytes_Check(h.ptr()) || PyByteArray_Check(h.ptr()) ||
        PyObject_CheckBuffer(h.ptr())) {
      throw py::type_error(fmt::format("{}: {} must be a list (one entry per key), not {}", what,
                                       name, Py_TYPE(h.ptr())->tp_name));
    }
    auto seq = py::reinterpret_steal<py::object>(PySequence_Fast(h.ptr(), "not a sequence"));
    if (!seq) {
      PyErr_Clear();
      throw py::type_error(fmt::format("{}: {} must be a list (one entry per key), not {}", what,
                                       name, Py_TYPE(h.ptr())->tp_name));
    }
    return seq;
  }

  static void check_count(Py_ssize_t got, std::size_t n, const char* name, std::string_view what) {
    if (static_cast<std::size_t>(got) != n) {
      raise_error_text(make_error_code(errc::invalid_argument), what,
                       fmt::format("{}: {} keys but {} {}: every list must have one entry per "
                                   "key [invalid_argument]",
                                   what, n, got, name));
    }
  }

  static key_columns read_keys(py::handle keys, std::string_view what) {
    auto seq = sequence(keys, "keys", what);
    const auto n = static_cast<std::size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
    key_columns k;
    k.keys.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      PyObject* o = PySequence_Fast_GET_ITEM(seq.ptr(), static_cast<Py_ssize_t>(i));
      if (!PyUnicode_Check(o)) {
        throw py::type_error(
            fmt::format("{}: keys[{}] must be a str, not {}", what, i, Py_TYPE(o)->tp_name));
      }
      Py_ssize_t len = 0;
      const char* s = PyUnicode_AsUTF8AndSize(o, &len);
      if (s == nullptr) throw py::error_already_set();
      k.keys.emplace_back(s, static_cast<std::size_t>(len));
    }
    k.views.assign(k.keys.begin(), k.keys.end());
    return k;
  }

  // Addresses and sizes (an int each, lists or arrays) of registered memory.
  void read_addresses(py::handle addresses, py::handle sizes, std::size_t n,
                      std::vector<const void*>& data, std::vector<std::uint64_t>& lens,
                      std::string_view what) {
    if (addresses.is_none() || sizes.is_none()) {
      throw py::type_error(
          fmt::format("{}: give a list of buffers, or addresses and sizes (both)", what));
    }
    const auto a = u64_column::from(addresses, "addresses");
    const auto s = u64_column::from(sizes, "sizes");
    if (!a.scalar()) check_count(static_cast<Py_ssize_t>(a.size()), n, "addresses", what);
    if (!s.scalar()) check_count(static_cast<Py_ssize_t>(s.size()), n, "sizes", what);
    for (std::size_t i = 0; i < n; ++i) {
      if (!registered(reinterpret_cast<const void*>(a[i]), s[i])) {
        raise_error_text(make_error_code(errc::not_registered), what,
                         fmt::format("{}: entry {} ({:#x}, {} bytes) is not inside memory "
                                     "registered with this client (StoreClient.register) "
                                     "[not_registered]",
                                     what, i, a[i], s[i]));
      }
      data[i] = reinterpret_cast<const void*>(a[i]);
      lens[i] = s[i];
    }
  }

  bool registered(const void* p, std::uint64_t len) const {
    return host_->segment_holding(reinterpret_cast<std::uintptr_t>(p), len).has_value();
  }

  host& h() {
    if (host_->closed()) raise_error(errc::cancelled, "kvlink: the store client is closed");
    return *host_;
  }

  // Starts start(client, done) and waits for done(ec) (GIL held on entry
  // and exit); raises kvlink.Error for the batch's own error.
  template <class Start>
  void run(const std::string& what, Start&& start) {
    py::gil_scoped_release nogil;
    run_nogil(what, std::forward<Start>(start));
  }

  // The same, called without the GIL; takes it to raise.
  template <class Start>
  void run_nogil(const std::string& what, Start&& start) {
    auto op = host_->make_operation(what);
    auto done = [op](std::error_code ec) { op->finish(ec, std::monostate{}); };
    {
      std::shared_lock lock{life_};
      if (!client_) {
        py::gil_scoped_acquire gil;
        raise_error(errc::cancelled, what + ": the store client is closed");
      }
      start(*client_, done);
    }
    py::gil_scoped_acquire gil;
    wait_op(*op, std::nullopt);
    if (auto ec = op->error()) raise_error(ec, what);
  }

  void close_nogil() {
    std::lock_guard once{close_mutex_};  // a second caller returns once the first is done
    if (!client_) return;                // only written here, under close_mutex_
    {
      // Pending operations of other threads fail with cancelled.
      auto op = host_->make_operation("close");
      {
        std::shared_lock lock{life_};
        client_->async_close([op](std::error_code ec) { op->finish(ec, std::monostate{}); });
      }
      op->wait();
    }
    {
      std::unique_lock lock{life_};
      client_.reset();  // posts its last step to the engine, which runs it before closing
    }
    host_->close();
  }

  std::shared_ptr<host> host_;
  std::mutex close_mutex_;
  std::shared_mutex life_;
  std::unique_ptr<store::client> client_;  // null once closed
};

}  // namespace kvlink::python
