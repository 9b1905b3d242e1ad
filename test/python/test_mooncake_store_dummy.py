"""MooncakeDistributedStore.setup_dummy (SGLang's dummy/real split): ranks
with no segment of their own, and a real kvlink-store-client process
(KVLINK_STORE_CLIENT, set by ctest; skipped without it) that holds the
host's segment, against a real kvlink-master. Bytes are checked across
processes; the objects outlive the rank that put them."""

import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

from kvlink.mooncake_store import MooncakeDistributedStore, MooncakeHostMemAllocator
from store_support import LineReader, master, start_master, stop  # noqa: F401 (fixtures)

SEGMENT = 16 << 20
WAIT = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_holder(master_address: str):
    """kvlink-store-client with mooncake_client's flags: (process, its
    engine's address, the rank service's address)."""
    path = os.environ.get("KVLINK_STORE_CLIENT")
    if not path:
        pytest.skip("KVLINK_STORE_CLIENT (the kvlink-store-client program) is not set")
    if not os.access(path, os.X_OK):
        pytest.fail(f"KVLINK_STORE_CLIENT={path} is not a program: build kvlink-store-client")
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [path, "--host", "127.0.0.1", f"--port={port}",
         f"--master_server_address={master_address}", "--global_segment_size", "16 MB",
         "--metadata_server", "P2PHANDSHAKE", "--protocol", "tcp"],
        stdout=subprocess.PIPE, stderr=log, text=True)
    line = LineReader(proc.stdout).next("kvlink-store-client's ready line")
    m = re.match(r"kvlink-store-client: serving (\d+) bytes \(segment \d+\) at (\S+) for master "
                 r"(\S+); ranks connect to (\S+)$", line.strip())
    if not m:
        stop(proc)
        log.seek(0)
        pytest.fail(f"kvlink-store-client: unexpected ready line {line!r}: {log.read()}")
    log.close()
    assert int(m.group(1)) == SEGMENT and m.group(3) == master_address
    assert m.group(4) == f"127.0.0.1:{port}"
    return proc, m.group(2), m.group(4)


@pytest.fixture
def holder(master):
    proc, engine, address = start_holder(master)
    yield engine, address
    stop(proc)
    assert proc.returncode == 0  # SIGTERM: unmounted and closed cleanly


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


RANK = textwrap.dedent("""
    import ctypes, json, sys
    from kvlink.mooncake_store import MooncakeDistributedStore, MooncakeHostMemAllocator
    holder, keys = sys.argv[1], json.loads(sys.argv[2])
    s = MooncakeDistributedStore()
    assert s.setup_dummy(64 << 20, 16 << 20, holder) == 0
    alloc = MooncakeHostMemAllocator()
    base = alloc.alloc(len(keys) * 4096)
    assert s.register_buffer(base, len(keys) * 4096) == 0
    got = s.batch_get_into(keys, [base + i * 4096 for i in range(len(keys))], [4096] * len(keys))
    data = ctypes.string_at(base, len(keys) * 4096)
    print(json.dumps({"got": got, "hex": data.hex(), "health": s.health_check()}))
    assert s.unregister_buffer(base) == 0 and s.close() == 0
""")


def test_ranks_share_the_holders_segment(master, holder):
    engine, address = holder
    rank = MooncakeDistributedStore()
    assert rank.setup_dummy(64 << 20, "16MB", address) == 0
    assert rank.health_check() == 0
    # SGLang's pattern: a host pool from the allocator, registered, pages
    # put with batch_put_from.
    alloc = MooncakeHostMemAllocator()
    base = alloc.alloc(16 * 4096)
    assert rank.register_buffer(base, 16 * 4096) == 0
    pages = blob(16 * 4096, 1)
    ctypes.memmove(base, pages, len(pages))
    keys = [f"hash{i}_0_k" for i in range(16)]
    assert rank.batch_put_from(keys, [base + i * 4096 for i in range(16)], [4096] * 16) == [0] * 16
    # Every object lives in the holder's segment (the rank has none).
    where = rank.batch_get_replica_desc(keys)
    assert set(where) == set(keys)
    assert {r.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for rs in where.values() for r in rs} == {engine}
    # Another rank process reads them, bytes checked.
    out = subprocess.run([sys.executable, "-c", RANK, address, json.dumps(keys[::-1])],
                         capture_output=True, text=True, timeout=WAIT, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["got"] == [4096] * 16 and answer["health"] == 0
    got = bytes.fromhex(answer["hex"])
    for i in range(16):
        assert got[i * 4096:(i + 1) * 4096] == pages[(15 - i) * 4096:(16 - i) * 4096]
    # The rank goes away: its objects stay with the holder; a new rank finds them.
    assert rank.unregister_buffer(base) == 0
    assert rank.close() == 0
    assert alloc.free(base) == 0
    again = MooncakeDistributedStore()
    assert again.setup_dummy(0, 0, address) == 0
    assert again.batch_is_exist(keys + ["hash99_0_k"]) == [1] * 16 + [0]
    assert again.get(keys[3]) == pages[3 * 4096:4 * 4096]
    assert again.close() == 0


def test_setup_dummy_failures(master, holder):
    s = MooncakeDistributedStore()
    assert s.setup_dummy(0, 0, f"127.0.0.1:{free_port()}") == -1   # nothing listens
    assert s.setup_dummy(0, 0, master) == -1                        # not a holder: the master
    assert s.setup_dummy(0, 0, "nonsense") == -1
    assert s.setup_dummy("lots", 0, holder[1]) == -1
    assert s.put("k", b"v") == -600 and s.health_check() == -1      # not set up
    assert s.setup_dummy(0, 0, holder[1]) == 0
    assert s.setup_dummy(0, 0, holder[1]) == -1                     # twice
    assert s.close() == 0


def test_holder_gone_then_health_fails():
    proc, address = start_master()
    try:
        holder_proc, _, holder_address = start_holder(address)
        s = MooncakeDistributedStore()
        assert s.setup_dummy(0, 0, holder_address) == 0
        assert s.put("g/1", b"x" * 1000) == 0
        stop(holder_proc)  # SIGTERM: the holder unmounts, its objects leave the pool
        assert holder_proc.returncode == 0
        assert s.health_check() == -1
        assert s.is_exist("g/1") == 0
        assert s.put("g/2", b"y") == -200  # no segment left anywhere: no space
        assert s.close() == 0
    finally:
        stop(proc)
