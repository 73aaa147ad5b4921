"""Logged outcomes: every operation's result, stored (as the trajectory log stores it: JSON, with
bytes inline or in the blob area) and decoded again, is what the edge call returned; a logged
error is raised again as its own class; output keeps the order it came in."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.protocol import errors
from dsec.protocol.digest import OPS
from dsec.protocol.errors import ERRORS, DSecError
from dsec.protocol.models import ExecResult, FileEntry, ProcessInfo
from dsec.protocol.outcome import (
    MAX_CHUNK_RUNS,
    REPLAY_CHUNK,
    ChunkRuns,
    decode,
    encode,
    encode_error,
    error_of,
    inline,
    output_chunks,
)
from dsec.store.blobs import BlobStore
from dsec.trajectory.log import INLINE_MAX, TrajectoryLog


def result(stdout: bytes, stderr: bytes, **fields: Any) -> ExecResult:
    return ExecResult(exit_code=fields.pop("exit_code", 0), stdout_b64=base64.b64encode(stdout).decode(),
                      stderr_b64=base64.b64encode(stderr).decode(), **fields)


ENTRY = FileEntry(name="a.txt", path="/work/a.txt", type="file", size=3, mode=0o644, mtime=1700000000.5)
DIR = FileEntry(name="d", path="/work/d", type="dir", size=4096, mode=0o755, mtime=1.0)
PROCESS = ProcessInfo(id="p1", pid=42, command="sleep 9", running=False, exit_code=-1, signal=9)

# What each operation's edge call returns (None: nothing).
RETURNS: dict[str, Any] = {
    "exec": result(b"out\n", b"err\n", exit_code=3, stdout_truncated=True, duration_ms=12),
    "output": result(b"", b"late\n", timed_out=True, oom_killed=True, signal=9, exit_code=137),
    "start": PROCESS,
    "processes": [PROCESS, ProcessInfo(id="p2", pid=43, command="true", running=True)],
    "signal": None,
    "stdin": None,
    "close_stdin": None,
    "pty": ProcessInfo(id="p3", pid=44, command="bash", running=True, pty=True),
    "resize": None,
    "read": b"\x00\xffbinary",
    "write": None,
    "remove": None,
    "list": [ENTRY, DIR],
    "mkdir": None,
    "stat": ENTRY,
    "download": b"tar bytes" * 10,
    "upload": None,
}


@pytest.fixture
def log(tmp_path: Path) -> Iterator[TrajectoryLog]:
    log = TrajectoryLog(tmp_path / "state.db", BlobStore(tmp_path / "blobs"), owner="unit")
    yield log
    log.close()


def stored(log: TrajectoryLog, op: str, value: Any, chunks: list[list[int]] | None = None) -> dict[str, Any]:
    """The outcome as the log's row holds it, through its JSON text."""
    return json.loads(json.dumps(log.stored_outcome(encode(op, value, chunks))))


def test_every_operation_is_covered_here() -> None:
    assert set(RETURNS) == set(OPS)


@pytest.mark.parametrize("op", sorted(RETURNS))
def test_every_operation_round_trips(log: TrajectoryLog, op: str) -> None:
    outcome = stored(log, op, RETURNS[op])
    assert decode(op, outcome, log.load) == RETURNS[op]
    assert inline(outcome)  # all small: nothing in the blob area


def test_the_value_is_the_result_less_its_bytes(log: TrajectoryLog) -> None:
    outcome = stored(log, "exec", RETURNS["exec"])
    assert "stdout_b64" not in outcome["value"] and outcome["value"]["exit_code"] == 3
    assert outcome["bytes"] == {"stdout": {"size": 4, "b64": base64.b64encode(b"out\n").decode()},
                                "stderr": {"size": 4, "b64": base64.b64encode(b"err\n").decode()}}
    assert stored(log, "stat", ENTRY)["value"] == {"name": "a.txt", "path": "/work/a.txt", "type": "file",
                                                   "size": 3, "mode": 0o644, "mtime": 1700000000.5}
    assert stored(log, "mkdir", None) == {"value": None, "bytes": {}}


def test_bytes_above_the_inline_limit_go_to_the_blob_area(log: TrajectoryLog, tmp_path: Path) -> None:
    small, large = b"s" * INLINE_MAX, bytes(range(256)) * (INLINE_MAX // 256 + 1)
    outcome = stored(log, "exec", result(small, large))
    digest = hashlib.sha256(large).hexdigest()
    assert outcome["bytes"]["stdout"] == {"size": INLINE_MAX, "b64": base64.b64encode(small).decode()}
    assert outcome["bytes"]["stderr"] == {"size": len(large), "sha256": digest}
    assert (tmp_path / "blobs" / "sha256" / digest[:2] / digest).read_bytes() == large
    assert not inline(outcome)
    decoded = decode("exec", outcome, log.load)
    assert (decoded.stdout_bytes, decoded.stderr_bytes) == (small, large)

    read = stored(log, "read", large)
    assert read["bytes"]["data"]["sha256"] == digest
    assert decode("read", read, log.load) == large


def test_a_missing_blob_is_a_typed_error(log: TrajectoryLog) -> None:
    outcome = {"value": None, "bytes": {"data": {"size": 1, "sha256": "0" * 64}}}
    with pytest.raises(DSecError, match="missing"):
        decode("read", outcome, log.load)


def _error_classes() -> set[type[DSecError]]:
    """Every error class the errors module defines, found by walking the class tree."""
    found, pending = set(), [DSecError]
    while pending:
        cls = pending.pop()
        if cls.__module__ == errors.__name__:
            found.add(cls)
        pending += cls.__subclasses__()
    return found


def test_every_error_class_has_its_code() -> None:
    assert set(ERRORS.values()) == _error_classes()
    assert len({cls.code for cls in _error_classes()}) == len(_error_classes())


@pytest.mark.parametrize("cls", sorted(_error_classes(), key=lambda c: c.code), ids=lambda c: c.__name__)
def test_every_error_is_raised_again_as_its_own_class(log: TrajectoryLog, cls: type[DSecError]) -> None:
    exc = cls("it went wrong: é", path="/work/x", limit=3, nested={"a": [1, 2]})
    outcome = json.loads(json.dumps(log.stored_outcome(encode_error(exc))))
    assert outcome == {"error": {"code": cls.code, "message": "it went wrong: é",
                                 "details": {"path": "/work/x", "limit": 3, "nested": {"a": [1, 2]}}}}
    again = error_of(outcome)
    assert type(again) is cls
    assert (again.message, again.details, again.status) == (exc.message, exc.details, cls.status)
    with pytest.raises(cls) as raised:
        decode("read", outcome, log.load)
    assert type(raised.value) is cls


def test_an_unknown_error_code_is_the_base_error() -> None:
    again = error_of({"error": {"code": "from_a_newer_server", "message": "m"}})
    assert type(again) is DSecError and again.message == "m" and again.details == {}


def test_chunk_runs_merge_consecutive_output_of_one_fd() -> None:
    runs = ChunkRuns()
    for fd, length in [(1, 3), (1, 2), (2, 4), (2, 0), (1, 1), (1, 0), (2, 5)]:
        runs.add(fd, length)
    assert runs.runs == [[1, 5], [2, 4], [1, 1], [2, 5]]


def test_chunk_runs_give_up_beyond_the_limit() -> None:
    runs = ChunkRuns()
    for i in range(MAX_CHUNK_RUNS):
        runs.add(1 + i % 2, 1)
    assert runs.runs is not None and len(runs.runs) == MAX_CHUNK_RUNS
    runs.add(1 + MAX_CHUNK_RUNS % 2, 1)
    assert runs.runs is None
    runs.add(1, 1)
    assert runs.runs is None


def test_output_comes_back_interleaved_as_it_came(log: TrajectoryLog) -> None:
    # stdout "ab" "cd", stderr "XY" written as: a b | X | c d | Y
    live = [(1, b"ab"), (2, b"X"), (1, b"cd"), (2, b"Y")]
    runs = ChunkRuns()
    for fd, data in live:
        runs.add(fd, len(data))
    outcome = stored(log, "exec", result(b"abcd", b"XY"), runs.runs)
    assert outcome["chunks"] == [[1, 2], [2, 1], [1, 2], [2, 1]]
    decoded = decode("exec", outcome, log.load)
    assert list(output_chunks(decoded, outcome["chunks"])) == live


def test_output_without_an_order_is_stdout_then_stderr() -> None:
    assert list(output_chunks(result(b"out", b"err"), None)) == [(1, b"out"), (2, b"err")]


def test_long_runs_are_cut_to_the_replay_chunk() -> None:
    stdout = bytes(range(256)) * (REPLAY_CHUNK // 256 * 2 + 1)  # two chunks and 256 bytes
    chunks = list(output_chunks(result(stdout, b"e"), [[1, len(stdout)], [2, 1]]))
    assert [(fd, len(data)) for fd, data in chunks] == [(1, REPLAY_CHUNK), (1, REPLAY_CHUNK), (1, 256), (2, 1)]
    assert b"".join(data for fd, data in chunks if fd == 1) == stdout
