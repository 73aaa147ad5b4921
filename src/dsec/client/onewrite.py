"""A request in one write: the SDK's HTTP connections send a request's head and body together.

httpcore writes a request's headers, then its body, in two socket writes. Each write wakes the
server, so a small call (an exec of ``true``) cost the server two wake-ups and two passes of its
event loop before it could answer; on a busy host each wake-up waits for a CPU. Here a
connection's writes are held until the client next reads (the response, which comes only after
the whole request) or until ``FLUSH_BYTES`` are held, so a small request leaves in one write
and a large upload still streams in bounded pieces.

A write that fails at the flush is dropped as httpcore drops one while it sends a request: the
response is read all the same (a server may refuse a request early, e.g. a body over its limit,
and answer before closing).

httpx builds its connection pool itself, with no way to pass a network backend in; the backend
is set on the pool it made (``coalesce_writes``), for the httpx versions pyproject.toml allows.
"""

from __future__ import annotations

import ssl
from typing import Any, Iterable

import httpcore
import httpx

FLUSH_BYTES = 64 << 10


class OneWriteStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._held: list[bytes] = []
        self._size = 0

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        self._held.append(buffer)
        self._size += len(buffer)
        if self._size >= FLUSH_BYTES:
            await self._flush(timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            try:
                await self._flush(timeout)
            except httpcore.WriteError:
                pass  # as httpcore does mid-request: the server may still have answered
        return await self._stream.read(max_bytes, timeout)

    async def _flush(self, timeout: float | None) -> None:
        held, self._held, self._size = b"".join(self._held), [], 0
        await self._stream.write(held, timeout)

    async def aclose(self) -> None:
        self._held, self._size = [], 0
        await self._stream.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        if self._held:
            await self._flush(timeout)
        return OneWriteStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class OneWriteBackend(httpcore.AsyncNetworkBackend):
    """``backend``'s connections, each a ``OneWriteStream``."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        return OneWriteStream(await self._backend.connect_tcp(
            host, port, timeout=timeout, local_address=local_address,
            socket_options=socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        return OneWriteStream(await self._backend.connect_unix_socket(
            path, timeout=timeout, socket_options=socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def coalesce_writes(transport: httpx.AsyncHTTPTransport) -> httpx.AsyncHTTPTransport:
    """``transport`` with its requests sent in one write (see the module docstring)."""
    pool = transport._pool
    pool._network_backend = OneWriteBackend(pool._network_backend)
    return transport
