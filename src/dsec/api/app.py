"""The HTTP API: a thin, stateless ASGI front over the edges.

Every route authenticates with an API key (``Authorization: Bearer dsk_...``), finds the
owning edge from the sandbox id, and maps ``DSecError`` to ``{"error": {...}}`` with the
error's status. Streams (exec output, process attach) are NDJSON: one JSON event per line,
``{"type": "stdout"|"stderr", "data": <base64>}`` (an image build's: ``{"type": "log",
"message": ...}``), then ``{"type": "result", "result": ...}`` or ``{"type": "error", ...}``.
Calls on a sandbox attached to a trajectory carry their step (``X-DSec-Step``) and are logged
and fast-forwarded by ``dsec.trajectory.recorder``, which ``Router.edge_for`` puts in front of
the edge.

The sandbox routes are those of the table of operations (``dsec.protocol.ops``: method and
path); tests/unit/test_operations.py checks that each of its operations has its route here.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..agent.client import Output
from ..compat.multipart import form_parts
from ..control.idempotency import REPLAYED_HEADER
from ..control.plane import ControlPlane
from ..control.ports import PortTokens
from ..protocol.build import BuildLog, ImageBuildRequest, ImageBuilt
from ..protocol.errors import DSecError, InvalidRequest, Unauthorized
from ..protocol.gc_models import GcReport
from ..protocol.models import (
    CreateRequest,
    ExecRequest,
    ExecResult,
    FileEntry,
    NetworkRequest,
    ProcessInfo,
    PtyRequest,
    ResizeRequest,
    RollbackRequest,
    SandboxInfo,
    SignalRequest,
    Snapshot,
    SnapshotRequest,
    TtlRequest,
    b64,
)
from ..trajectory.recorder import Call
from .dashboard import dashboard_routes
from .fn_routes import fn_routes
from .limits import BodyLimit, typed_http_error
from .port_routes import port_routes
from .project_routes import project_routes
from .trajectories import trajectory_routes

NDJSON = "application/x-ndjson"
CALL_SCOPE_KEY = "dsec.call"


def create_app(control: ControlPlane) -> FastAPI:
    """The HTTP routes over a composed control plane (``control.compose``)."""
    router, store, registry, projects = (control.router, control.store, control.registry,
                                         control.projects)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await control.start()
        yield
        await control.close()

    app = FastAPI(title="dsec", version="0.1.0", lifespan=lifespan,
                  description="Elastic sandboxes for agentic RL and evaluation.")

    @app.exception_handler(DSecError)
    async def dsec_error(request: Request, exc: DSecError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug, not a user error: still a typed JSON error for the client (and a traceback
        in the server log, which the server middleware prints after this returns)."""
        return JSONResponse(DSecError(f"internal error: {exc!r}").to_json(), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = InvalidRequest("invalid request", errors=_json_safe(exc.errors()))
        return JSONResponse(err.to_json(), status_code=err.status)

    app.add_exception_handler(StarletteHTTPException, typed_http_error)

    known_keys: dict[str, str] = {}  # secret -> key id; keys are never revoked yet

    async def authenticated(request: HTTPConnection) -> str:
        """Async on purpose: FastAPI runs a sync dependency in a thread, on every request.
        (An HTTPConnection: the WebSocket routes of ports call it too.)"""
        scheme, _, secret = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secret:
            raise Unauthorized("a valid API key is required (Authorization: Bearer dsk_...)")
        key_id = known_keys.get(secret) or store.key_for_secret(secret)
        if key_id is None:
            raise Unauthorized("a valid API key is required (Authorization: Bearer dsk_...)")
        known_keys[secret] = key_id
        projects.enter(key_id)
        return key_id

    auth = [Depends(authenticated)]

    async def call_of(request: Request, caller: str = Depends(authenticated)) -> Call:
        """Who calls, and at which step of the sandbox's trajectory (``X-DSec-Step``, with
        ``X-DSec-On-Divergence: raise|fork``). Kept in the scope for the response headers."""
        call = Call(caller=caller)
        step = request.headers.get("x-dsec-step")
        if step is not None:
            if not (step.isascii() and step.isdigit()) or int(step) < 1:
                raise InvalidRequest("X-DSec-Step must be a positive integer", step=step)
            call.step = int(step)
        mode = request.headers.get("x-dsec-on-divergence", "raise")
        if mode not in ("raise", "fork"):
            raise InvalidRequest("X-DSec-On-Divergence must be 'raise' or 'fork'", value=mode)
        call.on_divergence = mode  # type: ignore[assignment]
        request.scope[CALL_SCOPE_KEY] = call
        return call

    @app.get("/metrics", dependencies=auth, response_class=Response)
    async def metrics() -> Response:
        """Prometheus exposition (scrape with ``authorization: Bearer <admin key>``)."""
        projects.require_admin()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/admin/gc", dependencies=auth)
    async def gc(dry_run: bool = False) -> GcReport:
        """Collect garbage now, past the server's retention (admin key only): what was
        removed, by kind; with ``dry_run``, what would be, removing nothing."""
        projects.require_admin()
        return await control.gc.collect(time.time(), dry_run)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "edges": router.describe()}

    @app.post("/v1/sandboxes", dependencies=auth, status_code=201)
    async def create(req: CreateRequest, response: Response,
                     caller: str = Depends(authenticated),
                     idempotency_key: str | None = Header(None)) -> SandboxInfo:
        """With ``Idempotency-Key``, a retry of the same request gets the same sandbox."""
        info, replayed = await router.create_once(idempotency_key, "native", req,
                                                  lambda: router.create(req, caller))
        if replayed:
            response.headers[REPLAYED_HEADER] = "true"
        return info

    @app.get("/v1/sandboxes", dependencies=auth)
    async def list_sandboxes() -> list[SandboxInfo]:
        return router.list_visible()

    @app.get("/v1/sandboxes/{sandbox_id}", dependencies=auth)
    async def get(sandbox_id: str) -> SandboxInfo:
        edge = router.owner(sandbox_id)
        return edge.info(edge.get_row(sandbox_id))

    @app.delete("/v1/sandboxes/{sandbox_id}", dependencies=auth, status_code=204)
    async def stop(sandbox_id: str) -> Response:
        await router.owner(sandbox_id).stop(sandbox_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/snapshots", dependencies=auth, status_code=201)
    async def snapshot(sandbox_id: str, req: SnapshotRequest) -> Snapshot:
        """A copy of the sandbox's file system to start sandboxes from (see docs/API.md)."""
        return await router.snapshot(sandbox_id, req.mode, req.previous, req.ttl_s)

    @app.post("/v1/sandboxes/{sandbox_id}/rollback", dependencies=auth)
    async def rollback(sandbox_id: str, req: RollbackRequest) -> SandboxInfo:
        """The sandbox back at one of its own snapshots, processes fresh."""
        edge = router.owner(sandbox_id)
        router.visible_snapshot(req.snapshot)  # one the caller may see, else SnapshotNotFound
        return await edge.rollback(sandbox_id, req.snapshot)

    @app.get("/v1/snapshots", dependencies=auth)
    async def list_snapshots() -> list[Snapshot]:
        return router.snapshots()

    @app.delete("/v1/snapshots/{snapshot_id}", dependencies=auth, status_code=204)
    async def delete_snapshot(snapshot_id: str) -> Response:
        await router.delete_snapshot(snapshot_id)
        return Response(status_code=204)

    @app.put("/v1/sandboxes/{sandbox_id}/ttl", dependencies=auth)
    async def set_ttl(sandbox_id: str, req: TtlRequest) -> SandboxInfo:
        return await router.owner(sandbox_id).set_ttl(sandbox_id, req.ttl_s)

    @app.post("/v1/sandboxes/{sandbox_id}/pause", dependencies=auth)
    async def pause(sandbox_id: str) -> SandboxInfo:
        """Freeze the sandbox (no CPU) until resumed; any later call resumes it first."""
        return await router.owner(sandbox_id).pause(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/resume", dependencies=auth)
    async def resume(sandbox_id: str) -> SandboxInfo:
        """Let a paused sandbox run again (a no-op if it runs)."""
        return await router.owner(sandbox_id).resume(sandbox_id)

    @app.put("/v1/sandboxes/{sandbox_id}/network", dependencies=auth)
    async def set_network(sandbox_id: str, req: NetworkRequest) -> SandboxInfo:
        """Replace the sandbox's egress policy while it runs (see docs/NETWORK.md)."""
        return await router.owner(sandbox_id).set_network(sandbox_id, req.network)

    @app.post("/v1/sandboxes/{sandbox_id}/exec", dependencies=auth)
    async def run(sandbox_id: str, req: ExecRequest, call: Call = Depends(call_of)) -> ExecResult:
        return await router.edge_for(sandbox_id, call).run(sandbox_id, req)

    @app.post("/v1/sandboxes/{sandbox_id}/exec/stream", dependencies=auth,
              response_class=StreamingResponse)
    async def stream(sandbox_id: str, req: ExecRequest,
                     call: Call = Depends(call_of)) -> StreamingResponse:
        return await _ndjson(router.edge_for(sandbox_id, call).stream(sandbox_id, req))

    @app.post("/v1/sandboxes/{sandbox_id}/processes", dependencies=auth, status_code=201)
    async def start_process(sandbox_id: str, req: ExecRequest,
                            call: Call = Depends(call_of)) -> ProcessInfo:
        return await router.edge_for(sandbox_id, call).start_process(sandbox_id, req)

    @app.get("/v1/sandboxes/{sandbox_id}/processes", dependencies=auth)
    async def processes(sandbox_id: str, call: Call = Depends(call_of)) -> list[ProcessInfo]:
        return await router.edge_for(sandbox_id, call).processes(sandbox_id)

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{process}/output", dependencies=auth,
             response_class=StreamingResponse)
    async def attach(sandbox_id: str, process: str,
                     call: Call = Depends(call_of)) -> StreamingResponse:
        return await _ndjson(router.edge_for(sandbox_id, call).attach(sandbox_id, process))

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process}/signal", dependencies=auth,
              status_code=204)
    async def signal(sandbox_id: str, process: str, req: SignalRequest,
                     call: Call = Depends(call_of)) -> Response:
        await router.edge_for(sandbox_id, call).signal(sandbox_id, process, req.signal)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process}/stdin", dependencies=auth,
              status_code=204)
    async def send_stdin(sandbox_id: str, process: str, request: Request,
                         call: Call = Depends(call_of)) -> Response:
        """The body's bytes, for the process's stdin (or terminal); see docs/API.md."""
        data = await request.body()
        await router.edge_for(sandbox_id, call).send_stdin(sandbox_id, process, data)
        return Response(status_code=204)

    @app.delete("/v1/sandboxes/{sandbox_id}/processes/{process}/stdin", dependencies=auth,
                status_code=204)
    async def close_stdin(sandbox_id: str, process: str,
                          call: Call = Depends(call_of)) -> Response:
        await router.edge_for(sandbox_id, call).close_stdin(sandbox_id, process)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/ptys", dependencies=auth, status_code=201)
    async def start_pty(sandbox_id: str, req: PtyRequest,
                        call: Call = Depends(call_of)) -> ProcessInfo:
        """A command on a new pseudo-terminal, in the background (output: attach)."""
        return await router.edge_for(sandbox_id, call).start_pty(sandbox_id, req)

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process}/resize", dependencies=auth,
              status_code=204)
    async def resize_pty(sandbox_id: str, process: str, req: ResizeRequest,
                         call: Call = Depends(call_of)) -> Response:
        await router.edge_for(sandbox_id, call).resize_pty(sandbox_id, process, req.cols,
                                                           req.rows)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files", dependencies=auth,
             response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}})
    async def read_file(sandbox_id: str, path: str, call: Call = Depends(call_of)) -> Response:
        data = await router.edge_for(sandbox_id, call).read_file(sandbox_id, path)
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files", dependencies=auth, status_code=204)
    async def write_file(sandbox_id: str, path: str, request: Request,
                         mode: int = Query(0o644, ge=0, le=0o7777), append: bool = False,
                         call: Call = Depends(call_of)) -> Response:
        data = await request.body()
        await router.edge_for(sandbox_id, call).write_file(sandbox_id, path, data, mode, append)
        return Response(status_code=204)

    @app.delete("/v1/sandboxes/{sandbox_id}/files", dependencies=auth, status_code=204)
    async def remove(sandbox_id: str, path: str, recursive: bool = False,
                     call: Call = Depends(call_of)) -> Response:
        await router.edge_for(sandbox_id, call).remove(sandbox_id, path, recursive)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/dirs", dependencies=auth)
    async def list_dir(sandbox_id: str, path: str,
                       call: Call = Depends(call_of)) -> list[FileEntry]:
        return await router.edge_for(sandbox_id, call).list_dir(sandbox_id, path)

    @app.post("/v1/sandboxes/{sandbox_id}/dirs", dependencies=auth, status_code=204)
    async def mkdir(sandbox_id: str, path: str, parents: bool = False,
                    call: Call = Depends(call_of)) -> Response:
        await router.edge_for(sandbox_id, call).mkdir(sandbox_id, path, parents)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/stat", dependencies=auth)
    async def stat(sandbox_id: str, path: str, call: Call = Depends(call_of)) -> FileEntry:
        return await router.edge_for(sandbox_id, call).stat(sandbox_id, path)

    @app.get("/v1/sandboxes/{sandbox_id}/archive", dependencies=auth, response_class=Response,
             responses={200: {"content": {"application/x-tar": {}}}})
    async def download(sandbox_id: str, path: str, call: Call = Depends(call_of)) -> Response:
        data = await router.edge_for(sandbox_id, call).download_tar(sandbox_id, path)
        return Response(data, media_type="application/x-tar")

    @app.put("/v1/sandboxes/{sandbox_id}/archive", dependencies=auth, status_code=204)
    async def upload(sandbox_id: str, path: str, request: Request,
                     call: Call = Depends(call_of)) -> Response:
        await router.edge_for(sandbox_id, call).upload_tar(sandbox_id, path, await request.body())
        return Response(status_code=204)

    @app.post("/v1/images/build", dependencies=auth, response_class=StreamingResponse)
    async def build_image(request: Request) -> StreamingResponse:
        """A Dockerfile build (docs/IMAGES.md). multipart/form-data: a ``request`` part (an
        ``ImageBuildRequest`` as JSON) and a ``context`` part (a plain tar, may be absent);
        NDJSON log lines, then the result."""
        req, context = _build_parts(request.headers.get("content-type", ""),
                                    await request.body())
        return await _ndjson(router.build_image(req, context))

    app.include_router(trajectory_routes(router, store, authenticated), dependencies=auth)
    app.include_router(project_routes(projects), dependencies=auth)
    app.include_router(dashboard_routes(router, projects, registry, auth))
    app.include_router(fn_routes(router), dependencies=auth)
    app.include_router(port_routes(router, PortTokens(control.settings.state_dir), authenticated))
    app.add_middleware(CallHeaders)
    app.add_middleware(BodyLimit)
    return app


class CallHeaders:
    """Adds what the trajectory recorder said about a call (``X-DSec-Trajectory``) to its
    response, whatever the route returned."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                call = scope.get(CALL_SCOPE_KEY)
                if call is not None and call.source is not None:
                    message["headers"] = [*message.get("headers", []), call.response_header()]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _build_parts(content_type: str, body: bytes) -> tuple[ImageBuildRequest, bytes]:
    try:
        parts = {part.name: part.content for part in form_parts(content_type, body)}
        req = ImageBuildRequest.model_validate_json(parts["request"])
    except (ValueError, KeyError) as exc:  # pydantic's ValidationError is a ValueError
        raise InvalidRequest("a build is multipart/form-data: a 'request' part (JSON: name, "
                             f"dockerfile, ...) and a 'context' part (a tar): {exc}"[:2000]) from None
    return req, parts.get("context", b"")


async def _ndjson(events: AsyncIterator[Any]) -> StreamingResponse:
    """Stream events as NDJSON. The first event is awaited before the response starts, so an
    unknown sandbox or a bad request is still an ordinary HTTP error."""
    iterator = aiter(events)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        first = None

    async def lines() -> AsyncIterator[bytes]:
        if first is not None:
            yield _event_line(first)
        try:
            async for event in iterator:
                yield _event_line(event)
        except DSecError as exc:
            yield json.dumps({"type": "error", **exc.to_json()}).encode() + b"\n"

    return StreamingResponse(lines(), media_type=NDJSON)


def _json_safe(value: Any) -> Any:
    """Validation errors echo the input: keep it renderable as JSON (no NaN or infinities,
    no lone surrogates, no objects)."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_json_safe(str(k)): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return _json_safe(str(value))


def _event_line(event: Output | ExecResult | BuildLog | ImageBuilt) -> bytes:
    if isinstance(event, Output):
        body: dict[str, Any] = {"type": "stdout" if event.fd == 1 else "stderr", "data": b64(event.data)}
    elif isinstance(event, BuildLog):
        body = {"type": "log", "message": event.message}
    else:
        body = {"type": "result", "result": event.model_dump()}
    return json.dumps(body).encode() + b"\n"
