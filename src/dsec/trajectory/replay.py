"""Deterministic replay: re-execute logged calls into a sandbox, one at a time in step order,
and say for each step whether its result is the one logged, and if not, what differs.

Results are compared on what a deterministic sandbox reproduces: exit code, signal, output
bytes, truncation, timeout and OOM flags, file contents, directory entries, process ids, and
the error (code and message) of a call that failed. Timings are not compared, nor file
mtimes, nor the pids of background processes; an archive is compared member by member
(names, types, modes, contents), not byte for byte (tar headers carry mtimes).
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from typing import TYPE_CHECKING, Any

from ..protocol.errors import DSecError
from ..protocol.models import ExecResult, FileEntry, ProcessInfo, StepDiff
from ..protocol.ops import BY_STEP
from ..protocol.outcome import decode
from . import ops

if TYPE_CHECKING:
    from ..edge.edge import Edge
    from .log import StepRow, TrajectoryLog

SHOWN_BYTES = 512  # of a differing output, how much a report shows


async def replay_rows(log: TrajectoryLog, edge: Edge, sandbox_id: str,
                      rows: list[StepRow]) -> list[StepDiff]:
    diffs = []
    for row in rows:
        request = log.request_of(row)
        replayed: Any
        try:
            replayed, _ = await ops.call(edge, sandbox_id, request)
        except DSecError as exc:
            replayed = exc
        if row.outcome is None:
            logged: Any = None  # interrupted: nothing was logged
        else:
            try:
                logged = decode(row.op, row.outcome, log.load)
            except DSecError as exc:
                logged = exc
        diffs.append(compare(row.step, row.op, logged, replayed))
    return diffs


def compare(step: int, op: str, logged: Any, replayed: Any) -> StepDiff:
    a, b = project(op, logged), project(op, replayed)
    fields = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    return StepDiff(step=step, op=op, same=not fields, fields=fields,
                    logged={k: _shown(a.get(k)) for k in fields},
                    replayed={k: _shown(b.get(k)) for k in fields})


def project(op: str, value: Any) -> dict[str, Any]:
    """The comparable part of a call's result."""
    if value is None and BY_STEP[op].result is not None:
        return {"logged": "no result (interrupted)"}
    if isinstance(value, DSecError):
        return {"error": value.code, "message": value.message}
    if isinstance(value, ExecResult):
        return {"exit_code": value.exit_code, "signal": value.signal,
                "stdout": value.stdout_bytes, "stderr": value.stderr_bytes,
                "stdout_truncated": value.stdout_truncated,
                "stderr_truncated": value.stderr_truncated,
                "timed_out": value.timed_out, "oom_killed": value.oom_killed}
    if op == "read":
        return {"data": value}
    if op == "download":
        return {"archive": _members(value)}
    if op == "list":
        return {"entries": [_entry(e) for e in value]}
    if op == "stat":
        return {"entry": _entry(value)}
    if op == "start":
        p: ProcessInfo = value
        return {"process": p.id, "command": p.command}
    if op == "processes":
        return {"processes": [(p.id, p.command) for p in value]}
    return {}


def _entry(e: FileEntry) -> tuple[Any, ...]:
    return (e.name, e.path, e.type, e.mode, e.size if e.type == "file" else None)


def _members(tar: bytes) -> list[tuple[Any, ...]] | str:
    """What a sandbox-made archive holds, compared by content hash. Read as a plain tar only
    (never decompressed) and hashed in chunks up to the archive's own size, so a forged sparse
    member cannot make the server expand terabytes."""
    try:
        with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as archive:
            members = []
            for m in archive:
                if m.size > len(tar):
                    return f"unreadable archive: {m.name!r} claims {m.size} bytes"
                digest = hashlib.sha256()
                data = archive.extractfile(m) if m.isfile() else None
                while data is not None and (chunk := data.read(1 << 20)):
                    digest.update(chunk)
                members.append((m.name, m.type, m.mode, m.linkname, digest.hexdigest()))
            return members
    except (tarfile.TarError, EOFError, ValueError, OverflowError) as exc:
        return f"unreadable archive: {exc}"


def _shown(value: Any) -> Any:
    """A differing value as a report shows it: bytes as (the start of) their text."""
    if isinstance(value, bytes):
        text = value[:SHOWN_BYTES].decode("utf-8", errors="replace")
        return {"size": len(value), "text": text, "sha256": hashlib.sha256(value).hexdigest()}
    if isinstance(value, tuple):
        return list(value)
    return value
