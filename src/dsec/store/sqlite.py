"""The state store: sandboxes, their snapshots, API keys and events, in one SQLite file (embedded) or in
PostgreSQL (scaled out) through ``store.db``.

Writes are tiny and run on the event loop thread; WAL mode keeps readers (``dsec ls`` from
another process) from blocking the server.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .db import Row, open_database
from .walcheckpoint import BACKSTOP_PAGES

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    edge TEXT NOT NULL,
    substrate TEXT NOT NULL,
    image TEXT NOT NULL,
    image_digest TEXT NOT NULL,
    state TEXT NOT NULL,
    request TEXT NOT NULL,
    runtime TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    ended_at REAL,
    reason TEXT
);
CREATE INDEX IF NOT EXISTS sandboxes_live ON sandboxes(edge, state);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY,
    edge TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    substrate TEXT NOT NULL,
    image TEXT NOT NULL,
    image_digest TEXT NOT NULL,
    mode TEXT NOT NULL,
    disk_mb INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    inherited TEXT
);
CREATE TABLE IF NOT EXISTS snapshot_exports (
    id TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    exported_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    secret_sha256 TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    sandbox_id TEXT,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_sandbox ON events(sandbox_id);
CREATE INDEX IF NOT EXISTS events_at ON events(at);
CREATE INDEX IF NOT EXISTS sandboxes_ended ON sandboxes(ended_at, id);
CREATE INDEX IF NOT EXISTS snapshots_sandbox ON snapshots(sandbox_id);
"""

LIVE_STATES = ("starting", "running", "paused")
LIVE_IN = f"({','.join('?' * len(LIVE_STATES))})"  # SQL placeholders for LIVE_STATES


@dataclass
class SandboxRow:
    id: str
    edge: str
    substrate: str
    image: str
    image_digest: str
    state: str
    request: dict[str, Any]
    runtime: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    expires_at: float = 0.0
    ended_at: float | None = None
    reason: str | None = None


@dataclass
class SnapshotRow:
    """A snapshot's record; its files are on its edge (``<state>/snapshots/<id>/``)."""

    id: str
    edge: str
    sandbox_id: str  # the parent
    substrate: str
    image: str
    image_digest: str
    mode: str
    disk_mb: int
    size_bytes: int
    created_at: float
    expires_at: float | None = None  # its TTL's end: deleted by its edge's reaper after
    # What sandboxes made from it inherit of its parent's request, as it was when the snapshot
    # was taken (edge/inherit.py); None in a record of before inheritance.
    inherited: dict[str, Any] | None = None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


def _row(r: Row) -> SandboxRow:
    d = dict(r)
    d["request"] = json.loads(d["request"])
    d["runtime"] = json.loads(d["runtime"])
    return SandboxRow(**d)


def _snapshot_row(r: Row) -> SnapshotRow:
    d = dict(r)
    d["inherited"] = None if d["inherited"] is None else json.loads(d["inherited"])
    return SnapshotRow(**d)


BUSY_TIMEOUT_MS = 5000


def _switch_to_wal(db: sqlite3.Connection) -> None:
    """Put the file in WAL mode. Two processes opening a new file at once collide on this
    switch, and SQLite answers the loser "locked" at once, without its busy handler: retry
    within the busy timeout, as any other statement would wait."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def connect(path: Path, schema: str) -> sqlite3.Connection:
    """A connection to the state database in autocommit mode, WAL journal, with ``schema``
    applied: commits survive a crash of the process; readers in other processes never block.
    Its commits leave checkpoints to the file's checkpoint thread (``store.walcheckpoint``)
    up to a backstop."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    _switch_to_wal(db)
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")
    db.executescript(schema)
    return db


class StateStore:
    def __init__(self, target: Path | str) -> None:
        """``target``: a SQLite file, ``sqlite:///PATH`` or ``postgresql://...``."""
        self._db = open_database(target, SCHEMA)
        # a database of before snapshot TTLs, and of before inheritance
        self._db.add_columns("snapshots", {"expires_at": "REAL", "inherited": "TEXT"})
        self.url = self._db.url
        self.path: Path | None = getattr(self._db, "path", None)  # the SQLite file, if one

    def close(self) -> None:
        self._db.close()

    # sandboxes
    def insert_sandbox(self, row: SandboxRow) -> None:
        self._db.execute(
            "INSERT INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (row.id, row.edge, row.substrate, row.image, row.image_digest, row.state,
             json.dumps(row.request), json.dumps(row.runtime), row.created_at, row.expires_at,
             row.ended_at, row.reason),
        )

    def mark_running(self, sandbox_id: str, runtime: dict[str, Any], expires_at: float) -> None:
        self._db.execute("UPDATE sandboxes SET state='running', runtime=?, expires_at=? WHERE id=?",
                         (json.dumps(runtime), expires_at, sandbox_id))

    def set_runtime(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        """A live sandbox's runtime facts after its substrate restarted it (a VM's resume)."""
        self._db.execute("UPDATE sandboxes SET runtime=? WHERE id=?",
                         (json.dumps(runtime), sandbox_id))

    def mark_ended(self, sandbox_id: str, state: str, reason: str) -> None:
        """Record the end of a sandbox once; the first recorded reason wins."""
        self._db.execute(
            "UPDATE sandboxes SET state=?, reason=?, ended_at=? WHERE id=? AND state IN " + LIVE_IN,
            (state, reason, time.time(), sandbox_id, *LIVE_STATES),
        )

    def set_state(self, sandbox_id: str, state: str) -> None:
        """A live sandbox's move between running and paused (an ended one stays ended)."""
        self._db.execute("UPDATE sandboxes SET state=? WHERE id=? AND state IN " + LIVE_IN,
                         (state, sandbox_id, *LIVE_STATES))

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))

    def set_expiry(self, sandbox_id: str, expires_at: float) -> None:
        self._db.execute("UPDATE sandboxes SET expires_at=? WHERE id=?", (expires_at, sandbox_id))

    def set_request(self, sandbox_id: str, request: dict[str, Any]) -> None:
        """A live sandbox's request after a change in place (its network policy)."""
        self._db.execute("UPDATE sandboxes SET request=? WHERE id=?",
                         (json.dumps(request), sandbox_id))

    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None:
        r = self._db.execute("SELECT * FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        return _row(r) if r else None

    def sandboxes(self, edge: str | None = None, live_only: bool = False) -> list[SandboxRow]:
        sql, args = "SELECT * FROM sandboxes WHERE 1=1", []
        if edge is not None:
            sql += " AND edge=?"
            args.append(edge)
        if live_only:
            sql += " AND state IN " + LIVE_IN
            args.extend(LIVE_STATES)
        return [_row(r) for r in self._db.execute(sql + " ORDER BY created_at", args)]

    def live_counts(self, edge: str) -> dict[tuple[str, str], int]:
        """Live sandboxes of an edge by (substrate, state)."""
        rows = self._db.execute("SELECT substrate, state, COUNT(*) AS n FROM sandboxes WHERE "
                                f"edge=? AND state IN {LIVE_IN} GROUP BY substrate, state",
                                (edge, *LIVE_STATES))
        return {(r["substrate"], r["state"]): r["n"] for r in rows}

    # snapshots
    def insert_snapshot(self, row: SnapshotRow) -> None:
        self._db.execute("INSERT INTO snapshots (id, edge, sandbox_id, substrate, image, "
                         "image_digest, mode, disk_mb, size_bytes, created_at, expires_at, "
                         "inherited) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                         (row.id, row.edge, row.sandbox_id, row.substrate, row.image,
                          row.image_digest, row.mode, row.disk_mb, row.size_bytes,
                          row.created_at, row.expires_at,
                          None if row.inherited is None else json.dumps(row.inherited)))

    def get_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        """The snapshot's record, also once expired (``SnapshotRow.expired``) until its
        edge's reaper deletes it."""
        r = self._db.execute("SELECT * FROM snapshots WHERE id=?", (snapshot_id,)).fetchone()
        return _snapshot_row(r) if r else None

    def snapshots(self) -> list[SnapshotRow]:
        """The snapshots not expired."""
        return [_snapshot_row(r) for r in self._db.execute(
            "SELECT * FROM snapshots WHERE expires_at IS NULL OR expires_at > ? "
            "ORDER BY created_at", (time.time(),))]

    def expired_snapshots(self, edge: str, now: float) -> list[str]:
        """The ids of an edge's snapshots whose TTL ended by ``now``."""
        return [r["id"] for r in self._db.execute(
            "SELECT id FROM snapshots WHERE edge=? AND expires_at <= ?", (edge, now))]

    def delete_snapshot(self, snapshot_id: str) -> bool:
        """Whether there was such a snapshot (a concurrent delete finds none). Its export's
        record goes with it."""
        self._db.execute("DELETE FROM snapshot_exports WHERE id=?", (snapshot_id,))
        return self._db.execute("DELETE FROM snapshots WHERE id=?", (snapshot_id,)).rowcount > 0

    # a snapshot's copy in the shared snapshot directory (edge/shared_snapshots.py)
    def insert_export(self, snapshot_id: str, digest: str, size_bytes: int) -> None:
        self._db.execute("INSERT INTO snapshot_exports VALUES (?,?,?,?)",
                         (snapshot_id, digest, size_bytes, time.time()))

    def get_export(self, snapshot_id: str) -> tuple[str, int] | None:
        """The exported copy's content digest and apparent size, once it is complete."""
        r = self._db.execute("SELECT digest, size_bytes FROM snapshot_exports WHERE id=?",
                             (snapshot_id,)).fetchone()
        return (r["digest"], r["size_bytes"]) if r else None

    # keys
    def create_key(self, name: str) -> tuple[str, str, float]:
        """Returns (key id, secret, created_at); only the secret's hash is stored."""
        key_id = "key-" + secrets.token_hex(4)
        secret = "dsk_" + secrets.token_urlsafe(24)
        now = time.time()
        self._db.execute("INSERT INTO api_keys VALUES (?,?,?,?)",
                         (key_id, name, _sha256(secret), now))
        return key_id, secret, now

    def key_for_secret(self, secret: str) -> str | None:
        r = self._db.execute("SELECT id FROM api_keys WHERE secret_sha256=?",
                             (_sha256(secret),)).fetchone()
        return r["id"] if r else None

    def keys(self) -> Iterator[Row]:
        return iter(self._db.execute("SELECT id, name, created_at FROM api_keys ORDER BY created_at"))

    # events
    def event(self, kind: str, sandbox_id: str | None = None, **detail: Any) -> None:
        self._db.execute("INSERT INTO events (at, sandbox_id, kind, detail) VALUES (?,?,?,?)",
                         (time.time(), sandbox_id, kind, json.dumps(detail)))

    def events(self, sandbox_id: str) -> list[tuple[str, dict[str, Any]]]:
        rows = self._db.execute("SELECT kind, detail FROM events WHERE sandbox_id=? ORDER BY seq",
                                (sandbox_id,))
        return [(r["kind"], json.loads(r["detail"])) for r in rows]


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
