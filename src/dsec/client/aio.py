"""The asyncio SDK: ``AsyncClient`` (formerly ``DSecClient``) creates sandboxes; a ``Sandbox``
runs commands and touches files; a ``Process`` is a background command.

    async with dsec.AsyncClient() as client:
        sb = await client.create(image="python-3.11")
        r = await sb.run("python3 -c 'print(6*7)'")
        assert r.stdout == "42\\n"
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import io
import os
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncIterator,
    Callable,
    Iterable,
    Literal,
    Mapping,
    TypedDict,
    TypeVar,
)

from pydantic import BaseModel, ValidationError

from ..protocol import archive
from ..protocol.build import ImageBuildRequest, ImageBuilt
from ..protocol.digest import StepRequest, step_request
from ..protocol.errors import (
    CommandTimeout,
    DSecError,
    FileNotFound,
    InvalidRequest,
    ProcessNotFound,
    ServerUnavailable,
)
from ..protocol.fn import DEFAULT_IMAGE, CodeResult, Language, RunCodeRequest
from ..protocol.gc_models import GcReport
from ..protocol.models import (
    CreateRequest,
    ExecRequest,
    ExecResult,
    FileEntry,
    ForkTrajectoryRequest,
    NetworkRequest,
    ProcessInfo,
    PtyRequest,
    ReplayReport,
    ReplayRequest,
    SandboxInfo,
    Snapshot,
    SnapshotRequest,
    StepDiff,
    StepPage,
    StepRecord,
    TrajectoryInfo,
    b64,
)
from ..protocol.ops import BY_METHOD
from ..protocol.outcome import decode, output_chunks
from . import build as builds
from . import fn as fn_calls
from .build import Context as BuildContext
from .projects import Projects
from .trajectory import Attachment, Checkpoint, OnDivergence, check_on_divergence
from .transport import Response, Transport, retrying


@dataclass(frozen=True)
class CommandResult:
    """What a finished command left: bytes are exact; ``stdout``/``stderr`` decode them."""

    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    signal: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    duration_ms: int = 0

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @classmethod
    def from_wire(cls, r: ExecResult, stdout: bytes | None = None,
                  stderr: bytes | None = None) -> CommandResult:
        return cls(exit_code=r.exit_code, signal=r.signal,
                   stdout_bytes=r.stdout_bytes if stdout is None else stdout,
                   stderr_bytes=r.stderr_bytes if stderr is None else stderr,
                   stdout_truncated=r.stdout_truncated, stderr_truncated=r.stderr_truncated,
                   timed_out=r.timed_out, oom_killed=r.oom_killed, duration_ms=r.duration_ms)


class CreateOptions(TypedDict, total=False):
    """The keywords of ``create`` that ``create_many`` passes on to each create."""

    substrate: str
    image: str
    cpu: float
    memory_mb: int
    pids: int
    disk_mb: int
    ttl_s: int
    network: Any
    env: dict[str, str]
    runtime: str
    labels: dict[str, str]
    snapshot: str
    checkpoint: Checkpoint


@dataclass(frozen=True)
class OutputChunk:
    stream: Literal["stdout", "stderr"]
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


if TYPE_CHECKING:
    from typing_extensions import Unpack

M = TypeVar("M", bound=BaseModel)
V = TypeVar("V")
RETRY_S = 30.0  # how long a fork's creates are retried while the server cannot be reached


def _validated(model: type[M], **fields: Any) -> M:
    """Check a request before sending it, raising the same typed error the server would."""
    try:
        return model(**fields)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid {model.__name__}: {exc.errors(include_url=False)}") from None


def _timeout_error(result: CommandResult, timeout_s: float | None) -> CommandTimeout:
    err = CommandTimeout(f"command timed out after {timeout_s}s; its process group was killed",
                         timeout_s=timeout_s)
    err.result = result  # type: ignore[attr-defined]
    return err


class OutputStream:
    """Iterate for output chunks as they arrive; ``result`` holds the outcome afterwards."""

    result: CommandResult | None

    def __init__(self, events: AsyncIterator[dict[str, Any]], timeout_s: float | None) -> None:
        self._events = events
        self._timeout_s = timeout_s
        self._out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.result: CommandResult | None = None

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[OutputChunk]:
        async for event in self._events:
            if event["type"] == "result":
                wire = ExecResult.model_validate(event["result"])
                self.result = CommandResult.from_wire(wire, b"".join(self._out["stdout"]),
                                                      b"".join(self._out["stderr"]))
                if wire.timed_out:
                    raise _timeout_error(self.result, self._timeout_s)
            else:
                chunk = OutputChunk(event["type"], base64.b64decode(event["data"]))
                self._out[chunk.stream].append(chunk.data)
                yield chunk

    async def wait(self) -> CommandResult:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class Process:
    """A command started in the background; its output is kept so it can be read again."""

    def __init__(self, sandbox: Sandbox, info: ProcessInfo) -> None:
        self.sandbox = sandbox
        self.id = info.id
        self.pid = info.pid
        self.command = info.command

    async def send_stdin(self, data: bytes | str) -> None:
        """Write to the process's stdin (started with ``stdin_open=True``) or terminal. At
        most 1 MiB a call; waits while the process leaves 1 MiB of earlier input unread, up
        to 10 s, then raises ``StdinFull`` (nothing of ``data`` was taken). ``StdinClosed``
        after ``close_stdin``, ``ProcessExited`` once it ended."""
        content = data.encode() if isinstance(data, str) else data
        await self.sandbox._call("send_stdin", {"process": self.id, "data": content}, _none,
                                 content=content)

    async def close_stdin(self) -> None:
        """Close the process's stdin (EOF) once the input already sent is written."""
        await self.sandbox._call("close_stdin", {"process": self.id}, _none)

    def stream(self) -> OutputStream:
        """Everything the process printed from its start, then live output until it ends."""
        return OutputStream(self.sandbox._events("attach", {"process": self.id}), None)

    async def wait(self) -> CommandResult:
        return await self.stream().wait()

    async def signal(self, sig: int) -> None:
        await self.sandbox._call("signal", {"process": self.id, "signal": sig}, _none,
                                 json={"signal": sig})

    async def kill(self) -> None:
        await self.signal(9)


class Pty(Process):
    """A command on a pseudo-terminal (``Sandbox.pty``): ``send_stdin`` types, ``stream``
    gives the terminal's output (one stream, ``stdout``; the most recent ``max_output_bytes``
    are kept for a later reader), ``resize``, ``wait``, ``kill``. Find it again after a
    reconnect with ``Sandbox.process(id)``."""

    async def resize(self, cols: int, rows: int) -> None:
        """The terminal's new size; its foreground programs get SIGWINCH."""
        await self.sandbox._call("resize_pty", {"process": self.id, "cols": cols, "rows": rows},
                                 _none, json={"cols": cols, "rows": rows})


class Session:
    """A named shell session: cwd and exported environment persist between its commands."""

    def __init__(self, sandbox: Sandbox, name: str) -> None:
        self.sandbox = sandbox
        self.name = name

    async def run(self, command: str | list[str], *, cwd: str | None = None,
                  stdin: bytes | str | None = None, timeout_s: float | None = 60.0,
                  max_output_bytes: int | None = None) -> CommandResult:
        """``Sandbox.run`` in this session (its environment is the session's)."""
        return await self.sandbox.run(command, cwd=cwd, stdin=stdin, timeout_s=timeout_s,
                                      max_output_bytes=max_output_bytes, session=self.name)

    def stream(self, command: str | list[str], *, cwd: str | None = None,
               stdin: bytes | str | None = None, timeout_s: float | None = 60.0,
               max_output_bytes: int | None = None) -> OutputStream:
        """``Sandbox.stream`` in this session."""
        return self.sandbox.stream(command, cwd=cwd, stdin=stdin, timeout_s=timeout_s,
                                   max_output_bytes=max_output_bytes, session=self.name)


class Sandbox:
    """A sandbox. Attached to a trajectory (``create(trajectory=...)``, ``resume``), each call
    is numbered (``next_step``), logged by the server, and answered from the log when it
    repeats the logged call at its step (``fast_forwarded`` counts those)."""

    id: str  # changes when its trajectory forks into a new sandbox
    info: SandboxInfo

    def __init__(self, transport: Transport, info: SandboxInfo,
                 attachment: Attachment | None = None) -> None:
        self._t = transport
        self.info = info
        self.id = info.id
        self._attachment = attachment

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.substrate}:{self.info.image} {self.info.state}>"

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # trajectory
    @property
    def trajectory(self) -> str | None:
        return self._attachment.trajectory if self._attachment else None

    @property
    def next_step(self) -> int | None:
        """The step number the next call gets (None when not attached)."""
        return self._attachment.next_step if self._attachment else None

    @property
    def fast_forwarded(self) -> int:
        """Calls of this handle answered from the trajectory log instead of executed."""
        return self._attachment.fast_forwarded if self._attachment else 0

    @property
    def generation(self) -> int | None:
        return self._attachment.generation if self._attachment else None

    def _route(self, operation: str, arguments: dict[str, Any]) -> tuple[str, str]:
        """The HTTP method and path of a call of ``operation`` (an edge method of the table
        of operations) on this sandbox (its id changes when its trajectory forks)."""
        verb, template = BY_METHOD[operation].http
        return verb, template.format(sandbox_id=self.id, **arguments)

    async def _call(self, operation: str, arguments: dict[str, Any],
                    parse: Callable[[Response], V], **kwargs: Any) -> V:
        """One call of ``operation`` with ``arguments`` (every parameter of the table's
        entry, by name; ``kwargs`` are the HTTP request's body and query): plain, or
        numbered and fast-forwarded for an attached sandbox."""
        attachment = self._attachment
        if attachment is None:
            return parse(await self._t.request(*self._route(operation, arguments), **kwargs))
        step = attachment.take_step()
        request = _step_request(operation, arguments)
        if attachment.may_be_logged(step):
            logged = await attachment.logged_outcome(step, request, self._page)
            if logged is not None:
                return decode(logged.op, logged.outcome, _no_blobs)
        headers = attachment.headers(step)
        response = await retrying(attachment.retry_s, lambda: self._t.request(
            *self._route(operation, arguments), headers=headers, **kwargs))
        self._observe(response.headers)
        return parse(response)

    def _events(self, operation: str, arguments: dict[str, Any],
                **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events of a stream operation; for an attached sandbox the step is taken
        now, at the call, not when iteration starts."""
        attachment = self._attachment
        if attachment is None:
            return self._t.ndjson(*self._route(operation, arguments), **kwargs)
        return self._attached_events(attachment, attachment.take_step(), operation, arguments,
                                     kwargs)

    async def _attached_events(self, attachment: Attachment, step: int, operation: str,
                               arguments: dict[str, Any],
                               kwargs: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        request = _step_request(operation, arguments)
        logged = await attachment.logged_outcome(step, request, self._page)
        if logged is not None:
            result: ExecResult = decode(logged.op, logged.outcome, _no_blobs)
            for fd, data in output_chunks(result, logged.outcome.get("chunks")):
                yield {"type": "stdout" if fd == 1 else "stderr", "data": b64(data)}
            bare = result.model_copy(update={"stdout_b64": "", "stderr_b64": ""})
            yield {"type": "result", "result": bare.model_dump()}
            return
        headers = attachment.headers(step)
        started = time.monotonic()
        delay = 0.05
        while True:  # retried with the same step while nothing has been received
            received = False
            try:
                async for event in self._t.ndjson(*self._route(operation, arguments), headers=headers,
                                                  on_response=self._observe, **kwargs):
                    received = True
                    yield event
                return
            except ServerUnavailable:
                if received or time.monotonic() - started + delay > attachment.retry_s:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _page(self, after: int, limit: int) -> StepPage:
        attachment = self._attachment
        assert attachment is not None
        return StepPage.model_validate(await retrying(attachment.retry_s, lambda: self._t.json(
            "GET", f"/v1/trajectories/{attachment.trajectory}/-/steps",
            params={"after": after, "limit": limit, "generation": attachment.generation})))

    def _observe(self, headers: Mapping[str, str]) -> None:
        assert self._attachment is not None
        sandbox_id = self._attachment.observe(headers)
        if sandbox_id and sandbox_id != self.id:  # the trajectory forked into a new sandbox
            self.id = sandbox_id
            self.info = self.info.model_copy(update={"id": sandbox_id, "state": "running",
                                                     "reason": None})

    # commands
    def _exec_request(self, command: str | list[str], env: dict[str, str] | None,
                      cwd: str | None, stdin: bytes | str | None, timeout_s: float | None,
                      max_output_bytes: int | None, session: str | None) -> ExecRequest:
        return _validated(ExecRequest, command=command, env=env or {}, cwd=cwd,
                          timeout_s=timeout_s, session=session,
                          stdin_b64=None if stdin is None else
                          b64(stdin.encode() if isinstance(stdin, str) else stdin),
                          **({} if max_output_bytes is None else {"max_output_bytes": max_output_bytes}))

    async def run(self, command: str | list[str], *, env: dict[str, str] | None = None,
                  cwd: str | None = None, stdin: bytes | str | None = None,
                  timeout_s: float | None = 60.0, max_output_bytes: int | None = None,
                  session: str | None = None) -> CommandResult:
        """Run a command to completion. A string runs under dsec's ``/.dsec/bin/sh -c``; a list
        is an argv. Raises ``CommandTimeout`` (with ``.result`` holding partial output) on timeout."""
        req = self._exec_request(command, env, cwd, stdin, timeout_s, max_output_bytes, session)
        wire = await self._call("run", {"req": req}, _exec_result,
                                json=req.model_dump(exclude_unset=True))
        result = CommandResult.from_wire(wire)
        if wire.timed_out:
            raise _timeout_error(result, timeout_s)
        return result

    def stream(self, command: str | list[str], *, env: dict[str, str] | None = None,
               cwd: str | None = None, stdin: bytes | str | None = None,
               timeout_s: float | None = 60.0, max_output_bytes: int | None = None,
               session: str | None = None) -> OutputStream:
        """Run a command and iterate over its output as it arrives."""
        req = self._exec_request(command, env, cwd, stdin, timeout_s, max_output_bytes, session)
        return OutputStream(self._events("stream", {"req": req},
                                         json=req.model_dump(exclude_unset=True)), timeout_s)

    async def start(self, command: str | list[str], *, env: dict[str, str] | None = None,
                    cwd: str | None = None, stdin: bytes | str | None = None,
                    timeout_s: float | None = None, max_output_bytes: int | None = None,
                    stdin_open: bool = False) -> Process:
        """Start a command in the background and return at once. With ``stdin_open`` its
        stdin stays open (after ``stdin``) for ``Process.send_stdin`` until ``close_stdin``."""
        req = self._exec_request(command, env, cwd, stdin, timeout_s, max_output_bytes, None)
        if stdin_open:
            req = req.model_copy(update={"stdin_open": True})
        info = await self._call("start_process", {"req": req}, _model(ProcessInfo),
                                json=req.model_dump(exclude_unset=True))
        return Process(self, info)

    async def pty(self, cols: int = 80, rows: int = 24, command: str | list[str] = "bash", *,
                  env: dict[str, str] | None = None, cwd: str | None = None,
                  timeout_s: float | None = None, max_output_bytes: int | None = None) -> Pty:
        """Start ``command`` on a new pseudo-terminal of ``cols`` x ``rows`` (TERM is
        xterm-256color unless ``env`` or the sandbox sets it)."""
        req = _validated(PtyRequest, command=command, cols=cols, rows=rows, env=env or {},
                         cwd=cwd, timeout_s=timeout_s,
                         **({} if max_output_bytes is None else
                            {"max_output_bytes": max_output_bytes}))
        info = await self._call("start_pty", {"req": req}, _model(ProcessInfo),
                                json=req.model_dump(exclude_unset=True))
        return Pty(self, info)

    async def processes(self) -> list[ProcessInfo]:
        return await self._call("processes", {}, _models(ProcessInfo))

    async def process(self, process_id: str) -> Process:
        """A background process (a ``Pty`` for a terminal) by id, e.g. after a reconnect;
        ``ProcessNotFound`` if the sandbox does not know it."""
        for info in await self.processes():
            if info.id == process_id:
                return (Pty if info.pty else Process)(self, info)
        raise ProcessNotFound(f"no process {process_id!r}", process_id=process_id)

    def session(self, name: str) -> Session:
        return Session(self, name)

    # ports
    async def url(self, port: int) -> str:
        """The URL of ``port`` inside the sandbox, for any HTTP client: ``<server>/v1/ports/
        <token>/``, where the token opens this port of this sandbox only and dies with it.
        With the API key instead, the same port is ``<server>/v1/sandboxes/<id>/ports/<port>/``.
        Requests go through the API server (HTTP only, not WebSocket); a port where nothing
        listens answers ``PortUnavailable`` (502). Not a trajectory step."""
        base, _ = await self._t.endpoint()
        body = await self._t.json("GET", f"/v1/sandboxes/{self.id}/ports/{int(port)}")
        return base + str(body["path"])

    # files
    async def read_file(self, path: str) -> bytes:
        return await self._call("read_file", {"path": path}, _content, params={"path": path})

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644,
                         append: bool = False) -> None:
        content = data.encode() if isinstance(data, str) else data
        await self._call("write_file", {"path": path, "data": content, "mode": mode,
                                        "append": append}, _none, content=content,
                         params={"path": path, "mode": mode, "append": append})

    async def list_files(self, path: str = "/work") -> list[FileEntry]:
        return await self._call("list_dir", {"path": path}, _models(FileEntry),
                                params={"path": path})

    async def stat(self, path: str) -> FileEntry:
        return await self._call("stat", {"path": path}, _model(FileEntry), params={"path": path})

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except FileNotFound:
            return False
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._call("remove", {"path": path, "recursive": recursive}, _none,
                         params={"path": path, "recursive": recursive})

    async def mkdir(self, path: str, *, parents: bool = True) -> None:
        await self._call("mkdir", {"path": path, "parents": parents}, _none,
                         params={"path": path, "parents": parents})

    async def upload(self, local: str | Path, remote_dir: str) -> None:
        """Copy a local file or directory into ``remote_dir`` (created if missing) as one tar."""
        local = Path(local)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            if local.is_dir():
                for child in sorted(local.iterdir()):
                    tar.add(child, arcname=child.name)
            else:
                tar.add(local, arcname=local.name)
        await self.mkdir(remote_dir, parents=True)
        await self._call("upload_tar", {"path": remote_dir, "tar": buf.getvalue()}, _none,
                         content=buf.getvalue(), params={"path": remote_dir})

    async def download(self, remote_dir: str, local_dir: str | Path, *,
                       max_bytes: int = archive.DEFAULT_MAX_BYTES,
                       max_members: int = archive.DEFAULT_MAX_MEMBERS) -> None:
        """Copy the contents of ``remote_dir`` into ``local_dir``. The archive is sandbox-made:
        each member is checked and created under ``local_dir`` only (see ``protocol/archive.py``);
        ``UnsafeArchive`` if one would land outside, or past ``max_bytes``/``max_members``."""
        data = await self._call("download_tar", {"path": remote_dir}, _content,
                                params={"path": remote_dir})
        await asyncio.to_thread(archive.extract, data, local_dir, max_bytes=max_bytes,
                                max_members=max_members)

    # state
    async def snapshot(self, mode: str = "filesystem", previous: Snapshot | str | None = None,
                       ttl_s: int | None = None) -> Snapshot:
        """A copy of the sandbox's file system, kept until ``delete_snapshot`` or, with
        ``ttl_s``, until the server deletes it that many seconds later (it outlives the
        sandbox): ``create(snapshot=snap.id)`` starts sandboxes from it, processes fresh.
        It holds the sandbox's ``disk_mb`` of its project's snapshot quota (``QuotaExceeded``
        when that is full). With ``previous`` (one of this sandbox's snapshots), that one is
        the answer if nothing was written since (no copy, nothing more held).
        ``mode="full"``: memory and processes too (microvm and vm sandboxes; ``NotSupported``,
        with the reason, on container and fn ones); it also holds the sandbox's memory size."""
        if isinstance(previous, Snapshot):
            previous = previous.id
        req = _validated(SnapshotRequest, mode=mode, previous=previous, ttl_s=ttl_s)
        return Snapshot.model_validate(
            await self._t.json(*self._route("snapshot", {}), json=req.model_dump()))

    async def rollback(self, snapshot: Snapshot | str) -> SandboxInfo:
        """This sandbox back at one of its own snapshots: its processes are killed, its file
        system becomes the snapshot's, its init starts again (same id); ``InvalidRequest``
        for another sandbox's snapshot."""
        snapshot_id = snapshot if isinstance(snapshot, str) else snapshot.id
        self.info = SandboxInfo.model_validate(await self._t.json(
            *self._route("rollback", {}), json={"snapshot": snapshot_id}))
        return self.info

    async def fork(self, n: int, *, mode: str = "filesystem", concurrency: int = 32,
                   keep_snapshot: bool = False,
                   **options: Unpack[CreateOptions]) -> builtins.list[Sandbox | DSecError]:
        """``n`` new sandboxes starting from this one's file system now (``mode="full"``, VMs:
        its memory and processes too): one snapshot, then ``n`` creates from it,
        ``concurrency`` at a time; ``options`` as for ``create``: a child has this sandbox's
        limits, network policy, runtime, environment and ``ttl_s`` for every option not
        given (``env`` is added to this one's), and always its image and disk size (and for
        ``full`` its memory and cpu). One entry per child in order: the Sandbox or the typed
        error that stopped it (``QuotaExceeded`` when the project has no room for a child's
        inherited cpu and memory). The snapshot is deleted afterwards unless
        ``keep_snapshot``."""
        snap = await self.snapshot(mode)
        gate = asyncio.Semaphore(concurrency)
        fields = {**options, "snapshot": snap.id, "substrate": self.info.substrate,
                  "image": self.info.image}

        async def one() -> Sandbox | DSecError:
            async with gate:
                try:
                    return Sandbox(self._t, await _create(self._t, fields, None, RETRY_S))
                except DSecError as exc:
                    return exc

        try:
            return builtins.list(await asyncio.gather(*(one() for _ in range(n))))
        finally:
            if not keep_snapshot:
                verb, path = BY_METHOD["delete_snapshot"].http
                await self._t.request(verb, path.format(snapshot_id=snap.id))

    # lifecycle
    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(await self._t.json("GET", f"/v1/sandboxes/{self.id}"))
        return self.info

    async def set_ttl(self, ttl_s: int) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(
            await self._t.json(*self._route("set_ttl", {}), json={"ttl_s": ttl_s}))
        return self.info

    async def pause(self) -> SandboxInfo:
        """Freeze every process of the sandbox: it uses no CPU until resumed. Any later call
        on it (run, files, processes...) resumes it first; the TTL keeps running."""
        self.info = SandboxInfo.model_validate(await self._t.json(*self._route("pause", {})))
        return self.info

    async def resume(self) -> SandboxInfo:
        """Let a paused sandbox run again (a no-op if it runs)."""
        self.info = SandboxInfo.model_validate(await self._t.json(*self._route("resume", {})))
        return self.info

    async def set_network(self, network: Any) -> SandboxInfo:
        """Replace the sandbox's egress policy while it runs: ``"none"`` or a policy such as
        ``{"pypi": True, "allow": ["10.1.2.3:443"]}`` (see ``NetworkPolicy``). Atomic: on
        error the previous policy stays."""
        req = _validated(NetworkRequest, network=network)
        self.info = SandboxInfo.model_validate(
            await self._t.json(*self._route("set_network", {}), json=req.model_dump()))
        return self.info

    async def stop(self) -> None:
        await self._t.request(*self._route("stop", {}))


async def _create(t: Transport, fields: dict[str, Any], key: str | None,
                  retry_s: float) -> SandboxInfo:
    """A create of ``fields`` (``CreateRequest``'s, None for the server's default) under an
    ``Idempotency-Key`` (``key``, else a fresh one), retried with it for ``retry_s`` while the
    server cannot be reached: a retry gets the sandbox the cut request made."""
    req = _validated(CreateRequest, **{k: v for k, v in fields.items() if v is not None})
    headers = {"Idempotency-Key": key or str(uuid.uuid4())}
    return SandboxInfo.model_validate(await retrying(retry_s, lambda: t.json(
        *BY_METHOD["create"].http, json=req.model_dump(exclude_unset=True), headers=headers)))


def _exec_result(response: Response) -> ExecResult:
    return ExecResult.model_validate_json(response.content)


def _model(model: type[M]) -> Callable[[Response], M]:
    return lambda response: model.model_validate_json(response.content)


def _models(model: type[M]) -> Callable[[Response], list[M]]:
    return lambda response: [model.model_validate(e) for e in response.json()]


def _content(response: Response) -> bytes:
    return response.content


def _none(response: Response) -> None:
    return None


def _step_request(operation: str, arguments: dict[str, Any]) -> Callable[[], StepRequest]:
    """The call's StepRequest, made when it is needed to match the log."""
    return lambda: step_request(BY_METHOD[operation], arguments)


def _no_blobs(sha256: str) -> bytes:
    raise AssertionError("prefetched outcomes are inline")  # Attachment keeps only those


@dataclass
class Replay:
    """What a replay found: one ``StepDiff`` per replayed step, and the sandbox it ran in
    (yours to stop; attached to the trajectory when ``attach`` was asked)."""

    trajectory: str
    generation: int
    sandbox: Sandbox
    steps: list[StepDiff]
    attached_generation: int | None = None
    restored_step: int | None = None  # the checkpoint it started from (steps after it replayed)

    @property
    def differences(self) -> list[StepDiff]:
        return [s for s in self.steps if not s.same]

    @property
    def first_difference(self) -> StepDiff | None:
        return next((s for s in self.steps if not s.same), None)


class AsyncClient:
    """The entry point of the asyncio SDK. With no arguments it uses this host's local dsec
    server. ``dsec.Client`` is its blocking twin; ``DSecClient`` is its former name."""

    def __init__(self, url: str | None = None, api_key: str | None = None, *,
                 timeout_s: float = 600.0, autostart: bool = True, retry_s: float = 30.0) -> None:
        """``retry_s``: how long a call of an attached sandbox is retried (same step) while
        the server cannot be reached."""
        self._t = Transport(url, api_key, timeout_s, autostart)
        self._retry_s = retry_s

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._t.aclose()

    async def endpoint(self) -> tuple[str, str]:
        """The server's URL (``unix://PATH`` for the local socket) and the API key this client
        uses: for clients of dsec's other protocols (SWE-ReX's ``RemoteRuntime``)."""
        return await self._t.endpoint()

    async def create(self, substrate: str = "container", image: str = "debian-minbase", *,
                     cpu: float | None = None, memory_mb: int | None = None,
                     pids: int | None = None, disk_mb: int | None = None,
                     ttl_s: int | None = None, network: Any = None,
                     env: dict[str, str] | None = None, runtime: str | None = None,
                     labels: dict[str, str] | None = None, trajectory: str | None = None,
                     on_divergence: OnDivergence = "raise",
                     idempotency_key: str | None = None, snapshot: str | None = None,
                     checkpoint: Checkpoint | None = None,
                     trajectory_ttl_s: int | None = None) -> Sandbox:
        """Start a sandbox of ``image`` on ``substrate`` (``container``, ``fn``, ``microvm``,
        ``vm``). An option left None takes the server's default (see ``CreateRequest``):
        ``cpu`` (1.0), ``memory_mb`` (512), ``pids`` (512), ``disk_mb`` (1024), ``ttl_s``
        (600, counted from when it runs), ``network`` (``"none"``, or a policy such as
        ``{"pypi": True, "allow": ["10.1.2.3:443"]}``), ``env``, ``runtime`` (the edge's),
        ``labels``. With ``trajectory``, every call of the sandbox is logged under that new
        trajectory id (``TrajectoryExists`` if it is taken), to be resumed after a preemption.
        With ``snapshot`` (an id from ``Sandbox.snapshot``), the sandbox starts from that
        file system, with the snapshot's image and disk size (``SnapshotNotFound`` if gone),
        and the limits, network policy, runtime, environment and ``ttl_s`` of the sandbox it
        was taken of for every option left None (``env`` is added to the parent's).
        With ``trajectory`` and ``checkpoint`` (``"every_step"`` or every k-th step), the
        file system is snapshotted after each such step (the previous snapshot is kept when
        a step wrote nothing): ``fork_trajectory``, and forks and replays of the trajectory,
        start from a step's checkpoint instead of re-executing the steps before it.
        ``trajectory_ttl_s``: the trajectory is deleted (its sandbox stopped) that many
        seconds after it was created (default: the server's trajectory TTL, or never).

        The create carries an ``Idempotency-Key`` (``idempotency_key``, else a fresh one) and
        is retried with it for ``retry_s`` while the server cannot be reached or the
        connection drops: a retry gets the sandbox the cut request made, never a second one.
        Pass your own key to make a create you repeat yourself (after a crash) idempotent."""
        check_on_divergence(on_divergence)
        info = await _create(self._t, dict(
            substrate=substrate, image=image, cpu=cpu, memory_mb=memory_mb, pids=pids,
            disk_mb=disk_mb, ttl_s=ttl_s, network=network, env=env, runtime=runtime,
            labels=labels, trajectory=trajectory, snapshot=snapshot, checkpoint=checkpoint,
            trajectory_ttl_s=trajectory_ttl_s),
            idempotency_key,
            self._retry_s)
        attachment = None if trajectory is None else Attachment(
            trajectory, on_divergence, generation=1, retry_s=self._retry_s)
        return Sandbox(self._t, info, attachment)

    async def resume(self, trajectory: str, *, on_divergence: OnDivergence = "raise",
                     prefetch: bool = True) -> Sandbox:
        """The sandbox of a trajectory, attached from step 1: re-issue the calls from the
        start and the logged ones are answered from the log (fast-forward), the first new one
        runs. ``SandboxDied`` (details: ``last_step``) if the sandbox died: see ``replay``.
        ``on_divergence="fork"`` turns a call that differs from the log into a fork: the log
        up to that call is replayed into a fresh sandbox, which carries on."""
        check_on_divergence(on_divergence)
        info = TrajectoryInfo.model_validate(
            await self._t.json("POST", f"/v1/trajectories/{trajectory}/-/resume"))
        attachment = Attachment(trajectory, on_divergence, generation=info.generation,
                                logged=info.last_step, prefetch=prefetch, retry_s=self._retry_s)
        return Sandbox(self._t, info.sandbox, attachment)

    async def replay(self, trajectory: str, into: str = "new", *, upto: int | None = None,
                     generation: int | None = None, attach: bool = False,
                     on_divergence: OnDivergence = "raise", restore: bool = True) -> Replay:
        """Re-execute a trajectory's logged calls (of ``generation``, up to ``upto``) into a
        fresh sandbox, and report step by step where the results differ from the log. With
        ``attach``, the new sandbox becomes the trajectory's and the returned handle is
        attached from step 1, like ``resume``: the way on after the sandbox died. A
        trajectory with checkpoints starts from the newest one at or before ``upto`` and
        replays only the steps after it (``restored_step``), unless ``restore=False``."""
        req = _validated(ReplayRequest, into=into, upto=upto, generation=generation, attach=attach,
                         restore=restore)
        check_on_divergence(on_divergence)
        report = ReplayReport.model_validate(await self._t.json(
            "POST", f"/v1/trajectories/{trajectory}/-/replay", json=req.model_dump()))
        attachment = None
        if report.attached_generation is not None:
            attachment = Attachment(trajectory, on_divergence, generation=report.attached_generation,
                                    logged=max([s.step for s in report.steps],
                                               default=report.restored_step or 0),
                                    prefetch=True, retry_s=self._retry_s)
        return Replay(trajectory, report.generation, Sandbox(self._t, report.sandbox, attachment),
                      report.steps, report.attached_generation, report.restored_step)

    async def delete_trajectory(self, trajectory: str) -> None:
        """Forget a trajectory: its sandbox is stopped if it runs, its log deleted, and the
        snapshots of its checkpoints too (those a fork of it still links are kept)."""
        await self._t.request("DELETE", f"/v1/trajectories/{trajectory}")

    async def fork_trajectory(self, trajectory: str, at_step: int, n: int = 1, *,
                              on_divergence: OnDivergence = "raise") -> builtins.list[Sandbox]:
        """``n`` new sandboxes started from the checkpoint of step ``at_step`` of a
        trajectory created with ``checkpoint=`` (0: before its first step), each attached to
        a new trajectory (``<trajectory>/fork-<at_step>-<hex>``) that holds the steps up to
        ``at_step`` and goes on from the next one: no step is executed again.
        ``CheckpointNotFound`` if the step has no checkpoint (never checkpointed, or its
        snapshot deleted). Processes started by earlier steps are not running in the forks."""
        check_on_divergence(on_divergence)
        req = _validated(ForkTrajectoryRequest, at_step=at_step, n=n)
        forks = [TrajectoryInfo.model_validate(t) for t in await self._t.json(
            "POST", f"/v1/trajectories/{trajectory}/-/fork", json=req.model_dump())]
        return [Sandbox(self._t, fork.sandbox, Attachment(
            fork.id, on_divergence, generation=fork.generation, logged=at_step,
            retry_s=self._retry_s, next_step=at_step + 1)) for fork in forks]

    async def trajectory(self, trajectory: str) -> TrajectoryInfo:
        return TrajectoryInfo.model_validate(
            await self._t.json("GET", f"/v1/trajectories/{trajectory}"))

    async def trajectories(self, limit: int = 100) -> list[TrajectoryInfo]:
        """The most recently created trajectories."""
        return [TrajectoryInfo.model_validate(t) for t in
                await self._t.json("GET", "/v1/trajectories", params={"limit": limit})]

    async def trajectory_steps(self, trajectory: str,
                               generation: int | None = None) -> list[StepRecord]:
        """Every logged step of a generation (default: the current one), in order."""
        steps: list[StepRecord] = []
        after: int | None = 0
        while after is not None:
            params: dict[str, Any] = {"after": after, "limit": 1000}
            if generation is not None:
                params["generation"] = generation
            page = StepPage.model_validate(await self._t.json(
                "GET", f"/v1/trajectories/{trajectory}/-/steps", params=params))
            steps += page.steps
            after = page.next_after
        return steps

    async def export_trajectory(self, trajectory: str) -> AsyncIterator[dict[str, Any]]:
        """The provenance export, one JSON object per line: the trajectory, then its steps."""
        async for line in self._t.ndjson("GET", f"/v1/trajectories/{trajectory}/-/export",
                                         params={"format": "jsonl"}):
            yield line

    async def create_many(self, n: int, *, concurrency: int = 32,
                          idempotency_key: str | None = None,
                          **options: Unpack[CreateOptions]) -> builtins.list[Sandbox | DSecError]:
        """Start ``n`` sandboxes (``options`` as for ``create``; no trajectory: each would
        need its own), at most ``concurrency`` at a time. Returns one entry per
        sandbox in order: the Sandbox, or the typed error that stopped it. Each create has its
        own key; with ``idempotency_key``, sandbox ``i``'s is ``f"{idempotency_key}-{i}"``, so
        repeating the whole call gets the same ``n`` sandboxes."""
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> Sandbox | DSecError:
            async with gate:
                try:
                    return await self.create(idempotency_key=idempotency_key and
                                             f"{idempotency_key}-{i}", **options)
                except DSecError as exc:
                    return exc

        return builtins.list(await asyncio.gather(*(one(i) for i in range(n))))

    async def snapshots(self) -> builtins.list[Snapshot]:
        """The snapshots your key may see (those of your project's sandboxes)."""
        return [Snapshot.model_validate(s) for s in await self._t.json("GET", "/v1/snapshots")]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot and its files (sandboxes started from it keep running)."""
        verb, path = BY_METHOD["delete_snapshot"].http
        await self._t.request(verb, path.format(snapshot_id=snapshot_id))

    async def get(self, sandbox_id: str) -> Sandbox:
        info = await self._t.json("GET", f"/v1/sandboxes/{sandbox_id}")
        return Sandbox(self._t, SandboxInfo.model_validate(info))

    async def list(self) -> list[SandboxInfo]:
        return [SandboxInfo.model_validate(s) for s in await self._t.json("GET", "/v1/sandboxes")]

    async def health(self) -> dict[str, Any]:
        return await self._t.json("GET", "/v1/health")

    def projects(self) -> Projects:
        """Projects, quotas and project keys (see docs/PROJECTS.md)."""
        return Projects(self._t)

    async def gc(self, dry_run: bool = False) -> GcReport:
        """Collect garbage now (admin key): what past retention was removed, by kind (with
        ``dry_run``: what would be, removing nothing). See docs/RETENTION.md."""
        return GcReport.model_validate(await self._t.json(
            "POST", "/v1/admin/gc", params={"dry_run": "true" if dry_run else "false"}))

    # images
    async def build_image(self, name: str, context: BuildContext = None, *,
                          dockerfile: str | os.PathLike[str] | None = None,
                          build_args: dict[str, str] | None = None, network: Any = "none",
                          disk_mb: int = 4096, memory_mb: int = 2048, cpu: float = 1.0,
                          on_log: Callable[[str], Any] | None = None) -> ImageBuilt:
        """Build a Dockerfile on the server, each RUN, COPY and WORKDIR step in a sandbox of
        the image so far (docs/IMAGES.md); its ``ImageBuilt.image`` is the name to create
        sandboxes of (a project key's build: ``p.PROJECT.NAME``). ``context``: a directory
        (sent whole as a tar) or a tar's bytes; ``dockerfile``: a path, or the text itself
        (default: the context's ``Dockerfile``); ``network``: RUN steps' egress, as a
        sandbox's (``{"pypi": True}``; default none); ``on_log``: each line of progress.
        A failing step raises ``ImageBuildError`` (its line, exit code, output tail)."""
        text = builds.dockerfile_text(dockerfile, context)
        req = _validated(ImageBuildRequest, name=name, dockerfile=text,
                         build_args=build_args or {}, network=network, disk_mb=disk_mb,
                         memory_mb=memory_mb, cpu=cpu)
        return await builds.build(self._t, req, builds.context_tar(context), on_log)

    # fn substrate: calls into pre-warmed, jailed workers (see docs/FN.md)
    async def call(self, fn: Callable[..., V], *args: Any, substrate: str = "fn",
                   image: str = DEFAULT_IMAGE, timeout_s: float = 60.0,
                   kwargs: dict[str, Any] | None = None, trusted_result: bool = False) -> V:
        """``fn(*args, **kwargs)`` in a fresh jailed worker of ``image``; its return value.
        Raises ``RemoteError`` (``remote_type``, ``traceback``) if it raised,
        ``CommandTimeout`` past ``timeout_s``, ``SandboxDied`` if the worker died (OOM, signal).
        The value must be plain data (None, bool, int, float, str, bytes, list, tuple, dict,
        set), else ``ResultRefused``: the code in the call shapes its result's pickle.
        ``trusted_result=True`` unpickles any value, running what the pickle names in this
        process: only for calls that run no code you do not trust (see docs/FN.md)."""
        fn_calls.check_substrate(substrate)
        return await fn_calls.call(self._t, fn, args, kwargs or {}, image, timeout_s, trusted_result)

    async def run_code(self, language: Language, code: str, *, stdin: str = "",
                       image: str = DEFAULT_IMAGE, timeout_s: float = 10.0,
                       max_output_bytes: int | None = None,
                       substrate: str = "fn") -> CodeResult:
        """Run a python, bash, c or cpp program (compiled with gcc/g++ where the image has
        them, else ``NotSupported``) with ``stdin``; a time-out is ``result.timed_out``."""
        fn_calls.check_substrate(substrate)
        req = _validated(RunCodeRequest, language=language, code=code, stdin=stdin,
                         image=image, timeout_s=timeout_s,
                         **({} if max_output_bytes is None else {"max_output_bytes": max_output_bytes}))
        return await fn_calls.run_code(self._t, req)

    async def map(self, fn: Callable[..., V], items: Iterable[Any], *, concurrency: int = 16,
                  substrate: str = "fn", image: str = DEFAULT_IMAGE,
                  timeout_s: float = 60.0, return_exceptions: bool = False,
                  trusted_result: bool = False) -> builtins.list[Any]:
        """``[fn(item) for item in items]``, each in its own worker, ``concurrency`` at a
        time, in order. With ``return_exceptions`` a failed item is its typed error.
        Results are decoded as in ``call`` (``trusted_result``)."""
        fn_calls.check_substrate(substrate)
        return await fn_calls.map_calls(self._t, fn, items, concurrency, image, timeout_s,
                                        return_exceptions, trusted_result)


DSecClient = AsyncClient  # the former name, kept working
