// Where a store's masters and clients meet in etcd when masters stand for
// election (store/master/election.hpp): the leader's key and the form of
// the etcd endpoints both sides are given.
//
//   key    kvlink/store/<cluster>/leader
//   value  the leader's store address, "host:port" (what clients dial)
//
// The key lives under the leader's etcd lease: it goes when the leader
// stops, hangs or is cut off from etcd for the lease's TTL, and a standby
// puts its own (the first to create it wins). Clients read it each time
// they connect (client_options::master = "etcd://host:2379[,host:2379]").
//
// Endpoints are written as kvlink's metadata URL ("etcd://h:2379,h:2379")
// or as mooncake_master's --etcd_endpoints ("h:2379;h:2379", each may
// carry "http://"); parse_etcd_endpoints takes both.
#pragma once

#include <kvlink/core/address.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace kvlink::store::wire {

/// The cluster name masters and clients use when none is given
/// (mooncake_master's --cluster_id default).
inline constexpr std::string_view default_cluster = "mooncake_cluster";

/// The cluster named `given`, or when that is empty $MC_STORE_CLUSTER_ID
/// (Mooncake's variable, read by its master and clients alike), or
/// default_cluster.
inline std::string cluster_or_default(std::string_view given) {
  if (!given.empty()) return std::string(given);
  if (const char* env = std::getenv("MC_STORE_CLUSTER_ID"); env != nullptr && *env != '\0') {
    return env;
  }
  return std::string(default_cluster);
}

/// The etcd key of `cluster`'s leader.
inline std::string leader_key(std::string_view cluster) {
  return "kvlink/store/" + std::string(cluster) + "/leader";
}

/// Whether a client's master setting names etcd rather than one master.
inline bool names_etcd(std::string_view master) { return master.rfind("etcd://", 0) == 0; }

/// "etcd://h:p,h:p", "h:p;h:p", "http://h:p;http://h:p" (separators ',' or
/// ';'; a trailing '/' allowed) -> host:port list; false when one is not
/// host:port with a port or none is given.
inline bool parse_etcd_endpoints(std::string_view text, std::vector<std::string>& out) {
  out.clear();
  if (text.rfind("etcd://", 0) == 0) text.remove_prefix(7);
  std::size_t at = 0;
  while (at <= text.size()) {
    std::size_t end = text.find_first_of(",;", at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view one = text.substr(at, end - at);
    while (!one.empty() && (one.front() == ' ' || one.front() == '\t')) one.remove_prefix(1);
    while (!one.empty() && (one.back() == ' ' || one.back() == '\t')) one.remove_suffix(1);
    if (one.rfind("https://", 0) == 0) return false;  // TLS to etcd: not for elections yet
    if (one.rfind("http://", 0) == 0) one.remove_prefix(7);
    if (!one.empty() && one.back() == '/') one.remove_suffix(1);
    if (!one.empty()) {
      std::string_view host;
      std::uint16_t port = 0;
      if (!split_host_port(one, host, port) || host.empty() || port == 0) return false;
      out.emplace_back(one);
    }
    at = end + 1;
  }
  return !out.empty();
}

}  // namespace kvlink::store::wire
