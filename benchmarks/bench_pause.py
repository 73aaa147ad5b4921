"""``dsec bench --only pause``: what pause and resume cost, on one container sandbox with a
busy loop inside, alternating batches (``bench.compare``).

- ``sb.pause()`` through the API (the edge writes the cgroup freezer and waits for it to
  settle) against ``crun pause`` run from the host (the same write, plus a fork and exec);
- ``sb.resume()`` against ``crun resume``, likewise;
- ``run("true")`` on a paused sandbox (resumed on the call's path) against on a running one.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable

from rich.console import Console

from dsec.client.aio import Sandbox
from dsec.images.store import ImageStore

from .bench import BENCH_ROOT, IMAGE, Sample, bench_server, compare, phase


async def pause_series(console: Console, quick: bool = False) -> list[Sample]:
    rounds = 3 if quick else 10
    ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    samples: list[Sample] = []
    try:
        async with bench_server(root / "pause", "--warm-pool", "0") as created:
            sb = await created.client.create(image=IMAGE, ttl_s=600)
            created.sandboxes.append(sb)
            await sb.start(["sh", "-c", "while :; do :; done"])
            crun = ["crun", "--root", str(root / "pause" / "runtime" / "crun")]

            async def host(verb: str) -> float:
                t0 = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(*crun, verb, sb.id)
                if await proc.wait() != 0:
                    raise RuntimeError(f"crun {verb} failed")
                return (time.perf_counter() - t0) * 1000

            with phase(console, "pause"):
                samples += await compare(
                    Sample("crun pause (from the host)", []),
                    lambda: _then(host("pause"), host("resume")),
                    Sample("sb.pause()", []), lambda: _then(_ms(sb.pause), sb.resume()), 10, rounds)
            with phase(console, "resume"):
                samples += await compare(
                    Sample("crun resume (from the host)", []),
                    lambda: _before(host("pause"), host("resume")),
                    Sample("sb.resume()", []), lambda: _before(sb.pause(), _ms(sb.resume)),
                    10, rounds)
            with phase(console, "a call on a paused sandbox"):
                samples += await compare(
                    Sample("run('true') on a running sandbox", []), lambda: _ms(_run(sb)),
                    Sample("run('true') on a paused sandbox", []),
                    lambda: _before(sb.pause(), _ms(_run(sb))), 10, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return samples


def _run(sb: Sandbox) -> Callable[[], Awaitable[object]]:
    return lambda: sb.run("true")


async def _ms(call: Callable[[], Awaitable[object]]) -> float:
    t0 = time.perf_counter()
    await call()
    return (time.perf_counter() - t0) * 1000


async def _then(timed: Awaitable[float], after: Awaitable[object]) -> float:
    elapsed = await timed
    await after
    return elapsed


async def _before(first: Awaitable[object], timed: Awaitable[float]) -> float:
    await first
    return await timed

