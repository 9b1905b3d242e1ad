"""Device (GPU) memory from Python, on the emulated device (no GPU needed:
its memory faults on any CPU access and is reached only through its copy
engine): kvlink.DeviceBuffer, Engine registration of device memory
(__cuda_array_interface__, DLPack, plain addresses) and transfers between
device memory on one engine and host memory on another, bytes checked
through the copy engine; the Mooncake drop-in with "cuda:0" locations and
its *_on_cuda calls; the vLLM-pattern example with both KV caches in device
memory. That a CPU touch of emulated device memory faults is
left to the C++ tests of the emulated device (a fault here would end pytest)."""

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvlink
from conftest import PeerProcess
from kvlink.mooncake import TransferEngine

MiB = 1 << 20


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class CudaArray:
    """A foreign device array: only __cuda_array_interface__ (and optionally
    __dlpack_device__), over a DeviceBuffer's memory."""

    def __init__(self, buf, shape=None, typestr="|u1", strides=None, readonly=False,
                 dlpack=None):
        self.buf = buf
        self.__cuda_array_interface__ = {
            "shape": shape or (buf.nbytes,), "typestr": typestr, "strides": strides,
            "data": (buf.ptr, readonly), "version": 3}
        if dlpack is not None:
            self.__dlpack_device__ = lambda: dlpack


class DLPackOnly:
    """A CUDA DLPack object without __cuda_array_interface__, torch-style
    data_ptr()/nbytes (or without them: `addressable=False`)."""

    def __init__(self, buf, addressable=True):
        self.buf = buf
        if addressable:
            self.data_ptr = lambda: buf.ptr
            self.nbytes = buf.nbytes

    def __dlpack_device__(self):
        return (2, 0)


# --------------------------------------------------------------- DeviceBuffer

def test_device_buffer_round_trip():
    buf = kvlink.DeviceBuffer(3 * MiB + 7)
    assert (buf.nbytes, buf.device, buf.runtime, len(buf)) == (3 * MiB + 7, 0, "emulated",
                                                               3 * MiB + 7)
    assert buf.ptr != 0
    data = pattern(buf.nbytes, 1)
    buf.write(0, data)
    assert buf.read(0, buf.nbytes) == data
    buf.write(12345, b"kvlink")                     # bytes
    buf.write(99, bytearray(b"\x01\x02\x03"))       # any contiguous buffer
    buf.write(1000, np.arange(16, dtype=np.uint32))
    assert buf.read(12345, 6) == b"kvlink" and buf.read(99, 3) == b"\x01\x02\x03"
    assert buf.read(1000, 64) == np.arange(16, dtype=np.uint32).tobytes()
    assert buf.read(buf.nbytes, 0) == b""


def test_device_buffer_interface_and_errors():
    buf = kvlink.DeviceBuffer(4096, device=1)
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (4096,) and cai["typestr"] == "|u1"
    assert cai["data"] == (buf.ptr, False) and buf.device == 1
    assert kvlink.address_of(buf) == buf.ptr
    with pytest.raises(kvlink.Error) as e:
        buf.read(4000, 97)
    assert e.value.errc == "out_of_bounds"
    with pytest.raises(kvlink.Error) as e:
        buf.write(4095, b"ab")
    assert e.value.errc == "out_of_bounds"
    with pytest.raises(kvlink.Error) as e:
        kvlink.DeviceBuffer(4096, runtime="no_such_runtime")
    assert e.value.errc == "invalid_argument" and "no_such_runtime" in str(e.value)
    with pytest.raises(kvlink.Error) as e:
        kvlink.DeviceBuffer(4096, runtime="none")
    assert e.value.errc == "no_device" and "emulated" in str(e.value)
    with pytest.raises(kvlink.Error):
        kvlink.DeviceBuffer(4096, device=7)  # the emulated device has devices 0 and 1


# ------------------------------------------------------------------- Engine

@pytest.fixture(scope="module")
def engines():
    """An engine with the emulated device and one with host memory only."""
    a = kvlink.Engine(transports="tcp", device="emulated", use_env=False)
    b = kvlink.Engine(transports="tcp", device="none", use_env=False)
    host = bytearray(4 * MiB)
    seg = b.register(host)
    peer = a.connect(b.local_address)
    yield a, b, host, seg, peer
    a.close()
    b.close()


def test_engine_device_setting(monkeypatch):
    with kvlink.Engine(device="emulated", use_env=False) as e:
        assert e.device_runtime == "emulated" and e.config["device"] == "emulated"
    with kvlink.Engine(device="none", use_env=False) as e:
        assert e.device_runtime is None
    monkeypatch.setenv("KVLINK_DEVICE", "emulated")
    with kvlink.Engine() as e:
        assert e.device_runtime == "emulated"
    with pytest.raises(kvlink.Error) as err:
        kvlink.Engine(device="bogus", use_env=False)
    assert "bogus" in str(err.value)


@pytest.mark.parametrize("n,off_local,off_remote", [(1, 0, 0), (4097, 3, 5),
                                                     (3 * MiB + 11, 17, 1)])
def test_write_from_device_read_into_device(engines, n, off_local, off_remote):
    a, _, host, seg, peer = engines
    buf = kvlink.DeviceBuffer(n + off_local)
    sid = a.register(buf)
    try:
        data = pattern(n, n)
        buf.write(off_local, data)
        a.write(peer, buf.ptr + off_local, off_remote, n, segment=seg)
        assert bytes(host[off_remote:off_remote + n]) == data
        back = pattern(n, n + 1)
        host[off_remote:off_remote + n] = back
        a.read(peer, buf.ptr + off_local, off_remote, n, segment=seg)
        assert buf.read(off_local, n) == back
    finally:
        a.unregister(sid)


def test_batch_mixing_device_and_host(engines):
    a, _, host, seg, peer = engines
    dev = kvlink.DeviceBuffer(MiB)
    mem = np.zeros(MiB, np.uint8)
    a.register(dev)
    a.register(mem)
    dev_data, host_data = pattern(MiB, 7), pattern(MiB, 8)
    dev.write(0, dev_data)
    mem[:] = np.frombuffer(host_data, np.uint8)
    local = [dev.ptr, kvlink.address_of(mem), dev.ptr + 4096]
    a.write(peer, local, [0, MiB, 2 * MiB], [MiB, MiB, 100], segment=seg)
    assert bytes(host[:MiB]) == dev_data
    assert bytes(host[MiB:2 * MiB]) == host_data
    assert bytes(host[2 * MiB:2 * MiB + 100]) == dev_data[4096:4196]
    for s in a.segments():
        a.unregister(s.id)


def test_register_address_and_bytes_through_the_copy_engine(engines):
    a, _, host, seg, peer = engines
    buf = kvlink.DeviceBuffer(64 * 1024)
    sid = a.register(buf.ptr, buf.nbytes)  # the runtime finds device memory at an address
    try:
        a._core.write_bytes(buf.ptr + 10, b"through the copy engine")
        assert a._core.read_bytes(buf.ptr + 10, 23) == b"through the copy engine"
        assert buf.read(10, 23) == b"through the copy engine"
        a.write(peer, buf.ptr + 10, 100, 23, segment=seg)
        assert bytes(host[100:123]) == b"through the copy engine"
    finally:
        a.unregister(sid)


def test_cuda_array_interface_and_dlpack_objects(engines):
    a, _, host, seg, peer = engines
    buf = kvlink.DeviceBuffer(8192)
    # A 2-D float32 array: C-contiguous, registered whole.
    arr = CudaArray(buf, shape=(16, 128), typestr="<f4", strides=(512, 4), dlpack=(2, 0))
    sid = a.register(arr)
    assert [s.length for s in a.segments() if s.id == sid] == [8192]
    a.unregister(sid)
    sid = a.register(DLPackOnly(buf))
    buf.write(0, b"dlpack")
    a.write(peer, buf.ptr, 0, 6, segment=seg)
    assert bytes(host[:6]) == b"dlpack"
    a.unregister(sid)
    for bad, words in [
            (CudaArray(buf, shape=(16, 64), typestr="<f4", strides=(512, 4)), "contiguous"),
            (CudaArray(buf, readonly=True), "read-only"),
            (DLPackOnly(buf, addressable=False), "DLPack")]:
        with pytest.raises(kvlink.Error) as e:
            a.register(bad)
        assert e.value.errc == "invalid_argument" and words in str(e.value)
    assert a.segments() == []


def test_device_memory_needs_a_device_runtime(engines):
    _, b, _, _, _ = engines  # device="none"
    buf = kvlink.DeviceBuffer(4096)
    with pytest.raises(kvlink.Error) as e:
        b.register(buf)
    assert e.value.errc == "invalid_argument" and "device runtime" in str(e.value)
    with pytest.raises(kvlink.Error):
        b.register(buf.ptr, buf.nbytes, device=0)


def test_write_into_a_device_target():
    """Device memory on the target side: over TCP it needs the target's
    staging (the tcp branch of issue 23); expected to pass once merged."""
    with kvlink.Engine(transports="tcp", device="none", use_env=False) as a, \
            kvlink.Engine(transports="tcp", device="emulated", use_env=False) as b:
        src = bytearray(pattern(MiB + 3, 11))
        a.register(src)
        dst = kvlink.DeviceBuffer(MiB + 3)
        seg = b.register(dst)
        peer = a.connect(b.local_address)
        a.write(peer, kvlink.address_of(src), 0, len(src), segment=seg, deadline=20)
        assert dst.read(0, len(src)) == bytes(src)


# ------------------------------------------------------------ Mooncake drop-in

@pytest.fixture(scope="module")
def remote():
    p = PeerProcess()
    yield p
    p.close()


@pytest.fixture
def mooncake(monkeypatch):
    monkeypatch.setenv("KVLINK_DEVICE", "emulated")
    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert eng._engine.device_runtime == "emulated"
    yield eng
    eng._engine.close()


def test_mooncake_cuda_location(mooncake, remote):
    eng = mooncake
    buf = kvlink.DeviceBuffer(MiB)
    assert eng.register_memory(buf.ptr, buf.nbytes, "cuda:0") == 0
    data = pattern(MiB, 21)
    buf.write(0, data)
    assert eng.transfer_sync_write(remote.session, buf.ptr + 1, remote.base + 2, 4099) == 0
    assert remote.dump(2, 4099) == data[1:4100]
    remote.fill(0, 8192, 0xAB)
    assert eng.transfer_sync_read(remote.session, buf.ptr + 3, remote.base, 8192) == 0
    assert buf.read(3, 8192) == b"\xab" * 8192
    # write_bytes_to_buffer / read_bytes_from_buffer go through the copy engine.
    assert eng.write_bytes_to_buffer(buf.ptr + 100, b"mooncake", 8) == 0
    assert eng.read_bytes_from_buffer(buf.ptr + 100, 8) == b"mooncake"
    assert eng.unregister_memory(buf.ptr) == 0


def test_mooncake_on_cuda(mooncake, remote):
    eng = mooncake
    a, b = kvlink.DeviceBuffer(64 * 1024), kvlink.DeviceBuffer(64 * 1024, device=1)
    assert eng.batch_register_memory([a.ptr, b.ptr], [a.nbytes, b.nbytes],
                                     "cuda:0") == 0
    data = pattern(64 * 1024, 31)
    a.write(0, data)
    assert eng.transfer_write_on_cuda(remote.session, a.ptr, remote.base, 4096) is None
    assert remote.dump(0, 4096) == data[:4096]
    eng.transfer_read_on_cuda(remote.session, b.ptr + 5, remote.base, 4096, 0)
    assert b.read(5, 4096) == data[:4096]
    eng.batch_transfer_write_on_cuda(remote.session, [a.ptr + 4096, a.ptr + 8192],
                                     [remote.base + 10000, remote.base + 20000], [100, 200],
                                     stream_ptr=0)
    assert remote.dump(10000, 100) == data[4096:4196]
    assert remote.dump(20000, 200) == data[8192:8392]
    remote.fill(30000, 300, 0x3C)
    eng.batch_transfer_read_on_cuda(remote.session, [b.ptr, b.ptr + 1000],
                                    [remote.base + 30000, remote.base + 30100], [300, 200])
    assert b.read(0, 300) == b"\x3c" * 300 and b.read(1000, 200) == b"\x3c" * 200
    # Failures raise (Mooncake's stream callback would end the process).
    with pytest.raises(RuntimeError):
        eng.transfer_write_on_cuda(remote.session, a.ptr, remote.base + remote.size, 4096)
    with pytest.raises(RuntimeError):
        eng.batch_transfer_read_on_cuda(remote.session, [a.ptr], [remote.base], [1, 2])
    assert eng.batch_unregister_memory([a.ptr, b.ptr]) == 0


def test_mooncake_cuda_location_without_a_runtime(monkeypatch, caplog):
    monkeypatch.setenv("KVLINK_DEVICE", "none")
    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = kvlink.DeviceBuffer(4096)
    with caplog.at_level(logging.ERROR, "kvlink.mooncake"):
        assert eng.register_memory(buf.ptr, buf.nbytes, "cuda:0") == -1
        assert "device runtime" in caplog.text and "cuda:0" in caplog.text
        caplog.clear()
        assert eng.batch_register_memory([buf.ptr], [buf.nbytes], "cuda:0") == -1
        assert "device runtime" in caplog.text
        assert eng.register_memory(buf.ptr, buf.nbytes, "npu:0") == -1
    eng._engine.close()


# ------------------------------------------------------ vLLM's pattern, on device

def test_vllm_pattern_example_with_device_kv_caches():
    """examples/python/vllm_pattern.py --memory emulated: prefill and decode
    in two processes, each KV cache one DeviceBuffer per layer registered as
    "cuda:0"; decode checks every block's bytes through the copy engine."""
    example = Path(__file__).resolve().parents[2] / "examples" / "python" / "vllm_pattern.py"
    done = subprocess.run([sys.executable, str(example), "--memory", "emulated"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "emulated memory on both sides" in done.stdout, done.stdout
    assert "results {0}, blocks with wrong bytes: 0" in done.stdout, done.stdout
