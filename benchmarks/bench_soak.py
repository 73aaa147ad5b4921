"""``dsec bench --only soak [--cycles N]``: does a server that runs sandbox after sandbox keep
its resources flat (issue 18)?

A private server with retention set short (``SERVER_ARGS``: ended records kept 10 s,
trajectories 20 s, blobs 10 s past their last write, a collection every 5 s, no warm pool)
runs ``N`` (default 20,000; ``--quick`` 200) cycles of create → run → stop of container
sandboxes of IMAGE, ``CONCURRENCY`` at a time, in ten segments. Every ``TRAJECTORY_EVERY``-th
cycle is attached to a trajectory and prints about 5 KB (above the log's inline limit: a blob);
half of those trajectories are deleted after the stop, the other half left to the trajectory
TTL, so both collectors and the blob sweep run all along. The other cycles run ``echo``.

Before the first segment (after a warm-up) and after each (its cycles finished, none in
flight), the server is sampled: its process's RSS, open fds and the processes in its session;
the loop devices backed by files under its state dir and the mounts under it (as its mount
namespace shows them); the state store's SQLite database and, apart, its log (WAL and
shared-memory files, which may end anywhere under their bound); the blob store (bytes of
their files). A curve ended flat if its last sample is at most
``FLAT_TOLERANCE`` plus its slack above the median of its second half; its change per 1,000
cycles over the second half is printed beside, since a slow leak on a large base can pass the
first test on a short run. A report, not an assertion (a smoke run counts the cycles'
failures, never the figures).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import statistics
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dsec.client.aio import DSecClient
from dsec.images.store import ImageStore
from dsec.store.walcheckpoint import BACKSTOP_PAGES

from .bench import BENCH_ROOT, IMAGE, Sample, bench_server, phase
from .server_host import Host, server_host

CONCURRENCY = 16
TRAJECTORY_EVERY = 10
SERVER_ARGS = ("--warm-pool", "0", "--retain-ended-s", "10", "--retain-failed-s", "10",
               "--trajectory-ttl-s", "20", "--blob-grace-s", "10", "--gc-interval-s", "5")
FLAT_TOLERANCE = 0.05  # of the second half's median, plus the curve's slack (in its unit)
MB = 1e6
WAL_BOUND_MB = BACKSTOP_PAGES * (4096 + 24) / MB  # frames of a page and its header
SAMPLE_S, SAMPLE_READINGS = 2.0, 20  # a sampling: the least of 20 readings over 2 s


@dataclass(frozen=True)
class Curve:
    name: str
    column: str  # its heading in the table of samples
    unit: str
    slack: float  # in ``unit``: what a flat curve may end above its second half's median
    measure: Callable[[Host], float]  # the value now


def _files_mb(paths: list[Path]) -> float:
    total = 0
    for path in paths:
        with suppress(OSError):  # a blob the sweep just renamed aside or removed
            total += path.stat().st_size
    return total / MB


CURVES = (
    Curve("server RSS", "RSS MB", "MB", 1, lambda host: host.rss_kb() * 1024 / MB),
    Curve("server open fds", "fds", "", 2, Host.fds),
    Curve("processes in the server's session", "procs", "", 2, Host.session_processes),
    Curve("loop devices under the state dir", "loops", "", 2, Host.loops),
    Curve("mounts under the state dir", "mounts", "", 2, Host.mounts),
    Curve("state database", "db MB", "MB", 1, lambda host: _files_mb([host.state / "state.db"])),
    # The log is reused, not shrunk, after a checkpoint: it ends at the longest its checkpoint
    # thread let it grow in a burst of commits, which its backstop bounds (store/walcheckpoint.py).
    Curve("state database's log (wal + shm)", "log MB", "MB", WAL_BOUND_MB,
          lambda host: _files_mb([host.state / "state.db-wal", host.state / "state.db-shm"])),
    Curve("blob store", "blobs MB", "MB", 0.25,
          lambda host: _files_mb([p for p in (host.state / "blobs").rglob("*") if p.is_file()])),
)


@dataclass
class Point:
    """One sampling of the server, after ``cycle`` cycles."""
    cycle: int
    elapsed_s: float  # of cycling (the segments so far), samplings left out
    cycles_per_s: float  # over the segment that ended here
    failures: int  # in that segment
    values: list[float]  # one per curve of CURVES


async def _cycle(client: DSecClient, tag: str, i: int) -> float:
    """ms of one create → run → stop (and, for half the trajectories, their delete)."""
    t0 = time.perf_counter()
    trajectory = f"soak/{tag}/{i}" if i % TRAJECTORY_EVERY == 0 else None
    sb = await client.create(image=IMAGE, ttl_s=120, trajectory=trajectory)
    try:
        marker = f"cycle {i}"
        result = await sb.run(f"echo {marker}; seq 1200" if trajectory else f"echo {marker}")
        if result.exit_code != 0 or not result.stdout_bytes.startswith(marker.encode()):
            raise RuntimeError(f"{marker}: exit {result.exit_code}, {result.stdout_bytes[:80]!r}")
    finally:
        await sb.stop()
    if trajectory and i % (2 * TRAJECTORY_EVERY) == 0:
        await client.delete_trajectory(trajectory)
    return (time.perf_counter() - t0) * 1000


async def _segment(client: DSecClient, tag: str, first: int, end: int,
                   concurrency: int) -> list[float | BaseException]:
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> float:
        async with gate:
            return await _cycle(client, tag, i)

    return await asyncio.gather(*(gated(i) for i in range(first, end)), return_exceptions=True)


async def _sample(host: Host) -> list[float]:
    """Each curve's least value over ``SAMPLE_S``: what a leak holds stays, what the server
    lets go of just after the cycles (a stopped sandbox's removal, which runs after its stop
    answered; the disk stock refilling its loop devices and their fds) does not. A single
    reading put those curves anywhere between 8 and 20 loop devices and 66 and 86 fds from one
    sampling to the next, and a run ended "not flat" on that noise alone."""
    least = [float(curve.measure(host)) for curve in CURVES]
    for _ in range(SAMPLE_READINGS - 1):
        await asyncio.sleep(SAMPLE_S / SAMPLE_READINGS)
        least = [min(v, float(curve.measure(host))) for v, curve in zip(least, CURVES)]
    return least


@dataclass
class Ending:
    """How a curve ended."""
    curve: Curve
    values: list[float]  # one per sampling
    median: float  # of its second half
    per_1000: float  # its change per 1,000 cycles over the second half
    flat: bool  # the last value is at most FLAT_TOLERANCE + the curve's slack above ``median``

    @classmethod
    def of(cls, curve: Curve, cycles: list[int], values: list[float]) -> Ending:
        half = len(values) // 2
        median = statistics.median(values[half:])
        return cls(curve, values, median,
                   (values[-1] - values[half]) * 1000 / max(1, cycles[-1] - cycles[half]),
                   values[-1] <= median * (1 + FLAT_TOLERANCE) + curve.slack)


async def soak_series(console: Console, quick: bool = False, cycles: int | None = None,
                      concurrency: int = CONCURRENCY) -> list[Sample]:
    n = cycles or (200 if quick else 20_000)
    ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    state = root / "soak"
    tag = secrets.token_hex(3)
    latency = Sample("create → run → stop cycle", [])
    points: list[Point] = []
    try:
        async with bench_server(state, *SERVER_ARGS) as server:
            host, client = await server_host(server, state), server.client
            warm_up = Sample("warm-up", [])  # agent binary, layer mounts, page cache
            warm_up.add(await _segment(client, f"{tag}-warm-up", 0, concurrency, concurrency))
            if warm_up.failures:
                raise RuntimeError(f"{warm_up.failures} warm-up cycles failed: {warm_up.errors}")
            points.append(Point(0, 0.0, 0.0, 0, await _sample(host)))
            cycling = 0.0  # seconds of the segments, not of the samplings between them
            with phase(console, f"soak: {n} create/run/stop cycles at concurrency {concurrency}"):
                for k in range(10):
                    first, end = n * k // 10, n * (k + 1) // 10
                    t0, failed = time.perf_counter(), latency.failures
                    latency.add(await _segment(client, tag, first, end, concurrency))
                    segment_s = time.perf_counter() - t0
                    cycling += segment_s
                    points.append(Point(end, cycling, (end - first) / segment_s,
                                        latency.failures - failed, await _sample(host)))
                    console.print(f"[dim]  {end} cycles, {points[-1].cycles_per_s:.1f}/s, "
                                  f"{latency.failures} failed[/dim]")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cycles_at = [p.cycle for p in points]
    endings = [Ending.of(curve, cycles_at, [p.values[c] for p in points])
               for c, curve in enumerate(CURVES)]
    _report(console, points, endings)
    latency.extra = dict(cycles=n, concurrency=concurrency, trajectory_every=TRAJECTORY_EVERY,
                         server_args=list(SERVER_ARGS), elapsed_s=points[-1].elapsed_s,
                         cycles_per_s=n / points[-1].elapsed_s)
    samples = [latency, Sample("cycles per second, by segment (not ms)",
                               [p.cycles_per_s for p in points[1:]])]
    for e in endings:
        samples.append(Sample(f"{e.curve.name} ({e.curve.unit or 'count'}, not ms)", e.values,
                              extra=dict(at_cycle=cycles_at, first=e.values[0], last=e.values[-1],
                                         median_second_half=e.median,
                                         second_half_per_1000_cycles=e.per_1000, flat=e.flat,
                                         slack=e.curve.slack, tolerance=FLAT_TOLERANCE)))
    return samples


def _report(console: Console, points: list[Point],
            endings: list[Ending]) -> None:
    table = Table("cycles", "s", "cycles/s", "fail",
                  *(c.column for c in CURVES),
                  title="soak: the server after each tenth of the cycles")
    for p in points:
        table.add_row(str(p.cycle), f"{p.elapsed_s:.0f}", f"{p.cycles_per_s:.1f}",
                      str(p.failures), *(_value(v) for v in p.values))
    console.print(table)
    flat_table = Table("curve", "first", "median of the second half", "last",
                       "second half, per 1,000 cycles", "ended flat",
                       title=f"soak: flat if the last is at most {FLAT_TOLERANCE:.0%} + slack "
                             "above the second half's median")
    for e in endings:
        flat_table.add_row(f"{e.curve.name} ({e.curve.unit or 'count'}; slack {e.curve.slack:g})",
                           _value(e.values[0]), _value(e.median), _value(e.values[-1]),
                           f"{e.per_1000:+.2f}", "yes" if e.flat else "[red]no[/red]")
    console.print(flat_table)


def _value(v: float) -> str:
    return f"{v:.0f}" if v.is_integer() else f"{v:.2f}"
