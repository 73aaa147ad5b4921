"""A warm pool that grows with bursts, under ``dsec serve --ray``: a real Ray cluster of one
edge node and an API replica over PostgreSQL. A burst of creates through the replica grows the
node's pool for the image (``--warm-pool-max``), as an embedded server's does
(tests/test_warm_pool.py, which also shows the next burst claimed from it); it refills after
the next burst, and once the hold is over it shrinks back. The replica's health reports each
node's pool."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from typing import Any, Iterator

import pytest

import dsec
from conftest import Server

pytest.importorskip("ray", reason="the cluster tests need the `cluster` extra (Ray)")
from dsec.cluster.local import LocalRayCluster  # noqa: E402
from dsec.store.local_postgres import LocalPostgres  # noqa: E402
from test_cluster import replica_server, started_cluster, wait_for_edge  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster(images: Any) -> Iterator[LocalRayCluster]:
    with started_cluster("cw", [None, 10]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def replica(ray_cluster: LocalRayCluster, local_postgres: LocalPostgres) -> Iterator[Server]:
    url = local_postgres.fresh_database("warm_" + secrets.token_hex(3))
    server = replica_server(ray_cluster, url, "--warm-pool", "1", "--warm-pool-max", "5",
                            "--warm-pool-hold-s", "30").start()
    wait_for_edge(server, ray_cluster.edge_of(ray_cluster.nodes[1]))
    yield server
    server.kill(signal.SIGTERM)


async def _warm(client: dsec.DSecClient) -> int:
    [edge] = (await client.health())["edges"]
    return int(edge.get("warm", {}).get("container", {}).get("debian-minbase", 0))


async def _until_warm(client: dsec.DSecClient, n: int, what: str, timeout_s: float = 120) -> None:
    """Wait for an eventual state (the bound only ends a broken run)."""
    deadline = time.monotonic() + timeout_s
    while await _warm(client) != n:
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        await asyncio.sleep(0.2)


async def test_a_burst_grows_the_nodes_pool_under_ray(replica: Server) -> None:
    async with replica.client() as client:
        await (await client.create(ttl_s=120)).stop()  # the image gets a pool on the node
        await _until_warm(client, 1, "the pool did not fill to --warm-pool")
        burst = await asyncio.gather(*(client.create(ttl_s=120) for _ in range(7)))
        await asyncio.gather(*(sb.stop() for sb in burst))
        await _until_warm(client, 5, "the pool did not grow to --warm-pool-max")
        again = await asyncio.gather(*(client.create(ttl_s=120) for _ in range(5)))
        assert len({sb.id for sb in again}) == 5
        assert [(await sb.run("echo ok")).stdout for sb in again] == ["ok\n"] * 5
        await asyncio.gather(*(sb.stop() for sb in again))
        await _until_warm(client, 5, "the pool did not refill after the claims")
        await _until_warm(client, 1, "the pool did not shrink after the hold")
