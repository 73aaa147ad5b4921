"""The SDK's connection pool (client/pool.py), counted on the server's side of a real Unix
socket: bursts reuse the connections of the burst before (httpcore's own pool closed them as
they went idle once more than 64 were open), a connection the server closed is never sent a
request, and ``max_connections`` / ``max_keepalive_connections`` still hold."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpcore
import httpx
import pytest
from httpcore._async.connection import AsyncHTTPConnection

from dsec.client import pool
from dsec.client.pool import LeanPool, lean_pool
from dsec.client.transport import Transport
from support.unix_http import UnixServer


class CountingServer(UnixServer):
    """An HTTP/1.1 server on a Unix socket answering every GET ``{}``. It counts the
    connections it accepted, how many were open at once, and how many the client closed.
    ``hold``: answers wait until that many requests are in flight (a real burst: every one
    needs its own connection). ``close_after``: the server closes each connection after
    answering (as a server whose keep-alive timer fired), without saying so."""

    def __init__(self, path: Path, hold: int = 0, close_after: bool = False) -> None:
        super().__init__(path)
        self.hold = hold
        self.close_after = close_after
        self.accepted = self.open = self.most_open = self.closed_by_client = 0
        self.in_flight = 0
        self.released = asyncio.Event()
        self.server_closed = asyncio.Event()

    async def _request(self, reader: asyncio.StreamReader) -> bool:
        try:
            await reader.readuntil(b"\r\n\r\n")
            return True
        except asyncio.IncompleteReadError:
            self.closed_by_client += 1
            return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while await self._request(reader):
                self.in_flight += 1
                if self.in_flight >= self.hold:
                    self.released.set()
                await self.released.wait()
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.released.clear()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: 2\r\n\r\n{}")
                await writer.drain()
                if self.close_after:
                    return
        finally:
            self.open -= 1
            writer.close()
            await writer.wait_closed()
            self.server_closed.set()


def sdk_transport(path: Path) -> Transport:
    return Transport(f"unix://{path}", api_key="k", autostart=False)


async def test_a_burst_reuses_the_connections_of_the_burst_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 100  # more than httpcore's pool kept once over its keep-alive count
    checks = count_expiry_checks(monkeypatch)
    monkeypatch.setattr(pool, "SWEEP_S", float("inf"))  # one full sweep: the first pass
    async with CountingServer(tmp_path / "s.sock", hold=n) as server:
        t = sdk_transport(server.path)
        assert isinstance(t.http._transport._pool, LeanPool)  # type: ignore[attr-defined]
        try:
            for _ in range(3):
                answers = await asyncio.gather(*(t.json("GET", "/v1/x") for _ in range(n)))
                assert answers == [{}] * n
            assert server.accepted == n  # the first burst's n, none for the two after
            assert server.closed_by_client == 0
            # a connection is asked whether it expired when it is handed out, not at every
            # pass (httpcore's pool asked every idle one at every request and response)
            assert checks[0] <= 3 * n
        finally:
            await t.aclose()


def count_expiry_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]
    has_expired = AsyncHTTPConnection.has_expired

    def counted(self: AsyncHTTPConnection) -> bool:
        count[0] += 1
        return has_expired(self)

    monkeypatch.setattr(AsyncHTTPConnection, "has_expired", counted)
    return count


async def test_a_connection_the_server_closed_is_never_sent_a_request(tmp_path: Path) -> None:
    async with CountingServer(tmp_path / "s.sock", close_after=True) as server:
        t = sdk_transport(server.path)
        try:
            for _ in range(5):
                server.server_closed.clear()
                assert await t.json("GET", "/v1/x") == {}  # never ServerUnavailable
                await server.server_closed.wait()
            assert server.accepted == 5
        finally:
            await t.aclose()


async def test_the_limits_still_hold(tmp_path: Path) -> None:
    async with CountingServer(tmp_path / "s.sock", hold=3) as server:
        transport = lean_pool(httpx.AsyncHTTPTransport(
            uds=str(server.path),
            limits=httpx.Limits(max_connections=3, max_keepalive_connections=1)))
        async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as http:
            answers = await asyncio.gather(*(http.get("/v1/x") for _ in range(12)))
            assert [a.json() for a in answers] == [{}] * 12
            assert server.most_open == 3
            server.hold = 0
            await http.get("/v1/x")  # a pass: the surplus idle connections are closed
            for _ in range(1000):  # until the server saw them close
                if server.open == 1:
                    break
                await asyncio.sleep(0.01)
            assert server.open == 1


def test_only_httpcores_own_http11_pool_is_replaced() -> None:
    transport = httpx.AsyncHTTPTransport()
    transport._pool = httpcore.AsyncConnectionPool(http1=True, http2=True)
    with pytest.raises(TypeError):
        lean_pool(transport)
