// The SSD tier (store/tier/disk.hpp) against what a real machine does to it:
//
//   kvlink_store_disk_test crash   a writer process SIGKILLed in the middle of
//                                  its puts, three times: every put it was
//                                  told had completed is read back with its
//                                  bytes, no read returns other bytes.
//   kvlink_store_disk_test full    a disk that fills up and one remounted
//                                  read-only (a 3 MiB tmpfs in a private
//                                  mount namespace): clear errors (ENOSPC,
//                                  EROFS), and what was written before is
//                                  read back. Exit 77 (skipped) where this
//                                  process may not mount (no root and no
//                                  user namespaces).
//   kvlink_store_disk_test pool    the store's pool (a master and clients in
//                                  this process) over such a disk: the tier
//                                  of the segment's owner fills up, then is
//                                  read only; puts keep landing in memory,
//                                  what the disk held stays readable. Exit
//                                  77 as above.
#include <kvlink/engine.hpp>
#include <kvlink/store/client/client.hpp>
#include <kvlink/store/master/server.hpp>
#include <kvlink/store/tier/disk.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <asio/io_context.hpp>
#include <asio/use_future.hpp>
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

namespace tier = kvlink::store::tier;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what.c_str());
    ++failures;
  }
}

std::string temp_dir() {
  const char* t = std::getenv("TMPDIR");
  std::string tmpl = std::string(t != nullptr && *t != '\0' ? t : "/tmp") + "/kvlink-disk-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::system_error(errno, std::generic_category());
  return tmpl;
}

std::size_t object_size(std::uint64_t i) { return 1000 + (i * 7919) % 60'000; }

std::vector<std::byte> object(std::uint64_t i) {
  std::vector<std::byte> v(object_size(i));
  std::uint64_t x = i * 0x9E3779B97F4A7C15ULL + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  return v;
}

std::string key_of(std::uint64_t i) { return "run/obj-" + std::to_string(i); }

// The writer: puts objects first..., writing each completed index to `out`.
[[noreturn]] void writer(const std::string& dir, std::uint64_t first, int out) {
  try {
    tier::disk_tier d({.path = dir, .capacity = 1ULL << 30, .file_bytes = 8 << 20});
    for (std::uint64_t i = first;; ++i) {
      if (d.put(key_of(i), object(i))) _exit(3);
      if (::write(out, &i, sizeof i) != sizeof i) _exit(4);
    }
  } catch (const std::exception& e) {
    std::printf("writer: %s\n", e.what());
    _exit(5);
  }
}

int crash() {
  const std::string dir = temp_dir();
  std::uint64_t next = 0;
  std::uint64_t acked_total = 0;
  std::vector<std::uint64_t> in_flight;  // one per kill: written or not, never acknowledged
  for (int round = 0; round < 3; ++round) {
    int fds[2];
    if (::pipe(fds) != 0) return 1;
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      writer(dir, next, fds[1]);
    }
    ::close(fds[1]);
    // Kill it at a different moment each round, while it writes.
    std::this_thread::sleep_for(std::chrono::milliseconds(150 + 100 * round));
    ::kill(pid, SIGKILL);
    std::vector<std::uint64_t> acked;
    std::uint64_t i = 0;
    while (::read(fds[0], &i, sizeof i) == sizeof i) acked.push_back(i);
    ::close(fds[0]);
    int status = 0;
    ::waitpid(pid, &status, 0);
    check(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
          "round " + std::to_string(round) + ": the writer ended on its own");
    check(!acked.empty(), "round " + std::to_string(round) + ": nothing was written");
    const std::uint64_t last = acked.empty() ? next : acked.back() + 1;

    tier::disk_tier d({.path = dir, .capacity = 1ULL << 30, .file_bytes = 8 << 20});
    std::vector<std::byte> got(64 << 10);
    std::uint64_t read_ok = 0, wrong = 0, lost = 0;
    // Everything acknowledged, from every round so far, and the one put
    // that was in flight at the kill (back with its bytes, or not at all).
    for (std::uint64_t k = 0; k <= last; ++k) {
      std::uint64_t size = 0;
      const std::error_code ec = d.get(key_of(k), got, size);
      const bool was_acked =
          k != last && std::find(in_flight.begin(), in_flight.end(), k) == in_flight.end();
      if (!ec) {
        ++read_ok;
        const auto want = object(k);
        if (size != want.size() || std::memcmp(got.data(), want.data(), size) != 0) ++wrong;
      } else if (was_acked) {
        ++lost;
        std::printf("lost %s: %s\n", key_of(k).c_str(), ec.message().c_str());
      }
    }
    acked_total += acked.size();
    const auto s = d.stats();
    std::printf(
        "round %d: %zu puts acknowledged before SIGKILL, %llu objects read back, "
        "%llu blocks stepped over at the reopen\n",
        round, acked.size(), static_cast<unsigned long long>(read_ok),
        static_cast<unsigned long long>(s.skipped_blocks));
    check(wrong == 0, "a read returned other bytes than were put");
    check(lost == 0, "an acknowledged put was lost");
    in_flight.push_back(last);
    next = last + 1;  // the in-flight one may or may not be there: do not reuse its key
  }
  std::printf("crash: %llu acknowledged puts over 3 kills, none lost\n",
              static_cast<unsigned long long>(acked_total));
  std::filesystem::remove_all(dir);
  return failures == 0 ? 0 : 1;
}

// A private mount namespace where this process may mount; false if not.
bool private_mounts() {
  if (::unshare(CLONE_NEWNS) != 0) {
    const uid_t uid = ::getuid();
    const gid_t gid = ::getgid();
    if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
    auto write_file = [](const char* path, const std::string& text) {
      std::ofstream f(path);
      f << text;
      return static_cast<bool>(f.flush());
    };
    write_file("/proc/self/setgroups", "deny");
    if (!write_file("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1\n") ||
        !write_file("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1\n")) {
      return false;
    }
  }
  return ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0;
}

int full_in_namespace(const std::string& dir) {
  if (::mount("kvlink-test", dir.c_str(), "tmpfs", 0, "size=3m") != 0) {
    std::printf("SKIPPED: mount tmpfs: %s\n", std::strerror(errno));
    return 77;
  }
  const tier::disk_options opt{.path = dir + "/tier", .capacity = 64 << 20, .file_bytes = 1 << 20};
  std::vector<std::uint64_t> written;
  {
    tier::disk_tier d(opt);
    std::error_code ec;
    std::uint64_t i = 0;
    for (; i < 100 && !ec; ++i) {
      ec = d.put(key_of(i), object(i));
      if (!ec) written.push_back(i);
    }
    std::printf("full: %zu puts, then: %s\n", written.size(), ec.message().c_str());
    check(ec == std::errc::no_space_on_device, "the put on a full disk did not fail with ENOSPC");
    check(written.size() >= 20, "fewer puts than 2 MiB hold went in before the disk was full");
    check(d.stats().write_errors >= 1, "the write error was not counted");
    std::vector<std::byte> got(64 << 10);
    for (std::uint64_t k : written) {
      std::uint64_t size = 0;
      const std::error_code gec = d.get(key_of(k), got, size);
      const auto want = object(k);
      check(!gec && size == want.size() && std::memcmp(got.data(), want.data(), size) == 0,
            "an object written before the disk was full did not read back: " + gec.message());
    }
    // The next put fails the same way.
    ec = d.put("one more", object(1000));
    check(ec == std::errc::no_space_on_device, "a second put on the full disk: " + ec.message());
  }
  if (::mount(nullptr, dir.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) != 0) {
    std::printf("FAILED: remount read-only: %s\n", std::strerror(errno));
    return 1;
  }
  {
    tier::disk_tier d(opt);  // a read-only directory opens for reading
    std::vector<std::byte> got(64 << 10);
    std::uint64_t size = 0;
    const std::error_code gec = d.get(key_of(written.front()), got, size);
    check(!gec, "a read from the read-only disk failed: " + gec.message());
    const std::error_code ec = d.put("on a read-only disk", object(2000));
    std::printf("read-only: put: %s\n", ec.message().c_str());
    check(ec == std::errc::read_only_file_system, "the put on a read-only disk: " + ec.message());
  }
  return failures == 0 ? 0 : 1;
}

// A master and two clients in this process: `owner` serves a 1 MiB segment
// with its SSD tier in `disk` (a 16 MiB budget: files of 2 MiB, so one fits
// the 3 MiB tmpfs and the second does not), `user` puts and gets.
struct pool_rig {
  explicit pool_rig(const std::string& disk) {
    kvlink::store::master_config cfg;
    cfg.lease_ttl = std::chrono::milliseconds(50);  // reads lease what they read
    kvlink::store::server_options opt;
    opt.listen = "127.0.0.1:0";
    master.emplace(io.get_executor(), cfg, opt);
    master->listen();
    for (int i = 0; i < 2; ++i) threads.emplace_back([this] { io.run(); });
    const kvlink::config ecfg{.listen = "127.0.0.1:0", .transports = "tcp"};
    owner_engine.emplace(io.get_executor(), ecfg);
    user_engine.emplace(io.get_executor(), ecfg);
    owner.emplace(*owner_engine, kvlink::store::client_options{.master = master->local_address(),
                                                               .disk_path = disk,
                                                               .disk_capacity = 16u << 20});
    user.emplace(*user_engine, kvlink::store::client_options{.master = master->local_address()});
    owner->async_mount(segment.data(), segment.size(), asio::use_future).get();
    user_engine->register_segment(work.data(), work.size());
  }
  ~pool_rig() {
    user->async_close(asio::use_future).get();
    owner->async_close(asio::use_future).get();
    user.reset();
    owner.reset();
    user_engine.reset();
    owner_engine.reset();
    master->async_close(asio::use_future).get();
    guard.reset();
    for (auto& t : threads) t.join();
  }

  // Puts `n` objects of 64 KiB under `prefix`, each retried while the pool
  // answers no_space; how many landed.
  std::size_t put_all(const std::string& prefix, std::size_t n) {
    std::size_t landed = 0;
    for (std::size_t i = 0; i < n; ++i) {
      fill(i);
      std::error_code ec;
      for (int attempt = 0; attempt < 400; ++attempt) {
        ec = call([&](auto h) {
          user->async_put(prefix + std::to_string(i), work.data(), work.size(), {}, {}, h);
        });
        if (ec != kvlink::store_errc::no_space) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      check(!ec, "put " + prefix + std::to_string(i) + ": " + ec.message());
      landed += ec ? 0 : 1;
    }
    return landed;
  }
  // Objects read back with their bytes; every other answer must be
  // object_not_found.
  std::size_t read_all(const std::string& prefix, std::size_t n) {
    std::size_t good = 0;
    for (std::size_t i = 0; i < n; ++i) {
      std::fill(work.begin(), work.end(), std::byte{0});
      const std::error_code ec = call([&](auto h) {
        user->async_get(prefix + std::to_string(i), work.data(), work.size(),
                        [h](std::error_code e, std::uint64_t) mutable { h(e); });
      });
      if (ec) {
        check(ec == kvlink::store_errc::object_not_found,
              "get " + prefix + std::to_string(i) + ": " + ec.message());
        continue;
      }
      const std::vector<std::byte> want = expected(i);
      check(std::memcmp(work.data(), want.data(), want.size()) == 0,
            "get " + prefix + std::to_string(i) + ": other bytes");
      ++good;
    }
    return good;
  }
  std::string metrics() { return master->service().metrics_text(); }

  template <class Start>
  static std::error_code call(Start start) {
    auto p = std::make_shared<std::promise<std::error_code>>();
    auto f = p->get_future();
    start([p](std::error_code ec) { p->set_value(ec); });
    return f.get();
  }
  static std::vector<std::byte> expected(std::size_t i) {
    std::vector<std::byte> v(64u << 10);
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = static_cast<std::byte>((i * 131 + k) & 0xff);
    return v;
  }
  void fill(std::size_t i) {
    const auto v = expected(i);
    std::copy(v.begin(), v.end(), work.begin());
  }

  asio::io_context io;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard{
      io.get_executor()};
  std::vector<std::thread> threads;
  std::optional<kvlink::store::master_server> master;
  std::optional<kvlink::engine> owner_engine, user_engine;
  std::optional<kvlink::store::client> owner, user;
  std::vector<std::byte> segment = std::vector<std::byte>(1u << 20);
  std::vector<std::byte> work = std::vector<std::byte>(64u << 10);
};

int pool_in_namespace(const std::string& dir) {
  if (::mount("kvlink-test", dir.c_str(), "tmpfs", 0, "size=3m") != 0) {
    std::printf("SKIPPED: mount tmpfs: %s\n", std::strerror(errno));
    return 77;
  }
  const std::string disk = dir + "/tier";
  constexpr std::size_t n = 64;  // 4 MiB through a 1 MiB segment and a 3 MiB disk
  std::size_t kept = 0;
  {
    pool_rig r(disk);
    check(r.put_all("full/", n) == n, "puts stopped when the disk filled up");
    const std::string m = r.metrics();
    check(m.find("kvlink_store_disks 1\n") != std::string::npos, "the disk left the pool");
    check(m.find("kvlink_store_disks_accepting 0\n") != std::string::npos,
          "the full disk still takes objects");
    check(m.find("kvlink_store_disk_failures_total 0\n") == std::string::npos,
          "no failed copy was reported");
    kept = r.read_all("full/", n);
    std::printf("full disk: %zu puts landed, %zu of them read back\n", n, kept);
    // More than the segment holds: the disk's objects stayed readable.
    check(kept > 16, "what the disk held before it filled up was lost");
  }
  if (::mount(nullptr, dir.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) != 0) {
    std::printf("FAILED: remount read-only: %s\n", std::strerror(errno));
    return 1;
  }
  {
    // A new owner on the read-only disk: what it holds comes back; new
    // evictions cannot go there, and puts land all the same.
    pool_rig r(disk);
    const std::size_t back = r.read_all("full/", n);
    std::printf("read-only disk: %zu objects back\n", back);
    check(back + 16 >= kept, "objects of the read-only disk did not come back");
    check(r.put_all("ro/", 32) == 32, "puts stopped on a read-only disk");
    check(r.metrics().find("kvlink_store_disks_accepting 0\n") != std::string::npos,
          "the read-only disk still takes objects");
    (void)r.read_all("ro/", 32);
  }
  return failures == 0 ? 0 : 1;
}

// Runs `body` in a forked child with a private mount namespace (77 where
// there is none).
template <class Body>
int in_namespace(Body body) {
  const std::string dir = temp_dir();
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (!private_mounts()) {
      std::printf("SKIPPED: no private mount namespace here (%s): needs root or user namespaces\n",
                  std::strerror(errno));
      std::fflush(stdout);
      _exit(77);
    }
    int rc = 1;
    try {
      rc = body(dir);
    } catch (const std::exception& e) {
      std::printf("FAILED: %s\n", e.what());
    }
    std::fflush(stdout);
    _exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::filesystem::remove_all(dir);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string_view mode = argc > 1 ? argv[1] : "";
  if (mode == "crash") return crash();
  if (mode == "full") return in_namespace(full_in_namespace);
  if (mode == "pool") return in_namespace(pool_in_namespace);
  std::fprintf(stderr, "usage: %s crash|full|pool\n", argv[0]);
  return 2;
}
