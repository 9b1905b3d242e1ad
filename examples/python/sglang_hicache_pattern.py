"""SGLang HiCache's `mooncake` storage backend pattern over kvlink's store,
through the `mooncake.store` API.

SGLang keeps a host KV pool (pages of K and V) per rank, registers it once,
and stores each page as two objects, "<hash>_<tp_rank>_k" and "_v". Two
processes, as two SGLang instances sharing one pool:
  writer   mounts 32 MiB into the pool, registers its host pool, and backs
           up the pages of a prompt with batch_put_from;
  reader   (this process, another instance with 32 MiB of its own) counts
           the stored prefix with batch_is_exist (leading 1s), reads that
           many pages into other slots of its host pool with batch_get_into
           (prefix semantics: the count of leading successes), and checks
           every byte.
Both take their configuration as SGLang does without a config file: from
MOONCAKE_MASTER and the other MOONCAKE_* variables (MooncakeConfig).

This example starts a kvlink-master, the program named by KVLINK_MASTER
(build/py/tools/kvlink-master after a build); without KVLINK_MASTER it says
so and exits 0 ("skipped"):

    KVLINK_MASTER=build/py/tools/kvlink-master PYTHONPATH=build/py/python/site \\
        /usr/bin/python3 examples/python/sglang_hicache_pattern.py

`from mooncake.store import MooncakeDistributedStore` is what SGLang writes:
with kvlink's alias installed (README, "Python") it is kvlink; here it falls
back to kvlink.mooncake_store, the same class.
"""

import dataclasses
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
from kvlink.mooncake_store import MooncakeConfig

PAGE = 8192           # one page of K (or V) for page_size tokens, all layers
SLOTS = 64            # pages in a host pool
PROMPT_PAGES = 20     # pages the writer backs up
WAIT = 60             # seconds any step may take before the example fails


def page_keys(pages) -> list:
    return [f"{p:032x}_0_{kv}" for p in pages for kv in "kv"]


class HostPool:
    """One registered array [slot][k|v][PAGE]."""

    def __init__(self, store: MooncakeDistributedStore) -> None:
        self.a = np.zeros((SLOTS, 2, PAGE), np.uint8)
        if store.register_buffer(self.a.ctypes.data, self.a.nbytes) != 0:
            raise SystemExit("register_buffer failed")

    def ptrs(self, slots) -> list:
        return [self.a.ctypes.data + (s * 2 + kv) * PAGE for s in slots for kv in range(2)]


def computed(page: int) -> np.ndarray:
    return np.random.default_rng(1000 + page).integers(0, 256, (2, PAGE), dtype=np.uint8)


def connect() -> MooncakeDistributedStore:
    cfg = MooncakeConfig.load_from_env()
    store = MooncakeDistributedStore()
    if store.setup(dataclasses.asdict(cfg)) != 0:
        raise SystemExit("setup failed (the reason is on the kvlink.mooncake.store logger)")
    return store


def writer(conn) -> None:
    store = connect()
    pool = HostPool(store)
    for p in range(PROMPT_PAGES):
        pool.a[p] = computed(p)
    codes = store.batch_put_from(page_keys(range(PROMPT_PAGES)), pool.ptrs(range(PROMPT_PAGES)),
                                 [PAGE] * (2 * PROMPT_PAGES))
    conn.send(codes)
    if conn.poll(WAIT):  # its segment may hold pages: stay until the reader is done
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


def leading(results, ok) -> int:
    return next((i for i, r in enumerate(results) if not ok(r)), len(results))


def main() -> int:
    path = os.environ.get("KVLINK_MASTER")
    if not path:
        print("sglang_hicache_pattern: skipped: set KVLINK_MASTER to the kvlink-master program")
        return 0
    master_proc, master = start_master(path)
    os.environ.pop("MOONCAKE_CONFIG_PATH", None)
    os.environ.update(MOONCAKE_MASTER=master, MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
                      MOONCAKE_PROTOCOL="tcp", MOONCAKE_GLOBAL_SEGMENT_SIZE="32MB",
                      MOONCAKE_LOCAL_BUFFER_SIZE="16MB")
    ours, theirs = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=writer, args=(theirs,))
    proc.start()
    try:
        if not ours.poll(WAIT):
            raise SystemExit("the writer did not answer")
        codes = ours.recv()
        if codes != [0] * (2 * PROMPT_PAGES):
            raise SystemExit(f"writer: batch_put_from gave {codes}")
        print(f"writer: {PROMPT_PAGES} pages backed up ({2 * PROMPT_PAGES} objects)")

        store = connect()
        pool = HostPool(store)
        asked = PROMPT_PAGES + 4  # the prompt and then some nobody stored
        keys = page_keys(range(asked))
        hit = leading(store.batch_is_exist(keys), lambda r: r == 1) // 2
        print(f"reader: {hit} of {asked} pages stored (prefix)")
        slots = range(SLOTS - hit, SLOTS)
        got = store.batch_get_into(keys[:2 * hit], pool.ptrs(slots), [PAGE] * (2 * hit))
        read = leading(got, lambda r: r > 0) // 2
        bad = [p for p, s in zip(range(read), slots) if not np.array_equal(pool.a[s], computed(p))]
        store.close()
        if bad or read != hit or hit != PROMPT_PAGES:
            raise SystemExit(f"reader: hit {hit}, read {read}, pages {bad} differ")
        print(f"reader: {read} pages read into other slots, every byte as the writer wrote it")
        return 0
    finally:
        ours.send("done")
        proc.join(WAIT)
        if proc.is_alive():
            proc.kill()
        master_proc.terminate()
        master_proc.wait(WAIT)


if __name__ == "__main__":
    sys.exit(main())
