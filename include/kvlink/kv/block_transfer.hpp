// Block transfers: turn (local block ids, remote block ids) of two paged KV
// caches into the transfer_requests that move those blocks, for every layer,
// K and V, coalescing runs of blocks that are contiguous on both sides.
//
//   kvlink::kv_local_view  mine   = kvlink::kv_local_view::contiguous(layout, base);
//   kvlink::kv_remote_view theirs = kvlink::kv_remote_view::contiguous(peer_layout, seg, 0);
//   std::vector<kvlink::transfer_request> reqs;
//   std::string why;
//   if (auto ec = kvlink::make_block_transfer(kvlink::opcode::read, mine, theirs,
//                                             my_blocks, their_blocks, reqs, &why)) { ... }
//   co_await engine.async_submit_transfer(reqs, asio::use_awaitable);
//
// Both directions use the same call: opcode::read pulls the remote blocks into
// the local ones (decode pulls, NIXL style), opcode::write pushes the local
// blocks into the remote ones (prefill pushes, Mooncake style). Local block
// local_blocks[i] pairs with remote block remote_blocks[i].
//
// Tensor parallelism: a rank holds a contiguous range of KV heads (see
// kv_layout). When the two sides have different tp_size, one rank's block
// holds heads that live on several ranks of the other side;
// make_tp_block_transfer() emits what one local rank must move against every
// remote rank whose heads overlap its own. The pieces per block are:
//   - equal head ranges: the whole block (one piece, coalesced across runs);
//   - heads_major blocks: one contiguous piece per block (the head range);
//   - tokens_major blocks: one piece per token, i.e. block_tokens requests per
//     block and per layer and K/V, merged only where they happen to touch.
// Prefer heads_major caches when the two sides run different TP sizes.
//
// Pure: no I/O. Requests are appended to `out` in a fixed order (layer, then
// K before V, then the order of the id lists); on error `out` is left as it
// was and an errc::invalid_argument with a message is returned. `out` grows
// once per call (std::bad_alloc is the only exception); reuse it across calls.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/kv/layout.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <system_error>
#include <vector>

namespace kvlink {

/// Where this rank's KV tensors are in local memory. Per layer: the base of
/// the K tensor and of the V tensor (split), or of the joint tensor (in `k`,
/// with `v` empty). Each tensor spans layout.tensor_bytes() bytes and must lie
/// in memory registered with the engine.
struct kv_local_view {
  kv_layout layout;
  std::vector<void*> k;
  std::vector<void*> v;

  /// The view of a single buffer of layout.total_bytes() bytes holding the
  /// layers one after the other: per layer the K tensor then the V tensor
  /// (separate), or the joint tensor. Matches kv_remote_view::contiguous.
  static kv_local_view contiguous(const kv_layout& layout, void* base) {
    kv_local_view view{layout, {}, {}};
    auto* p = static_cast<std::byte*>(base);
    const std::uint64_t t = layout.tensor_bytes();
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      if (layout.split == kv_split::joint) {
        view.k.push_back(p + std::uint64_t{l} * t);
      } else {
        view.k.push_back(p + 2 * std::uint64_t{l} * t);
        view.v.push_back(p + (2 * std::uint64_t{l} + 1) * t);
      }
    }
    return view;
  }

  /// Accepts the view or returns errc::invalid_argument with a message.
  std::error_code validate(std::string* why = nullptr) const;
};

/// A remote tensor: a segment of a peer and the tensor's offset inside it.
struct remote_tensor {
  remote_segment segment{};
  std::uint64_t offset = 0;
};

/// Where a remote rank's KV tensors are: per layer, as for kv_local_view, but
/// as (remote segment, offset) pairs. Each tensor spans
/// layout.tensor_bytes() bytes of its segment.
struct kv_remote_view {
  kv_layout layout;
  std::vector<remote_tensor> k;
  std::vector<remote_tensor> v;

  /// The view of one remote segment that holds the layers one after the
  /// other from `offset` on, in the order of kv_local_view::contiguous.
  static kv_remote_view contiguous(const kv_layout& layout, remote_segment segment,
                                   std::uint64_t offset = 0) {
    kv_remote_view view{layout, {}, {}};
    const std::uint64_t t = layout.tensor_bytes();
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      if (layout.split == kv_split::joint) {
        view.k.push_back({segment, offset + std::uint64_t{l} * t});
      } else {
        view.k.push_back({segment, offset + 2 * std::uint64_t{l} * t});
        view.v.push_back({segment, offset + (2 * std::uint64_t{l} + 1) * t});
      }
    }
    return view;
  }

  /// Accepts the view or returns errc::invalid_argument with a message.
  std::error_code validate(std::string* why = nullptr) const;
};

namespace detail {

// Where one block's share of a (local, remote) rank pair lies: `count` pieces
// of `length` bytes, the first at `*_start` inside the block, the next ones
// `*_step` further.
struct block_pieces {
  std::uint64_t local_start = 0;
  std::uint64_t remote_start = 0;
  std::uint64_t length = 0;
  std::uint64_t local_step = 0;
  std::uint64_t remote_step = 0;
  std::uint32_t count = 0;  // 0: the two ranks share no head
  std::uint32_t heads = 0;  // KV heads the two ranks share
};

// Block ids that advance by one on both sides, paired.
struct block_run {
  std::uint32_t local_first = 0;
  std::uint32_t remote_first = 0;
  std::uint32_t count = 0;
};

// One tensor of one layer seen from both sides.
struct tensor_pass {
  std::byte* local_base = nullptr;
  std::uint64_t local_stride = 0;
  remote_segment segment{};
  std::uint64_t remote_base = 0;
  std::uint64_t remote_stride = 0;
};

// The two layouts describe the same model and paging, so that a block of one
// maps onto a block of the other; fills `pieces` for their head overlap.
inline std::error_code plan_pieces(const kv_layout& local, const kv_layout& remote,
                                   block_pieces& pieces, std::string* why) {
  auto mismatch = [&](const char* field, std::uint64_t a, std::uint64_t b) {
    return fail(why, std::string{"kv layouts cannot map: "} + field + " differs (local " +
                         std::to_string(a) + ", remote " + std::to_string(b) + ")");
  };
  if (local.num_layers != remote.num_layers)
    return mismatch("num_layers", local.num_layers, remote.num_layers);
  if (local.num_kv_heads != remote.num_kv_heads)
    return mismatch("num_kv_heads (total over ranks)", local.num_kv_heads, remote.num_kv_heads);
  if (local.head_dim != remote.head_dim)
    return mismatch("head_dim", local.head_dim, remote.head_dim);
  if (local.type != remote.type)
    return fail(why, std::string{"kv layouts cannot map: dtype differs (local "} +
                         std::string{to_string(local.type)} + ", remote " +
                         std::string{to_string(remote.type)} + ")");
  if (local.block_tokens != remote.block_tokens)
    return mismatch("block_tokens", local.block_tokens, remote.block_tokens);

  // The in-block order only matters for blocks with several heads and
  // several tokens: otherwise both orders are the same bytes.
  const std::uint32_t hl = local.heads_per_rank(), hr = remote.heads_per_rank();
  const bool local_matters = hl > 1 && local.block_tokens > 1;
  const bool remote_matters = hr > 1 && remote.block_tokens > 1;
  if (local_matters && remote_matters && local.order != remote.order)
    return fail(why, std::string{"kv layouts cannot map: in-block order differs (local "} +
                         std::string{to_string(local.order)} + ", remote " +
                         std::string{to_string(remote.order)} + ")");
  const block_order order = local_matters ? local.order : remote.order;

  const std::uint32_t l0 = local.first_head(), r0 = remote.first_head();
  const std::uint32_t lo = l0 > r0 ? l0 : r0;
  const std::uint32_t hi = (l0 + hl) < (r0 + hr) ? (l0 + hl) : (r0 + hr);
  pieces = {};
  if (lo >= hi) return {};  // no shared head: nothing to move between these ranks
  const std::uint32_t heads = hi - lo;
  pieces.heads = heads;
  const std::uint64_t hb = local.head_bytes();
  const std::uint64_t bt = local.block_tokens;
  if (heads == hl && heads == hr) {  // same head range: whole blocks
    pieces.length = local.block_bytes();
    pieces.count = 1;
  } else if (order == block_order::heads_major) {  // [head][token][dim]
    pieces.local_start = (lo - l0) * bt * hb;
    pieces.remote_start = (lo - r0) * bt * hb;
    pieces.length = heads * bt * hb;
    pieces.count = 1;
  } else {  // [token][head][dim]: one piece per token
    pieces.local_start = (lo - l0) * hb;
    pieces.remote_start = (lo - r0) * hb;
    pieces.length = heads * hb;
    pieces.local_step = hl * hb;
    pieces.remote_step = hr * hb;
    pieces.count = local.block_tokens;
  }
  return {};
}

// Pairs the id lists into runs, checking every id against the capacity.
inline std::error_code make_runs(const kv_layout& local, const kv_layout& remote,
                                 std::span<const std::uint32_t> local_blocks,
                                 std::span<const std::uint32_t> remote_blocks,
                                 std::vector<block_run>& runs, std::string* why) {
  if (local_blocks.size() != remote_blocks.size())
    return fail(why, "block id lists differ in length (local " +
                         std::to_string(local_blocks.size()) + ", remote " +
                         std::to_string(remote_blocks.size()) + ")");
  runs.clear();
  for (std::size_t i = 0; i < local_blocks.size(); ++i) {
    const std::uint32_t a = local_blocks[i], b = remote_blocks[i];
    if (a >= local.num_blocks)
      return fail(why, "local block id " + std::to_string(a) + " at index " + std::to_string(i) +
                           " is not below num_blocks " + std::to_string(local.num_blocks));
    if (b >= remote.num_blocks)
      return fail(why, "remote block id " + std::to_string(b) + " at index " + std::to_string(i) +
                           " is not below num_blocks " + std::to_string(remote.num_blocks));
    if (!runs.empty()) {
      block_run& r = runs.back();
      if (std::uint64_t{a} == std::uint64_t{r.local_first} + r.count &&
          std::uint64_t{b} == std::uint64_t{r.remote_first} + r.count) {
        ++r.count;
        continue;
      }
    }
    runs.push_back({a, b, 1});
  }
  return {};
}

// Appends a request, merging it into the previous one appended by this call
// when both its local and its remote bytes continue that one's.
inline void append_request(std::vector<transfer_request>& out, std::size_t first_new, opcode op,
                           std::byte* local, remote_segment segment, std::uint64_t remote_offset,
                           std::uint64_t length) {
  if (out.size() > first_new) {
    transfer_request& last = out.back();
    if (last.remote == segment && last.remote_offset + last.length == remote_offset &&
        reinterpret_cast<std::uintptr_t>(last.local) + last.length ==
            reinterpret_cast<std::uintptr_t>(local)) {
      last.length += length;
      return;
    }
  }
  out.push_back({op, local, segment, remote_offset, length});
}

inline void emit_pass(opcode op, const tensor_pass& t, const block_pieces& p,
                      std::span<const block_run> runs, std::vector<transfer_request>& out,
                      std::size_t first_new) {
  // One piece filling the whole stride on both sides: a run is one request.
  if (p.count == 1 && p.length == t.local_stride && p.length == t.remote_stride) {
    for (const block_run& r : runs)
      append_request(out, first_new, op, t.local_base + r.local_first * t.local_stride, t.segment,
                     t.remote_base + r.remote_first * t.remote_stride, r.count * p.length);
    return;
  }
  for (const block_run& r : runs) {
    for (std::uint32_t i = 0; i < r.count; ++i) {
      std::byte* local =
          t.local_base + (std::uint64_t{r.local_first} + i) * t.local_stride + p.local_start;
      std::uint64_t remote =
          t.remote_base + (std::uint64_t{r.remote_first} + i) * t.remote_stride + p.remote_start;
      for (std::uint32_t k = 0; k < p.count; ++k) {
        append_request(out, first_new, op, local, t.segment, remote, p.length);
        local += p.local_step;
        remote += p.remote_step;
      }
    }
  }
}

// Emits every layer's K and V for one (local rank, remote rank) pair whose
// views were validated and whose `pieces` came from plan_pieces.
inline void emit_pair(opcode op, const kv_local_view& local, const kv_remote_view& remote,
                      const block_pieces& pieces, std::span<const block_run> runs,
                      std::vector<transfer_request>& out, std::size_t first_new) {
  if (pieces.count == 0) return;
  const kv_layout& ll = local.layout;
  const kv_layout& rl = remote.layout;
  const bool both_joint = ll.split == kv_split::joint && rl.split == kv_split::joint;
  const bool whole =
      pieces.count == 1 && pieces.length == ll.block_bytes() && pieces.length == rl.block_bytes();
  for (std::uint32_t l = 0; l < ll.num_layers; ++l) {
    auto* lk = static_cast<std::byte*>(local.k[l]);
    if (both_joint && whole) {  // a block's K and V are adjacent on both sides: one piece
      block_pieces kv = pieces;
      kv.length = 2 * pieces.length;
      emit_pass(op,
                {lk, ll.block_stride(), remote.k[l].segment, remote.k[l].offset, rl.block_stride()},
                kv, runs, out, first_new);
      continue;
    }
    // V of a joint tensor starts one block (of that side) after K.
    std::byte* lv =
        ll.split == kv_split::joint ? lk + ll.block_bytes() : static_cast<std::byte*>(local.v[l]);
    const remote_tensor rv =
        rl.split == kv_split::joint
            ? remote_tensor{remote.k[l].segment, remote.k[l].offset + rl.block_bytes()}
            : remote.v[l];
    emit_pass(op,
              {lk, ll.block_stride(), remote.k[l].segment, remote.k[l].offset, rl.block_stride()},
              pieces, runs, out, first_new);
    emit_pass(op, {lv, ll.block_stride(), rv.segment, rv.offset, rl.block_stride()}, pieces, runs,
              out, first_new);
  }
}

// How many requests emit_pair appends at most (exactly, before merging).
inline std::uint64_t request_bound(const kv_layout& ll, const kv_layout& rl,
                                   const block_pieces& pieces, std::size_t runs,
                                   std::size_t blocks) {
  if (pieces.count == 0) return 0;
  const bool whole =
      pieces.count == 1 && pieces.length == ll.block_bytes() && pieces.length == rl.block_bytes();
  const bool both_joint = ll.split == kv_split::joint && rl.split == kv_split::joint;
  // Mirrors emit_pair / emit_pass: whole blocks with both strides equal to
  // the piece become one request per run.
  std::uint64_t per_pass = blocks * std::uint64_t{pieces.count};
  if (whole && (both_joint || (ll.split == kv_split::separate && rl.split == kv_split::separate)))
    per_pass = runs;
  return std::uint64_t{ll.num_layers} * (both_joint && whole ? 1 : 2) * per_pass;
}

// Grows `out` once for `extra` more requests, keeping geometric growth so
// that many small calls appending to one vector stay linear.
inline void reserve_more(std::vector<transfer_request>& out, std::uint64_t extra) {
  const std::uint64_t need = out.size() + extra;
  if (need <= out.capacity()) return;
  out.reserve(static_cast<std::size_t>(need > 2 * out.capacity() ? need : 2 * out.capacity()));
}

inline std::error_code check_opcode(opcode op, std::string* why) {
  if (op != opcode::read && op != opcode::write) return fail(why, "unknown opcode");
  return {};
}

}  // namespace detail

inline std::error_code kv_local_view::validate(std::string* why) const {
  if (auto ec = layout.validate(why)) return ec;
  const bool joint = layout.split == kv_split::joint;
  const std::size_t layers = layout.num_layers;
  if (k.size() != layers)
    return detail::fail(why, "kv_local_view: " + std::to_string(k.size()) + " K bases for " +
                                 std::to_string(layers) + " layers");
  if (v.size() != (joint ? 0 : layers))
    return detail::fail(why, "kv_local_view: " + std::to_string(v.size()) + " V bases, expected " +
                                 std::to_string(joint ? 0 : layers) +
                                 (joint ? " (joint K/V: V lives in the K tensor)" : ""));
  const std::uint64_t bytes = layout.tensor_bytes();
  auto check = [&](void* p, const char* which, std::size_t l) -> std::error_code {
    std::uint64_t end = 0;
    if (p == nullptr)
      return detail::fail(why, std::string{"kv_local_view: "} + which + " base of layer " +
                                   std::to_string(l) + " is null");
    if (!detail::checked_add(reinterpret_cast<std::uintptr_t>(p), bytes, end))
      return detail::fail(why, std::string{"kv_local_view: "} + which + " tensor of layer " +
                                   std::to_string(l) + " wraps around the address space");
    return {};
  };
  for (std::size_t l = 0; l < layers; ++l) {
    if (auto ec = check(k[l], "K", l)) return ec;
    if (!joint)
      if (auto ec = check(v[l], "V", l)) return ec;
  }
  return {};
}

inline std::error_code kv_remote_view::validate(std::string* why) const {
  if (auto ec = layout.validate(why)) return ec;
  const bool joint = layout.split == kv_split::joint;
  const std::size_t layers = layout.num_layers;
  if (k.size() != layers)
    return detail::fail(why, "kv_remote_view: " + std::to_string(k.size()) + " K tensors for " +
                                 std::to_string(layers) + " layers");
  if (v.size() != (joint ? 0 : layers))
    return detail::fail(why, "kv_remote_view: " + std::to_string(v.size()) +
                                 " V tensors, expected " + std::to_string(joint ? 0 : layers) +
                                 (joint ? " (joint K/V: V lives in the K tensor)" : ""));
  const std::uint64_t bytes = layout.tensor_bytes();
  auto check = [&](const remote_tensor& t, const char* which, std::size_t l) -> std::error_code {
    std::uint64_t end = 0;
    if (!t.segment.segment.valid())
      return detail::fail(why, std::string{"kv_remote_view: "} + which + " tensor of layer " +
                                   std::to_string(l) + " has no segment");
    if (!detail::checked_add(t.offset, bytes, end))
      return detail::fail(why, std::string{"kv_remote_view: "} + which + " tensor of layer " +
                                   std::to_string(l) + ": offset + size overflows 64 bits");
    return {};
  };
  for (std::size_t l = 0; l < layers; ++l) {
    if (auto ec = check(k[l], "K", l)) return ec;
    if (!joint)
      if (auto ec = check(v[l], "V", l)) return ec;
  }
  return {};
}

/// Appends to `out` the requests that move, for every layer and both K and
/// V, local block local_blocks[i] to or from remote block remote_blocks[i]
/// (op read: remote -> local; write: local -> remote), for the heads the two
/// ranks share. Runs of ids consecutive on both sides become one request per
/// layer and K/V when the ranks hold the same heads (and, when both are
/// joint, K and V of a block go together). Ranks sharing no head append
/// nothing. Errors (errc::invalid_argument, message in `*why`): invalid
/// views, layouts that cannot map (layers, total KV heads, head_dim, dtype,
/// block_tokens, or in-block order where it matters), id lists of different
/// lengths, ids not below num_blocks.
inline std::error_code make_block_transfer(opcode op, const kv_local_view& local,
                                           const kv_remote_view& remote,
                                           std::span<const std::uint32_t> local_blocks,
                                           std::span<const std::uint32_t> remote_blocks,
                                           std::vector<transfer_request>& out,
                                           std::string* why = nullptr) {
  if (auto ec = detail::check_opcode(op, why)) return ec;
  if (auto ec = local.validate(why)) return ec;
  if (auto ec = remote.validate(why)) return ec;
  detail::block_pieces pieces;
  if (auto ec = detail::plan_pieces(local.layout, remote.layout, pieces, why)) return ec;
  std::vector<detail::block_run> runs;
  if (auto ec =
          detail::make_runs(local.layout, remote.layout, local_blocks, remote_blocks, runs, why))
    return ec;
  detail::reserve_more(out, detail::request_bound(local.layout, remote.layout, pieces, runs.size(),
                                                  local_blocks.size()));
  detail::emit_pair(op, local, remote, pieces, runs, out, out.size());
  return {};
}

/// make_block_transfer of one local rank against all ranks of the other side
/// (its TP group, any order): appends the requests of every remote rank
/// whose heads overlap the local rank's, remote ranks in the order given. The
/// same remote block ids are used on every remote rank (a serving engine
/// shares one block table over its TP group). Besides make_block_transfer's
/// errors, rejects remote views with different tp_size, repeated ranks, and
/// sets of ranks that do not cover every local head.
inline std::error_code make_tp_block_transfer(opcode op, const kv_local_view& local,
                                              std::span<const kv_remote_view> remote_ranks,
                                              std::span<const std::uint32_t> local_blocks,
                                              std::span<const std::uint32_t> remote_blocks,
                                              std::vector<transfer_request>& out,
                                              std::string* why = nullptr) {
  if (auto ec = detail::check_opcode(op, why)) return ec;
  if (auto ec = local.validate(why)) return ec;
  if (remote_ranks.empty()) return detail::fail(why, "no remote rank given");
  for (const kv_remote_view& r : remote_ranks)
    if (auto ec = r.validate(why)) return ec;
  std::vector<std::uint32_t> ranks;
  for (const kv_remote_view& r : remote_ranks) {
    if (r.layout.tp_size != remote_ranks.front().layout.tp_size)
      return detail::fail(why, "remote ranks disagree on tp_size (" +
                                   std::to_string(remote_ranks.front().layout.tp_size) + " and " +
                                   std::to_string(r.layout.tp_size) + ")");
    ranks.push_back(r.layout.tp_rank);
  }
  std::sort(ranks.begin(), ranks.end());
  if (auto twice = std::adjacent_find(ranks.begin(), ranks.end()); twice != ranks.end())
    return detail::fail(why, "remote rank " + std::to_string(*twice) + " given twice");
  std::vector<detail::block_pieces> pieces(remote_ranks.size());
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < remote_ranks.size(); ++i) {
    const kv_remote_view& r = remote_ranks[i];
    if (auto ec = detail::plan_pieces(local.layout, r.layout, pieces[i], why)) return ec;
    covered += pieces[i].heads;  // ranks are distinct, so their head ranges are disjoint
  }
  if (covered != local.layout.heads_per_rank())
    return detail::fail(why, "remote ranks cover " + std::to_string(covered) + " of the " +
                                 std::to_string(local.layout.heads_per_rank()) +
                                 " KV heads of local rank " + std::to_string(local.layout.tp_rank) +
                                 ": pass every rank of the remote TP group");
  std::vector<detail::block_run> runs;
  if (auto ec = detail::make_runs(local.layout, remote_ranks.front().layout, local_blocks,
                                  remote_blocks, runs, why))
    return ec;
  // make_runs checked the ids against the first remote rank's capacity; the
  // others may have another num_blocks.
  std::uint32_t max_remote = 0;
  for (std::uint32_t b : remote_blocks) max_remote = b > max_remote ? b : max_remote;
  for (const kv_remote_view& r : remote_ranks)
    if (!remote_blocks.empty() && max_remote >= r.layout.num_blocks)
      return detail::fail(why, "remote block id " + std::to_string(max_remote) +
                                   " is not below num_blocks " +
                                   std::to_string(r.layout.num_blocks) + " of remote rank " +
                                   std::to_string(r.layout.tp_rank));
  std::uint64_t bound = 0;
  for (std::size_t i = 0; i < remote_ranks.size(); ++i)
    bound += detail::request_bound(local.layout, remote_ranks[i].layout, pieces[i], runs.size(),
                                   local_blocks.size());
  detail::reserve_more(out, bound);
  for (std::size_t i = 0; i < remote_ranks.size(); ++i) {
    // Merging stops at each rank: their segments differ.
    detail::emit_pair(op, local, remote_ranks[i], pieces[i], runs, out, out.size());
  }
  return {};
}

}  // namespace kvlink
