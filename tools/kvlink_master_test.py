#!/usr/bin/env python3
"""Runs the real kvlink-master: its ready line, GET /health, a clean exit on SIGTERM.

usage: kvlink_master_test.py PATH/TO/kvlink-master
"""
import re
import signal
import subprocess
import sys
import urllib.request


def main() -> int:
    binary = sys.argv[1]
    proc = subprocess.Popen(
        [binary, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.fullmatch(r"kvlink-master: listening on (\S+) \(http (\S+)\)\n", line)
        if not m:
            print(f"unexpected ready line: {line!r}; stderr: {proc.stderr.read()}")
            return 1
        with urllib.request.urlopen(f"http://{m.group(2)}/health", timeout=5) as r:
            body = r.read().decode()
            if r.status != 200 or body != "ok\n":
                print(f"/health answered {r.status} {body!r}")
                return 1
        with urllib.request.urlopen(f"http://{m.group(2)}/metrics", timeout=5) as r:
            if b"kvlink_store_clients 0" not in r.read():
                print("/metrics lacks kvlink_store_clients")
                return 1
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
        if rc != 0:
            print(f"exit status {rc} after SIGTERM; stderr: {proc.stderr.read()}")
            return 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # A bad setting is refused with a message, exit status 2.
    bad = subprocess.run([binary, "--listen", "nonsense"], capture_output=True, text=True,
                         timeout=10)
    if bad.returncode != 2 or "store_listen" not in bad.stderr:
        print(f"--listen nonsense: status {bad.returncode}, stderr {bad.stderr!r}")
        return 1
    print("kvlink-master: ready line, /health, /metrics, SIGTERM: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
