// Tests of include/kvlink/rdma/verbs.hpp that need no RDMA device.
#include <kvlink/rdma/verbs.hpp>

#include <cerrno>
#include <filesystem>
#include <string>
#include <system_error>
#include <type_traits>

#include "verbs_devices.hpp"
#include <doctest/doctest.h>

namespace rdma = kvlink::rdma;

namespace {}  // namespace

TEST_CASE("ibv_get_device_list answers map to no_device or their errno") {
  CHECK(rdma::detail::classify_device_list(true, 0, ENOSYS) == kvlink::errc::no_device);
  CHECK(rdma::detail::classify_device_list(true, 0, ENODEV) == kvlink::errc::no_device);
  CHECK(rdma::detail::classify_device_list(true, 0, 0) == kvlink::errc::no_device);
  CHECK(rdma::detail::classify_device_list(false, 0, 0) == kvlink::errc::no_device);
  const std::error_code enomem = rdma::detail::classify_device_list(true, 0, ENOMEM);
  CHECK(enomem == std::error_code(ENOMEM, std::system_category()));
  CHECK_FALSE(rdma::detail::classify_device_list(false, 2, 0));
}

TEST_CASE("device_list on this machine: no devices is a clean errc::no_device") {
  std::error_code ec;
  rdma::device_list devices = rdma::device_list::open(ec);
  if (kvlink_test::machine_has_verbs_devices()) {
    // Inside the soft-RoCE VM: the same call must find them.
    CHECK_FALSE(ec);
    CHECK_FALSE(devices.empty());
    CHECK(devices.find(ibv_get_device_name(devices[0])) == devices[0]);
  } else {
    CHECK(ec == kvlink::errc::no_device);
    CHECK(&ec.category() == &kvlink::error_category());
    CHECK(devices.empty());
    CHECK(devices.size() == 0);
    CHECK(devices.begin() == devices.end());
    CHECK(devices.find("rxe0") == nullptr);
    try {
      static_cast<void>(rdma::device_list::open());
      FAIL("device_list::open() did not throw without devices");
    } catch (const std::system_error& e) {
      CHECK(e.code() == kvlink::errc::no_device);
      CHECK(std::string{e.what()}.rfind("ibv_get_device_list(): no usable RDMA device", 0) == 0);
    }
  }
}

TEST_CASE("ibv_wc_status has its own category with rdma-core's messages") {
  const std::error_category& cat = rdma::wc_status_category();
  CHECK(std::string{cat.name()} == "ibv_wc_status");
  CHECK(&cat == &rdma::wc_status_category());
  for (int s = IBV_WC_SUCCESS; s <= IBV_WC_TM_RNDV_INCOMPLETE; ++s) {
    CAPTURE(s);
    CHECK(cat.message(s) == ibv_wc_status_str(static_cast<ibv_wc_status>(s)));
  }
  CHECK(cat.message(IBV_WC_RETRY_EXC_ERR) == "transport retry counter exceeded");
  CHECK(cat.message(IBV_WC_REM_ACCESS_ERR) == "remote access error");
  CHECK(cat.message(IBV_WC_WR_FLUSH_ERR) == "Work Request Flushed Error");

  CHECK_FALSE(rdma::make_wc_error(IBV_WC_SUCCESS));
  const std::error_code retry = rdma::make_wc_error(IBV_WC_RETRY_EXC_ERR);
  CHECK(retry.value() == IBV_WC_RETRY_EXC_ERR);
  CHECK(&retry.category() == &cat);
  // Same number, different meaning: never equal to an errno or a kvlink errc.
  CHECK(retry != std::error_code(IBV_WC_RETRY_EXC_ERR, std::system_category()));
  CHECK(retry != std::error_code(IBV_WC_RETRY_EXC_ERR, kvlink::error_category()));

  ibv_wc wc{};
  wc.status = IBV_WC_REM_ACCESS_ERR;
  CHECK(rdma::wc_error(wc) == rdma::make_wc_error(IBV_WC_REM_ACCESS_ERR));
  CHECK(rdma::wc_error(wc).message() == "remote access error");
  wc.status = IBV_WC_SUCCESS;
  CHECK_FALSE(rdma::wc_error(wc));
}

TEST_CASE("verbs errno failures carry the call and its subject") {
  try {
    rdma::detail::throw_error(std::error_code(ENOMEM, std::system_category()), "ibv_reg_mr",
                              "segment 3");
    FAIL("throw_error returned");
  } catch (const std::system_error& e) {
    CHECK(std::string{e.what()} == "ibv_reg_mr(segment 3): Cannot allocate memory");
    CHECK(e.code() == std::errc::not_enough_memory);
  }
  // rdma-core returns a positive errno; older providers -1 with errno set.
  CHECK_FALSE(rdma::detail::verbs_result(0));
  CHECK(rdma::detail::verbs_result(EINVAL) == std::errc::invalid_argument);
  errno = EAGAIN;
  CHECK(rdma::detail::verbs_result(-1) == std::errc::resource_unavailable_try_again);
  errno = 0;
  CHECK(rdma::detail::verbs_result(-1) == std::errc::io_error);  // failed, reason unknown
}

TEST_CASE("kvlink access maps to ibv access flags") {
  using kvlink::access;
  CHECK(rdma::to_ibv_access(access::none) == IBV_ACCESS_LOCAL_WRITE);
  CHECK(rdma::to_ibv_access(access::remote_read) ==
        (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
  CHECK(rdma::to_ibv_access(access::remote_write) ==
        (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE));
  CHECK(rdma::to_ibv_access(access::remote_read_write) ==
        (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE));
}

TEST_CASE("RDMA WRITE and READ work requests") {
  const rdma::local_buffer local{0x1000, 4096, 0x11};
  const rdma::remote_buffer remote{0xabc000, 0x22};

  rdma::rdma_work_request w = rdma::rdma_write(7, local, remote);
  CHECK(w.wr().opcode == IBV_WR_RDMA_WRITE);
  CHECK(w.wr().wr_id == 7);
  CHECK(w.wr().num_sge == 1);
  CHECK(w.wr().sg_list == &w.sge());
  CHECK(w.sge().addr == 0x1000);
  CHECK(w.sge().length == 4096);
  CHECK(w.sge().lkey == 0x11);
  CHECK(w.wr().wr.rdma.remote_addr == 0xabc000);
  CHECK(w.wr().wr.rdma.rkey == 0x22);
  CHECK(w.wr().send_flags == IBV_SEND_SIGNALED);
  CHECK(w.wr().next == nullptr);

  rdma::rdma_work_request r = rdma::rdma_read(8, local, remote, false);
  CHECK(r.wr().opcode == IBV_WR_RDMA_READ);
  CHECK(r.wr().send_flags == 0U);
  w.chain(r);
  CHECK(w.wr().next == &r.wr());

  // A copy points at its own scatter/gather entry and is not chained.
  const rdma::rdma_work_request copy = w;
  CHECK(copy.wr().sg_list == &copy.sge());
  CHECK(copy.wr().next == nullptr);
  CHECK(copy.sge().addr == 0x1000);
  CHECK(copy.wr().wr_id == 7);
  rdma::rdma_work_request assigned;
  assigned = r;
  CHECK(assigned.wr().sg_list == &assigned.sge());
  CHECK(assigned.wr().opcode == IBV_WR_RDMA_READ);
}

TEST_CASE("verbs owners are move-only and start empty") {
  static_assert(!std::is_copy_constructible_v<rdma::device_list>);
  static_assert(!std::is_copy_constructible_v<rdma::context>);
  static_assert(!std::is_copy_constructible_v<rdma::protection_domain>);
  static_assert(!std::is_copy_constructible_v<rdma::memory_region>);
  static_assert(!std::is_copy_constructible_v<rdma::completion_channel>);
  static_assert(!std::is_copy_constructible_v<rdma::completion_queue>);
  static_assert(!std::is_copy_constructible_v<rdma::queue_pair>);
  static_assert(std::is_nothrow_move_constructible_v<rdma::queue_pair>);
  static_assert(std::is_nothrow_move_assignable_v<rdma::memory_region>);

  rdma::context ctx;
  CHECK_FALSE(ctx);
  rdma::queue_pair qp;
  CHECK_FALSE(qp);
  rdma::queue_pair moved = std::move(qp);
  CHECK_FALSE(moved);

  std::error_code ec;
  rdma::context none{nullptr, ec};
  CHECK(ec == kvlink::errc::invalid_argument);
  CHECK_FALSE(none);
}
