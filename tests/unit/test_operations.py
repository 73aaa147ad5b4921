"""Every layer against the table of operations (``dsec.protocol.ops``): the embedded edge, the
recorded edge, the cluster proxy and actor, the HTTP routes, the trajectory step codecs and
the SDK, async and blocking. A layer that lacks an operation, or disagrees on its signature,
route or result, fails here, in seconds and without root."""

from __future__ import annotations

import base64
import collections.abc
import inspect
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from starlette.routing import WebSocketRoute

import dsec
from dsec.api.app import create_app
from dsec.client import aio, sync
from dsec.client.projects import Projects, SyncProjects
from dsec.cluster.edge_actor import CALLS, STREAMS
from dsec.cluster.remote import RemoteEdge
from dsec.config import Settings
from dsec.control.directory import LocalEdges
from dsec.control.gc import GarbageCollector
from dsec.control.plane import ControlPlane
from dsec.control.projects import Projects as ProjectAccess
from dsec.control.routing import Router
from dsec.edge.edge import Edge
from dsec.protocol.digest import OPS, STREAM_OPS, call_arguments, step_request
from dsec.protocol.models import (
    ExecRequest,
    ExecResult,
    FileEntry,
    ProcessInfo,
    PtyRequest,
)
from dsec.protocol.ops import BY_STEP, OPERATIONS, REQUIRED, Operation, bind
from dsec.protocol.outcome import decode, encode
from dsec.store.lease import Leases
from dsec.store.sqlite import StateStore
from dsec.trajectory.recorder import RecordedEdge

EDGES = [Edge, RecordedEdge, RemoteEdge]
ASYNC = {"Client": aio.AsyncClient, "Sandbox": aio.Sandbox, "Process": aio.Process,
         "Pty": aio.Pty}
SYNC = {"Client": sync.Client, "Sandbox": sync.Sandbox, "Process": sync.Process, "Pty": sync.Pty}
TWINS = [(aio.AsyncClient, sync.Client), (aio.Sandbox, sync.Sandbox), (aio.Process, sync.Process),
         (aio.Pty, sync.Pty),
         (aio.Session, sync.Session),
         (aio.OutputStream, sync.OutputStream),
         (aio.Replay, sync.Replay), (Projects, SyncProjects)]
# the async name and its blocking twin's, where they differ
RENAMED = {"aclose": "close"}


def _params(fn: Any, evaluated: bool = True) -> list[tuple[str, Any, Any, Any]]:
    """(name, kind, default, type) of each parameter after ``self``, types evaluated (else
    as spelled)."""
    sig = inspect.signature(fn, eval_str=evaluated)
    return [(p.name, p.kind, p.default, p.annotation) for p in list(sig.parameters.values())[1:]]


def _returns(fn: Any) -> Any:
    return inspect.signature(fn, eval_str=True).return_annotation


@pytest.mark.parametrize("edge", EDGES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: op.method)
def test_every_edge_serves_every_operation_with_its_signature(edge: type, op: Operation) -> None:
    method = getattr(edge, op.method, None)
    assert method is not None, f"{edge.__name__} lacks the operation {op.method}"
    assert _params(method) == _params(_signed(op)), \
        f"{edge.__name__}.{op.method} disagrees with the table"
    returns = _returns(method)
    if op.kind == "call":
        assert inspect.iscoroutinefunction(method), f"{edge.__name__}.{op.method} is not async"
        assert returns == op.result, f"{edge.__name__}.{op.method} returns {returns}"
    else:
        assert typing.get_origin(returns) is collections.abc.AsyncIterator, op.method
        (event,) = typing.get_args(returns)
        assert event is Any or event is op.result or op.result in typing.get_args(event), op.method


def _signed(op: Operation) -> Any:
    """A function carrying the table's signature, for ``_params``."""
    def fn() -> None: ...
    fn.__signature__ = op.signature()  # type: ignore[attr-defined]
    return fn


def test_the_cluster_actor_serves_exactly_the_table() -> None:
    assert CALLS == {op.method for op in OPERATIONS if op.kind == "call"}
    assert STREAMS == {op.method for op in OPERATIONS if op.kind == "stream"}
    assert CALLS | STREAMS == {op.method for op in OPERATIONS}


# the edge's own, not operations; commit_layer serves Dockerfile builds on the command line's
# builder edge (edge/dockerbuild.py): no API route or remote call (yet)
EDGE_LIFECYCLE = {"start", "close", "recover", "reap", "commit_layer"}


def test_every_operation_of_the_edge_is_in_the_table() -> None:
    """An operation added to the edge but not to the table would be missing from the recorded
    edge (running unlogged) and from the cluster proxy."""
    served = {name for name, fn in inspect.getmembers(Edge, inspect.isfunction)
              if not name.startswith("_")
              and (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn))}
    assert served - EDGE_LIFECYCLE == {op.method for op in OPERATIONS}


def test_recorded_edge_forwards_nothing_outside_the_table() -> None:
    assert not hasattr(RecordedEdge, "__getattr__")
    assert not hasattr(RemoteEdge, "__getattr__")


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """(method, path) -> endpoint of the HTTP API, built on an empty router and a throwaway
    state store."""
    state = Path(tmp_path_factory.mktemp("state"))
    store, registry = StateStore(state / "state.db"), CollectorRegistry()
    projects = ProjectAccess(store, registry)
    gc = GarbageCollector(Leases(store.url), [], [], 300, registry)
    app = create_app(ControlPlane(Settings(state_dir=state), store, registry, projects,
                                  Router(LocalEdges([]), projects), gc))
    return dict(_endpoints(app.routes))


def _endpoints(routes: list[Any]) -> Any:
    """((method, path), endpoint) of every route, also of routers included without a prefix
    (FastAPI keeps those as one entry holding the router)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _endpoints(included.routes)
        for verb in getattr(route, "methods", None) or ():
            yield (verb, route.path), route.endpoint
        if isinstance(route, WebSocketRoute):  # the table spells it "WEBSOCKET path"
            yield ("WEBSOCKET", route.path), route.endpoint


def _names(code: types.CodeType) -> set[str]:
    """The attribute and global names a function's code (lambdas in it included) uses."""
    inner = (c for c in code.co_consts if isinstance(c, types.CodeType))
    return set(code.co_names).union(*map(_names, inner))


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: op.method)
def test_every_operation_has_its_route(op: Operation, routes: dict[tuple[str, str], Any]) -> None:
    endpoint = routes.get(op.http)
    assert endpoint is not None, f"no route {op.http[0]} {op.http[1]} for {op.method}"
    assert op.method in _names(endpoint.__code__), \
        f"the route {op.http} does not call the edge's {op.method}"


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: op.method)
def test_the_sdk_issues_every_operation_async_and_blocking(op: Operation) -> None:
    assert op.sdk is not None, f"{op.method}: which SDK method issues it?"
    owner, name = op.sdk.split(".")
    assert callable(getattr(ASYNC[owner], name, None)), f"async {op.sdk} is missing"
    assert callable(getattr(SYNC[owner], name, None)), f"blocking {op.sdk} is missing"


def test_trajectory_steps_are_the_table_s() -> None:
    assert OPS == {op.step for op in OPERATIONS if op.step is not None}
    assert STREAM_OPS == {op.step for op in OPERATIONS if op.kind == "stream" and op.step}
    for op in OPERATIONS:  # operations sharing a step take the same arguments
        if op.step is not None:
            assert BY_STEP[op.step].params == op.params
            assert BY_STEP[op.step].result == op.result


SAMPLES: dict[Any, Any] = {
    ExecRequest: ExecRequest(command=["echo", "hi"], env={"A": "1"}, stdin_b64="aGk="),
    PtyRequest: PtyRequest(command="bash", cols=100, rows=30, env={"TERM": "vt100"}),
    str: "/work/a.txt", bytes: b"\x00data", int: 7, bool: True,
}
RESULTS: dict[Any, Any] = {
    ExecResult: ExecResult(exit_code=3, stdout_b64="b3V0", stderr_b64="ZXJy", duration_ms=4),
    bytes: b"\xffbytes", None: None,
    FileEntry: FileEntry(name="a", path="/a", type="file", size=1, mode=0o644, mtime=1.5),
    list[FileEntry]: [FileEntry(name="d", path="/d", type="dir", size=0, mode=0o755, mtime=2.0)],
    ProcessInfo: ProcessInfo(id="p1", pid=9, command="sleep 1", running=True),
    list[ProcessInfo]: [ProcessInfo(id="p1", pid=9, command="x", running=False, exit_code=0)],
}


@pytest.mark.parametrize("op", [op for op in OPERATIONS if op.step], ids=lambda op: op.method)
def test_a_step_round_trips_through_the_log(op: Operation) -> None:
    """What a call's arguments are logged as gives the same call back, and its result's
    outcome decodes to the result."""
    arguments = {p.name: SAMPLES[p.type] for p in op.params}
    request = step_request(op, arguments)
    assert call_arguments(op, request) == arguments
    assert step_request(op, call_arguments(op, request)).digest == request.digest
    outcome = encode(op.step, RESULTS[op.result], [[1, 3]] if op.result is ExecResult else None)
    stored = {"value": outcome.value,
              "bytes": {k: {"size": len(v), "b64": base64.b64encode(v).decode()}
                        for k, v in outcome.data.items()}}
    assert decode(op.step, stored, lambda sha: b"") == RESULTS[op.result]


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: op.method)
def test_bind_is_a_python_call_s_binding(op: Operation) -> None:
    """Every argument by position (the routes' way, bound without ``inspect``), by name, or
    with defaults left out: the same arguments as the edge method's own signature binds; and
    a call that does not fit is the TypeError a Python call raises."""
    sig = op.signature()
    values = tuple(object() for _ in op.params)
    by_name = {p.name: v for p, v in zip(op.params, values)}
    required = tuple(v for p, v in zip(op.params, values) if p.default is REQUIRED)

    def python(*args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = sig.bind("self", *(("sb",) if op.on_sandbox else ()), *args, **kwargs)
        bound.apply_defaults()
        return {k: v for k, v in bound.arguments.items() if k not in ("self", "sandbox_id")}

    for args, kwargs in ((values, {}), ((), by_name), (required, {}), (values[:1], {
            k: v for k, v in list(by_name.items())[1:]})):
        assert bind(op, args, kwargs) == python(*args, **kwargs)
        assert list(bind(op, args, kwargs)) == [p.name for p in op.params]
    for args, kwargs in ((values + (object(),), {}), ((), {**by_name, "nope": 1})):
        with pytest.raises(TypeError):
            bind(op, args, kwargs)
        with pytest.raises(TypeError):
            python(*args, **kwargs)


@pytest.mark.parametrize(("async_cls", "sync_cls"), TWINS, ids=lambda c: c.__name__)
def test_sync_and_async_twins_have_the_same_methods_and_signatures(async_cls: type,
                                                                    sync_cls: type) -> None:
    def public(cls: type) -> dict[str, Any]:
        """Methods and properties, and the attributes the class declares."""
        declared = {n: None for n in vars(cls).get("__annotations__", {})}
        members = {n: v for n, v in inspect.getmembers(cls) if not n.startswith("_")}
        return {RENAMED.get(n, n): v for n, v in {**declared, **members}.items()}

    a, s = public(async_cls), public(sync_cls)
    assert sorted(a) == sorted(s), f"{async_cls.__name__} and {sync_cls.__name__} differ"
    for name, member in a.items():
        twin = s[name]
        if member is None or isinstance(member, property):  # an attribute: read-only is fine
            assert twin is None or isinstance(twin, property), name
            continue
        assert not inspect.iscoroutinefunction(twin), f"blocking {name} is async"
        assert _params(member, False) == _params(twin, False), \
            f"{sync_cls.__name__}.{name}'s signature differs"
        assert twin.__doc__, f"{sync_cls.__name__}.{name} has no docstring"


def test_the_sdk_names() -> None:
    assert dsec.DSecClient is dsec.AsyncClient is aio.AsyncClient  # the former name still works
    assert dsec.Client is sync.Client
    for name in ("AsyncClient", "DSecClient", "Client", "AsyncSandbox", "Sandbox", "Session",
                 "AsyncSession", "FileNotFound", "CommandTimeout", "DSecError"):
        assert name in dsec.__all__
