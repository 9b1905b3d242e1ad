// Helpers shared by the engine tests, the kvlink_test_peer helper process and
// the benches.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <sys/resource.h>

namespace kvlink_test {

using namespace std::chrono_literals;

// Whether this build runs under ThreadSanitizer (clang's -fsanitize=thread,
// or GCC's): long byte-filling rounds are cut there, since they cost several
// times more and add no interleavings.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool under_thread_sanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool under_thread_sanitizer = true;
#else
inline constexpr bool under_thread_sanitizer = false;
#endif
#else
inline constexpr bool under_thread_sanitizer = false;
#endif

// The sizes of the engine tests' "1 byte to 64 MiB" rounds (each round
// fills and compares whole buffers): under ThreadSanitizer fewer, up to
// 16 MiB.
inline std::vector<std::uint64_t> sizes_up_to_64_mib() {
  if (under_thread_sanitizer) return {1, 4096, 65537, (1 << 20) + 3, 16u << 20};
  return {1, 7, 4096, 65536, 65537, 1 << 20, (1 << 20) + 3, 16u << 20, 64u << 20};
}

inline std::uint64_t mix(std::uint64_t z) noexcept {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The test pattern of `seed`: byte `pos` is a function of (seed, pos) alone,
// so either side can lay out or check the bytes any range should hold.
inline std::byte pattern_byte(std::uint64_t key, std::uint64_t pos) noexcept {
  return static_cast<std::byte>(mix(key ^ (pos / 8)) >> (8 * (pos % 8)));
}

// Writes the pattern of `seed` for positions [origin, origin + len) to dst.
inline void fill_pattern(std::byte* dst, std::uint64_t len, std::uint64_t seed,
                         std::uint64_t origin) {
  const std::uint64_t key = mix(seed);
  std::uint64_t w = mix(key ^ (origin / 8));
  for (std::uint64_t i = 0; i < len; ++i) {
    const std::uint64_t pos = origin + i;
    if (pos % 8 == 0) w = mix(key ^ (pos / 8));
    dst[i] = static_cast<std::byte>(w >> (8 * (pos % 8)));
  }
}

// True if src[0, len) is the pattern of `seed` at positions origin...
inline bool is_pattern(const std::byte* src, std::uint64_t len, std::uint64_t seed,
                       std::uint64_t origin) {
  const std::uint64_t key = mix(seed);
  std::uint64_t w = mix(key ^ (origin / 8));
  for (std::uint64_t i = 0; i < len; ++i) {
    const std::uint64_t pos = origin + i;
    if (pos % 8 == 0) w = mix(key ^ (pos / 8));
    if (src[i] != static_cast<std::byte>(w >> (8 * (pos % 8)))) return false;
  }
  return true;
}

// Runs the io_context until `done` or the (generous) limit: a hang fails the
// test instead of blocking the suite.
template <class Pred>
bool run_until(asio::io_context& io, Pred done, std::chrono::seconds limit = 120s) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    io.run_one_for(100ms);
  }
  return true;
}

// Both ends of one TCP connection over loopback, on `io`.
struct loopback_connection {
  asio::io_context io;
  asio::ip::tcp::socket connected{io};  // the end that connected
  asio::ip::tcp::socket accepted{io};   // the end the listener accepted
  loopback_connection() {
    asio::ip::tcp::acceptor listener(io, {asio::ip::address_v4::loopback(), 0});
    connected.connect(listener.local_endpoint());
    listener.accept(accepted);
  }
};

// User + system CPU time of every thread of this process, in seconds: what
// benches report beside the wall clock, which a shared machine inflates.
inline double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  const auto secs = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6;
  };
  return secs(u.ru_utime) + secs(u.ru_stime);
}

}  // namespace kvlink_test
