// The disk's own sequential rate, the reference the SSD tier's figures are
// divided by (kvlink_disk_bench: the tier alone; kvlink_store_bench --disk:
// the store's eviction to disk and its gets of disk-only objects): each
// thread writes, then reads back, its own file in requests of one object's
// size from one aligned buffer, O_DIRECT where the file system takes it.
// No Asio: the disk bench stays small. GB = 10^9 bytes.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace kvlink::bench::disk {

/// A page-aligned buffer filled with a pattern.
struct aligned {
  std::byte* p = nullptr;
  explicit aligned(std::uint64_t n) {
    p = static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) & ~std::uint64_t{4095}));
    if (p == nullptr) throw std::bad_alloc();
    for (std::uint64_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(i * 131 + 7);
  }
  ~aligned() { std::free(p); }
  aligned(const aligned&) = delete;
  aligned& operator=(const aligned&) = delete;
};

/// Runs f(thread) on `threads` threads; the seconds they took together.
/// Throws when any of them threw (after all joined).
template <class F>
double timed(unsigned threads, F&& f) {
  std::vector<std::thread> ts;
  std::atomic<bool> failed{false};
  const auto t0 = std::chrono::steady_clock::now();
  for (unsigned t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      try {
        f(t);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "disk bench thread %u: %s\n", t, e.what());
        failed = true;
      }
    });
  }
  for (auto& th : ts) th.join();
  if (failed) throw std::runtime_error("a thread failed");
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct rates {
  double write_gbs = 0, read_gbs = 0;
};

/// The disk under `dir`: each of `threads` threads writes then reads its own
/// (unlinked) file of `per_thread` bytes in requests of `size` (rounded up
/// to 4 KiB). `direct`: O_DIRECT; without it the writes are fsynced.
inline rates sequential(const std::string& dir, std::uint64_t size, std::uint64_t per_thread,
                        unsigned threads, bool direct) {
  const std::uint64_t req = std::max<std::uint64_t>(4096, (size + 4095) & ~std::uint64_t{4095});
  const std::uint64_t count = std::max<std::uint64_t>(1, per_thread / size);
  std::vector<int> fds(threads, -1);
  const auto close_all = [&fds] {
    for (int& fd : fds) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  };
  for (unsigned t = 0; t < threads; ++t) {
    const std::string path = dir + "/reference-" + std::to_string(t);
    fds[t] = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0),
                    0644);
    if (fds[t] < 0) {
      const int err = errno;
      close_all();
      throw std::system_error(err, std::system_category(), "open " + path);
    }
    ::unlink(path.c_str());
  }
  rates r;
  const double total = static_cast<double>(count * size) * threads;
  try {
    const double w = timed(threads, [&](unsigned t) {
      aligned buf(req);
      for (std::uint64_t i = 0; i < count; ++i) {
        if (::pwrite(fds[t], buf.p, req, static_cast<off_t>(i * req)) !=
            static_cast<ssize_t>(req)) {
          throw std::system_error(errno, std::system_category(), "reference write");
        }
      }
      if (!direct) ::fsync(fds[t]);
    });
    const double rd = timed(threads, [&](unsigned t) {
      aligned buf(req);
      for (std::uint64_t i = 0; i < count; ++i) {
        if (::pread(fds[t], buf.p, req, static_cast<off_t>(i * req)) != static_cast<ssize_t>(req)) {
          throw std::system_error(errno, std::system_category(), "reference read");
        }
      }
    });
    r.write_gbs = total / w / 1e9;
    r.read_gbs = total / rd / 1e9;
  } catch (...) {
    close_all();
    throw;
  }
  close_all();
  return r;
}

}  // namespace kvlink::bench::disk
