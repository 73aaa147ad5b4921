"""The durable trajectory log: tables in the state store's database (SQLite or PostgreSQL),
bytes above ``INLINE_MAX`` in its blob area.

- ``trajectories``: one row per trajectory: its current generation and sandbox, and the
  create request as the client sent it (a fork starts the same sandbox again).
- ``trajectory_generations``: one row per sandbox the trajectory ran in.
- ``trajectory_steps``: one row per call, keyed by (trajectory, generation, step). A live
  call first *claims* its step by inserting the row as ``running`` (the primary key makes the
  claim atomic: one call per position, whoever asks), then the outcome is made durable
  before the result goes back to the client (see below). ``request`` is the canonical text
  whose SHA-256 is ``digest`` (a payload enters it as size and SHA-256); the payload bytes
  are in ``payload`` up to ``INLINE_MAX``, in the blob area above.
- ``trajectory_checkpoints``: for a trajectory created with ``checkpoint=``, the snapshot
  holding the sandbox's file system after a step (step 0: before the first), keyed like its
  step. Consecutive steps that wrote nothing share one snapshot; a fork (of a generation or
  into a new trajectory) links the snapshots of the steps it copies. The snapshot itself is
  in the state store's ``snapshots`` table, and may have been deleted since.

A ``running`` row whose owner is not this server process is ``interrupted``: the server that
ran it stopped before the outcome was written, so nobody knows what it did to the sandbox.

Every statement commits on its own (autocommit; on SQLite in WAL mode with
``synchronous=NORMAL``): a committed row survives a crash of the client, the API server or the
edge. The log has its own connection to the state store's database. On SQLite, an outcome
is first appended to this process's journal (``trajectory.journal``: as durable, a fraction
of a commit's cost) and folded into the table right after the answer, before any read of the
table, and by the next process to open the database if this one dies first; PostgreSQL,
shared by replicas on other hosts, commits each outcome.
"""

from __future__ import annotations

import base64
import builtins
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..protocol.digest import StepRequest
from ..protocol.errors import TrajectoryDiverged, TrajectoryExists, TrajectoryNotFound
from ..protocol.outcome import Outcome
from ..store.blobs import BlobStore
from ..store.db import IntegrityError, Row, open_database
from .journal import SUFFIX, Finish, Journal, orphans

INLINE_MAX = 4096  # bytes fields above this go to the blob area

# A claimed step's outcome; only a step its own owner left running (a late or replayed
# journal record never touches a step someone else claimed, or one finished already).
FINISH = ("UPDATE trajectory_steps SET status=?, outcome=?, ended_at=? WHERE trajectory=? AND "
          "generation=? AND step=? AND owner=? AND status='running'")

SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectories (
    id TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    sandbox_id TEXT NOT NULL,
    request TEXT NOT NULL,
    created_at REAL NOT NULL,
    created_by TEXT,
    expires_at REAL
);
CREATE TABLE IF NOT EXISTS trajectory_generations (
    trajectory TEXT NOT NULL,
    generation INTEGER NOT NULL,
    sandbox_id TEXT NOT NULL,
    image TEXT NOT NULL,
    image_digest TEXT NOT NULL,
    started_at REAL NOT NULL,
    forked_at_step INTEGER,
    reason TEXT,
    replay_differences TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (trajectory, generation)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS trajectory_steps (
    trajectory TEXT NOT NULL,
    generation INTEGER NOT NULL,
    step INTEGER NOT NULL,
    op TEXT NOT NULL,
    digest TEXT NOT NULL,
    request TEXT NOT NULL,
    payload BLOB,
    status TEXT NOT NULL,
    outcome TEXT,
    sandbox_id TEXT NOT NULL,
    caller TEXT,
    owner TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    PRIMARY KEY (trajectory, generation, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS trajectory_checkpoints (
    trajectory TEXT NOT NULL,
    generation INTEGER NOT NULL,
    step INTEGER NOT NULL,
    snapshot TEXT NOT NULL,
    PRIMARY KEY (trajectory, generation, step)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS trajectory_checkpoints_snapshot ON trajectory_checkpoints (snapshot);
CREATE INDEX IF NOT EXISTS trajectory_generations_sandbox ON trajectory_generations (sandbox_id);
CREATE INDEX IF NOT EXISTS trajectories_sandbox ON trajectories (sandbox_id);
"""


def step_blob_refs(request: str, outcome: str | None) -> Iterator[str]:
    """The blob names a step row's request (its payload) and outcome (its bytes) hold."""
    payload = json.loads(request).get("payload")
    if isinstance(payload, dict) and isinstance(payload.get("sha256"), str):
        yield payload["sha256"]
    stored = json.loads(outcome) if outcome else {}
    for ref in (stored.get("bytes") or {}).values():
        if isinstance(ref, dict) and isinstance(ref.get("sha256"), str):
            yield ref["sha256"]


@dataclass
class TrajectoryRow:
    id: str
    generation: int
    sandbox_id: str
    request: dict[str, Any]
    created_at: float
    created_by: str | None
    expires_at: float | None = None  # its own TTL's end (None: the server's TTL, if any)


@dataclass
class GenerationRow:
    trajectory: str
    generation: int
    sandbox_id: str
    image: str
    image_digest: str
    started_at: float
    forked_at_step: int | None
    reason: str | None
    replay_differences: list[int]


@dataclass
class StepRow:
    trajectory: str
    generation: int
    step: int
    op: str
    digest: str
    request: dict[str, Any]  # {"op", "params", "payload": {"size", "sha256"} | None}
    status: str  # running | interrupted | ok | error
    outcome: dict[str, Any] | None
    sandbox_id: str
    caller: str | None
    started_at: float
    ended_at: float | None
    payload: bytes | None = None  # inline payload bytes (see ``request_of``)


class TrajectoryLog:
    def __init__(self, db: Path | str, blobs: BlobStore, owner: str) -> None:
        """``db``: the state store's target (path or URL). ``owner`` names this server
        process: rows it leaves ``running`` are its own."""
        self.blobs = blobs
        self.owner = owner
        self._db = open_database(db, SCHEMA)
        self._db.add_columns("trajectories", {"expires_at": "REAL"})  # a log of before TTLs
        self._journal: Journal | None = None
        self._journal_lock = threading.Lock()  # finish (the loop) against fold (any thread)
        path: Path | None = getattr(self._db, "path", None)  # SQLite: a file on this host
        if path is not None:
            directory = path.with_name(path.name + SUFFIX)
            for finishes in orphans(directory):  # of processes that died before folding
                self._apply(finishes)
            self._journal = Journal(directory, owner)

    def close(self) -> None:
        if self._journal is not None:
            self.fold()
            self._journal.close()
            self._journal = None
        self._db.close()

    # bytes
    def ref(self, data: bytes) -> dict[str, Any]:
        if len(data) <= INLINE_MAX:
            return {"size": len(data), "b64": base64.b64encode(data).decode()}
        return {"size": len(data), "sha256": self.blobs.put(data)}

    def load(self, sha256: str) -> bytes:
        return self.blobs.get(sha256)

    def stored_outcome(self, outcome: Outcome) -> dict[str, Any]:
        """The outcome as a row holds it; large bytes are written to the blob area first."""
        if outcome.error is not None:
            return {"error": outcome.error}
        stored: dict[str, Any] = {"value": outcome.value,
                                  "bytes": {k: self.ref(v) for k, v in outcome.data.items()}}
        if outcome.chunks is not None:
            stored["chunks"] = outcome.chunks
        return stored

    def request_of(self, row: StepRow) -> StepRequest:
        """The logged call, payload included."""
        ref = row.request.get("payload")
        payload = None
        if ref is not None:
            payload = row.payload if row.payload is not None else self.blobs.get(ref["sha256"])
        return StepRequest(row.op, row.request["params"], payload)

    # trajectories
    def create(self, trajectory: str, sandbox_id: str, request: dict[str, Any], image: str,
               image_digest: str, caller: str | None) -> None:
        try:
            with self._db.transaction():
                self._insert(trajectory, sandbox_id, request, image, image_digest, caller,
                             "created")
        except IntegrityError:
            raise TrajectoryExists(f"trajectory {trajectory!r} exists; resume it, or pick a new id",
                                   trajectory=trajectory) from None

    def _insert(self, trajectory: str, sandbox_id: str, request: dict[str, Any], image: str,
                image_digest: str, caller: str | None, reason: str,
                forked_at_step: int | None = None) -> None:
        """A trajectory's row and its first generation's, in the caller's transaction."""
        now = time.time()
        ttl = request.get("trajectory_ttl_s")  # a fork's request carries its source's
        self._db.execute("INSERT INTO trajectories (id, generation, sandbox_id, request, "
                         "created_at, created_by, expires_at) VALUES (?,?,?,?,?,?,?)",
                         (trajectory, 1, sandbox_id, json.dumps(request), now, caller,
                          None if ttl is None else now + ttl))
        self._db.execute(
            "INSERT INTO trajectory_generations (trajectory, generation, sandbox_id, image, "
            "image_digest, started_at, forked_at_step, reason) VALUES (?,?,?,?,?,?,?,?)",
            (trajectory, 1, sandbox_id, image, image_digest, now, forked_at_step, reason))

    def exists(self, trajectory: str) -> bool:
        row = self._db.execute("SELECT 1 FROM trajectories WHERE id=?", (trajectory,)).fetchone()
        return row is not None

    def get(self, trajectory: str) -> TrajectoryRow:
        r = self._db.execute("SELECT * FROM trajectories WHERE id=?", (trajectory,)).fetchone()
        if r is None:
            raise TrajectoryNotFound(f"no trajectory {trajectory!r}", trajectory=trajectory)
        d = dict(r)
        d["request"] = json.loads(d["request"])
        return TrajectoryRow(**d)

    def delete(self, trajectory: str) -> builtins.list[str]:
        """Forget the trajectory (its generations, steps and checkpoints); returns the
        snapshots its checkpoints held that no other trajectory's (a fork's) still links."""
        self.fold()
        with self._db.transaction():
            self.get(trajectory)  # TrajectoryNotFound
            held = [r[0] for r in self._db.execute(
                "SELECT DISTINCT snapshot FROM trajectory_checkpoints WHERE trajectory=?",
                (trajectory,))]
            for table, key in (("trajectory_checkpoints", "trajectory"),
                               ("trajectory_steps", "trajectory"),
                               ("trajectory_generations", "trajectory"), ("trajectories", "id")):
                self._db.execute(f"DELETE FROM {table} WHERE {key}=?", (trajectory,))
            return [snapshot for snapshot in held if self._db.execute(
                "SELECT 1 FROM trajectory_checkpoints WHERE snapshot=? LIMIT 1",
                (snapshot,)).fetchone() is None]

    def expired(self, now: float, default_ttl_s: float, limit: int) -> builtins.list[str]:
        """Ids of up to ``limit`` trajectories past their TTL at ``now``: their own, else
        ``default_ttl_s`` from their creation (0: none), oldest first."""
        return [r["id"] for r in self._db.execute(
            "SELECT id FROM trajectories WHERE expires_at < ? OR (expires_at IS NULL AND "
            "? > 0 AND created_at < ?) ORDER BY created_at LIMIT ?",
            (now, default_ttl_s, now - default_ttl_s, limit))]

    def blob_refs(self, page: int = 1000) -> Iterator[str]:
        """The blob names every logged step holds (payloads and outcome bytes), read a page
        at a time. Only the places the log writes refs to are read: what a sandbox put in a
        result's ``value`` names nothing."""
        self.fold()
        after: tuple[str, int, int] = ("", 0, 0)
        while True:
            rows = self._db.execute(
                "SELECT trajectory, generation, step, request, outcome FROM trajectory_steps "
                "WHERE (trajectory, generation, step) > (?,?,?) AND (request LIKE ? OR "
                "outcome LIKE ?) ORDER BY trajectory, generation, step LIMIT ?",
                (*after, '%"sha256"%', '%"sha256"%', page)).fetchall()
            for r in rows:
                yield from step_blob_refs(r["request"], r["outcome"])
            if len(rows) < page:
                return
            last = rows[-1]
            after = (last["trajectory"], last["generation"], last["step"])

    def list(self, limit: int = 100) -> list[TrajectoryRow]:
        rows = self._db.execute("SELECT id FROM trajectories ORDER BY created_at DESC LIMIT ?",
                                (limit,)).fetchall()
        return [self.get(r["id"]) for r in rows]

    def generations(self, trajectory: str) -> builtins.list[GenerationRow]:
        rows = self._db.execute("SELECT * FROM trajectory_generations WHERE trajectory=? "
                                "ORDER BY generation", (trajectory,))
        out = []
        for r in rows:
            d = dict(r)
            d["replay_differences"] = json.loads(d["replay_differences"])
            out.append(GenerationRow(**d))
        return out

    # steps
    def step(self, trajectory: str, generation: int, step: int) -> StepRow | None:
        self.fold()
        r = self._db.execute("SELECT * FROM trajectory_steps WHERE trajectory=? AND generation=? "
                             "AND step=?", (trajectory, generation, step)).fetchone()
        return self._step_row(r) if r else None

    def claim(self, trajectory: str, generation: int, step: int, request: StepRequest,
              sandbox_id: str, caller: str | None) -> bool:
        """Insert the step as running; False if the position is taken (by anyone)."""
        payload = request.payload
        if payload is not None and len(payload) > INLINE_MAX:
            self.blobs.put(payload)
            payload = None
        cur = self._db.execute(
            "INSERT INTO trajectory_steps (trajectory, generation, step, op, digest, "
            "request, payload, status, sandbox_id, caller, owner, started_at) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
            (trajectory, generation, step, request.op, request.digest, request.canonical,
             payload, "running", sandbox_id, caller, self.owner, time.time()))
        return cur.rowcount == 1

    def finish(self, trajectory: str, generation: int, step: int, stored: dict[str, Any]) -> None:
        """A claimed step's outcome, durable when this returns: journaled (then ``fold``
        it soon) or committed."""
        finish = Finish("error" if "error" in stored else "ok", time.time(), trajectory,
                        generation, step, self.owner, json.dumps(stored, separators=(",", ":")))
        if self._journal is None:  # PostgreSQL: committed on its own
            self._db.execute(FINISH, finish.params())
            return
        with self._journal_lock:
            self._journal.append(finish)

    def fold(self) -> None:
        """The journaled outcomes into the table, in one transaction."""
        journal = self._journal
        if journal is None or not journal.pending:
            return
        with self._journal_lock:
            if journal.pending:
                self._apply(journal.pending)
                journal.folded()

    def _apply(self, finishes: builtins.list[Finish]) -> None:
        with self._db.transaction():
            for finish in finishes:
                self._db.execute(FINISH, finish.params())

    def last_step(self, trajectory: str, generation: int) -> tuple[int, int]:
        """(number of logged steps, highest step) of a generation."""
        self.fold()
        (r,) = self._db.execute("SELECT COUNT(*), COALESCE(MAX(step), 0) FROM trajectory_steps "
                                "WHERE trajectory=? AND generation=?", (trajectory, generation)).fetchall()
        return r[0], r[1]  # an aggregate without GROUP BY: exactly one row

    def steps(self, trajectory: str, generation: int, after: int = 0, upto: int | None = None,
              limit: int | None = None) -> builtins.list[StepRow]:
        self.fold()
        sql = "SELECT * FROM trajectory_steps WHERE trajectory=? AND generation=? AND step>?"
        args: list[Any] = [trajectory, generation, after]
        if upto is not None:
            sql += " AND step<=?"
            args.append(upto)
        sql += " ORDER BY step"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return [self._step_row(r) for r in self._db.execute(sql, args)]

    def _step_row(self, r: Row) -> StepRow:
        status = r["status"]
        if status == "running" and r["owner"] != self.owner:
            status = "interrupted"
        return StepRow(trajectory=r["trajectory"], generation=r["generation"], step=r["step"],
                       op=r["op"], digest=r["digest"], request=json.loads(r["request"]),
                       status=status, outcome=json.loads(r["outcome"]) if r["outcome"] else None,
                       sandbox_id=r["sandbox_id"], caller=r["caller"], started_at=r["started_at"],
                       ended_at=r["ended_at"], payload=r["payload"])

    # forks
    def fork(self, trajectory: str, from_generation: int, at_step: int, sandbox_id: str,
             image: str, image_digest: str, reason: str, differences: builtins.list[int]) -> int:
        """Start the next generation in ``sandbox_id``, holding a copy of the steps before
        ``at_step`` (their results as the client saw them). Returns the new generation."""
        self.fold()
        generation = from_generation + 1
        with self._db.transaction():
            current = self._db.execute("SELECT generation FROM trajectories WHERE id=?",
                                       (trajectory,)).fetchone()
            if current is None or current[0] != from_generation:
                raise TrajectoryDiverged(f"trajectory {trajectory!r} was forked by another call "
                                         "meanwhile", trajectory=trajectory)
            self._db.execute(
                "INSERT INTO trajectory_generations VALUES (?,?,?,?,?,?,?,?,?)",
                (trajectory, generation, sandbox_id, image, image_digest, time.time(), at_step,
                 reason, json.dumps(differences)))
            self._db.execute(
                "INSERT INTO trajectory_steps SELECT trajectory, ?, step, op, digest, request, "
                "payload, status, outcome, sandbox_id, caller, owner, started_at, ended_at "
                "FROM trajectory_steps WHERE trajectory=? AND generation=? AND step<?",
                (generation, trajectory, from_generation, at_step))
            self._copy_checkpoints(trajectory, from_generation, at_step - 1, trajectory, generation)
            self._db.execute("UPDATE trajectories SET generation=?, sandbox_id=? WHERE id=?",
                             (generation, sandbox_id, trajectory))
        return generation

    def branch(self, source: str, generation: int, at_step: int, trajectory: str,
               sandbox_id: str, request: dict[str, Any], image: str, image_digest: str,
               caller: str | None) -> None:
        """A new trajectory ``trajectory`` in ``sandbox_id`` (started from ``source``'s
        checkpoint at ``at_step``): its first generation holds a copy of ``source``'s steps
        up to ``at_step`` and links their checkpoints."""
        self.fold()
        try:
            with self._db.transaction():
                self._insert(trajectory, sandbox_id, request, image, image_digest, caller,
                             f"forked from trajectory {source} at step {at_step}", at_step + 1)
                self._db.execute(
                    "INSERT INTO trajectory_steps SELECT ?, 1, step, op, digest, request, "
                    "payload, status, outcome, sandbox_id, caller, owner, started_at, ended_at "
                    "FROM trajectory_steps WHERE trajectory=? AND generation=? AND step<=?",
                    (trajectory, source, generation, at_step))
                self._copy_checkpoints(source, generation, at_step, trajectory, 1)
        except IntegrityError:
            raise TrajectoryExists(f"trajectory {trajectory!r} exists", trajectory=trajectory) from None

    # checkpoints
    def _copy_checkpoints(self, source: str, generation: int, upto: int, trajectory: str,
                          into: int) -> None:
        self._db.execute(
            "INSERT INTO trajectory_checkpoints SELECT ?, ?, step, snapshot FROM "
            "trajectory_checkpoints WHERE trajectory=? AND generation=? AND step<=?",
            (trajectory, into, source, generation, upto))

    def add_checkpoint(self, trajectory: str, generation: int, step: int, snapshot: str) -> None:
        self._db.execute("INSERT INTO trajectory_checkpoints VALUES (?,?,?,?)",
                         (trajectory, generation, step, snapshot))

    def checkpoint(self, trajectory: str, generation: int, upto: int) -> tuple[int, str] | None:
        """(step, snapshot) of the last checkpoint at or before step ``upto``."""
        r = self._db.execute(
            "SELECT step, snapshot FROM trajectory_checkpoints WHERE trajectory=? AND "
            "generation=? AND step<=? ORDER BY step DESC LIMIT 1",
            (trajectory, generation, upto)).fetchone()
        return None if r is None else (r[0], r[1])

    def checkpoints(self, trajectory: str, generation: int, after: int = 0,
                    upto: int | None = None) -> dict[int, str]:
        """Each checkpointed step's snapshot, in a range of steps."""
        sql = ("SELECT step, snapshot FROM trajectory_checkpoints WHERE trajectory=? AND "
               "generation=? AND step>?")
        args: list[Any] = [trajectory, generation, after]
        if upto is not None:
            sql += " AND step<=?"
            args.append(upto)
        return {r[0]: r[1] for r in self._db.execute(sql, args)}
