"""Shared fixtures of kvlink's Python tests. They run against the package in
the build tree (ctest sets PYTHONPATH=<build>/python/site) with Debian's
interpreter; by hand:

    PYTHONPATH=build/py/python/site /usr/bin/python3 -m pytest test/python
"""

import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

try:
    importlib.import_module("kvlink")
except ImportError as e:  # a clear message instead of one error per test
    pytest.exit(f"kvlink is not importable ({e}); set PYTHONPATH=<build>/python/site", 2)

HERE = Path(__file__).resolve().parent


class PeerProcess:
    """peer_proc.py in a child process: a Mooncake-style engine to talk to."""

    def __init__(self, host: str = "127.0.0.1", size: int = 1 << 20, env=None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "peer_proc.py"), host, str(size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, **(env or {})))
        hello = json.loads(self.proc.stdout.readline())
        if "error" in hello:
            raise RuntimeError(hello["error"])
        self.session, self.base, self.size = hello["session"], hello["base"], hello["size"]

    def call(self, cmd: str, **args):
        self.proc.stdin.write(json.dumps(dict(args, cmd=cmd)) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def dump(self, offset: int, length: int) -> bytes:
        return bytes.fromhex(self.call("dump", offset=offset, length=length)["hex"])

    def fill(self, offset: int, length: int, byte: int) -> None:
        self.call("fill", offset=offset, length=length, byte=byte)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def peer_process():
    p = PeerProcess()
    yield p
    p.close()


# A real etcd (Debian's etcd-server) for the modules that need one; skipped
# where it is not installed, failed then under KVLINK_REQUIRE_ETCD=1 (CI).

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, what: str, limit: float = 20.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not start within {limit} s")


@pytest.fixture(scope="module")
def etcd():
    binary = os.environ.get("KVLINK_ETCD") or shutil.which("etcd")
    if not binary:
        if os.environ.get("KVLINK_REQUIRE_ETCD") == "1":
            pytest.fail("KVLINK_REQUIRE_ETCD=1 but etcd is not installed (Debian: etcd-server)")
        pytest.skip("etcd is not installed (Debian: etcd-server)")
    client, peer = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="kvlink-etcd-") as d:
        log = open(os.path.join(d, "etcd.log"), "w")
        proc = subprocess.Popen(
            [binary, "--name", "m0", "--data-dir", os.path.join(d, "data"),
             "--listen-client-urls", f"http://127.0.0.1:{client}",
             "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"m0=http://127.0.0.1:{peer}"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: b"true" in urllib.request.urlopen(
                f"http://127.0.0.1:{client}/health", timeout=1).read(), "etcd")
            yield f"127.0.0.1:{client}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()
