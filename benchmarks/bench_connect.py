"""``dsec bench --only connect``: dsec's hand-written Connect server and protobuf codec
(``dsec.compat.connect``, ``dsec.compat.proto``) against the ``connectrpc`` library with
``protobuf-py`` messages (what the e2b SDK 2.63 itself speaks), serving the same handlers
behind the same uvicorn (``connect_servers.py``), alternating batches (``bench.compare``):

- a unary call (``Filesystem/Stat``, JSON, the e2b SDK's codec for unary calls);
- a server stream of 100 output chunks of 4 KiB (``Process/Start``, binary envelopes), read
  to its end.

No sandbox is involved: this isolates what the library would change. The connectrpc side runs
in a virtualenv under ``$DSEC_BENCH_VENVS`` (``/var/cache/dsec/bench-venvs``) with the pins
below, built on first use (it needs the package registry once).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import httpx
from rich.console import Console

from .bench import Sample, compare, phase

SERVERS = Path(__file__).with_name("connect_servers.py")
VENVS = Path(os.environ.get("DSEC_BENCH_VENVS", "/var/cache/dsec/bench-venvs"))
CONNECTRPC_PINS = ("e2b==2.63.0", "connectrpc==0.12.1", "protobuf-py==0.6.0", "uvicorn==0.55.0",
                   "uvloop==0.23.0", "httptools==0.9.0")
START = b"\n\x0b\n\t/bin/true"  # StartRequest{process: {cmd: "/bin/true"}}


async def connect_series(console: Console, quick: bool = False) -> list[Sample]:
    rounds = 5 if quick else 20
    with phase(console, "the connectrpc virtualenv"):
        connectrpc_python = await asyncio.to_thread(_connectrpc_python)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-connect-") as tmp:
        async with _server(sys.executable, Path(tmp, "dsec.sock"), "dsec") as ours, \
                _server(str(connectrpc_python), Path(tmp, "connectrpc.sock"), "connectrpc") as theirs:
            samples: list[Sample] = []
            with phase(console, "unary calls"):
                samples += await compare(Sample("connectrpc: unary Stat (JSON)", []), lambda: _unary(theirs),
                                         Sample("dsec Connect: unary Stat (JSON)", []), lambda: _unary(ours),
                                         50, rounds)
            with phase(console, "server streams"):
                samples += await compare(
                    Sample("connectrpc: stream of 100 x 4 KiB (proto)", []), lambda: _stream(theirs),
                    Sample("dsec Connect: stream of 100 x 4 KiB (proto)", []), lambda: _stream(ours),
                    5, rounds)
    return samples


def _connectrpc_python() -> Path:
    """The interpreter of the pinned connectrpc virtualenv, built once."""
    root = VENVS / ("connectrpc-" + hashlib.sha256("\n".join(CONNECTRPC_PINS).encode()).hexdigest()[:12])
    python, done = root / "bin" / "python", root / ".complete"
    if not done.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *CONNECTRPC_PINS], check=True, timeout=900)
        done.touch()
    return python


@asynccontextmanager
async def _server(python: str, socket: Path, side: str) -> AsyncIterator[httpx.AsyncClient]:
    server = subprocess.Popen([python, str(SERVERS), side, str(socket)])
    try:
        deadline = time.monotonic() + 60
        while not socket.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {side} envd server did not start")
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(socket)),
                                     base_url="http://envd") as client:
            yield client
    finally:
        server.terminate()
        server.wait()


async def _unary(client: httpx.AsyncClient) -> float:
    t0 = time.perf_counter()
    answer = await client.post("/filesystem.Filesystem/Stat", content=b'{"path": "/x"}',
                               headers={"content-type": "application/json", "connect-protocol-version": "1"})
    if answer.status_code != 200 or answer.json()["entry"]["path"] != "/x":
        raise RuntimeError(f"Stat answered {answer.status_code}: {answer.text[:200]}")
    return (time.perf_counter() - t0) * 1000


async def _stream(client: httpx.AsyncClient) -> float:
    t0 = time.perf_counter()
    body = struct.pack(">BI", 0, len(START)) + START
    async with client.stream("POST", "/process.Process/Start", content=body,
                             headers={"content-type": "application/connect+proto",
                                      "connect-protocol-version": "1"}) as answer:
        received = sum([len(chunk) async for chunk in answer.aiter_bytes()])
    if answer.status_code != 200 or received < 100 * 4096:
        raise RuntimeError(f"Start answered {answer.status_code} with {received} bytes")
    return (time.perf_counter() - t0) * 1000
