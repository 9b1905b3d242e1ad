// Python batches -> transfer requests, without a Python object per entry.
//
// A batch comes as columns (local addresses, remote offsets or addresses,
// lengths, optionally segment ids), each one integer for every entry, a
// numpy array of 8-byte integers (read in place), or a list (read once, no
// objects made). Columns are read with the GIL; requests are built from them
// without it. Remote addresses are the peer's virtual addresses (what
// Mooncake hands around): they are mapped to (segment, offset) through the
// segments the peer advertised, which carry their base addresses.
#pragma once

#include <kvlink/engine.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "errors.hpp"
#include <fmt/format.h>
#include <pybind11/pybind11.h>

namespace kvlink::python {

/// One column of a batch: unsigned 64-bit integers. Built with the GIL held,
/// read without it, destroyed with it (it may hold a buffer view).
class u64_column {
 public:
  /// `h`: an int (the value of every entry), a 1-D buffer of native 8-byte
  /// integers (no copy; int64 values are taken as their two's complement),
  /// or a sequence of ints. Raises TypeError/OverflowError naming `name`.
  static u64_column from(py::handle h, const char* name) {
    u64_column c;
    c.name_ = name;
    if (PyLong_Check(h.ptr())) {
      c.set_scalar(h, name);
      return c;
    }
    if (PyObject_CheckBuffer(h.ptr()) && !PyBytes_Check(h.ptr()) && !PyByteArray_Check(h.ptr())) {
      auto view = py::reinterpret_borrow<py::buffer>(h).request();
      if (view.ndim == 0) {  // a numpy scalar
        c.set_scalar(h, name);
        return c;
      }
      if (view.ndim == 1 && view.itemsize == 8 && native_int64(view.format) &&
          (view.shape[0] <= 1 || view.strides[0] == 8)) {
        c.data_ = static_cast<const std::uint64_t*>(view.ptr);
        c.size_ = static_cast<std::size_t>(view.shape[0]);
        c.view_.emplace(std::move(view));
        return c;
      }
      // Other element types are read entry by entry below.
    }
    if (PyIndex_Check(h.ptr()) && !PySequence_Check(h.ptr())) {
      c.set_scalar(h, name);
      return c;
    }
    py::object seq = py::reinterpret_steal<py::object>(
        PySequence_Fast(h.ptr(), "must be an int, a list of ints or a 1-D integer array"));
    if (!seq) {
      throw py::type_error(
          fmt::format("{}: must be an int, a list of ints or a 1-D integer array", name));
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    c.owned_.resize(static_cast<std::size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      c.owned_[static_cast<std::size_t>(i)] = to_u64(items[i], name, i);
    }
    c.data_ = c.owned_.data();
    c.size_ = c.owned_.size();
    return c;
  }

  bool scalar() const noexcept { return scalar_; }
  std::size_t size() const noexcept { return size_; }
  const char* name() const noexcept { return name_; }
  std::uint64_t operator[](std::size_t i) const noexcept { return scalar_ ? value_ : data_[i]; }

 private:
  static bool native_int64(const std::string& f) {
    // '@', '=' and '<' are native order on the little-endian machines kvlink runs on.
    static_assert(std::endian::native == std::endian::little, "big-endian: check the prefixes");
    std::string_view t = f;
    if (!t.empty() && (t.front() == '@' || t.front() == '=' || t.front() == '<'))
      t.remove_prefix(1);
    return t == "Q" || t == "q" || (sizeof(long) == 8 && (t == "L" || t == "l"));
  }

  static std::uint64_t to_u64(PyObject* o, const char* name, Py_ssize_t index) {
    py::object owned;
    if (!PyLong_Check(o)) {  // numpy integers and other __index__ types
      owned = py::reinterpret_steal<py::object>(PyNumber_Index(o));
      if (!owned) {
        PyErr_Clear();
        throw py::type_error(index < 0 ? fmt::format("{}: not an integer", name)
                                       : fmt::format("{}[{}]: not an integer", name, index));
      }
      o = owned.ptr();
    }
    const unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::value_error(
          index < 0 ? fmt::format("{}: not an unsigned 64-bit integer", name)
                    : fmt::format("{}[{}]: not an unsigned 64-bit integer", name, index));
    }
    return static_cast<std::uint64_t>(v);
  }

  void set_scalar(py::handle h, const char* name) {
    scalar_ = true;
    value_ = to_u64(h.ptr(), name, -1);
  }

  const char* name_ = "";
  bool scalar_ = false;
  std::uint64_t value_ = 0;
  const std::uint64_t* data_ = nullptr;
  std::size_t size_ = 0;
  std::vector<std::uint64_t> owned_;
  std::optional<py::buffer_info> view_;  // keeps an array's memory exported while it is read
};

/// The columns of one batch. `segments` empty: `remote` holds the peer's
/// virtual addresses; otherwise offsets inside those segments.
struct batch_columns {
  u64_column local;
  u64_column remote;
  u64_column lengths;
  std::optional<u64_column> segments;
};

/// Builds the requests of a batch (no GIL needed). Errors, with `what` the
/// whole message, naming the entry: invalid_argument (columns of different
/// lengths), not_registered (a peer address outside every segment the peer
/// advertised: the remote side, with the address and the peer's segments),
/// out_of_bounds (one that starts inside a segment and runs past its end).
/// Local addresses and access are checked by the engine.
inline std::error_code build_requests(opcode op, const peer& p, const batch_columns& b,
                                      std::vector<transfer_request>& out, std::string& what) {
  std::size_t n = 1;
  bool all_scalar = true;
  for (const u64_column* c :
       {&b.local, &b.remote, &b.lengths,
        b.segments ? &*b.segments : static_cast<const u64_column*>(nullptr)}) {
    if (c == nullptr || c->scalar()) continue;
    if (all_scalar) {
      n = c->size();
      all_scalar = false;
    } else if (c->size() != n) {
      what = fmt::format("{} has {} entries, the batch {}: every list must have one per entry",
                         c->name(), c->size(), n);
      return errc::invalid_argument;
    }
  }
  out.clear();
  out.reserve(n);
  if (b.segments) {
    for (std::size_t i = 0; i < n; ++i) {
      out.push_back(transfer_request{op, reinterpret_cast<void*>(b.local[i]),
                                     p.segment(segment_id{(*b.segments)[i]}), b.remote[i],
                                     b.lengths[i]});
    }
    return {};
  }
  // The peer's segments by base address; a few, so a sorted vector.
  struct range {
    std::uint64_t base, length;
    segment_id id;
  };
  std::vector<range> ranges;
  for (const auto& s : p.segments()) ranges.push_back(range{s.base, s.length, s.id});
  std::sort(ranges.begin(), ranges.end(),
            [](const range& x, const range& y) { return x.base < y.base; });
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t addr = b.remote[i];
    const std::uint64_t len = b.lengths[i];
    auto it = std::upper_bound(ranges.begin(), ranges.end(), addr,
                               [](std::uint64_t a, const range& r) { return a < r.base; });
    if (it == ranges.begin() || addr - std::prev(it)->base >= std::prev(it)->length) {
      // The remote side: not the caller's buffer, which the engine checks.
      std::string listed;
      for (std::size_t k = 0; k < ranges.size() && k < 4; ++k) {
        listed += fmt::format("{}{:#x}+{}", k == 0 ? "" : ", ", ranges[k].base, ranges[k].length);
      }
      if (ranges.size() > 4) listed += fmt::format(", ... ({} in all)", ranges.size());
      what = fmt::format(
          "entry {}: remote address {:#x} is not inside any segment the peer {} registered ({}): "
          "check the peer buffer address",
          i, addr, p.address(), ranges.empty() ? std::string("it registered none") : listed);
      return errc::not_registered;
    }
    const range& r = *std::prev(it);
    const std::uint64_t offset = addr - r.base;
    if (len > r.length - offset) {
      what = fmt::format(
          "entry {}: remote address {:#x} + {} bytes runs past the end of the peer {}'s segment "
          "{:#x}+{}",
          i, addr, len, p.address(), r.base, r.length);
      return errc::out_of_bounds;
    }
    out.push_back(transfer_request{op, reinterpret_cast<void*>(b.local[i]),
                                   remote_segment{p.id(), r.id}, offset, len});
  }
  return {};
}

}  // namespace kvlink::python
