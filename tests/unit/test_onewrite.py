"""The SDK sends a request in one write (client/onewrite.py): against a real Unix-socket HTTP
server that records what each of its reads returned, a call's head and body arrive in its first
read; a body above FLUSH_BYTES still arrives whole and in order; a server that answers a
request early and closes gets its answer read, not a write error."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpcore
import pytest
from httpcore._backends.auto import AutoBackend

from dsec.client.onewrite import FLUSH_BYTES, OneWriteBackend
from dsec.client.transport import Transport
from dsec.protocol.errors import PayloadTooLarge
from support.unix_http import UnixServer


class RecordingServer(UnixServer):
    """An HTTP/1.1 server on a Unix socket that answers every request with JSON of what it
    received, and records the bytes each read returned. ``refuse_above``: a request whose
    Content-Length is above it is answered 413 at once, its body unread, and the connection
    closed (as a server enforcing a body limit may)."""

    def __init__(self, path: Path, refuse_above: int | None = None) -> None:
        super().__init__(path)
        self.refuse_above = refuse_above
        self.reads: list[bytes] = []

    async def _read(self, reader: asyncio.StreamReader) -> bytes:
        data = await reader.read(1 << 20)
        self.reads.append(data)
        return data

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buffered = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffered:
                    data = await self._read(reader)
                    if not data:
                        return
                    buffered += data
                head, _, buffered = buffered.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                if self.refuse_above is not None and length > self.refuse_above:
                    body = json.dumps({"error": {"code": "payload_too_large", "message": "big",
                                                 "details": {"limit": self.refuse_above}}}).encode()
                    writer.write(b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json"
                                 b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
                                 + body)
                    await writer.drain()
                    return
                while len(buffered) < length:
                    data = await self._read(reader)
                    if not data:
                        return
                    buffered += data
                received, buffered = buffered[:length], buffered[length:]
                answer = json.dumps({"size": len(received), "sum": sum(received) % 65521}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % len(answer) + answer)
                await writer.drain()
        finally:
            writer.close()


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "api.sock"


class CountedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's own backend, counting the writes that reach its sockets."""

    def __init__(self) -> None:
        self.backend = AutoBackend()
        self.writes: list[bytes] = []

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        stream = await self.backend.connect_unix_socket(path, timeout, socket_options)
        write, writes = stream.write, self.writes

        async def counted(buffer: bytes, timeout: float | None = None) -> None:
            writes.append(buffer)
            await write(buffer, timeout)
        stream.write = counted  # type: ignore[method-assign]
        return stream

    async def sleep(self, seconds: float) -> None:
        await self.backend.sleep(seconds)


@pytest.mark.parametrize("one_write", [True, False])
async def test_a_small_request_leaves_in_one_write(socket_path: Path, one_write: bool) -> None:
    """httpcore alone writes the head, then the body; through OneWriteBackend the socket
    sees one write per request, also on a kept-alive connection."""
    counted = CountedBackend()
    backend = OneWriteBackend(counted) if one_write else counted
    body = b'{"command":"true","timeout_s":60.0}'
    async with RecordingServer(socket_path) as server, httpcore.AsyncConnectionPool(
            uds=str(socket_path), network_backend=backend) as pool:
        for _ in range(3):  # a fresh connection, then the kept-alive one
            counted.writes.clear()
            response = await pool.request("POST", "http://dsec/v1/sandboxes/sb-x/exec",
                                          headers={"content-type": "application/json"},
                                          content=body)
            assert json.loads(response.content)["size"] == len(body)
            sent = [w for w in counted.writes if w]  # httpcore also writes b"" at the end
            assert len(sent) == (1 if one_write else 2), sent
            assert sent[-1].endswith(b"\r\n\r\n" + body if one_write else body)
    assert server.reads


async def test_a_large_body_arrives_whole_and_in_order(socket_path: Path) -> None:
    payload = bytes(range(256)) * (5 * FLUSH_BYTES // 256 + 7)
    async with RecordingServer(socket_path):
        transport = Transport(f"unix://{socket_path}", "dsk_test", autostart=False)
        try:
            whole = await transport.json("PUT", "/v1/files", content=payload)
            assert whole == {"size": len(payload), "sum": sum(payload) % 65521}
        finally:
            await transport.aclose()


async def test_an_early_refusal_is_read_not_a_write_error(socket_path: Path) -> None:
    async with RecordingServer(socket_path, refuse_above=1000) as server:
        transport = Transport(f"unix://{socket_path}", "dsk_test", autostart=False)
        try:
            with pytest.raises(PayloadTooLarge) as refused:
                await transport.request("PUT", "/v1/files", content=b"\0" * (40 * FLUSH_BYTES))
            assert refused.value.details["limit"] == 1000
            assert server.reads  # it read the head, then answered and closed
        finally:
            await transport.aclose()


def test_every_sdk_connection_goes_through_the_one_write_backend(socket_path: Path) -> None:
    """Guards the hook into httpx's pool (a private attribute): an httpx release that moves
    it fails here, not silently in the figures."""
    for url in (f"unix://{socket_path}", "http://127.0.0.1:9"):
        transport = Transport(url, "dsk_test", autostart=False)
        pool = transport.http._transport._pool  # type: ignore[attr-defined]
        assert isinstance(pool._network_backend, OneWriteBackend)
