// The SSD tier (store/tier/disk.hpp) against the disk it sits on, measured in
// one run on the same directory:
//
//   kvlink_disk_bench --dir /nvme/tmp --sizes 64K,1M,16M --bytes 2G --threads 1,4
//
// For each object size and thread count: the disk's own sequential rate
// (this program's O_DIRECT writer and reader: each thread its own file,
// requests of the object's size from one aligned buffer, the same bytes in
// all), then the tier's puts of --bytes of fresh objects of that size and
// its gets of all of them (each thread its own keys). The ratio is tier /
// disk, written and read. GB = 10^9 bytes.
//
// Both sides go around the page cache (O_DIRECT) where the file system takes
// it; where it does not (tmpfs, some FUSE), both go through it and the table
// says so.
#include <kvlink/store/tier/disk.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "disk_reference.hpp"
#include <unistd.h>

namespace tier = kvlink::store::tier;
using clock_type = std::chrono::steady_clock;

namespace {

std::uint64_t parse_bytes(std::string_view s) {
  std::uint64_t mult = 1;
  if (!s.empty()) {
    switch (s.back()) {
      case 'K':
        mult = 1ULL << 10;
        break;
      case 'M':
        mult = 1ULL << 20;
        break;
      case 'G':
        mult = 1ULL << 30;
        break;
      default:
        break;
    }
    if (mult != 1) s.remove_suffix(1);
  }
  std::size_t used = 0;
  const std::uint64_t n = std::stoull(std::string(s), &used);
  if (used != s.size() || n == 0) throw std::invalid_argument("bad size: " + std::string(s));
  return n * mult;
}

std::vector<std::string> split(std::string_view s) {
  std::vector<std::string> out;
  while (!s.empty()) {
    const auto comma = s.find(',');
    out.emplace_back(s.substr(0, comma));
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

using kvlink::bench::disk::aligned;
using kvlink::bench::disk::rates;
using kvlink::bench::disk::timed;

rates tier_run(const std::string& dir, std::uint64_t size, std::uint64_t per_thread,
               unsigned threads, bool direct, tier::disk_stats& st) {
  const std::uint64_t count = std::max<std::uint64_t>(1, per_thread / size);
  const std::uint64_t total_bytes = count * size * threads;
  std::filesystem::remove_all(dir + "/tier");
  // Room for everything (no eviction during the run): files of at least
  // four objects.
  const std::uint64_t file = std::clamp<std::uint64_t>(
      ((4 * (size + 8192) + (1u << 20) - 1) >> 20) << 20, 64u << 20, 1u << 30);
  tier::disk_tier d({.path = dir + "/tier",
                     .capacity = std::max(2 * total_bytes + 4 * file, 4 * file),
                     .file_bytes = file,
                     .direct_io = direct});
  aligned src(size);
  const auto key = [](unsigned t, std::uint64_t i) {
    return "bench/t" + std::to_string(t) + "/block-" + std::to_string(i) + "/layer-00";
  };
  rates r;
  const double w = timed(threads, [&](unsigned t) {
    for (std::uint64_t i = 0; i < count; ++i) {
      if (auto ec = d.put(key(t, i), {src.p, size})) {
        throw std::system_error(ec, "tier put");
      }
    }
  });
  const double rd = timed(threads, [&](unsigned t) {
    aligned out(size);  // page-aligned, as a registered segment is
    for (std::uint64_t i = 0; i < count; ++i) {
      std::uint64_t got = 0;
      if (auto ec = d.get(key(t, i), {out.p, size}, got); ec || got != size) {
        throw std::system_error(ec, "tier get");
      }
    }
    if (std::memcmp(out.p, src.p, size) != 0) throw std::runtime_error("tier get: bytes differ");
  });
  st = d.stats();
  r.write_gbs = static_cast<double>(total_bytes) / w / 1e9;
  r.read_gbs = static_cast<double>(total_bytes) / rd / 1e9;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp", sizes = "64K,1M,16M", threads_list = "1,4";
  std::uint64_t bytes = 1ULL << 30;
  bool direct = true;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(a) + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--dir") {
        dir = value();
      } else if (a == "--sizes") {
        sizes = value();
      } else if (a == "--bytes") {
        bytes = parse_bytes(value());
      } else if (a == "--threads") {
        threads_list = value();
      } else if (a == "--page-cache") {
        direct = false;
      } else {
        std::fprintf(stderr,
                     "usage: %s [--dir DIR] [--sizes 64K,1M,16M] [--bytes 1G] [--threads 1,4] "
                     "[--page-cache]\n",
                     argv[0]);
        return a == "--help" ? 0 : 2;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kvlink_disk_bench: %s\n", e.what());
      return 2;
    }
  }
  try {
    const std::string work = dir + "/kvlink-disk-bench-" + std::to_string(::getpid());
    std::filesystem::create_directories(work);
    tier::disk_stats probe;
    {
      tier::disk_tier t({.path = work + "/probe", .capacity = 64 << 20, .direct_io = direct});
      probe = t.stats();
    }
    direct = probe.direct_io;
    std::printf("# SSD tier vs the disk under %s (%s, block %llu B); %s per row; GB = 10^9 B\n",
                dir.c_str(), direct ? "O_DIRECT" : "page cache: no O_DIRECT here",
                static_cast<unsigned long long>(probe.block),
                (std::to_string(bytes >> 20) + " MiB").c_str());
    std::printf("%-8s %7s | %12s %12s %6s | %12s %12s %6s\n", "size", "threads", "disk wr GB/s",
                "put GB/s", "ratio", "disk rd GB/s", "get GB/s", "ratio");
    for (const auto& s : split(sizes)) {
      const std::uint64_t size = parse_bytes(s);
      for (const auto& ts : split(threads_list)) {
        const unsigned threads = static_cast<unsigned>(std::stoul(ts));
        const std::uint64_t per_thread = bytes / threads;
        const rates ref = kvlink::bench::disk::sequential(work, size, per_thread, threads, direct);
        tier::disk_stats st;
        const rates got = tier_run(work, size, per_thread, threads, direct, st);
        std::printf("%-8s %7u | %12.2f %12.2f %6.2f | %12.2f %12.2f %6.2f\n", s.c_str(), threads,
                    ref.write_gbs, got.write_gbs, got.write_gbs / ref.write_gbs, ref.read_gbs,
                    got.read_gbs, got.read_gbs / ref.read_gbs);
        std::fflush(stdout);
      }
    }
    std::filesystem::remove_all(work);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvlink_disk_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
