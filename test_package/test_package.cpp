// The consumer program: uses kvlink as an outside project would and checks, at
// run time, that what it got is consistent. Built by Conan's test_package and,
// from the same file, by the CMake consumer tests in test/cmake/ (find_package,
// build tree, FetchContent, add_subdirectory, pkg-config). Exits non-zero on
// any mismatch.
//
// KVLINK_EXPECTED_VERSION is the version the consumer's build system found
// (kvlink_VERSION from find_package, or the parent build's version).
#if __has_include(<kvlink/kvlink.hpp>)
#include <kvlink/kvlink.hpp>  // the umbrella header, once it exists
#else
#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/version.hpp>
#endif

#include <cstdio>
#include <string>
#include <string_view>
#include <system_error>

#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#ifndef KVLINK_EXPECTED_VERSION
#error "define KVLINK_EXPECTED_VERSION as the \"MAJOR.MINOR.PATCH\" the build system found"
#endif

namespace {

int failures = 0;

void check(bool ok, std::string_view what) {
  if (!ok) {
    fmt::print(stderr, "FAILED: {}\n", what);
    ++failures;
  }
}

}  // namespace

int main() {
  constexpr std::string_view expected = KVLINK_EXPECTED_VERSION;

  // The build system's version, the header's string and its macros agree.
  check(kvlink::version_string == expected, "kvlink::version_string == the version CMake found");
  check(fmt::format("{}.{}.{}", KVLINK_VERSION_MAJOR, KVLINK_VERSION_MINOR, KVLINK_VERSION_PATCH) ==
            expected,
        "KVLINK_VERSION_{MAJOR,MINOR,PATCH} == the version CMake found");

  // kvlink::errc plugs into std::error_code with its own category and messages.
  const std::error_code ec = kvlink::errc::cancelled;
  check(ec == kvlink::errc::cancelled, "errc compares equal through std::error_code");
  check(std::string_view{ec.category().name()} == "kvlink", "category name is \"kvlink\"");
  check(ec.message() == "the transfer was cancelled", "errc::cancelled message");

  // Vocabulary types.
  const kvlink::segment_id id{7};
  check(id.valid() && id.value() == 7, "segment_id keeps its value");
  check(kvlink::allows(kvlink::access::remote_read_write,
                       kvlink::required_access(kvlink::opcode::write)),
        "remote_read_write allows a write");

  // Asio (standalone, from kvlink's usage requirements): a posted handler runs.
  asio::io_context io;
  int ran = 0;
  asio::post(io, [&ran] { ++ran; });
  io.run();
  check(ran == 1, "asio::io_context ran the posted handler once");

  // nlohmann/json round trip.
  const nlohmann::json j = {{"version", kvlink::version_string}};
  check(nlohmann::json::parse(j.dump()).at("version").get<std::string>() == expected,
        "nlohmann::json round trip");

  fmt::print("kvlink {} consumer: {}\n", kvlink::version_string, failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
