"""Garbage collection by several API replicas sharing one real PostgreSQL: the GC lease lets
one replica collect at a time, and even replicas collecting at once (a lease that lapsed
while its holder stalled) remove and count each record exactly once."""

from __future__ import annotations

import asyncio
import secrets
import time

from prometheus_client import CollectorRegistry

from dsec.control.collectors import SandboxRecords
from dsec.control.gc import LEASE, GarbageCollector
from dsec.store.blobs import BlobStore
from dsec.store.lease import Leases
from dsec.store.local_postgres import LocalPostgres
from dsec.store.projects import ProjectStore
from dsec.store.sqlite import SandboxRow, StateStore
from dsec.trajectory.log import TrajectoryLog

DAY = 86400.0
N = 1200  # more than two batches


def ended_sandboxes(store: StateStore, n: int) -> None:
    old = time.time() - 30 * DAY
    for i in range(n):
        sandbox_id = f"sb-pg-{secrets.token_hex(6)}-{i}"
        store.insert_sandbox(SandboxRow(id=sandbox_id, edge="e1", substrate="container",
                                        image="debian-minbase", image_digest="sha256:x",
                                        state="running", request={}, runtime={"pid": 1},
                                        created_at=old, expires_at=old))
        store.event("created", sandbox_id)
        store.mark_ended(sandbox_id, "stopped", "test")
    store._db.execute("UPDATE sandboxes SET ended_at=?", (old,))


def replica(url: str, interval_s: float) -> tuple[GarbageCollector, CollectorRegistry]:
    registry = CollectorRegistry()
    records = SandboxRecords(url, retain_ended_s=7 * DAY, retain_failed_s=7 * DAY)
    return GarbageCollector(Leases(url), [records], [], interval_s, registry), registry


def removed(registry: CollectorRegistry, kind: str) -> float:
    return registry.get_sample_value("dsec_gc_removed_total", {"kind": kind}) or 0.0


def test_replicas_remove_each_record_once(local_postgres: LocalPostgres, tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = local_postgres.fresh_database("gc_" + secrets.token_hex(3))
    store = StateStore(url)
    TrajectoryLog(url, BlobStore(tmp_path / "blobs"), owner="t").close()  # their tables
    ProjectStore(url, "default", (10, 10, 10, 10))
    ended_sandboxes(store, N)
    (a, ra), (b, rb) = replica(url, 0.2), replica(url, 0.2)

    async def background() -> None:
        """Both replicas' loops run; the lease lets one of them collect."""
        a.start()
        b.start()
        deadline = time.monotonic() + 120
        while store.sandboxes():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        holder = Leases(url).holder(LEASE)
        await a.close()
        await b.close()
        assert holder in (a.holder, b.holder)

    asyncio.run(background())
    counts = sorted([removed(ra, "sandboxes"), removed(rb, "sandboxes")])
    assert counts == [0, N]  # one replica held the lease throughout and removed them all
    assert removed(ra, "events") + removed(rb, "events") == N

    ended_sandboxes(store, N)

    windows: list[tuple[float, float]] = []

    async def timed(gc: GarbageCollector) -> int:
        started = time.monotonic()
        report = await gc.collect(time.time(), False)
        windows.append((started, time.monotonic()))
        return next(r.count for r in report.removed if r.kind == "sandboxes")

    async def at_once() -> list[int]:
        """A lapsed lease: both collect the same backlog at the same time."""
        return list(await asyncio.gather(timed(a), timed(b)))

    both = asyncio.run(at_once())
    assert max(w[0] for w in windows) < min(w[1] for w in windows)  # they did overlap
    assert sum(both) == N and store.sandboxes() == []
    assert removed(ra, "sandboxes") + removed(rb, "sandboxes") == 2 * N
    assert removed(ra, "events") + removed(rb, "events") == 2 * N
