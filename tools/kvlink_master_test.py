#!/usr/bin/env python3
"""Runs the real kvlink-master: its ready line, GET /health, a clean exit on
SIGTERM; mooncake_master's flag names mapped onto kvlink's settings, and its
embedded metadata server (--enable_http_metadata_server) storing a value.

usage: kvlink_master_test.py PATH/TO/kvlink-master
"""
import re
import signal
import socket
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
    if not mooncake_flags(binary):
        return 1
    print("kvlink-master: ready line, /health, /metrics, SIGTERM, mooncake_master's flags, "
          "metadata server: ok")
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mooncake_flags(binary: str) -> bool:
    """mooncake_master's names and units, as a deployment passes them."""
    flags = ["--rpc_port=50061", "--rpc_address=127.0.0.1", "--default_kv_lease_ttl=5s",
             "--client_ttl=2", "--eviction_high_watermark_ratio=0.8", "--eviction_ratio=0.1",
             "--metrics_port=9013", "--allow_evict_soft_pinned_objects=false",
             "--put_start_discard_timeout_sec=40", "--max_threads=3",
             "--default_kv_soft_pin_ttl=90000"]
    out = subprocess.run([binary, *flags, "--print-settings"], capture_output=True, text=True,
                         timeout=10)
    got = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            got[parts[0]] = parts[1]
    want = {"store_listen": '"127.0.0.1:50061"', "store_http_listen": '"0.0.0.0:9013"',
            "store_lease_ttl": "5000", "store_liveness_timeout": "2000",
            "store_suspect_after": "1000", "store_heartbeat_interval": "500",
            "store_eviction_high_watermark": "80", "store_eviction_share": "10",
            "store_evict_soft_pinned": "false", "store_put_discard_timeout": "40000",
            "store_soft_pin_ttl": "90000", "threads": "3"}
    wrong = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    if out.returncode != 0 or wrong:
        print(f"--print-settings with mooncake_master's flags: status {out.returncode}, "
              f"(got, want) {wrong}; stderr {out.stderr!r}")
        return False
    for bad, says in ((["--port=1", "--listen=127.0.0.1:2"], "give one"),
                      (["--default_kv_lease_ttl=5x"], "not a duration"),
                      (["--eviction_ratio=1.5"], "between 0 and 1")):
        r = subprocess.run([binary, *bad], capture_output=True, text=True, timeout=10)
        if r.returncode != 2 or says not in r.stderr:
            print(f"{bad}: status {r.returncode}, stderr {r.stderr!r}")
            return False
    # And a real start on them: clients' port, the metrics port and the
    # metadata server, which keeps a value (Mooncake's protocol).
    port, metrics, md = free_port(), free_port(), free_port()
    proc = subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--port={port}",
                             f"--metrics_port={metrics}", "--rpc_thread_num=2",
                             "--enable_http_metadata_server=true",
                             "--http_metadata_server_host=127.0.0.1",
                             f"--http_metadata_server_port={md}"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        if lines != [f"kvlink-master: metadata server on http://127.0.0.1:{md}/metadata\n",
                     f"kvlink-master: listening on 127.0.0.1:{port} (http 0.0.0.0:{metrics})\n"]:
            print(f"mooncake_master's flags: ready lines {lines!r}")
            return False
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/health", timeout=5) as r:
            if r.status != 200:
                print(f"/health on --metrics_port answered {r.status}")
                return False
        url = f"http://127.0.0.1:{md}/metadata?key=mooncake%2Fseg"
        value = bytes(range(256)) * 64
        put = urllib.request.Request(url, data=value, method="PUT")
        with urllib.request.urlopen(put, timeout=5) as r:
            if r.status != 200:
                print(f"PUT on the metadata server answered {r.status}")
                return False
        with urllib.request.urlopen(url, timeout=5) as r:
            if r.read() != value:
                print("GET on the metadata server: not the value put")
                return False
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
