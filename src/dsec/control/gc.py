"""The server's garbage collector: every collector (``store.gc.Collector``) run in the
background every ``gc_interval_s``, never on a request's path, and on demand (``dsec gc``,
``POST /v1/admin/gc``).

In a cluster the replicas share the state store and the image store; their *shared*
collectors (records, the log, image layers) run on the one replica holding the ``gc`` lease (``store.lease``), taken and renewed before
each collection, so one replica collects at a time with no lock server. A lease that lapses
while its holder stalls lets a second replica start while the first finishes: removals are
conditional deletes, counted by whoever removed them, so nothing is removed or counted twice.
*Local* collectors (this host's files: blobs) run on every replica.

What each collection removed is counted in ``/metrics`` (``dsec_gc_removed_total`` and
``dsec_gc_removed_bytes_total`` by kind) and logged; a collector that fails is logged and
counted (``dsec_gc_failures_total``) and the others still run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter

from ..protocol.gc_models import GcReport, Removed
from ..store.gc import Collector
from ..store.lease import Leases

log = logging.getLogger("dsec.gc")
LEASE = "gc"


class GarbageCollector:
    def __init__(self, leases: Leases, shared: Sequence[Collector], local: Sequence[Collector],
                 interval_s: float, registry: CollectorRegistry) -> None:
        self.leases = leases
        self.shared = list(shared)
        self.local = list(local)
        self.interval_s = interval_s
        self.holder = "gc-" + secrets.token_hex(8)  # this replica, for the lease
        self.lease_s = max(3 * interval_s, 30.0)
        self._task: asyncio.Task[None] | None = None
        self.removed = Counter("dsec_gc_removed_total", "Things garbage collection removed, by "
                               "kind", ["kind"], registry=registry)
        self.removed_bytes = Counter("dsec_gc_removed_bytes_total", "Bytes garbage collection "
                                     "removed, by kind (files on disk; the recorded text of "
                                     "rows)", ["kind"], registry=registry)
        self.failures = Counter("dsec_gc_failures_total", "Collections of a collector that "
                                "failed (logged; the others still ran)", ["collector"],
                                registry=registry)

    def start(self) -> None:
        self._task = asyncio.create_task(self._forever(), name="dsec-gc")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await asyncio.to_thread(self.leases.give_up, LEASE, self.holder)
        finally:
            self.leases.close()

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.collect(time.time(), dry_run=False, shared=await self._lead())
            except Exception:  # the loop must outlive any single failure
                log.exception("garbage collection failed")

    async def _lead(self) -> bool:
        """Whether this replica holds the lease (taken or renewed now)."""
        return await asyncio.to_thread(self.leases.take, LEASE, self.holder, self.lease_s)

    async def collect(self, now: float, dry_run: bool, shared: bool = True) -> GcReport:
        """One collection of every local collector, and of the shared ones with ``shared``;
        what it removed (or, ``dry_run``, would remove), by kind."""
        totals: dict[str, list[int]] = {}
        for collector in (self.shared if shared else []) + self.local:
            try:
                removed = await collector.collect(now, dry_run)
            except Exception:
                self.failures.labels(collector.name).inc()
                log.exception("garbage collector %s failed", collector.name)
                continue
            for r in removed:
                total = totals.setdefault(r.kind, [0, 0])
                total[0] += r.count
                total[1] += r.bytes
                if not dry_run:
                    self.removed.labels(r.kind).inc(r.count)
                    self.removed_bytes.labels(r.kind).inc(r.bytes)
                if r.count:
                    log.info("gc %s %d %s (%d bytes)", "would remove" if dry_run else "removed",
                             r.count, r.kind, r.bytes,
                             extra={"kind": r.kind, "count": r.count, "bytes": r.bytes,
                                    "dry_run": dry_run})
        return GcReport(dry_run=dry_run, removed=[Removed(kind=k, count=n, bytes=b)
                                                  for k, (n, b) in totals.items()])
