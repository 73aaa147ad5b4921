"""HTTP routes of the fn substrate: ``POST /v1/call`` (body: a cloudpickled ``(fn, args,
kwargs)``; answer: the pickled return value) and ``POST /v1/run_code``. Both go to the
least-loaded edge that serves fn; errors are the usual typed JSON (``remote_error`` when the
function raised, ``command_timeout``, ``sandbox_died`` when the worker died)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ..client.errors import NotSupported
from ..client.fn import DEFAULT_IMAGE, CodeResult, RunCodeRequest
from ..edge.edge import Edge
from ..substrates.fn import FnSubstrate
from .routing import Router


def fn_routes(router: Router) -> APIRouter:
    api = APIRouter()

    def fn_edge() -> tuple[Edge, FnSubstrate]:
        serving = [e for e in router.edges.values() if isinstance(e.substrates.get("fn"), FnSubstrate)]
        if not serving:
            raise NotSupported("no edge serves the fn substrate")
        edge = min(serving, key=Edge.load)
        return edge, edge.substrates["fn"]  # type: ignore[return-value]

    @api.post("/v1/call", response_class=Response,
              responses={200: {"content": {"application/octet-stream": {}}}})
    async def call(request: Request, image: str = DEFAULT_IMAGE,
                   timeout_s: float = Query(60.0, gt=0, le=3600)) -> Response:
        edge, fn = fn_edge()
        result = await fn.call(edge.images.get(image), await request.body(), timeout_s)
        return Response(result, media_type="application/octet-stream")

    @api.post("/v1/run_code")
    async def run_code(req: RunCodeRequest) -> CodeResult:
        edge, fn = fn_edge()
        fields = await fn.run_code(edge.images.get(req.image), req.language, req.code, req.stdin,
                                   req.timeout_s, req.max_output_bytes)
        return CodeResult.model_validate(fields)

    return api
