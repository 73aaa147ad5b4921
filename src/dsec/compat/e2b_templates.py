"""E2B templates (the e2b SDK's ``Template`` / ``AsyncTemplate``): a template is an alias, per
project, naming a dsec image plus the metadata its build steps set (store/templates.py).

Routes (``e2b-dev/infra`` ``spec/openapi.yml``, what the SDK 2.x calls):

- ``GET /templates/aliases/{alias}``: ``Template.exists`` / ``alias_exists`` (200 when the
  caller's project has a template of that alias with a ready image, else 404)
- ``POST /v3/templates``: ``Template.build``'s first call: a template id and a build id
- ``GET /templates/{id}/files/{hash}``: the upload link a COPY step asks for (``present``,
  ``url``), and ``PUT`` there: the step's files as a tar (e2b_build.py: token, storage)
- ``POST /v2/templates/{id}/builds/{build id}``: the build's steps; answered 202, built in
  the background
- ``GET /templates/{id}/builds/{build id}/status``: status and logs (``logsOffset``)
- ``GET /templates/{id or name}/tags``: ``Template.get_tags`` (harbor's first call)
- ``GET /templates``, ``DELETE /templates/{id or alias}`` (compat/e2b.py routes the delete of
  a snapshot id to the snapshots)

What a build does: its base is ``fromImage`` (a dsec image name, or a registry reference that
is pulled into the image store when the server pulls: ``--pull missing``; the pull's progress
lines are the build's logs) or ``fromTemplate`` (another template of the project); ENV,
WORKDIR and USER steps and the start/ready commands are kept as the template's metadata
(ENV and WORKDIR apply to its sandboxes: their environment and envd's default working
directory). A build with RUN or COPY steps is a Dockerfile build through the server's one
builder (``Router.build_image``, on an edge; e2b_build.py translates the steps and the
uploaded files): its log lines are the build's logs, a failing step fails the build with
its line and output, and its image (``p.PROJECT.e2b-...``, the project's own) is what the
template names. RUN steps have the server's ``DSEC_E2B_BUILD_ALLOW`` egress (services of its
table, raw rules; none by default): an E2B build request carries no policy of its own.

``Sandbox.create(template=...)`` asks ``Templates.resolve``: the caller's project's template
of that alias (or id), else the server's static mapping (``DSEC_E2B_TEMPLATES``), else the
name taken as a dsec image name.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from rich.console import Console

from ..control.image_names import check_visible
from ..images.store import ImageStore
from ..protocol.build import BuildLog, ImageBuildRequest, ImageBuilt
from ..protocol.errors import DSecError, ImageNotFound, InvalidRequest
from ..protocol.models import Network
from ..store.templates import TemplateRow, TemplateStore
from .e2b_build import MAX_UPLOAD_BYTES, Uploads, dockerfile

log = logging.getLogger("dsec.compat.e2b")

# E2B's template names: lowercase letters, digits, '-', '_' and '.' (an optional ':tag' after)
ALIAS = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
METADATA_STEPS = {"ENV", "WORKDIR", "USER"}
LAYER_STEPS = {"RUN", "COPY"}  # what needs the Dockerfile build
MAX_LOG_ENTRIES = 20_000  # of one build (RUN output is capped by the build itself)
FLUSH_S = 0.5  # a build's new log lines are written this often
MAX_STEPS = 512
HEARTBEAT_S = 10  # a running build touches its record this often
STALE_S = 120  # a build not touched for this long is reported failed: its server stopped
MAX_TEMPLATES = 1000  # per project: records are small, but not free
LOG_PAGE = 100  # the status route's page of log entries, as E2B's
SNAPSHOT_PREFIX = "sn-"  # a templateID naming a dsec snapshot (dsec's ids: sn-<edge>-<hex>)
WORKDIR_LABEL = "e2b.workdir"  # a sandbox's default working directory, read by envd.py


class TemplateError(Exception):
    """An E2B error answer (status, message) from a template route."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Resolved:
    """What ``Sandbox.create(template=name)`` starts: an image, plus a template's env and
    default working directory."""

    image: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None


def split_name(name: str) -> tuple[str, str | None]:
    """``alias[:tag]``, checked (E2B's charset: no path or shell characters)."""
    alias, sep, tag = name.partition(":")
    if not ALIAS.fullmatch(alias) or (sep and not TAG.fullmatch(tag)):
        raise TemplateError(400, f"invalid template name {name!r}: lowercase letters, digits, "
                                 "'-', '_' and '.' (at most 63), optionally ':tag'")
    if alias.startswith(SNAPSHOT_PREFIX):
        raise TemplateError(400, f"invalid template name {name!r}: '{SNAPSHOT_PREFIX}' starts "
                                 "the ids of snapshots (which E2B's API also calls templates)")
    return alias, tag if sep else None


Builder = Callable[[ImageBuildRequest, bytes], AsyncIterator[BuildLog | ImageBuilt]]


class Templates:
    def __init__(self, store: TemplateStore, images: ImageStore, static: dict[str, str],
                 pull: str, project: Callable[[], str], build: Builder,
                 uploads: Uploads, network: Network = "none",
                 caller: Callable[[], str | None] = lambda: None) -> None:
        """``static``: the server's template → image mapping; ``pull``: the server's pull
        policy (``missing`` lets a build pull a registry reference); ``project``: the caller's;
        ``build``: the server's Dockerfile build (``Router.build_image``); ``uploads``: where
        COPY steps' files wait for their build; ``network``: RUN steps' egress (the server's
        ``DSEC_E2B_BUILD_ALLOW``); ``caller``: the caller's project, None for an admin key
        (which images it may name: control/image_names.py)."""
        self.store = store
        self.images = images
        self.static = static
        self.pull = pull
        self.project = project
        self.build = build
        self.uploads = uploads
        self.network = network
        self.caller = caller
        self._builds: set[asyncio.Task[None]] = set()

    # create
    def resolve(self, name: str) -> Resolved:
        alias = name.partition(":")[0]
        project = self.project()
        row = self.store.get(project, alias) or self.store.by_id(project, name)
        if row is not None and row.image is not None:
            return Resolved(row.image, dict(row.settings.get("env", {})),
                            row.settings.get("workdir"))
        return Resolved(self.static.get(name, name))

    # routes
    def alias(self, alias: str) -> dict[str, Any]:
        row = self.store.get(self.project(), alias)
        if row is None or row.image is None:
            raise TemplateError(404, f"template '{alias}' not found")
        return {"templateID": row.template_id, "public": False}

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name") or body.get("alias")
        if not isinstance(name, str):
            raise TemplateError(400, "name is required")
        alias, tag = split_name(name)
        tags = body.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) and TAG.fullmatch(t)
                                                 for t in tags):
            raise TemplateError(400, "tags must be a list of tag names")
        cpu, memory = body.get("cpuCount", 2), body.get("memoryMB", 512)
        if (not isinstance(cpu, int) or not isinstance(memory, int) or isinstance(cpu, bool)
                or not 1 <= cpu <= 64 or not 128 <= memory <= 1 << 20):
            raise TemplateError(400, "cpuCount must be 1..64 and memoryMB 128..1048576")
        tags = list(dict.fromkeys([tag or "default", *tags]))
        project = self.project()
        if (self.store.get(project, alias) is None
                and len(self.store.of_project(project)) >= MAX_TEMPLATES):
            raise TemplateError(429, f"a project has at most {MAX_TEMPLATES} templates: "
                                     "delete some first")
        row = self.store.request(project, alias, "tpl-" + secrets.token_hex(8),
                                 str(uuid.uuid4()), tags, cpu, memory)  # E2B's build ids: UUIDs
        return {"templateID": row.template_id, "buildID": row.build_id, "public": False,
                "names": [alias], "aliases": [alias], "tags": tags}

    def upload_link(self, template_id: str, files_hash: str, base_url: str) -> dict[str, Any]:
        """Where a COPY step's files go (a link with a token: the SDK PUTs them without its
        key), or ``present`` when this build has them already."""
        row = self._row(template_id)
        if row.status != "waiting":
            raise TemplateError(409, f"template '{template_id}' has no build waiting for files")
        present = self._checked(self.uploads.present, template_id, files_hash)
        token = self.uploads.token(row.project, template_id, files_hash)
        return {"present": present,
                "url": f"{base_url}/templates/{template_id}/files/{files_hash}?token={token}"}

    def upload(self, template_id: str, files_hash: str, token: str, data: bytes) -> None:
        project = self.uploads.project_of(token, template_id, files_hash)
        row = None if project is None else self.store.by_id(project, template_id)
        if row is None:
            raise TemplateError(403, "invalid upload link (ask GET /templates/{id}/files/{hash})")
        if row.status != "waiting":
            raise TemplateError(409, f"template '{template_id}' has no build waiting for files")
        path = self._checked(self.uploads.path, template_id, files_hash)
        replaced = path.stat().st_size if path.is_file() else 0
        held = self.uploads.held(r.template_id for r in self.store.of_project(row.project))
        if held - replaced + len(data) > MAX_UPLOAD_BYTES:
            raise TemplateError(413, f"a project's templates hold at most "
                                     f"{MAX_UPLOAD_BYTES >> 20} MiB of uploads waiting for "
                                     "their builds: build or delete some first")
        self._checked(self.uploads.put, template_id, files_hash, data)

    @staticmethod
    def _checked(call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except InvalidRequest as exc:
            raise TemplateError(400, exc.message) from None

    def trigger(self, template_id: str, build_id: str, body: dict[str, Any]) -> None:
        row = self._row(template_id, build_id)
        if row.status != "waiting":
            raise TemplateError(409, f"build {build_id} was already started")
        try:
            steps, hashes = _steps(body)
            if body.get("fromImageRegistry"):
                raise TemplateError(400, "registry credentials in a template are not supported: "
                                         "give the server DSEC_REGISTRY_AUTH (docs/IMAGES.md)")
            base = body.get("fromImage"), body.get("fromTemplate")
            if sum(isinstance(b, str) and bool(b) for b in base) != 1:
                raise TemplateError(400, "a build needs one of fromImage and fromTemplate")
        except TemplateError as exc:
            self._fail(row, exc.message)
            raise
        row.status = "building"
        self.store.update(row)
        task = asyncio.create_task(self._build(row, body, steps, hashes))
        self._builds.add(task)
        task.add_done_callback(self._builds.discard)

    def status(self, template_id: str, build_id: str, offset: int) -> dict[str, Any]:
        row = self._row(template_id, build_id)
        if row.status == "building" and time.time() - row.updated_at > STALE_S:
            self._fail(row, "the build was interrupted (the server building it stopped): "
                            "build again")
        entries = row.logs[offset:offset + LOG_PAGE]
        answer: dict[str, Any] = {"templateID": row.template_id, "buildID": row.build_id,
                                  "status": row.status, "logEntries": entries,
                                  "logs": [e["message"] for e in entries]}
        if row.status == "error":
            answer["reason"] = {"message": row.reason or "build failed"}
        return answer

    def tags(self, template_id_or_alias: str) -> list[dict[str, Any]]:
        """A ready template's tags (all naming its one image); 404 for no such template."""
        project = self.project()
        row = self.store.by_id(project, template_id_or_alias) or self.store.get(
            project, template_id_or_alias.partition(":")[0])
        if row is None or row.image is None:
            raise TemplateError(404, f"template '{template_id_or_alias}' not found")
        return [{"tag": tag, "buildID": row.build_id, "createdAt": _rfc3339(row.updated_at)}
                for tag in row.tags]

    def all(self) -> list[dict[str, Any]]:
        return [_listed(row) for row in self.store.of_project(self.project())]

    def delete(self, template_id_or_alias: str) -> bool:
        """The template's name goes, and any uploads waiting for its build; the image it
        named stays in the image store under its own name (its layers go with layer GC once
        that is removed too)."""
        project = self.project()
        row = self.store.by_id(project, template_id_or_alias) or self.store.get(
            project, template_id_or_alias)
        deleted = self.store.delete(project, template_id_or_alias)
        if row is not None:
            self.uploads.drop(row.template_id)
        return deleted

    # the build
    def _row(self, template_id: str, build_id: str | None = None) -> TemplateRow:
        row = self.store.by_id(self.project(), template_id)
        if row is None or (build_id is not None and row.build_id != build_id):
            raise TemplateError(404, f"template '{template_id}' build '{build_id}' not found")
        return row

    def _fail(self, row: TemplateRow, reason: str) -> None:
        row.status, row.reason = "error", reason
        row.logs.append(_entry(reason, "error"))
        self.store.update(row)

    async def _build(self, row: TemplateRow, body: dict[str, Any],
                     steps: list[tuple[str, list[str]]], hashes: list[str | None]) -> None:
        heartbeat = asyncio.create_task(self._heartbeat(row))
        try:
            await self._run_build(row, body, steps, hashes)
        finally:
            heartbeat.cancel()
            await asyncio.to_thread(self.uploads.drop, row.template_id)

    async def _heartbeat(self, row: TemplateRow) -> None:
        """A running build says so: one whose server stopped is seen stale (``status``)."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await asyncio.to_thread(self.store.touch, row.project, row.alias, row.build_id)

    async def _run_build(self, row: TemplateRow, body: dict[str, Any],
                         steps: list[tuple[str, list[str]]], hashes: list[str | None]) -> None:
        try:
            base, settings = await self._base(row, body)
            row.settings = {**settings, **_metadata(steps, settings, body)}
            image = base
            if any(kind in LAYER_STEPS for kind, _ in steps):
                image = await self._image(row, base, steps, hashes, settings.get("user"))
            row.image = image  # only a finished build names an image (a failed one: none)
        except DSecError as exc:
            self._fail(row, exc.message)
            return
        except Exception as exc:  # the build must end, whatever broke it
            log.exception("template build %s failed", row.build_id)
            self._fail(row, f"internal error: {exc}")
            return
        row.status = "ready"
        row.logs.append(_entry(f"template '{row.alias}' is ready: image {row.image}"))
        self.store.update(row)

    async def _base(self, row: TemplateRow, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The base image (its name in the image store) and the settings it comes with."""
        if body.get("fromTemplate"):
            base = self.store.get(row.project, str(body["fromTemplate"]).partition(":")[0])
            if base is None or base.image is None:
                raise ImageNotFound(f"no ready template {body['fromTemplate']!r} to build from",
                                    ref=str(body["fromTemplate"]))
            return base.image, dict(base.settings)
        ref = str(body["fromImage"])
        check_visible(ref, self.caller())  # as the create of a sandbox of it would
        try:  # a builtin spec (python-3.11) is built if it is not yet, as a create would
            return (await asyncio.to_thread(self.images.ensure, ref)).name, {}
        except ImageNotFound:
            if not self.images.pullable(ref) or self.pull != "missing":
                raise
        row.logs.append(_entry(f"pulling {ref}"))
        self.store.update(row)
        lines = _Lines(row, self.store)
        image = await asyncio.to_thread(self.images.pull, ref, None,
                                        Console(file=lines, width=200, color_system=None),
                                        True)
        row.logs.append(_entry(f"pulled {image.name} ({image.digest[:19]})"))
        return image.name, {}

    async def _image(self, row: TemplateRow, base: str, steps: list[tuple[str, list[str]]],
                     hashes: list[str | None], user: str | None) -> str:
        """The image of the steps on ``base``: a Dockerfile build through the server's
        builder, its log lines written to the build's logs as they come."""
        text = dockerfile(base, steps, hashes, user)
        context = await asyncio.to_thread(self.uploads.context, row.template_id,
                                          [h for h in hashes if h])
        req = ImageBuildRequest(name=f"e2b-{row.template_id}-{row.build_id[:8]}", dockerfile=text,
                                network=self.network, cpu=row.cpu_count,
                                memory_mb=max(row.memory_mb, 512))
        flushed, built = time.monotonic(), None
        async for event in self.build(req, context):
            if isinstance(event, ImageBuilt):
                built = event
            elif len(row.logs) < MAX_LOG_ENTRIES:
                row.logs.append(_entry(event.message))
                if time.monotonic() - flushed > FLUSH_S:
                    await asyncio.to_thread(self.store.update, row)
                    flushed = time.monotonic()
        assert built is not None  # the builder's stream ends with its result or raises
        row.logs.append(_entry(f"built {built.image} ({built.steps_run} steps run, "
                               f"{built.steps_cached} cached)"))
        return built.image


class _Lines(io.StringIO):
    """A console's output, a build-log entry per line, written through as it comes."""

    def __init__(self, row: TemplateRow, store: TemplateStore) -> None:
        super().__init__()
        self._row, self._store = row, store

    def write(self, text: str) -> int:
        for line in filter(None, (line.strip() for line in text.splitlines())):
            self._row.logs.append(_entry(line))
        self._store.update(self._row)
        return len(text)


def _steps(body: dict[str, Any]) -> tuple[list[tuple[str, list[str]]], list[str | None]]:
    """The steps (kind, args), checked by shape, and each one's files hash (COPY's)."""
    steps = body.get("steps") or []
    if not isinstance(steps, list) or len(steps) > MAX_STEPS:
        raise TemplateError(400, f"steps must be a list of at most {MAX_STEPS}")
    out, hashes = [], []
    for step in steps:
        kind = step.get("type") if isinstance(step, dict) else None
        args = step.get("args") or [] if isinstance(step, dict) else None
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise TemplateError(400, "a step's args must be a list of strings")
        files_hash = step.get("filesHash") if isinstance(step, dict) else None
        if kind == "COPY" and not (isinstance(files_hash, str) and 2 <= len(args) <= 4):
            raise TemplateError(400, "COPY takes src, dest[, user[, mode]] and a filesHash")
        if kind == "RUN" and not 1 <= len(args) <= 2:
            raise TemplateError(400, "RUN takes a command[, user]")
        if kind not in METADATA_STEPS | LAYER_STEPS:
            raise TemplateError(400, f"unknown template step {kind!r}")
        if kind in ("WORKDIR", "USER") and len(args) != 1:
            raise TemplateError(400, f"{kind} takes one argument")
        if kind == "ENV" and len(args) % 2:
            raise TemplateError(400, "ENV takes name, value pairs")
        out.append((str(kind), args))
        hashes.append(files_hash if kind == "COPY" else None)
    for key in ("startCmd", "readyCmd"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise TemplateError(400, f"{key} must be a string")
    return out, hashes


def _metadata(steps: list[tuple[str, list[str]]], base: dict[str, Any],
              body: dict[str, Any]) -> dict[str, Any]:
    """What the steps set, on top of the base's (a template built from a template)."""
    env = dict(base.get("env", {}))
    out: dict[str, Any] = {}
    for kind, args in steps:
        if kind == "ENV":
            env.update(zip(args[::2], args[1::2], strict=True))
        elif kind == "WORKDIR":
            out["workdir"] = _absolute(args[0], out.get("workdir") or base.get("workdir"))
        elif kind == "USER":
            out["user"] = args[0]
    out["env"] = env
    for key, name in (("startCmd", "start_cmd"), ("readyCmd", "ready_cmd")):
        if body.get(key):
            out[name] = body[key]
    return out


def _absolute(path: str, current: str | None) -> str:
    if not path.startswith("/"):
        path = f"{(current or '/').rstrip('/')}/{path}"
    if "\0" in path or len(path) > 4096:
        raise InvalidRequest("WORKDIR must be a path")
    return path


def _entry(message: str, level: str = "info") -> dict[str, Any]:
    return {"timestamp": _rfc3339(time.time()), "level": level, "message": message}


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _listed(row: TemplateRow) -> dict[str, Any]:
    return {"templateID": row.template_id, "buildID": row.build_id, "cpuCount": row.cpu_count,
            "memoryMB": row.memory_mb, "diskSizeMB": 1024, "public": False,
            "aliases": [row.alias], "names": [row.alias], "createdAt": _rfc3339(row.created_at),
            "updatedAt": _rfc3339(row.updated_at), "createdBy": None, "lastSpawnedAt": None,
            "spawnCount": 0, "buildCount": 1, "envdVersion": "0.2.0",
            "buildStatus": row.status}


def add_template_routes(app: FastAPI, templates: Templates,
                        authenticate: Callable[[Request], None],
                        read_json: Callable[[Request], Any]) -> None:
    """The template routes on the E2B app (their errors in E2B's shape)."""

    @app.exception_handler(TemplateError)
    async def template_error(request: Request, exc: TemplateError) -> JSONResponse:
        return JSONResponse({"code": exc.status, "message": exc.message}, status_code=exc.status)

    @app.get("/templates/aliases/{alias:path}")
    async def alias(alias: str, request: Request) -> JSONResponse:
        authenticate(request)
        return JSONResponse(templates.alias(alias))

    @app.post("/v3/templates")
    async def request_build(request: Request) -> JSONResponse:
        authenticate(request)
        return JSONResponse(templates.request(await read_json(request)), status_code=202)

    @app.get("/templates/{template_id}/files/{files_hash}")
    async def upload_link(template_id: str, files_hash: str, request: Request) -> JSONResponse:
        authenticate(request)
        base = str(request.base_url).rstrip("/") + request.scope.get("root_path", "")
        return JSONResponse(templates.upload_link(template_id, files_hash, base), status_code=201)

    @app.put("/templates/{template_id}/files/{files_hash}")
    async def upload(template_id: str, files_hash: str, request: Request) -> Response:
        """The upload link's target: no API key (the SDK sends none), its token instead."""
        templates.upload(template_id, files_hash, request.query_params.get("token", ""),
                         await request.body())
        return Response(status_code=201)

    @app.post("/v2/templates/{template_id}/builds/{build_id}")
    async def trigger(template_id: str, build_id: str, request: Request) -> Response:
        authenticate(request)
        templates.trigger(template_id, build_id, await read_json(request))
        return Response(status_code=202)

    @app.get("/templates/{template_id}/builds/{build_id}/status")
    async def status(template_id: str, build_id: str, request: Request) -> JSONResponse:
        authenticate(request)
        offset = request.query_params.get("logsOffset") or "0"
        if not offset.isdigit():
            raise TemplateError(400, "logsOffset must be a non-negative integer")
        return JSONResponse(templates.status(template_id, build_id, int(offset)))

    @app.get("/templates/{template_id}/tags")
    async def tags(template_id: str, request: Request) -> JSONResponse:
        authenticate(request)
        return JSONResponse(templates.tags(template_id))

    @app.get("/templates")
    async def listing(request: Request) -> JSONResponse:
        authenticate(request)
        return JSONResponse(templates.all())


__all__ = ["Templates", "TemplateError", "add_template_routes", "Resolved", "WORKDIR_LABEL"]
