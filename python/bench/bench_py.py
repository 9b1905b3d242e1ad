"""kvlink from Python: the cost per batch entry, and bandwidth, beside the C++ figure.

    PYTHONPATH=build/py/python/site /usr/bin/python3 python/bench/bench_py.py

A target engine runs in a child process (its data path is C++ only); the
initiator is driven from Python. Two measurements:

 1. Per-entry cost: blocking WRITEs of --entries (10^5) requests of --tiny
    (64) bytes, local blocks contiguous, remote blocks scattered (stride
    block + 4 KiB, as kvlink-bench's scattered layout, so nothing coalesces),
    through each Python entry point. The time is the whole call: reading the
    columns, building the requests, moving them, waiting. The C++ floor for
    the same batch:
        kvlink-bench sweep --sizes 64 --batches 100000 --lanes 2 --ops write \\
            --depth 1 --segment-size 256MiB
    (its "lat/batch us" / 10^5).
 2. Bandwidth: --depth (4) batches of --batch (64) blocks of --block (1 MiB)
    in flight for --seconds, the same layout; the same as
        kvlink-bench sweep --sizes 1MiB --batches 64 --lanes 2 --ops write \\
            --depth 4 --segment-size 256MiB
GB = 10^9 bytes.
"""

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

import kvlink
from kvlink.mooncake import TransferEngine


def target(conn, segment_size: int) -> None:
    eng = kvlink.Engine(transports="tcp")
    mem = np.ones(segment_size, np.uint8)  # touched, as kvlink-bench's target does
    seg = eng.register(mem)
    conn.send((eng.local_address, seg, kvlink.address_of(mem)))
    conn.recv()  # until told to stop
    eng.close()


def layout(n: int, block: int, local_size: int, remote_size: int):
    """kvlink-bench's scattered layout: slot i -> local i*block, remote i*(block+4096)."""
    stride = block + 4096
    slots = max(1, min(local_size // block, (remote_size - block) // stride + 1))
    slot = np.arange(n, dtype=np.uint64) % np.uint64(slots)
    return slot * np.uint64(block), slot * np.uint64(stride)


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--tiny", type=int, default=64)
    ap.add_argument("--block", type=int, default=1 << 20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--segment-size", type=int, default=256 << 20)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--target", help="HOST:PORT of a running `kvlink-bench target --segment-size "
                    "256MiB` (the C++ target) instead of a Python child")
    a = ap.parse_args()

    child = None
    if a.target:
        address = a.target
    else:
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        child = ctx.Process(target=target, args=(there, a.segment_size))
        child.start()
        address, _, _ = here.recv()

    eng = kvlink.Engine(transports="tcp", tcp_lanes=2)
    mem = np.ones(a.segment_size, np.uint8)
    eng.register(mem)
    base = kvlink.address_of(mem)
    peer = eng.connect(address)
    seg, remote_base, remote_size = [(s.id, s.base, s.length) for s in peer.segments()][0]
    a.segment_size = min(a.segment_size, remote_size)
    where = f"target {a.target}" if a.target else "target in a child process on loopback"
    print(f"# kvlink {kvlink.__version__} from Python, {where}, {peer.transport}, 2 lanes")

    # 1. per entry
    loc, rem = layout(a.entries, a.tiny, a.segment_size, a.segment_size)
    local_np, offs_np = np.uint64(base) + loc, rem
    peer_addr_np = np.uint64(remote_base) + rem
    local_list, offs_list, peer_list = local_np.tolist(), offs_np.tolist(), peer_addr_np.tolist()
    lengths_list = [a.tiny] * a.entries
    mc = TransferEngine()
    assert mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    mc_mem = np.ones(a.segment_size, np.uint8)
    assert mc.register_memory(kvlink.address_of(mc_mem), a.segment_size) == 0
    mc_local = (np.uint64(kvlink.address_of(mc_mem)) + loc).tolist()

    cases = [
        ("Engine.write, numpy columns, (segment, offset)",
         lambda: eng.write(peer, local_np, offs_np, a.tiny, segment=seg)),
        ("Engine.write, list columns, (segment, offset)",
         lambda: eng.write(peer, local_list, offs_list, a.tiny, segment=seg)),
        ("Engine.write, numpy columns, peer addresses",
         lambda: eng.write(peer, local_np, peer_addr_np, a.tiny)),
        ("mooncake batch_transfer_sync_write, lists",
         lambda: mc.batch_transfer_sync_write(address, mc_local, peer_list, lengths_list)),
    ]
    print(f"\n{a.entries} entries x {a.tiny} B per blocking call (median of {a.repeat}):")
    print(f"{'entry point':<50} {'ms/call':>9} {'us/entry':>9}")
    for name, fn in cases:
        fn()  # warm-up (connects the Mooncake engine)
        t = timed(fn, a.repeat)
        print(f"{name:<50} {t * 1e3:>9.2f} {t / a.entries * 1e6:>9.3f}")

    # The Python side alone: columns read and requests built for the whole
    # batch, then refused at its last entry (a peer address outside every
    # segment), so nothing is sent.
    bad_np = peer_addr_np.copy()
    bad_np[-1] = 8
    bad_list = bad_np.tolist()

    def refused(local, remote):
        try:
            eng.write(peer, local, remote, a.tiny)
        except kvlink.Error:
            return
        raise AssertionError("the batch was not refused")

    print("\nthe same batches built and refused at the last entry, nothing sent:")
    for name, fn in [("numpy columns, peer addresses", lambda: refused(local_np, bad_np)),
                     ("list columns, peer addresses", lambda: refused(local_list, bad_list))]:
        t = timed(fn, a.repeat)
        print(f"{name:<50} {t * 1e3:>9.2f} {t / a.entries * 1e6:>9.3f}")

    # 2. bandwidth
    loc, rem = layout(a.batch * a.depth, a.block, a.segment_size, a.segment_size)
    batches = [(np.uint64(base) + loc[i::a.depth], rem[i::a.depth]) for i in range(a.depth)]
    ops = [eng.submit(kvlink.WRITE, peer, lo, ro, a.block, segment=seg) for lo, ro in batches]
    warm_end = time.perf_counter() + 0.3
    moved, t0, measuring, done = 0, None, False, 0
    i = 0
    while True:
        r = ops[i].result()
        now = time.perf_counter()
        if measuring:
            moved += r.bytes
            done += 1
            if now - t0 >= a.seconds:
                break
        elif now >= warm_end:
            measuring, t0 = True, now
        ops[i] = eng.submit(kvlink.WRITE, peer, batches[i][0], batches[i][1], a.block,
                            segment=seg)
        i = (i + 1) % a.depth
    elapsed = time.perf_counter() - t0
    for op in ops:
        op.wait()
    print(f"\nWRITE {a.batch} x {a.block} B per batch, {a.depth} in flight, {elapsed:.2f} s: "
          f"{moved / elapsed / 1e9:.2f} GB/s ({done} batches)")

    eng.close()
    if child is not None:
        here.send("stop")
        child.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
