"""The other process of the Mooncake-compatibility tests: a TransferEngine
(kvlink.mooncake) with a registered numpy buffer, driven by JSON lines on
stdin, answering JSON lines on stdout. Its first line says where it is:
{"session": "127.0.0.1:PORT", "base": ADDR, "size": N}.

Commands: dump(offset, length) -> hex; fill(offset, length, byte);
notifies -> [[name, msg], ...]; register_more(size) -> base (a buffer
registered after peers connected); write_to(session, base, length, name,
msg): a transfer_sync WRITE with a TransferNotify to a peer; quit.
"""

import json
import sys

import numpy as np

from kvlink.mooncake import TransferEngine, TransferNotify, TransferOpcode


def main() -> int:
    host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    eng = TransferEngine()
    if eng.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        print(json.dumps({"error": "initialize failed"}), flush=True)
        return 1
    buf = np.zeros(size, np.uint8)
    base = buf.ctypes.data
    assert eng.register_memory(base, size) == 0
    extra = []  # keeps later buffers alive
    h = host if ":" not in host else f"[{host}]"
    print(json.dumps({"session": f"{h}:{eng.get_rpc_port()}", "base": base, "size": size}),
          flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "dump":
            o, n = req["offset"], req["length"]
            out = {"hex": buf[o:o + n].tobytes().hex()}
        elif cmd == "fill":
            o, n = req["offset"], req["length"]
            buf[o:o + n] = req["byte"]
            out = {"ok": True}
        elif cmd == "notifies":
            out = {"notifies": [[n.name, n.msg] for n in eng.get_notifies()]}
        elif cmd == "register_more":
            more = np.full(req["size"], 0x5A, np.uint8)
            extra.append(more)
            out = {"base": more.ctypes.data, "rc": eng.register_memory(more.ctypes.data, more.size)}
        elif cmd == "write_to":
            buf[:req["length"]] = 0x77
            rc = eng.transfer_sync(req["session"], base, req["base"], req["length"],
                                   TransferOpcode.Write, TransferNotify(req["name"], req["msg"]))
            out = {"rc": rc}
        elif cmd == "quit":
            print(json.dumps({"ok": True}), flush=True)
            return 0
        else:
            out = {"error": f"unknown command {cmd}"}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
