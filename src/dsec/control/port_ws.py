"""WebSocket through sandbox ports: a client's WebSocket to a port inside a sandbox, through
the API server only (docs/API.md, "Sandbox ports"; plain HTTP is control/ports.py).

Why this shape: uvicorn (under Starlette) accepts an upgrade itself and hands the app
WebSocket *messages* (the ASGI ``websocket`` scope), never the raw connection, so a raw byte
pipe cannot be had without leaving ASGI. The proxy is therefore a WebSocket server to the
client (uvicorn's, ``ws="wsproto"``: server.py) and a WebSocket client to the sandbox's
server, made with wsproto (sans-I/O, the library uvicorn's end is built on) over the same
byte path as an HTTP request: the edge's ``proxy_port`` stream, opened with a session name,
carries the sandbox's bytes back, and ``port_send`` (a plain edge call, so the Ray edge
actor serves it like any other) carries the client's in. Messages are relayed as whole
messages, text as text, bytes as bytes; the client's subprotocols are offered as they came
and the one the sandbox's server picks is the one the client gets. Compression is not
offered to the sandbox (its frames are read as they are, never inflated).

Trust: the handshake is re-made like any request (control/ports.py: credentials, cookies,
tokens and ``X-DSec-*`` dropped, ``Host: localhost:PORT``, head capped); the proxy makes the
``Sec-WebSocket-Key`` and checks the answer's ``Sec-WebSocket-Accept``. An answer that is
not ``101`` is relayed as an HTTP answer, exactly like control/ports.py's (the client sees
the sandbox's 403, 404, redirect: not followed). What the sandbox's server sends is data:
bounded by ``MESSAGE_MAX`` per message (a larger one closes both sides with 1009), by the
edge's bounds (``PORT_BYTES_MAX`` per direction, the idle cut ``DSEC_PORT_IDLE_S`` counting
bytes either way, the per-sandbox connection count), and read only as fast as the client
takes it. A client that leaves ends the edge's stream, which closes the sandbox-side
connection (under ``--ray``: the stream's cancel on the edge actor).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any, AsyncIterator, Awaitable, Callable

import h11
from starlette.websockets import WebSocket, WebSocketDisconnect
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Message, Ping, TextMessage
from wsproto.frame_protocol import LOCAL_ONLY_CLOSE_REASONS
from wsproto.utilities import (
    LocalProtocolError,
    generate_accept_token,
    generate_nonce,
)

from ..protocol.errors import DSecError
from .ports import Answer, request_bytes

MESSAGE_MAX = 16 << 20  # one message either way (the client's: uvicorn's ws_max_size, server.py)
GONE, TOO_BIG, FAILED = 1001, 1009, 1011  # close codes the proxy gives the client

# the edge's proxy_port (sandbox, port, handshake bytes, session) and port_send (sandbox,
# session, bytes): the table's operations (dsec.protocol.ops), embedded or through Ray
Open = Callable[[str, int, bytes, str], AsyncIterator[bytes]]
Write = Callable[[str, str, bytes], Awaitable[None]]


async def relay(websocket: WebSocket, sandbox_id: str, port: int, target: str, open_: Open,
                write: Write) -> None:
    """Serve the client's WebSocket ``websocket`` from ``port`` in the sandbox, ``target``
    (path and query) on its server. A DSecError before the handshake is the caller's to
    answer (an HTTP error: nothing was accepted yet); after it, any failure closes the
    client's WebSocket with a code."""
    nonce = generate_nonce()
    offered = list(websocket.scope.get("subprotocols") or [])
    raw = request_bytes("GET", target, websocket.headers.items(), b"", port, upgrade=[
        ("Upgrade", "websocket"), ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", nonce.decode()), ("Sec-WebSocket-Version", "13"),
        *([("Sec-WebSocket-Protocol", ", ".join(offered))] if offered else [])])
    session = secrets.token_hex(16)
    answer = Answer(open_(sandbox_id, port, raw, session), "GET", sandbox_id, port, upgrade=True)
    try:
        head = await answer.head()
        if isinstance(head, h11.Response):  # not switched: the sandbox's answer, as an answer
            await websocket.send_denial_response(answer.response(head))
            return
        subprotocol = _accepted(head, nonce, offered, answer)
        await websocket.accept(subprotocol=subprotocol)
        await _pipe(websocket, answer.upgraded(), lambda data: write(sandbox_id, session, data))
    except (OSError, WebSocketDisconnect):  # the client left (uvicorn's, Starlette's word)
        return
    finally:
        await answer.close()


def _accepted(head: h11.InformationalResponse, nonce: bytes, offered: list[str],
              answer: Answer) -> str | None:
    """The subprotocol of a valid 101 for our handshake; PortUnavailable for any other."""
    headers = {k.decode().lower(): v.decode("latin-1") for k, v in head.headers}
    chosen = headers.get("sec-websocket-protocol")
    if headers.get("upgrade", "").lower() != "websocket":
        problem = "no Upgrade: websocket"
    elif headers.get("sec-websocket-accept") != generate_accept_token(nonce).decode():
        problem = "a wrong Sec-WebSocket-Accept"
    elif "sec-websocket-extensions" in headers:
        problem = "an extension that was not offered"
    elif chosen is not None and chosen not in offered:
        problem = "a subprotocol that was not offered"
    else:
        return chosen
    raise answer.unavailable(f"answered the WebSocket handshake with {problem}", "bad_handshake")


async def _pipe(websocket: WebSocket, incoming: AsyncIterator[bytes],
                write: Callable[[bytes], Awaitable[None]]) -> None:
    """Messages both ways until either side closes or a bound cuts; then both are closed."""
    conn = Connection(ConnectionType.CLIENT)
    writing = asyncio.Lock()  # one frame at a time into the edge (pongs beside messages)

    async def put(data: bytes) -> None:
        async with writing:
            await write(data)

    async def close_sandbox(code: int, reason: str = "") -> None:
        with contextlib.suppress(DSecError, LocalProtocolError):  # it may have gone already
            await put(conn.send(CloseConnection(code=_code(code), reason=reason)))

    async def up() -> tuple[int, str] | None:
        """The client's messages to the sandbox, until the client closes or leaves."""
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                await close_sandbox(message.get("code", 1000), message.get("reason") or "")
                return None  # nothing more can be said to the client
            data = message.get("bytes")
            await put(conn.send(Message(data=message.get("text", "") if data is None else data)))

    async def down() -> tuple[int, str]:
        """The sandbox's messages to the client; the code and reason to close the client with."""
        parts: list[Any] = []
        size = 0
        async for chunk in incoming:
            conn.receive_data(chunk)
            for event in conn.events():
                if isinstance(event, (TextMessage, BytesMessage)):
                    data = event.data
                    parts.append(data)
                    size += len(data.encode() if isinstance(data, str) else data)
                    if size > MESSAGE_MAX:
                        await close_sandbox(TOO_BIG, "message too big")
                        return TOO_BIG, f"the sandbox's message is over {MESSAGE_MAX} bytes"
                    if event.message_finished:
                        await websocket.send(
                            {"type": "websocket.send", "text": "".join(parts)}
                            if isinstance(event, TextMessage) else
                            {"type": "websocket.send", "bytes": b"".join(parts)})
                        parts, size = [], 0
                elif isinstance(event, Ping):
                    await put(conn.send(event.response()))
                elif isinstance(event, CloseConnection):  # also wsproto's for bad frames (1002)
                    with contextlib.suppress(DSecError, LocalProtocolError):
                        await put(conn.send(event.response()))
                    return _code(event.code), event.reason or ""
        return GONE, "the sandbox's side ended (closed, idle or over a bound)"

    tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        first = done.pop()
        try:
            closing = first.result()
        except LocalProtocolError:  # the client's message crossed the sandbox's close
            closing = GONE, "the sandbox's server closed the connection"
        except DSecError as exc:  # the edge ended it: idle, over a bound, the sandbox gone
            closing = FAILED, exc.message[:120]
        if closing is not None:
            with contextlib.suppress(OSError, RuntimeError, WebSocketDisconnect):  # gone too?
                await websocket.close(*closing)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        aclose = getattr(incoming, "aclose", None)
        if aclose is not None:
            await aclose()


def _code(code: int) -> int:
    """A close code that may be sent (1005, 1006 and 1015 are only ever reported)."""
    return 1000 if code in LOCAL_ONLY_CLOSE_REASONS or not 1000 <= code < 5000 else code
