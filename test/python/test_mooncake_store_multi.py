"""The multi-buffer batches of kvlink.mooncake_store.MooncakeDistributedStore
(vLLM's MooncakeStoreConnector: per-layer K/V pieces of one block gathered
into one object, scattered back into other block ids) and its setup from a
dict, a MOONCAKE_CONFIG_PATH file and MOONCAKE_* variables, against a real
kvlink-master (KVLINK_MASTER; skipped without it) and a second process that
holds the pool's memory, every byte checked; and setup through etcd with
masters standing for election (skipped without etcd)."""

import concurrent.futures
import dataclasses
import json
import os
import queue
import subprocess
import sys
import time

import numpy as np
import pytest

from kvlink.mooncake_store import MooncakeConfig, MooncakeDistributedStore, ReplicateConfig
from store_support import HERE, WAIT, LineReader, StorePeer, master, peer, start_master, stop  # noqa: F401,E501
from store_support import mooncake_store as store  # noqa: F401 (a fixture)

PEER_SEGMENT = 16 << 20  # the peer process's segment (the peer fixture)
LAYERS, BLOCKS, PIECE = 4, 16, 512  # a paged KV cache: [layer][k|v][block] pieces
BLOCK_BYTES = LAYERS * 2 * PIECE


class KvCache:
    """One registered array as vLLM's paged KV storage: piece (layer, kv,
    block) of PIECE bytes."""

    def __init__(self, store, seed):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(0, 256, (LAYERS, 2, BLOCKS, PIECE), dtype=np.uint8)
        self.base = self.a.ctypes.data
        assert store.register_buffer(self.base, self.a.nbytes) == 0

    def ptrs(self, block):
        return [self.base + ((l * 2 + kv) * BLOCKS + block) * PIECE
                for l in range(LAYERS) for kv in range(2)]

    def block(self, block):
        """The bytes of one block's pieces, in ptrs() order."""
        return self.a[:, :, block, :].tobytes()


def test_gather_put_then_scatter_into_other_blocks(store, peer):
    kv = KvCache(store, 11)
    keys = [f"vllm@tp0@{b:04x}" for b in range(4)]
    sizes = [[PIECE] * (LAYERS * 2)] * 4
    assert store.batch_put_from_multi_buffers(keys, [kv.ptrs(b) for b in range(4)], sizes) \
        == [0] * 4
    # One object per key: the pieces in order, held by the other process.
    for b, key in enumerate(keys):
        assert peer.call("get", key=key) == {"hex": kv.block(b).hex()}
    assert store.batch_is_exist(keys + ["vllm@tp0@missing"]) == [1, 1, 1, 1, 0]
    assert store.get_size(keys[2]) == BLOCK_BYTES
    before = kv.a.copy()
    # Scattered back into blocks 8..11 (reversed: key i -> block 11 - i).
    got = store.batch_get_into_multi_buffers(keys, [kv.ptrs(11 - i) for i in range(4)], sizes)
    assert got == [BLOCK_BYTES] * 4
    for i in range(4):
        assert kv.block(11 - i) == before[:, :, i, :].tobytes()
    untouched = [b for b in range(BLOCKS) if b not in (8, 9, 10, 11)]
    assert np.array_equal(kv.a[:, :, untouched, :], before[:, :, untouched, :])
    # A re-put of an existing key is 0 and keeps the first writer's bytes.
    assert store.batch_put_from_multi_buffers(keys[:1], [kv.ptrs(5)], sizes[:1]) == [0]
    assert peer.call("get", key=keys[0]) == {"hex": before[:, :, 0, :].tobytes().hex()}
    assert store.unregister_buffer(kv.base) == 0


def test_objects_put_elsewhere_scatter_over_uneven_pieces(store, peer):
    kv = KvCache(store, 12)
    theirs = np.random.default_rng(13).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    assert peer.call("put", key="other/1", hex=theirs.hex()) == {"rc": 0}
    before = kv.a.copy()
    ptrs = kv.ptrs(3)[:3]
    # 512 + 512 + 512 bytes of room for 1000: the third piece is not reached.
    assert store.batch_get_into_multi_buffers(["other/1", "other/missing"],
                                              [ptrs, kv.ptrs(4)],
                                              [[PIECE] * 3, [PIECE] * 8]) == [1000, -704]
    flat = b"".join(bytes(kv.a.reshape(-1)[p - kv.base:p - kv.base + PIECE]) for p in ptrs)
    assert flat[:1000] == theirs
    assert flat[1000:] == before.reshape(-1)[ptrs[1] - kv.base + 488:ptrs[1] - kv.base + PIECE] \
        .tobytes() + before.reshape(-1)[ptrs[2] - kv.base:ptrs[2] - kv.base + PIECE].tobytes()
    assert np.array_equal(kv.a[:, :, 4, :], before[:, :, 4, :])   # the missing key: nothing
    # Pieces of different sizes, put and read back in the same order.
    sizes = [100, 7, 300, 1]
    base = kv.base + 20 * PIECE
    ptrs = [base, base + 1000, base + 2000, base + 3000]
    assert store.batch_put_from_multi_buffers(["uneven"], [ptrs], [sizes]) == [0]
    want = b"".join(kv.a.reshape(-1)[p - kv.base:p - kv.base + n].tobytes()
                    for p, n in zip(ptrs, sizes))
    assert peer.call("get", key="uneven") == {"hex": want.hex()}
    assert store.get("uneven") == want
    assert store.unregister_buffer(kv.base) == 0


def test_bad_arguments_give_minus_600_and_move_nothing(store, peer):
    kv = KvCache(store, 14)
    before = kv.a.copy()
    sizes8 = [PIECE] * 8
    # Lists of different lengths: the whole batch, nothing put.
    assert store.batch_put_from_multi_buffers(["b/1", "b/2"], [kv.ptrs(0)], [sizes8, sizes8]) \
        == [-600, -600]
    assert store.batch_put_from_multi_buffers(["b/1"], [kv.ptrs(0)], [sizes8, sizes8]) == [-600]
    # One key's pointer and size lists differ: that key alone.
    assert store.batch_put_from_multi_buffers(["b/1", "b/2"], [kv.ptrs(0), kv.ptrs(1)],
                                              [sizes8[:7], sizes8]) == [-600, 0]
    # A piece outside registered memory, or running past its end.
    plain = np.ones(PIECE, np.uint8)
    assert store.batch_put_from_multi_buffers(
        ["b/3", "b/4", "b/5"],
        [[plain.ctypes.data], [kv.base + kv.a.nbytes - 10], [kv.base]],
        [[PIECE], [11], [0]]) == [-600, -600, -600]  # b/5: no bytes at all
    assert store.batch_is_exist(["b/1", "b/2", "b/3", "b/4", "b/5"]) == [0, 1, 0, 0, 0]
    assert peer.call("get", key="b/2") == {"hex": kv.block(1).hex()}
    # Gets: too little room, unregistered memory, mismatched lists.
    assert store.batch_get_into_multi_buffers(["b/2"], [kv.ptrs(6)[:7]], [sizes8[:7]]) == [-600]
    assert store.batch_get_into_multi_buffers(["b/2"], [[plain.ctypes.data]], [[PIECE]]) \
        == [-600]
    assert store.batch_get_into_multi_buffers(["b/2", "b/2"], [kv.ptrs(6)], [sizes8]) \
        == [-600, -600]
    assert np.array_equal(kv.a, before) and (plain == 1).all()
    assert store.batch_put_from_multi_buffers([], [], []) == []
    assert store.batch_get_into_multi_buffers([], [], []) == []
    assert store.unregister_buffer(kv.base) == 0
    # Unregistered now: refused.
    assert store.batch_put_from_multi_buffers(["b/6"], [kv.ptrs(0)], [sizes8]) == [-600]
    assert store.is_exist("b/6") == 0
    idle = MooncakeDistributedStore()  # not set up
    assert idle.batch_put_from_multi_buffers(["b/7"], [kv.ptrs(0)], [sizes8]) == [-600]
    assert idle.batch_get_into_multi_buffers(["b/2"], [kv.ptrs(0)], [sizes8]) == [-600]


def test_vllm_pattern_from_several_threads(store, peer):
    """Lookup over thousands of keys, puts of the missing blocks and loads
    into other block ids, from four threads with one store, as vLLM's send
    and recv threads do."""
    kvs = [KvCache(store, 20 + t) for t in range(4)]
    keys = [[f"m@tp{t}@{b:04x}" for b in range(8)] for t in range(4)]
    sizes = [[PIECE] * (LAYERS * 2)] * 8
    lookup = [k for ks in keys for k in ks] + [f"m@absent@{i}" for i in range(4000)]
    assert store.batch_is_exist(lookup) == [0] * len(lookup)
    originals = [kv.a.copy() for kv in kvs]

    def one(t):
        kv = kvs[t]
        put = store.batch_put_from_multi_buffers(keys[t], [kv.ptrs(b) for b in range(8)], sizes)
        got = store.batch_get_into_multi_buffers(keys[t], [kv.ptrs(8 + b) for b in range(8)],
                                                 sizes)
        return put, got

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = [f.result(timeout=WAIT) for f in [pool.submit(one, t) for t in range(4)]]
    for t, (put, got) in enumerate(outs):
        assert put == [0] * 8 and got == [BLOCK_BYTES] * 8
        assert np.array_equal(kvs[t].a[:, :, 8:, :], originals[t][:, :, :8, :])
        assert np.array_equal(kvs[t].a[:, :, :8, :], originals[t][:, :, :8, :])
    exist = store.batch_is_exist(lookup)
    assert exist[:32] == [1] * 32 and exist[32:] == [0] * 4000
    assert peer.call("get", key=keys[3][5]) == {"hex": originals[3][:, :, 5, :].tobytes().hex()}
    for kv in kvs:
        assert store.unregister_buffer(kv.base) == 0


def test_blocks_read_back_into_other_ids_in_reverse(store, peer):
    kv = KvCache(store, 30)
    keys = [f"r/{b}" for b in range(7)]
    sizes = [[PIECE] * 8] * 7
    assert store.batch_put_from_multi_buffers(keys, [kv.ptrs(b) for b in range(7)], sizes) \
        == [0] * 7
    before = kv.a.copy()
    got = store.batch_get_into_multi_buffers(keys[::-1], [kv.ptrs(8 + b) for b in range(7)],
                                             sizes)
    assert got == [BLOCK_BYTES] * 7
    for b in range(7):
        assert kv.block(8 + b) == before[:, :, 6 - b, :].tobytes()
        assert peer.call("get", key=keys[b]) == {"hex": before[:, :, b, :].tobytes().hex()}
    assert store.unregister_buffer(kv.base) == 0


def _hard_pinned():
    c = ReplicateConfig()
    c.with_hard_pin = True
    return c


def test_setup_dict_form_mounts_its_segment():
    proc, address = start_master()
    try:
        s = MooncakeDistributedStore()
        # The JSON file's spellings, sizes as strings, and keys of LMCache's
        # own that Mooncake ignores.
        cfg = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
               "global_segment_size": "4MB", "local_buffer_size": "0", "protocol": "tcp",
               "device_name": "", "master_server_address": address, "tenant_id": "default",
               "enable_ssd_offload": "false", "type": "mooncake_store", "num_workers": 2}
        assert s.setup(cfg) == 0
        blob = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
        assert s.put("big", blob, _hard_pinned()) == 0
        assert s.put("more", blob[:2 << 20], _hard_pinned()) == -200  # 4 MiB it is
        assert s.get("big") == blob
        assert s.close() == 0
    finally:
        stop(proc)


def test_setup_dict_form_refusals(master):
    s = MooncakeDistributedStore()
    base = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": 0, "master_server_addr": master}
    assert s.setup({k: v for k, v in base.items() if k != "master_server_addr"}) == -1
    assert s.setup({k: v for k, v in base.items() if k != "metadata_server"}) == -1
    assert s.setup(dict(base, enable_ssd_offload="true")) == -1   # no ssd_offload_path
    assert s.setup(dict(base, enable_ssd_offload=True,               # a file, not a directory
                        ssd_offload_path=os.path.abspath(__file__))) == -1
    assert s.setup(dict(base, enable_ssd_offload="maybe")) == -1
    assert s.setup(dict(base, tenant_id="other")) == -1
    assert s.setup(dict(base, global_segment_size="lots")) == -1
    assert s.setup(dict(base, master_server_addr="redis://127.0.0.1:6379")) == -1
    assert s.setup(dict(base, protocol="nvlink")) == -1
    assert s.setup(base, "P2PHANDSHAKE") == -1
    assert s.is_exist("k") == -1  # none of them set it up
    assert s.setup(base) == 0
    assert s.put("dict/k", b"v") == 0 and s.get("dict/k") == b"v"
    assert s.remove("dict/k", True) == 0
    assert s.close() == 0


def test_ssd_offload_keeps_evicted_objects_and_survives_a_restart(tmp_path, monkeypatch):
    # Mooncake's settings for its SSD tier: kvlink's on this client. Leases
    # of 50 ms: each get leases what it read, and a 4 MiB segment full of
    # leased objects has no room to read others back.
    proc, address = start_master("--default_kv_lease_ttl", "50")
    monkeypatch.delenv("KVLINK_SSD_CAPACITY", raising=False)
    monkeypatch.setenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", str(tmp_path / "ssd"))
    cfg = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
           "global_segment_size": "4MB", "local_buffer_size": 0, "protocol": "tcp",
           "master_server_address": address, "enable_ssd_offload": True}
    rng = np.random.default_rng(11)
    blobs = {f"ssd/{i}": rng.integers(0, 256, 512 << 10, dtype=np.uint8).tobytes()
             for i in range(24)}  # 12 MiB through 4 MiB
    try:
        s = MooncakeDistributedStore()
        assert s.setup(cfg) == 0
        for key, blob in blobs.items():
            for _ in range(400):
                rc = s.put(key, blob)
                if rc != -200:  # no space while eviction copies to the disk
                    break
                time.sleep(0.005)
            assert rc == 0, key
        for key, blob in blobs.items():
            assert s.get(key) == blob, key
        assert s.close() == 0
        # A new client on the same directory: what the disk holds is back.
        s = MooncakeDistributedStore()
        assert s.setup(cfg) == 0
        back = [key for key, blob in blobs.items() if s.get(key) == blob]
        assert len(back) >= len(blobs) - 8, back  # 4 MiB held at most 8 of them
        missing = [key for key in blobs if key not in back]
        assert all(s.is_exist(key) == 0 for key in missing)
        assert s.close() == 0
    finally:
        stop(proc)


def test_config_from_file_and_environment(master, peer, tmp_path, monkeypatch):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "512MB", "local_buffer_size": 1 << 20, "protocol": "tcp",
        "device_name": "", "master_server_address": master, "enable_ssd_offload": False}))
    for name in ("MOONCAKE_CONFIG_PATH", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH",
                 "MOONCAKE_MASTER", "MOONCAKE_GLOBAL_SEGMENT_SIZE",
                 "MOONCAKE_LOCAL_HOSTNAME", "MOONCAKE_PROTOCOL", "MOONCAKE_TENANT_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError):
        MooncakeConfig.load_from_env()
    # SGLang's variable names the same file; Mooncake's wins where both are set.
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    assert MooncakeConfig.load_from_env().global_segment_size == 512 << 20
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                                 "global_segment_size": "1GB",
                                 "master_server_address": master}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(other))
    assert MooncakeConfig.load_from_env().global_segment_size == 1 << 30
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    cfg = MooncakeConfig.load_from_env()
    assert (cfg.global_segment_size, cfg.local_buffer_size) == (512 << 20, 1 << 20)
    assert cfg.master_server_address == master and cfg.tenant_id == "default"
    cfg.global_segment_size = 0  # a pure requester for the rest of the test
    s = MooncakeDistributedStore()
    assert s.setup(dataclasses.asdict(cfg)) == 0
    assert s.put("cfg/k", b"from a file") == 0 and s.get("cfg/k") == b"from a file"
    assert s.remove("cfg/k", True) == 0
    assert s.close() == 0
    path.write_text(json.dumps({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE"}))
    with pytest.raises(ValueError, match="master_server_address"):
        MooncakeConfig.load_from_env()
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH")
    monkeypatch.setenv("MOONCAKE_MASTER", master)
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "0")
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    cfg = MooncakeConfig.load_from_env()
    assert (cfg.metadata_server, cfg.protocol, cfg.global_segment_size) == \
        ("P2PHANDSHAKE", "tcp", 0)
    assert cfg.local_buffer_size == 1 << 30
    s = MooncakeDistributedStore()
    assert s.setup(dataclasses.asdict(cfg)) == 0
    assert s.health_check() == 0
    assert s.close() == 0


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize("example, args, says", [
    ("vllm_store_pattern.py", [], ["prefix hit 24 of 32 blocks",
                                   "(host memory), every byte as prefill wrote it"]),
    ("vllm_store_pattern.py", ["--memory", "emulated"],
     ["prefix hit 24 of 32 blocks", "(emulated memory), every byte as prefill wrote it"]),
    ("vllm_store_pattern.py", ["--memory", "cuda"],
     ["prefix hit 24 of 32 blocks", "(cuda memory), every byte as prefill wrote it"]),
    ("sglang_hicache_pattern.py", [], ["20 of 24 pages stored (prefix)",
                                       "every byte as the writer wrote it"]),
])
def test_store_pattern_examples_run(example, args, says):
    """The examples, as a user runs them (ctest does not register them:
    this test does); vLLM's with its KV caches in host, emulated device and
    (where torch sees a GPU) CUDA memory."""
    if not os.environ.get("KVLINK_MASTER"):
        pytest.skip("KVLINK_MASTER (the kvlink-master program) is not set")
    if "cuda" in args and not _cuda():
        pytest.skip("no torch with a CUDA device")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MOONCAKE_") and k != "KVLINK_DEVICE"}
    path = HERE.parent.parent / "examples" / "python" / example
    out = subprocess.run([sys.executable, str(path)] + args, capture_output=True, text=True,
                         timeout=3 * WAIT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for line in says:
        assert line in out.stdout


def test_owner_killed_gets_fail_and_write_nothing():
    """The process holding an object's bytes dies: gets of it fail (a
    negative code, b"" for get) and write nothing; a new put fails and
    leaves no object behind."""
    proc, address = start_master()
    try:
        holder = StorePeer(address, 4 << 20)  # the pool's only memory
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", address) == 0
        data = np.random.default_rng(40).integers(0, 256, 25600, dtype=np.uint8).tobytes()
        assert s.put("owned", data) == 0
        arena = np.zeros(1 << 16, np.uint8)
        base = arena.ctypes.data
        assert s.register_buffer(base, arena.nbytes) == 0
        assert s.get_into("owned", base, arena.nbytes) == len(data)
        assert arena[:len(data)].tobytes() == data
        holder.proc.kill()
        holder.proc.wait(timeout=WAIT)
        arena[:] = 7
        assert s.get_into("owned", base, arena.nbytes) < 0
        assert s.get("owned") == b""
        assert s.batch_get_into_multi_buffers(["owned"], [[base, base + 4096]],
                                              [[4096, 60000]])[0] < 0
        assert (arena == 7).all()
        assert s.put("new", b"abc") < 0  # -200 once the master has dropped the segment
        assert s.is_exist("new") == 0
        assert s.close() == 0
        holder.close()
    finally:
        stop(proc)


def test_sglang_hicache_pattern(master, peer):
    """SGLang's HiCache `mooncake` backend: setup with its transfer engine
    passed on (kvlink's client has its own: ignored) and the SSD keywords,
    the warm-up put/is_exist/get, the host KV pool registered once, pages
    put with batch_put_from as "<hash>_<tp>_k" / "_v" keys, and prefix
    semantics: the count of leading successes of batch_is_exist and
    batch_get_into."""
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 8 << 20, 16 << 20, "tcp", "", master,
                   object(), enable_ssd_offload=False, ssd_offload_path="") == 0
    try:
        assert s.remove_all(True) >= 0
        warm = bytes(4096)
        assert s.put("warmup_key_0", warm) == 0
        assert s.is_exist("warmup_key_0") == 1 and s.get("warmup_key_0") == warm
        page = 4096
        pool = np.random.default_rng(50).integers(0, 256, (16, 2, page), dtype=np.uint8)
        base = pool.ctypes.data
        assert s.register_buffer(base, pool.nbytes) == 0

        def keys(pages):
            return [f"{p:08x}_0_{kv}" for p in pages for kv in "kv"]

        def ptrs(slots):
            return [base + (slot * 2 + kv) * page for slot in slots for kv in range(2)]

        assert s.batch_put_from(keys(range(6)), ptrs(range(6)), [page] * 12) == [0] * 12
        # Another rank (the other process) stored page 7 but not page 6.
        theirs = {k: np.random.default_rng(51 + i).integers(0, 256, page, np.uint8).tobytes()
                  for i, k in enumerate(keys([7]))}
        for k, v in theirs.items():
            assert peer.call("put", key=k, hex=v.hex()) == {"rc": 0}
        exist = s.batch_is_exist(keys(range(8)))
        prefix = next((i for i, e in enumerate(exist) if e != 1), len(exist))
        assert exist == [1] * 12 + [0, 0, 1, 1] and prefix == 12
        before = pool.copy()
        got = s.batch_get_into(keys(range(8)), ptrs(range(8, 16)), [page] * 16)
        assert got == [page] * 12 + [-704, -704, page, page]
        assert np.array_equal(pool[8:14], before[0:6])
        assert np.array_equal(pool[14], before[14])  # page 6: missing, nothing written
        assert pool[15].tobytes() == b"".join(theirs.values())
        for k in keys([2]):
            want = before[2, 0 if k.endswith("_k") else 1].tobytes()
            assert peer.call("get", key=k) == {"hex": want.hex()}
        assert s.unregister_buffer(base) == 0
    finally:
        assert s.close() == 0


def test_setup_through_etcd_follows_the_elected_master(etcd, monkeypatch):
    """Two kvlink-masters stand for election through a real etcd; setup()
    names etcd (Mooncake's HA form, cluster from MC_STORE_CLUSTER_ID). The
    leader is SIGKILLed: the standby leads, the client follows it and its
    object comes back from its own segment's records."""
    path = os.environ.get("KVLINK_MASTER")
    if not path:
        pytest.skip("KVLINK_MASTER (the kvlink-master program) is not set")
    cluster = f"py{os.getpid()}"
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", cluster)
    env = dict(os.environ, KVLINK_STORE_HA_LEADER_TTL="2s")
    procs = [subprocess.Popen([path, "--listen", "127.0.0.1:0", "--threads", "2", "--enable_ha",
                               "--etcd_endpoints", etcd], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    readers = [LineReader(p.stdout) for p in procs]
    try:
        for r in readers:
            assert r.next("standing line").startswith(
                f"kvlink-master: standing for election in cluster {cluster} as ")

        def leader():  # the index of the one that says it leads
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline:
                for i, r in enumerate(readers):
                    try:
                        line = r.lines.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    if line.startswith(f"kvlink-master: leading cluster {cluster}; "):
                        return i
            pytest.fail("no master says it leads")

        first = leader()
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", "16MB", "16MB", "tcp", "",
                       f"etcd://{etcd}") == 0
        value = bytes(range(256)) * 40
        assert s.put("ha/k", value) == 0
        procs[first].kill()
        procs[first].wait()
        assert leader() == 1 - first
        got = b""
        deadline = time.monotonic() + WAIT
        while got != value and time.monotonic() < deadline:
            got = s.get("ha/k")
            time.sleep(0.1)
        assert got == value
        assert s.put("ha/after", b"x" * 1000) == 0 and s.get("ha/after") == b"x" * 1000
        assert s.close() == 0
    finally:
        for p in procs:
            stop(p)
