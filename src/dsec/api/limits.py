"""Request hygiene for the HTTP API: a body size limit, and typed errors for what Starlette
answers itself (unknown routes, wrong methods), so every error a client sees is a dsec error.

The body limit sits below the agent's frame limit: a file write or an exec's stdin travels to
the sandbox in one frame, so a larger body could never be delivered anyway. It is enforced on
``Content-Length`` before the app runs, and on the bytes actually received for chunked bodies.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..agent.protocol import MAX_FRAME
from ..protocol.errors import (
    DSecError,
    InvalidRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
)

MAX_BODY_BYTES = MAX_FRAME - (1 << 16)  # room for the frame's other fields (path, mode, ...)
# What Starlette and FastAPI raise themselves: an unreadable body, no such route, no such method.
_BY_STATUS: dict[int, type[DSecError]] = {400: InvalidRequest, 404: RouteNotFound,
                                          405: MethodNotAllowed}


class _TooLarge(HTTPException):
    """Raised from ``receive`` past the limit. An HTTPException, because FastAPI turns any
    other exception raised while it parses a JSON body into a 400; the app's handler for
    HTTPException (``typed_http_error``) answers it."""

    def __init__(self, limit: int) -> None:
        super().__init__(413)
        self.limit = limit


class BodyLimit:
    """ASGI middleware: bodies over ``limit`` bytes are answered ``413 payload_too_large``."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            await _payload_too_large(self.limit)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise _TooLarge(self.limit)
            return message

        await self.app(scope, counted, send)


def _payload_too_large(limit: int) -> JSONResponse:
    err = PayloadTooLarge(f"request body exceeds {limit} bytes", limit=limit)
    return JSONResponse(err.to_json(), status_code=err.status)


async def typed_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404 for an unknown path, 405, ...) as dsec errors."""
    assert isinstance(exc, HTTPException)
    if isinstance(exc, _TooLarge):
        return _payload_too_large(exc.limit)
    cls = _BY_STATUS.get(exc.status_code)
    body = (cls or DSecError)(str(exc.detail)).to_json()
    if cls is None:
        body["error"]["code"] = f"http_{exc.status_code}"
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
