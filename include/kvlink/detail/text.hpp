// Small text helpers shared by the parsers of config and the KV layer.
#pragma once

#include <kvlink/core/error.hpp>

#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace kvlink::detail {

/// Stores `message` in `*what` (when given) and returns invalid_argument:
/// the shape of every "bad input, here is why" path.
inline std::error_code fail(std::string* what, std::string message) {
  if (what != nullptr) *what = std::move(message);
  return make_error_code(errc::invalid_argument);
}

constexpr char ascii_lower(char c) noexcept {
  return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
}

constexpr bool iequals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (ascii_lower(a[i]) != ascii_lower(b[i])) return false;
  }
  return true;
}

/// "a,b,c" -> {"a", "b", "c"}; "" -> {}; empty items are kept ("a,,b" has
/// three) so that callers can refuse them.
inline std::vector<std::string> split_list(std::string_view text, char sep = ',') {
  std::vector<std::string> out;
  if (text.empty()) return out;
  while (true) {
    const std::size_t at = text.find(sep);
    out.emplace_back(text.substr(0, at));
    if (at == std::string_view::npos) break;
    text.remove_prefix(at + 1);
  }
  return out;
}

}  // namespace kvlink::detail
