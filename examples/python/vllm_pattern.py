"""vLLM's disaggregated-prefill pattern over the Mooncake API, on kvlink.

Two processes, as vLLM's MooncakeConnector runs them:
  decode   registers its paged KV cache (one buffer per layer), picks free
           blocks for a request and announces their addresses over a side
           channel (vLLM uses ZMQ; a multiprocessing pipe here);
  prefill  registers its KV cache, and pushes the prompt's blocks into the
           announced ones with batch_transfer_sync_write from a thread pool
           (one batch per layer), then says "done" over the side channel;
  decode   checks every byte of every block.

    PYTHONPATH=build/py/python/site /usr/bin/python3 examples/python/vllm_pattern.py

With `--memory emulated` both KV caches are device memory, as vLLM's are on
GPUs: one kvlink.DeviceBuffer per layer on the emulated device (memory the
CPU cannot touch, reached through its copy engine; KVLINK_DEVICE=emulated),
registered with Mooncake's "cuda:0" location, filled and checked through
the copy engine. With `--memory cuda` they are torch CUDA tensors on GPU 0,
registered by data_ptr() as vLLM does (needs torch and a kvlink built with
kvlink::cuda).

`from mooncake.engine import TransferEngine` is what vLLM writes: with
kvlink's alias installed (README, "Python") it is kvlink; here it falls back
to kvlink.mooncake, the same class.
"""

import argparse
import multiprocessing as mp
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:
    from mooncake.engine import TransferEngine
except ImportError:
    from kvlink.mooncake import TransferEngine

LAYERS = 8           # per-layer KV caches, as vLLM registers them
BLOCKS = 256         # blocks per layer's cache
BLOCK_BYTES = 32768  # one block of K and V for block_size tokens
PROMPT_BLOCKS = 96   # blocks of the request's prompt


def kv_block(layer: int, block: int) -> np.ndarray:
    """What prefill computed for (layer, block): a pattern decode can recompute."""
    return np.random.default_rng(layer * 100003 + block).integers(0, 256, BLOCK_BYTES,
                                                                  dtype=np.uint8)


class KVCache:
    """One process's paged KV cache: a buffer per layer, in host memory
    (numpy), GPU memory (torch CUDA tensors) or device memory of the
    emulated device (kvlink.DeviceBuffer)."""

    def __init__(self, memory: str) -> None:
        self.memory = memory
        layer_bytes = BLOCKS * BLOCK_BYTES
        if memory == "host":
            self.host = np.zeros((LAYERS, BLOCKS, BLOCK_BYTES), np.uint8)
            self.bases = [self.host[layer].ctypes.data for layer in range(LAYERS)]
        elif memory == "cuda":
            import torch
            self.gpu = torch.zeros((LAYERS, BLOCKS, BLOCK_BYTES), dtype=torch.uint8,
                                   device="cuda:0")
            self.bases = [self.gpu[layer].data_ptr() for layer in range(LAYERS)]
        else:
            import kvlink
            self.dev = [kvlink.DeviceBuffer(layer_bytes, runtime=memory) for _ in range(LAYERS)]
            self.bases = [d.ptr for d in self.dev]
        self.location = "*" if memory == "host" else "cuda:0"
        self.layer_bytes = layer_bytes

    def write_block(self, layer: int, block: int, data: np.ndarray) -> None:
        if self.memory == "host":
            self.host[layer, block] = data
        elif self.memory == "cuda":
            import torch
            self.gpu[layer, block].copy_(torch.from_numpy(data))
            torch.cuda.synchronize()
        else:  # through the device's copy engine, as a kernel's output would land
            self.dev[layer].write(block * BLOCK_BYTES, data.tobytes())

    def read_block(self, layer: int, block: int) -> np.ndarray:
        if self.memory == "host":
            return self.host[layer, block]
        if self.memory == "cuda":
            return self.gpu[layer, block].cpu().numpy()
        return np.frombuffer(self.dev[layer].read(block * BLOCK_BYTES, BLOCK_BYTES), np.uint8)


def make_engine(kv: KVCache) -> TransferEngine:
    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert eng.batch_register_memory(kv.bases, [kv.layer_bytes] * LAYERS, kv.location) == 0
    return eng


def decode(pipe, memory: str) -> None:
    kv = KVCache(memory)
    eng = make_engine(kv)
    # Free blocks, in no particular order, as a block manager hands them out.
    block_ids = np.random.default_rng(7).permutation(BLOCKS)[:PROMPT_BLOCKS].tolist()
    pipe.send({"request_id": "req-0",
               "session": f"127.0.0.1:{eng.get_rpc_port()}",
               "layer_bases": kv.bases,
               "block_ids": block_ids})
    assert pipe.recv() == ("done", "req-0")
    bad = [(layer, i) for layer in range(LAYERS) for i, b in enumerate(block_ids)
           if not np.array_equal(kv.read_block(layer, b), kv_block(layer, i))]
    pipe.send(("checked", len(bad)))
    eng.batch_unregister_memory(kv.bases)


def prefill(pipe, memory: str) -> int:
    kv = KVCache(memory)
    for layer in range(LAYERS):  # the prompt occupies blocks 0..PROMPT_BLOCKS-1 here
        for i in range(PROMPT_BLOCKS):
            kv.write_block(layer, i, kv_block(layer, i))
    eng = make_engine(kv)
    meta = pipe.recv()

    def push(layer: int) -> int:
        src = [kv.bases[layer] + i * BLOCK_BYTES for i in range(PROMPT_BLOCKS)]
        dst = [meta["layer_bases"][layer] + b * BLOCK_BYTES for b in meta["block_ids"]]
        return eng.batch_transfer_sync_write(meta["session"], src, dst,
                                             [BLOCK_BYTES] * PROMPT_BLOCKS)

    with ThreadPoolExecutor(max_workers=10) as pool:  # vLLM's transfer threads
        results = list(pool.map(push, range(LAYERS)))
    pipe.send(("done", meta["request_id"]))
    _, bad = pipe.recv()
    total = LAYERS * PROMPT_BLOCKS * BLOCK_BYTES
    print(f"prefill -> decode: {LAYERS} layers x {PROMPT_BLOCKS} blocks of {BLOCK_BYTES} B "
          f"({total / 1e6:.1f} MB, {memory} memory on both sides) with "
          f"{TransferEngine.__module__}.TransferEngine; "
          f"results {set(results)}, blocks with wrong bytes: {bad}")
    return 0 if results == [0] * LAYERS and bad == 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", choices=["host", "emulated", "cuda"], default="host",
                    help="where both KV caches live (cuda: torch tensors on GPU 0; emulated: "
                         "device memory, no GPU needed)")
    args = ap.parse_args()
    if args.memory != "host":
        os.environ["KVLINK_DEVICE"] = args.memory  # both engines' device runtime
    ctx = mp.get_context("spawn")  # a fresh interpreter, as vLLM's workers are
    here, there = ctx.Pipe()
    child = ctx.Process(target=decode, args=(there, args.memory))
    child.start()
    try:
        rc = prefill(here, args.memory)
    finally:
        child.join(60)
    return rc if child.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
