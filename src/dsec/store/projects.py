"""Projects, their quotas, project keys and quota reservations, in the state database.

Plain standard SQL (BIGINT, DOUBLE PRECISION, BEGIN/COMMIT, no upserts or RETURNING) so the
same statements serve PostgreSQL. Every quota check is one conditional ``UPDATE`` of one
project row (``... WHERE used + delegated + asked <= quota``): atomic in SQLite and in
PostgreSQL (which re-checks the condition on the locked row), so concurrent creates, even
through several API servers, cannot overshoot. CPUs are stored in thousandths, exactly.

Each project row keeps what its live sandboxes hold (``used_*``) and what it handed to its
children (``delegated_*``, the sum of their quotas), so the invariant
``used + delegated <= quota`` is checked on that row alone.
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
    created_at DOUBLE PRECISION NOT NULL
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
"""

RESOURCES = ("sandboxes", "cpu_milli", "memory_mb")
Amounts = tuple[int, int, int]  # sandboxes, cpu in thousandths, memory MB


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
        if self.get(root) is None:
            try:
                self._db.execute("INSERT INTO projects (name, parent, max_sandboxes, max_cpu_milli, "
                                 "max_memory_mb, created_at) VALUES (?,NULL,?,?,?,?)",
                                 (root, *root_quota, time.time()))
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
                                 "max_cpu_milli, max_memory_mb, created_at) VALUES (?,?,?,?,?,?)",
                                 (name, parent, *quota, time.time()))
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
                        "UPDATE projects SET max_sandboxes=?, max_cpu_milli=?, max_memory_mb=? "
                        "WHERE name=? AND " + " AND ".join(
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
        asked = (1, cpu_milli, memory_mb)
        reservation = "rsv-" + secrets.token_hex(8)
        with self._db.transaction():
            taken = self._db.execute(
                "UPDATE projects SET " + ", ".join(f"used_{x} = used_{x} + ?" for x in RESOURCES)
                + " WHERE name=? AND " + " AND ".join(
                    f"used_{x} + delegated_{x} + ? <= max_{x}" for x in RESOURCES),
                (*asked, project, *asked)).rowcount
            if taken:
                self._db.execute("INSERT INTO sandbox_projects (id, project, cpu_milli, "
                                 "memory_mb, created_at) VALUES (?,?,?,?,?)",
                                 (reservation, project, cpu_milli, memory_mb, time.time()))
        return reservation if taken else None

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
