"""A hostile-minded HTTP server run inside a sandbox by tests/test_ports.py (python3 only).

``python3 port_server.py PORT``: ``/headers`` answers the request headers it got (as JSON),
``/big?n=N`` N bytes, ``/flood`` bytes without end, ``/redirect?to=URL`` a 302 to URL,
``/silent`` nothing ever, ``POST /echo`` the body back; ``/reach?url=URL`` what fetching
URL from inside the sandbox gave (the sandbox's own reach).
"""

import json
import sys
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def send_body(self, status: int, body: bytes, **headers: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/headers":
            self.send_body(200, json.dumps([[k, v] for k, v in self.headers.items()] +
                                           [["path", self.path]]).encode())
        elif url.path == "/big":
            n = int(query["n"])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = b"x" * (1 << 20)
            while n > 0:
                self.wfile.write(chunk[:n])
                n -= len(chunk)
        elif url.path == "/flood":
            self.send_response(200)
            self.end_headers()
            chunk = b"f" * (1 << 20)
            while True:
                self.wfile.write(chunk)
        elif url.path == "/redirect":
            self.send_body(302, b"", Location=query["to"])
        elif url.path == "/silent":
            time.sleep(3600)
        elif url.path == "/reach":
            try:
                with urllib.request.urlopen(query["url"], timeout=3) as r:
                    got = f"reached {r.status}"
            except Exception as exc:
                got = f"failed {type(exc).__name__}"
            self.send_body(200, got.encode())
        else:
            self.send_body(404, b"no such page")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_body(200, body, **{"Content-Type": "application/octet-stream"})

    def log_message(self, *args: object) -> None:
        pass


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
