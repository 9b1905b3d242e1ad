// What the store backends (etcd, HTTP) share: the value an engine writes
// under its key, and the directory of peers' values a backend keeps.
//
// The value is the engine's descriptor (control/descriptor.hpp, with its
// name and seq) as JSON text. With a shared secret (config.auth_secret) it
// also carries "sig": HMAC-SHA-256 under the secret of the rest of the
// object as nlohmann::json dumps it (keys sorted, no spaces), so engines
// that share the secret ignore whatever someone else wrote there:
//
//   kvlink/engines/decode-3 -> {"address": "10.0.0.7:17001", "instance": "9f..", "name":
//                               "decode-3", "protocol": 2, "segments": [...], "seq": 4,
//                               "transports": {...}, "sig": "5be1.."}
//
// No secret is ever written. No I/O; not thread-safe.
#pragma once

#include <kvlink/control/descriptor.hpp>
#include <kvlink/control/guard.hpp>
#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/metadata/backend.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/steady_timer.hpp>
#include <nlohmann/json.hpp>

namespace kvlink::detail {

inline constexpr std::string_view descriptor_sig_label = "kvlink/metadata/descriptor";

/// The text that is signed: one form for writer and reader.
inline std::string canonical_json(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// The value to store for `d`; `extra` fields (an object) are added beside
/// the descriptor's (the HTTP backend's "beat") and signed with them.
inline std::string encode_entry(const control::peer_descriptor& d, const control::peer_guard& guard,
                                const nlohmann::json& extra = nlohmann::json::object()) {
  nlohmann::json j = control::to_json(d);
  for (const auto& [k, v] : extra.items()) j[k] = v;
  if (guard.enabled()) {
    j["sig"] = control::hex_of(guard.sign(descriptor_sig_label, canonical_json(j)));
  }
  return canonical_json(j);
}

/// Parses and checks a stored value. Errors: malformed_message (not JSON,
/// too deep, too large, not a descriptor), protocol_version_mismatch,
/// authentication_failed (a secret is set and the signature is missing or
/// does not match). `whole` gets the parsed object (extra fields included).
inline std::error_code decode_entry(std::string_view text, const control::peer_guard& guard,
                                    std::size_t max_size, control::peer_descriptor& out,
                                    nlohmann::json* whole = nullptr) {
  if (text.size() > max_size) return errc::message_too_large;
  bool too_deep = false;
  nlohmann::json j = nlohmann::json::parse(
      text,
      [&too_deep](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > control::max_message_depth) too_deep = true;
        return !too_deep;
      },
      /*allow_exceptions=*/false);
  if (too_deep || j.is_discarded() || !j.is_object()) return errc::malformed_message;
  if (guard.enabled()) {
    std::string sig_text;
    control::digest sig{};
    if (!control::get_field(j, "sig", sig_text) || !control::parse_hex(sig_text, sig)) {
      return errc::authentication_failed;
    }
    j.erase("sig");
    if (!control::peer_guard::same(sig, guard.sign(descriptor_sig_label, canonical_json(j)))) {
      return errc::authentication_failed;
    }
  } else {
    j.erase("sig");
  }
  if (auto ec = control::from_json(j, out)) return ec;
  if (whole != nullptr) *whole = std::move(j);
  return {};
}

/// "prefix" + name <-> key.
inline std::string key_of(std::string_view prefix, std::string_view name) {
  std::string k(prefix);
  k += name;
  return k;
}

/// The peers a store backend knows, by name, and the events their changes
/// make. A value is checked once, when it arrives; what is kept is its text
/// and the few fields lookups need.
class peer_directory {
 public:
  struct entry {
    instance_id instance{};
    std::uint64_t seq = 0;
    std::string address;
    std::string value;                                ///< the stored text, parsed again on lookup
    std::chrono::steady_clock::time_point changed{};  ///< when `value` last changed
    bool missing = false;  ///< not in the store at the last full read (grace period)
  };

  peer_directory(const control::peer_guard& guard, std::size_t max_size, std::string self_name)
      : guard_(guard), max_size_(max_size), self_(std::move(self_name)) {}

  void on_change(metadata_backend::change_fn fn) { on_change_ = std::move(fn); }

  /// A value arrived for `name`. A bad one is ignored (and said once per
  /// name and reason); a good one replaces the entry and is reported as
  /// published. False when ignored.
  bool put(const std::string& name, std::string value,
           std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) {
    const auto it = entries_.find(name);
    if (it != entries_.end() && it->second.value == value) {
      it->second.missing = false;
      return true;  // the same text again (a resync): nothing changed
    }
    control::peer_descriptor d;
    if (auto ec = decode_entry(value, guard_, max_size_, d)) {
      complain(name, ec == errc::authentication_failed
                         ? "its signature does not match our auth_secret (written by an engine "
                           "with another secret, or not by kvlink)"
                         : "it is not a kvlink descriptor (" + ec.message() + ")");
      return false;
    }
    if (d.name != name) {
      complain(name, "it names another engine (\"" + d.name + "\")");
      return false;
    }
    entry& e = entries_[name];
    e.instance = d.instance;
    e.seq = d.seq;
    e.address = d.address;
    e.value = std::move(value);
    e.changed = now;
    e.missing = false;
    if (name != self_ && on_change_) {
      metadata_event ev;
      ev.what = metadata_event::kind::published;
      ev.name = name;
      ev.instance = d.instance;
      ev.seq = d.seq;
      ev.segments = std::move(d.segments);
      on_change_(ev);
    }
    return true;
  }

  /// `name` is gone from the store: reported as withdrawn if it was known.
  void remove(const std::string& name) {
    const auto it = entries_.find(name);
    if (it == entries_.end()) return;
    const instance_id inst = it->second.instance;
    entries_.erase(it);
    if (name != self_ && on_change_) {
      metadata_event ev;
      ev.what = metadata_event::kind::withdrawn;
      ev.name = name;
      ev.instance = inst;
      on_change_(ev);
    }
  }

  const entry* find(const std::string& name) const {
    const auto it = entries_.find(name);
    return it == entries_.end() ? nullptr : &it->second;
  }

  /// Where async_connect(name) goes, from a stored value.
  std::error_code resolve(const std::string& name, resolved_peer& out) const {
    const entry* e = find(name);
    if (e == nullptr) return errc::name_not_found;
    return to_resolved(e->value, out);
  }

  std::error_code to_resolved(std::string_view value, resolved_peer& out) const {
    control::peer_descriptor d;
    if (auto ec = decode_entry(value, guard_, max_size_, d)) return ec;
    out.address = d.address;
    out.descriptor = std::move(d);
    return {};
  }

  /// A lookup of `name` that read `value` from the store itself: the peer,
  /// or unsigned_entry (a secret is set and the value is not signed with it:
  /// said once, with the name) or name_not_found (not a kvlink descriptor).
  std::error_code lookup(const std::string& name, std::string_view value, resolved_peer& out) {
    const std::error_code ec = to_resolved(value, out);
    if (!ec) return {};
    if (ec == errc::authentication_failed) {
      complain(name,
               "the published entry for " + name +
                   " is not signed with this cluster's secret (auth_secret): it was not used; "
                   "lookups fail with unsigned_entry until its owner, if alive, publishes its "
                   "signed entry again (within metadata_lease_ttl)");
      return errc::unsigned_entry;
    }
    return errc::name_not_found;
  }

  /// After a full read of the store: names that were not in it are marked
  /// missing (and removed by sweep_missing() if they stay away).
  void mark_missing(const std::set<std::string>& present) {
    for (auto& [name, e] : entries_) {
      if (!present.contains(name)) e.missing = true;
    }
  }
  /// Removes (and reports) the entries still marked missing.
  void sweep_missing() {
    std::vector<std::string> gone;
    for (const auto& [name, e] : entries_) {
      if (e.missing) gone.push_back(name);
    }
    for (const auto& name : gone) remove(name);
  }
  bool any_missing() const {
    for (const auto& [name, e] : entries_) {
      if (e.missing) return true;
    }
    return false;
  }

  /// Entries whose value has not changed since `before` (the HTTP backend's
  /// expiry: a live publisher rewrites its value every TTL/3).
  std::vector<std::string> unchanged_since(std::chrono::steady_clock::time_point before) const {
    std::vector<std::string> out;
    for (const auto& [name, e] : entries_) {
      if (e.changed < before) out.push_back(name);
    }
    return out;
  }

  /// Counts every entry as changed at `now` (after the store was away:
  /// nobody could refresh anything meanwhile).
  void touch_all(std::chrono::steady_clock::time_point now) {
    for (auto& [name, e] : entries_) e.changed = now;
  }

  std::size_t size() const noexcept { return entries_.size(); }
  const std::map<std::string, entry>& entries() const noexcept { return entries_; }

 private:
  void complain(const std::string& name, const std::string& why) {
    if (complaints_.insert(name + "\n" + why).second) {
      log("ignoring the metadata store's entry for \"{}\": {} (said once)", name, why);
    }
  }

  control::peer_guard guard_;
  std::size_t max_size_;
  std::string self_;
  metadata_backend::change_fn on_change_;
  std::map<std::string, entry> entries_;
  std::set<std::string> complaints_;
};

/// `done`, called once: by the returned function or after `bound`,
/// whichever comes first (a store that does not answer a withdrawal must
/// not hold up a shutdown).
inline std::shared_ptr<std::function<void()>> bounded_once(const asio::any_io_executor& ex,
                                                           std::chrono::milliseconds bound,
                                                           std::function<void()> done) {
  auto slot = std::make_shared<std::function<void()>>(std::move(done));
  auto timer = std::make_shared<asio::steady_timer>(ex, bound);
  auto fire = std::make_shared<std::function<void()>>();
  *fire = [slot, timer] {
    timer->cancel();
    if (auto f = std::move(*slot)) {
      *slot = nullptr;
      f();
    }
  };
  timer->async_wait([slot](std::error_code ec) {
    if (ec) return;
    if (auto f = std::move(*slot)) {
      *slot = nullptr;
      f();
    }
  });
  return fire;
}

/// Says once per outage that the store is unreachable, and once when it is
/// back.
class outage_log {
 public:
  explicit outage_log(std::string where) : where_(std::move(where)) {}
  void down(const std::string& why) {
    last_ = why;
    if (down_) return;
    down_ = true;
    log("metadata store {} is failing ({}): connected peers keep working, lookups by name fail "
        "with metadata_unavailable; retrying",
        where_, why);
  }
  void up(std::string_view what) {
    if (!down_) return;
    down_ = false;
    log("metadata store {} reachable again{}{}", where_, what.empty() ? "" : ": ", what);
  }
  bool is_down() const noexcept { return down_; }
  const std::string& last_error() const noexcept { return last_; }
  const std::string& where() const noexcept { return where_; }

 private:
  std::string where_;
  std::string last_;
  bool down_ = false;
};

}  // namespace kvlink::detail
