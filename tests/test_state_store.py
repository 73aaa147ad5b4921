"""The state store on both backends: embedded SQLite and PostgreSQL (a real server from the
apt package), through the one interface the edge and the trajectory log use."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from dsec.store.db import IntegrityError
from dsec.store.local_postgres import LocalPostgres
from dsec.store.sqlite import SandboxRow, StateStore


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    if request.param == "sqlite":
        s = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    else:
        pg: LocalPostgres = request.getfixturevalue("local_postgres")
        s = StateStore(pg.fresh_database("store_" + secrets.token_hex(3)))
    yield s
    s.close()


def row(sandbox_id: str, edge: str = "e1") -> SandboxRow:
    now = time.time()
    return SandboxRow(id=sandbox_id, edge=edge, substrate="container", image="debian-minbase",
                      image_digest="sha256:ab", state="starting", request={"cpu": 1, "env": {}},
                      created_at=now, expires_at=now + 60)


def test_sandbox_rows_keys_and_events(store: StateStore) -> None:
    store.insert_sandbox(row("sb-e1-a"))
    store.insert_sandbox(row("sb-e2-b", edge="e2"))
    with pytest.raises(IntegrityError):
        store.insert_sandbox(row("sb-e1-a"))
    store.mark_running("sb-e1-a", {"pid": 42})
    got = store.get_sandbox("sb-e1-a")
    assert got is not None and got.state == "running" and got.runtime == {"pid": 42}
    assert abs(got.created_at - time.time()) < 600  # full float precision, not REAL(4)
    store.mark_ended("sb-e1-a", "died", "first")
    store.mark_ended("sb-e1-a", "stopped", "second")  # the first recorded end wins
    assert store.get_sandbox("sb-e1-a").reason == "first"  # type: ignore[union-attr]
    assert [r.id for r in store.sandboxes(live_only=True)] == ["sb-e2-b"]
    assert [r.id for r in store.sandboxes(edge="e1")] == ["sb-e1-a"]

    key_id, secret, _ = store.create_key("ci")
    assert store.key_for_secret(secret) == key_id and store.key_for_secret("nope") is None
    assert [k["name"] for k in store.keys()] == ["ci"]
    store.event("created", "sb-e2-b", warm=True, note="100%")  # a % must not be a placeholder
    assert store.events("sb-e2-b") == [("created", {"warm": True, "note": "100%"})]


def test_postgres_store_reconnects_after_losing_its_connection(local_postgres: LocalPostgres) -> None:
    url = local_postgres.fresh_database("reconnect_" + secrets.token_hex(3))
    store = StateStore(url)
    store.insert_sandbox(row("sb-e1-a"))
    with psycopg.connect(url, autocommit=True) as admin:  # what a server restart does to us
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    assert store.get_sandbox("sb-e1-a") is not None
    store.close()
