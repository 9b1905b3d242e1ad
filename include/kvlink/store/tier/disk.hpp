// The SSD tier of a store client: objects kept in files of a local directory,
// within a byte budget, surviving the process.
//
//   kvlink::store::tier::disk_tier disk({.path = "/nvme/kvlink", .capacity = 100'000'000'000});
//   std::vector<std::string> evicted;            // keys the budget pushed out
//   std::error_code ec = disk.put("key", bytes, &evicted);
//   std::uint64_t size = 0;
//   ec = disk.get("key", buffer, size);          // checksum checked on every read
//
// Files are append-only logs of records (format: tier/disk_record.hpp), each
// of at most `file_bytes`; the tier keeps the files' total within
// `capacity` by deleting its oldest file when a new one is needed (first in,
// first out by file: the objects of that file are evicted and named to the
// caller). The directory is re-read when the tier is opened again, so a
// client that restarts finds what it had (a key's newest record wins; a
// removal is a record too, so a removed key stays removed). Writes go
// through O_DIRECT where the file system takes it (not through the page
// cache: a KV cache on disk would otherwise crowd out everything else), in
// blocks of the file system's direct-I/O alignment.
//
// What a crash leaves: each record is written with one pwrite; a record cut
// short or never written has bytes that do not match its checksum, and
// every read checks them, so it is never returned (the read fails with
// checksum_mismatch and the key is dropped). A scan after a restart trusts
// only record headers whose checksum holds (salted per file), and steps over
// anything else block by block.
//
// Nothing is fsynced: a put that returned is in the file (with O_DIRECT, on
// the device), so it survives its process being killed, not necessarily a
// power cut (the device's own cache) or, through the page cache, a crash of
// the machine; a cache tier trades that for not waiting on a flush per put.
//
// Errors (std::error_code): store_errc::invalid_key (empty or longer than
// disk_max_key), invalid_params (an object larger than a file can hold),
// object_not_found, object_in_progress (a put of that key is being
// written), buffer_overflow (`size` says what is needed), checksum_mismatch
// (a torn or damaged record), and the system's errno for I/O (ENOSPC: the
// disk is full, EROFS, EIO, ...). Set-up problems (a path that cannot be
// created, a directory another process has open, files of another format
// version) throw std::system_error with the path in the message.
//
// Thread safety: every member may be called from any thread at once; I/O
// runs on the caller's thread outside the tier's lock (the store client
// calls it from its own I/O threads, never from the engine's).
#pragma once

#include <kvlink/core/crc32c.hpp>
#include <kvlink/store/error.hpp>
#include <kvlink/store/tier/disk_record.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

namespace kvlink::store::tier {

/// How a tier is set up.
struct disk_options {
  /// The directory (created if missing). One process at a time: a second
  /// open of the same directory throws.
  std::string path;
  /// The most bytes the tier's files take on disk (required).
  std::uint64_t capacity = 0;
  /// The size of one file; 0: capacity / 8, clamped to [1 MiB, 1 GiB]. The
  /// largest object is a file less its header and a record's head
  /// (max_object_size()); capacity must hold two files.
  std::uint64_t file_bytes = 0;
  /// O_DIRECT where the file system takes it; false: through the page cache.
  bool direct_io = true;
};

/// Counters and sizes (a snapshot).
struct disk_stats {
  std::uint64_t objects = 0;       ///< readable objects
  std::uint64_t object_bytes = 0;  ///< their bytes
  std::uint64_t used_bytes = 0;    ///< bytes of files counted against capacity
  std::uint64_t capacity = 0;
  std::uint64_t files = 0;
  std::uint64_t block = 0;      ///< the alignment of new records
  std::uint64_t mem_align = 0;  ///< memory at multiples of this moves without a copy
  bool direct_io = false;       ///< whether new files are written with O_DIRECT
  std::uint64_t puts = 0, put_bytes = 0, gets = 0, get_bytes = 0, misses = 0;
  std::uint64_t evicted = 0;         ///< objects evicted with their file
  std::uint64_t damaged = 0;         ///< reads that found a record torn or damaged
  std::uint64_t write_errors = 0;    ///< puts and removals the disk refused
  std::uint64_t skipped_blocks = 0;  ///< blocks the last open stepped over (not a record)
};

class disk_tier {
 public:
  /// Opens (or creates) the tier in options.path and reads what its files
  /// hold. Throws std::system_error (with the path) when the directory
  /// cannot be created or locked, a file cannot be read, or a file has
  /// another format version; std::invalid_argument for bad options.
  explicit disk_tier(disk_options options) : opt_(std::move(options)) {
    if (opt_.path.empty()) throw std::invalid_argument("disk tier: no path given");
    if (opt_.capacity == 0) throw std::invalid_argument("disk tier: capacity must be > 0");
    if (opt_.file_bytes == 0) {
      opt_.file_bytes = std::clamp<std::uint64_t>(opt_.capacity / 8, 1u << 20, 1u << 30);
    }
    std::error_code ec;
    std::filesystem::create_directories(opt_.path, ec);
    if (ec) throw std::system_error(ec, "disk tier: cannot create " + opt_.path);
    const std::string lock = opt_.path + "/kvlink-disk.lock";
    lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    // A read-only file system: the tier opens for reading (its puts fail
    // with EROFS), locked if an earlier life left the lock file.
    if (lock_fd_ < 0 && errno == EROFS) lock_fd_ = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
    if (lock_fd_ < 0 && errno != ENOENT) throw sys_error("cannot open " + lock);
    if (lock_fd_ >= 0 && ::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      ::close(lock_fd_);
      throw std::system_error(e, std::system_category(),
                              "disk tier: " + opt_.path + " is in use by another process");
    }
    choose_block();
    // A file holds its header block and at least one record of the longest
    // key and a block of bytes.
    const std::uint64_t least = 2 * block_ + record_body_offset(disk_max_key, block_);
    if (opt_.file_bytes < least || opt_.file_bytes % block_ != 0 ||
        opt_.capacity / 2 < opt_.file_bytes) {
      if (lock_fd_ >= 0) ::close(lock_fd_);
      throw std::invalid_argument("disk tier: file_bytes (" + std::to_string(opt_.file_bytes) +
                                  ") must be a multiple of the block (" + std::to_string(block_) +
                                  "), at least " + std::to_string(least) +
                                  ", and at most half the capacity (" +
                                  std::to_string(opt_.capacity) + ")");
    }
    // Stripes: as many as leave room for one sealed file (at most 4).
    open_.resize(static_cast<std::size_t>(
        std::clamp<std::uint64_t>(opt_.capacity / opt_.file_bytes - 1, 1, 4)));
    std::random_device rd;
    salt_rng_.seed((static_cast<std::uint64_t>(rd()) << 32) ^ rd());
    try {
      load();
    } catch (...) {
      if (lock_fd_ >= 0) ::close(lock_fd_);
      throw;
    }
  }

  ~disk_tier() {
    files_.clear();
    open_.clear();
    if (lock_fd_ >= 0) ::close(lock_fd_);
  }
  disk_tier(const disk_tier&) = delete;
  disk_tier& operator=(const disk_tier&) = delete;

  /// The largest object a put takes.
  std::uint64_t max_object_size() const noexcept {
    return opt_.file_bytes - block_ - record_body_offset(disk_max_key, block_);
  }

  /// Writes `bytes` under `key`. A key already held with the same bytes
  /// (size and checksum) is left as it is; other bytes replace it. Keys the
  /// budget evicted to make room are appended to `evicted` (when given).
  /// Bytes at an address aligned to the file system's direct-I/O memory
  /// alignment (stats().mem_align; page-aligned memory always is) go from
  /// there to the disk without a copy.
  std::error_code put(std::string_view key, std::span<const std::byte> bytes,
                      std::vector<std::string>* evicted = nullptr) {
    if (key.empty() || key.size() > disk_max_key) return store_errc::invalid_key;
    if (bytes.size() > max_object_size()) return store_errc::invalid_params;
    const std::uint32_t crc = kvlink::crc32c(bytes.data(), bytes.size());
    const std::uint64_t rec_bytes = disk_record_bytes(bytes.size(), key.size(), block_);
    place where;
    {
      std::lock_guard lk(mu_);
      auto it = index_.find(key);
      if (it != index_.end()) {
        if (!it->second.ready) return store_errc::object_in_progress;
        if (it->second.size == bytes.size() && it->second.body_crc == crc) return {};
      }
      if (std::error_code ec = allocate(rec_bytes, where, evicted)) return count_write_error(ec);
      const entry pending{where.file, where.offset, bytes.size(), where.sequence, crc, false};
      it = index_.find(key);  // allocate may have evicted it
      if (it == index_.end()) {
        index_.emplace(std::string(key), pending);
      } else {
        set_entry(it->second, pending);  // other bytes replace the old ones
      }
      where.file->keys.emplace_back(key);
      ++stats_.puts;
    }
    const std::error_code ec = move_record(
        *where.file, where.offset, key, bytes.size(), true,
        const_cast<std::byte*>(bytes.data()),  // written from, not to
        [&](std::span<std::byte> head) {
          encode_record_header(
              where.file->salt,
              disk_record{disk_record_kind::object, key, bytes.size(), where.sequence, crc}, head);
        });
    std::lock_guard lk(mu_);
    auto it = index_.find(key);
    const bool ours =
        it != index_.end() && it->second.file == where.file && it->second.offset == where.offset;
    if (ec) {
      if (ours) forget(it);
      return count_write_error(ec);
    }
    if (ours) {
      set_entry(it->second,
                entry{where.file, where.offset, bytes.size(), where.sequence, crc, true});
      stats_.put_bytes += bytes.size();
    } else if (evicted != nullptr) {
      evicted->emplace_back(key);  // its file was dropped while it was written
    }
    return {};
  }

  /// Reads the object under `key` into `out`; `size` is set to its size
  /// (also when `out` is too small: buffer_overflow). On any error the
  /// contents of `out` are unspecified. Like put, aligned memory is read
  /// into without a copy.
  std::error_code get(std::string_view key, std::span<std::byte> out, std::uint64_t& size) {
    entry e;
    {
      std::lock_guard lk(mu_);
      ++stats_.gets;
      auto it = index_.find(key);
      if (it == index_.end()) {
        ++stats_.misses;
        return store_errc::object_not_found;
      }
      if (!it->second.ready) return store_errc::object_in_progress;
      e = it->second;
    }
    size = e.size;
    if (out.size() < e.size) return store_errc::buffer_overflow;
    disk_record rec;
    bool header_ok = false;
    std::error_code ec = move_record(*e.file, e.offset, key, e.size, false, out.data(),
                                     [&](std::span<std::byte> head) {
                                       header_ok = decode_record_header(e.file->salt, head, rec);
                                     });
    if (ec && ec != store_errc::checksum_mismatch) return ec;
    const bool intact = !ec && header_ok && rec.kind == disk_record_kind::object &&
                        rec.key == key && rec.size == e.size && rec.sequence == e.sequence &&
                        rec.body_crc == e.body_crc &&
                        kvlink::crc32c(out.data(), e.size) == e.body_crc;
    std::lock_guard lk(mu_);
    if (!intact) {
      ++stats_.damaged;
      auto it = index_.find(key);
      if (it != index_.end() && it->second.file == e.file && it->second.offset == e.offset) {
        forget(it);
      }
      return store_errc::checksum_mismatch;
    }
    stats_.get_bytes += e.size;
    return {};
  }

  /// The size of the object under `key`, if the tier holds it readable.
  std::optional<std::uint64_t> size_of(std::string_view key) const {
    std::lock_guard lk(mu_);
    auto it = index_.find(key);
    if (it == index_.end() || !it->second.ready) return std::nullopt;
    return it->second.size;
  }
  bool contains(std::string_view key) const { return size_of(key).has_value(); }

  /// Removes `key`: gone from the tier at once; a removal record makes it
  /// stay gone after a restart. An I/O error means the removal was not
  /// recorded (a restart may bring the key back).
  std::error_code remove(std::string_view key, std::vector<std::string>* evicted = nullptr) {
    place where;
    const std::uint64_t rec_bytes = disk_record_bytes(0, key.size(), block_);
    {
      std::lock_guard lk(mu_);
      auto it = index_.find(key);
      if (it == index_.end()) return store_errc::object_not_found;
      if (!it->second.ready) return store_errc::object_in_progress;
      forget(it);
      if (std::error_code ec = allocate(rec_bytes, where, evicted)) return count_write_error(ec);
    }
    const std::error_code ec = move_record(
        *where.file, where.offset, key, 0, true, nullptr, [&](std::span<std::byte> head) {
          encode_record_header(where.file->salt,
                               disk_record{disk_record_kind::removal, key, 0, where.sequence, 0},
                               head);
        });
    if (ec) {
      std::lock_guard lk(mu_);
      return count_write_error(ec);
    }
    return {};
  }

  /// Calls f(key, size) for every readable object (under the tier's lock:
  /// f must not call the tier).
  template <class F>
  void for_each(F&& f) const {
    std::lock_guard lk(mu_);
    for (const auto& [k, e] : index_) {
      if (e.ready) f(std::string_view(k), e.size);
    }
  }

  disk_stats stats() const {
    std::lock_guard lk(mu_);
    disk_stats s = stats_;
    s.objects = ready_objects_;
    s.object_bytes = ready_bytes_;
    s.used_bytes = used_locked();
    s.capacity = opt_.capacity;
    s.files = files_.size() + open_count_;
    s.block = block_;
    s.mem_align = direct_ ? mem_align_ : 1;
    s.direct_io = direct_;
    return s;
  }

  const disk_options& options() const noexcept { return opt_; }

 private:
  struct tier_file {
    int fd = -1;
    std::uint64_t number = 0, salt = 0, block = 0;
    std::uint64_t end = 0;  ///< the append point (current file) or the file's size
    bool direct = false;    ///< opened with O_DIRECT
    std::string path;
    std::vector<std::string> keys;  ///< keys of the object records appended
    tier_file() = default;
    tier_file(const tier_file&) = delete;
    tier_file& operator=(const tier_file&) = delete;
    ~tier_file() {
      if (fd >= 0) ::close(fd);
    }
  };
  struct entry {
    std::shared_ptr<tier_file> file;
    std::uint64_t offset = 0, size = 0, sequence = 0;
    std::uint32_t body_crc = 0;
    bool ready = false;  ///< false while its put is being written
  };
  struct place {
    std::shared_ptr<tier_file> file;
    std::uint64_t offset = 0, sequence = 0;
  };
  // Transparent hashing: find() with a string_view.
  struct key_hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept {
      return std::hash<std::string_view>{}(s);
    }
  };
  /// An aligned buffer of this thread's, for record heads and tails (and
  /// whole objects whose memory is not aligned): reused, so a put or a get
  /// touches no fresh pages. Requests above 64 MiB get a buffer of their own.
  class scratch {
   public:
    explicit scratch(std::uint64_t n) {
      static thread_local held mine;
      const std::uint64_t cap = disk_round(n == 0 ? 1 : n, 1u << 16);
      if (cap > (64u << 20)) {
        own_.reset(alloc(cap));
        p_ = own_.get();
        return;
      }
      if (mine.cap < cap) {
        mine.p.reset(alloc(cap));
        mine.cap = cap;
      }
      p_ = mine.p.get();
    }
    std::byte* data() const noexcept { return p_; }

   private:
    struct release {
      void operator()(std::byte* p) const noexcept { std::free(p); }
    };
    using owned = std::unique_ptr<std::byte, release>;
    struct held {
      owned p;
      std::uint64_t cap = 0;
    };
    static std::byte* alloc(std::uint64_t n) {
      auto* p = static_cast<std::byte*>(std::aligned_alloc(4096, n));
      if (p == nullptr) throw std::bad_alloc();
      return p;
    }
    owned own_;
    std::byte* p_ = nullptr;
  };

  static std::system_error sys_error(const std::string& what) {
    return std::system_error(errno, std::system_category(), "disk tier: " + what);
  }

  std::error_code count_write_error(std::error_code ec) {
    ++stats_.write_errors;
    return ec;
  }

  // Direct I/O where the file system takes it, in blocks of its alignment.
  void choose_block() {
    direct_ = false;
    block_ = disk_min_block;
    mem_align_ = 4096;
    if (!opt_.direct_io) return;
    const std::string probe = opt_.path + "/kvlink-disk.probe";
    const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
    if (fd < 0) {
      ::unlink(probe.c_str());
      return;  // EINVAL: no O_DIRECT here (tmpfs before Linux 6.6, some FUSE)
    }
    // Records start at multiples of the file system's block (at least
    // O_DIRECT's alignment): a record that shares a device sector with the
    // one before it costs the device a read-modify-write (measured here:
    // 1 MiB puts at 0.46-0.50 of the disk's rate with 512-byte alignment on
    // 4 KiB sectors, 0.59-0.77 with 4 KiB).
    std::uint64_t align = 4096;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_blksize > 0)
      align = static_cast<std::uint64_t>(st.st_blksize);
#ifdef STATX_DIOALIGN
    struct statx sx {};
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) != 0 && sx.stx_dio_offset_align != 0) {
      align = std::max<std::uint64_t>(align, sx.stx_dio_offset_align);
      if (sx.stx_dio_mem_align != 0) mem_align_ = sx.stx_dio_mem_align;
    }
#endif
    align = std::clamp<std::uint64_t>(align, disk_min_block, 64u << 10);
    ::close(fd);
    ::unlink(probe.c_str());
    if (!disk_block_valid(align)) return;
    direct_ = true;
    block_ = align;
  }

  // pwritev/preadv of all of `iov` at `off`, however the kernel splits it.
  static std::error_code io_all(int fd, std::vector<iovec>& iov, std::uint64_t off, bool write) {
    std::size_t first = 0;
    while (first < iov.size()) {
      const int n = static_cast<int>(std::min<std::size_t>(iov.size() - first, IOV_MAX));
      const ssize_t r = write ? ::pwritev(fd, iov.data() + first, n, static_cast<off_t>(off))
                              : ::preadv(fd, iov.data() + first, n, static_cast<off_t>(off));
      if (r < 0) {
        if (errno == EINTR) continue;
        return {errno, std::system_category()};
      }
      // A short read is the end of the file: a record cut short.
      if (r == 0)
        return write ? std::make_error_code(std::errc::io_error)
                     : std::error_code(store_errc::checksum_mismatch);
      off += static_cast<std::uint64_t>(r);
      auto left = static_cast<std::size_t>(r);
      while (left > 0 && left >= iov[first].iov_len) left -= iov[first++].iov_len;
      if (left > 0) {
        iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
      }
    }
    return {};
  }

  // Moves one record between the file and memory: its head block(s) through
  // a scratch buffer (`head` fills it before a write, reads it after a
  // read), the object's `size` bytes straight from/to `body` where the
  // file's direct-I/O alignment allows, the rest (an unaligned address, the
  // last partial block) through the scratch buffer.
  template <class Head>
  std::error_code move_record(tier_file& f, std::uint64_t offset, std::string_view key,
                              std::uint64_t size, bool write, std::byte* body, Head&& head) {
    const std::uint64_t block = f.block;
    const std::uint64_t head_bytes = record_body_offset(key.size(), block);
    // O_DIRECT moves whole blocks from aligned memory: the object's whole
    // blocks go straight when `body` is aligned, the rest (all of it when it
    // is not) through the scratch buffer, rounded up to a block. Through
    // the page cache everything goes straight; a write adds the zeros to
    // the record's end (a scan takes a file that ends early for a torn
    // record).
    std::uint64_t straight = size, tail_bytes = 0;
    if (f.direct) {
      const bool aligned = reinterpret_cast<std::uintptr_t>(body) % mem_align_ == 0;
      straight = aligned ? size / block * block : 0;
      tail_bytes = disk_round(size - straight, block);
    } else if (write) {
      tail_bytes = disk_round(size, block) - size;
    }
    const std::uint64_t rest = f.direct ? size - straight : 0;
    scratch buf(head_bytes + tail_bytes);
    std::byte* h = buf.data();
    std::byte* tail = h + head_bytes;
    std::vector<iovec> iov;
    iov.reserve(3);
    iov.push_back({h, head_bytes});
    if (straight > 0) iov.push_back({body, straight});
    if (tail_bytes > 0) iov.push_back({tail, tail_bytes});
    if (write) {
      head(std::span<std::byte>(h, head_bytes));
      if (rest > 0) std::memcpy(tail, body + straight, rest);
      std::memset(tail + rest, 0, tail_bytes - rest);
      return io_all(f.fd, iov, offset, true);
    }
    if (std::error_code ec = io_all(f.fd, iov, offset, false)) return ec;
    head(std::span<std::byte>(h, head_bytes));
    if (rest > 0) std::memcpy(body + straight, tail, rest);
    return {};
  }

  static std::error_code write_all(tier_file& f, const std::byte* p, std::uint64_t n,
                                   std::uint64_t off) {
    std::vector<iovec> iov{{const_cast<std::byte*>(p), n}};
    return io_all(f.fd, iov, off, true);
  }

  // Reads n bytes; a file shorter than that is a damaged record.
  static std::error_code read_all(tier_file& f, std::byte* p, std::uint64_t n, std::uint64_t off) {
    std::vector<iovec> iov{{p, n}};
    return io_all(f.fd, iov, off, false);
  }

  // Every change of an index entry goes through these two, which keep the
  // readable objects' count and bytes (stats() reads them, not the index).
  void set_entry(entry& slot, const entry& e) noexcept {
    if (slot.ready) {
      --ready_objects_;
      ready_bytes_ -= slot.size;
    }
    slot = e;
    if (slot.ready) {
      ++ready_objects_;
      ready_bytes_ += slot.size;
    }
  }
  template <class It>
  void forget(It it) {
    set_entry(it->second, entry{});
    index_.erase(it);
  }

  // Bytes counted against capacity: sealed files at their size, the file
  // being written at its whole size (it is preallocated).
  std::uint64_t used_locked() const noexcept {
    return sealed_bytes_ + open_count_ * opt_.file_bytes;
  }

  static std::string file_name(std::uint64_t number) {
    char name[40];
    std::snprintf(name, sizeof name, "kvlink-%016llx.kvd", static_cast<unsigned long long>(number));
    return name;
  }

  // Deletes the oldest sealed file; its objects leave the index.
  void drop_oldest(std::vector<std::string>* evicted) {
    std::shared_ptr<tier_file> f = std::move(files_.front());
    files_.pop_front();
    sealed_bytes_ -= f->end;
    for (const std::string& k : f->keys) {
      auto it = index_.find(std::string_view(k));
      if (it == index_.end() || it->second.file.get() != f.get()) continue;
      forget(it);
      ++stats_.evicted;
      if (evicted != nullptr) evicted->push_back(k);
    }
    f->keys.clear();
    ::unlink(f->path.c_str());  // readers holding it keep reading the open file
  }

  // Finds `n` bytes at the end of the calling thread's file (starting a new
  // one, and dropping old ones, as needed); holds mu_. Threads append to
  // up to four files at once (stripes): appends to one file serialise on
  // its inode in the file system (measured here: two threads putting 64 KiB
  // objects into one file at 0.69 of the disk's rate, one at 0.81). When
  // a new file cannot be started (a full disk), another stripe's file with
  // room takes the record.
  std::error_code allocate(std::uint64_t n, place& out, std::vector<std::string>* evicted) {
    const std::size_t stripe = thread_number() % open_.size();
    std::shared_ptr<tier_file>& cur = open_[stripe];
    if (!cur || cur->end + n > opt_.file_bytes) {
      if (cur) {
        sealed_bytes_ += cur->end;
        files_.push_back(std::move(cur));
        cur.reset();
        --open_count_;
      }
      while (!files_.empty() &&
             sealed_bytes_ + (open_count_ + 1) * opt_.file_bytes > opt_.capacity) {
        drop_oldest(evicted);
      }
      if (std::error_code ec = start_file(cur)) {
        // No new file (the disk is full, say): another open file with room
        // takes the record.
        for (auto& other : open_) {
          if (other && other->end + n <= opt_.file_bytes) return place_in(other, n, out);
        }
        return ec;
      }
      ++open_count_;
    }
    return place_in(cur, n, out);
  }
  std::error_code place_in(const std::shared_ptr<tier_file>& f, std::uint64_t n, place& out) {
    out.file = f;
    out.offset = f->end;
    out.sequence = next_sequence_++;
    f->end += n;
    return {};
  }

  // This thread's number: threads get 0, 1, 2, ... as they first put.
  static std::size_t thread_number() {
    static std::atomic<std::size_t> next{0};
    static thread_local const std::size_t mine = next.fetch_add(1, std::memory_order_relaxed);
    return mine;
  }

  std::error_code start_file(std::shared_ptr<tier_file>& into) {
    auto f = std::make_shared<tier_file>();
    f->number = next_file_++;
    f->salt = salt_rng_();
    f->block = block_;
    f->path = opt_.path + "/" + file_name(f->number);
    const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | (direct_ ? O_DIRECT : 0);
    f->fd = ::open(f->path.c_str(), flags, 0644);
    if (f->fd < 0) return {errno, std::system_category()};
    f->direct = direct_;
    // Reserve the whole file now, so a full disk shows here and not halfway
    // through a record; file systems without fallocate simply go on.
    if (::fallocate(f->fd, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(opt_.file_bytes)) != 0 &&
        errno != EOPNOTSUPP && errno != ENOSYS) {
      const std::error_code ec(errno, std::system_category());
      ::unlink(f->path.c_str());
      return ec;
    }
    scratch head(block_);
    std::memset(head.data(), 0, block_);
    encode_file_header(disk_file_header{disk_format_version, block_, f->number, f->salt},
                       std::span<std::byte>(head.data(), block_));
    if (std::error_code ec = write_all(*f, head.data(), block_, 0)) {
      ::unlink(f->path.c_str());
      return ec;
    }
    f->end = block_;
    into = std::move(f);
    return {};
  }

  // Reads the directory: every tier file, oldest first; a key's newest
  // record decides.
  void load() {
    std::vector<std::pair<std::uint64_t, std::string>> names;
    for (const auto& de : std::filesystem::directory_iterator(opt_.path)) {
      const std::string name = de.path().filename().string();
      unsigned long long number = 0;
      char tail[8] = {};
      if (name.size() != 27 || std::sscanf(name.c_str(), "kvlink-%16llx.%3s", &number, tail) != 2 ||
          std::string_view(tail) != "kvd") {
        continue;
      }
      names.emplace_back(number, de.path().string());
    }
    std::sort(names.begin(), names.end());
    // New files are numbered after every file seen (also those deleted
    // below as torn), so the order of numbers stays the order of writing.
    if (!names.empty()) next_file_ = names.back().first + 1;
    std::unordered_map<std::string, std::uint64_t, key_hash, std::equal_to<>> removed;
    for (const auto& [number, path] : names) scan_file(number, path, removed);
    for (const auto& [k, seq] : removed) {
      auto it = index_.find(std::string_view(k));
      if (it != index_.end() && it->second.sequence < seq) forget(it);
    }
    while (!files_.empty() && sealed_bytes_ + opt_.file_bytes > opt_.capacity) {
      drop_oldest(nullptr);  // the capacity was made smaller since
    }
  }

  void scan_file(
      std::uint64_t number, const std::string& path,
      std::unordered_map<std::string, std::uint64_t, key_hash, std::equal_to<>>& removed) {
    // Buffered reads for the scan: any block size reads, however the
    // directory is opened now.
    auto f = std::make_shared<tier_file>();
    f->path = path;
    f->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) throw sys_error("cannot open " + path);
    struct stat st {};
    if (::fstat(f->fd, &st) != 0) throw sys_error("cannot stat " + path);
    const std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
    std::byte head[disk_file_header_size] = {};
    disk_file_header h;
    const bool whole =
        size >= disk_file_header_size && !read_all(*f, head, disk_file_header_size, 0);
    const file_header_status hs =
        whole ? decode_file_header(std::span<const std::byte>(head, disk_file_header_size), h)
              : file_header_status::corrupt;
    if (hs == file_header_status::other_version) {
      throw std::system_error(std::make_error_code(std::errc::invalid_argument),
                              "disk tier: " + path + " is of format version " +
                                  std::to_string(h.version) + "; this kvlink reads version " +
                                  std::to_string(disk_format_version) +
                                  ": move the directory away or give another path");
    }
    if (hs != file_header_status::ok || h.number != number) {
      // Torn at its creation (or not ours under our name): nothing in it
      // can be trusted.
      ::unlink(path.c_str());
      return;
    }
    f->number = number;
    f->salt = h.salt;
    f->block = h.block;
    f->end = size;
    // Records in windows of 1 MiB: one read per window, not per record.
    const std::uint64_t window = std::max<std::uint64_t>(1u << 20, 2 * h.block);
    std::vector<std::byte> buf(window);
    std::uint64_t buf_at = 0, buf_len = 0;
    std::uint64_t at = h.block;
    while (at + h.block <= size) {
      const std::uint64_t want = std::min<std::uint64_t>(
          size - at, disk_round(disk_record_header_size + disk_max_key, h.block));
      if (at < buf_at || at + want > buf_at + buf_len) {
        buf_at = at;
        buf_len = std::min<std::uint64_t>(window, size - at);
        if (read_all(*f, buf.data(), buf_len, at)) throw sys_error("cannot read " + path);
      }
      disk_record rec;
      const std::span<const std::byte> here(buf.data() + (at - buf_at), buf_len - (at - buf_at));
      const std::uint64_t n = decode_record_header(h.salt, here, rec)
                                  ? disk_record_bytes(rec.size, rec.key.size(), h.block)
                                  : 0;
      if (n == 0 || n > size - at) {
        ++stats_.skipped_blocks;
        at += h.block;
        continue;
      }
      next_sequence_ = std::max(next_sequence_, rec.sequence + 1);
      if (rec.kind == disk_record_kind::removal) {
        auto [it, fresh] = removed.try_emplace(std::string(rec.key), rec.sequence);
        if (!fresh) it->second = std::max(it->second, rec.sequence);
      } else {
        auto it = index_.find(rec.key);
        if (it == index_.end() || it->second.sequence < rec.sequence) {
          const entry found{f, at, rec.size, rec.sequence, rec.body_crc, true};
          if (it == index_.end()) it = index_.emplace(std::string(rec.key), entry{}).first;
          set_entry(it->second, found);
          f->keys.emplace_back(rec.key);
        }
      }
      at += n;
    }
    // Reads from now on may be direct where the block allows it.
    if (direct_ && f->block % block_ == 0) {
      const int dfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      if (dfd >= 0) {
        ::close(f->fd);
        f->fd = dfd;
        f->direct = true;
      }
    }
    sealed_bytes_ += size;
    files_.push_back(std::move(f));
  }

  disk_options opt_;
  int lock_fd_ = -1;
  bool direct_ = false;
  std::uint64_t block_ = disk_min_block;
  std::uint64_t mem_align_ = 4096;  ///< O_DIRECT's memory alignment
  std::mt19937_64 salt_rng_;

  mutable std::mutex mu_;
  std::unordered_map<std::string, entry, key_hash, std::equal_to<>> index_;
  std::deque<std::shared_ptr<tier_file>> files_;  ///< sealed files, oldest first
  std::vector<std::shared_ptr<tier_file>> open_;  ///< the files appended to, one per stripe
  std::uint64_t open_count_ = 0;                  ///< of them started
  std::uint64_t sealed_bytes_ = 0;
  std::uint64_t next_file_ = 1;
  std::uint64_t next_sequence_ = 1;
  std::uint64_t ready_objects_ = 0, ready_bytes_ = 0;  ///< readable entries of index_
  disk_stats stats_;
};

}  // namespace kvlink::store::tier
