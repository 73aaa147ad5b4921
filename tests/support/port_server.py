"""A hostile-minded HTTP server run inside a sandbox by tests/test_ports.py (python3 only).

``python3 port_server.py PORT``: ``/headers`` answers the request headers it got (as JSON),
``/big?n=N`` N bytes, ``/flood`` bytes without end, ``/redirect?to=URL`` a 302 to URL,
``/silent`` nothing ever, ``/hugehead`` a 100 KB head, ``/garbage`` no HTTP at all,
``/chunked`` a chunked body, ``POST /echo`` the body back; ``/reach?url=URL`` what fetching
URL from inside the sandbox gave (the sandbox's own reach). One thread (asyncio): under
gVisor here a process could not start threads.

WebSocket (hand-made: the image has the standard library only), tests/test_ports_ws.py:
``/ws`` echoes each message (text as text), answers ``headers`` with the handshake's headers
as JSON and ``close`` with a close of code 4000; it picks the subprotocol ``two`` when
offered. ``/ws/flood`` sends 1 MiB messages without end, ``/ws/huge`` one 20 MiB message,
``/ws/deaf`` reads nothing, ``/ws/refuse`` answers 403, ``/ws/badaccept`` a 101 with a wrong accept token, ``/ws/garbage``
a 101 then bytes that are no frames. ``/wsopen`` says how many WebSockets are open now.
"""

import asyncio
import base64
import hashlib
import json
import struct
import sys
import urllib.parse
import urllib.request

CHUNK = 1 << 20
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
OPEN = set()  # the WebSockets open now


def head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def reach(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return f"reached {r.status}"
    except Exception as exc:
        return f"failed {type(exc).__name__}"


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        request = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        method, target, _ = request[0].split(" ")
        headers = [line.split(": ", 1) for line in request[1:] if line]
        length = int(dict((k.lower(), v) for k, v in headers).get("content-length", "0"))
        body = await reader.readexactly(length)
        url = urllib.parse.urlsplit(target)
        query = dict(urllib.parse.parse_qsl(url.query))

        async def send(status: int, data: bytes, **extra: str) -> None:
            writer.write(head(status, {"Content-Length": str(len(data)), **extra}) + data)
            await writer.drain()

        if url.path.startswith("/ws/") or url.path == "/ws":
            await websocket(reader, writer, url.path, headers)
        elif url.path == "/wsopen":
            await send(200, str(len(OPEN)).encode())
        elif method == "POST" and url.path == "/echo":
            await send(200, body, **{"Content-Type": "application/octet-stream"})
        elif url.path == "/headers":
            await send(200, json.dumps(headers + [["path", target]]).encode())
        elif url.path == "/big":
            n = int(query["n"])
            writer.write(head(200, {"Content-Length": str(n)}))
            while n > 0 and method != "HEAD":
                writer.write(b"x" * min(CHUNK, n))
                n -= CHUNK
                await writer.drain()
        elif url.path == "/flood":
            writer.write(head(200, {}))
            while True:
                writer.write(b"f" * CHUNK)
                await writer.drain()
        elif url.path == "/redirect":
            await send(302, b"", Location=query["to"])
        elif url.path == "/hugehead":  # a head past the proxy's 64 KiB bound
            writer.write(head(200, {f"X-{i}": "h" * 1000 for i in range(100)}))
            await writer.drain()
        elif url.path == "/garbage":
            writer.write(b"SSH-2.0-not-http\r\n\r\n")
            await writer.drain()
        elif url.path == "/chunked":  # chunked, and a header trying to loosen the sandbox CSP
            writer.write(head(200, {"Transfer-Encoding": "chunked",
                                    "Content-Security-Policy": "default-src *"}))
            writer.write(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
            await writer.drain()
        elif url.path == "/silent":
            await asyncio.sleep(3600)
        elif url.path == "/reach":
            await send(200, reach(query["url"]).encode())  # blocks the loop: a test's aside
        else:
            await send(404, b"no such page")
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def frame(opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    size = bytes([n]) if n < 126 else bytes([126]) + struct.pack("!H", n) if n < 65536 else \
        bytes([127]) + struct.pack("!Q", n)
    return bytes([0x80 | opcode]) + size + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bool, bytes]:
    first, second = await reader.readexactly(2)
    n = second & 0x7F
    if n == 126:
        (n,) = struct.unpack("!H", await reader.readexactly(2))
    elif n == 127:
        (n,) = struct.unpack("!Q", await reader.readexactly(8))
    mask = await reader.readexactly(4) if second & 0x80 else b"\0\0\0\0"
    data = await reader.readexactly(n)
    pad = (mask * (n // 4 + 1))[:n]
    data = (int.from_bytes(data, "big") ^ int.from_bytes(pad, "big")).to_bytes(n, "big")
    return first & 0x0F, bool(first & 0x80), data


async def websocket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str,
                    headers: list) -> None:
    got = {k.lower(): v for k, v in headers}
    if path == "/ws/refuse":
        writer.write(head(403, {"Content-Length": "2", "X-Why": "refused"}) + b"no")
        await writer.drain()
        return
    accept = base64.b64encode(hashlib.sha1(got["sec-websocket-key"].encode() + GUID).digest())
    extra = {}
    offered = [p.strip() for p in got.get("sec-websocket-protocol", "").split(",")]
    if "two" in offered:
        extra["Sec-WebSocket-Protocol"] = "two"
    writer.write(head(101, {"Upgrade": "websocket", "Connection": "Upgrade",
                            "Sec-WebSocket-Accept": "AAAA" if path == "/ws/badaccept"
                            else accept.decode(), **extra}))
    OPEN.add(writer)
    try:
        if path == "/ws/garbage":
            writer.write(b"\xff" * 64)
            await writer.drain()
            await reader.read()
        elif path == "/ws/flood":
            while True:
                writer.write(frame(2, b"f" * CHUNK))
                await writer.drain()
        elif path == "/ws/deaf":  # reads nothing: what the client sends piles up
            await asyncio.sleep(3600)
        elif path == "/ws/huge":
            writer.write(frame(2, b"h" * (20 << 20)))
            await writer.drain()
            await reader.read()
        message, kind = b"", 1
        while True:
            opcode, fin, data = await read_frame(reader)
            if opcode == 8:
                writer.write(frame(8, data[:2]))
                await writer.drain()
                return
            if opcode == 9:
                writer.write(frame(10, data))
                continue
            if opcode in (1, 2):
                message, kind = data, opcode
            elif opcode == 0:
                message += data
            if not fin or opcode in (10,):
                continue
            if kind == 1 and message == b"headers":
                writer.write(frame(1, json.dumps(headers + [["path", path]]).encode()))
            elif kind == 1 and message == b"close":
                writer.write(frame(8, struct.pack("!H", 4000) + b"bye"))
            else:
                writer.write(frame(kind, message))
            await writer.drain()
    finally:
        OPEN.discard(writer)


async def main() -> None:
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()


asyncio.run(main())
