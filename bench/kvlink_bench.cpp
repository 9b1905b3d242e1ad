// kvlink-bench: how long moving one prompt's paged KV cache takes, per prompt
// length, between two processes (the Mooncake + vLLM table), plus a
// block-size sweep and a target role for two machines.
//
//   kvlink-bench                      # = kvlink-bench kv: Qwen3-8B, TCP, loopback
//   kvlink-bench kv --prompts 1K,32K --op read --blocks scattered --csv
//   kvlink-bench sweep --sizes 64KiB,1MiB --batches 1,16 --lanes 1,2,4
//   kvlink-bench target --listen 0.0.0.0:17001          # on host A
//   kvlink-bench kv --connect hostA:17001 --line-rate 12.5   # on host B
//   kvlink-bench kv --src-memory device --device cuda    # KV cache in GPU memory
//
// kv: for every prompt length, the prompt plus --pad template tokens is
// rounded up to whole blocks of --block-tokens; the blocks of every layer's K
// and V go through kv_layout -> make_block_transfer -> one
// async_submit_transfer with a notification attached, so a run ends once the
// data is placed at the target and the notification handed to the kernel
// after it. The figure is the median of --iterations runs (after --warmup
// untimed runs), with min..max as the spread. Without --connect the target is
// this program re-executed as `target` in a child process on loopback; both
// sides hold a KV cache sized to the largest prompt, touched before timing.
//
// Memory kinds: --src-memory is where the bytes come from, --dst-memory
// where they land (WRITE: the initiator's buffer -> the target's segment;
// READ: the target's segment -> the initiator's buffer); device memory is
// --device's (cuda, or emulated: kvlink's CPU-only stand-in), device 0,
// filled through its copy engine, and the engines get config.device. With
// device memory the table adds a reference measured in the same run: one
// stream's D2H and H2D copies of each row's bytes through pinned memory.
//
// Units: GB = 10^9 B, GiB = 2^30 B, MB = 10^6 B, MiB = 2^20 B.
#include <kvlink/engine.hpp>
#ifdef KVLINK_BENCH_WITH_RDMA
#include <kvlink/rdma.hpp>
#endif
#if defined(KVLINK_BENCH_HAS_CUDA) && __has_include(<kvlink/cuda.hpp>)
#include <kvlink/cuda.hpp>
#endif
#include <kvlink/kv/block_transfer.hpp>
#include <kvlink/kv/layout.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "bench_common.hpp"
#include <CLI/CLI.hpp>
#include <asio/io_context.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/signal_set.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace {

using namespace std::chrono_literals;
namespace kb = kvlink::bench;

// A bad option value: main() prints it and exits with status 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ------------------------------------------------------------------ options

struct layout_options {
  std::string model = "qwen3-8b";
  std::uint32_t layers = 0;  // 0: from the preset
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::string dtype;  // empty: from the preset
  std::uint32_t tp = 1;
  std::uint32_t block_tokens = 16;
  std::uint32_t pad = 16;
  std::string prompts = "128,256,512,1K,2K,4K,8K,16K,32K";
};

struct engine_options {
  std::string transport = "tcp";
  unsigned threads = 1;  // threads running each side's io_context
  bool checksums = false;
  std::uint32_t lanes = 0;  // 0: config default / environment
  std::string slice_size;
  std::uint32_t max_inflight = 0;
  std::string socket_buffer;
  std::string memory = "private";  // the target's segment: private or shared (shm/memory.hpp)
};

// Which memory the bytes come from (src) and land in (dst): host or device
// memory of --device. For a WRITE src is the initiator's buffer and dst the
// target's segment; for a READ src is the target's segment and dst the
// initiator's buffer.
struct memory_options {
  std::string src = "host";
  std::string dst = "host";
  std::string device;  // --device; empty: cuda where a side is device memory

  bool any_device() const { return src == "device" || dst == "device"; }
  /// The device runtime in use: empty when none.
  std::string runtime() const {
    if (!device.empty()) return device;
    return any_device() ? "cuda" : "";
  }
  /// The initiator's buffer for `op` is device memory.
  bool local_device(kvlink::opcode op) const {
    return (op == kvlink::opcode::write ? src : dst) == "device";
  }
  /// The target's segment for `op` is device memory.
  bool remote_device(kvlink::opcode op) const {
    return (op == kvlink::opcode::write ? dst : src) == "device";
  }
};

// Every device buffer of the bench is on this device of the runtime.
constexpr std::int32_t bench_device = 0;

struct kv_options {
  layout_options layout;
  engine_options engine;
  memory_options memory;
  std::string connect;
  std::uint32_t iterations = 3;
  std::uint32_t warmup = 1;
  std::string op = "write";
  std::string blocks = "contiguous";
  std::string line_rate = "measure";
  std::uint32_t line_rate_seconds = 3;
  bool csv = false;
  bool json = false;
};

struct sweep_options {
  engine_options engine;
  memory_options memory;
  std::string connect;
  std::string sizes = "4KiB,64KiB,1MiB,16MiB";
  std::string batches = "1,16,64";
  std::string lanes_list = "1,2,4";
  std::string ops = "write,read";
  std::uint32_t depth = 4;
  double seconds = 0.5;
  double warmup = 0.1;
  std::string segment_size = "1GiB";
  std::string block_layout = "scattered";
  std::string line_rate = "measure";
  std::uint32_t line_rate_seconds = 3;
  bool csv = false;
  bool json = false;
};

struct target_options {
  layout_options layout;
  engine_options engine;
  std::string listen = "127.0.0.1:0";
  std::string segment_size;  // empty: sized for the layout's largest prompt
  std::string segment_memory = "host";
  std::string device;  // --device; empty: cuda for a device segment
  bool watch_stdin = false;
};

// Which transports this build has (kvlink::rdma is linked where libibverbs
// was found).
std::string transport_help() {
  return fmt::format(
      "data transports in order of preference, comma-separated (this build has: {}); the "
      "target child gets the same",
      kvlink::transport_catalog::global().names());
}

std::uint64_t parse_bytes(std::string_view name, std::string_view v) {
  const auto n = kvlink::parse_size(v);
  if (!n || *n == 0) {
    throw usage_error(fmt::format("{}: '{}' is not a positive size ({})", name, v,
                                  kvlink::detail::size_units_help));
  }
  return *n;
}

std::uint64_t parse_count(std::string_view name, std::string_view v) {
  std::uint64_t n = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), n);
  if (r.ec != std::errc{} || r.ptr != v.data() + v.size() || n == 0) {
    throw usage_error(fmt::format("{}: '{}' is not a positive integer", name, v));
  }
  return n;
}

// Token counts: "4096", "4K" or "4k" (K = 1024 tokens, as in the Mooncake table).
std::vector<std::uint32_t> parse_prompts(std::string_view v) {
  std::vector<std::uint32_t> out;
  for (auto s : kb::split_list(v)) {
    std::uint64_t mult = 1;
    if (!s.empty() && (s.back() == 'K' || s.back() == 'k')) {
      mult = 1024;
      s.remove_suffix(1);
    }
    const std::uint64_t n = parse_count("--prompts", s) * mult;
    if (n > (1u << 24)) throw usage_error(fmt::format("--prompts: {} tokens is too many", n));
    out.push_back(static_cast<std::uint32_t>(n));
  }
  if (out.empty()) throw usage_error("--prompts: empty list");
  return out;
}

kvlink::config make_config(const engine_options& e) {
  std::error_code ec;
  std::string what;
  kvlink::config cfg = kvlink::config_from_env(kvlink::config{}, ec, &what);
  if (ec) throw usage_error(what);
  cfg.transports = e.transport;
  // The bench measures transfers, not first touches: a target's shared
  // memory is mapped with its page tables filled whatever its size (once, at
  // the first lease, inside the first row's warm-up), unless
  // KVLINK_SHM_PREFAULT says otherwise.
  if (std::getenv("KVLINK_SHM_PREFAULT") == nullptr) {
    cfg.shm.prefault = std::numeric_limits<std::uint64_t>::max();
  }
  if (e.checksums) cfg.checksums = true;
  if (e.lanes != 0) cfg.tcp.lanes = cfg.shm.lanes = e.lanes;
  if (!e.slice_size.empty()) cfg.slice_size = parse_bytes("--slice-size", e.slice_size);
  if (e.max_inflight != 0) cfg.tcp.max_inflight_per_lane = e.max_inflight;
  if (!e.socket_buffer.empty()) {
    const auto n = kvlink::parse_size(e.socket_buffer);
    if (!n) throw usage_error("--socket-buffer: not a size");
    cfg.tcp.socket_buffer = *n;
  }
  // Keep the planner's rules when only the slice size was given; both sides
  // get the same options, so the target accepts what we send.
  cfg.min_chunk = std::min(cfg.min_chunk, cfg.slice_size);
  cfg.tcp.max_frame_payload = std::max(cfg.tcp.max_frame_payload, cfg.slice_size + cfg.min_chunk);
  cfg.transfer_deadline = 0ms;  // a 4.5 GiB transfer on a slow box must not time out
  if (auto bad = kvlink::validate(cfg, &what)) throw usage_error("invalid settings: " + what);
  return cfg;
}

// Options the child target needs to accept what the initiator sends.
std::vector<std::string> engine_args(const engine_options& e) {
  std::vector<std::string> a{"--transport", e.transport, "--threads", std::to_string(e.threads)};
  if (!e.slice_size.empty()) a.insert(a.end(), {"--slice-size", e.slice_size});
  if (!e.socket_buffer.empty()) a.insert(a.end(), {"--socket-buffer", e.socket_buffer});
  a.insert(a.end(), {"--memory", e.memory});
  return a;
}

void add_engine_options(CLI::App* app, engine_options& e, bool lanes) {
  app->add_option("--transport", e.transport, transport_help())->capture_default_str();
  app->add_option("--memory", e.memory,
                  "the target's segment: private (any memory; shm copies with cross-memory "
                  "attach) or shared (kvlink::shm::shared_memory; shm maps it, memcpy)")
      ->check(CLI::IsMember({"private", "shared"}))
      ->capture_default_str();
  app->add_flag("--checksums", e.checksums,
                "end-to-end CRC32C of every slice's payload (config.checksums)");
  app->add_option("--threads", e.threads,
                  "threads running each side's io_context (the target child gets the same); "
                  "TCP lanes run on strands of their own, so data moves on up to this many cores; "
                  "with more than one, sweep's handlers (each submits the next transfer) run on a "
                  "strand of the engine's io_context, the kv table's on the bench's own thread")
      ->capture_default_str()
      ->check(CLI::Range(1u, 256u));
  if (lanes) {
    app->add_option("--lanes", e.lanes,
                    "TCP connections (or shm copy lanes) per peer (default: config, 2)");
  }
  app->add_option("--slice-size", e.slice_size, "planner slice size (default 1MiB)");
  app->add_option("--max-inflight", e.max_inflight, "slices in flight per lane (default 32)");
  app->add_option("--socket-buffer", e.socket_buffer, "SO_SNDBUF/SO_RCVBUF, 0 = kernel default");
}

void add_device_option(CLI::App* app, std::string& device) {
  app->add_option("--device", device,
                  fmt::format("device runtime of device memory (device 0), also set as the "
                              "engines' config.device: cuda, or emulated (kvlink's CPU-only "
                              "stand-in: its figures mean nothing for a GPU); default cuda "
                              "where a side is device memory (this build has: {})",
                              kvlink::device_catalog::global().names()))
      ->check(CLI::IsMember({"cuda", "emulated"}));
}

void add_memory_options(CLI::App* app, memory_options& m) {
  app->add_option("--src-memory", m.src,
                  "memory the bytes come from: host or device (--device). WRITE: the "
                  "initiator's buffer; READ: the target's segment")
      ->check(CLI::IsMember({"host", "device"}))
      ->capture_default_str();
  app->add_option("--dst-memory", m.dst,
                  "memory the bytes land in: host or device (--device). WRITE: the target's "
                  "segment; READ: the initiator's buffer")
      ->check(CLI::IsMember({"host", "device"}))
      ->capture_default_str();
  add_device_option(app, m.device);
}

// The device runtime named `name`, usable here, or a usage error saying why
// (`given`: named with --device, not the default).
std::shared_ptr<kvlink::device_runtime> find_device(const std::string& name, bool given) {
  kvlink::device_config c;
  c.runtime = name;
  std::error_code ec;
  std::string what;
  auto rt = kvlink::device_catalog::global().select(c, ec, what);
  if (!rt && !given) {
    throw usage_error("device memory without --device: cuda by default, but " + what +
                      " (--device emulated: the CPU-only stand-in)");
  }
  if (!rt) throw usage_error("--device: " + what);
  if (rt->device_count() <= bench_device) {
    throw usage_error(fmt::format("--device {}: no device {}", name, bench_device));
  }
  return rt;
}

// The target child's options for its segment's memory.
std::vector<std::string> memory_args(const memory_options& m, bool remote_device) {
  std::vector<std::string> a;
  if (remote_device) a.insert(a.end(), {"--segment-memory", "device"});
  if (!m.runtime().empty()) a.insert(a.end(), {"--device", m.runtime()});
  return a;
}

// "host", "host, shared", "device (emulated device 0)".
std::string memory_name(bool device, const std::string& runtime, const std::string& host_alloc) {
  if (device) return fmt::format("device ({} device {})", runtime, bench_device);
  return host_alloc.empty() ? std::string{"host"} : "host, " + host_alloc;
}

// The header's lines on memory: which kinds, which device, and what the
// figures are worth with the emulated one.
void print_memory_header(const memory_options& m, const std::vector<kvlink::opcode>& ops,
                         const std::string& host_alloc) {
  const auto rt = m.runtime();
  const auto src = memory_name(m.src == "device", rt, "");
  const auto dst = memory_name(m.dst == "device", rt, "");
  if (ops.size() == 1 && ops.front() == kvlink::opcode::write) {
    fmt::print("# memory: src = the initiator's buffer, {}; dst = the target's segment, {}\n", src,
               memory_name(m.dst == "device", rt, host_alloc));
  } else if (ops.size() == 1) {
    fmt::print("# memory: src = the target's segment, {}; dst = the initiator's buffer, {}\n",
               memory_name(m.src == "device", rt, host_alloc), dst);
  } else {
    fmt::print(
        "# memory: src (WRITE: the initiator's buffer, READ: the target's segment) {}; dst "
        "(WRITE: the target's segment, READ: the initiator's buffer) {}; the target's host "
        "memory {}\n",
        src, dst, host_alloc);
  }
  if (rt == "emulated") {
    fmt::print(
        "# NOTE: --device emulated is kvlink's CPU-only stand-in for a GPU (memfd memory moved "
        "by a copy thread): these figures mean nothing for a real GPU\n");
  }
}

void add_layout_options(CLI::App* app, layout_options& l) {
  app->add_option("--model", l.model, "model preset (qwen3-8b, qwen3-32b, llama-3.1-8b, ...)")
      ->capture_default_str();
  app->add_option("--layers", l.layers, "explicit layout: layers (overrides the preset)");
  app->add_option("--kv-heads", l.kv_heads, "explicit layout: KV heads of the whole model");
  app->add_option("--head-dim", l.head_dim, "explicit layout: elements per head");
  app->add_option("--dtype", l.dtype, "explicit layout: f32, f16, bf16, fp8");
  app->add_option("--tp", l.tp, "tensor-parallel size of both sides; rank 0 is measured")
      ->capture_default_str();
  app->add_option("--block-tokens", l.block_tokens, "tokens per KV block")->capture_default_str();
  app->add_option("--pad", l.pad,
                  "template tokens added to each prompt before rounding up to whole blocks")
      ->capture_default_str();
  app->add_option("--prompts", l.prompts, "prompt lengths in tokens (K = 1024)")
      ->capture_default_str();
}

struct model_shape {
  std::string label;
  kvlink::kv_layout layout;  // num_blocks left 0
};

model_shape make_shape(const layout_options& o) {
  kvlink::kv_layout l;
  std::string label;
  if (const auto p = kvlink::find_model_preset(o.model)) {
    l = p->layout(1, o.block_tokens);
    label = std::string{p->model_id};
  } else if (o.layers == 0 || o.kv_heads == 0 || o.head_dim == 0) {
    std::string known;
    for (const auto& m : kvlink::model_presets())
      known += std::string{known.empty() ? "" : ", "} + std::string{m.name};
    throw usage_error(fmt::format(
        "--model: unknown preset '{}' (known: {}); or give --layers --kv-heads --head-dim", o.model,
        known));
  }
  if (o.layers || o.kv_heads || o.head_dim || !o.dtype.empty()) label = "explicit layout";
  if (o.layers) l.num_layers = o.layers;
  if (o.kv_heads) l.num_kv_heads = o.kv_heads;
  if (o.head_dim) l.head_dim = o.head_dim;
  if (!o.dtype.empty()) {
    constexpr std::array types{kvlink::dtype::f32, kvlink::dtype::f16, kvlink::dtype::bf16,
                               kvlink::dtype::fp8};
    const auto it = std::find_if(types.begin(), types.end(),
                                 [&](kvlink::dtype t) { return kvlink::to_string(t) == o.dtype; });
    if (it == types.end()) throw usage_error("--dtype: f32, f16, bf16 or fp8");
    l.type = *it;
  }
  l.block_tokens = o.block_tokens;
  l.tp_size = o.tp;
  l.tp_rank = 0;
  l.num_blocks = 1;
  if (std::string why; l.validate(&why)) throw usage_error(why);
  l.num_blocks = 0;
  return {label, l};
}

std::uint32_t padded_tokens(const kvlink::kv_layout& l, std::uint32_t prompt, std::uint32_t pad) {
  const std::uint64_t t = std::uint64_t{prompt} + pad;
  return static_cast<std::uint32_t>((t + l.block_tokens - 1) / l.block_tokens * l.block_tokens);
}

// Bytes of one block index across all layers, K and V, on one rank.
std::uint64_t bytes_per_block_index(const kvlink::kv_layout& l) {
  return 2 * std::uint64_t{l.num_layers} * l.block_bytes();
}

// ------------------------------------------------------------------ target

int run_target(const target_options& o) {
  kvlink::config cfg = make_config(o.engine);
  cfg.listen = o.listen;
  std::uint64_t size = 0;
  if (!o.segment_size.empty()) {
    size = parse_bytes("--segment-size", o.segment_size);
  } else {
    const auto shape = make_shape(o.layout);
    std::uint32_t max_tokens = 0;
    for (auto p : parse_prompts(o.layout.prompts))
      max_tokens = std::max(max_tokens, padded_tokens(shape.layout, p, o.layout.pad));
    // + 1 spare block per tensor, as the initiator's cache (see run_kv).
    size = (std::uint64_t{max_tokens / shape.layout.block_tokens} + 1) *
           bytes_per_block_index(shape.layout);
  }
  const bool device = o.segment_memory == "device";
  const std::string runtime = !o.device.empty() ? o.device : device ? "cuda" : "";
  if (device && o.engine.memory == "shared") {
    throw usage_error("--memory shared is host memory; the segment is device memory");
  }
  if (!runtime.empty()) cfg.device.runtime = runtime;
  fmt::print(stderr, "target: allocating and touching {} of {} memory ...\n",
             kvlink::format_size(size),
             device ? fmt::format("{} device {}", runtime, bench_device) : o.engine.memory);
  // Shared memory: a same-host initiator maps it and copies with memcpy.
  std::optional<kb::page_buffer> private_mem;
  kvlink::shm::shared_memory shared_mem;
  std::optional<kb::device_copier> copier;
  std::optional<kb::bench_buffer> device_mem;
  std::byte* base = nullptr;
  if (device) {
    copier.emplace(find_device(runtime, !o.device.empty()), bench_device);
    device_mem.emplace(*copier, size);
    base = device_mem->data();
  } else if (o.engine.memory == "shared") {
    shared_mem = kvlink::shm::shared_memory::allocate(size);
    std::memset(shared_mem.data(), 0, size);  // touched, as make_buffer's
    base = shared_mem.data();
  } else {
    private_mem.emplace(size);
    base = private_mem->data();
  }
  kb::bench_io bio{o.engine.threads};
  kvlink::engine eng{bio.engine_io().get_executor(), cfg};
  eng.register_segment(base, size, kvlink::access::remote_read_write);
  const auto notes = kb::serve_target(bio, eng, size, o.watch_stdin);
  fmt::print(stderr, "target: done, {} notifications received\n", notes);
  return 0;
}

// ------------------------------------------------------------------ initiator helpers

kvlink::peer connect_peer(kb::bench_io& bio, kvlink::engine& eng, const std::string& address) {
  std::optional<std::pair<std::error_code, kvlink::peer>> conn;
  eng.async_connect(address,
                    bio.bind([&](std::error_code ec, kvlink::peer p) { conn.emplace(ec, p); }));
  bio.run_until([&] { return conn.has_value(); });
  if (conn->first) {
    throw std::runtime_error(fmt::format("connect({}): {}", address, conn->first.message()));
  }
  if (conn->second.segments().empty()) throw std::runtime_error("the target has no segment");
  return conn->second;
}

// The remote target: a child process on loopback unless `connect` is given.
struct target_handle {
  kb::child_process child;
  std::string address;
  bool local = true;
};

void start_target(const std::string& connect, std::vector<std::string> args, target_handle& t) {
  if (!connect.empty()) {
    t.address = connect;
    t.local = false;
    return;
  }
  args.insert(args.begin(), {"target", "--listen", "127.0.0.1:0", "--watch-stdin"});
  kb::spawn_target(args, t.child);
  t.address = t.child.address;
}

// ------------------------------------------------------------------ kv

struct kv_row {
  std::uint32_t prompt = 0;
  std::uint32_t padded = 0;
  std::uint32_t blocks = 0;
  std::uint64_t bytes = 0;
  std::size_t requests = 0;
  std::uint32_t slices = 0;
  std::vector<double> ms;  // sorted
  std::error_code error;
  /// Same-host rows: a single-core memcpy of the same requests, run after
  /// each transfer, GB/s of the median (0: none).
  double memcpy_gb_per_s = 0;
  std::vector<double> memcpy_ms;
  /// Device memory: the device copy reference (kb::copy_reference) of the
  /// row's bytes after each transfer, GB/s.
  std::vector<double> d2h_gb_per_s;
  std::vector<double> h2d_gb_per_s;

  double median_ms() const {
    if (ms.empty()) return 0;
    const std::size_t n = ms.size();
    return n % 2 ? ms[n / 2] : (ms[n / 2 - 1] + ms[n / 2]) / 2;
  }
  double gb_per_s() const {
    const double m = median_ms();
    return m > 0 ? static_cast<double>(bytes) / (m / 1e3) / 1e9 : 0;
  }
  double gib_per_s() const { return gb_per_s() * 1e9 / 1073741824.0; }
  double d2h() const { return median(d2h_gb_per_s); }
  double h2d() const { return median(h2d_gb_per_s); }

  static double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }
};

// Remote block ids for local blocks 0..n-1. Scattered: i -> i * s mod n with
// s coprime to n and s != 1, so no two consecutive local blocks land on
// consecutive remote blocks and nothing coalesces across blocks.
std::vector<std::uint32_t> remote_ids(std::uint32_t n, bool scattered) {
  std::vector<std::uint32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0u);
  if (!scattered || n < 2) return ids;
  if (n == 2) return {1, 0};
  std::uint32_t s = n / 2 + 1;
  while (std::gcd(s, n) != 1) ++s;  // n - 1 is always coprime with n
  for (std::uint32_t i = 0; i < n; ++i)
    ids[i] = static_cast<std::uint32_t>(std::uint64_t{i} * s % n);
  return ids;
}

// One single-core memcpy of the same requests, in their order: the same
// lengths, the same local buffers, and on the other side a scratch buffer
// laid out as the target's segment (each piece at its remote offset,
// wrapping at 1 GiB): the reference for a same-host transport, which at
// best is one copy of the same pieces. (Scattered block ids make both
// sides' pieces land 4 KiB at a time all over memory; a reference reading
// or writing its side end to end ran about twice as fast on READ here.)
// The scratch buffer is the kind of memory the target's segment is:
// `shared` (--memory shared) a kvlink::shm::shared_memory, as the target
// allocates it, else anonymous memory asked for in huge pages (page_buffer,
// as the target's private segment). They differ: where the kernel gives
// shared memory no transparent huge pages (shmem_enabled "never", the kernel's
// default and this VM's), a copy pays a TLB miss for every 4 KiB of it (a
// standalone copy of 1.5 * 10^5 scattered 4 KiB pieces here: 5.9-6.6 GB/s
// into shared memory, 7.2 into huge pages). ms.
double memcpy_pass(const std::vector<kvlink::transfer_request>& reqs, bool shared,
                   std::uint64_t passes = 1) {
  std::uint64_t extent = 0;
  std::uint64_t largest = 0;
  for (const auto& r : reqs) {
    extent = std::max(extent, r.remote_offset + r.length);
    largest = std::max(largest, r.length);
  }
  const std::uint64_t size =
      std::max<std::uint64_t>(std::min<std::uint64_t>(extent, 1u << 30), largest);
  // Page-aligned, as every segment is: glibc's memcpy on AMD EPYC runs
  // about 15 times slower when the destination is 1-31 bytes past the
  // source modulo 4 KiB (4 KiB pieces at 40-46 GB/s, 2.7-15 at 16 bytes;
  // a std::vector's block starts 16 bytes into its pages), which made this
  // reference's WRITEs far slower than any copy the transport makes.
  static std::optional<kb::page_buffer> private_scratch;
  static kvlink::shm::shared_memory shared_scratch;
  std::byte* scratch = nullptr;
  if (shared) {
    if (shared_scratch.size() < size) {  // every page allocated before timing
      shared_scratch = kvlink::shm::shared_memory::allocate(size, kvlink::shm::prefault::yes);
    }
    scratch = shared_scratch.data();
  } else {
    if (!private_scratch || private_scratch->size() < size) {
      private_scratch.emplace(size);  // touched before timing
    }
    scratch = private_scratch->data();
  }
  const auto t0 = kb::clock_type::now();
  for (std::uint64_t pass = 0; pass < passes; ++pass) {
    for (const auto& r : reqs) {
      std::uint64_t at = r.remote_offset % size;
      if (at + r.length > size) at = size - r.length;
      auto* local = static_cast<std::byte*>(r.local);
      if (r.op == kvlink::opcode::read) {  // a READ lands in local memory
        std::memcpy(local, scratch + at, r.length);
      } else {
        std::memcpy(scratch + at, local, r.length);
      }
    }
  }
  return std::chrono::duration<double, std::milli>(kb::clock_type::now() - t0).count();
}

// The memcpy reference of a sweep case: its requests (every batch in
// flight, in order) copied by memcpy_pass for at least `seconds`, after one
// pass that warms what the case left in the caches. GB/s.
double memcpy_rate(const std::vector<kvlink::transfer_request>& reqs, bool shared, double seconds) {
  std::uint64_t bytes = 0;
  for (const auto& r : reqs) bytes += r.length;
  if (bytes == 0) return 0;
  (void)memcpy_pass(reqs, shared);
  std::uint64_t passes = 1;
  for (;;) {
    const double ms = memcpy_pass(reqs, shared, passes);
    if (ms >= seconds * 1e3) {
      return static_cast<double>(bytes * passes) / (ms / 1e3) / 1e9;
    }
    passes *= 2;
  }
}

struct line_rate_info {
  double gb_per_s = 0;  // 0: unavailable
  std::string source;
};

// The line rate of rows over `transport`: `line_rate` is a rate in GB/s or
// "measure" (iperf3 -P 2 over loopback now, for a target on this host).
line_rate_info find_line_rate(const std::string& line_rate, std::uint32_t seconds,
                              const std::string& transport, bool local_target) {
  if (line_rate != "measure") {
    char* end = nullptr;
    const double v = std::strtod(line_rate.c_str(), &end);
    if (line_rate.empty() || end != line_rate.c_str() + line_rate.size() || !(v > 0)) {
      throw usage_error("--line-rate: a rate in GB/s (10^9 B/s) or 'measure'");
    }
    return {v, "given with --line-rate"};
  }
  if (!local_target) {
    return {0,
            "unavailable: 'measure' runs iperf3 on loopback, which says nothing about a "
            "remote target; pass --line-rate <GB/s>"};
  }
  // Same-host rows compare with a memcpy of their own pieces (or the
  // device's copies): iperf3's seconds at full load on every core would
  // measure nothing they use and disturb the rows that follow.
  if (transport == "shm") {
    return {0, "not measured: --transport shm rows compare with a memcpy of their own pieces"};
  }
  fmt::print(stderr, "line rate: iperf3 -P 2 over loopback for {} s ...\n", seconds);
  std::string why;
  const auto r = kb::iperf3_loopback(2, seconds, why);
  if (!r) return {0, "unavailable: " + why};
  return {r->receiver_gb_per_s,
          fmt::format("iperf3 -P 2 -t {} over loopback, receiver, measured in this run "
                      "(sender {:.2f} GB/s)",
                      seconds, r->sender_gb_per_s)};
}

// The loopback reference varies with what else runs on the machine: after
// the rows it is measured again and the higher figure kept (the harder bar).
void line_rate_again(line_rate_info& rate, const std::string& line_rate, std::uint32_t seconds,
                     bool local_target) {
  if (line_rate != "measure" || !local_target || rate.gb_per_s <= 0) return;
  std::string why;
  fmt::print(stderr, "line rate: iperf3 -P 2 over loopback again for {} s ...\n", seconds);
  if (const auto again = kb::iperf3_loopback(2, seconds, why)) {
    rate.source = fmt::format(
        "iperf3 -P 2 -t {} over loopback, receiver, measured in this run before ({:.2f}) and "
        "after ({:.2f}) the rows; the higher one",
        seconds, rate.gb_per_s, again->receiver_gb_per_s);
    rate.gb_per_s = std::max(rate.gb_per_s, again->receiver_gb_per_s);
  }
}

void print_kv(const kv_options& o, const model_shape& shape, const line_rate_info& rate,
              const std::string& where, const std::string& transport, std::uint32_t lanes,
              const std::vector<kv_row>& rows) {
  const auto& l = shape.layout;
  const double line = rate.gb_per_s;
  // Same-host rows compare with a memcpy of their own requests; others with
  // the line rate.
  auto share = [&](const kv_row& r) {
    const double ref = r.memcpy_gb_per_s > 0 ? r.memcpy_gb_per_s : line;
    return ref > 0 ? 100.0 * r.gb_per_s() / ref : 0.0;
  };
  // The CSV's and JSON's line-rate share is against the line rate only.
  auto line_share = [&](const kv_row& r) { return line > 0 ? 100.0 * r.gb_per_s() / line : 0.0; };
  const bool by_memcpy = !rows.empty() && rows.front().memcpy_gb_per_s > 0;
  // Device memory: kvlink against the copy its staging makes (D2H for a
  // device source, H2D for a device destination, the slower for both).
  const std::string runtime = o.memory.runtime();
  const bool by_copy = !runtime.empty();
  auto copy_share = [&](const kv_row& r) {
    double ref = 0;
    if (o.memory.src == "device") ref = r.d2h();
    if (o.memory.dst == "device") ref = ref > 0 ? std::min(ref, r.h2d()) : r.h2d();
    return ref > 0 ? 100.0 * r.gb_per_s() / ref : 0.0;
  };
  if (o.json) {
    nlohmann::json j;
    j["model"] = shape.label;
    j["layout"] = {{"layers", l.num_layers},
                   {"kv_heads", l.num_kv_heads},
                   {"head_dim", l.head_dim},
                   {"dtype", std::string{kvlink::to_string(l.type)}},
                   {"tp", l.tp_size},
                   {"block_tokens", l.block_tokens},
                   {"bytes_per_token_per_rank", l.bytes_per_token_per_rank()}};
    j["transport"] = transport;
    j["checksums"] = o.engine.checksums;
    j["lanes"] = lanes;
    j["threads"] = o.engine.threads;
    j["target"] = where;
    j["op"] = o.op;
    j["blocks"] = o.blocks;
    j["pad_tokens"] = o.layout.pad;
    j["iterations"] = o.iterations;
    j["src_memory"] = o.memory.src;
    j["dst_memory"] = o.memory.dst;
    j["host_memory"] = o.engine.memory;
    j["device"] = by_copy ? nlohmann::json(runtime) : nlohmann::json(nullptr);
    j["device_index"] = by_copy ? nlohmann::json(bench_device) : nlohmann::json(nullptr);
    j["device_figures_meaningful"] = runtime != "emulated";
    j["line_rate_gb_per_s"] = line > 0 ? nlohmann::json(line) : nlohmann::json(nullptr);
    j["line_rate_source"] = rate.source;
    j["rows"] = nlohmann::json::array();
    for (const auto& r : rows) {
      nlohmann::json x{{"prompt_tokens", r.prompt},
                       {"padded_tokens", r.padded},
                       {"blocks", r.blocks},
                       {"bytes", r.bytes},
                       {"requests", r.requests},
                       {"slices", r.slices},
                       {"ms", r.ms},
                       {"median_ms", r.median_ms()},
                       {"gb_per_s", r.gb_per_s()},
                       {"gib_per_s", r.gib_per_s()}};
      x["line_rate_share"] =
          line > 0 ? nlohmann::json(line_share(r) / 100) : nlohmann::json(nullptr);
      if (r.memcpy_gb_per_s > 0) {
        x["memcpy_gb_per_s"] = r.memcpy_gb_per_s;
        x["memcpy_share"] = share(r) / 100;
      }
      if (by_copy) {
        x["d2h_gb_per_s"] = r.d2h();
        x["h2d_gb_per_s"] = r.h2d();
        x["copy_share"] = copy_share(r) / 100;
      }
      x["error"] = r.error ? r.error.message() : std::string{};
      j["rows"].push_back(std::move(x));
    }
    fmt::print("{}\n", j.dump(2));
    return;
  }
  if (o.csv) {
    fmt::print(
        "prompt_tokens,padded_tokens,blocks,bytes,requests,slices,median_ms,min_ms,max_ms,"
        "gb_per_s,gib_per_s,line_rate_gb_per_s,line_rate_share_pct,op,block_ids,lanes,error,"
        "src_memory,dst_memory,device,d2h_gb_per_s,h2d_gb_per_s,memcpy_gb_per_s,memcpy_share_"
        "pct\n");
    for (const auto& r : rows) {
      const bool ok = !r.error && !r.ms.empty();
      fmt::print("{},{},{},{},{},{},{:.4f},{:.4f},{:.4f},{:.4f},{:.4f},{},{},{},{},{},{},",
                 r.prompt, r.padded, r.blocks, r.bytes, r.requests, r.slices, r.median_ms(),
                 ok ? r.ms.front() : 0.0, ok ? r.ms.back() : 0.0, r.gb_per_s(), r.gib_per_s(),
                 line > 0 ? fmt::format("{:.4f}", line) : "",
                 line > 0 && ok ? fmt::format("{:.2f}", line_share(r)) : "", o.op, o.blocks, lanes,
                 r.error ? r.error.message() : "");
      const bool memcpy_ref = ok && r.memcpy_gb_per_s > 0;
      fmt::print("{},{},{},{},{},{},{}\n", o.memory.src, o.memory.dst, runtime,
                 by_copy && ok ? fmt::format("{:.4f}", r.d2h()) : "",
                 by_copy && ok ? fmt::format("{:.4f}", r.h2d()) : "",
                 memcpy_ref ? fmt::format("{:.4f}", r.memcpy_gb_per_s) : "",
                 memcpy_ref ? fmt::format("{:.2f}", share(r)) : "");
    }
    return;
  }
  fmt::print(
      "# kvlink-bench kv: {} ({} layers, {} KV heads, head_dim {}, {}), TP {}: rank 0 moves "
      "{} B/token\n",
      shape.label, l.num_layers, l.num_kv_heads, l.head_dim, kvlink::to_string(l.type), l.tp_size,
      l.bytes_per_token_per_rank());
  fmt::print(
      "# {} over {} ({} lanes, {} thread{} per side{}), target {}; {} block ids, "
      "{}-token blocks\n",
      o.op == "write" ? "WRITE (push)" : "READ (pull)", transport, lanes, o.engine.threads,
      o.engine.threads == 1 ? "" : "s", o.engine.checksums ? ", CRC32C checksums" : "", where,
      o.blocks, l.block_tokens);
  print_memory_header(o.memory, {o.op == "write" ? kvlink::opcode::write : kvlink::opcode::read},
                      o.engine.memory);
  fmt::print("# padded = prompt + {} template tokens, rounded up to whole {}-token blocks\n",
             o.layout.pad, l.block_tokens);
  fmt::print(
      "# time = median of {} runs (after {} warm-up) from submit to completion, "
      "notification included; spread = min..max\n",
      o.iterations, o.warmup);
  if (by_memcpy) {
    fmt::print(
        "# reference: a single-core memcpy of each row's own requests (same sizes, same local "
        "buffers, the other side laid out as the target's segment, in {}) in this process, after "
        "each transfer, median of {} runs; memcpy% = kvlink / memcpy\n",
        o.engine.memory == "shared" ? "shared memory, as the segment"
                                    : "huge-page anonymous memory, as the segment",
        o.iterations);
  } else {
    fmt::print("# line rate: {}\n",
               line > 0 ? fmt::format("{:.2f} GB/s, {}", line, rate.source) : rate.source);
  }
  if (by_copy) {
    fmt::print(
        "# device copy reference: one {} stream (device {}) copying each row's bytes between "
        "device and pinned host memory in this process, D2H then H2D, pieces of up to 256 MiB, "
        "after each transfer, median of {} runs; copy% = kvlink / the copy its staging makes "
        "(D2H for a device src, H2D for a device dst, the slower for both)\n",
        runtime, bench_device, o.iterations);
  }
  fmt::print("# MB = 10^6 B, MiB = 2^20 B, GB/s = 10^9 B/s, GiB/s = 2^30 B/s\n");
  fmt::print("{:>7} {:>7} {:>10} {:>10} {:>9} {:>8} {:>8} {:>19} {:>7}{}{}\n", "prompt", "padded",
             "KV MiB", "KV MB", "ms (med)", "GB/s", "GiB/s", "spread ms",
             by_memcpy ? "memcpy%" : "line%", by_memcpy ? "  memcpy GB/s" : "",
             by_copy ? fmt::format(" {:>9} {:>9} {:>6}", "D2H GB/s", "H2D GB/s", "copy%") : "");
  for (const auto& r : rows) {
    const double mib = static_cast<double>(r.bytes) / 1048576.0;
    const double mb = static_cast<double>(r.bytes) / 1e6;
    if (r.error) {
      fmt::print("{:>7} {:>7} {:>10.2f} {:>10.2f} error: {}\n", r.prompt, r.padded, mib, mb,
                 r.error.message());
      continue;
    }
    fmt::print(
        "{:>7} {:>7} {:>10.2f} {:>10.2f} {:>9.2f} {:>8.2f} {:>8.2f} {:>19} {:>7}{}{}\n", r.prompt,
        r.padded, mib, mb, r.median_ms(), r.gb_per_s(), r.gib_per_s(),
        fmt::format("{:.2f}..{:.2f}", r.ms.front(), r.ms.back()),
        line > 0 || by_memcpy ? fmt::format("{:.1f}", share(r)) : "-",
        by_memcpy ? fmt::format("  {:>11.2f}", r.memcpy_gb_per_s) : "",
        by_copy ? fmt::format(" {:>9.2f} {:>9.2f} {:>6.1f}", r.d2h(), r.h2d(), copy_share(r)) : "");
  }
}

int run_kv(const kv_options& o) {
  if (o.csv && o.json) throw usage_error("--csv and --json: pick one");
  const kvlink::opcode op = o.op == "read" ? kvlink::opcode::read : kvlink::opcode::write;
  const bool scattered = o.blocks == "scattered";
  const auto shape = make_shape(o.layout);
  const auto prompts = parse_prompts(o.layout.prompts);
  kvlink::config cfg = make_config(o.engine);
  const std::string runtime = o.memory.runtime();
  const bool local_device = o.memory.local_device(op);
  const bool remote_device = o.memory.remote_device(op);
  if (remote_device && o.engine.memory == "shared") {
    throw usage_error("--memory shared is host memory; the target's segment is device memory");
  }
  if (!runtime.empty()) cfg.device.runtime = runtime;
  // Device memory: the runtime's stream for filling it and for the reference.
  std::optional<kb::device_copier> copier;
  if (!runtime.empty())
    copier.emplace(find_device(runtime, !o.memory.device.empty()), bench_device);

  std::uint32_t max_blocks = 0;
  for (auto p : prompts) {
    max_blocks = std::max(max_blocks,
                          padded_tokens(shape.layout, p, o.layout.pad) / shape.layout.block_tokens);
  }
  // One spare block per layer tensor: a serving engine's cache is larger than
  // one prompt, and without it the largest prompt would be one contiguous
  // range across all layers (a single request), which no real cache gives.
  kvlink::kv_layout local_layout = shape.layout;
  local_layout.num_blocks = max_blocks + 1;
  if (std::string why; local_layout.validate(&why)) throw usage_error(why);
  const std::uint64_t max_bytes = std::uint64_t{max_blocks} * bytes_per_block_index(shape.layout);

  // The reference first, while nothing else runs.
  line_rate_info rate =
      find_line_rate(o.line_rate, o.line_rate_seconds, o.engine.transport, o.connect.empty());

  target_handle target;
  std::vector<std::string> targs = engine_args(o.engine);
  targs.insert(targs.end(), {"--segment-size", std::to_string(local_layout.total_bytes()) + "B"});
  const auto margs = memory_args(o.memory, remote_device);
  targs.insert(targs.end(), margs.begin(), margs.end());
  start_target(o.connect, targs, target);

  fmt::print(stderr, "initiator: allocating and touching {} of {} memory ...\n",
             kvlink::format_size(local_layout.total_bytes()),
             memory_name(local_device, runtime, ""));
  auto mem = local_device ? kb::bench_buffer(*copier, local_layout.total_bytes())
                          : kb::bench_buffer(local_layout.total_bytes());
  // The device copy reference: pieces of up to 256 MiB (own buffers).
  std::optional<kb::copy_reference> reference;
  if (copier) {
    reference.emplace(*copier, std::min<std::uint64_t>(max_bytes, 256u << 20));
  }
  kb::bench_io bio{o.engine.threads};
  kvlink::engine eng{bio.engine_io().get_executor(), cfg};
  eng.register_segment(mem.data(), mem.size(), kvlink::access::remote_read_write);
  const kvlink::peer peer = connect_peer(bio, eng, target.address);
  const auto seg = peer.segments().front();

  // The target's block table: as many blocks as its first segment holds.
  kvlink::kv_layout remote_layout = shape.layout;
  const std::uint64_t remote_blocks = seg.length / bytes_per_block_index(shape.layout);
  if (remote_blocks < max_blocks) {
    throw std::runtime_error(fmt::format(
        "the target's segment ({}) holds {} blocks of this layout, the largest prompt needs {}: "
        "start the target with the same --model/--prompts or a larger --segment-size",
        kvlink::format_size(seg.length), remote_blocks, max_blocks));
  }
  remote_layout.num_blocks = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(remote_blocks, std::numeric_limits<std::uint32_t>::max()));
  const auto local_view = kvlink::kv_local_view::contiguous(local_layout, mem.data());
  const auto remote_view = kvlink::kv_remote_view::contiguous(
      remote_layout, kvlink::remote_segment{peer.id(), seg.id}, 0);
  const std::string where = target.local ? fmt::format("child process on {}", target.address)
                                         : fmt::format("{} (--connect)", target.address);
  const std::string transport = peer.transport_reason();
  const std::uint32_t lanes = peer.transport() == "shm" ? cfg.shm.lanes : cfg.tcp.lanes;
  fmt::print(stderr, "initiator: connected to {} over {} with {} lanes\n", target.address,
             transport, lanes);

  std::vector<kv_row> rows;
  std::vector<kvlink::transfer_request> reqs;
  int rc = 0;
  const bool same_host = peer.transport() == "shm";
  for (auto prompt : prompts) {
    kv_row row;
    row.prompt = prompt;
    row.padded = padded_tokens(shape.layout, prompt, o.layout.pad);
    row.blocks = row.padded / shape.layout.block_tokens;
    std::vector<std::uint32_t> local_ids(row.blocks);
    std::iota(local_ids.begin(), local_ids.end(), 0u);
    const auto rids = remote_ids(row.blocks, scattered);
    reqs.clear();
    std::string why;
    if (auto ec =
            kvlink::make_block_transfer(op, local_view, remote_view, local_ids, rids, reqs, &why)) {
      throw std::runtime_error("make_block_transfer: " + why);
    }
    row.requests = reqs.size();
    row.bytes = std::uint64_t{row.blocks} * bytes_per_block_index(shape.layout);
    fmt::print(stderr, "  prompt {:>6} -> {:>6} tokens, {:>10}, {:>6} requests:", prompt,
               row.padded, kvlink::format_size(row.bytes), row.requests);
    std::fflush(stderr);
    for (std::uint32_t it = 0; it < o.warmup + o.iterations && !row.error; ++it) {
      kvlink::transfer_options opts;
      opts.deadline = 0ms;
      opts.notify = kvlink::notification{"kv", fmt::format("prompt={} run={}", prompt, it)};
      std::optional<std::pair<std::error_code, kvlink::transfer_result>> done;
      const auto t0 = kb::clock_type::now();
      eng.async_submit_transfer(
          reqs, opts,
          bio.bind([&](std::error_code ec, kvlink::transfer_result r) { done.emplace(ec, r); }));
      bio.run_until([&] { return done.has_value(); });
      const double ms =
          std::chrono::duration<double, std::milli>(kb::clock_type::now() - t0).count();
      if (done->first) {
        row.error = done->first;
      } else if (done->second.bytes != row.bytes) {
        row.error = make_error_code(kvlink::errc::invalid_argument);
        fmt::print(stderr, " moved {} bytes, expected {}", done->second.bytes, row.bytes);
      } else if (it >= o.warmup) {
        row.ms.push_back(ms);
        row.slices = done->second.slices;
      }
      // The references interleaved with the transfers: both see the same
      // state of a shared machine. (The CPU cannot read device memory.)
      if (same_host && !local_device && !row.error) {
        const double m = memcpy_pass(reqs, o.engine.memory == "shared");
        if (it >= o.warmup) row.memcpy_ms.push_back(m);
      }
      if (reference && !row.error) {
        const auto c = reference->measure(row.bytes);
        if (it >= o.warmup) {
          row.d2h_gb_per_s.push_back(c.d2h_gb_per_s);
          row.h2d_gb_per_s.push_back(c.h2d_gb_per_s);
        }
      }
    }
    std::sort(row.ms.begin(), row.ms.end());
    if (!row.error && !row.memcpy_ms.empty()) {
      std::sort(row.memcpy_ms.begin(), row.memcpy_ms.end());
      const double m = row.memcpy_ms[row.memcpy_ms.size() / 2];
      row.memcpy_gb_per_s = m > 0 ? static_cast<double>(row.bytes) / (m / 1e3) / 1e9 : 0;
    }
    if (row.error) {
      fmt::print(stderr, " error: {}\n", row.error.message());
      rc = 1;
    } else {
      fmt::print(stderr, " {:.2f} ms, {:.2f} GB/s\n", row.median_ms(), row.gb_per_s());
    }
    rows.push_back(std::move(row));
  }
  line_rate_again(rate, o.line_rate, o.line_rate_seconds, target.local);
  print_kv(o, shape, rate, where, transport, lanes, rows);
  return rc;
}

// ------------------------------------------------------------------ sweep

int run_sweep(const sweep_options& o) {
  if (o.csv && o.json) throw usage_error("--csv and --json: pick one");
  std::vector<std::uint64_t> sizes, batches, lanes;
  std::vector<kvlink::opcode> ops;
  for (auto s : kb::split_list(o.sizes)) sizes.push_back(parse_bytes("--sizes", s));
  for (auto s : kb::split_list(o.batches)) batches.push_back(parse_count("--batches", s));
  for (auto s : kb::split_list(o.lanes_list)) lanes.push_back(parse_count("--lanes", s));
  for (auto s : kb::split_list(o.ops)) {
    if (s == "write") {
      ops.push_back(kvlink::opcode::write);
    } else if (s == "read") {
      ops.push_back(kvlink::opcode::read);
    } else {
      throw usage_error(fmt::format("--ops: '{}' is neither write nor read", s));
    }
  }
  if (sizes.empty() || batches.empty() || lanes.empty() || ops.empty())
    throw usage_error("empty --sizes/--batches/--lanes/--ops");
  if (!(o.seconds > 0) || !(o.warmup >= 0)) throw usage_error("--seconds/--warmup: positive");
  const std::uint64_t segment = parse_bytes("--segment-size", o.segment_size);
  for (auto s : sizes)
    if (s > segment) throw usage_error(fmt::format("block size {} exceeds --segment-size", s));
  // One buffer per side: its kind must suit every op.
  const bool local_device = o.memory.local_device(ops.front());
  const bool remote_device = o.memory.remote_device(ops.front());
  for (auto op : ops) {
    if (o.memory.local_device(op) != local_device) {
      throw usage_error(
          "--src-memory and --dst-memory differ: give one op (--ops write or --ops read)");
    }
  }
  if (remote_device && o.engine.memory == "shared") {
    throw usage_error("--memory shared is host memory; the target's segment is device memory");
  }
  const std::string runtime = o.memory.runtime();
  std::optional<kb::device_copier> copier;
  if (!runtime.empty())
    copier.emplace(find_device(runtime, !o.memory.device.empty()), bench_device);

  // The line rate first, while nothing else runs (rows over shm compare
  // with a memcpy of their own pieces instead, measured after each case).
  line_rate_info rate =
      find_line_rate(o.line_rate, o.line_rate_seconds, o.engine.transport, o.connect.empty());

  target_handle target;
  auto targs = engine_args(o.engine);
  targs.insert(targs.end(), {"--segment-size", o.segment_size});
  const auto margs = memory_args(o.memory, remote_device);
  targs.insert(targs.end(), margs.begin(), margs.end());
  start_target(o.connect, targs, target);
  auto mem = local_device ? kb::bench_buffer(*copier, segment) : kb::bench_buffer(segment);
  // The device copy reference per block size: copies of one block each,
  // back to back on one stream, 64 MiB at least (and 2 blocks).
  std::vector<kb::copy_reference::rates> copy_rates;
  if (copier) {
    kb::copy_reference reference{*copier, *std::max_element(sizes.begin(), sizes.end())};
    for (auto block : sizes) {
      fmt::print(stderr, "  device copy reference, {} blocks ...", kvlink::format_size(block));
      std::fflush(stderr);
      const std::uint64_t n = std::max<std::uint64_t>(64u << 20, 2 * block) / block * block;
      copy_rates.push_back(reference.measure(n, block));
      fmt::print(stderr, " D2H {:.2f} GB/s, H2D {:.2f} GB/s\n", copy_rates.back().d2h_gb_per_s,
                 copy_rates.back().h2d_gb_per_s);
    }
  }
  const kb::case_timing timing{std::chrono::duration<double>(o.warmup),
                               std::chrono::duration<double>(o.seconds),
                               o.block_layout == "scattered"};
  kb::bench_io bio{o.engine.threads};
  std::vector<kb::case_result> rows;
  int rc = 0;
  kvlink::config cfg0 = make_config(o.engine);
  if (!runtime.empty()) cfg0.device.runtime = runtime;
  std::string used_transport;
  for (auto n : lanes) {
    kvlink::config cfg = cfg0;
    cfg.tcp.lanes = static_cast<std::uint32_t>(std::min<std::uint64_t>(n, 1024));
    kvlink::engine eng{bio.engine_io().get_executor(), cfg};
    eng.register_segment(mem.data(), mem.size(), kvlink::access::remote_read_write);
    const kvlink::peer peer = connect_peer(bio, eng, target.address);
    used_transport = peer.transport_reason();
    const std::uint64_t remote_size = peer.segments().front().length;
    for (auto op : ops) {
      for (auto block : sizes) {
        if (block > remote_size) throw std::runtime_error("block size exceeds the target segment");
        for (auto batch : batches) {
          kb::case_result r;
          r.op = op;
          r.block = block;
          r.batch = batch;
          r.depth = o.depth;
          r.lanes = cfg.tcp.lanes;
          fmt::print(stderr, "  lanes {} {:<5} {:>8} x {:<3} depth {} ...", r.lanes,
                     kb::op_name(op), kvlink::format_size(block), batch, o.depth);
          std::fflush(stderr);
          kb::case_runner runner{bio, eng, peer, mem.data(), mem.size(), remote_size, timing, r};
          if (!kb::run_and_report(runner, r)) rc = 1;
          // Same host, host memory: a memcpy of the case's pieces right
          // after it, so both see the same state of a shared machine.
          if (!r.error && peer.transport() == "shm" && !local_device && !remote_device) {
            std::vector<kvlink::transfer_request> all;
            for (const auto& b : runner.batches()) all.insert(all.end(), b.begin(), b.end());
            r.memcpy_gb_per_s =
                memcpy_rate(all, o.engine.memory == "shared", std::min(o.seconds, 0.2));
          }
          rows.push_back(r);
        }
      }
    }
  }
  line_rate_again(rate, o.line_rate, o.line_rate_seconds, target.local);
  const double line = rate.gb_per_s;
  const bool by_memcpy =
      std::any_of(rows.begin(), rows.end(), [](const auto& r) { return r.memcpy_gb_per_s > 0; });
  auto line_share = [&](const kb::case_result& r) {
    return line > 0 && !r.error ? 100.0 * r.gb_per_s() / line : 0.0;
  };
  auto memcpy_share = [](const kb::case_result& r) {
    return r.memcpy_gb_per_s > 0 && !r.error ? 100.0 * r.gb_per_s() / r.memcpy_gb_per_s : 0.0;
  };
  // The device copy reference of a row's block size, and kvlink's share of
  // the copy its staging makes (as in the kv table).
  const bool by_copy = !copy_rates.empty();
  auto rates_of = [&](std::uint64_t block) {
    const auto i =
        static_cast<std::size_t>(std::find(sizes.begin(), sizes.end(), block) - sizes.begin());
    return i < copy_rates.size() ? copy_rates[i] : kb::copy_reference::rates{};
  };
  auto copy_share = [&](const kb::case_result& r) {
    const auto c = rates_of(r.block);
    double ref = 0;
    if (o.memory.src == "device") ref = c.d2h_gb_per_s;
    if (o.memory.dst == "device") ref = ref > 0 ? std::min(ref, c.h2d_gb_per_s) : c.h2d_gb_per_s;
    return ref > 0 ? 100.0 * r.gb_per_s() / ref : 0.0;
  };
  if (o.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& r : rows) {
      nlohmann::json x{{"op", kb::op_name(r.op)},
                       {"block_bytes", r.block},
                       {"batch", r.batch},
                       {"depth", r.depth},
                       {"lanes", r.lanes},
                       {"bytes", r.bytes},
                       {"seconds", r.seconds},
                       {"gb_per_s", r.gb_per_s()},
                       {"gib_per_s", r.gib_per_s()},
                       {"mean_batch_latency_us", r.mean_latency_us},
                       {"error", r.error ? r.error.message() : std::string{}},
                       {"src_memory", o.memory.src},
                       {"dst_memory", o.memory.dst},
                       {"host_memory", o.engine.memory},
                       {"device", by_copy ? nlohmann::json(runtime) : nlohmann::json(nullptr)}};
      if (by_copy) {
        x["d2h_gb_per_s"] = rates_of(r.block).d2h_gb_per_s;
        x["h2d_gb_per_s"] = rates_of(r.block).h2d_gb_per_s;
        x["copy_share"] = copy_share(r) / 100;
      }
      x["line_rate_gb_per_s"] = line > 0 ? nlohmann::json(line) : nlohmann::json(nullptr);
      x["line_rate_share"] =
          line > 0 && !r.error ? nlohmann::json(line_share(r) / 100) : nlohmann::json(nullptr);
      if (r.memcpy_gb_per_s > 0) {
        x["memcpy_gb_per_s"] = r.memcpy_gb_per_s;
        x["memcpy_share"] = memcpy_share(r) / 100;
      }
      j.push_back(std::move(x));
    }
    fmt::print("{}\n", j.dump(2));
  } else if (o.csv) {
    fmt::print(
        "op,block_bytes,batch,depth,lanes,bytes,seconds,gb_per_s,gib_per_s,"
        "mean_batch_latency_us,error,src_memory,dst_memory,device,d2h_gb_per_s,h2d_gb_per_s,"
        "line_rate_gb_per_s,line_rate_share_pct,memcpy_gb_per_s,memcpy_share_pct\n");
    for (const auto& r : rows) {
      fmt::print("{},{},{},{},{},{},{:.6f},{:.4f},{:.4f},{:.1f},{},", kb::op_name(r.op), r.block,
                 r.batch, r.depth, r.lanes, r.bytes, r.seconds, r.gb_per_s(), r.gib_per_s(),
                 r.mean_latency_us, r.error ? r.error.message() : std::string{});
      fmt::print("{},{},{},{},{},", o.memory.src, o.memory.dst, runtime,
                 by_copy ? fmt::format("{:.4f}", rates_of(r.block).d2h_gb_per_s) : "",
                 by_copy ? fmt::format("{:.4f}", rates_of(r.block).h2d_gb_per_s) : "");
      const bool memcpy_ref = r.memcpy_gb_per_s > 0 && !r.error;
      fmt::print("{},{},{},{}\n", line > 0 ? fmt::format("{:.4f}", line) : "",
                 line > 0 && !r.error ? fmt::format("{:.2f}", line_share(r)) : "",
                 memcpy_ref ? fmt::format("{:.4f}", r.memcpy_gb_per_s) : "",
                 memcpy_ref ? fmt::format("{:.2f}", memcpy_share(r)) : "");
    }
  } else {
    fmt::print(
        "# kvlink-bench sweep over {}, target {}; depth {}, {} block layout, {} thread(s) per "
        "side; GB/s = 10^9 B/s, GiB/s = 2^30 B/s\n",
        used_transport, target.local ? "child process on loopback" : target.address, o.depth,
        o.block_layout, o.engine.threads);
    print_memory_header(o.memory, ops, o.engine.memory);
    if (by_memcpy) {
      fmt::print(
          "# memcpy reference: after each case, one core copies the case's pieces (every batch in "
          "flight, the same lengths, the same local buffers, the target's offsets in a buffer of "
          "this process) for at least {:.2f} s; memcpy% = kvlink / that copy\n",
          std::min(o.seconds, 0.2));
    } else {
      fmt::print("# line rate: {}{}\n",
                 line > 0 ? fmt::format("{:.2f} GB/s, ", line) : std::string{}, rate.source);
    }
    if (by_copy) {
      fmt::print(
          "# device copy reference: one {} stream (device {}) copying blocks of the row's size "
          "back to back between device and pinned host memory in this process (64 MiB at "
          "least), before the rows; copy% = kvlink / the copy its staging makes (D2H for a "
          "device src, H2D for a device dst, the slower for both)\n",
          runtime, bench_device);
    }
    fmt::print("{:>5} {:<6} {:>9} {:>6} {:>9} {:>9} {:>13}{}{}\n", "lanes", "op", "block", "batch",
               "GB/s", "GiB/s", "lat/batch us",
               by_copy ? fmt::format(" {:>9} {:>9} {:>6}", "D2H GB/s", "H2D GB/s", "copy%") : "",
               by_memcpy  ? fmt::format(" {:>11} {:>8}", "memcpy GB/s", "memcpy%")
               : line > 0 ? fmt::format(" {:>6}", "line%")
                          : "");
    for (const auto& r : rows) {
      if (r.error) {
        fmt::print("{:>5} {:<6} {:>9} {:>6} error: {}\n", r.lanes, kb::op_name(r.op),
                   kvlink::format_size(r.block), r.batch, r.error.message());
        continue;
      }
      fmt::print(
          "{:>5} {:<6} {:>9} {:>6} {:>9.2f} {:>9.2f} {:>13.1f}{}{}\n", r.lanes, kb::op_name(r.op),
          kvlink::format_size(r.block), r.batch, r.gb_per_s(), r.gib_per_s(), r.mean_latency_us,
          by_copy ? fmt::format(" {:>9.2f} {:>9.2f} {:>6.1f}", rates_of(r.block).d2h_gb_per_s,
                                rates_of(r.block).h2d_gb_per_s, copy_share(r))
                  : "",
          by_memcpy  ? fmt::format(" {:>11.2f} {:>8.1f}", r.memcpy_gb_per_s, memcpy_share(r))
          : line > 0 ? fmt::format(" {:>6.1f}", line_share(r))
                     : "");
    }
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvlink-bench: KV-cache transfer time and bandwidth per prompt length between two "
      "processes (default: `kv`, Qwen3-8B over TCP on loopback)",
      "kvlink-bench"};
  app.require_subcommand(0, 1);

  kv_options kv;
  auto* kv_cmd = app.add_subcommand("kv", "per-prompt-length KV table (the default)");
  add_layout_options(kv_cmd, kv.layout);
  add_engine_options(kv_cmd, kv.engine, true);
  add_memory_options(kv_cmd, kv.memory);
  kv_cmd->add_option("--connect", kv.connect, "HOST:PORT of a running `kvlink-bench target`");
  kv_cmd->add_option("--iterations", kv.iterations, "timed runs per prompt (median reported)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 100000u));
  kv_cmd->add_option("--warmup", kv.warmup, "untimed runs per prompt first")->capture_default_str();
  kv_cmd->add_option("--op", kv.op, "write (prefill pushes) or read (decode pulls)")
      ->capture_default_str()
      ->check(CLI::IsMember({"write", "read"}));
  kv_cmd
      ->add_option("--blocks", kv.blocks,
                   "contiguous, or scattered: remote block ids permuted so that nothing "
                   "coalesces across blocks")
      ->capture_default_str()
      ->check(CLI::IsMember({"contiguous", "scattered"}));
  kv_cmd
      ->add_option("--line-rate", kv.line_rate,
                   "reference in GB/s, or 'measure' (iperf3 -P 2 over loopback in this run)")
      ->capture_default_str();
  kv_cmd->add_option("--line-rate-seconds", kv.line_rate_seconds, "iperf3 -t for 'measure'")
      ->capture_default_str()
      ->check(CLI::Range(1u, 60u));
  kv_cmd->add_flag("--csv", kv.csv, "CSV on stdout");
  kv_cmd->add_flag("--json", kv.json, "JSON on stdout");

  sweep_options sw;
  auto* sweep_cmd = app.add_subcommand("sweep", "block size x batch x lanes bandwidth sweep");
  add_engine_options(sweep_cmd, sw.engine, false);
  add_memory_options(sweep_cmd, sw.memory);
  sweep_cmd->add_option("--connect", sw.connect, "HOST:PORT of a running `kvlink-bench target`");
  sweep_cmd->add_option("--sizes", sw.sizes, "block sizes")->capture_default_str();
  sweep_cmd->add_option("--batches", sw.batches, "requests per batch")->capture_default_str();
  sweep_cmd->add_option("--lanes", sw.lanes_list, "TCP lanes per peer")->capture_default_str();
  sweep_cmd->add_option("--ops", sw.ops, "write,read")->capture_default_str();
  sweep_cmd->add_option("--depth", sw.depth, "batches in flight")
      ->capture_default_str()
      ->check(CLI::Range(1u, 4096u));
  sweep_cmd->add_option("--seconds", sw.seconds, "measured time per case")->capture_default_str();
  sweep_cmd->add_option("--warmup", sw.warmup, "warm-up time per case")->capture_default_str();
  sweep_cmd->add_option("--segment-size", sw.segment_size, "bytes registered on each side")
      ->capture_default_str();
  sweep_cmd
      ->add_option("--layout", sw.block_layout,
                   "scattered (remote blocks 4 KiB apart: no coalescing) or contiguous")
      ->capture_default_str()
      ->check(CLI::IsMember({"contiguous", "scattered"}));
  sweep_cmd
      ->add_option("--line-rate", sw.line_rate,
                   "reference of rows over the network in GB/s, or 'measure' (iperf3 -P 2 over "
                   "loopback before and after the rows, the higher one); rows over shm compare "
                   "with a memcpy of their own pieces instead")
      ->capture_default_str();
  sweep_cmd->add_option("--line-rate-seconds", sw.line_rate_seconds, "iperf3 -t for 'measure'")
      ->capture_default_str()
      ->check(CLI::Range(1u, 60u));
  sweep_cmd->add_flag("--csv", sw.csv, "CSV on stdout");
  sweep_cmd->add_flag("--json", sw.json, "JSON on stdout");

  target_options tg;
  auto* target_cmd = app.add_subcommand(
      "target", "serve a KV cache for an initiator (prints LISTEN host:port on stdout)");
  add_layout_options(target_cmd, tg.layout);
  add_engine_options(target_cmd, tg.engine, false);
  target_cmd->add_option("--listen", tg.listen, "HOST:PORT to listen on")->capture_default_str();
  target_cmd->add_option("--segment-size", tg.segment_size,
                         "bytes to register (default: the layout's largest prompt)");
  target_cmd
      ->add_option("--segment-memory", tg.segment_memory,
                   "host (allocated as --memory says) or device memory (--device)")
      ->check(CLI::IsMember({"host", "device"}))
      ->capture_default_str();
  add_device_option(target_cmd, tg.device);
  target_cmd->add_flag("--watch-stdin", tg.watch_stdin, "stop when stdin closes");

  // No subcommand: `kv`, so that `kvlink-bench --prompts 1K` works too.
  std::vector<std::string> args(argv, argv + argc);
  const bool top_help = argc == 2 && (args[1] == "--help" || args[1] == "-h");
  if (!top_help && (argc == 1 || args[1].rfind('-', 0) == 0)) {
    args.insert(args.begin() + 1, "kv");
  }
  std::vector<char*> cargv;
  for (auto& s : args) cargv.push_back(s.data());
  try {
    app.parse(static_cast<int>(cargv.size()), cargv.data());
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (sweep_cmd->parsed()) return run_sweep(sw);
    if (target_cmd->parsed()) return run_target(tg);
    return run_kv(kv);
  } catch (const usage_error& e) {
    fmt::print(stderr, "kvlink-bench: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "kvlink-bench: {}\n", e.what());
    return 1;
  }
}
