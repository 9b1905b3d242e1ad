#!/usr/bin/env python3
"""A metadata server with the protocol of Mooncake's HTTP metadata server,
for kvlink's metadata tests (test/metadata): GET, PUT and DELETE of a value
under <path>?key=<key>; 400 without a key, 404 for a key it does not hold,
200 otherwise. Values are kept in memory only.

    http_metadata_server.py [--port N] [--path /metadata] [--token T]

Prints "PORT <n>" on stdout once it listens (port 0: any free port). With
--token, requests must carry "Authorization: Bearer <T>" (401 otherwise),
like Mooncake's server with MC_METADATA_HTTP_TOKEN.
"""
import argparse
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--path", default="/metadata")
    ap.add_argument("--token", default="")
    args = ap.parse_args()
    store = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *unused):
            pass

        def answer(self, status, body=b"", content_type="text/plain"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def key(self):
            url = urlsplit(self.path)
            if url.path != args.path:
                self.answer(404, b"no such path")
                return None
            if args.token and self.headers.get("Authorization") != "Bearer " + args.token:
                self.answer(401, b"unauthorized")
                return None
            key = parse_qs(url.query).get("key", [""])[0].strip()
            if not key:
                self.answer(400, b"metadata key is required")
                return None
            return key

        def do_GET(self):
            key = self.key()
            if key is None:
                return
            with lock:
                value = store.get(key)
            if value is None:
                self.answer(404, b"metadata not found")
            else:
                self.answer(200, value, "application/json")

        def do_PUT(self):
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            key = self.key()
            if key is None:
                return
            with lock:
                store[key] = body
            self.answer(200, b"metadata updated")

        def do_DELETE(self):
            key = self.key()
            if key is None:
                return
            with lock:
                found = store.pop(key, None) is not None
            self.answer(200 if found else 404,
                        b"metadata deleted" if found else b"metadata not found")

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print("PORT %d" % server.server_address[1], flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
