"""E2B's sandbox ports (``Sandbox.get_host(port)``) served through dsec's port proxy
(control/ports.py).

The SDK's ``get_host(port)`` is ``{port}-{sandboxID}.{domain}`` (``localhost:{port}`` in debug
mode, which reaches nothing of dsec's), and with ``E2B_SANDBOX_URL`` set the SDK names a
sandbox's port in the ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` headers. A request under
``/e2b`` is for a port (not envd's, 49983) when either says so: the two headers, or a
``Host`` of that form (send it to the server with ``Host: <get_host(port)>``, or point
wildcard DNS for the domain at the server). The path after ``/e2b`` goes to the port.

Access: a dsec API key (``X-API-Key``, ``Authorization``: as ``E2B_API_KEY``) or the
sandbox's envd access token (``X-Access-Token``), for HTTP and WebSocket (``ws://`` to the
same host form: control/port_ws.py) alike. E2B's ports are public unless restricted;
dsec's never are. Errors are E2B's gateway bodies (``{"sandboxId", "port", "code",
"message"}``).
"""

from __future__ import annotations

import re
from typing import Mapping

from fastapi import Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from ..control.port_ws import relay
from ..control.ports import forward, request_bytes
from ..control.routing import Router
from ..protocol.errors import (
    DSecError,
    PortUnavailable,
    SandboxDied,
    SandboxNotFound,
    Unauthorized,
)
from .auth import Keys
from .envd import ENVD_PORT, gone

HOST = re.compile(r"(\d{1,5})-(sb-[A-Za-z0-9]{1,64}-[0-9a-f]{1,64})\.[^/]+")  # a dsec sandbox id only


def port_of(headers: Mapping[str, str]) -> tuple[str, int] | None:
    """The sandbox and port a request is for, None for envd's (or a control-plane call)."""
    sandbox_id, port = headers.get("e2b-sandbox-id"), headers.get("e2b-sandbox-port")
    if not (sandbox_id and port):
        match = HOST.fullmatch(headers.get("host", ""))
        if match is None:
            return None
        port, sandbox_id = match.group(1), match.group(2)
    if port == ENVD_PORT or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        return None
    return sandbox_id, int(port)


class E2BPorts:
    """ASGI wrapper of the E2B app: requests for a sandbox's port go to it, the rest on."""

    def __init__(self, app: ASGIApp, router: Router, keys: Keys) -> None:
        self.app = app
        self.router = router
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        where = (port_of(HTTPConnection(scope).headers) if scope["type"] in ("http", "websocket")
                 else None)
        if where is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(WebSocket(scope, receive, send), *where)
        else:
            response = await self._serve(Request(scope, receive), *where)
            await response(scope, receive, send)

    async def _serve(self, request: Request, sandbox_id: str, port: int) -> Response:
        try:
            self._check_access(request, sandbox_id)
            edge = self.router.edge_for(sandbox_id)
            raw = request_bytes(request.method, _target(request), request.headers.items(),
                                await request.body(), port)
            return await forward(edge.proxy_port(sandbox_id, port, raw), request.method,
                                 sandbox_id, port)
        except DSecError as exc:
            return _refusal(exc, sandbox_id, port)

    async def _websocket(self, websocket: WebSocket, sandbox_id: str, port: int) -> None:
        """A WebSocket to the port (control/port_ws.py); refusals are the same bodies."""
        try:
            self._check_access(websocket, sandbox_id)
            edge = self.router.edge_for(sandbox_id)
            await relay(websocket, sandbox_id, port, _target(websocket), edge.proxy_port,
                        edge.port_send)
        except DSecError as exc:
            await websocket.send_denial_response(_refusal(exc, sandbox_id, port))

    def _check_access(self, connection: HTTPConnection, sandbox_id: str) -> None:
        headers = connection.headers
        if not (self.keys.valid(self.keys.from_headers(headers))
                or self.keys.valid_access_token(sandbox_id, headers.get("x-access-token"))):
            raise Unauthorized("a dsec API key (X-API-Key) or the sandbox's X-Access-Token is "
                               "required")


def _refusal(exc: DSecError, sandbox_id: str, port: int) -> Response:
    """E2B's gateway body for a typed error."""
    if isinstance(exc, (SandboxNotFound, SandboxDied)):
        return gone(sandbox_id).response()
    if isinstance(exc, PortUnavailable):
        return JSONResponse({"sandboxId": sandbox_id, "port": port, "code": 502,
                             "message": f"The sandbox is running but port is not open: "
                                        f"{exc.message}"}, status_code=502)
    if isinstance(exc, Unauthorized):
        return JSONResponse({"sandboxId": sandbox_id, "port": port, "code": 401,
                             "message": exc.message}, status_code=401)
    return JSONResponse({"code": exc.status, "message": exc.message}, status_code=exc.status)


def _target(request: HTTPConnection) -> str:
    """The raw path below the mount (``/e2b``) and the query, as they came."""
    raw = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")
    root = request.scope.get("root_path", "")
    path = raw[len(root):] if root and raw.startswith(root) else raw
    query = request.scope.get("query_string", b"").decode("latin-1")
    return (path or "/") + (f"?{query}" if query else "")
