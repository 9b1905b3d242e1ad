// An engine's transports, in order of preference, and the choice per peer.
//
//   transport_set set{{rdma, tcp}, /*allow_tcp_fallback=*/true};
//   set.offer();                       // "rdma,tcp", or "tcp (rdma: no usable RDMA device)"
//   auto c = set.choose(descriptor);   // c.chosen: the first that is usable on both sides
//   c.reason;                          // "rdma", or "tcp (rdma: the peer offers no rdma)"
//
// A transport is chosen for a peer when it is available here, the peer's
// descriptor has an entry for it, and the transport says that entry is
// reachable. TCP chosen after a preferred transport was passed over is a
// fallback, refused (errc::transport_unavailable) when the configuration
// forbids it; passing over a same-host transport (shm) is not. Never
// silent: the reason names every transport passed over ("tcp (shm: the peer
// runs on another host)").
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/transport/transport.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlink {

class transport_set {
 public:
  struct choice {
    transport* chosen = nullptr;  ///< null: none reaches the peer (see error)
    std::string reason;           ///< what was chosen and why the others were not
    std::error_code error;        ///< transport_unavailable when nothing may carry data
  };

  transport_set() = default;
  transport_set(std::vector<std::shared_ptr<transport>> preferred, bool allow_tcp_fallback)
      : all_(std::move(preferred)), allow_tcp_fallback_(allow_tcp_fallback) {}

  const std::vector<std::shared_ptr<transport>>& all() const noexcept { return all_; }

  transport* find(std::string_view name) const noexcept {
    for (const auto& t : all_) {
      if (t->name() == name) return t.get();
    }
    return nullptr;
  }

  /// Whether any transport is usable here (and, without TCP fallback, any
  /// other than TCP). When not, `why` says so.
  bool usable(std::string& why) const {
    bool any = false;
    bool preferred = false;  // a network transport other than TCP is configured
    bool any_preferred = false;
    std::string reasons;
    for (const auto& t : all_) {
      const bool network_preferred = t->name() != "tcp" && !t->local_only();
      preferred = preferred || network_preferred;
      if (t->available()) {
        any = true;
        if (network_preferred) any_preferred = true;
        continue;
      }
      reasons += reasons.empty() ? "" : "; ";
      reasons += std::string(t->name()) + ": " + t->unavailable_reason();
    }
    if (!any || (!allow_tcp_fallback_ && preferred && !any_preferred)) {
      why = reasons.empty() ? "no transport configured" : reasons;
      return false;
    }
    return true;
  }

  /// What the engine offers peers: the available transports in order
  /// ("rdma,tcp"), then those that are not, with the reason
  /// ("tcp (rdma: no usable RDMA device)").
  std::string offer() const {
    std::string out;
    std::string missing;
    for (const auto& t : all_) {
      if (t->available()) {
        out += out.empty() ? "" : ",";
        out += t->name();
      } else {
        missing += missing.empty() ? "" : "; ";
        missing += std::string(t->name()) + ": " + t->unavailable_reason();
      }
    }
    if (!missing.empty()) out += (out.empty() ? "(" : " (") + missing + ")";
    return out;
  }

  /// The transport for a peer whose descriptor lists `remote` (its
  /// "transports" object).
  choice choose(const nlohmann::json& remote) const {
    choice c;
    std::string passed;
    bool passed_preferred = false;
    for (const auto& t : all_) {
      const std::string name(t->name());
      std::string why;
      if (!t->available()) {
        why = t->unavailable_reason();
      } else if (!remote.is_object() || !remote.contains(name)) {
        why = "the peer offers no " + name;
      } else if (t->reachable(remote.at(name), why)) {
        if (name == "tcp" && passed_preferred && !allow_tcp_fallback_) {
          c.error = errc::transport_unavailable;
          c.reason = "config.allow_tcp_fallback is false and " + passed;
          return c;
        }
        c.chosen = t.get();
        c.reason = passed.empty() ? name : name + " (" + passed + ")";
        return c;
      }
      passed += passed.empty() ? "" : "; ";
      passed += name + ": " + why;
      // Passing over a same-host transport (the peer is elsewhere, or
      // refuses it) is said in the reason, but makes no TCP a fallback.
      passed_preferred = passed_preferred || (name != "tcp" && !t->local_only());
    }
    c.error = errc::transport_unavailable;
    c.reason = passed.empty() ? "no transport configured" : passed;
    return c;
  }

  /// The memory kinds some available transport reaches.
  bool reaches(memory_kind k, std::string& why) const {
    for (const auto& t : all_) {
      if (t->available() && t->reaches().contains(k)) return true;
    }
    why = "no transport of this engine (" + offer() + ") reaches " + std::string(to_string(k)) +
          " memory";
    return false;
  }

 private:
  std::vector<std::shared_ptr<transport>> all_;
  bool allow_tcp_fallback_ = true;
};

}  // namespace kvlink
