// The emulated device: a device runtime (memory/device.hpp) with no GPU, for
// tests and CI. It is a faithful stand-in for the one property that
// matters: device memory is reachable only through the copy engine.
//
// An allocation is a memfd mapped twice: PROT_NONE at the address the user
// gets (any CPU load or store there faults, any syscall given it fails with
// EFAULT, as a device pointer would), and read-write at a private address
// that only the copy engine uses. A stream is a thread of its own that
// runs copies in order and posts each completion on the stream's executor.
// Export is the memfd itself (an importer duplicates it with pidfd_getfd
// and maps it the same two ways). "Pinned" memory is ordinary page-aligned
// memory. It is selected explicitly (config.device = "emulated",
// KVLINK_DEVICE=emulated), never by "auto".
//
//   auto rt = kvlink::emulated_device::get();
//   kvlink::device_buffer buf{rt, 0, 1 << 20};   // *buf.data() would fault
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/memory/device.hpp>

#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include <asio/any_io_executor.hpp>
#include <asio/execution/outstanding_work.hpp>
#include <asio/post.hpp>
#include <asio/prefer.hpp>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace kvlink {

class emulated_device final : public device_runtime,
                              public std::enable_shared_from_this<emulated_device> {
 public:
  /// Devices it pretends to have.
  static constexpr int devices = 2;

  /// The process's emulated device (the catalog's "emulated").
  static std::shared_ptr<emulated_device> get() {
    static const auto instance = std::shared_ptr<emulated_device>(new emulated_device());
    return instance;
  }

  ~emulated_device() override {
    std::unique_lock lock{mutex_};
    for (auto& [base, a] : allocs_) unmap(base, a);
  }
  emulated_device(const emulated_device&) = delete;
  emulated_device& operator=(const emulated_device&) = delete;

  std::string_view name() const noexcept override { return "emulated"; }
  bool available() const noexcept override { return true; }
  std::string unavailable_reason() const override { return {}; }
  int device_count() const noexcept override { return devices; }

  pointer_info classify(const void* p) const noexcept override {
    pointer_info info;
    std::shared_lock lock{mutex_};
    if (const auto* a = find_locked(reinterpret_cast<std::uintptr_t>(p))) {
      info.memory = memory_desc{memory_kind::device, a->second.device};
      info.base = a->first;
      info.size = a->second.size;
    }
    return info;
  }

  void* allocate_pinned(std::size_t n, std::error_code& ec, std::string& what) override {
    void* p =
        ::mmap(nullptr, round_up(n), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      ec = std::error_code(errno, std::system_category());
      what = fmt::format("mmap({} bytes of staging): {}", n, ec.message());
      return nullptr;
    }
    std::unique_lock lock{mutex_};
    pinned_.emplace(reinterpret_cast<std::uintptr_t>(p), round_up(n));
    return p;
  }

  void free_pinned(void* p) noexcept override {
    std::unique_lock lock{mutex_};
    auto it = pinned_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == pinned_.end()) return;
    ::munmap(p, it->second);
    pinned_.erase(it);
  }

  void* allocate(std::int32_t device, std::size_t n, std::error_code& ec,
                 std::string& what) override {
    if (device < 0 || device >= devices || n == 0) {
      ec = errc::invalid_argument;
      what =
          fmt::format("emulated device allocation of {} bytes on device {} (it has devices 0..{})",
                      n, device, devices - 1);
      return nullptr;
    }
    const int fd = ::memfd_create("kvlink-emulated-device", MFD_CLOEXEC);
    if (fd < 0) return fail_errno(ec, what, "memfd_create");
    const auto size = round_up(n);
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      auto* r = fail_errno(ec, what, "ftruncate");
      ::close(fd);
      return r;
    }
    alloc a{size, fd, nullptr, device, false};
    void* user = nullptr;
    if (!map(fd, size, user, a.view, ec, what)) {
      ::close(fd);
      return nullptr;
    }
    std::unique_lock lock{mutex_};
    allocs_.emplace(reinterpret_cast<std::uintptr_t>(user), a);
    return user;
  }

  void free(void* p) noexcept override { release(p, false); }

  std::shared_ptr<device_stream> open_stream(std::int32_t device, asio::any_io_executor ex,
                                             std::error_code& ec, std::string& what) override {
    if (device < 0 || device >= devices) {
      ec = errc::invalid_argument;
      what = fmt::format("emulated device {} (it has devices 0..{})", device, devices - 1);
      return nullptr;
    }
    return std::make_shared<stream>(shared_from_this(), device, std::move(ex));
  }

  std::error_code export_memory(const void* p, exported_memory& out, std::string& what) override {
    std::shared_lock lock{mutex_};
    const auto* a = find_locked(reinterpret_cast<std::uintptr_t>(p));
    if (!a) {
      what = fmt::format("{} is not emulated device memory", p);
      return errc::not_registered;
    }
    out.method = "memfd";
    out.handle.clear();
    out.fd = a->second.fd;
    out.device = a->second.device;
    out.size = a->second.size;
    return {};
  }

  void* import_memory(const exported_memory& m, int fd, std::error_code& ec,
                      std::string& what) override {
    if (m.method != "memfd" || fd < 0 || m.device < 0 || m.device >= devices || m.size == 0) {
      if (fd >= 0) ::close(fd);
      ec = errc::invalid_argument;
      what = fmt::format(
          "cannot import '{}' memory of {} bytes on device {} into the emulated "
          "device (it imports memfd exports)",
          m.method, m.size, m.device);
      return nullptr;
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<std::uint64_t>(st.st_size) < m.size) {
      ::close(fd);
      ec = errc::invalid_argument;
      what = fmt::format("the imported memfd holds fewer than the {} bytes exported", m.size);
      return nullptr;
    }
    alloc a{round_up(m.size), fd, nullptr, m.device, true};
    void* user = nullptr;
    if (!map(fd, a.size, user, a.view, ec, what)) {
      ::close(fd);
      return nullptr;
    }
    std::unique_lock lock{mutex_};
    allocs_.emplace(reinterpret_cast<std::uintptr_t>(user), a);
    return user;
  }

  void close_imported(void* p) noexcept override { release(p, true); }

  int dmabuf_fd(const void* p, std::uint64_t n, std::uint64_t& offset, std::error_code& ec,
                std::string& what) override {
    (void)p;
    (void)n;
    offset = 0;
    ec = errc::invalid_argument;
    what = "the emulated device has no dma-buf export (RDMA moves its memory through staging)";
    return -1;
  }

  /// The copy engine's view of [p, p + n): the private read-write mapping
  /// for emulated device memory, `p` itself for host memory. null with
  /// out_of_bounds when the range runs past its allocation.
  std::byte* view(const void* p, std::uint64_t n, std::error_code& ec) const noexcept {
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    std::shared_lock lock{mutex_};
    const auto* a = find_locked(addr);
    if (!a) return static_cast<std::byte*>(const_cast<void*>(p));
    const auto off = addr - a->first;
    if (n > a->second.size - off) {
      ec = errc::out_of_bounds;
      return nullptr;
    }
    return static_cast<std::byte*>(a->second.view) + off;
  }

  /// Copies on one device: a thread of its own runs them in order.
  class stream final : public device_stream {
   public:
    stream(std::shared_ptr<emulated_device> rt, std::int32_t device, asio::any_io_executor ex)
        : rt_(std::move(rt)), device_(device), ex_(std::move(ex)) {
      worker_ = std::thread([this] { run(); });
    }
    ~stream() override {
      {
        std::lock_guard lock{mutex_};
        stop_ = true;
      }
      cv_.notify_all();
      worker_.join();  // a copy under way finishes first: nothing touches memory after this
    }
    stream(const stream&) = delete;
    stream& operator=(const stream&) = delete;

    std::int32_t device() const noexcept override { return device_; }

    bool copies(memory_kind from, memory_kind to) const noexcept override {
      (void)from;
      (void)to;
      return true;
    }

    void async_copy(void* dst, memory_desc dst_memory, const void* src, memory_desc src_memory,
                    std::size_t n, done_fn done) override {
      (void)dst_memory;
      (void)src_memory;
      {
        std::lock_guard lock{mutex_};
        if (!stop_) {
          // The executor counts the copy as outstanding work until its
          // completion ran: an io_context does not run out of work under it.
          jobs_.push_back(job{dst, src, n, std::move(done),
                              asio::prefer(ex_, asio::execution::outstanding_work.tracked)});
          cv_.notify_one();
          return;
        }
      }
      asio::post(ex_, [done = std::move(done)] { done(errc::cancelled); });
    }

   private:
    struct job {
      void* dst;
      const void* src;
      std::size_t n;
      done_fn done;
      asio::any_io_executor work;
    };

    void run() {
      std::unique_lock lock{mutex_};
      for (;;) {
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, nothing left
        auto j = std::move(jobs_.front());
        jobs_.pop_front();
        lock.unlock();
        std::error_code ec;
        auto* d = rt_->view(j.dst, j.n, ec);
        const auto* s = ec ? nullptr : rt_->view(j.src, j.n, ec);
        if (!ec && j.n > 0) std::memmove(d, s, j.n);
        asio::post(j.work, [done = std::move(j.done), ec] { done(ec); });
        lock.lock();
      }
    }

    std::shared_ptr<emulated_device> rt_;
    std::int32_t device_;
    asio::any_io_executor ex_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<job> jobs_;
    bool stop_ = false;
    std::thread worker_;  // last: started after everything it uses
  };

 private:
  struct alloc {
    std::uint64_t size;
    int fd;
    void* view;  // the copy engine's read-write mapping
    std::int32_t device;
    bool imported;
  };

  emulated_device() = default;

  static std::uint64_t round_up(std::uint64_t n) {
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    return (std::max<std::uint64_t>(n, 1) + page - 1) / page * page;
  }

  static void* fail_errno(std::error_code& ec, std::string& what, const char* call) {
    ec = std::error_code(errno, std::system_category());
    what = fmt::format("{} (emulated device): {}", call, ec.message());
    return nullptr;
  }

  static bool map(int fd, std::uint64_t size, void*& user, void*& view, std::error_code& ec,
                  std::string& what) {
    user = ::mmap(nullptr, size, PROT_NONE, MAP_SHARED, fd, 0);
    if (user == MAP_FAILED) {
      fail_errno(ec, what, "mmap(PROT_NONE)");
      return false;
    }
    view = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (view == MAP_FAILED) {
      fail_errno(ec, what, "mmap(view)");
      ::munmap(user, size);
      return false;
    }
    return true;
  }

  static void unmap(std::uintptr_t base, const alloc& a) noexcept {
    ::munmap(reinterpret_cast<void*>(base), a.size);
    ::munmap(a.view, a.size);
    ::close(a.fd);
  }

  void release(void* p, bool imported) noexcept {
    std::unique_lock lock{mutex_};
    auto it = allocs_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == allocs_.end() || it->second.imported != imported) return;
    unmap(it->first, it->second);
    allocs_.erase(it);
  }

  const std::pair<const std::uintptr_t, alloc>* find_locked(std::uintptr_t addr) const noexcept {
    auto it = allocs_.upper_bound(addr);
    if (it == allocs_.begin()) return nullptr;
    --it;
    if (addr - it->first >= it->second.size) return nullptr;
    return &*it;
  }

  mutable std::shared_mutex mutex_;
  std::map<std::uintptr_t, alloc> allocs_;
  std::map<std::uintptr_t, std::uint64_t> pinned_;
};

namespace detail {
inline const bool emulated_device_in_catalog = device_catalog::global().add(
    "emulated", [] { return std::shared_ptr<device_runtime>(emulated_device::get()); });
}  // namespace detail

}  // namespace kvlink
