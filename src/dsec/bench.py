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
    baseline: Sample | None = None

    def ratio(self) -> float | None:
        """p50 over the baseline's p50."""
        return self.pct(50) / self.baseline.pct(50) if self.baseline else None

    def pct(self, q: float) -> float:
        ordered = sorted(self.values_ms)
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    def row(self) -> dict[str, float | int | str]:
        return {"name": self.name, "n": len(self.values_ms), "failures": self.failures,
                "p50": self.pct(50), "p95": self.pct(95), "p99": self.pct(99),
                "mean": statistics.fmean(self.values_ms), "p50_ratio_to_baseline": self.ratio()}


async def _timed(fn: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return (time.perf_counter() - t0) * 1000


async def _series(name: str, fn: Callable[[], Awaitable[None]], n: int, concurrency: int = 1,
                  baseline: Sample | None = None) -> Sample:
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
    return Sample(name, values, failures, baseline)


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
        config = json.loads(json.dumps(self.template))
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
            try:
                yield created
            finally:
                await created.stop_all()
    finally:
        proc.terminate()
        proc.wait()


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


def idle_memory(created: Created) -> Sample:
    """Memory charged to each idle sandbox's cgroup (agent, page tables, its page cache)."""
    values = []
    for sb in created.sandboxes:
        for usage in Path("/sys/fs/cgroup/memory").glob(f"dsec-*/{sb.id}/memory.usage_in_bytes"):
            values.append(int(usage.read_text()) / 1e6)
    return Sample("idle sandbox memory (MB, not ms)", values)


async def run_benchmark(console: Console, quick: bool = False) -> list[Sample]:
    n_seq, n_burst, n_exec = (10, 20, 100) if quick else (50, 100, 500)
    image = ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    bare = BareCrun(root / "bare", LayerMounter().lowerdirs(image))
    samples = []
    try:
        async with bench_server(root / "cold", "--warm-pool", "0") as cold:
            await cold.first_output()  # warm-up: agent binary, layer mounts, page cache
            await bare.run_echo()
            await cold.stop_all()
            with console.status("create-to-first-output, one at a time"):
                seq = await _series("bare crun run: first output", bare.run_echo, n_seq)
                samples += [seq, await _series("dsec create (cold): first output",
                                               cold.first_output, n_seq, baseline=seq)]
                await cold.stop_all()
            with console.status(f"create-to-first-output, burst of {n_burst}"):
                burst = await _series(f"bare crun run: burst {n_burst}", bare.run_echo,
                                      n_burst, n_burst)
                samples += [burst, await _series(f"dsec create (cold): burst {n_burst}",
                                                 cold.first_output, n_burst, n_burst, burst)]
                memory = idle_memory(cold)
                await cold.stop_all()
            with console.status("exec round trip of `true`"):
                async with bare.running() as cid:
                    exec_base = await _series("bare crun exec true", lambda: bare.exec_true(cid),
                                              n_exec // 5)
                sb = await cold.client.create(image=IMAGE, ttl_s=300)
                samples += [exec_base, await _series("dsec exec true", lambda: _run_true(sb),
                                                     n_exec, baseline=exec_base)]
                await sb.stop()
        async with bench_server(root / "warm", "--warm-pool", "8") as warm:
            with console.status("create-to-first-output from the warm pool"):
                await warm.first_output()  # asks for the image: the pool fills
                await asyncio.sleep(2)
                await warm.stop_all()
                samples.append(await _series("dsec create (warm pool of 8): first output",
                                             warm.first_output, 8, baseline=seq))
        samples.append(memory)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return samples


async def _run_true(sb: AsyncSandbox) -> None:
    r = await sb.run("true")
    if r.exit_code != 0:
        raise RuntimeError("true failed")


def report(console: Console, samples: list[Sample]) -> None:
    table = Table("measure", "n", "fail", "p50", "p95", "p99", "p50 / baseline", title="dsec bench (ms)")
    for s in samples:
        ratio = s.ratio()
        table.add_row(s.name, str(len(s.values_ms)), str(s.failures), f"{s.pct(50):.1f}",
                      f"{s.pct(95):.1f}", f"{s.pct(99):.1f}", f"{ratio:.2f}" if ratio else "")
    console.print(table)


def main(quick: bool = False, json_out: Path | None = None) -> None:
    if os.geteuid() != 0:
        raise SystemExit("dsec bench runs containers and must run as root")
    console = Console()
    samples = asyncio.run(run_benchmark(console, quick))
    report(console, samples)
    if json_out:
        json_out.write_text(json.dumps([s.row() for s in samples], indent=2))
        console.print(f"raw figures in {json_out}")
