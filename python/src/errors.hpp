// Errors of the Python binding: every failure reaches Python as one exception
// type, kvlink.Error, carrying the std::error_code's name ("not_registered",
// "EADDRINUSE"), value, category and message, and what was being done.
//
//   raise_error(kvlink::errc::not_registered, "transfer entry 3");  // needs the GIL
//
// The data path keeps std::error_code (style rule 3); the exception is made
// only at this edge, with the GIL held.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/store/error.hpp>

#include <cstddef>
#include <cstring>
#include <iterator>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>
#include <pybind11/pybind11.h>

namespace kvlink::python {

namespace py = pybind11;

/// The name of a kvlink::errc value as written in the source, by value.
inline std::string_view errc_name(errc e) noexcept {
  // By value, not by enumerator, so that this compiles against releases
  // with fewer codes; a new code must get its name here (errc_last moves).
  static constexpr std::string_view names[] = {
      "",
      "not_registered",
      "out_of_bounds",
      "access_denied",
      "overlapping_registration",
      "invalid_argument",
      "peer_unreachable",
      "peer_closed",
      "protocol_version_mismatch",
      "malformed_message",
      "deadline_exceeded",
      "cancelled",
      "no_device",
      "queue_full",
      "unknown_peer",
      "message_too_large",
      "transport_unavailable",
      "instance_changed",
      "local_memory_fault",
      "checksum_mismatch",
      "authentication_failed",
      "limit_exceeded",
      "metadata_unavailable",
      "name_not_found",
      "remote_memory_fault",
      "overlapping_destinations",
      "unsigned_entry",
      "device_error",
  };
  static_assert(static_cast<std::size_t>(errc_last) < std::size(names),
                "name the new kvlink::errc values in errc_name()");
  const auto i = static_cast<std::size_t>(e);
  return i > 0 && i < std::size(names) ? names[i] : std::string_view("unknown");
}

/// The name of a kvlink::store_errc value as written in the source.
inline std::string_view store_errc_name(store_errc e) noexcept {
  switch (e) {
    case store_errc::internal_error:
      return "internal_error";
    case store_errc::buffer_overflow:
      return "buffer_overflow";
    case store_errc::segment_not_found:
      return "segment_not_found";
    case store_errc::segment_already_exists:
      return "segment_already_exists";
    case store_errc::client_not_found:
      return "client_not_found";
    case store_errc::no_space:
      return "no_space";
    case store_errc::invalid_key:
      return "invalid_key";
    case store_errc::invalid_params:
      return "invalid_params";
    case store_errc::illegal_client:
      return "illegal_client";
    case store_errc::object_in_progress:
      return "object_in_progress";
    case store_errc::object_not_found:
      return "object_not_found";
    case store_errc::object_already_exists:
      return "object_already_exists";
    case store_errc::object_has_lease:
      return "object_has_lease";
    case store_errc::lease_expired:
      return "lease_expired";
    case store_errc::transfer_failed:
      return "transfer_failed";
    case store_errc::checksum_mismatch:
      return "checksum_mismatch";
    case store_errc::rpc_failed:
      return "rpc_failed";
    case store_errc::rpc_timeout:
      return "rpc_timeout";
    case store_errc::object_hard_pinned:
      return "object_hard_pinned";
    case store_errc::object_loading:
      return "object_loading";
  }
  return "unknown";
}

/// Whether `ec` holds an errno value (Asio's socket errors have a category of
/// their own, "asio.system").
inline bool is_errno(const std::error_code& ec) noexcept {
  const std::string_view c = ec.category().name();
  return c == "system" || c == "generic" || c == "asio.system";
}

/// kvlink's names for its own codes, errno's symbol ("ECONNREFUSED") for
/// errno values, "<category>:<value>" otherwise (verbs completion codes).
inline std::string error_name(const std::error_code& ec) {
  if (ec.category() == error_category())
    return std::string(errc_name(static_cast<errc>(ec.value())));
  if (ec.category() == store_error_category())
    return std::string(store_errc_name(static_cast<store_errc>(ec.value())));
  if (is_errno(ec)) {
    if (const char* n = ::strerrorname_np(ec.value())) return n;
  }
  return fmt::format("{}:{}", ec.category().name(), ec.value());
}

/// kvlink.Error, made once when the module is imported (module.cpp).
inline PyObject*& error_type() noexcept {
  static PyObject* type = nullptr;  // owned by the module for the life of the interpreter
  return type;
}

/// Raises kvlink.Error for `ec` with `text` as its str(); `context` says what
/// was being done. Needs the GIL.
[[noreturn]] inline void raise_error_text(const std::error_code& ec, std::string_view context,
                                          const std::string& text) {
  const std::string name = error_name(ec);
  py::object err = py::reinterpret_borrow<py::object>(error_type())(text);
  err.attr("errc") = name;
  err.attr("value") = ec.value();
  err.attr("category") = is_errno(ec) ? std::string("system") : std::string(ec.category().name());
  err.attr("message") = ec.message();
  err.attr("context") = std::string(context);
  // Mooncake Store's integer for the error (store errors; -1 for others).
  err.attr("mooncake_code") = mooncake_code(ec);
  PyErr_SetObject(error_type(), err.ptr());
  throw py::error_already_set();
}

/// Raises kvlink.Error for `ec`: "<context>: <message> [<name>]". Needs the GIL.
[[noreturn]] inline void raise_error(const std::error_code& ec, std::string_view context) {
  const std::string name = error_name(ec);
  raise_error_text(ec, context,
                   context.empty() ? fmt::format("{} [{}]", ec.message(), name)
                                   : fmt::format("{}: {} [{}]", context, ec.message(), name));
}

/// Runs `f` and turns a std::system_error (the set-up calls of the engine
/// throw them, with the reason in what()) into kvlink.Error.
template <class F>
auto translate(std::string_view context, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::system_error& e) {
    // what() already ends with the code's message.
    raise_error_text(e.code(), context,
                     fmt::format("{}: {} [{}]", context, e.what(), error_name(e.code())));
  }
}

}  // namespace kvlink::python
