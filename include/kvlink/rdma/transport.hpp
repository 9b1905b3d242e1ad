// The RDMA verbs transport (kvlink::rdma::transport), one transport of an
// engine's run-time set: kvlink/rdma.hpp makes it available to engines
// (config.transports = "rdma,tcp"; kvlink::rdma_engine). The engine's
// planner and completion contract are the same as for every transport; what
// differs is below the planner:
// - Devices: every ACTIVE port with a usable GID (device.hpp picks a RoCE v2
//   IPv4-mapped GID by itself and says why, in a line on stderr and in the
//   peer descriptor); config.rdma_devices narrows the set, rdma_gid_index
//   overrides the GID. One protection domain, completion channel and
//   completion queue per port.
// - Registration: every segment is registered with every port (in parallel,
//   one thread per extra port); its key in the descriptor is one rkey per
//   port ("keys": {"rdma": [...]}).
// - Rails: a path to a peer has one rail per local port, paired with the
//   peer's port on the same IPv4 subnet (by index when none is). A rail has
//   config.rdma_qps_per_endpoint RC queue pairs, created and connected
//   lazily: the first slice for the peer sends an "rdma_connect" over the
//   engine's control channel and the peer's RDMA transport answers with its
//   queue pairs ("rdma_accept", or "rdma_reject" with the reason). Each
//   direction has its own queue pairs, so two engines connecting to each
//   other at once simply get two independent sets.
// - Slices: one RDMA WRITE or READ each, given to the queue pair with the
//   fewest bytes outstanding among active rails, at most config.rdma_max_wr
//   per queue pair (unsignaled work requests count until a later completion
//   retires them) and no more than a completion queue holds per port. One
//   large request is cut into slices by the planner and so uses every rail.
//   Each pass over the queued slices stages their work requests per queue
//   pair and posts them as chains: one ibv_post_send() per chain, only its
//   last work request signaled. A chain ends at config.rdma_chain work
//   requests or 256 KiB (chain_limits in path_logic.hpp), so 4 KiB pieces
//   share one completion per 16 and a 1 MiB slice keeps its own. A queue
//   pair completes in order: a completion retires every work request posted
//   on it up to and including its own (retired_by()), and an error
//   completion names the work request that failed (errors are reported for
//   unsignaled ones too); those before it succeeded. A chain that the
//   device refused part of puts the unposted rest back at the front of the
//   queue and breaks the rail.
// - Completions: one coroutine per port on the engine's strand polls its
//   completion queue while work is outstanding (yielding to other handlers
//   between polls, and parking after a run of empty polls) and waits on the
//   completion channel's file descriptor when idle. No threads of its own.
// - Failure: a work request that fails breaks its queue pair, so its rail is
//   torn down at once (queue pairs moved to ERR and destroyed: after
//   ibv_destroy_qp returns the device touches none of their buffers) and
//   paused with an exponential backoff before it reconnects. Its slices are
//   retried on another rail (at most rails + 1 posts per slice) unless the
//   request itself was wrong (remote access error: fails with that
//   ibv_wc_status). When no rail is left to wait for, queued slices fail
//   with the last error. A peer whose control connection drops (process
//   gone) fails every slice with errc::peer_closed; one that stops answering
//   fails them by the transport's retry timeout or the transfer's deadline.
//   Slices are reported done only once no queue pair can touch their memory.
#pragma once

#include <kvlink/control/handshake.hpp>
#include <kvlink/control/message.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/rdma/config.hpp>
#include <kvlink/rdma/device.hpp>
#include <kvlink/rdma/gpudirect.hpp>
#include <kvlink/rdma/path_logic.hpp>
#include <kvlink/rdma/verbs.hpp>
#include <kvlink/transport/transport.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <arpa/inet.h>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <unistd.h>

namespace kvlink::rdma {

class transport;
class path;

namespace detail {

inline std::uint32_t random_psn() {
  static thread_local std::mt19937 gen{std::random_device{}()};
  return gen() & 0xffffffU;
}

/// The IPv4 prefix length of `ipv4` on `netdev` (0 when not found).
inline int ipv4_prefix(const std::string& netdev, const std::string& ipv4) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return 0;
  int prefix = 0;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || !a->ifa_netmask || a->ifa_addr->sa_family != AF_INET) continue;
    if (netdev != a->ifa_name) continue;
    char buf[INET_ADDRSTRLEN] = {};
    const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof buf);
    if (ipv4 != buf) continue;
    const auto* mask = reinterpret_cast<const sockaddr_in*>(a->ifa_netmask);
    prefix = __builtin_popcount(ntohl(mask->sin_addr.s_addr));
    break;
  }
  freeifaddrs(list);
  return prefix;
}

inline std::optional<std::uint32_t> parse_ipv4(const std::string& s) {
  in_addr a{};
  if (inet_pton(AF_INET, s.c_str(), &a) != 1) return std::nullopt;
  return ntohl(a.s_addr);
}

/// A GID as eight groups of four hex digits (the sysfs form; parse_gid()
/// reads it back whatever the address family).
inline std::string gid_wire(const gid_bytes& g) {
  std::string out;
  static constexpr char hex[] = "0123456789abcdef";
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (i > 0 && i % 2 == 0) out += ':';
    out += hex[g[i] >> 4];
    out += hex[g[i] & 0xf];
  }
  return out;
}

inline std::string ipv4_of(const gid_bytes& g) {
  if (!is_ipv4_mapped(g)) return {};
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, g.data() + 12, buf, sizeof buf);
  return buf;
}

}  // namespace detail

/// A port of the peer, as its descriptor describes it.
struct remote_port {
  std::string device;
  gid_bytes gid{};
  int mtu = 1024;
  std::string ipv4;
  int prefix = 0;
};

/// Parses the "rdma" entry of a peer descriptor; false when it is malformed.
inline bool parse_remote_ports(const nlohmann::json& entry, std::vector<remote_port>& out,
                               std::string& why) {
  out.clear();
  const auto it = entry.is_object() ? entry.find("ports") : entry.end();
  if (it == entry.end() || !it->is_array() || it->empty() || it->size() > 64) {
    why = "the peer's rdma entry has no valid port list";
    return false;
  }
  for (const auto& p : *it) {
    remote_port r;
    std::string gid;
    unsigned mtu = 0, prefix = 0;
    if (!p.is_object() || !control::get_field(p, "gid", gid) ||
        !control::get_field(p, "mtu", mtu) || mtu > 4096 ||
        !mtu_from_bytes(static_cast<int>(mtu))) {
      why = "a port in the peer's rdma entry is malformed";
      return false;
    }
    const auto g = parse_gid(gid);
    if (!g) {
      why = "a port in the peer's rdma entry has a malformed GID";
      return false;
    }
    r.gid = *g;
    r.mtu = static_cast<int>(mtu);
    (void)control::get_field(p, "device", r.device);
    (void)control::get_field(p, "ipv4", r.ipv4);
    if (control::get_field(p, "prefix", prefix) && prefix <= 32)
      r.prefix = static_cast<int>(prefix);
    out.push_back(std::move(r));
  }
  return true;
}

/// For each local port (IPv4 and prefix), the peer's port on the same
/// subnet, else the one with the same index (modulo the peer's count).
inline std::vector<std::size_t> pair_ports(const std::vector<std::pair<std::string, int>>& local,
                                           const std::vector<remote_port>& remote) {
  std::vector<std::size_t> out;
  if (remote.empty()) return out;
  for (std::size_t i = 0; i < local.size(); ++i) {
    std::size_t pick = i % remote.size();
    const auto mine = detail::parse_ipv4(local[i].first);
    const int prefix = local[i].second;
    if (mine && prefix > 0 && prefix <= 32) {
      const std::uint32_t mask = prefix == 32 ? 0xffffffffU : ~(0xffffffffU >> prefix);
      for (std::size_t j = 0; j < remote.size(); ++j) {
        const auto theirs = detail::parse_ipv4(remote[j].ipv4);
        if (theirs && (*theirs & mask) == (*mine & mask)) {
          pick = j;
          break;
        }
      }
    }
    out.push_back(pick);
  }
  return out;
}

/// One local port: its verbs objects, completion polling and the queue
/// pairs whose completions land in its queue.
struct port_state {
  rdma_port info;
  ::kvlink::rdma::context ctx;
  protection_domain pd;
  completion_channel channel;
  completion_queue cq;
  std::size_t cq_capacity = 0;
  std::size_t outstanding = 0;  // work requests posted, not completed (all paths)
  std::uint8_t max_init_rd = 1;
  std::uint8_t max_dest_rd = 1;
  std::string ipv4;
  int prefix = 0;
  std::unique_ptr<asio::posix::stream_descriptor> fd;
  struct owner {
    std::weak_ptr<path> p;
    std::uint32_t rail = 0;
    std::uint32_t qp = 0;
  };
  std::unordered_map<std::uint32_t, owner> qps;  // qp_num -> its path
};

// ------------------------------------------------------------------ path

/// The data path to one peer: rails x queue pairs, one lane to the planner
/// (the path spreads slices over its rails itself).
class path final : public data_path, public std::enable_shared_from_this<path> {
 public:
  path(std::shared_ptr<transport> t, transport_host& host, path_context ctx,
       std::vector<remote_port> remote, std::vector<std::size_t> pairing);
  ~path() override;

  std::span<const double> lane_weights() const noexcept override { return weights_; }
  void start() override {}
  void enqueue(std::size_t, const slice_ref& s) override { queue_.push_back({s, 0}); }
  void pump() override;
  std::size_t drop_queued(const ::kvlink::detail::transfer_op* op) override {
    const auto before = queue_.size();
    std::erase_if(queue_, [op](const pending& p) { return p.s.op == op; });
    return before - queue_.size();
  }
  bool has_in_flight(const ::kvlink::detail::transfer_op* op) const override {
    for (const auto& r : rails_)
      for (const auto& q : r.qps)
        for (const auto& p : q.inflight)
          if (p.p.s.op == op) return true;
    return false;
  }
  /// Tearing the queue pairs down is what stops the device from touching the
  /// slices' memory: the whole path goes (its peer is reported lost).
  void fence(const ::kvlink::detail::transfer_op* op, std::error_code ec) override {
    if (has_in_flight(op)) fail(ec);
  }
  void fail(std::error_code ec) override;
  void on_message(const nlohmann::json& msg) override;

  /// A completion of one of this path's queue pairs (from its port's poller).
  void on_completion(std::uint32_t rail, std::uint32_t qp, const ibv_wc& wc);

 private:
  struct pending {
    slice_ref s;
    unsigned tries = 0;
    int avoid_rail = -1;  // the rail it last failed on
  };
  struct posted {
    pending p;
    std::uint64_t wr_id = 0;
  };
  struct qp_slot {
    queue_pair qp;
    std::uint32_t psn = 0;
    /// Oldest first; the last staged.size() are staged, not posted yet.
    std::deque<posted> inflight;
    std::uint64_t bytes = 0;
    std::vector<rdma_work_request> staged;  // the chain being built
    std::uint64_t staged_bytes = 0;
  };
  struct rail {
    std::size_t port = 0;         // index into the transport's ports
    std::size_t remote_port = 0;  // index into remote_
    rail_health health;
    std::vector<qp_slot> qps;
    std::unique_ptr<asio::steady_timer> timer;  // connect timeout, then backoff
  };

  void connect_rail(std::uint32_t r);
  void rail_failed(std::uint32_t r, std::error_code ec, bool counts = true);
  void teardown(std::uint32_t r, std::error_code ec, failure_kind kind);
  void requeue_or_fail(pending p, std::error_code ec, failure_kind kind, std::uint32_t on_rail);
  bool port_active(std::size_t port) const;
  void post_queued();
  /// Posts rail r's queue pair qi's staged work requests as one chain, the
  /// last one signaled; on failure the unposted ones are back at the front
  /// of the queue.
  std::error_code post_chain(std::uint32_t r, std::size_t qi);
  /// Ends the chain being built on rail r's queue pair qi: the last `n` of
  /// its work requests were not posted and go back to the front of the
  /// queue, in order (not a try).
  void unstage(std::uint32_t r, std::size_t qi, std::size_t n);
  void check_stranded();
  unsigned max_tries() const noexcept { return static_cast<unsigned>(rails_.size()) + 1; }
  /// The peer's segment as this path addresses it: base, length, one rkey
  /// per peer port (parsed from the cache's keys once per change).
  struct remote_keys {
    std::uint64_t base = 0;
    std::uint64_t length = 0;
    std::vector<std::uint32_t> rkeys;
  };
  const remote_keys* keys_of(std::uint64_t segment);

  std::shared_ptr<transport> transport_;
  transport_host& host_;
  path_context ctx_;
  std::vector<double> weights_{1.0};
  std::uint64_t keys_generation_ = ~std::uint64_t{0};
  std::unordered_map<std::uint64_t, remote_keys> keys_;
  std::vector<remote_port> remote_;
  std::vector<rail> rails_;
  std::deque<pending> queue_;
  std::vector<qp_load> loads_;
  std::vector<slice_report> retired_;  // reused by on_completion
  std::error_code last_error_;
  bool failed_ = false;
};

// ------------------------------------------------------------------ transport

/// Parses the "rdma" key of a segment (one rkey per port of the peer).
inline bool parse_rkeys(const nlohmann::json& keys, std::vector<std::uint32_t>& out) {
  out.clear();
  const auto it = keys.is_object() ? keys.find("rdma") : keys.end();
  if (it == keys.end() || !it->is_array() || it->size() > 64) return false;
  for (const auto& k : *it) {
    if (!k.is_number_unsigned() || k.get<std::uint64_t>() > 0xffffffffu) return false;
    out.push_back(k.get<std::uint32_t>());
  }
  return true;
}

class transport final : public ::kvlink::transport, public std::enable_shared_from_this<transport> {
 public:
  transport(transport_env env, rdma_config cfg)
      : env_(std::move(env)), cfg_(std::move(cfg)), strand_(env_.executor) {
    discovery_options opt;
    if (cfg_.gid_index >= 0) opt.gid_index = cfg_.gid_index;
    std::error_code ec;
    auto found = discover(opt, ec);
    if (ec) {
      reason_ = ec == errc::no_device ? "no usable RDMA device" : ec.message();
      for (const auto& s : found.skipped) reason_ += "; " + s;
      return;
    }
    const auto wanted = split_names(cfg_.devices);
    devices_ = device_list::open(ec);
    if (ec) {
      reason_ = ec.message();
      return;
    }
    for (auto& p : found.ports) {
      if (!wanted.empty() &&
          std::find(wanted.begin(), wanted.end(), p.port.device) == wanted.end()) {
        continue;
      }
      try {
        open_port(std::move(p));
      } catch (const std::system_error& e) {
        reason_ += std::string(reason_.empty() ? "" : "; ") + e.what();
      }
    }
    if (ports_.empty()) {
      if (reason_.empty()) {
        reason_ = wanted.empty() ? "no usable RDMA port"
                                 : "none of the devices in config.rdma.devices ('" + cfg_.devices +
                                       "') has a usable port";
      }
      return;
    }
    reason_.clear();
    available_ = true;
    for (const auto& p : ports_) ::kvlink::detail::log("rdma: {}", p->info.gid.reason);
  }

  ~transport() override {
    shutdown();
    for (auto& p : ports_) {
      if (p->fd) p->fd->release();  // the completion channel owns the fd
    }
  }

  std::string_view name() const noexcept override { return "rdma"; }
  bool available() const noexcept override { return available_; }
  std::string unavailable_reason() const override { return reason_; }
  /// Device memory too when the engine has a device runtime: registered
  /// with GPUDirect where it can be (rdma/gpudirect.hpp), staged otherwise.
  memory_kinds reaches() const noexcept override {
    return env_.device ? memory_kinds{memory_kind::host, memory_kind::device}
                       : memory_kinds{memory_kind::host};
  }
  /// A device segment is reached directly only when GPUDirect registered it.
  bool reaches_segment(const segment_info& seg) const override {
    if (seg.memory.kind != memory_kind::device) return true;
    std::lock_guard lock{mr_mutex_};
    return mrs_.count(seg.id) != 0;
  }
  const rdma_config& cfg() const noexcept { return cfg_; }
  std::chrono::milliseconds connect_timeout() const noexcept { return env_.connect_timeout; }
  const asio::any_io_executor& strand() const noexcept { return strand_; }
  std::vector<std::unique_ptr<port_state>>& ports() noexcept { return ports_; }
  std::uint64_t next_wr_id() noexcept { return ++wr_ids_; }

  void start() override {
    for (std::size_t i = 0; i < ports_.size(); ++i) {
      asio::co_spawn(strand_, poll_loop(shared_from_this(), i), asio::detached);
    }
  }

  nlohmann::json describe() const override {
    auto arr = nlohmann::json::array();
    for (const auto& p : ports_) {
      arr.push_back({{"device", p->info.port.device},
                     {"port", p->info.port.port},
                     {"gid", detail::gid_wire(p->info.gid.gid)},
                     {"gid_index", p->info.gid.index},
                     {"why", p->info.gid.reason},
                     {"mtu", static_cast<unsigned>(mtu_bytes(p->info.port.active_mtu))},
                     {"ipv4", p->ipv4},
                     {"prefix", static_cast<unsigned>(p->prefix)}});
    }
    return {{"ports", std::move(arr)}};
  }

  std::error_code register_memory(const segment_info& seg, std::string& what) override {
    if (!available_) return {};
    if (seg.memory.kind == memory_kind::device) return register_device_memory(seg);
    const segment_id id = seg.id;
    void* base = reinterpret_cast<void*>(seg.base);
    const std::uint64_t length = seg.length;
    const int flags = IBV_ACCESS_LOCAL_WRITE | to_ibv_access(seg.granted);
    std::vector<memory_region> mrs(ports_.size());
    std::vector<std::error_code> errs(ports_.size());
    auto one = [&](std::size_t i) {
      mrs[i] = memory_region(ports_[i]->pd, base, static_cast<std::size_t>(length), flags, errs[i]);
    };
    // Pinning is per device: the devices work in parallel.
    std::vector<std::thread> helpers;
    for (std::size_t i = 1; i < ports_.size(); ++i) helpers.emplace_back(one, i);
    if (!ports_.empty()) one(0);
    for (auto& t : helpers) t.join();
    for (std::size_t i = 0; i < ports_.size(); ++i) {
      if (errs[i]) {
        what = "ibv_reg_mr(segment " + std::to_string(id.value()) + " on " +
               ports_[i]->info.port.device + "): " + errs[i].message();
        return errs[i];
      }
    }
    std::lock_guard lock{mr_mutex_};
    mrs_[id] = std::move(mrs);
    return {};
  }

  /// GPUDirect for a device segment: dma-buf, else the device pointer
  /// (nvidia-peermem), else staging (no registration: the engine moves the
  /// bytes through pinned chunks, and peers cannot address the segment over
  /// RDMA). The choice and its reason go to the log.
  std::error_code register_device_memory(const segment_info& seg) {
    gpudirect_facts f;
    f.device_memory = true;
    f.have_reg_dmabuf_mr = true;  // rdma-core 34 or later (Debian 12: 44)
    f.peermem = peermem_loaded();
    void* base = reinterpret_cast<void*>(seg.base);
    int fd = -1;
    if (env_.device) {
      std::error_code dec;
      std::uint64_t offset = 0;
      fd = env_.device->dmabuf_fd(base, seg.length, offset, dec, f.dmabuf_error);
      f.dmabuf_fd = fd >= 0;
      f.dmabuf_offset = offset;
      f.dmabuf_start = seg.base - offset;
      f.dmabuf_length = offset + seg.length;
    }
    const int flags = IBV_ACCESS_LOCAL_WRITE | to_ibv_access(seg.granted);
    gpudirect_choice choice;
    std::vector<memory_region> mrs;
    for (;;) {
      choice = choose_gpudirect(f);
      if (choice.method == gpudirect_method::staging) break;
      mrs.clear();
      mrs.resize(ports_.size());
      std::error_code ec;
      for (std::size_t i = 0; i < ports_.size() && !ec; ++i) {
        mrs[i] = choice.method == gpudirect_method::dmabuf
                     ? memory_region(ports_[i]->pd, f.dmabuf_offset,
                                     static_cast<std::size_t>(seg.length), seg.base, fd, flags, ec)
                     : memory_region(ports_[i]->pd, base, static_cast<std::size_t>(seg.length),
                                     flags, ec);
      }
      if (!ec) break;
      mrs.clear();
      (choice.method == gpudirect_method::dmabuf ? f.reg_dmabuf_error : f.reg_mr_error) =
          ec.value();
    }
    if (fd >= 0) ::close(fd);
    ::kvlink::detail::log("rdma: segment {} ({} bytes of device {} memory): {}", seg.id.value(),
                          seg.length, seg.memory.device, choice.reason);
    if (!mrs.empty()) {
      std::lock_guard lock{mr_mutex_};
      mrs_[seg.id] = std::move(mrs);
    }
    return {};
  }

  void unregister_memory(segment_id id) override {
    std::vector<memory_region> gone;
    {
      std::lock_guard lock{mr_mutex_};
      auto it = mrs_.find(id);
      if (it == mrs_.end()) return;
      gone = std::move(it->second);
      mrs_.erase(it);
    }
    // ibv_dereg_mr runs here, outside the lock.
  }

  /// One rkey per port, in descriptor order.
  nlohmann::json segment_key(segment_id id) const override {
    std::lock_guard lock{mr_mutex_};
    auto it = mrs_.find(id);
    if (it == mrs_.end()) return nullptr;
    auto out = nlohmann::json::array();
    for (const auto& m : it->second) out.push_back(m.rkey());
    return out;
  }

  std::optional<std::uint32_t> lkey(std::uint64_t segment, std::size_t port) const {
    std::lock_guard lock{mr_mutex_};
    auto it = mrs_.find(segment_id{segment});
    if (it == mrs_.end() || port >= it->second.size()) return std::nullopt;
    return it->second[port].lkey();
  }

  bool reachable(const nlohmann::json& remote, std::string& why) const override {
    std::vector<remote_port> ports;
    return available_ && parse_remote_ports(remote, ports, why);
  }

  /// Connects lazily: nothing happens on the wire until the first slice.
  asio::awaitable<std::error_code> connect(path_context ctx,
                                           std::shared_ptr<data_path>& out) override {
    std::vector<remote_port> ports;
    std::string why;
    if (!parse_remote_ports(ctx.entry, ports, why)) co_return errc::transport_unavailable;
    std::vector<std::pair<std::string, int>> local;
    for (const auto& p : ports_) local.emplace_back(p->ipv4, p->prefix);
    auto pairing = pair_ports(local, ports);
    out = std::make_shared<path>(shared_from_this(), *env_.host, std::move(ctx), std::move(ports),
                                 std::move(pairing));
    co_return std::error_code{};
  }

  std::optional<nlohmann::json> on_request(const void* session,
                                           const nlohmann::json& msg) override {
    if (msg.value("type", std::string{}) != "rdma_connect") return std::nullopt;
    std::uint32_t rail = 0, gen = 0;
    if (!control::get_field(msg, "rail", rail) || !control::get_field(msg, "gen", gen)) {
      return reject(0, 0, errc::malformed_message, "rdma_connect without rail/gen");
    }
    std::string what;
    std::vector<queue_pair> qps;
    nlohmann::json answer = nlohmann::json::array();
    std::uint8_t dest_rd = 1;
    if (auto ec = accept_qps(session, msg, rail, qps, answer, dest_rd, what)) {
      return reject(rail, gen, ec, what);
    }
    auto& slot = accepted_[{session, rail}];
    slot = std::move(qps);  // a rebuilt rail replaces its old queue pairs
    return nlohmann::json{{"type", "rdma_accept"},
                          {"rail", rail},
                          {"gen", gen},
                          {"qps", std::move(answer)},
                          {"rd_atomic", dest_rd}};
  }

  void session_closed(const void* session) override {
    for (auto it = accepted_.begin(); it != accepted_.end();) {
      it = it->first.first == session ? accepted_.erase(it) : std::next(it);
    }
  }

  void shutdown() override {
    if (stopped_) return;
    stopped_ = true;
    accepted_.clear();
    for (auto& p : ports_) {
      if (p->fd) {
        std::error_code ignored;
        p->fd->cancel(ignored);
      }
    }
  }

 private:
  static std::vector<std::string> split_names(const std::string& s) {
    std::vector<std::string> out;
    std::size_t start = 0;
    while (start <= s.size()) {
      const auto comma = s.find(',', start);
      auto name = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!name.empty()) out.push_back(std::move(name));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    return out;
  }

  void open_port(rdma_port p) {
    auto ps = std::make_unique<port_state>();
    ibv_device* dev = devices_.find(p.port.device);
    if (!dev) throw std::system_error(make_error_code(errc::no_device), p.port.device);
    ps->ctx = ::kvlink::rdma::context{dev};
    ps->pd = protection_domain{ps->ctx};
    ps->channel = completion_channel{ps->ctx};
    const ibv_device_attr attr = ps->ctx.query_device();
    const int depth = std::min(attr.max_cqe, 16384);
    ps->cq = completion_queue{ps->ctx, depth, &ps->channel};
    ps->cq_capacity = static_cast<std::size_t>(ps->cq.capacity());
    ps->max_init_rd = static_cast<std::uint8_t>(std::clamp(attr.max_qp_init_rd_atom, 1, 16));
    ps->max_dest_rd = static_cast<std::uint8_t>(std::clamp(attr.max_qp_rd_atom, 1, 16));
    ps->ipv4 = detail::ipv4_of(p.gid.gid);
    if (!ps->ipv4.empty()) ps->prefix = detail::ipv4_prefix(p.gid.netdev, ps->ipv4);
    const int fd = ps->channel.fd();
    const int fl = ::fcntl(fd, F_GETFL);
    if (fl >= 0) ::fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    ps->fd = std::make_unique<asio::posix::stream_descriptor>(strand_, fd);
    ps->info = std::move(p);
    ports_.push_back(std::move(ps));
  }

  static nlohmann::json reject(std::uint32_t rail, std::uint32_t gen, std::error_code ec,
                               const std::string& what) {
    return {{"type", "rdma_reject"},
            {"rail", rail},
            {"gen", gen},
            {"code", static_cast<unsigned>(ec.category() == error_category()
                                               ? ec.value()
                                               : static_cast<int>(errc::transport_unavailable))},
            {"message", what.empty() ? ec.message() : what}};
  }

  std::error_code accept_qps(const void* session, const nlohmann::json& msg, std::uint32_t rail,
                             std::vector<queue_pair>& qps, nlohmann::json& answer,
                             std::uint8_t& dest_rd, std::string& what) {
    std::uint32_t port_index = 0;
    unsigned mtu = 0;
    std::string gid_text;
    if (!control::get_field(msg, "port", port_index) || port_index >= ports_.size()) {
      what = "rdma_connect names no port of this engine";
      return errc::malformed_message;
    }
    if (!control::get_field(msg, "mtu", mtu) || mtu > 4096 ||
        !mtu_from_bytes(static_cast<int>(mtu)) || !control::get_field(msg, "gid", gid_text) ||
        !parse_gid(gid_text)) {
      what = "rdma_connect with a malformed mtu or gid";
      return errc::malformed_message;
    }
    const auto it = msg.find("qps");
    if (it == msg.end() || !it->is_array() || it->empty() || it->size() > 64) {
      what = "rdma_connect needs 1 to 64 queue pairs";
      return errc::malformed_message;
    }
    if (rail >= 1024 || (accepted_.size() >= 4096 && !accepted_.contains({session, rail}))) {
      what = "too many rails";
      return errc::queue_full;
    }
    auto& p = *ports_[port_index];
    const ibv_gid remote_gid = to_ibv_gid(*parse_gid(gid_text));
    const ibv_mtu path = path_mtu(p.info.port.active_mtu, *mtu_from_bytes(static_cast<int>(mtu)));
    dest_rd = p.max_dest_rd;
    for (const auto& q : *it) {
      std::uint32_t qpn = 0, psn = 0;
      if (!q.is_object() || !control::get_field(q, "qpn", qpn) ||
          !control::get_field(q, "psn", psn) || qpn > 0xffffffU || psn > 0xffffffU) {
        what = "rdma_connect with a malformed queue pair";
        return errc::malformed_message;
      }
      std::error_code ec;
      queue_pair qp{p.pd, p.cq, p.cq, qp_capacity{1, 1, 1, 1, 0}, IBV_QPT_RC, ec};
      if (ec) {
        what = "ibv_create_qp: " + ec.message();
        return ec;
      }
      const std::uint32_t mine = detail::random_psn();
      qp.to_init(p.info.port.port,
                 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, ec);
      rtr_params rtr;
      rtr.remote_qpn = qpn;
      rtr.remote_psn = psn;
      rtr.remote_gid = remote_gid;
      rtr.sgid_index = static_cast<std::uint8_t>(p.info.gid.index);
      rtr.port = p.info.port.port;
      rtr.mtu = path;
      rtr.max_dest_rd_atomic = dest_rd;
      if (!ec) qp.to_rtr(rtr, ec);
      rts_params rts;
      rts.psn = mine;
      if (!ec) qp.to_rts(rts, ec);
      if (ec) {
        what = "ibv_modify_qp(target QP " + std::to_string(qp.qp_num()) + "): " + ec.message();
        return ec;
      }
      answer.push_back({{"qpn", qp.qp_num()}, {"psn", mine}});
      qps.push_back(std::move(qp));
    }
    return {};
  }

  static asio::awaitable<void> poll_loop(std::shared_ptr<transport> self, std::size_t index) {
    constexpr int spin_limit = 64;  // empty polls with work outstanding before parking
    auto& p = *self->ports_[index];
    std::array<ibv_wc, 32> wcs{};
    int empty = 0;
    for (;;) {
      if (self->stopped_) break;
      std::error_code ec;
      auto n = p.cq.poll(wcs, ec);
      if (ec) n = 0;
      if (n > 0) {
        empty = 0;
        self->dispatch(p, std::span<const ibv_wc>(wcs.data(), n));
        if (n == wcs.size()) continue;  // more may be waiting
        co_await asio::post(self->strand_, asio::use_awaitable);
        continue;
      }
      if (p.outstanding > 0 && ++empty < spin_limit) {
        co_await asio::post(self->strand_, asio::use_awaitable);
        continue;
      }
      empty = 0;
      // Park: arm the queue, poll once more (a completion may have arrived
      // before arming), then wait for the channel's event.
      if (p.cq.request_notify()) {
        co_await asio::post(self->strand_, asio::use_awaitable);
        continue;
      }
      n = p.cq.poll(wcs, ec);
      if (!ec && n > 0) {
        self->dispatch(p, std::span<const ibv_wc>(wcs.data(), n));
        continue;
      }
      auto [wec] = co_await p.fd->async_wait(asio::posix::stream_descriptor::wait_read,
                                             control::use_nothrow);
      if (self->stopped_ || wec == asio::error::operation_aborted) break;
      // Each event is acknowledged at once: ibv_destroy_cq waits for every
      // event taken from the channel to be acknowledged, and this coroutine
      // may never run again after the engine is gone.
      std::error_code gec;
      while (p.channel.get_event(gec) != nullptr) p.cq.ack_events(1);
    }
    if (p.fd) p.fd->release();  // the completion channel owns the fd
  }

  void dispatch(port_state& p, std::span<const ibv_wc> wcs) {
    for (const auto& wc : wcs) {
      auto it = p.qps.find(wc.qp_num);
      if (it == p.qps.end()) continue;  // a queue pair torn down already
      auto owner = it->second;
      if (auto path = owner.p.lock()) path->on_completion(owner.rail, owner.qp, wc);
    }
  }

  transport_env env_;
  rdma_config cfg_;
  asio::any_io_executor strand_;
  bool available_ = false;
  bool stopped_ = false;
  std::string reason_;
  device_list devices_;
  std::vector<std::unique_ptr<port_state>> ports_;
  mutable std::mutex mr_mutex_;
  std::unordered_map<segment_id, std::vector<memory_region>> mrs_;
  std::map<std::pair<const void*, std::uint32_t>, std::vector<queue_pair>> accepted_;
  std::uint64_t wr_ids_ = 0;
};

// ------------------------------------------------------------------ path impl

inline path::path(std::shared_ptr<transport> t, transport_host& host, path_context ctx,
                  std::vector<remote_port> remote, std::vector<std::size_t> pairing)
    : transport_(std::move(t)), host_(host), ctx_(std::move(ctx)), remote_(std::move(remote)) {
  for (std::size_t i = 0; i < pairing.size(); ++i) {
    rail r;
    r.port = i;
    r.remote_port = pairing[i];
    r.timer = std::make_unique<asio::steady_timer>(transport_->strand());
    rails_.push_back(std::move(r));
  }
}

inline path::~path() {
  for (std::uint32_t r = 0; r < rails_.size(); ++r) {
    auto& rl = rails_[r];
    auto& port = *transport_->ports()[rl.port];
    for (auto& q : rl.qps) {
      if (q.qp) port.qps.erase(q.qp.qp_num());
      port.outstanding -= std::min(port.outstanding, q.inflight.size());
    }
  }
}

inline const path::remote_keys* path::keys_of(std::uint64_t segment) {
  // Rebuilt when the peer's segment list changed: a slice then costs one
  // hash lookup, not a copy of the cached entry.
  if (const auto g = ctx_.cache->generation(); g != keys_generation_) {
    keys_.clear();
    for (const auto& seg : ctx_.cache->segments(ctx_.peer)) {
      remote_keys k{seg.base, seg.length, {}};
      if (parse_rkeys(seg.keys, k.rkeys)) keys_.emplace(seg.id.value(), std::move(k));
    }
    keys_generation_ = g;
  }
  const auto it = keys_.find(segment);
  return it == keys_.end() ? nullptr : &it->second;
}

inline void path::pump() {
  if (failed_ || queue_.empty()) return;
  for (std::uint32_t r = 0; r < rails_.size(); ++r) {
    if (rails_[r].health.state() != rail_state::idle) continue;
    if (!port_active(rails_[r].port)) {
      // Link down here (ip link set ... down): stay paused, look again later.
      if (rails_[r].health.begin_connect()) {
        rail_failed(r, std::make_error_code(std::errc::network_down));
      }
      continue;
    }
    connect_rail(r);
  }
  post_queued();
  check_stranded();
}

inline void path::connect_rail(std::uint32_t r) {
  auto& rl = rails_[r];
  const auto gen = rl.health.begin_connect();
  if (!gen) return;
  auto& port = *transport_->ports()[rl.port];
  const auto& cfg = transport_->cfg();
  rl.qps.clear();
  nlohmann::json qps = nlohmann::json::array();
  for (std::uint32_t i = 0; i < cfg.qps_per_endpoint; ++i) {
    std::error_code ec;
    qp_slot slot;
    slot.qp =
        queue_pair{port.pd, port.cq, port.cq, qp_capacity{cfg.max_wr, 1, 1, 1, 0}, IBV_QPT_RC, ec};
    if (!ec) slot.qp.to_init(port.info.port.port, IBV_ACCESS_LOCAL_WRITE, ec);
    if (ec) {
      rail_failed(r, ec);
      return;
    }
    slot.psn = detail::random_psn();
    port.qps[slot.qp.qp_num()] = port_state::owner{weak_from_this(), r, i};
    qps.push_back({{"qpn", slot.qp.qp_num()}, {"psn", slot.psn}});
    rl.qps.push_back(std::move(slot));
  }
  ctx_.send({{"type", "rdma_connect"},
             {"rail", r},
             {"gen", *gen},
             {"port", rl.remote_port},
             {"gid", detail::gid_wire(port.info.gid.gid)},
             {"mtu", static_cast<unsigned>(mtu_bytes(port.info.port.active_mtu))},
             {"qps", std::move(qps)}});
  rl.timer->expires_after(transport_->connect_timeout());
  rl.timer->async_wait([w = weak_from_this(), r, g = *gen](std::error_code ec) {
    auto self = w.lock();
    if (ec || !self || self->failed_) return;
    auto& h = self->rails_[r].health;
    if (h.state() == rail_state::connecting && h.generation() == g) {
      self->rail_failed(r, errc::peer_unreachable);
    }
  });
}

inline void path::on_message(const nlohmann::json& msg) {
  if (failed_) return;
  std::uint32_t r = 0, gen = 0;
  if (!control::get_field(msg, "rail", r) || !control::get_field(msg, "gen", gen) ||
      r >= rails_.size()) {
    return;  // not ours
  }
  auto& rl = rails_[r];
  if (rl.health.state() != rail_state::connecting || rl.health.generation() != gen) return;
  const auto type = msg.value("type", std::string{});
  if (type == "rdma_reject") {
    unsigned code = 0;
    if (!control::get_field(msg, "code", code) || code == 0 ||
        code > static_cast<unsigned>(errc_last)) {
      code = static_cast<unsigned>(errc::transport_unavailable);
    }
    rail_failed(r, make_error_code(static_cast<errc>(code)));
    return;
  }
  if (type != "rdma_accept") return;
  const auto it = msg.find("qps");
  unsigned rd = 1;
  if (!control::get_field(msg, "rd_atomic", rd)) rd = 1;
  if (it == msg.end() || !it->is_array() || it->size() != rl.qps.size()) {
    rail_failed(r, errc::malformed_message);
    return;
  }
  auto& port = *transport_->ports()[rl.port];
  const auto& rp = remote_[rl.remote_port];
  for (std::size_t i = 0; i < rl.qps.size(); ++i) {
    const auto& q = (*it)[i];
    std::uint32_t qpn = 0, psn = 0;
    if (!q.is_object() || !control::get_field(q, "qpn", qpn) ||
        !control::get_field(q, "psn", psn)) {
      rail_failed(r, errc::malformed_message);
      return;
    }
    rtr_params rtr;
    rtr.remote_qpn = qpn;
    rtr.remote_psn = psn;
    rtr.remote_gid = to_ibv_gid(rp.gid);
    rtr.sgid_index = static_cast<std::uint8_t>(port.info.gid.index);
    rtr.port = port.info.port.port;
    rtr.mtu = path_mtu(port.info.port.active_mtu, *mtu_from_bytes(rp.mtu));
    rts_params rts;
    rts.psn = rl.qps[i].psn;
    rts.max_rd_atomic = static_cast<std::uint8_t>(std::clamp<unsigned>(rd, 1, port.max_init_rd));
    std::error_code ec;
    rl.qps[i].qp.to_rtr(rtr, ec);
    if (!ec) rl.qps[i].qp.to_rts(rts, ec);
    if (ec) {
      rail_failed(r, ec);
      return;
    }
  }
  rl.timer->cancel();
  rl.health.connected(gen);
  pump();
}

inline void path::rail_failed(std::uint32_t r, std::error_code ec, bool counts) {
  auto& rl = rails_[r];
  last_error_ = ec;
  teardown(r, ec, failure_kind::rail);
  const auto backoff = rl.health.failed(rl.health.generation(), ec, counts);
  if (backoff) {
    rl.timer->cancel();
    rl.timer->expires_after(*backoff);
    rl.timer->async_wait([w = weak_from_this(), r](std::error_code tec) {
      auto self = w.lock();
      if (tec || !self || self->failed_) return;
      if (self->rails_[r].health.resume()) self->pump();
    });
  }
  post_queued();
  check_stranded();
}

inline void path::teardown(std::uint32_t r, std::error_code ec, failure_kind kind) {
  auto& rl = rails_[r];
  auto& port = *transport_->ports()[rl.port];
  std::vector<pending> orphans;
  for (std::size_t qi = 0; qi < rl.qps.size(); ++qi) unstage(r, qi, rl.qps[qi].staged.size());
  for (auto& q : rl.qps) {
    if (q.qp) {
      std::error_code ignored;
      q.qp.to_error(ignored);
      port.qps.erase(q.qp.qp_num());
      q.qp = queue_pair{};  // ibv_destroy_qp: the device no longer touches its buffers
    }
    port.outstanding -= std::min(port.outstanding, q.inflight.size());
    for (auto& p : q.inflight) orphans.push_back(p.p);
    q.inflight.clear();
    q.bytes = 0;
  }
  rl.qps.clear();
  // Oldest first at the front of the queue, in their original order.
  for (auto it = orphans.rbegin(); it != orphans.rend(); ++it) requeue_or_fail(*it, ec, kind, r);
}

inline void path::requeue_or_fail(pending p, std::error_code ec, failure_kind kind,
                                  std::uint32_t on_rail) {
  const bool stopping = failed_ || host_.stopping(p.s.op);
  if (fate_of(kind, p.tries, max_tries(), stopping) == slice_fate::fail) {
    host_.slice_done(p.s.op, 0, ec);
  } else {
    p.avoid_rail = static_cast<int>(on_rail);
    queue_.push_front(p);
  }
}

inline bool path::port_active(std::size_t port) const {
  auto& ps = *transport_->ports()[port];
  try {
    return ps.ctx.query_port(ps.info.port.port).state == IBV_PORT_ACTIVE;
  } catch (const std::system_error&) {
    return false;
  }
}

inline void path::post_queued() {
  if (failed_) return;
  auto& ports = transport_->ports();
  const auto& cfg = transport_->cfg();
  const chain_limits limits{std::max<std::uint32_t>(cfg.chain, 1)};
  // The first rail whose queue pair refused a chain: no more posting in
  // this pass; rail_failed() tears it down and posts what is left.
  std::optional<std::pair<std::uint32_t, std::error_code>> broken;
  while (!queue_.empty() && !broken) {
    loads_.clear();
    for (const auto& rl : rails_) {
      const auto& port = *ports[rl.port];
      for (const auto& q : rl.qps) {
        loads_.push_back(qp_load{rl.health.usable(), static_cast<std::uint32_t>(q.inflight.size()),
                                 cfg.max_wr, q.bytes, port.outstanding >= port.cq_capacity});
      }
    }
    // A slice retried after a failure goes to another rail when one has room.
    if (const int avoid = queue_.front().avoid_rail; avoid >= 0) {
      std::size_t first = 0;
      for (std::size_t r = 0; r < rails_.size(); ++r) {
        const auto n = rails_[r].qps.size();
        if (static_cast<int>(r) == avoid) {
          std::vector<qp_load> others = loads_;
          for (std::size_t i = first; i < first + n; ++i) others[i].usable = false;
          if (pick_qp(others)) loads_ = std::move(others);
        }
        first += n;
      }
    }
    const auto pick = pick_qp(loads_);
    if (!pick) break;  // the staged chains still go out below
    std::uint32_t r = 0;
    std::size_t qi = *pick;
    while (qi >= rails_[r].qps.size()) qi -= rails_[r].qps.size(), ++r;
    auto& rl = rails_[r];
    auto& slot = rl.qps[qi];
    auto& port = *ports[rl.port];

    pending p = queue_.front();
    queue_.pop_front();
    const auto& s = p.s;
    const remote_keys* seg = keys_of(s.segment);
    if (!seg) {
      host_.slice_done(s.op, 0, errc::not_registered);
      continue;
    }
    if (s.offset > seg->length || s.length > seg->length - s.offset) {
      host_.slice_done(s.op, 0, errc::out_of_bounds);
      continue;
    }
    if (rl.remote_port >= seg->rkeys.size()) {
      host_.slice_done(s.op, 0, errc::transport_unavailable);
      continue;
    }
    const auto lkey = transport_->lkey(s.local_segment, rl.port);
    if (!lkey) {
      host_.slice_done(s.op, 0, errc::not_registered);
      continue;
    }
    const std::uint64_t wr_id = transport_->next_wr_id();
    const local_buffer local{reinterpret_cast<std::uint64_t>(s.local),
                             static_cast<std::uint32_t>(s.length), *lkey};
    const remote_buffer remote{seg->base + s.offset, seg->rkeys[rl.remote_port]};
    // Unsignaled; post_chain() signals the last of its chain.
    slot.staged.push_back(s.kind == opcode::write ? rdma_write(wr_id, local, remote, false)
                                                  : rdma_read(wr_id, local, remote, false));
    slot.staged_bytes += s.length;
    ++p.tries;
    slot.inflight.push_back(posted{p, wr_id});
    slot.bytes += s.length;
    ++port.outstanding;
    if (limits.full(slot.staged.size(), slot.staged_bytes)) {
      if (auto ec = post_chain(r, qi)) broken.emplace(r, ec);
    }
  }
  // The chains not full yet go out now: no queue pair is left with an
  // unsignaled work request last (nothing would ever complete it).
  for (std::uint32_t r = 0; r < rails_.size() && !broken; ++r) {
    for (std::size_t qi = 0; qi < rails_[r].qps.size() && !broken; ++qi) {
      if (auto ec = post_chain(r, qi)) broken.emplace(r, ec);
    }
  }
  if (!broken) return;
  for (std::uint32_t r = 0; r < rails_.size(); ++r) {
    for (std::size_t qi = 0; qi < rails_[r].qps.size(); ++qi) {
      unstage(r, qi, rails_[r].qps[qi].staged.size());
    }
  }
  rail_failed(broken->first, broken->second);  // posts what is left
}

inline std::error_code path::post_chain(std::uint32_t r, std::size_t qi) {
  auto& slot = rails_[r].qps[qi];
  auto& wrs = slot.staged;
  if (wrs.empty()) return {};
  for (std::size_t i = 0; i + 1 < wrs.size(); ++i) wrs[i].chain(wrs[i + 1]);
  wrs.back().wr().send_flags |= static_cast<unsigned>(IBV_SEND_SIGNALED);
  std::error_code ec;
  const ibv_send_wr* bad = slot.qp.post(wrs.front(), ec);
  std::size_t sent = wrs.size();
  if (ec) {
    // Those before `bad` were posted (none when it names none of ours). The
    // last of them is unsignaled, but the caller breaks the rail: the queue
    // pair is destroyed and its work requests are retried elsewhere.
    sent = 0;
    while (sent < wrs.size() && &wrs[sent].wr() != bad) ++sent;
    if (sent == wrs.size()) sent = 0;
  }
  unstage(r, qi, wrs.size() - sent);
  return ec;
}

inline void path::unstage(std::uint32_t r, std::size_t qi, std::size_t n) {
  auto& rl = rails_[r];
  auto& slot = rl.qps[qi];
  auto& port = *transport_->ports()[rl.port];
  for (std::size_t i = 0; i < n && !slot.inflight.empty(); ++i) {
    pending p = slot.inflight.back().p;
    slot.inflight.pop_back();
    slot.bytes -= p.s.length;
    port.outstanding -= std::min<std::size_t>(port.outstanding, 1);
    --p.tries;
    queue_.push_front(p);  // the newest first: they end up in their order
  }
  slot.staged.clear();
  slot.staged_bytes = 0;
}

inline void path::check_stranded() {
  if (failed_ || queue_.empty()) return;
  std::vector<const rail_health*> hs;
  for (const auto& rl : rails_) hs.push_back(&rl.health);
  if (keep_waiting(hs)) return;
  const auto ec = last_error_ ? last_error_ : std::error_code{errc::peer_unreachable};
  auto q = std::move(queue_);
  queue_.clear();
  for (auto& p : q) host_.slice_done(p.s.op, 0, ec);
}

inline void path::on_completion(std::uint32_t r, std::uint32_t qi, const ibv_wc& wc) {
  if (failed_ || r >= rails_.size() || qi >= rails_[r].qps.size()) return;
  auto& rl = rails_[r];
  auto& slot = rl.qps[qi];
  // In order: this completion ends every work request posted before it on
  // this queue pair too (unsignaled ones have no completion of their own).
  const std::size_t n =
      retired_by(slot.inflight, wc.wr_id, [](const posted& p) { return p.wr_id; });
  if (n == 0) return;  // stale
  const bool ok = wc.status == IBV_WC_SUCCESS;
  auto& port = *transport_->ports()[rl.port];
  port.outstanding -= std::min(port.outstanding, n);
  auto done = std::move(retired_);
  done.clear();
  std::optional<pending> failed;
  for (std::size_t i = 0; i < n; ++i) {
    const pending& p = slot.inflight.front().p;
    slot.bytes -= p.s.length;
    if (ok || i + 1 < n) {
      add_report(done, p.s.op, p.s.length);
    } else {
      failed = p;  // an error names the work request that failed
    }
    slot.inflight.pop_front();
  }
  // The queue pair no longer touches their memory. (slices_done may stop
  // a transfer, and so this path: `slot` is not used after it.)
  if (!done.empty()) host_.slices_done(done);
  done.clear();
  retired_ = std::move(done);
  if (!failed) {
    pump();
    return;
  }
  const auto ec = make_wc_error(wc.status);
  const auto kind = classify(wc.status);
  requeue_or_fail(*failed, ec, kind, r);
  // The queue pair is in error now: rebuild the rail (a bad request says
  // nothing about the rail, so no backoff for it).
  if (!failed_) rail_failed(r, ec, kind == failure_kind::rail);
}

inline void path::fail(std::error_code ec) {
  if (failed_) return;
  failed_ = true;
  for (std::uint32_t r = 0; r < rails_.size(); ++r) {
    rails_[r].timer->cancel();
    teardown(r, ec, failure_kind::rail);  // failed_: every slice is reported, none requeued
  }
  auto q = std::move(queue_);
  queue_.clear();
  for (auto& p : q) host_.slice_done(p.s.op, 0, ec);
  if (auto cb = std::move(ctx_.on_failure)) cb(ec);
}

}  // namespace kvlink::rdma
