// Device memory over the same-host transport (shm/device.hpp): a grant's
// "device" object round-trips and is checked field by field; an imported
// allocation is closed when its owner goes. (The path's and the target's
// use of them: transport_test.cpp.)
#include <kvlink/memory/emulated.hpp>
#include <kvlink/shm/device.hpp>

#include <fstream>
#include <string>

#include <doctest/doctest.h>
#include <unistd.h>

namespace {

using json = nlohmann::json;

// Mappings of emulated device memory in this process (transport_test.cpp
// has its own: the two files form one translation unit in a unity build).
int emulated_mapping_count() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:kvlink-emulated-device") != std::string::npos) ++n;
  }
  return n;
}

}  // namespace

TEST_CASE("shm device grant: round trip, and every field checked") {
  kvlink::shm::device_grant g;
  g.runtime = "cuda";
  g.memory.method = "ipc";
  g.memory.handle = {0x00, 0xab, 0xff};
  g.memory.device = 3;
  g.memory.size = 1 << 20;
  g.offset = 4096;
  const auto j = kvlink::shm::to_json(g);
  CHECK(j["handle"] == "00abff");
  CHECK_FALSE(j.contains("fd"));  // ipc passes no descriptor
  kvlink::shm::device_grant back;
  std::string why;
  REQUIRE(kvlink::shm::parse_device_grant(j, (1 << 20) - 4096, back, why) == kvlink::errc{});
  CHECK(back.runtime == "cuda");
  CHECK(back.memory.handle == g.memory.handle);
  CHECK(back.memory.device == 3);
  CHECK(back.memory.fd == -1);
  CHECK(back.offset == 4096);
  // One byte more than the allocation holds past the offset.
  CHECK(kvlink::shm::parse_device_grant(j, (1 << 20) - 4095, back, why) ==
        kvlink::errc::malformed_message);
  CHECK(why.find("does not hold the segment") != std::string::npos);

  g.memory.method = "memfd";
  g.memory.fd = 12;
  auto m = kvlink::shm::to_json(g);
  CHECK(m["fd"] == 12);
  REQUIRE(kvlink::shm::parse_device_grant(m, 1, back, why) == kvlink::errc{});
  CHECK(back.memory.fd == 12);
  for (const char* field : {"runtime", "method", "handle", "index", "size", "offset"}) {
    CAPTURE(field);
    auto bad = m;
    bad.erase(field);
    CHECK(kvlink::shm::parse_device_grant(bad, 1, back, why) == kvlink::errc::malformed_message);
    bad[field] = json::array();
    CHECK(kvlink::shm::parse_device_grant(bad, 1, back, why) == kvlink::errc::malformed_message);
  }
  auto huge = m;
  huge["fd"] = std::uint64_t{1} << 40;
  CHECK(kvlink::shm::parse_device_grant(huge, 1, back, why) == kvlink::errc::malformed_message);
  huge = m;
  huge["index"] = std::uint64_t{1} << 40;
  CHECK(kvlink::shm::parse_device_grant(huge, 1, back, why) == kvlink::errc::malformed_message);
  huge = m;
  huge["size"] = ~std::uint64_t{0};
  huge["offset"] = ~std::uint64_t{0};
  CHECK(kvlink::shm::parse_device_grant(huge, 2, back, why) == kvlink::errc::malformed_message);
  CHECK(kvlink::shm::parse_device_grant(json("memfd"), 1, back, why) ==
        kvlink::errc::malformed_message);
}

TEST_CASE("shm imported allocation: closed through its runtime when the last owner goes") {
  auto rt = kvlink::emulated_device::get();
  kvlink::device_buffer buf{rt, 0, 1 << 16};
  const int before = emulated_mapping_count();
  kvlink::exported_memory m;
  std::string what;
  REQUIRE(!rt->export_memory(buf.data(), m, what));
  std::error_code ec;
  void* p = rt->import_memory(m, ::dup(m.fd), ec, what);
  REQUIRE_MESSAGE(p != nullptr, what);
  CHECK(rt->classify(p).memory.kind == kvlink::memory_kind::device);
  {
    auto a = std::make_shared<kvlink::shm::imported_allocation>(rt, p, m.device, m.size);
    auto held = a;  // a lease and a copy in flight, say
    CHECK(emulated_mapping_count() == before + 2);
    a.reset();
    CHECK(emulated_mapping_count() == before + 2);
  }
  CHECK(emulated_mapping_count() == before);
  CHECK(rt->classify(p).memory.kind == kvlink::memory_kind::host);
}
