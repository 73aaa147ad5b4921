"""``dsec bench --only density`` and ``--only throughput`` (issue 15): how many idle container
sandboxes one node holds, and how fast it makes and ends them.

density: one private server (no warm pool, capacity above N) creates N (default 3,000;
``--quick`` 20) sandboxes of IMAGE, ``CONCURRENCY`` at a time, and keeps them idle. Measured:
each create's latency and the creates per second; the host's memory per sandbox (the fall of
MemAvailable over N, after a settle) beside what each sandbox's memory cgroup is charged; the
server's RSS and open fds and the host's processes and loop devices per sandbox (the limits a
node meets first); then ``echo`` in every one (each must answer with its own marker), then
every stop (latency, stops per second). Afterwards, what is left against the count before
the creates: mounts and loop devices under the server's state dir, its sandbox cgroups,
processes in its session, live rows in its state store. A create or exec that failed, a
sandbox that did not answer and a leftover are failures of the series (``dsec bench`` exits
non-zero); figures never are.

throughput: N (default 1,000; ``--quick`` 50) sandboxes through the SDK's ``create_many`` at
concurrency 64 (creates per second over the whole call), then stopped at the same
concurrency (each stop's latency, stops per second). The baseline, alternating with it: N
bare ``crun run --detach`` containers of ``sleep infinity`` on an overlay of the same layers
(bundle, mount, run), 64 at a time, then ``crun delete --force`` and the unmount of each.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from dsec.client.aio import Sandbox as AsyncSandbox
from dsec.images.store import ImageStore

from .bench import (
    BENCH_ROOT,
    IMAGE,
    Created,
    Sample,
    bare_workspace,
    bench_server,
    idle_memory,
    phase,
)
from .server_host import Host, meminfo_kb, server_host, steady

CONCURRENCY = 64
SETTLE_S = 5.0  # after the last create, before memory is read: the agents' start-up is over
T = TypeVar("T")
R = TypeVar("R")


def per_sandbox_mb(high_kb: int, low_kb: int, n: int) -> float:
    """MB per sandbox of ``n`` that a figure in kB moved by, between ``high_kb`` and
    ``low_kb`` (a fall of MemAvailable: before, after; a growth of RSS: after, before)."""
    return (high_kb - low_kb) * 1024 / 1e6 / max(1, n)


def excess(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What each count has above its value before the series: the series' leftovers."""
    return {name: after[name] - before.get(name, 0) for name in after
            if after[name] > before.get(name, 0)}


def host_processes() -> int:
    return sum(1 for _ in Path("/proc").glob("[0-9]*"))


def host_loops() -> int:
    return sum(1 for _ in Path("/sys/block").glob("loop*/loop/backing_file"))


def mem_available_kb() -> int:
    return meminfo_kb(Path("/proc/meminfo").read_text(), "MemAvailable")


async def gated(items: Sequence[T], fn: Callable[[T], Awaitable[R]],
                concurrency: int = CONCURRENCY) -> list[R | BaseException]:
    """``fn`` over ``items``, at most ``concurrency`` at once: each one's result (ms, mostly)
    or its failure."""
    gate = asyncio.Semaphore(concurrency)

    async def one(item: T) -> R:
        async with gate:
            return await fn(item)

    return await asyncio.gather(*(one(item) for item in items), return_exceptions=True)


async def _timed(call: Awaitable[object]) -> float:
    t0 = time.perf_counter()
    await call
    return (time.perf_counter() - t0) * 1000


async def _answers(sb: AsyncSandbox) -> float:
    t0 = time.perf_counter()
    marker = f"here {sb.id}"
    result = await sb.run(f"echo {marker}")
    if result.exit_code != 0 or result.stdout_bytes.strip() != marker.encode():
        raise RuntimeError(f"{sb.id} answered exit {result.exit_code}, "
                           f"{result.stdout_bytes[:80]!r}")
    return (time.perf_counter() - t0) * 1000


async def _stop_all(created: Created, stops: Sample) -> float:
    """Stop every sandbox of ``created``, timing each (their rate by tenth in ``stops``' row);
    seconds for all."""
    t0 = time.perf_counter()
    done_at: list[float] = []
    stops.add(await gated(created.sandboxes, lambda sb: _timed_at(sb.stop(), done_at)))
    stops.extra["per_second_by_tenth"] = by_tenth(done_at, t0)
    created.sandboxes = []
    return time.perf_counter() - t0


async def _warm_up(created: Created) -> None:
    """The agent binary, the layers' mounts, the golden disk, the page cache: once, untimed."""
    await created.first_output()
    await created.stop_all()


def _rate(name: str, n: int, seconds: float, baseline: Sample | None = None) -> Sample:
    """A rate as a one-value sample (per second, not ms)."""
    return Sample(name, [n / seconds], baseline=baseline, extra=dict(count=n, seconds=seconds))


def by_tenth(done_at: list[float], start: float) -> list[float]:
    """Per second over each tenth of the calls, in the order they ended (``done_at``: their
    end times): how the rate changes as the node fills (or empties)."""
    ends = sorted(done_at)
    rates, last = [], start
    for k in range(1, 11):
        chunk = ends[len(ends) * (k - 1) // 10:len(ends) * k // 10]
        if chunk:
            rates.append(len(chunk) / max(chunk[-1] - last, 1e-9))
            last = chunk[-1]
    return rates


async def _timed_at(call: Awaitable[object], done_at: list[float]) -> float:
    """``_timed``, also noting when the call ended."""
    ms = await _timed(call)
    done_at.append(time.perf_counter())
    return ms


async def density_series(console: Console, quick: bool = False,
                         count: int | None = None) -> list[Sample]:
    n = count or (20 if quick else 3000)
    ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    state = root / "density"
    creates = Sample(f"create, {n} kept idle, {CONCURRENCY} at a time", [])
    execs = Sample(f"echo in each of the {n}: answers", [])
    stops = Sample(f"stop, {n}, {CONCURRENCY} at a time", [])
    samples: list[Sample] = []
    try:
        async with bench_server(state, "--warm-pool", "0", "--capacity", str(n + 16)) as created:
            await _warm_up(created)
            host = await server_host(created, state)
            # After the warm-up, its sandbox's removal and the disk stock's refill of the disk
            # it took run in the background. Counted while they ran, the stock was a disk short
            # of what it held after the series, and a CI run reported it as a leftover.
            before = await steady(host.counts)
            mem0, rss0, fds0 = mem_available_kb(), host.rss_kb(), host.fds()
            procs0, loops0 = host_processes(), host_loops()

            done_at: list[float] = []

            async def create(_: int) -> float:
                t0 = time.perf_counter()
                created.sandboxes.append(await created.client.create(image=IMAGE, ttl_s=7200))
                done_at.append(time.perf_counter())
                return (done_at[-1] - t0) * 1000

            with phase(console, f"density: {n} creates, {CONCURRENCY} at a time"):
                t0 = time.perf_counter()
                creates.add(await gated(range(n), create))
                create_s = time.perf_counter() - t0
            creates.extra["per_second_by_tenth"] = by_tenth(done_at, t0)
            made = len(created.sandboxes)
            await asyncio.sleep(SETTLE_S)
            per_host = dict(
                host_mem_available_mb_per_sandbox=per_sandbox_mb(mem0, mem_available_kb(), made),
                server_rss_mb_per_sandbox=per_sandbox_mb(host.rss_kb(), rss0, made),
                server_fds_per_sandbox=(host.fds() - fds0) / max(1, made),
                host_processes_per_sandbox=(host_processes() - procs0) / max(1, made),
                host_loop_devices_per_sandbox=(host_loops() - loops0) / max(1, made))
            charged = Sample("memory charged to each idle sandbox's cgroup (MB, not ms)",
                             idle_memory(created))
            host_mb = Sample("host memory per idle sandbox: MemAvailable's fall (MB, not ms)",
                             [per_host["host_mem_available_mb_per_sandbox"]], extra=per_host)
            with phase(console, f"density: echo in each of the {made}"):
                execs.add(await gated(created.sandboxes, _answers))
            with phase(console, f"density: {made} stops"):
                stop_s = await _stop_all(created, stops)
            with phase(console, "density: the stopped sandboxes' removal"):
                left, removal_s = await _settled(host, before, timeout_s=60 + n / 10)
            stops.extra["removal_done_s_after_the_last_stop"] = removal_s
            samples = [creates, _rate("creates per second (not ms)", made, create_s),
                       host_mb, charged, execs, stops,
                       _rate("stops per second (not ms)", len(stops.values_ms), stop_s),
                       _leftovers(left)]
    finally:
        _keep_log_if_failed(console, state, samples)
        shutil.rmtree(root, ignore_errors=True)
    creates.extra.update(count=n, concurrency=CONCURRENCY, created=made)
    return samples


async def _settled(host: Host, before: dict[str, int], timeout_s: float) -> tuple[dict[str, int], float]:
    """The leftovers once there are none, or as they are after ``timeout_s``, and the seconds
    that took: a stop returns once its sandbox can no longer run, and the removal of its
    mounts, disk, cgroups and runtime record finishes in the background (``Edge._remove``)."""
    t0 = time.perf_counter()
    while (left := excess(before, host.counts())) and time.perf_counter() - t0 < timeout_s:
        await asyncio.sleep(0.1)
    return left, time.perf_counter() - t0


def _keep_log_if_failed(console: Console, state: Path, samples: list[Sample]) -> None:
    """The server's log, copied out of the state dir (removed next) when the series failed."""
    if (not samples or any(s.failures for s in samples)) and (state / "server.log").exists():
        kept = Path(f"/tmp/dsec-bench-{state.parent.name}-{state.name}-server.log")
        shutil.copyfile(state / "server.log", kept)
        console.print(f"[red]the series failed: its server's log is kept in {kept}[/red]")


def _leftovers(left: dict[str, int]) -> Sample:
    """Leftovers as a sample whose failures are their total (each kind in its row)."""
    sample = Sample("leftovers after every stop (count, not ms)", [float(sum(left.values()))],
                    failures=sum(left.values()), extra=dict(left))
    sample.errors = [f"{count} {name} left" for name, count in left.items()][:3]
    return sample


async def throughput_series(console: Console, quick: bool = False,
                            count: int | None = None) -> list[Sample]:
    n = count or (50 if quick else 1000)
    bare_stops = Sample(f"bare crun delete + unmount, {n}, {CONCURRENCY} at a time", [])
    stops = Sample(f"dsec stop, {n}, {CONCURRENCY} at a time", [], baseline=bare_stops)
    with bare_workspace(console) as (root, bare):
        async with bench_server(root / "throughput", "--warm-pool", "0",
                                "--capacity", str(n + 16)) as created:
            await _warm_up(created)
            with phase(console, f"throughput: {n} bare crun starts, {CONCURRENCY} at a time"):
                t0 = time.perf_counter()
                started = await gated(range(n), lambda _: bare.start_detached())
                bare_create_s = time.perf_counter() - t0
            bare_ok = [c for c in started if isinstance(c, str)]
            bare_failed = [c for c in started if isinstance(c, BaseException)]
            t0 = time.perf_counter()
            bare_stops.add(await gated(bare_ok, lambda cid: _timed(bare.remove(cid))))
            bare_stop_s = time.perf_counter() - t0
            with phase(console, f"throughput: create_many({n}, concurrency={CONCURRENCY})"):
                t0 = time.perf_counter()
                made = await created.client.create_many(n, concurrency=CONCURRENCY,
                                                        image=IMAGE, ttl_s=1800)
                create_s = time.perf_counter() - t0
            created.sandboxes = [sb for sb in made if isinstance(sb, AsyncSandbox)]
            refused = [RuntimeError(f"{e.code}: {e.message}") for e in made
                       if not isinstance(e, AsyncSandbox)]
            with phase(console, f"throughput: {len(created.sandboxes)} stops"):
                stop_s = await _stop_all(created, stops)
    bare_rate = _rate("bare crun starts per second (not ms)", len(bare_ok), bare_create_s)
    bare_rate.add(bare_failed)
    bare_stop_rate = _rate("bare crun removals per second (not ms)", len(bare_stops.values_ms),
                           bare_stop_s)
    rate = _rate(f"dsec creates per second, create_many({n}, concurrency={CONCURRENCY}) "
                 "(not ms)", n - len(refused), create_s, baseline=bare_rate)
    rate.add(list(refused))
    return [bare_rate, rate, bare_stops, stops, bare_stop_rate,
            _rate("dsec stops per second (not ms)", len(stops.values_ms), stop_s,
                  baseline=bare_stop_rate)]
