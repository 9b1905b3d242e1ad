// store/wire/leader.hpp: the leader's etcd key, the cluster's default, and
// the two ways etcd endpoints are written.
#include <kvlink/store/wire/leader.hpp>

#include <cstdlib>
#include <string>
#include <vector>

#include <doctest/doctest.h>

namespace wire = kvlink::store::wire;

TEST_CASE("leader: etcd endpoints in kvlink's and mooncake_master's forms") {
  std::vector<std::string> e;
  CHECK(wire::parse_etcd_endpoints("etcd://10.0.0.1:2379,10.0.0.2:2379/", e));
  CHECK(e == std::vector<std::string>{"10.0.0.1:2379", "10.0.0.2:2379"});
  CHECK(wire::parse_etcd_endpoints("10.0.0.1:2379; http://10.0.0.2:2379", e));
  CHECK(e == std::vector<std::string>{"10.0.0.1:2379", "10.0.0.2:2379"});
  CHECK(wire::parse_etcd_endpoints("etcd://[::1]:2379", e));
  CHECK(e == std::vector<std::string>{"[::1]:2379"});
  CHECK(wire::parse_etcd_endpoints("etcd://h:1;;", e));  // empty entries are skipped
  CHECK(e.size() == 1);
  for (const char* bad : {"", "etcd://", "etcd://host", "host:0", "host:99999", ";",
                          "https://10.0.0.1:2379", "10.0.0.1:2379,nohost"}) {
    CAPTURE(bad);
    CHECK_FALSE(wire::parse_etcd_endpoints(bad, e));
  }
  CHECK(wire::names_etcd("etcd://10.0.0.1:2379"));
  CHECK_FALSE(wire::names_etcd("10.0.0.1:50051"));
}

TEST_CASE("leader: the key per cluster; the cluster from MC_STORE_CLUSTER_ID when none is given") {
  CHECK(wire::leader_key("prod") == "kvlink/store/prod/leader");
  CHECK(wire::cluster_or_default("given") == "given");
  ::unsetenv("MC_STORE_CLUSTER_ID");
  CHECK(wire::cluster_or_default("") == "mooncake_cluster");
  ::setenv("MC_STORE_CLUSTER_ID", "from-env", 1);
  CHECK(wire::cluster_or_default("") == "from-env");
  CHECK(wire::cluster_or_default("given") == "given");
  ::setenv("MC_STORE_CLUSTER_ID", "", 1);
  CHECK(wire::cluster_or_default("") == "mooncake_cluster");
  ::unsetenv("MC_STORE_CLUSTER_ID");
}
