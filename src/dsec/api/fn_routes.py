"""HTTP routes of the fn substrate: ``POST /v1/call`` (body: a cloudpickled ``(fn, args,
kwargs)``; answer: the pickled return value) and ``POST /v1/run_code``. The router places
both on an edge serving fn and the image, after the caller's project admits them; errors are
the usual typed JSON (``remote_error`` when the function raised, ``command_timeout``,
``sandbox_died`` when the worker died)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ..control.routing import Router
from ..protocol.fn import DEFAULT_IMAGE, CodeResult, RunCodeRequest


def fn_routes(router: Router) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/call", response_class=Response,
              responses={200: {"content": {"application/octet-stream": {}}}})
    async def call(request: Request, image: str = DEFAULT_IMAGE,
                   timeout_s: float = Query(60.0, gt=0, le=3600)) -> Response:
        result = await router.call_fn(image, await request.body(), timeout_s)
        return Response(result, media_type="application/octet-stream")

    @api.post("/v1/run_code")
    async def run_code(req: RunCodeRequest) -> CodeResult:
        return await router.run_code(req)

    return api
