"""Garbage collection's parts on a real SQLite state store and a real blob area: the lease,
the records collector (retention, what keeps a record, batches, dry runs), the blob sweep
racing real writers, and what a sandbox can put in front of the collector."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from dsec.control.collectors import BATCH, SandboxRecords, UnreferencedBlobs
from dsec.protocol.digest import StepRequest
from dsec.store.blobs import BlobStore
from dsec.store.idempotency import IdempotencyStore
from dsec.store.lease import Leases
from dsec.store.projects import ProjectStore
from dsec.store.sqlite import SandboxRow, SnapshotRow, StateStore
from dsec.trajectory.log import INLINE_MAX, TrajectoryLog, step_blob_refs

DAY = 86400.0


@pytest.fixture
def state(tmp_path: Path) -> tuple[StateStore, TrajectoryLog, ProjectStore]:
    store = StateStore(tmp_path / "state.db")
    log = TrajectoryLog(store.url, BlobStore(tmp_path / "blobs"), owner="test")
    projects = ProjectStore(store.url, "default", (1000, 10**6, 10**6, 10**9))
    return store, log, projects


def sandbox(store: StateStore, sandbox_id: str, ended_ago: float | None, ran: bool = True) -> None:
    now = time.time()
    store.insert_sandbox(SandboxRow(id=sandbox_id, edge="e1", substrate="container",
                                    image="debian-minbase", image_digest="sha256:x",
                                    state="running", request={"ttl_s": 60},
                                    runtime={"pid": 1} if ran else {}, created_at=now - 30 * DAY,
                                    expires_at=now + DAY))
    store.event("created", sandbox_id, image="debian-minbase")
    if ended_ago is not None:
        store.mark_ended(sandbox_id, "stopped" if ran else "died", "test")
        store._db.execute("UPDATE sandboxes SET ended_at=? WHERE id=?", (now - ended_ago, sandbox_id))


def ids(store: StateStore) -> set[str]:
    return {row.id for row in store.sandboxes()}


def collect(collector: SandboxRecords | UnreferencedBlobs, dry_run: bool = False,
            now: float | None = None) -> dict[str, tuple[int, int]]:
    removed = asyncio.run(collector.collect(time.time() if now is None else now, dry_run))
    return {r.kind: (r.count, r.bytes) for r in removed}


# the lease
def test_one_holder_at_a_time_and_a_lapsed_lease_is_taken_over(tmp_path: Path) -> None:
    a, b = Leases(tmp_path / "state.db"), Leases(tmp_path / "state.db")
    assert a.take("gc", "A", 0.5)
    assert not b.take("gc", "B", 0.5)
    assert a.take("gc", "A", 0.5)  # renewed
    assert a.holder("gc") == "A"
    time.sleep(0.6)
    assert b.take("gc", "B", 30)
    assert not a.take("gc", "A", 30)
    b.give_up("gc", "B")
    assert a.take("gc", "A", 30)


def test_racing_replicas_never_both_hold_the_lease(tmp_path: Path) -> None:
    holders: list[set[str]] = [set() for _ in range(200)]
    failures: list[BaseException] = []

    def replica(name: str) -> None:
        try:
            leases = Leases(tmp_path / "state.db")
            for attempt in range(200):
                if leases.take(f"gc-{attempt}", name, 60):
                    holders[attempt].add(name)
        except BaseException as e:  # noqa: BLE001 - a replica that died proves nothing
            failures.append(e)

    threads = [threading.Thread(target=replica, args=(f"r{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert all(len(h) == 1 for h in holders)


# the records
def test_ended_records_and_events_go_after_retention_live_and_named_ones_stay(state) -> None:
    store, log, projects = state
    sandbox(store, "sb-old", ended_ago=8 * DAY)
    sandbox(store, "sb-recent", ended_ago=DAY)
    sandbox(store, "sb-live", ended_ago=None)
    sandbox(store, "sb-traj", ended_ago=8 * DAY)
    sandbox(store, "sb-parent", ended_ago=8 * DAY)
    sandbox(store, "sb-unreleased", ended_ago=8 * DAY)
    sandbox(store, "sb-failed", ended_ago=2 * DAY, ran=False)
    log.create("t1", "sb-traj", {}, "debian-minbase", "sha256:x", None)
    store.insert_snapshot(SnapshotRow("sn-1", "e1", "sb-parent", "container", "debian-minbase",
                                      "sha256:x", "full", 64, 100, time.time()))
    projects.bind(projects.reserve("default", 1000, 64), "sb-unreleased")
    released = projects.reserve("default", 1000, 64)
    projects.bind(released, "sb-old")
    projects.release(released)
    store.event("snapshot_deleted", None, snapshot="sn-0")
    store._db.execute("UPDATE events SET at=? WHERE sandbox_id IS NULL", (time.time() - 8 * DAY,))
    keys = IdempotencyStore(store.url)
    for made in ("sb-old", "sb-live"):
        assert keys.claim("default", f"key-{made}", "digest", "server", 15, DAY).state == "claimed"
        assert keys.complete("default", f"key-{made}", "server", made)

    collector = SandboxRecords(store.url, retain_ended_s=7 * DAY, retain_failed_s=DAY)
    before = ids(store)
    dry = collect(collector, dry_run=True)
    assert ids(store) == before
    assert dry["sandboxes"][0] == 1 and dry["failed_creates"][0] == 1
    assert dry["events"][0] == 3  # two records' "created", one edge event
    assert dry["idempotency_keys"][0] == 1  # the key that made sb-old

    assert collect(collector) == dry
    assert ids(store) == before - {"sb-old", "sb-failed"}
    assert store.events("sb-old") == [] and store.events("sb-failed") == []
    assert store.events("sb-live") and store.events("sb-traj")
    assert projects.project_of("sb-old") is None  # its released reservation went with it
    assert projects.project_of("sb-unreleased") == "default"
    # the key went with its record: the same key claims afresh; the live sandbox's still holds
    assert keys.claim("default", "key-sb-old", "other", "server", 15, DAY).state == "claimed"
    assert keys.claim("default", "key-sb-live", "digest", "server", 15, DAY).sandbox_id == "sb-live"
    assert collect(collector) == {"sandboxes": (0, 0), "failed_creates": (0, 0), "events": (0, 0),
                                  "idempotency_keys": (0, 0)}

    log.delete("t1")
    store.delete_snapshot("sn-1")
    assert collect(collector)["sandboxes"][0] == 2  # nothing names them any more


def test_a_huge_event_backlog_goes_in_batches(state) -> None:
    """A sandbox that made many events (every exec, pause and snapshot is one) is collected
    whole, a batch per statement."""
    store, _, _ = state
    sandbox(store, "sb-busy", ended_ago=8 * DAY)
    n = 5 * BATCH + 7
    store._db.execute("INSERT INTO events (at, sandbox_id, kind, detail) "
                      "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM c WHERE i<?) "
                      "SELECT ?, 'sb-busy', 'exec', '{\"x\": \"\\u0000../../\"}' FROM c",
                      (n, time.time()))
    removed = collect(SandboxRecords(store.url, 7 * DAY, 7 * DAY))
    assert removed["sandboxes"][0] == 1 and removed["events"][0] == n + 1
    assert store.events("sb-busy") == []


# blobs
def test_step_refs_are_read_only_where_the_log_writes_them() -> None:
    """A result's value is what the sandbox printed: a ref-looking dict there names nothing."""
    digest = "a" * 64
    forged = json.dumps({"value": {"bytes": {"x": {"sha256": "b" * 64}}, "sha256": "c" * 64},
                         "bytes": {"stdout": {"size": 9000, "sha256": digest},
                                   "stderr": {"size": 1, "b64": "eA=="}, "odd": "not-a-ref"}})
    request = StepRequest("write_file", {"path": "/x"}, b"p" * (INLINE_MAX + 1)).canonical
    assert set(step_blob_refs(request, forged)) == {
        digest, hashlib.sha256(b"p" * (INLINE_MAX + 1)).hexdigest()}
    assert list(step_blob_refs(json.dumps({"payload": None}), None)) == []


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_unreferenced_blobs_go_after_the_grace_named_ones_stay(state, tmp_path: Path) -> None:
    _, log, _ = state
    blobs = log.blobs
    named = StepRequest("write_file", {"path": "/x"}, b"n" * 5000)
    log.create("t1", "sb-1", {}, "debian-minbase", "sha256:x", None)
    assert log.claim("t1", 1, 1, named, "sb-1", None)
    old, young = blobs.put(b"o" * 5000), blobs.put(b"y" * 5000)
    age(blobs.path(old), 120)
    age(blobs.path(hashlib.sha256(named.payload or b"").hexdigest()), 120)
    collector = UnreferencedBlobs(log, blobs, grace_s=60)
    assert collect(collector, dry_run=True) == {"blobs": (1, 5000)}
    assert blobs.path(old).exists()
    assert collect(collector) == {"blobs": (1, 5000)}
    assert not blobs.path(old).exists() and blobs.path(young).exists()
    assert log.request_of(log.steps("t1", 1)[0]).payload == named.payload


def test_a_blob_written_again_while_the_collector_runs_is_never_lost(state) -> None:
    """The dangerous case, raced for real: blobs that exist, old and unreferenced, are
    written again by steps that commit while collectors sweep over and over. Every
    committed step's blob must be there at the end."""
    _, log, _ = state
    blobs = log.blobs
    contents = [os.urandom(8) * 700 for _ in range(300)]
    for data in contents:
        age(blobs.path(blobs.put(data)), 600)
    log.create("t1", "sb-1", {}, "debian-minbase", "sha256:x", None)
    stop = threading.Event()
    removed: list[int] = []

    def sweeper() -> None:
        collector = UnreferencedBlobs(log, blobs, grace_s=300)
        while not stop.is_set():
            removed.append(collect(collector)["blobs"][0])

    def writer(part: int) -> None:
        for step, data in enumerate(contents[part::2], start=1):
            assert log.claim("t1", 1, 2 * step + part, StepRequest("write_file", {}, data),
                             "sb-1", None)

    sweepers = [threading.Thread(target=sweeper) for _ in range(2)]
    for t in sweepers:
        t.start()
    writers = [threading.Thread(target=writer, args=(part,)) for part in (0, 1)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in sweepers:
        t.join()
    assert sum(removed) > 0, "the sweepers removed nothing: no race happened"
    for row in log.steps("t1", 1):
        assert log.request_of(row).payload is not None  # each committed step reads its blob
    assert sum(removed) + len(log.steps("t1", 1)) >= len(contents)


def test_the_sweep_skips_what_it_did_not_write_and_never_recurses(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    kept = blobs.put(b"k" * 10)
    fan = blobs.path(kept).parent
    deep = fan / ("d" * 64)
    (deep / "x" / "y").mkdir(parents=True)  # a directory where a blob would be
    (fan / ("e" * 64)).symlink_to("/etc/passwd")
    (fan / "not-a-digest").write_text("x")
    (blobs.root / "sha256" / "zz").mkdir()
    (blobs.root / "sha256" / "zz" / ("f" * 64)).write_text("x")
    (blobs.root / "sha256" / "ab").symlink_to("/etc")
    for p in (blobs.path(kept), fan / "not-a-digest", blobs.root / "sha256" / "zz" / ("f" * 64)):
        age(p, 600)
    assert [d for d, _ in blobs.candidates(time.time())] == [kept]
    assert Path("/etc/passwd").exists() and deep.is_dir()


def test_a_sweep_cut_short_is_undone_by_the_next(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    digest = blobs.put(b"a" * 10)
    path = blobs.path(digest)
    os.rename(path, path.with_name(f".gc.{digest}.dead"))  # the collector died here
    assert blobs.get(digest) == b"a" * 10  # a reader meanwhile still reads it
    assert list(blobs.candidates(time.time() - 60)) == []
    assert path.read_bytes() == b"a" * 10


# trajectories
def test_a_trajectory_expires_by_its_own_ttl_else_the_servers(state) -> None:
    _, log, _ = state
    log.create("own", "sb-1", {"trajectory_ttl_s": 10}, "debian-minbase", "sha256:x", None)
    log.create("default", "sb-2", {}, "debian-minbase", "sha256:x", None)
    log.branch("own", 1, 0, "own/fork", "sb-3", {"trajectory_ttl_s": 10}, "debian-minbase",
               "sha256:x", None)
    now = time.time()
    assert log.expired(now + 5, 0, 100) == []
    assert set(log.expired(now + 11, 0, 100)) == {"own", "own/fork"}  # no server TTL
    assert log.expired(now + 5, 3, 100) == ["default"]
    assert set(log.expired(now + 11, 3, 100)) == {"own", "own/fork", "default"}
    assert len(log.expired(now + 11, 3, 2)) == 2
