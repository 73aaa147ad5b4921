"""``dsec bench --only fn``: the fn substrate against starting a Python process, in one run.

- latency of ``client.call(lambda: 1)`` one at a time (p50/p95/p99), against
  ``subprocess.run([python3, "-c", "1"])`` on the host, alternating batches;
- throughput (calls per second) of ``client.map`` at several concurrencies, against the same
  subprocess run from as many threads;
- ``run_code`` of a python program, against the subprocess.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .bench import BENCH_ROOT, Sample, bench_server, compare, phase, report
from .client.aio import DSecClient
from .images.store import ImageStore

IMAGE = "python-3.11"
PYTHON = shutil.which("python3") or "/usr/bin/python3"


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


async def run(console: Console, quick: bool) -> tuple[list[Sample], list[tuple[int, float, float]]]:
    n_seq, n_tp = (100, 200) if quick else (500, 1000)
    ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    samples: list[Sample] = []
    rates = []
    try:
        async with bench_server(root / "fn", "--warm-pool", "0") as server:
            client = server.client
            await client.call(lambda: 1, image=IMAGE)  # starts the template and its pool
            await asyncio.sleep(1)
            with phase(console, f"fn call latency, {n_seq} one at a time"):
                samples += await compare(Sample("subprocess.run python3 -c 1", []), _baseline,
                                         Sample("dsec call(lambda: 1)", []),
                                         lambda: _call(client), 20, n_seq // 20)
            with phase(console, f"fn run_code python, {n_seq // 5} one at a time"):
                samples += await compare(Sample("subprocess.run python3 -c 1 (again)", []), _baseline,
                                         Sample("dsec run_code python", []),
                                         lambda: _run_code(client), 10, n_seq // 50)
            for concurrency in (1, 4, 16):
                with phase(console, f"fn throughput, {n_tp} calls at concurrency {concurrency}"):
                    ours, base = await _throughput(client, n_tp, concurrency)
                    rates.append((concurrency, ours, base))
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
