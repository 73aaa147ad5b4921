"""Idempotency keys of sandbox creates, in the state database (SQLite or PostgreSQL).

A key is claimed by one request at a time, atomically (``INSERT ... ON CONFLICT DO NOTHING``
on the ``(scope, key)`` primary key), so two API servers on one database, or two racing
requests on one, can never both create. The claim holds a lease its owner renews while the
create runs; a claim whose owner died (its lease ran out, or its process is gone) is taken
over by compare-and-swap on the owner. A finished claim records the sandbox, for retries to
find, until it expires.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .db import open_database

SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    request_sha256 TEXT NOT NULL,
    owner TEXT NOT NULL,
    lease_until REAL NOT NULL,
    sandbox_id TEXT,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (scope, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_expiry ON idempotency_keys(expires_at);
"""

State = Literal["claimed", "done", "pending", "mismatch"]


@dataclass(frozen=True)
class Claim:
    """``claimed``: the caller creates; ``done``: ``sandbox_id`` was created for the key;
    ``pending``: another live owner is creating; ``mismatch``: the key names another request."""

    state: State
    sandbox_id: str | None = None
    owner: str | None = None


class IdempotencyStore:
    def __init__(self, target: Path | str) -> None:
        """``target``: the state store's SQLite file or URL (``StateStore.url``)."""
        self._db = open_database(target, SCHEMA)

    def close(self) -> None:
        self._db.close()

    def claim(self, scope: str, key: str, digest: str, owner: str, lease_s: float,
              ttl_s: float) -> Claim:
        """Claim ``key`` for ``owner`` unless it is taken; what the key holds otherwise."""
        now = time.time()
        self._db.execute("DELETE FROM idempotency_keys WHERE expires_at < ?", (now,))
        inserted = self._db.execute(
            "INSERT INTO idempotency_keys (scope, idem_key, request_sha256, owner, lease_until, "
            "sandbox_id, created_at, expires_at) VALUES (?,?,?,?,?,NULL,?,?) "
            "ON CONFLICT DO NOTHING", (scope, key, digest, owner, now + lease_s, now, now + ttl_s))
        if inserted.rowcount == 1:
            return Claim("claimed")
        row = self._db.execute("SELECT * FROM idempotency_keys WHERE scope=? AND idem_key=?",
                               (scope, key)).fetchone()
        if row is None:  # expired or released between the two statements: try again
            return Claim("pending")
        if row["request_sha256"] != digest:
            return Claim("mismatch")
        if row["sandbox_id"] is not None:
            return Claim("done", row["sandbox_id"])
        if row["lease_until"] < now:  # its owner stopped renewing: it died
            return self.take_over(scope, key, row["owner"], owner, lease_s)
        return Claim("pending", owner=row["owner"])

    def take_over(self, scope: str, key: str, dead: str, owner: str, lease_s: float) -> Claim:
        """Claim a key whose owner ``dead`` is gone, if nobody else took it first."""
        taken = self._db.execute(
            "UPDATE idempotency_keys SET owner=?, lease_until=? WHERE scope=? AND idem_key=? AND "
            "owner=? AND sandbox_id IS NULL", (owner, time.time() + lease_s, scope, key, dead))
        return Claim("claimed") if taken.rowcount == 1 else Claim("pending")

    def renew(self, scope: str, key: str, owner: str, lease_s: float) -> bool:
        return self._db.execute(
            "UPDATE idempotency_keys SET lease_until=? WHERE scope=? AND idem_key=? AND owner=? AND "
            "sandbox_id IS NULL", (time.time() + lease_s, scope, key, owner)).rowcount == 1

    def complete(self, scope: str, key: str, owner: str, sandbox_id: str) -> bool:
        """Record the sandbox made for the key; False if the claim was lost meanwhile."""
        return self._db.execute(
            "UPDATE idempotency_keys SET sandbox_id=? WHERE scope=? AND idem_key=? AND owner=? AND "
            "sandbox_id IS NULL", (sandbox_id, scope, key, owner)).rowcount == 1

    def release(self, scope: str, key: str, owner: str) -> None:
        """Give up a claim whose create failed: a retry creates afresh."""
        self._db.execute("DELETE FROM idempotency_keys WHERE scope=? AND idem_key=? AND owner=? AND "
                         "sandbox_id IS NULL", (scope, key, owner))

    def forget(self, scope: str, key: str, sandbox_id: str) -> None:
        """Drop a key whose sandbox's record is gone (the key expires with it)."""
        self._db.execute("DELETE FROM idempotency_keys WHERE scope=? AND idem_key=? AND sandbox_id=?",
                         (scope, key, sandbox_id))
