"""kvlink.mooncake.TransferEngine with a metadata server instead of
P2PHANDSHAKE: a real etcd (Debian's etcd-server) and the HTTP metadata
server of test/metadata (Mooncake's protocol). Engines publish themselves
under their local_hostname and reach each other by it. Skipped where etcd is
not installed."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvlink.mooncake import TransferEngine

from conftest import free_port  # and the etcd fixture (conftest.py)

HTTP_SERVER = Path(__file__).resolve().parents[1] / "metadata" / "http_metadata_server.py"


@pytest.fixture(scope="module")
def http_store():
    proc = subprocess.Popen([sys.executable, str(HTTP_SERVER), "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "PORT", f"http_metadata_server.py said {line}"
        yield f"http://127.0.0.1:{line[1]}/metadata"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def pair(server: str, kind: str = ""):
    """Two engines that publish themselves in `server` under their names."""
    engines, buffers = [], []
    for _ in range(2):
        eng = TransferEngine()
        name = f"127.0.0.1:{free_port()}"
        rc = (eng.initialize_ext(name, server, "tcp", "", kind) if kind
              else eng.initialize(name, server, "tcp", ""))
        assert rc == 0, f"initialize({name!r}, {server!r})"
        buf = np.zeros(1 << 16, dtype=np.uint8)
        assert eng.register_memory(buf.ctypes.data, buf.nbytes) == 0
        engines.append((eng, name))
        buffers.append(buf)
    return engines, buffers


def write_and_read_by_name(engines, buffers):
    (a, _), (b, b_name) = engines
    src, dst = buffers
    data = np.arange(5000, dtype=np.uint32).view(np.uint8)[:5000] ^ 0x5A
    src[:5000] = data
    assert a.transfer_sync_write(b_name, src.ctypes.data, dst.ctypes.data + 333, 5000) == 0
    assert dst[333:5333].tobytes() == data.tobytes()
    src[10000:15000] = 0
    assert a.transfer_sync_read(b_name, src.ctypes.data + 10000, dst.ctypes.data + 333,
                                5000) == 0
    assert src[10000:15000].tobytes() == data.tobytes()
    # A name the store does not hold: -1, not a hang.
    assert a.transfer_sync_write("127.0.0.1:1", src.ctypes.data, dst.ctypes.data, 8) == -1


@pytest.mark.parametrize("form", ["etcd://", "bare", "ext"])
def test_etcd_by_name(etcd, form, caplog):
    server = {"etcd://": f"etcd://{etcd}", "bare": etcd, "ext": etcd}[form]
    engines, buffers = pair(server, "etcd" if form == "ext" else "")
    write_and_read_by_name(engines, buffers)
    assert "127.0.0.1:1" in caplog.text  # the failed lookup names what it looked for


def test_http_metadata_server_by_name(http_store):
    engines, buffers = pair(http_store)
    write_and_read_by_name(engines, buffers)
    # initialize_ext's "http" turns a bare host:port into an http:// URL.
    host_port = http_store[len("http://"):].split("/")[0]
    eng, name = TransferEngine(), f"127.0.0.1:{free_port()}"
    assert eng.initialize_ext(name, host_port, "tcp", "", "http") == 0
    third = np.zeros(4096, dtype=np.uint8)
    assert eng.register_memory(third.ctypes.data, third.nbytes) == 0
    (a, _), _ = engines
    buffers[0][:100] = 7
    assert a.transfer_sync_write(name, buffers[0].ctypes.data, third.ctypes.data + 1, 100) == 0
    assert third[1:101].tolist() == [7] * 100 and third[0] == 0 and third[101] == 0
