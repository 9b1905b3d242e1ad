// The store as its users run it: a kvlink-master process and store clients
// each in its own process (kvlink_store_peer, test/support/store_peer.cpp),
// on loopback. Bytes are checked where they arrive; errors are checked by
// their codes.
#include <kvlink/store/error.hpp>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "processes.hpp"
#include <doctest/doctest.h>

#ifndef KVLINK_MASTER_PATH
#error "KVLINK_MASTER_PATH and KVLINK_STORE_PEER_PATH are set by test/store/CMakeLists.txt"
#endif

namespace {

using namespace kvlink_store_test;

// A kvlink-master process with short liveness timeouts, so the tests see
// clients declared gone within seconds.
struct master {
  explicit master(std::uint16_t port = 0, const std::string& secret = {}, bool records = true,
                  const std::string& more_settings = {})
      : config(std::string(R"({"store_heartbeat_interval": "100ms", "store_suspect_after": "400ms",
                   "store_liveness_timeout": "1500ms", "store_object_records": )") +
               (records ? "true" : "false") + more_settings + "}"),
        secret_file(secret.empty() ? "unused" : secret),
        proc(KVLINK_MASTER_PATH, args(port, secret.empty()), "kvlink-master: listening on ") {
    address = proc.address().substr(0, proc.address().find(' '));
  }
  std::vector<std::string> args(std::uint16_t port, bool open) const {
    std::vector<std::string> a{"--listen", std::string("127.0.0.1:").append(std::to_string(port)),
                               "--config", config.path};
    if (!open) {
      a.push_back("--auth-secret-file");
      a.push_back(secret_file.path);
    }
    return a;
  }
  temp_file config;
  temp_file secret_file;
  peer_process proc;
  std::string address;
};

}  // namespace

TEST_CASE("store: put, get, exists, remove across processes; first writer wins") {
  master m;
  auto a = client(m.address);     // serves a segment
  auto b = client(m.address, 0);  // a pure requester
  CHECK(a.command("PUT k1 100000 7") == "OK");
  CHECK(b.command("GET k1 7") == "OK 100000");
  CHECK(a.command("GET k1 7") == "OK 100000");        // from its own segment
  CHECK(b.command("GET k1 8").rfind("BAD", 0) == 0);  // the check can fail
  CHECK(b.command("EXISTS k1") == "YES");
  CHECK(b.command("EXISTS k2") == "NO");
  CHECK(
      b.command("PUT k1 10 9").rfind("ERR " + code(kvlink::store_errc::object_already_exists), 0) ==
      0);
  CHECK(b.command("GET k1 7") == "OK 100000");  // unchanged
  CHECK(b.command("PUT k2 4096 3") == "OK");    // from a requester into a's segment
  CHECK(a.command("GET k2 3") == "OK 4096");
  // Read a moment ago: it holds a read lease, so only a forced remove takes it.
  CHECK(b.command("REMOVE k1").rfind("ERR " + code(kvlink::store_errc::object_has_lease), 0) == 0);
  CHECK(b.command("EXISTS k1") == "YES");
  CHECK(b.command("REMOVE k1 force") == "OK");
  CHECK(b.command("EXISTS k1") == "NO");
  CHECK(b.command("GET k1 7").rfind("ERR " + code(kvlink::store_errc::object_not_found), 0) == 0);
  CHECK(b.command("REMOVE k1").rfind("ERR " + code(kvlink::store_errc::object_not_found), 0) == 0);
  // Bad input: a key longer than the master's bound, a size of zero.
  CHECK(b.command("PUT " + std::string(5000, 'x') + " 10 1")
            .rfind("ERR " + code(kvlink::store_errc::invalid_key), 0) == 0);
  CHECK(b.command("PUT zero 0 1").rfind("ERR " + code(kvlink::store_errc::invalid_params), 0) == 0);
  CHECK(a.finish() == 0);
  CHECK(b.finish() == 0);
}

TEST_CASE("store: batches of 4 KiB objects, every byte checked, results in order") {
  master m;
  auto a = client(m.address);
  auto b = client(m.address);
  CHECK(a.command("PUTB 500 blk 4096 100") == "OK");
  CHECK(b.command("GETB 500 blk 100") == "OK");
  CHECK(a.command("GETB 500 blk 100") == "OK");
  // Existing keys fail one by one, in order; the batch as a whole answers.
  CHECK(b.command("PUTB 3 blk 64 1")
            .rfind("ERR 0 " + code(kvlink::store_errc::object_already_exists), 0) == 0);
  CHECK(b.command("GETB 501 blk 100")
            .rfind("ERR 500 " + code(kvlink::store_errc::object_not_found), 0) == 0);
  CHECK(a.finish() == 0);
  CHECK(b.finish() == 0);
}

TEST_CASE("store: a replica's owner SIGKILLed: the other replica serves; its own objects go") {
  master m;
  auto a = client(m.address);
  auto req = client(m.address, 0);
  CHECK(req.command("PUT only-a 65536 11") == "OK");  // a is the only segment
  auto c = client(m.address);
  CHECK(req.command("PUT both 65536 12 2") == "OK");  // on a and c
  CHECK(req.command("GET both 12") == "OK 65536");
  a.kill_now();
  // Reads of "both" go to c (at once, or after a's replica fails).
  CHECK(req.command("GET both 12") == "OK 65536");
  // Within the liveness timeout a's objects leave the lookups.
  CHECK(until(req, "EXISTS only-a", "NO") == "NO");
  CHECK(
      req.command("GET only-a 11").rfind("ERR " + code(kvlink::store_errc::object_not_found), 0) ==
      0);
  CHECK(req.command("GET both 12") == "OK 65536");
  CHECK(c.finish() == 0);
  CHECK(req.finish() == 0);
}

TEST_CASE("store: the master restarted: clients mount again and their objects come back") {
  const auto port = free_port();
  auto m = std::make_unique<master>(port);
  auto a = client(m->address);
  auto b = client(m->address, 0);
  CHECK(b.command("PUT before 4096 1") == "OK");
  CHECK(b.command("PUTB 200 blk 1000 5") == "OK");
  CHECK(b.command("PUT gone 4096 4") == "OK");
  CHECK(b.command("REMOVE gone force") == "OK");
  CHECK(b.command("PUT replaced 3000 6") == "OK");
  m.reset();  // SIGKILL: the master's tables are gone; a's memory holds the objects
  CHECK(b.command("PUT during 4096 2").rfind("ERR " + code(kvlink::store_errc::rpc_failed), 0) ==
        0);
  m = std::make_unique<master>(port);
  // a mounts its segment again by itself, with the objects its records
  // show; b reads them with their bytes, and puts find space around them.
  CHECK(until(b, "GET before 1", "OK") == "OK 4096");
  CHECK(b.command("GETB 200 blk 5") == "OK");
  CHECK(b.command("GET replaced 6") == "OK 3000");
  CHECK(b.command("PUT after 4096 3") == "OK");
  CHECK(a.command("GET after 3") == "OK 4096");
  CHECK(b.command("GET before 1") == "OK 4096");
  CHECK(b.command("EXISTS during") == "NO");
  CHECK(a.finish() == 0);
  CHECK(b.finish() == 0);
}

// 1,000 objects whose announcement is larger than the master takes in one
// frame (store_max_body 8 KiB: about 150 objects a frame): the owner mounts
// its segment closed and announces the rest in adopt frames; all come back,
// and nothing is placed in the segment before the last frame.
TEST_CASE("store: a restarted master takes back more objects than one frame announces") {
  const auto port = free_port();
  const std::string small = R"(, "store_max_body": 8192)";
  auto m = std::make_unique<master>(port, std::string{}, true, small);
  auto a = client(m->address);
  auto b = client(m->address, 0);
  for (int i = 0; i < 10; ++i) {
    const std::string batch = "PUTB 100 many" + std::to_string(i) + "- 1000 " + std::to_string(i);
    REQUIRE(b.command(batch) == "OK");
  }
  m.reset();
  m = std::make_unique<master>(port, std::string{}, true, small);
  CHECK(until(b, "GET many0-0 0", "OK") == "OK 1000");
  for (int i = 0; i < 10; ++i) {
    CHECK(b.command("GETB 100 many" + std::to_string(i) + "- " + std::to_string(i)) == "OK");
  }
  CHECK(b.command("STATS").rfind("OK ", 0) == 0);
  CHECK(b.command("PUT after 4096 3") == "OK");
  CHECK(b.command("GETB 100 many9- 9") == "OK");  // not overwritten by the new put
  CHECK(a.finish() == 0);
  CHECK(b.finish() == 0);
}

TEST_CASE("store: without object records a restarted master starts empty") {
  const auto port = free_port();
  auto m = std::make_unique<master>(port, "", false);
  auto a = client(m->address);
  auto b = client(m->address, 0);
  CHECK(b.command("PUT before 4096 1") == "OK");
  CHECK(b.command("GET before 1") == "OK 4096");
  m.reset();
  m = std::make_unique<master>(port, "", false);
  CHECK(until(b, "PUT after 4096 3", "OK") == "OK");  // a mounted again, empty
  CHECK(b.command("GET after 3") == "OK 4096");
  CHECK(b.command("EXISTS before") == "NO");
  CHECK(a.finish() == 0);
  CHECK(b.finish() == 0);
}

// Puts from two clients and gets from a third while the master is SIGKILLed
// and started again, twice: every put that was acknowledged is read back
// afterwards with its bytes, from one segment or two.
TEST_CASE("store: the master SIGKILLed under a put and get load loses no completed object") {
  const auto port = free_port();
  auto m = std::make_unique<master>(port);
  auto a = client(m->address);
  auto d = client(m->address);
  auto w1 = client(m->address, 8u << 20);  // its own segment too: copies, not transfers
  auto w2 = client(m->address, 0);
  auto r = client(m->address, 0);
  const auto out = kvlink_store_test::put_get_load(w1, w2, r, [&] {
    for (int round = 0; round < 2; ++round) {
      std::this_thread::sleep_for(1500ms);
      m.reset();  // SIGKILL
      std::this_thread::sleep_for(300ms);
      m = std::make_unique<master>(port);
    }
    std::this_thread::sleep_for(1500ms);
  });
  CHECK(out.bad_reads == 0);
  REQUIRE(out.acked > 50);
  MESSAGE(out.acked << " puts acknowledged, " << out.reads << " gets");
  for (const auto& e : out.lost_examples) MESSAGE(e);
  CHECK(out.lost == 0);
  for (auto* p : {&a, &d, &w1, &w2, &r}) CHECK(p->finish() == 0);
}

// The SSD tier: a 4 MiB segment whose owner has a disk takes 8 MiB of
// objects (the ones eviction takes go to its disk, gets read them back);
// the owner SIGKILLed and started again on the same directory brings back
// what its disk holds; so does a master restarted.
TEST_CASE("store: the SSD tier across processes: evicted, read back, back after kills") {
  const auto port = free_port();
  const std::string fast = R"(, "store_lease_ttl": "50ms")";
  auto m = std::make_unique<master>(port, "", true, fast);
  char dir_template[] = "/tmp/kvlink-ssd-XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  struct cleanup {
    std::string path;
    ~cleanup() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  } wipe{dir};
  auto a = std::make_unique<peer_process>(KVLINK_STORE_PEER_PATH,
                                          client_args(m->address, 4u << 20, {}, dir), "READY ");
  auto b = client(m->address, 0);
  constexpr int count = 32;
  const auto key = [](int i) { return std::string("ssd").append(std::to_string(i)); };
  const auto put_all = [&] {
    for (int i = 0; i < count; ++i) {
      const std::string line = "PUT " + key(i) + " 262144 " + std::to_string(10 + i);
      CHECK(until(b, line, "OK", 20s) == "OK");
    }
  };
  // Objects read back with their bytes; the rest must be not-found.
  const auto read_all = [&] {
    int good = 0;
    for (int i = 0; i < count; ++i) {
      const std::string got = b.command("GET " + key(i) + " " + std::to_string(10 + i));
      if (got == "OK 262144") {
        ++good;
      } else {
        CHECK_MESSAGE(got.rfind("ERR " + code(kvlink::store_errc::object_not_found), 0) == 0,
                      key(i) << ": " << got);
      }
    }
    return good;
  };
  put_all();
  CHECK(read_all() == count);
  CHECK(read_all() == count);
  // SIGKILL: the master declares a gone (1.5 s) and forgets its segment and
  // disk; started again on the same directory, a announces what its disk
  // holds (all but the objects only its memory held).
  a->kill_now();
  a.reset();
  CHECK(until(b, "EXISTS " + key(0), "NO", 10s) == "NO");
  a = std::make_unique<peer_process>(KVLINK_STORE_PEER_PATH,
                                     client_args(m->address, 4u << 20, {}, dir), "READY ");
  const int after_owner = read_all();
  MESSAGE(after_owner << " of " << count << " objects back after the owner's restart");
  CHECK(after_owner >= count - 16);  // a 4 MiB segment holds at most 16 of them
  // The master SIGKILLed and started again: a mounts its segment and its
  // disk again with what they hold; nothing that was readable is lost.
  m.reset();
  m = std::make_unique<master>(port, "", true, fast);
  CHECK(until(b, "EXISTS " + key(count - 1), "YES", 15s) == "YES");
  std::this_thread::sleep_for(500ms);  // the rest of the announcements
  const int after_master = read_all();
  MESSAGE(after_master << " of " << count << " objects back after the master's restart");
  CHECK(after_master >= after_owner);
  CHECK(a->finish() == 0);
  CHECK(b.finish() == 0);
}

TEST_CASE("store: the master's secret: a client without it, or with another, is refused") {
  master m(0, "s3cret");
  auto good = client(m.address, 1u << 20, "s3cret");
  CHECK(good.command("PUT k 100 1") == "OK");
  CHECK_THROWS(client(m.address, 0, "wrong"));  // its first line is ERR, not READY
  CHECK_THROWS(client(m.address, 0));
  CHECK(good.command("GET k 1") == "OK 100");
  CHECK(good.finish() == 0);
}
