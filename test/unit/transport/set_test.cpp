// Tests of include/kvlink/transport/set.hpp: the choice of a transport per
// peer, in order of preference, with its reason; fallback to TCP allowed
// or forbidden.
#include <kvlink/transport/set.hpp>

#include <memory>
#include <string>

#include <doctest/doctest.h>

namespace {

using json = nlohmann::json;

// A transport that is only a name, whether it is usable, and what it
// accepts of a peer's entry.
class named final : public kvlink::transport {
 public:
  named(std::string name, bool available, std::string why = {}, bool reach = true)
      : name_(std::move(name)), available_(available), why_(std::move(why)), reach_(reach) {}
  std::string_view name() const noexcept override { return name_; }
  bool local_only() const noexcept override { return name_ == "shm"; }  // as shm::transport
  bool available() const noexcept override { return available_; }
  std::string unavailable_reason() const override { return why_; }
  kvlink::memory_kinds reaches() const noexcept override { return {kvlink::memory_kind::host}; }
  void shutdown() override {}
  json describe() const override { return json::object(); }
  bool reachable(const json& entry, std::string& why) const override {
    if (!reach_ || entry.value("refuse", false)) {
      why = "its entry is refused";
      return false;
    }
    return true;
  }
  asio::awaitable<std::error_code> connect(kvlink::path_context,
                                           std::shared_ptr<kvlink::data_path>&) override {
    co_return kvlink::errc::transport_unavailable;
  }

 private:
  std::string name_;
  bool available_;
  std::string why_;
  bool reach_;
};

std::shared_ptr<kvlink::transport> t(std::string n, bool available = true, std::string why = {}) {
  return std::make_shared<named>(std::move(n), available, std::move(why));
}

}  // namespace

TEST_CASE("transport_set: the first transport both sides can use, with the reason") {
  const kvlink::transport_set set{{t("shm"), t("rdma"), t("tcp")}, true};
  CHECK(set.offer() == "shm,rdma,tcp");
  const json both{{"shm", json::object()}, {"rdma", json::object()}, {"tcp", json::object()}};
  auto c = set.choose(both);
  REQUIRE(c.chosen != nullptr);
  CHECK(c.chosen->name() == "shm");
  CHECK(c.reason == "shm");

  c = set.choose({{"rdma", {{"refuse", true}}}, {"tcp", json::object()}});
  REQUIRE(c.chosen != nullptr);
  CHECK(c.chosen->name() == "tcp");
  CHECK(c.reason == "tcp (shm: the peer offers no shm; rdma: its entry is refused)");

  c = set.choose({{"fake", json::object()}});
  CHECK(c.chosen == nullptr);
  CHECK(c.error == kvlink::errc::transport_unavailable);
  CHECK(c.reason.find("tcp: the peer offers no tcp") != std::string::npos);
}

TEST_CASE("transport_set: transports not usable here are passed over and said so") {
  const kvlink::transport_set set{{t("rdma", false, "no usable RDMA device"), t("tcp")}, true};
  CHECK(set.offer() == "tcp (rdma: no usable RDMA device)");
  std::string why;
  CHECK(set.usable(why));
  auto c = set.choose({{"rdma", json::object()}, {"tcp", json::object()}});
  REQUIRE(c.chosen != nullptr);
  CHECK(c.reason == "tcp (rdma: no usable RDMA device)");
  CHECK(set.find("rdma") != nullptr);
  CHECK(set.find("shm") == nullptr);
}

TEST_CASE("transport_set: without TCP fallback, TCP after a preferred one is refused") {
  const kvlink::transport_set strict{{t("rdma"), t("tcp")}, false};
  auto c = strict.choose({{"tcp", json::object()}});
  CHECK(c.chosen == nullptr);
  CHECK(c.error == kvlink::errc::transport_unavailable);
  CHECK(c.reason.find("allow_tcp_fallback") != std::string::npos);
  c = strict.choose({{"rdma", json::object()}, {"tcp", json::object()}});
  REQUIRE(c.chosen != nullptr);
  CHECK(c.chosen->name() == "rdma");

  std::string why;
  const kvlink::transport_set no_device{{t("rdma", false, "no usable RDMA device"), t("tcp")},
                                        false};
  CHECK_FALSE(no_device.usable(why));
  CHECK(why == "rdma: no usable RDMA device");
  // TCP alone is not a fallback: allowed whatever the setting.
  const kvlink::transport_set tcp_only{{t("tcp")}, false};
  CHECK(tcp_only.usable(why));
  c = tcp_only.choose({{"tcp", json::object()}});
  REQUIRE(c.chosen != nullptr);
  CHECK(c.reason == "tcp");
}

TEST_CASE("transport_set: memory kinds reached") {
  std::string why;
  CHECK(kvlink::transport_set{{t("tcp")}, true}.reaches(kvlink::memory_kind::host, why));
  CHECK_FALSE(kvlink::transport_set{{t("tcp", false, "down")}, true}.reaches(
      kvlink::memory_kind::host, why));
  CHECK(why.find("host memory") != std::string::npos);
}

TEST_CASE("transport_set: passing over a same-host transport makes no TCP a fallback") {
  // A peer on another host: shm is passed over (said in the reason), and
  // TCP is still allowed where a network transport's fallback is not.
  const kvlink::transport_set strict{{t("shm"), t("tcp")}, false};
  std::string why;
  CHECK(strict.usable(why));
  const json elsewhere{{"shm", {{"refuse", true}}}, {"tcp", json::object()}};
  auto c = strict.choose(elsewhere);
  REQUIRE(c.chosen != nullptr);
  CHECK(c.chosen->name() == "tcp");
  CHECK(c.reason == "tcp (shm: its entry is refused)");

  // With RDMA configured and passed over, TCP is a fallback again, refused.
  const kvlink::transport_set with_rdma{{t("shm"), t("rdma"), t("tcp")}, false};
  c = with_rdma.choose(json{{"shm", {{"refuse", true}}}, {"tcp", json::object()}});
  CHECK(c.chosen == nullptr);
  CHECK(c.error == kvlink::errc::transport_unavailable);
  // An engine with shm and RDMA but no usable RDMA device may not start
  // without the fallback: shm alone reaches no other host.
  const kvlink::transport_set no_device{
      {t("shm"), t("rdma", false, "no usable RDMA device"), t("tcp")}, false};
  CHECK_FALSE(no_device.usable(why));
  // shm alone is usable.
  CHECK(kvlink::transport_set({t("shm")}, false).usable(why));
}
