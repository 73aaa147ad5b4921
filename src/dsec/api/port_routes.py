"""The routes of sandbox ports (control/ports.py says how a request reaches the port):

- ``GET /v1/sandboxes/{id}/ports/{port}``: the port's URL path with a port token
  (``{"path": "/v1/ports/<token>/", "token": ...}``, what ``sb.url(port)`` joins to the base URL);
- ``/v1/sandboxes/{id}/ports/{port}/{path}``, any method, with the caller's API key;
- ``/v1/ports/{token}/{path}``, any method, with no key: the token opens that port only.

The URL path after the port (or token) and the query go to the sandbox's server as they came.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..control.ports import PortTokens, check_port, forward, request_bytes
from ..control.routing import Router

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# HEAD too, but not in the OpenAPI schema: its answers have no body, so none is a typed error
HEAD = {"methods": ["HEAD"], "include_in_schema": False}


def target(request: Request, prefix_segments: int) -> str:
    """The request's raw path after its first ``prefix_segments`` segments, with its query:
    percent-escapes are passed on undecoded."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    rest = raw.decode("latin-1").split("/", prefix_segments + 1)
    path = "/" + (rest[prefix_segments + 1] if len(rest) > prefix_segments + 1 else "")
    query = request.scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


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

    @api.api_route("/v1/ports/{token}/{path:path}", methods=METHODS)
    @api.api_route("/v1/ports/{token}/{path:path}", **HEAD)  # type: ignore[arg-type]
    @api.api_route("/v1/ports/{token}", methods=METHODS)
    @api.api_route("/v1/ports/{token}", **HEAD)  # type: ignore[arg-type]
    async def with_token(token: str, request: Request, path: str = "") -> Response:
        sandbox_id, port = tokens.check(token)
        edge = router.edge_for(sandbox_id)
        raw = await encoded(request, port, 3)
        return await forward(edge.proxy_port(sandbox_id, port, raw), request.method, sandbox_id, port)

    return api
