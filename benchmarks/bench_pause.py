"""``dsec bench --only pause``: what pause and resume cost, on one container sandbox with a
busy loop inside, alternating batches (``bench.compare``).

- ``sb.pause()`` through the API (the edge writes the cgroup freezer and waits for it to
  settle) against ``crun pause`` run from the host (the same write, plus a fork and exec);
- ``sb.resume()`` against ``crun resume``, likewise;
- ``run("true")`` on a paused sandbox (resumed on the call's path) against on a running one;
- a microVM (``$DSEC_BENCH_VM_ACCEL``, default ``tcg``) with 200 MB of its memory in use:
  ``sb.pause()`` (saved to disk, QEMU exits), ``run("true")`` on it (restored on the call's
  path), and the host memory freed by the pause (QEMU's RSS before; after, no QEMU).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.console import Console

from dsec.client.aio import Sandbox
from dsec.images.store import ImageStore
from dsec.substrates.container.container import RUNTIME_DIR
from dsec.substrates.host.volume import VOLUME_DIR

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
            crun = ["crun", "--root", str(root / "pause" / VOLUME_DIR / RUNTIME_DIR / "crun")]

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
        samples += await _vm_series(console, root / "vm", rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return samples


async def _vm_series(console: Console, state: Path, rounds: int) -> list[Sample]:
    accel = os.environ.get("DSEC_BENCH_VM_ACCEL", "tcg")
    paused = Sample(f"microvm ({accel}) sb.pause(), saved to disk", [])
    call = Sample(f"microvm ({accel}) run('true') on a paused VM (restored)", [])
    freed = Sample(f"microvm ({accel}) host memory freed by pause (MB, not ms)", [])
    async with bench_server(state, "--warm-pool", "0", "--vm-accel", accel) as created:
        sb = await created.client.create(substrate="microvm", image=IMAGE, memory_mb=512,
                                         ttl_s=1800)
        created.sandboxes.append(sb)
        await sb.run("head -c 200M /dev/urandom > /dev/shm/fill", timeout_s=600)  # not zero pages: a save skips those
        with phase(console, f"microvm ({accel}) pause to disk and resume, {rounds} times"):
            for _ in range(rounds):
                rss = _qemu_rss_mb(sb.id)
                paused.values_ms.append(await _ms(sb.pause))
                freed.values_ms.append(rss - _qemu_rss_mb(sb.id))
                call.values_ms.append(await _ms(_run(sb)))
    return [paused, call, freed]


def _qemu_rss_mb(sandbox_id: str) -> float:
    """Resident MB of the sandbox's QEMU (0 with none)."""
    total = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"qemu-system" in (proc / "cmdline").read_bytes()[:200] and \
                    sandbox_id.encode() in (proc / "cmdline").read_bytes():
                status = (proc / "status").read_text()
                total += int(status.split("VmRSS:")[1].split()[0])
        except (OSError, IndexError):
            continue
    return total / 1024


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

