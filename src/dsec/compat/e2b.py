"""E2B compatibility: the control plane (``e2b-dev/infra`` ``spec/openapi.yml``) and the
sandboxes' data plane (envd, see ``envd.py``), served together under one prefix so that the
E2B SDK's single-gateway configuration works unchanged::

    E2B_API_URL=http://HOST:PORT/e2b  E2B_SANDBOX_URL=http://HOST:PORT/e2b  E2B_API_KEY=<dsec key>

Control plane (``X-API-Key`` or ``Authorization: Bearer``, any dsec API key; a project
key sees and creates only its project's sandboxes, see docs/PROJECTS.md):

- ``POST /sandboxes``, ``POST /v2/sandboxes``: create from a template (a project's built
  template, the static mapping, or a dsec image name: ``Templates.resolve``); the SDK's ``Idempotency-Key`` makes its retries return the same sandbox (control/idempotency.py)
- ``GET /sandboxes``, ``GET /v2/sandboxes`` (metadata/state/template filters, pagination)
- ``GET /sandboxes/{id}``, ``DELETE /sandboxes/{id}``, ``POST /sandboxes/{id}/timeout``
- ``POST /sandboxes/{id}/connect``, ``POST /v2/sandboxes/{id}/connect`` (resumes a paused one)
- ``POST /sandboxes/{id}/pause`` (dsec's freeze: docs/API.md), ``POST /sandboxes/{id}/resume``
- ``POST /sandboxes/{id}/snapshots``, ``GET /snapshots``, ``DELETE /templates/{snapshot id}``,
  a create whose ``templateID`` is a snapshot id, ``POST /sandboxes/{id}/fork``: dsec's
  filesystem snapshots (the router's, under the project's snapshot quota). A snapshot with
  memory (``memory: true``, the SDK's ``mode="full"``) is refused; left unset, the server's
  default is dsec's: filesystem. A fork's children start from one filesystem snapshot
  (processes fresh), which is deleted once they have started.

- templates (``Template.build`` from an image, ``exists``, build status and logs, list,
  delete): e2b_templates.py

Everything else E2B's API has (auto-pause, template builds with RUN/COPY steps, metrics, logs, volumes, secrets,
network updates) answers 501. A request carrying ``E2b-Sandbox-Id`` (or an envd
``X-Access-Token``) is for the data plane (both planes have a ``/health``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
import urllib.parse
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..control.routing import Router
from ..protocol.errors import (
    CapacityExhausted,
    DSecError,
    IdempotencyKeyReused,
    ImageNotFound,
    InvalidRequest,
    NotSupported,
    QuotaExceeded,
    SandboxDied,
    SandboxNotFound,
    SnapshotNotFound,
    Unauthorized,
)
from ..protocol.models import CreateRequest, SandboxInfo, Snapshot, lone_surrogate
from .auth import Keys
from .connect import PlainHttpError
from .e2b_templates import (
    SNAPSHOT_PREFIX,
    WORKDIR_LABEL,
    Templates,
    add_template_routes,
)
from .envd import ENVD_VERSION, USERS, Envd, gone

TEMPLATE_LABEL = "e2b.template"
HIDDEN_LABELS = {TEMPLATE_LABEL, WORKDIR_LABEL}  # dsec's own labels, not the user's metadata
# E2B template name -> dsec image. A template that is not listed is taken as a dsec image name.
DEFAULT_TEMPLATES = {"base": "python-3.11"}
DEFAULT_CPU = 2  # E2B's default sandbox: 2 vCPUs, 512 MiB
DEFAULT_MEMORY_MB = 512
MAX_TIMEOUT_S = 7 * 86400
MAX_FORKS = 20  # E2B's bound on a fork's count


def template_mapping(raw: str) -> dict[str, str]:
    """``DSEC_E2B_TEMPLATES="base=python-3.11,mytpl=myimage"`` (``Settings.e2b_templates``)
    adds to (or overrides) the default template mapping."""
    mapping = dict(DEFAULT_TEMPLATES)
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, image = item.partition("=")
        if not sep or not name.strip() or not image.strip():
            raise ValueError(f"DSEC_E2B_TEMPLATES: expected name=image, got {item!r}")
        mapping[name.strip()] = image.strip()
    return mapping


def create_e2b_app(router: Router, keys: Keys, templates: Templates) -> FastAPI:
    envd = Envd(router, keys)
    app = FastAPI(title="dsec: E2B compatibility", docs_url=None, redoc_url=None)

    @app.exception_handler(PlainHttpError)
    async def plain(request: Request, exc: PlainHttpError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(DSecError)
    async def dsec_error(request: Request, exc: DSecError) -> JSONResponse:
        """A dsec error no route turned into E2B's terms (the routes map the expected ones)."""
        if isinstance(exc, (SandboxNotFound, SandboxDied)):
            sandbox_id = str(exc.details.get("sandbox_id", ""))
            if "e2b-sandbox-id" in request.headers or "x-access-token" in request.headers:
                return gone(sandbox_id).response()
            return _error(404, exc.message)
        return _dsec_error(exc)

    def authenticate(request: Request) -> None:
        if not keys.valid(keys.from_headers(request.headers)):
            raise PlainHttpError(401, {"code": 401, "message": "Invalid API key: use a dsec API "
                                       "key as E2B_API_KEY (dsec key create NAME)"})

    def running(sandbox_id: str) -> SandboxInfo:
        try:
            edge = router.edge_for(sandbox_id)
            info = edge.info(edge.get_row(sandbox_id))
        except SandboxNotFound:
            info = None
        if info is None or info.state not in ("running", "paused"):  # a call resumes a paused one
            raise PlainHttpError(404, {"code": 404, "message": f"sandbox \"{sandbox_id}\" doesn't "
                                       "exist or you don't have access to it"})
        return info

    async def snapshot_of(sandbox_id: str) -> Snapshot | JSONResponse:
        """A filesystem snapshot of the sandbox through the router (under the project's
        quota), or the E2B error response saying why not."""
        try:
            return await router.snapshot(sandbox_id)
        except (SandboxNotFound, SandboxDied):
            return _error(404, f"sandbox \"{sandbox_id}\" not found")
        except DSecError as exc:
            return _dsec_error(exc)

    def created(info: SandboxInfo) -> dict[str, Any]:
        template = info.labels.get(TEMPLATE_LABEL, info.image)
        return {"templateID": template, "alias": template, "sandboxID": info.id, "clientID": "dsec",
                "envdVersion": ENVD_VERSION, "envdAccessToken": keys.access_token(info.id),
                "trafficAccessToken": None, "domain": None}

    def listed(info: SandboxInfo) -> dict[str, Any]:
        template = info.labels.get(TEMPLATE_LABEL, info.image)
        try:
            disk_mb = int(router.edge_for(info.id).get_row(info.id).request.get("disk_mb", 1024))
        except DSecError:
            disk_mb = 1024
        return {"templateID": template, "alias": template, "sandboxID": info.id, "clientID": "dsec",
                "startedAt": _rfc3339(info.created_at), "endAt": _rfc3339(info.expires_at),
                "cpuCount": max(1, math.ceil(info.cpu)), "memoryMB": info.memory_mb,
                "diskSizeMB": disk_mb, "metadata": _metadata(info), "state": info.state,
                "envdVersion": ENVD_VERSION}

    # control plane
    async def create(request: Request) -> JSONResponse:
        authenticate(request)
        body = await _json(request)
        template = body.get("templateID")
        if not isinstance(template, str) or not template:
            return _error(400, "templateID is required")
        refused = _unsupported_options(body)
        if refused:
            return _error(400, refused)
        timeout = _int(body.get("timeout", 15), "timeout")
        try:
            # Sandbox.create(snapshot_id): the image is the snapshot's, the machine, network
            # and environment its parent's (edge/inherit.py), envVars added to that
            snapshot = template if template.startswith(SNAPSHOT_PREFIX) else None
            machine = {} if snapshot else {"cpu": DEFAULT_CPU, "memory_mb": DEFAULT_MEMORY_MB}
            found = templates.resolve(template)
            workdir = {WORKDIR_LABEL: found.workdir} if found.workdir else {}
            req = CreateRequest(image=found.image, snapshot=snapshot,
                                **machine, ttl_s=min(max(timeout, 1), MAX_TIMEOUT_S),
                                env={**found.env, **_strings(body.get("envVars"), "envVars")},
                                labels={**{k: v for k, v in _strings(body.get("metadata"),
                                           "metadata").items() if k not in HIDDEN_LABELS},
                                        TEMPLATE_LABEL: template, **workdir})
        except ValidationError as exc:
            return _error(400, f"invalid request: {exc.errors(include_url=False)}")
        try:
            info, _ = await router.create_once(request.headers.get("idempotency-key"), "e2b", req,
                                               lambda: set_up(req))
        except ImageNotFound:
            return _error(404, f"template '{template}' not found: it names no dsec image (the "
                               "mapping is in docs/COMPAT.md; DSEC_E2B_TEMPLATES adds to it)")
        except SnapshotNotFound:
            return _error(404, f"template '{template}' not found: no such snapshot")
        except DSecError as exc:
            return _dsec_error(exc)
        envd.prune({live.id for live in router.list()})
        return JSONResponse(created(info), status_code=201)

    async def set_up(req: CreateRequest) -> SandboxInfo:
        """A sandbox as E2B makes them: envd's users have homes, the default one is the
        default working directory. A sandbox whose set-up fails is stopped."""
        info = await router.create(req)
        edge = router.edge_for(info.id)
        try:
            for home in USERS.values():
                await edge.mkdir(info.id, home, parents=True)
        except DSecError:
            await edge.stop(info.id, "stopped", "E2B set-up failed")
            raise
        return info

    app.add_api_route("/sandboxes", create, methods=["POST"], status_code=201)
    app.add_api_route("/v2/sandboxes", create, methods=["POST"], status_code=201)

    async def list_v1(request: Request) -> JSONResponse:
        authenticate(request)
        infos = _filtered(router.list_visible(), request.query_params)
        return JSONResponse([listed(info) for info in infos])

    @app.get("/v2/sandboxes")
    async def list_v2(request: Request) -> JSONResponse:
        authenticate(request)
        params = request.query_params
        infos = _filtered(router.list_visible(), params)
        states = {s for value in params.getlist("state") for s in value.split(",") if s}
        if states:
            infos = [i for i in infos if i.state in states]
        infos.sort(key=lambda i: i.created_at, reverse=params.get("order", "desc") != "asc")
        start = _int(params.get("nextToken") or 0, "nextToken")
        limit = _int(params.get("limit") or 0, "limit") or len(infos)
        page = infos[start:start + limit]
        headers = {"X-Total-Running": str(len(router.list_visible()))}
        if start + limit < len(infos):
            headers["X-Next-Token"] = str(start + limit)
        return JSONResponse([listed(info) for info in page], headers=headers)

    app.add_api_route("/sandboxes", list_v1, methods=["GET"])

    @app.get("/sandboxes/{sandbox_id}")
    async def get(sandbox_id: str, request: Request) -> JSONResponse:
        authenticate(request)
        info = running(sandbox_id)
        return JSONResponse({**listed(info), "envdAccessToken": keys.access_token(info.id),
                             "domain": None, "allowInternetAccess": False})

    @app.delete("/sandboxes/{sandbox_id}")
    async def kill(sandbox_id: str, request: Request) -> Response:
        authenticate(request)
        running(sandbox_id)
        try:
            await router.edge_for(sandbox_id).stop(sandbox_id, "stopped", "killed through the E2B API")
        except (SandboxNotFound, SandboxDied):
            return _error(404, f"sandbox \"{sandbox_id}\" not found")
        envd.forget(sandbox_id)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/timeout")
    async def set_timeout(sandbox_id: str, request: Request) -> Response:
        authenticate(request)
        timeout = _int((await _json(request)).get("timeout"), "timeout")
        running(sandbox_id)
        try:
            await router.edge_for(sandbox_id).set_ttl(sandbox_id, min(max(timeout, 1), MAX_TIMEOUT_S))
        except (SandboxNotFound, SandboxDied):
            return _error(404, f"sandbox \"{sandbox_id}\" not found")
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/pause")
    async def pause(sandbox_id: str, request: Request) -> Response:
        """Freeze the sandbox (a no-op if paused: dsec's pause is idempotent). Its memory
        stays (a freeze): a filesystem-only pause (``memory: false``) is refused."""
        authenticate(request)
        if (await _json(request)).get("memory") is False:
            return _error(400, "a filesystem-only pause (mode='filesystem') is not supported: "
                               "dsec's pause freezes the sandbox with its memory")
        running(sandbox_id)
        try:
            await router.edge_for(sandbox_id).pause(sandbox_id)
        except (SandboxNotFound, SandboxDied):
            return _error(404, f"sandbox \"{sandbox_id}\" not found")
        return Response(status_code=204)

    async def connect(sandbox_id: str, request: Request) -> JSONResponse:
        """Connect to a sandbox, resuming it if paused; its timeout is only ever extended."""
        authenticate(request)
        body = await _json(request)
        timeout = _int(body.get("timeout", 0), "timeout")
        if body.get("memory") is False:
            return _error(400, "on_resume='reboot' is not supported: a paused dsec sandbox "
                               "resumes with its memory")
        info = running(sandbox_id)
        if info.state == "paused":
            try:
                info = await router.edge_for(sandbox_id).resume(sandbox_id)
            except (SandboxNotFound, SandboxDied):
                return _error(404, f"sandbox \"{sandbox_id}\" not found")
        remaining = math.ceil(info.expires_at - time.time())
        if timeout > remaining:
            try:
                info = await router.edge_for(sandbox_id).set_ttl(sandbox_id, min(timeout, MAX_TIMEOUT_S))
            except (SandboxNotFound, SandboxDied):
                return _error(404, f"sandbox \"{sandbox_id}\" not found")
        return JSONResponse(created(info), status_code=200)

    app.add_api_route("/sandboxes/{sandbox_id}/connect", connect, methods=["POST"])
    app.add_api_route("/v2/sandboxes/{sandbox_id}/connect", connect, methods=["POST"])
    app.add_api_route("/sandboxes/{sandbox_id}/resume", connect, methods=["POST"])  # E2B's older name

    # snapshots and forks: dsec's filesystem snapshots, through the router
    @app.post("/sandboxes/{sandbox_id}/snapshots")
    async def snapshot(sandbox_id: str, request: Request) -> JSONResponse:
        authenticate(request)
        body = await _json(request)
        if body.get("memory") is True:
            return _error(400, "snapshots with memory (mode='full') are not supported: dsec "
                               "takes filesystem snapshots (mode='filesystem')")
        if body.get("name") is not None:
            return _error(400, "named snapshots are not supported: dsec names a snapshot by "
                               "its id")
        running(sandbox_id)
        snap = await snapshot_of(sandbox_id)
        if isinstance(snap, JSONResponse):
            return snap
        return JSONResponse(_snapshot(snap.id), status_code=201)

    @app.get("/snapshots")
    async def list_snapshots(request: Request) -> JSONResponse:
        authenticate(request)
        params = request.query_params
        snaps = [s for s in router.snapshots()
                 if params.get("sandboxID") in (None, s.sandbox_id)
                 and params.get("name") in (None, s.id)]
        start = _int(params.get("nextToken") or 0, "nextToken")
        limit = _int(params.get("limit") or 0, "limit") or len(snaps)
        headers = {"X-Next-Token": str(start + limit)} if start + limit < len(snaps) else {}
        return JSONResponse([_snapshot(s.id) for s in snaps[start:start + limit]],
                            headers=headers)

    @app.delete("/templates/{template_id:path}")
    async def delete_snapshot(template_id: str, request: Request) -> Response:
        """A snapshot's delete (E2B's snapshots are templates), or a template's."""
        authenticate(request)
        if not template_id.startswith(SNAPSHOT_PREFIX):
            if templates.delete(template_id):
                return Response(status_code=204)
            return _error(404, f"template '{template_id}' not found")
        try:
            await router.delete_snapshot(template_id)
        except SnapshotNotFound:
            return _error(404, f"template '{template_id}' not found")
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/fork")
    async def fork(sandbox_id: str, request: Request) -> JSONResponse:
        """``count`` new sandboxes from one filesystem snapshot of this one (deleted once
        they started), each with its limits, network and environment (edge/inherit.py); one
        result each, a sandbox or its error, as E2B answers."""
        authenticate(request)
        body = await _json(request)
        count = _int(body.get("count", 1), "count")
        if not 1 <= count <= MAX_FORKS:
            return _error(400, f"count must be between 1 and {MAX_FORKS}")
        timeout = min(max(_int(body.get("timeout", 15), "timeout"), 1), MAX_TIMEOUT_S)
        parent = running(sandbox_id)
        snap = await snapshot_of(sandbox_id)
        if isinstance(snap, JSONResponse):
            return snap
        req = CreateRequest(image=parent.image, snapshot=snap.id, ttl_s=timeout,
                            labels=parent.labels)

        async def child() -> dict[str, Any]:
            try:
                return {"sandbox": created(await set_up(req))}
            except DSecError as exc:
                status, message = _status(exc)
                return {"error": {"code": status, "message": message}}
        try:
            results = await asyncio.gather(*(child() for _ in range(count)))
        finally:
            await router.delete_snapshot(snap.id)
        return JSONResponse(list(results), status_code=201)

    add_template_routes(app, templates, authenticate, _json)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if "e2b-sandbox-id" in request.headers or "x-access-token" in request.headers:
            return await envd.health(request)
        return JSONResponse({"ok": True})

    # data plane
    app.add_api_route("/files", envd.download, methods=["GET"])
    app.add_api_route("/files", envd.upload, methods=["POST"])

    @app.post("/{service}/{method}")
    async def rpc(service: str, method: str, request: Request) -> Response:
        if "." not in service:
            return _not_supported(request)
        return await envd.service.handle(request, f"{service}/{method}")

    @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def other(rest: str, request: Request) -> Response:
        return _not_supported(request)

    return app


def _not_supported(request: Request) -> JSONResponse:
    path = request.url.path
    return _error(501, f"{request.method} {path} is not supported by dsec's E2B compatibility "
                       "layer (see docs/COMPAT.md)")


def _unsupported_options(body: dict[str, Any]) -> str | None:
    """Options dsec cannot honour are refused rather than silently dropped."""
    if body.get("autoPause") or body.get("autoResume"):
        return ("autoPause/autoResume are not supported by dsec (pause explicitly; a paused "
                "sandbox is still killed when its timeout ends)")
    if body.get("volumeMounts"):
        return "volumeMounts are not supported by dsec"
    if body.get("mcp"):
        return "mcp is not supported by dsec"
    # allow_internet_access is accepted: older SDKs send True by default. dsec sandboxes have
    # loopback only (documented; get_info reports allowInternetAccess false). Explicit egress
    # rules, though, ask for something specific and are refused.
    network = body.get("network") or {}
    if network.get("allowOut") or network.get("allowPublicTraffic") is True or network.get("rules"):
        return "network rules are not supported: dsec sandboxes have no network yet"
    return None


def _filtered(infos: list[SandboxInfo], params: Any) -> list[SandboxInfo]:
    wanted = urllib.parse.parse_qsl(params.get("metadata") or "", keep_blank_values=True)
    template = params.get("template")
    out = []
    for info in infos:
        metadata = _metadata(info)
        if any(metadata.get(k) != v for k, v in wanted):
            continue
        if template and template not in (info.labels.get(TEMPLATE_LABEL), info.image):
            continue
        out.append(info)
    return out


def _metadata(info: SandboxInfo) -> dict[str, str]:
    return {k: v for k, v in info.labels.items() if k not in HIDDEN_LABELS}


async def _json(request: Request) -> dict[str, Any]:
    body = await request.body()
    if not body:
        return {}
    try:
        data = await request.json()
    except ValueError:
        raise PlainHttpError(400, {"code": 400, "message": "the body is not valid JSON"}) from None
    if not isinstance(data, dict):
        raise PlainHttpError(400, {"code": 400, "message": "the body must be a JSON object"})
    if lone_surrogate(data) is not None:
        raise PlainHttpError(400, {"code": 400, "message": "the body's strings must be valid "
                                   "Unicode text (a lone surrogate is not)"})
    return data


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise PlainHttpError(400, {"code": 400, "message": f"{name} must be an integer"})
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: JSON Infinity
        raise PlainHttpError(400, {"code": 400, "message": f"{name} must be an integer"}) from None
    if number < 0:
        raise PlainHttpError(400, {"code": 400, "message": f"{name} must not be negative"})
    return number


def _strings(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise PlainHttpError(400, {"code": 400, "message": f"{name} must map strings to strings"})
    return {str(k): v for k, v in value.items()}


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _snapshot(snapshot_id: str) -> dict[str, Any]:
    return {"snapshotID": snapshot_id, "names": [snapshot_id]}


def _status(exc: DSecError) -> tuple[int, str]:
    """E2B's status and message for a dsec error (the SDK raises its exception by status)."""
    if isinstance(exc, Unauthorized):
        return 401, exc.message
    if isinstance(exc, CapacityExhausted):
        return 429, f"{exc.message}: too many sandboxes at once"
    if isinstance(exc, QuotaExceeded):
        return 429, exc.message
    if isinstance(exc, (InvalidRequest, NotSupported)):
        return 400, exc.message
    if isinstance(exc, (SandboxNotFound, SnapshotNotFound)):
        return 404, exc.message
    return 500, exc.message


def _dsec_error(exc: DSecError) -> JSONResponse:
    if isinstance(exc, IdempotencyKeyReused):  # E2B's code for it, with the same status
        return JSONResponse({"code": 422, "message": exc.message,
                             "error_code": "idempotency_request_mismatch"}, status_code=422)
    return _error(*_status(exc))
