"""The state store on both backends: embedded SQLite and PostgreSQL (a real server from the
apt package), through the one interface the edge and the trajectory log use."""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from dsec.store.db import IntegrityError
from dsec.store.local_postgres import LocalPostgres
from dsec.store.projects import NameTaken, ProjectStore
from dsec.store.sqlite import SandboxRow, SnapshotRow, StateStore
from dsec.store.templates import TemplateStore


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
    store.mark_running("sb-e1-a", {"pid": 42}, 1e10)
    got = store.get_sandbox("sb-e1-a")
    assert got is not None and got.state == "running" and got.runtime == {"pid": 42}
    assert got.expires_at == 1e10
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


def test_project_quotas_hold_between_two_servers(store: StateStore) -> None:
    """Two API servers on one store (as scaled out) share the project quotas: delegation and
    admission are checked in the database, so racing reservations never overshoot."""
    a, b = (ProjectStore(store.url, "root", (10, 10_000, 10_000, 10_000)) for _ in range(2))
    try:
        assert a.create("team", "root", (3, 3_000, 3_000, 0))
        assert not b.create("big", "root", (8, 1_000, 1_000, 0))  # root has 7 sandboxes left
        with pytest.raises(NameTaken):
            b.create("team", "root", (1, 1, 1, 0))
        with ThreadPoolExecutor(8) as pool:
            taken = list(pool.map(lambda i: (a, b)[i % 2].reserve("team", 100, 100), range(8)))
        held = [r for r in taken if r is not None]
        assert len(held) == 3 and b.get("team").used == (3, 300, 300, 0)  # type: ignore[union-attr]
        assert b.set_quota("team", (2, 3_000, 3_000, 0)) == "team"  # it holds 3: cannot shrink
        assert a.release(held[0]) and not b.release(held[0])  # given back once
        assert a.get("team").used == (2, 200, 200, 0)  # type: ignore[union-attr]
        assert a.get("root").delegated == (3, 3_000, 3_000, 0)  # type: ignore[union-attr]
    finally:
        a.close()
        b.close()


def test_a_database_of_before_snapshot_quotas_and_ttls_gains_their_columns(
        store: StateStore) -> None:
    """A state database made before snapshot quotas and TTLs: opening it adds the columns,
    the root project keeps no limit on snapshots, a child gets none until delegated."""
    url = store.url
    store.close()
    old = StateStore(url)
    with old._db.transaction():
        for statement in ("DROP TABLE IF EXISTS snapshot_holds", "DROP TABLE IF EXISTS projects",
                          "ALTER TABLE snapshots DROP COLUMN expires_at"):
            old._db.execute(statement)
    old._db.execute("CREATE TABLE projects (name TEXT PRIMARY KEY, parent TEXT, max_sandboxes "
                    "BIGINT NOT NULL, max_cpu_milli BIGINT NOT NULL, max_memory_mb BIGINT NOT "
                    "NULL, delegated_sandboxes BIGINT NOT NULL DEFAULT 0, delegated_cpu_milli "
                    "BIGINT NOT NULL DEFAULT 0, delegated_memory_mb BIGINT NOT NULL DEFAULT 0, "
                    "used_sandboxes BIGINT NOT NULL DEFAULT 0, used_cpu_milli BIGINT NOT NULL "
                    "DEFAULT 0, used_memory_mb BIGINT NOT NULL DEFAULT 0, created_at DOUBLE "
                    "PRECISION NOT NULL)")
    old._db.execute("INSERT INTO projects (name, parent, max_sandboxes, max_cpu_milli, "
                    "max_memory_mb, created_at) VALUES ('root', NULL, 10, 10000, 10000, 0)")
    old._db.execute("INSERT INTO projects (name, parent, max_sandboxes, max_cpu_milli, "
                    "max_memory_mb, created_at) VALUES ('kid', 'root', 1, 1000, 1000, 0)")
    old.close()
    reopened = StateStore(url)
    projects = ProjectStore(url, "root", (10, 10_000, 10_000, 1 << 40))
    try:
        assert projects.get("root").quota == (10, 10_000, 10_000, 1 << 40)  # type: ignore[union-attr]
        assert projects.get("kid").quota == (1, 1000, 1000, 0)  # type: ignore[union-attr]
        assert projects.hold_snapshot("kid", 1) is None and projects.hold_snapshot("root", 1)
        assert reopened.snapshots() == [] and reopened.expired_snapshots("e1", time.time()) == []
    finally:
        projects.close()
        reopened.close()


def test_a_database_of_before_inheritance_gains_its_column_and_keeps_its_snapshots(
        store: StateStore) -> None:
    """A snapshot recorded before children inherited (no ``inherited`` column) is read with
    none (edge/inherit.py falls back to its parent's record); one recorded now keeps what its
    children inherit, the network policy and environment as they were."""
    url = store.url
    store.close()
    old = StateStore(url)
    old._db.execute("ALTER TABLE snapshots DROP COLUMN inherited")
    old._db.execute("INSERT INTO snapshots (id, edge, sandbox_id, substrate, image, image_digest, "
                    "mode, disk_mb, size_bytes, created_at) VALUES ('sn-e1-old', 'e1', 'sb-e1-a', "
                    "'container', 'debian-minbase', 'sha256:ab', 'filesystem', 64, 1, 0)")
    old.close()
    reopened = StateStore(url)
    try:
        kept = {"cpu": 0.5, "memory_mb": 192, "network": {"services": {}, "allow": ["10.1.2.3:443"]},
                "env": {"STAGE": "prepared"}, "runtime": None}
        reopened.insert_snapshot(SnapshotRow("sn-e1-new", "e1", "sb-e1-a", "container",
                                             "debian-minbase", "sha256:ab", "filesystem", 64, 1,
                                             time.time(), inherited=kept))
        assert reopened.get_snapshot("sn-e1-old").inherited is None  # type: ignore[union-attr]
        assert reopened.get_snapshot("sn-e1-new").inherited == kept  # type: ignore[union-attr]
        assert [s.inherited for s in reopened.snapshots()] == [None, kept]
    finally:
        reopened.close()


def test_two_first_builds_of_one_e2b_template_at_once_make_one(store: StateStore) -> None:
    """Two API servers (each its own connection) start the first build of one alias at the
    same moment: one template, the build of whichever wrote last, no error for either (on
    PostgreSQL a read-then-insert raced into a unique violation)."""
    barrier = threading.Barrier(8)
    ids: list[str] = []

    def build(n: int) -> None:
        templates = TemplateStore(store.url)
        try:
            barrier.wait()
            ids.append(templates.request("a", "tpl", f"tpl-{n}", f"b{n}", ["default"], 2,
                                         512).template_id)
        finally:
            templates.close()

    threads = [threading.Thread(target=build, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    templates = TemplateStore(store.url)
    (only,) = templates.of_project("a")
    templates.close()
    assert len(ids) == 8 and set(ids) == {only.template_id}
    assert only.build_id in {f"b{n}" for n in range(8)} and only.status == "waiting"
