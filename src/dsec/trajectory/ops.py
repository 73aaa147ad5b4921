"""Executing a logged request against an edge: the step's operation in the table of
operations (``dsec.protocol.ops``) names the edge method, and the request gives its
arguments. Used for live calls, replays and forks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from ..agent.client import Output
from ..protocol.digest import StepRequest, call_arguments
from ..protocol.models import ExecResult, b64
from ..protocol.ops import BY_STEP, Operation
from ..protocol.outcome import ChunkRuns

if TYPE_CHECKING:
    from ..edge.edge import Edge


def operation(request: StepRequest) -> Operation:
    op = BY_STEP.get(request.op)
    if op is None:
        raise ValueError(f"unknown operation {request.op!r}")
    return op


def events(edge: Edge, sandbox_id: str, request: StepRequest) -> AsyncIterator[Output | ExecResult]:
    """Output events then the ExecResult (without output) of ``exec`` or ``output``."""
    op = operation(request)
    if op.kind != "stream":
        raise ValueError(f"{request.op!r} is not an output operation")
    stream: AsyncIterator[Output | ExecResult] = getattr(edge, op.method)(
        sandbox_id, **call_arguments(op, request))
    return stream


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
    op = operation(request)
    if op.kind == "stream":
        return await collect(events(edge, sandbox_id, request))
    return await getattr(edge, op.method)(sandbox_id, **call_arguments(op, request)), None
