"""vLLM's MooncakeStoreConnector pattern over kvlink's store, through the
`mooncake.store` API.

vLLM keeps a paged KV cache per layer (K and V); the store holds one
object per block: that block's K and V pieces of every layer, gathered.
Two processes, as two vLLM instances sharing one pool:
  prefill  mounts 64 MiB into the pool (embedded mode), registers its KV
           cache, asks batch_is_exist which blocks of the prompt are stored,
           and puts the missing ones with batch_put_from_multi_buffers;
  decode   (this process, a pure requester) looks the prompt's blocks up
           with batch_is_exist (the prefix hit), loads them into *other*
           block ids of its own cache with batch_get_into_multi_buffers,
           and checks every byte.

This example starts a kvlink-master, the program named by KVLINK_MASTER
(build/py/tools/kvlink-master after a build); without KVLINK_MASTER it says
so and exits 0 ("skipped"):

    KVLINK_MASTER=build/py/tools/kvlink-master PYTHONPATH=build/py/python/site \\
        /usr/bin/python3 examples/python/vllm_store_pattern.py [--memory host|emulated|cuda]

`--memory cuda` keeps both KV caches on GPU 0 (torch CUDA tensors), as vLLM
does, and registers them by address; `--memory emulated` uses kvlink's
emulated device (kvlink.DeviceBuffer: memory the CPU cannot touch, no GPU
needed); host (numpy) by default. The pool itself is host memory.

`from mooncake.store import MooncakeDistributedStore` is what vLLM writes:
with kvlink's alias installed (README, "Python") it is kvlink; here it falls
back to kvlink.mooncake_store, the same class.
"""

import argparse
import multiprocessing as mp
import os
import re
import select
import subprocess
import sys

import numpy as np

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError:
    from kvlink.mooncake_store import MooncakeDistributedStore

LAYERS = 8            # one K and one V cache per layer, as vLLM registers them
BLOCKS = 64           # blocks per cache
PIECE = 16384         # one block of one layer's K (or V): block_size tokens
PROMPT_BLOCKS = 24    # blocks of the request's prompt
WAIT = 60             # seconds any step may take before the example fails


def block_keys(model: str, n: int) -> list:
    return [f"{model}@tp_rank:0@pp_rank:0@{b:016x}" for b in range(n)]


class PagedKv:
    """One registered cache [layer][k|v][block][PIECE] (host, emulated device
    or CUDA memory) and the addresses of one block's pieces, in the order the
    object holds them."""

    def __init__(self, store: MooncakeDistributedStore, memory: str) -> None:
        self.memory = memory
        shape = (LAYERS, 2, BLOCKS, PIECE)
        nbytes = LAYERS * 2 * BLOCKS * PIECE
        if memory == "host":
            self.a = np.zeros(shape, np.uint8)
            self.base = self.a.ctypes.data
        elif memory == "cuda":
            import torch
            self.t = torch.zeros(shape, dtype=torch.uint8, device="cuda:0")
            self.base = self.t.data_ptr()
        else:
            import kvlink
            self.dev = kvlink.DeviceBuffer(nbytes, runtime=memory)
            self.base = self.dev.ptr
        if store.register_buffer(self.base, nbytes) != 0:
            raise SystemExit("register_buffer failed")

    def offset(self, layer: int, kv: int, block: int) -> int:
        return ((layer * 2 + kv) * BLOCKS + block) * PIECE

    def ptrs(self, block: int) -> list:
        return [self.base + self.offset(layer, kv, block)
                for layer in range(LAYERS) for kv in range(2)]

    def write_block(self, block: int, data: np.ndarray) -> None:
        if self.memory == "host":
            self.a[:, :, block, :] = data
        elif self.memory == "cuda":
            import torch
            self.t[:, :, block, :] = torch.from_numpy(data).cuda()
            torch.cuda.synchronize()
        else:
            for layer in range(LAYERS):
                for kv in range(2):
                    self.dev.write(self.offset(layer, kv, block), data[layer, kv].tobytes())

    def read_block(self, block: int) -> np.ndarray:
        if self.memory == "host":
            return self.a[:, :, block, :]
        if self.memory == "cuda":
            import torch
            torch.cuda.synchronize()
            return self.t[:, :, block, :].cpu().numpy()
        return np.stack([np.stack([np.frombuffer(self.dev.read(self.offset(layer, kv, block),
                                                               PIECE), np.uint8)
                                   for kv in range(2)]) for layer in range(LAYERS)])


def computed(block: int) -> np.ndarray:
    """What prefill computed for one prompt block: a pattern decode recomputes."""
    return np.random.default_rng(block).integers(0, 256, (LAYERS, 2, PIECE), dtype=np.uint8)


def prefill(master: str, memory: str, conn) -> None:
    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master) != 0:
        conn.send("setup failed")
        return
    kv = PagedKv(store, memory)
    for b in range(PROMPT_BLOCKS):
        kv.write_block(b, computed(b))
    keys = block_keys("demo-model", PROMPT_BLOCKS)
    # vLLM puts only what the pool lacks (another instance may have stored it).
    missing = [i for i, there in enumerate(store.batch_is_exist(keys)) if there != 1]
    codes = store.batch_put_from_multi_buffers(
        [keys[i] for i in missing], [kv.ptrs(i) for i in missing],
        [[PIECE] * (LAYERS * 2)] * len(missing))
    conn.send(("stored", len(missing), codes))
    # The pool's bytes live in this process: stay until decode has read them.
    if conn.poll(WAIT):
        conn.recv()
    store.close()


def start_master(path: str):
    proc = subprocess.Popen([path, "--listen", "127.0.0.1:0", "--threads", "2"],
                            stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], WAIT)
    line = proc.stdout.readline() if ready else ""
    m = re.match(r"kvlink-master: listening on (\S+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"kvlink-master did not start (its first line: {line!r})")
    return proc, m.group(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", choices=["host", "emulated", "cuda"], default="host",
                    help="where both KV caches live")
    memory = ap.parse_args().memory
    if memory == "emulated":
        os.environ["KVLINK_DEVICE"] = "emulated"  # the stores' engines (and prefill's)
    path = os.environ.get("KVLINK_MASTER")
    if not path:
        print("vllm_store_pattern: skipped: set KVLINK_MASTER to the kvlink-master program")
        return 0
    master_proc, master = start_master(path)
    ours, theirs = mp.Pipe()
    worker = mp.get_context("spawn").Process(target=prefill, args=(master, memory, theirs))
    worker.start()
    try:
        if not ours.poll(WAIT):
            raise SystemExit("prefill did not answer")
        msg = ours.recv()
        if msg[0] != "stored" or any(c != 0 for c in msg[2]):
            raise SystemExit(f"prefill: {msg}")
        print(f"prefill: {msg[1]} blocks put, each {LAYERS * 2} pieces gathered into one object")

        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
            raise SystemExit("decode: setup failed")
        kv = PagedKv(store, memory)
        # The scheduler's lookup: the prompt's blocks and then some it never had.
        keys = block_keys("demo-model", PROMPT_BLOCKS + 8)
        there = store.batch_is_exist(keys)
        hit = next((i for i, t in enumerate(there) if t != 1), len(keys))
        print(f"decode: prefix hit {hit} of {len(keys)} blocks")
        # Load block b into block id BLOCKS - 1 - b of this cache.
        dst = [BLOCKS - 1 - b for b in range(hit)]
        got = store.batch_get_into_multi_buffers(keys[:hit], [kv.ptrs(d) for d in dst],
                                                 [[PIECE] * (LAYERS * 2)] * hit)
        if got != [LAYERS * 2 * PIECE] * hit:
            raise SystemExit(f"decode: batch_get_into_multi_buffers gave {got}")
        bad = [b for b, d in enumerate(dst) if not np.array_equal(kv.read_block(d), computed(b))]
        store.close()
        if bad or hit != PROMPT_BLOCKS:
            raise SystemExit(f"decode: blocks {bad} differ (hit {hit})")
        print(f"decode: {hit} blocks loaded into other block ids ({memory} memory), every byte "
              "as prefill wrote it")
        return 0
    finally:
        ours.send("done")
        worker.join(WAIT)
        if worker.is_alive():
            worker.kill()
        master_proc.terminate()
        master_proc.wait(WAIT)


if __name__ == "__main__":
    sys.exit(main())
