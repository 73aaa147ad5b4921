"""``dsec bench --only fn``: the fn substrate against starting a Python process, in one run.

- latency of ``client.call(lambda: 1)`` one at a time (p50/p95/p99), against
  ``subprocess.run([sys.executable, "-c", "1"])`` on the host, alternating batches;
- throughput (calls per second) of ``client.map`` at several concurrencies, against the same
  subprocess run from as many threads;
- ``run_code`` of a python program, against the subprocess;
- fn *sandboxes* against container sandboxes of the same image, in the same server:
  create-to-first-output (``create`` + ``stream("echo hi")``), exec round trip of ``true`` in
  a running one, and memory per idle sandbox: its memory cgroup's charge (the worker's for
  fn), the PSS of an fn sandbox's init, the host's kernel memory (slab, stacks, page tables)
  per sandbox, and how many idle ones fit in available memory (cgroup + kernel).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dsec.client.aio import DSecClient
from dsec.images.store import ImageStore
from dsec.store.sqlite import StateStore

from .bench import (
    BENCH_ROOT,
    Created,
    Sample,
    _run_true,
    bench_server,
    compare,
    idle_memory,
    phase,
    report,
)
from .bench_vm import IDLE_SETTLE_S, _mem_available_mb, _stop

IMAGE = "python-3.11"
# The interpreter running the bench: a real binary. ``python3`` on PATH may be a version
# manager's shell shim (pyenv's takes ~70 ms more to start than the interpreter).
PYTHON = sys.executable


def _baseline_once() -> float:
    t0 = time.perf_counter()
    subprocess.run([PYTHON, "-c", "1"], check=True)
    return (time.perf_counter() - t0) * 1000


async def _baseline() -> float:
    return _baseline_once()  # blocking on purpose: one at a time, nothing else runs


async def _call(client: DSecClient) -> float:
    t0 = time.perf_counter()
    if await client.call(lambda: 1, image=IMAGE) != 1:
        raise RuntimeError("call returned something else")
    return (time.perf_counter() - t0) * 1000


async def _run_code(client: DSecClient) -> float:
    t0 = time.perf_counter()
    if (await client.run_code("python", "1", image=IMAGE)).exit_code != 0:
        raise RuntimeError("run_code failed")
    return (time.perf_counter() - t0) * 1000


async def _throughput(client: DSecClient, n: int, concurrency: int) -> tuple[float, float]:
    """Calls per second of dsec (map) and of the subprocess baseline (threads)."""
    t0 = time.perf_counter()
    results = await client.map(lambda x: x, range(n), concurrency=concurrency, image=IMAGE)
    ours = n / (time.perf_counter() - t0)
    if results != list(range(n)):
        raise RuntimeError("map returned something else")
    n_base = max(n // 5, 2 * concurrency)  # a fifth as many: each takes far longer
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda _: _baseline_once(), range(n_base)))
        base = n_base / (time.perf_counter() - t0)
    return ours, base


class FnCreated(Created):
    """Created fn sandboxes, with their workers' memory cgroups."""

    def __init__(self, created: Created, state: Path) -> None:
        super().__init__(created.client, substrate="fn", image=IMAGE)
        self.state = state

    def idle_memory(self) -> list[float]:
        """MB charged to each sandbox's worker memory cgroup (the agent, its tmpfs, page
        tables), found from the worker's host pid."""
        values = []
        for pid in self._pids():
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                if "memory" in controllers.split(","):
                    usage = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.usage_in_bytes"
                    values.append(int(usage.read_text()) / 1e6)
        return values

    def init_pss(self) -> list[float]:
        """PSS in MB of each sandbox's init (the agent the worker exec'd)."""
        values = []
        for pid in self._pids():
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    values.append(int(line.split()[1]) / 1024)
        return values

    def _pids(self) -> list[int]:
        """Host pids of the sandboxes' workers, as the server recorded them."""
        store = StateStore(self.state / "state.db")
        try:
            rows = {row.id: row for row in store.sandboxes()}
            return [rows[sb.id].runtime["pid"] for sb in self.sandboxes]
        finally:
            store.close()


def _kernel_mb() -> float:
    """The host's kernel memory that namespaces, tasks and page tables take (MB)."""
    fields = {line.split(":")[0]: int(line.split()[1])
              for line in Path("/proc/meminfo").read_text().splitlines()}
    return (fields["Slab"] + fields["KernelStack"] + fields["PageTables"]) / 1024


async def _kernel_per_sandbox(created: Created, n: int) -> float:
    """MB of kernel memory per sandbox over ``n`` new idle ones (namespaces, sockets, mounts:
    made before a worker joins its cgroup, so no cgroup is charged for them). Noisy on a
    shared host: settles first, so the deferred teardown of earlier sandboxes lands outside."""
    await asyncio.sleep(IDLE_SETTLE_S)
    before = _kernel_mb()
    for _ in range(n):
        await created.first_output()
    await asyncio.sleep(IDLE_SETTLE_S)
    return (_kernel_mb() - before) / n


async def _memory(containers: Created, fns: FnCreated, n: int) -> list[Sample]:
    """Per idle sandbox: its cgroup's charge, the kernel memory the host lost, an fn
    sandbox init's PSS; and how many fit in available memory (cgroup + kernel)."""
    kernel_container = await _kernel_per_sandbox(containers, n)
    kernel_fn = await _kernel_per_sandbox(fns, n)
    container = Sample("idle container memory cgroup (MB, not ms)", idle_memory(containers))
    charged = Sample("idle fn sandbox memory cgroup (MB, not ms)", fns.idle_memory(),
                     baseline=container)
    kernel = Sample("host kernel memory per idle container (MB, not ms)", [kernel_container])
    available = _mem_available_mb()
    return [container, charged, Sample("idle fn sandbox init PSS (MB, not ms)", fns.init_pss()),
            kernel, Sample("host kernel memory per idle fn sandbox (MB, not ms)", [kernel_fn],
                           baseline=kernel),
            Sample("idle containers that fit in available memory (count, not ms)",
                   _fit(available, container.pct(50) + kernel_container)),
            Sample("idle fn sandboxes that fit in available memory (count, not ms)",
                   _fit(available, charged.pct(50) + kernel_fn))]


def _fit(available_mb: float, per_sandbox_mb: float) -> list[float]:
    return [available_mb / per_sandbox_mb] if per_sandbox_mb > 0 else []  # noise won


async def sandbox_series(console: Console, containers: Created, state: Path,
                         n_create: int, n_exec: int, n_idle: int) -> list[Sample]:
    """fn sandboxes against container sandboxes of the same image, alternating batches."""
    fns = FnCreated(containers, state)
    samples: list[Sample] = []
    try:
        await containers.first_output()  # warm-up: agent binary, layer mounts, page cache
        await fns.first_output()
        await _stop(containers, fns)
        with phase(console, f"fn sandbox create-to-first-output, {n_create} one at a time"):
            samples += await compare(Sample("container create: first output", []),
                                     containers.first_output,
                                     Sample("fn sandbox create: first output", []),
                                     fns.first_output, 5, n_create // 5,
                                     between=lambda: _stop(containers, fns))
        with phase(console, f"fn sandbox exec round trip of `true`, {n_exec}"):
            box = await containers.client.create(image=IMAGE, ttl_s=600)
            fn = await fns.client.create(substrate="fn", image=IMAGE, ttl_s=600)
            samples += await compare(Sample("container exec true", []), lambda: _run_true(box),
                                     Sample("fn sandbox exec true", []), lambda: _run_true(fn),
                                     20, n_exec // 20)
            await asyncio.gather(box.stop(), fn.stop())
        with phase(console, f"memory of {n_idle} idle fn sandboxes and containers"):
            samples += await _memory(containers, fns, n_idle)
    finally:
        await _stop(containers, fns)
    return samples


async def run(console: Console, quick: bool) -> tuple[list[Sample], list[tuple[int, float, float]]]:
    n_seq, n_tp = (100, 200) if quick else (500, 1000)
    n_create, n_exec, n_idle = (10, 40, 10) if quick else (50, 200, 50)
    ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    samples: list[Sample] = []
    rates = []
    try:
        state = root / "fn"
        async with bench_server(state, "--warm-pool", "0") as server:
            client = server.client
            await client.call(lambda: 1, image=IMAGE)  # starts the template and its pool
            await asyncio.sleep(1)
            with phase(console, f"fn call latency, {n_seq} one at a time"):
                samples += await compare(Sample("subprocess.run python -c 1", []), _baseline,
                                         Sample("dsec call(lambda: 1)", []),
                                         lambda: _call(client), 20, n_seq // 20)
            with phase(console, f"fn run_code python, {n_seq // 5} one at a time"):
                samples += await compare(Sample("subprocess.run python -c 1 (again)", []), _baseline,
                                         Sample("dsec run_code python", []),
                                         lambda: _run_code(client), 10, n_seq // 50)
            for concurrency in (1, 4, 16):
                with phase(console, f"fn throughput, {n_tp} calls at concurrency {concurrency}"):
                    ours, base = await _throughput(client, n_tp, concurrency)
                    rates.append((concurrency, ours, base))
            samples += await sandbox_series(console, Created(client, image=IMAGE), state,
                                            n_create, n_exec, n_idle)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return samples, rates


def main(quick: bool = False, json_out: Path | None = None) -> None:
    console = Console()
    samples, rates = asyncio.run(run(console, quick))
    report(console, samples)
    table = Table("concurrency", "dsec calls/s", "subprocess runs/s", "ratio", title="fn throughput")
    for concurrency, ours, base in rates:
        table.add_row(str(concurrency), f"{ours:.0f}", f"{base:.0f}", f"{ours / base:.2f}")
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps({"latency": [s.row() for s in samples],
                                        "throughput": [{"concurrency": c, "calls_per_s": o,
                                                        "baseline_per_s": b} for c, o, b in rates]},
                                       indent=2))
        console.print(f"raw figures in {json_out}")
