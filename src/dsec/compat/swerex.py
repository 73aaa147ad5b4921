"""SWE-ReX's remote-runtime protocol at ``/swerex/<sandbox id>``, so that swe-rex's own
``RemoteRuntime(host="http://HOST:PORT/swerex/<id>", auth_token=<dsec key>)`` drives a dsec
sandbox unmodified (SWE-agent, mini-swe-agent's ``swerex_*`` environments, verl's agent loop).

Routes as ``swerex/server.py`` of swe-rex 1.4: ``GET /is_alive``; ``POST /create_session``,
``/run_in_session``, ``/close_session`` (bash sessions: ``swerex_session``), ``/execute`` (a
command through dsec's agent: its exit code is the agent's, never parsed from output),
``/read_file``, ``/write_file``, ``/upload`` (multipart ``file``, ``target_path``, ``unzip``;
a zip is re-packed as a tar and extracted by dsec's own tar inside the sandbox, never on the
host: ``zipped``) and ``/close`` (closes the sessions; the sandbox ends with its deployment or
TTL).

- Auth: ``X-API-Key`` is a dsec API key (a missing one is 403, a wrong one 401, as SWE-ReX's
  server answers), and the sandbox must be one the key's project may see (else 404, as for a
  sandbox that does not exist).
- Retries: the client sends ``X-Request-ID`` and repeats it when a request fails in transit.
  The answer to each id is kept (the most recent ``REMEMBERED``, at most ``REMEMBERED_BYTES``
  together, per server process), and a repeat gets it without running anything again, also
  while the first is still running.
- Errors the runtime raises answer HTTP 511 with SWE-ReX's JSON body, naming only dsec's fixed
  exception classes (``swerex_models``), so the client raises its own exception classes; JSON
  only, nothing pickled either way.

Every call goes through the router (access, quotas, trajectories, ``--ray``) like the E2B
front-end. See docs/COMPAT.md.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from ..agent.tools import SHELL
from ..control.routing import Router
from ..edge.edge import Edge
from ..protocol.errors import (
    CommandTimeout,
    DSecError,
    FileNotFound,
    InvalidRequest,
    SandboxDied,
    SandboxNotFound,
)
from ..protocol.models import ExecRequest
from .auth import Keys
from .files import write_creating
from .multipart import form_parts
from .swerex_models import (
    ACTION,
    CloseBashSession,
    Command,
    CreateBashSession,
    ReadFile,
    SwerexError,
    WriteFile,
)
from .swerex_session import BashSession
from .zipped import zip_to_tar

REMEMBERED = 1024  # answers kept for request-id retries
REMEMBERED_BYTES = 256 << 20  # and their bodies together (an execute answer may hold 32 MiB)
MAX_REQUEST_ID = 256  # characters (swe-rex sends a uuid4)
MAX_SESSIONS = 64  # per sandbox: each is a terminal in the sandbox and a reader here
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Edge, str, bytes], Awaitable[Any]]


class _Refused(Exception):
    """An HTTP error in FastAPI's shape, ``{"detail": ...}``, as SWE-ReX's server answers."""

    def __init__(self, status: int, detail: Any) -> None:
        self.status, self.detail = status, detail


def _parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> _Refused:
    """FastAPI's 422, without echoing the input (it may not be text)."""
    return _Refused(422, exc.errors(include_url=False, include_input=False, include_context=False))


class Swerex:
    def __init__(self, router: Router, keys: Keys) -> None:
        self.router, self.keys = router, keys
        self.sessions: dict[str, dict[str, BashSession]] = {}
        self._answers: collections.OrderedDict[tuple[str, str, str], asyncio.Task[Response]] = (
            collections.OrderedDict())
        self._answer_bytes = 0
        self._starting: set[tuple[str, str]] = set()  # (sandbox, session) being created

    # access
    def authenticate(self, request: Request) -> None:
        key = request.headers.get("x-api-key")
        if not key:
            raise _Refused(403, "Not authenticated")
        if not self.keys.valid(key):
            raise _Refused(401, "Invalid API Key")

    def edge(self, sandbox_id: str) -> Edge:
        """The sandbox's edge (as the trajectory recorder serves it), if the caller may see it
        and it runs (or is paused: its next call resumes it)."""
        missing = _Refused(404, f"sandbox {sandbox_id!r} does not exist or you don't have access to it")
        try:
            edge = cast(Edge, self.router.edge_for(sandbox_id))
            state = edge.get_row(sandbox_id).state
        except SandboxNotFound:
            raise missing from None
        if state not in ("running", "paused"):
            raise _Refused(404, f"sandbox {sandbox_id!r} is {state}")
        return edge

    async def answer(self, request: Request, sandbox_id: str, handler: Handler) -> Response:
        """The handler's answer; for a request id seen before, the first answer to it. The
        handler runs as a task of its own, so a client that goes away mid-call (and retries)
        does not cut it short: the retry waits for it and gets its answer."""
        self.authenticate(request)
        edge = self.edge(sandbox_id)
        request_id = request.headers.get("x-request-id")
        if request_id and len(request_id) > MAX_REQUEST_ID:
            raise _Refused(422, f"X-Request-ID is at most {MAX_REQUEST_ID} characters")
        body = await request.body()
        if not request_id:
            return await self._respond(handler, edge, sandbox_id, body)
        key = (sandbox_id, request.url.path, request_id)
        task = self._answers.get(key)
        if task is None:
            task = asyncio.create_task(self._respond(handler, edge, sandbox_id, body))
            self._answers[key] = task
            task.add_done_callback(self._answered)
        return _copy(await asyncio.shield(task))

    def _answered(self, task: asyncio.Task[Response]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._answer_bytes += len(task.result().body)
        self._forget_old()

    def _forget_old(self) -> None:
        """Drop the oldest answers past the count or byte budget (never one still running)."""
        while len(self._answers) > REMEMBERED or self._answer_bytes > REMEMBERED_BYTES:
            key, oldest = next(iter(self._answers.items()))
            if not oldest.done():
                break
            del self._answers[key]
            if not oldest.cancelled() and oldest.exception() is None:
                self._answer_bytes -= len(oldest.result().body)

    @staticmethod
    async def _respond(handler: Handler, edge: Edge, sandbox_id: str, body: bytes) -> Response:
        try:
            return JSONResponse(await handler(edge, sandbox_id, body))
        except SwerexError as exc:
            return JSONResponse(exc.body(), status_code=511)
        except (SandboxNotFound, SandboxDied) as exc:
            return JSONResponse({"detail": exc.message}, status_code=404)
        except CommandTimeout as exc:
            return JSONResponse(SwerexError("CommandTimeoutError", exc.message).body(), status_code=511)
        except DSecError as exc:
            return JSONResponse(SwerexError("SwerexException", exc.message).body(), status_code=511)

    # sessions
    def _session(self, sandbox_id: str, name: str) -> BashSession:
        session = self.sessions.get(sandbox_id, {}).get(name)
        if session is None or session.ended:
            raise SwerexError("SessionDoesNotExistError", f"session {name!r} does not exist")
        return session

    def _prune(self) -> None:
        """Forget sessions whose shell ended (exited, killed, its sandbox gone)."""
        for sandbox_id, sessions in list(self.sessions.items()):
            for name in [n for n, s in sessions.items() if s.ended]:
                del sessions[name]
            if not sessions:
                del self.sessions[sandbox_id]

    async def create_session(self, edge: Edge, sandbox_id: str, body: bytes) -> Any:
        req = _parse(CreateBashSession, body)
        self._prune()
        existing = self.sessions.get(sandbox_id, {}).get(req.session)
        name = (sandbox_id, req.session)
        if (existing is not None and not existing.ended) or name in self._starting:
            raise SwerexError("SessionExistsError", f"session {req.session} already exists")
        starting = sum(1 for sid, _ in self._starting if sid == sandbox_id)
        if len(self.sessions.get(sandbox_id, {})) + starting >= MAX_SESSIONS:
            raise SwerexError("SwerexException", f"a sandbox has at most {MAX_SESSIONS} sessions: "
                              "close one first")
        self._starting.add(name)
        try:
            session, output = await BashSession.start(edge, sandbox_id, req.startup_source,
                                                      req.startup_timeout)
        finally:
            self._starting.discard(name)
        self.sessions.setdefault(sandbox_id, {})[req.session] = session
        return {"output": output, "session_type": "bash"}

    async def run_in_session(self, edge: Edge, sandbox_id: str, body: bytes) -> Any:
        try:
            action = ACTION.validate_json(body or b"{}")
        except ValidationError as exc:
            raise _invalid(exc) from None
        return await self._session(sandbox_id, action.session).run(action)

    async def close_session(self, edge: Edge, sandbox_id: str, body: bytes) -> Any:
        req = _parse(CloseBashSession, body)
        session = self._session(sandbox_id, req.session)
        del self.sessions[sandbox_id][req.session]
        await session.close()
        return {"session_type": "bash"}

    async def close(self, edge: Edge, sandbox_id: str, body: bytes) -> Any:
        for session in self.sessions.pop(sandbox_id, {}).values():
            await session.close()
        return {}

    # commands and files
    async def execute(self, edge: Edge, sandbox_id: str, body: bytes) -> Any:
        cmd = _parse(Command, body)
        argv = _argv(cmd)
        if cmd.merge_output_streams:
            argv = [SHELL, "-c", 'exec "$@" 2>&1', "sh", *argv]
        try:
            result = await edge.run(sandbox_id, ExecRequest(
                command=argv, env=cmd.env or {}, cwd=cmd.cwd, timeout_s=cmd.timeout))
        except FileNotFound as exc:
            raise SwerexError("builtins.FileNotFoundError", exc.message) from None
        except InvalidRequest as exc:
            raise SwerexError("builtins.ValueError", exc.message) from None
        if result.timed_out:
            raise SwerexError("CommandTimeoutError",
                              f"Timeout ({cmd.timeout}s) exceeded while running command")
        stdout = result.stdout_bytes.decode(errors="backslashreplace")
        stderr = result.stderr_bytes.decode(errors="backslashreplace")
        code = -result.signal if result.signal else result.exit_code
        if cmd.check and code != 0:
            message = (f"Command {cmd.command!r} failed with exit code {code}. "
                       f"Stdout:\n{stdout!r}\nStderr:\n{stderr!r}")
            raise SwerexError("NonZeroExitCodeError",
                              f"{cmd.error_msg}: {message}" if cmd.error_msg else message)
        return {"stdout": stdout, "stderr": stderr, "exit_code": code}

    async def read_file(self, edge: Edge, sandbox_id: str, body: bytes) -> Any:
        req = _parse(ReadFile, body)
        encoding, errors = req.encoding or "utf-8", req.errors or "strict"
        try:
            codecs.lookup(encoding)
            codecs.lookup_error(errors)
        except LookupError as exc:
            raise SwerexError("builtins.LookupError", str(exc)) from None
        data = await _file_op(edge.read_file(sandbox_id, req.path), req.path)
        try:
            return {"content": data.decode(encoding, errors)}
        except UnicodeError as exc:
            raise SwerexError("builtins.ValueError", f"{req.path}: {exc}") from None

    async def write_file(self, edge: Edge, sandbox_id: str, body: bytes) -> Any:
        req = _parse(WriteFile, body)
        await _file_op(write_creating(edge, sandbox_id, req.path, req.content.encode()), req.path)
        return {}

    async def upload(self, edge: Edge, sandbox_id: str, body: bytes, content_type: str) -> Any:
        try:
            parts = {p.name: p for p in form_parts(content_type, body)}
        except ValueError as exc:
            raise _Refused(422, f"invalid multipart body: {exc}") from None
        if "file" not in parts or "target_path" not in parts:
            raise _Refused(422, "an upload needs the form fields file and target_path")
        try:
            target = parts["target_path"].content.decode()
            unzip = parts["unzip"].content.decode().strip().lower() if "unzip" in parts else "false"
        except UnicodeDecodeError:
            raise _Refused(422, "target_path and unzip are text") from None
        if unzip not in _BOOLS:
            raise _Refused(422, f"unzip is a boolean, not {unzip!r}")
        content = parts["file"].content
        if _BOOLS[unzip]:
            tar = zip_to_tar(content)
            await _file_op(edge.mkdir(sandbox_id, target, parents=True), target)
            await _file_op(edge.upload_tar(sandbox_id, target, tar), target)
        else:
            await _file_op(write_creating(edge, sandbox_id, target, content), target)
        return {}


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False,
          "no": False, "off": False}


def _argv(cmd: Command) -> list[str]:
    """``subprocess.run``'s reading of ``command`` and ``shell``; the shell is dsec's own."""
    if isinstance(cmd.command, str):
        return [SHELL, "-c", cmd.command] if cmd.shell else [cmd.command]
    if not cmd.command:
        raise SwerexError("builtins.ValueError", "an empty command")
    return [SHELL, "-c", *cmd.command] if cmd.shell else list(cmd.command)


async def _file_op(work: Awaitable[Any], path: str) -> Any:
    try:
        return await work
    except FileNotFound:
        raise SwerexError("builtins.FileNotFoundError",
                          f"[Errno 2] No such file or directory: {path!r}") from None
    except InvalidRequest as exc:
        if exc.details.get("errno") == "EISDIR":
            raise SwerexError("builtins.IsADirectoryError",
                              f"[Errno 21] Is a directory: {path!r}") from None
        raise SwerexError("builtins.ValueError", exc.message) from None


def _copy(response: Response) -> Response:
    return Response(bytes(response.body), status_code=response.status_code,
                    media_type="application/json")


def create_swerex_app(router: Router, keys: Keys) -> FastAPI:
    swerex = Swerex(router, keys)
    app = FastAPI(title="dsec: SWE-ReX compatibility", docs_url=None, redoc_url=None)
    app.state.swerex = swerex

    @app.exception_handler(_Refused)
    async def refused(request: Request, exc: _Refused) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    @app.get("/{sandbox_id}/is_alive")
    async def is_alive(sandbox_id: str, request: Request) -> Response:
        async def alive(edge: Edge, sid: str, body: bytes) -> Any:
            return {"is_alive": True, "message": ""}
        return await swerex.answer(request, sandbox_id, alive)

    routes: dict[str, Handler] = {
        "create_session": swerex.create_session, "run_in_session": swerex.run_in_session,
        "close_session": swerex.close_session, "execute": swerex.execute,
        "read_file": swerex.read_file, "write_file": swerex.write_file, "close": swerex.close,
    }
    for name, handler in routes.items():
        app.add_api_route(f"/{{sandbox_id}}/{name}", _route(swerex, handler), methods=["POST"],
                          name=name)

    @app.post("/{sandbox_id}/upload")
    async def upload(sandbox_id: str, request: Request) -> Response:
        content_type = request.headers.get("content-type", "")
        return await swerex.answer(request, sandbox_id, lambda edge, sid, body: swerex.upload(
            edge, sid, body, content_type))

    return app


def _route(swerex: Swerex, handler: Handler) -> Callable[[str, Request], Awaitable[Response]]:
    async def route(sandbox_id: str, request: Request) -> Response:
        return await swerex.answer(request, sandbox_id, handler)
    return route

