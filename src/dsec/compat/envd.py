"""E2B's data plane ("envd") served for dsec sandboxes.

In E2B every sandbox runs an ``envd`` daemon; the SDK reaches it through a gateway that
picks the sandbox from the ``E2b-Sandbox-Id`` header. Here the gateway and envd are one
thing: each request names its sandbox in that header, proves access with the per-sandbox
``X-Access-Token``, and is carried out through the owning edge's public methods.

Served (e2b-dev/infra ``packages/envd/spec``):

- REST ``envd.yaml``: ``GET /health``, ``GET /files`` (download), ``POST /files`` (upload,
  ``multipart/form-data`` or ``application/octet-stream``, optionally gzip-encoded).
- Connect ``process.Process``: ``Start`` and ``Connect`` (server streams; a command with an
  open stdin, ``stdin=True``, or on a PTY), ``List``, ``SendSignal``, ``SendInput`` (to a
  command's stdin or a PTY), ``StreamInput`` (a client stream of the same), ``CloseStdin``,
  ``Update`` (a PTY's size). These are dsec's ``stdin_open`` processes and terminals
  (``Edge.start_pty``), with their bounds: input waits while 1 MiB is unread, then
  ``resource_exhausted``.
- Connect ``filesystem.Filesystem``: ``Stat``, ``ListDir`` (with depth), ``MakeDir``,
  ``Remove``, ``Move``.

Not served (answered ``unimplemented``): directory watching. The envd version reported at
create (``ENVD_VERSION``) is the newest whose version-gated SDK behaviour this implements (see docs/COMPAT.md).

Users: commands and file operations run as the sandbox's root. ``user`` (E2B's default) and
``root`` are accepted and pick the home directory (``/home/user`` or ``/root``), which is the
default working directory and the base of relative paths, as in envd.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import posixpath
import shlex
import signal as signals
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..agent.client import Output
from ..agent.tools import BUSYBOX, SHELL
from ..control.routing import Router
from ..edge.edge import Edge
from ..protocol.errors import (
    CapacityExhausted,
    CommandTimeout,
    DSecError,
    FileNotFound,
    InvalidRequest,
    NotSupported,
    PayloadTooLarge,
    ProcessExited,
    ProcessNotFound,
    SandboxDied,
    SandboxNotFound,
    StdinClosed,
    StdinFull,
)
from ..protocol.models import (
    DEFAULT_MAX_OUTPUT,
    ExecRequest,
    ExecResult,
    FileEntry,
    ProcessInfo,
    PtyRequest,
)
from .auth import Keys
from .connect import Call, ConnectError, Method, PlainHttpError, Service
from .e2b_templates import WORKDIR_LABEL
from .files import write_creating
from .multipart import form_parts
from .proto import ENVD, Message

ENVD_VERSION = "0.5.7"
ENVD_PORT = "49983"
USERS = {"user": "/home/user", "root": "/root"}
DEFAULT_USER = "user"
_REMEMBERED_PROCS = 256  # per sandbox: what envd knows of the processes it started


@dataclass
class Target:
    edge: Edge
    sandbox_id: str


@dataclass
class _Started:
    """What envd knows about a process it started and the agent does not keep."""

    proc_id: str
    config: Message
    tag: str | None


@dataclass
class _Sandbox:
    procs: dict[int, _Started] = field(default_factory=dict)  # pid -> latest process
    workdir: str | None = None  # its template's WORKDIR (a label set at create), once read


def gone(sandbox_id: str) -> PlainHttpError:
    """What E2B's gateway answers for a sandbox that does not run (killed, expired, died):
    the SDK turns it into ``SandboxNotRunningException`` (``TimeoutException`` in older
    SDKs)."""
    return PlainHttpError(502, {"sandboxId": sandbox_id, "message": "The sandbox was not found",
                                "code": 502})


def rpc_error(exc: DSecError, target: Target) -> Exception:
    if isinstance(exc, (SandboxNotFound, SandboxDied)):
        return gone(target.sandbox_id)
    if isinstance(exc, (FileNotFound, ProcessNotFound, ProcessExited)):
        return ConnectError("not_found", exc.message)
    if isinstance(exc, StdinClosed):
        return ConnectError("failed_precondition", f"stdin not enabled or closed: {exc.message}")
    if isinstance(exc, (StdinFull, PayloadTooLarge)):
        return ConnectError("resource_exhausted", exc.message)
    if isinstance(exc, InvalidRequest):
        return ConnectError("invalid_argument", exc.message)
    if isinstance(exc, NotSupported):
        return ConnectError("unimplemented", exc.message)
    if isinstance(exc, CommandTimeout):
        return ConnectError("deadline_exceeded", exc.message)
    if isinstance(exc, CapacityExhausted):
        return ConnectError("resource_exhausted", exc.message)
    return ConnectError("internal", exc.message)


def resolve(path: str, home: str) -> str:
    """envd's path rules: ``~`` is the user's home, relative paths start there; the result
    is normalised lexically (so ``..`` never reaches dsec's stricter path check)."""
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    if not path.startswith("/"):
        path = f"{home}/{path}"
    path = posixpath.normpath(path)
    return "/" + path.lstrip("/")


def go_file_mode(kind: str, perm: int) -> int:
    """A file mode as Go's ``os.FileMode`` (what envd sends): type and special bits on top."""
    mode = perm & 0o777
    mode |= (1 << 31) if kind == "dir" else (1 << 27) if kind == "symlink" else 0
    mode |= (1 << 23) if perm & 0o4000 else 0  # setuid
    mode |= (1 << 22) if perm & 0o2000 else 0  # setgid
    mode |= (1 << 20) if perm & 0o1000 else 0  # sticky
    return mode


def go_mode_string(mode: int) -> str:
    """``os.FileMode.String()``: type/special letters (``-`` if none), then ``rwxrwxrwx``."""
    letters = "".join(ch for bit, ch in ((31, "d"), (27, "L"), (23, "u"), (22, "g"), (20, "t"))
                      if mode & (1 << bit))
    perms = "".join(ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return (letters or "-") + perms


def entry_info(e: FileEntry, path: str, symlink_target: str | None = None) -> Message:
    mode = go_file_mode(e.type, e.mode)
    info: Message = {
        "name": posixpath.basename(path) or "/", "type": {"file": 1, "dir": 2, "symlink": 3}.get(e.type, 0),
        "path": path, "size": e.size, "mode": mode, "permissions": go_mode_string(mode),
        "owner": "root", "group": "root", "modified_time": e.mtime,
    }
    if symlink_target is not None:
        info["symlink_target"] = symlink_target
    return info


def end_event(result: ExecResult) -> Message:
    """envd's EndEvent, worded like Go's ``ProcessState``: ``exit status 3`` or
    ``signal: killed`` (then ``exit_code`` is -1 and ``exited`` false)."""
    if result.signal:
        try:
            name = (signals.strsignal(result.signal) or f"signal {result.signal}").lower()
        except ValueError:
            name = f"signal {result.signal}"
        status, exited, code = f"signal: {name}", False, -1
    else:
        status, exited, code = f"exit status {result.exit_code}", True, result.exit_code
    end: Message = {"exit_code": code, "exited": exited, "status": status}
    notes = [note for flag, note in (
        (result.oom_killed, "a process of the sandbox ran out of memory"),
        (result.timed_out, "the command's timeout expired"),
        (result.stdout_truncated, f"stdout was truncated at {DEFAULT_MAX_OUTPUT >> 20} MiB"),
        (result.stderr_truncated, f"stderr was truncated at {DEFAULT_MAX_OUTPUT >> 20} MiB"),
    ) if flag]
    if code != 0 or notes:
        end["error"] = "; ".join([status, *notes])
    return end


class Envd:
    def __init__(self, router: Router, keys: Keys) -> None:
        self.router = router
        self.keys = keys
        self._sandboxes: dict[str, _Sandbox] = {}
        rpc = Method
        self.service = Service(ENVD, {
            "process.Process/Start": rpc("process.StartRequest", "process.StartResponse", stream=self.start),
            "process.Process/Connect": rpc("process.ConnectRequest", "process.ConnectResponse",
                                           stream=self.connect),
            "process.Process/List": rpc("process.ListRequest", "process.ListResponse", unary=self.list_processes),
            "process.Process/SendSignal": rpc("process.SendSignalRequest", "process.SendSignalResponse",
                                              unary=self.send_signal),
            "process.Process/SendInput": rpc("process.SendInputRequest", "process.SendInputResponse",
                                             unary=self.send_input),
            "process.Process/StreamInput": rpc("process.StreamInputRequest",
                                               "process.StreamInputResponse",
                                               client_stream=self.stream_input),
            "process.Process/CloseStdin": rpc("process.CloseStdinRequest", "process.CloseStdinResponse",
                                              unary=self.close_stdin),
            "process.Process/Update": rpc("process.UpdateRequest", "process.UpdateResponse",
                                          unary=self.update),
            "filesystem.Filesystem/Stat": rpc("filesystem.StatRequest", "filesystem.StatResponse",
                                              unary=self.stat),
            "filesystem.Filesystem/ListDir": rpc("filesystem.ListDirRequest", "filesystem.ListDirResponse",
                                                 unary=self.list_dir),
            "filesystem.Filesystem/MakeDir": rpc("filesystem.MakeDirRequest", "filesystem.MakeDirResponse",
                                                 unary=self.make_dir),
            "filesystem.Filesystem/Remove": rpc("filesystem.RemoveRequest", "filesystem.RemoveResponse",
                                                unary=self.remove),
            "filesystem.Filesystem/Move": rpc("filesystem.MoveRequest", "filesystem.MoveResponse",
                                              unary=self.move),
        }, prepare=self._prepare)

    # routing and access
    def target(self, request: Request) -> Target:
        token = request.headers.get("x-access-token")
        sandbox_id = request.headers.get("e2b-sandbox-id") or self.keys.sandbox_of_token(token)
        if not sandbox_id:
            raise PlainHttpError(400, {"code": 400, "message": "no E2b-Sandbox-Id header: point "
                                       "E2B_SANDBOX_URL at this server (see docs/COMPAT.md)"})
        if not self.keys.valid_access_token(sandbox_id, token):
            raise PlainHttpError(401, {"code": 401, "message": "invalid or missing X-Access-Token "
                                       f"for sandbox {sandbox_id}"})
        try:  # the edge itself, or as a trajectory recorder serves it (same methods)
            edge = cast(Edge, self.router.edge_for(sandbox_id))
        except SandboxNotFound:
            raise gone(sandbox_id) from None
        return Target(edge, sandbox_id)

    @staticmethod
    def _running(edge: Edge, sandbox_id: str) -> None:
        try:
            row = edge.get_row(sandbox_id)
        except SandboxNotFound:
            raise gone(sandbox_id) from None
        if row.state not in ("running", "paused"):  # its next call resumes a paused one
            raise gone(sandbox_id)

    async def _prepare(self, call: Call) -> None:
        call.state["target"] = self.target(call.request)
        username = DEFAULT_USER
        scheme, _, value = call.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "basic":
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                username = base64.b64decode(value.strip()).decode().partition(":")[0] or DEFAULT_USER
        if username not in USERS:
            raise ConnectError("unauthenticated", f"invalid username: '{username}' (dsec sandboxes "
                               f"know {', '.join(USERS)})")
        call.state["home"] = USERS[username]

    def _workdir(self, target: Target) -> str | None:
        """The sandbox's default working directory: its template's WORKDIR, if any."""
        state = self._state(target.sandbox_id)
        if state.workdir is None:
            labels = target.edge.get_row(target.sandbox_id).request.get("labels") or {}
            state.workdir = str(labels.get(WORKDIR_LABEL, ""))
        return state.workdir or None

    def _state(self, sandbox_id: str) -> _Sandbox:
        return self._sandboxes.setdefault(sandbox_id, _Sandbox())

    def forget(self, sandbox_id: str) -> None:
        self._sandboxes.pop(sandbox_id, None)

    def prune(self, live: set[str]) -> None:
        """Forget sandboxes that ended some other way (expired, died, stopped via dsec)."""
        if len(self._sandboxes) > 2 * len(live) + 64:
            for sandbox_id in [s for s in self._sandboxes if s not in live]:
                del self._sandboxes[sandbox_id]

    # REST
    async def health(self, request: Request) -> Response:
        target = self.target(request)
        self._running(target.edge, target.sandbox_id)
        return Response(status_code=204)

    async def download(self, request: Request) -> Response:
        target = self.target(request)
        home = _home(request.query_params.get("username"))
        path = resolve(request.query_params.get("path", ""), home)
        try:
            data = await target.edge.read_file(target.sandbox_id, path)
        except FileNotFound:
            return _error(404, f"path '{path}' does not exist")
        except InvalidRequest as exc:
            if exc.details.get("errno") == "EISDIR":
                return _error(400, f"path '{path}' is a directory")
            return _error(400, exc.message)
        except (SandboxNotFound, SandboxDied):
            raise gone(target.sandbox_id) from None
        return Response(data, media_type="application/octet-stream")

    async def upload(self, request: Request) -> Response:
        target = self.target(request)
        home = _home(request.query_params.get("username"))
        path_param = request.query_params.get("path")
        body = await request.body()
        if request.headers.get("content-encoding", "").lower() == "gzip":
            try:
                body = gzip.decompress(body)
            except (OSError, EOFError) as exc:
                return _error(400, f"error decompressing request body: {exc}")
        content_type = request.headers.get("content-type", "")
        media = content_type.partition(";")[0].strip().lower()
        if media == "application/octet-stream":
            if not path_param:
                return _error(400, "the path query parameter is required for an "
                                   "application/octet-stream upload")
            files = [(path_param, body)]
        elif media.startswith("multipart/"):
            try:
                files = _multipart_files(content_type, body)
            except ValueError as exc:
                return _error(400, f"invalid multipart body: {exc}")
            if path_param and len(files) == 1:
                files = [(path_param, files[0][1])]
        else:
            return _error(400, f"unsupported content type: {content_type}, expected "
                               "multipart/form-data or application/octet-stream")
        written: list[dict[str, str]] = []
        for name, data in files:
            path = resolve(name, home)
            if any(entry["path"] == path for entry in written):
                return _error(400, f"you cannot upload multiple files to the same path '{path}' "
                                   "in one upload request")
            try:
                await write_creating(target.edge, target.sandbox_id, path, data)
            except (SandboxNotFound, SandboxDied):
                raise gone(target.sandbox_id) from None
            except InvalidRequest as exc:
                if exc.details.get("errno") == "EISDIR":
                    return _error(400, f"path is a directory: {path}")
                return _error(400, exc.message)
            except FileNotFound as exc:
                return _error(400, exc.message)
            written.append({"path": path, "name": posixpath.basename(path), "type": "file"})
        return JSONResponse(written)

    # process.Process
    async def start(self, msg: Message, call: Call) -> AsyncIterator[Message]:
        target: Target = call.state["target"]
        home: str = call.state["home"]
        config = msg.get("process") or {}
        if not config.get("cmd"):
            raise ConnectError("invalid_argument", "process.cmd is required")
        cwd = resolve(config["cwd"], home) if config.get("cwd") else self._workdir(target) or home
        env = {"HOME": home, **config.get("envs", {})}
        command = [config["cmd"], *config.get("args", [])]
        pty = msg.get("pty")
        try:
            if pty is not None:
                size = pty.get("size") or {}
                req: ExecRequest | PtyRequest = PtyRequest(
                    command=command, env=env, cwd=cwd, timeout_s=call.timeout_s,
                    cols=size.get("cols") or 80, rows=size.get("rows") or 24)
            else:
                req = ExecRequest(command=command, env=env, cwd=cwd, timeout_s=call.timeout_s,
                                  stdin_open=bool(msg.get("stdin")))
        except ValueError as exc:
            raise ConnectError("invalid_argument", str(exc)) from None
        try:
            proc = (await target.edge.start_pty(target.sandbox_id, req)
                    if isinstance(req, PtyRequest) else
                    await target.edge.start_process(target.sandbox_id, req))
        except FileNotFound:
            raise ConnectError("invalid_argument", f"error starting process: working directory "
                               f"'{cwd}' does not exist") from None
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        procs = self._state(target.sandbox_id).procs
        procs.pop(proc.pid, None)
        procs[proc.pid] = _Started(proc.id, config, msg.get("tag"))
        while len(procs) > _REMEMBERED_PROCS:
            del procs[next(iter(procs))]
        async for event in self._process_events(target, proc, call, own_timeout=True):
            yield {"event": event}

    async def connect(self, msg: Message, call: Call) -> AsyncIterator[Message]:
        target: Target = call.state["target"]
        proc = await self._find(target, msg.get("process") or {}, running_only=False)
        async for event in self._process_events(target, proc, call, own_timeout=False):
            yield {"event": event}

    async def _process_events(self, target: Target, proc: ProcessInfo, call: Call,
                              own_timeout: bool) -> AsyncIterator[Message]:
        """start, the output (from the process's start: dsec keeps it; a PTY's as ``pty``
        data, its most recent bytes), end; keepalives in
        between when the client asked for them (``Keepalive-Ping-Interval``). A process
        killed by this call's own timeout ends the call with ``deadline_exceeded``; seen
        from a later Connect, it simply ended (``signal: killed``)."""
        yield {"start": {"pid": proc.pid}}
        try:
            keepalive_s: float | None = max(1.0, float(call.headers.get("keepalive-ping-interval", "")))
        except ValueError:
            keepalive_s = None
        events = aiter(target.edge.attach(target.sandbox_id, proc.id))

        async def following() -> Output | ExecResult:
            return await anext(events)

        pending: asyncio.Task[Output | ExecResult] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.create_task(following())
                done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
                if not done:
                    yield {"keepalive": {}}
                    continue
                task, pending = pending, None
                try:
                    event = task.result()
                except StopAsyncIteration:
                    return
                except DSecError as exc:
                    raise rpc_error(exc, target) from None
                if isinstance(event, Output):
                    stream = "pty" if proc.pty else "stdout" if event.fd == 1 else "stderr"
                    yield {"data": {stream: event.data}}
                    continue
                if event.timed_out and own_timeout:
                    raise ConnectError("deadline_exceeded", "the command's timeout expired; its "
                                       "process group was killed")
                yield {"end": end_event(event)}
                return
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.wait({pending})
                if not pending.cancelled():
                    pending.exception()  # retrieved: it ended the stream anyway
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _find(self, target: Target, selector: Message, running_only: bool) -> ProcessInfo:
        known = self._state(target.sandbox_id).procs
        if "pid" in selector:
            pid = int(selector["pid"])
            what = f"pid {pid}"
        elif "tag" in selector:
            tagged = [p for p, s in known.items() if s.tag == selector["tag"]]
            if not tagged:
                raise ConnectError("not_found", f"process with tag {selector['tag']} not found")
            pid, what = tagged[-1], f"tag {selector['tag']}"
        else:
            raise ConnectError("invalid_argument", "a process selector (pid or tag) is required")
        try:
            procs = await target.edge.processes(target.sandbox_id)
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        matches = [p for p in procs if p.pid == pid and (p.running or not running_only)]
        started = known.get(pid)
        matches.sort(key=lambda p: (p.running, started is not None and p.id == started.proc_id))
        if not matches:
            raise ConnectError("not_found", f"process with {what} not found")
        return matches[-1]

    async def list_processes(self, msg: Message, call: Call) -> Message:
        target: Target = call.state["target"]
        try:
            procs = await target.edge.processes(target.sandbox_id)
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        known = self._state(target.sandbox_id).procs
        out = []
        for p in procs:
            if not p.running:
                continue
            started = known.get(p.pid)
            if started is not None and started.proc_id == p.id:
                info: Message = {"config": started.config, "pid": p.pid}
                if started.tag is not None:
                    info["tag"] = started.tag
            else:
                argv = shlex.split(p.command) if p.command else [""]
                info = {"config": {"cmd": argv[0], "args": argv[1:]}, "pid": p.pid}
            out.append(info)
        return {"processes": out}

    async def _on_running(self, msg: Message, call: Call,
                          action: Callable[[Edge, str, str], Awaitable[None]]) -> Message:
        """``action(edge, sandbox id, dsec process id)`` on the running process the message
        selects; dsec's errors as envd's."""
        target: Target = call.state["target"]
        proc = await self._find(target, msg.get("process") or {}, running_only=True)
        try:
            await action(target.edge, target.sandbox_id, proc.id)
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        return {}

    async def send_signal(self, msg: Message, call: Call) -> Message:
        sig = int(msg.get("signal", 0))
        if sig not in (signals.SIGKILL, signals.SIGTERM):
            raise ConnectError("invalid_argument", f"invalid signal {sig}: SIGTERM or SIGKILL")
        return await self._on_running(msg, call, lambda edge, sid, p: edge.signal(sid, p, sig))

    async def send_input(self, msg: Message, call: Call) -> Message:
        data = _input(msg.get("input") or {})
        return await self._on_running(msg, call, lambda edge, sid, p: edge.send_stdin(sid, p, data))

    async def stream_input(self, messages: AsyncIterator[Message], call: Call) -> Message:
        """A start event naming the process, then its input in order, as it arrives
        (keepalives ignored); each chunk is one ``send_stdin``, with its bounds."""
        target: Target = call.state["target"]
        proc: ProcessInfo | None = None
        async for msg in messages:
            if "start" in msg:
                proc = await self._find(target, msg["start"].get("process") or {}, running_only=True)
            elif "data" in msg:
                if proc is None:
                    raise ConnectError("failed_precondition", "an input stream starts with a "
                                       "start event naming its process")
                try:
                    await target.edge.send_stdin(target.sandbox_id, proc.id,
                                                 _input(msg["data"].get("input") or {}))
                except DSecError as exc:
                    raise rpc_error(exc, target) from None
        return {}

    async def close_stdin(self, msg: Message, call: Call) -> Message:
        return await self._on_running(msg, call, lambda edge, sid, p: edge.close_stdin(sid, p))

    async def update(self, msg: Message, call: Call) -> Message:
        """A PTY's new size (the only update envd knows)."""
        size = (msg.get("pty") or {}).get("size")
        if size is None:
            raise ConnectError("invalid_argument", "an update needs pty.size")
        cols, rows = int(size.get("cols") or 0), int(size.get("rows") or 0)
        return await self._on_running(msg, call,
                                      lambda edge, sid, p: edge.resize_pty(sid, p, cols, rows))

    # filesystem.Filesystem
    async def _entry(self, target: Target, path: str) -> Message:
        try:
            e = await target.edge.stat(target.sandbox_id, path)
        except FileNotFound:
            raise ConnectError("not_found", f"file not found: {path}") from None
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        links = await self._symlink_targets(target, [path]) if e.type == "symlink" else {}
        return entry_info(e, path, links.get(path))

    async def _symlink_targets(self, target: Target, paths: list[str]) -> dict[str, str]:
        script = f'for p do printf "%s\\0" "$({BUSYBOX} readlink -- "$p")"; done'
        try:
            result = await target.edge.run(target.sandbox_id, ExecRequest(
                command=[SHELL, "-c", script, "sh", *paths], timeout_s=30))
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        values = result.stdout_bytes.decode(errors="replace").split("\0")  # one more: the last NUL
        return {p: v for p, v in zip(paths, values) if v}

    async def stat(self, msg: Message, call: Call) -> Message:
        target: Target = call.state["target"]
        return {"entry": await self._entry(target, resolve(msg.get("path", ""), call.state["home"]))}

    async def list_dir(self, msg: Message, call: Call) -> Message:
        target: Target = call.state["target"]
        depth = int(msg.get("depth") or 1)
        root = resolve(msg.get("path", ""), call.state["home"])
        top = await self._entry(target, root)
        if top["type"] == 1:
            raise ConnectError("invalid_argument", f"path is not a directory: {root}")
        entries: list[tuple[FileEntry, str]] = []
        level = [root]
        for _ in range(depth):
            following: list[str] = []
            for directory in level:
                try:
                    listed = await target.edge.list_dir(target.sandbox_id, directory)
                except FileNotFound:
                    if directory == root:
                        raise ConnectError("not_found", f"directory not found: {root}") from None
                    continue  # removed while walking
                except InvalidRequest as exc:
                    if directory == root:
                        raise ConnectError("invalid_argument", f"path is not a directory: {root}") from None
                    if exc.details.get("errno") in ("EACCES", "ENOTDIR"):
                        continue
                    raise rpc_error(exc, target) from None
                except DSecError as exc:
                    raise rpc_error(exc, target) from None
                for e in listed:
                    path = posixpath.join(directory, e.name)
                    entries.append((e, path))
                    if e.type == "dir":
                        following.append(path)
            level = following
        links = [p for e, p in entries if e.type == "symlink"]
        targets = await self._symlink_targets(target, links) if links else {}
        return {"entries": [entry_info(e, p, targets.get(p)) for e, p in entries]}

    async def make_dir(self, msg: Message, call: Call) -> Message:
        target: Target = call.state["target"]
        path = resolve(msg.get("path", ""), call.state["home"])
        try:
            existing = await target.edge.stat(target.sandbox_id, path)
        except FileNotFound:
            existing = None
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        if existing is not None:
            if existing.type == "dir":
                raise ConnectError("already_exists", f"directory already exists: {path}")
            raise ConnectError("invalid_argument", f"path already exists but it is not a directory: {path}")
        try:
            await target.edge.mkdir(target.sandbox_id, path, parents=True)
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        return {"entry": await self._entry(target, path)}

    async def remove(self, msg: Message, call: Call) -> Message:
        target: Target = call.state["target"]
        path = resolve(msg.get("path", ""), call.state["home"])
        try:
            await target.edge.remove(target.sandbox_id, path, recursive=True)
        except FileNotFound:
            pass  # like os.RemoveAll
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        return {}

    async def move(self, msg: Message, call: Call) -> Message:
        target: Target = call.state["target"]
        home = call.state["home"]
        source, destination = resolve(msg.get("source", ""), home), resolve(msg.get("destination", ""), home)
        await self._entry(target, source)  # not_found if missing
        script = f'{BUSYBOX} mkdir -p -- "$({BUSYBOX} dirname -- "$2")" && {BUSYBOX} mv -T -- "$1" "$2"'
        try:
            result = await target.edge.run(target.sandbox_id, ExecRequest(
                command=[SHELL, "-c", script, "sh", source, destination], timeout_s=60))
        except DSecError as exc:
            raise rpc_error(exc, target) from None
        if result.exit_code != 0:
            raise ConnectError("invalid_argument", f"error renaming: "
                               f"{result.stderr_bytes.decode(errors='replace').strip()}")
        return {"entry": await self._entry(target, destination)}


def _input(given: Message) -> bytes:
    """A ProcessInput's bytes: for a PTY or for stdin (dsec has one input channel for both)."""
    data: bytes = given["pty"] if given.get("pty") is not None else given.get("stdin") or b""
    return data


def _home(username: str | None) -> str:
    username = username or DEFAULT_USER
    if username not in USERS:
        raise PlainHttpError(401, {"code": 401, "message": f"error looking up user '{username}': "
                                   f"dsec sandboxes know {', '.join(USERS)}"})
    return USERS[username]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _multipart_files(content_type: str, body: bytes) -> list[tuple[str, bytes]]:
    """The ``file`` parts of a multipart body as (file name, content); envd takes the file name
    (a path) as where to write."""
    files = []
    for part in form_parts(content_type, body):
        if part.name != "file":
            continue
        if not part.filename:
            raise ValueError("a file part without a file name")
        files.append((part.filename.replace("%22", '"'), part.content))
    if not files:
        raise ValueError("no file part")
    return files
