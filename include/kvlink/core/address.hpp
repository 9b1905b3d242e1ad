// "host:port" as kvlink writes it: the one parser for listen addresses,
// peer addresses and advertised addresses.
//
//   std::string_view host;
//   std::uint16_t port = 0;
//   if (kvlink::split_host_port("[::1]:17001", host, port)) ...   // host "::1", port 17001
//
// Rules: a decimal port 0..65535 after the last colon; an IPv6 address in
// brackets ("[::1]:0", "[fe80::1%eth0]:1"); a host name or IPv4 address
// otherwise, without spaces or brackets. No I/O, no Asio.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvlink {

/// Splits "host:port" / "[v6]:port". False (outputs untouched) when `text`
/// breaks a rule above.
constexpr bool split_host_port(std::string_view text, std::string_view& host,
                               std::uint16_t& port) noexcept {
  const std::size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return false;
  const std::string_view p = text.substr(colon + 1);
  if (p.empty() || p.size() > 5) return false;
  std::uint32_t v = 0;
  for (char c : p) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<std::uint32_t>(c - '0');
  }
  if (v > 65535) return false;
  std::string_view h = text.substr(0, colon);
  if (h.front() == '[') {
    if (h.size() < 3 || h.back() != ']') return false;
    h = h.substr(1, h.size() - 2);
  } else if (h.find(':') != std::string_view::npos) {
    return false;  // an IPv6 address needs brackets
  }
  if (h.find_first_of(" \t[]") != std::string_view::npos) return false;
  host = h;
  port = static_cast<std::uint16_t>(v);
  return true;
}

/// "host:port", bracketing a host that contains a colon (IPv6).
inline std::string join_host_port(std::string_view host, std::uint16_t port) {
  std::string out;
  if (host.find(':') != std::string_view::npos) {
    out += '[';
    out += host;
    out += ']';
  } else {
    out += host;
  }
  out += ':';
  out += std::to_string(port);
  return out;
}

}  // namespace kvlink
