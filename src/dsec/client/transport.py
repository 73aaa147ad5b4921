"""Finding and talking to a dsec server: URL and key resolution, the local server, errors.

``DSEC_URL`` (``http://host:port`` or ``unix:///path/api.sock``) and ``DSEC_API_KEY`` select a
server. Without them the client uses this host's local server on its Unix socket, starting
it in the background on first use (like a Docker daemon socket, but started on demand), and
reads the local key the server keeps root-only in its state directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import httpx

from ..protocol.errors import (
    DSecError,
    NotSupported,
    ServerUnavailable,
    Unauthorized,
    error_from_json,
)
from .onewrite import coalesce_writes
from .pool import lean_pool

START_TIMEOUT_S = 120.0
EXIT_MISSING_EXTRA = 3  # `dsec serve` (any dsec command) run without its extra installed
# TCP keepalive: a server whose host died (or was cut off) mid-call leaves a half-open
# connection that no read ever ends; the kernel probes it after 10 s of silence and drops it
# after 3 unanswered probes 3 s apart, so the call fails with ServerUnavailable in about 20 s
# instead of waiting out the read timeout. A live server's kernel answers the probes, so
# long quiet commands are unaffected.
KEEPALIVE = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
             (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10),
             (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 3),
             (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)]


T = TypeVar("T")


def state_dir() -> Path:
    return Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"))


class Transport:
    def __init__(self, url: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, autostart: bool = True) -> None:
        url = url or os.environ.get("DSEC_URL")
        self.local = url is None
        self.socket = state_dir() / "api.sock" if url is None else None
        if url and url.startswith("unix://"):
            self.socket = Path(url[len("unix://"):])
        self.autostart = autostart and self.local
        self._api_key = api_key or os.environ.get("DSEC_API_KEY")
        # The limits go to the transport: a client given a transport ignores its own. Every
        # connection may stay open (idle for httpx's 5 s): the pool's pass is linear
        # (client/pool.py), so a burst's connections serve the next calls at no cost per call.
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        transport = lean_pool(coalesce_writes(
            httpx.AsyncHTTPTransport(uds=str(self.socket), limits=limits) if self.socket
            else httpx.AsyncHTTPTransport(socket_options=KEEPALIVE, limits=limits)))
        base = "http://dsec" if self.socket else url
        self.http = httpx.AsyncClient(base_url=base or "", transport=transport,
                                      timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._ready = False
        self._lock = asyncio.Lock()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _ensure_ready(self) -> None:
        if self._ready:
            return
        async with self._lock:
            if self._ready:
                return
            if self.autostart and not await self._healthy():
                await self._start_local_server()
            if self._api_key is None:
                key_file = (self.socket.parent if self.socket else state_dir()) / "local.key"
                if not key_file.exists():
                    raise Unauthorized("no API key: set DSEC_API_KEY, or run as a user who can "
                                       f"read the local server's key at {key_file}")
                self._api_key = key_file.read_text().strip()
            self.http.headers["authorization"] = f"Bearer {self._api_key}"
            self._ready = True

    async def endpoint(self) -> tuple[str, str]:
        """The server's URL (``unix://PATH`` for a socket) and the API key in use."""
        await self._ensure_ready()
        url = f"unix://{self.socket}" if self.socket else str(self.http.base_url).rstrip("/")
        return url, self._api_key or ""

    async def _healthy(self) -> bool:
        try:
            return (await self.http.get("/v1/health", timeout=2.0)).status_code == 200
        except httpx.TransportError:
            return False

    async def _start_local_server(self) -> None:
        """Start ``dsec serve`` detached; it outlives this client, so sandboxes do too."""
        directory = self.socket.parent if self.socket else state_dir()
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "server.log", "ab") as log:
            server = subprocess.Popen([sys.executable, "-m", "dsec", "serve", "--state-dir",
                                       str(directory)], stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=log, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if await self._healthy():
                return
            if server.poll() == EXIT_MISSING_EXTRA:
                raise NotSupported("starting a local dsec server needs the server: pip install "
                                   "'dsec[server]' (or pass the URL of a running server)")
            await asyncio.sleep(0.05)
        raise DSecError(f"the local dsec server did not start within {START_TIMEOUT_S:.0f}s; "
                        f"see {directory / 'server.log'}")

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        await self._ensure_ready()
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        if response.status_code >= 400:
            raise _error(response.status_code, response.content)
        return response

    def _unavailable(self, exc: httpx.TransportError) -> ServerUnavailable:
        return ServerUnavailable(f"dsec server at {self.http.base_url}: {exc!r}")

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return (await self.request(method, path, **kwargs)).json()

    async def ndjson(self, method: str, path: str,
                     on_response: Callable[[httpx.Response], None] | None = None,
                     **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events; ``on_response`` sees the response (headers) before the first."""
        await self._ensure_ready()
        try:
            async with self.http.stream(method, path, **kwargs) as response:
                if response.status_code >= 400:
                    raise _error(response.status_code, await response.aread())
                if on_response is not None:
                    on_response(response)
                async for line in response.aiter_lines():
                    if line:
                        event = json.loads(line)
                        if event["type"] == "error":
                            raise error_from_json(event)
                        yield event
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc


def _error(status: int, body: bytes) -> DSecError:
    try:
        return error_from_json(json.loads(body))
    except (ValueError, AttributeError):
        return DSecError(f"HTTP {status}: {body[:500].decode(errors='replace')}")


async def retrying(retry_s: float, send: Callable[[], Awaitable[T]]) -> T:
    """``send()``, again after a back-off while the server cannot be reached (or dropped the
    connection), for up to ``retry_s``: only for calls that are safe to repeat."""
    deadline = time.monotonic() + retry_s
    delay = 0.05
    while True:
        try:
            return await send()
        except ServerUnavailable:
            if time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
