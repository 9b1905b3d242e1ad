#include <kvlink/kv/block_transfer.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

namespace {

using kvlink::block_order;
using kvlink::kv_layout;
using kvlink::kv_split;
using kvlink::opcode;
using kvlink::transfer_request;

// ---------------------------------------------------------------------------
// Request counting with the Qwen3-8B shape. Addresses are computed, never
// dereferenced, so the views may point at a made-up base.

void* fake_base() { return reinterpret_cast<void*>(std::uintptr_t{1} << 40); }

constexpr kvlink::remote_segment fake_segment{kvlink::peer_id{1}, kvlink::segment_id{7}};

kv_layout qwen(std::uint32_t tp_rank = 0, std::uint32_t tp_size = 1,
               block_order order = block_order::heads_major, kv_split split = kv_split::separate) {
  kv_layout l = kvlink::find_model_preset("qwen3-8b")->layout(4096, 16);
  l.tp_rank = tp_rank;
  l.tp_size = tp_size;
  l.order = order;
  l.split = split;
  return l;
}

std::vector<std::uint32_t> iota_ids(std::uint32_t first, std::uint32_t n, std::uint32_t step = 1) {
  std::vector<std::uint32_t> ids(n);
  for (std::uint32_t i = 0; i < n; ++i) ids[i] = first + i * step;
  return ids;
}

std::uint64_t total_length(const std::vector<transfer_request>& reqs) {
  std::uint64_t sum = 0;
  for (const auto& r : reqs) sum += r.length;
  return sum;
}

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

}  // namespace

TEST_CASE("contiguous block ids coalesce to one request per layer and K/V") {
  const kv_layout l = qwen();
  const auto local = kvlink::kv_local_view::contiguous(l, fake_base());
  const auto remote = kvlink::kv_remote_view::contiguous(l, fake_segment, 4096);
  const auto lids = iota_ids(0, 2048);
  const auto rids = iota_ids(1000, 2048);
  for (opcode op : {opcode::read, opcode::write}) {
    std::vector<transfer_request> reqs;
    REQUIRE_FALSE(kvlink::make_block_transfer(op, local, remote, lids, rids, reqs));
    REQUIRE(reqs.size() == 36 * 2);
    CHECK(total_length(reqs) == 2048ULL * 16 * 147'456);  // 2048 blocks of 16 tokens
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      CAPTURE(i);
      const std::uint64_t tensor = i;  // layer l: K is tensor 2l, V is tensor 2l+1
      CHECK(reqs[i].op == op);
      CHECK(reqs[i].remote == fake_segment);
      CHECK(reqs[i].length == 2048 * l.block_bytes());
      CHECK(address(reqs[i].local) == address(fake_base()) + tensor * l.tensor_bytes());
      CHECK(reqs[i].remote_offset == 4096 + tensor * l.tensor_bytes() + 1000 * l.block_bytes());
    }
  }
}

TEST_CASE("scattered block ids give one request per block, layer and K/V") {
  const kv_layout l = qwen();
  const auto local = kvlink::kv_local_view::contiguous(l, fake_base());
  const auto remote = kvlink::kv_remote_view::contiguous(l, fake_segment);
  const auto lids = iota_ids(0, 1000, 2);  // every other local block
  const auto rids = iota_ids(5, 1000);
  std::vector<transfer_request> reqs;
  REQUIRE_FALSE(kvlink::make_block_transfer(opcode::write, local, remote, lids, rids, reqs));
  CHECK(reqs.size() == 36 * 2 * 1000);
  for (const auto& r : reqs) CHECK(r.length == l.block_bytes());
  // Layer 0 K, block 3 of the list: local block 6, remote block 8.
  CHECK(address(reqs[3].local) == address(fake_base()) + 6 * l.block_bytes());
  CHECK(reqs[3].remote_offset == 8 * l.block_bytes());
}

TEST_CASE("partially contiguous ids: one request per run on both sides") {
  const kv_layout l = qwen();
  const auto local = kvlink::kv_local_view::contiguous(l, fake_base());
  const auto remote = kvlink::kv_remote_view::contiguous(l, fake_segment);
  // Runs: [10,11,12]->[0,1,2]; [13]->[7] (remote jumps); [40,41]->[8,9]; [41]->[10]
  // would repeat a local block, so keep distinct ids: [50]->[11] (local jumps).
  const std::vector<std::uint32_t> lids{10, 11, 12, 13, 40, 41, 50};
  const std::vector<std::uint32_t> rids{0, 1, 2, 7, 8, 9, 11};
  std::vector<transfer_request> reqs;
  REQUIRE_FALSE(kvlink::make_block_transfer(opcode::read, local, remote, lids, rids, reqs));
  REQUIRE(reqs.size() == 36 * 2 * 4);
  CHECK(reqs[0].length == 3 * l.block_bytes());
  CHECK(reqs[1].length == l.block_bytes());
  CHECK(reqs[1].remote_offset == 7 * l.block_bytes());
  CHECK(reqs[2].length == 2 * l.block_bytes());
  CHECK(reqs[3].length == l.block_bytes());
  CHECK(total_length(reqs) == 7ULL * 16 * 147'456);

  // Descending ids are not a run.
  const std::vector<std::uint32_t> down{5, 4, 3};
  reqs.clear();
  REQUIRE_FALSE(kvlink::make_block_transfer(opcode::read, local, remote, down, down, reqs));
  CHECK(reqs.size() == 36 * 2 * 3);
}

TEST_CASE("joint K/V on both sides moves a block's K and V in one request") {
  const kv_layout l = qwen(0, 1, block_order::heads_major, kv_split::joint);
  const auto local = kvlink::kv_local_view::contiguous(l, fake_base());
  const auto remote = kvlink::kv_remote_view::contiguous(l, fake_segment);
  std::vector<transfer_request> reqs;
  REQUIRE_FALSE(kvlink::make_block_transfer(opcode::write, local, remote, iota_ids(0, 100),
                                            iota_ids(200, 100), reqs));
  REQUIRE(reqs.size() == 36);
  CHECK(reqs[0].length == 100 * 2 * l.block_bytes());
  CHECK(reqs[0].remote_offset == 200 * 2 * l.block_bytes());

  // Scattered: one request per block and layer, K and V together.
  reqs.clear();
  REQUIRE_FALSE(kvlink::make_block_transfer(opcode::write, local, remote, iota_ids(0, 100, 3),
                                            iota_ids(0, 100), reqs));
  CHECK(reqs.size() == 36 * 100);
  CHECK(reqs[0].length == 2 * l.block_bytes());
}

TEST_CASE("equal TP reduces to whole blocks in either in-block order") {
  for (block_order order : {block_order::heads_major, block_order::tokens_major}) {
    CAPTURE(static_cast<int>(order));
    const kv_layout a = qwen(1, 2, order);
    const auto local = kvlink::kv_local_view::contiguous(a, fake_base());
    std::vector<kvlink::kv_remote_view> remotes;
    for (std::uint32_t r = 0; r < 2; ++r)
      remotes.push_back(kvlink::kv_remote_view::contiguous(
          qwen(r, 2, order), {kvlink::peer_id{1}, kvlink::segment_id{10 + r}}));
    std::vector<transfer_request> reqs;
    REQUIRE_FALSE(kvlink::make_tp_block_transfer(opcode::read, local, remotes, iota_ids(0, 64),
                                                 iota_ids(64, 64), reqs));
    REQUIRE(reqs.size() == 36 * 2);  // only remote rank 1 shares heads with local rank 1
    for (const auto& r : reqs) {
      CHECK(r.remote.segment == kvlink::segment_id{11});
      CHECK(r.length == 64 * a.block_bytes());
    }
  }
}

TEST_CASE("different TP: sub-block pieces, one per block (heads_major) or per token") {
  // Local: rank 1 of TP 2 (heads 4..7); remote: TP 1 (heads 0..7).
  const auto lids = iota_ids(0, 10);
  const auto rids = iota_ids(0, 10);
  {
    const kv_layout a = qwen(1, 2, block_order::heads_major);
    const kv_layout b = qwen(0, 1, block_order::heads_major);
    std::vector<transfer_request> reqs;
    const std::array<kvlink::kv_remote_view, 1> remotes{
        kvlink::kv_remote_view::contiguous(b, fake_segment)};
    REQUIRE_FALSE(kvlink::make_tp_block_transfer(opcode::write,
                                                 kvlink::kv_local_view::contiguous(a, fake_base()),
                                                 remotes, lids, rids, reqs));
    CHECK(reqs.size() == 36 * 2 * 10);
    CHECK(reqs[0].length == a.block_bytes());      // the local block, half a remote block
    CHECK(reqs[0].remote_offset == 4 * 16 * 256);  // heads 4..7 of remote block 0
    CHECK(reqs[1].remote_offset == b.block_bytes() + 4 * 16 * 256);
  }
  {
    const kv_layout a = qwen(1, 2, block_order::tokens_major);
    const kv_layout b = qwen(0, 1, block_order::tokens_major);
    std::vector<transfer_request> reqs;
    const std::array<kvlink::kv_remote_view, 1> remotes{
        kvlink::kv_remote_view::contiguous(b, fake_segment)};
    REQUIRE_FALSE(kvlink::make_tp_block_transfer(opcode::write,
                                                 kvlink::kv_local_view::contiguous(a, fake_base()),
                                                 remotes, lids, rids, reqs));
    CHECK(reqs.size() == 36 * 2 * 10 * 16);  // block_tokens pieces per block
    CHECK(reqs[0].length == 4 * 256);
    CHECK(reqs[0].remote_offset == 4 * 256);            // token 0, heads 4..7
    CHECK(reqs[1].remote_offset == 8 * 256 + 4 * 256);  // token 1
    CHECK(address(reqs[1].local) == address(reqs[0].local) + 4 * 256);
  }
}

TEST_CASE("requests are appended after what out already holds, never merged into it") {
  const kv_layout l = qwen();
  const auto local = kvlink::kv_local_view::contiguous(l, fake_base());
  const auto remote = kvlink::kv_remote_view::contiguous(l, fake_segment);
  std::vector<transfer_request> reqs;
  REQUIRE_FALSE(kvlink::make_block_transfer(opcode::write, local, remote, iota_ids(0, 4),
                                            iota_ids(0, 4), reqs));
  REQUIRE(reqs.size() == 72);
  // Blocks 4..7 continue blocks 0..3 on both sides, but land in new requests.
  REQUIRE_FALSE(kvlink::make_block_transfer(opcode::write, local, remote, iota_ids(4, 4),
                                            iota_ids(4, 4), reqs));
  CHECK(reqs.size() == 144);
  CHECK(reqs[0].length == 4 * l.block_bytes());
}

// ---------------------------------------------------------------------------
// Byte-exact execution: real memory on both sides, requests executed with
// memcpy, every destination byte checked.

namespace {

// Fake remote memory: one byte vector per segment id. Every rank's memory
// lives here, so both sides can be the "remote" one.
struct fabric {
  std::map<std::uint64_t, std::vector<std::byte>> segments;
  std::uint64_t next_id = 1;

  kvlink::segment_id add(std::size_t bytes, std::byte fill) {
    const kvlink::segment_id id{next_id++};
    segments[id.value()].assign(bytes, fill);
    return id;
  }
  std::byte* at(kvlink::remote_segment s, std::uint64_t offset, std::uint64_t length) {
    auto it = segments.find(s.segment.value());
    REQUIRE(it != segments.end());
    REQUIRE(offset + length <= it->second.size());
    return it->second.data() + offset;
  }
  // (segment, offset) of a local pointer into one of the segments.
  std::pair<std::uint64_t, std::uint64_t> locate(const void* p, std::uint64_t length) {
    for (auto& [id, bytes] : segments) {
      const auto b = address(bytes.data());
      if (address(p) >= b && address(p) + length <= b + bytes.size()) return {id, address(p) - b};
    }
    FAIL("local pointer outside every buffer");
    return {};
  }
};

// One rank's cache: tensors placed in two segments (K and joint tensors in
// `a`, V tensors in `b`), layers in reverse order with gaps, so that per-layer
// bases matter.
struct rank_memory {
  kv_layout layout;
  kvlink::segment_id a, b;
  std::vector<std::uint64_t> k_off, v_off;

  static constexpr std::uint64_t gap = 24;

  rank_memory(fabric& f, const kv_layout& l, std::byte fill) : layout{l} {
    const std::uint64_t t = l.tensor_bytes();
    const std::uint64_t n = l.num_layers;
    a = f.add(n * (t + gap) + gap, fill);
    b = f.add(n * (t + gap) + gap, fill);
    for (std::uint64_t i = 0; i < n; ++i) {
      k_off.push_back(gap + (n - 1 - i) * (t + gap));
      v_off.push_back(gap + i * (t + gap));
    }
  }
  kvlink::remote_segment seg(kvlink::segment_id id) const { return {kvlink::peer_id{9}, id}; }

  kvlink::kv_local_view local_view(fabric& f) const {
    kvlink::kv_local_view v{layout, {}, {}};
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      v.k.push_back(f.at(seg(a), k_off[l], 0));
      if (layout.split == kv_split::separate) v.v.push_back(f.at(seg(b), v_off[l], 0));
    }
    return v;
  }
  kvlink::kv_remote_view remote_view() const {
    kvlink::kv_remote_view v{layout, {}, {}};
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      v.k.push_back({seg(a), k_off[l]});
      if (layout.split == kv_split::separate) v.v.push_back({seg(b), v_off[l]});
    }
    return v;
  }

  // The reference addressing, written out independently of the library:
  // (segment, offset) of element (layer, kv, block, token, local head, dim).
  std::pair<kvlink::segment_id, std::uint64_t> element(std::uint32_t layer, int kv,
                                                       std::uint32_t block, std::uint32_t token,
                                                       std::uint32_t head,
                                                       std::uint32_t dim) const {
    const std::uint64_t es = kvlink::size_of(layout.type);
    const std::uint64_t heads = layout.num_kv_heads / layout.tp_size;
    const std::uint64_t bt = layout.block_tokens, hd = layout.head_dim;
    const std::uint64_t block_bytes = bt * heads * hd * es;
    std::uint64_t in_block = layout.order == block_order::heads_major
                                 ? ((head * bt + token) * hd + dim) * es
                                 : ((token * heads + head) * hd + dim) * es;
    if (layout.split == kv_split::joint)
      return {a, k_off[layer] + block * 2 * block_bytes + (kv ? block_bytes : 0) + in_block};
    return kv ? std::pair{b, v_off[layer] + block * block_bytes + in_block}
              : std::pair{a, k_off[layer] + block * block_bytes + in_block};
  }
};

// Element value: a unique code of (layer, kv, token of the prompt, global head,
// dim), little-endian over the element's bytes.
std::uint32_t element_code(std::uint32_t layer, int kv, std::uint32_t token, std::uint32_t head,
                           std::uint32_t dim) {
  return ((((layer * 2 + static_cast<std::uint32_t>(kv)) * 1000 + token) * 64 + head) * 256 + dim) +
         1;
}

// Writes the prompt's pattern into the blocks `ids` (logical block i ->
// physical ids[i]) of every rank.
void write_pattern(fabric& f, const std::vector<rank_memory>& ranks,
                   const std::vector<std::uint32_t>& ids) {
  for (const rank_memory& m : ranks) {
    const kv_layout& l = m.layout;
    const std::uint32_t heads = l.num_kv_heads / l.tp_size;
    const std::uint32_t es = kvlink::size_of(l.type);
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer)
      for (int kv = 0; kv < 2; ++kv)
        for (std::uint32_t i = 0; i < ids.size(); ++i)
          for (std::uint32_t t = 0; t < l.block_tokens; ++t)
            for (std::uint32_t h = 0; h < heads; ++h)
              for (std::uint32_t d = 0; d < l.head_dim; ++d) {
                const auto [seg, off] = m.element(layer, kv, ids[i], t, h, d);
                const std::uint32_t code =
                    element_code(layer, kv, i * l.block_tokens + t, l.tp_rank * heads + h, d);
                std::byte* p = f.at(m.seg(seg), off, es);
                for (std::uint32_t k = 0; k < es; ++k)
                  p[k] = static_cast<std::byte>((code >> (8 * k)) & 0xff);
              }
  }
}

struct tp_case {
  std::uint32_t src_tp, dst_tp;
  block_order src_order, dst_order;
  kv_split src_split, dst_split;
  opcode op;
  kvlink::dtype type;
};

kv_layout small(std::uint32_t rank, std::uint32_t tp, block_order order, kv_split split,
                kvlink::dtype type) {
  kv_layout l;
  l.num_layers = 2;
  l.num_kv_heads = 4;
  l.head_dim = 8;
  l.type = type;
  l.block_tokens = 4;
  l.num_blocks = 8;
  l.split = split;
  l.order = order;
  l.tp_rank = rank;
  l.tp_size = tp;
  return l;
}

// Runs one prefill (source) -> decode (destination) transfer of a 5-block
// prompt: WRITE initiated by every source rank, or READ initiated by every
// destination rank. Returns the number of requests, or -1 when the layouts
// were rejected (the rejection message is in *why).
long run_tp_case(const tp_case& c, std::string* why) {
  const std::vector<std::uint32_t> src_ids{3, 4, 5, 0, 7};
  const std::vector<std::uint32_t> dst_ids{1, 2, 3, 6, 4};
  fabric f;
  std::vector<rank_memory> src, dst, expected_dst;
  fabric expected;
  for (std::uint32_t r = 0; r < c.src_tp; ++r)
    src.emplace_back(f, small(r, c.src_tp, c.src_order, c.src_split, c.type), std::byte{0xA5});
  for (std::uint32_t r = 0; r < c.dst_tp; ++r) {
    const kv_layout l = small(r, c.dst_tp, c.dst_order, c.dst_split, c.type);
    dst.emplace_back(f, l, std::byte{0x5A});
    expected_dst.emplace_back(expected, l, std::byte{0x5A});
  }
  write_pattern(f, src, src_ids);
  write_pattern(expected, expected_dst, dst_ids);

  const bool write = c.op == opcode::write;
  const auto& initiators = write ? src : dst;
  const auto& targets = write ? dst : src;
  std::vector<kvlink::kv_remote_view> remote_views;
  for (const auto& m : targets) remote_views.push_back(m.remote_view());
  std::vector<transfer_request> reqs;
  for (const auto& m : initiators) {
    const std::size_t before = reqs.size();
    const std::error_code ec = kvlink::make_tp_block_transfer(c.op, m.local_view(f), remote_views,
                                                              write ? src_ids : dst_ids,
                                                              write ? dst_ids : src_ids, reqs, why);
    if (ec) {
      CHECK(ec == kvlink::errc::invalid_argument);
      CHECK(reqs.size() == before);
      return -1;
    }
  }

  // Execute; record each destination byte range (segment, offset, length).
  std::vector<std::array<std::uint64_t, 3>> written;
  for (const auto& r : reqs) {
    REQUIRE(r.op == c.op);
    REQUIRE(r.length > 0);
    std::byte* remote = f.at(r.remote, r.remote_offset, r.length);
    const auto [local_seg, local_off] = f.locate(r.local, r.length);
    if (write) {
      std::memcpy(remote, r.local, r.length);
      written.push_back({r.remote.segment.value(), r.remote_offset, r.length});
    } else {
      std::memcpy(r.local, remote, r.length);
      written.push_back({local_seg, local_off, r.length});
    }
  }

  // Every byte lands exactly once: destination ranges are disjoint and add
  // up to the prompt's whole KV (all layers, K and V, all heads).
  std::sort(written.begin(), written.end());
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < written.size(); ++i) {
    sum += written[i][2];
    if (i > 0 && written[i][0] == written[i - 1][0])
      CHECK(written[i - 1][1] + written[i - 1][2] <= written[i][1]);
  }
  const kv_layout any = src.front().layout;
  CHECK(sum == src_ids.size() * any.block_tokens * any.bytes_per_token());

  // Destination memory, byte for byte, including untouched blocks and gaps.
  for (std::size_t r = 0; r < dst.size(); ++r) {
    for (auto id : {dst[r].a, dst[r].b}) {
      const auto& got = f.segments.at(id.value());
      const auto exp_id = id == dst[r].a ? expected_dst[r].a : expected_dst[r].b;
      const auto& want = expected.segments.at(exp_id.value());
      REQUIRE(got.size() == want.size());
      CHECK(std::memcmp(got.data(), want.data(), got.size()) == 0);
    }
  }
  // Sources are untouched by a READ and a WRITE alike: re-derive them.
  fabric src_again;
  std::vector<rank_memory> src_expected;
  for (std::uint32_t r = 0; r < c.src_tp; ++r)
    src_expected.emplace_back(src_again, src[r].layout, std::byte{0xA5});
  write_pattern(src_again, src_expected, src_ids);
  for (std::size_t r = 0; r < src.size(); ++r) {
    CHECK(f.segments.at(src[r].a.value()) == src_again.segments.at(src_expected[r].a.value()));
    CHECK(f.segments.at(src[r].b.value()) == src_again.segments.at(src_expected[r].b.value()));
  }
  return static_cast<long>(reqs.size());
}

}  // namespace

TEST_CASE("every byte of every token and head lands once, in the right place, for any TP pair") {
  const std::vector<std::pair<std::uint32_t, std::uint32_t>> tps{
      {1, 1}, {2, 2}, {4, 4}, {4, 2}, {2, 4}, {1, 4}, {4, 1}, {1, 2}, {2, 1}};
  int ran = 0, rejected = 0;
  for (const auto& tp_pair : tps)
    for (block_order so : {block_order::heads_major, block_order::tokens_major})
      for (block_order d_o : {block_order::heads_major, block_order::tokens_major})
        for (kv_split ss : {kv_split::separate, kv_split::joint})
          for (kv_split ds : {kv_split::separate, kv_split::joint})
            for (opcode op : {opcode::read, opcode::write}) {
              const auto src_tp = tp_pair.first;  // named: clang 14 captures no bindings
              const auto dst_tp = tp_pair.second;
              const tp_case c{src_tp, dst_tp, so, d_o, ss, ds, op, kvlink::dtype::f32};
              CAPTURE(src_tp);
              CAPTURE(dst_tp);
              CAPTURE(static_cast<int>(so));
              CAPTURE(static_cast<int>(d_o));
              CAPTURE(static_cast<int>(ss));
              CAPTURE(static_cast<int>(ds));
              CAPTURE(static_cast<int>(op));
              std::string why;
              const long n = run_tp_case(c, &why);
              // The order only matters where a rank's block has several heads.
              const bool order_matters = so != d_o && 4 / src_tp > 1 && 4 / dst_tp > 1;
              if (order_matters) {
                CHECK(n == -1);
                CHECK(why.find("in-block order differs") != std::string::npos);
                ++rejected;
              } else {
                CHECK(n > 0);
                ++ran;
              }
            }
  CHECK(ran > 0);
  CHECK(rejected > 0);
}

TEST_CASE("byte-exact with bf16 and fp8 elements") {
  for (kvlink::dtype t : {kvlink::dtype::bf16, kvlink::dtype::fp8})
    for (opcode op : {opcode::read, opcode::write}) {
      std::string why;
      CHECK(run_tp_case({4, 2, block_order::heads_major, block_order::heads_major,
                         kv_split::separate, kv_split::joint, op, t},
                        &why) > 0);
      CHECK(run_tp_case({1, 2, block_order::tokens_major, block_order::tokens_major,
                         kv_split::joint, kv_split::separate, op, t},
                        &why) > 0);
    }
}

TEST_CASE("request counts of the byte-exact cases: runs coalesce, sub-blocks do not") {
  // The prompt's 5 blocks form 3 runs on both sides ({3,4,5}->{1,2,3}, {0}->{6}, {7}->{4}).
  const auto count = [](std::uint32_t s, std::uint32_t d, block_order o, kv_split ss, kv_split ds) {
    std::string why;
    return run_tp_case({s, d, o, o, ss, ds, opcode::write, kvlink::dtype::f32}, &why);
  };
  // Equal TP, separate: 2 layers x K/V x 3 runs, per rank.
  CHECK(count(1, 1, block_order::heads_major, kv_split::separate, kv_split::separate) == 12);
  CHECK(count(2, 2, block_order::tokens_major, kv_split::separate, kv_split::separate) == 2 * 12);
  // Joint on both sides: K and V together.
  CHECK(count(1, 1, block_order::heads_major, kv_split::joint, kv_split::joint) == 6);
  // Joint on one side only: runs do not continue on that side, one per block.
  CHECK(count(1, 1, block_order::heads_major, kv_split::separate, kv_split::joint) == 2 * 2 * 5);
  // TP 1 -> 2 heads_major: each destination gets one piece per block.
  CHECK(count(1, 2, block_order::heads_major, kv_split::separate, kv_split::separate) ==
        2 * (2 * 2 * 5));
  // TP 1 -> 2 tokens_major: one piece per token.
  CHECK(count(1, 2, block_order::tokens_major, kv_split::separate, kv_split::separate) ==
        2 * (2 * 2 * 5 * 4));
}

// ---------------------------------------------------------------------------
// Rejections.

namespace {

std::string rejected(const kv_layout& a, const kv_layout& b,
                     std::vector<std::uint32_t> lids = {0, 1},
                     std::vector<std::uint32_t> rids = {0, 1}) {
  const auto local = kvlink::kv_local_view::contiguous(a, fake_base());
  const auto remote = kvlink::kv_remote_view::contiguous(b, fake_segment);
  std::vector<transfer_request> reqs(3);  // existing content must survive
  std::string why;
  const std::error_code ec =
      kvlink::make_block_transfer(opcode::read, local, remote, lids, rids, reqs, &why);
  if (!ec) {
    CHECK(reqs.size() >= 3);
    return {};
  }
  CHECK(reqs.size() == 3);
  CHECK(ec == kvlink::errc::invalid_argument);
  CHECK_FALSE(why.empty());
  return why;
}

bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("layouts that cannot map are rejected with a clear message") {
  const kv_layout a = qwen();
  CHECK(rejected(a, a).empty());
  auto changed = [&](auto change) {
    kv_layout b = a;
    change(b);
    return rejected(a, b);
  };
  CHECK(has(changed([](kv_layout& b) { b.head_dim = 64; }),
            "head_dim differs (local 128, remote 64)"));
  CHECK(has(changed([](kv_layout& b) { b.type = kvlink::dtype::fp8; }),
            "dtype differs (local bf16, remote fp8)"));
  CHECK(has(changed([](kv_layout& b) { b.block_tokens = 32; }), "block_tokens differs"));
  CHECK(has(changed([](kv_layout& b) { b.num_layers = 32; }), "num_layers differs"));
  CHECK(has(changed([](kv_layout& b) { b.num_kv_heads = 16; }), "num_kv_heads"));
  CHECK(has(changed([](kv_layout& b) { b.order = block_order::tokens_major; }),
            "in-block order differs"));
  // Capacity, split and TP may differ.
  CHECK(changed([](kv_layout& b) { b.num_blocks = 2; }).empty());
  CHECK(changed([](kv_layout& b) { b.split = kv_split::joint; }).empty());
  CHECK(changed([](kv_layout& b) { b.tp_size = 2; }).empty());
  // An invalid layout on either side.
  CHECK(has(changed([](kv_layout& b) { b.tp_size = 3; }), "does not divide"));

  // With one head per block, the order is the same bytes: accepted.
  kv_layout one = qwen(0, 8, block_order::heads_major);
  kv_layout other = qwen(0, 8, block_order::tokens_major);
  CHECK(rejected(one, other).empty());
}

TEST_CASE("bad block ids are rejected") {
  const kv_layout a = qwen();
  CHECK(has(rejected(a, a, {0, 1, 2}, {0, 1}), "differ in length (local 3, remote 2)"));
  CHECK(has(rejected(a, a, {0, 4096}, {0, 1}),
            "local block id 4096 at index 1 is not below num_blocks 4096"));
  CHECK(has(rejected(a, a, {0, 1}, {9999, 1}), "remote block id 9999 at index 0"));
  CHECK(rejected(a, a, {}, {}).empty());  // nothing to move is fine...
  std::vector<transfer_request> reqs;
  CHECK_FALSE(kvlink::make_block_transfer(
      opcode::read, kvlink::kv_local_view::contiguous(a, fake_base()),
      kvlink::kv_remote_view::contiguous(a, fake_segment), {}, {}, reqs));
  CHECK(reqs.empty());  // ...and moves nothing
}

TEST_CASE("bad views are rejected") {
  const kv_layout a = qwen();
  const auto local = kvlink::kv_local_view::contiguous(a, fake_base());
  const auto remote = kvlink::kv_remote_view::contiguous(a, fake_segment);
  const std::vector<std::uint32_t> ids{0};
  std::vector<transfer_request> reqs;
  std::string why;
  auto try_views = [&](const kvlink::kv_local_view& l, const kvlink::kv_remote_view& r) {
    why.clear();
    const auto ec = kvlink::make_block_transfer(opcode::write, l, r, ids, ids, reqs, &why);
    return ec ? why : std::string{};
  };
  REQUIRE(try_views(local, remote).empty());
  reqs.clear();

  auto l2 = local;
  l2.k.pop_back();
  CHECK(has(try_views(l2, remote), "35 K bases for 36 layers"));
  l2 = local;
  l2.v[3] = nullptr;
  CHECK(has(try_views(l2, remote), "V base of layer 3 is null"));
  l2 = local;
  l2.layout.split = kv_split::joint;  // joint must not carry V bases
  CHECK(has(try_views(l2, remote), "joint K/V"));
  l2 = local;
  l2.k[0] = reinterpret_cast<void*>(~std::uintptr_t{0} - 10);
  CHECK(has(try_views(l2, remote), "wraps around"));

  auto r2 = remote;
  r2.v.pop_back();
  CHECK(has(try_views(local, r2), "35 V tensors, expected 36"));
  r2 = remote;
  r2.k[5].segment = {};
  CHECK(has(try_views(local, r2), "K tensor of layer 5 has no segment"));
  r2 = remote;
  r2.k[1].offset = ~std::uint64_t{0} - 5;
  CHECK(has(try_views(local, r2), "overflows"));
  CHECK(reqs.empty());

  CHECK(kvlink::make_block_transfer(static_cast<opcode>(5), local, remote, ids, ids, reqs, &why) ==
        kvlink::errc::invalid_argument);
  CHECK(has(why, "opcode"));
}

TEST_CASE("TP: the remote ranks must be one whole group") {
  const kv_layout mine = qwen(0, 2);
  const auto local = kvlink::kv_local_view::contiguous(mine, fake_base());
  auto rank = [](std::uint32_t r, std::uint32_t tp) {
    return kvlink::kv_remote_view::contiguous(qwen(r, tp),
                                              {kvlink::peer_id{2}, kvlink::segment_id{1 + r}});
  };
  const std::vector<std::uint32_t> ids{0, 1, 2};
  std::vector<transfer_request> reqs;
  std::string why;
  auto attempt = [&](std::vector<kvlink::kv_remote_view> remotes) {
    why.clear();
    const auto ec =
        kvlink::make_tp_block_transfer(opcode::write, local, remotes, ids, ids, reqs, &why);
    return ec ? why : std::string{};
  };
  // Local rank 0 of TP 2 holds heads 0..3: ranks 0 and 1 of TP 4.
  CHECK(attempt({rank(0, 4), rank(1, 4), rank(2, 4), rank(3, 4)}).empty());
  CHECK(reqs.size() == 2 * 36 * 2 * 3);  // two remote ranks, one piece per block each
  CHECK(attempt({rank(3, 4), rank(1, 4), rank(0, 4)}).empty());  // any order, extra ranks fine
  reqs.clear();
  CHECK(has(attempt({rank(0, 4), rank(2, 4)}),
            "remote ranks cover 2 of the 4 KV heads of local rank 0"));
  CHECK(has(attempt({rank(0, 4), rank(0, 4), rank(1, 4)}), "remote rank 0 given twice"));
  CHECK(has(attempt({rank(0, 4), rank(1, 2)}), "disagree on tp_size"));
  CHECK(has(attempt({}), "no remote rank"));
  auto small_rank = rank(1, 4);
  small_rank.layout.num_blocks = 2;
  CHECK(has(attempt({rank(0, 4), small_rank}),
            "remote block id 2 is not below num_blocks 2 of remote rank 1"));
  CHECK(reqs.empty());
}

TEST_CASE("ranks that share no head move nothing") {
  const auto local = kvlink::kv_local_view::contiguous(qwen(0, 2), fake_base());
  const auto remote = kvlink::kv_remote_view::contiguous(qwen(1, 2), fake_segment);
  const std::vector<std::uint32_t> ids{0, 1};
  std::vector<transfer_request> reqs;
  CHECK_FALSE(kvlink::make_block_transfer(opcode::read, local, remote, ids, ids, reqs));
  CHECK(reqs.empty());
}
