// Fuzzes the peer descriptor (include/kvlink/control/descriptor.hpp) and the
// RDMA transport's readers of it (include/kvlink/rdma/transport.hpp) the way
// the engine reaches them. The input is JSON text, parsed with nlohmann's
// non-throwing parse as control::parse_message() does:
// - a "welcome" message: its "descriptor" goes to control::from_json() (as
//   engine_core::do_connect does with welcome.value("descriptor", {}));
// - a "segments" message: its "segments" go to segments_from_json() (as
//   metadata/p2p.hpp does);
// - anything else is taken as a descriptor itself (what a metadata backend
//   publishes) and given to from_json().
// With kvlink::rdma (KVLINK_FUZZ_RDMA), every entry under "transports" goes to
// rdma::parse_remote_ports() (what rdma::transport::reachable() and connect()
// run), the ports it accepts to rdma::pair_ports() against a few local ports,
// and every segment's "keys" to rdma::parse_rkeys() (path::keys_of()).
//
// Asserts, besides "no crash, no hang, no exception, no out-of-bounds read":
// - from_json(): a descriptor whose "protocol" is an unsigned number other than
//   protocol_version is protocol_version_mismatch; one it accepts has the
//   current protocol, a valid instance id, segments with non-zero ids and an
//   object of transports; to_json() and from_json() again give the same
//   descriptor, and segments_to_json()/segments_from_json() the same segments;
// - parse_remote_ports(): accepted lists have 1..64 ports with a valid MTU and
//   a prefix <= 32, and a refusal says why;
// - pair_ports(): one pick per local port, each an index of a remote port, the
//   first remote port on the local port's IPv4 subnet when there is one;
// - parse_rkeys(): at most 64 keys, the 32-bit numbers of the "rdma" array.
#include <kvlink/control/descriptor.hpp>
#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/version.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#if defined(KVLINK_FUZZ_RDMA)
#include <kvlink/rdma/device.hpp>
#include <kvlink/rdma/transport.hpp>

#include <arpa/inet.h>
#endif

#include "fuzz_check.hpp"

namespace {

namespace control = kvlink::control;
using kvlink::errc;
using json = nlohmann::json;

void check_segments(const std::vector<kvlink::remote_segment_info>& segs) {
  for (const auto& s : segs) {
    KVLINK_FUZZ_CHECK(s.id.valid());
    KVLINK_FUZZ_CHECK(s.keys.is_object());
  }
  std::vector<kvlink::remote_segment_info> again;
  KVLINK_FUZZ_CHECK(!control::segments_from_json(control::segments_to_json(segs), again));
  KVLINK_FUZZ_CHECK(again == segs);
}

#if defined(KVLINK_FUZZ_RDMA)
namespace rdma = kvlink::rdma;

std::optional<std::uint32_t> ipv4(const std::string& s) {
  in_addr a{};
  if (inet_pton(AF_INET, s.c_str(), &a) != 1) return std::nullopt;
  return ntohl(a.s_addr);
}

void check_pairing(const std::vector<std::pair<std::string, int>>& local,
                   const std::vector<rdma::remote_port>& remote) {
  const auto picks = rdma::pair_ports(local, remote);
  if (remote.empty()) {
    KVLINK_FUZZ_CHECK(picks.empty());
    return;
  }
  KVLINK_FUZZ_CHECK(picks.size() == local.size());
  for (std::size_t i = 0; i < local.size(); ++i) {
    KVLINK_FUZZ_CHECK(picks[i] < remote.size());
    const auto mine = ipv4(local[i].first);
    const int prefix = local[i].second;
    std::size_t want = i % remote.size();
    if (mine && prefix > 0 && prefix <= 32) {
      const std::uint32_t mask =
          static_cast<std::uint32_t>(~std::uint64_t{0} << (32 - prefix)) & 0xffffffffU;
      for (std::size_t j = 0; j < remote.size(); ++j) {
        const auto theirs = ipv4(remote[j].ipv4);
        if (theirs && (*theirs & mask) == (*mine & mask)) {
          want = j;
          break;
        }
      }
    }
    KVLINK_FUZZ_CHECK(picks[i] == want);
  }
}

void check_ports(const json& entry) {
  std::vector<rdma::remote_port> ports;
  std::string why;
  if (!rdma::parse_remote_ports(entry, ports, why)) {
    KVLINK_FUZZ_CHECK(!why.empty());
    return;
  }
  KVLINK_FUZZ_CHECK(!ports.empty() && ports.size() <= 64);
  for (const auto& p : ports) {
    KVLINK_FUZZ_CHECK(rdma::mtu_from_bytes(p.mtu).has_value());
    KVLINK_FUZZ_CHECK(p.prefix >= 0 && p.prefix <= 32);
  }
  // This engine's ports: on the peer's subnets, elsewhere, and malformed.
  std::vector<std::pair<std::string, int>> local{
      {"10.0.0.1", 24}, {"192.168.7.9", 16}, {"", 0},         {"10.1.2.3", 32},
      {"not an ip", 8}, {"172.16.0.1", 33},  {"1.2.3.4", -1}, {"0.0.0.0", 1}};
  for (const auto& p : ports) local.emplace_back(p.ipv4, p.prefix);
  check_pairing(local, ports);
  check_pairing(local, {});
}

void check_rkeys(const json& keys) {
  std::vector<std::uint32_t> rkeys;
  if (!rdma::parse_rkeys(keys, rkeys)) return;
  const auto& arr = keys.at("rdma");
  KVLINK_FUZZ_CHECK(rkeys.size() == arr.size() && rkeys.size() <= 64);
  for (std::size_t i = 0; i < rkeys.size(); ++i) {
    KVLINK_FUZZ_CHECK(arr[i].get<std::uint64_t>() == rkeys[i]);
  }
}
#endif

void check_descriptor(const json& j) {
  control::peer_descriptor d;
  const std::error_code ec = control::from_json(j, d);
  KVLINK_FUZZ_CHECK(!ec || ec == errc::malformed_message || ec == errc::protocol_version_mismatch);

  // The protocol is read first: another version is never "malformed".
  if (j.is_object()) {
    const auto p = j.find("protocol");
    if (p != j.end() && p->is_number_unsigned() &&
        p->get<std::uint64_t>() <= std::numeric_limits<unsigned>::max() &&
        p->get<std::uint64_t>() != kvlink::protocol_version) {
      KVLINK_FUZZ_CHECK(ec == errc::protocol_version_mismatch);
    }
  }
  if (ec) return;

  KVLINK_FUZZ_CHECK(d.protocol == kvlink::protocol_version);
  KVLINK_FUZZ_CHECK(d.instance.valid());
  KVLINK_FUZZ_CHECK(d.transports.is_object());
  check_segments(d.segments);

  control::peer_descriptor d2;
  KVLINK_FUZZ_CHECK(!control::from_json(control::to_json(d), d2));
  KVLINK_FUZZ_CHECK(d2.protocol == d.protocol && d2.instance == d.instance &&
                    d2.address == d.address && d2.segments == d.segments &&
                    d2.transports == d.transports);

#if defined(KVLINK_FUZZ_RDMA)
  for (const auto& [name, entry] : d.transports.items()) {
    (void)name;
    check_ports(entry);
  }
  for (const auto& s : d.segments) check_rkeys(s.keys);
#endif
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // libFuzzer hands over an exactly-sized heap copy: ASan sees any overread.
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;

  json msg;
  if (!control::parse_message(text, msg)) {
    const auto type = msg.at("type").get<std::string>();
    if (type == "welcome") {
      check_descriptor(msg.value("descriptor", json{}));
    } else if (type == "segments") {
      std::vector<kvlink::remote_segment_info> segs;
      const auto it = msg.find("segments");
      if (it != msg.end() && !control::segments_from_json(*it, segs)) check_segments(segs);
    } else {
      check_descriptor(j);
    }
  } else {
    check_descriptor(j);
  }

#if defined(KVLINK_FUZZ_RDMA)
  // The readers take any JSON a descriptor entry or a key may hold.
  check_ports(j);
  check_rkeys(j);
#endif
  return 0;
}
