// A store client: puts and gets objects of the pool through a store master
// (store/master/server.hpp, the kvlink-master program), moving their bytes
// with a kvlink engine directly between clients, never through the master.
//
//   kvlink::engine eng{io.get_executor(), {.listen = "0.0.0.0:0"}};
//   kvlink::store::client c{eng, {.master = "10.0.0.1:50051"}};
//   co_await c.async_mount(pool, pool_bytes, asio::use_awaitable);  // serve 1 GiB to the pool
//   eng.register_segment(buf, len);                     // buffers to put from and get into
//   co_await c.async_put("key", buf, 4096, {}, asio::use_awaitable);
//   auto size = co_await c.async_get("key", buf, len, asio::use_awaitable);
//
// (examples/store_client.cpp is the whole program.)
//
// Model (Mooncake Store's): a put asks the master for space (put_start: ranges
// on distinct segments, one per replica, the object invisible), WRITEs the
// bytes into every replica at once with the engine, then makes the object
// visible (put_end) or gives the space back (put_revoke) when a write
// failed. A get asks the master where the object lies (a read lease comes
// with the answer), READs it from one replica (this client's own segment
// first: a copy; then one on the same host; then the first; another
// replica when that read fails) and fails with lease_expired when the lease
// ran out before the bytes arrived. Objects are immutable; the first writer
// wins.
//
// Buffers: the `data` of a put and the buffer of a get must lie in memory
// registered with the engine (engine::register_segment), so the engine moves
// the bytes without a copy; otherwise that key fails with not_registered.
// They must stay valid until the handler runs. Keys are copied before the
// initiating function returns. Device memory (the engine's config.device
// runtime: cuda, emulated) is a buffer like host memory: the engine stages
// or maps it for the transport, and copies to and from this client's own
// segment go through the device's stream instead of memcpy. The pool's
// segments (async_mount) are host memory. The gather/scatter forms take
// several pieces per object (buffer_piece), moved without a staging copy.
//
// Batches take columns (keys[i], data[i], sizes[i]) and write one result per
// key into the caller's `results` span, in input order; the handler's own
// error_code is for the batch as a whole (the master unreachable,
// invalid_argument for columns of different lengths). A key's result is a
// store_errc (object_not_found, no_space, object_already_exists, ...) or the
// engine's error for its transfer (peer_closed, not_registered, ...).
//
// The master: connected at the first operation (or async_connect), with the
// engine's shared secret (or client_options::auth_secret); operations fail
// with store_errc::rpc_failed while it cannot be reached and rpc_timeout
// when it does not answer within request_timeout. The client sends
// heartbeats, reconnects when the connection drops, and mounts its segments
// again when the master no longer knows it (it restarted, or declared this
// client gone), with the objects they hold: each object's bytes are followed
// in its segment by a record (store/wire/record.hpp) the putting client
// writes in the same transfer, and the owner announces the objects whose
// records check out, so a restarted master loses no completed object
// (objects put from device memory carry no record: a restart forgets them).
// Operations in flight when the connection is lost fail with rpc_failed,
// and segment ids of a master this client is no longer connected to are
// never used with another. A put whose bytes are written sends its put_end
// once more on a new connection to the same master (ending an ended put is
// a no-op) and succeeds; a put whose put_start, put_end or put_revoke
// answer was lost is given back (put_revoke) once this client reaches the
// same master again, so a flapping connection leaves no put holding space
// until the master's put_discard_timeout + put_release_timeout.
//
// The SSD tier (client_options::disk_path): objects the master evicts from
// this client's segments are first copied to a directory on this host's
// disk (store/tier/disk.hpp) when the master asks (a disk_task frame); a
// get of such an object, by any client, has this client read it back into
// one of its segments, and the reader's get waits for that (the master
// answers object_loading meanwhile; the get asks again after 100 us,
// doubling to 50 ms, up to request_timeout). What the disk holds is announced
// at every connection, so it is readable again after this client or the
// master restarts. The disk's I/O runs on two threads of its own. An I/O
// error (a full or read-only disk) takes the disk out of the pool, logged;
// the memory tier goes on.
//
// Thread safety: every member may be called from any thread; the client's
// state lives on a strand of the engine's executor, and handlers run on
// their associated executor (by default the engine's). The engine must
// outlive the client; async_close() unmounts this client's segments and
// unregisters them from the engine (the destructor only drops the master
// connection).
#pragma once

#include <kvlink/control/handshake.hpp>
#include <kvlink/core/address.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/detail/erased_handler.hpp>
#include <kvlink/detail/log.hpp>
#include <kvlink/engine.hpp>
#include <kvlink/memory/device.hpp>
#include <kvlink/metadata/etcd.hpp>
#include <kvlink/store/error.hpp>
#include <kvlink/store/tier/disk.hpp>
#include <kvlink/store/wire/leader.hpp>
#include <kvlink/store/wire/protocol.hpp>
#include <kvlink/store/wire/record.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <iterator>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <asio/async_result.hpp>
#include <asio/bind_executor.hpp>
#include <asio/co_spawn.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/read.hpp>
#include <asio/steady_timer.hpp>
#include <asio/strand.hpp>
#include <asio/thread_pool.hpp>
#include <asio/write.hpp>
#include <nlohmann/json.hpp>

namespace kvlink::store {

struct client_options {
  /// The master's "host:port", or "etcd://host:2379[,host:2379]" where
  /// masters stand for election (kvlink-master --ha-etcd): the leader of
  /// `cluster` is read from etcd at every connection (wire/leader.hpp).
  std::string master = "127.0.0.1:50051";
  /// With an etcd master: the cluster whose leader to follow ("" =
  /// $MC_STORE_CLUSTER_ID, else "mooncake_cluster", as the master's default).
  std::string cluster{};
  /// The shared secret; empty: the engine's (config.auth_secret or
  /// auth_secret_file), which is what a cluster normally shares.
  std::string auth_secret{};
  std::chrono::milliseconds connect_timeout{5'000};
  /// A request the master has not answered in this time fails with rpc_timeout.
  std::chrono::milliseconds request_timeout{10'000};
  /// Between attempts to reach a master that went away.
  std::chrono::milliseconds reconnect_interval{500};
  /// The largest reply accepted (bytes of a frame's body).
  std::uint32_t max_body = wire::default_max_body;
  /// The SSD tier: a directory on this host's disk (store/tier/disk.hpp)
  /// where objects the master evicts from this client's segments are kept,
  /// read back into a segment when they are read again, and found again
  /// after this client restarts ("" none: evicted objects are dropped).
  /// Opened by the constructor (which throws when it cannot be).
  std::string disk_path{};
  /// The most bytes the tier's files take (required with disk_path).
  std::uint64_t disk_capacity = 0;
  /// O_DIRECT where the file system takes it (false: the page cache).
  bool disk_direct_io = true;
};

/// Where one replica of an object is (client::async_describe_batch).
struct replica_location {
  std::uint64_t segment = 0;  ///< the store's id of its segment
  std::uint64_t offset = 0;   ///< where the object starts in it
  std::string address;        ///< the owner's engine address; "" when the segment is gone
  std::string host;           ///< the owner's host
  bool local = false;         ///< a segment this client mounted
};

/// One key's description (client::async_describe_batch).
struct object_description {
  std::error_code ec;  ///< {} or object_not_found, object_in_progress, invalid_key, ...
  std::uint64_t size = 0;
  std::vector<replica_location> replicas;
};

/// How a put wants its objects placed and kept (Mooncake's ReplicateConfig).
struct put_config {
  std::size_t replicas = 1;                   ///< on distinct segments, 1..8 (fewer when fewer fit)
  std::vector<std::uint64_t> preferred;       ///< store segment ids tried first (async_mount's)
  bool soft_pin = false;                      ///< evicted only when nothing else is
  std::chrono::milliseconds soft_pin_ttl{0};  ///< 0: the master's default
  bool hard_pin = false;                      ///< never evicted; removed only by force
};

/// One piece of an object's bytes in the caller's memory (registered with
/// the engine): a put gathers an object from its pieces in order, a get
/// scatters it over them (vLLM's per-layer K and V of one block, one object).
struct buffer_piece {
  void* data = nullptr;
  std::uint64_t size = 0;
};

namespace detail {

inline std::string read_secret_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

// Everything of a client, on its strand; coroutines hold it alive.
class client_state : public std::enable_shared_from_this<client_state> {
 public:
  using strand_type = asio::strand<asio::any_io_executor>;
  template <class... T>
  using result = std::tuple<std::error_code, T...>;

  client_state(engine& eng, client_options opt)
      : eng_(eng),
        opt_(std::move(opt)),
        strand_(asio::make_strand(eng.get_executor())),
        tick_(strand_),
        self_(make_instance_id()) {
    std::string secret = opt_.auth_secret;
    if (secret.empty()) secret = eng.get_config().auth_secret;
    if (secret.empty() && !eng.get_config().auth_secret_file.empty()) {
      secret = read_secret_file(eng.get_config().auth_secret_file);
    }
    if (!secret.empty()) guard_ = control::peer_guard(std::move(secret));
    std::string_view host;
    std::uint16_t port = 0;
    if (split_host_port(eng.local_address(), host, port)) host_ = std::string(host);
    if (!opt_.disk_path.empty()) {
      disk_ = std::make_shared<tier::disk_tier>(
          tier::disk_options{opt_.disk_path, opt_.disk_capacity, 0, opt_.disk_direct_io});
      disk_pool_ = std::make_unique<asio::thread_pool>(2);
      const auto st = disk_->stats();
      kvlink::detail::log("store: SSD tier at {}: {} object(s), {} of {} bytes", opt_.disk_path,
                          st.objects, st.used_bytes, opt_.disk_capacity);
    }
  }

  strand_type& strand() noexcept { return strand_; }
  asio::any_io_executor executor() const { return eng_.get_executor(); }
  std::uint64_t client_id() const noexcept { return client_id_; }

  // ------------------------------------------------------------ the master

  asio::awaitable<std::error_code> connect() {
    if (closed_) co_return make_error_code(errc::cancelled);
    if (socket_ && connected_) co_return std::error_code{};
    if (connecting_) {
      // Named, not a temporary of the co_await expression: g++ 12 destroys
      // some of those too early (see control::use_nothrow).
      auto wait = [this](auto h) { connect_waiters_.emplace_back(std::move(h), strand_); };
      auto [ec] =
          co_await asio::async_initiate<decltype(control::use_nothrow), void(std::error_code)>(
              wait, control::use_nothrow);
      co_return ec;
    }
    connecting_ = true;
    const auto ec = co_await dial();
    connecting_ = false;
    auto waiters = std::move(connect_waiters_);
    connect_waiters_.clear();
    for (auto& w : waiters) w.complete(ec);
    if (!ec && !ticking_) {
      ticking_ = true;
      asio::co_spawn(strand_, ticker(shared_from_this()), asio::detached);
    }
    co_return ec;
  }

  /// Sends one request frame (built with id 0) and waits for its reply's
  /// body. Errors: the connection's (rpc_failed, rpc_timeout, cancelled);
  /// the reply's status is the caller's to read.
  asio::awaitable<result<std::string>> call(std::string frame) {
    if (auto ec = co_await connect()) co_return result<std::string>{ec, {}};
    const std::uint64_t id = ++next_id_;
    wire::detail::put_le(reinterpret_cast<unsigned char*>(frame.data()) + 16, id, 8);
    const auto deadline = std::chrono::steady_clock::now() + opt_.request_timeout;
    auto start = [this, id, deadline, &frame](auto h) {
      pending_.emplace(
          id, pending_call{kvlink::detail::erased_handler<void(std::error_code, std::string)>(
                               std::move(h), strand_),
                           deadline});
      send(std::move(frame));
    };
    auto [ec, body] = co_await asio::async_initiate<decltype(control::use_nothrow),
                                                    void(std::error_code, std::string)>(
        start, control::use_nothrow);
    co_return result<std::string>{ec, std::move(body)};
  }

  /// call() and the reply's status; `r` reads the rest of the body.
  asio::awaitable<std::error_code> request(std::string frame, std::string& body) {
    auto [ec, b] = co_await call(std::move(frame));
    if (ec) co_return ec;
    body = std::move(b);
    wire::reader r(body);
    std::string_view message;
    const auto st = r.status(&message);
    if (!r.ok()) co_return make_error_code(errc::malformed_message);
    if (st) co_return st;
    // Hand back what follows the status.
    body.erase(0, body.size() - r.remaining());
    co_return std::error_code{};
  }

  // ------------------------------------------------------------ segments

  asio::awaitable<result<std::uint64_t>> mount(void* base, std::uint64_t size) {
    std::error_code ec;
    // The pool is host memory: this client copies into and out of its own
    // segment on the CPU when the other side is host memory.
    if (const auto& rt = eng_.device_runtime();
        rt && rt->classify(base).memory.kind == memory_kind::device) {
      kvlink::detail::log(
          "store: mount {} ({} bytes) refused: device memory; a segment of the pool is host "
          "memory (register device memory with the engine and put from it)",
          base, size);
      co_return result<std::uint64_t>{make_error_code(errc::invalid_argument), 0};
    }
    const auto seg = eng_.register_segment(base, size, access::remote_read_write, ec);
    if (ec) co_return result<std::uint64_t>{ec, 0};
    mount_rec m{static_cast<std::byte*>(base), size, seg, 0};
    if (auto mec = co_await mount_at_master(m)) {
      auto [uec] = co_await eng_.async_unregister_segment(seg, control::use_nothrow);
      (void)uec;
      co_return result<std::uint64_t>{mec, 0};
    }
    mounts_.push_back(m);
    co_return result<std::uint64_t>{std::error_code{}, m.master_segment};
  }

  // ------------------------------------------------------------ operations

  // One piece per key (the plain batch forms).
  template <class Ptr>
  static void one_piece_each(std::span<Ptr const> data, std::span<const std::uint64_t> sizes,
                             std::vector<buffer_piece>& pieces, std::vector<std::size_t>& first) {
    pieces.reserve(data.size());
    first.reserve(data.size() + 1);
    for (std::size_t i = 0; i < data.size(); ++i) {
      first.push_back(i);
      pieces.push_back({const_cast<void*>(static_cast<const void*>(data[i])), sizes[i]});
    }
    first.push_back(data.size());
  }

  // first[] and per-key byte totals of `counts` pieces each; false when
  // the counts do not add up to pieces.size() or a total overflows.
  static bool split_pieces(std::span<const buffer_piece> pieces,
                           std::span<const std::uint32_t> counts, std::vector<std::size_t>& first,
                           std::vector<std::uint64_t>& totals) {
    first.assign(1, 0);
    totals.clear();
    std::size_t at = 0;
    for (const auto c : counts) {
      if (c > pieces.size() - at) return false;
      std::uint64_t total = 0;
      for (std::size_t p = at; p < at + c; ++p) {
        if (pieces[p].size > UINT64_MAX - total) return false;
        total += pieces[p].size;
      }
      at += c;
      first.push_back(at);
      totals.push_back(total);
    }
    return at == pieces.size();
  }

  // Key i's bytes are pieces[first[i]] .. pieces[first[i + 1] - 1], in
  // order (first has one entry more than keys): one piece per key for the
  // plain forms, several for the gather/scatter ones.
  struct put_batch_args {
    std::vector<std::string> keys;
    std::vector<buffer_piece> pieces;
    std::vector<std::size_t> first;
    std::vector<std::uint64_t> sizes;  ///< key i's bytes: its pieces' sum
    std::vector<std::string> parents;
    put_config cfg;
    std::span<std::error_code> results;
  };

  asio::awaitable<std::error_code> put(put_batch_args a) {
    const std::size_t n = a.keys.size();
    std::fill(a.results.begin(), a.results.end(), std::error_code{});
    if (n == 0) co_return std::error_code{};
    wire::writer w(wire::message_type::put_start, 0, false);
    {
      wire::put_start_request q;
      q.replicas = static_cast<std::uint8_t>(a.cfg.replicas);
      q.flags = static_cast<std::uint8_t>((a.cfg.soft_pin ? q.flag_soft_pin : 0) |
                                          (a.cfg.hard_pin ? q.flag_hard_pin : 0));
      q.soft_pin_ms = static_cast<std::uint32_t>(
          std::min<std::int64_t>(a.cfg.soft_pin_ttl.count(), UINT32_MAX));
      q.preferred = a.cfg.preferred;
      q.keys.assign(a.keys.begin(), a.keys.end());
      q.sizes = a.sizes;
      q.parents.assign(a.parents.begin(), a.parents.end());
      q.encode(w);
    }
    std::string body;
    std::string frame = w.take();
    // The master placing these puts: only it may end or revoke them.
    if (auto ec = co_await connect()) co_return ec;
    const instance_id master = master_;
    const put_claim claim(*this, a.keys);
    if (auto ec = co_await request(std::move(frame), body)) {
      // Sent: the master may have placed some of them.
      if (lost(ec)) leave_unsettled(a.keys, {}, master);
      co_return ec;
    }
    // Segment ids are this master's: the put ends where it started.
    const std::uint64_t epoch = epoch_;
    const bool records = records_;  // this master's choice
    wire::placement_list placed;
    {
      wire::reader r(body);
      if (placed.decode(r, false) || placed.entries.size() != n) {
        co_return make_error_code(errc::malformed_message);
      }
    }
    // Each object's record (store/wire/record.hpp) goes with its bytes, so
    // that the segment's owner can announce it to a master that comes up
    // empty. Its checksum needs the bytes on the CPU: objects put from
    // device memory get none (a master restart forgets them).
    std::vector<std::uint64_t> rec_at(n, no_record);
    std::uint64_t rec_bytes = 0;
    for (std::size_t i = 0; i < n && records; ++i) {
      if (placed.entries[i].code != 0 || !recordable(a, i)) continue;
      rec_at[i] = rec_bytes;
      rec_bytes += wire::record_size(a.keys[i].size());
    }
    record_room room;
    if (rec_bytes != 0) {
      if (auto ec = records_room(rec_bytes, room)) {
        kvlink::detail::log("store: no memory for object records ({}): puts go without them",
                            ec.message());
        std::fill(rec_at.begin(), rec_at.end(), no_record);
      }
      for (std::size_t i = 0; i < n; ++i) {
        if (rec_at[i] == no_record) continue;
        std::uint32_t crc = 0;
        for (std::size_t p = a.first[i]; p < a.first[i + 1]; ++p) {
          crc = kvlink::crc32c(a.pieces[p].data, a.pieces[p].size, crc);
        }
        wire::encode_record(a.keys[i], a.sizes[i], crc,
                            {room.base + rec_at[i], wire::record_size(a.keys[i].size())});
      }
    }
    // The writes: every replica of every placed key, grouped by peer.
    std::vector<char> placed_ok(n, 0);
    std::vector<group> groups;
    std::vector<local_copy> copies;
    for (std::size_t i = 0; i < n; ++i) {
      const auto& e = placed.entries[i];
      if (e.code != 0) {
        a.results[i] = store_error(e.code);
        continue;
      }
      placed_ok[i] = 1;
      const std::uint64_t footprint =
          records ? wire::object_footprint(a.sizes[i], a.keys[i].size()) : a.sizes[i];
      for (const auto& rep : e.list()) {
        const location* loc = nullptr;
        if (auto ec = co_await locate(rep.segment, loc, epoch)) {
          if (!a.results[i]) a.results[i] = ec;
          continue;
        }
        if (footprint == 0 || rep.offset > loc->size || footprint > loc->size - rep.offset) {
          a.results[i] = make_error_code(store_errc::internal_error);
          continue;
        }
        if (rec_at[i] != no_record) {
          const std::uint64_t rat = rep.offset + wire::record_offset(a.sizes[i]);
          std::byte* rec = room.base + rec_at[i];
          const std::uint64_t rn = wire::record_size(a.keys[i].size());
          if (loc->local != nullptr) {
            copies.push_back({loc->local + rat, rec, rn, i, true});
          } else {
            group_of(groups, loc->remote.peer, rep.segment)
                .add(i, transfer_request{opcode::write, rec, loc->remote, rat, rn});
          }
        }
        std::uint64_t at = rep.offset;
        for (std::size_t p = a.first[i]; p < a.first[i + 1]; ++p) {
          const auto& piece = a.pieces[p];
          if (piece.size == 0) continue;
          if (loc->local != nullptr) {
            copies.push_back({loc->local + at, piece.data, piece.size, i, true});
          } else {
            group_of(groups, loc->remote.peer, rep.segment)
                .add(i, transfer_request{opcode::write, piece.data, loc->remote, at, piece.size});
          }
          at += piece.size;
        }
      }
    }
    if (!copies.empty()) co_await run_copies(copies, a.results);
    co_await run_groups(groups);
    release(room);
    for (auto& g : groups) {
      if (!g.ec) continue;
      forget(g.segment);
      for (const auto k : g.keys) {
        if (!a.results[k]) a.results[k] = g.ec;
      }
    }
    // Visible, or given back.
    std::vector<std::size_t> done, failed;
    for (std::size_t i = 0; i < n; ++i) {
      if (!placed_ok[i]) continue;
      (a.results[i] ? failed : done).push_back(i);
    }
    if (!failed.empty()) {
      std::vector<std::error_code> ignored(failed.size());
      const auto ec =
          co_await keys_call(wire::message_type::put_revoke, a.keys, failed, false, ignored);
      if (lost(ec)) leave_unsettled(a.keys, failed, master);
    }
    if (!done.empty() && master != master_) {
      // The master that placed these is gone; its successor takes the
      // objects back from their records, or never saw them.
      for (const auto i : done) a.results[i] = make_error_code(store_errc::rpc_failed);
      done.clear();
    }
    if (!done.empty()) {
      // The connection may have broken and come back since put_start (the
      // epoch moved on): the same master still holds these puts as ours.
      std::vector<std::error_code> codes(done.size());
      auto ec = co_await keys_call(wire::message_type::put_end, a.keys, done, false, codes);
      if (lost(ec)) {
        // Once more on a new connection to the same master: ending an
        // ended put of ours is a no-op. Keys another put of this client has
        // in flight are not (if ours was discarded, theirs may be the one
        // the master holds): they are given back later instead.
        const bool sole =
            std::all_of(done.begin(), done.end(), [&](auto i) { return claim.sole(a.keys[i]); });
        if (sole) {
          const auto cec = co_await connect();
          if (!cec && master_ == master) {
            ec = co_await keys_call(wire::message_type::put_end, a.keys, done, false, codes);
          }
        }
      }
      if (ec) {
        for (const auto i : done) a.results[i] = ec;
        if (lost(ec)) leave_unsettled(a.keys, done, master);
      } else {
        for (std::size_t j = 0; j < done.size(); ++j) a.results[done[j]] = codes[j];
      }
    }
    co_return std::error_code{};
  }

  struct get_batch_args {
    std::vector<std::string> keys;
    std::vector<buffer_piece> pieces;  ///< as put_batch_args'
    std::vector<std::size_t> first;
    std::vector<std::uint64_t> capacities;  ///< key i's pieces' sum
    std::span<std::uint64_t> sizes;
    std::span<std::error_code> results;
  };

  // A get whose keys on a disk only are asked for again (the master reads
  // them back into memory meanwhile: object_loading) after 100 us, doubling
  // to 50 ms, until they arrive or request_timeout passes. A 64 KiB load
  // takes a few hundred microseconds: a first wait of 1 ms made a get of a
  // disk-only object 4-8 times slower than its disk read.
  asio::awaitable<std::error_code> get(get_batch_args a) {
    const auto deadline = std::chrono::steady_clock::now() + opt_.request_timeout;
    if (auto ec = co_await get_once(a)) co_return ec;
    auto delay = std::chrono::microseconds(100);
    for (;;) {
      std::vector<std::size_t> waiting;
      for (std::size_t i = 0; i < a.keys.size(); ++i) {
        if (a.results[i] == store_errc::object_loading) waiting.push_back(i);
      }
      if (waiting.empty() || closed_ || std::chrono::steady_clock::now() >= deadline) break;
      asio::steady_timer pause(strand_, delay);
      (void)co_await pause.async_wait(control::use_nothrow);
      delay = std::min<std::chrono::microseconds>(delay * 2, std::chrono::milliseconds(50));
      get_batch_args b;
      std::vector<std::error_code> results(waiting.size());
      std::vector<std::uint64_t> sizes(waiting.size());
      b.first.push_back(0);
      for (const std::size_t i : waiting) {
        b.keys.push_back(a.keys[i]);
        for (std::size_t p = a.first[i]; p < a.first[i + 1]; ++p) b.pieces.push_back(a.pieces[p]);
        b.first.push_back(b.pieces.size());
        b.capacities.push_back(a.capacities[i]);
      }
      b.results = results;
      b.sizes = sizes;
      const auto ec = co_await get_once(b);
      for (std::size_t k = 0; k < waiting.size(); ++k) {
        a.results[waiting[k]] = ec ? ec : results[k];
        a.sizes[waiting[k]] = ec ? 0 : sizes[k];
      }
      if (ec) break;
    }
    co_return std::error_code{};
  }

  asio::awaitable<std::error_code> get_once(get_batch_args& a) {
    const std::size_t n = a.keys.size();
    std::fill(a.results.begin(), a.results.end(), std::error_code{});
    std::fill(a.sizes.begin(), a.sizes.end(), std::uint64_t{0});
    if (n == 0) co_return std::error_code{};
    wire::writer w(wire::message_type::get, 0, false);
    wire::key_batch q;
    q.keys.assign(a.keys.begin(), a.keys.end());
    q.encode(w, false);
    const auto sent = std::chrono::steady_clock::now();
    std::string body;
    std::string frame = w.take();
    if (auto ec = co_await request(std::move(frame), body)) co_return ec;
    const std::uint64_t epoch = epoch_;  // the segment ids are this master's
    wire::placement_list placed;
    {
      wire::reader r(body);
      if (placed.decode(r, true) || placed.entries.size() != n) {
        co_return make_error_code(errc::malformed_message);
      }
    }
    // Replicas in the order they are tried: ours, this host's, the rest.
    std::vector<std::vector<wire::wire_replica>> order(n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto& e = placed.entries[i];
      if (e.code != 0) {
        a.results[i] = store_error(e.code);
        continue;
      }
      if (e.size > a.capacities[i]) {
        a.results[i] = make_error_code(store_errc::buffer_overflow);
        a.sizes[i] = e.size;  // what a buffer must hold (a retry knows its size)
        continue;
      }
      a.sizes[i] = e.size;
      std::vector<std::pair<int, wire::wire_replica>> ranked;
      for (const auto& rep : e.list()) {
        const location* loc = nullptr;
        const int rank = co_await locate(rep.segment, loc, epoch) ? 3
                         : loc->local != nullptr                  ? 0
                         : loc->host == host_                     ? 1
                                                                  : 2;
        ranked.emplace_back(rank, rep);
      }
      std::stable_sort(ranked.begin(), ranked.end(),
                       [](const auto& x, const auto& y) { return x.first < y.first; });
      for (const auto& [rank, rep] : ranked) order[i].push_back(rep);
      if (order[i].empty()) a.results[i] = make_error_code(store_errc::object_not_found);
    }
    // Rounds: each key reads its next replica until one read succeeds.
    std::vector<std::size_t> next(n, 0);
    std::vector<char> pending(n, 0);
    for (std::size_t i = 0; i < n; ++i) pending[i] = !a.results[i] && !order[i].empty();
    for (std::size_t round = 0; round < wire::max_wire_replicas; ++round) {
      std::vector<group> groups;
      std::vector<local_copy> copies;
      bool any = false;
      for (std::size_t i = 0; i < n; ++i) {
        if (!pending[i]) continue;
        if (next[i] >= order[i].size()) {
          pending[i] = 0;
          continue;
        }
        const auto rep = order[i][next[i]++];
        const location* loc = nullptr;
        if (auto ec = co_await locate(rep.segment, loc, epoch)) {
          a.results[i] = ec;
          continue;
        }
        if (rep.offset > loc->size || a.sizes[i] > loc->size - rep.offset) {
          a.results[i] = make_error_code(store_errc::internal_error);
          continue;
        }
        // The object's bytes over the key's pieces, the last one filled as
        // far as the object goes.
        std::uint64_t at = rep.offset;
        std::uint64_t left = a.sizes[i];
        for (std::size_t p = a.first[i]; p < a.first[i + 1] && left > 0; ++p) {
          const auto step = std::min(a.pieces[p].size, left);
          if (step == 0) continue;
          if (loc->local != nullptr) {
            copies.push_back({a.pieces[p].data, loc->local + at, step, i, false});
          } else {
            any = true;
            group_of(groups, loc->remote.peer, rep.segment)
                .add(i, transfer_request{opcode::read, a.pieces[p].data, loc->remote, at, step});
          }
          at += step;
          left -= step;
        }
        if (loc->local != nullptr) {
          a.results[i] = {};
          pending[i] = 0;
        }
      }
      if (!copies.empty()) {
        co_await run_copies(copies, a.results);
        // A copy that failed (a device's) is not retried from another replica.
        for (const auto& c : copies) pending[c.key] = 0;
      }
      if (!any) break;
      co_await run_groups(groups);
      for (auto& g : groups) {
        if (g.ec) forget(g.segment);
        for (const auto k : g.keys) {
          a.results[k] = g.ec;
          if (!g.ec) pending[k] = 0;
        }
      }
    }
    // The lease: the read must have finished before it ran out (it is
    // counted from when the request left, so never later than the master's).
    const auto now = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < n; ++i) {
      if (a.results[i] || placed.entries[i].code != 0) {
        if (a.results[i] && a.results[i] != store_errc::buffer_overflow) a.sizes[i] = 0;
        continue;
      }
      if (now > sent + std::chrono::milliseconds(placed.entries[i].lease_ms)) {
        a.results[i] = make_error_code(store_errc::lease_expired);
        a.sizes[i] = 0;
      }
    }
    co_return std::error_code{};
  }

  // Where keys' objects are, without a lease and without connecting to
  // their owners: one replicas request, then one segment_info per segment
  // this client has not located yet.
  asio::awaitable<result<>> describe(std::vector<std::string> keys,
                                     std::span<object_description> out, bool ok) {
    if (!ok) co_return result<>{make_error_code(errc::invalid_argument)};
    for (auto& d : out) d = object_description{};
    if (keys.empty()) co_return result<>{};
    wire::writer w(wire::message_type::replicas, 0, false);
    wire::key_batch q;
    q.keys.assign(keys.begin(), keys.end());
    q.encode(w, false);
    std::string body;
    std::string frame = w.take();
    if (auto ec = co_await request(std::move(frame), body)) co_return result<>{ec};
    wire::placement_list placed;
    {
      wire::reader r(body);
      if (placed.decode(r, true) || placed.entries.size() != keys.size()) {
        co_return result<>{make_error_code(errc::malformed_message)};
      }
    }
    std::map<std::uint64_t, replica_location> seen;  // by segment, offset 0
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const auto& e = placed.entries[i];
      if (e.code != 0) {
        out[i].ec = store_error(e.code);
        continue;
      }
      out[i].size = e.size;
      for (const auto& rep : e.list()) {
        auto it = seen.find(rep.segment);
        if (it == seen.end()) {
          replica_location where;
          where.segment = rep.segment;
          for (const auto& m : mounts_)
            where.local = where.local || m.master_segment == rep.segment;
          if (where.local) {
            where.address = eng_.local_address();
            where.host = host_;
          } else {
            wire::writer sw(wire::message_type::segment_info, 0, false);
            sw.u64(rep.segment);
            std::string sbody;
            std::string sframe = sw.take();
            const auto sec = co_await request(std::move(sframe), sbody);
            if (sec && sec != store_errc::segment_not_found) co_return result<>{sec};
            wire::segment_location l;
            wire::reader r(sbody);
            if (!sec && !l.decode(r)) {
              where.address = std::string(l.address);
              where.host = std::string(l.host);
            }
          }
          it = seen.emplace(rep.segment, std::move(where)).first;
        }
        replica_location one = it->second;
        one.offset = rep.offset;
        out[i].replicas.push_back(std::move(one));
      }
    }
    co_return result<>{};
  }

  /// exists (0: it exists), remove, put_end, put_revoke over all `keys`.
  asio::awaitable<std::error_code> keys_op(wire::message_type type, std::vector<std::string> keys,
                                           bool force, std::span<std::error_code> results) {
    std::vector<std::size_t> all(keys.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    std::fill(results.begin(), results.end(), std::error_code{});
    if (keys.empty()) co_return std::error_code{};
    co_return co_await keys_call(type, keys, all, force, results);
  }

  // Single-key forms and checked batches, for the initiating functions.
  asio::awaitable<result<>> connect_op() { co_return result<>{co_await connect()}; }
  asio::awaitable<result<>> close_op() { co_return result<>{co_await close()}; }
  asio::awaitable<result<>> put_op(put_batch_args a, bool ok) {
    if (!ok) co_return result<>{make_error_code(errc::invalid_argument)};
    const auto results = a.results;
    co_return result<>{interrupted(co_await put(std::move(a)), results)};
  }
  asio::awaitable<result<>> put_one(put_batch_args a) {
    std::error_code r;
    a.results = std::span<std::error_code>(&r, 1);
    const auto ec = co_await put(std::move(a));
    co_return result<>{ec ? ec : r};
  }
  asio::awaitable<result<>> get_op(get_batch_args a, bool ok) {
    if (!ok) co_return result<>{make_error_code(errc::invalid_argument)};
    const auto results = a.results;
    co_return result<>{interrupted(co_await get(std::move(a)), results)};
  }
  // A batch that the client's close cut short fails as a whole with
  // cancelled (as a call that starts after it does), not with keys failed
  // one by one; one that finished before the close stands.
  std::error_code interrupted(std::error_code ec, std::span<const std::error_code> results) const {
    if (ec || !closed_) return ec;
    const bool cut = std::any_of(results.begin(), results.end(),
                                 [](const std::error_code& r) { return static_cast<bool>(r); });
    return cut ? make_error_code(errc::cancelled) : ec;
  }
  asio::awaitable<result<std::uint64_t>> get_one(get_batch_args a) {
    std::error_code r;
    std::uint64_t size = 0;
    a.results = std::span<std::error_code>(&r, 1);
    a.sizes = std::span<std::uint64_t>(&size, 1);
    const auto ec = co_await get(std::move(a));
    if (ec) co_return result<std::uint64_t>{ec, 0};
    if (r) co_return result<std::uint64_t>{r, r == store_errc::buffer_overflow ? size : 0};
    co_return result<std::uint64_t>{std::error_code{}, size};
  }
  asio::awaitable<result<>> keys_batch(wire::message_type type, std::vector<std::string> keys,
                                       bool force, std::span<std::error_code> results, bool ok) {
    if (!ok) co_return result<>{make_error_code(errc::invalid_argument)};
    co_return result<>{co_await keys_op(type, std::move(keys), force, results)};
  }
  asio::awaitable<result<>> remove_one(std::string key, bool force) {
    std::error_code r;
    std::vector<std::string> keys{std::move(key)};
    const auto ec = co_await keys_op(wire::message_type::remove, std::move(keys), force,
                                     std::span<std::error_code>(&r, 1));
    co_return result<>{ec ? ec : r};
  }
  asio::awaitable<result<bool>> exists_one(std::string key) {
    std::error_code r;
    std::vector<std::string> keys{std::move(key)};
    const auto ec = co_await keys_op(wire::message_type::exists, std::move(keys), false,
                                     std::span<std::error_code>(&r, 1));
    if (ec) co_return result<bool>{ec, false};
    if (!r) co_return result<bool>{std::error_code{}, true};
    if (r == store_errc::object_not_found || r == store_errc::object_in_progress) {
      co_return result<bool>{std::error_code{}, false};
    }
    co_return result<bool>{r, false};
  }

  asio::awaitable<result<std::uint64_t>> remove_all(bool force) {
    wire::writer w(wire::message_type::remove_all, 0, false);
    w.u8(force ? 1 : 0);
    std::string body;
    std::string frame = w.take();
    if (auto ec = co_await request(std::move(frame), body)) co_return result<std::uint64_t>{ec, 0};
    wire::reader r(body);
    const auto n = r.u64();
    if (auto ec = r.finish()) co_return result<std::uint64_t>{ec, 0};
    co_return result<std::uint64_t>{std::error_code{}, n};
  }

  asio::awaitable<result<wire::stats_reply>> stats() {
    wire::writer w(wire::message_type::stats, 0, false);
    std::string body;
    std::string frame = w.take();
    if (auto ec = co_await request(std::move(frame), body))
      co_return result<wire::stats_reply>{ec, {}};
    wire::reader r(body);
    wire::stats_reply s;
    if (auto ec = s.decode(r)) co_return result<wire::stats_reply>{ec, {}};
    co_return result<wire::stats_reply>{std::error_code{}, s};
  }

  // The disk's threads stop: tasks not started are dropped (the master
  // gives them up), the ones running finish before this returns.
  void stop_disk() {
    if (!disk_pool_) return;
    disk_pool_->stop();
    disk_pool_->join();
  }

  // The destructor's: no more operations, no I/O, the engine untouched.
  void abandon() {
    closed_ = true;
    stop_disk();
    if (etcd_) etcd_->shutdown();
    drop_connection(make_error_code(errc::cancelled));
    tick_.cancel();
  }

  asio::awaitable<std::error_code> close() {
    if (closed_) co_return std::error_code{};
    // Our segments leave the pool first (their objects with them), then
    // the engine forgets them.
    if (connected_) {
      if (disk_) {
        // Its objects cannot be read while this client is away; they come
        // back with its manifest when it mounts the disk again.
        wire::writer w(wire::message_type::disk_mount, 0, false);
        w.u64(0);
        w.u8(0);
        std::string body;
        std::string frame = w.take();
        (void)co_await request(std::move(frame), body);
      }
      for (const auto& m : mounts_) (void)co_await unmount_at_master(m);
    }
    closed_ = true;
    stop_disk();
    // The tier's directory is free for another client once close completes
    // (the pool first: tasks it never ran hold the tier too).
    disk_pool_.reset();
    disk_.reset();
    for (const auto& m : mounts_) {
      auto [ec] = co_await eng_.async_unregister_segment(m.engine_segment, control::use_nothrow);
      (void)ec;
    }
    mounts_.clear();
    drop_arena_now();  // a batch still writing from it fails with not_registered
    if (etcd_) etcd_->shutdown();
    drop_connection(make_error_code(errc::cancelled));
    tick_.cancel();
    co_return std::error_code{};
  }

 private:
  struct pending_call {
    kvlink::detail::erased_handler<void(std::error_code, std::string)> handler;
    std::chrono::steady_clock::time_point deadline;
  };
  struct mount_rec {
    std::byte* base = nullptr;
    std::uint64_t size = 0;
    segment_id engine_segment{};
    std::uint64_t master_segment = 0;
    /// Its objects are being announced over several frames (the master
    /// keeps it closed meanwhile); still true after a failure: it is
    /// unmounted and announced again at the next connection.
    bool announcing = false;
  };
  struct location {
    std::byte* local = nullptr;  ///< this client's own segment: copied, not transferred
    remote_segment remote{};
    std::uint64_t size = 0;
    std::string host;
  };
  // A copy between the caller's memory and this client's own segment.
  struct local_copy {
    void* dst = nullptr;
    const void* src = nullptr;
    std::uint64_t n = 0;
    std::size_t key = 0;
    bool from_caller = true;  ///< src is the caller's memory (a put), else dst (a get)
  };
  // Transfers to one peer's segment, and the keys they carry.
  struct group {
    peer_id peer;
    std::uint64_t segment = 0;
    std::vector<transfer_request> reqs;
    std::vector<std::size_t> keys;
    std::error_code ec;
    void add(std::size_t key, const transfer_request& r) {
      reqs.push_back(r);
      keys.push_back(key);
    }
  };

  static std::error_code store_error(std::uint32_t code) {
    return {static_cast<int>(code), store_error_category()};
  }

  static constexpr std::uint64_t no_record = UINT64_MAX;

  // Whether key i's record can be made: its pieces all lie in registered
  // host memory (the checksum reads them on the CPU; a piece outside
  // registered memory is never read: its transfer fails with
  // not_registered or out_of_bounds and the put with it).
  bool recordable(const put_batch_args& a, std::size_t i) const {
    for (std::size_t p = a.first[i]; p < a.first[i + 1]; ++p) {
      if (a.pieces[p].size == 0) continue;
      segment_info where;
      if (eng_.find_segment(a.pieces[p].data, a.pieces[p].size, where) ||
          where.memory.kind == memory_kind::device) {
        return false;
      }
    }
    return true;
  }

  // Registered memory the records of one put batch are written from: the
  // client's arena (registered once, grown while no batch uses it), or,
  // while another batch holds it, a buffer of this batch's own.
  struct record_room {
    std::byte* base = nullptr;
    std::shared_ptr<std::byte[]> own;  // a buffer of this batch's own
    segment_id own_segment{};
    std::shared_ptr<std::byte[]> arena;  // the arena, alive while the batch uses it
  };

  std::error_code records_room(std::uint64_t n, record_room& out) {
    std::error_code ec;
    std::lock_guard lock{arena_mu_};
    if (arena_users_ == 0) {
      arena_used_ = 0;
      if (n > arena_cap_) {
        drop_arena();
        const std::uint64_t cap = std::max<std::uint64_t>(n * 2, 64u << 10);
        auto mem = std::shared_ptr<std::byte[]>(new std::byte[cap]);
        const auto seg = eng_.register_segment(mem.get(), cap, access::none, ec);
        if (ec) return ec;
        arena_ = std::move(mem);
        arena_cap_ = cap;
        arena_segment_ = seg;
      }
    }
    if (arena_ && arena_cap_ - arena_used_ >= n) {
      out.base = arena_.get() + arena_used_;
      out.arena = arena_;  // ~client() may drop the arena meanwhile
      arena_used_ += n;
      ++arena_users_;
      return {};
    }
    auto mem = std::shared_ptr<std::byte[]>(new std::byte[n]);
    const auto seg = eng_.register_segment(mem.get(), n, access::none, ec);
    if (ec) return ec;
    out.base = mem.get();
    out.own = std::move(mem);
    out.own_segment = seg;
    return {};
  }

  void release(record_room& r) {
    if (r.base == nullptr) return;
    if (r.own) {
      eng_.async_unregister_segment(r.own_segment, [keep = std::move(r.own)](std::error_code) {});
    } else {
      std::lock_guard lock{arena_mu_};
      --arena_users_;
      r.arena.reset();
    }
    r.base = nullptr;
  }

  // The arena leaves the engine (its memory kept until it has).
  // ~client() calls it from the caller's thread (the engine is alive then,
  // as it must outlive the client), so its fields are under arena_mu_.
 public:
  void drop_arena_now() {
    std::lock_guard lock{arena_mu_};
    drop_arena();
  }

 private:
  void drop_arena() {  // under arena_mu_
    if (!arena_) return;
    eng_.async_unregister_segment(arena_segment_, [keep = std::move(arena_)](std::error_code) {});
    arena_.reset();
    arena_cap_ = arena_used_ = 0;
  }

  static group& group_of(std::vector<group>& gs, peer_id p, std::uint64_t segment) {
    for (auto& g : gs) {
      if (g.segment == segment) return g;
    }
    gs.push_back(group{p, segment, {}, {}, {}});
    return gs.back();
  }

  // Submits every group at once; each gets its transfer's error.
  asio::awaitable<void> run_groups(std::vector<group>& groups) {
    if (groups.empty()) co_return;
    struct join {
      std::size_t left = 0;
      kvlink::detail::erased_handler<void(std::error_code)> done;
    };
    auto j = std::make_shared<join>();
    j->left = groups.size();
    for (auto& g : groups) {
      eng_.async_submit_transfer(g.reqs,
                                 asio::bind_executor(asio::any_io_executor(strand_),
                                                     [j, &g](std::error_code ec, transfer_result) {
                                                       g.ec = ec;
                                                       if (--j->left == 0) j->done.complete({});
                                                     }));
    }
    // Named, not a temporary of the co_await expression: g++ 12 destroyed
    // that temporary (and the shared_ptr it holds) twice (ASan, unit.store).
    auto wait = [this, j](auto h) {
      j->done = kvlink::detail::erased_handler<void(std::error_code)>(std::move(h), strand_);
      if (j->left == 0) j->done.complete({});
    };
    auto [ec] =
        co_await asio::async_initiate<decltype(control::use_nothrow), void(std::error_code)>(
            wait, control::use_nothrow);
    (void)ec;
  }

  // Copies between the caller's memory and this client's own segment:
  // memcpy for host memory, the device's stream (the engine's runtime) for
  // device memory. The caller's side must lie in memory registered with the
  // engine, as a transfer's must (not_registered, out_of_bounds otherwise:
  // nothing is copied). A failed copy sets its key's result.
  asio::awaitable<void> run_copies(std::vector<local_copy>& copies,
                                   std::span<std::error_code> results) {
    const auto& rt = eng_.device_runtime();
    struct join {
      std::size_t left = 1;  // the issuing loop's own
      kvlink::detail::erased_handler<void(std::error_code)> done;
      bool waiting = false;
      std::vector<std::error_code> errs;  // per copy
    };
    auto j = std::make_shared<join>();
    j->errs.resize(copies.size());
    auto& errs = j->errs;
    for (std::size_t c = 0; c < copies.size(); ++c) {
      auto& cp = copies[c];
      segment_info caller;
      if (auto ec = eng_.find_segment(cp.from_caller ? cp.src : cp.dst, cp.n, caller)) {
        errs[c] = ec;
        continue;
      }
      // The own segment is host memory (mount refuses device memory).
      memory_desc dst_m{}, src_m{};
      (cp.from_caller ? src_m : dst_m) = caller.memory;
      if (!rt || caller.memory.kind != memory_kind::device) {
        std::memcpy(cp.dst, cp.src, cp.n);
        continue;
      }
      const auto device = caller.memory.device;
      std::string what;
      auto stream = stream_of(device, errs[c], what);
      if (!stream) {
        kvlink::detail::log("store: no copy stream on device {} for key {}: {}", device, cp.key,
                            what);
        continue;
      }
      ++j->left;
      stream->async_copy(cp.dst, dst_m, cp.src, src_m, cp.n, [j, c](std::error_code ec) {
        j->errs[c] = ec;
        if (--j->left == 0 && j->waiting) j->done.complete({});
      });
    }
    if (--j->left != 0) {
      // Named, not a temporary of the co_await expression (see run_groups).
      auto wait = [this, j](auto h) {
        j->done = kvlink::detail::erased_handler<void(std::error_code)>(std::move(h), strand_);
        j->waiting = true;
        if (j->left == 0) j->done.complete({});
      };
      auto [ec] =
          co_await asio::async_initiate<decltype(control::use_nothrow), void(std::error_code)>(
              wait, control::use_nothrow);
      (void)ec;
    }
    for (std::size_t c = 0; c < copies.size(); ++c) {
      if (errs[c] && !results[copies[c].key]) results[copies[c].key] = errs[c];
    }
  }

  // The engine runtime's stream on `device`, opened at first use; its
  // completions run on the strand.
  std::shared_ptr<device_stream> stream_of(std::int32_t device, std::error_code& ec,
                                           std::string& what) {
    if (auto it = streams_.find(device); it != streams_.end()) return it->second;
    const auto& rt = eng_.device_runtime();
    auto s = rt->open_stream(device, asio::any_io_executor(strand_), ec, what);
    if (s) streams_.emplace(device, s);
    return s;
  }

  // Where a store segment's bytes are: ours, or a peer's (connected).
  // `epoch`: the connection the segment id came from; an id of a master
  // that has since been replaced (the client reconnected) names nothing
  // (rpc_failed): the new master's ids are its own.
  asio::awaitable<std::error_code> locate(std::uint64_t segment, const location*& out,
                                          std::uint64_t epoch) {
    if (epoch != epoch_) co_return make_error_code(store_errc::rpc_failed);
    if (auto it = locations_.find(segment); it != locations_.end()) {
      out = &it->second;
      co_return std::error_code{};
    }
    for (const auto& m : mounts_) {
      if (m.master_segment == segment) {
        auto& loc = locations_[segment];
        loc.local = m.base;
        loc.size = m.size;
        loc.host = host_;
        out = &loc;
        co_return std::error_code{};
      }
    }
    wire::writer w(wire::message_type::segment_info, 0, false);
    w.u64(segment);
    std::string body;
    std::string frame = w.take();
    if (auto ec = co_await request(std::move(frame), body)) co_return ec;
    if (epoch != epoch_) co_return make_error_code(store_errc::rpc_failed);
    wire::segment_location where;
    {
      wire::reader r(body);
      if (auto ec = where.decode(r)) co_return ec;
    }
    const std::string address(where.address);
    const std::string host(where.host);
    const std::uint64_t engine_segment = where.engine_segment;
    const std::uint64_t size = where.size;
    if (address.empty()) co_return make_error_code(store_errc::segment_not_found);
    auto [cec, p] = co_await eng_.async_connect(address, control::use_nothrow);
    if (cec) co_return cec;
    if (epoch != epoch_) co_return make_error_code(store_errc::rpc_failed);
    auto& loc = locations_[segment];
    loc.remote = p.segment(segment_id{engine_segment});
    loc.size = size;
    loc.host = host;
    out = &loc;
    co_return std::error_code{};
  }

  void forget(std::uint64_t segment) {
    auto it = locations_.find(segment);
    if (it != locations_.end() && it->second.local == nullptr) locations_.erase(it);
  }

  // ------------------------------------------------------- lost answers

  // An error after which the master may or may not have done what was asked
  // (the connection broke with the request sent, or no answer in time).
  static bool lost(std::error_code ec) noexcept {
    return ec == store_errc::rpc_failed || ec == store_errc::rpc_timeout;
  }

  // A put's keys counted in putting_ while it runs.
  class put_claim {
   public:
    put_claim(client_state& c, const std::vector<std::string>& keys) : c_(c), keys_(keys) {
      for (const auto& k : keys_) ++c_.putting_[k];
    }
    ~put_claim() {
      for (const auto& k : keys_) {
        auto it = c_.putting_.find(k);
        if (--it->second == 0) c_.putting_.erase(it);
      }
    }
    put_claim(const put_claim&) = delete;
    put_claim& operator=(const put_claim&) = delete;
    /// No other put of this client has `key` in flight.
    bool sole(std::string_view key) const { return c_.putting_.find(key)->second == 1; }

   private:
    client_state& c_;
    const std::vector<std::string>& keys_;
  };

  // Puts of keys[which] (all keys when `which` is empty) the master may
  // hold in progress: the answer to their put_start, put_end or put_revoke
  // was lost. Left alone, the master would keep their space for
  // put_discard_timeout + put_release_timeout (30 s + 10 min by default),
  // and a flapping connection could fill the pool; the ticker gives them
  // back (settle).
  void leave_unsettled(const std::vector<std::string>& keys, const std::vector<std::size_t>& which,
                       const instance_id& master) {
    const auto until = std::chrono::steady_clock::now() + unsettled_horizon;
    // Beyond max_unsettled the new ones are dropped (counted), never older
    // ones: settle holds iterators to those across its revoke.
    auto add = [&](const std::string& k) {
      if (unsettled_.size() >= max_unsettled) {
        ++unsettled_dropped_;
        return;
      }
      unsettled_.push_back({k, master, until});
    };
    if (which.empty()) {
      for (const auto& k : keys) add(k);
    } else {
      for (const auto i : which) add(keys[i]);
    }
  }

  // Revokes the unsettled puts, on the master that placed them (another
  // one never did: they are dropped), connected; a key another put of this
  // client has in flight waits for it (a later put of the key may be the
  // one the master holds, its writes still landing). Revoking is safe
  // otherwise: the master checks the writer (another client's put of the
  // key stays: illegal_client), an ended put stays (object_already_exists),
  // a put never placed is not found. Entries older than unsettled_horizon
  // are dropped: the master discarded those puts itself by then (its
  // default put_discard_timeout is 30 s).
  static asio::awaitable<void> settle(std::shared_ptr<client_state> self) {
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::string> keys;
    std::vector<std::list<unsettled_put>::iterator> sent;
    std::size_t dropped = std::exchange(self->unsettled_dropped_, 0);
    for (auto it = self->unsettled_.begin(); it != self->unsettled_.end();) {
      if (it->master != self->master_ || now >= it->until) {
        it = self->unsettled_.erase(it);
        ++dropped;
        continue;
      }
      if (!self->putting_.contains(it->key)) {
        keys.push_back(it->key);
        sent.push_back(it);
      }
      ++it;
    }
    if (dropped != 0) {
      kvlink::detail::log(
          "store: {} put(s) whose answer was lost with the connection to the master could not be "
          "given back (another master, or too late: it discards them itself)",
          dropped);
    }
    if (!keys.empty()) {
      std::vector<std::size_t> all(keys.size());
      for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
      std::vector<std::error_code> codes(keys.size());
      const auto ec =
          co_await self->keys_call(wire::message_type::put_revoke, keys, all, false, codes);
      if (!lost(ec)) {
        // Only settle erases entries, one at a time: `sent` is valid.
        for (const auto it : sent) self->unsettled_.erase(it);
        const auto revoked = ec ? std::size_t{0}
                                : static_cast<std::size_t>(std::count_if(
                                      codes.begin(), codes.end(), [](auto c) { return !c; }));
        if (revoked != 0) {
          kvlink::detail::log(
              "store: {} put(s) left in progress at the master by a lost connection given back",
              revoked);
        }
      }
    }
    self->settling_ = false;
  }

  asio::awaitable<std::error_code> keys_call(wire::message_type type,
                                             const std::vector<std::string>& keys,
                                             const std::vector<std::size_t>& which, bool force,
                                             std::span<std::error_code> results) {
    wire::writer w(type, 0, false);
    wire::key_batch q;
    q.force = force;
    q.keys.reserve(which.size());
    for (const auto i : which) q.keys.push_back(keys[i]);
    q.encode(w, type == wire::message_type::remove);
    std::string body;
    std::string frame = w.take();
    if (auto ec = co_await request(std::move(frame), body)) co_return ec;
    wire::code_list codes;
    wire::reader r(body);
    if (codes.decode(r) || codes.codes.size() != which.size()) {
      co_return make_error_code(errc::malformed_message);
    }
    for (std::size_t j = 0; j < which.size(); ++j) {
      results[results.size() == which.size() ? j : which[j]] =
          codes.codes[j] == 0 ? std::error_code{} : store_error(codes.codes[j]);
    }
    co_return std::error_code{};
  }

  // Mounts a segment at the master. `announce`: the master does not know
  // this client (it came up empty, or declared us gone), so the objects
  // whose records check out in the segment go with the mount and come back
  // readable; records it does not take back are cleared.
  asio::awaitable<std::error_code> mount_at_master(mount_rec& m, bool announce = false) {
    const std::string name =
        std::string("engine-segment-").append(std::to_string(m.engine_segment.value()));
    struct found {
      std::string key;  // copied: a late writer may change the memory
      std::uint64_t offset = 0;
      std::uint64_t size = 0;
    };
    std::vector<found> objects;
    std::uint64_t cleared = 0;
    if (announce) {
      const auto t0 = std::chrono::steady_clock::now();
      cleared =
          wire::scan_records(m.base, m.size, 65535, true, false, [&](const wire::found_object& f) {
            objects.push_back({std::string(f.key), f.offset, f.size});
          });
      kvlink::detail::log(
          "store: segment {} ({} bytes) scanned in {} ms: {} object(s) to announce, {} torn or "
          "overwritten record(s) cleared",
          m.engine_segment.value(), m.size,
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                t0)
              .count(),
          objects.size(), cleared);
    }
    // As many objects per frame as the master's max_body takes (half of it:
    // room for the rest of the frame); the first go with the mount, which
    // leaves the segment closed while more follow in adopt frames.
    std::vector<std::size_t> cuts{0};
    {
      const std::size_t budget = std::max<std::size_t>(master_max_body_ / 2, 512);
      std::size_t bytes = 0;
      for (std::size_t i = 0; i < objects.size(); ++i) {
        const std::size_t b = wire::mount_request::found_bytes(objects[i].key.size());
        if (i > cuts.back() && (bytes + b > budget || i - cuts.back() >= wire::max_batch / 2)) {
          cuts.push_back(i);
          bytes = 0;
        }
        bytes += b;
      }
      cuts.push_back(objects.size());
    }
    const std::size_t frames = cuts.size() - 1;
    m.announcing = frames > 1;
    for (std::size_t f = 0; f < frames; ++f) {
      const bool last = f + 1 == frames;
      std::vector<wire::mount_request::found> part;
      part.reserve(cuts[f + 1] - cuts[f]);
      for (std::size_t i = cuts[f]; i < cuts[f + 1]; ++i) {
        part.push_back({objects[i].key, objects[i].offset, objects[i].size});
      }
      wire::writer w(f == 0 ? wire::message_type::mount : wire::message_type::adopt, 0, false);
      if (f == 0) {
        wire::mount_request{name, m.size, m.engine_segment.value(), std::move(part), last}.encode(
            w);
      } else {
        wire::adopt_request{m.master_segment, std::move(part), last}.encode(w);
      }
      std::string body;
      std::string frame = w.take();
      if (auto ec = co_await request(std::move(frame), body)) co_return ec;
      wire::reader r(body);
      if (f == 0) m.master_segment = r.u64();
      wire::code_list codes;
      if (auto ec = codes.decode(r)) co_return ec;
      if (codes.codes.size() != cuts[f + 1] - cuts[f]) {
        co_return make_error_code(errc::malformed_message);
      }
      for (std::size_t i = cuts[f]; i < cuts[f + 1]; ++i) {
        // Not taken back (the key was put again meanwhile): its space is the
        // master's to hand out, so its record must not come back later.
        if (codes.codes[i - cuts[f]] != 0) {
          std::memset(m.base + objects[i].offset + wire::record_offset(objects[i].size), 0, 8);
        }
      }
    }
    m.announcing = false;
    if (frames > 1) {
      kvlink::detail::log("store: segment {}: {} object(s) announced in {} frames",
                          m.engine_segment.value(), objects.size(), frames);
    }
    co_return std::error_code{};
  }

  // ------------------------------------------------------------ SSD tier

  // Tells the master this client's disk is in the tier and what it holds
  // (its manifest, in frames of up to half the master's max_body). Keys the
  // master does not take are deleted from the disk.
  asio::awaitable<std::error_code> mount_disk_at_master() {
    if (!disk_) co_return std::error_code{};
    {
      wire::writer w(wire::message_type::disk_mount, 0, false);
      w.u64(opt_.disk_capacity);
      w.u8(disk_failed_ ? 0 : 1);
      std::string body;
      std::string frame = w.take();
      if (auto ec = co_await request(std::move(frame), body)) co_return ec;
    }
    if (!disk_) co_return std::error_code{};  // closed meanwhile
    std::vector<std::pair<std::string, std::uint64_t>> held;
    disk_->for_each([&](std::string_view key, std::uint64_t size) {
      held.emplace_back(std::string(key), size);
    });
    std::vector<report_entry> entries;
    entries.reserve(held.size());
    for (auto& [key, size] : held) {
      entries.push_back({wire::disk_report_kind::adopt, std::move(key), size, 0, 0, 0});
    }
    const auto ec = co_await send_disk_reports(std::move(entries));
    if (!ec && !held.empty()) {
      kvlink::detail::log("store: SSD tier at {}: {} object(s) announced to the master at {}",
                          opt_.disk_path, held.size(), master_address_);
    }
    co_return ec;
  }

  // One line of a disk_report (owning its key).
  struct report_entry {
    wire::disk_report_kind kind{};
    std::string key;
    std::uint64_t size = 0;
    std::uint64_t segment = 0;
    std::uint64_t offset = 0;
    std::uint32_t code = 0;
  };

  // Sends reports in frames the master takes; deletes from the disk the
  // objects the master refused to count on it (a store it no longer
  // wanted, a manifest entry it holds otherwise).
  asio::awaitable<std::error_code> send_disk_reports(std::vector<report_entry> entries) {
    const std::size_t budget = std::max<std::size_t>(master_max_body_ / 2, 512);
    std::size_t at = 0;
    std::vector<std::string> refused;
    while (at < entries.size()) {
      wire::disk_entries frame;
      std::size_t bytes = 0;
      const std::size_t from = at;
      for (; at < entries.size() && (at == from || bytes < budget) && at - from < wire::max_batch;
           ++at) {
        const auto& e = entries[at];
        frame.entries.push_back(
            {static_cast<std::uint8_t>(e.kind), e.key, e.size, e.segment, e.offset, e.code});
        bytes += 31 + e.key.size();
      }
      wire::writer w(wire::message_type::disk_report, 0, false);
      frame.encode(w, true);
      std::string body;
      std::string out = w.take();
      if (auto ec = co_await request(std::move(out), body)) co_return ec;
      wire::reader r(body);
      wire::code_list codes;
      if (codes.decode(r) || codes.codes.size() != at - from) {
        co_return make_error_code(errc::malformed_message);
      }
      // Refused for the object's sake (not for the disk's: client_not_found
      // when the disk is not mounted there keeps everything).
      for (std::size_t i = from; i < at; ++i) {
        const auto kind = entries[i].kind;
        const auto code = static_cast<store_errc>(codes.codes[i - from]);
        if (entries[i].code == 0 &&
            (kind == wire::disk_report_kind::adopt || kind == wire::disk_report_kind::stored) &&
            (code == store_errc::object_not_found || code == store_errc::object_already_exists ||
             code == store_errc::invalid_params || code == store_errc::invalid_key)) {
          refused.push_back(std::move(entries[i].key));
        }
      }
    }
    if (!refused.empty() && disk_pool_) {
      asio::post(*disk_pool_, [disk = disk_, keys = std::move(refused)] {
        for (const auto& k : keys) (void)disk->remove(k);
      });
    }
    co_return std::error_code{};
  }

  // A disk_task frame from the master: each task runs on the disk's
  // threads; their reports go back in one disk_report when all are done.
  void on_disk_tasks(std::string frame_body) {
    wire::disk_entries tasks;
    {
      wire::reader r(frame_body);
      if (tasks.decode(r, false)) {
        log_once("store: the master at {} sent a disk task this client cannot read; ignored",
                 master_address_);
        return;
      }
    }
    if (!disk_ || !disk_pool_ || closed_) return;  // given up by the master in time
    struct job {
      std::vector<report_entry> reports;
      std::vector<std::string> evicted;
      std::mutex mu;        // evicted, failure
      std::string failure;  // the first write the disk refused ("" none)
      std::atomic<std::size_t> left{0};
    };
    auto j = std::make_shared<job>();
    std::vector<std::function<void()>> work;
    for (const auto& t : tasks.entries) {
      const auto kind = static_cast<wire::disk_task_kind>(t.kind);
      std::string key(t.key);
      if (kind == wire::disk_task_kind::drop) {
        work.push_back([disk = disk_, key = std::move(key)] { (void)disk->remove(key); });
        continue;
      }
      const bool store = kind == wire::disk_task_kind::store;
      const std::size_t slot = j->reports.size();
      j->reports.push_back({store ? wire::disk_report_kind::stored : wire::disk_report_kind::loaded,
                            key, t.size, t.segment, t.offset, 0});
      // The range must lie in one of our segments as the master knows them.
      const std::uint64_t footprint =
          records_ ? wire::object_footprint(t.size, key.size()) : t.size;
      std::byte* at = nullptr;
      for (const auto& m : mounts_) {
        if (m.master_segment == t.segment && m.master_segment != 0 && t.offset <= m.size &&
            footprint != 0 && footprint <= m.size - t.offset) {
          at = m.base + t.offset;
        }
      }
      if (at == nullptr || t.size == 0) {
        j->reports[slot].code = static_cast<std::uint32_t>(store_errc::segment_not_found);
        continue;
      }
      work.push_back([j, slot, disk = disk_, key = std::move(key), at, size = t.size, store,
                      records = records_] {
        std::error_code ec = store ? store_to_disk(*disk, key, at, size, records, j->evicted, j->mu)
                                   : load_from_disk(*disk, key, at, size, records);
        if (ec) {
          j->reports[slot].code = ec.category() == store_error_category()
                                      ? static_cast<std::uint32_t>(ec.value())
                                      : static_cast<std::uint32_t>(store_errc::transfer_failed);
          // The disk refused a write (full, read only, failing): not this
          // object's fault.
          if (store && (ec.category() == std::system_category() ||
                        ec.category() == std::generic_category())) {
            std::lock_guard lock{j->mu};
            if (j->failure.empty()) j->failure = ec.message();
          }
        }
      });
    }
    if (work.empty()) {
      if (!j->reports.empty()) {
        asio::co_spawn(strand_, finish_disk_job(shared_from_this(), std::move(j->reports), {}, {}),
                       asio::detached);
      }
      return;
    }
    j->left.store(work.size());
    std::weak_ptr<client_state> weak = weak_from_this();
    for (auto& w : work) {
      asio::post(*disk_pool_, [j, w = std::move(w), weak, strand = strand_]() mutable {
        w();
        if (j->left.fetch_sub(1) != 1) return;
        asio::post(strand, [j, weak] {
          auto self = weak.lock();
          if (!self || self->closed_) return;
          asio::co_spawn(self->strand_,
                         finish_disk_job(self, std::move(j->reports), std::move(j->evicted),
                                         std::move(j->failure)),
                         asio::detached);
        });
      });
    }
  }

  // A store task: the object's bytes from our segment to the disk. Its
  // record, when there is one, must match them (bytes damaged in memory do
  // not go to the disk).
  static std::error_code store_to_disk(tier::disk_tier& disk, const std::string& key,
                                       const std::byte* at, std::uint64_t size, bool records,
                                       std::vector<std::string>& evicted, std::mutex& mu) {
    if (records) {
      const std::span<const std::byte> rec(at + wire::record_offset(size),
                                           wire::record_size(key.size()));
      wire::object_record r;
      if (wire::has_record_magic(rec) &&
          (!wire::decode_record(rec, 65535, r) || r.key != key || r.size != size ||
           r.body_crc != kvlink::crc32c(at, size))) {
        return make_error_code(store_errc::checksum_mismatch);
      }
    }
    std::vector<std::string> gone;
    const auto ec = disk.put(key, std::span<const std::byte>(at, size), &gone);
    if (!gone.empty()) {
      std::lock_guard lock{mu};
      for (auto& k : gone) evicted.push_back(std::move(k));
    }
    return ec;
  }

  // A load task: the object's bytes from the disk into our segment, and
  // its record after them (a master that restarts finds it again).
  static std::error_code load_from_disk(tier::disk_tier& disk, const std::string& key,
                                        std::byte* at, std::uint64_t size, bool records) {
    std::uint64_t got = 0;
    if (auto ec = disk.get(key, std::span<std::byte>(at, size), got)) return ec;
    if (got != size) return make_error_code(store_errc::object_not_found);  // another object
    if (records) {
      wire::encode_record(
          key, size, kvlink::crc32c(at, size),
          std::span<std::byte>(at + wire::record_offset(size), wire::record_size(key.size())));
    }
    return {};
  }

  // Reports a frame's tasks (and what the tier evicted meanwhile); a write
  // the disk refused makes it read only in the pool: what it holds stays
  // readable, eviction sends it nothing more (the memory tier goes on).
  static asio::awaitable<void> finish_disk_job(std::shared_ptr<client_state> self,
                                               std::vector<report_entry> reports,
                                               std::vector<std::string> evicted,
                                               std::string failure) {
    for (auto& k : evicted) {
      reports.push_back({wire::disk_report_kind::dropped, std::move(k), 0, 0, 0, 0});
    }
    if (!reports.empty()) (void)co_await self->send_disk_reports(std::move(reports));
    if (!failure.empty() && !self->disk_failed_ && !self->closed_) {
      self->disk_failed_ = true;
      kvlink::detail::log(
          "store: SSD tier at {}: a write failed ({}); what the disk holds stays readable, "
          "evicted objects are dropped from now on, until this client restarts",
          self->opt_.disk_path, failure);
      wire::writer w(wire::message_type::disk_mount, 0, false);
      w.u64(self->opt_.disk_capacity);
      w.u8(0);
      std::string body;
      std::string frame = w.take();
      (void)co_await self->request(std::move(frame), body);
    }
  }

  // Drops one of our segments at the master (its objects with it).
  asio::awaitable<std::error_code> unmount_at_master(const mount_rec& m) {
    wire::writer w(wire::message_type::unmount, 0, false);
    w.u64(m.master_segment);
    std::string body;
    std::string frame = w.take();
    co_return co_await request(std::move(frame), body);
  }

  // Connects and authenticates; mounts our segments again when the master
  // does not know us.
  // The leader etcd names for our cluster ("" none), or the error.
  asio::awaitable<std::error_code> find_leader(std::string& out) {
    out.clear();
    if (!etcd_) {
      std::vector<std::string> endpoints;
      if (!wire::parse_etcd_endpoints(opt_.master, endpoints)) {
        co_return make_error_code(errc::invalid_argument);
      }
      etcd_ = std::make_unique<kvlink::detail::etcd_client>(
          strand_, kvlink::detail::etcd_client::options{
                       std::move(endpoints), nullptr, {}, {}, opt_.connect_timeout});
    }
    nlohmann::json got;
    std::string what;
    const nlohmann::json range{{"key", kvlink::detail::http::base64_encode(wire::leader_key(
                                           wire::cluster_or_default(opt_.cluster)))}};
    if (co_await etcd_->call("/v3/kv/range", range, got, what)) {
      (void)unreachable("etcd: " + what);
      co_return make_error_code(store_errc::rpc_failed);
    }
    const auto kvs = got.value("kvs", nlohmann::json::array());
    if (!kvs.empty()) {
      out = kvlink::detail::http::base64_decode(kvs[0].value("value", std::string{})).value_or("");
    }
    co_return std::error_code{};
  }

  asio::awaitable<std::error_code> dial() {
    std::string_view host;
    std::uint16_t port = 0;
    if (wire::names_etcd(opt_.master)) {
      if (auto ec = co_await find_leader(master_address_)) co_return ec;
      if (closed_) co_return make_error_code(errc::cancelled);
      if (master_address_.empty()) {
        co_return unreachable("etcd names no leader of cluster \"" +
                              wire::cluster_or_default(opt_.cluster) + "\" yet");
      }
    } else {
      master_address_ = opt_.master;
    }
    if (!split_host_port(master_address_, host, port)) {
      co_return make_error_code(errc::invalid_argument);
    }
    asio::ip::tcp::resolver resolver(strand_);
    const std::string host_text(host), port_text = std::to_string(port);
    auto [rec, eps] = co_await resolver.async_resolve(host_text, port_text, control::use_nothrow);
    if (rec || eps.empty()) co_return unreachable("cannot resolve the master's address");
    auto sock = std::make_shared<asio::ip::tcp::socket>(strand_);
    control::hello hello;
    hello.instance = self_;
    hello.r = control::role::store;
    hello.address = eng_.local_address();
    nlohmann::json welcome;
    const control::client_auth auth{&guard_, {}, {}};
    const control::socket_options options{true, 0};
    const auto timeout = opt_.connect_timeout;
    auto ec = co_await control::dial(*sock, eps, timeout, options, hello,
                                     control::max_handshake_message, auth, welcome);
    if (ec == errc::peer_unreachable) co_return unreachable("no answer");
    if (ec == errc::peer_closed) co_return unreachable("the connection was lost in the handshake");
    if (ec) {
      log_once("store: the master at {} refused this client: {}{}", master_address_, ec.message(),
               ec == errc::invalid_argument ? " (is it a kvlink engine, not a store master?)" : "");
      co_return ec == errc::authentication_failed || ec == errc::protocol_version_mismatch
          ? ec
          : make_error_code(store_errc::rpc_failed);
    }
    const auto store = welcome.find("store");
    const auto master = parse_instance_id(welcome.value("instance", std::string{}));
    if (store == welcome.end() || !store->is_object() || !master) {
      co_return make_error_code(errc::malformed_message);
    }
    const bool known = store->value("known", false);
    client_id_ = store->value("client", std::uint64_t{0});
    heartbeat_ = std::chrono::milliseconds(store->value("heartbeat_ms", std::uint64_t{1000}));
    records_ = store->value("records", false);
    master_max_body_ = store->value("max_body", std::uint64_t{wire::default_max_body});
    if (heartbeat_.count() <= 0) heartbeat_ = std::chrono::milliseconds(1000);
    if (*master != master_) locations_.clear();  // another master: its segment ids are new
    if (!known) forget_mounts();
    ++epoch_;  // ids handed out before this connection are void
    master_ = *master;
    socket_ = std::move(sock);
    connected_ = true;
    if (logged_unreachable_) {
      kvlink::detail::log("store: reached the master at {} again{}", master_address_,
                          known ? "" : " (it did not know this client: mounting again)");
    }
    logged_unreachable_ = false;
    asio::co_spawn(strand_, read_loop(shared_from_this(), socket_), asio::detached);
    if (!known && !mounts_.empty()) {
      for (auto& m : mounts_) {
        if (auto mec = co_await mount_at_master(m, true)) {
          kvlink::detail::log("store: mounting a segment again at the master {} failed: {}",
                              master_address_, mec.message());
        }
      }
      locations_.clear();
    } else if (known) {
      // An announcement the connection broke off: the segment is closed at
      // the master with part of its objects; start it again from scratch.
      for (auto& m : mounts_) {
        if (!m.announcing) continue;
        (void)co_await unmount_at_master(m);
        m.master_segment = 0;
        if (auto mec = co_await mount_at_master(m, true)) {
          kvlink::detail::log("store: announcing a segment again at the master {} failed: {}",
                              master_address_, mec.message());
        }
      }
    }
    // The disk after the segments: its manifest may add disk replicas to
    // the objects they brought back.
    if (auto dec = co_await mount_disk_at_master()) {
      kvlink::detail::log("store: mounting the SSD tier at the master {} failed: {}",
                          master_address_, dec.message());
    }
    co_return std::error_code{};
  }

  // The master does not know our segments: the ids it gave them are void
  // until they are mounted again. A put placed meanwhile in a segment that
  // now has one of those ids must not take it for ours (it would write
  // another client's object into our memory, over objects of our own).
  void forget_mounts() {
    for (auto& m : mounts_) m.master_segment = 0;
    std::erase_if(locations_, [](const auto& kv) { return kv.second.local != nullptr; });
  }

  std::string where() const {
    if (!wire::names_etcd(opt_.master)) return opt_.master;
    return (master_address_.empty() ? std::string("(none yet)") : master_address_) +
           " (leader of \"" + wire::cluster_or_default(opt_.cluster) + "\" in " + opt_.master + ")";
  }

  std::error_code unreachable(std::string_view why) {
    if (!logged_unreachable_) {
      logged_unreachable_ = true;
      kvlink::detail::log("store: the master at {} cannot be reached ({}); retrying every {} ms",
                          where(), why, opt_.reconnect_interval.count());
    }
    return make_error_code(store_errc::rpc_failed);
  }

  template <class... Args>
  void log_once(fmt::format_string<Args...> f, Args&&... args) {
    if (logged_unreachable_) return;
    logged_unreachable_ = true;
    kvlink::detail::log(f, std::forward<Args>(args)...);
  }

  void send(std::string frame) {
    out_.push_back(std::move(frame));
    if (!writing_ && socket_) {
      writing_ = true;
      asio::co_spawn(strand_, write_loop(shared_from_this(), socket_), asio::detached);
    }
  }

  static asio::awaitable<void> write_loop(std::shared_ptr<client_state> self,
                                          std::shared_ptr<asio::ip::tcp::socket> sock) {
    while (!self->out_.empty() && self->socket_ == sock) {
      std::vector<std::string> batch;
      while (!self->out_.empty() && batch.size() < 64) {
        batch.push_back(std::move(self->out_.front()));
        self->out_.pop_front();
      }
      std::vector<asio::const_buffer> bufs;
      bufs.reserve(batch.size());
      for (const auto& f : batch) bufs.push_back(asio::buffer(f));
      auto [ec, n] = co_await asio::async_write(*sock, bufs, control::use_nothrow);
      (void)n;
      if (ec) {
        if (self->socket_ == sock) self->drop_connection(make_error_code(store_errc::rpc_failed));
        break;
      }
    }
    self->writing_ = false;
  }

  static asio::awaitable<void> read_loop(std::shared_ptr<client_state> self,
                                         std::shared_ptr<asio::ip::tcp::socket> sock) {
    std::error_code why = make_error_code(store_errc::rpc_failed);
    for (;;) {
      wire::header_bytes hb{};
      auto [ec, n] = co_await asio::async_read(*sock, asio::buffer(hb), control::use_nothrow);
      (void)n;
      if (ec) break;
      wire::frame_header h;
      const auto dec = wire::decode_header(hb, self->opt_.max_body, h);
      const bool task = !dec && !h.is_reply() && h.kind() == wire::message_type::disk_task;
      if (dec || (!h.is_reply() && !task)) {
        kvlink::detail::log(
            "store: the master at {} sent a frame this client cannot read ({}); reconnecting",
            self->master_address_, dec ? dec.message() : std::string("not a reply"));
        why = dec ? dec : make_error_code(errc::malformed_message);
        break;
      }
      std::string body(h.body_length, '\0');
      auto [ec2, n2] = co_await asio::async_read(*sock, asio::buffer(body), control::use_nothrow);
      (void)n2;
      if (ec2) break;
      if (task) {
        self->on_disk_tasks(std::move(body));
        continue;
      }
      if (auto it = self->pending_.find(h.id); it != self->pending_.end()) {
        auto handler = std::move(it->second.handler);
        self->pending_.erase(it);
        handler.complete({}, std::move(body));
      }
    }
    if (self->socket_ == sock) self->drop_connection(why);
  }

  void drop_connection(std::error_code why) {
    if (socket_) {
      std::error_code ignored;
      socket_->close(ignored);
    }
    socket_.reset();
    connected_ = false;
    out_.clear();
    auto pending = std::move(pending_);
    pending_.clear();
    for (auto& [id, p] : pending) p.handler.complete(why, {});
  }

  // Heartbeats, request timeouts, reconnection; one tick at a time.
  static asio::awaitable<void> ticker(std::shared_ptr<client_state> self) {
    auto last_beat = std::chrono::steady_clock::now();
    while (!self->closed_) {
      const auto step = std::min<std::chrono::milliseconds>(
          std::chrono::milliseconds(100),
          std::min(self->heartbeat_, self->opt_.reconnect_interval));
      self->tick_.expires_after(step);
      auto [ec] = co_await self->tick_.async_wait(control::use_nothrow);
      if (self->closed_) break;
      (void)ec;
      const auto now = std::chrono::steady_clock::now();
      // Requests the master did not answer in time.
      std::vector<std::uint64_t> late;
      for (const auto& [id, p] : self->pending_) {
        if (p.deadline < now) late.push_back(id);
      }
      for (const auto id : late) {
        auto it = self->pending_.find(id);
        auto handler = std::move(it->second.handler);
        self->pending_.erase(it);
        handler.complete(make_error_code(store_errc::rpc_timeout), {});
      }
      if (!self->connected_) {
        if (!self->connecting_ && now - last_beat >= self->opt_.reconnect_interval) {
          last_beat = now;
          (void)co_await self->connect();
        }
        continue;
      }
      if (!self->unsettled_.empty() && !self->settling_) {
        self->settling_ = true;
        asio::co_spawn(self->strand_, settle(self), asio::detached);
      }
      if (now - last_beat < self->heartbeat_) continue;
      last_beat = now;
      asio::co_spawn(self->strand_, heartbeat(self), asio::detached);
    }
  }

  static asio::awaitable<void> heartbeat(std::shared_ptr<client_state> self) {
    wire::writer w(wire::message_type::heartbeat, 0, false);
    std::string body;
    std::string frame = w.take();
    if (const auto ec = co_await self->request(std::move(frame), body)) {
      // A master that stopped answering (hung, cut off) may have been
      // replaced: leave it when etcd names another leader.
      if (ec == store_errc::rpc_timeout && wire::names_etcd(self->opt_.master) && !self->closed_) {
        const std::string was = self->master_address_;
        std::string now;
        if (!co_await self->find_leader(now) && !now.empty() && now != was &&
            self->master_address_ == was && self->connected_) {
          kvlink::detail::log(
              "store: the master at {} does not answer and etcd names {} the "
              "leader now: reconnecting",
              was, now);
          self->drop_connection(make_error_code(store_errc::rpc_failed));
        }
      }
      co_return;
    }
    wire::reader r(body);
    const bool known = r.u8() != 0;
    if (r.finish() || known || self->closed_) co_return;
    // The master forgot us (it declared this client gone): mount again.
    kvlink::detail::log(
        "store: the master at {} no longer knows this client; mounting its segments again",
        self->master_address_);
    self->forget_mounts();
    for (auto& m : self->mounts_) (void)co_await self->mount_at_master(m, true);
    self->locations_.clear();
    (void)co_await self->mount_disk_at_master();
  }

  engine& eng_;
  client_options opt_;
  strand_type strand_;
  asio::steady_timer tick_;
  instance_id self_;
  control::peer_guard guard_;
  std::string host_;

  std::unique_ptr<kvlink::detail::etcd_client> etcd_;  // with an etcd:// master
  std::string master_address_;                         // the master dialled last
  std::shared_ptr<asio::ip::tcp::socket> socket_;
  bool connected_ = false;
  bool connecting_ = false;
  bool ticking_ = false;
  bool writing_ = false;
  bool closed_ = false;
  bool logged_unreachable_ = false;
  std::vector<kvlink::detail::erased_handler<void(std::error_code)>> connect_waiters_;
  std::deque<std::string> out_;
  std::unordered_map<std::uint64_t, pending_call> pending_;
  std::uint64_t next_id_ = 0;
  std::uint64_t client_id_ = 0;
  instance_id master_{};
  std::uint64_t epoch_ = 0;  // connections made: segment ids are an epoch's
  bool records_ = false;     // whether puts write object records (the master says)
  std::uint64_t master_max_body_ = wire::default_max_body;  // the largest request it takes
  std::chrono::milliseconds heartbeat_{1000};

  // Puts in flight, by key (views of their own keys): put_claim's.
  std::unordered_map<std::string_view, std::uint32_t> putting_;
  // Puts whose answer was lost with the connection (leave_unsettled).
  struct unsettled_put {
    std::string key;
    instance_id master;  // the master that placed it
    std::chrono::steady_clock::time_point until;
  };
  static constexpr auto unsettled_horizon = std::chrono::seconds(60);
  static constexpr std::size_t max_unsettled = 1u << 16;  // new ones are dropped beyond
  std::list<unsettled_put> unsettled_;
  std::size_t unsettled_dropped_ = 0;
  bool settling_ = false;

  std::vector<mount_rec> mounts_;
  std::unordered_map<std::uint64_t, location> locations_;
  std::mutex arena_mu_;
  std::shared_ptr<std::byte[]> arena_;                              // records_room's; arena_mu_
  std::uint64_t arena_cap_ = 0, arena_used_ = 0;                    // arena_mu_
  std::size_t arena_users_ = 0;                                     // arena_mu_
  segment_id arena_segment_{};                                      // arena_mu_
  std::map<std::int32_t, std::shared_ptr<device_stream>> streams_;  // run_copies'

  std::shared_ptr<tier::disk_tier> disk_;         // the SSD tier (opt_.disk_path)
  std::unique_ptr<asio::thread_pool> disk_pool_;  // its I/O, off the engine's threads
  bool disk_failed_ = false;                      // an I/O error took it out of the pool
};

}  // namespace detail

/// A store client over `engine` (see the top of this file).
class client {
  using state = detail::client_state;

 public:
  using executor_type = asio::any_io_executor;

  explicit client(engine& eng, client_options opt = {})
      : state_(std::make_shared<state>(eng, std::move(opt))) {}
  /// Drops the connection to the master without waiting and without
  /// touching the engine: call async_close() first to leave the pool
  /// cleanly (otherwise the master drops this client's segments after its
  /// liveness timeout, and they stay registered with the engine).
  ~client() {
    if (state_) {
      state_->drop_arena_now();
      asio::post(state_->strand(), [s = state_] { s->abandon(); });
    }
  }
  client(const client&) = delete;
  client& operator=(const client&) = delete;

  executor_type get_executor() const { return state_->executor(); }
  /// This client's id at the master (0 before the first connection).
  std::uint64_t id() const noexcept { return state_->client_id(); }

  /// Connects to the master now (operations otherwise connect at their
  /// first use). Signature: void(std::error_code). Errors: rpc_failed (not
  /// reachable, or not a store master), authentication_failed,
  /// protocol_version_mismatch, invalid_argument (a bad address).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_connect(Token&& token = Token{}) {
    return run<void(std::error_code)>(std::forward<Token>(token),
                                      [](state& s) { return s.connect_op(); });
  }

  /// Gives [base, base + size) to the pool: registers it with the engine
  /// (remote read and write) and mounts it at the master. Signature:
  /// void(std::error_code, std::uint64_t segment), the store's id of it
  /// (for put_config::preferred). The memory must stay valid until
  /// async_close() completes.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_mount(void* base, std::uint64_t size, Token&& token = Token{}) {
    return run<void(std::error_code, std::uint64_t)>(
        std::forward<Token>(token), [base, size](state& s) { return s.mount(base, size); });
  }

  /// Puts one object: `size` bytes at `data` (registered memory: host, or
  /// device memory when the engine has a device runtime) under `key`.
  /// `parent`: the key this object extends (a KV-cache prefix), so eviction
  /// takes chain tails first; "" none. Signature: void(std::error_code).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_put(std::string_view key, const void* data, std::uint64_t size, put_config cfg = {},
                 std::string_view parent = {}, Token&& token = Token{}) {
    state::put_batch_args a;
    a.keys = {std::string(key)};
    a.pieces = {buffer_piece{const_cast<void*>(data), size}};
    a.first = {0, 1};
    a.sizes = {size};
    a.parents = {std::string(parent)};
    a.cfg = std::move(cfg);
    return run<void(std::error_code)>(
        std::forward<Token>(token),
        [a = std::move(a)](state& s) mutable { return s.put_one(std::move(a)); });
  }

  /// Puts many objects: keys[i] from data[i], sizes[i] bytes (columns of one
  /// length; `parents` empty or of that length too). results[i] gets key i's
  /// outcome; `results` must stay valid until the handler runs. Signature:
  /// void(std::error_code) for the batch as a whole.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_put_batch(std::span<const std::string_view> keys, std::span<const void* const> data,
                       std::span<const std::uint64_t> sizes, std::span<std::error_code> results,
                       put_config cfg = {}, std::span<const std::string_view> parents = {},
                       Token&& token = Token{}) {
    const bool ok = data.size() == keys.size() && sizes.size() == keys.size() &&
                    results.size() == keys.size() &&
                    (parents.empty() || parents.size() == keys.size());
    state::put_batch_args a;
    if (ok) {
      a.keys.assign(keys.begin(), keys.end());
      state::one_piece_each(data, sizes, a.pieces, a.first);
      a.sizes.assign(sizes.begin(), sizes.end());
      a.parents.assign(parents.begin(), parents.end());
      a.cfg = std::move(cfg);
      a.results = results;
    }
    return run<void(std::error_code)>(
        std::forward<Token>(token),
        [a = std::move(a), ok](state& s) mutable { return s.put_op(std::move(a), ok); });
  }

  /// Puts many objects, each gathered from pieces: keys[i]'s object is the
  /// next counts[i] entries of `pieces`, in order (vLLM's K and V of every
  /// layer of one block: one object, no gathering copy; each piece is
  /// WRITTEN to its place in every replica). A key whose pieces hold no
  /// bytes gets invalid_params, as an empty put does. Otherwise as
  /// async_put_batch; sum(counts) must be pieces.size() (else the batch:
  /// invalid_argument).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_put_gather_batch(std::span<const std::string_view> keys,
                              std::span<const buffer_piece> pieces,
                              std::span<const std::uint32_t> counts,
                              std::span<std::error_code> results, put_config cfg = {},
                              std::span<const std::string_view> parents = {},
                              Token&& token = Token{}) {
    state::put_batch_args a;
    bool ok = counts.size() == keys.size() && results.size() == keys.size() &&
              (parents.empty() || parents.size() == keys.size()) &&
              state::split_pieces(pieces, counts, a.first, a.sizes);
    if (ok) {
      a.keys.assign(keys.begin(), keys.end());
      a.pieces.assign(pieces.begin(), pieces.end());
      a.parents.assign(parents.begin(), parents.end());
      a.cfg = std::move(cfg);
      a.results = results;
    }
    return run<void(std::error_code)>(
        std::forward<Token>(token),
        [a = std::move(a), ok](state& s) mutable { return s.put_op(std::move(a), ok); });
  }

  /// Gets one object into [buffer, buffer + capacity) (registered memory,
  /// host or device). Signature: void(std::error_code, std::uint64_t size).
  /// Errors: object_not_found, object_in_progress, buffer_overflow
  /// (capacity below its size; `size` is then the object's, nothing is
  /// written), lease_expired, the engine's transfer errors, rpc_*.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_get(std::string_view key, void* buffer, std::uint64_t capacity,
                 Token&& token = Token{}) {
    state::get_batch_args a;
    a.keys = {std::string(key)};
    a.pieces = {buffer_piece{buffer, capacity}};
    a.first = {0, 1};
    a.capacities = {capacity};
    return run<void(std::error_code, std::uint64_t)>(
        std::forward<Token>(token),
        [a = std::move(a)](state& s) mutable { return s.get_one(std::move(a)); });
  }

  /// Gets many objects: keys[i] into buffers[i] of capacities[i] bytes;
  /// sizes[i] and results[i] are key i's outcome (both spans must stay
  /// valid until the handler runs): the bytes read, or with buffer_overflow
  /// the object's size (0 for other errors). Signature:
  /// void(std::error_code) for the batch as a whole.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_get_batch(std::span<const std::string_view> keys, std::span<void* const> buffers,
                       std::span<const std::uint64_t> capacities, std::span<std::uint64_t> sizes,
                       std::span<std::error_code> results, Token&& token = Token{}) {
    const bool ok = buffers.size() == keys.size() && capacities.size() == keys.size() &&
                    sizes.size() == keys.size() && results.size() == keys.size();
    state::get_batch_args a;
    if (ok) {
      a.keys.assign(keys.begin(), keys.end());
      state::one_piece_each(buffers, capacities, a.pieces, a.first);
      a.capacities.assign(capacities.begin(), capacities.end());
      a.sizes = sizes;
      a.results = results;
    }
    return run<void(std::error_code)>(
        std::forward<Token>(token),
        [a = std::move(a), ok](state& s) mutable { return s.get_op(std::move(a), ok); });
  }

  /// Gets many objects, each scattered over pieces: keys[i]'s bytes fill
  /// the next counts[i] entries of `pieces` in order, the last one as far
  /// as the object goes (buffer_overflow, nothing written, when they hold
  /// fewer bytes than the object). Otherwise as async_get_batch.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_get_scatter_batch(std::span<const std::string_view> keys,
                               std::span<const buffer_piece> pieces,
                               std::span<const std::uint32_t> counts,
                               std::span<std::uint64_t> sizes, std::span<std::error_code> results,
                               Token&& token = Token{}) {
    state::get_batch_args a;
    bool ok = counts.size() == keys.size() && sizes.size() == keys.size() &&
              results.size() == keys.size() &&
              state::split_pieces(pieces, counts, a.first, a.capacities);
    if (ok) {
      a.keys.assign(keys.begin(), keys.end());
      a.pieces.assign(pieces.begin(), pieces.end());
      a.sizes = sizes;
      a.results = results;
    }
    return run<void(std::error_code)>(
        std::forward<Token>(token),
        [a = std::move(a), ok](state& s) mutable { return s.get_op(std::move(a), ok); });
  }

  /// Whether `key` exists (its put ended). Signature: void(std::error_code,
  /// bool); an in-progress put is not there yet (false).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_exists(std::string_view key, Token&& token = Token{}) {
    return run<void(std::error_code, bool)>(
        std::forward<Token>(token),
        [k = std::string(key)](state& s) mutable { return s.exists_one(std::move(k)); });
  }

  /// results[i]: {} when keys[i] exists, object_not_found (or
  /// object_in_progress) when not. Signature: void(std::error_code).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_exists_batch(std::span<const std::string_view> keys,
                          std::span<std::error_code> results, Token&& token = Token{}) {
    return keys_batch(wire::message_type::exists, keys, false, results, std::forward<Token>(token));
  }

  /// Where keys' objects are (Mooncake's batch_get_replica_desc): results[i]
  /// gets key i's size and replicas (segment, offset, its owner's engine
  /// address and host), or its error (object_not_found, object_in_progress,
  /// ...). No read lease is taken, so a replica may be gone by the time it
  /// is used: read with async_get. `results` must stay valid until the
  /// handler runs. Signature: void(std::error_code) for the batch.
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_describe_batch(std::span<const std::string_view> keys,
                            std::span<object_description> results, Token&& token = Token{}) {
    const bool ok = results.size() == keys.size();
    std::vector<std::string> copy;
    if (ok) copy.assign(keys.begin(), keys.end());
    return run<void(std::error_code)>(std::forward<Token>(token),
                                      [copy = std::move(copy), results, ok](state& s) mutable {
                                        return s.describe(std::move(copy), results, ok);
                                      });
  }

  /// Removes `key` (force: even while it is read or hard-pinned).
  /// Signature: void(std::error_code): object_not_found, object_has_lease,
  /// object_hard_pinned, ...
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_remove(std::string_view key, bool force = false, Token&& token = Token{}) {
    return run<void(std::error_code)>(std::forward<Token>(token),
                                      [k = std::string(key), force](state& s) mutable {
                                        return s.remove_one(std::move(k), force);
                                      });
  }

  /// results[i]: key i's outcome. Signature: void(std::error_code).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_remove_batch(std::span<const std::string_view> keys, bool force,
                          std::span<std::error_code> results, Token&& token = Token{}) {
    return keys_batch(wire::message_type::remove, keys, force, results, std::forward<Token>(token));
  }

  /// Removes every object (force: leased and hard-pinned ones too).
  /// Signature: void(std::error_code, std::uint64_t removed).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_remove_all(bool force = false, Token&& token = Token{}) {
    return run<void(std::error_code, std::uint64_t)>(
        std::forward<Token>(token), [force](state& s) { return s.remove_all(force); });
  }

  /// The pool's totals. Signature: void(std::error_code, wire::stats_reply).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_stats(Token&& token = Token{}) {
    return run<void(std::error_code, wire::stats_reply)>(std::forward<Token>(token),
                                                         [](state& s) { return s.stats(); });
  }

  /// Unmounts this client's segments (their objects leave the pool),
  /// unregisters them from the engine and closes the connection; pending
  /// operations fail with cancelled (a batch the close cuts short as a
  /// whole, not key by key). Signature: void(std::error_code).
  template <class Token = asio::default_completion_token_t<executor_type>>
  auto async_close(Token&& token = Token{}) {
    return run<void(std::error_code)>(std::forward<Token>(token),
                                      [](state& s) { return s.close_op(); });
  }

 private:
  // Runs the coroutine make(state) on the client's strand and completes the
  // handler with its tuple (internal_error if it threw). The completion
  // handler holds the state alive until then.
  template <class Signature, class Token, class Make>
  auto run(Token&& token, Make make) {
    return asio::async_initiate<Token, Signature>(
        [st = state_](auto handler, Make mk) {
          kvlink::detail::erased_handler<Signature> h(std::move(handler), st->executor());
          auto aw = mk(*st);
          asio::co_spawn(st->strand(), std::move(aw),
                         [st, h = std::move(h)](std::exception_ptr e, auto out) mutable {
                           if (e) {
                             out = decltype(out){};
                             std::get<0>(out) = make_error_code(store_errc::internal_error);
                           }
                           std::apply([&h](auto&&... v) { h.complete(std::move(v)...); },
                                      std::move(out));
                         });
        },
        token, std::move(make));
  }

  template <class Token>
  auto keys_batch(wire::message_type type, std::span<const std::string_view> keys, bool force,
                  std::span<std::error_code> results, Token&& token) {
    const bool ok = results.size() == keys.size();
    std::vector<std::string> copy;
    if (ok) copy.assign(keys.begin(), keys.end());
    return run<void(std::error_code)>(
        std::forward<Token>(token),
        [type, copy = std::move(copy), force, results, ok](state& s) mutable {
          return s.keys_batch(type, std::move(copy), force, results, ok);
        });
  }

  std::shared_ptr<state> state_;
};

}  // namespace kvlink::store
