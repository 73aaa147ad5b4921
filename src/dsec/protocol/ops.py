"""The table of operations on a sandbox: one entry per operation, and everything else derived
from it or checked against it.

An operation used to be spelled out by hand in a dozen places (SDK, route, edge, recorder,
cluster proxy, trajectory codecs); a forgotten one ran unlogged or failed only in cluster
mode. Here, as in Firecracker's single action enum between its API and its VMM, each
operation is one frozen ``Operation``:

- ``method``: the edge's method, called ``method(sandbox_id, *params)`` (``create`` and the fn
  calls take no sandbox id). ``Edge`` implements it; ``RecordedEdge`` (trajectory/recorder.py),
  ``RemoteEdge`` and ``EdgeActor`` (cluster/) are derived from this table.
- ``params``: name, type and default of each argument after the sandbox id. ``payload`` names
  the one carried as raw bytes in a trajectory step (file data, tar); an ``ExecRequest``
  parameter is logged as its fields, with its stdin as the payload.
- ``result``: the type of the value (for a stream, of its last event: output chunks come
  before it). The trajectory's outcome codec is chosen by this type.
- ``step``: the operation's name in a trajectory log (``exec``, ``read``, ...), or None for a
  lifecycle operation that is not a step (create, stop, ttl, network, pause). Two operations may
  share a step (``run`` and ``stream`` are one ``exec``: one result, two ways to receive it).
- ``http``: the route's method and path; ``sdk``: the SDK method that issues it
  (``Sandbox.run``, ``Process.signal``: the async class names, the sync facade has the same).

tests/unit/test_operations.py walks the table and fails when a layer lacks an operation or
disagrees on its signature or route. To add an operation: its entry here, its ``Edge`` method
(and the agent's side where needed), its route (api/app.py) and its SDK method (client/aio.py
and its blocking twin in client/sync.py); recording, fast-forward, replay and the cluster
proxy follow from the entry, and the unit test names whatever is still missing.

Pure data: imports nothing of dsec but the wire models.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any, Literal, TypeVar

from .build import ImageBuildRequest, ImageBuilt
from .fn import CodeResult, RunCodeRequest
from .models import (
    CreateRequest,
    ExecRequest,
    ExecResult,
    FileEntry,
    Network,
    ProcessInfo,
    PtyRequest,
    SandboxInfo,
    Snapshot,
)

C = TypeVar("C", bound=type)
REQUIRED = inspect.Parameter.empty
SANDBOX = "/v1/sandboxes/{sandbox_id}"


@dataclass(frozen=True)
class Param:
    """An argument of an operation: its name (the same in the edge method, the SDK's step
    request and the trajectory log), its type and its default."""

    name: str
    type: Any
    default: Any = REQUIRED


@dataclass(frozen=True)
class Operation:
    """One operation on a sandbox (its fields: see the module docstring)."""

    method: str
    params: tuple[Param, ...]
    result: Any
    http: tuple[str, str]
    step: str | None = None
    kind: Literal["call", "stream"] = "call"
    payload: str | None = None
    sdk: str | None = None
    on_sandbox: bool = True  # False: no sandbox id argument (create, fn calls)

    @cached_property
    def exec_param(self) -> str | None:
        """The parameter that is an ExecRequest (logged as its fields, with its stdin as the
        payload), if the operation has one."""
        return next((p.name for p in self.params if p.type is ExecRequest), None)

    @cached_property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def signature(self) -> inspect.Signature:
        """The edge method's signature: ``(self, sandbox_id, *params) -> result``, where a
        call is a coroutine function and a stream returns an async iterator of output events
        then its result."""
        first = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if self.on_sandbox:
            first.append(inspect.Parameter("sandbox_id", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                           annotation=str))
        rest = [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                  default=p.default, annotation=p.type) for p in self.params]
        returns = AsyncIterator[Any] if self.kind == "stream" else self.result
        return inspect.Signature(first + rest, return_annotation=returns)


def _op(method: str, params: tuple[Param, ...], result: Any, http: str, **fields: Any) -> Operation:
    verb, _, path = http.partition(" ")
    return Operation(method, params, result, (verb, path), **fields)


PATH = Param("path", str)
PROCESS = Param("process", str)
EXEC = Param("req", ExecRequest)

OPERATIONS: tuple[Operation, ...] = (
    # lifecycle: not trajectory steps
    _op("create", (Param("req", CreateRequest),), SandboxInfo, "POST /v1/sandboxes",
        sdk="Client.create", on_sandbox=False),
    _op("stop", (Param("state", str, "stopped"), Param("reason", str, "stopped by client")),
        None, f"DELETE {SANDBOX}", sdk="Sandbox.stop"),
    _op("set_ttl", (Param("ttl_s", int),), SandboxInfo, f"PUT {SANDBOX}/ttl", sdk="Sandbox.set_ttl"),
    _op("set_network", (Param("network", Network),), SandboxInfo, f"PUT {SANDBOX}/network",
        sdk="Sandbox.set_network"),
    _op("snapshot", (Param("mode", str, "filesystem"), Param("previous", str | None, None),
                     Param("ttl_s", int | None, None)),
        Snapshot, f"POST {SANDBOX}/snapshots",
        sdk="Sandbox.snapshot"),
    _op("rollback", (Param("snapshot", str),), SandboxInfo, f"POST {SANDBOX}/rollback",
        sdk="Sandbox.rollback"),
    _op("delete_snapshot", (Param("snapshot_id", str),), None, "DELETE /v1/snapshots/{snapshot_id}",
        sdk="Client.delete_snapshot", on_sandbox=False),
    _op("pause", (), SandboxInfo, f"POST {SANDBOX}/pause", sdk="Sandbox.pause"),
    _op("resume", (), SandboxInfo, f"POST {SANDBOX}/resume", sdk="Sandbox.resume"),
    # commands
    _op("run", (EXEC,), ExecResult, f"POST {SANDBOX}/exec", step="exec", sdk="Sandbox.run"),
    _op("stream", (EXEC,), ExecResult, f"POST {SANDBOX}/exec/stream", step="exec",
        kind="stream", sdk="Sandbox.stream"),
    _op("start_process", (EXEC,), ProcessInfo, f"POST {SANDBOX}/processes", step="start",
        sdk="Sandbox.start"),
    _op("processes", (), list[ProcessInfo], f"GET {SANDBOX}/processes", step="processes",
        sdk="Sandbox.processes"),
    _op("attach", (PROCESS,), ExecResult, f"GET {SANDBOX}/processes/{{process}}/output",
        step="output", kind="stream", sdk="Process.stream"),
    _op("signal", (PROCESS, Param("signal", int)), None,
        f"POST {SANDBOX}/processes/{{process}}/signal", step="signal", sdk="Process.signal"),
    _op("send_stdin", (PROCESS, Param("data", bytes)), None,
        f"POST {SANDBOX}/processes/{{process}}/stdin", step="stdin", payload="data",
        sdk="Process.send_stdin"),
    _op("close_stdin", (PROCESS,), None, f"DELETE {SANDBOX}/processes/{{process}}/stdin",
        step="close_stdin", sdk="Process.close_stdin"),
    # terminals: background processes on a pseudo-terminal (attach, signal and stdin as above)
    _op("start_pty", (Param("req", PtyRequest),), ProcessInfo, f"POST {SANDBOX}/ptys",
        step="pty", sdk="Sandbox.pty"),
    _op("resize_pty", (PROCESS, Param("cols", int), Param("rows", int)), None,
        f"POST {SANDBOX}/processes/{{process}}/resize", step="resize", sdk="Pty.resize"),
    # ports: an HTTP request's bytes to a port in the sandbox, its answer's bytes streamed back
    # (not a trajectory step: a port's traffic is not the agent's actions; control/ports.py).
    # A WebSocket is the same stream opened with a ``session`` name, and ``port_send`` writes
    # the client's bytes into it while it lasts (control/port_ws.py, edge/ports.py)
    _op("proxy_port", (Param("port", int), Param("request", bytes),
                       Param("session", str | None, None)), bytes,
        f"GET {SANDBOX}/ports/{{port}}/{{path:path}}", kind="stream", sdk="Sandbox.url"),
    _op("port_send", (Param("session", str), Param("data", bytes)), None,
        f"WEBSOCKET {SANDBOX}/ports/{{port}}/{{path:path}}", sdk="Sandbox.url"),
    # files
    _op("read_file", (PATH,), bytes, f"GET {SANDBOX}/files", step="read", sdk="Sandbox.read_file"),
    _op("write_file", (PATH, Param("data", bytes), Param("mode", int, 0o644),
                       Param("append", bool, False)), None, f"PUT {SANDBOX}/files",
        step="write", payload="data", sdk="Sandbox.write_file"),
    _op("list_dir", (PATH,), list[FileEntry], f"GET {SANDBOX}/dirs", step="list",
        sdk="Sandbox.list_files"),
    _op("stat", (PATH,), FileEntry, f"GET {SANDBOX}/stat", step="stat", sdk="Sandbox.stat"),
    _op("remove", (PATH, Param("recursive", bool, False)), None, f"DELETE {SANDBOX}/files",
        step="remove", sdk="Sandbox.remove"),
    _op("mkdir", (PATH, Param("parents", bool, False)), None, f"POST {SANDBOX}/dirs",
        step="mkdir", sdk="Sandbox.mkdir"),
    _op("upload_tar", (PATH, Param("tar", bytes)), None, f"PUT {SANDBOX}/archive",
        step="upload", payload="tar", sdk="Sandbox.upload"),
    _op("download_tar", (PATH,), bytes, f"GET {SANDBOX}/archive", step="download",
        sdk="Sandbox.download"),
    # fn: a call in a fresh worker, no sandbox (placed and admitted like a create)
    _op("call_fn", (Param("image", str), Param("payload", bytes), Param("timeout_s", float)), bytes,
        "POST /v1/call", sdk="Client.call", on_sandbox=False),
    _op("run_code", (Param("req", RunCodeRequest),), CodeResult, "POST /v1/run_code",
        sdk="Client.run_code", on_sandbox=False),
    # images: a Dockerfile build on an edge (its steps in sandboxes there), log lines streamed
    # before its result; the route takes the request and the context tar as multipart parts
    _op("build_image", (Param("req", ImageBuildRequest), Param("context", bytes)), ImageBuilt,
        "POST /v1/images/build", kind="stream", sdk="Client.build_image", on_sandbox=False),
)

BY_METHOD: dict[str, Operation] = {op.method: op for op in OPERATIONS}


def _steps() -> dict[str, Operation]:
    """Each step name's operation; where two share one, the stream (replaying a step
    collects its output in the order it came)."""
    steps: dict[str, Operation] = {}
    for op in OPERATIONS:
        if op.step is not None and (op.step not in steps or op.kind == "stream"):
            steps[op.step] = op
    return steps


BY_STEP: dict[str, Operation] = _steps()
STEP_NAMES = frozenset(BY_STEP)
STREAM_STEPS = frozenset(name for name, op in BY_STEP.items() if op.kind == "stream")


def derive_operations(make: Callable[[Operation], Callable[..., Any]]) -> Callable[[C], C]:
    """Class decorator: one method per operation of the table that the class does not define
    itself, ``make(op)``, named and signed as the table says (so ``inspect`` and the unit
    test see the operation's signature). How a proxy of the edge serves every operation."""
    def decorate(cls: C) -> C:
        for op in OPERATIONS:
            if op.method in vars(cls):
                continue
            method = make(op)
            method.__name__ = op.method
            method.__qualname__ = f"{cls.__qualname__}.{op.method}"
            method.__signature__ = op.signature()  # type: ignore[attr-defined]
            setattr(cls, op.method, method)
        return cls
    return decorate


def bind(op: Operation, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call of ``op`` after the sandbox id, by name, defaults filled in;
    TypeError as for a Python call when they do not fit. A call that gives every argument
    by position (as the routes do) is bound without ``inspect``, which costs a logged step
    more than its digest."""
    names = op.param_names
    if not kwargs and len(args) == len(names):
        return dict(zip(names, args))
    bound = _arguments(op).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@cache
def _arguments(op: Operation) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=p.default) for p in op.params])
