// A thin RAII layer over libibverbs, with no policy in it.
//
// Each class owns exactly one verbs object and destroys it in its destructor;
// all are move-only. An owner does not keep its parent alive: the caller holds
// them in the order rc_pingpong creates them (device list -> context ->
// protection domain / completion channel -> completion queue -> memory
// regions, queue pairs), so that members declared in that order are destroyed
// in the reverse one, as verbs requires (a QP before its CQs, CQs before their
// channel, everything before the context).
//
//   auto devices = kvlink::rdma::device_list::open();      // throws errc::no_device
//   kvlink::rdma::context ctx{devices[0]};
//   kvlink::rdma::protection_domain pd{ctx};
//   kvlink::rdma::completion_queue cq{ctx, 256};
//   kvlink::rdma::memory_region mr{pd, buf, len, kvlink::rdma::to_ibv_access(access::remote_write),
//                                  "segment 3"};
//   kvlink::rdma::queue_pair qp{pd, cq, cq, {}};
//   qp.to_init(1, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
//   qp.to_rtr({.remote_qpn = ..., .remote_psn = ..., .remote_gid = ..., .sgid_index = 1});
//   qp.to_rts({.psn = ...});
//
// Errors: creating an object is a set-up edge and throws std::system_error
// whose what() names the call and its subject ("ibv_reg_mr(segment 3): Cannot
// allocate memory"); every such call also has a noexcept overload taking a
// std::error_code&. The data path (posting, polling, notifying, QP state
// changes during recovery) reports through std::error_code only. Failed work
// completions carry an `ibv_wc_status` in wc_status_category().
//
// Thread safety: as libibverbs. The objects have no internal locking; verbs
// calls on one QP or CQ from several threads need the caller's serialisation.
//
// Only headers under kvlink/rdma/ include <infiniband/verbs.h>.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <infiniband/verbs.h>

namespace kvlink::rdma {

// ---------------------------------------------------------------------------
// Errors

namespace detail {

class wc_status_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "ibv_wc_status"; }
  std::string message(int ev) const override {
    // ibv_wc_status_str() answers "unknown" for values it does not know.
    return ibv_wc_status_str(static_cast<ibv_wc_status>(ev));
  }
};

/// errno as a std::error_code; never success (0 becomes EIO: a verbs call that
/// failed without saying why still failed).
inline std::error_code errno_code(int err) noexcept {
  return {err != 0 ? err : EIO, std::system_category()};
}

/// Verbs calls returning int report failure either as a positive errno value
/// (rdma-core) or as -1 with errno set (older providers). 0 is success.
inline std::error_code verbs_result(int rc) noexcept {
  if (rc == 0) return {};
  return errno_code(rc > 0 ? rc : errno);
}

/// "call(subject)", the context a failure message starts with.
inline std::string call_context(std::string_view call, std::string_view subject) {
  std::string s{call};
  s += '(';
  s += subject;
  s += ')';
  return s;
}

/// Throws ec with context: what() reads "call(subject): message".
[[noreturn]] inline void throw_error(std::error_code ec, std::string_view call,
                                     std::string_view subject) {
  throw std::system_error(ec, call_context(call, subject));
}

/// Maps ibv_get_device_list()'s answer to an error: NULL with ENOSYS (no
/// uverbs in the kernel), ENODEV or no errno, and an empty list all mean "no
/// devices" (errc::no_device); NULL with any other errno is that errno.
inline std::error_code classify_device_list(bool list_is_null, int count, int err) noexcept {
  if (list_is_null) {
    if (err == 0 || err == ENOSYS || err == ENODEV) return make_error_code(errc::no_device);
    return errno_code(err);
  }
  if (count <= 0) return make_error_code(errc::no_device);
  return {};
}

/// Owns one verbs object; Destroy's failure cannot be reported from a
/// destructor and only happens when the caller broke the teardown order (for
/// example destroying a CQ that a QP still uses), so it is ignored.
template <class T, int (*Destroy)(T*)>
class verbs_handle {
 public:
  verbs_handle() noexcept = default;
  explicit verbs_handle(T* p) noexcept : p_{p} {}
  verbs_handle(verbs_handle&& o) noexcept : p_{std::exchange(o.p_, nullptr)} {}
  verbs_handle& operator=(verbs_handle&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  verbs_handle(const verbs_handle&) = delete;
  verbs_handle& operator=(const verbs_handle&) = delete;
  ~verbs_handle() { reset(); }

  T* get() const noexcept { return p_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }
  void reset() noexcept {
    if (p_ != nullptr) static_cast<void>(Destroy(std::exchange(p_, nullptr)));
  }

 private:
  T* p_ = nullptr;
};

}  // namespace detail

/// The category of failed work completions; value = ibv_wc_status, messages
/// from ibv_wc_status_str(). IBV_WC_SUCCESS (0) is "no error".
inline const std::error_category& wc_status_category() noexcept {
  static const detail::wc_status_category_impl instance;
  return instance;
}

inline std::error_code make_wc_error(ibv_wc_status status) noexcept {
  return {static_cast<int>(status), wc_status_category()};
}

/// The outcome of one work completion as an error code (empty on success).
inline std::error_code wc_error(const ibv_wc& wc) noexcept { return make_wc_error(wc.status); }

/// kvlink access flags as ibv access flags. Local write is always granted: the
/// NIC writes into the region for incoming WRITEs and for READ responses.
constexpr int to_ibv_access(access a) noexcept {
  int flags = IBV_ACCESS_LOCAL_WRITE;
  if (allows(a, access::remote_read)) flags |= IBV_ACCESS_REMOTE_READ;
  if (allows(a, access::remote_write)) flags |= IBV_ACCESS_REMOTE_WRITE;
  return flags;
}

// ---------------------------------------------------------------------------
// Device list

/// The devices libibverbs sees. Empty (default-constructed or after a failed
/// open) means none.
class device_list {
 public:
  device_list() noexcept = default;
  device_list(device_list&& o) noexcept
      : list_{std::exchange(o.list_, nullptr)}, count_{std::exchange(o.count_, 0)} {}
  device_list& operator=(device_list&& o) noexcept {
    if (this != &o) {
      reset();
      list_ = std::exchange(o.list_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  device_list(const device_list&) = delete;
  device_list& operator=(const device_list&) = delete;
  ~device_list() { reset(); }

  /// Lists the devices. No devices (ENOSYS, an empty list) is
  /// errc::no_device; other failures keep their errno.
  static device_list open(std::error_code& ec) noexcept {
    device_list dl;
    int count = 0;
    errno = 0;
    ibv_device** list = ibv_get_device_list(&count);
    const int err = errno;
    ec = detail::classify_device_list(list == nullptr, count, err);
    if (ec) {
      if (list != nullptr) ibv_free_device_list(list);
      return dl;
    }
    dl.list_ = list;
    dl.count_ = count;
    return dl;
  }

  /// As above; throws std::system_error ("ibv_get_device_list(): no usable
  /// RDMA device found ...").
  static device_list open() {
    std::error_code ec;
    device_list dl = open(ec);
    if (ec) detail::throw_error(ec, "ibv_get_device_list", "");
    return dl;
  }

  std::span<ibv_device* const> devices() const noexcept {
    return {list_, static_cast<std::size_t>(count_)};
  }
  std::size_t size() const noexcept { return static_cast<std::size_t>(count_); }
  bool empty() const noexcept { return count_ == 0; }
  ibv_device* operator[](std::size_t i) const noexcept { return list_[i]; }
  auto begin() const noexcept { return devices().begin(); }
  auto end() const noexcept { return devices().end(); }

  /// The device called `name` ("rxe0", "mlx5_0"), or nullptr.
  ibv_device* find(std::string_view name) const noexcept {
    for (ibv_device* d : devices()) {
      if (name == ibv_get_device_name(d)) return d;
    }
    return nullptr;
  }

 private:
  void reset() noexcept {
    if (list_ != nullptr) ibv_free_device_list(std::exchange(list_, nullptr));
    count_ = 0;
  }

  ibv_device** list_ = nullptr;
  int count_ = 0;
};

// ---------------------------------------------------------------------------
// Context

/// An opened device. The device list it came from may be freed once opened.
class context {
 public:
  context() noexcept = default;
  explicit context(ibv_device* device) {
    std::error_code ec;
    *this = context{device, ec};
    if (ec) detail::throw_error(ec, "ibv_open_device", device_name(device));
  }
  context(ibv_device* device, std::error_code& ec) noexcept {
    ec.clear();
    if (device == nullptr) {
      ec = make_error_code(errc::invalid_argument);
      return;
    }
    errno = 0;
    ctx_ = handle{ibv_open_device(device)};
    if (!ctx_) ec = detail::errno_code(errno);
  }

  ibv_context* get() const noexcept { return ctx_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(ctx_); }
  /// The kernel's device name ("rxe0").
  std::string_view name() const noexcept {
    return device_name(ctx_ ? ctx_.get()->device : nullptr);
  }

  ibv_device_attr query_device() const {
    ibv_device_attr attr{};
    if (auto ec = detail::verbs_result(ibv_query_device(get(), &attr)))
      detail::throw_error(ec, "ibv_query_device", name());
    return attr;
  }

  ibv_port_attr query_port(std::uint8_t port) const {
    ibv_port_attr attr{};
    if (auto ec = detail::verbs_result(ibv_query_port(get(), port, &attr)))
      detail::throw_error(ec, "ibv_query_port",
                          std::string{name()} + " port " + std::to_string(port));
    return attr;
  }

  ibv_gid query_gid(std::uint8_t port, int index) const {
    ibv_gid gid{};
    if (auto ec = detail::verbs_result(ibv_query_gid(get(), port, index, &gid)))
      detail::throw_error(ec, "ibv_query_gid",
                          std::string{name()} + " port " + std::to_string(port) + " index " +
                              std::to_string(index));
    return gid;
  }

 private:
  static std::string_view device_name(ibv_device* d) noexcept {
    const char* n = d != nullptr ? ibv_get_device_name(d) : nullptr;
    return n != nullptr ? std::string_view{n} : std::string_view{"?"};
  }
  using handle = detail::verbs_handle<ibv_context, &ibv_close_device>;
  handle ctx_;
};

// ---------------------------------------------------------------------------
// Protection domain

class protection_domain {
 public:
  protection_domain() noexcept = default;
  explicit protection_domain(const context& ctx) {
    std::error_code ec;
    *this = protection_domain{ctx, ec};
    if (ec) detail::throw_error(ec, "ibv_alloc_pd", ctx.name());
  }
  protection_domain(const context& ctx, std::error_code& ec) noexcept {
    errno = 0;
    pd_ = handle{ibv_alloc_pd(ctx.get())};
    ec = pd_ ? std::error_code{} : detail::errno_code(errno);
  }

  ibv_pd* get() const noexcept { return pd_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(pd_); }

 private:
  using handle = detail::verbs_handle<ibv_pd, &ibv_dealloc_pd>;
  handle pd_;
};

// ---------------------------------------------------------------------------
// Memory region

/// Registered (pinned) memory. Registering is slow (it pins every page): keep
/// it off latency-sensitive executors.
class memory_region {
 public:
  memory_region() noexcept = default;
  /// `subject` names the memory in error messages ("segment 3").
  memory_region(const protection_domain& pd, void* addr, std::size_t length, int ibv_access,
                std::string_view subject) {
    std::error_code ec;
    *this = memory_region{pd, addr, length, ibv_access, ec};
    if (ec) detail::throw_error(ec, "ibv_reg_mr", subject);
  }
  memory_region(const protection_domain& pd, void* addr, std::size_t length, int ibv_access,
                std::error_code& ec) noexcept {
    errno = 0;
    mr_ = handle{ibv_reg_mr(pd.get(), addr, length, ibv_access)};
    ec = mr_ ? std::error_code{} : detail::errno_code(errno);
  }

  /// A dma-buf range (GPUDirect, rdma/gpudirect.hpp): `length` bytes at
  /// `offset` into the dma-buf `fd`, addressed as `iova` in work requests.
  memory_region(const protection_domain& pd, std::uint64_t offset, std::size_t length,
                std::uint64_t iova, int fd, int ibv_access, std::error_code& ec) noexcept {
    errno = 0;
    mr_ = handle{ibv_reg_dmabuf_mr(pd.get(), offset, length, iova, fd, ibv_access)};
    ec = mr_ ? std::error_code{} : detail::errno_code(errno);
  }

  ibv_mr* get() const noexcept { return mr_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(mr_); }
  std::uint32_t lkey() const noexcept { return mr_.get()->lkey; }
  std::uint32_t rkey() const noexcept { return mr_.get()->rkey; }
  void* addr() const noexcept { return mr_.get()->addr; }
  std::size_t length() const noexcept { return mr_.get()->length; }

 private:
  using handle = detail::verbs_handle<ibv_mr, &ibv_dereg_mr>;
  handle mr_;
};

// ---------------------------------------------------------------------------
// Completion channel

/// A file descriptor that becomes readable when a CQ bound to it, armed with
/// completion_queue::request_notify(), gets a completion.
class completion_channel {
 public:
  completion_channel() noexcept = default;
  explicit completion_channel(const context& ctx) {
    std::error_code ec;
    *this = completion_channel{ctx, ec};
    if (ec) detail::throw_error(ec, "ibv_create_comp_channel", ctx.name());
  }
  completion_channel(const context& ctx, std::error_code& ec) noexcept {
    errno = 0;
    ch_ = handle{ibv_create_comp_channel(ctx.get())};
    ec = ch_ ? std::error_code{} : detail::errno_code(errno);
  }

  ibv_comp_channel* get() const noexcept { return ch_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(ch_); }
  int fd() const noexcept { return ch_.get()->fd; }

  /// Takes one event: the CQ that fired, or nullptr with ec set (EAGAIN when
  /// the fd is non-blocking and no event is pending). Every event taken must
  /// be acknowledged with that CQ's ack_events() before the CQ is destroyed.
  ibv_cq* get_event(std::error_code& ec) noexcept {
    ibv_cq* cq = nullptr;
    void* cq_context = nullptr;
    errno = 0;
    if (ibv_get_cq_event(get(), &cq, &cq_context) != 0) {
      ec = detail::errno_code(errno);
      return nullptr;
    }
    ec.clear();
    return cq;
  }

 private:
  using handle = detail::verbs_handle<ibv_comp_channel, &ibv_destroy_comp_channel>;
  handle ch_;
};

// ---------------------------------------------------------------------------
// Completion queue

class completion_queue {
 public:
  completion_queue() noexcept = default;
  /// `min_entries` completions at least; bound to `channel` when given.
  completion_queue(const context& ctx, int min_entries, completion_channel* channel = nullptr,
                   int comp_vector = 0) {
    std::error_code ec;
    *this = completion_queue{ctx, min_entries, channel, comp_vector, ec};
    if (ec)
      detail::throw_error(
          ec, "ibv_create_cq",
          std::string{ctx.name()} + ", " + std::to_string(min_entries) + " entries");
  }
  completion_queue(const context& ctx, int min_entries, completion_channel* channel,
                   int comp_vector, std::error_code& ec) noexcept {
    errno = 0;
    cq_ = handle{ibv_create_cq(ctx.get(), min_entries, nullptr,
                               channel != nullptr ? channel->get() : nullptr, comp_vector)};
    ec = cq_ ? std::error_code{} : detail::errno_code(errno);
  }

  ibv_cq* get() const noexcept { return cq_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(cq_); }
  /// Entries actually allocated (may exceed what was asked for).
  int capacity() const noexcept { return cq_.get()->cqe; }

  /// Polls up to out.size() completions into `out`; returns how many were
  /// written. A failed poll (the CQ is broken) sets ec and returns 0. Each
  /// completion's own status is in out[i].status (see wc_error()).
  std::size_t poll(std::span<ibv_wc> out, std::error_code& ec) noexcept {
    const int n = ibv_poll_cq(get(), static_cast<int>(out.size()), out.data());
    if (n < 0) {
      // Providers return -1 or a private negative value, not an errno.
      ec = detail::errno_code(EIO);
      return 0;
    }
    ec.clear();
    return static_cast<std::size_t>(n);
  }

  /// Arms the CQ: the next completion fires the channel once.
  std::error_code request_notify(bool solicited_only = false) noexcept {
    return detail::verbs_result(ibv_req_notify_cq(get(), solicited_only ? 1 : 0));
  }

  /// Acknowledges `n` events taken from the channel for this CQ (ibv_destroy_cq
  /// waits for all of them). Batching acknowledgements is cheaper.
  void ack_events(unsigned n) noexcept {
    if (n != 0) ibv_ack_cq_events(get(), n);
  }

 private:
  using handle = detail::verbs_handle<ibv_cq, &ibv_destroy_cq>;
  handle cq_;
};

// ---------------------------------------------------------------------------
// Work requests

/// Local memory of a work request: a registered range.
struct local_buffer {
  std::uint64_t addr = 0;
  std::uint32_t length = 0;
  std::uint32_t lkey = 0;
};

/// Remote memory of a one-sided work request.
struct remote_buffer {
  std::uint64_t addr = 0;
  std::uint32_t rkey = 0;
};

/// One RDMA WRITE or READ with a single scatter/gather entry. The ibv_send_wr
/// points at the entry inside this object, so copies re-point it at their own
/// entry and start unchained: chain() links specific objects.
class rdma_work_request {
 public:
  rdma_work_request() noexcept { wr_.sg_list = &sge_; }
  rdma_work_request(ibv_wr_opcode op, std::uint64_t wr_id, local_buffer local, remote_buffer remote,
                    bool signaled = true) noexcept {
    sge_.addr = local.addr;
    sge_.length = local.length;
    sge_.lkey = local.lkey;
    wr_.wr_id = wr_id;
    wr_.next = nullptr;
    wr_.sg_list = &sge_;
    wr_.num_sge = 1;
    wr_.opcode = op;
    wr_.send_flags = signaled ? static_cast<unsigned>(IBV_SEND_SIGNALED) : 0U;
    wr_.wr.rdma.remote_addr = remote.addr;
    wr_.wr.rdma.rkey = remote.rkey;
  }
  rdma_work_request(const rdma_work_request& o) noexcept : sge_{o.sge_}, wr_{o.wr_} { repoint(); }
  rdma_work_request& operator=(const rdma_work_request& o) noexcept {
    sge_ = o.sge_;
    wr_ = o.wr_;
    repoint();
    return *this;
  }
  ~rdma_work_request() = default;

  ibv_send_wr& wr() noexcept { return wr_; }
  const ibv_send_wr& wr() const noexcept { return wr_; }
  const ibv_sge& sge() const noexcept { return sge_; }

  /// Posts `next` after this one in the same ibv_post_send() call.
  void chain(rdma_work_request& next) noexcept { wr_.next = &next.wr_; }

 private:
  void repoint() noexcept {
    wr_.sg_list = &sge_;
    wr_.next = nullptr;
  }

  ibv_sge sge_{};
  ibv_send_wr wr_{};
};

/// RDMA WRITE of `local` to `remote`; its completion carries `wr_id`.
inline rdma_work_request rdma_write(std::uint64_t wr_id, local_buffer local, remote_buffer remote,
                                    bool signaled = true) noexcept {
  return {IBV_WR_RDMA_WRITE, wr_id, local, remote, signaled};
}

/// RDMA READ of `remote` into `local`; its completion carries `wr_id`.
inline rdma_work_request rdma_read(std::uint64_t wr_id, local_buffer local, remote_buffer remote,
                                   bool signaled = true) noexcept {
  return {IBV_WR_RDMA_READ, wr_id, local, remote, signaled};
}

// ---------------------------------------------------------------------------
// Queue pair

/// Sizes of a QP's queues.
struct qp_capacity {
  std::uint32_t max_send_wr = 128;
  std::uint32_t max_recv_wr = 1;
  std::uint32_t max_send_sge = 1;
  std::uint32_t max_recv_sge = 1;
  std::uint32_t max_inline_data = 0;
};

/// What INIT -> RTR needs: the remote QP's number, first PSN and address.
struct rtr_params {
  std::uint32_t remote_qpn = 0;
  std::uint32_t remote_psn = 0;  ///< 24 bits
  ibv_gid remote_gid{};          ///< all zero: no GRH (InfiniBand with LID routing)
  std::uint16_t remote_lid = 0;  ///< InfiniBand only; 0 on RoCE
  std::uint8_t sgid_index = 0;   ///< the local GID to send from
  std::uint8_t port = 1;
  ibv_mtu mtu = IBV_MTU_1024;  ///< the smaller of both ports' active MTU
  std::uint8_t hop_limit = 64;
  std::uint8_t traffic_class = 0;
  std::uint8_t service_level = 0;
  std::uint8_t max_dest_rd_atomic = 1;  ///< READs the remote may have in flight to us
  std::uint8_t min_rnr_timer = 12;
};

/// What RTR -> RTS needs.
struct rts_params {
  std::uint32_t psn = 0;      ///< our first PSN, 24 bits
  std::uint8_t timeout = 14;  ///< 4.096 us * 2^timeout before a retry
  std::uint8_t retry_cnt = 7;
  std::uint8_t rnr_retry = 7;      ///< 7: retry forever
  std::uint8_t max_rd_atomic = 1;  ///< READs we may have in flight
};

/// A queue pair and its state steps, in rc_pingpong's order:
/// RESET -> to_init() -> to_rtr() -> to_rts(). to_error() flushes outstanding
/// work requests (each completes with IBV_WC_WR_FLUSH_ERR) and to_reset()
/// makes the QP reusable from to_init() on.
class queue_pair {
 public:
  queue_pair() noexcept = default;
  queue_pair(const protection_domain& pd, const completion_queue& send_cq,
             const completion_queue& recv_cq, const qp_capacity& cap,
             ibv_qp_type type = IBV_QPT_RC) {
    std::error_code ec;
    *this = queue_pair{pd, send_cq, recv_cq, cap, type, ec};
    if (ec)
      detail::throw_error(ec, "ibv_create_qp", "max_send_wr " + std::to_string(cap.max_send_wr));
  }
  queue_pair(const protection_domain& pd, const completion_queue& send_cq,
             const completion_queue& recv_cq, const qp_capacity& cap, ibv_qp_type type,
             std::error_code& ec) noexcept {
    ibv_qp_init_attr init{};
    init.send_cq = send_cq.get();
    init.recv_cq = recv_cq.get();
    init.cap.max_send_wr = cap.max_send_wr;
    init.cap.max_recv_wr = cap.max_recv_wr;
    init.cap.max_send_sge = cap.max_send_sge;
    init.cap.max_recv_sge = cap.max_recv_sge;
    init.cap.max_inline_data = cap.max_inline_data;
    init.qp_type = type;
    init.sq_sig_all = 0;  // each work request says whether it is signaled
    errno = 0;
    qp_ = handle{ibv_create_qp(pd.get(), &init)};
    ec = qp_ ? std::error_code{} : detail::errno_code(errno);
  }

  ibv_qp* get() const noexcept { return qp_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(qp_); }
  std::uint32_t qp_num() const noexcept { return qp_.get()->qp_num; }

  /// The QP's current state as the device sees it.
  ibv_qp_state state(std::error_code& ec) const noexcept {
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    ec = detail::verbs_result(ibv_query_qp(get(), &attr, IBV_QP_STATE, &init));
    return attr.qp_state;
  }

  /// RESET -> INIT: bind to `port` and grant remote peers `ibv_access`.
  void to_init(std::uint8_t port, int ibv_access, std::error_code& ec) noexcept {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = port;
    attr.qp_access_flags = static_cast<unsigned>(ibv_access);
    const int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    ec = detail::verbs_result(ibv_modify_qp(get(), &attr, mask));
  }
  void to_init(std::uint8_t port, int ibv_access) {
    std::error_code ec;
    to_init(port, ibv_access, ec);
    if (ec) throw_step(ec, "INIT");
  }

  /// INIT -> RTR: connect to the remote QP (we can receive from now on).
  void to_rtr(const rtr_params& p, std::error_code& ec) noexcept {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = p.mtu;
    attr.dest_qp_num = p.remote_qpn;
    attr.rq_psn = p.remote_psn & psn_mask;
    attr.max_dest_rd_atomic = p.max_dest_rd_atomic;
    attr.min_rnr_timer = p.min_rnr_timer;
    attr.ah_attr.dlid = p.remote_lid;
    attr.ah_attr.sl = p.service_level;
    attr.ah_attr.src_path_bits = 0;
    attr.ah_attr.port_num = p.port;
    attr.ah_attr.is_global = is_zero(p.remote_gid) ? 0 : 1;  // RoCE always routes by GID
    attr.ah_attr.grh.dgid = p.remote_gid;
    attr.ah_attr.grh.sgid_index = p.sgid_index;
    attr.ah_attr.grh.hop_limit = p.hop_limit;
    attr.ah_attr.grh.traffic_class = p.traffic_class;
    attr.ah_attr.grh.flow_label = 0;
    const int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    ec = detail::verbs_result(ibv_modify_qp(get(), &attr, mask));
  }
  void to_rtr(const rtr_params& p) {
    std::error_code ec;
    to_rtr(p, ec);
    if (ec) throw_step(ec, "RTR");
  }

  /// RTR -> RTS: we may send from now on.
  void to_rts(const rts_params& p, std::error_code& ec) noexcept {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = p.psn & psn_mask;
    attr.timeout = p.timeout;
    attr.retry_cnt = p.retry_cnt;
    attr.rnr_retry = p.rnr_retry;
    attr.max_rd_atomic = p.max_rd_atomic;
    const int mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                     IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    ec = detail::verbs_result(ibv_modify_qp(get(), &attr, mask));
  }
  void to_rts(const rts_params& p) {
    std::error_code ec;
    to_rts(p, ec);
    if (ec) throw_step(ec, "RTS");
  }

  /// Any state -> ERR: outstanding work requests complete as flushed.
  void to_error(std::error_code& ec) noexcept { to_state(IBV_QPS_ERR, ec); }
  /// Any state -> RESET: the QP can be connected again from to_init().
  void to_reset(std::error_code& ec) noexcept { to_state(IBV_QPS_RESET, ec); }

  /// Posts a chain of send work requests. On failure returns the first one
  /// not posted (it and those after it were not posted) and sets ec
  /// (ENOMEM: the send queue is full).
  ibv_send_wr* post_send(ibv_send_wr& first, std::error_code& ec) noexcept {
    ibv_send_wr* bad = nullptr;
    ec = detail::verbs_result(ibv_post_send(get(), &first, &bad));
    return ec ? bad : nullptr;
  }
  ibv_send_wr* post(rdma_work_request& first, std::error_code& ec) noexcept {
    return post_send(first.wr(), ec);
  }

 private:
  static constexpr std::uint32_t psn_mask = 0xffffffU;

  static bool is_zero(const ibv_gid& g) noexcept {
    for (std::uint8_t b : g.raw)
      if (b != 0) return false;
    return true;
  }

  void to_state(ibv_qp_state s, std::error_code& ec) noexcept {
    ibv_qp_attr attr{};
    attr.qp_state = s;
    const int mask = IBV_QP_STATE;
    ec = detail::verbs_result(ibv_modify_qp(get(), &attr, mask));
  }

  [[noreturn]] void throw_step(std::error_code ec, std::string_view state) const {
    detail::throw_error(ec, "ibv_modify_qp",
                        "QP " + std::to_string(qp_num()) + " to " + std::string{state});
  }

  using handle = detail::verbs_handle<ibv_qp, &ibv_destroy_qp>;
  handle qp_;
};

}  // namespace kvlink::rdma
