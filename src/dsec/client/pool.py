"""The SDK's connection pool: httpcore's, with its pass over the connections made linear and
its keep-alive limit counted on the idle connections.

httpcore 1.0's pool runs one pass over its connections at every request and every response
close. That pass (``_assign_requests_to_connections``) had two costs a burst pays:

- it closed an idle connection whenever the pool held more connections *in all* than
  ``max_keepalive_connections`` (it counts every connection as idle; encode/httpcore#1000):
  a burst of 100 creates and streams, more than the 64 kept, closed connections as they went
  idle and opened new ones for the next calls (18 to 188 new connections per 100 first
  outputs);
- it asked every idle connection whether the server had closed it (a ``poll`` on its socket,
  through anyio's attribute lookup) and rebuilt the lists of all connections for each queued
  request: O(connections x requests) per pass, so more kept connections made every call
  slower (keep-alive 256 made a burst's p50 twice as long).

Here a pass walks the connections once. A connection is asked whether it expired only when it
is about to be handed out (a server-closed one is then closed and the next one tried, so a
request never goes out on a dead connection) and, for the keep-alive expiry of the rest, in a
full sweep at most every ``SWEEP_S``. A connection already assigned to a waiting request is
never closed under it (encode/httpcore#1110). HTTP/1.1 only, as the SDK's transports are.

httpx builds its pool itself; ``lean_pool`` gives the pool it made this class (it adds no
state of its own but the time of the last sweep), for the httpcore versions pyproject.toml
allows; tests/unit/test_pool.py fails if httpcore's pool changes under it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httpcore
import httpx

if TYPE_CHECKING:  # httpcore's private modules: names for the annotations only
    from httpcore._async.connection_pool import AsyncPoolRequest
    from httpcore._async.interfaces import AsyncConnectionInterface

SWEEP_S = 1.0


class LeanPool(httpcore.AsyncConnectionPool):
    _swept_at = 0.0

    def _assign_requests_to_connections(self) -> list[AsyncConnectionInterface]:
        """Close what must close, then give each queued request a connection: an idle one
        (checked first), else a new one within ``max_connections``, else one made by
        closing an idle one. Returns the connections to close, as httpcore's does."""
        closing: list[AsyncConnectionInterface] = []
        assigned = {id(r.connection) for r in self._requests if r.connection is not None}
        now = time.monotonic()
        sweep = now - self._swept_at >= SWEEP_S
        if sweep:
            self._swept_at = now
        kept: list[AsyncConnectionInterface] = []
        idle: list[AsyncConnectionInterface] = []
        for connection in self._connections:
            if connection.is_closed():
                continue
            free = connection.is_idle() and id(connection) not in assigned
            if free and (len(idle) >= self._max_keepalive_connections
                         or (sweep and connection.has_expired())):
                closing.append(connection)
                continue
            kept.append(connection)
            if free:
                idle.append(connection)
        waiting: list[AsyncPoolRequest] = []
        for request in (r for r in self._requests if r.is_queued()):
            reused = self._idle_for(request, idle, kept, closing)
            if reused is None:
                waiting.append(request)
            else:
                request.assign_to_connection(reused)
        for request in waiting:
            if len(kept) >= self._max_connections:
                if not idle:
                    break  # waits for a connection to come back
                victim = idle.pop(0)
                kept.remove(victim)
                closing.append(victim)
            connection = self.create_connection(request.request.url.origin)
            kept.append(connection)
            request.assign_to_connection(connection)
        self._connections = kept
        return closing

    @staticmethod
    def _idle_for(request: AsyncPoolRequest, idle: list[AsyncConnectionInterface],
                  kept: list[AsyncConnectionInterface],
                  closing: list[AsyncConnectionInterface]) -> AsyncConnectionInterface | None:
        """An idle connection for ``request``'s origin, the newest first (the older ones
        expire), taken out of ``idle``; one the server closed goes to ``closing``."""
        origin = request.request.url.origin
        for i in range(len(idle) - 1, -1, -1):
            connection = idle[i]
            if not connection.can_handle_request(origin):
                continue
            del idle[i]
            if not connection.has_expired():
                return connection
            kept.remove(connection)
            closing.append(connection)
        return None


def lean_pool(transport: httpx.AsyncHTTPTransport) -> httpx.AsyncHTTPTransport:
    """``transport`` with its pool a ``LeanPool`` (see the module docstring)."""
    pool = transport._pool
    if type(pool) is not httpcore.AsyncConnectionPool or pool._http2:
        raise TypeError(f"expected httpcore's HTTP/1.1 AsyncConnectionPool, got {pool!r}")
    pool.__class__ = LeanPool
    return transport
