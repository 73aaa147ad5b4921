"""The SDK's HTTP transport (client/transport.py) against a real HTTP/1.1 server on a Unix
socket that records what each of its reads returned and answers as a test tells it: a request
leaves in one write; a large body waits for 100 Continue and arrives whole; a server that
refuses a body early is heard, not taken for a dead server, and gets none of it; NDJSON lines
are whole whatever the chunks they arrive in; a stream cut short is ServerUnavailable, never a
clean end; query values go as the server reads them."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from dsec.client.transport import SPLIT_BODY, Transport
from dsec.protocol.errors import PayloadTooLarge, SandboxNotFound, ServerUnavailable
from support.unix_http import UnixServer


def _json_answer(status: str, body: dict[str, Any], close: bool = False) -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"{'connection: close' + chr(13) + chr(10) if close else ''}"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def _chunked(pieces: list[bytes], end: bool = True) -> bytes:
    """A chunked NDJSON response of ``pieces``, each one chunk; without ``end`` it stops
    short of the last chunk, as a server that died mid-stream."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)
    return head + body + (b"0\r\n\r\n" if end else b"")


class RecordingServer(UnixServer):
    """Records each read's bytes and each request's head; answers with ``answer(head, body)``
    (bytes to send; the connection closes after it when they say ``connection: close`` or
    are not a whole response). ``refuse_above``: a request whose Content-Length is above it
    is answered 413 at once, its body unread, and the connection closed."""

    def __init__(self, path: Path, answer: Callable[[bytes, bytes], bytes] | None = None,
                 refuse_above: int | None = None) -> None:
        super().__init__(path)
        self.answer = answer or (lambda head, body: _json_answer(
            "200 OK", {"size": len(body), "sum": sum(body) % 65521}))
        self.refuse_above = refuse_above
        self.reads: list[bytes] = []
        self.heads: list[bytes] = []
        self.after_refusal: bytes | None = None

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
                self.heads.append(head)
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                if self.refuse_above is not None and length > self.refuse_above:
                    writer.write(_json_answer("413 Payload Too Large", {"error": {
                        "code": "payload_too_large", "message": "big",
                        "details": {"limit": self.refuse_above}}}, close=True))
                    await writer.drain()
                    try:  # whatever the client sends in the next 0.1 s is kept
                        late = await asyncio.wait_for(reader.read(1 << 20), 0.1)
                    except asyncio.TimeoutError:
                        late = b""
                    self.after_refusal = buffered + late
                    return
                if b"\r\nexpect: 100-continue" in head.lower():
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                while len(buffered) < length:
                    data = await self._read(reader)
                    if not data:
                        return
                    buffered += data
                received, buffered = buffered[:length], buffered[length:]
                answer = self.answer(head, received)
                writer.write(answer)
                await writer.drain()
                if b"connection: close" in answer.split(b"\r\n\r\n")[0] or \
                        b"transfer-encoding: chunked" in answer and not answer.endswith(b"0\r\n\r\n"):
                    return
        finally:
            writer.close()


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "api.sock"


@pytest.fixture
async def connect(socket_path: Path) -> Any:
    made: list[Transport] = []

    def transport() -> Transport:
        made.append(Transport(f"unix://{socket_path}", "dsk_test", autostart=False))
        return made[-1]
    yield transport
    for t in made:
        await t.aclose()


async def test_a_small_request_leaves_in_one_write(socket_path: Path, connect: Any) -> None:
    """Head and body together: each write wakes the server, which then reads the request in
    one pass of its loop (also on a kept-alive connection)."""
    body = {"command": "true", "timeout_s": 60.0}
    async with RecordingServer(socket_path) as server:
        transport = connect()
        for _ in range(3):  # a fresh connection, then the kept-alive one
            server.reads.clear()
            answer = await transport.json("POST", "/v1/sandboxes/sb-x/exec", json=body)
            sent = json.dumps(body).encode()
            assert answer["size"] == len(sent)
            assert len(server.reads) == 1 and server.reads[0].endswith(b"\r\n\r\n" + sent)
        assert all(b"\r\nauthorization: bearer dsk_test" in h.lower() for h in server.heads)


@pytest.mark.parametrize("size", [SPLIT_BODY, SPLIT_BODY + 1, 5 * 65536 + 1799, 1 << 20])
async def test_a_large_body_arrives_whole_and_in_order(socket_path: Path, connect: Any,
                                                       size: int) -> None:
    """Below and above the size from which a body waits for the server's 100 Continue, then
    goes in pieces (``_Body``): all of it, in order, under its Content-Length (never
    chunked), also on a kept-alive connection."""
    payload = (bytes(range(256)) * (size // 256 + 1))[:size]
    async with RecordingServer(socket_path) as server:
        transport = connect()
        for _ in range(2):
            whole = await transport.json("PUT", "/v1/files", content=payload)
            assert whole == {"size": len(payload), "sum": sum(payload) % 65521}
        for head in server.heads:
            assert f"content-length: {size}".encode() in head.lower()
            assert b"transfer-encoding" not in head.lower()
            assert (b"expect: 100-continue" in head.lower()) == (size > SPLIT_BODY)


async def test_an_early_refusal_is_read_not_a_write_error(socket_path: Path, connect: Any) -> None:
    """A server enforcing a body limit answers 413 and closes before the body is read: the
    caller gets PayloadTooLarge with the server's details, not ServerUnavailable."""
    async with RecordingServer(socket_path, refuse_above=1000) as server:
        with pytest.raises(PayloadTooLarge) as refused:
            await connect().request("PUT", "/v1/files", content=b"\0" * (40 << 16))
        assert refused.value.details["limit"] == 1000
        assert server.heads  # it read the head, then answered and closed
        for _ in range(100):  # what came after its answer, once it looked
            if server.after_refusal is not None:
                break
            await asyncio.sleep(0.01)
        assert server.after_refusal == b""  # not a byte of the body was sent


async def test_a_typed_error_answer_is_its_error(socket_path: Path, connect: Any) -> None:
    answer = _json_answer("404 Not Found", {"error": {"code": "sandbox_not_found",
                                                       "message": "no sandbox 'sb-x'",
                                                       "details": {"sandbox_id": "sb-x"}}})
    async with RecordingServer(socket_path, lambda head, body: answer):
        with pytest.raises(SandboxNotFound) as missing:
            await connect().json("GET", "/v1/sandboxes/sb-x")
        assert missing.value.details == {"sandbox_id": "sb-x"}


EVENTS = [{"type": "stdout", "data": "x" * 300_000}, {"type": "stderr", "data": "é\n"},
          {"type": "result", "result": {"exit_code": 0}}]


@pytest.mark.parametrize("cut", [1, 7, 4096, 65536, 1 << 20])
async def test_ndjson_events_are_whole_whatever_their_chunks(socket_path: Path, connect: Any,
                                                            cut: int) -> None:
    """Lines split anywhere (inside a line, between two, one line over many chunks, several
    in one chunk), blank lines between them: the same events, in order."""
    text = b"\n".join(json.dumps(e).encode() for e in EVENTS) + b"\n\n"
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    async with RecordingServer(socket_path, lambda head, body: _chunked(pieces)):
        got = [e async for e in connect().ndjson("POST", "/v1/sandboxes/sb-x/exec/stream")]
        assert got == EVENTS


async def test_the_last_line_without_a_newline_is_an_event(socket_path: Path, connect: Any) -> None:
    text = json.dumps(EVENTS[0]).encode() + b"\n" + json.dumps(EVENTS[2]).encode()
    async with RecordingServer(socket_path, lambda head, body: _chunked([text])):
        got = [e async for e in connect().ndjson("GET", "/v1/trajectories/t/-/export")]
        assert got == [EVENTS[0], EVENTS[2]]


async def test_a_stream_cut_short_is_server_unavailable(socket_path: Path, connect: Any) -> None:
    """The server died after some output and before the result: the caller sees the output,
    then ServerUnavailable, never a stream that simply ended."""
    first = json.dumps(EVENTS[1]).encode() + b"\n"
    partial = json.dumps(EVENTS[2]).encode()[:10]
    async with RecordingServer(socket_path, lambda head, body: _chunked([first, partial],
                                                                        end=False)):
        got: list[dict[str, Any]] = []
        with pytest.raises(ServerUnavailable):
            async for event in connect().ndjson("POST", "/v1/sandboxes/sb-x/exec/stream"):
                got.append(event)
        assert got == [EVENTS[1]]


async def test_an_error_event_raises_its_typed_error(socket_path: Path, connect: Any) -> None:
    error = {"type": "error", "error": {"code": "sandbox_not_found", "message": "gone",
                                        "details": {"sandbox_id": "sb-x"}}}
    text = b"".join(json.dumps(e).encode() + b"\n" for e in (EVENTS[1], error))
    async with RecordingServer(socket_path, lambda head, body: _chunked([text])):
        with pytest.raises(SandboxNotFound):
            async for _ in connect().ndjson("POST", "/v1/sandboxes/sb-x/exec/stream"):
                pass


async def test_query_values_go_as_the_server_reads_them(socket_path: Path, connect: Any) -> None:
    async with RecordingServer(socket_path) as server:
        await connect().request("GET", "/v1/admin/gc", params={
            "dry_run": True, "append": False, "limit": 3, "path": "/a b&c", "after": None})
        line = server.heads[-1].split(b"\r\n")[0]
        assert line == (b"GET /v1/admin/gc?dry_run=true&append=false&limit=3&path=/a+b%26c"
                        b"&after= HTTP/1.1")


async def test_no_server_is_server_unavailable(socket_path: Path, connect: Any) -> None:
    with pytest.raises(ServerUnavailable):
        await connect().json("GET", "/v1/health")


class OneAnswerServer:
    """A blocking server in a thread: each connection gets one answer (keep-alive, as far as
    the client can tell), then is closed; ``closed`` is set once it is."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen()
        self.closed = threading.Event()
        self.answered = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:  # the client left before its request was whole
                        break
                    data += chunk
                else:
                    self.answered += 1
                    conn.sendall(_json_answer("200 OK", {"answered": self.answered}))
            self.closed.set()


async def test_a_connection_closed_unheard_takes_no_request(socket_path: Path,
                                                            connect: Any) -> None:
    """The server closed the kept-alive connection (killed and restarted) while the client's
    event loop was blocked and could not hear it: the next call, a POST that is never
    retried, goes out on a new connection and is answered."""
    server = OneAnswerServer(socket_path)
    try:
        transport = connect()
        assert await transport.json("POST", "/v1/trajectories/t/-/resume") == {"answered": 1}
        assert server.closed.wait(10)  # blocks the loop: the client cannot hear the close
        assert await transport.json("POST", "/v1/trajectories/t/-/resume") == {"answered": 2}
    finally:
        server.listener.close()
