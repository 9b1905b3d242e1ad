#include <kvlink/kv/layout.hpp>

#include <cstdint>
#include <limits>
#include <set>
#include <string>

#include <doctest/doctest.h>

namespace {

kvlink::kv_layout small_layout() {
  kvlink::kv_layout l;
  l.num_layers = 2;
  l.num_kv_heads = 4;
  l.head_dim = 8;
  l.type = kvlink::dtype::f32;
  l.block_tokens = 4;
  l.num_blocks = 8;
  return l;
}

// The message validate() gives, or "" when it accepts the layout.
std::string rejection(const kvlink::kv_layout& l) {
  std::string why;
  const std::error_code ec = l.validate(&why);
  if (ec) CHECK(ec == kvlink::errc::invalid_argument);
  return ec ? why : std::string{};
}

}  // namespace

TEST_CASE("dtype sizes") {
  CHECK(kvlink::size_of(kvlink::dtype::f32) == 4);
  CHECK(kvlink::size_of(kvlink::dtype::f16) == 2);
  CHECK(kvlink::size_of(kvlink::dtype::bf16) == 2);
  CHECK(kvlink::size_of(kvlink::dtype::fp8) == 1);
  CHECK(kvlink::to_string(kvlink::dtype::bf16) == "bf16");
}

TEST_CASE("model presets carry the numbers of the models' configs") {
  auto qwen = kvlink::find_model_preset("qwen3-8b");
  REQUIRE(qwen.has_value());
  CHECK(qwen->num_layers == 36);
  CHECK(qwen->num_kv_heads == 8);
  CHECK(qwen->head_dim == 128);
  CHECK(qwen->type == kvlink::dtype::bf16);
  const kvlink::kv_layout q = qwen->layout(1024);
  CHECK_FALSE(q.validate());
  CHECK(q.bytes_per_token() == 147'456);
  // 32,768 tokens of Qwen3-8B = 4.50 GiB (2^30 bytes).
  CHECK(q.bytes_per_token() * 32'768 == 4'831'838'208ULL);
  CHECK(q.bytes_per_token() * 32'768 == 9 * (std::uint64_t{1} << 29));

  CHECK(kvlink::find_model_preset("llama-3.1-8b")->layout(1).bytes_per_token() == 131'072);
  CHECK(kvlink::find_model_preset("llama-3.1-70b")->layout(1).bytes_per_token() == 327'680);
  CHECK(kvlink::find_model_preset("qwen3-32b")->layout(1).bytes_per_token() == 262'144);
}

TEST_CASE("preset lookup: case-insensitive, by Hugging Face id, unknown names") {
  CHECK(kvlink::find_model_preset("Qwen3-8B")->name == "qwen3-8b");
  CHECK(kvlink::find_model_preset("Qwen/Qwen3-8B")->name == "qwen3-8b");
  CHECK(kvlink::find_model_preset("meta-llama/Llama-3.1-70B")->num_layers == 80);
  CHECK_FALSE(kvlink::find_model_preset("qwen3-8").has_value());
  CHECK_FALSE(kvlink::find_model_preset("").has_value());

  std::set<std::string_view> names;
  for (const auto& p : kvlink::model_presets()) {
    CAPTURE(p.name);
    names.insert(p.name);
    CHECK_FALSE(p.layout(1024).validate());
    CHECK(kvlink::find_model_preset(p.name)->model_id == p.model_id);
  }
  CHECK(names.size() == kvlink::model_presets().size());
  CHECK(names.count("llama-3.1-8b") == 1);
}

TEST_CASE("sizes per rank, per block, per tensor are computed from the shape") {
  kvlink::kv_layout l = kvlink::find_model_preset("qwen3-8b")->layout(1000, 16);
  l.tp_size = 2;
  l.tp_rank = 1;
  REQUIRE_FALSE(l.validate());
  CHECK(l.heads_per_rank() == 4);
  CHECK(l.first_head() == 4);
  CHECK(l.head_bytes() == 256);
  CHECK(l.bytes_per_token() == 147'456);  // whole model, whatever the rank
  CHECK(l.bytes_per_token_per_rank() == 73'728);
  CHECK(l.block_bytes() == 16 * 4 * 256);
  CHECK(l.block_stride() == l.block_bytes());
  CHECK(l.tensor_bytes() == 1000 * l.block_bytes());
  CHECK(l.total_bytes() == 2 * 36 * l.tensor_bytes());
  CHECK(l.total_bytes() == l.bytes_per_token_per_rank() * 16 * 1000);

  l.split = kvlink::kv_split::joint;
  CHECK(l.block_stride() == 2 * l.block_bytes());
  CHECK(l.tensor_bytes() == 1000 * 2 * l.block_bytes());
  CHECK(l.total_bytes() == 36 * l.tensor_bytes());
}

TEST_CASE("validate rejects bad layouts with a message naming the field") {
  CHECK(rejection(small_layout()).empty());
  CHECK_FALSE(small_layout().validate());  // message pointer is optional

  auto with = [](auto change) {
    kvlink::kv_layout l = small_layout();
    change(l);
    return rejection(l);
  };
  CHECK(with([](auto& l) { l.num_layers = 0; }).find("num_layers") != std::string::npos);
  CHECK(with([](auto& l) { l.num_kv_heads = 0; }).find("num_kv_heads") != std::string::npos);
  CHECK(with([](auto& l) { l.head_dim = 0; }).find("head_dim") != std::string::npos);
  CHECK(with([](auto& l) { l.block_tokens = 0; }).find("block_tokens") != std::string::npos);
  CHECK(with([](auto& l) { l.num_blocks = 0; }).find("num_blocks") != std::string::npos);
  CHECK(with([](auto& l) { l.type = static_cast<kvlink::dtype>(9); }).find("dtype") !=
        std::string::npos);
  CHECK(with([](auto& l) { l.split = static_cast<kvlink::kv_split>(7); }).find("kv_split") !=
        std::string::npos);
  CHECK(with([](auto& l) { l.order = static_cast<kvlink::block_order>(7); }).find("block_order") !=
        std::string::npos);
  CHECK(with([](auto& l) { l.tp_size = 0; }).find("tp_size is 0") != std::string::npos);
  CHECK(with([](auto& l) {
          l.tp_size = 2;
          l.tp_rank = 2;
        }).find("tp_rank 2 is not below tp_size 2") != std::string::npos);
  // 4 heads over 3 ranks, and more ranks than heads (replication): rejected.
  CHECK(with([](auto& l) { l.tp_size = 3; }).find("does not divide") != std::string::npos);
  CHECK(with([](auto& l) { l.tp_size = 8; }).find("does not divide") != std::string::npos);
  CHECK(with([](auto& l) { l.tp_size = 4; }).empty());
  CHECK(with([](auto& l) {
          l.num_kv_heads = 8;
          l.tp_size = 8;
          l.tp_rank = 7;
        }).empty());
}

TEST_CASE("validate rejects sizes that overflow 64 bits") {
  constexpr auto max32 = std::numeric_limits<std::uint32_t>::max();
  kvlink::kv_layout l = small_layout();
  l.num_blocks = max32;
  l.head_dim = max32;
  l.block_tokens = max32;
  CHECK(rejection(l).find("overflow") != std::string::npos);

  // Per-token size alone overflowing (whole model, all ranks).
  l = small_layout();
  l.num_layers = max32;
  l.num_kv_heads = max32 - (max32 % 5);  // divisible by tp_size below
  l.tp_size = 5;
  l.head_dim = max32;
  CHECK(rejection(l).find("overflow") != std::string::npos);

  // Large but representable: accepted, and the sizes are exact.
  l = small_layout();
  l.num_blocks = max32;
  l.type = kvlink::dtype::f32;
  CHECK(rejection(l).empty());
  CHECK(l.total_bytes() == 2ULL * 2 * max32 * (4 * 4 * 8 * 4));
}
