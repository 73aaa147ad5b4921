"""Image-layer garbage collection under ``dsec serve --ray``: a real two-node Ray cluster,
real PostgreSQL, its own image store (never the shared cache) and two API replicas. A layer
a sandbox uses on a cluster node survives collections by both replicas at once, while an
image nothing uses loses its own layers, each removed and counted exactly once."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
from collections.abc import Iterator

import pytest

from conftest import Server, scrape
from dsec.images.store import ImageStore
from dsec.store.local_postgres import LocalPostgres
from test_layer_gc import GRACE_S, import_image, on_disk, own_layers

pytest.importorskip("ray", reason="the cluster tests need the `cluster` extra (Ray)")
from dsec.cluster.local import LocalRayCluster  # noqa: E402
from test_cluster import replica_server, started_cluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[LocalRayCluster, ImageStore]]:
    with started_cluster("lg", [4, 4]) as ray_cluster:
        # every node's, as on a shared mount
        yield ray_cluster, ImageStore(ray_cluster.state_dir / "images")


def replica(ray_cluster: LocalRayCluster, store: ImageStore, url: str) -> Server:
    return replica_server(ray_cluster, url, "--image-store", str(store.root), "--warm-pool", "0",
                          "--layer-grace-s", str(GRACE_S), "--gc-interval-s", "3600").start()


async def test_a_layer_used_on_a_node_survives_two_replicas_collecting_at_once(
        cluster: tuple[LocalRayCluster, ImageStore], local_postgres: LocalPostgres) -> None:
    ray_cluster, store = cluster
    used, unused = import_image(store, "used"), import_image(store, "unused")
    url = local_postgres.fresh_database("layers_" + secrets.token_hex(3))
    first = replica(ray_cluster, store, url)
    second = None
    try:
        second = replica(ray_cluster, store, url)
        async with first.client() as a, second.client() as b:
            sb = await a.create(image="used", ttl_s=300)
            edge = sb.id.split("-")[1]
            assert edge in {ray_cluster.edge_of(n) for n in ray_cluster.nodes}
            record = json.loads((store.root / "nodes" / f"{edge}.json").read_text())
            assert record["images"][used.digest] == [layer.digest for layer in used.layers]
            store.remove("used")
            store.remove("unused")
            await asyncio.sleep(GRACE_S + 1)
            reports = await asyncio.gather(a.gc(), b.gc())
            removed = [{r.kind: r.count for r in report.removed} for report in reports]
            assert sum(r["layers"] for r in removed) == len(own_layers(unused, used))
            assert sum(r["image_versions"] for r in removed) == 1  # unused's
            assert on_disk(store) == {layer.digest for layer in used.layers}
            assert (await sb.run("cat /used.txt")).stdout == "used\n"
            counted = sum(scrape(s).get("dsec_gc_removed_total{kind=layers}", 0)
                          for s in (first, second))
            assert counted == len(own_layers(unused, used))
            await sb.stop()
    finally:
        for server in (first, second):
            if server is not None:
                server.kill(signal.SIGTERM)
