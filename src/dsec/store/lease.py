"""Leases in the state database: at most one holder of a named duty at a time (the cluster's
garbage collector) among the API replicas sharing it, with no lock server.

A lease is one row, taken atomically by its first holder (``INSERT ... ON CONFLICT DO
NOTHING`` on its name) and afterwards by one conditional ``UPDATE`` (``WHERE holder = me OR
until < now``): SQLite serialises writers, PostgreSQL re-checks the condition on the locked
row, so of two replicas racing for a lapsed lease exactly one gets it. A holder renews it by
taking it again; one that dies or stalls loses it when ``until`` passes. Times are the
replicas' wall clocks: they must agree to well within the lease's length (NTP does).
"""

from __future__ import annotations

import time
from pathlib import Path

from .db import open_database

SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    until REAL NOT NULL
);
"""


class Leases:
    def __init__(self, target: Path | str) -> None:
        """``target``: the state store's SQLite file or URL (``StateStore.url``)."""
        self._db = open_database(target, SCHEMA)

    def close(self) -> None:
        self._db.close()

    def take(self, name: str, holder: str, seconds: float) -> bool:
        """Hold (or keep holding) lease ``name`` for ``seconds`` from now, unless another
        holder's has not run out; whether ``holder`` holds it."""
        now = time.time()
        if self._db.execute("INSERT INTO leases (name, holder, until) VALUES (?,?,?) "
                            "ON CONFLICT DO NOTHING", (name, holder, now + seconds)).rowcount:
            return True
        return self._db.execute(
            "UPDATE leases SET holder=?, until=? WHERE name=? AND (holder=? OR until<?)",
            (holder, now + seconds, name, holder, now)).rowcount == 1

    def give_up(self, name: str, holder: str) -> None:
        """End ``holder``'s lease now (a replica shutting down), so another takes it at once."""
        self._db.execute("UPDATE leases SET until=0 WHERE name=? AND holder=?", (name, holder))

    def holder(self, name: str) -> str | None:
        """Who holds the lease now, if anyone."""
        r = self._db.execute("SELECT holder FROM leases WHERE name=? AND until>=?",
                             (name, time.time())).fetchone()
        return r["holder"] if r else None
