/* ucx_pieces: UCX's one-sided puts and gets of the pieces kvlink-bench sweep
 * moves, for bench/compare_same_host.
 *
 * ucx_perftest's ucp_put_bw and ucp_get move one message of the size to and
 * from one buffer per side, over and over, with no completion until the end:
 * stores into memory the cache already holds. A kvlink transfer completes only
 * once its bytes are in place at the peer, and a batch of tensor
 * parallelism's pieces goes to distinct places. This program moves what a
 * `kvlink-bench sweep --layout scattered --sizes S --batches B --depth D` case
 * moves: batches of B pieces of S bytes, each from its own block of the local
 * buffer to its own block of the peer's (S + 4 KiB apart), D x B blocks in
 * turn, and ends each batch with ucp_worker_flush (every put or get of it
 * complete at the peer), the completion a kvlink transfer has. The peer is a
 * second process (fork) on this host: UCX_TLS=sm,self as in the script.
 * MEMORY says how the peer's buffer is made, as kvlink-bench's --memory:
 * private (mmap, then ucp_mem_map: UCX reaches it by cross-memory attach or
 * through its own copies) or shared (ucp_mem_map allocates it, as
 * ucx_perftest does: shared memory UCX maps in the initiator, where a put is
 * a store).
 *
 *   ucx_pieces put|get private|shared SIZE BATCH DEPTH SECONDS
 *
 * Prints one line: "<op> <memory> <size> <batch> <GB/s>" (GB = 10^9 B), after a warm-up
 * of a tenth of SECONDS. Exit status 1 with a message on stderr when UCX fails.
 * Built by bench/compare_same_host when Debian's libucx-dev is there:
 *   cc -O2 bench/ucx_pieces.c -o ucx_pieces $(pkg-config --cflags --libs ucx)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

static void die(const char* what, ucs_status_t st) {
  fprintf(stderr, "ucx_pieces: %s: %s\n", what, ucs_status_string(st));
  exit(1);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Length-prefixed messages over the socket pair. */
static void send_blob(int fd, const void* p, uint64_t n) {
  if (write(fd, &n, sizeof n) != (ssize_t)sizeof n || (n && write(fd, p, n) != (ssize_t)n)) {
    perror("ucx_pieces: write");
    exit(1);
  }
}

static void* recv_blob(int fd, uint64_t* n) {
  if (read(fd, n, sizeof *n) != (ssize_t)sizeof *n) {
    perror("ucx_pieces: read");
    exit(1);
  }
  char* p = malloc(*n ? *n : 1);
  for (uint64_t got = 0; got < *n;) {
    const ssize_t r = read(fd, p + got, *n - got);
    if (r <= 0) {
      perror("ucx_pieces: read");
      exit(1);
    }
    got += (uint64_t)r;
  }
  return p;
}

static void setup(ucp_context_h* ctx, ucp_worker_h* worker) {
  ucp_params_t params;
  memset(&params, 0, sizeof params);
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  ucs_status_t st = ucp_init(&params, NULL, ctx);
  if (st != UCS_OK) die("ucp_init", st);
  ucp_worker_params_t wp;
  memset(&wp, 0, sizeof wp);
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(*ctx, &wp, worker);
  if (st != UCS_OK) die("ucp_worker_create", st);
}

static void wait_request(ucp_worker_h worker, void* req, const char* what) {
  if (req == NULL) return;
  if (UCS_PTR_IS_ERR(req)) die(what, UCS_PTR_STATUS(req));
  ucs_status_t st;
  while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS) ucp_worker_progress(worker);
  ucp_request_free(req);
  if (st != UCS_OK) die(what, st);
}

static void flush(ucp_worker_h worker) {
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  wait_request(worker, ucp_worker_flush_nbx(worker, &p), "ucp_worker_flush_nbx");
}

/* The peer: its buffer mapped and described, then progress until told. */
static int target(int fd, uint64_t bytes, int shared) {
  ucp_context_h ctx;
  ucp_worker_h worker;
  setup(&ctx, &worker);
  void* buf = NULL;
  if (!shared) {
    buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) {
      perror("ucx_pieces: mmap");
      return 1;
    }
  }
  ucp_mem_map_params_t mp;
  memset(&mp, 0, sizeof mp);
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = buf;
  mp.length = bytes;
  mp.flags = shared ? UCP_MEM_MAP_ALLOCATE : 0;
  ucp_mem_h memh;
  ucs_status_t st = ucp_mem_map(ctx, &mp, &memh);
  if (st != UCS_OK) die("ucp_mem_map", st);
  if (shared) {
    ucp_mem_attr_t attr;
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    st = ucp_mem_query(memh, &attr);
    if (st != UCS_OK) die("ucp_mem_query", st);
    buf = attr.address;
  }
  memset(buf, 1, bytes);
  void* rkey;
  size_t rkey_len;
  st = ucp_rkey_pack(ctx, memh, &rkey, &rkey_len);
  if (st != UCS_OK) die("ucp_rkey_pack", st);
  ucp_address_t* addr;
  size_t addr_len;
  st = ucp_worker_get_address(worker, &addr, &addr_len);
  if (st != UCS_OK) die("ucp_worker_get_address", st);
  uint64_t base = (uint64_t)(uintptr_t)buf;
  send_blob(fd, addr, addr_len);
  send_blob(fd, rkey, rkey_len);
  send_blob(fd, &base, sizeof base);
  /* Progress (software-emulated RMA needs it) until the initiator is done. */
  for (;;) {
    ucp_worker_progress(worker);
    char c;
    const ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT);
    if (r == 1 || r == 0) break;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) break;
  }
  ucp_worker_release_address(worker, addr);
  ucp_rkey_buffer_release(rkey);
  ucp_mem_unmap(ctx, memh);
  ucp_worker_destroy(worker);
  ucp_cleanup(ctx);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 7 || (strcmp(argv[1], "put") != 0 && strcmp(argv[1], "get") != 0) ||
      (strcmp(argv[2], "private") != 0 && strcmp(argv[2], "shared") != 0)) {
    fprintf(stderr, "usage: ucx_pieces put|get private|shared SIZE BATCH DEPTH SECONDS\n");
    return 2;
  }
  const int put = strcmp(argv[1], "put") == 0;
  const int shared = strcmp(argv[2], "shared") == 0;
  const uint64_t size = strtoull(argv[3], NULL, 10);
  const uint64_t batch = strtoull(argv[4], NULL, 10);
  const uint64_t depth = strtoull(argv[5], NULL, 10);
  const double seconds = strtod(argv[6], NULL);
  if (size == 0 || batch == 0 || depth == 0 || !(seconds > 0)) {
    fprintf(stderr, "ucx_pieces: SIZE, BATCH, DEPTH and SECONDS must be positive\n");
    return 2;
  }
  const uint64_t slots = batch * depth;
  const uint64_t stride = size + 4096; /* kvlink-bench sweep --layout scattered */
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    perror("ucx_pieces: socketpair");
    return 1;
  }
  const pid_t child = fork();
  if (child < 0) {
    perror("ucx_pieces: fork");
    return 1;
  }
  if (child == 0) {
    close(sv[0]);
    _exit(target(sv[1], slots * stride, shared));
  }
  close(sv[1]);
  ucp_context_h ctx;
  ucp_worker_h worker;
  setup(&ctx, &worker);
  uint64_t n;
  void* peer_addr = recv_blob(sv[0], &n);
  void* rkey_buf = recv_blob(sv[0], &n);
  uint64_t* base = recv_blob(sv[0], &n);
  ucp_ep_params_t ep_params;
  memset(&ep_params, 0, sizeof ep_params);
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  ep_params.address = peer_addr;
  ucp_ep_h ep;
  ucs_status_t st = ucp_ep_create(worker, &ep_params, &ep);
  if (st != UCS_OK) die("ucp_ep_create", st);
  ucp_rkey_h rkey;
  st = ucp_ep_rkey_unpack(ep, rkey_buf, &rkey);
  if (st != UCS_OK) die("ucp_ep_rkey_unpack", st);
  /* The local pieces back to back, as kvlink-bench's blocks. */
  char* local = mmap(NULL, slots * size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (local == MAP_FAILED) {
    perror("ucx_pieces: mmap");
    return 1;
  }
  memset(local, 2, slots * size);
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  uint64_t slot = 0, bytes = 0;
  double t0 = now_s(), start = 0;
  const double warmup = seconds / 10;
  int measuring = 0;
  for (;;) {
    for (uint64_t i = 0; i < batch; ++i) {
      void* req = put ? ucp_put_nbx(ep, local + slot * size, size, *base + slot * stride, rkey, &p)
                      : ucp_get_nbx(ep, local + slot * size, size, *base + slot * stride, rkey, &p);
      if (UCS_PTR_IS_ERR(req)) die(put ? "ucp_put_nbx" : "ucp_get_nbx", UCS_PTR_STATUS(req));
      if (req != NULL) ucp_request_free(req); /* completed by the flush below */
      slot = (slot + 1) % slots;
    }
    flush(worker);
    const double t = now_s();
    if (!measuring) {
      if (t - t0 >= warmup) {
        measuring = 1;
        start = t;
      }
      continue;
    }
    bytes += batch * size;
    if (t - start >= seconds) {
      printf("%s %s %llu %llu %.4f\n", argv[1], argv[2], (unsigned long long)size,
             (unsigned long long)batch, (double)bytes / (t - start) / 1e9);
      break;
    }
  }
  ucp_rkey_destroy(rkey);
  ucp_request_param_t cp;
  memset(&cp, 0, sizeof cp);
  wait_request(worker, ucp_ep_close_nbx(ep, &cp), "ucp_ep_close_nbx");
  if (write(sv[0], "x", 1) != 1) perror("ucx_pieces: write");
  int status = 0;
  waitpid(child, &status, 0);
  ucp_worker_destroy(worker);
  ucp_cleanup(ctx);
  free(peer_addr);
  free(rkey_buf);
  free(base);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
