"""Request hygiene for the HTTP API: a body size limit, and typed errors for what Starlette
answers itself (unknown routes, wrong methods), so every error a client sees is a dsec error.

The body limit sits below the agent's frame limit: a file write or an exec's stdin travels to
the sandbox in one frame, so a larger body could never be delivered anyway. It is enforced on
``Content-Length`` before the app runs, and on the bytes actually received for chunked bodies.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..agent.protocol import MAX_FRAME
from ..client.errors import (DSecError, InvalidRequest, MethodNotAllowed, PayloadTooLarge,
                             RouteNotFound, Unauthorized)

MAX_BODY_BYTES = MAX_FRAME - (1 << 16)  # room for the frame's other fields (path, mode, ...)
_BY_STATUS: dict[int, type[DSecError]] = {400: InvalidRequest, 401: Unauthorized,
                                          404: RouteNotFound, 405: MethodNotAllowed,
                                          413: PayloadTooLarge}


class _TooLarge(Exception):
    pass


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
            await self._refuse(scope, receive, send)
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise _TooLarge()
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = PayloadTooLarge(f"request body exceeds {self.limit} bytes", limit=self.limit)
        await JSONResponse(err.to_json(), status_code=err.status)(scope, receive, send)


async def typed_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404 for an unknown path, 405, ...) as dsec errors."""
    assert isinstance(exc, HTTPException)
    cls = _BY_STATUS.get(exc.status_code)
    err = (cls or DSecError)(str(exc.detail), status=exc.status_code)
    body = err.to_json()
    if cls is None:
        body["error"]["code"] = f"http_{exc.status_code}"
    return JSONResponse(json.loads(json.dumps(body, default=str)), status_code=exc.status_code,
                        headers=exc.headers)
