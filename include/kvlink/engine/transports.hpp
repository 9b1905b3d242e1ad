// Which transports a program has, and how an engine makes them from its
// config. The catalog is filled by the headers that bring a transport:
// engine.hpp adds "shm" and "tcp"; kvlink/rdma.hpp adds "rdma" (so a program that
// includes it and links kvlink::rdma has RDMA); a test adds its in-process
// transport. An engine then makes those its config.transports names, in
// that order (empty: every transport of the catalog, by rank).
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/detail/text.hpp>
#include <kvlink/engine/config.hpp>
#include <kvlink/transport/transport.hpp>

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fmt/format.h>

namespace kvlink {

using transport_factory =
    std::function<std::shared_ptr<transport>(const transport_env&, const config&)>;

class transport_catalog {
 public:
  struct entry {
    std::string name;
    int rank;  ///< lower comes first when config.transports is empty
    transport_factory make;
  };

  /// The program's catalog.
  static transport_catalog& global() {
    static transport_catalog c;
    return c;
  }

  /// Adds (or replaces) a transport. Returns true, so that a header can add
  /// one from the initializer of an inline variable.
  bool add(std::string name, int rank, transport_factory make) {
    std::lock_guard lock{mutex_};
    std::erase_if(entries_, [&](const entry& e) { return e.name == name; });
    entries_.push_back(entry{std::move(name), rank, std::move(make)});
    std::stable_sort(entries_.begin(), entries_.end(),
                     [](const entry& a, const entry& b) { return a.rank < b.rank; });
    return true;
  }

  /// "rdma, tcp": what this program has, by rank.
  std::string names() const {
    std::lock_guard lock{mutex_};
    return names_locked();
  }

  /// Makes the transports `wanted` names ("rdma,tcp"; empty: all, by rank).
  /// A name this program does not have is invalid_argument, with `what`
  /// saying which and what it has.
  std::error_code make(std::string_view wanted, const transport_env& env, const config& cfg,
                       std::vector<std::shared_ptr<transport>>& out, std::string& what) const {
    std::vector<entry> chosen;
    {
      std::lock_guard lock{mutex_};
      if (wanted.empty()) {
        chosen = entries_;
      } else {
        for (const auto& n : detail::split_list(wanted)) {
          auto it = std::find_if(entries_.begin(), entries_.end(),
                                 [&](const entry& e) { return e.name == n; });
          if (it == entries_.end()) {
            what = fmt::format(
                "config.transports names '{}', which this program does not have (it has: {}){}", n,
                names_locked(),
                n == "rdma" ? "; include <kvlink/rdma.hpp> and link kvlink::rdma" : "");
            return errc::invalid_argument;
          }
          chosen.push_back(*it);
        }
      }
    }
    for (const auto& e : chosen) out.push_back(e.make(env, cfg));
    return {};
  }

 private:
  std::string names_locked() const {
    std::string out;
    for (const auto& e : entries_) {
      out += out.empty() ? "" : ", ";
      out += e.name;
    }
    return out;
  }

  mutable std::mutex mutex_;
  std::vector<entry> entries_;
};

}  // namespace kvlink
