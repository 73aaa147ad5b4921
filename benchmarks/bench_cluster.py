"""``dsec bench --only cluster``: creates across a local Ray cluster against the single-node
embedded mode, in one run.

Both sides are driven in-process through their router (no HTTP, so the figures compare the
create paths): the embedded mode is one ``Edge`` on SQLite; the cluster is a head and two
worker nodes (separate raylets on this host, ``dsec.cluster.local``) with an edge actor each
and PostgreSQL state. For each burst size: create latency p50/p95/p99 (ms) and throughput
(sandboxes/s), cold creates (no warm pool), ``CONCURRENCY`` in flight, the two sides in
turn (three rounds of bursts up to 100, one of larger ones). Also the time of one
placement decision, and how long after a node is killed a call on its sandbox answers
``SandboxDied``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from rich.console import Console

from dsec.config import Settings
from dsec.control.directory import LocalEdges
from dsec.control.routing import Router
from dsec.edge.edge import Edge, EdgeConfig
from dsec.edge.metrics import EdgeMetrics
from dsec.images.store import ImageStore
from dsec.protocol.errors import SandboxDied
from dsec.protocol.models import CreateRequest, ExecRequest
from dsec.store.local_postgres import LocalPostgres
from dsec.store.sqlite import StateStore
from dsec.substrates.container.container import ContainerSubstrate
from dsec.substrates.host.volume import DiskVolume

from .bench import BENCH_ROOT, IMAGE, Sample, phase
from .server_host import loop_devices_under, steady

CONCURRENCY = 32
NODES = 3
QUIET_TIMEOUT_S = 120.0  # for one side's removals and refills to end after its burst's stops


async def burst(router: Any, n: int) -> tuple[list[float], float, list[str]]:
    """(create latencies in ms, sandboxes per second, the sandbox ids) of ``n`` creates."""
    gate = asyncio.Semaphore(CONCURRENCY)
    latencies: list[float] = []
    ids: list[str] = []

    async def one() -> None:
        async with gate:
            t0 = time.perf_counter()
            info = await router.place(CreateRequest(image=IMAGE, ttl_s=900))
            latencies.append((time.perf_counter() - t0) * 1000)
            ids.append(info.id)

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return latencies, n / (time.perf_counter() - started), ids


async def stop_all(router: Any, ids: list[str]) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(sandbox_id: str) -> None:
        async with gate:
            await router.owner(sandbox_id).stop(sandbox_id)

    await asyncio.gather(*(one(i) for i in ids))


async def alternate(console: Console, routers: dict[str, Any], sizes: list[int],
                    root: Path) -> list[Sample]:
    """Bursts on each side in turn (several rounds for small bursts), so both meet the same
    machine: on a shared host conditions drift more between minutes than between sides. A
    burst starts once the loop devices under ``root`` (both sides' disks) hold still: the
    stopped sandboxes' removal and the disk stocks' refill run after the stops answered, and
    would otherwise land in the next side's burst (a burst of 1,000's removal takes seconds)."""
    latency = {(label, n): Sample(f"{label} create: burst {n}", []) for label in routers for n in sizes}
    rate = {(label, n): Sample(f"{label} creates/s (not ms): burst {n}", []) for label in routers
            for n in sizes}
    for n in sizes:
        for round_ in range(3 if n <= 100 else 1):
            for label, router in routers.items():
                with phase(console, f"{label}: burst of {n} creates (round {round_ + 1})"):
                    latencies, per_s, ids = await burst(router, n)
                    await stop_all(router, ids)
                    await steady(lambda: loop_devices_under(root), timeout_s=QUIET_TIMEOUT_S)
                latency[label, n].values_ms += latencies
                rate[label, n].values_ms.append(per_s)
    base, ours = list(routers)
    for n in sizes:
        latency[ours, n].baseline = latency[base, n]
        rate[ours, n].baseline = rate[base, n]
    return [sample for n in sizes for table in (latency, rate) for label in routers
            for sample in [table[label, n]]]


def single_node(root: Any, capacity: int) -> Router:
    store = StateStore(root / "state.db")
    config = EdgeConfig(state_dir=root, capacity=capacity, warm_pool=0)
    volume = DiskVolume(root, config.edge_id)
    edge = Edge(config, store, ImageStore(),
                {"container": ContainerSubstrate(root, config.edge_id, volume)},
                EdgeMetrics(CollectorRegistry()), volume)
    return Router(LocalEdges([edge]))


async def death_report_s(router: Any, cluster: Any) -> float:
    """Seconds from killing a worker node to ``SandboxDied`` on one of its sandboxes."""
    victim = cluster.nodes[-1]
    _, _, ids = await burst(router, 12)
    mine = [i for i in ids if router.owner(i).id == cluster.edge_of(victim)]
    if not mine:
        return float("nan")
    killed = time.perf_counter()
    await asyncio.to_thread(cluster.kill_node, victim)
    while True:
        try:
            await router.owner(mine[0]).run(mine[0], ExecRequest(command="true"))
        except SandboxDied:
            elapsed = time.perf_counter() - killed
            break
        await asyncio.sleep(0.05)
    await stop_all(router, [i for i in ids if i not in mine])
    return elapsed


async def cluster_benchmark(console: Console, sizes: list[int]) -> list[Sample]:
    import ray

    from dsec.cluster.directory import RayEdges
    from dsec.cluster.ids import NAMESPACE
    from dsec.cluster.local import LocalRayCluster

    ImageStore().ensure(IMAGE, console=console)
    capacity = max(sizes)
    root = BENCH_ROOT / f"cluster-{secrets.token_hex(3)}"
    (root / "single").mkdir(parents=True)
    samples: list[Sample] = []
    async with AsyncExitStack() as cleanup:  # every step undone, even if another fails
        cleanup.callback(shutil.rmtree, root, ignore_errors=True)
        pg = LocalPostgres().start()
        cleanup.callback(pg.stop)
        single = single_node(root / "single", capacity)
        await single.start()
        cleanup.push_async_callback(single.close)
        await stop_all(single, (await burst(single, 4))[2])  # warm-up: agent, layer mounts
        with phase(console, f"starting a local Ray cluster of {NODES} nodes"):
            cluster = LocalRayCluster(root / "cluster", [capacity] * NODES)
            cleanup.callback(cluster.stop)
            cluster.start()
            ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False,
                     logging_level=logging.ERROR)
            cleanup.callback(ray.shutdown)
            edges = RayEdges(StateStore(pg.url), Settings.load(
                state_dir=cluster.state_dir, state_url=pg.url, capacity=capacity, warm_pool=0))
            router = Router(edges)
            await router.start()
            cleanup.push_async_callback(router.close)
            await stop_all(router, (await burst(router, 4 * NODES))[2])
        edges.decision_seconds.clear()
        samples += await alternate(console, {"single node": single,
                                             f"cluster of {NODES}": router}, sizes, root)
        samples.append(Sample("placement decision (µs, not ms)",
                              [s * 1e6 for s in edges.decision_seconds]))
        with phase(console, "a worker node killed: time to SandboxDied"):
            samples.append(Sample("node killed -> SandboxDied (s, not ms)",
                                  [await death_report_s(router, cluster)]))
    return samples
