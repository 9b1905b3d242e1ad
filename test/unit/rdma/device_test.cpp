// Tests of include/kvlink/rdma/device.hpp on fake sysfs trees (no device).
#include <kvlink/rdma/device.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include <doctest/doctest.h>
#include <unistd.h>

namespace fs = std::filesystem;
namespace rdma = kvlink::rdma;

namespace {

// A throw-away <root>/class/infiniband/<dev>/ports/<port>/... tree laid out as
// the kernel's (one file per GID index; types and ndevs only where the kernel
// has them).
class fake_sysfs {
 public:
  fake_sysfs() {
    static std::atomic<int> counter{0};
    root_ = fs::temp_directory_path() /
            ("kvlink-fake-sysfs-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  fake_sysfs(const fake_sysfs&) = delete;
  fake_sysfs& operator=(const fake_sysfs&) = delete;
  ~fake_sysfs() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  const fs::path& root() const { return root_; }

  void gid(const std::string& dev, int port, int index, const std::string& gid,
           std::optional<std::string> type, std::optional<std::string> ndev) {
    const fs::path p = root_ / "class/infiniband" / dev / "ports" / std::to_string(port);
    write(p / "gids" / std::to_string(index), gid + "\n");
    if (type) write(p / "gid_attrs/types" / std::to_string(index), *type + "\n");
    if (ndev) write(p / "gid_attrs/ndevs" / std::to_string(index), *ndev + "\n");
  }

 private:
  static void write(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream{p} << text;
  }
  fs::path root_;
};

const std::string link_local = "fe80:0000:0000:0000:5054:00ff:fe12:3456";
const std::string v4_mapped = "0000:0000:0000:0000:0000:ffff:0a00:0001";  // 10.0.0.1
const std::string global6 = "fd00:0000:0000:0001:0000:0000:0000:0002";
const std::string zero = "0000:0000:0000:0000:0000:0000:0000:0000";

}  // namespace

TEST_CASE("path MTU is the smaller of both ports' active MTU") {
  CHECK(rdma::path_mtu(IBV_MTU_4096, IBV_MTU_1024) == IBV_MTU_1024);
  CHECK(rdma::path_mtu(IBV_MTU_1024, IBV_MTU_4096) == IBV_MTU_1024);
  CHECK(rdma::path_mtu(IBV_MTU_2048, IBV_MTU_2048) == IBV_MTU_2048);
  CHECK(rdma::path_mtu(IBV_MTU_256, IBV_MTU_512) == IBV_MTU_256);
  CHECK(rdma::mtu_bytes(IBV_MTU_4096) == 4096);
  CHECK(rdma::mtu_bytes(IBV_MTU_256) == 256);
  CHECK(rdma::mtu_from_bytes(2048) == IBV_MTU_2048);
  CHECK_FALSE(rdma::mtu_from_bytes(1500));
  CHECK_FALSE(rdma::mtu_from_bytes(0));
}

TEST_CASE("GIDs parse from sysfs text and print readably") {
  const auto g = rdma::parse_gid(v4_mapped + "\n");
  REQUIRE(g);
  CHECK(rdma::is_ipv4_mapped(*g));
  CHECK_FALSE(rdma::is_link_local(*g));
  CHECK(rdma::format_gid(*g) == "10.0.0.1");

  const auto ll = rdma::parse_gid(link_local);
  REQUIRE(ll);
  CHECK(rdma::is_link_local(*ll));
  CHECK_FALSE(rdma::is_ipv4_mapped(*ll));
  CHECK(rdma::format_gid(*ll) == "fe80::5054:ff:fe12:3456");

  const auto z = rdma::parse_gid(zero);
  REQUIRE(z);
  CHECK(rdma::is_zero(*z));

  CHECK_FALSE(rdma::parse_gid(""));
  CHECK_FALSE(rdma::parse_gid("not a gid"));
  CHECK_FALSE(rdma::parse_gid("fe80:0000:0000"));

  const ibv_gid ib = rdma::to_ibv_gid(*g);
  CHECK(ib.raw[10] == 0xff);
  CHECK(ib.raw[15] == 1);
  CHECK(rdma::from_ibv_gid(ib) == *g);
}

TEST_CASE("RoCE v1 entries alone give no GID") {
  fake_sysfs fs;
  fs.gid("rxe0", 1, 0, link_local, "IB/RoCE v1", "eth0");
  fs.gid("rxe0", 1, 1, v4_mapped, "IB/RoCE v1", "eth0");
  std::error_code ec;
  const auto table = rdma::read_gid_table(fs.root(), "rxe0", 1, ec);
  REQUIRE_FALSE(ec);
  CHECK(table.size() == 2);
  const auto choice = rdma::choose_gid(fs.root(), "rxe0", 1, std::nullopt, ec);
  CHECK_FALSE(choice);
  CHECK(ec == kvlink::errc::no_device);
}

TEST_CASE("an IPv4-mapped RoCE v2 GID beats link-local IPv6 and RoCE v1") {
  // The layout rxe gives an interface with an IPv4 address: v1 and v2 rows
  // for the link-local address, then for the IPv4 one, then unused zeros.
  fake_sysfs fs;
  fs.gid("rxe0", 1, 0, link_local, "IB/RoCE v1", "eth0");
  fs.gid("rxe0", 1, 1, link_local, "RoCE v2", "eth0");
  fs.gid("rxe0", 1, 2, v4_mapped, "IB/RoCE v1", "eth0");
  fs.gid("rxe0", 1, 3, v4_mapped, "RoCE v2", "eth0");
  for (int i = 4; i < 8; ++i) fs.gid("rxe0", 1, i, zero, std::nullopt, std::nullopt);

  std::error_code ec;
  const auto table = rdma::read_gid_table(fs.root(), "rxe0", 1, ec);
  REQUIRE_FALSE(ec);
  REQUIRE(table.size() == 4);  // zero GIDs are unused entries
  CHECK(table[0].index == 0);
  CHECK(table[3].index == 3);
  CHECK(table[3].type == "RoCE v2");
  CHECK(table[3].netdev == "eth0");

  const auto choice = rdma::choose_gid(fs.root(), "rxe0", 1, std::nullopt, ec);
  REQUIRE(choice);
  CHECK_FALSE(ec);
  CHECK(choice->index == 3);
  CHECK(choice->device == "rxe0");
  CHECK(choice->port == 1);
  CHECK(choice->netdev == "eth0");
  CHECK(choice->type == "RoCE v2");
  CHECK(rdma::format_gid(choice->gid) == "10.0.0.1");
  CHECK(choice->reason == "rxe0 port 1 GID index 3: RoCE v2, IPv4-mapped 10.0.0.1 on eth0");
}

TEST_CASE("indices sort numerically, not as text") {
  fake_sysfs fs;
  fs.gid("mlx5_0", 1, 10, v4_mapped, "RoCE v2", "ens1f0");
  fs.gid("mlx5_0", 1, 9, v4_mapped, "RoCE v2", "ens1f0.100");
  std::error_code ec;
  const auto choice = rdma::choose_gid(fs.root(), "mlx5_0", 1, std::nullopt, ec);
  REQUIRE(choice);
  CHECK(choice->index == 9);
  CHECK(choice->netdev == "ens1f0.100");
}

TEST_CASE("a global IPv6 RoCE v2 GID beats a link-local one") {
  fake_sysfs fs;
  fs.gid("rxe0", 1, 1, link_local, "RoCE v2", "eth0");
  fs.gid("rxe0", 1, 5, global6, "RoCE v2", "eth0");
  std::error_code ec;
  const auto choice = rdma::choose_gid(fs.root(), "rxe0", 1, std::nullopt, ec);
  REQUIRE(choice);
  CHECK(choice->index == 5);
  CHECK(choice->reason ==
        "rxe0 port 1 GID index 5: RoCE v2, IPv6 fd00:0:0:1::2 on eth0 (no IPv4-mapped RoCE v2 "
        "GID)");
}

TEST_CASE("link-local is chosen only when nothing better exists, and says so") {
  fake_sysfs fs;
  fs.gid("rxe1", 1, 0, link_local, "IB/RoCE v1", "eth1");
  fs.gid("rxe1", 1, 1, link_local, "RoCE v2", "eth1");
  std::error_code ec;
  const auto choice = rdma::choose_gid(fs.root(), "rxe1", 1, std::nullopt, ec);
  REQUIRE(choice);
  CHECK(choice->index == 1);
  CHECK(choice->reason.rfind("rxe1 port 1 GID index 1: RoCE v2, IPv6 link-local "
                             "fe80::5054:ff:fe12:3456 on eth1 (",
                             0) == 0);
  CHECK(choice->reason.find("not routable") != std::string::npos);
}

TEST_CASE("entries without a netdev are skipped") {
  fake_sysfs fs;
  fs.gid("rxe0", 1, 1, link_local, "RoCE v2", "eth0");
  fs.gid("rxe0", 1, 3, v4_mapped, "RoCE v2", std::nullopt);  // netdev gone
  std::error_code ec;
  auto choice = rdma::choose_gid(fs.root(), "rxe0", 1, std::nullopt, ec);
  REQUIRE(choice);
  CHECK(choice->index == 1);

  fake_sysfs only_orphans;
  only_orphans.gid("rxe0", 1, 3, v4_mapped, "RoCE v2", std::nullopt);
  only_orphans.gid("rxe0", 1, 4, v4_mapped, "RoCE v2", "");
  choice = rdma::choose_gid(only_orphans.root(), "rxe0", 1, std::nullopt, ec);
  CHECK_FALSE(choice);
  CHECK(ec == kvlink::errc::no_device);
}

TEST_CASE("a configured GID index overrides the rule") {
  fake_sysfs fs;
  fs.gid("rxe0", 1, 0, link_local, "IB/RoCE v1", "eth0");
  fs.gid("rxe0", 1, 1, link_local, "RoCE v2", "eth0");
  fs.gid("rxe0", 1, 3, v4_mapped, "RoCE v2", "eth0");
  std::error_code ec;
  auto choice = rdma::choose_gid(fs.root(), "rxe0", 1, 1, ec);
  REQUIRE(choice);
  CHECK_FALSE(ec);
  CHECK(choice->index == 1);
  CHECK(choice->reason ==
        "rxe0 port 1 GID index 1: set by configuration; RoCE v2, IPv6 link-local "
        "fe80::5054:ff:fe12:3456 on eth0");

  // Even a RoCE v1 entry: the configuration wins, and the reason tells.
  choice = rdma::choose_gid(fs.root(), "rxe0", 1, 0, ec);
  REQUIRE(choice);
  CHECK(choice->index == 0);
  CHECK(choice->reason.find("IB/RoCE v1") != std::string::npos);

  // An index with no entry is a configuration error, not a silent fallback.
  choice = rdma::choose_gid(fs.root(), "rxe0", 1, 7, ec);
  CHECK_FALSE(choice);
  CHECK(ec == kvlink::errc::invalid_argument);
}

TEST_CASE("a port without a GID table is no_device; ports are told apart") {
  fake_sysfs fs;
  fs.gid("rxe0", 1, 1, v4_mapped, "RoCE v2", "eth0");
  std::error_code ec;
  CHECK_FALSE(rdma::choose_gid(fs.root(), "rxe0", 2, std::nullopt, ec));
  CHECK(ec == kvlink::errc::no_device);
  CHECK_FALSE(rdma::choose_gid(fs.root(), "rxe9", 1, std::nullopt, ec));
  CHECK(ec == kvlink::errc::no_device);
  CHECK_FALSE(rdma::choose_gid(fs.root() / "missing", "rxe0", 1, std::nullopt, ec));
  CHECK(ec == kvlink::errc::no_device);
}

TEST_CASE("files that are not GID indices are ignored") {
  fake_sysfs fs;
  fs.gid("rxe0", 1, 2, v4_mapped, "RoCE v2", "eth0");
  {
    std::ofstream{fs.root() / "class/infiniband/rxe0/ports/1/gids/README"} << v4_mapped << "\n";
    std::ofstream{fs.root() / "class/infiniband/rxe0/ports/1/gids/-1"} << v4_mapped << "\n";
    std::ofstream{fs.root() / "class/infiniband/rxe0/ports/1/gids/4"} << "garbage\n";
  }
  std::error_code ec;
  const auto table = rdma::read_gid_table(fs.root(), "rxe0", 1, ec);
  REQUIRE_FALSE(ec);
  REQUIRE(table.size() == 1);
  CHECK(table[0].index == 2);
}

TEST_CASE("discovery without devices is no_device, not an exception") {
  std::error_code ec;
  const fs::path verbs_dir = "/sys/class/infiniband_verbs";
  std::error_code fs_ec;
  if (!fs::exists(verbs_dir, fs_ec) || fs::is_empty(verbs_dir, fs_ec)) {
    const auto result = rdma::discover({}, ec);
    CHECK(ec == kvlink::errc::no_device);
    CHECK(result.ports.empty());
  } else {
    // Inside the soft-RoCE VM: every port found has a reason line.
    const auto result = rdma::discover({}, ec);
    for (const auto& p : result.ports) CHECK_FALSE(p.gid.reason.empty());
    CHECK((ec ? result.ports.empty() : !result.ports.empty()));
  }
}
