// store/tier/disk.hpp: the SSD tier on a real directory (under $TMPDIR):
// bytes back after a reopen, removals that stay, first-in-first-out eviction
// within the capacity, damaged and torn records never returned, and many
// threads at once.
#include <kvlink/store/tier/disk.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <unistd.h>

namespace tier = kvlink::store::tier;
using kvlink::store_errc;

namespace {

struct disk_dir {
  std::string path;
  disk_dir() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t != nullptr && *t != '\0' ? t : "/tmp") + "/kvlink-disk-XXXXXX";
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~disk_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path)) {
      if (e.path().extension() == ".kvd") out.push_back(e.path().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  std::uint64_t file_bytes_on_disk() const {
    std::uint64_t n = 0;
    for (const auto& f : files()) n += std::filesystem::file_size(f);
    return n;
  }
};

std::vector<std::byte> disk_pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::byte>((i * 131 + seed * 7 + 3) & 0xff);
  return v;
}

// The object under key, read back ("" and the bytes on success, else the
// error's message).
std::error_code disk_read_back(tier::disk_tier& d, const std::string& key,
                               std::vector<std::byte>& out) {
  std::uint64_t size = 0;
  out.assign(1 << 20, std::byte{0});
  const std::error_code ec = d.get(key, out, size);
  out.resize(ec ? 0 : size);
  return ec;
}

// prefix + i (appended, not operator+: g++ 12 at -O3 warns falsely about
// "literal" + std::string, issue 28).
std::string disk_key(std::string_view prefix, long long i) {
  std::string k(prefix);
  k += std::to_string(i);
  return k;
}

// "t<thread>/<i>" (appended, not operator+: g++ 12 at -O3 warns falsely
// about "literal" + std::string, issue 28).
std::string disk_thread_key(int t, int i) {
  std::string k = "t";
  k += std::to_string(t);
  k += '/';
  k += std::to_string(i);
  return k;
}

// Flips one byte of a file at `offset`.
void disk_flip(const std::string& file, std::uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("disk tier: bytes come back, also after the directory is opened again") {
  disk_dir dir;
  const std::vector<std::size_t> sizes{1, 63, 64, 511, 4096, 4097, 100'000, 1 << 20};
  {
    tier::disk_tier d({.path = dir.path, .capacity = 64 << 20});
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      REQUIRE_FALSE(d.put(disk_key("k", i), disk_pattern(sizes[i], unsigned(i))));
    }
    std::vector<std::byte> got;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      REQUIRE_FALSE(disk_read_back(d, disk_key("k", i), got));
      CHECK(got == disk_pattern(sizes[i], unsigned(i)));
    }
    const auto s = d.stats();
    CHECK(s.objects == sizes.size());
    CHECK(s.puts == sizes.size());
    CHECK(s.gets == sizes.size());
    CHECK(s.used_bytes <= s.capacity);
    MESSAGE("block " << s.block << std::string(s.direct_io ? ", O_DIRECT" : ", page cache"));
  }
  tier::disk_tier d({.path = dir.path, .capacity = 64 << 20});
  std::vector<std::byte> got;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CAPTURE(i);
    REQUIRE_FALSE(disk_read_back(d, disk_key("k", i), got));
    CHECK(got == disk_pattern(sizes[i], unsigned(i)));
  }
  CHECK(d.stats().skipped_blocks == 0);
  std::size_t listed = 0;
  d.for_each([&](std::string_view key, std::uint64_t size) {
    ++listed;
    CHECK(size == sizes[std::stoul(std::string(key.substr(1)))]);
  });
  CHECK(listed == sizes.size());
  // New puts after the reopen go on; both survive another reopen.
  REQUIRE_FALSE(d.put("after", disk_pattern(777, 9)));
  CHECK(d.contains("after"));
}

TEST_CASE("disk tier: errors a caller can get") {
  disk_dir dir;
  tier::disk_tier d({.path = dir.path, .capacity = 8 << 20, .file_bytes = 2 << 20});
  std::uint64_t size = 0;
  std::vector<std::byte> small(10);
  CHECK(d.get("nothing", small, size) == store_errc::object_not_found);
  CHECK(d.put("", disk_pattern(10, 1)) == store_errc::invalid_key);
  CHECK(d.put(std::string(tier::disk_max_key + 1, 'k'), disk_pattern(10, 1)) ==
        store_errc::invalid_key);
  CHECK(d.put("huge", disk_pattern(d.max_object_size() + 1, 1)) == store_errc::invalid_params);
  REQUIRE_FALSE(d.put("largest", disk_pattern(d.max_object_size(), 1)));
  REQUIRE_FALSE(d.put("k", disk_pattern(100, 1)));
  CHECK(d.get("k", small, size) == store_errc::buffer_overflow);
  CHECK(size == 100);
  CHECK(d.remove("nothing") == store_errc::object_not_found);

  // A second tier on the same directory is refused while this one is open.
  CHECK_THROWS_WITH_AS(tier::disk_tier({.path = dir.path, .capacity = 8 << 20}),
                       doctest::Contains("in use by another process"), std::system_error);
  CHECK_THROWS_AS(tier::disk_tier({.path = dir.path + "x", .capacity = 0}), std::invalid_argument);
  CHECK_THROWS_AS(
      tier::disk_tier({.path = dir.path + "y", .capacity = 1 << 20, .file_bytes = 1 << 20}),
      std::invalid_argument);  // one file would fill the whole capacity
}

TEST_CASE("disk tier: the same bytes twice are kept once; other bytes replace them") {
  disk_dir dir;
  {
    tier::disk_tier d({.path = dir.path, .capacity = 8 << 20, .file_bytes = 2 << 20});
    REQUIRE_FALSE(d.put("k", disk_pattern(5000, 1)));
    const auto used = d.stats().used_bytes;
    REQUIRE_FALSE(d.put("k", disk_pattern(5000, 1)));
    CHECK(d.stats().used_bytes == used);
    REQUIRE_FALSE(d.put("k", disk_pattern(6000, 2)));
    std::vector<std::byte> got;
    REQUIRE_FALSE(disk_read_back(d, "k", got));
    CHECK(got == disk_pattern(6000, 2));
  }
  tier::disk_tier d({.path = dir.path, .capacity = 8 << 20, .file_bytes = 2 << 20});
  std::vector<std::byte> got;
  REQUIRE_FALSE(disk_read_back(d, "k", got));
  CHECK(got == disk_pattern(6000, 2));  // the newest record wins at the scan
  CHECK(d.stats().objects == 1);
  CHECK(d.stats().object_bytes == 6000);
}

TEST_CASE("disk tier: a removed key stays removed after a reopen; put again, it is back") {
  disk_dir dir;
  {
    tier::disk_tier d({.path = dir.path, .capacity = 8 << 20, .file_bytes = 2 << 20});
    REQUIRE_FALSE(d.put("gone", disk_pattern(3000, 1)));
    REQUIRE_FALSE(d.put("back", disk_pattern(3000, 2)));
    REQUIRE_FALSE(d.put("kept", disk_pattern(3000, 3)));
    REQUIRE_FALSE(d.remove("gone"));
    REQUIRE_FALSE(d.remove("back"));
    REQUIRE_FALSE(d.put("back", disk_pattern(4000, 4)));
    CHECK_FALSE(d.contains("gone"));
  }
  tier::disk_tier d({.path = dir.path, .capacity = 8 << 20, .file_bytes = 2 << 20});
  std::vector<std::byte> got;
  CHECK(disk_read_back(d, "gone", got) == store_errc::object_not_found);
  CHECK(d.stats().objects == 2);
  CHECK(d.stats().object_bytes == 4000 + 3000);
  REQUIRE_FALSE(disk_read_back(d, "back", got));
  CHECK(got == disk_pattern(4000, 4));
  REQUIRE_FALSE(disk_read_back(d, "kept", got));
  CHECK(got == disk_pattern(3000, 3));
}

TEST_CASE("disk tier: the capacity is kept by evicting the oldest file, named to the caller") {
  disk_dir dir;
  const std::uint64_t capacity = 8 << 20, file = 1 << 20;
  std::vector<std::string> evicted;
  std::vector<std::string> put_keys;
  {
    tier::disk_tier d({.path = dir.path, .capacity = capacity, .file_bytes = file});
    for (int i = 0; i < 400; ++i) {  // 400 x 64 KiB = 25.6 MiB through 8 MiB
      const std::string key = disk_key("obj", i);
      REQUIRE_FALSE(d.put(key, disk_pattern(64 << 10, unsigned(i)), &evicted));
      put_keys.push_back(key);
      REQUIRE(d.stats().used_bytes <= capacity);
      REQUIRE(dir.file_bytes_on_disk() <= capacity);
    }
    const auto s = d.stats();
    CHECK(s.evicted == evicted.size());
    CHECK(s.objects + evicted.size() == put_keys.size());
    CHECK(s.object_bytes == s.objects * (64 << 10));
    // First in, first out: what was evicted is a prefix of what was put.
    REQUIRE_FALSE(evicted.empty());
    CHECK(std::equal(evicted.begin(), evicted.end(), put_keys.begin()));
    std::vector<std::byte> got;
    for (std::size_t i = 0; i < put_keys.size(); ++i) {
      const bool gone = i < evicted.size();
      const std::error_code ec = disk_read_back(d, put_keys[i], got);
      if (gone) {
        CHECK(ec == store_errc::object_not_found);
      } else {
        REQUIRE_FALSE(ec);
        CHECK(got == disk_pattern(64 << 10, unsigned(i)));
      }
    }
  }
  // A smaller capacity at the next open: the oldest files go at once.
  tier::disk_tier d({.path = dir.path, .capacity = 4 << 20, .file_bytes = file});
  CHECK(d.stats().used_bytes <= 4u << 20);
  CHECK(dir.file_bytes_on_disk() <= 4u << 20);
  CHECK(d.contains(put_keys.back()));
  CHECK_FALSE(d.contains(put_keys[evicted.size()]));
}

TEST_CASE("disk tier: a damaged record is never returned") {
  disk_dir dir;
  tier::disk_options o{.path = dir.path, .capacity = 8 << 20, .file_bytes = 2 << 20};
  std::uint64_t block = 0;
  {
    tier::disk_tier d(o);
    block = d.stats().block;
    for (int i = 0; i < 3; ++i)
      REQUIRE_FALSE(d.put(disk_key("k", i), disk_pattern(10'000, unsigned(i))));
  }
  const auto files = dir.files();
  REQUIRE(files.size() == 1);
  // k0's record starts at the file's second block; flip a byte of its
  // object's bytes.
  disk_flip(files[0], block + tier::record_body_offset(2, block) + 5000);
  tier::disk_tier d(o);
  CHECK(d.contains("k0"));  // the scan reads headers only
  std::vector<std::byte> got;
  CHECK(disk_read_back(d, "k0", got) == store_errc::checksum_mismatch);
  CHECK(disk_read_back(d, "k0", got) == store_errc::object_not_found);  // and it is gone
  CHECK(d.stats().damaged == 1);
  REQUIRE_FALSE(disk_read_back(d, "k1", got));
  CHECK(got == disk_pattern(10'000, 1));
}

TEST_CASE("disk tier: torn records and garbage are stepped over at a reopen") {
  disk_dir dir;
  tier::disk_options o{.path = dir.path, .capacity = 16 << 20, .file_bytes = 4 << 20};
  std::uint64_t block = 0;
  const std::uint64_t rec = [&] {
    tier::disk_tier d(o);
    block = d.stats().block;
    for (int i = 0; i < 6; ++i)
      REQUIRE_FALSE(d.put(disk_key("k", i), disk_pattern(20'000, unsigned(i))));
    return tier::disk_record_bytes(20'000, 2, block);
  }();
  auto files = dir.files();
  REQUIRE(files.size() == 1);
  // k1's header damaged (the scan must find k2.. behind it), k5 cut in the
  // middle of its bytes (a crash mid-write), garbage after it.
  disk_flip(files[0], block + rec + 20);
  std::filesystem::resize_file(files[0], block + 5 * rec + rec / 2);
  {
    std::ofstream g(files[0], std::ios::app | std::ios::binary);
    for (int i = 0; i < 3000; ++i) g.put(static_cast<char>(i * 37));
  }
  std::optional<tier::disk_tier> d(std::in_place, o);
  std::vector<std::byte> got;
  for (int i : {0, 2, 3, 4}) {
    CAPTURE(i);
    REQUIRE_FALSE(disk_read_back(*d, disk_key("k", i), got));
    CHECK(got == disk_pattern(20'000, unsigned(i)));
  }
  CHECK(disk_read_back(*d, "k1", got) == store_errc::object_not_found);
  CHECK(disk_read_back(*d, "k5", got) == store_errc::object_not_found);
  CHECK(d->stats().skipped_blocks > 0);
  // A file whose own header is torn holds nothing trusted: it is deleted.
  d.reset();
  {
    std::ofstream torn(dir.path + "/kvlink-00000000000000ff.kvd", std::ios::binary);
    torn << "KVLDISK1 and then nothing";
  }
  d.emplace(o);
  CHECK_FALSE(std::filesystem::exists(dir.path + "/kvlink-00000000000000ff.kvd"));
  CHECK(d->contains("k4"));
  // New files are numbered after every file seen, the deleted one too.
  REQUIRE_FALSE(d->put("new", disk_pattern(10, 1)));
  CHECK(dir.files().back() > dir.path + "/kvlink-00000000000000ff.kvd");
}

TEST_CASE("disk tier: a file of another format version is refused, not deleted") {
  disk_dir dir;
  std::vector<std::byte> head(512);
  REQUIRE(tier::encode_file_header(tier::disk_file_header{9, 512, 1, 5}, head));
  const std::string name = dir.path + "/kvlink-0000000000000001.kvd";
  {
    std::ofstream f(name, std::ios::binary);
    f.write(reinterpret_cast<const char*>(head.data()), static_cast<std::streamsize>(head.size()));
  }
  CHECK_THROWS_WITH_AS(tier::disk_tier({.path = dir.path, .capacity = 8 << 20}),
                       doctest::Contains("format version 9"), std::system_error);
  CHECK(std::filesystem::exists(name));
}

TEST_CASE("disk tier: written through the page cache, read back by a tier that uses O_DIRECT") {
  disk_dir dir;
  {
    tier::disk_tier d(
        {.path = dir.path, .capacity = 8 << 20, .file_bytes = 2 << 20, .direct_io = false});
    CHECK_FALSE(d.stats().direct_io);
    CHECK(d.stats().block == tier::disk_min_block);
    REQUIRE_FALSE(d.put("k", disk_pattern(9000, 1)));
  }
  tier::disk_tier d({.path = dir.path, .capacity = 8 << 20, .file_bytes = 2 << 20});
  std::vector<std::byte> got;
  REQUIRE_FALSE(disk_read_back(d, "k", got));
  CHECK(got == disk_pattern(9000, 1));
}

TEST_CASE("disk tier: threads putting, getting and removing at once") {
  disk_dir dir;
  tier::disk_tier d({.path = dir.path, .capacity = 4 << 20, .file_bytes = 512 << 10});
  std::atomic<int> wrong{0}, errors{0}, reads{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::byte> got;
      for (int i = 0; i < 150; ++i) {
        const std::string key = disk_thread_key(t, i);
        const auto bytes = disk_pattern(std::size_t(1000 + 97 * i), unsigned(t * 1000 + i));
        if (d.put(key, bytes)) ++errors;
        // Reads of the own and another thread's keys: right bytes, or gone.
        for (const std::string& k : {key, disk_thread_key((t + 1) % 4, i)}) {
          const std::error_code ec = disk_read_back(d, k, got);
          if (!ec) {
            ++reads;
            const int owner = k[1] - '0';
            const auto want = disk_pattern(std::size_t(1000 + 97 * i), unsigned(owner * 1000 + i));
            if (got != want) ++wrong;
          } else if (ec != store_errc::object_not_found && ec != store_errc::object_in_progress) {
            ++errors;
          }
        }
        if (i % 10 == 0) {
          const std::error_code ec = d.remove(key);
          if (ec && ec != store_errc::object_not_found) ++errors;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(wrong == 0);
  CHECK(errors == 0);
  CHECK(reads > 0);
  CHECK(d.stats().used_bytes <= 4u << 20);
}

TEST_CASE("disk tier: aligned memory moves without a copy, unaligned through one: same bytes") {
  disk_dir dir;
  tier::disk_tier d({.path = dir.path, .capacity = 32 << 20, .file_bytes = 4 << 20});
  const std::uint64_t block = d.stats().block;
  // Page-aligned memory (a registered segment's), and the same one byte on.
  std::unique_ptr<std::byte, decltype(&std::free)> mem(
      static_cast<std::byte*>(std::aligned_alloc(4096, 1 << 20)), &std::free);
  REQUIRE(mem);
  std::unique_ptr<std::byte, decltype(&std::free)> back(
      static_cast<std::byte*>(std::aligned_alloc(4096, (1 << 20) + 4096)), &std::free);
  REQUIRE(back);
  int n = 0;
  for (std::uint64_t size : {std::uint64_t{1}, block - 1, block, block + 1, 3 * block + 7,
                             std::uint64_t{65536}, std::uint64_t{100'000}}) {
    for (std::size_t shift : {std::size_t{0}, std::size_t{1}}) {
      CAPTURE(size);
      CAPTURE(shift);
      const auto bytes = disk_pattern(size, unsigned(n));
      std::memcpy(mem.get() + shift, bytes.data(), size);
      const std::string key = disk_key("a", n++);
      REQUIRE_FALSE(d.put(key, {mem.get() + shift, size}));
      for (std::size_t read_shift : {std::size_t{0}, std::size_t{3}}) {
        std::memset(back.get(), 0xee, (1 << 20) + 4096);
        std::uint64_t got = 0;
        REQUIRE_FALSE(d.get(key, {back.get() + read_shift, size}, got));
        CHECK(got == size);
        CHECK(std::memcmp(back.get() + read_shift, bytes.data(), size) == 0);
        // Nothing written around the object.
        CHECK(back.get()[read_shift + size] == std::byte{0xee});
        if (read_shift > 0) CHECK(back.get()[read_shift - 1] == std::byte{0xee});
      }
    }
  }
}

TEST_CASE("disk tier: a file too small for one record of the longest key is refused") {
  disk_dir dir;
  CHECK_THROWS_WITH_AS(
      tier::disk_tier({.path = dir.path, .capacity = 1 << 20, .file_bytes = 16384}),
      doctest::Contains("at least"), std::invalid_argument);
}
