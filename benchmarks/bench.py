"""The benchmark: dsec against bare ``crun`` on the same image, in one process run.

Measured (latencies in ms, p50/p95/p99):
- create-to-first-output, one at a time and in a burst of 100: dsec's ``create`` + ``stream``
  of ``echo hi`` until the first byte, against ``crun run`` of ``echo hi`` on an overlay of the
  same layers until its first byte;
- exec round trip of ``true`` in a warm sandbox, against ``crun exec`` into a running container;
- the trajectory log, against executing ``true`` live in a sandbox with no trajectory: the
  round trip of a logged ``true`` (log write overhead), and the time per step to fast-forward
  the 1,000 (``--quick``: 200) steps so logged, answered from the SDK's prefetched log and
  (``prefetch=False``) by the server.
Ratios are dsec over the baseline. ``dsec bench`` runs it; docs/BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Sequence,
)
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from dsec.client.aio import DSecClient
from dsec.client.aio import Sandbox as AsyncSandbox
from dsec.images.mount import LayerMounter, overlay_mount, unmount_or_detach
from dsec.images.store import ImageStore
from dsec.substrates.host import spawn
from dsec.substrates.host.cgroups import remove_parent_if_unused
from dsec.substrates.host.spawn import Spawned

IMAGE = "debian-minbase"
BENCH_ROOT = Path("/run/dsec-bench")
BARE_CGROUP_PARENT = "/dsec-bench"


@dataclass
class Sample:
    name: str
    values_ms: list[float]
    failures: int = 0
    baseline: Sample | None = None
    errors: list[str] = field(default_factory=list)  # the first few failures, for the report
    extra: dict[str, Any] = field(default_factory=dict)  # more of the series' figures, in its row

    def add(self, results: Sequence[float | BaseException]) -> None:
        """A batch's results: its latencies, and its failures (the first few kept)."""
        self.values_ms += [r for r in results if isinstance(r, float)]
        failed = [r for r in results if isinstance(r, BaseException)]
        self.failures += len(failed)
        self.errors += [f"{type(e).__name__}: {e}" for e in failed][:3 - len(self.errors)]

    def ratio(self) -> float | None:
        """p50 over the baseline's p50."""
        return self.pct(50) / self.baseline.pct(50) if self.baseline else None

    def pct(self, q: float) -> float:
        ordered = sorted(self.values_ms) or [float("nan")]
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    def row(self) -> dict[str, float | int | str | None]:
        return {"name": self.name, "n": len(self.values_ms), "failures": self.failures,
                "p50": self.pct(50), "p95": self.pct(95), "p99": self.pct(99),
                "mean": statistics.fmean(self.values_ms) if self.values_ms else None,
                "p50_ratio_to_baseline": self.ratio(), **self.extra}


async def compare(base: Sample, base_fn: Callable[[], Awaitable[float]], ours: Sample,
                  ours_fn: Callable[[], Awaitable[float]], batch: int, rounds: int,
                  concurrent: bool = False, settle_s: float = 0.0,
                  between: Callable[[], Awaitable[None]] | None = None) -> list[Sample]:
    """Alternate batches of the baseline and of dsec, so both meet the same machine: on a
    shared host, conditions drift more between minutes than between the two. A batch runs
    one call after another, or all at once (``concurrent``); ``between`` runs after each
    round, untimed (clean-up of both sides); ``settle_s`` pauses after each batch, so the
    kernel's deferred teardown of one side's containers (network namespaces above all) does
    not land in the other's timings. Each function returns the milliseconds that count."""
    ours.baseline = base
    for _ in range(rounds):
        for sample, fn in ((base, base_fn), (ours, ours_fn)):
            if concurrent:
                results = await asyncio.gather(*(fn() for _ in range(batch)), return_exceptions=True)
            else:
                results = [await _attempt(fn) for _ in range(batch)]
            sample.add(results)
            await asyncio.sleep(settle_s)
        if between:
            await between()
    return [base, ours]


async def _attempt(fn: Callable[[], Awaitable[float]]) -> float | BaseException:
    try:
        return await fn()
    except Exception as exc:
        return exc


class BareCrun:
    """The baseline: crun itself, on an overlay of the same image layers."""

    def __init__(self, root: Path, lowerdirs: list[Path]) -> None:
        self.root = root
        self.lowerdirs = lowerdirs
        self.state = root / "crun-state"
        root.mkdir(parents=True)
        subprocess.run(["crun", "spec"], cwd=root, capture_output=True, check=True)
        self.template = json.loads((root / "config.json").read_text())

    def _bundle(self, args: list[str]) -> tuple[str, Path]:
        cid = "bare-" + secrets.token_hex(4)
        d = self.root / cid
        for sub in ("upper", "work", "rootfs"):
            (d / sub).mkdir(parents=True)
        overlay_mount(self.lowerdirs, d / "upper", d / "work", d / "rootfs")
        (d / "config.json").write_text(json.dumps(self.config(cid, d / "rootfs", args)))
        return cid, d

    def config(self, cid: str, rootfs: Path, args: list[str]) -> dict[str, Any]:
        """``crun spec``'s config for container ``cid`` running ``args`` on ``rootfs``."""
        config: dict[str, Any] = json.loads(json.dumps(self.template))
        config["root"] = {"path": str(rootfs), "readonly": False}
        config["process"]["terminal"] = False
        config["process"]["args"] = args
        config["linux"]["cgroupsPath"] = f"{BARE_CGROUP_PARENT}/{cid}"
        return config

    async def run_echo(self) -> float:
        """ms from setting up the bundle to the first byte ``crun run`` prints (clean-up not
        counted, as dsec's stop is not)."""
        t0 = time.perf_counter()
        cid, d = self._bundle(["/bin/echo", "hi"])
        try:
            crun = await Spawned.start(["crun", "--root", str(self.state), "run", "--bundle",
                                        str(d), cid], capture_stdout=True, stderr=None)
            first = await crun.first_byte()
            elapsed = (time.perf_counter() - t0) * 1000
            await crun.wait()
        finally:  # untimed, and also when crun failed: its mount must not outlive the series
            await self._remove(cid, d)
        if first != b"h":
            raise RuntimeError("bare crun printed nothing")
        return elapsed

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        cid = await self.start_detached()
        try:
            yield cid
        finally:
            await self.remove(cid)

    async def start_detached(self) -> str:
        """A container of ``sleep infinity`` left running (its bundle set up in a thread, as
        dsec's are); its id."""
        cid, d = await asyncio.to_thread(self._bundle, ["/bin/sleep", "infinity"])
        if await spawn.run(["crun", "--root", str(self.state), "run", "--detach",
                            "--bundle", str(d), cid]) != 0:
            raise RuntimeError(f"crun run --detach {cid} failed")
        return cid

    async def remove(self, cid: str) -> None:
        await self._remove(cid, self.root / cid)

    async def exec_true(self, cid: str) -> float:
        t0 = time.perf_counter()
        if await spawn.run(["crun", "--root", str(self.state), "exec", cid, "true"]) != 0:
            raise RuntimeError("crun exec failed")
        return (time.perf_counter() - t0) * 1000

    async def timed_removal(self) -> float:
        """ms of ``crun delete --force`` of an idle container plus the unmount of its rootfs
        (its start untimed): the baseline of dsec's ``stop``."""
        cid, d = self._bundle(["/bin/sleep", "infinity"])
        await spawn.run(["crun", "--root", str(self.state), "run", "--detach", "--bundle", str(d), cid])
        t0 = time.perf_counter()
        await self._remove(cid, d)
        return (time.perf_counter() - t0) * 1000

    async def _remove(self, cid: str, d: Path) -> None:
        await spawn.run(["crun", "--root", str(self.state), "delete", "--force", cid])
        unmount_or_detach(d / "rootfs")  # as dsec: a dying process may hold it a moment
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def bare_workspace(console: Console) -> Iterator[tuple[Path, BareCrun]]:
    """A series' scratch root under BENCH_ROOT and bare crun on IMAGE's layers beneath it;
    the root and the bare containers' cgroup parent are removed after the series."""
    image = ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    try:
        yield root, BareCrun(root / "bare", LayerMounter().lowerdirs(image))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        remove_parent_if_unused(BARE_CGROUP_PARENT)


class Created:
    """Sandboxes made by a timed series, stopped after it, outside the timings."""

    def __init__(self, client: DSecClient, substrate: str = "container", image: str = IMAGE,
                 **options: Any) -> None:
        """``options``: more of ``create``'s arguments, for every sandbox of the series."""
        self.client = client
        self.substrate = substrate
        self.image = image
        self.options = {"ttl_s": 120, **options}
        self.sandboxes: list[AsyncSandbox] = []
        self.server_pid = 0  # the private server's process (``bench_server``)

    async def first_output(self, **options: Any) -> float:
        """ms from asking for a sandbox (``options`` on top of the series') to the first byte
        of ``echo hi`` run in it (``echo_first_byte``)."""
        t0 = time.perf_counter()
        sb = await self.client.create(**{"substrate": self.substrate, "image": self.image,
                                         **self.options, **options})
        self.sandboxes.append(sb)
        return await echo_first_byte(sb, t0)

    async def wait_warm(self, n: int, timeout_s: float = 120) -> None:
        """Until the server's warm pool holds ``n`` sandboxes."""
        deadline = time.monotonic() + timeout_s
        while (await self.client.health())["edges"][0]["warm"][self.substrate].get(self.image, 0) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the warm pool did not reach {n} within {timeout_s}s")
            await asyncio.sleep(0.2)

    async def stop_all(self) -> None:
        while self.sandboxes:
            batch, self.sandboxes = self.sandboxes[:50], self.sandboxes[50:]
            await asyncio.gather(*(sb.stop() for sb in batch))


async def echo_first_byte(sb: AsyncSandbox, t0: float) -> float:
    """ms from ``t0`` to the first byte of ``echo hi`` run in ``sb``. The rest of the stream is
    read untimed, as the baseline's exit is awaited untimed: a stream left unread loses its
    connection, and the next call would time a new one (a client that reads its output keeps
    it)."""
    elapsed = None
    async for chunk in sb.stream("echo hi"):
        if elapsed is None:
            elapsed = (time.perf_counter() - t0) * 1000
            if not chunk.data.startswith(b"h"):
                raise RuntimeError(f"unexpected output {chunk.data!r}")
    if elapsed is None:
        raise RuntimeError("no output")
    return elapsed


@asynccontextmanager
async def bench_server(state: Path, *args: str) -> AsyncIterator[Created]:
    """A private dsec server; every sandbox made through the yielded ``Created`` is stopped
    before the server is, also when a series fails."""
    state.mkdir(parents=True)
    with open(state / "server.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dsec", "serve", "--state-dir", str(state),
                                 "--capacity", "250", *args], stdout=log, stderr=log,
                                start_new_session=True)
    try:
        _wait_healthy(state)
        async with DSecClient(f"unix://{state / 'api.sock'}",
                              (state / "local.key").read_text().strip(), autostart=False) as client:
            created = Created(client)
            created.server_pid = proc.pid
            try:
                yield created
            finally:  # everything the server still runs, also what a failed series left
                await created.stop_all()
                left = [await client.get(info.id) for info in await client.list()]
                await asyncio.gather(*(sb.stop() for sb in left))
    finally:
        proc.terminate()
        proc.wait()
        await _unmount_layers(state / "layers")


async def _unmount_layers(layers: Path, tries: int = 100) -> None:
    """A server leaves its layers mounted; a stopped sandbox's overlay, detached while one of
    its processes was still exiting, holds its layers a moment longer (EBUSY): retried, so
    no layer mount outlives the run (two quick runs left one so)."""
    for _ in range(tries):
        if not LayerMounter(layers).unmount_all():
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"layers under {layers} still busy after {tries / 10:.0f}s")


@asynccontextmanager
async def one_sandbox(name: str) -> AsyncIterator[AsyncSandbox]:
    """One container sandbox of IMAGE on a private server without a warm pool, whose state
    (under BENCH_ROOT) is removed afterwards."""
    root = BENCH_ROOT / secrets.token_hex(3)
    try:
        async with bench_server(root / name, "--warm-pool", "0") as created:
            sb = await created.client.create(image=IMAGE, ttl_s=600)
            created.sandboxes.append(sb)
            yield sb
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _wait_healthy(state: Path) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(state / "api.sock")),
                      base_url="http://dsec") as http:
        for _ in range(2400):
            try:
                if http.get("/v1/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
    raise RuntimeError(f"server did not start: {(state / 'server.log').read_text()}")


@contextmanager
def phase(console: Console, title: str) -> Iterator[None]:
    """Say what is being measured. Deliberately no live spinner: its refresh thread would take
    the GIL from the client's event loop and inflate every latency measured."""
    console.print(f"[dim]measuring {title} ...[/dim]")
    t0 = time.perf_counter()
    yield
    console.print(f"[dim]  done in {time.perf_counter() - t0:.1f}s[/dim]")


def idle_memory(created: Created) -> list[float]:
    """MB charged to each idle sandbox's memory cgroup (agent, page tables, its page cache)."""
    values = []
    for sb in created.sandboxes:
        for usage in Path("/sys/fs/cgroup/memory").glob(f"dsec-*/{sb.id}/memory.usage_in_bytes"):
            values.append(int(usage.read_text()) / 1e6)
    return values


async def trajectory_series(console: Console, client: DSecClient, steps: int) -> list[Sample]:
    """Log overhead: ``true`` in a plain sandbox against ``true`` logged in a trajectory,
    alternating batches. Fast-forward: the logged steps re-issued by a resumed handle (SDK
    prefetch, then server only), alternating with ``true`` run live in the plain sandbox."""
    plain = await client.create(image=IMAGE, ttl_s=900)
    trajectory = f"bench/{secrets.token_hex(4)}"
    logged = await client.create(image=IMAGE, ttl_s=900, trajectory=trajectory)
    samples: list[Sample] = []
    try:
        with phase(console, f"trajectory: log write overhead over {steps} execs of `true`"):
            samples += await compare(Sample("exec true (no trajectory)", []),
                                     lambda: _run_true(plain),
                                     Sample("exec true, logged in a trajectory", []),
                                     lambda: _run_true(logged), 20, steps // 20)
        for prefetch, where in ((True, "from the SDK's prefetched log"), (False, "by the server")):
            with phase(console, f"trajectory: fast-forward of {steps} steps {where}"):
                resumed = await client.resume(trajectory, prefetch=prefetch)
                samples += await compare(Sample("exec true (no trajectory), again", []),
                                         lambda: _run_true(plain),
                                         Sample(f"fast-forward, answered {where}", []),
                                         functools.partial(_run_true, resumed), 20, steps // 20)
                if resumed.fast_forwarded != steps:
                    raise RuntimeError(f"only {resumed.fast_forwarded} of {steps} steps were "
                                       "fast-forwarded")
    finally:
        await asyncio.gather(plain.stop(), logged.stop())
    return samples


async def cold_create_phases(console: Console, cold: Created, bare: BareCrun, n_seq: int,
                             n_burst: int, burst_rounds: int,
                             between: Callable[[], Awaitable[None]]) -> list[Sample]:
    """Create-to-first-output on ``cold``'s server (no warm pool) against bare ``crun run``:
    ``n_seq`` one at a time in batches of 10, then ``burst_rounds`` bursts of ``n_burst``;
    ``between`` after each round, untimed."""
    with phase(console, "create-to-first-output, one at a time"):
        samples = await compare(Sample("bare crun run: first output", []), bare.run_echo,
                                Sample("dsec create (cold): first output", []),
                                cold.first_output, 10, n_seq // 10, between=between)
    with phase(console, f"create-to-first-output, {burst_rounds} bursts of {n_burst}"):
        samples += await compare(Sample(f"bare crun run: burst {n_burst}", []), bare.run_echo,
                                 Sample(f"dsec create (cold): burst {n_burst}", []),
                                 cold.first_output, n_burst, burst_rounds, concurrent=True,
                                 settle_s=2.0, between=between)
    return samples


async def exec_phase(console: Console, created: Created, bare: BareCrun, n_exec: int) -> list[Sample]:
    """``true`` run in a warm sandbox of ``created``'s server against ``crun exec`` into a
    running bare container, alternating batches of 20."""
    with phase(console, "exec round trip of `true`"):
        sb = await created.client.create(image=IMAGE, ttl_s=300)
        try:
            async with bare.running() as cid:
                return await compare(Sample("bare crun exec true", []),
                                     lambda: bare.exec_true(cid), Sample("dsec exec true", []),
                                     lambda: _run_true(sb), 20, n_exec // 20)
        finally:
            await sb.stop()


async def exec_series(console: Console, quick: bool = False) -> list[Sample]:
    """``dsec bench --only exec``: the exec round trip alone, as the full benchmark runs it."""
    with bare_workspace(console) as (root, bare):
        async with bench_server(root / "cold", "--warm-pool", "0") as cold:
            await cold.first_output()  # warm-up: agent binary, layer mounts, page cache
            await cold.stop_all()
            return await exec_phase(console, cold, bare, 50 if quick else 200)


async def trajectory_only(console: Console, quick: bool = False) -> list[Sample]:
    """``dsec bench --only trajectory``: the trajectory series alone, on its own server."""
    root = BENCH_ROOT / secrets.token_hex(3)
    try:
        async with bench_server(root / "trajectory", "--warm-pool", "0") as server:
            await server.first_output()  # warm-up
            await server.stop_all()
            return await trajectory_series(console, server.client, 200 if quick else 1000)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def run_benchmark(console: Console, quick: bool = False) -> list[Sample]:
    n_seq, n_burst, burst_rounds, n_exec = (10, 20, 1, 50) if quick else (50, 100, 2, 200)
    n_steps = 200 if quick else 1000
    samples: list[Sample] = []
    memory = Sample("idle sandbox memory (MB, not ms)", [])
    with bare_workspace(console) as (root, bare):
        async with bench_server(root / "cold", "--warm-pool", "0") as cold:
            await cold.first_output()  # warm-up: agent binary, layer mounts, page cache
            await bare.run_echo()
            await cold.stop_all()
            async def clean_up() -> None:
                memory.values_ms += idle_memory(cold)
                await cold.stop_all()

            samples += await cold_create_phases(console, cold, bare, n_seq, n_burst, burst_rounds,
                                                clean_up)
            samples += await exec_phase(console, cold, bare, n_exec)
            samples += await trajectory_series(console, cold.client, n_steps)
        samples += await warm_pool_phase(console, bare, root, n_burst)
        samples.append(memory)
    return samples


async def warm_pool_phase(console: Console, bare: BareCrun, root: Path, n: int,
                          n_seq: int = 10) -> list[Sample]:
    """Create-to-first-output from a warm pool of ``n`` (``n_seq`` one at a time, then a burst of ``n``)
    against bare ``crun run``: the pool full before each batch, so every create is a claim.
    Each batch of ten is followed by a pause, so the pool's refill (it starts once claims
    pause) and bare crun's teardown stay out of the other side's timings. Between the two,
    the floor (``_round_trips``): the same two requests with no claim, timed the same way."""
    samples: list[Sample] = []
    async with bench_server(root / "warm", "--warm-pool", str(n)) as warm:
        with phase(console, f"create-to-first-output from a warm pool of {n}"):
            await warm.first_output()  # asks for the image: its pool fills
            await warm.stop_all()
            await warm.wait_warm(n)
            samples += await compare(Sample("bare crun run: first output (again)", []),
                                     bare.run_echo,
                                     Sample("dsec create (warm pool): first output", []),
                                     warm.first_output, 10, n_seq // 10, settle_s=1.0)
            sb = await warm.client.create(image=IMAGE, ttl_s=120)
            warm.sandboxes.append(sb)
            samples += await compare(Sample("bare crun run: first output (floor)", []),
                                     bare.run_echo, Sample(FLOOR, []),
                                     lambda: _round_trips(warm.client, sb), 10, n_seq // 10,
                                     settle_s=1.0)
            await warm.stop_all()
            await warm.wait_warm(n)
            samples += await compare(Sample(f"bare crun run: burst {n} (again)", []),
                                     bare.run_echo,
                                     Sample(f"dsec create (warm pool): burst {n}", []),
                                     warm.first_output, n, 1, concurrent=True, settle_s=2.0)
            await warm.stop_all()
    samples += await grown_pool_phase(console, bare, root, n)
    return samples


FLOOR = "dsec floor: get, then a stream's first byte (no create)"


async def _round_trips(client: DSecClient, sb: AsyncSandbox) -> float:
    """ms of what every create-to-first-output costs before dsec does any sandbox work: a
    ``get`` of a running sandbox (a request answered from the server's state, as a claim's
    answer is), then ``echo hi``'s stream in it to its first byte: the floor under a warm
    create's row."""
    t0 = time.perf_counter()
    await client.get(sb.id)
    return await echo_first_byte(sb, t0)


async def grown_pool_phase(console: Console, bare: BareCrun, root: Path, n: int) -> list[Sample]:
    """A burst of ``n`` on a server with the default pool (2) that may grow to ``n``
    (``--warm-pool-max``), after a burst of ``n`` grew it, against a bare ``crun run`` burst:
    a trainer's next training step."""
    async with bench_server(root / "grown", "--warm-pool", "2", "--warm-pool-max",
                            str(n)) as grown:
        with phase(console, f"a burst of {n} from the pool the burst before it grew"):
            await grown.first_output()  # asks for the image: its pool fills to 2
            await grown.stop_all()
            await grown.wait_warm(2)
            await asyncio.gather(*(grown.first_output() for _ in range(n)))  # grows it
            await grown.stop_all()
            await grown.wait_warm(n)
            samples = await compare(Sample(f"bare crun run: burst {n} (once more)", []),
                                    bare.run_echo,
                                    Sample(f"dsec create (pool grown by a burst): burst {n}", []),
                                    grown.first_output, n, 1, concurrent=True, settle_s=2.0)
            await grown.stop_all()
    return samples


async def warm_series(console: Console, quick: bool = False) -> list[Sample]:
    """``dsec bench --only warm``: the warm-pool phase of the full benchmark alone."""
    n_seq, n_burst = (10, 20) if quick else (50, 100)
    with bare_workspace(console) as (root, bare):
        await bare.run_echo()  # warm-up: layer mounts, page cache
        return await warm_pool_phase(console, bare, root, n_burst, n_seq)


async def _run_true(sb: AsyncSandbox) -> float:
    t0 = time.perf_counter()
    if (await sb.run("true")).exit_code != 0:
        raise RuntimeError("true failed")
    return (time.perf_counter() - t0) * 1000


def report(console: Console, samples: list[Sample]) -> None:
    table = Table("measure", "n", "fail", "p50", "p95", "p99", "p50 / baseline", title="dsec bench (ms)")
    for s in samples:
        ratio = s.ratio()
        table.add_row(s.name, str(len(s.values_ms)), str(s.failures), _ms(s.pct(50)),
                      _ms(s.pct(95)), _ms(s.pct(99)), f"{ratio:.3f}" if ratio else "")
    console.print(table)
    for s in samples:
        for error in s.errors:
            console.print(f"[red]{s.name} failed:[/red] {error}")


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 0.1 else f"{value:.3f}"  # fast-forwards take µs


# Series run alone with ``dsec bench --only NAME``: "module:function(console, quick, **options)",
# ``options`` the series' own (soak: ``cycles``; density, throughput: ``count``).
ONLY = {"create": "dsec_benchmarks.bench_create:create_series",
        "create-parts": "dsec_benchmarks.bench_create_parts:create_parts_series",
        "warm": "dsec_benchmarks.bench:warm_series",
        "network": "dsec_benchmarks.bench_network:network_series",
        "projects": "dsec_benchmarks.bench_projects:run_projects",
        "state": "dsec_benchmarks.bench_state:run_state",
        "pause": "dsec_benchmarks.bench_pause:pause_series",
        "stdin": "dsec_benchmarks.bench_stdin:stdin_series",
        "soak": "dsec_benchmarks.bench_soak:soak_series",
        "pull": "dsec_benchmarks.bench_pull:pull_series",
        "lazy": "dsec_benchmarks.bench_lazy:lazy_series",
        "connect": "dsec_benchmarks.bench_connect:connect_series",
        "density": "dsec_benchmarks.bench_density:density_series",
        "throughput": "dsec_benchmarks.bench_density:throughput_series",
        "exec": "dsec_benchmarks.bench:exec_series",
        "trajectory": "dsec_benchmarks.bench:trajectory_only"}


# The longest ``--settle`` waits for the load average before a series starts anyway.
SETTLE_MAX_S = 600.0

# What ``dsec bench`` runs with no ``--only`` after the latency series above (``--quick``
# small counts: the CI smoke).
DEFAULT_ONLY = ("throughput", "density")


def _series(name: str) -> Callable[..., Coroutine[Any, Any, list[Sample]]]:
    module, _, function = ONLY[name].partition(":")
    series: Callable[..., Coroutine[Any, Any, list[Sample]]] = getattr(
        importlib.import_module(module), function)
    return series


async def _all_series(console: Console, quick: bool, settle: float | None) -> list[Sample]:
    samples = await _settled(console, settle, lambda: run_benchmark(console, quick))
    for name in DEFAULT_ONLY:
        samples += await _settled(console, settle, functools.partial(_series(name), console, quick))
    return samples


async def start_load(console: Console, under: float | None, max_s: float = SETTLE_MAX_S,
                     poll_s: float = 2.0,
                     read: Callable[[], float] = lambda: os.getloadavg()[0]) -> float:
    """The 1-minute load average a series starts at; with ``under``, once it is below
    ``under``. The machine's own background work (a density series' 3,000 teardowns, the
    kernel's deferred namespace clean-up) lasts minutes after a series and lands in the next
    one's timings. After ``max_s`` the series starts all the same, and its load says so."""
    load = read()
    if under is None or load < under:
        return load
    deadline = time.monotonic() + max_s
    with phase(console, f"waiting for the load average ({load:.1f}) to fall under {under:g}"):
        while load >= under and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            load = read()
    return load


async def _settled(console: Console, settle: float | None,
                   series: Callable[[], Coroutine[Any, Any, list[Sample]]]) -> list[Sample]:
    """``series()``'s rows, each with the load average it started at (``load_at_start``)."""
    load = await start_load(console, settle)
    samples = await series()
    for sample in samples:
        sample.extra.setdefault("load_at_start", round(load, 2))
    return samples


def failed(samples: list[Sample]) -> list[Sample]:
    """The series' rows with failures (errors, sandboxes not answering, leftovers): what
    makes ``dsec bench`` fail. A figure never does."""
    return [s for s in samples if s.failures]


def main(quick: bool = False, json_out: Path | None = None, only: str | None = None, sizes: list[int] | None = None,
         cycles: int | None = None, count: int | None = None, settle: float | None = None) -> None:
    """``settle``: start each series once the load average is below it (``start_load``)."""
    if os.geteuid() != 0:
        raise SystemExit("dsec bench runs containers and must run as root")
    console = Console()
    if only == "cluster":
        from .bench_cluster import cluster_benchmark
        samples = asyncio.run(_settled(console, settle,
                                       lambda: cluster_benchmark(console, sizes or [100])))
    elif only is not None:
        options = {key: value for key, value in (("cycles", cycles), ("count", count))
                   if value is not None}
        samples = asyncio.run(_settled(console, settle,
                                       functools.partial(_series(only), console, quick, **options)))
    else:
        samples = asyncio.run(_all_series(console, quick, settle))
    report(console, samples)
    if json_out:
        json_out.write_text(json.dumps([s.row() for s in samples], indent=2))
        console.print(f"raw figures in {json_out}")
    if bad := failed(samples):
        raise SystemExit(f"dsec bench: failures in {len(bad)} rows: "
                         + "; ".join(f"{s.name} ({s.failures})" for s in bad))
