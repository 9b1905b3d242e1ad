"""The kvlink package's own API: config, registration of buffers, transfers
(blocking, from threads, from asyncio), notifications and errors."""

import asyncio
import datetime
import threading
import time

import numpy as np
import pytest

import kvlink


@pytest.fixture(scope="module")
def pair():
    """Two engines in this process, a registered buffer on each."""
    a, b = kvlink.Engine(transports="tcp"), kvlink.Engine(transports="tcp")
    src, dst = np.zeros(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    a.register(src)
    seg = b.register(dst)
    peer = a.connect(b.local_address)
    yield a, b, src, dst, seg, peer
    a.close()
    b.close()


def fill(arr: np.ndarray, seed: int) -> np.ndarray:
    arr[:] = np.random.default_rng(seed).integers(0, 256, arr.size, dtype=np.uint8)
    return arr


# ------------------------------------------------------------------ config

def test_config_table_and_kwargs():
    names = {row["name"] for row in kvlink.config_table()}
    assert {"listen", "transfer_deadline", "tcp_lanes", "slice_size"} <= names
    cfg = kvlink.make_config(tcp_lanes=4, slice_size="4MiB",
                             transfer_deadline=datetime.timedelta(seconds=2), use_env=False)
    assert (cfg["tcp_lanes"], cfg["slice_size"], cfg["transfer_deadline"]) == (4, 4 << 20, 2000)
    assert "tcp_lanes" in kvlink.describe(tcp_lanes=4)
    with kvlink.Engine({"tcp_lanes": 3}, connect_timeout="1s") as e:
        assert e.config["tcp_lanes"] == 3 and e.config["connect_timeout"] == 1000


def test_config_errors_name_the_setting(monkeypatch):
    with pytest.raises(kvlink.Error) as e:
        kvlink.make_config(no_such_setting=1)
    assert e.value.errc == "invalid_argument" and "no_such_setting" in str(e.value)
    with pytest.raises(kvlink.Error, match="min_chunk"):
        kvlink.Engine(slice_size=1024, min_chunk=4096)
    monkeypatch.setenv("KVLINK_TCP_LANES", "3")
    assert kvlink.make_config()["tcp_lanes"] == 3
    assert kvlink.make_config(use_env=False)["tcp_lanes"] != 3


def test_listen_error_is_a_kvlink_error():
    with kvlink.Engine() as a:
        with pytest.raises(kvlink.Error) as e:
            kvlink.Engine(listen=a.listen_address)
    assert e.value.errc == "EADDRINUSE" and e.value.category == "system"


# ------------------------------------------------------------ registration

def test_register_buffers():
    with kvlink.Engine() as e:
        arr = np.zeros(4096, np.uint8)
        ba = bytearray(8192)
        s1, s2 = e.register(arr), e.register(ba, access="read")
        infos = {s.id: s for s in e.segments()}
        assert infos[s1].base == kvlink.address_of(arr) and infos[s1].length == 4096
        assert infos[s2].access == "read" and infos[s2].length == 8192
        with pytest.raises(kvlink.Error) as err:
            e.register(kvlink.address_of(arr) + 100, 10)
        assert err.value.errc == "overlapping_registration"
        with pytest.raises(BufferError):
            e.register(b"read-only bytes")
        e.unregister(s1)
        with pytest.raises(kvlink.Error) as err:
            e.unregister(s1)
        assert err.value.errc == "not_registered"
        e.register(kvlink.address_of(arr), arr.nbytes)  # by address now


# --------------------------------------------------------------- transfers

def test_write_and_read_by_address(pair):
    a, b, src, dst, seg, peer = pair
    fill(src[:65536], 1)
    r = a.write(peer, kvlink.address_of(src), kvlink.address_of(dst) + 100, 65536)
    assert r.bytes == 65536 and r.requests == 1
    assert dst[100:100 + 65536].tobytes() == src[:65536].tobytes()
    src[:65536] = 0
    a.read(peer, kvlink.address_of(src), kvlink.address_of(dst) + 100, 65536)
    assert src[:65536].tobytes() == dst[100:100 + 65536].tobytes()


@pytest.mark.parametrize("kind", ["list", "numpy", "numpy_int64"])
def test_batches_by_segment_offset(pair, kind):
    a, b, src, dst, seg, peer = pair
    n, block = 2000, 128
    fill(src[:n * block], 2)
    dst[:] = 0
    perm = np.random.default_rng(3).permutation(n).astype(np.uint64)
    local = kvlink.address_of(src) + np.arange(n, dtype=np.uint64) * block
    offsets = perm * block
    if kind == "list":
        local, offsets = local.tolist(), offsets.tolist()
    elif kind == "numpy_int64":
        local, offsets = local.astype(np.int64), offsets.astype(np.int64)
    r = a.write(peer, local, offsets, block, segment=seg)
    assert r.requests == n and r.bytes == n * block
    got = dst[:n * block].reshape(n, block)
    want = src[:n * block].reshape(n, block)
    assert (got[perm.astype(np.int64)] == want).all()


def test_mismatched_columns_move_nothing(pair):
    a, b, src, dst, seg, peer = pair
    dst[:] = 7
    with pytest.raises(kvlink.Error) as e:
        a.write(peer, [kvlink.address_of(src)] * 3, [0, 8], 8, segment=seg)
    assert e.value.errc == "invalid_argument" and "entries" in str(e.value)
    with pytest.raises(TypeError):
        a.write(peer, ["x"], [0], 8, segment=seg)
    with pytest.raises(ValueError):
        a.write(peer, [-1], [0], 8, segment=seg)
    assert (dst == 7).all()


def test_errors_carry_errc(pair):
    a, b, src, dst, seg, peer = pair
    stray = np.zeros(64, np.uint8)
    dst[:] = 5
    cases = [
        (dict(local=kvlink.address_of(stray), remote=0, lengths=64, segment=seg), "not_registered"),
        (dict(local=kvlink.address_of(src), remote=dst.size - 10, lengths=64, segment=seg),
         "out_of_bounds"),
        (dict(local=kvlink.address_of(src), remote=0, lengths=64, segment=seg + 1000),
         "not_registered"),
        (dict(local=kvlink.address_of(src), remote=kvlink.address_of(dst) + dst.size - 10,
              lengths=64), "out_of_bounds"),
        (dict(local=kvlink.address_of(src), remote=8, lengths=64), "not_registered"),
    ]
    for kw, errc in cases:
        with pytest.raises(kvlink.Error) as e:
            a.write(peer, kw["local"], kw["remote"], kw["lengths"], segment=kw.get("segment"))
        assert e.value.errc == errc, (kw, str(e.value))
        assert e.value.category == "kvlink" and e.value.message
    assert (dst == 5).all()


def test_threads_at_once(pair):
    a, b, src, dst, seg, peer = pair
    fill(src[:10 * 32768], 4)
    dst[:] = 0
    errors = []

    def worker(t: int) -> None:
        try:
            for i in range(5):
                o = t * 32768 + i * 4096
                a.write(peer, kvlink.address_of(src) + o, o, 4096, segment=seg)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(10)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for t in range(10):
        o = t * 32768
        assert dst[o:o + 5 * 4096].tobytes() == src[o:o + 5 * 4096].tobytes()


def test_asyncio_does_not_block_the_loop(pair):
    a, b, src, dst, seg, peer = pair
    fill(src, 5)
    dst[:] = 0

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        chunk = src.size // 8
        results = await asyncio.gather(*[
            a.awrite(peer, kvlink.address_of(src) + i * chunk, i * chunk, chunk, segment=seg)
            for i in range(8)])
        stop.set()
        await t
        return results, ticks

    results, ticks = asyncio.run(main())
    assert sum(r.bytes for r in results) == src.size
    assert dst.tobytes() == src.tobytes()
    assert ticks > 0  # the loop kept running while the transfers were in flight


def test_asyncio_cancellation_waits_for_the_fence(pair):
    a, b, src, dst, seg, peer = pair

    async def main():
        task = asyncio.create_task(
            a.awrite(peer, kvlink.address_of(src), 0, src.size, segment=seg))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
            return "completed"  # it may finish before the cancellation lands
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(main()) in ("completed", "cancelled")
    # Whatever happened, the engine is fine afterwards.
    a.write(peer, kvlink.address_of(src), 0, 16, segment=seg)


def test_operation_handle(pair):
    a, b, src, dst, seg, peer = pair
    op = a.submit(kvlink.WRITE, peer, kvlink.address_of(src), 0, 4096, segment=seg)
    assert op.wait(10) and op.done()
    assert op.result().bytes == 4096
    called = threading.Event()
    op.add_done_callback(called.set)  # already done: called at once
    assert called.is_set()


# ----------------------------------------------------------- notifications

def test_notifications_blocking_and_after_data(pair):
    a, b, src, dst, seg, peer = pair
    assert b.recv_notification(timeout=0.05) is None
    fill(src[:1000], 6)
    a.write(peer, kvlink.address_of(src), 0, 1000, segment=seg, notify=("done-1", b"meta"))
    n = b.recv_notification(timeout=10)
    assert (n.id, n.payload, n.sender) == ("done-1", b"meta", a.local_address)
    assert dst[:1000].tobytes() == src[:1000].tobytes()
    a.send_notification(peer, "free", "blocks 1-3")
    assert b.recv_notification(timeout=10).payload == b"blocks 1-3"


def test_notifications_async_and_none_lost(pair):
    a, b, src, dst, seg, peer = pair

    async def main():
        waiter = asyncio.create_task(b.arecv_notification())
        await asyncio.sleep(0.01)
        await a.asend_notification(peer, "x1")
        first = await waiter
        # A cancelled receiver never swallows a notification.
        abandoned = asyncio.create_task(b.arecv_notification())
        await asyncio.sleep(0.01)
        await a.asend_notification(peer, "x2")
        abandoned.cancel()
        await asyncio.gather(abandoned, return_exceptions=True)
        second = abandoned.result() if not abandoned.cancelled() else await b.arecv_notification()
        return first, second

    first, second = asyncio.run(main())
    assert (first.id, second.id) == ("x1", "x2")


def test_closed_engine():
    e = kvlink.Engine()
    e.close()
    e.close()  # idempotent
    with pytest.raises(kvlink.Error) as err:
        e.connect("127.0.0.1:1")
    assert err.value.errc == "cancelled"


def test_connect_failure():
    with kvlink.Engine(connect_timeout="2s") as e:
        t = time.monotonic()
        with pytest.raises(kvlink.Error) as err:
            e.connect("127.0.0.1:1")
        assert err.value.errc in ("peer_unreachable", "ECONNREFUSED")
        assert time.monotonic() - t < 5
