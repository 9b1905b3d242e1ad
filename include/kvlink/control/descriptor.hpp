// The peer descriptor: what an engine tells others about itself. Versioned
// and instance-stamped JSON, sent in the handshake's welcome (peer to peer)
// and published by metadata backends:
//
//   {"protocol": 2, "instance": "<32 hex>", "address": "10.0.0.1:17001",
//    "name": "decode-3", "seq": 7,
//    "segments": [{"id": 1, "base": 140..., "length": 1073741824, "access": "rw",
//                  "keys": {"rdma": [4660, 4661]}}],
//    "transports": {"tcp": {...}, "rdma": {...}}}
//
// Each transport writes its own entry under "transports" and its own key
// per segment under "keys"; this layer never looks inside either. "name"
// (what peers call the engine in a metadata store) and "seq" (counts the
// engine's publications, so that a late copy never replaces a newer one)
// are optional: a descriptor without them reads as name "" and seq 0.
#pragma once

#include <kvlink/control/message.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/version.hpp>

#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlink::control {

/// What a peer tells others about itself.
struct peer_descriptor {
  unsigned protocol = protocol_version;
  instance_id instance{};
  std::string address;                                   ///< host:port of its listener
  std::string name;                                      ///< config.name; "" = not said
  std::uint64_t seq = 0;                                 ///< publication count; 0 = unordered
  std::vector<remote_segment_info> segments;             ///< ordered by id
  nlohmann::json transports = nlohmann::json::object();  ///< transport name -> its entry
};

inline nlohmann::json segments_to_json(const std::vector<remote_segment_info>& segs) {
  auto arr = nlohmann::json::array();
  for (const auto& s : segs) {
    nlohmann::json js{{"id", s.id.value()},
                      {"base", s.base},
                      {"length", s.length},
                      {"access", to_string(s.granted)}};
    if (s.keys.is_object() && !s.keys.empty()) js["keys"] = s.keys;
    arr.push_back(std::move(js));
  }
  return arr;
}

/// Parses a segment list; anything missing or mistyped is malformed.
inline std::error_code segments_from_json(const nlohmann::json& arr,
                                          std::vector<remote_segment_info>& out) {
  if (!arr.is_array()) return errc::malformed_message;
  out.clear();
  out.reserve(arr.size());
  for (const auto& js : arr) {
    if (!js.is_object()) return errc::malformed_message;
    remote_segment_info s;
    std::uint64_t id = 0;
    std::string acc;
    if (!get_field(js, "id", id) || id == 0 || !get_field(js, "base", s.base) ||
        !get_field(js, "length", s.length) || !get_field(js, "access", acc)) {
      return errc::malformed_message;
    }
    const auto a = parse_access(acc);
    if (!a) return errc::malformed_message;
    s.id = segment_id{id};
    s.granted = *a;
    if (const auto it = js.find("keys"); it != js.end()) {
      if (!it->is_object()) return errc::malformed_message;
      s.keys = *it;
    }
    out.push_back(std::move(s));
  }
  return {};
}

inline nlohmann::json to_json(const peer_descriptor& d) {
  nlohmann::json j{{"protocol", d.protocol},
                   {"instance", to_string(d.instance)},
                   {"address", d.address},
                   {"segments", segments_to_json(d.segments)},
                   {"transports", d.transports}};
  if (!d.name.empty()) j["name"] = d.name;
  if (d.seq != 0) j["seq"] = d.seq;
  return j;
}

/// Parses a descriptor. The protocol field is read first: a descriptor of
/// another version is protocol_version_mismatch, not malformed.
inline std::error_code from_json(const nlohmann::json& j, peer_descriptor& d) {
  if (!j.is_object()) return errc::malformed_message;
  std::string inst;
  if (!get_field(j, "protocol", d.protocol)) return errc::malformed_message;
  if (d.protocol != protocol_version) return errc::protocol_version_mismatch;
  if (!get_field(j, "instance", inst) || !get_field(j, "address", d.address)) {
    return errc::malformed_message;
  }
  const auto parsed = parse_instance_id(inst);
  if (!parsed || !parsed->valid()) return errc::malformed_message;
  d.instance = *parsed;
  d.name.clear();
  d.seq = 0;
  if (j.contains("name") && !get_field(j, "name", d.name)) return errc::malformed_message;
  if (j.contains("seq") && !get_field(j, "seq", d.seq)) return errc::malformed_message;
  const auto segs = j.find("segments");
  if (segs == j.end()) return errc::malformed_message;
  if (auto ec = segments_from_json(*segs, d.segments)) return ec;
  if (const auto t = j.find("transports"); t != j.end()) {
    if (!t->is_object()) return errc::malformed_message;
    d.transports = *t;
  }
  return {};
}

/// A descriptor update: the sender's segment list as it is now, and the
/// seq of the descriptor it belongs to (0: none; left out).
inline nlohmann::json make_segments(const std::vector<remote_segment_info>& segs,
                                    std::uint64_t seq = 0) {
  nlohmann::json j{{"type", "segments"}, {"segments", segments_to_json(segs)}};
  if (seq != 0) j["seq"] = seq;
  return j;
}

}  // namespace kvlink::control
