"""The other process of the store tests: a kvlink.StoreClient that mounts a
segment (its memory holds the pool's bytes) and is driven by JSON lines on
stdin, answering JSON lines on stdout. Its first line:
{"segment": ID, "address": "host:port"} or {"error": "..."}.

usage: store_peer_proc.py MASTER SEGMENT_BYTES

Commands: put(key, hex) -> {"rc": int}; get(key) -> {"hex": ...} or
{"errc": name, "code": int}; exists(key) -> {"there": bool}; quit.
"""

import json
import sys

import kvlink


def main() -> int:
    master, size = sys.argv[1], int(sys.argv[2])
    try:
        store = kvlink.StoreClient(master, listen="127.0.0.1:0", request_timeout=10)
        seg = store.mount(size)
    except kvlink.Error as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1
    print(json.dumps({"segment": seg, "address": store.local_address}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "put":
            out = {"rc": store.put_batch([req["key"]], [bytes.fromhex(req["hex"])])[0]}
        elif cmd == "get":
            try:
                out = {"hex": store.get(req["key"]).hex()}
            except kvlink.Error as e:
                out = {"errc": e.errc, "code": e.mooncake_code}
        elif cmd == "exists":
            out = {"there": store.exists(req["key"])}
        elif cmd == "quit":
            store.close()
            print(json.dumps({"ok": True}), flush=True)
            return 0
        else:
            out = {"error": f"unknown command {cmd}"}
        print(json.dumps(out), flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
