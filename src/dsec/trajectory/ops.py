"""Executing a logged request against an edge: the one place that maps an operation name to
the edge call that performs it. Used for live calls, replays and forks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from ..agent.client import Output
from ..client.models import ExecResult, b64
from .digest import STREAM_OPS, StepRequest, exec_model
from .outcome import ChunkRuns

if TYPE_CHECKING:
    from ..edge.edge import Edge


def events(edge: Edge, sandbox_id: str, request: StepRequest) -> AsyncIterator[Output | ExecResult]:
    """Output events then the ExecResult (without output) of ``exec`` or ``output``."""
    if request.op == "exec":
        return edge.stream(sandbox_id, exec_model(request))
    if request.op == "output":
        return edge.attach(sandbox_id, request.params["process"])
    raise ValueError(f"{request.op!r} is not an output operation")


async def collect(stream: AsyncIterator[Output | ExecResult],
                  on_event: Callable[[Output | ExecResult], None] | None = None,
                  ) -> tuple[ExecResult, list[list[int]] | None]:
    """The whole result of an output stream, and the order its chunks came in. ``on_event``
    sees every event as it comes."""
    out: dict[int, list[bytes]] = {1: [], 2: []}
    runs = ChunkRuns()
    async for event in stream:
        if on_event is not None:
            on_event(event)
        if isinstance(event, Output):
            out[event.fd].append(event.data)
            runs.add(event.fd, len(event.data))
        else:
            return event.model_copy(update={"stdout_b64": b64(b"".join(out[1])),
                                            "stderr_b64": b64(b"".join(out[2]))}), runs.runs
    raise AssertionError("an output stream ends with a result")


async def call(edge: Edge, sandbox_id: str, request: StepRequest) -> tuple[Any, list[list[int]] | None]:
    """Run ``request`` in the sandbox: (what the edge call returned, output order if any)."""
    op, p, payload = request.op, request.params, request.payload
    if op in STREAM_OPS:
        return await collect(events(edge, sandbox_id, request))
    if op == "start":
        return await edge.start_process(sandbox_id, exec_model(request)), None
    if op == "processes":
        return await edge.processes(sandbox_id), None
    if op == "signal":
        await edge.signal(sandbox_id, p["process"], p["signal"])
        return None, None
    if op == "read":
        return await edge.read_file(sandbox_id, p["path"]), None
    if op == "write":
        await edge.write_file(sandbox_id, p["path"], payload or b"", p["mode"], p["append"])
        return None, None
    if op == "remove":
        await edge.remove(sandbox_id, p["path"], p["recursive"])
        return None, None
    if op == "list":
        return await edge.list_dir(sandbox_id, p["path"]), None
    if op == "mkdir":
        await edge.mkdir(sandbox_id, p["path"], p["parents"])
        return None, None
    if op == "stat":
        return await edge.stat(sandbox_id, p["path"]), None
    if op == "download":
        return await edge.download_tar(sandbox_id, p["path"]), None
    if op == "upload":
        await edge.upload_tar(sandbox_id, p["path"], payload or b"")
        return None, None
    raise ValueError(f"unknown operation {op!r}")
