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
connect, ``idle_s`` without a byte (a server that never answers), ``PORT_RESPONSE_MAX`` bytes
in all (a flood), read ``CHUNK`` at a time only as the consumer takes them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import AsyncIterator

from ..agent.client import AgentClient, AgentError
from ..protocol.errors import InvalidRequest, PortUnavailable

PORT_CONNECTIONS = 64  # open port connections per sandbox
PORT_CONNECT_S = 10.0  # the agent's connect to the port (a full accept queue holds it)
PORT_RESPONSE_MAX = 1 << 30  # bytes one request may bring back
CHUNK = 256 << 10


class PortConnections:
    """Counts each sandbox's open port connections (one edge's)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._open: Counter[str] = Counter()

    async def exchange(self, sandbox_id: str, agent: AgentClient, port: int,
                       request: bytes) -> AsyncIterator[bytes]:
        """Write ``request`` to the port, then yield what it answers until it closes, falls
        silent for ``idle_s`` or passes ``PORT_RESPONSE_MAX``. PortUnavailable when nothing
        accepts; AgentUnavailable (the caller's to judge) when the agent is gone."""
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
            try:
                writer.write(request)
                await asyncio.wait_for(writer.drain(), self.idle_s)
                left = PORT_RESPONSE_MAX
                while left > 0:
                    chunk = await asyncio.wait_for(reader.read(min(CHUNK, left)), self.idle_s)
                    if not chunk:
                        return
                    left -= len(chunk)
                    yield chunk
            except (TimeoutError, ConnectionError):
                return  # silent or gone: the answer ends here (the API server sees it cut)
            finally:
                writer.close()
        finally:
            self._open[sandbox_id] -= 1
            if not self._open[sandbox_id]:
                del self._open[sandbox_id]
