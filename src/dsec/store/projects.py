"""Projects, their quotas, project keys and quota reservations, in the state database.

Plain standard SQL (BIGINT, DOUBLE PRECISION, BEGIN/COMMIT, no upserts or RETURNING) so the
same statements serve PostgreSQL. Every quota check is one conditional ``UPDATE`` of one
project row (``... WHERE used + delegated + asked <= quota``): atomic in SQLite and in
PostgreSQL (which re-checks the condition on the locked row), so concurrent creates, even
through several API servers, cannot overshoot. CPUs are stored in thousandths, exactly.

Each project row keeps what its live sandboxes and its snapshots hold (``used_*``) and what
it handed to its children (``delegated_*``, the sum of their quotas), so the invariant
``used + delegated <= quota`` is checked on that row alone. A snapshot holds bytes
(``snapshot_holds``) from before it is taken until it is deleted.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from .db import IntegrityError, Row, open_database
from .sqlite import LIVE_IN, LIVE_STATES

SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    name TEXT PRIMARY KEY,
    parent TEXT REFERENCES projects(name),
    max_sandboxes BIGINT NOT NULL,
    max_cpu_milli BIGINT NOT NULL,
    max_memory_mb BIGINT NOT NULL,
    delegated_sandboxes BIGINT NOT NULL DEFAULT 0,
    delegated_cpu_milli BIGINT NOT NULL DEFAULT 0,
    delegated_memory_mb BIGINT NOT NULL DEFAULT 0,
    used_sandboxes BIGINT NOT NULL DEFAULT 0,
    used_cpu_milli BIGINT NOT NULL DEFAULT 0,
    used_memory_mb BIGINT NOT NULL DEFAULT 0,
    created_at DOUBLE PRECISION NOT NULL,
    max_snapshot_bytes BIGINT NOT NULL DEFAULT 0,
    delegated_snapshot_bytes BIGINT NOT NULL DEFAULT 0,
    used_snapshot_bytes BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS project_keys (
    key_id TEXT PRIMARY KEY,
    project TEXT NOT NULL REFERENCES projects(name)
);
CREATE TABLE IF NOT EXISTS sandbox_projects (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT UNIQUE,
    project TEXT NOT NULL REFERENCES projects(name),
    cpu_milli BIGINT NOT NULL,
    memory_mb BIGINT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    released_at DOUBLE PRECISION
);
CREATE TABLE IF NOT EXISTS snapshot_holds (
    id TEXT PRIMARY KEY,
    snapshot_id TEXT UNIQUE,
    project TEXT NOT NULL REFERENCES projects(name),
    bytes BIGINT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
"""
SNAPSHOT_COLUMNS = {f"{kind}_snapshot_bytes": "BIGINT NOT NULL DEFAULT 0"
                    for kind in ("max", "delegated", "used")}  # what a database of before lacks

RESOURCES = ("sandboxes", "cpu_milli", "memory_mb", "snapshot_bytes")
Amounts = tuple[int, int, int, int]  # sandboxes, cpu in thousandths, memory MB, snapshot bytes


class NameTaken(Exception):
    """A project of that name exists."""


class _Short(Exception):
    """A conditional update found no room: roll the transaction back."""

    def __init__(self, project: str) -> None:
        self.project = project


@dataclass(frozen=True)
class ProjectRow:
    name: str
    parent: str | None
    quota: Amounts
    delegated: Amounts
    used: Amounts
    created_at: float


def _project(r: Row) -> ProjectRow:
    return ProjectRow(r["name"], r["parent"],
                      tuple(r[f"max_{x}"] for x in RESOURCES),
                      tuple(r[f"delegated_{x}"] for x in RESOURCES),
                      tuple(r[f"used_{x}"] for x in RESOURCES),
                      r["created_at"])


class ProjectStore:
    def __init__(self, target: Path | str, root: str, root_quota: Amounts) -> None:
        """``target``: the state store's SQLite file or URL (``StateStore.url``)."""
        self._db = open_database(target, SCHEMA)
        if self._db.add_columns("projects", SNAPSHOT_COLUMNS):  # the root keeps its "no limit"
            self._db.execute("UPDATE projects SET max_snapshot_bytes=? WHERE name=?",
                             (root_quota[3], root))
        if self.get(root) is None:
            try:
                self._db.execute("INSERT INTO projects (name, parent, max_sandboxes, max_cpu_milli, "
                                 "max_memory_mb, max_snapshot_bytes, created_at) "
                                 "VALUES (?,NULL,?,?,?,?,?)", (root, *root_quota, time.time()))
            except IntegrityError:  # another process made it first
                pass

    def close(self) -> None:
        self._db.close()

    # projects
    def get(self, name: str) -> ProjectRow | None:
        r = self._db.execute("SELECT * FROM projects WHERE name=?", (name,)).fetchone()
        return _project(r) if r else None

    def all(self) -> list[ProjectRow]:
        return [_project(r) for r in self._db.execute("SELECT * FROM projects ORDER BY name")]

    def create(self, name: str, parent: str, quota: Amounts) -> bool:
        """Make a child of ``parent`` holding ``quota``, taken from the parent's room. False
        when the parent lacks the room; ``NameTaken`` if the name is."""
        try:
            with self._db.transaction():
                self._db.execute("INSERT INTO projects (name, parent, max_sandboxes, "
                                 "max_cpu_milli, max_memory_mb, max_snapshot_bytes, created_at) "
                                 "VALUES (?,?,?,?,?,?,?)", (name, parent, *quota, time.time()))
                self._delegate(parent, quota)
        except IntegrityError:
            raise NameTaken(name) from None
        except _Short:
            return False
        return True

    def set_quota(self, name: str, quota: Amounts) -> str | None:
        """Change a project's quota (for a child: the parent's delegation). None when done;
        else whose room is short: ``name`` (it holds more than ``quota``) or its parent."""
        try:
            with self._db.transaction():
                self._db.execute("UPDATE projects SET name=name WHERE name=?", (name,))  # lock the row
                row = self.get(name)
                assert row is not None, "callers check the project exists"
                if row.parent is not None:
                    self._delegate(row.parent,
                                   tuple(new - old for new, old in zip(quota, row.quota)))
                if not self._db.execute(
                        "UPDATE projects SET " + ", ".join(f"max_{x}=?" for x in RESOURCES)
                        + " WHERE name=? AND " + " AND ".join(
                            f"used_{x} + delegated_{x} <= ?" for x in RESOURCES),
                        (*quota, name, *quota)).rowcount:
                    raise _Short(name)
        except _Short as short:
            return short.project
        return None

    def _delegate(self, parent: str, change: tuple[int, ...]) -> None:
        """Hand ``change`` more (or, negative, less) of the parent's quota to a child."""
        if not self._db.execute(
            "UPDATE projects SET " + ", ".join(f"delegated_{x} = delegated_{x} + ?" for x in RESOURCES)
            + " WHERE name=? AND " + " AND ".join(
                f"used_{x} + delegated_{x} + ? <= max_{x}" for x in RESOURCES),
                (*change, parent, *change)).rowcount:
            raise _Short(parent)

    # keys
    def set_key_project(self, key_id: str, project: str) -> None:
        self._db.execute("INSERT INTO project_keys VALUES (?,?)", (key_id, project))

    def key_project(self, key_id: str) -> str | None:
        r = self._db.execute("SELECT project FROM project_keys WHERE key_id=?", (key_id,)).fetchone()
        return r["project"] if r else None

    # reservations: what a sandbox (or a create in flight) holds of its project's quota
    def reserve(self, project: str, cpu_milli: int, memory_mb: int) -> str | None:
        """Take one sandbox, ``cpu_milli`` and ``memory_mb`` of the project's room, all or
        nothing. The reservation id, or None if the room is short."""
        reservation = "rsv-" + secrets.token_hex(8)
        with self._db.transaction():
            taken = self._take(project, (1, cpu_milli, memory_mb, 0))
            if taken:
                self._db.execute("INSERT INTO sandbox_projects (id, project, cpu_milli, "
                                 "memory_mb, created_at) VALUES (?,?,?,?,?)",
                                 (reservation, project, cpu_milli, memory_mb, time.time()))
        return reservation if taken else None

    def _take(self, project: str, asked: Amounts) -> bool:
        """Add ``asked`` to the project's use if it stays within its quota (inside a
        transaction of the caller's)."""
        return bool(self._db.execute(
            "UPDATE projects SET " + ", ".join(f"used_{x} = used_{x} + ?" for x in RESOURCES)
            + " WHERE name=? AND " + " AND ".join(
                f"used_{x} + delegated_{x} + ? <= max_{x}" for x in RESOURCES),
            (*asked, project, *asked)).rowcount)

    def bind(self, reservation: str, sandbox_id: str) -> None:
        self._db.execute("UPDATE sandbox_projects SET sandbox_id=? WHERE id=?",
                         (sandbox_id, reservation))

    def release(self, reservation: str) -> bool:
        """Give a reservation's share back, once (False if it was already)."""
        with self._db.transaction():
            if not self._db.execute("UPDATE sandbox_projects SET released_at=? WHERE id=? AND "
                                    "released_at IS NULL", (time.time(), reservation)).rowcount:
                return False
            r = self._db.execute("SELECT * FROM sandbox_projects WHERE id=?",
                                 (reservation,)).fetchone()
            assert r is not None, "the update above found it"
            self._db.execute("UPDATE projects SET used_sandboxes = used_sandboxes - 1, "
                             "used_cpu_milli = used_cpu_milli - ?, "
                             "used_memory_mb = used_memory_mb - ? WHERE name=?",
                             (r["cpu_milli"], r["memory_mb"], r["project"]))
            self._db.execute("DELETE FROM sandbox_projects WHERE id=? AND sandbox_id IS NULL",
                             (reservation,))  # a failed create: nothing to remember
        return True

    def reservation_of(self, sandbox_id: str) -> str | None:
        r = self._db.execute("SELECT id FROM sandbox_projects WHERE sandbox_id=?",
                             (sandbox_id,)).fetchone()
        return r["id"] if r else None

    def project_of(self, sandbox_id: str) -> str | None:
        r = self._db.execute("SELECT project FROM sandbox_projects WHERE sandbox_id=?",
                             (sandbox_id,)).fetchone()
        return r["project"] if r else None

    def stale(self, started_before: float) -> list[str]:
        """Unreleased reservations of sandboxes that are not live, and of creates that were in
        flight before ``started_before`` (the server that made them is gone)."""
        rows = self._db.execute(
            "SELECT r.id FROM sandbox_projects r LEFT JOIN sandboxes s ON s.id = r.sandbox_id "
            "WHERE r.released_at IS NULL AND ((r.sandbox_id IS NULL AND r.created_at < ?) OR "
            "(r.sandbox_id IS NOT NULL AND (s.id IS NULL OR s.state NOT IN " + LIVE_IN + ")))",
            (started_before, *LIVE_STATES))
        return [r["id"] for r in rows]

    # snapshot holds: the bytes a snapshot (or one being taken) holds of its project's quota
    def hold_snapshot(self, project: str, size: int) -> str | None:
        """Take ``size`` bytes of the project's snapshot room: the hold's id, or None if the
        room is short."""
        hold = "snh-" + secrets.token_hex(8)
        with self._db.transaction():
            taken = self._take(project, (0, 0, 0, size))
            if taken:
                self._db.execute("INSERT INTO snapshot_holds (id, project, bytes, created_at) "
                                 "VALUES (?,?,?,?)", (hold, project, size, time.time()))
        return hold if taken else None

    def bind_snapshot(self, hold: str, snapshot_id: str) -> None:
        self._db.execute("UPDATE snapshot_holds SET snapshot_id=? WHERE id=?", (snapshot_id, hold))

    def snapshot_hold_of(self, snapshot_id: str) -> str | None:
        r = self._db.execute("SELECT id FROM snapshot_holds WHERE snapshot_id=?",
                             (snapshot_id,)).fetchone()
        return r["id"] if r else None

    def release_snapshot(self, hold: str) -> bool:
        """Give a hold's bytes back, once (False if it was already)."""
        with self._db.transaction():
            r = self._db.execute("SELECT * FROM snapshot_holds WHERE id=?", (hold,)).fetchone()
            if r is None or not self._db.execute("DELETE FROM snapshot_holds WHERE id=?",
                                                 (hold,)).rowcount:
                return False
            self._db.execute("UPDATE projects SET used_snapshot_bytes = used_snapshot_bytes - ? "
                             "WHERE name=?", (r["bytes"], r["project"]))
        return True

    def stale_snapshot_holds(self, started_before: float) -> list[str]:
        """Holds of snapshots that are gone (deleted by their edge's TTL reaper, or with the
        answer lost), and of snapshots being taken before ``started_before`` (the server that
        took them is gone)."""
        rows = self._db.execute(
            "SELECT h.id FROM snapshot_holds h LEFT JOIN snapshots s ON s.id = h.snapshot_id "
            "WHERE (h.snapshot_id IS NULL AND h.created_at < ?) OR "
            "(h.snapshot_id IS NOT NULL AND s.id IS NULL)", (started_before,))
        return [r["id"] for r in rows]
