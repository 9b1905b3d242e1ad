"""Shared fixtures of kvlink's Python tests. They run against the package in
the build tree (ctest sets PYTHONPATH=<build>/python/site) with Debian's
interpreter; by hand:

    PYTHONPATH=build/py/python/site /usr/bin/python3 -m pytest test/python
"""

import importlib
import json
import os
import subprocess
import sys
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
