"""The store from Python (mooncake.store's API over kvlink) beside the C++
client, in one run: the figures issue 26 asks for and Mooncake Store's own
Python figures (/work/shared/notes/store.md) are on the same footing.

    PYTHONPATH=build/rel/python/site /usr/bin/python3 python/bench/bench_store_py.py \\
        --master build/rel/tools/kvlink-master \\
        --holder build/rel/tools/kvlink-store-client \\
        --cpp-bench build/rel/bench/kvlink_store_bench

Set-up, as the Mooncake figures were taken: a kvlink-master, a holder
process with a 1 GiB segment (kvlink-store-client), and one client with no
segment (MooncakeDistributedStore.setup), loopback TCP (KVLINK_TRANSPORTS=tcp
in the client, so the same-host shared-memory path is not used). Rows, each
over --seconds after a warm-up, 4 KiB values from registered memory:
  batched puts / gets (batch_put_from / batch_get_into, 128 keys a call),
  one at a time (put_from / get_into), batch_is_exist of 128 keys,
  and 2.25 MiB objects (one Qwen3-8B 16-token block) put and get, GB/s:
  4 a call (batch_put_from / batch_get_into: bw-*-b4, no C++ row of that
  shape) and, as the C++ rows run, 4 calls of one object in flight
  (put_from / get_into from 4 threads: bw-*-block).
The C++ rows are kvlink_store_bench's put-c1-b128, get-c1-b128, put-c1-d1,
get-c1-d1, exists-c1-b128 and bw-put-block / bw-get-block (the C++ client
on the same machine, its own master and serving process, TCP), run right
after by this script. GB = 10^9 bytes, GiB = 2^30 bytes.
"""

import argparse
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("KVLINK_TRANSPORTS", "tcp")
os.environ.setdefault("KVLINK_QUIET", "1")

from kvlink.mooncake_store import MooncakeDistributedStore  # noqa: E402

KIB4 = 4096
BLOCK = 2359296  # 2.25 MiB: 16 tokens x 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 B


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, pattern):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"{cmd[0]} exited before it was ready")
        m = re.match(pattern, line)
        if m:
            return proc, m


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rate(fn, seconds: float, per_call: int) -> float:
    """Units per second of fn() over `seconds`, after one warm-up call."""
    fn()
    calls = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    return calls * per_call / (time.perf_counter() - t0)


def python_rows(store: MooncakeDistributedStore, seconds: float) -> dict:
    arena = np.zeros(2 * 128 * KIB4 + 8 * BLOCK, np.uint8)
    arena[:] = np.random.default_rng(1).integers(0, 256, arena.size, dtype=np.uint8)
    base = arena.ctypes.data
    assert store.register_buffer(base, arena.nbytes) == 0
    src = [base + i * KIB4 for i in range(128)]
    dst = [base + (128 + i) * KIB4 for i in range(128)]
    sizes = [KIB4] * 128
    out = {}
    n = [0]

    def put_batch():
        keys = [f"py/p/{n[0]}/{i}" for i in range(128)]
        n[0] += 1
        r = store.batch_put_from(keys, src, sizes)
        assert r == [0] * 128, r[:4]

    out["put-b128"] = rate(put_batch, seconds, 128)
    assert store.remove_all(True) >= 0
    stored = [f"py/g/{i}" for i in range(128)]
    assert store.batch_put_from(stored, src, sizes) == [0] * 128

    def get_batch():
        r = store.batch_get_into(stored, dst, sizes)
        assert r == sizes, r[:4]

    out["get-b128"] = rate(get_batch, seconds, 128)
    assert arena[128 * KIB4:256 * KIB4].tobytes() == arena[:128 * KIB4].tobytes()

    def exists_batch():
        assert store.batch_is_exist(stored) == [1] * 128

    out["exists-b128"] = rate(exists_batch, seconds, 128)
    m = [0]

    def put_one():
        assert store.put_from(f"py/1/{m[0]}", src[0], KIB4) == 0
        m[0] += 1

    out["put-d1"] = rate(put_one, seconds, 1)

    def get_one():
        assert store.get_into(stored[m[0] % 128], dst[0], KIB4) == KIB4
        m[0] += 1

    out["get-d1"] = rate(get_one, seconds, 1)
    # 2.25 MiB objects, 4 a call (kvlink_store_bench's bw rows keep 4 calls
    # of one object in flight), in an emptied pool.
    assert store.remove_all(True) >= 0
    blocks = base + 256 * KIB4
    bsrc = [blocks + i * BLOCK for i in range(4)]
    bdst = [blocks + (4 + i) * BLOCK for i in range(4)]
    k = [0]

    def put_blocks():
        keys = [f"py/b/{k[0]}/{i}" for i in range(4)]
        r = store.batch_put_from(keys, bsrc, [BLOCK] * 4)
        assert r == [0] * 4, r
        k[0] += 1
        if k[0] % 16 == 0:  # stay inside the 1 GiB pool without leaning on eviction
            store.batch_remove([f"py/b/{j}/{i}" for j in range(k[0] - 16, k[0])
                                for i in range(4)], True)

    out["bw-put-b4"] = rate(put_blocks, seconds, 4 * BLOCK) / 1e9
    read = [f"py/r/{i}" for i in range(4)]
    assert store.batch_put_from(read, bsrc, [BLOCK] * 4) == [0] * 4

    def get_blocks():
        assert store.batch_get_into(read, bdst, [BLOCK] * 4) == [BLOCK] * 4

    out["bw-get-b4"] = rate(get_blocks, seconds, 4 * BLOCK) / 1e9
    assert arena[blocks + 0 - base + 4 * BLOCK:].tobytes() == \
        arena[blocks - base:blocks - base + 4 * BLOCK].tobytes()
    # The C++ rows' shape: 4 calls of one object in flight (4 threads; the
    # calls release the GIL).
    assert store.remove_all(True) >= 0

    def in_flight(call) -> float:
        def worker(t: int) -> int:
            calls = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                call(t, calls)
                calls += 1
            return calls
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            calls = sum(pool.map(worker, range(4)))
        return calls * BLOCK / (time.perf_counter() - t0) / 1e9

    def put_one_block(t: int, c: int) -> None:
        assert store.put_from(f"py/t/{t}/{c}", bsrc[t], BLOCK) == 0
        if c % 16 == 15:  # 4 x 16 x 2.25 MiB at most: inside the 1 GiB pool
            store.batch_remove([f"py/t/{t}/{j}" for j in range(c - 15, c + 1)], True)

    def get_one_block(t: int, c: int) -> None:
        assert store.get_into(read[t], bdst[t], BLOCK) == BLOCK

    out["bw-put-block"] = in_flight(put_one_block)
    assert store.remove_all(True) >= 0
    assert store.batch_put_from(read, bsrc, [BLOCK] * 4) == [0] * 4
    out["bw-get-block"] = in_flight(get_one_block)
    assert store.remove_all(True) >= 0
    assert store.unregister_buffer(base) == 0
    return out


def cpp_rows(path: str, seconds: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        out = subprocess.run([path, "--transports", "tcp", "--seconds", str(seconds), "--json",
                              f.name, "--rows",
                              "put-c1-b128,get-c1-b128,exists-c1-b128,put-c1-d1,get-c1-d1,"
                              "bw-put-block,bw-get-block"],
                             capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise SystemExit(f"{path}: status {out.returncode}: {out.stderr[-2000:]}")
        result = json.load(open(f.name))
    rows = {}
    for table in result["tables"]:
        for r in table["rows"]:
            rows[r["row"]] = r["gb_per_s"] if r["section"] == "bw" else r["keys_per_s"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--master", required=True)
    ap.add_argument("--holder", required=True)
    ap.add_argument("--cpp-bench", default="")
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()

    master, m = start([a.master, "--listen", "127.0.0.1:0", "--threads", "2"],
                      r"kvlink-master: listening on (\S+)")
    address = m.group(1)
    port = free_port()
    holder, _ = start([a.holder, "--host", "127.0.0.1", f"--port={port}",
                       f"--master_server_address={address}", "--global_segment_size", "1 GB"],
                      r"kvlink-store-client: serving")
    try:
        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
        py = python_rows(store, a.seconds)
        store.close()
    finally:
        stop(holder)
        stop(master)
    cpp = cpp_rows(a.cpp_bench, a.seconds) if a.cpp_bench else {}
    names = {"put-b128": "put-c1-b128", "get-b128": "get-c1-b128",
             "exists-b128": "exists-c1-b128", "put-d1": "put-c1-d1", "get-d1": "get-c1-d1",
             "bw-put-b4": "", "bw-get-b4": "",
             "bw-put-block": "bw-put-block", "bw-get-block": "bw-get-block"}
    print("# the store from Python (mooncake.store over kvlink, one client, no segment) vs "
          "kvlink_store_bench's C++ client, loopback TCP, 1 GiB holder; keys/s, GB/s = 10^9 B/s")
    print(f"{'row':<14} {'unit':<6} {'python':>12} {'c++':>12} {'py/c++':>8}")
    for row, value in py.items():
        unit = "GB/s" if row.startswith("bw-") else "keys/s"
        ref = cpp.get(names[row]) if names[row] else None
        ratio = f"{value / ref:.2f}" if ref else "-"
        fmt = "{:>12.2f}" if unit == "GB/s" else "{:>12.0f}"
        print(f"{row:<14} {unit:<6} " + fmt.format(value) + " " +
              (fmt.format(ref) if ref else f"{'-':>12}") + f" {ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
