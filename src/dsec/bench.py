"""The benchmark: dsec against bare ``crun`` on the same image, in one process run.

Measured (latencies in ms, p50/p95/p99):
- create-to-first-output, one at a time and in a burst of 100: dsec's ``create`` + ``stream``
  of ``echo hi`` until the first byte, against ``crun run`` of ``echo hi`` on an overlay of the
  same layers until its first byte;
- exec round trip of ``true`` in a warm sandbox, against ``crun exec`` into a running container.
Ratios are dsec over the baseline. ``dsec bench`` runs it; docs/BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import httpx
from rich.console import Console
from rich.table import Table

from .client.aio import DSecClient
from .client.aio import Sandbox as AsyncSandbox
from .images.mount import LayerMounter, overlay_mount, unmount
from .images.store import ImageStore

IMAGE = "debian-minbase"
BENCH_ROOT = Path("/run/dsec-bench")


@dataclass
class Sample:
    name: str
    values_ms: list[float]
    failures: int = 0

    def pct(self, q: float) -> float:
        ordered = sorted(self.values_ms)
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    def row(self) -> dict[str, float | int | str]:
        return {"name": self.name, "n": len(self.values_ms), "failures": self.failures,
                "p50": self.pct(50), "p95": self.pct(95), "p99": self.pct(99),
                "mean": statistics.fmean(self.values_ms)}


async def _timed(fn: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return (time.perf_counter() - t0) * 1000


async def _series(name: str, fn: Callable[[], Awaitable[None]], n: int, concurrency: int = 1) -> Sample:
    gate = asyncio.Semaphore(concurrency)
    failures = 0

    async def one() -> float | None:
        nonlocal failures
        async with gate:
            try:
                return await _timed(fn)
            except Exception:
                failures += 1
                return None

    values = [v for v in await asyncio.gather(*(one() for _ in range(n))) if v is not None]
    return Sample(name, values, failures)


class BareCrun:
    """The baseline: crun itself, on an overlay of the same image layers."""

    def __init__(self, root: Path, lowerdirs: list[Path]) -> None:
        self.root = root
        self.lowerdirs = lowerdirs
        self.state = root / "crun-state"

    def _bundle(self, args: list[str]) -> tuple[str, Path]:
        cid = "bare-" + secrets.token_hex(4)
        d = self.root / cid
        for sub in ("upper", "work", "rootfs"):
            (d / sub).mkdir(parents=True)
        overlay_mount(self.lowerdirs, d / "upper", d / "work", d / "rootfs")
        subprocess.run(["crun", "spec"], cwd=d, capture_output=True, check=True)
        config = json.loads((d / "config.json").read_text())
        config["root"] = {"path": str(d / "rootfs"), "readonly": False}
        config["process"]["terminal"] = False
        config["process"]["args"] = args
        config["linux"]["cgroupsPath"] = f"/dsec-bench/{cid}"
        (d / "config.json").write_text(json.dumps(config))
        return cid, d

    async def run_echo(self) -> float:
        """ms from spawning ``crun run`` to its first byte of output, bundle set-up included."""
        t0 = time.perf_counter()
        cid, d = self._bundle(["/bin/echo", "hi"])
        proc = await asyncio.create_subprocess_exec(
            "crun", "--root", str(self.state), "run", "--bundle", str(d), cid,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        first = await proc.stdout.read(1)
        elapsed = (time.perf_counter() - t0) * 1000
        await proc.wait()
        self._remove(cid, d)
        if first != b"h":
            raise RuntimeError("bare crun printed nothing")
        return elapsed

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        cid, d = self._bundle(["/bin/sleep", "infinity"])
        await (await asyncio.create_subprocess_exec(
            "crun", "--root", str(self.state), "run", "--detach", "--bundle", str(d), cid)).wait()
        try:
            yield cid
        finally:
            self._remove(cid, d)

    async def exec_true(self, cid: str) -> None:
        proc = await asyncio.create_subprocess_exec("crun", "--root", str(self.state), "exec", cid, "true")
        if await proc.wait() != 0:
            raise RuntimeError("crun exec failed")

    def _remove(self, cid: str, d: Path) -> None:
        subprocess.run(["crun", "--root", str(self.state), "delete", "--force", cid],
                       capture_output=True)
        unmount(d / "rootfs")
        shutil.rmtree(d, ignore_errors=True)


class Created:
    """Sandboxes made by a timed series, stopped after it, outside the timings."""

    def __init__(self, client: DSecClient) -> None:
        self.client = client
        self.sandboxes: list[AsyncSandbox] = []

    async def first_output(self) -> None:
        sb = await self.client.create(image=IMAGE, ttl_s=120)
        self.sandboxes.append(sb)
        async for chunk in sb.stream("echo hi"):
            if not chunk.data.startswith(b"h"):
                raise RuntimeError(f"unexpected output {chunk.data!r}")
            break

    async def stop_all(self) -> None:
        while self.sandboxes:
            batch, self.sandboxes = self.sandboxes[:50], self.sandboxes[50:]
            await asyncio.gather(*(sb.stop() for sb in batch))


def _start_server(state: Path) -> subprocess.Popen[bytes]:
    log = open(state / "server.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "dsec", "serve", "--state-dir", str(state),
                             "--capacity", "200"], stdout=log, stderr=log, start_new_session=True)
    transport = httpx.HTTPTransport(uds=str(state / "api.sock"))
    with httpx.Client(transport=transport, base_url="http://dsec") as http:
        for _ in range(2400):
            try:
                if http.get("/v1/health").status_code == 200:
                    return proc
            except httpx.TransportError:
                time.sleep(0.05)
    raise RuntimeError(f"server did not start: {(state / 'server.log').read_text()}")


async def run_benchmark(console: Console, quick: bool = False) -> list[Sample]:
    n_seq, n_burst, n_exec = (10, 20, 100) if quick else (50, 100, 500)
    image = ImageStore().ensure(IMAGE, console=console)
    state = BENCH_ROOT / secrets.token_hex(3)
    state.mkdir(parents=True)
    bare = BareCrun(state / "bare", LayerMounter().lowerdirs(image))
    server = _start_server(state)
    samples = []
    try:
        async with DSecClient(f"unix://{state / 'api.sock'}",
                              (state / "local.key").read_text().strip(), autostart=False) as client:
            created = Created(client)
            await created.first_output()  # warm-up: agent binary, layer mounts, page cache
            await bare.run_echo()
            await created.stop_all()
            with console.status("create-to-first-output, one at a time"):
                samples.append(await _series("bare crun run: first output", bare.run_echo, n_seq))
                samples.append(await _series("dsec create: first output", created.first_output, n_seq))
                await created.stop_all()
            with console.status(f"create-to-first-output, burst of {n_burst}"):
                samples.append(await _series(f"bare crun run: burst {n_burst}", bare.run_echo,
                                             n_burst, n_burst))
                samples.append(await _series(f"dsec create: burst {n_burst}", created.first_output,
                                             n_burst, n_burst))
                await created.stop_all()
            with console.status("exec round trip of `true`"):
                async with bare.running() as cid:
                    samples.append(await _series("bare crun exec true", lambda: bare.exec_true(cid), n_exec // 5))
                sb = await client.create(image=IMAGE, ttl_s=300)
                samples.append(await _series("dsec exec true", lambda: _run_true(sb), n_exec))
                await sb.stop()
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(state, ignore_errors=True)
    return samples


async def _run_true(sb: AsyncSandbox) -> None:
    r = await sb.run("true")
    if r.exit_code != 0:
        raise RuntimeError("true failed")


def report(console: Console, samples: list[Sample]) -> dict[str, float]:
    table = Table("measure", "n", "fail", "p50 ms", "p95 ms", "p99 ms", title="dsec bench")
    for s in samples:
        r = s.row()
        table.add_row(s.name, str(r["n"]), str(r["failures"]), f"{r['p50']:.1f}", f"{r['p95']:.1f}",
                      f"{r['p99']:.1f}")
    console.print(table)
    ratios = {}
    for base, ours in zip(samples[::2], samples[1::2]):  # series come in (baseline, dsec) pairs
        ratios[ours.name] = ours.pct(50) / base.pct(50)
        console.print(f"{ours.name} / {base.name}: p50 ratio {ratios[ours.name]:.2f}")
    return ratios


def main(quick: bool = False) -> None:
    if os.geteuid() != 0:
        raise SystemExit("dsec bench runs containers and must run as root")
    console = Console()
    samples = asyncio.run(run_benchmark(console, quick))
    report(console, samples)
    out = Path(os.environ.get("DSEC_BENCH_JSON", "benchmarks/results.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([s.row() for s in samples], indent=2))
    console.print(f"raw figures in {out}")
