"""A test HTTP server's lifetime on a Unix socket (``async with``): each subclass answers its
connections in ``_serve`` (tests/unit/test_transport.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TypeVar

S = TypeVar("S", bound="UnixServer")


class UnixServer:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self: S) -> S:
        self.server = await asyncio.start_unix_server(self._serve, str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
