// RDMA device, port and GID discovery.
//
// On RoCE a port has a table of GIDs, one per (netdev address, RoCE version).
// Which entry a QP sends from decides whether packets are routable at all, so
// kvlink picks it by itself and says why:
//
//   auto found = kvlink::rdma::discover({}, ec);   // every ACTIVE port with a usable GID
//   for (auto& p : found.ports) log(p.gid.reason);
//   // "rxe0 port 1 GID index 1: RoCE v2, IPv4-mapped 10.0.0.1 on eth0"
//
// The rule (select_gid()): only RoCE v2 entries with a netdev attached are
// candidates; an IPv4-mapped address (::ffff:a.b.c.d) beats a global IPv6
// address, which beats a link-local one (fe80::/10, not routable); ties go to
// the lowest index. A configured index overrides the rule when that entry
// exists. The kernel publishes the table in sysfs
// (<root>/class/infiniband/<dev>/ports/<port>/{gids,gid_attrs/types,
// gid_attrs/ndevs}/<index>); reading it takes the root as a parameter so the
// parsing is tested on fake trees.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/rdma/verbs.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <arpa/inet.h>
#include <infiniband/verbs.h>

namespace kvlink::rdma {

// ---------------------------------------------------------------------------
// MTU

/// An ibv_mtu in bytes (256 ... 4096); 0 for a value verbs does not define.
constexpr int mtu_bytes(ibv_mtu mtu) noexcept {
  switch (mtu) {
    case IBV_MTU_256:
      return 256;
    case IBV_MTU_512:
      return 512;
    case IBV_MTU_1024:
      return 1024;
    case IBV_MTU_2048:
      return 2048;
    case IBV_MTU_4096:
      return 4096;
  }
  return 0;
}

/// The ibv_mtu for a byte count from a peer descriptor; nullopt unless it is
/// one of 256, 512, 1024, 2048, 4096.
constexpr std::optional<ibv_mtu> mtu_from_bytes(int bytes) noexcept {
  switch (bytes) {
    case 256:
      return IBV_MTU_256;
    case 512:
      return IBV_MTU_512;
    case 1024:
      return IBV_MTU_1024;
    case 2048:
      return IBV_MTU_2048;
    case 4096:
      return IBV_MTU_4096;
    default:
      return std::nullopt;
  }
}

/// The path MTU of a connection: the smaller of both ports' active MTU (a
/// larger one would be dropped by the side that cannot take it).
constexpr ibv_mtu path_mtu(ibv_mtu local_active, ibv_mtu remote_active) noexcept {
  return mtu_bytes(local_active) <= mtu_bytes(remote_active) ? local_active : remote_active;
}

// ---------------------------------------------------------------------------
// GIDs

/// A GID in network byte order, as in ibv_gid::raw.
using gid_bytes = std::array<std::uint8_t, 16>;

inline ibv_gid to_ibv_gid(const gid_bytes& g) noexcept {
  ibv_gid out{};
  std::memcpy(out.raw, g.data(), g.size());
  return out;
}
inline gid_bytes from_ibv_gid(const ibv_gid& g) noexcept {
  gid_bytes out{};
  std::memcpy(out.data(), g.raw, out.size());
  return out;
}

constexpr bool is_zero(const gid_bytes& g) noexcept {
  return std::all_of(g.begin(), g.end(), [](std::uint8_t b) { return b == 0; });
}

/// ::ffff:a.b.c.d, the form RoCE v2 gives an IPv4 address.
constexpr bool is_ipv4_mapped(const gid_bytes& g) noexcept {
  for (std::size_t i = 0; i < 10; ++i)
    if (g[i] != 0) return false;
  return g[10] == 0xff && g[11] == 0xff;
}

/// fe80::/10: valid on one link only.
constexpr bool is_link_local(const gid_bytes& g) noexcept {
  return g[0] == 0xfe && (g[1] & 0xc0) == 0x80;
}

/// Parses a GID as sysfs and most tools write it
/// ("fe80:0000:0000:0000:5054:00ff:fe12:3456", or any IPv6 text form).
inline std::optional<gid_bytes> parse_gid(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  if (text.empty() || text.size() > 45) return std::nullopt;
  const std::string s{text};
  gid_bytes g{};
  if (inet_pton(AF_INET6, s.c_str(), g.data()) != 1) return std::nullopt;
  return g;
}

/// "10.0.0.1" for an IPv4-mapped GID, the IPv6 text form otherwise.
inline std::string format_gid(const gid_bytes& g) {
  if (is_ipv4_mapped(g)) {
    return std::to_string(g[12]) + '.' + std::to_string(g[13]) + '.' + std::to_string(g[14]) + '.' +
           std::to_string(g[15]);
  }
  char buf[INET6_ADDRSTRLEN] = {};
  if (inet_ntop(AF_INET6, g.data(), buf, sizeof buf) == nullptr) return "?";
  return buf;
}

/// One row of a port's GID table.
struct gid_entry {
  int index = 0;
  gid_bytes gid{};
  std::string type;    ///< "RoCE v2", "IB/RoCE v1"; empty when the kernel gives none
  std::string netdev;  ///< "eth0"; empty when no netdev is attached
};

namespace detail {

/// The first line of a small sysfs file, without its newline; nullopt when it
/// is missing or unreadable (sysfs answers EINVAL for unused GID entries).
inline std::optional<std::string> read_line(const std::filesystem::path& p) {
  std::ifstream in{p};
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r' || line.back() == ' '))
    line.pop_back();
  return line;
}

inline std::optional<int> parse_index(std::string_view s) {
  int v = 0;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, v);
  if (ec != std::errc{} || ptr != end || v < 0) return std::nullopt;
  return v;
}

inline std::filesystem::path port_dir(const std::filesystem::path& sysfs_root,
                                      std::string_view device, std::uint8_t port) {
  return sysfs_root / "class" / "infiniband" / std::string{device} / "ports" / std::to_string(port);
}

inline std::string describe(const gid_entry& e) {
  std::string s = e.type.empty() ? std::string{"unknown type"} : e.type;
  s += ", ";
  if (is_ipv4_mapped(e.gid))
    s += "IPv4-mapped ";
  else if (is_link_local(e.gid))
    s += "IPv6 link-local ";
  else
    s += "IPv6 ";
  s += format_gid(e.gid);
  s += e.netdev.empty() ? std::string{" with no netdev"} : " on " + e.netdev;
  return s;
}

}  // namespace detail

/// Reads the GID table of `device` port `port` under `sysfs_root` (normally
/// "/sys"). Zero GIDs (unused entries) are left out; rows come sorted by
/// index. A port without a gids directory is errc::no_device.
inline std::vector<gid_entry> read_gid_table(const std::filesystem::path& sysfs_root,
                                             std::string_view device, std::uint8_t port,
                                             std::error_code& ec) {
  namespace fs = std::filesystem;
  std::vector<gid_entry> table;
  const fs::path dir = detail::port_dir(sysfs_root, device, port);
  std::error_code fs_ec;
  fs::directory_iterator it{dir / "gids", fs_ec};
  if (fs_ec) {
    ec = make_error_code(errc::no_device);
    return table;
  }
  for (; it != fs::directory_iterator{}; it.increment(fs_ec)) {
    if (fs_ec) break;
    const std::string name = it->path().filename().string();
    const auto index = detail::parse_index(name);
    if (!index) continue;
    const auto text = detail::read_line(it->path());
    if (!text) continue;
    const auto gid = parse_gid(*text);
    if (!gid || is_zero(*gid)) continue;
    gid_entry e;
    e.index = *index;
    e.gid = *gid;
    e.type = detail::read_line(dir / "gid_attrs" / "types" / name).value_or("");
    e.netdev = detail::read_line(dir / "gid_attrs" / "ndevs" / name).value_or("");
    table.push_back(std::move(e));
  }
  std::sort(table.begin(), table.end(),
            [](const gid_entry& a, const gid_entry& b) { return a.index < b.index; });
  ec.clear();
  return table;
}

/// The GID a port's QPs send from, and why it was chosen.
struct gid_choice {
  std::string device;
  std::uint8_t port = 0;
  int index = 0;
  gid_bytes gid{};
  std::string type;
  std::string netdev;
  /// One line for logs and peer descriptors:
  /// "rxe0 port 1 GID index 1: RoCE v2, IPv4-mapped 10.0.0.1 on eth0".
  std::string reason;
};

/// Picks the GID from `table` by the rule at the top of this file, or takes
/// `override_index` when given. Errors: errc::no_device when no entry
/// qualifies; errc::invalid_argument when the override names no entry.
inline std::optional<gid_choice> select_gid(std::span<const gid_entry> table,
                                            std::string_view device, std::uint8_t port,
                                            std::optional<int> override_index,
                                            std::error_code& ec) {
  const std::string where = std::string{device} + " port " + std::to_string(port) + " GID index ";
  auto make = [&](const gid_entry& e, std::string why) {
    ec.clear();
    return gid_choice{std::string{device},
                      port,
                      e.index,
                      e.gid,
                      e.type,
                      e.netdev,
                      where + std::to_string(e.index) + ": " + std::move(why)};
  };

  if (override_index) {
    for (const gid_entry& e : table) {
      if (e.index == *override_index)
        return make(e, "set by configuration; " + detail::describe(e));
    }
    ec = make_error_code(errc::invalid_argument);
    return std::nullopt;
  }

  // Rank: 0 IPv4-mapped, 1 global IPv6, 2 link-local IPv6.
  const gid_entry* best = nullptr;
  int best_rank = 3;
  for (const gid_entry& e : table) {
    if (e.type != "RoCE v2" || e.netdev.empty()) continue;
    const int rank = is_ipv4_mapped(e.gid) ? 0 : is_link_local(e.gid) ? 2 : 1;
    if (rank < best_rank) {  // table is sorted: the first of a rank has the lowest index
      best = &e;
      best_rank = rank;
    }
  }
  if (best == nullptr) {
    ec = make_error_code(errc::no_device);
    return std::nullopt;
  }
  std::string why = detail::describe(*best);
  if (best_rank == 1) why += " (no IPv4-mapped RoCE v2 GID)";
  if (best_rank == 2) why += " (no IPv4-mapped or global RoCE v2 GID; link-local is not routable)";
  return make(*best, std::move(why));
}

/// read_gid_table() then select_gid().
inline std::optional<gid_choice> choose_gid(const std::filesystem::path& sysfs_root,
                                            std::string_view device, std::uint8_t port,
                                            std::optional<int> override_index,
                                            std::error_code& ec) {
  const auto table = read_gid_table(sysfs_root, device, port, ec);
  if (ec) return std::nullopt;
  return select_gid(table, device, port, override_index, ec);
}

// ---------------------------------------------------------------------------
// Ports

/// One port of one device, as ibv_query_port() saw it.
struct port_info {
  std::string device;
  std::uint8_t port = 0;
  ibv_port_state state = IBV_PORT_NOP;
  ibv_mtu active_mtu = IBV_MTU_1024;
  ibv_mtu max_mtu = IBV_MTU_1024;
  std::uint16_t lid = 0;
  std::uint8_t link_layer = IBV_LINK_LAYER_UNSPECIFIED;
};

/// A usable port: ACTIVE, with the GID chosen for it.
struct rdma_port {
  port_info port;
  gid_choice gid;
};

struct discovery_options {
  std::filesystem::path sysfs_root = "/sys";
  std::optional<int> gid_index;  ///< overrides the GID rule on every port
  std::string device;            ///< only this device ("rxe0") when not empty
};

struct discovery_result {
  std::vector<rdma_port> ports;
  /// One line per port left out, with the reason ("rxe1 port 1: DOWN").
  std::vector<std::string> skipped;
};

/// Every port of every device, queried through verbs.
inline std::vector<port_info> list_ports(const device_list& devices) {
  std::vector<port_info> out;
  for (ibv_device* dev : devices) {
    context ctx{dev};
    const ibv_device_attr dattr = ctx.query_device();
    for (int p = 1; p <= dattr.phys_port_cnt; ++p) {
      const auto port = static_cast<std::uint8_t>(p);
      const ibv_port_attr pattr = ctx.query_port(port);
      out.push_back(port_info{std::string{ctx.name()}, port, pattr.state, pattr.active_mtu,
                              pattr.max_mtu, pattr.lid, pattr.link_layer});
    }
  }
  return out;
}

/// Finds the usable ports. Errors: errc::no_device when there are no
/// devices or none has a usable port (the reasons are in `skipped`); verbs
/// failures while querying keep their errno. Never throws for want of
/// devices.
inline discovery_result discover(const discovery_options& opt, std::error_code& ec) {
  discovery_result result;
  device_list devices = device_list::open(ec);
  if (ec) return result;
  std::vector<port_info> ports;
  try {
    ports = list_ports(devices);
  } catch (const std::system_error& e) {
    ec = e.code();
    return result;
  }
  for (port_info& p : ports) {
    const std::string where = p.device + " port " + std::to_string(p.port);
    if (!opt.device.empty() && p.device != opt.device) continue;
    if (p.state != IBV_PORT_ACTIVE) {
      result.skipped.push_back(where + ": not ACTIVE (" + ibv_port_state_str(p.state) + ")");
      continue;
    }
    std::error_code gec;
    std::optional<gid_choice> gid;
    if (p.link_layer == IBV_LINK_LAYER_INFINIBAND && !opt.gid_index) {
      // InfiniBand routes by LID inside a subnet; GID index 0 is the port GID.
      auto table = read_gid_table(opt.sysfs_root, p.device, p.port, gec);
      if (!gec && !table.empty() && table.front().index == 0) {
        gid = gid_choice{p.device,
                         p.port,
                         0,
                         table.front().gid,
                         table.front().type,
                         "",
                         where + " GID index 0: InfiniBand port GID " +
                             format_gid(table.front().gid) + ", LID " + std::to_string(p.lid)};
      }
    } else {
      gid = choose_gid(opt.sysfs_root, p.device, p.port, opt.gid_index, gec);
    }
    if (!gid) {
      result.skipped.push_back(
          where + ": no usable GID (" +
          (opt.gid_index ? "configured index " + std::to_string(*opt.gid_index) + " does not exist"
                         : std::string{"no RoCE v2 GID with a netdev"}) +
          ")");
      continue;
    }
    result.ports.push_back(rdma_port{std::move(p), std::move(*gid)});
  }
  ec = result.ports.empty() ? make_error_code(errc::no_device) : std::error_code{};
  return result;
}

}  // namespace kvlink::rdma
