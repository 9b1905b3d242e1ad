"""The store with device memory: objects put from and got into device
memory against host memory, through this client's own segment (copies on
the device's stream) and through another client's segment (the engine),
GB/s (10^9 B/s), with the device-to-host copy of the same bytes as the
reference, in one run.

    KVLINK_MASTER=build/rel/tools/kvlink-master PYTHONPATH=build/rel/python/site \\
        /usr/bin/python3 python/bench/bench_store_device.py [--memory cuda|emulated]

--memory cuda (the default): torch CUDA tensors on GPU 0 against pinned host
tensors, torch's copy as the reference. --memory emulated: kvlink's emulated
device (no GPU; its copy engine is a CPU thread) against numpy memory, the
reference a DeviceBuffer.read of the same bytes. Two MooncakeDistributedStore
clients in this process: one holding a 1 GiB segment, one holding none;
batch_put_from / batch_get_into of --objects objects of --size bytes (2.25
MiB: one Qwen3-8B 16-token block), best of 3, bytes checked.
"""

import argparse
import os
import re
import select
import subprocess
import time

import numpy as np

os.environ.setdefault("KVLINK_QUIET", "1")


def start_master(path: str):
    proc = subprocess.Popen([path, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""
    m = re.match(r"kvlink-master: listening on (\S+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"kvlink-master did not start (its first line: {line!r})")
    return proc, m.group(1)


class Memory:
    """2 x n x size bytes of one kind: base address, fill, and a check that
    the second half equals the first."""

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind = kind
        self.nbytes = nbytes
        if kind == "cuda" or kind == "pinned":
            import torch
            self.torch = torch
            if kind == "cuda":
                self.t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
            else:
                self.t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
            torch.cuda.synchronize()
            self.base = self.t.data_ptr()
        elif kind == "emulated":
            import kvlink
            self.d = kvlink.DeviceBuffer(nbytes)
            self.d.write(0, np.random.default_rng(1).integers(0, 256, nbytes, np.uint8))
            self.base = self.d.ptr
        else:
            self.a = np.random.default_rng(2).integers(0, 256, nbytes, np.uint8)
            self.base = self.a.ctypes.data

    def halves_equal(self) -> bool:
        h = self.nbytes // 2
        if self.kind in ("cuda", "pinned"):
            self.torch.cuda.synchronize()
            return bool(self.torch.equal(self.t[:h], self.t[h:]))
        if self.kind == "emulated":
            return self.d.read(0, h) == self.d.read(h, h)
        return bool(np.array_equal(self.a[:h], self.a[h:]))

    def reference(self, n: int) -> float:
        """GB/s of a device-to-host copy of n bytes (best of 2)."""
        best = 0.0
        for _ in range(2):
            if self.kind == "cuda":
                dst = self.torch.empty(n, dtype=self.torch.uint8).pin_memory()
                t = time.perf_counter()
                dst.copy_(self.t[:n], non_blocking=True)
                self.torch.cuda.synchronize()
            else:
                t = time.perf_counter()
                self.d.read(0, n)
            best = max(best, n / (time.perf_counter() - t) / 1e9)
        return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", choices=["cuda", "emulated"], default="cuda")
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--size", type=int, default=2_359_296)
    a = ap.parse_args()
    if a.memory == "emulated":
        os.environ["KVLINK_DEVICE"] = "emulated"
    from kvlink.mooncake_store import MooncakeDistributedStore
    n, sz = a.objects, a.size
    master_proc, master = start_master(os.environ["KVLINK_MASTER"])
    try:
        holder = MooncakeDistributedStore()
        assert holder.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 30, 0, "tcp", "", master) == 0
        req = MooncakeDistributedStore()
        assert req.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0
        dev = Memory(a.memory, 2 * n * sz)
        host = Memory("pinned" if a.memory == "cuda" else "host", 2 * n * sz)
        for s in (holder, req):
            assert s.register_buffer(dev.base, dev.nbytes) == 0
            assert s.register_buffer(host.base, host.nbytes) == 0
        print(f"# the store with {a.memory} memory: {n} objects of {sz} B a call, best of 3, "
              f"GB = 10^9 B")
        print(f"reference: device-to-host copy of the same {n * sz} B: "
              f"{dev.reference(n * sz):.2f} GB/s")
        rnd = 0
        for who, s in (("own segment", holder), ("another's segment", req)):
            for mem in (dev, host):
                best_put = best_get = 0.0
                for _ in range(3):
                    rnd += 1
                    keys = [f"r{rnd}/{i}" for i in range(n)]
                    t = time.perf_counter()
                    rc = s.batch_put_from(keys, [mem.base + i * sz for i in range(n)], [sz] * n)
                    tp = time.perf_counter() - t
                    assert rc == [0] * n, rc[:4]
                    t = time.perf_counter()
                    got = s.batch_get_into(keys, [mem.base + (n + i) * sz for i in range(n)],
                                           [sz] * n)
                    tg = time.perf_counter() - t
                    assert got == [sz] * n, got[:4]
                    assert mem.halves_equal(), "bytes differ"
                    best_put = max(best_put, n * sz / tp / 1e9)
                    best_get = max(best_get, n * sz / tg / 1e9)
                    assert s.batch_remove(keys, True) == [0] * n
                print(f"{who:18s} {mem.kind:9s} put {best_put:6.2f} GB/s  get {best_get:6.2f} GB/s")
        req.close()
        holder.close()
    finally:
        master_proc.terminate()
        master_proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
