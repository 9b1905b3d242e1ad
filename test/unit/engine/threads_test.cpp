// Engines on an io_context run by many threads: TCP lanes and served lanes
// each run on a strand of their own (tcp/transport.hpp), the engine's state
// on its strand. Bytes are checked after every transfer; cancellations and a
// peer killed mid-transfer keep the completion contract (the handler is the
// fence). CI runs this under ThreadSanitizer.
#include <kvlink/engine.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "../../support/peer_process.hpp"
#include "../../support/test_support.hpp"
#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/use_future.hpp>
#include <doctest/doctest.h>

namespace {

using namespace std::chrono_literals;
using kvlink::opcode;
using kvlink_test::fill_pattern;
using kvlink_test::is_pattern;

constexpr int threads = 8;

kvlink::config lanes_config(std::uint32_t lanes) {
  kvlink::config c;
  c.tcp.lanes = lanes;
  c.fence_timeout = 500ms;
  c.transfer_deadline = 0ms;  // a loaded machine must not fail a transfer
  c.slice_size = 256u << 10;  // many slices per transfer: many lanes busy at once
  return c;
}

// An io_context run by `n` threads until destroyed.
struct pool {
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  std::vector<std::thread> runners;
  explicit pool(int n) {
    for (int i = 0; i < n; ++i) runners.emplace_back([this] { io.run(); });
  }
  ~pool() {
    work.reset();
    for (auto& t : runners) t.join();
  }
};

struct result {
  std::error_code ec;
  kvlink::transfer_result r;
};

result submit(kvlink::tcp_engine& e, std::vector<kvlink::transfer_request> reqs) {
  std::promise<result> out;
  auto f = out.get_future();
  e.async_submit_transfer(reqs, [&out](std::error_code ec, kvlink::transfer_result r) {
    out.set_value({ec, r});
  });
  return f.get();
}

}  // namespace

TEST_CASE("8 threads, 8 lanes: WRITE and READ, contiguous and scattered, from many threads") {
  constexpr std::size_t size = 32u << 20;
  pool p{threads};
  std::vector<std::byte> remote(size), local(size), back(size);
  kvlink::tcp_engine target(p.io.get_executor(), lanes_config(8));
  kvlink::tcp_engine initiator(p.io.get_executor(), lanes_config(8));
  target.register_segment(remote.data(), remote.size());
  initiator.register_segment(local.data(), local.size());
  initiator.register_segment(back.data(), back.size());
  kvlink::peer peer = initiator.async_connect(target.local_address(), asio::use_future).get();
  REQUIRE(peer.transport() == "tcp");
  const auto seg = peer.segment(0);

  // Four submitting threads, each on its own quarter, each round with new bytes.
  std::vector<std::thread> users;
  std::atomic<int> failures{0};
  for (int u = 0; u < 4; ++u) {
    users.emplace_back([&, u] {
      const std::size_t quarter = size / 4, base = u * quarter;
      std::mt19937_64 g(static_cast<std::uint64_t>(u) + 1);
      for (int round = 0; round < 6; ++round) {
        const std::uint64_t seed = 100 * u + round;
        fill_pattern(local.data() + base, quarter, seed, 0);
        std::vector<kvlink::transfer_request> w, rd;
        if (round % 2 == 0) {  // contiguous
          w.push_back({opcode::write, local.data() + base, seg, base, quarter});
          rd.push_back({opcode::read, back.data() + base, seg, base, quarter});
        } else {  // scattered 16 KiB blocks, shuffled on the remote side
          constexpr std::size_t block = 16u << 10;
          std::vector<std::size_t> order(quarter / block);
          for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
          std::shuffle(order.begin(), order.end(), g);
          for (std::size_t i = 0; i < order.size(); ++i) {
            w.push_back({opcode::write, local.data() + base + i * block, seg,
                         base + order[i] * block, block});
            rd.push_back({opcode::read, back.data() + base + i * block, seg,
                          base + order[i] * block, block});
          }
        }
        std::memset(back.data() + base, 0, quarter);
        const auto wr = submit(initiator, w);
        const auto rr = submit(initiator, rd);
        if (wr.ec || rr.ec || wr.r.bytes != quarter || rr.r.bytes != quarter ||
            std::memcmp(back.data() + base, local.data() + base, quarter) != 0) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : users) t.join();
  CHECK(failures.load() == 0);
  CHECK(peer.connected());
}

// Each transfer submitted from the handler of the one before it, on the
// pool's threads: the engine starts it in the submitting thread when its
// strand is idle, queues it behind the strand otherwise; both meet here.
TEST_CASE("8 threads: transfers submitted from handlers, eight chains at once") {
  constexpr int chains = 8, rounds = 40;
  constexpr std::size_t piece = 4096, pieces = 16, part = piece * pieces;
  // The target in a process of its own: in one process ThreadSanitizer
  // would see no order between the target's lane that sent a READ's bytes
  // (its sendmsg interceptor records the read of the buffer after the
  // release that orders it) and the lane that overwrites them next WRITE.
  kvlink_test::peer_process child({"--size", std::to_string(chains * part), "--seed", "3"});
  pool p{threads};
  std::vector<std::byte> local(chains * part), back(chains * part);
  kvlink::tcp_engine initiator(p.io.get_executor(), lanes_config(4));
  initiator.register_segment(local.data(), local.size());
  initiator.register_segment(back.data(), back.size());
  kvlink::peer peer = initiator.async_connect(child.address(), asio::use_future).get();
  const auto seg = peer.segment(0);

  struct chain {
    int round = 0;
    int failures = 0;
    int ran_inside = 0;  // handlers run inside the call that submitted them
    std::promise<void> done;
  };
  static thread_local bool inside_call = false;
  std::vector<chain> cs(chains);
  std::function<void(int)> next = [&](int c) {
    chain& ch = cs[c];
    if (ch.round == rounds) {
      ch.done.set_value();
      return;
    }
    const std::size_t base = c * part;
    fill_pattern(local.data() + base, part, 1000 * c + ch.round, 0);
    std::memset(back.data() + base, 0, part);
    // Scattered pieces, the remote side reversed each round.
    std::vector<kvlink::transfer_request> w, rd;
    for (std::size_t i = 0; i < pieces; ++i) {
      const std::size_t to = (ch.round % 2 ? pieces - 1 - i : i) * piece;
      w.push_back({opcode::write, local.data() + base + i * piece, seg, base + to, piece});
      rd.push_back({opcode::read, back.data() + base + i * piece, seg, base + to, piece});
    }
    inside_call = true;
    initiator.async_submit_transfer(w, [&, c, rd](std::error_code wec, kvlink::transfer_result) {
      chain& wc = cs[c];
      wc.ran_inside += inside_call;
      if (wec) ++wc.failures;
      inside_call = true;
      initiator.async_submit_transfer(rd, [&, c](std::error_code rec, kvlink::transfer_result r) {
        chain& rc = cs[c];
        rc.ran_inside += inside_call;
        const std::size_t at = c * part;
        if (rec || r.bytes != part || std::memcmp(back.data() + at, local.data() + at, part) != 0) {
          ++rc.failures;
        }
        ++rc.round;
        next(c);
      });
      inside_call = false;
    });
    inside_call = false;
  };
  for (int c = 0; c < chains; ++c) asio::post(p.io, [&next, c] { next(c); });
  for (auto& ch : cs) {
    REQUIRE(ch.done.get_future().wait_for(120s) == std::future_status::ready);
    CHECK(ch.failures == 0);
    CHECK(ch.ran_inside == 0);
  }
}

TEST_CASE("8 threads: one target serving four initiators at once") {
  constexpr std::size_t each = 8u << 20;
  pool p{threads};
  std::vector<std::byte> remote(4 * each);
  kvlink::tcp_engine target(p.io.get_executor(), lanes_config(4));
  target.register_segment(remote.data(), remote.size());
  std::vector<std::vector<std::byte>> locals(4, std::vector<std::byte>(each));
  std::vector<std::unique_ptr<kvlink::tcp_engine>> initiators;
  std::vector<std::future<result>> done;
  for (int i = 0; i < 4; ++i) {
    initiators.push_back(
        std::make_unique<kvlink::tcp_engine>(p.io.get_executor(), lanes_config(4)));
    initiators[i]->register_segment(locals[i].data(), each);
    fill_pattern(locals[i].data(), each, 7 + i, 0);
  }
  for (int i = 0; i < 4; ++i) {
    auto peer = initiators[i]->async_connect(target.local_address(), asio::use_future).get();
    done.push_back(std::async(std::launch::async, [&, i, peer] {
      return submit(*initiators[i], {{opcode::write, locals[i].data(), peer.segment(0),
                                      static_cast<std::uint64_t>(i) * each, each}});
    }));
  }
  for (int i = 0; i < 4; ++i) {
    const auto r = done[i].get();
    REQUIRE_MESSAGE(!r.ec, r.ec.message());
    CHECK(is_pattern(remote.data() + i * each, each, 7 + i, 0));
  }
}

TEST_CASE("8 threads: cancelled transfers; after the handler no byte of them changes") {
  constexpr std::size_t size = 16u << 20;
  pool p{threads};
  std::vector<std::byte> remote(size), local(size);
  kvlink::tcp_engine target(p.io.get_executor(), lanes_config(8));
  kvlink::tcp_engine initiator(p.io.get_executor(), lanes_config(8));
  target.register_segment(remote.data(), remote.size());
  initiator.register_segment(local.data(), local.size());
  kvlink::peer peer = initiator.async_connect(target.local_address(), asio::use_future).get();
  fill_pattern(remote.data(), size, 11, 0);
  int cancelled = 0;
  for (int round = 0; round < 12; ++round) {
    CAPTURE(round);
    std::memset(local.data(), 0, size);
    asio::cancellation_signal sig;
    std::promise<result> out;
    initiator.async_submit_transfer(
        std::vector<kvlink::transfer_request>{
            {opcode::read, local.data(), peer.segment(0), 0, size}},
        asio::bind_cancellation_slot(sig.slot(),
                                     [&out](std::error_code ec, kvlink::transfer_result r) {
                                       out.set_value({ec, r});
                                     }));
    std::this_thread::sleep_for(std::chrono::microseconds(200 * (round % 5)));
    asio::post(p.io, [&sig] { sig.emit(asio::cancellation_type::terminal); });
    const auto r = out.get_future().get();
    if (r.ec) {
      CHECK(r.ec == kvlink::errc::cancelled);
      ++cancelled;
    } else {
      CHECK(is_pattern(local.data(), size, 11, 0));
    }
    // The handler is the fence: nothing of that READ lands afterwards.
    const std::vector<std::byte> snapshot(local);
    std::this_thread::sleep_for(20ms);
    CHECK(std::memcmp(snapshot.data(), local.data(), size) == 0);
    // The peer stays usable.
    const auto again = submit(initiator, {{opcode::read, local.data(), peer.segment(0), 0, 4096}});
    REQUIRE_MESSAGE(!again.ec, again.ec.message());
    CHECK(is_pattern(local.data(), 4096, 11, 0));
  }
  MESSAGE(cancelled << " of 12 cancelled mid-transfer");
}

TEST_CASE("8 threads: a target process killed mid-transfer fails what it carried, nothing hangs") {
  constexpr std::uint64_t size = 64u << 20;
  for (const auto op : {opcode::write, opcode::read}) {
    CAPTURE(kvlink::to_string(op));
    kvlink_test::peer_process child({"--size", std::to_string(size), "--seed", "3"});
    pool p{threads};
    std::vector<std::byte> local(size);
    {
      kvlink::tcp_engine initiator(p.io.get_executor(), lanes_config(8));
      initiator.register_segment(local.data(), local.size(), kvlink::access::none);
      kvlink::peer peer = initiator.async_connect(child.address(), asio::use_future).get();
      const auto seg = peer.segment(0);
      std::vector<std::future<result>> running;
      for (int i = 0; i < 4; ++i) {
        running.push_back(std::async(std::launch::async, [&, i] {
          const std::uint64_t quarter = size / 4;
          return submit(initiator, {{op, local.data() + i * quarter, seg, i * quarter, quarter}});
        }));
      }
      std::this_thread::sleep_for(5ms);
      child.kill_now();
      for (auto& f : running) {
        const auto r = f.get();
        if (r.ec) CHECK(r.ec == kvlink::errc::peer_closed);
      }
      const auto later = submit(initiator, {{op, local.data(), seg, 0, 16}});
      CHECK(later.ec == kvlink::errc::peer_closed);
      CHECK_FALSE(peer.connected());
    }  // destroyed while 8 threads run the io_context
  }
}
