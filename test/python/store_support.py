"""What the store's tests share: a real kvlink-master (KVLINK_MASTER: its
path, set by ctest; without it the tests are skipped, never passed) and a
second process that mounts the pool's memory (store_peer_proc.py)."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WAIT = 60  # seconds any one answer of a child may take before the test fails


class LineReader:
    """A child's stdout, line by line, with a bounded wait for each line."""

    def __init__(self, stream) -> None:
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put("")  # end of output

    def next(self, what: str) -> str:
        try:
            return self.lines.get(timeout=WAIT)
        except queue.Empty:
            pytest.fail(f"{what}: no line within {WAIT} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def start_master(*extra: str) -> tuple:
    path = os.environ.get("KVLINK_MASTER")
    if not path:
        pytest.skip("KVLINK_MASTER (the kvlink-master program) is not set")
    if not os.access(path, os.X_OK):
        pytest.fail(f"KVLINK_MASTER={path} is not a program: build the kvlink-master target")
    # Its log goes to a file: a pipe nobody reads would stop it once full.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([path, "--listen", "127.0.0.1:0", "--threads", "2", *extra],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    line = LineReader(proc.stdout).next("kvlink-master's ready line")
    m = re.match(r"kvlink-master: listening on (\S+)", line)
    if not m:
        stop(proc)
        log.seek(0)
        pytest.fail(f"kvlink-master: unexpected ready line {line!r}: {log.read()}")
    log.close()  # the master keeps its own descriptor
    return proc, m.group(1)


class StorePeer:
    """store_peer_proc.py: another process, with a mounted segment."""

    def __init__(self, master: str, size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "store_peer_proc.py"), master, str(size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.out = LineReader(self.proc.stdout)
        hello = json.loads(self.out.next("store peer's first line") or '{"error": "exited"}')
        if "error" in hello:
            stop(self.proc)
            pytest.fail(f"store peer: {hello['error']}")
        self.segment, self.address = hello["segment"], hello["address"]

    def call(self, cmd: str, **args):
        self.proc.stdin.write(json.dumps(dict(args, cmd=cmd)) + "\n")
        self.proc.stdin.flush()
        line = self.out.next(f"store peer's answer to {cmd}")
        assert line, f"the store peer exited (status {self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call("quit")
            self.proc.wait(timeout=WAIT)
        stop(self.proc)


# Fixtures the store's test modules import (pytest finds a fixture imported
# into a test module as if it were defined there).

@pytest.fixture(scope="module")
def master():
    """A kvlink-master process for the test module: its address."""
    proc, address = start_master()
    yield address
    stop(proc)


@pytest.fixture(scope="module")
def peer(master, request):
    """A second process that mounts the module's PEER_SEGMENT bytes (8 MiB
    where the module names none)."""
    p = StorePeer(master, getattr(request.module, "PEER_SEGMENT", 8 << 20))
    yield p
    p.close()


@pytest.fixture
def mooncake_store(master, peer):
    """A MooncakeDistributedStore that is a pure requester (no segment of its
    own: every object's bytes live in the peer process), the pool emptied."""
    from kvlink.mooncake_store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
    assert s.remove_all(True) >= 0
    yield s
    assert s.close() == 0
