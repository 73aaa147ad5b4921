"""A hostile-minded HTTP server run inside a sandbox by tests/test_ports.py (python3 only).

``python3 port_server.py PORT``: ``/headers`` answers the request headers it got (as JSON),
``/big?n=N`` N bytes, ``/flood`` bytes without end, ``/redirect?to=URL`` a 302 to URL,
``/silent`` nothing ever, ``/hugehead`` a 100 KB head, ``/garbage`` no HTTP at all,
``/chunked`` a chunked body, ``POST /echo`` the body back; ``/reach?url=URL`` what fetching
URL from inside the sandbox gave (the sandbox's own reach). One thread (asyncio): under
gVisor here a process could not start threads.
"""

import asyncio
import json
import sys
import urllib.parse
import urllib.request

CHUNK = 1 << 20


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

        if method == "POST" and url.path == "/echo":
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


async def main() -> None:
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()


asyncio.run(main())
