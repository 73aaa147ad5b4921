"""``dsec bench --only create``: the create/stop path alone, against bare ``crun`` in the same
run (``bench.compare`` alternates the batches), without the rest of the full benchmark.

- create-to-first-output, one at a time and in a burst of 100 (``--quick``: 20), as the full
  benchmark times it (``bench.Created.first_output`` against ``bench.BareCrun.run_echo``);
- stop, one at a time: ``sb.stop()`` of an idle sandbox until it returns (the sandbox can no
  longer run and is recorded as stopping; see ARCHITECTURE.md, "Stop") against
  ``crun delete --force`` of an idle container plus the unmount of its overlay;
- the whole stop, until the server holds nothing of the sandboxes (no bundle directory, no
  runtime record): the time for 100 (``--quick``: 20) stops issued at once to finish.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rich.console import Console

from dsec.client.aio import Sandbox
from dsec.substrates.container.container import RUNTIME_DIR
from dsec.substrates.host.volume import VOLUME_DIR

from .bench import (
    IMAGE,
    Created,
    Sample,
    bare_workspace,
    bench_server,
    cold_create_phases,
    compare,
    phase,
)


async def create_series(console: Console, quick: bool = False) -> list[Sample]:
    n_seq, n_burst, n_stop = (10, 20, 20) if quick else (50, 100, 50)
    samples: list[Sample] = []
    with bare_workspace(console) as (root, bare):
        async with bench_server(root / "cold", "--warm-pool", "0") as cold:
            await cold.first_output()  # warm-up: agent binary, layer mounts, page cache
            await bare.run_echo()
            await cold.stop_all()
            samples += await cold_create_phases(console, cold, bare, n_seq, n_burst, 2,
                                                cold.stop_all)
            with phase(console, "stop, one at a time"):
                samples += await compare(Sample("bare crun delete + unmount", []),
                                         lambda: bare.timed_removal(),
                                         Sample("dsec stop", []), lambda: _timed_stop(cold),
                                         10, n_stop // 10)
            with phase(console, f"{n_burst} stops at once, until nothing is left"):
                samples.append(await _stops_until_clean(cold, root / "cold", n_burst))
    return samples


async def _timed_stop(created: Created) -> float:
    """ms of ``stop`` of a fresh idle sandbox (its create untimed)."""
    sb = await created.client.create(image=IMAGE, ttl_s=120)
    t0 = time.perf_counter()
    await sb.stop()
    return (time.perf_counter() - t0) * 1000


async def _stops_until_clean(created: Created, state: Path, n: int) -> Sample:
    """``n`` idle sandboxes stopped at once: ms from the first ``stop`` until the server has
    removed every one's bundle directory and runtime record (polled every 5 ms)."""
    sandboxes: list[Sandbox] = list(await asyncio.gather(
        *(created.client.create(image=IMAGE, ttl_s=120) for _ in range(n))))
    ids = {sb.id for sb in sandboxes}
    t0 = time.perf_counter()
    await asyncio.gather(*(sb.stop() for sb in sandboxes))
    returned = (time.perf_counter() - t0) * 1000
    runtime = state / VOLUME_DIR / RUNTIME_DIR / "crun"
    bundles = state / "volume" / "sandboxes"
    while any((runtime / i).exists() or (bundles / i).exists() for i in ids):
        if time.perf_counter() - t0 > 120:
            raise RuntimeError("the stopped sandboxes were not cleaned up within 120 s")
        await asyncio.sleep(0.005)
    sample = Sample(f"dsec: {n} stops at once, all clean (ms in all)",
                    [(time.perf_counter() - t0) * 1000])
    sample.extra["stops_returned_ms"] = returned
    return sample
