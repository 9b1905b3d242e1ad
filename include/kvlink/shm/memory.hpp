// Host memory that peers on this host can map: a sealed memfd, mapped
// shared. Register it like any memory; a same-host peer then copies into
// and out of it with plain memcpy through its own mapping (one copy at
// memcpy speed) instead of cross-memory attach, which pins every page it
// touches and runs at about 0.7 of a memcpy (README: "Same-host transfers").
//
//   auto mem = kvlink::shm::shared_memory::allocate(1 << 30);   // throws std::system_error
//   eng.register_segment(mem.data(), mem.size(), kvlink::access::remote_read_write);
//
// Pre-faulting: a fresh memfd has no pages; the first write into each page
// allocates and zeroes it, so the first transfer into fresh memory ran at
// 0.5-1 GB/s here against 8-12 GB/s afterwards. allocate() therefore
// allocates every page up front (MADV_POPULATE_WRITE) when the allocation is
// at most `prefault_limit` (1 GiB; about 1-1.4 s per GiB on this project's
// 2-core machine, the cost the first writes would otherwise pay) or when asked
// to (prefault::yes); prefault::no leaves the pages to their first use. The
// peer fills its own page tables when it maps the segment (shm_prefault).
//
// The peer gets the file descriptor with pidfd_getfd(2), which the kernel
// allows exactly where it allows cross-memory attach (the ptrace rule), and
// checks what it got (the same file, sealed against shrinking, large
// enough) before it maps it: a target cannot make its peer fault by
// truncating the file.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace kvlink::shm {

/// Where a shared allocation lives, for a peer to find it.
struct shared_region {
  int fd = -1;
  std::uintptr_t base = 0;
  std::uint64_t size = 0;
  std::uint64_t dev = 0;
  std::uint64_t ino = 0;
};

namespace memory_detail {
struct shared_table {
  std::mutex mutex;
  std::map<std::uintptr_t, shared_region> by_base;
};
// Never destroyed: a shared_memory with static storage (a program's
// global, a function's static) may be released after every static below it
// is gone, and it erases its entry here. A table destroyed at exit made
// that release a double free (found by kvlink-bench's static reference
// buffer, 2026-12-07).
inline shared_table& table() {
  static shared_table* const t = new shared_table;
  return *t;
}
}  // namespace memory_detail

/// The shared allocation holding [p, p + length), if one does.
inline std::optional<shared_region> find_shared(std::uintptr_t p, std::uint64_t length) {
  auto& t = memory_detail::table();
  std::lock_guard lock{t.mutex};
  auto it = t.by_base.upper_bound(p);
  if (it == t.by_base.begin()) return std::nullopt;
  --it;
  const auto& r = it->second;
  if (p - r.base > r.size || length > r.size - (p - r.base)) return std::nullopt;
  return r;
}

/// Whether shared_memory::allocate allocates its pages up front.
enum class prefault {
  automatic,  ///< when the allocation is at most shared_memory::prefault_limit
  yes,
  no,
};

class shared_memory {
 public:
  /// prefault::automatic pre-faults allocations up to this size.
  static constexpr std::size_t prefault_limit = std::size_t{1} << 30;

  shared_memory() = default;
  shared_memory(shared_memory&& o) noexcept { *this = std::move(o); }
  shared_memory& operator=(shared_memory&& o) noexcept {
    if (this != &o) {
      release();
      region_ = std::exchange(o.region_, shared_region{});
    }
    return *this;
  }
  shared_memory(const shared_memory&) = delete;
  shared_memory& operator=(const shared_memory&) = delete;
  ~shared_memory() { release(); }

  /// `bytes` (rounded up to whole pages) of zeroed shared memory, its pages
  /// allocated now or at first use (see prefault).
  static shared_memory allocate(std::size_t bytes, prefault pf = prefault::automatic) {
    shared_memory m;
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t size = (bytes + page - 1) / page * page;
    const int fd = ::memfd_create("kvlink-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) throw std::system_error(errno, std::system_category(), "memfd_create");
    auto fail = [fd](const char* what) {
      const int err = errno;
      ::close(fd);
      throw std::system_error(err, std::system_category(), what);
    };
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) fail("ftruncate");
    if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      fail("fcntl(F_ADD_SEALS)");
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail("fstat");
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) fail("mmap");
    if (pf == prefault::yes || (pf == prefault::automatic && size <= prefault_limit)) {
      populate(p, size, [&](const char* what) {
        const int err = errno;
        ::munmap(p, size);
        errno = err;
        fail(what);
      });
    }
    m.region_ = {fd, reinterpret_cast<std::uintptr_t>(p), size,
                 static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
    auto& t = memory_detail::table();
    std::lock_guard lock{t.mutex};
    t.by_base[m.region_.base] = m.region_;
    return m;
  }

  std::byte* data() const noexcept { return reinterpret_cast<std::byte*>(region_.base); }
  std::size_t size() const noexcept { return region_.size; }
  const shared_region& region() const noexcept { return region_; }

 private:
  void release() noexcept {
    if (region_.base == 0) return;
    {
      auto& t = memory_detail::table();
      std::lock_guard lock{t.mutex};
      t.by_base.erase(region_.base);
    }
    ::munmap(reinterpret_cast<void*>(region_.base), region_.size);
    ::close(region_.fd);
    region_ = {};
  }

  // Allocates every page of [p, p + size): MADV_POPULATE_WRITE (Linux 5.14),
  // or a write to each page where the kernel does not know it. Not enough
  // memory is an error here rather than a SIGBUS at first use.
  template <class Fail>
  static void populate(void* p, std::size_t size, Fail&& fail) {
#ifndef MADV_POPULATE_WRITE
    constexpr int MADV_POPULATE_WRITE = 23;
#endif
    if (::madvise(p, size, MADV_POPULATE_WRITE) == 0) return;
    if (errno != EINVAL) fail("madvise(MADV_POPULATE_WRITE)");
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    auto* bytes = static_cast<volatile unsigned char*>(p);
    for (std::size_t off = 0; off < size; off += page) bytes[off] = 0;
  }

  shared_region region_;
};

/// A peer's shared allocation, mapped here; unmapped when the last holder
/// (a lease, a copy in flight) lets go.
class peer_mapping {
 public:
  peer_mapping(void* addr, std::size_t length, std::uint64_t delta)
      : addr_(addr), length_(length), delta_(delta) {}
  peer_mapping(const peer_mapping&) = delete;
  peer_mapping& operator=(const peer_mapping&) = delete;
  ~peer_mapping() { ::munmap(addr_, length_); }

  /// Where the segment's byte 0 is in our address space.
  std::byte* segment() const noexcept { return static_cast<std::byte*>(addr_) + delta_; }

 private:
  void* addr_;
  std::size_t length_;
  std::uint64_t delta_;
};

}  // namespace kvlink::shm
