// The store master's logic in-process: a client mounts a segment, a writer
// puts an object (start -> its engine would WRITE the bytes -> end), a
// reader gets it with a read lease, and eviction makes room when the pool
// fills. No I/O: the master program and its clients (over the engine) sit
// on top of this.
#include <kvlink/store/master/eviction.hpp>
#include <kvlink/store/master/objects.hpp>

#include <cstdio>
#include <string>

int main() {
  namespace st = kvlink::store;
  st::object_table table{};  // Mooncake's defaults: 10 s leases, evict at 90 %
  st::evictor evictor{table};

  kvlink::segment_id seg;
  if (auto ec = table.mount_segment({.client = 1, .name = "seg0", .size = 1 << 20}, seg)) {
    std::printf("mount: %s\n", ec.message().c_str());
    return 1;
  }

  auto now = st::master_clock::now();
  st::replica_list where;
  if (auto ec = table.put_start("block-0", 4096, /*writer=*/2, {}, now, where)) {
    std::printf("put_start: %s (Mooncake %d)\n", ec.message().c_str(), kvlink::mooncake_code(ec));
    return 1;
  }
  // ... the writer's engine WRITEs 4096 bytes to where[0].segment at where[0].offset ...
  std::printf("put block-0: segment %llu offset %llu\n",
              static_cast<unsigned long long>(where[0].segment.value()),
              static_cast<unsigned long long>(where[0].offset));
  (void)table.put_end("block-0", 2, now);

  st::object_info info;
  if (!table.get("block-0", now, info)) {
    // ... the reader's engine READs info.size bytes; it keeps the result only
    // if the read finished before info.lease_until ...
    std::printf("get block-0: %llu bytes, %zu replica(s)\n",
                static_cast<unsigned long long>(info.size), info.replicas.size());
  }

  // Fill the pool: once it is 90 % full the evictor brings it back to 85 %
  // (a full pool: 15 % freed), never taking leased objects.
  for (int i = 1; i < 256; ++i) {
    const std::string key = "block-" + std::to_string(i);
    if (table.put_start(key, 4096, 2, {}, now, where) == kvlink::store_errc::no_space) break;
    (void)table.put_end(key, 2, now);
  }
  const auto r = evictor.run_once(now);
  std::printf("eviction: %zu objects, %llu bytes freed; block-0 %s\n", r.evicted,
              static_cast<unsigned long long>(r.freed),
              table.exists("block-0", now) ? "gone" : "still there (leased)");
  return 0;
}
