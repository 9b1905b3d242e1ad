// Paged KV-cache layouts: what one tensor-parallel rank's block table looks
// like in memory, with every size computed from the model's shape (never typed
// in), plus presets with the numbers from common models' configs.
//
// A paged KV cache stores, per layer, the keys (K) and values (V) of every
// cached token in fixed-size blocks of `block_tokens` tokens. A block of one
// layer's K (or V) tensor on one rank holds
//     block_tokens x heads_per_rank() x head_dim elements of `type`,
// ordered either [head][token][dim] (heads_major) or [token][head][dim]
// (tokens_major, vLLM's and SGLang's default "NHD"). K and V live either in
// separate tensors per layer (kv_split::separate) or in one tensor per layer
// whose every block holds the K block followed by the V block (kv_split::joint).
//
//   auto layout = kvlink::find_model_preset("qwen3-8b")->layout(/*num_blocks=*/8192);
//   layout.tp_rank = 1;
//   layout.tp_size = 2;  // this rank holds KV heads [4, 8)
//   if (std::string why; auto ec = layout.validate(&why)) { /* report why */ }
//   // allocate and register layout.tensor_bytes() per layer (per K and V when separate)
//
// Pure: no I/O, no allocation except for error messages and the preset lookup.
#pragma once

#include <kvlink/core/error.hpp>
#include <kvlink/detail/text.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace kvlink {

/// Element type of the cached keys and values.
enum class dtype : std::uint8_t { f32, f16, bf16, fp8 };

/// Bytes per element of `t`.
constexpr std::uint32_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return 4;
    case dtype::f16:
    case dtype::bf16:
      return 2;
    case dtype::fp8:
      return 1;
  }
  return 0;  // not a dtype: validate() rejects it
}

constexpr std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::f16:
      return "f16";
    case dtype::bf16:
      return "bf16";
    case dtype::fp8:
      return "fp8";
  }
  return "invalid dtype";
}

/// Whether K and V of a layer are two tensors or one.
enum class kv_split : std::uint8_t {
  separate,  ///< a K tensor and a V tensor per layer, each made of blocks
  joint,     ///< one tensor per layer; each block is its K block then its V block
};

/// Order of the elements inside one block of one layer's K (or V).
enum class block_order : std::uint8_t {
  heads_major,   ///< [head][token][dim]: a head range is one contiguous piece
  tokens_major,  ///< [token][head][dim]: a head range is one piece per token
};

constexpr std::string_view to_string(kv_split s) noexcept {
  return s == kv_split::separate ? "separate" : "joint";
}
constexpr std::string_view to_string(block_order o) noexcept {
  return o == block_order::heads_major ? "heads_major" : "tokens_major";
}

namespace detail {

// a * b into `out`; false (and `out` unspecified) when it does not fit.
constexpr bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept {
  return !__builtin_mul_overflow(a, b, &out);
}

constexpr bool checked_add(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept {
  return !__builtin_add_overflow(a, b, &out);
}

}  // namespace detail

/// The paged KV cache of one tensor-parallel rank. An aggregate: fill the
/// model's shape (or start from a model_preset), the paging and the rank, then
/// call validate(). The size accessors assume a layout that validate()
/// accepted; on any other they may return wrapped values.
struct kv_layout {
  std::uint32_t num_layers = 0;
  std::uint32_t num_kv_heads = 0;  ///< KV heads of the whole model, all ranks together
  std::uint32_t head_dim = 0;      ///< elements per head
  dtype type = dtype::bf16;
  std::uint32_t block_tokens = 16;  ///< tokens per block
  std::uint32_t num_blocks = 0;     ///< capacity of this rank's block table (per layer)
  kv_split split = kv_split::separate;
  block_order order = block_order::tokens_major;
  /// This rank holds KV heads [tp_rank * heads_per_rank(), +heads_per_rank())
  /// (the Megatron / vLLM split). num_kv_heads must divide by tp_size: KV
  /// heads replicated over ranks (tp_size > num_kv_heads) are not supported.
  std::uint32_t tp_rank = 0;
  std::uint32_t tp_size = 1;

  /// KV heads held by this rank.
  constexpr std::uint32_t heads_per_rank() const noexcept { return num_kv_heads / tp_size; }
  /// First (global) KV head held by this rank.
  constexpr std::uint32_t first_head() const noexcept { return tp_rank * heads_per_rank(); }

  /// Bytes of one head of one token (head_dim x element size).
  constexpr std::uint64_t head_bytes() const noexcept {
    return std::uint64_t{head_dim} * size_of(type);
  }
  /// K and V bytes of one token for the whole model (all layers, all ranks):
  /// 2 x layers x kv_heads x head_dim x dtype bytes.
  constexpr std::uint64_t bytes_per_token() const noexcept {
    return 2 * std::uint64_t{num_layers} * num_kv_heads * head_bytes();
  }
  /// K and V bytes of one token held by this rank (all layers).
  constexpr std::uint64_t bytes_per_token_per_rank() const noexcept {
    return 2 * std::uint64_t{num_layers} * heads_per_rank() * head_bytes();
  }
  /// Bytes of one block of one layer's K (or V) on this rank.
  constexpr std::uint64_t block_bytes() const noexcept {
    return std::uint64_t{block_tokens} * heads_per_rank() * head_bytes();
  }
  /// Distance between block b and block b+1 in one layer's tensor: the block
  /// itself when split, its K and V blocks together when joint.
  constexpr std::uint64_t block_stride() const noexcept {
    return split == kv_split::joint ? 2 * block_bytes() : block_bytes();
  }
  /// Bytes of one layer's tensor (each of K and V when separate, the one
  /// joint tensor otherwise): what to allocate and register per layer.
  constexpr std::uint64_t tensor_bytes() const noexcept {
    return std::uint64_t{num_blocks} * block_stride();
  }
  /// Bytes of the whole block table of this rank, all layers, K and V.
  constexpr std::uint64_t total_bytes() const noexcept {
    return 2 * std::uint64_t{num_layers} * num_blocks * block_bytes();
  }

  /// Accepts the layout (empty error code) or returns errc::invalid_argument
  /// and, when `why` is not null, stores a message naming the bad field.
  /// Checks: non-zero shape and paging, a known dtype, tp_rank < tp_size,
  /// num_kv_heads divisible by tp_size, and that every size above (including
  /// bytes_per_token() of the whole model) fits in 64 bits.
  std::error_code validate(std::string* why = nullptr) const {
    using detail::fail;
    if (num_layers == 0) return fail(why, "kv_layout: num_layers is 0");
    if (num_kv_heads == 0) return fail(why, "kv_layout: num_kv_heads is 0");
    if (head_dim == 0) return fail(why, "kv_layout: head_dim is 0");
    if (size_of(type) == 0) return fail(why, "kv_layout: unknown dtype");
    if (block_tokens == 0) return fail(why, "kv_layout: block_tokens is 0");
    if (num_blocks == 0)
      return fail(why, "kv_layout: num_blocks is 0 (set the block table capacity)");
    if (split != kv_split::separate && split != kv_split::joint)
      return fail(why, "kv_layout: unknown kv_split");
    if (order != block_order::heads_major && order != block_order::tokens_major)
      return fail(why, "kv_layout: unknown block_order");
    if (tp_size == 0) return fail(why, "kv_layout: tp_size is 0");
    if (tp_rank >= tp_size)
      return fail(why, "kv_layout: tp_rank " + std::to_string(tp_rank) + " is not below tp_size " +
                           std::to_string(tp_size));
    if (num_kv_heads % tp_size != 0)
      return fail(why, "kv_layout: num_kv_heads " + std::to_string(num_kv_heads) +
                           " does not divide by tp_size " + std::to_string(tp_size) +
                           " (replicated KV heads are not supported)");
    // The largest quantities; every other size is a factor of one of them.
    std::uint64_t per_token = 0, all = 0, joint_tensor = 0;
    const bool fits =
        detail::checked_mul(2, num_layers, per_token) &&
        detail::checked_mul(per_token, num_kv_heads, per_token) &&
        detail::checked_mul(per_token, head_dim, per_token) &&
        detail::checked_mul(per_token, size_of(type), per_token) &&
        detail::checked_mul(2, num_layers, all) && detail::checked_mul(all, num_blocks, all) &&
        detail::checked_mul(all, block_tokens, all) &&
        detail::checked_mul(all, heads_per_rank(), all) &&
        detail::checked_mul(all, head_bytes(), all) &&
        detail::checked_mul(2 * std::uint64_t{num_blocks}, block_tokens, joint_tensor) &&
        detail::checked_mul(joint_tensor, heads_per_rank(), joint_tensor) &&
        detail::checked_mul(joint_tensor, head_bytes(), joint_tensor);
    if (!fits)
      return fail(why, "kv_layout: sizes overflow 64 bits (num_blocks or shape too large)");
    return {};
  }
};

/// The KV shape of a known model, with the numbers from its config.json
/// (num_hidden_layers, num_key_value_heads, head_dim, torch_dtype).
struct model_preset {
  std::string_view name;      ///< lookup key, lower case, e.g. "qwen3-8b"
  std::string_view model_id;  ///< Hugging Face model id
  std::uint32_t num_layers = 0;
  std::uint32_t num_kv_heads = 0;
  std::uint32_t head_dim = 0;
  dtype type = dtype::bf16;

  /// A single-rank layout of this model; adjust tp_rank, tp_size, split and
  /// order to the serving engine's cache before validate().
  constexpr kv_layout layout(std::uint32_t num_blocks,
                             std::uint32_t block_tokens = 16) const noexcept {
    kv_layout l;
    l.num_layers = num_layers;
    l.num_kv_heads = num_kv_heads;
    l.head_dim = head_dim;
    l.type = type;
    l.block_tokens = block_tokens;
    l.num_blocks = num_blocks;
    return l;
  }
};

namespace detail {

// From the models' config.json files. KV bytes per token (bf16):
// Qwen3-8B 147,456; Qwen3-32B 262,144; Llama-3.1-8B 131,072; Llama-3.1-70B 327,680.
inline constexpr std::array<model_preset, 4> model_preset_table{{
    {"qwen3-8b", "Qwen/Qwen3-8B", 36, 8, 128, dtype::bf16},
    {"qwen3-32b", "Qwen/Qwen3-32B", 64, 8, 128, dtype::bf16},
    {"llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 8, 128, dtype::bf16},
    {"llama-3.1-70b", "meta-llama/Llama-3.1-70B", 80, 8, 128, dtype::bf16},
}};

}  // namespace detail

/// Every preset, in a fixed order.
constexpr std::span<const model_preset> model_presets() noexcept {
  return detail::model_preset_table;
}

/// The preset called `name` (case-insensitive, e.g. "Qwen3-8B"), also found by
/// its Hugging Face id ("Qwen/Qwen3-8B"); nullopt when unknown.
constexpr std::optional<model_preset> find_model_preset(std::string_view name) noexcept {
  auto equal = [](std::string_view a, std::string_view b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (detail::ascii_lower(a[i]) != detail::ascii_lower(b[i])) return false;
    return true;
  };
  for (const model_preset& p : detail::model_preset_table)
    if (equal(p.name, name) || equal(p.model_id, name)) return p;
  return std::nullopt;
}

}  // namespace kvlink
