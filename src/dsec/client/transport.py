"""Finding and talking to a dsec server: URL and key resolution, the local server, errors.

``DSEC_URL`` (``http://host:port`` or ``unix:///path/api.sock``) and ``DSEC_API_KEY`` select a
server. Without them the client uses this host's local server on its Unix socket, starting
it in the background on first use (like a Docker daemon socket, but started on demand), and
reads the local key the server keeps root-only in its state directory.

The HTTP client is aiohttp's: a call costs the client about a fifth of the CPU it cost through
httpx's AsyncClient (0.16 against 0.75 ms for a ``GET`` here, docs/BENCHMARKS.md), which a
trainer driving thousands of sandboxes from one event loop pays on every call. What leaves
this module is library-free: a ``Response`` of status, headers and body, or NDJSON events.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, TypeVar

import aiohttp
from aiohttp.abc import AbstractStreamWriter

from ..protocol.errors import (
    DSecError,
    NotSupported,
    ServerUnavailable,
    Unauthorized,
    error_from_json,
)

START_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 10.0
# An idle connection is dropped after this long, well before the server's own expiry
# (server.py's KEEP_ALIVE_S), so the client never reuses one the server is closing.
IDLE_S = 5.0
MAX_CONNECTIONS = 256
SPLIT_BODY = 1 << 16  # a body above this waits for 100 Continue, then goes in pieces (_Body)
# What the server's failure to answer looks like: it is down, unreachable, cut the connection,
# sent no HTTP, or went silent past the timeout.
UNREACHED = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
             aiohttp.ClientResponseError, asyncio.TimeoutError)
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


class _Unheard(aiohttp.BaseConnector):
    """A connector that never hands out a connection its server has closed unheard.

    aiohttp reuses a kept-alive connection while it looks open to the event loop. When the
    server closed it (it was killed and restarted) and the loop has not run since to hear
    the end, the next request went out on it and failed: ServerUnavailable for a server that
    was up. A connection whose socket is readable while idle (the end, or bytes nobody asked
    for) is closed here and the next one taken, as httpx's pool did."""

    async def connect(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout,
                      ) -> aiohttp.connector.Connection:
        for _ in range(MAX_CONNECTIONS):  # each idle connection is looked at once at most
            connection = await super().connect(req, traces, timeout)
            transport = connection.transport
            if transport is None or not _readable(transport.get_extra_info("socket")):
                return connection
            connection.close()
        return await super().connect(req, traces, timeout)


class UnixConnector(_Unheard, aiohttp.UnixConnector):
    pass


class TCPConnector(_Unheard, aiohttp.TCPConnector):
    pass


def _readable(sock: socket.socket | None) -> bool:
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


@dataclass(frozen=True)
class Response:
    """A whole answer of the server: what the SDK's calls parse."""

    status: int
    headers: Mapping[str, str]  # case-insensitive
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


class _Body(aiohttp.BytesPayload):
    """A large request body (above ``SPLIT_BODY``), sent with ``Expect: 100-continue``: once
    the server said it reads it, in pieces of ``SPLIT_BODY``. The server refuses one it will
    not take (413) before a byte of it is sent, and a refusal is read as such: a body written
    past the server's close would tear the connection down before its answer was read. The
    pieces keep the event loop's write buffer small: aiohttp writes a body whole, and on
    Pythons before 3.12.9 (3.13.2) copied it with its head into one new buffer, then asyncio
    copied what the socket did not take at once: a 1 MiB ``send_stdin`` cost the client 2-3
    ms of CPU instead of under 1, and stdin throughput fell 20 % below httpx's."""

    async def write_with_length(self, writer: AbstractStreamWriter,
                                content_length: int | None) -> None:
        body = memoryview(self._value)[:content_length]
        for start in range(0, len(body), SPLIT_BODY):
            await writer.write(body[start:start + SPLIT_BODY])


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
        self.base = "http://dsec" if self.socket else (url or "").rstrip("/")
        # A read waits up to timeout_s for the server's next bytes (a quiet command's stream
        # included); taking a connection from a full pool, as long.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s,
                                              sock_connect=CONNECT_TIMEOUT_S, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None  # made in the loop that uses it
        self._auth: dict[str, str] = {}
        self._ready = False
        self._lock = asyncio.Lock()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector: aiohttp.BaseConnector = (
                UnixConnector(str(self.socket), limit=MAX_CONNECTIONS, keepalive_timeout=IDLE_S)
                if self.socket else
                TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=IDLE_S,
                             socket_factory=_keepalive_socket))
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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
            self._auth = {"authorization": f"Bearer {self._api_key}"}
            self._ready = True

    async def endpoint(self) -> tuple[str, str]:
        """The server's URL (``unix://PATH`` for a socket) and the API key in use."""
        await self._ensure_ready()
        url = f"unix://{self.socket}" if self.socket else self.base
        return url, self._api_key or ""

    async def _healthy(self) -> bool:
        try:
            async with self._http().get(self.base + "/v1/health",
                                        timeout=aiohttp.ClientTimeout(total=2.0)) as response:
                return response.status == 200
        except UNREACHED:
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

    def _send(self, method: str, path: str, *, headers: Mapping[str, str] | None = None,
              params: Mapping[str, Any] | None = None, content: bytes | None = None,
              json: Any = None, files: Mapping[str, tuple[str | None, bytes | str, str]] | None = None,
              ) -> Any:
        """The request (an aiohttp context manager): ``content`` raw, ``json`` encoded,
        ``files`` as multipart fields (name: filename or None, value, content type)."""
        data: Any = content
        if content is not None and len(content) > SPLIT_BODY:
            data = _Body(content)
        if files is not None:
            data = aiohttp.FormData()
            for name, (filename, value, content_type) in files.items():
                data.add_field(name, value, filename=filename, content_type=content_type)
        return self._http().request(
            method, self.base + path, headers={**self._auth, **(headers or {})},
            params=None if params is None else _query(params), data=data, json=json,
            expect100=isinstance(data, _Body))

    async def request(self, method: str, path: str, **kwargs: Any) -> Response:
        """The whole answer; its error as the typed DSecError."""
        await self._ensure_ready()
        try:
            async with self._send(method, path, **kwargs) as answer:
                response = Response(answer.status, answer.headers, await answer.read())
        except UNREACHED as exc:
            raise self._unavailable(exc) from exc
        if response.status >= 400:
            raise _error(response.status, response.content)
        return response

    def _unavailable(self, exc: BaseException) -> ServerUnavailable:
        return ServerUnavailable(f"dsec server at {self.base}: {exc!r}")

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return (await self.request(method, path, **kwargs)).json()

    async def ndjson(self, method: str, path: str,
                     on_response: Callable[[Mapping[str, str]], None] | None = None,
                     **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events; ``on_response`` sees the response's headers before the first."""
        await self._ensure_ready()
        try:
            async with self._send(method, path, **kwargs) as answer:
                if answer.status >= 400:
                    raise _error(answer.status, await answer.read())
                if on_response is not None:
                    on_response(answer.headers)
                held: list[bytes] = []  # the line so far, in the pieces it came in
                async for chunk in answer.content.iter_any():
                    cut = chunk.find(b"\n")
                    if cut < 0:
                        held.append(chunk)
                        continue
                    lines = [b"".join([*held, chunk[:cut]]), *chunk[cut + 1:].split(b"\n")]
                    held = [lines.pop()]
                    for line in lines:
                        if line.strip():
                            yield _event(line)
                if b"".join(held).strip():
                    yield _event(b"".join(held))
        except UNREACHED as exc:
            raise self._unavailable(exc) from exc


def _event(line: bytes) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(line)
    if event["type"] == "error":
        raise error_from_json(event)
    return event


def _query(params: Mapping[str, Any]) -> dict[str, str]:
    """Query values as text: booleans as ``true``/``false``, None as empty."""
    return {k: "true" if v is True else "false" if v is False else "" if v is None else str(v)
            for k, v in params.items()}


def _keepalive_socket(addr_info: Any) -> socket.socket:
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    for option in KEEPALIVE:
        sock.setsockopt(*option)
    return sock


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
