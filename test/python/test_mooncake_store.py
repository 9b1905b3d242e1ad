"""kvlink.mooncake_store.MooncakeDistributedStore (what `import mooncake.store`
gives through the alias) against a real kvlink-master (KVLINK_MASTER, set by
ctest; skipped without it) and a second process that mounts the pool's
memory, with Mooncake's integer results and every byte checked."""

import ctypes

import numpy as np
import pytest

from kvlink.mooncake_store import (MooncakeDistributedStore, MooncakeHostMemAllocator,
                                   ReplicaStatus, ReplicateConfig, SoftPinAction)
from store_support import master, peer, start_master, stop  # noqa: F401 (fixtures)
from store_support import mooncake_store as store  # noqa: F401 (a fixture)


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_put_get_exist_remove(store, peer):
    data = blob(50_000, 1)
    assert store.put("m/1", data) == 0
    assert peer.call("get", key="m/1") == {"hex": data.hex()}
    assert store.get("m/1") == data
    assert store.get_size("m/1") == len(data)
    assert store.put("m/1", b"again") == 0  # exists: Mooncake counts it a success
    assert store.get("m/1") == data         # the first writer's bytes stay
    assert store.get("m/missing") == b""
    assert store.get_size("m/missing") == -704
    assert store.is_exist("m/1") == 1 and store.is_exist("m/missing") == 0
    theirs = blob(3000, 2)
    assert peer.call("put", key="m/2", hex=theirs.hex()) == {"rc": 0}
    assert store.batch_is_exist(["m/2", "m/missing", "m/1"]) == [1, 0, 1]
    assert store.get_batch(["m/2", "m/missing"]) == [theirs, b""]
    assert store.put_parts("m/3", b"ab", bytearray(b"cd"), np.frombuffer(b"ef", np.uint8)) == 0
    assert store.get("m/3") == b"abcdef"
    assert store.put_batch(["m/4", "m/5"], [b"four", b"five"]) == 0
    assert store.remove("m/4") == 0  # never read: no lease
    assert store.is_exist("m/4") == 0
    assert store.batch_remove(["m/5", "m/missing"], True) == [0, -704]
    assert store.remove_all(True) == 3
    assert store.get_hostname().startswith("127.0.0.1:")
    assert store.health_check() == 0


def test_zero_copy_registered_buffers(store, peer):
    arena = np.zeros(1 << 16, np.uint8)
    base = arena.ctypes.data
    assert store.register_buffer(base, arena.nbytes) == 0
    src = np.frombuffer(blob(4 * 4096, 3), np.uint8)
    arena[:src.size] = src
    keys = [f"z/{i}" for i in range(4)]
    assert store.batch_put_from(keys, [base + i * 4096 for i in range(4)], [4096] * 4) == [0] * 4
    assert store.put_from("z/0", base, 4096) == 0  # exists: 0
    assert peer.call("get", key="z/3") == {"hex": src[3 * 4096:].tobytes().hex()}
    out = base + (1 << 15)
    got = store.batch_get_into(keys[::-1], [out + i * 4096 for i in range(4)], [4096] * 4)
    assert got == [4096] * 4
    assert arena[1 << 15:(1 << 15) + 4 * 4096].reshape(4, 4096)[::-1].tobytes() == src.tobytes()
    assert store.get_into("z/1", out, 100) == -600            # buffer too small
    plain = np.zeros(4096, np.uint8)
    assert store.get_into("z/1", plain.ctypes.data, 4096) == -600   # not registered
    assert not plain.any()
    assert store.batch_get_into(["z/1"], [out, out], [4096]) == [-600]  # lengths differ
    assert store.batch_put_from(["y/1", "y/2"], [base], [8, 8]) == [-600, -600]
    assert store.batch_is_exist(["y/1", "y/2"]) == [0, 0]      # nothing was put
    assert store.unregister_buffer(base) == 0
    assert store.unregister_buffer(base) == -600


def test_pool_full_then_space_after_remove():
    proc, address = start_master()
    try:
        s = MooncakeDistributedStore()
        # Its own 4 MiB segment (a size as Mooncake's configs write it).
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", "4MB", "16MB", "tcp", "", address) == 0
        # Hard-pinned, all of them: the eviction round a refused put asks
        # for finds nothing to take, whenever it runs.
        pinned = ReplicateConfig()
        pinned.with_hard_pin = True
        assert s.put("pinned", blob(3 << 20, 4), pinned) == 0
        assert s.put("more", blob(2 << 20, 5), pinned) == -200  # vLLM backs off on this
        assert s.put_batch(["more"], [blob(2 << 20, 5)], pinned) == -200
        assert s.remove("pinned", True) == 0
        assert s.put("more", blob(2 << 20, 5), pinned) == 0
        assert s.get("more") == blob(2 << 20, 5)
        assert s.close() == 0
    finally:
        stop(proc)


def test_replica_descriptors(store, peer, master):
    """batch_get_replica_desc: each replica's owner, offset and size; keys
    without an object left out; no read lease taken."""
    other = MooncakeDistributedStore()  # a second holder: 4 MiB of its own
    assert other.setup("127.0.0.1", "P2PHANDSHAKE", "4MB", "16MB", "tcp", "", master) == 0
    try:
        two = ReplicateConfig()
        two.replica_num = 2
        two.soft_pin_action = SoftPinAction.ENABLE
        data = blob(100_000, 7)
        assert store.put("d/two", data, two) == 0
        assert store.put("d/one", b"x" * 10) == 0
        got = store.batch_get_replica_desc(["d/two", "d/missing", "d/one"])
        assert set(got) == {"d/two", "d/one"}
        assert len(got["d/two"]) == 2 and len(got["d/one"]) == 1
        endpoints = set()
        for r in got["d/two"]:
            assert r.status == ReplicaStatus.COMPLETE
            assert r.is_memory_replica() and not r.is_disk_replica()
            assert not r.is_local_disk_replica()
            d = r.get_memory_descriptor().buffer_descriptor
            assert d.size == 100_000 and d.buffer_address + d.size <= 8 << 20
            endpoints.add(d.transport_endpoint)
        assert endpoints == {peer.address, other.get_hostname()}
        with pytest.raises(RuntimeError):
            got["d/one"][0].get_disk_descriptor()
        assert store.get_replica_desc("d/missing") == []
        assert [r.get_memory_descriptor().buffer_descriptor.size
                for r in other.get_replica_desc("d/one")] == [10]
        # Described, not read: no lease, so a plain remove succeeds; after a
        # get it is refused while the lease runs (-706).
        assert store.remove("d/two") == 0
        assert store.get("d/one") == b"x" * 10
        assert store.remove("d/one") == -706
        assert store.batch_get_replica_desc([]) == {}
    finally:
        assert other.close() == 0


def test_host_memory_allocator(store, peer):
    """MooncakeHostMemAllocator: memory to register and move from."""
    alloc = MooncakeHostMemAllocator()
    base = alloc.alloc(1 << 20)
    assert base % 4096 == 0
    view = (ctypes.c_ubyte * (1 << 20)).from_address(base)
    data = blob(8192, 8)
    ctypes.memmove(base, data, len(data))
    assert store.register_buffer(base, 1 << 20) == 0
    assert store.batch_put_from(["h/0", "h/1"], [base, base + 4096], [4096, 4096]) == [0, 0]
    assert peer.call("get", key="h/1") == {"hex": data[4096:].hex()}
    assert store.get_into("h/0", base + (1 << 19), 4096) == 4096
    assert bytes(view[1 << 19:(1 << 19) + 4096]) == data[:4096]
    del view
    assert store.unregister_buffer(base) == 0
    assert alloc.free(base) == 0
    assert alloc.free(base) == -1
    with pytest.raises(ValueError):
        alloc.alloc(0)


def _device_memory_moves(s, peer, ptr: int, nbytes: int, write, read, tag: str) -> None:
    """put_from / get_into / their batches / the multi-buffer calls with
    device memory registered as vLLM registers its KV cache (an address),
    bytes read back through the device and from the peer process."""
    assert s.register_buffer(ptr, nbytes) == 0
    host = np.zeros(1 << 16, np.uint8)
    assert s.register_buffer(host.ctypes.data, host.nbytes) == 0
    data = blob(3 * 4096, 40)
    write(0, data)
    keys = [f"{tag}/{i}" for i in range(3)]
    # Three objects from device memory: into this client's own segment or
    # the peer's (wherever the master places them), read by the peer.
    assert s.batch_put_from(keys, [ptr + i * 4096 for i in range(3)], [4096] * 3) == [0] * 3
    for i, k in enumerate(keys):
        assert peer.call("get", key=k) == {"hex": data[i * 4096:(i + 1) * 4096].hex()}
    # Back into device memory, reversed, and one into host memory.
    out = 1 << 18
    got = s.batch_get_into(keys[::-1], [ptr + out + i * 4096 for i in range(3)], [4096] * 3)
    assert got == [4096] * 3
    assert read(out, 3 * 4096) == data[2 * 4096:] + data[4096:2 * 4096] + data[:4096]
    assert s.get_into(keys[1], host.ctypes.data, 4096) == 4096
    assert host[:4096].tobytes() == data[4096:2 * 4096]
    # An object the peer put, into device memory.
    theirs = blob(5000, 41)
    assert peer.call("put", key=f"{tag}/theirs", hex=theirs.hex()) == {"rc": 0}
    assert s.get_into(f"{tag}/theirs", ptr + (1 << 19), 8192) == 5000
    assert read(1 << 19, 5000) == theirs
    # One object gathered from device, host and device pieces (vLLM's
    # per-layer K/V of a block), scattered back over other pieces.
    host[8192:8192 + 1000] = np.frombuffer(blob(1000, 42), np.uint8)
    pieces = [ptr, host.ctypes.data + 8192, ptr + 2 * 4096]
    sizes = [4096, 1000, 4096]
    whole = data[:4096] + host[8192:9192].tobytes() + data[2 * 4096:3 * 4096]
    assert s.batch_put_from_multi_buffers([f"{tag}/block"], [pieces], [sizes]) == [0]
    assert peer.call("get", key=f"{tag}/block") == {"hex": whole.hex()}
    back = [ptr + (3 << 18), host.ctypes.data + 20000, ptr + (3 << 18) + 8192]
    assert s.batch_get_into_multi_buffers([f"{tag}/block"], [back], [[3000, 3000, 8192]]) \
        == [len(whole)]
    assert read(3 << 18, 3000) == whole[:3000]
    assert host[20000:23000].tobytes() == whole[3000:6000]
    assert read((3 << 18) + 8192, len(whole) - 6000) == whole[6000:]
    # Pieces holding fewer bytes than the object: -600, nothing written.
    before = read(700_000, 4096)
    assert s.batch_get_into_multi_buffers([f"{tag}/block"], [[ptr + 700_000]], [[4096]]) \
        == [-600]
    assert read(700_000, 4096) == before
    assert s.unregister_buffer(host.ctypes.data) == 0
    assert s.unregister_buffer(ptr) == 0


def test_device_memory_moves_like_host_memory(master, peer, monkeypatch):
    """Device memory (here the emulated device's, which faults on any CPU
    access: a CPU copy of it would end the test) registered with
    register_buffer and moved by every buffer call; the client's own
    segment is host memory, so its copies go through the device's stream."""
    import kvlink
    monkeypatch.setenv("KVLINK_DEVICE", "emulated")
    dev = kvlink.DeviceBuffer(1 << 20)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", "4MB", "16MB", "tcp", "", master) == 0
    try:
        _device_memory_moves(s, peer, dev.ptr, dev.nbytes, dev.write, dev.read, "dev")
    finally:
        assert s.close() == 0


def test_cuda_tensors_move_like_host_memory(master, peer):
    """The same with torch CUDA tensors and the real CUDA runtime (the
    engine's default "auto" device runtime): skipped without torch and a GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")

    def write(offset: int, data: bytes) -> None:
        t[offset:offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
        torch.cuda.synchronize()

    def read(offset: int, n: int) -> bytes:
        torch.cuda.synchronize()
        return t[offset:offset + n].cpu().numpy().tobytes()

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", "4MB", "16MB", "tcp", "", master) == 0
    try:
        _device_memory_moves(s, peer, t.data_ptr(), t.numel(), write, read, "cuda")
    finally:
        assert s.close() == 0


def test_setup_failures_give_minus_one(master):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", "127.0.0.1:1") == -1
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", "redis://127.0.0.1:6379") == -1
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", "lots", 0, "tcp", "", master) == -1
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "nvlink", "", master) == -1
    assert s.put("k", b"v") == -600 and s.get("k") == b"" and s.is_exist("k") == -1
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == -1  # twice
    assert s.close() == 0


def test_get_buffer_and_batch_get_buffer(store, peer):
    small, big = blob(5000, 21), blob((3 << 20) + 17, 22)  # big: past the first guess
    assert peer.call("put", key="buf/small", hex=small.hex()) == {"rc": 0}
    assert store.put("buf/big", big) == 0
    assert store.put("buf/empty-ish", b"x") == 0
    hs = store.batch_get_buffer(["buf/big", "buf/missing", "buf/small", "buf/empty-ish"])
    assert hs[1] is None
    for h, want in ((hs[0], big), (hs[2], small), (hs[3], b"x")):
        assert bytes(h) == want and len(h) == h.size() == len(want)
        assert ctypes.string_at(h.ptr(), h.size()) == want   # ptr() is where the bytes are
        assert np.frombuffer(h, np.uint8).tobytes() == want  # the buffer protocol, in place
    # Again, after a call that saw the big one.
    again = store.batch_get_buffer(["buf/small", "buf/big"])
    assert [bytes(h) for h in again] == [small, big]
    assert bytes(store.get_buffer("buf/small")) == small
    assert store.get_buffer("buf/missing") is None
    assert store.batch_get_buffer([]) == []
    assert MooncakeDistributedStore().batch_get_buffer(["buf/small"]) == [None]


def test_get_hostname_is_the_given_name_with_the_engines_port(master):
    s = MooncakeDistributedStore()
    assert s.get_hostname() == ""
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0
    try:
        host, port = s.get_hostname().rsplit(":", 1)
        assert host == "localhost"            # as given, not resolved
        assert 12300 <= int(port) <= 14300    # none given: one of Mooncake's
        assert s._store.local_address.endswith(f":{port}")  # where the engine listens
    finally:
        assert s.close() == 0
    # A port given is the one used, and named.
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    t = MooncakeDistributedStore()
    assert t.setup(f"127.0.0.1:{free}", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0
    try:
        assert t.get_hostname() == f"127.0.0.1:{free}"
    finally:
        assert t.close() == 0


def test_get_into_ranges(store, peer):
    a, b = blob(5000, 31), blob(300, 32)
    assert store.put("rng/a", a) == 0
    assert peer.call("put", key="rng/b", hex=b.hex()) == {"rc": 0}
    arena = np.full(1 << 14, 0x5F, np.uint8)
    base = arena.ctypes.data
    assert store.register_buffer(base, 8192) == 0  # the second half is not registered
    two = base + 4096
    got = store.get_into_ranges(
        [base, two],
        [["rng/a", "rng/b"], ["rng/b", "rng/a", "rng/missing"]],
        [[[0, 1100], [1200]], [[0], [64, 1000], [0]]],
        [[[4000, 0], [299]], [[10], [4999, 17], [0]]],
        [[[1000, 50], [1]], [[20], [1, 3000], [8]]])
    assert got == [[[1000, 50], [1]], [[20], [1, 3000], [-704]]]
    assert arena[0:1000].tobytes() == a[4000:5000]
    assert arena[1100:1150].tobytes() == a[0:50]
    assert arena[1200:1201].tobytes() == b[299:300]
    assert arena[4096:4116].tobytes() == b[10:30]
    assert arena[4096 + 64:4096 + 65].tobytes() == a[4999:5000]
    assert arena[4096 + 1000:4096 + 4000].tobytes() == a[17:3017]
    assert arena[1000:1100].tobytes() == b"\x5f" * 100  # nothing between the ranges
    # Past the object, past registered memory, negative, lists of different
    # lengths, no ranges: a code per range (or per key); the rest land.
    arena[:] = 0x5F
    got = store.get_into_ranges(
        [base], [["rng/a", "rng/b", "rng/a", "rng/b", "rng/a"]],
        [[[0, 8190, 10], [2000], [-1], [0, 1], []]],
        [[[4990, 0, 0], [0], [0], [0], []]],
        [[[11, 4, 5], [300], [1], [1], []]])
    assert got == [[[-600, -600, 5], [300], [-600], [-600], []]]
    assert arena[10:15].tobytes() == a[0:5]
    assert arena[2000:2300].tobytes() == b
    assert arena[0:10].tobytes() == b"\x5f" * 10
    assert arena[8190:].tobytes() == b"\x5f" * (len(arena) - 8190)  # never past registered memory
    # Outer lists of different lengths: nothing, and the reason logged.
    assert store.get_into_ranges([base, two], [["rng/a"]], [[[0]]], [[[0]]], [[[1]]]) == []
    assert store.get_into_ranges([], [], [], [], []) == []
    assert store.unregister_buffer(base) == 0
    assert store.get_into_ranges([base], [["rng/a"]], [[[0]]], [[[0]]], [[[1]]]) == [[[-600]]]
