// Tests of include/kvlink/memory/copy_engine.hpp: host copies, completion
// never inside the call, pairs of kinds it does not copy refused.
#include <kvlink/memory/copy_engine.hpp>

#include <optional>
#include <vector>

#include "../../support/test_support.hpp"
#include <asio/io_context.hpp>
#include <doctest/doctest.h>

TEST_CASE("host_copy_engine copies host to host and completes later") {
  asio::io_context io;
  kvlink::host_copy_engine copies{io.get_executor()};
  CHECK(copies.copies(kvlink::memory_kind::host, kvlink::memory_kind::host));
  std::vector<std::byte> src(100003), dst(100003);
  kvlink_test::fill_pattern(src.data(), src.size(), 5, 0);
  std::optional<std::error_code> done;
  copies.async_copy(dst.data(), {}, src.data(), {}, src.size(),
                    [&](std::error_code ec) { done = ec; });
  CHECK_FALSE(done.has_value());  // posted, never inline
  io.run();
  REQUIRE(done.has_value());
  CHECK_FALSE(*done);
  CHECK(dst == src);
}
