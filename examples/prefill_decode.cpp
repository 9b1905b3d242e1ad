// Prefill pushes a prompt's paged KV cache into decode, Mooncake style, in
// two processes: decode registers its KV cache and waits; prefill fills its
// own cache with a known pattern, WRITEs it chunk by chunk into decode's
// differently numbered block table, and attaches a notification to each
// chunk. Decode verifies every byte of a chunk as its notification arrives
// (the notification is delivered only after the chunk's data is in place),
// then both report time and bandwidth.
//
//   build/examples/prefill_decode [--tokens 4096] [--model qwen3-8b] [--chunk-blocks 32]
//                                 [--prefill-memory host|cuda|emulated] [--decode-memory ...]
//
// With no --role it starts decode as a child process on loopback. A side's
// KV cache may live in device memory, as a serving engine keeps it on its
// GPU (--prefill-memory cuda; emulated is kvlink's CPU-only stand-in for CI):
// the CPU then fills and checks it only through the device's copy engine,
// and the engine, told the runtime by config.device, stages it.
#include <kvlink/kvlink.hpp>
#if defined(KVLINK_EXAMPLE_HAS_CUDA) && __has_include(<kvlink/cuda.hpp>)
#include <kvlink/cuda.hpp>  // the "cuda" device runtime (link kvlink::cuda)
#endif

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/async_result.hpp>
#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

struct options {
  std::string role = "both";
  std::string model = "qwen3-8b";
  std::uint32_t tokens = 4096;
  std::uint32_t chunk_blocks = 32;
  std::string connect;
  std::string prefill_memory = "host";  // or a device runtime: cuda, emulated
  std::string decode_memory = "host";
};

// A KV cache in host memory, or in device memory of a device runtime (device
// 0), which the CPU reaches only through a stream of the device's copy
// engine: fill() and copy_out() go through it, awaited.
class kv_cache {
 public:
  kv_cache(const std::string& memory, std::uint64_t size, asio::any_io_executor ex) {
    if (memory == "host") {
      host_.resize(size);
      return;
    }
    auto rt = kvlink::device_catalog::global().find(memory);
    if (!rt || !rt->available()) {
      throw std::runtime_error(fmt::format("no usable device runtime '{}' (this program has: {}){}",
                                           memory, kvlink::device_catalog::global().names(),
                                           rt ? ": " + rt->unavailable_reason() : ""));
    }
    device_ = kvlink::device_buffer{rt, 0, size};
    std::error_code ec;
    std::string what;
    stream_ = rt->open_stream(0, std::move(ex), ec, what);
    if (!stream_) throw std::system_error(ec, what);
  }

  std::byte* data() { return stream_ ? device_.data() : host_.data(); }
  std::uint64_t size() const { return stream_ ? device_.size() : host_.size(); }
  bool on_device() const { return stream_ != nullptr; }

  // n host bytes from `src` to `at` in the cache.
  asio::awaitable<void> fill(std::byte* at, const std::byte* src, std::size_t n) {
    co_await copy(at, device_memory(), src, {}, n);
  }
  // n bytes from `at` in the cache to host memory at `dst`.
  asio::awaitable<void> copy_out(std::byte* dst, const std::byte* at, std::size_t n) {
    co_await copy(dst, {}, at, device_memory(), n);
  }

 private:
  kvlink::memory_desc device_memory() const {
    return stream_ ? kvlink::memory_desc{kvlink::memory_kind::device, 0} : kvlink::memory_desc{};
  }

  asio::awaitable<void> copy(void* dst, kvlink::memory_desc dm, const void* src,
                             kvlink::memory_desc sm, std::size_t n) {
    if (!stream_) {
      std::memcpy(dst, src, n);
      co_return;
    }
    // The stream's completion, posted on our executor, resumes the coroutine
    // (an error throws).
    co_await asio::async_initiate<const asio::use_awaitable_t<>&, void(std::error_code)>(
        [&](auto handler) {
          auto h = std::make_shared<decltype(handler)>(std::move(handler));
          stream_->async_copy(dst, dm, src, sm, n, [h](std::error_code ec) { (*h)(ec); });
        },
        asio::use_awaitable);
  }

  std::vector<std::byte> host_;
  kvlink::device_buffer device_;
  std::shared_ptr<kvlink::device_stream> stream_;  // last: stopped before the memory goes
};

// The engine's settings: the device runtime of a cache in device memory.
kvlink::config engine_config(const kv_cache& cache, const std::string& memory) {
  kvlink::config cfg{.listen = "127.0.0.1:0"};
  if (cache.on_device()) cfg.device.runtime = memory;
  return cfg;
}

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The bytes of logical block `i` of layer `layer`, tensor `kv` (0 = K, 1 = V):
// the same on both sides whatever physical block holds them.
void pattern(std::byte* out, std::uint64_t len, std::uint32_t layer, std::uint32_t kv,
             std::uint32_t i) {
  const std::uint64_t seed = mix((std::uint64_t{layer} << 40) ^ (std::uint64_t{kv} << 32) ^ i);
  for (std::uint64_t w = 0; w < len; w += 8) {
    const std::uint64_t v = mix(seed + w);
    std::memcpy(out + w, &v, std::min<std::uint64_t>(8, len - w));
  }
}

// Prefill's block table is 0, 1, 2, ...; decode's is another numbering, in
// runs of 8 with gaps (as an allocator hands them out). In a serving engine
// decode allocates these ids and its scheduler tells prefill; here both sides
// compute them from the same rule.
std::uint32_t prefill_block(std::uint32_t i) { return i; }
std::uint32_t decode_block(std::uint32_t i) { return 5 + (i / 8) * 11 + (i % 8); }

kvlink::kv_layout make_layout(const options& o, std::uint32_t blocks) {
  const auto preset = kvlink::find_model_preset(o.model);
  if (!preset) throw std::runtime_error(fmt::format("unknown model preset '{}'", o.model));
  // Room for decode's sparser numbering.
  return preset->layout(decode_block(blocks) + 1);
}

std::uint32_t block_count(const options& o, const kvlink::kv_layout& l) {
  return (o.tokens + l.block_tokens - 1) / l.block_tokens;
}

std::byte* block_addr(const kvlink::kv_local_view& v, std::uint32_t layer, std::uint32_t kv,
                      std::uint32_t block) {
  void* base = kv == 0 ? v.k[layer] : v.v[layer];
  return static_cast<std::byte*>(base) + std::uint64_t{block} * v.layout.block_stride();
}

// ------------------------------------------------------------------ decode

int run_decode(const options& o) {
  auto layout = make_layout(o, 1);
  const std::uint32_t blocks = block_count(o, layout);
  layout = make_layout(o, blocks);
  asio::io_context io;
  kv_cache cache{o.decode_memory, layout.total_bytes(), io.get_executor()};
  const auto view = kvlink::kv_local_view::contiguous(layout, cache.data());

  kvlink::tcp_engine engine{io.get_executor(), engine_config(cache, o.decode_memory)};
  engine.register_segment(cache.data(), cache.size(), kvlink::access::remote_write);
  std::printf("ADDR %s\n", engine.local_address().c_str());
  std::fflush(stdout);

  std::uint64_t verified = 0, bad = 0;
  std::optional<std::chrono::steady_clock::time_point> first;
  std::vector<std::byte> expect(layout.block_stride()), got(layout.block_stride());
  bool done = false;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        while (!done) {
          auto n = co_await engine.async_receive_notification(asio::use_awaitable);
          if (!first) first = std::chrono::steady_clock::now();
          unsigned chunk_first = 0, chunk_count = 0;
          if (std::sscanf(n.payload.c_str(), "%u %u", &chunk_first, &chunk_count) != 2) {
            ++bad;
            continue;
          }
          // The chunk's data is already here: verify block by block.
          for (std::uint32_t i = chunk_first; i < chunk_first + chunk_count; ++i) {
            for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
              for (std::uint32_t kv = 0; kv < 2; ++kv) {
                pattern(expect.data(), expect.size(), l, kv, i);
                co_await cache.copy_out(got.data(), block_addr(view, l, kv, decode_block(i)),
                                        got.size());
                if (got == expect) {
                  verified += expect.size();
                } else {
                  ++bad;
                }
              }
            }
          }
          done = n.id == "last";
        }
      },
      [&](std::exception_ptr e) {
        if (e) ++bad;
        io.stop();
      });
  io.run();
  const auto secs =
      first ? std::chrono::duration<double>(std::chrono::steady_clock::now() - *first).count() : 0;
  std::fprintf(stderr,
               "decode: verified %llu bytes (%.2f GiB) of %u blocks in %.3f s after the first "
               "chunk, %llu bad blocks\n",
               static_cast<unsigned long long>(verified),
               static_cast<double>(verified) / double(1ull << 30), blocks, secs,
               static_cast<unsigned long long>(bad));
  return bad == 0 &&
                 verified == std::uint64_t{blocks} * layout.num_layers * 2 * layout.block_stride()
             ? 0
             : 1;
}

// ------------------------------------------------------------------ prefill

int run_prefill(const options& o, const std::string& address) {
  auto layout = make_layout(o, 1);
  const std::uint32_t blocks = block_count(o, layout);
  layout = make_layout(o, blocks);
  asio::io_context io;
  kv_cache cache{o.prefill_memory, layout.total_bytes(), io.get_executor()};
  const auto view = kvlink::kv_local_view::contiguous(layout, cache.data());

  kvlink::tcp_engine engine{io.get_executor(), engine_config(cache, o.prefill_memory)};
  engine.register_segment(cache.data(), cache.size(), kvlink::access::none);

  int status = 1;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<int> {
        // The prompt's KV cache, as the forward pass would have left it.
        std::vector<std::byte> block(layout.block_stride());
        for (std::uint32_t i = 0; i < blocks; ++i) {
          for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
            for (std::uint32_t kv = 0; kv < 2; ++kv) {
              pattern(block.data(), block.size(), l, kv, i);
              co_await cache.fill(block_addr(view, l, kv, prefill_block(i)), block.data(),
                                  block.size());
            }
          }
        }
        kvlink::peer decode = co_await engine.async_connect(address, asio::use_awaitable);
        const auto remote = kvlink::kv_remote_view::contiguous(layout, decode.segment(0));
        std::uint64_t bytes = 0, requests = 0;
        const auto start = std::chrono::steady_clock::now();
        std::vector<kvlink::transfer_request> reqs;
        for (std::uint32_t first = 0; first < blocks; first += o.chunk_blocks) {
          const std::uint32_t count = std::min(o.chunk_blocks, blocks - first);
          std::vector<std::uint32_t> src, dst;
          for (std::uint32_t i = first; i < first + count; ++i) {
            src.push_back(prefill_block(i));
            dst.push_back(decode_block(i));
          }
          reqs.clear();
          std::string why;
          if (auto ec = kvlink::make_block_transfer(kvlink::opcode::write, view, remote, src, dst,
                                                    reqs, &why)) {
            throw std::system_error(ec, why);
          }
          kvlink::transfer_options opts;
          const bool last = first + count >= blocks;
          opts.notify =
              kvlink::notification{last ? "last" : "chunk", fmt::format("{} {}", first, count)};
          auto r = co_await engine.async_submit_transfer(reqs, opts, asio::use_awaitable);
          bytes += r.bytes;
          requests += reqs.size();
        }
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::fprintf(stderr,
                     "prefill: %u tokens of %s = %u blocks, %llu bytes (%.2f GiB) in %llu "
                     "requests, %.3f s, %.2f GB/s (%.2f GiB/s)\n",
                     o.tokens, o.model.c_str(), blocks, static_cast<unsigned long long>(bytes),
                     static_cast<double>(bytes) / double(1ull << 30),
                     static_cast<unsigned long long>(requests), secs,
                     static_cast<double>(bytes) / secs / 1e9,
                     static_cast<double>(bytes) / secs / double(1ull << 30));
        co_return 0;
      },
      [&](std::exception_ptr e, int rc) {
        if (e) {
          try {
            std::rethrow_exception(e);
          } catch (const std::exception& ex) {
            std::fprintf(stderr, "prefill: %s\n", ex.what());
          }
        }
        status = e ? 1 : rc;
        io.stop();
      });
  io.run();
  return status;
}

// ------------------------------------------------------------------ both

int run_both(const options& o, const char* self) {
  int out[2];
  if (pipe(out) != 0) return 1;
  const std::string tokens = std::to_string(o.tokens);
  const pid_t child = fork();
  if (child == 0) {
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    execl(self, self, "--role", "decode", "--tokens", tokens.c_str(), "--model", o.model.c_str(),
          "--decode-memory", o.decode_memory.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  std::string line;
  char c = 0;
  while (read(out[0], &c, 1) == 1 && c != '\n') line += c;
  close(out[0]);
  int prefill = 1;
  if (line.rfind("ADDR ", 0) == 0) {
    try {
      prefill = run_prefill(o, line.substr(5));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "prefill: %s\n", e.what());
    }
  } else {
    std::fprintf(stderr, "decode did not start\n");
  }
  if (prefill != 0) kill(child, SIGKILL);  // it would wait for chunks forever
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  const int decode = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 1;
  std::fprintf(stderr, "%s (prefill's KV cache in %s memory, decode's in %s memory)\n",
               prefill == 0 && decode == 0 ? "OK: every byte verified" : "FAILED",
               o.prefill_memory.c_str(), o.decode_memory.c_str());
  return prefill == 0 && decode == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--role")
      o.role = v;
    else if (k == "--tokens")
      o.tokens = static_cast<std::uint32_t>(std::stoul(v));
    else if (k == "--model")
      o.model = v;
    else if (k == "--chunk-blocks")
      o.chunk_blocks = static_cast<std::uint32_t>(std::stoul(v));
    else if (k == "--connect")
      o.connect = v;
    else if (k == "--prefill-memory")
      o.prefill_memory = v;
    else if (k == "--decode-memory")
      o.decode_memory = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (o.tokens == 0 || o.chunk_blocks == 0) return 2;
  try {
    if (o.role == "decode") return run_decode(o);
    if (o.role == "prefill") return run_prefill(o, o.connect);
    return run_both(o, "/proc/self/exe");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", o.role.c_str(), e.what());
    return 1;
  }
}
