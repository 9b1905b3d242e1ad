// The same-host transport's ring (shm/ring.hpp), both sides in this
// process: pieces WRITTEN and READ through a small ring, slot after slot,
// land where their descriptors say; the target checks each piece against
// the leases it is given and fails a bad one alone; hostile descriptors and
// counters written straight into the ring stop the bad slot or the ring,
// never a copy outside; the initiator checks the grant and the target's
// counter; a ring that stops answering fails its slices when told, and a
// transfer stopping drops its queued ones.
#include <kvlink/shm/cma.hpp>
#include <kvlink/shm/ring.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../../support/test_support.hpp"
#include <asio/io_context.hpp>
#include <doctest/doctest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

using kvlink::opcode;
using kvlink_test::fill_pattern;
using kvlink_test::is_pattern;
using kvlink_test::run_until;
using json = nlohmann::json;

// The engine as the ring sees it: finished slices kept.
class ring_host final : public kvlink::transport_host {
 public:
  void slice_done(kvlink::detail::transfer_op* op, std::uint64_t bytes,
                  std::error_code ec) override {
    done.push_back({op, bytes, ec});
  }
  bool stopping(const kvlink::detail::transfer_op* op) const noexcept override {
    return op == stopped;
  }
  bool pin(kvlink::segment_id) override { return true; }
  void unpin(kvlink::segment_id) override {}

  std::uint64_t slices() const {
    std::uint64_t n = 0;
    for (const auto& d : done) n += d.slices;
    return n;
  }

  std::vector<kvlink::slice_report> done;
  const kvlink::detail::transfer_op* stopped = nullptr;
};

kvlink::detail::transfer_op* op_of(std::uintptr_t tag) {
  return reinterpret_cast<kvlink::detail::transfer_op*>(tag);
}

// A target with leased segments (id -> memory, access) and the pins it holds.
struct ring_rig {
  asio::io_context io;
  ring_host host;
  kvlink::shm::ring_shape shape{4, 8192, 8};  // small: slots wrap around often
  std::map<std::uint64_t, kvlink::shm::ring_segment> leased;
  std::map<std::uint64_t, int> pins;
  std::shared_ptr<kvlink::shm::ring_server> server;
  std::shared_ptr<kvlink::shm::ring_client> client;
  kvlink::shm::pid_watch self{::getpid()};
  std::optional<std::error_code> fatal;

  ring_rig() {
    std::string why;
    server = kvlink::shm::ring_server::make(
        io.get_executor(), shape,
        [this](std::uint64_t id, kvlink::shm::ring_segment& out) {
          const auto it = leased.find(id);
          if (it == leased.end()) return kvlink::errc::not_registered;
          ++pins[id];
          out = it->second;
          return kvlink::errc{};
        },
        [this](std::uint64_t id) { --pins[id]; }, why);
    REQUIRE_MESSAGE(server, why);
    server->start();
    REQUIRE(self.watching());
    client = kvlink::shm::ring_client::open(
        io.get_executor(), host, server->grant(), self.fd(),
        [this](std::error_code ec) {
          fatal = ec;
          client->fail(ec);
        },
        why);
    REQUIRE_MESSAGE(client, why);
  }
  ~ring_rig() {
    server->stop();
    if (client) client->fail(kvlink::errc::cancelled);
    io.run_for(std::chrono::milliseconds(50));
  }

  kvlink::slice_ref slice(std::uintptr_t tag, opcode k, std::byte* local, std::uint64_t seg,
                          std::uint64_t off, std::uint64_t len) const {
    kvlink::slice_ref s;
    s.op = op_of(tag);
    s.kind = k;
    s.local = local;
    s.segment = seg;
    s.offset = off;
    s.length = len;
    return s;
  }

  // Until `n` slices were reported.
  void settle(std::uint64_t n) {
    client->pump();
    REQUIRE(run_until(io, [&] { return host.slices() >= n; }));
  }

  // The ring's memory as the initiator sees it (a mapping of its own).
  std::shared_ptr<std::byte> map_ring() const {
    const auto g = server->grant();
    const auto size = g["size"].get<std::size_t>();
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, g["fd"].get<int>(), 0);
    REQUIRE(p != MAP_FAILED);
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(p),
                                      [size](std::byte* q) { ::munmap(q, size); });
  }
};

TEST_CASE("ring: pieces WRITTEN and READ through it land where they say, slot after slot") {
  ring_rig r;
  std::vector<std::byte> theirs(1u << 20), mine(1u << 20);
  r.leased[7] = {theirs.data(), theirs.size(), kvlink::access::remote_read_write};
  fill_pattern(mine.data(), mine.size(), 11, 0);

  // Pieces of 1 B .. 8 KiB (a whole slot) at odd places, disjoint.
  std::mt19937_64 rng{7};
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (std::uint64_t at = 1; at + 8192 < theirs.size();) {
    const std::uint64_t len = 1 + rng() % 8192;
    spans.emplace_back(at, len);
    at += len + 1 + rng() % 300;
  }
  REQUIRE(spans.size() > 100);  // dozens of times around the 4 slots
  std::uint64_t bytes = 0;
  for (const auto& [off, len] : spans) {
    r.client->add(r.slice(1, opcode::write, mine.data() + off, 7, off, len));
    bytes += len;
  }
  // Reported in runs (add_report), every piece a success.
  auto total = [&] {
    std::uint64_t n = 0;
    for (const auto& d : r.host.done) {
      CHECK(!d.ec);
      CHECK(d.op == op_of(r.host.done[0].op == op_of(1) ? 1 : 2));
      n += d.bytes;
    }
    return n;
  };
  r.settle(spans.size());
  CHECK(r.host.slices() == spans.size());
  CHECK(total() == bytes);
  for (const auto& [off, len] : spans) REQUIRE(is_pattern(theirs.data() + off, len, 11, off));
  CHECK(theirs[0] == std::byte{0});  // between the pieces: untouched
  CHECK(theirs[spans[0].first + spans[0].second] == std::byte{0});
  CHECK(r.pins[7] == 0);  // every pin given back

  // READ them back into zeroed memory.
  std::fill(mine.begin(), mine.end(), std::byte{0});
  r.host.done.clear();
  for (const auto& [off, len] : spans) {
    r.client->add(r.slice(2, opcode::read, mine.data() + off, 7, off, len));
  }
  r.settle(spans.size());
  CHECK(total() == bytes);
  for (const auto& [off, len] : spans) REQUIRE(is_pattern(mine.data() + off, len, 11, off));
  CHECK(mine[0] == std::byte{0});
  CHECK(!r.client->busy());
  CHECK(r.server->finished() > 2 * r.shape.slots);
}

TEST_CASE("ring target: each piece is checked against the leases it holds; a bad one fails alone") {
  ring_rig r;
  std::vector<std::byte> rw(8192), ro(8192), mine(8192);
  r.leased[1] = {rw.data(), rw.size(), kvlink::access::remote_read_write};
  r.leased[2] = {ro.data(), ro.size(), kvlink::access::remote_read};
  fill_pattern(mine.data(), mine.size(), 3, 0);
  fill_pattern(ro.data(), ro.size(), 4, 0);

  r.client->add(r.slice(1, opcode::write, mine.data(), 1, 0, 100));         // fine
  r.client->add(r.slice(2, opcode::write, mine.data(), 9, 0, 100));         // no lease
  r.client->add(r.slice(3, opcode::write, mine.data(), 1, 8150, 100));      // past the end
  r.client->add(r.slice(4, opcode::write, mine.data(), 2, 0, 100));         // read-only
  r.client->add(r.slice(5, opcode::read, mine.data() + 200, 2, 200, 50));   // fine
  r.client->add(r.slice(6, opcode::write, mine.data() + 300, 1, 300, 10));  // fine, after them
  r.settle(6);
  std::map<std::uintptr_t, kvlink::slice_report> by_op;
  for (const auto& d : r.host.done) by_op[reinterpret_cast<std::uintptr_t>(d.op)] = d;
  REQUIRE(by_op.size() == 6);
  CHECK(!by_op[1].ec);
  CHECK(by_op[1].bytes == 100);
  CHECK(by_op[2].ec == kvlink::errc::not_registered);
  CHECK(by_op[3].ec == kvlink::errc::out_of_bounds);
  CHECK(by_op[4].ec == kvlink::errc::access_denied);
  CHECK(by_op[2].bytes + by_op[3].bytes + by_op[4].bytes == 0);
  CHECK(!by_op[5].ec);
  CHECK(!by_op[6].ec);
  CHECK(is_pattern(rw.data(), 100, 3, 0));
  CHECK(is_pattern(rw.data() + 300, 10, 3, 300));
  CHECK(std::all_of(rw.begin() + 8100, rw.end(), [](std::byte b) { return b == std::byte{0}; }));
  CHECK(is_pattern(ro.data(), ro.size(), 4, 0));  // not written
  CHECK(is_pattern(mine.data() + 200, 50, 4, 200));
  CHECK(r.pins[1] == 0);
  CHECK(r.pins[2] == 0);
  CHECK(r.pins[9] == 0);
}

TEST_CASE("ring target: hostile slots fail their pieces; hostile counters stop the ring") {
  ring_rig r;
  std::vector<std::byte> theirs(8192);
  r.leased[1] = {theirs.data(), theirs.size(), kvlink::access::remote_read_write};
  r.client.reset();  // this test is the initiator, writing the ring itself
  const auto mem = r.map_ring();
  namespace d = kvlink::shm::ring_detail;
  auto& ctl = *reinterpret_cast<d::control*>(mem.get());
  const auto stride = d::slot_stride(r.shape);
  auto slot = [&](std::uint64_t i) { return mem.get() + d::page + (i % r.shape.slots) * stride; };
  auto piece_at = [&](std::uint64_t i, std::uint32_t k) {
    return reinterpret_cast<d::piece*>(slot(i) + sizeof(d::slot_header)) + k;
  };
  auto publish = [&](std::uint64_t posted) {
    d::store(ctl.posted, posted);
    d::ring_bell(r.server->grant()["doorbell"].get<int>());
  };
  auto finished = [&](std::uint64_t n) {
    return run_until(r.io, [&] { return d::load(ctl.done) >= n; });
  };

  // Slot 0: more pieces than a slot holds: each fails, nothing copied.
  reinterpret_cast<d::slot_header*>(slot(0))->count = 1000;
  for (std::uint32_t k = 0; k < r.shape.max_pieces; ++k) {
    *piece_at(0, k) = d::piece{1, 0, 16, d::kind_write, {}, 0, 0};
  }
  publish(1);
  REQUIRE(finished(1));
  for (std::uint32_t k = 0; k < r.shape.max_pieces; ++k) {
    CHECK(piece_at(0, k)->result == static_cast<int>(kvlink::errc::malformed_message));
  }
  // Slot 1: an unknown kind, a piece longer than the slot, pieces running
  // past the slot's data, then a good one that still fits.
  reinterpret_cast<d::slot_header*>(slot(1))->count = 4;
  *piece_at(1, 0) = d::piece{1, 0, 16, 7, {}, 0, 0};
  *piece_at(1, 1) = d::piece{1, 0, r.shape.slot_data + 1, d::kind_write, {}, 0, 0};
  *piece_at(1, 2) = d::piece{1, 100, 64, d::kind_write, {}, 0, 0};
  *piece_at(1, 3) = d::piece{1, 0, r.shape.slot_data, d::kind_write, {}, 0, 0};
  std::memset(slot(1) + sizeof(d::slot_header) + r.shape.max_pieces * sizeof(d::piece), 0x5a,
              r.shape.slot_data);
  publish(2);
  REQUIRE(finished(2));
  CHECK(piece_at(1, 0)->result == static_cast<int>(kvlink::errc::malformed_message));
  CHECK(piece_at(1, 1)->result == static_cast<int>(kvlink::errc::malformed_message));
  CHECK(piece_at(1, 2)->result == 0);  // its bytes follow the first piece's room
  CHECK(piece_at(1, 3)->result == static_cast<int>(kvlink::errc::malformed_message));  // past it
  CHECK(std::all_of(theirs.begin() + 100, theirs.begin() + 164,
                    [](std::byte b) { return b == std::byte{0x5a}; }));
  CHECK(std::all_of(theirs.begin(), theirs.begin() + 100,
                    [](std::byte b) { return b == std::byte{0}; }));
  CHECK(std::all_of(theirs.begin() + 164, theirs.end(),
                    [](std::byte b) { return b == std::byte{0}; }));
  // A counter claiming more slots than the ring has: the ring stops.
  reinterpret_cast<d::slot_header*>(slot(2))->count = 1;
  *piece_at(2, 0) = d::piece{1, 0, 16, d::kind_write, {}, 0, 0};
  publish(2 + r.shape.slots + 1);
  r.io.run_for(std::chrono::milliseconds(100));
  CHECK(d::load(ctl.done) == 2);
  CHECK(piece_at(2, 0)->result == 0);  // never looked at
  CHECK(r.pins[1] == 0);
}

TEST_CASE("ring initiator: the target's grant and counter are checked") {
  ring_rig r;
  const json good = r.server->grant();
  std::string why;
  auto open = [&](const json& g) {
    why.clear();
    return kvlink::shm::ring_client::open(r.io.get_executor(), r.host, g, r.self.fd(), nullptr,
                                          why);
  };
  CHECK(open(good));
  for (const char* field : {"version", "fd", "size", "dev", "ino", "doorbell", "answer", "slots",
                            "slot_data", "max_pieces"}) {
    auto bad = good;
    bad.erase(field);
    CHECK_FALSE(open(bad));
    CHECK(why == "its grant is malformed");
    bad[field] = "1";
    CHECK_FALSE(open(bad));
  }
  auto bad = good;
  bad["version"] = 2u;
  CHECK_FALSE(open(bad));
  CHECK(why.find("version 2") != std::string::npos);
  bad = good;
  bad["slots"] = 5u;  // the size no longer matches
  CHECK_FALSE(open(bad));
  CHECK(why == "its ring's shape is out of range");
  bad = good;
  bad["ino"] = good["ino"].get<std::uint64_t>() + 1;
  CHECK_FALSE(open(bad));
  CHECK(why == "its descriptor is not the file it named");
  bad = good;
  bad["fd"] = 100000u;  // not a descriptor of the target's
  CHECK_FALSE(open(bad));
  CHECK(why.find("pidfd_getfd") == 0);

  // A file that is not sealed: refused (a target could make us fault).
  const int unsealed = ::memfd_create("kvlink-test", MFD_CLOEXEC);
  REQUIRE(unsealed >= 0);
  REQUIRE(::ftruncate(unsealed, static_cast<off_t>(good["size"].get<std::uint64_t>())) == 0);
  struct stat st {};
  REQUIRE(::fstat(unsealed, &st) == 0);
  bad = good;
  bad["fd"] = static_cast<std::uint64_t>(unsealed);
  bad["dev"] = static_cast<std::uint64_t>(st.st_dev);
  bad["ino"] = static_cast<std::uint64_t>(st.st_ino);
  CHECK_FALSE(open(bad));
  CHECK(why == "its file is not sealed against shrinking");
  ::close(unsealed);

  // The target says more slots are finished than were published: the
  // initiator fails the ring, and its slices with it.
  std::vector<std::byte> mine(64);
  r.server->stop();
  r.io.run_for(std::chrono::milliseconds(20));
  r.client->add(r.slice(1, opcode::write, mine.data(), 1, 0, 64));
  r.client->pump();
  const auto mem = r.map_ring();
  namespace d = kvlink::shm::ring_detail;
  d::store(reinterpret_cast<d::control*>(mem.get())->done, 5);
  r.client->pump();
  REQUIRE(r.fatal);
  CHECK(*r.fatal == kvlink::errc::malformed_message);
  REQUIRE(r.host.done.size() == 1);
  CHECK(r.host.done[0].ec == kvlink::errc::malformed_message);
}

TEST_CASE("ring initiator: a full ring frees finished slots while slices are added") {
  // While the engine plans a large transfer, add() takes back the slots the
  // target finished and publishes more; reports, waiters and failing stay
  // for pump().
  ring_rig r;
  r.server->stop();  // the test plays the target through the counter
  r.io.run_for(std::chrono::milliseconds(20));
  const auto mem = r.map_ring();
  namespace d = kvlink::shm::ring_detail;
  auto& done = reinterpret_cast<d::control*>(mem.get())->done;
  std::vector<std::byte> mine(64);
  for (int i = 0; i < 12; ++i) r.client->add(r.slice(1, opcode::write, mine.data(), 1, 0, 64));
  CHECK(r.client->busy());  // four slots of two, four slices queued

  d::store(done, 2);  // two slots finished
  r.client->add(r.slice(3, opcode::write, mine.data(), 1, 0, 64));
  CHECK(r.client->in_flight(op_of(3)));  // published without a pump
  CHECK(r.host.done.empty());            // reported by the pump
  r.client->pump();
  CHECK(r.host.slices() == 4);
  CHECK(!r.fatal);

  // A bad counter seen in add() fails the ring in the pump, not there.
  d::store(done, 99);
  for (int i = 0; i < 4; ++i) r.client->add(r.slice(4, opcode::write, mine.data(), 1, 0, 64));
  CHECK(!r.fatal);
  CHECK(r.host.slices() == 4);
  r.client->pump();
  REQUIRE(r.fatal);
  CHECK(*r.fatal == kvlink::errc::malformed_message);
  CHECK(r.host.slices() == 4 + 9 + 4);  // every slice added, reported once
}

TEST_CASE("ring initiator: a stopped transfer's queued slices go; failing reports every other") {
  ring_rig r;
  std::vector<std::byte> theirs(1u << 20), mine(1u << 20);
  r.leased[1] = {theirs.data(), theirs.size(), kvlink::access::remote_read_write};
  r.server->stop();  // the target copies nothing from here on
  r.io.run_for(std::chrono::milliseconds(20));
  // Transfer 1 fills every slot; transfers 2 and 3 wait in the queue.
  const std::uint64_t per_slot = r.shape.slot_data / 4096;
  for (std::uint64_t i = 0; i < r.shape.slots * per_slot; ++i) {
    r.client->add(r.slice(1, opcode::write, mine.data(), 1, i * 4096, 4096));
  }
  for (int i = 0; i < 5; ++i) r.client->add(r.slice(2, opcode::read, mine.data(), 1, 0, 4096));
  for (int i = 0; i < 3; ++i) r.client->add(r.slice(3, opcode::read, mine.data(), 1, 0, 4096));
  r.client->pump();
  r.io.run_for(std::chrono::milliseconds(20));
  CHECK(r.client->busy());
  CHECK(r.client->in_flight(op_of(1)));
  CHECK_FALSE(r.client->in_flight(op_of(2)));
  CHECK(r.host.done.empty());
  CHECK(r.client->drop(op_of(2)) == 5);  // counted, not reported
  bool idle = false;
  r.client->when_through([&] { idle = true; });
  CHECK_FALSE(idle);
  r.client->fail(kvlink::errc::peer_closed);
  CHECK(idle);
  std::map<std::uintptr_t, std::uint64_t> failed;
  for (const auto& d : r.host.done) {
    CHECK(d.ec == kvlink::errc::peer_closed);
    failed[reinterpret_cast<std::uintptr_t>(d.op)] += d.slices;
  }
  CHECK(failed[1] == r.shape.slots * per_slot);
  CHECK(failed[2] == 0);
  CHECK(failed[3] == 3);
  CHECK(std::all_of(theirs.begin(), theirs.end(), [](std::byte b) { return b == std::byte{0}; }));
}

TEST_CASE("ring initiator: a transfer stopping before its slices reach a slot is told cancelled") {
  ring_rig r;
  std::vector<std::byte> theirs(8192), mine(8192);
  r.leased[1] = {theirs.data(), theirs.size(), kvlink::access::remote_read_write};
  fill_pattern(mine.data(), mine.size(), 9, 0);
  r.host.stopped = op_of(1);
  r.client->add(r.slice(1, opcode::write, mine.data(), 1, 0, 4096));
  r.client->add(r.slice(2, opcode::write, mine.data() + 4096, 1, 4096, 4096));
  r.settle(2);
  std::map<std::uintptr_t, kvlink::slice_report> by_op;
  for (const auto& d : r.host.done) by_op[reinterpret_cast<std::uintptr_t>(d.op)] = d;
  CHECK(by_op[1].ec == kvlink::errc::cancelled);
  CHECK(!by_op[2].ec);
  CHECK(std::all_of(theirs.begin(), theirs.begin() + 4096,
                    [](std::byte b) { return b == std::byte{0}; }));
  CHECK(is_pattern(theirs.data() + 4096, 4096, 9, 4096));
}

}  // namespace
