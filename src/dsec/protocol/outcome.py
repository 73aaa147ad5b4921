"""The result of a call, as logged: a JSON ``value``, named ``bytes`` fields, and for the
output operations the order of the output (``chunks``); or the typed error it raised.

    {"value": {...} | [...] | null, "bytes": {"stdout": REF, ...}, "chunks": [[1, 12], [2, 5]]}
    {"error": {"code": "file_not_found", "message": "...", "details": {...}}}

``REF`` is ``{"size": n, "b64": "..."}`` inline, or ``{"size": n, "sha256": "..."}`` for bytes
kept in the blob area (see ``dsec.trajectory.log``). ``value`` is what the route answers, less
its bytes: an ExecResult without stdout/stderr, a FileEntry, a ProcessInfo, lists of those.
The codec is chosen by the result type the table of operations gives the step
(``dsec.protocol.ops``): ExecResult, bytes, None, or a model or list of models.
``chunks`` are runs of ``[fd, length]`` of the output as it came (1 stdout, 2 stderr), so a
fast-forwarded stream yields the output interleaved as it was the first time.

Shared by the SDK (which decodes inline outcomes it prefetched) and the server.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Iterator

from pydantic import TypeAdapter

from .errors import ERRORS, DSecError
from .models import ExecResult, b64
from .ops import BY_STEP

MAX_CHUNK_RUNS = 4096  # beyond this many runs, a stream's interleaving is not kept
REPLAY_CHUNK = 1 << 20  # largest output event a fast-forwarded stream yields


@dataclass
class Outcome:
    """A call's result before it is stored: JSON value plus raw bytes, or an error."""

    value: Any = None
    data: dict[str, bytes] = field(default_factory=dict)
    chunks: list[list[int]] | None = None
    error: dict[str, Any] | None = None


def encode(op: str, value: Any, chunks: list[list[int]] | None = None) -> Outcome:
    """What an edge call returned, as an Outcome."""
    result = BY_STEP[op].result
    if result is ExecResult:
        r: ExecResult = value
        return Outcome(r.model_dump(exclude={"stdout_b64", "stderr_b64"}),
                       {"stdout": r.stdout_bytes, "stderr": r.stderr_bytes}, chunks)
    if result is bytes:
        return Outcome(None, {"data": value})
    if result is None:
        return Outcome(None)
    return Outcome(_adapter(result).dump_python(value))


def encode_error(exc: DSecError) -> Outcome:
    return Outcome(error=exc.to_json()["error"])


def decode(op: str, outcome: dict[str, Any], load: Callable[[str], bytes]) -> Any:
    """The value an edge call returned (ExecResult with its output, bytes, FileEntry, ...),
    from a stored outcome; raises the logged error again. ``load`` fetches a blob by sha256."""
    if "error" in outcome:
        raise error_of(outcome)
    data = {name: ref_bytes(ref, load) for name, ref in (outcome.get("bytes") or {}).items()}
    value: Any = outcome.get("value")
    result = BY_STEP[op].result
    if result is ExecResult:
        return ExecResult(**value, stdout_b64=b64(data["stdout"]), stderr_b64=b64(data["stderr"]))
    if result is bytes:
        return data["data"]
    if result is None:
        return None
    return _adapter(result).validate_python(value)


@cache
def _adapter(result: Any) -> TypeAdapter[Any]:
    """Encodes and decodes a model or a list of models."""
    return TypeAdapter(result)


def error_of(outcome: dict[str, Any]) -> DSecError:
    err = outcome["error"]
    cls = ERRORS.get(err.get("code", ""), DSecError)
    return cls(err.get("message", "error"), **(err.get("details") or {}))


def ref_bytes(ref: dict[str, Any], load: Callable[[str], bytes]) -> bytes:
    return base64.b64decode(ref["b64"]) if "b64" in ref else load(ref["sha256"])


def inline(outcome: dict[str, Any]) -> bool:
    """Whether every byte field is stored inline (decodable without the blob area)."""
    return all("b64" in ref for ref in (outcome.get("bytes") or {}).values())


def output_chunks(result: ExecResult, chunks: list[list[int]] | None) -> Iterator[tuple[int, bytes]]:
    """(fd, data) of a logged output in the order it came; without an order, stdout then
    stderr. Runs are cut to at most REPLAY_CHUNK bytes."""
    streams = {1: result.stdout_bytes, 2: result.stderr_bytes}
    runs = chunks if chunks is not None else [[1, len(streams[1])], [2, len(streams[2])]]
    offsets = {1: 0, 2: 0}
    for fd, length in runs:
        start = offsets[fd]
        offsets[fd] += length
        for at in range(start, start + length, REPLAY_CHUNK):
            yield fd, streams[fd][at:min(at + REPLAY_CHUNK, start + length)]


class ChunkRuns:
    """Collects the ``chunks`` of a live output: consecutive output on one fd is one run."""

    def __init__(self) -> None:
        self.runs: list[list[int]] | None = []

    def add(self, fd: int, length: int) -> None:
        if self.runs is None or not length:
            return
        if self.runs and self.runs[-1][0] == fd:
            self.runs[-1][1] += length
        elif len(self.runs) < MAX_CHUNK_RUNS:
            self.runs.append([fd, length])
        else:
            self.runs = None  # too fragmented to be worth keeping
