"""Sandbox ports over HTTP: a client's request to a port inside a sandbox, through the API
server only (docs/API.md, "Sandbox ports"; E2B's ``get_host``: compat/e2b.py).

Why this shape: the API server is the one door. A request is re-made here with h11 (the
sans-I/O HTTP/1.1 library uvicorn and httpx are built on) as ``Connection: close`` bytes, and
its answer parsed back with h11, so the edge and the agent only move bytes
(edge/ports.py, the agent's ``N`` pipe); this works the same for containers and VMs,
embedded and under ``--ray`` (the router's owner edge, a stream like exec output), and opens
no host port. A request goes whole to the edge and its answer streams back; a WebSocket (an
upgraded, two-way connection) is control/port_ws.py, over the same ``Answer`` reading.

Trust: the request is the caller's, the answer the sandbox's (hostile).

- Credentials never reach the sandbox: ``Authorization``, ``X-API-Key``, cookies, E2B's
  tokens and routing headers, dsec's own ``X-DSec-*`` are dropped, and so are hop-by-hop
  headers (``Upgrade`` too: an HTTP route never upgrades). ``Host`` is ``localhost:PORT``.
- The answer is only passed back: a redirect (to the API server, say) goes to the client as
  it is, never followed here. Its head is bounded (``HEAD_MAX``), its body streamed as the
  client reads it. Hop-by-hop headers are dropped, and every answer carries
  ``Content-Security-Policy: sandbox ...`` without ``allow-same-origin``: a page a sandbox
  serves runs in an opaque origin in a browser, so its scripts cannot read what the API
  server's origin keeps (the dashboard's key in sessionStorage).
- A port token (``PortTokens``) is ``<sandbox id>.<port>.<HMAC>``: it opens that port of that
  sandbox and nothing else, and dies with the sandbox (its route looks the sandbox up).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Sequence

import h11
from starlette.responses import StreamingResponse

from ..protocol.errors import InvalidRequest, PortUnavailable, Unauthorized
from ..store.secret import load_secret

HEAD_MAX = 64 << 10  # status line and headers of the sandbox's answer
DROPPED_REQUEST = frozenset({
    "authorization", "proxy-authorization", "x-api-key", "cookie", "x-access-token",
    "e2b-traffic-access-token", "e2b-sandbox-id", "e2b-sandbox-port", "host", "content-length",
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
    "upgrade", "expect"})
# a WebSocket handshake's headers the proxy makes itself for the sandbox's side (port_ws.py)
WEBSOCKET_OWN = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                           "sec-websocket-accept", "sec-websocket-protocol"})
DROPPED_RESPONSE = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding",
                              "trailer", "upgrade"})
SANDBOXED = (b"content-security-policy",
             b"sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads")


class PortTokens:
    """Per-sandbox, per-port tokens, verifiable without state (HMAC with a secret kept in the
    state directory, ``ports.secret``)."""

    def __init__(self, state_dir: Path) -> None:
        self._secret = load_secret(state_dir / "ports.secret")

    def mint(self, sandbox_id: str, port: int) -> str:
        mac = hmac.new(self._secret, f"port {sandbox_id} {port}".encode(), hashlib.sha256)
        return f"{sandbox_id}.{port}.{mac.hexdigest()}"

    def check(self, token: str) -> tuple[str, int]:
        """The sandbox and port a token opens; Unauthorized for anything else."""
        sandbox_id, _, rest = token.partition(".")
        port, _, _ = rest.partition(".")
        if (port.isascii() and port.isdigit() and len(port) <= 5
                and hmac.compare_digest(self.mint(sandbox_id, int(port)), token)):
            return sandbox_id, int(port)
        raise Unauthorized("invalid port token (a token opens one port of one sandbox)")


def check_port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise InvalidRequest("port must be 1-65535", port=port)
    return port


def request_bytes(method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes,
                  port: int, upgrade: Sequence[tuple[str, str]] = ()) -> bytes:
    """The request as the sandbox's server gets it: credentials and hop-by-hop headers
    dropped, ``Connection: close``, the body whole (``Content-Length``). With ``upgrade`` (a
    WebSocket handshake's own headers, control/port_ws.py) those instead, and no body."""
    kept = [(k, v) for k, v in headers
            if k.lower() not in DROPPED_REQUEST and not k.lower().startswith("x-dsec-")
            and not (upgrade and k.lower() in WEBSOCKET_OWN)]
    hop = list(upgrade) or [("Connection", "close"), ("Content-Length", str(len(body)))]
    conn = h11.Connection(h11.CLIENT)
    try:
        return b"".join((
            conn.send(h11.Request(method=method, target=target or "/", headers=[
                ("Host", f"localhost:{port}"), *kept, *hop])) or b"",
            conn.send(h11.Data(data=body)) or b"" if body and not upgrade else b"",
            b"" if upgrade else conn.send(h11.EndOfMessage()) or b""))
    except h11.LocalProtocolError as exc:
        raise InvalidRequest(f"cannot forward this request: {exc}") from None


class Answer:
    """The sandbox's answer (``chunks``: its bytes, from the edge's ``proxy_port``) read with
    h11: its head, then its body as a response streamed to the client, or after a ``101``
    the bytes of the switched protocol (``upgraded``)."""

    def __init__(self, chunks: AsyncIterator[bytes], method: str, sandbox_id: str, port: int,
                 upgrade: bool = False) -> None:
        self.source = aiter(chunks)
        self.sandbox_id, self.port = sandbox_id, port
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_MAX)
        proposal = [("Upgrade", "websocket"), ("Connection", "Upgrade")] if upgrade else []
        self.conn.send(h11.Request(method=method, target="/", headers=[("Host", "x"), *proposal]))
        self.conn.send(h11.EndOfMessage())

    async def _event(self) -> Any:
        while True:
            ev = self.conn.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            self.conn.receive_data(await anext(self.source, b""))

    async def head(self) -> h11.Response | h11.InformationalResponse:
        """The answer's status and headers (a 101 only where an upgrade was proposed);
        PortUnavailable if no answer head comes."""
        try:
            head = await self._event()
            while isinstance(head, h11.InformationalResponse) and head.status_code != 101:
                head = await self._event()
            if not isinstance(head, (h11.Response, h11.InformationalResponse)):
                raise h11.RemoteProtocolError("the connection closed before an answer")
            if sum(len(k) + len(v) + 4 for k, v in head.headers) > HEAD_MAX:  # h11 bounds only
                raise h11.RemoteProtocolError(f"its head is over {HEAD_MAX} bytes")  # an incomplete one
        except h11.RemoteProtocolError as exc:
            await self.close()
            raise self.unavailable(f"gave no HTTP answer: {exc}", "no_answer") from None
        except BaseException:
            await self.close()
            raise
        return head

    def unavailable(self, what: str, reason: str) -> PortUnavailable:
        return PortUnavailable(f"port {self.port} in sandbox {self.sandbox_id} {what}",
                               sandbox_id=self.sandbox_id, port=self.port, reason=reason)

    def response(self, head: h11.Response) -> StreamingResponse:
        """The answer as a response streamed to the client (and as a WebSocket's refusal)."""
        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    ev = await self._event()
                    if isinstance(ev, h11.Data):
                        yield bytes(ev.data)
                    else:  # EndOfMessage
                        return
            except h11.RemoteProtocolError:
                return  # cut short (closed, idle, over the bound): the client sees a short body
            finally:
                await self.close()

        headers = [(k, v) for k, v in head.headers if k.decode().lower() not in DROPPED_RESPONSE]
        response = StreamingResponse(body(), status_code=head.status_code)
        response.raw_headers = [*headers, SANDBOXED]
        return response

    async def upgraded(self) -> AsyncIterator[bytes]:
        """After a 101: the bytes that came with its head, then the rest as it comes."""
        try:
            rest, _ = self.conn.trailing_data
            if rest:
                yield bytes(rest)
            async for chunk in self.source:
                yield chunk
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop the edge's stream (its connection to the port closes with it)."""
        close = getattr(self.source, "aclose", None)
        if close is not None:
            await close()


async def forward(chunks: AsyncIterator[bytes], method: str, sandbox_id: str,
                  port: int) -> StreamingResponse:
    """The sandbox's answer as a response streamed to the client; PortUnavailable if no
    answer head comes."""
    answer = Answer(chunks, method, sandbox_id, port)
    head = await answer.head()
    assert isinstance(head, h11.Response)  # no upgrade proposed: h11 refuses a 101
    return answer.response(head)
