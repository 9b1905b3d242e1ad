// The two candidate one-copy paths between processes on one host, against a
// single-core memcpy of the same sizes, in one run (issue: same-host
// transfers; shm/transport.hpp says which was chosen and why):
//
//  - memcpy:        private buffer -> private buffer (the reference);
//  - memfd_put:     private buffer -> a MAP_SHARED memfd mapping that a
//                   child process also maps (what a shared-segment
//                   transport costs per WRITE: the registered memory
//                   must live in such segments);
//  - cma_write:     process_vm_writev into a child process's private
//                   memory (cross-memory attach: what kvlink's shm does);
//  - cma_read:      process_vm_readv from it;
//  - *_pieces:      the same bytes as 4 KiB pieces whose destinations (or
//                   sources, for cma_read) lie 8 KiB apart, so nothing is
//                   contiguous (tensor parallelism's case, issue 25):
//                   memcpy piece by piece, and cross-memory attach with as
//                   many pieces per call as the kernel takes (IOV_MAX),
//                   which is what kvlink's shm lanes do. Their ratio is
//                   the kernel's own price of a scattered piece.
//
// Sizes 64 KiB .. 256 MiB; the destination is touched first (no page
// faults in the timing). Bytes/s in the output: Google Benchmark's
// "bytes_per_second" (printed in binary units, e.g. 9.1G/s = 9.1 GiB/s).
//   <build>/bench/kvlink_same_host_bench --benchmark_min_time=0.5
#include <algorithm>
#include <climits>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <benchmark/benchmark.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

constexpr std::size_t max_size = 256u << 20;

// A child process that holds `max_size` bytes of private memory at the same
// address as ours (it is forked after the buffer was made and touched) and
// waits to be killed: the other end of the cross-memory copies.
struct child_process {
  std::vector<std::byte> remote;  // the child's copy lives at remote.data()
  std::byte* shared = nullptr;    // a memfd mapping both processes share
  pid_t pid = -1;

  child_process() : remote(max_size, std::byte{1}) {
    const int fd = ::memfd_create("kvlink-bench", MFD_CLOEXEC);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(max_size)) != 0) {
      throw std::runtime_error("memfd_create");
    }
    void* m = ::mmap(nullptr, max_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) throw std::runtime_error("mmap");
    shared = static_cast<std::byte*>(m);
    std::memset(shared, 1, max_size);
    pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      // Its own copy of every page (copy-on-write undone), then wait.
      std::memset(remote.data(), 2, remote.size());
      for (;;) ::pause();
    }
    // The child's pages must be its own before the first copy is timed:
    // give it the time to write them.
    ::usleep(500000);
  }
  ~child_process() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    ::munmap(shared, max_size);
  }
};

child_process& child() {
  static child_process c;
  return c;
}

std::vector<std::byte>& source() {
  static std::vector<std::byte> s(max_size, std::byte{3});
  return s;
}

void bm_memcpy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  static std::vector<std::byte> dst(max_size, std::byte{4});
  for (auto _ : state) {
    std::memcpy(dst.data(), source().data(), n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

void bm_memfd_put(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  auto& c = child();
  for (auto _ : state) {
    std::memcpy(c.shared, source().data(), n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

void cma(benchmark::State& state, bool write) {
  const auto n = static_cast<std::size_t>(state.range(0));
  auto& c = child();
  iovec local{source().data(), n};
  iovec remote{c.remote.data(), n};
  for (auto _ : state) {
    const ssize_t got = write ? ::process_vm_writev(c.pid, &local, 1, &remote, 1, 0)
                              : ::process_vm_readv(c.pid, &local, 1, &remote, 1, 0);
    if (got != static_cast<ssize_t>(n)) {
      state.SkipWithError("process_vm_*: refused or partial (ptrace permission?)");
      break;
    }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

void bm_cma_write(benchmark::State& state) { cma(state, true); }
void bm_cma_read(benchmark::State& state) { cma(state, false); }

constexpr std::size_t piece = 4096;

void bm_memcpy_pieces(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  static std::vector<std::byte> dst(max_size, std::byte{4});
  for (auto _ : state) {
    for (std::size_t i = 0; i < n / piece; ++i) {
      std::memcpy(dst.data() + 2 * i * piece, source().data() + i * piece, piece);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

void cma_pieces(benchmark::State& state, bool write) {
  const auto n = static_cast<std::size_t>(state.range(0));
  auto& c = child();
  std::vector<iovec> local(n / piece), remote(n / piece);
  for (std::size_t i = 0; i < n / piece; ++i) {
    local[i] = iovec{source().data() + i * piece, piece};
    remote[i] = iovec{c.remote.data() + 2 * i * piece, piece};
  }
  const auto per_call = static_cast<std::size_t>(IOV_MAX);
  for (auto _ : state) {
    for (std::size_t i = 0; i < local.size(); i += per_call) {
      const auto k = std::min(per_call, local.size() - i);
      const ssize_t got = write ? ::process_vm_writev(c.pid, &local[i], k, &remote[i], k, 0)
                                : ::process_vm_readv(c.pid, &local[i], k, &remote[i], k, 0);
      if (got != static_cast<ssize_t>(k * piece)) {
        state.SkipWithError("process_vm_*: refused or partial (ptrace permission?)");
        return;
      }
    }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

void bm_cma_write_pieces(benchmark::State& state) { cma_pieces(state, true); }
void bm_cma_read_pieces(benchmark::State& state) { cma_pieces(state, false); }

void sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t s = 64 << 10; s <= static_cast<std::int64_t>(max_size); s *= 4) b->Arg(s);
}

BENCHMARK(bm_memcpy)->Apply(sizes);
BENCHMARK(bm_memfd_put)->Apply(sizes);
BENCHMARK(bm_cma_write)->Apply(sizes);
BENCHMARK(bm_cma_read)->Apply(sizes);
// Scattered pieces take twice their bytes of destination: up to half the buffers.
BENCHMARK(bm_memcpy_pieces)->Arg(1 << 20)->Arg(16 << 20)->Arg(64 << 20);
BENCHMARK(bm_cma_write_pieces)->Arg(1 << 20)->Arg(16 << 20)->Arg(64 << 20);
BENCHMARK(bm_cma_read_pieces)->Arg(1 << 20)->Arg(16 << 20)->Arg(64 << 20);

}  // namespace

BENCHMARK_MAIN();
