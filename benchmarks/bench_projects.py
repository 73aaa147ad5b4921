"""``dsec bench --only projects``: what projects cost, measured against the admin key on the
same server, alternating batches (``bench.compare``).

- create-to-first-output with a key of a project three levels deep (its quota checked and
  reserved at admission, given back at stop) against the admin key (project ``default``,
  admitted the same way at the root);
- ``GET /v1/sandboxes`` with a project key that owns a tenth of the live sandboxes (each
  sandbox's project looked up, the rest filtered out) against the admin key (all of them).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time

from rich.console import Console

from dsec.client.aio import DSecClient
from dsec.images.store import ImageStore

from .bench import BENCH_ROOT, IMAGE, Created, Sample, bench_server, compare, phase


async def run_projects(console: Console, quick: bool = False) -> list[Sample]:
    creates, listed = (20, 50) if quick else (100, 200)
    ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    samples: list[Sample] = []
    try:
        async with bench_server(root / "projects", "--warm-pool", "0") as admin:
            projects = admin.client.projects()
            parent = "bench"
            for depth, name in enumerate(("bench", "bench-team", "bench-run")):
                await projects.create(name, parent="default" if depth == 0 else parent,
                                      sandboxes=1000 - depth, cpu=1000 - depth,
                                      memory_mb=1 << 20)
                parent = name
            key = (await projects.create_key("bench-run", "bench")).key
            url = f"unix://{root / 'projects' / 'api.sock'}"
            async with DSecClient(url, key, autostart=False) as client:
                team = Created(client)
                await admin.first_output()  # warm-up: agent binary, layer mounts, page cache
                await team.first_output()

                async def clean_up() -> None:
                    await asyncio.gather(admin.stop_all(), team.stop_all())

                await clean_up()
                with phase(console, f"create-to-first-output, {creates} per key"):
                    samples += await compare(
                        Sample("admin key (project default): first output", []),
                        admin.first_output,
                        Sample("key of a nested project: first output", []),
                        team.first_output, 10, creates // 10, between=clean_up)
                with phase(console, f"listing among {listed} live sandboxes"):
                    for _ in range(listed - listed // 10):
                        await admin.first_output()
                    for _ in range(listed // 10):
                        await team.first_output()

                    async def timed_list(c: DSecClient, expect: int) -> float:
                        t0 = time.perf_counter()
                        if len(await c.list()) != expect:
                            raise RuntimeError("the listing is not what the key may see")
                        return (time.perf_counter() - t0) * 1000

                    samples += await compare(
                        Sample(f"admin key: list {listed}", []),
                        lambda: timed_list(admin.client, listed),
                        Sample(f"project key: list its {listed // 10} of {listed}", []),
                        lambda: timed_list(client, listed // 10), 20, 5)
                await clean_up()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return samples
