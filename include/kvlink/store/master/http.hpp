// The master's HTTP/1.1 pieces, with no I/O: a request head parsed into what
// its routes need, and an answer formatted as a response that closes the
// connection. The master's endpoints (server.hpp: /health, /metrics, ...)
// and its metadata server (metadata.hpp) read requests through these; the
// connection handling is master_server's.
#pragma once

#include <kvlink/core/settings.hpp>
#include <kvlink/detail/text.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace kvlink::store {

/// One HTTP answer of the master.
struct http_answer {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

/// A request as the routes see it; the views point into the bytes read.
struct http_request {
  std::string_view method;
  std::string_view target;
  std::string_view authorization;  ///< the Authorization header's value, "" when absent
  std::uint64_t content_length = 0;
  bool chunked = false;          ///< Transfer-Encoding other than identity (refused: 411)
  bool expect_continue = false;  ///< "Expect: 100-continue": answer 100 before reading the body
  std::string_view body;         ///< set once the body is read
};

/// Parses a request head (the request line and headers, up to and including
/// the empty line). nullopt for anything that is not an HTTP/1.x request: a
/// bad request line, a header line without ':', a Content-Length that is
/// not a number or given twice with different values.
inline std::optional<http_request> parse_http_head(std::string_view head) {
  const std::size_t eol = head.find("\r\n");
  if (eol == std::string_view::npos) return std::nullopt;
  const std::string_view line = head.substr(0, eol);
  const std::size_t sp1 = line.find(' ');
  const std::size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == 0 || sp2 == std::string_view::npos || sp2 == sp1 + 1 ||
      !line.substr(sp2 + 1).starts_with("HTTP/1.")) {
    return std::nullopt;
  }
  http_request r;
  r.method = line.substr(0, sp1);
  r.target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  bool have_length = false;
  std::string_view rest = head.substr(eol + 2);
  for (;;) {
    const std::size_t e = rest.find("\r\n");
    if (e == std::string_view::npos) return std::nullopt;  // no empty line
    const std::string_view h = rest.substr(0, e);
    rest.remove_prefix(e + 2);
    if (h.empty()) break;  // the end of the head
    const std::size_t colon = h.find(':');
    if (colon == std::string_view::npos || colon == 0) return std::nullopt;
    const std::string_view name = h.substr(0, colon);
    const std::string_view value = kvlink::detail::trim(h.substr(colon + 1));
    if (kvlink::detail::iequals(name, "Content-Length")) {
      if (value.empty() || value.size() > 18) return std::nullopt;
      std::uint64_t n = 0;
      for (const char c : value) {
        if (c < '0' || c > '9') return std::nullopt;
        n = n * 10 + static_cast<std::uint64_t>(c - '0');
      }
      if (have_length && n != r.content_length) return std::nullopt;
      have_length = true;
      r.content_length = n;
    } else if (kvlink::detail::iequals(name, "Transfer-Encoding")) {
      if (!kvlink::detail::iequals(value, "identity")) r.chunked = true;
    } else if (kvlink::detail::iequals(name, "Authorization")) {
      r.authorization = value;
    } else if (kvlink::detail::iequals(name, "Expect")) {
      r.expect_continue = kvlink::detail::iequals(value, "100-continue");
    }
  }
  return r;
}

/// The bytes of an HTTP/1.1 response that closes the connection.
inline std::string format_http(const http_answer& a) {
  const char* reason = a.status == 200   ? "OK"
                       : a.status == 400 ? "Bad Request"
                       : a.status == 401 ? "Unauthorized"
                       : a.status == 404 ? "Not Found"
                       : a.status == 405 ? "Method Not Allowed"
                       : a.status == 411 ? "Length Required"
                       : a.status == 413 ? "Content Too Large"
                       : a.status == 507 ? "Insufficient Storage"
                                         : "Error";
  return fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
      a.status, reason, a.content_type, a.body.size(), a.body);
}

}  // namespace kvlink::store
