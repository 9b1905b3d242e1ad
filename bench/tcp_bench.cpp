// kvlink_tcp_bench: WRITE and READ bandwidth of the TCP engine between two
// processes.
//
// By default (--role both) the program re-executes itself as the target
// (--role target), reads the target's address from the child's stdout, and
// drives it as the initiator. The target registers one segment and serves
// until its stdin closes (when started by the initiator) or until SIGTERM /
// SIGINT. For two machines: `--role target --listen 0.0.0.0:17001` on one,
// `--role initiator --connect host:17001` on the other.
//
// For every op x block size x batch size the initiator keeps `depth` batches
// in flight (each batch: `batch` requests of `block` bytes at distinct
// offsets, as long as they fit the segment), first for --warmup, then for
// --seconds. The figure is steady state: payload bytes of the batches that
// completed after the warm-up's last completion, up to and including the
// first completion after --seconds, divided by the time between those two
// completions. GB/s = 10^9 B/s, GiB/s = 2^30 B/s.
//
// Each process runs its io_context on one thread. Settings come from the
// KVLINK_* environment variables, then from the options below.
#include <kvlink/engine.hpp>

#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "bench_common.hpp"
#include <asio/io_context.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/signal_set.hpp>
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

using namespace std::chrono_literals;
using kvlink::bench::case_result;
using kvlink::bench::case_runner;
using kvlink::bench::child_process;
using kvlink::bench::make_buffer;
using kvlink::bench::op_name;
using kvlink::bench::split_list;

constexpr std::string_view usage_text = R"(usage: kvlink_tcp_bench [options]
  --role both|target|initiator  both (default): start the target as a child process
  --listen HOST:PORT            target's listen address (default 127.0.0.1:0)
  --connect HOST:PORT           initiator: the target to drive (role initiator)
  --sizes LIST                  block sizes (default 4KiB,64KiB,1MiB,16MiB)
  --batches LIST                requests per batch (default 1,16,64)
  --ops LIST                    write,read (default both)
  --depth N                     batches in flight (default 4)
  --seconds S                   measured time per case (default 0.5)
  --warmup S                    warm-up time per case (default 0.1)
  --segment-size SIZE           bytes registered on each side (default 1GiB)
  --layout scattered|contiguous scattered (default): remote blocks are 4 KiB apart,
                                so the planner cannot coalesce them
  --lanes N                     config.tcp.lanes
  --slice-size SIZE             config.slice_size
  --max-inflight N              config.tcp.max_inflight_per_lane
  --socket-buffer SIZE          config.tcp.socket_buffer (0 = kernel default)
  --csv                         CSV on stdout instead of the table
Sizes take KiB/MiB/GiB (2^10..) or KB/MB/GB (10^3..). Other settings: KVLINK_* variables.
)";

[[noreturn]] void die(std::string_view what) {
  fmt::print(stderr, "kvlink_tcp_bench: {}\n", what);
  std::exit(2);
}

struct options {
  std::string role = "both";
  std::string listen = "127.0.0.1:0";
  std::string connect;
  std::vector<std::uint64_t> sizes{4u << 10, 64u << 10, 1u << 20, 16u << 20};
  std::vector<std::uint64_t> batches{1, 16, 64};
  std::vector<kvlink::opcode> ops{kvlink::opcode::write, kvlink::opcode::read};
  std::uint64_t depth = 4;
  double seconds = 0.5;
  double warmup = 0.1;
  std::uint64_t segment_size = 1u << 30;
  bool scattered = true;
  bool csv = false;
  bool watch_stdin = false;  // target: stop when stdin closes (set by --role both)
  kvlink::config cfg;
  std::vector<std::string> passthrough;  // settings handed on to the child target
};

std::uint64_t parse_count(std::string_view name, std::string_view v) {
  std::uint64_t n = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), n);
  if (r.ec != std::errc{} || r.ptr != v.data() + v.size()) {
    die(fmt::format("{}: '{}' is not a non-negative integer", name, v));
  }
  return n;
}

std::uint64_t parse_bytes(std::string_view name, std::string_view v) {
  const auto n = kvlink::parse_size(v);
  if (!n) die(fmt::format("{}: '{}' is not a size ({})", name, v, kvlink::detail::size_units_help));
  return *n;
}

double parse_seconds(std::string_view name, std::string_view v) {
  char* end = nullptr;
  const std::string s{v};
  const double d = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !(d > 0.0) || d > 3600.0) {
    die(fmt::format("{}: '{}' is not a number of seconds in (0, 3600]", name, v));
  }
  return d;
}

std::uint32_t to_u32(std::string_view name, std::uint64_t n) {
  if (n == 0 || n > 0xffffffffu) die(fmt::format("{}: {} is out of range", name, n));
  return static_cast<std::uint32_t>(n);
}

options parse_options(int argc, char** argv) {
  options o;
  std::error_code ec;
  std::string what;
  o.cfg = kvlink::config_from_env(kvlink::config{}, ec, &what);
  if (ec) die(what);
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      fmt::print("{}", usage_text);
      std::exit(0);
    }
    if (a == "--csv") {
      o.csv = true;
      continue;
    }
    if (a == "--watch-stdin") {
      o.watch_stdin = true;
      continue;
    }
    if (i + 1 >= argc) die(fmt::format("{} needs a value (see --help)", a));
    const std::string_view v = argv[++i];
    const auto pass = [&] {
      o.passthrough.emplace_back(a);
      o.passthrough.emplace_back(v);
    };
    if (a == "--role") {
      if (v != "both" && v != "target" && v != "initiator")
        die("--role: both, target or initiator");
      o.role = v;
    } else if (a == "--listen") {
      o.listen = v;
    } else if (a == "--connect") {
      o.connect = v;
    } else if (a == "--sizes") {
      o.sizes.clear();
      for (auto s : split_list(v)) o.sizes.push_back(parse_bytes(a, s));
    } else if (a == "--batches") {
      o.batches.clear();
      for (auto s : split_list(v)) o.batches.push_back(to_u32(a, parse_count(a, s)));
    } else if (a == "--ops") {
      o.ops.clear();
      for (auto s : split_list(v)) {
        if (s == "write") {
          o.ops.push_back(kvlink::opcode::write);
        } else if (s == "read") {
          o.ops.push_back(kvlink::opcode::read);
        } else {
          die(fmt::format("--ops: '{}' is neither write nor read", s));
        }
      }
    } else if (a == "--depth") {
      o.depth = to_u32(a, parse_count(a, v));
    } else if (a == "--seconds") {
      o.seconds = parse_seconds(a, v);
    } else if (a == "--warmup") {
      o.warmup = parse_seconds(a, v);
    } else if (a == "--segment-size") {
      o.segment_size = parse_bytes(a, v);
      pass();
    } else if (a == "--layout") {
      if (v != "scattered" && v != "contiguous") die("--layout: scattered or contiguous");
      o.scattered = v == "scattered";
    } else if (a == "--lanes") {
      o.cfg.tcp.lanes = to_u32(a, parse_count(a, v));
      pass();
    } else if (a == "--slice-size") {
      o.cfg.slice_size = parse_bytes(a, v);
      pass();
    } else if (a == "--max-inflight") {
      o.cfg.tcp.max_inflight_per_lane = to_u32(a, parse_count(a, v));
      pass();
    } else if (a == "--socket-buffer") {
      o.cfg.tcp.socket_buffer = parse_bytes(a, v);
      pass();
    } else {
      die(fmt::format("unknown option '{}' (see --help)", a));
    }
  }
  if (o.sizes.empty() || o.batches.empty() || o.ops.empty()) die("empty --sizes/--batches/--ops");
  for (auto s : o.sizes) {
    if (s == 0 || s > o.segment_size) {
      die(fmt::format("block size {} must be in [1, segment size {}]", s, o.segment_size));
    }
  }
  if (o.role == "initiator" && o.connect.empty()) die("--role initiator needs --connect HOST:PORT");
  // Keep the planner's rules satisfied when only the slice size was given:
  // a small slice lowers min_chunk, a large one raises the frame bound (both
  // sides get the same options, so the target accepts what we send).
  o.cfg.min_chunk = std::min(o.cfg.min_chunk, o.cfg.slice_size);
  o.cfg.tcp.max_frame_payload =
      std::max(o.cfg.tcp.max_frame_payload, o.cfg.slice_size + o.cfg.min_chunk);
  o.cfg.transfer_deadline = 0ms;  // a 1 GiB batch on a slow box must not time out
  if (o.role != "initiator") o.cfg.listen = o.listen;
  if (auto vec = kvlink::validate(o.cfg, &what)) die("invalid settings: " + what);
  return o;
}

// ------------------------------------------------------------------ target

int run_target(const options& o) {
  kvlink::bench::bench_io bio{1};
  auto mem = make_buffer(o.segment_size);
  kvlink::tcp_engine eng{bio.engine_io().get_executor(), o.cfg};
  eng.register_segment(mem.data(), mem.size(), kvlink::access::remote_read_write);
  kvlink::bench::serve_target(bio, eng, o.segment_size, o.watch_stdin);
  return 0;
}

// ------------------------------------------------------------------ initiator

void print_table(const options& o, const std::vector<case_result>& rows) {
  fmt::print(
      "# kvlink TCP engine, 2 processes; lanes={} slice_size={} max_inflight_per_lane={} "
      "socket_buffer={} depth={} layout={}\n",
      o.cfg.tcp.lanes, kvlink::format_size(o.cfg.slice_size), o.cfg.tcp.max_inflight_per_lane,
      o.cfg.tcp.socket_buffer == 0 ? std::string{"kernel default"}
                                   : kvlink::format_size(o.cfg.tcp.socket_buffer),
      o.depth, o.scattered ? "scattered" : "contiguous");
  fmt::print("{:<6} {:>8} {:>6} {:>6} {:>9} {:>9} {:>11} {:>8} {:>13}\n", "op", "block", "batch",
             "depth", "GB/s", "GiB/s", "req/s", "batches", "lat/batch us");
  for (const auto& r : rows) {
    const double reqs = r.seconds > 0 ? static_cast<double>(r.batches * r.batch) / r.seconds : 0;
    if (r.error) {
      fmt::print("{:<6} {:>8} {:>6} {:>6} error: {}\n", op_name(r.op), kvlink::format_size(r.block),
                 r.batch, r.depth, r.error.message());
      continue;
    }
    fmt::print("{:<6} {:>8} {:>6} {:>6} {:>9.2f} {:>9.2f} {:>11.0f} {:>8} {:>13.1f}\n",
               op_name(r.op), kvlink::format_size(r.block), r.batch, r.depth, r.gb_per_s(),
               r.gib_per_s(), reqs, r.batches, r.mean_latency_us);
  }
}

void print_csv(const options& o, const std::vector<case_result>& rows) {
  fmt::print(
      "op,block_bytes,batch,depth,lanes,slice_size,max_inflight_per_lane,socket_buffer,bytes,"
      "seconds,gb_per_s,gib_per_s,batches,mean_batch_latency_us,error\n");
  for (const auto& r : rows) {
    fmt::print("{},{},{},{},{},{},{},{},{},{:.6f},{:.4f},{:.4f},{},{:.1f},{}\n", op_name(r.op),
               r.block, r.batch, r.depth, o.cfg.tcp.lanes, o.cfg.slice_size,
               o.cfg.tcp.max_inflight_per_lane, o.cfg.tcp.socket_buffer, r.bytes, r.seconds,
               r.gb_per_s(), r.gib_per_s(), r.batches, r.mean_latency_us,
               r.error ? r.error.message() : std::string{});
  }
}

int run_initiator(const options& o, const std::string& address) {
  kvlink::bench::bench_io bio{1};
  asio::io_context& io = bio.engine_io();
  auto mem = make_buffer(o.segment_size);
  kvlink::config cfg = o.cfg;
  cfg.listen = "127.0.0.1:0";  // the initiator's own listener is not used
  kvlink::tcp_engine eng{io.get_executor(), cfg};
  eng.register_segment(mem.data(), mem.size(), kvlink::access::remote_read_write);

  std::optional<std::pair<std::error_code, kvlink::peer>> conn;
  eng.async_connect(address, [&](std::error_code ec, kvlink::peer p) { conn.emplace(ec, p); });
  while (!conn) io.run_one();
  if (conn->first) die(fmt::format("connect({}): {}", address, conn->first.message()));
  const kvlink::peer peer = conn->second;
  const auto segs = peer.segments();
  if (segs.empty()) die("the target registered no segment");
  const std::uint64_t remote_size = segs.front().length;
  fmt::print(stderr, "initiator: connected to {} ({} lanes), remote segment {}\n", address,
             o.cfg.tcp.lanes, kvlink::format_size(remote_size));

  std::vector<case_result> rows;
  int rc = 0;
  for (auto op : o.ops) {
    for (auto block : o.sizes) {
      if (block > remote_size) die("block size exceeds the target's segment");
      for (auto batch : o.batches) {
        case_result r;
        r.op = op;
        r.block = block;
        r.batch = batch;
        r.depth = o.depth;
        fmt::print(stderr, "  {:<5} {:>8} x {:<3} depth {} ...", op_name(op),
                   kvlink::format_size(block), batch, o.depth);
        std::fflush(stderr);
        const kvlink::bench::case_timing timing{std::chrono::duration<double>(o.warmup),
                                                std::chrono::duration<double>(o.seconds),
                                                o.scattered};
        case_runner runner{bio, eng, peer, mem.data(), mem.size(), remote_size, timing, r};
        if (!kvlink::bench::run_and_report(runner, r)) rc = 1;
        rows.push_back(r);
      }
    }
  }
  if (o.csv) {
    print_csv(o, rows);
  } else {
    print_table(o, rows);
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse_options(argc, argv);
    if (o.role == "target") return run_target(o);
    if (o.role == "initiator") return run_initiator(o, o.connect);
    child_process child;
    std::vector<std::string> args{"--role", "target", "--listen", o.listen, "--watch-stdin"};
    args.insert(args.end(), o.passthrough.begin(), o.passthrough.end());
    kvlink::bench::spawn_target(args, child);
    return run_initiator(o, child.address);
  } catch (const std::exception& e) {
    fmt::print(stderr, "kvlink_tcp_bench: {}\n", e.what());
    return 1;
  }
}
