"""kvlink.StoreClient against a real kvlink-master (KVLINK_MASTER: its path,
set by ctest) and a second process that mounts the pool's memory
(store_peer_proc.py), so every byte checked here crossed between processes.
Without KVLINK_MASTER these tests are skipped, never passed."""

import asyncio
import threading

import numpy as np
import pytest

import kvlink
from store_support import WAIT, master, peer, start_master, stop  # noqa: F401 (fixtures)

PEER_SEGMENT = 8 << 20


@pytest.fixture(scope="module")
def client(master, peer):
    # A pure requester: no memory of its own in the pool, so every put and
    # get moves its bytes to or from the peer process.
    with kvlink.StoreClient(master, listen="127.0.0.1:0") as c:
        yield c


@pytest.fixture
def store(client):
    client.remove_all(force=True)
    return client


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_put_get_between_processes(store, peer):
    data = pattern(100_000, 1)
    store.put("req-1/block-0", data)
    assert peer.call("get", key="req-1/block-0") == {"hex": data.hex()}
    assert peer.call("exists", key="req-1/block-0") == {"there": True}

    theirs = pattern(70_000, 2)
    assert peer.call("put", key="req-1/block-1", hex=theirs.hex()) == {"rc": 0}
    assert store.exists("req-1/block-1")
    assert store.get("req-1/block-1") == theirs
    buf = np.zeros(80_000, np.uint8)
    assert store.get_into("req-1/block-1", buf) == len(theirs)
    assert buf[:len(theirs)].tobytes() == theirs and not buf[len(theirs):].any()
    stats = store.stats()
    assert stats["capacity"] == PEER_SEGMENT and stats["objects"] == 2


def test_get_larger_than_first_guess(store, peer):
    # get() reads into 1 MiB first, then into memory of the object's size.
    data = pattern(3 << 20, 3)
    store.put("big", data)
    assert store.get("big") == data


def test_batches_in_input_order(store, peer):
    values = [pattern(1000 + 37 * i, 10 + i) for i in range(8)]
    kinds = [bytes, bytearray, lambda b: np.frombuffer(b, np.uint8).copy(), memoryview]
    keys = [f"batch/{i}" for i in range(8)]
    assert store.put_batch(keys, [kinds[i % 4](v) for i, v in enumerate(values)]) == [0] * 8
    for i in (0, 5):
        assert peer.call("get", key=keys[i]) == {"hex": values[i].hex()}

    order = [keys[3], "batch/missing", keys[0], keys[7]]
    bufs = [np.zeros(2048, np.uint8) for _ in order]
    got = store.get_batch(order, bufs)
    assert got == [len(values[3]), -704, len(values[0]), len(values[7])]
    assert bufs[0][:got[0]].tobytes() == values[3] and not bufs[1].any()
    assert bufs[2][:got[2]].tobytes() == values[0] and bufs[3][:got[3]].tobytes() == values[7]

    assert store.exists_batch([keys[1], "nope", keys[6]]) == [1, 0, 1]
    # Gets and exists hold read leases: remove with force.
    assert store.remove_batch([keys[1], "nope", keys[6]], force=True) == [0, -704, 0]
    assert store.exists_batch([keys[1], keys[2], keys[6]]) == [0, 1, 0]
    assert peer.call("get", key=keys[1]) == {"errc": "object_not_found", "code": -704}


def test_remove_and_remove_all(store):
    store.put("r/1", b"one")
    store.remove("r/1")  # never read: no lease
    assert not store.exists("r/1")
    store.put_batch(["r/2", "r/3"], [b"two", b"three"])
    assert store.remove_all(force=True) == 2
    assert store.exists_batch(["r/2", "r/3"]) == [0, 0]


def test_first_writer_wins(store, peer):
    store.put("once", b"first")
    with pytest.raises(kvlink.Error) as e:
        store.put("once", b"second")
    assert (e.value.errc, e.value.mooncake_code) == ("object_already_exists", -705)
    assert store.put_batch(["once", "twice"], [b"third", b"new"]) == [-705, 0]
    assert peer.call("put", key="once", hex=b"fourth".hex()) == {"rc": -705}
    assert store.get("once") == b"first"
    assert peer.call("get", key="twice") == {"hex": b"new".hex()}


def test_missing_key(store):
    for call in (lambda: store.get("absent"),
                 lambda: store.get_into("absent", bytearray(16)),
                 lambda: store.remove("absent")):
        with pytest.raises(kvlink.Error) as e:
            call()
        assert (e.value.errc, e.value.mooncake_code) == ("object_not_found", -704)
        assert "absent" in str(e.value)
    assert store.exists("absent") is False


def test_bad_arguments_move_nothing(store):
    with pytest.raises(kvlink.Error, match="2 keys but 1 values") as e:
        store.put_batch(["m/1", "m/2"], [b"x"])
    assert e.value.errc == "invalid_argument"
    with pytest.raises(kvlink.Error, match="1 keys but 2 buffers"):
        store.get_batch(["m/1"], [bytearray(4), bytearray(4)])
    with pytest.raises(kvlink.Error, match="2 keys but 3 sizes"):
        store.put_batch(["m/1", "m/2"], addresses=0, sizes=[1, 2, 3])
    with pytest.raises(TypeError, match="keys must be a list"):
        store.put_batch("m/1", [b"x"])
    with pytest.raises(TypeError, match=r"keys\[1\] must be a str"):
        store.exists_batch(["m/1", 2])
    with pytest.raises(TypeError, match=r"values\[0\]: a contiguous buffer is needed"):
        store.put_batch(["m/1"], ["a str"])
    with pytest.raises(TypeError, match=r"buffers\[0\]: a writable contiguous buffer"):
        store.get_batch(["m/1"], [b"read-only bytes"])
    with pytest.raises(kvlink.Error, match="not inside memory registered") as e:
        store.put_batch(["m/1"], addresses=[np.zeros(8).ctypes.data], sizes=[8])
    assert e.value.errc == "not_registered"
    assert store.exists_batch(["m/1", "m/2"]) == [0, 0]  # nothing was put

    store.put("m/big", pattern(5000, 4))
    small = bytearray(b"\xee" * 100)
    with pytest.raises(kvlink.Error, match="the object has 5000 bytes") as e:
        store.get_into("m/big", small)
    assert (e.value.errc, e.value.mooncake_code) == ("buffer_overflow", -10)
    assert small == bytearray(b"\xee" * 100)  # untouched
    assert store.get_batch(["m/big", "m/big"], [bytearray(100), bytearray(5000)]) == [-10, 5000]


def test_registered_memory_in_place(store, peer):
    arena = np.zeros(1 << 16, np.uint8)
    seg = store.register(arena)
    src = np.frombuffer(pattern(4 * 4096, 5), np.uint8)
    arena[:src.size] = src
    base = arena.ctypes.data
    keys = [f"reg/{i}" for i in range(4)]
    addrs = np.array([base + i * 4096 for i in range(4)], np.int64)
    assert store.put_batch(keys, addresses=addrs, sizes=4096) == [0] * 4
    assert peer.call("get", key="reg/2") == {"hex": src[2 * 4096:3 * 4096].tobytes().hex()}
    dst = base + (1 << 15)
    assert store.get_batch(keys[::-1], addresses=[dst + i * 4096 for i in range(4)],
                           capacities=4096) == [4096] * 4
    back = arena[1 << 15:(1 << 15) + 4 * 4096].reshape(4, 4096)[::-1].tobytes()
    assert back == src.tobytes()
    assert store.get_into("reg/0", address=base + 60000, capacity=4096) == 4096
    assert arena[60000:64096].tobytes() == src[:4096].tobytes()
    store.unregister(seg)
    with pytest.raises(kvlink.Error, match="not inside memory registered"):
        store.get_into("reg/0", address=base, capacity=4096)


def test_pieces_gather_and_scatter(store, peer):
    """put_pieces / get_pieces: objects of several pieces each, in flat
    columns, moved without a staging copy; bad columns refused whole."""
    arena = np.zeros(1 << 16, np.uint8)
    seg = store.register(arena)
    base = arena.ctypes.data
    src = np.frombuffer(pattern(3 * 3000, 6), np.uint8)
    arena[:src.size] = src
    # Two objects: pieces 0,1 (3000 + 1000 B) and piece 2 alone (2000 B).
    addrs = [base, base + 3000, base + 6000]
    assert store.put_pieces(["pc/a", "pc/b"], addrs, [3000, 1000, 2000], [2, 1]) == [0, 0]
    assert peer.call("get", key="pc/a") == {"hex": src[:4000].tobytes().hex()}
    assert peer.call("get", key="pc/b") == {"hex": src[6000:8000].tobytes().hex()}
    # Scattered back over three pieces (the last filled as far as it goes)
    # and one, numpy columns.
    out = base + (1 << 15)
    got = store.get_pieces(["pc/a", "pc/b"],
                           np.array([out, out + 10000, out + 20000, out + 30000], np.uint64),
                           np.array([1500, 1500, 4000, 2000], np.uint64), [3, 1])
    assert got == [4000, 2000]
    o = 1 << 15
    assert arena[o:o + 1500].tobytes() + arena[o + 10000:o + 11500].tobytes() + \
        arena[o + 20000:o + 21000].tobytes() == src[:4000].tobytes()
    assert not arena[o + 21000:o + 24000].any()
    assert arena[o + 30000:o + 32000].tobytes() == src[6000:8000].tobytes()
    # Too little room: -10; a key with no bytes: -600; a missing key: -704.
    assert store.get_pieces(["pc/a"], [out], [100], [1]) == [-10]
    assert store.put_pieces(["pc/empty"], [], [], [0]) == [-600]
    assert store.get_pieces(["pc/missing"], [out], [100], [1]) == [-704]
    with pytest.raises(kvlink.Error, match="add up to 3, not to the 2"):
        store.put_pieces(["pc/x", "pc/y"], [base, base], [10, 10], [2, 1])
    with pytest.raises(kvlink.Error, match="not inside memory registered"):
        store.put_pieces(["pc/x"], [base, 4096], [10, 10], [2])
    assert store.exists_batch(["pc/x", "pc/y"]) == [0, 0]
    store.unregister(seg)


def test_device_memory_registered_and_moved(master, peer):
    """StoreClient.register of device memory (the emulated device's
    DeviceBuffer by its __cuda_array_interface__, or an address), moved by
    the address forms and the pieces, bytes read back through the device."""
    dev = kvlink.DeviceBuffer(1 << 20)
    with kvlink.StoreClient(master, listen="127.0.0.1:0", device="emulated") as c:
        c.mount(4 << 20)
        seg = c.register(dev)
        data = pattern(3 * 4096, 7)
        dev.write(0, data)
        keys = [f"dv/{i}" for i in range(3)]
        assert c.put_batch(keys, addresses=[dev.ptr + i * 4096 for i in range(3)],
                           sizes=4096) == [0] * 3
        for i, k in enumerate(keys):
            assert peer.call("get", key=k) == {"hex": data[i * 4096:(i + 1) * 4096].hex()}
            assert c.get(k) == data[i * 4096:(i + 1) * 4096]
        assert c.get_into("dv/2", address=dev.ptr + 500000, capacity=4096) == 4096
        assert dev.read(500000, 4096) == data[2 * 4096:]
        assert c.put_pieces(["dv/all"], [dev.ptr + 8192, dev.ptr], [4096, 8192], [2]) == [0]
        assert c.get("dv/all") == data[8192:] + data[:8192]
        assert peer.call("get", key="dv/all") == {"hex": (data[8192:] + data[:8192]).hex()}
        # Registered by address; pieces read into it.
        dev2 = kvlink.DeviceBuffer(1 << 16)
        seg2 = c.register(dev2.ptr, dev2.nbytes)
        assert c.get_pieces(["dv/0", "dv/all"], [dev2.ptr + 100, dev2.ptr + 9000, dev2.ptr + 20000],
                            [4096, 4096, 8192], [1, 2]) == [4096, 3 * 4096]
        assert dev2.read(100, 4096) == data[:4096]
        assert dev2.read(9000, 4096) + dev2.read(20000, 8192) == data[8192:] + data[:8192]
        c.unregister(seg2)
        c.unregister(seg)


def test_pool_full_gives_no_space():
    # A master of its own: a put refused for space asks the master for an
    # eviction round, which would take unpinned objects of other tests.
    # Every object here is hard-pinned, so that round finds nothing to take
    # whenever it runs.
    proc, address = start_master()
    try:
        with kvlink.StoreClient(address, listen="127.0.0.1:0") as store:
            store.mount(4 << 20)
            assert store.stats()["capacity"] == 4 << 20
            store.put("pinned", pattern(3 << 20, 6), hard_pin=True)
            with pytest.raises(kvlink.Error) as e:
                store.put("more", pattern(2 << 20, 7), hard_pin=True)
            assert (e.value.errc, e.value.mooncake_code) == ("no_space", -200)
            assert store.put_batch(["more", "small"], [pattern(2 << 20, 7), b"fits"],
                                   hard_pin=True) == [-200, 0]
            store.remove("pinned", force=True)
            store.put("more", pattern(2 << 20, 7), hard_pin=True)
            assert store.get("more") == pattern(2 << 20, 7)
            assert store.get("small") == b"fits"
    finally:
        stop(proc)


def test_master_unreachable_is_an_error_not_a_hang():
    # A port nobody listens on: refused at once, bounded by connect_timeout anyway.
    with kvlink.StoreClient("127.0.0.1:1", listen="127.0.0.1:0", connect_timeout=2) as c:
        with pytest.raises(kvlink.Error) as e:
            c.exists("k")
        assert e.value.errc == "rpc_failed"


def test_auth_secret(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    proc, address = start_master("--auth-secret-file", str(secret))
    try:
        with kvlink.StoreClient(address, listen="127.0.0.1:0", auth_secret="wrong") as c:
            with pytest.raises(kvlink.Error):
                c.exists("k")
        with kvlink.StoreClient(address, listen="127.0.0.1:0", auth_secret="s3cret") as c:
            c.mount(1 << 20)
            c.put("k", b"v")  # into its own segment
            assert c.get("k") == b"v"
    finally:
        stop(proc)


def test_closed_client_refuses(master):
    c = kvlink.StoreClient(master, listen="127.0.0.1:0")
    c.close()
    c.close()  # idempotent
    with pytest.raises(kvlink.Error) as e:
        c.exists("k")
    assert e.value.errc == "cancelled"


def test_threads_share_one_client(store, peer):
    # The GIL is released while a call waits: four threads at once, each
    # with its own keys, all in flight on one client.
    errors = []

    def work(t: int) -> None:
        try:
            keys = [f"t{t}/{i}" for i in range(16)]
            values = [pattern(512 + i, 100 * t + i) for i in range(16)]
            assert store.put_batch(keys, values) == [0] * 16
            bufs = [bytearray(1024) for _ in keys]
            assert store.get_batch(keys, bufs) == [len(v) for v in values]
            assert [bytes(b[:len(v)]) for b, v in zip(bufs, values)] == values
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=WAIT)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert peer.call("get", key="t3/15") == {"hex": pattern(527, 315).hex()}


def test_close_while_other_threads_call(master, peer):
    # Calls in flight when the client closes end with errc 'cancelled' (or
    # finish): none hangs, none crashes.
    c = kvlink.StoreClient(master, listen="127.0.0.1:0")
    keys = [f"close/{i}" for i in range(32)]
    assert c.put_batch(keys, [pattern(4096, i) for i in range(32)]) == [0] * 32
    started = [threading.Event() for _ in range(3)]
    outcome = []

    def work(t: int) -> None:
        try:
            while True:
                bufs = [bytearray(4096) for _ in keys]
                assert c.get_batch(keys, bufs) == [4096] * 32
                assert bytes(bufs[5]) == pattern(4096, 5)
                started[t].set()
        except kvlink.Error as e:
            outcome.append(e.errc)
        except BaseException as e:  # reported below, in the test's thread
            outcome.append(repr(e))
        finally:
            started[t].set()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for ev in started:
        assert ev.wait(WAIT)
    c.close()
    for th in threads:
        th.join(timeout=WAIT)
    assert not any(th.is_alive() for th in threads)
    assert outcome == ["cancelled"] * 3


def test_mount_a_buffer_holds_the_bytes():
    # The only memory in this master's pool is this numpy array: a put's
    # bytes land in it, and a get reads them back from it.
    proc, address = start_master()
    try:
        pool = np.zeros(1 << 20, np.uint8)
        with kvlink.StoreClient(address, listen="127.0.0.1:0") as c:
            seg = c.mount(pool)
            assert c.stats()["capacity"] == pool.nbytes
            data = pattern(10_000, 8)
            c.put("in-pool", data, preferred=[seg])
            assert data in pool.tobytes()
            assert c.get("in-pool") == data
    finally:
        stop(proc)


def test_asyncio_forms(store, peer):
    """The a-prefixed calls from one event loop, many at once: every byte
    crossed to the peer process and back; errors raise as in the blocking
    forms; the loop keeps running while they wait."""
    keys = [f"async/{i}" for i in range(32)]
    blobs = [pattern(20_000 + i, 100 + i) for i in range(32)]

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        await asyncio.gather(*(store.aput(k, b) for k, b in zip(keys, blobs)))
        got = await asyncio.gather(*(store.aget(k) for k in keys))
        assert got == blobs
        assert await store.aexists_batch(keys + ["async/none"]) == [1] * 32 + [0]
        bufs = [bytearray(len(b)) for b in blobs[:4]]
        assert await store.aget_batch(keys[:4], bufs) == [len(b) for b in blobs[:4]]
        assert [bytes(b) for b in bufs] == blobs[:4]
        one = bytearray(len(blobs[5]))
        assert await store.aget_into(keys[5], one) == len(blobs[5]) and one == blobs[5]
        # The first writer wins: -705 for the key put above.
        assert await store.aput_batch(["async/b0", keys[0]], [b"x" * 10, b"y"]) == [0, -705]
        with pytest.raises(kvlink.Error) as e:
            await store.aget("async/absent")
        assert e.value.errc == "object_not_found"
        assert await store.aexists("async/b0") is True
        await store.aremove("async/b0", force=True)
        assert await store.aremove_batch(keys, force=True) == [0] * 32
        t.cancel()
        return ticks

    assert asyncio.run(main()) > 0
    assert peer.call("exists", key=keys[0]) == {"there": False}
