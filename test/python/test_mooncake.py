"""kvlink.mooncake against another process: every method of Mooncake's
TransferEngine that vLLM and SGLang use, with the bytes that arrived checked
and bad input answered by Mooncake's negative results, memory untouched."""

import logging
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from conftest import PeerProcess
from kvlink.mooncake import (Read, TransferEngine, TransferNotify, TransferOpcode, Write)

SIZE = 1 << 20


@pytest.fixture(scope="module")
def local():
    """This process's engine and a registered numpy buffer."""
    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(SIZE, np.uint8)
    assert eng.register_memory(buf.ctypes.data, buf.nbytes) == 0
    yield eng, buf
    assert eng.unregister_memory(buf.ctypes.data) == 0


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def session_of(eng: TransferEngine) -> str:
    return f"127.0.0.1:{eng.get_rpc_port()}"


# ----------------------------------------------------------------- set-up

def test_initialize_and_rpc_port(local):
    eng, _ = local
    port = eng.get_rpc_port()
    assert 0 < port < 65536
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # once only


def test_initialize_refusals(caplog):
    with caplog.at_level(logging.ERROR, "kvlink.mooncake"):
        assert TransferEngine().initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") == -1
        assert "redis" in caplog.text and "metadata server" in caplog.text
        assert TransferEngine().initialize_ext("127.0.0.1", "127.0.0.1:6379", "tcp", "",
                                               "redis") == -1
        assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
        assert "nvlink" in caplog.text
        # A store nobody runs: -1 naming its URL, not a hang.
        caplog.clear()
        assert TransferEngine().initialize_ext("127.0.0.1", "127.0.0.1:1", "tcp", "", "etcd") == -1
        assert "etcd://127.0.0.1:1" in caplog.text
    assert TransferEngine().get_rpc_port() == -1  # before initialize
    assert TransferEngine().transfer_sync_write("127.0.0.1:1", 1, 1, 1) == -1


def test_rdma_falls_back_visibly(caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, "kvlink.mooncake"):
        eng = TransferEngine()
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    if "rdma" in eng._engine.transports.split(" (", 1)[0].split(","):
        pytest.skip("this machine has a usable RDMA device: nothing falls back")
    assert "TCP" in caplog.text
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    forced = TransferEngine()
    assert forced.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    assert forced._engine.transports == "tcp"


def test_positional_only_and_keywords(local, peer_process):
    eng, buf = local
    with pytest.raises(TypeError):
        TransferEngine().initialize(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE",
                                    protocol="tcp", device_name="")
    with pytest.raises(TypeError):
        eng.get_rpc_port(self=None)
    # The transfer calls take keywords, with Mooncake's names.
    buf[:16] = 9
    assert eng.transfer_sync_write(target_hostname=peer_process.session, buffer=buf.ctypes.data,
                                   peer_buffer_address=peer_process.base, length=16,
                                   transport_hint="") == 0
    assert peer_process.dump(0, 16) == bytes([9]) * 16


def test_get_engine_fails_loudly(local):
    eng, _ = local
    with pytest.raises(NotImplementedError, match="get_engine"):
        eng.get_engine()
    assert TransferEngine.TransferOpcode is TransferOpcode
    assert (int(Read), int(Write)) == (0, 1) and TransferOpcode.READ is TransferOpcode.Read


# -------------------------------------------------------------- transfers

def test_transfer_sync_write_and_read(local, peer_process):
    eng, buf = local
    data = pattern(4096, 1)
    buf[:4096] = data
    assert eng.transfer_sync_write(peer_process.session, buf.ctypes.data,
                                   peer_process.base + 1000, 4096) == 0
    assert peer_process.dump(1000, 4096) == data.tobytes()
    buf[8192:8192 + 4096] = 0
    assert eng.transfer_sync_read(peer_process.session, buf.ctypes.data + 8192,
                                  peer_process.base + 1000, 4096) == 0
    assert buf[8192:8192 + 4096].tobytes() == data.tobytes()


def test_batch_sync_scattered(local, peer_process):
    eng, buf = local
    n, block = 256, 512
    data = pattern(n * block, 2)
    buf[:n * block] = data
    src = [buf.ctypes.data + i * block for i in range(n)]
    dst = [peer_process.base + (n - 1 - i) * (block + 64) for i in range(n)]  # reversed, gaps
    assert eng.batch_transfer_sync_write(peer_process.session, src, dst, [block] * n) == 0
    remote = peer_process.dump(0, n * (block + 64))
    for i in range(n):
        o = (n - 1 - i) * (block + 64)
        assert remote[o:o + block] == data[i * block:(i + 1) * block].tobytes()
    buf[:n * block] = 0
    assert eng.batch_transfer_sync_read(peer_process.session, np.array(src, np.uint64),
                                        np.array(dst, np.uint64), np.full(n, block)) == 0
    assert buf[:n * block].tobytes() == data.tobytes()


def test_transfer_sync_opcodes_and_notify(local, peer_process):
    eng, buf = local
    peer_process.call("notifies")  # drain
    buf[:100] = 42
    assert eng.transfer_sync(peer_process.session, buf.ctypes.data, peer_process.base, 100,
                             TransferOpcode.Write, TransferNotify("req-1", "kv ready")) == 0
    assert peer_process.dump(0, 100) == bytes([42]) * 100
    buf[:100] = 0
    assert eng.batch_transfer_sync(peer_process.session, [buf.ctypes.data], [peer_process.base],
                                   [100], Read, TransferNotify(name="req-2", msg="read done")) == 0
    assert buf[:100].tobytes() == bytes([42]) * 100
    deadline = time.time() + 10
    got = []
    while len(got) < 2 and time.time() < deadline:
        got += peer_process.call("notifies")["notifies"]
        time.sleep(0.02)
    assert got == [["req-1", "kv ready"], ["req-2", "read done"]]


def test_get_notifies_here(local, peer_process):
    eng, buf = local
    eng.get_notifies()  # drain
    buf[:64] = 0
    out = peer_process.call("write_to", session=session_of(eng), base=buf.ctypes.data, length=64,
                            name="from-peer", msg="hello")
    assert out["rc"] == 0
    assert buf[:64].tobytes() == bytes([0x77]) * 64  # the data came before the notification
    notes = eng.get_notifies()
    for _ in range(200):
        if notes:
            break
        time.sleep(0.01)
        notes = eng.get_notifies()
    assert [(n.name, n.msg) for n in notes] == [("from-peer", "hello")]


def test_batch_async_and_status(local, peer_process):
    eng, buf = local
    data = pattern(64 * 1024, 3)
    buf[:data.size] = data
    ids = [eng.batch_transfer_async_write(peer_process.session, [buf.ctypes.data + i * 16384],
                                          [peer_process.base + 200000 + i * 16384], [16384])
           for i in range(4)]
    assert all(i > 0 for i in ids) and len(set(ids)) == 4
    assert eng.get_batch_transfer_status(ids) == 0
    assert peer_process.dump(200000, data.size) == data.tobytes()
    buf[:data.size] = 0
    rid = eng.batch_transfer_async_read(peer_process.session, [buf.ctypes.data],
                                        [peer_process.base + 200000], [data.size])
    rid2 = eng.batch_transfer_async(peer_process.session, [buf.ctypes.data + data.size],
                                    [peer_process.base + 200000], [16], TransferOpcode.Read)
    assert rid > 0 and rid2 > 0
    assert eng.get_batch_transfer_status([rid, rid2]) == 0
    assert buf[:data.size].tobytes() == data.tobytes()
    assert eng.get_batch_transfer_status([rid]) == -1  # already collected


def test_submit_write_and_check_status(local, peer_process):
    eng, buf = local
    buf[:333] = 17
    bid = eng.transfer_submit_write(peer_process.session, buf.ctypes.data,
                                    peer_process.base + 5000, 333)
    assert bid > 0
    status = 0
    for _ in range(1000):
        status = eng.transfer_check_status(bid)
        if status != 0:
            break
        time.sleep(0.005)
    assert status == 1
    assert peer_process.dump(5000, 333) == bytes([17]) * 333
    assert eng.transfer_check_status(bid) == -1  # collected
    assert eng.transfer_check_status(987654321) == -1


def test_probe_and_first_buffer(local, peer_process):
    eng, _ = local
    assert eng.send_probe(peer_process.session) == 0
    assert eng.get_first_buffer_address(peer_process.session) == peer_process.base
    assert eng.send_probe("127.0.0.1:1") != 0
    assert eng.get_first_buffer_address("127.0.0.1:1") == 0


def test_late_registration_reaches_peers(local, peer_process):
    eng, buf = local
    assert eng.send_probe(peer_process.session) == 0  # connected before it registers more
    more = peer_process.call("register_more", size=4096)
    assert more["rc"] == 0
    buf[:4096] = 0
    rc = -1
    for _ in range(100):  # the new segment travels over the control channel
        rc = eng.transfer_sync_read(peer_process.session, buf.ctypes.data, more["base"], 4096)
        if rc == 0:
            break
        time.sleep(0.02)
    assert rc == 0 and buf[:4096].tobytes() == bytes([0x5A]) * 4096


def test_managed_buffers(local, peer_process):
    eng, _ = local
    addr = eng.allocate_managed_buffer(8192)
    assert addr != 0 and addr % 4096 == 0
    assert eng.write_bytes_to_buffer(addr, b"managed bytes!", 14) == 0
    assert eng.read_bytes_from_buffer(addr, 14) == b"managed bytes!"
    assert eng.transfer_sync_write(peer_process.session, addr, peer_process.base + 9000, 14) == 0
    assert peer_process.dump(9000, 14) == b"managed bytes!"
    assert eng.write_bytes_to_buffer(addr, b"short", 100) == -1  # never reads past the data
    assert eng.free_managed_buffer(addr, 8192) == 0
    assert eng.free_managed_buffer(addr, 8192) == -1
    assert eng.allocate_managed_buffer(0) == 0


def test_register_calls(local):
    eng, _ = local
    bufs = [np.zeros(4096, np.uint8) for _ in range(3)]
    addrs = [b.ctypes.data for b in bufs]
    assert eng.batch_register_memory(addrs, [4096] * 3) == 0
    # Mooncake's error codes (its error.h): ERR_ADDRESS_OVERLAPPED (-7),
    # ERR_ADDRESS_NOT_REGISTERED (-3), ERR_INVALID_ARGUMENT (-1).
    assert eng.register_memory(addrs[0], 4096) == -7  # overlapping
    assert eng.batch_unregister_memory(addrs) == 0
    assert eng.unregister_memory(addrs[0]) == -3  # unknown
    assert eng.batch_unregister_memory([addrs[0]]) == -3
    assert eng.batch_register_memory(addrs, [4096] * 2) == -1  # mismatched lengths
    # All or nothing: the second overlaps the first, so neither stays.
    assert eng.batch_register_memory([addrs[1], addrs[1] + 100], [4096, 100]) == -7
    assert eng.register_memory(addrs[1], 4096) == 0 and eng.unregister_memory(addrs[1]) == 0
    assert eng.register_memory(addrs[2], 4096, "cuda:0") == -1
    assert eng.register_memory(addrs[2], 4096, location="cpu:0") == 0
    assert eng.unregister_memory(addrs[2]) == 0


def test_ten_threads_at_once(local, peer_process):
    """vLLM calls batch_transfer_sync_write from a pool of threads."""
    eng, buf = local
    threads, per, block = 10, 32, 1024
    data = pattern(threads * per * block, 4)
    buf[:data.size] = data
    results = [None] * threads
    start = threading.Barrier(threads)

    def push(t: int) -> None:
        src = [buf.ctypes.data + (t * per + i) * block for i in range(per)]
        dst = [peer_process.base + 300000 + (t * per + i) * block for i in range(per)]
        start.wait()
        results[t] = eng.batch_transfer_sync_write(peer_process.session, src, dst, [block] * per)

    ts = [threading.Thread(target=push, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results == [0] * threads
    assert peer_process.dump(300000, data.size) == data.tobytes()


# -------------------------------------------------------------- bad input

def test_bad_input_leaves_memory_untouched(local, peer_process, caplog):
    eng, buf = local
    peer_process.fill(0, 4096, 0xEE)
    before = peer_process.dump(0, 4096)
    buf[:4096] = 1
    stray = np.zeros(4096, np.uint8)  # never registered
    base, s = peer_process.base, peer_process.session
    with caplog.at_level(logging.ERROR, "kvlink.mooncake"):
        assert eng.transfer_sync_write(s, stray.ctypes.data, base, 4096) == -1
        assert eng.transfer_sync_write(s, buf.ctypes.data, base + SIZE - 10, 100) == -1
        assert eng.transfer_sync_write(s, buf.ctypes.data, base + 10 * SIZE, 100) == -1
        # One good entry and one bad: nothing moves.
        assert eng.batch_transfer_sync_write(s, [buf.ctypes.data, stray.ctypes.data],
                                             [base, base + 100], [100, 100]) == -1
        assert eng.batch_transfer_sync_write(s, [buf.ctypes.data] * 2, [base], [100, 100]) == -1
        # Mooncake's values for a batch refused at submission: 0 from
        # batch_transfer_async_*, its (batch_id_t)-1 (2**64 - 1) from
        # transfer_submit_write.
        assert eng.batch_transfer_async_write(s, [buf.ctypes.data], [base, base], [1]) == 0
        assert eng.batch_transfer_async_write(s, [buf.ctypes.data], [base + 10 * SIZE], [1]) == 0
        assert eng.transfer_submit_write(s, buf.ctypes.data, base + 10 * SIZE, 10) == 2**64 - 1
        # An unregistered local buffer is the engine's to refuse, after
        # submission: the id fails when it is checked.
        bid = eng.batch_transfer_async_write(s, [stray.ctypes.data], [base], [1])
        assert bid not in (0, 2**64 - 1) and eng.get_batch_transfer_status([bid]) == -1
        bid = eng.transfer_submit_write(s, stray.ctypes.data, base, 10)
        assert bid not in (0, 2**64 - 1)
        status = 0
        while status == 0:
            status = eng.transfer_check_status(bid)
        assert status == -1
    assert peer_process.dump(0, 4096) == before
    assert "not registered" in caplog.text and "entries" in caplog.text
    stray[:] = 3
    assert eng.transfer_sync_read(s, stray.ctypes.data, base, 4096) == -1
    assert (stray == 3).all()


def test_a_bad_peer_address_names_the_remote_side(local, peer_process, caplog):
    eng, buf = local
    base, s = peer_process.base, peer_process.session
    bad = base + 10 * SIZE
    with caplog.at_level(logging.ERROR, "kvlink.mooncake"):
        assert eng.transfer_sync_write(s, buf.ctypes.data, bad, 100) == -1
    said = caplog.text
    assert f"remote address {bad:#x} is not inside any segment the peer" in said, said
    assert f"{base:#x}+" in said  # the peer's segments, for comparison
    assert "register the buffer" not in said  # not the local side
    caplog.clear()
    with caplog.at_level(logging.ERROR, "kvlink.mooncake"):
        assert eng.batch_transfer_sync_read(s, [buf.ctypes.data], [base + SIZE - 10], [100]) == -1
    assert f"remote address {base + SIZE - 10:#x} + 100 bytes runs past the end" in caplog.text


def test_unknown_sessions_fail_fast(local):
    eng, buf = local
    for name in ("unreachable_peer:9", "127.0.0.1:1", "not a session"):
        t = time.monotonic()
        assert eng.transfer_sync_write(name, buf.ctypes.data, 0x1000, 8) == -1
        assert eng.batch_transfer_sync_read(name, [buf.ctypes.data], [0x1000], [8]) == -1
        # Mooncake: openSegment fails, and its `return -1` of a uint64
        # batch id reaches Python as 2**64 - 1 (issue 28).
        assert eng.batch_transfer_async_write(name, [buf.ctypes.data], [0x1000], [8]) == 2**64 - 1
        assert eng.batch_transfer_async_read(name, [buf.ctypes.data], [0x1000], [8]) == 2**64 - 1
        assert eng.batch_transfer_async(name, [buf.ctypes.data], [0x1000], [8],
                                        TransferOpcode.Write) == 2**64 - 1
        assert eng.transfer_submit_write(name, buf.ctypes.data, 0x1000, 8) == 2**64 - 1
        assert eng.transfer_check_status(2**64 - 1) == -1
        assert eng.get_batch_transfer_status([0]) == -1
        assert time.monotonic() - t < 15, name


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["localhost", "::1"])
def test_localhost_and_ipv6(host):
    if host == "::1" and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    peer = PeerProcess(host=host, size=65536)
    try:
        eng = TransferEngine()
        assert eng.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0
        buf = np.full(4096, 0x3C, np.uint8)
        assert eng.register_memory(buf.ctypes.data, buf.nbytes) == 0
        # How vLLM builds a session name: f"{host}:{port}", brackets or not.
        name = f"{host}:{peer.session.rpartition(':')[2]}"
        assert eng.transfer_sync_write(name, buf.ctypes.data, peer.base, 4096) == 0
        assert peer.dump(0, 4096) == buf.tobytes()
        assert eng.unregister_memory(buf.ctypes.data) == 0
    finally:
        peer.close()


def test_transfer_timeout_bounds_a_stalled_peer(monkeypatch):
    """MC_TRANSFER_TIMEOUT (at least 5 s) bounds a transfer to a peer that
    stopped answering; the call returns -1 instead of hanging. Over TCP: on
    this host the drop-in would pick shm, whose cross-memory attach writes into
    a stopped process once its lease was granted, so the WRITE may rightly
    complete (it did in about 1 run of 20, when the grant came before
    SIGSTOP)."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")  # Mooncake's floor makes it 5 s
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    peer = PeerProcess(size=64 << 20)
    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.ones(64 << 20, np.uint8)
    assert eng.register_memory(buf.ctypes.data, buf.nbytes) == 0
    assert eng.send_probe(peer.session) == 0
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        rc = eng.transfer_sync_write(peer.session, buf.ctypes.data, peer.base, buf.nbytes)
        took = time.monotonic() - t
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        peer.close()
    assert rc == -1
    assert 4 < took < 5 + 0.07 + 2 + 5, took  # timeout + 1 s/GB + fence_timeout + slack
    assert eng.unregister_memory(buf.ctypes.data) == 0


def test_same_host_peer_gets_shm(local, peer_process, monkeypatch):
    """The drop-in reaches a peer on this host with kvlink's one-copy shm
    transport (protocol "tcp" included); MC_FORCE_TCP=1 keeps it on TCP."""
    eng, _ = local
    peer = eng._engine.connect(peer_process.session)
    assert peer.transport == "shm", peer.transport_reason
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    forced = TransferEngine()
    assert forced.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    p = forced._engine.connect(peer_process.session)
    assert p.transport == "tcp"
    assert p.transport_reason == "tcp"
