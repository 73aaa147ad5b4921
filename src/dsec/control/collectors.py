"""The collectors of the control plane's state (``store.gc.Collector``): ended sandboxes'
records and events, failed creates' records, trajectories past the trajectory TTL, and
blobs no logged step names.

Why here: what keeps a record is known only where the tables meet -- a sandbox's record
stays while a trajectory (its row or any generation) or a snapshot names it, or its project
reservation is not yet given back; a blob stays while a step names it. Each collector works
in batches of ``BATCH`` in a worker thread on its own database connection, so the event loop
(and the requests on it) never wait for a collection, and each batch is committed on its
own, so a large backlog never holds the database.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Awaitable

from ..protocol.errors import DSecError
from ..protocol.gc_models import Removed
from ..store.blobs import BlobStore
from ..store.db import Database, open_database
from ..store.idempotency import SCHEMA as IDEMPOTENCY_SCHEMA
from ..store.sqlite import LIVE_IN, LIVE_STATES
from ..trajectory.log import TrajectoryLog

log = logging.getLogger("dsec.gc")
BATCH = 500  # sandbox records (or events, or trajectories) per statement


class SandboxRecords:
    """Ended sandboxes' records after ``retain_ended_s``, failed creates' (never ran: no
    runtime facts recorded) after ``retain_failed_s``, each with its events, its released
    project reservation and the idempotency key that made it (a key lives no longer than its
    sandbox's record: control/idempotency.py); then events no sandbox record names, after
    ``retain_ended_s``."""

    name = "sandboxes"

    def __init__(self, target: Path | str, retain_ended_s: float, retain_failed_s: float) -> None:
        self._db: Database = open_database(target, IDEMPOTENCY_SCHEMA)
        self.retain_ended_s = retain_ended_s
        self.retain_failed_s = retain_failed_s

    async def collect(self, now: float, dry_run: bool) -> list[Removed]:
        totals = {kind: [0, 0] for kind in ("sandboxes", "failed_creates", "events",
                                            "idempotency_keys")}
        for kind, never_ran, retain in (("sandboxes", False, self.retain_ended_s),
                                        ("failed_creates", True, self.retain_failed_s)):
            after: tuple[float, str] = (0.0, "")
            while batch := await asyncio.to_thread(self._ended, now - retain, never_ran, after):
                after = batch[-1]
                for k, n, b in await asyncio.to_thread(self._remove, [i for _, i in batch],
                                                       never_ran, now - retain, dry_run, kind):
                    totals[k][0] += n
                    totals[k][1] += b
        after_seq = 0
        while events := await asyncio.to_thread(self._orphan_events, now - self.retain_ended_s,
                                                after_seq):
            after_seq = events[-1][0]
            n, b = (len(events), sum(e[1] for e in events)) if dry_run else \
                await asyncio.to_thread(self._delete_events, [e[0] for e in events])
            totals["events"][0] += n
            totals["events"][1] += b
        return [Removed(kind=k, count=n, bytes=b) for k, (n, b) in totals.items()]

    def _collectable(self, never_ran: bool, s: str = "s") -> str:
        """The condition on a record ``s`` of ``sandboxes`` (an alias, or the table's name in
        a DELETE): ended before ``?`` and nothing needs it any more."""
        return (f"{s}.state NOT IN {LIVE_IN} AND {s}.ended_at < ? AND "
                f"{s}.runtime {'=' if never_ran else '<>'} '{{}}' "
                f"AND NOT EXISTS (SELECT 1 FROM trajectories t WHERE t.sandbox_id = {s}.id) "
                "AND NOT EXISTS (SELECT 1 FROM trajectory_generations g WHERE "
                f"g.sandbox_id = {s}.id) "
                f"AND NOT EXISTS (SELECT 1 FROM snapshots n WHERE n.sandbox_id = {s}.id) "
                f"AND NOT EXISTS (SELECT 1 FROM sandbox_projects r WHERE r.sandbox_id = {s}.id "
                "AND r.released_at IS NULL)")

    def _ended(self, cutoff: float, never_ran: bool,
               after: tuple[float, str]) -> list[tuple[float, str]]:
        """(ended_at, id) of the next batch, in that order: a range of the ``ended_at``
        index, so a pass reads the records past retention, not every record."""
        return [(r["ended_at"], r["id"]) for r in self._db.execute(
            f"SELECT s.ended_at, s.id FROM sandboxes s WHERE {self._collectable(never_ran)} "
            "AND (s.ended_at, s.id) > (?, ?) ORDER BY s.ended_at, s.id LIMIT ?",
            (*LIVE_STATES, cutoff, *after, BATCH))]

    def _remove(self, ids: list[str], never_ran: bool, cutoff: float, dry_run: bool,
                kind: str) -> list[tuple[str, int, int]]:
        """Remove a batch of records (events first: a crash leaves records to find again)."""
        marks = ",".join("?" * len(ids))
        if dry_run:
            (ev,) = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(detail)), 0) FROM "
                                     f"events WHERE sandbox_id IN ({marks})", ids).fetchall()
            (sb,) = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(s.request) + LENGTH(s.runtime)), 0) FROM "
                f"sandboxes s WHERE s.id IN ({marks})", ids).fetchall()
            (key,) = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(idem_key) + LENGTH(scope)), 0) FROM "
                f"idempotency_keys WHERE sandbox_id IN ({marks})", ids).fetchall()
            return [("events", ev[0], ev[1]), (kind, sb[0], sb[1]),
                    ("idempotency_keys", key[0], key[1])]
        events = [0, 0]
        while seqs := [r[0] for r in self._db.execute(
                f"SELECT seq FROM events WHERE sandbox_id IN ({marks}) LIMIT ?", (*ids, BATCH))]:
            n, b = self._delete_events(seqs)
            events[0] += n
            events[1] += b
        with self._db.transaction():
            rows = self._db.execute(
                f"DELETE FROM sandboxes WHERE id IN ({marks}) AND "
                f"{self._collectable(never_ran, 'sandboxes')} "
                "RETURNING LENGTH(request) + LENGTH(runtime)",
                (*ids, *LIVE_STATES, cutoff)).fetchall()
            self._db.execute(f"DELETE FROM sandbox_projects WHERE sandbox_id IN ({marks}) AND "
                             "released_at IS NOT NULL AND sandbox_id NOT IN (SELECT id FROM "
                             "sandboxes)", ids)
            keys = self._db.execute(
                f"DELETE FROM idempotency_keys WHERE sandbox_id IN ({marks}) AND sandbox_id NOT "
                "IN (SELECT id FROM sandboxes) RETURNING LENGTH(idem_key) + LENGTH(scope)",
                ids).fetchall()
        return [("events", events[0], events[1]), (kind, len(rows), sum(r[0] for r in rows)),
                ("idempotency_keys", len(keys), sum(k[0] for k in keys))]

    def _orphan_events(self, cutoff: float, after: int) -> list[tuple[int, int]]:
        """(seq, size) of events before ``cutoff`` that name no sandbox record (the edge's
        own, and those of records removed already)."""
        return [(r[0], r[1]) for r in self._db.execute(
            "SELECT e.seq, LENGTH(e.detail) FROM events e WHERE e.at < ? AND e.seq > ? AND "
            "(e.sandbox_id IS NULL OR NOT EXISTS (SELECT 1 FROM sandboxes s WHERE "
            "s.id = e.sandbox_id)) ORDER BY e.seq LIMIT ?", (cutoff, after, BATCH))]

    def _delete_events(self, seqs: list[int]) -> tuple[int, int]:
        rows = self._db.execute(f"DELETE FROM events WHERE seq IN ({','.join('?' * len(seqs))}) "
                                "RETURNING LENGTH(detail)", seqs).fetchall()
        return len(rows), sum(r[0] for r in rows)


class ExpiredTrajectories:
    """Trajectories past their TTL (their own ``trajectory_ttl_s``, else ``ttl_s`` from
    their creation; 0: kept until deleted), deleted the way a client deletes one
    (``delete``: the recorder's, which stops the sandbox and deletes its checkpoints'
    snapshots); their blobs and records go with later collections."""

    name = "trajectories"

    def __init__(self, log: TrajectoryLog, delete: Callable[[str], Awaitable[Any]],
                 ttl_s: float) -> None:
        self.log = log
        self.delete = delete
        self.ttl_s = ttl_s

    async def collect(self, now: float, dry_run: bool) -> list[Removed]:
        """At most ``BATCH`` a collection (the next one takes the rest); one with calls
        under way is skipped until a later one."""
        expired = await asyncio.to_thread(self.log.expired, now, self.ttl_s, BATCH)
        count = 0
        for trajectory in expired:
            if not dry_run:
                try:
                    await self.delete(trajectory)
                except DSecError as exc:
                    log.info("trajectory %s past its TTL is kept for now: %s", trajectory, exc)
                    continue
            count += 1
        return [Removed(kind="trajectories", count=count, bytes=0)]


class UnreferencedBlobs:
    """Blobs no logged step names, last written more than ``grace_s`` ago (see
    ``store.blobs``: the grace covers a step between its blob's write and its commit). Run
    by every replica for its own blob area; the names come from the shared log."""

    name = "blobs"

    def __init__(self, log: TrajectoryLog, blobs: BlobStore, grace_s: float) -> None:
        self.log = log
        self.blobs = blobs
        self.grace_s = grace_s

    async def collect(self, now: float, dry_run: bool) -> list[Removed]:
        return [await asyncio.to_thread(self._sweep, dry_run)]

    def _sweep(self, dry_run: bool) -> Removed:
        # the real clock, whatever ``now`` says: the grace is what keeps a write in flight safe
        cutoff = time.time() - self.grace_s
        referenced = set(self.log.blob_refs())  # read after the cut-off was taken
        count = size = 0
        for digest, blob_size in self.blobs.candidates(cutoff):
            if digest in referenced:
                continue
            removed = blob_size if dry_run else self.blobs.remove_if_unwritten(digest, cutoff)
            if removed is not None:
                count += 1
                size += removed
        return Removed(kind="blobs", count=count, bytes=size)


class SnapshotImages:
    """The image versions (digests) every snapshot record names, for the layer collector
    (``images.gc.UnusedLayers``): a snapshot keeps the layers it was taken over, whatever
    its image's name points at now. Its own connection: called from a worker thread."""

    def __init__(self, target: Path | str) -> None:
        self._db: Database = open_database(target, IDEMPOTENCY_SCHEMA)

    def __call__(self) -> set[str]:
        rows = self._db.execute("SELECT DISTINCT image_digest FROM snapshots").fetchall()
        return {str(row["image_digest"]) for row in rows}
