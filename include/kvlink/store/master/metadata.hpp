// The master's embedded metadata server: Mooncake's HTTP metadata protocol
// (mooncake_master --enable_http_metadata_server), so that engines started
// with metadata "http://<master>:8080/metadata" need no separate server.
// kvlink's HTTP backend (metadata/http.hpp) and Mooncake's engines speak it:
//
//   GET    /metadata?key=<percent-encoded key>   200 + the value | 404
//   PUT    /metadata?key=<key>   body: the value  200
//   DELETE /metadata?key=<key>                    200 | 404
//
// 400 without a key or with a malformed one, 401 when a token is set and the
// request lacks "Authorization: Bearer <token>", 405 another method, 404
// another path, 413 a value over max_value, 507 when the table holds
// `capacity` bytes of keys and values already. Values live in memory only,
// as in Mooncake's server: a restarted master starts empty and kvlink's
// engines publish again within their beat (metadata_ttl / 3).
//
// metadata_table is thread-safe; route_metadata is a pure function of the
// table and the request, tested on its own (test/unit/store/metadata_test.cpp).
#pragma once

#include <kvlink/store/master/http.hpp>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

namespace kvlink::store {

/// Keys and values of the metadata server, bounded in bytes.
class metadata_table {
 public:
  enum class put_result : std::uint8_t { stored, too_large, full };

  metadata_table(std::size_t max_value, std::size_t capacity)
      : max_value_{max_value}, capacity_{capacity} {}

  std::optional<std::string> get(const std::string& key) const {
    std::lock_guard lock{mu_};
    const auto it = values_.find(key);
    if (it == values_.end()) return std::nullopt;
    return it->second;
  }

  put_result put(const std::string& key, std::string value) {
    if (value.size() > max_value_) return put_result::too_large;
    std::lock_guard lock{mu_};
    const auto it = values_.find(key);
    const std::size_t old = it == values_.end() ? 0 : key.size() + it->second.size();
    const std::size_t now = key.size() + value.size();
    if (bytes_ - old + now > capacity_) return put_result::full;
    bytes_ = bytes_ - old + now;
    if (it == values_.end()) {
      values_.emplace(key, std::move(value));
    } else {
      it->second = std::move(value);
    }
    return put_result::stored;
  }

  bool erase(const std::string& key) {
    std::lock_guard lock{mu_};
    const auto it = values_.find(key);
    if (it == values_.end()) return false;
    bytes_ -= key.size() + it->second.size();
    values_.erase(it);
    return true;
  }

  std::size_t size() const {
    std::lock_guard lock{mu_};
    return values_.size();
  }
  /// Bytes of keys and values held.
  std::size_t bytes() const {
    std::lock_guard lock{mu_};
    return bytes_;
  }
  std::size_t max_value() const noexcept { return max_value_; }

 private:
  const std::size_t max_value_;
  const std::size_t capacity_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::string> values_;  // mu_
  std::size_t bytes_ = 0;                                // mu_
};

namespace detail {

inline int hex_digit(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/// A query value percent-decoded ('+' is a space, as in forms); nullopt for
/// a '%' not followed by two hex digits.
inline std::optional<std::string> percent_decode(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '+') {
      out += ' ';
    } else if (in[i] != '%') {
      out += in[i];
    } else {
      if (i + 2 >= in.size()) return std::nullopt;
      const int hi = hex_digit(in[i + 1]), lo = hex_digit(in[i + 2]);
      if (hi < 0 || lo < 0) return std::nullopt;
      out += static_cast<char>(hi * 16 + lo);
      i += 2;
    }
  }
  return out;
}

/// The value of `name` in a query string ("a=1&key=x"); nullopt when absent.
inline std::optional<std::string_view> query_value(std::string_view query, std::string_view name) {
  while (!query.empty()) {
    const std::size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    const std::size_t eq = pair.find('=');
    if (pair.substr(0, eq) == name) {
      return eq == std::string_view::npos ? std::string_view{} : pair.substr(eq + 1);
    }
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return std::nullopt;
}

/// Equal strings, compared in time that depends on their lengths only.
inline bool same_secret(std::string_view a, std::string_view b) noexcept {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::size_t n = a.size() < b.size() ? a.size() : b.size();
  for (std::size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace detail

/// One request to the metadata server: its method, target ("/metadata?key=k"),
/// Authorization header ("" when absent) and body.
inline http_answer route_metadata(metadata_table& table, std::string_view token,
                                  const http_request& req) {
  constexpr std::string_view text = "text/plain; charset=utf-8";
  std::string_view path = req.target, query;
  if (const auto q = path.find('?'); q != std::string_view::npos) {
    query = path.substr(q + 1);
    path = path.substr(0, q);
  }
  if (path != "/metadata") return {404, std::string(text), "no such path\n"};
  if (!token.empty() && !detail::same_secret(req.authorization, "Bearer " + std::string(token))) {
    return {401, std::string(text), "unauthorized\n"};
  }
  if (req.method != "GET" && req.method != "PUT" && req.method != "DELETE") {
    return {405, std::string(text), "method not allowed\n"};
  }
  const auto raw = detail::query_value(query, "key");
  std::optional<std::string> key;
  if (raw) key = detail::percent_decode(*raw);
  // Mooncake's server trims the key; an empty one is an error.
  if (key) {
    const auto first = key->find_first_not_of(" \t\r\n");
    const auto last = key->find_last_not_of(" \t\r\n");
    key = first == std::string::npos ? std::string{} : key->substr(first, last - first + 1);
  }
  if (!key || key->empty()) return {400, std::string(text), "metadata key is required\n"};
  if (req.method == "GET") {
    auto value = table.get(*key);
    if (!value) return {404, std::string(text), "metadata not found\n"};
    return {200, "application/json", std::move(*value)};
  }
  if (req.method == "DELETE") {
    if (!table.erase(*key)) return {404, std::string(text), "metadata not found\n"};
    return {200, std::string(text), "metadata deleted\n"};
  }
  switch (table.put(*key, std::string(req.body))) {
    case metadata_table::put_result::stored:
      return {200, std::string(text), "metadata updated\n"};
    case metadata_table::put_result::too_large:
      return {413, std::string(text),
              fmt::format("a value over {} bytes (store_metadata_max_value)\n", table.max_value())};
    case metadata_table::put_result::full:
      break;
  }
  return {507, std::string(text), "the metadata table is full (store_metadata_capacity)\n"};
}

}  // namespace kvlink::store
