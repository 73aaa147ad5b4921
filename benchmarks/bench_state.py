"""``dsec bench --only state``: what filesystem snapshots cost, on a private server with no
warm pool (so a cold create is the baseline of a create from a snapshot).

- snapshot of a sandbox with a small diff (a few files written), and with 200 MB written
  (on ext4 the copy reads the blocks written; on xfs/btrfs it is a clone, O(1));
- create-to-first-output from a snapshot against a cold create, alternating batches;
- fork(10): one snapshot and ten creates from it, per child;
- rollback of a sandbox to its own snapshot (processes killed, disk copied, init restarted);
- a trajectory's checkpoint per step: a step logged with ``checkpoint="every_step"`` against
  the same step logged without, alternating batches, for a step that writes nothing
  (``true``: the previous snapshot is kept, after a syncfs and a counter read) and one that
  writes a small file (a snapshot is taken).
- a microVM (``$DSEC_BENCH_VM_ACCEL``, default ``tcg``), few rounds: a ``filesystem`` and a
  ``full`` snapshot, create-to-first-output from a ``full`` snapshot (restored with its
  processes) against a cold boot, and a ``full`` rollback.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from pathlib import Path

from rich.console import Console

from dsec.client.aio import DSecClient
from dsec.client.aio import Sandbox as AsyncSandbox
from dsec.images.store import ImageStore

from .bench import BENCH_ROOT, IMAGE, Sample, bench_server, compare, phase


async def _timed_snapshot(client: DSecClient, sb: AsyncSandbox, mode: str = "filesystem") -> float:
    """ms to snapshot ``sb`` (the snapshot is deleted after, untimed)."""
    t0 = time.perf_counter()
    snap = await sb.snapshot(mode)
    elapsed = (time.perf_counter() - t0) * 1000
    await client.delete_snapshot(snap.id)
    return elapsed


async def _timed_step(sb: AsyncSandbox, command: str) -> float:
    t0 = time.perf_counter()
    if (await sb.run(command)).exit_code != 0:
        raise RuntimeError(f"{command!r} failed")
    return (time.perf_counter() - t0) * 1000


async def checkpoint_series(console: Console, client: DSecClient, steps: int) -> list[Sample]:
    """Each step logged in a trajectory without checkpoints (the baseline) and with one
    after every step (the checkpoints go with the private server's state dir)."""
    plain = await client.create(image=IMAGE, ttl_s=900, trajectory=f"bench/{secrets.token_hex(4)}")
    checkpointed = await client.create(image=IMAGE, ttl_s=900,
                                       trajectory=f"bench/{secrets.token_hex(4)}",
                                       checkpoint="every_step")
    samples: list[Sample] = []
    try:
        for what, command in (("writes nothing (exec true)", "true"),
                              ("writes a small file", "echo $$ > /work/step")):
            with phase(console, f"checkpoint per step, a step that {what}, {steps} steps"):
                samples += await compare(
                    Sample(f"step that {what}, logged", []),
                    lambda command=command: _timed_step(plain, command),  # type: ignore[misc]
                    Sample(f"step that {what}, logged + checkpoint", []),
                    lambda command=command: _timed_step(checkpointed, command),  # type: ignore[misc]
                    20, steps // 20)
    finally:
        await asyncio.gather(plain.stop(), checkpointed.stop())
    return samples


async def run_state(console: Console, quick: bool = False) -> list[Sample]:
    snaps, creates, forks = (10, 10, 2) if quick else (50, 50, 5)
    ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    samples: list[Sample] = []
    try:
        async with bench_server(root / "state", "--warm-pool", "0") as created:
            client = created.client
            parent = await client.create(image=IMAGE, ttl_s=1800)
            try:
                await parent.run("mkdir -p /work/repo && seq 1000 > /work/repo/data && "
                                 "echo 'print(1)' > /work/repo/main.py")
                with phase(console, f"snapshot, small diff, {snaps} times"):
                    small = Sample("snapshot, small diff", [])
                    for _ in range(snaps):
                        small.values_ms.append(await _timed_snapshot(client, parent))
                    samples.append(small)
                big = await client.create(image=IMAGE, ttl_s=600)
                try:
                    await big.run("head -c 200000000 /dev/urandom > /work/blob", timeout_s=300)
                    with phase(console, "snapshot, 200 MB written"):
                        written = Sample("snapshot, 200 MB written", [])
                        for _ in range(max(3, snaps // 10)):
                            written.values_ms.append(await _timed_snapshot(client, big))
                        samples.append(written)
                finally:
                    await big.stop()
                snap = await parent.snapshot()
                await created.first_output()  # warm-up: layer mounts, agent binary, caches
                await created.first_output(snapshot=snap.id)
                await created.stop_all()
                with phase(console, f"create-to-first-output, {creates} each"):
                    samples += await compare(
                        Sample("cold create: first output", []), created.first_output,
                        Sample("create from a snapshot: first output", []),
                        lambda: created.first_output(snapshot=snap.id), 5, creates // 5,
                        between=created.stop_all)
                with phase(console, f"fork(10), {forks} times"):
                    per_child = Sample("fork(10), per child", [])
                    for _ in range(forks):
                        t0 = time.perf_counter()
                        children = await parent.fork(10, ttl_s=120)
                        per_child.values_ms.append((time.perf_counter() - t0) * 1000 / 10)
                        kids = [c for c in children if isinstance(c, AsyncSandbox)]
                        per_child.failures += len(children) - len(kids)
                        await asyncio.gather(*(k.stop() for k in kids))
                    samples.append(per_child)
                with phase(console, f"rollback, {forks * 4} times"):
                    back = Sample("rollback to its own snapshot", [])
                    for _ in range(forks * 4):
                        await parent.write_file("/work/repo/main.py", b"print(2)")
                        t0 = time.perf_counter()
                        await parent.rollback(snap)
                        back.values_ms.append((time.perf_counter() - t0) * 1000)
                    samples.append(back)
                await client.delete_snapshot(snap.id)
            finally:
                await parent.stop()
            samples += await checkpoint_series(console, client, 100 if quick else 400)
        samples += await _vm_series(console, root / "vm", 3 if quick else 10)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return samples


async def _vm_series(console: Console, state: Path, rounds: int) -> list[Sample]:
    accel = os.environ.get("DSEC_BENCH_VM_ACCEL", "tcg")
    vm = dict(substrate="microvm", image=IMAGE, memory_mb=256, ttl_s=1800)
    samples: list[Sample] = []
    async with bench_server(state, "--warm-pool", "0", "--vm-accel", accel) as created:
        client = created.client
        parent = await client.create(**vm)  # type: ignore[arg-type]
        try:
            await parent.start(["sh", "-c", "while :; do date > /tmp/now; sleep 0.1; done"])
            for mode in ("filesystem", "full"):
                with phase(console, f"microvm ({accel}) {mode} snapshot, {rounds} times"):
                    taken = Sample(f"microvm ({accel}) {mode} snapshot", [])
                    for _ in range(rounds):
                        taken.values_ms.append(await _timed_snapshot(client, parent, mode))
                    samples.append(taken)
            snap = await parent.snapshot("full")

            async def first_output(**options: object) -> float:
                t0 = time.perf_counter()
                sb = await client.create(**{**vm, **options})  # type: ignore[arg-type]
                try:
                    await sb.run("true")
                    return (time.perf_counter() - t0) * 1000
                finally:
                    await sb.stop()

            with phase(console, f"microvm ({accel}) create from a full snapshot vs a cold boot"):
                samples += await compare(
                    Sample(f"microvm ({accel}) cold boot: first output", []), first_output,
                    Sample(f"microvm ({accel}) from a full snapshot: first output", []),
                    lambda: first_output(snapshot=snap.id), 1, rounds)
            with phase(console, f"microvm ({accel}) full rollback, {rounds} times"):
                back = Sample(f"microvm ({accel}) rollback to a full snapshot", [])
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    await parent.rollback(snap)
                    back.values_ms.append((time.perf_counter() - t0) * 1000)
                samples.append(back)
            await client.delete_snapshot(snap.id)
        finally:
            await parent.stop()
    return samples
