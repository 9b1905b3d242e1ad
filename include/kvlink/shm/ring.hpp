// The same-host transport's ring: small pieces between private memory,
// copied twice (into a shared ring by one process, out of it by the other)
// instead of once by the kernel. Cross-memory attach pins every remote page
// of every piece: 4 KiB pieces scattered over private memory ran at a third
// of a memcpy (README: "Same-host transfers"), while the two copies of the
// ring run on two cores at once, each a plain memcpy.
//
// The target makes the ring (a sealed memfd) and two eventfds when a path
// asks for one, and gives their descriptors' numbers; the initiator takes
// them with pidfd_getfd (allowed exactly where cross-memory attach is) and
// checks them as it checks a shared segment. Then:
//   - the initiator fills a slot (up to max_pieces descriptors and
//     slot_data bytes: a WRITE's bytes, room for a READ's), publishes it by
//     advancing `posted`, and rings the target's doorbell unless the target
//     says it is awake;
//   - the target copies each piece of each published slot between the slot
//     and its registered memory, checked against the leases that session
//     holds (bounds, access; pinned while it copies), writes each piece's
//     result, advances `done`, and rings the initiator's doorbell if it
//     said it waits;
//   - the initiator reports the slot's pieces (a READ's bytes copied out
//     first) and reuses the slot.
// Both sides read what the other wrote once, into locals, and check it: a
// descriptor, a counter, a result that makes no sense stops the ring (the
// target's side) or fails the path (the initiator's), never a copy outside
// a slot or a lease.
//
// The flags and counters are a Dekker pair on each side (a store, then a
// load of the other's word, both sequentially consistent): a doorbell may
// be rung for nothing, never missed.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/transport/transport.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/post.hpp>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kvlink::shm {

/// A ring's size: `slots` slots of up to `max_pieces` pieces and
/// `slot_data` bytes each.
struct ring_shape {
  std::uint32_t slots = 32;
  std::uint32_t slot_data = 64u << 10;
  std::uint32_t max_pieces = 64;

  friend bool operator==(const ring_shape&, const ring_shape&) = default;
};

namespace ring_detail {

inline constexpr std::uint32_t magic = 0x6b76726e;  // "kvrn"
inline constexpr std::uint32_t version = 1;
inline constexpr std::uint64_t page = 4096;
inline constexpr std::uint8_t kind_write = 1;  // initiator -> target
inline constexpr std::uint8_t kind_read = 2;   // target -> initiator

/// The ring's first page. Counters count slots ever published / finished.
struct control {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint32_t slots;
  std::uint32_t slot_data;
  std::uint32_t max_pieces;
  alignas(64) std::uint64_t posted;        // the initiator's
  alignas(64) std::uint64_t done;          // the target's
  alignas(64) std::uint32_t target_awake;  // the target's: it will look at `posted` again
  // The initiator sleeps until `done` reaches this (0: it does not): set by
  // it, cleared by the target when it rings.
  alignas(64) std::uint64_t wake_at;
};
static_assert(sizeof(control) <= page);

struct piece {
  std::uint64_t segment;
  std::uint64_t offset;
  std::uint32_t length;
  std::uint8_t kind;
  std::uint8_t unused[3];
  std::int32_t result;  // the target's: 0 or an errc value
  std::uint32_t unused2;
};
static_assert(sizeof(piece) == 32);

struct slot_header {
  std::uint32_t count;
  std::uint32_t unused[15];
};
static_assert(sizeof(slot_header) == 64);

/// Where a piece's bytes start in its slot's data: pieces in order, each at
/// a multiple of 64 bytes.
constexpr std::uint64_t data_step(std::uint64_t length) noexcept { return (length + 63) / 64 * 64; }

constexpr std::uint64_t slot_stride(const ring_shape& s) noexcept {
  const std::uint64_t raw =
      sizeof(slot_header) + std::uint64_t{s.max_pieces} * sizeof(piece) + s.slot_data;
  return (raw + page - 1) / page * page;
}
constexpr std::uint64_t ring_bytes(const ring_shape& s) noexcept {
  return page + std::uint64_t{s.slots} * slot_stride(s);
}
constexpr bool sane(const ring_shape& s) noexcept {
  return s.slots >= 1 && s.slots <= 1024 && s.slot_data >= 4096 && s.slot_data <= (16u << 20) &&
         s.slot_data % 64 == 0 && s.max_pieces >= 1 && s.max_pieces <= 4096;
}

inline std::uint64_t load(std::uint64_t& w) noexcept {
  return std::atomic_ref<std::uint64_t>(w).load(std::memory_order_seq_cst);
}
inline void store(std::uint64_t& w, std::uint64_t v) noexcept {
  std::atomic_ref<std::uint64_t>(w).store(v, std::memory_order_seq_cst);
}
inline std::uint32_t load(std::uint32_t& w) noexcept {
  return std::atomic_ref<std::uint32_t>(w).load(std::memory_order_seq_cst);
}
inline void store(std::uint32_t& w, std::uint32_t v) noexcept {
  std::atomic_ref<std::uint32_t>(w).store(v, std::memory_order_seq_cst);
}
inline bool clear_if(std::uint64_t& w, std::uint64_t expected) noexcept {
  return std::atomic_ref<std::uint64_t>(w).compare_exchange_strong(expected, 0,
                                                                   std::memory_order_seq_cst);
}

/// How long each side polls the other's counter (on its strand, a handler
/// posted again and again, yielding the core between looks) before it
/// sleeps on its eventfd: the initiator while it has slots out, until the
/// target has made no progress for initiator_poll; the target for
/// target_poll after its last slot. Two processes that woke each other
/// slot by slot ran at a third of the pipeline's rate on this project's
/// 2-core VM (a wake-up costs tens of microseconds there, and the woken
/// process tends to land on its waker's core); polls of 2 ms fell into the
/// same hole when the scheduler put both processes on one core, the poller
/// starving the copier (measured: README, "Small pieces").
inline constexpr std::chrono::microseconds initiator_poll{100};
inline constexpr std::chrono::microseconds target_poll{500};

inline void ring_bell(int fd) noexcept {
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto n = ::write(fd, &one, sizeof one);  // EAGAIN: already rung
}
inline void quiet_bell(int fd) noexcept {
  std::uint64_t v = 0;
  [[maybe_unused]] const auto n = ::read(fd, &v, sizeof v);  // EAGAIN: not rung
}

/// A ring's memory, mapped here; unmapped when the last owner goes.
class mapping {
 public:
  mapping(void* p, std::uint64_t len, ring_shape shape) noexcept
      : p_(static_cast<std::byte*>(p)), len_(len), shape_(shape) {}
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;
  ~mapping() { ::munmap(p_, static_cast<std::size_t>(len_)); }

  control& ctl() const noexcept { return *reinterpret_cast<control*>(p_); }
  const ring_shape& shape() const noexcept { return shape_; }
  std::byte* slot(std::uint64_t index) const noexcept {
    return p_ + page + (index % shape_.slots) * slot_stride(shape_);
  }
  static slot_header& header(std::byte* slot) noexcept {
    return *reinterpret_cast<slot_header*>(slot);
  }
  static piece* pieces(std::byte* slot) noexcept {
    return reinterpret_cast<piece*>(slot + sizeof(slot_header));
  }
  std::byte* data(std::byte* slot) const noexcept {
    return slot + sizeof(slot_header) + std::uint64_t{shape_.max_pieces} * sizeof(piece);
  }

 private:
  std::byte* p_;
  std::uint64_t len_;
  ring_shape shape_;
};

}  // namespace ring_detail

/// What the target copies to or from: a segment the session holds a lease
/// on, pinned (ring_server::acquire_fn) until released.
struct ring_segment {
  std::byte* base = nullptr;
  std::uint64_t length = 0;
  access granted = access::none;
};

/// The target's side of one session's ring, on a strand of its own.
class ring_server : public std::enable_shared_from_this<ring_server> {
 public:
  /// errc{} and `out` filled, the segment pinned; or why not.
  using acquire_fn = std::function<errc(std::uint64_t segment, ring_segment& out)>;
  using release_fn = std::function<void(std::uint64_t segment)>;

  /// Null with `why` when the ring cannot be made.
  static std::shared_ptr<ring_server> make(asio::any_io_executor strand, ring_shape shape,
                                           acquire_fn acquire, release_fn release,
                                           std::string& why) {
    if (!ring_detail::sane(shape)) {
      why = "its shape is out of range";
      return nullptr;
    }
    const auto bytes = ring_detail::ring_bytes(shape);
    const int fd = static_cast<int>(
        ::syscall(SYS_memfd_create, "kvlink-shm-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (fd < 0) {
      why = std::string("memfd_create: ") + std::strerror(errno);
      return nullptr;
    }
    void* p = MAP_FAILED;
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
        ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
        (p = ::mmap(nullptr, static_cast<std::size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED,
                    fd, 0)) == MAP_FAILED) {
      why = std::string("the ring's memory: ") + std::strerror(errno);
      ::close(fd);
      return nullptr;
    }
    auto map = std::make_shared<ring_detail::mapping>(p, bytes, shape);
    const int doorbell = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    const int answer = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (doorbell < 0 || answer < 0) {
      why = std::string("eventfd: ") + std::strerror(errno);
      if (doorbell >= 0) ::close(doorbell);
      if (answer >= 0) ::close(answer);
      ::close(fd);
      return nullptr;
    }
    auto& c = map->ctl();
    c.magic = ring_detail::magic;
    c.version = ring_detail::version;
    c.slots = shape.slots;
    c.slot_data = shape.slot_data;
    c.max_pieces = shape.max_pieces;
    struct stat st {};
    (void)::fstat(fd, &st);
    auto s = std::shared_ptr<ring_server>(
        new ring_server(std::move(strand), std::move(map), std::move(acquire), std::move(release)));
    s->fd_ = fd;
    s->answer_ = answer;
    s->dev_ = static_cast<std::uint64_t>(st.st_dev);
    s->ino_ = static_cast<std::uint64_t>(st.st_ino);
    s->doorbell_fd_ = doorbell;
    std::error_code ec;
    s->doorbell_.assign(doorbell, ec);
    if (ec) {
      ::close(doorbell);
      why = "the doorbell: " + ec.message();
      return nullptr;
    }
    return s;
  }

  ring_server(const ring_server&) = delete;
  ring_server& operator=(const ring_server&) = delete;
  ~ring_server() {
    if (fd_ >= 0) ::close(fd_);
    if (answer_ >= 0) ::close(answer_);
  }

  /// What the initiator needs to find the ring and its doorbells.
  nlohmann::json grant() const {
    const auto& sh = map_->shape();
    return {{"op", "ring"},
            {"version", ring_detail::version},
            {"fd", static_cast<std::uint64_t>(fd_)},
            {"size", ring_detail::ring_bytes(sh)},
            {"dev", dev_},
            {"ino", ino_},
            {"doorbell", static_cast<std::uint64_t>(doorbell_fd_)},
            {"answer", static_cast<std::uint64_t>(answer_)},
            {"slots", sh.slots},
            {"slot_data", sh.slot_data},
            {"max_pieces", sh.max_pieces}};
  }

  /// Starts waiting for the doorbell.
  void start() {
    asio::post(strand_, [self = shared_from_this()] { self->wait(); });
  }

  /// Stops for good (the session closed): no slot is looked at after the
  /// one being copied, if any.
  void stop() {
    asio::post(strand_, [self = shared_from_this()] {
      self->stopped_ = true;
      std::error_code ignored;
      self->doorbell_.close(ignored);
    });
  }

  /// Slots finished (for tests and logs).
  std::uint64_t finished() const noexcept { return done_; }

 private:
  ring_server(asio::any_io_executor strand, std::shared_ptr<ring_detail::mapping> map,
              acquire_fn acquire, release_fn release)
      : strand_(std::move(strand)),
        map_(std::move(map)),
        acquire_(std::move(acquire)),
        release_(std::move(release)),
        doorbell_(strand_) {}

  void wait() {
    if (stopped_) return;
    doorbell_.async_wait(asio::posix::stream_descriptor::wait_read,
                         [self = shared_from_this()](std::error_code ec) {
                           if (ec || self->stopped_) return;
                           ring_detail::quiet_bell(self->doorbell_.native_handle());
                           self->drain();
                         });
  }

  // Copies published slots; after `burst` of them yields the strand (and
  // stays awake), and sleeps once none is left.
  void drain() {
    static constexpr int burst = 16;
    auto& c = map_->ctl();
    ring_detail::store(c.target_awake, 1);
    for (int n = 0; !stopped_; ++n) {
      const std::uint64_t posted = ring_detail::load(c.posted);
      if (posted - done_ > map_->shape().slots) {
        detail::log(
            "shm: a peer's ring says {} slots are published, {} finished, of {}: stopping it",
            posted, done_, map_->shape().slots);
        stopped_ = true;
        std::error_code ignored;
        doorbell_.close(ignored);
        return;
      }
      if (posted == done_ &&
          std::chrono::steady_clock::now() - worked_ < ring_detail::target_poll) {
        asio::post(strand_, [self = shared_from_this()] {
          ::sched_yield();  // a process sharing this core may run
          self->drain();
        });
        return;  // awake: the initiator does not ring
      }
      if (posted == done_) {
        ring_detail::store(c.target_awake, 0);
        if (ring_detail::load(c.posted) != done_) {
          ring_detail::store(c.target_awake, 1);
          continue;
        }
        wait();
        return;
      }
      if (n == burst) {
        asio::post(strand_, [self = shared_from_this()] { self->drain(); });
        return;
      }
      copy_slot(map_->slot(done_));
      worked_ = std::chrono::steady_clock::now();
      ++done_;
      ring_detail::store(c.done, done_);
      // The initiator sleeps until a slot it named is done.
      if (const auto w = ring_detail::load(c.wake_at);
          w != 0 && w <= done_ && ring_detail::clear_if(c.wake_at, w)) {
        ring_detail::ring_bell(answer_);
      }
    }
  }

  void copy_slot(std::byte* slot) {
    const auto& sh = map_->shape();
    const std::uint32_t count =
        std::atomic_ref<std::uint32_t>(ring_detail::mapping::header(slot).count)
            .load(std::memory_order_relaxed);
    auto* pieces = ring_detail::mapping::pieces(slot);
    std::byte* data = map_->data(slot);
    const std::uint32_t n = count <= sh.max_pieces ? count : sh.max_pieces;
    std::uint64_t at = 0;
    std::optional<std::uint64_t> held;  // the segment pinned for the pieces so far
    ring_segment seg{};
    errc held_error{};
    for (std::uint32_t i = 0; i < n; ++i) {
      ring_detail::piece p{};
      std::memcpy(&p, &pieces[i], sizeof p);  // read once: the peer may change it
      errc e{};
      if (count > sh.max_pieces) e = errc::malformed_message;
      if (e == errc{} && (p.kind != ring_detail::kind_write && p.kind != ring_detail::kind_read)) {
        e = errc::malformed_message;
      }
      if (e == errc{} && (p.length > sh.slot_data || at > sh.slot_data - p.length)) {
        e = errc::malformed_message;
      }
      if (e == errc{} && (!held || *held != p.segment)) {
        if (held && held_error == errc{}) release_(*held);
        held = p.segment;
        held_error = acquire_(p.segment, seg);
      }
      if (e == errc{}) e = held_error;
      if (e == errc{}) {
        e = detail::check_segment_access(
            seg.length, seg.granted, p.offset, p.length,
            p.kind == ring_detail::kind_write ? access::remote_write : access::remote_read);
      }
      if (e == errc{} && p.length > 0) {
        if (p.kind == ring_detail::kind_write) {
          std::memcpy(seg.base + p.offset, data + at, p.length);
        } else {
          std::memcpy(data + at, seg.base + p.offset, p.length);
        }
      }
      std::atomic_ref<std::int32_t>(pieces[i].result)
          .store(static_cast<std::int32_t>(e), std::memory_order_relaxed);
      if (p.length <= sh.slot_data) at += ring_detail::data_step(p.length);
      if (at > sh.slot_data) at = sh.slot_data;  // the rest fail their bounds
    }
    if (held && held_error == errc{}) release_(*held);
  }

  asio::any_io_executor strand_;
  std::shared_ptr<ring_detail::mapping> map_;
  acquire_fn acquire_;
  release_fn release_;
  asio::posix::stream_descriptor doorbell_;
  int fd_ = -1;
  int doorbell_fd_ = -1;  // owned by doorbell_
  int answer_ = -1;
  std::uint64_t dev_ = 0;
  std::uint64_t ino_ = 0;
  std::uint64_t done_ = 0;
  std::chrono::steady_clock::time_point worked_{};  // the last slot copied
  bool stopped_ = false;
};

/// The initiator's side of a ring, on the path's strand: slices queued,
/// slots filled and published, finished slots reported.
class ring_client : public std::enable_shared_from_this<ring_client> {
 public:
  using fatal_fn = std::function<void(std::error_code)>;

  /// Maps the ring `grant` names through duplicates of the target's
  /// descriptors (pidfd: the target's process), after checking them; null
  /// with `why` if it cannot.
  static std::shared_ptr<ring_client> open(asio::any_io_executor ex, transport_host& host,
                                           const nlohmann::json& grant, int pidfd,
                                           fatal_fn on_fatal, std::string& why) {
    ring_shape shape;
    std::uint64_t version = 0, fd = 0, size = 0, dev = 0, ino = 0, doorbell = 0, answer = 0,
                  slots = 0, slot_data = 0, max_pieces = 0;
    const auto get = [&](const char* k, std::uint64_t& v) {
      const auto it = grant.find(k);
      if (it == grant.end() || !it->is_number_unsigned()) return false;
      v = it->get<std::uint64_t>();
      return true;
    };
    if (!grant.is_object() || !get("version", version) || !get("fd", fd) || !get("size", size) ||
        !get("dev", dev) || !get("ino", ino) || !get("doorbell", doorbell) ||
        !get("answer", answer) || !get("slots", slots) || !get("slot_data", slot_data) ||
        !get("max_pieces", max_pieces) || fd > INT_MAX || doorbell > INT_MAX || answer > INT_MAX ||
        slots > UINT32_MAX || slot_data > UINT32_MAX || max_pieces > UINT32_MAX) {
      why = "its grant is malformed";
      return nullptr;
    }
    if (version != ring_detail::version) {
      why = "its ring is of version " + std::to_string(version) + ", this build's of " +
            std::to_string(ring_detail::version);
      return nullptr;
    }
    shape = {static_cast<std::uint32_t>(slots), static_cast<std::uint32_t>(slot_data),
             static_cast<std::uint32_t>(max_pieces)};
    if (!ring_detail::sane(shape) || size != ring_detail::ring_bytes(shape)) {
      why = "its ring's shape is out of range";
      return nullptr;
    }
    int local[3] = {-1, -1, -1};
    const std::uint64_t theirs[3] = {fd, doorbell, answer};
    const auto close_all = [&] {
      for (int& l : local) {
        if (l >= 0) ::close(l);
        l = -1;
      }
    };
#ifdef SYS_pidfd_getfd
    for (int i = 0; i < 3; ++i) {
      local[i] =
          static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, static_cast<int>(theirs[i]), 0));
      if (local[i] < 0) {
        why = std::string("pidfd_getfd: ") + std::strerror(errno);
        close_all();
        return nullptr;
      }
    }
#else
    (void)pidfd;
    (void)theirs;
    why = "this build has no pidfd_getfd";
    return nullptr;
#endif
    struct stat st {};
    const int seals = ::fcntl(local[0], F_GET_SEALS);
    if (::fstat(local[0], &st) != 0 || static_cast<std::uint64_t>(st.st_dev) != dev ||
        static_cast<std::uint64_t>(st.st_ino) != ino) {
      why = "its descriptor is not the file it named";
    } else if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
      why = "its file is not sealed against shrinking";
    } else if (static_cast<std::uint64_t>(st.st_size) < size) {
      why = "its file is smaller than the ring";
    }
    void* p = MAP_FAILED;
    if (why.empty()) {
      p = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_POPULATE, local[0], 0);
      if (p == MAP_FAILED) why = std::string("mmap: ") + std::strerror(errno);
    }
    if (!why.empty()) {
      close_all();
      return nullptr;
    }
    ::close(local[0]);
    local[0] = -1;
    auto map = std::make_shared<ring_detail::mapping>(p, size, shape);
    if (map->ctl().magic != ring_detail::magic || map->ctl().slots != shape.slots ||
        map->ctl().slot_data != shape.slot_data || map->ctl().max_pieces != shape.max_pieces) {
      why = "its ring does not say what its grant does";
      close_all();
      return nullptr;
    }
    auto c = std::shared_ptr<ring_client>(
        new ring_client(std::move(ex), host, std::move(map), local[1], std::move(on_fatal)));
    std::error_code ec;
    c->answer_.assign(local[2], ec);
    if (ec) {
      ::close(local[2]);
      why = "its answer descriptor: " + ec.message();
      return nullptr;
    }
    return c;
  }

  ring_client(const ring_client&) = delete;
  ring_client& operator=(const ring_client&) = delete;
  ~ring_client() {
    if (doorbell_ >= 0) ::close(doorbell_);
  }

  const ring_shape& shape() const noexcept { return map_->shape(); }

  /// Whether a slice of `length` bytes fits a slot.
  bool fits(std::uint64_t length) const noexcept { return length <= map_->shape().slot_data; }

  /// Queues a slice that fits(). A slot's worth is published at once: the
  /// peer copies while the engine still plans the rest of a transfer.
  void add(const slice_ref& s) {
    queue_.push_back(s);
    if (queue_.size() < early() || failed_) return;
    if (posted_ - retired_ == slots_.size()) collect(false);
    if (!failed_) fill(true);
  }

  /// Fills free slots, reports finished ones, and sleeps on the target's
  /// answer while slots are out.
  void pump() {
    if (failed_) return;
    collect();
    if (failed_) return;
    fill();
    if (!reports_.empty()) flush();
    sleep();
  }

  /// `op` stops: its queued slices go (counted); those in slots finish.
  std::size_t drop(const detail::transfer_op* op) {
    return std::erase_if(queue_, [op](const slice_ref& s) { return s.op == op; });
  }

  /// Whether slices of `op` are in published slots.
  bool in_flight(const detail::transfer_op* op) const {
    for (std::uint64_t i = retired_; i < posted_; ++i) {
      for (const auto& s : slots_[i % slots_.size()]) {
        if (s.op == op) return true;
      }
    }
    return false;
  }
  bool busy() const noexcept { return posted_ != retired_; }

  /// The queued slices of the peer's segment `seg` (not yet in a slot).
  std::vector<slice_ref> take_segment(std::uint64_t seg) {
    std::vector<slice_ref> out;
    std::erase_if(queue_, [&](const slice_ref& s) {
      if (s.segment != seg) return false;
      out.push_back(s);
      return true;
    });
    return out;
  }

  /// Runs `fn` once every slot published so far is finished (at once if
  /// none is out): slots published later do not hold it back.
  void when_through(std::function<void()> fn) {
    if (!busy() || failed_) {
      fn();
      return;
    }
    waiters_.emplace_back(posted_, std::move(fn));
  }

  /// Stops for good: every queued slice and every slice in a slot is
  /// reported with `ec` (the target touches only the ring, never our
  /// memory, so nothing waits).
  void fail(std::error_code ec) {
    if (failed_) return;
    failed_ = true;
    std::error_code ignored;
    answer_.close(ignored);
    for (; retired_ < posted_; ++retired_) {
      for (const auto& s : slots_[retired_ % slots_.size()]) reports_.push_back({s.op, 0, ec});
    }
    for (const auto& s : queue_) reports_.push_back({s.op, 0, ec});
    queue_.clear();
    if (!reports_.empty()) flush();
    run_waiters();
  }

 private:
  ring_client(asio::any_io_executor ex, transport_host& host,
              std::shared_ptr<ring_detail::mapping> map, int doorbell, fatal_fn on_fatal)
      : ex_(std::move(ex)),
        host_(host),
        map_(std::move(map)),
        doorbell_(doorbell),
        answer_(ex_),
        on_fatal_(std::move(on_fatal)),
        slots_(map_->shape().slots) {}

  // A slot is published before pump() once this many slices wait.
  std::size_t early() const noexcept {
    return std::max<std::size_t>(1, map_->shape().max_pieces / 4);
  }

  // `full_only`: only while early() slices wait.
  void fill(bool full_only = false) {
    const auto& sh = map_->shape();
    auto& c = map_->ctl();
    while (!queue_.empty() && posted_ - retired_ < sh.slots &&
           (!full_only || queue_.size() >= early())) {
      std::byte* slot = map_->slot(posted_);
      auto* pieces = ring_detail::mapping::pieces(slot);
      std::byte* data = map_->data(slot);
      auto& held = slots_[posted_ % sh.slots];
      held.clear();
      std::uint64_t at = 0;
      std::uint32_t count = 0;
      while (!queue_.empty() && count < sh.max_pieces) {
        const slice_ref& s = queue_.front();
        if (host_.stopping(s.op)) {
          reports_.push_back({s.op, 0, errc::cancelled});
          queue_.pop_front();
          continue;
        }
        if (s.length > sh.slot_data - at) break;
        ring_detail::piece p{};
        p.segment = s.segment;
        p.offset = s.offset;
        p.length = static_cast<std::uint32_t>(s.length);
        p.kind = s.kind == opcode::read ? ring_detail::kind_read : ring_detail::kind_write;
        std::memcpy(&pieces[count], &p, sizeof p);
        if (s.kind != opcode::read) std::memcpy(data + at, s.local, s.length);
        at += ring_detail::data_step(s.length);
        if (at > sh.slot_data) at = sh.slot_data;
        held.push_back(s);
        ++count;
        queue_.pop_front();
      }
      if (count == 0) break;
      ring_detail::mapping::header(slot).count = count;
      if (posted_ == retired_) moved_ = std::chrono::steady_clock::now();  // a new start
      ring_detail::store(c.posted, ++posted_);
      if (ring_detail::load(c.target_awake) == 0) ring_detail::ring_bell(doorbell_);
    }
  }

  // `run_waiting`: runs the waiters now through, and fails the ring on a
  // bad count; add() leaves those, and the reports, to pump(), outside the
  // engine's planning.
  void collect(bool run_waiting = true) {
    auto& c = map_->ctl();
    const std::uint64_t done = ring_detail::load(c.done);
    if (done < retired_ || done > posted_) {
      if (!run_waiting) return;
      detail::log("shm: the peer's ring says {} slots are finished, {} were published: failing it",
                  done, posted_);
      fatal(errc::malformed_message);
      return;
    }
    if (done != retired_) moved_ = std::chrono::steady_clock::now();
    for (; retired_ < done; ++retired_) {
      std::byte* slot = map_->slot(retired_);
      auto* pieces = ring_detail::mapping::pieces(slot);
      const std::byte* data = map_->data(slot);
      std::uint64_t at = 0;
      const auto& held = slots_[retired_ % slots_.size()];
      for (std::size_t i = 0; i < held.size(); ++i) {
        const auto& s = held[i];
        const std::int32_t r =
            std::atomic_ref<std::int32_t>(pieces[i].result).load(std::memory_order_relaxed);
        std::error_code ec;
        if (r != 0) {
          ec = r > 0 && r <= static_cast<std::int32_t>(errc_last) ? static_cast<errc>(r)
                                                                  : errc::malformed_message;
        }
        if (!ec && s.kind == opcode::read) std::memcpy(s.local, data + at, s.length);
        add_report(reports_, s.op, ec ? 0 : s.length, ec);
        at += ring_detail::data_step(s.length);
      }
    }
    if (run_waiting && !waiters_.empty()) run_waiters();
  }

  // Waits for a quarter of the ring's slots to be done (all of those out,
  // if fewer): polls while the target made progress within
  // ring_detail::initiator_poll, else asks the target to ring and sleeps on
  // its answer (while this process copies out what came back, the target
  // copies the rest).
  void sleep() {
    if (failed_ || sleeping_ || polling_ || !busy()) return;
    auto& c = map_->ctl();
    const std::uint64_t out = posted_ - retired_;
    const std::uint64_t want =
        retired_ + std::max<std::uint64_t>(1, std::min<std::uint64_t>(out, slots_.size() / 4));
    if (ring_detail::load(c.done) < want &&
        std::chrono::steady_clock::now() - moved_ < ring_detail::initiator_poll) {
      polling_ = true;
      asio::post(ex_, [self = shared_from_this()] {
        self->polling_ = false;
        ::sched_yield();  // a process sharing this core may run
        self->pump();
      });
      return;
    }
    ring_detail::store(c.wake_at, want);
    if (ring_detail::load(c.done) >= want) {
      ring_detail::clear_if(c.wake_at, want);
      asio::post(ex_, [self = shared_from_this()] { self->pump(); });
      return;
    }
    sleeping_ = true;
    answer_.async_wait(asio::posix::stream_descriptor::wait_read,
                       [self = shared_from_this()](std::error_code ec) {
                         self->sleeping_ = false;
                         if (ec || self->failed_) return;
                         ring_detail::quiet_bell(self->answer_.native_handle());
                         self->pump();
                       });
  }

  void flush() {
    host_.slices_done(reports_);
    reports_.clear();
  }

  // Those whose slots are all finished (all of them once failed).
  void run_waiters() {
    std::vector<std::function<void()>> due;
    std::erase_if(waiters_, [&](auto& w) {
      if (!failed_ && w.first > retired_) return false;
      due.push_back(std::move(w.second));
      return true;
    });
    for (auto& fn : due) fn();
  }

  void fatal(std::error_code ec) {
    if (on_fatal_) {
      on_fatal_(ec);  // the path fails, which fails this ring
    } else {
      fail(ec);
    }
  }

  asio::any_io_executor ex_;
  transport_host& host_;
  std::shared_ptr<ring_detail::mapping> map_;
  int doorbell_;
  asio::posix::stream_descriptor answer_;
  fatal_fn on_fatal_;
  std::deque<slice_ref> queue_;
  std::vector<std::vector<slice_ref>> slots_;  // the slices each slot holds
  std::vector<slice_report> reports_;
  std::vector<std::pair<std::uint64_t, std::function<void()>>> waiters_;  // (slots, fn)
  std::uint64_t posted_ = 0;
  std::uint64_t retired_ = 0;
  std::chrono::steady_clock::time_point moved_{};  // the target's last progress (or our start)
  bool sleeping_ = false;
  bool polling_ = false;
  bool failed_ = false;
};

}  // namespace kvlink::shm
