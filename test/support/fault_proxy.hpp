// fault_proxy: an in-process TCP proxy on loopback that injects faults, for
// tests. It listens on 127.0.0.1 (a free port) and forwards every connection
// it accepts to one target endpoint, byte for byte, both ways, on its own
// io_context and thread (started by the constructor, joined by the
// destructor).
//
//   kvlink_test::fault_proxy proxy{target.listen_address()};
//   // A connect opens the control connection, then the lanes, in that order:
//   // cut lane 0 of the next connect 64 KiB in, initiator -> target.
//   proxy.set_fault(kvlink_test::fault::truncate(64 << 10, kvlink_test::direction::to_target)
//                       .on_connection(proxy.accepted() + 1));
//   initiator.async_connect(proxy.address(), handler);  // control + lanes all go through it
//   ...
//   proxy.clear_faults();
//   const auto s = proxy.stats();  // accepted, bytes per direction, faults injected
//
// Faults may be added and removed at any time from any thread; each applies
// to the bytes read from then on, on the connection(s) and direction(s) it
// names (per connection and per direction: "after K more bytes" counts each
// pipe's own bytes from the moment the fault reached it):
//   delay(d)       every chunk is forwarded d after it was read (order kept);
//   throttle(n)    at most n bytes/s are read (so forwarded), per pipe;
//   truncate(k)    k more bytes are forwarded, then both sides of the
//                  connection are closed with FIN (k = 0: at once, even idle;
//                  the kernel follows with a RST where bytes were left unread);
//   reset(k)       the same, closed with RST (SO_LINGER 0);
//   black_hole()   bytes are read and dropped, connections stay open: the
//                  other side looks hung;
//   bit_flip(k)    the k-th, 2k-th, ... byte forwarded from then on has one
//                  bit flipped: bit (j - 1) % 8 of the (j * k)-th byte.
// A peer closing or resetting its side is passed on (FIN after the bytes
// queued before it, RST at once). reset_connection(i) resets connection i at
// once, dropping what the proxy holds for it.
#pragma once

#include <kvlink/core/address.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <asio/buffer.hpp>
#include <asio/co_spawn.hpp>
#include <asio/connect.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>

namespace kvlink_test {

/// Which way a fault applies: the bytes the connecting side (the initiator)
/// sends to the target, those coming back, or both.
enum class direction : unsigned { to_target = 1, to_initiator = 2, both = 3 };

struct fault {
  enum class kind { delay, throttle, truncate, reset, black_hole, bit_flip };
  static constexpr std::int64_t any_connection = -1;

  kind what = kind::delay;
  direction dir = direction::both;
  std::uint64_t n = 0;                // throttle: bytes/s; truncate, reset: bytes; bit_flip: period
  std::chrono::milliseconds wait{0};  // delay
  std::int64_t connection = any_connection;  // index in accept order (0 = the first)

  static fault delay(std::chrono::milliseconds d, direction w = direction::both) {
    return {kind::delay, w, 0, d};
  }
  static fault throttle(std::uint64_t bytes_per_second, direction w = direction::both) {
    return {kind::throttle, w, std::max<std::uint64_t>(bytes_per_second, 1)};
  }
  static fault truncate(std::uint64_t after, direction w = direction::both) {
    return {kind::truncate, w, after};
  }
  static fault reset(std::uint64_t after, direction w = direction::both) {
    return {kind::reset, w, after};
  }
  static fault black_hole(direction w = direction::both) { return {kind::black_hole, w}; }
  static fault bit_flip(std::uint64_t every, direction w = direction::both) {
    return {kind::bit_flip, w, std::max<std::uint64_t>(every, 1)};
  }
  /// The same fault, on the connection accepted `index`-th only (0-based).
  fault on_connection(std::uint64_t index) const {
    fault f = *this;
    f.connection = static_cast<std::int64_t>(index);
    return f;
  }
};

class fault_proxy {
 public:
  struct counters {
    std::uint64_t accepted = 0;
    std::uint64_t bytes_to_target = 0;     // forwarded initiator -> target
    std::uint64_t bytes_to_initiator = 0;  // forwarded target -> initiator
    std::uint64_t truncations = 0, resets = 0, bit_flips = 0;
    std::uint64_t black_holed_chunks = 0, black_holed_bytes = 0;
    std::uint64_t delayed_chunks = 0, throttled_reads = 0;
    /// Truncations, resets, bits flipped and chunks dropped.
    std::uint64_t faults_injected() const {
      return truncations + resets + bit_flips + black_holed_chunks;
    }
  };

  /// Forwards to `target` ("host:port"); throws if it does not resolve.
  explicit fault_proxy(const std::string& target) : acceptor_(io_) {
    std::string_view host;
    std::uint16_t port = 0;
    if (!kvlink::split_host_port(target, host, port)) {
      throw std::invalid_argument("fault_proxy: not host:port: " + target);
    }
    asio::ip::tcp::resolver resolver(io_);
    for (const auto& e : resolver.resolve(std::string(host), std::to_string(port))) {
      target_.push_back(e.endpoint());
    }
    const asio::ip::tcp::endpoint here(asio::ip::make_address("127.0.0.1"), 0);
    acceptor_.open(here.protocol());
    acceptor_.set_option(asio::socket_base::reuse_address(true));
    acceptor_.bind(here);
    acceptor_.listen();
    endpoint_ = acceptor_.local_endpoint();
    address_ = "127.0.0.1:" + std::to_string(endpoint_.port());
    asio::co_spawn(io_, accept_loop(), asio::detached);
    thread_ = std::thread([this] { io_.run(); });
  }

  /// Closes every connection and the listener, then joins the thread.
  ~fault_proxy() {
    asio::post(io_, [this] {
      stopping_ = true;
      std::error_code ignored;
      acceptor_.close(ignored);
      for (auto& w : live_) {
        if (auto c = w.lock()) c->close(false);
      }
    });
    thread_.join();
  }

  fault_proxy(const fault_proxy&) = delete;
  fault_proxy& operator=(const fault_proxy&) = delete;

  /// "127.0.0.1:port": connect here instead of to the target.
  const std::string& address() const noexcept { return address_; }
  asio::ip::tcp::endpoint endpoint() const { return endpoint_; }
  std::uint64_t accepted() const noexcept { return accepted_.load(); }

  /// Adds a fault; returns its id (for remove_fault).
  std::uint64_t add_fault(const fault& f) {
    std::uint64_t id = 0;
    {
      std::lock_guard lock(mutex_);
      id = ++next_id_;
      faults_.push_back({id, f});
      ++generation_;
    }
    poke();
    return id;
  }
  /// Replaces every fault with `f`.
  std::uint64_t set_fault(const fault& f) {
    clear_faults();
    return add_fault(f);
  }
  void remove_fault(std::uint64_t id) {
    {
      std::lock_guard lock(mutex_);
      std::erase_if(faults_, [id](const auto& x) { return x.id == id; });
      ++generation_;
    }
    poke();
  }
  void clear_faults() {
    {
      std::lock_guard lock(mutex_);
      faults_.clear();
      ++generation_;
    }
    poke();
  }

  /// Closes the connection accepted `index`-th (0-based) with RST on both
  /// sides at once: the bytes the proxy holds for it (delayed, throttled,
  /// not yet written) are dropped, as when the path between the two dies.
  /// (reset(0) as a fault forwards those first.) Returns once it is done;
  /// false if no such connection is open. Not from the proxy's thread.
  bool reset_connection(std::uint64_t index) {
    std::promise<bool> done;
    asio::post(io_, [&] {
      bool found = false;
      for (auto& w : live_) {
        auto c = w.lock();
        if (!c || c->closed || c->index != index) continue;
        c->close(true);
        count(resets);
        found = true;
      }
      done.set_value(found);
    });
    return done.get_future().get();
  }

  counters stats() const {
    counters c;
    c.accepted = accepted_.load();
    c.bytes_to_target = stat_[bytes_up].load();
    c.bytes_to_initiator = stat_[bytes_down].load();
    c.truncations = stat_[truncations].load();
    c.resets = stat_[resets].load();
    c.bit_flips = stat_[bit_flips].load();
    c.black_holed_chunks = stat_[holed_chunks].load();
    c.black_holed_bytes = stat_[holed_bytes].load();
    c.delayed_chunks = stat_[delayed].load();
    c.throttled_reads = stat_[throttled].load();
    return c;
  }

 private:
  using clock = std::chrono::steady_clock;
  static constexpr auto nothrow = asio::experimental::as_tuple(asio::use_awaitable);
  static constexpr std::size_t read_size = 256u << 10;
  static constexpr std::size_t max_queued = 8u << 20;  // per pipe, then reading waits

  enum stat : std::size_t {
    bytes_up,
    bytes_down,
    truncations,
    resets,
    bit_flips,
    holed_chunks,
    holed_bytes,
    delayed,
    throttled,
    stat_count
  };
  enum class ending { none, eof, fin, rst };

  struct entry {
    std::uint64_t id;
    fault f;
  };
  struct active {
    std::uint64_t id;
    fault f;
    std::uint64_t seen = 0;  // bytes forwarded on this pipe since the fault reached it
  };
  struct chunk {
    std::vector<std::byte> data;
    clock::time_point due;
    ending end = ending::none;  // after the data
  };

  // One direction of a connection: a reader fills the queue, a writer
  // empties it when each chunk is due. Proxy thread only.
  struct pipe {
    pipe(asio::io_context& io, unsigned w, asio::ip::tcp::socket& f, asio::ip::tcp::socket& t)
        : way(w), from(f), to(t), writer_wake(io), reader_wake(io) {}
    unsigned way;  // 1: to target, 2: to initiator (as direction)
    asio::ip::tcp::socket& from;
    asio::ip::tcp::socket& to;
    std::deque<chunk> queue;
    std::size_t queued = 0;
    asio::steady_timer writer_wake, reader_wake;  // cancelled to wake a waiter
    std::vector<active> faults;
    std::uint64_t generation = 0;
    bool ended = false;  // the last chunk is queued
    bool done = false;   // EOF passed on
  };

  struct connection {
    connection(asio::io_context& io, std::uint64_t i, asio::ip::tcp::socket c)
        : index(i),
          client(std::move(c)),
          server(io),
          up(io, 1, client, server),
          down(io, 2, server, client) {}
    std::uint64_t index;
    asio::ip::tcp::socket client, server;
    pipe up, down;
    bool closed = false;

    void close(bool rst) {
      if (closed) return;
      closed = true;
      for (auto* s : {&client, &server}) {
        std::error_code ignored;
        if (rst) {
          s->set_option(asio::socket_base::linger(true, 0), ignored);
        } else {
          s->shutdown(asio::socket_base::shutdown_both, ignored);
        }
        s->close(ignored);
      }
      for (auto* p : {&up, &down}) {
        p->writer_wake.cancel();
        p->reader_wake.cancel();
      }
    }
  };

  void count(stat s, std::uint64_t n = 1) { stat_[s].fetch_add(n, std::memory_order_relaxed); }

  // Faults changed: idle pipes learn of them too (truncate(0) acts at once).
  void poke() {
    asio::post(io_, [this] {
      std::erase_if(live_, [](const auto& w) { return w.expired(); });
      for (auto& w : live_) {
        auto c = w.lock();
        if (!c || c->closed) continue;
        for (auto* p : {&c->up, &c->down}) {
          refresh(*c, *p);
          if (p->ended) continue;
          std::vector<std::byte> none;
          const auto cut = apply(*p, none);
          if (cut != ending::none) push(*p, {{}, clock::now(), cut});
        }
      }
    });
  }

  // The pipe's view of the faults that apply to it, their byte counts kept.
  void refresh(const connection& c, pipe& p) {
    std::lock_guard lock(mutex_);
    if (p.generation == generation_) return;
    std::vector<active> next;
    for (const auto& [id, f] : faults_) {
      if ((static_cast<unsigned>(f.dir) & p.way) == 0) continue;
      if (f.connection != fault::any_connection &&
          f.connection != static_cast<std::int64_t>(c.index)) {
        continue;
      }
      active a{id, f};
      for (const auto& old : p.faults) {
        if (old.id == id) a.seen = old.seen;
      }
      next.push_back(a);
    }
    p.faults = std::move(next);
    p.generation = generation_;
  }

  // Applies the pipe's faults to bytes just read: drops them (black hole),
  // cuts them (truncate, reset: the returned ending), flips bits.
  ending apply(pipe& p, std::vector<std::byte>& data) {
    ending cut = ending::none;
    std::uint64_t keep = data.size();
    for (const auto& a : p.faults) {
      if (a.f.what == fault::kind::black_hole) {
        if (!data.empty()) {
          count(holed_chunks);
          count(holed_bytes, data.size());
        }
        data.clear();
        return ending::none;
      }
      if (a.f.what != fault::kind::truncate && a.f.what != fault::kind::reset) continue;
      const std::uint64_t left = a.f.n > a.seen ? a.f.n - a.seen : 0;
      if (left <= keep && (cut == ending::none || left < keep)) {
        keep = left;
        cut = a.f.what == fault::kind::truncate ? ending::fin : ending::rst;
      }
    }
    data.resize(static_cast<std::size_t>(keep));
    for (auto& a : p.faults) {
      if (a.f.what == fault::kind::bit_flip) {
        for (std::uint64_t i = 0; i < keep; ++i) {
          const std::uint64_t pos = a.seen + i + 1;
          if (pos % a.f.n != 0) continue;
          data[static_cast<std::size_t>(i)] ^=
              static_cast<std::byte>(1u << ((pos / a.f.n - 1) % 8));
          count(bit_flips);
        }
      }
      a.seen += keep;
    }
    if (cut != ending::none) p.ended = true;
    return cut;
  }

  static std::uint64_t rate_of(const pipe& p) {  // bytes/s, 0: no throttle
    std::uint64_t rate = 0;
    for (const auto& a : p.faults) {
      if (a.f.what == fault::kind::throttle) rate = rate == 0 ? a.f.n : std::min(rate, a.f.n);
    }
    return rate;
  }
  static std::chrono::milliseconds delay_of(const pipe& p) {
    std::chrono::milliseconds d{0};
    for (const auto& a : p.faults) {
      if (a.f.what == fault::kind::delay) d = std::max(d, a.f.wait);
    }
    return d;
  }

  void push(pipe& p, chunk c) {
    p.queued += c.data.size();
    p.queue.push_back(std::move(c));
    p.writer_wake.cancel();
  }

  static asio::awaitable<void> sleep(asio::steady_timer& t, clock::time_point until) {
    t.expires_at(until);
    co_await t.async_wait(nothrow);
  }

  asio::awaitable<void> accept_loop() {
    for (;;) {
      auto [ec, s] = co_await acceptor_.async_accept(nothrow);
      if (stopping_) co_return;
      if (ec) continue;  // a connection that went away before it was accepted
      auto c = std::make_shared<connection>(io_, accepted_.fetch_add(1), std::move(s));
      std::erase_if(live_, [](const auto& w) { return w.expired(); });
      live_.push_back(c);
      asio::co_spawn(io_, serve(c), asio::detached);
    }
  }

  asio::awaitable<void> serve(std::shared_ptr<connection> c) {
    auto [ec, ep] = co_await asio::async_connect(c->server, target_, nothrow);
    (void)ep;
    if (c->closed) co_return;
    if (ec) {
      c->close(true);  // as if the target refused
      co_return;
    }
    std::error_code ignored;
    c->client.set_option(asio::ip::tcp::no_delay(true), ignored);
    c->server.set_option(asio::ip::tcp::no_delay(true), ignored);
    for (auto* p : {&c->up, &c->down}) {
      asio::co_spawn(io_, read_loop(c, *p), asio::detached);
      asio::co_spawn(io_, write_loop(c, *p), asio::detached);
    }
  }

  asio::awaitable<void> read_loop(std::shared_ptr<connection> c, pipe& p) {
    std::vector<std::byte> buf;
    auto next_read = clock::now();  // throttle: when reading may go on
    for (;;) {
      if (c->closed || p.ended) co_return;
      if (p.queued >= max_queued) {
        co_await sleep(p.reader_wake, clock::time_point::max());
        continue;
      }
      refresh(*c, p);
      const auto rate = rate_of(p);
      std::size_t want = read_size;
      if (rate > 0) {
        if (clock::now() < next_read) {
          count(throttled);
          co_await sleep(p.reader_wake, next_read);
          continue;
        }
        want = static_cast<std::size_t>(std::clamp<std::uint64_t>(rate / 100, 1, read_size));
      }
      buf.resize(want);
      auto [ec, n] = co_await p.from.async_read_some(asio::buffer(buf), nothrow);
      if (c->closed || p.ended) co_return;
      if (ec == asio::error::eof) {
        push(p, {{}, clock::now(), ending::eof});
        p.ended = true;
        co_return;
      }
      if (ec) {
        c->close(true);  // a reset (or worse) is passed on at once
        co_return;
      }
      if (rate > 0) {
        next_read = std::max(next_read, clock::now()) +
                    std::chrono::nanoseconds(n * 1'000'000'000ull / rate);
      }
      buf.resize(n);
      refresh(*c, p);
      const auto delay = delay_of(p);
      const auto cut = apply(p, buf);
      if (delay.count() > 0 && !buf.empty()) count(delayed);
      if (!buf.empty() || cut != ending::none) push(p, {buf, clock::now() + delay, cut});
    }
  }

  asio::awaitable<void> write_loop(std::shared_ptr<connection> c, pipe& p) {
    for (;;) {
      if (c->closed) co_return;
      if (p.queue.empty()) {
        co_await sleep(p.writer_wake, clock::time_point::max());
        continue;
      }
      if (p.queue.front().due > clock::now()) {
        co_await sleep(p.writer_wake, p.queue.front().due);
        continue;
      }
      chunk next = std::move(p.queue.front());
      p.queue.pop_front();
      p.queued -= next.data.size();
      p.reader_wake.cancel();
      if (!next.data.empty()) {
        auto [ec, n] = co_await asio::async_write(p.to, asio::buffer(next.data), nothrow);
        if (c->closed) co_return;
        if (ec) {
          c->close(true);
          co_return;
        }
        count(p.way == 1 ? bytes_up : bytes_down, n);
      }
      switch (next.end) {
        case ending::none:
          continue;
        case ending::eof: {
          std::error_code ignored;
          p.to.shutdown(asio::socket_base::shutdown_send, ignored);
          p.done = true;
          if (c->up.done && c->down.done) c->close(false);
          co_return;
        }
        case ending::fin:
          count(truncations);
          c->close(false);
          co_return;
        case ending::rst:
          count(resets);
          c->close(true);
          co_return;
      }
    }
  }

  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  std::vector<asio::ip::tcp::endpoint> target_;
  asio::ip::tcp::endpoint endpoint_;
  std::string address_;
  std::thread thread_;
  // proxy thread only
  std::vector<std::weak_ptr<connection>> live_;
  bool stopping_ = false;
  // shared
  mutable std::mutex mutex_;
  std::vector<entry> faults_;
  std::uint64_t next_id_ = 0;
  std::uint64_t generation_ = 1;
  std::atomic<std::uint64_t> accepted_{0};
  std::array<std::atomic<std::uint64_t>, stat_count> stat_{};
};

}  // namespace kvlink_test
