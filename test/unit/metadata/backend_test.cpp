#include <kvlink/metadata/backend.hpp>
#include <kvlink/metadata/p2p.hpp>

#include <vector>

#include <asio/io_context.hpp>
#include <doctest/doctest.h>

TEST_CASE("segment updates over a control channel: with and without a seq") {
  std::vector<kvlink::remote_segment_info> segs{
      {kvlink::segment_id{3}, 0x1000, 64, kvlink::access::remote_read, nlohmann::json::object()}};
  const kvlink::instance_id from{5, 6};
  kvlink::metadata_event e;
  REQUIRE(kvlink::segments_event(from, kvlink::control::make_segments(segs, 9), e));
  CHECK(e.what == kvlink::metadata_event::kind::published);
  CHECK(e.instance == from);
  CHECK(e.seq == 9);
  CHECK(e.segments == segs);
  CHECK(e.name.empty());

  REQUIRE(kvlink::segments_event(from, kvlink::control::make_segments(segs), e));
  CHECK(e.seq == 0);  // an older peer: unordered
  CHECK_FALSE(kvlink::control::make_segments(segs).contains("seq"));

  auto bad = kvlink::control::make_segments(segs, 9);
  bad["seq"] = "nine";
  CHECK_FALSE(kvlink::segments_event(from, bad, e));
  CHECK_FALSE(kvlink::segments_event(from, {{"type", "notify"}}, e));
  CHECK_FALSE(kvlink::segments_event(from, {{"type", "segments"}, {"segments", 5}}, e));
}

TEST_CASE("p2p: names are addresses, updates come from the control channels") {
  asio::io_context io;
  std::vector<nlohmann::json> sent;
  kvlink::p2p_metadata p2p(io.get_executor(),
                           [&sent](const nlohmann::json& m) { sent.push_back(m); });
  std::vector<kvlink::metadata_event> seen;
  p2p.watch([&seen](const kvlink::metadata_event& e) { seen.push_back(e); });

  kvlink::control::peer_descriptor self;
  self.seq = 3;
  p2p.publish(self);
  REQUIRE(sent.size() == 1);
  CHECK(sent[0].at("seq") == 3);

  std::error_code got = kvlink::errc::cancelled;
  kvlink::resolved_peer where;
  p2p.resolve("127.0.0.1:17001", [&](std::error_code ec, kvlink::resolved_peer rp) {
    got = ec;
    where = std::move(rp);
  });
  CHECK(got == kvlink::errc::cancelled);  // never inside the call
  io.run();
  CHECK_FALSE(got);
  CHECK(where.address == "127.0.0.1:17001");
  CHECK_FALSE(where.descriptor);
  io.restart();
  p2p.resolve("decode-3", [&](std::error_code ec, kvlink::resolved_peer) { got = ec; });
  io.run();
  CHECK(got == kvlink::errc::invalid_argument);

  p2p.on_peer_message(kvlink::instance_id{1, 2}, kvlink::control::make_segments({}, 4));
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].seq == 4);

  bool done = false;
  p2p.withdraw([&done] { done = true; });
  CHECK(done);
}
