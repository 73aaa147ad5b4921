"""The edge's end of a sandbox's port: one request's bytes in, the answer's bytes out.

How a port is reached (docs/API.md, "Sandbox ports"): the API server turns an HTTP request
into bytes (control/ports.py), the router sends them to the sandbox's edge (embedded, or the
node's edge actor under ``--ray``, as a stream like exec output), and the edge writes them
into the agent's ``N`` pipe: a TCP connection the agent opens to ``127.0.0.1:PORT`` inside
the sandbox (docs/AGENT_PROTOCOL.md). The same path serves every substrate (a container's
agent is in its network namespace, a VM's in its guest), opens no host port and changes
no egress rule: the sandbox's server only ever answers connections the edge made.

What comes back is the sandbox's: hostile. It is passed on as bytes, never acted upon, and
bounded here: ``PORT_CONNECTIONS`` at once per sandbox, ``PORT_CONNECT_S`` for the agent's
connect, ``idle_s`` without a byte (a server that never answers), ``PORT_BYTES_MAX`` bytes
in all (a flood), read ``CHUNK`` at a time only as the consumer takes them.

A two-way connection (WebSocket, control/port_ws.py) is the same exchange opened with a
``session`` name the API server chose: while its answer streams, ``send`` writes more bytes
into it (the edge operation ``port_send``, a plain call, so it works the same through the Ray
edge actor). Its bounds: ``PORT_BYTES_MAX`` per direction, the idle cut counting bytes either
way, the per-sandbox count; it ends when the stream ends (the port closed, the idle cut, the
caller left: under ``--ray`` the stream's cancel), and a later ``send`` is PortUnavailable.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..agent.client import AgentClient, AgentError
from ..protocol.errors import InvalidRequest, PortUnavailable

PORT_CONNECTIONS = 64  # open port connections per sandbox
PORT_CONNECT_S = 10.0  # the agent's connect to the port (a full accept queue holds it)
PORT_BYTES_MAX = 1 << 30  # bytes one connection may bring back (and a session send)
CHUNK = 256 << 10


@dataclass
class _Session:
    """A two-way connection's write side, while its answer streams."""

    writer: asyncio.StreamWriter
    sent: int = 0
    active_at: float = field(default_factory=time.monotonic)  # its last byte either way


class PortConnections:
    """Counts each sandbox's open port connections (one edge's), and holds the write side of
    its two-way ones by (sandbox, session)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._open: Counter[str] = Counter()
        self._sessions: dict[tuple[str, str], _Session] = {}

    async def exchange(self, sandbox_id: str, agent: AgentClient, port: int,
                       request: bytes, session: str | None = None) -> AsyncIterator[bytes]:
        """Write ``request`` to the port, then yield what it answers until it closes, falls
        silent for ``idle_s`` or passes ``PORT_BYTES_MAX``. With a ``session`` name, ``send``
        may write more while it lasts. PortUnavailable when nothing accepts; AgentUnavailable
        (the caller's to judge) when the agent is gone."""
        if not 1 <= port <= 65535:
            raise InvalidRequest("port must be 1-65535", port=port)
        if self._open[sandbox_id] >= PORT_CONNECTIONS:
            raise PortUnavailable(f"sandbox {sandbox_id} has {PORT_CONNECTIONS} port connections "
                                  "open already", sandbox_id=sandbox_id, port=port, reason="busy")
        self._open[sandbox_id] += 1
        try:
            try:
                reader, writer = await asyncio.wait_for(agent.open_port(port), PORT_CONNECT_S)
            except AgentError as exc:
                raise PortUnavailable(f"nothing answers on port {port} in sandbox {sandbox_id} "
                                      f"({exc.message})", sandbox_id=sandbox_id, port=port,
                                      reason=exc.errno) from None
            except TimeoutError:
                raise PortUnavailable(f"port {port} in sandbox {sandbox_id} did not accept within "
                                      f"{PORT_CONNECT_S:g} s", sandbox_id=sandbox_id, port=port,
                                      reason="timeout") from None
            pipe = _Session(writer)
            key = (sandbox_id, session or "")
            if session is not None:
                if key in self._sessions:
                    writer.close()
                    raise InvalidRequest(f"port session {session} is open already")
                self._sessions[key] = pipe
            try:
                writer.write(request)
                await asyncio.wait_for(writer.drain(), self.idle_s)
                left = PORT_BYTES_MAX
                while left > 0:
                    chunk = await self._read(reader, min(CHUNK, left), pipe)
                    if not chunk:
                        return
                    left -= len(chunk)
                    pipe.active_at = time.monotonic()
                    yield chunk
            except (TimeoutError, ConnectionError):
                return  # silent or gone: the answer ends here (the API server sees it cut)
            finally:
                if self._sessions.get(key) is pipe:
                    del self._sessions[key]
                # abort, not close: close waits to flush what the port never read, keeping
                # the connection (and the sandbox's end of it) open for good
                writer.transport.abort()
        finally:
            self._open[sandbox_id] -= 1
            if not self._open[sandbox_id]:
                del self._open[sandbox_id]

    async def _read(self, reader: asyncio.StreamReader, n: int, pipe: _Session) -> bytes:
        """Up to ``n`` bytes; TimeoutError once nothing moved either way for ``idle_s``."""
        while True:
            wait = pipe.active_at + self.idle_s - time.monotonic()
            if wait <= 0:
                raise TimeoutError
            try:
                return await asyncio.wait_for(reader.read(n), wait)
            except TimeoutError:
                continue  # a send moved ``active_at`` meanwhile, or the loop says so

    async def send(self, sandbox_id: str, session: str, data: bytes) -> None:
        """Write ``data`` into the open two-way connection ``session``; PortUnavailable when it
        has ended, or when the sandbox's server takes nothing for ``idle_s`` or over
        ``PORT_BYTES_MAX`` in all (both end it)."""
        pipe = self._sessions.get((sandbox_id, session))
        if pipe is None or pipe.writer.is_closing():
            raise PortUnavailable(f"the port connection {session} of sandbox {sandbox_id} has "
                                  "ended", sandbox_id=sandbox_id, reason="closed")
        pipe.sent += len(data)
        if pipe.sent > PORT_BYTES_MAX:
            pipe.writer.transport.abort()
            raise PortUnavailable(f"over {PORT_BYTES_MAX} bytes sent to a port of sandbox "
                                  f"{sandbox_id}", sandbox_id=sandbox_id, reason="too_much")
        try:
            pipe.writer.write(data)
            await asyncio.wait_for(pipe.writer.drain(), self.idle_s)
        except (TimeoutError, ConnectionError):
            pipe.writer.transport.abort()  # (what it holds unsent is dropped: see exchange)
            raise PortUnavailable(f"the port connection {session} of sandbox {sandbox_id} "
                                  "took nothing", sandbox_id=sandbox_id, reason="closed") from None
        pipe.active_at = time.monotonic()
