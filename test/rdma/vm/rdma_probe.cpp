// rdma_probe: what kvlink's verbs layer sees on this machine.
//
// Lists devices and ports, the GID that discovery picks on each ACTIVE port
// and why, and checks that verbs reports the same GID at that index as sysfs.
// With --loopback it also connects two RC QPs on each port to each other
// (RESET -> INIT -> RTR -> RTS) and moves a buffer with RDMA WRITE, then back
// with RDMA READ, waiting for one completion through the completion channel,
// and compares the bytes.
//
// Usage: kvlink_rdma_probe [--loopback] [--gid-index N] [--device NAME]
// Exit status: 0 fine, 1 a check failed, 2 no usable device.
#include <kvlink/rdma/device.hpp>
#include <kvlink/rdma/verbs.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <poll.h>

namespace rdma = kvlink::rdma;

namespace {

// Waits for `count` completions on `cq`; the first one through the channel
// (armed, then woken by the fd), the rest by polling. False on any failure.
bool wait_completions(rdma::completion_queue& cq, rdma::completion_channel& ch, int count,
                      bool use_channel) {
  std::error_code ec;
  ibv_wc wc[8];
  int done = 0;
  if (use_channel) {
    pollfd pfd{ch.fd(), POLLIN, 0};
    if (::poll(&pfd, 1, 10000) != 1) {
      std::fprintf(stderr, "probe: no completion event within 10 s\n");
      return false;
    }
    ibv_cq* fired = ch.get_event(ec);
    if (ec || fired != cq.get()) {
      std::fprintf(stderr, "probe: get_event: %s\n", ec.message().c_str());
      return false;
    }
    cq.ack_events(1);
  }
  for (long spins = 0; done < count; ++spins) {
    const std::size_t n = cq.poll(wc, ec);
    if (ec) {
      std::fprintf(stderr, "probe: poll: %s\n", ec.message().c_str());
      return false;
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (auto wec = rdma::wc_error(wc[i])) {
        std::fprintf(stderr, "probe: wr %llu failed: %s (%s)\n",
                     static_cast<unsigned long long>(wc[i].wr_id), wec.message().c_str(),
                     wec.category().name());
        return false;
      }
    }
    done += static_cast<int>(n);
    if (spins > 200000000L) {
      std::fprintf(stderr, "probe: completions did not arrive\n");
      return false;
    }
  }
  return true;
}

bool loopback(const rdma::rdma_port& p) {
  const std::size_t len = std::size_t{1} << 20;  // 1 MiB
  auto devices = rdma::device_list::open();
  // Declaration order is teardown order in reverse: QPs, MRs, CQ, channel, PD, context.
  rdma::context ctx{devices.find(p.port.device)};
  rdma::protection_domain pd{ctx};
  rdma::completion_channel ch{ctx};
  rdma::completion_queue cq{ctx, 64, &ch};
  std::vector<unsigned char> a(len), b(len, 0), c(len, 0);
  for (std::size_t i = 0; i < len; ++i) a[i] = static_cast<unsigned char>((i * 131) ^ (i >> 9));
  const int acc = rdma::to_ibv_access(kvlink::access::remote_read_write);
  rdma::memory_region mra{pd, a.data(), len, acc, "probe buffer a"};
  rdma::memory_region mrb{pd, b.data(), len, acc, "probe buffer b"};
  rdma::memory_region mrc{pd, c.data(), len, acc, "probe buffer c"};
  rdma::queue_pair qa{pd, cq, cq, {}};
  rdma::queue_pair qb{pd, cq, cq, {}};

  const ibv_gid gid = rdma::to_ibv_gid(p.gid.gid);
  const auto sgid = static_cast<std::uint8_t>(p.gid.index);
  const ibv_mtu mtu = rdma::path_mtu(p.port.active_mtu, p.port.active_mtu);
  const int remote = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  qa.to_init(p.port.port, remote);
  qb.to_init(p.port.port, remote);
  qa.to_rtr({.remote_qpn = qb.qp_num(),
             .remote_psn = 200,
             .remote_gid = gid,
             .sgid_index = sgid,
             .port = p.port.port,
             .mtu = mtu});
  qb.to_rtr({.remote_qpn = qa.qp_num(),
             .remote_psn = 100,
             .remote_gid = gid,
             .sgid_index = sgid,
             .port = p.port.port,
             .mtu = mtu});
  qa.to_rts({.psn = 100});
  qb.to_rts({.psn = 200});
  std::error_code ec;
  if (qa.state(ec) != IBV_QPS_RTS || ec) {
    std::fprintf(stderr, "probe: QP not in RTS\n");
    return false;
  }

  if (auto nec = cq.request_notify()) {
    std::fprintf(stderr, "probe: request_notify: %s\n", nec.message().c_str());
    return false;
  }
  // WRITE a -> b in two chained halves, then READ b -> c.
  const auto half = static_cast<std::uint32_t>(len / 2);
  auto base = [](const std::vector<unsigned char>& v) {
    return reinterpret_cast<std::uint64_t>(v.data());
  };
  rdma::rdma_work_request w1 =
      rdma::rdma_write(1, {base(a), half, mra.lkey()}, {base(b), mrb.rkey()});
  rdma::rdma_work_request w2 =
      rdma::rdma_write(2, {base(a) + half, half, mra.lkey()}, {base(b) + half, mrb.rkey()});
  w1.chain(w2);
  if (qa.post(w1, ec) != nullptr || ec) {
    std::fprintf(stderr, "probe: post WRITE: %s\n", ec.message().c_str());
    return false;
  }
  if (!wait_completions(cq, ch, 2, true)) return false;
  rdma::rdma_work_request r = rdma::rdma_read(
      3, {base(c), static_cast<std::uint32_t>(len), mrc.lkey()}, {base(b), mrb.rkey()});
  if (qa.post(r, ec) != nullptr || ec) {
    std::fprintf(stderr, "probe: post READ: %s\n", ec.message().c_str());
    return false;
  }
  if (!wait_completions(cq, ch, 1, false)) return false;
  const bool ok =
      std::memcmp(a.data(), b.data(), len) == 0 && std::memcmp(a.data(), c.data(), len) == 0;
  std::printf("  loopback %s port %u: WRITE 1 MiB + READ 1 MiB via GID index %d: %s\n",
              p.port.device.c_str(), unsigned{p.port.port}, p.gid.index,
              ok ? "bytes match" : "BYTES DIFFER");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  rdma::discovery_options opt;
  bool do_loopback = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--loopback") {
      do_loopback = true;
    } else if (a == "--gid-index" && i + 1 < argc) {
      opt.gid_index = std::atoi(argv[++i]);
    } else if (a == "--device" && i + 1 < argc) {
      opt.device = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--loopback] [--gid-index N] [--device NAME]\n", argv[0]);
      return 1;
    }
  }
  try {
    std::error_code ec;
    const rdma::device_list devices = rdma::device_list::open(ec);
    if (ec) {
      std::printf("devices: none (%s)\n", ec.message().c_str());
      return 2;
    }
    std::printf("devices: %zu\n", devices.size());
    for (const rdma::port_info& p : rdma::list_ports(devices)) {
      std::printf("  %s port %u: %s, active MTU %d, link layer %s\n", p.device.c_str(),
                  unsigned{p.port}, ibv_port_state_str(p.state), rdma::mtu_bytes(p.active_mtu),
                  p.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand");
    }
    const rdma::discovery_result found = rdma::discover(opt, ec);
    for (const std::string& s : found.skipped) std::printf("skipped: %s\n", s.c_str());
    if (ec) {
      std::printf("no usable port: %s\n", ec.message().c_str());
      return 2;
    }
    int failures = 0;
    for (const rdma::rdma_port& p : found.ports) {
      std::printf("chosen: %s\n", p.gid.reason.c_str());
      // sysfs and verbs must agree on the entry, or the QP would send from another address.
      rdma::context ctx{devices.find(p.port.device)};
      const ibv_gid g = ctx.query_gid(p.port.port, p.gid.index);
      const bool same = rdma::from_ibv_gid(g) == p.gid.gid;
      std::printf("  ibv_query_gid(%s, %u, %d) = %s: %s\n", p.port.device.c_str(),
                  unsigned{p.port.port}, p.gid.index,
                  rdma::format_gid(rdma::from_ibv_gid(g)).c_str(),
                  same ? "matches sysfs" : "DIFFERS from sysfs");
      if (!same) ++failures;
      if (do_loopback && !loopback(p)) ++failures;
    }
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "probe: %s\n", e.what());
    return 1;
  }
}
