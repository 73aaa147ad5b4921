"""The routes of sandbox ports (control/ports.py says how a request reaches the port):

- ``GET /v1/sandboxes/{id}/ports/{port}``: the port's URL path with a port token
  (``{"path": "/v1/ports/<token>/", "token": ...}``, what ``sb.url(port)`` joins to the base URL);
- ``/v1/sandboxes/{id}/ports/{port}/{path}``, any method, with the caller's API key;
- ``/v1/ports/{token}/{path}``, any method, with no key: the token opens that port only.

Each of the last two also takes a WebSocket (``ws://``: control/port_ws.py relays it), with
the same access; a refusal before the handshake is an HTTP answer with the typed error.
The URL path after the port (or token) and the query go to the sandbox's server as they came.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.requests import HTTPConnection

from ..control.port_ws import relay
from ..control.ports import PortTokens, check_port, forward, request_bytes
from ..control.routing import Router
from ..protocol.errors import DSecError, InvalidRequest

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# HEAD too, but not in the OpenAPI schema: its answers have no body, so none is a typed error
HEAD = {"methods": ["HEAD"], "include_in_schema": False}


def target(request: HTTPConnection, prefix_segments: int) -> str:
    """The request's raw path after its first ``prefix_segments`` segments, with its query:
    percent-escapes are passed on undecoded."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    rest = raw.decode("latin-1").split("/", prefix_segments + 1)
    path = "/" + (rest[prefix_segments + 1] if len(rest) > prefix_segments + 1 else "")
    query = request.scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


def number(port: str) -> int:
    """A WebSocket route's port (FastAPI would close a WebSocket on a type error, untyped)."""
    if not (port.isascii() and port.isdigit() and len(port) <= 5):
        raise InvalidRequest("port must be 1-65535", port=port)
    return check_port(int(port))


async def refused_on_error(websocket: WebSocket, serve: Callable[[], Awaitable[None]]) -> None:
    """``serve()``; a typed error before the handshake answered as the HTTP error it is."""
    try:
        await serve()
    except DSecError as exc:
        await websocket.send_denial_response(JSONResponse(exc.to_json(), status_code=exc.status))


async def encoded(request: Request, port: int, prefix_segments: int) -> bytes:
    return request_bytes(request.method, target(request, prefix_segments),
                         request.headers.items(), await request.body(), port)


def port_routes(router: Router, tokens: PortTokens, authenticated: Callable[..., Any]) -> APIRouter:
    api = APIRouter()
    auth = [Depends(authenticated)]

    @api.get("/v1/sandboxes/{sandbox_id}/ports/{port}", dependencies=auth)
    async def port_url(sandbox_id: str, port: int) -> dict[str, str]:
        router.owner(sandbox_id).require_live(sandbox_id)
        token = tokens.mint(sandbox_id, check_port(port))
        return {"path": f"/v1/ports/{token}/", "token": token}

    @api.api_route("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}", methods=METHODS,
                   dependencies=auth)
    @api.api_route("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}", dependencies=auth,
                   **HEAD)  # type: ignore[arg-type]
    async def with_key(sandbox_id: str, port: int, path: str, request: Request) -> Response:
        edge = router.edge_for(sandbox_id)
        raw = await encoded(request, check_port(port), 5)
        return await forward(edge.proxy_port(sandbox_id, port, raw), request.method, sandbox_id, port)

    @api.websocket("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}")
    async def websocket_with_key(websocket: WebSocket, sandbox_id: str, port: str) -> None:
        async def serve() -> None:
            await authenticated(websocket)
            edge = router.edge_for(sandbox_id)
            await relay(websocket, sandbox_id, number(port), target(websocket, 5),
                        edge.proxy_port, edge.port_send)
        await refused_on_error(websocket, serve)

    @api.api_route("/v1/ports/{token}/{path:path}", methods=METHODS)
    @api.api_route("/v1/ports/{token}/{path:path}", **HEAD)  # type: ignore[arg-type]
    @api.api_route("/v1/ports/{token}", methods=METHODS)
    @api.api_route("/v1/ports/{token}", **HEAD)  # type: ignore[arg-type]
    async def with_token(token: str, request: Request, path: str = "") -> Response:
        sandbox_id, port = tokens.check(token)
        edge = router.edge_for(sandbox_id)
        raw = await encoded(request, port, 3)
        return await forward(edge.proxy_port(sandbox_id, port, raw), request.method, sandbox_id, port)

    @api.websocket("/v1/ports/{token}/{path:path}")
    @api.websocket("/v1/ports/{token}")
    async def websocket_with_token(websocket: WebSocket, token: str) -> None:
        async def serve() -> None:
            sandbox_id, port = tokens.check(token)
            edge = router.edge_for(sandbox_id)
            await relay(websocket, sandbox_id, port, target(websocket, 3),
                        edge.proxy_port, edge.port_send)
        await refused_on_error(websocket, serve)

    return api
