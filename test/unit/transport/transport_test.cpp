// Tests of include/kvlink/transport/transport.hpp: slice reports (several
// successful slices of one transfer as one report; a failed slice alone),
// and transport_host's default slices_done, which hands each slice to
// slice_done.
#include <kvlink/transport/transport.hpp>

#include <cstdint>
#include <system_error>
#include <vector>

#include <doctest/doctest.h>

namespace {

using kvlink::errc;
using kvlink::slice_report;

kvlink::detail::transfer_op* op_n(std::uintptr_t n) {
  return reinterpret_cast<kvlink::detail::transfer_op*>(n * 64);
}

// Records what slice_done is told; slices_done is the base class's.
class recorder final : public kvlink::transport_host {
 public:
  void slice_done(kvlink::detail::transfer_op* op, std::uint64_t bytes,
                  std::error_code ec) override {
    got.push_back({op, bytes, ec});
  }
  bool stopping(const kvlink::detail::transfer_op*) const noexcept override { return false; }
  bool pin(kvlink::segment_id) override { return true; }
  void unpin(kvlink::segment_id) override {}

  std::vector<slice_report> got;
};

}  // namespace

TEST_CASE("add_report: successes of one transfer in a row become one report") {
  std::vector<slice_report> done;
  kvlink::add_report(done, op_n(1), 4096);
  kvlink::add_report(done, op_n(1), 4096);
  kvlink::add_report(done, op_n(1), 100);
  REQUIRE(done.size() == 1);
  CHECK(done[0].op == op_n(1));
  CHECK(done[0].bytes == 8292);
  CHECK(done[0].slices == 3);
  CHECK_FALSE(done[0].ec);

  // Another transfer starts a report of its own, and so does the first
  // transfer again after it (reports stay in order).
  kvlink::add_report(done, op_n(2), 10);
  kvlink::add_report(done, op_n(1), 20);
  REQUIRE(done.size() == 3);
  CHECK(done[1].op == op_n(2));
  CHECK(done[1].slices == 1);
  CHECK(done[2].op == op_n(1));
  CHECK(done[2].bytes == 20);
  CHECK(done[2].slices == 1);
}

TEST_CASE("add_report: a failed slice is reported alone; nothing joins it") {
  std::vector<slice_report> done;
  kvlink::add_report(done, op_n(1), 4096);
  kvlink::add_report(done, op_n(1), 0, errc::out_of_bounds);
  kvlink::add_report(done, op_n(1), 4096);
  kvlink::add_report(done, op_n(1), 0, errc::cancelled);
  kvlink::add_report(done, op_n(1), 0, errc::cancelled);
  REQUIRE(done.size() == 5);
  CHECK(done[0].slices == 1);
  CHECK(done[1].ec == errc::out_of_bounds);
  CHECK(done[1].slices == 1);
  CHECK_FALSE(done[2].ec);
  CHECK(done[2].bytes == 4096);
  CHECK(done[2].slices == 1);
  CHECK(done[3].ec == errc::cancelled);
  CHECK(done[4].ec == errc::cancelled);
  CHECK(done[4].slices == 1);
}

TEST_CASE("transport_host::slices_done: every slice of a report reaches slice_done once") {
  recorder host;
  std::vector<slice_report> done;
  kvlink::add_report(done, op_n(1), 4096);
  kvlink::add_report(done, op_n(1), 4096);
  kvlink::add_report(done, op_n(1), 4096);
  kvlink::add_report(done, op_n(2), 0, errc::peer_closed);
  host.slices_done(done);
  REQUIRE(host.got.size() == 4);
  std::uint64_t bytes = 0;
  for (int i = 0; i < 3; ++i) {
    CHECK(host.got[i].op == op_n(1));
    CHECK_FALSE(host.got[i].ec);
    bytes += host.got[i].bytes;
  }
  CHECK(bytes == 3 * 4096);
  CHECK(host.got[3].op == op_n(2));
  CHECK(host.got[3].ec == errc::peer_closed);
}
