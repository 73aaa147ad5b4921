"""Snapshots on any node, under ``dsec serve --ray``: a real Ray cluster of two edge nodes (the
head runs no edge), real PostgreSQL, one API replica with a shared snapshot directory.

A container's and an fn sandbox's snapshots are taken on one node, which is then killed; a
create from each lands on the other node and has the files. An export tampered with in the
shared directory is refused there (typed, nothing made); deleting a snapshot whose node is
dead removes its exported copy and the other node's fetched one. A full node sends a create
from its snapshot to another, whose fetched copy goes soon after the snapshot is deleted.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import dsec
from conftest import Server

pytest.importorskip("ray", reason="the cluster tests need the `cluster` extra (Ray)")
from dsec.cluster.local import LocalRayCluster  # noqa: E402
from dsec.store.local_postgres import LocalPostgres  # noqa: E402
from dsec.substrates.host.volume import VOLUME_DIR  # noqa: E402
from test_cluster import died, replica_server, started_cluster, wait_for_edge  # noqa: E402

FN_IMAGE = "python-3.11"


@pytest.fixture(scope="module")
def ray_cluster(images) -> Iterator[LocalRayCluster]:  # type: ignore[no-untyped-def]
    with started_cluster("cs", [None, 8, 8]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def replica(ray_cluster: LocalRayCluster, local_postgres: LocalPostgres) -> Iterator[Server]:
    url = local_postgres.fresh_database("snapshots_" + secrets.token_hex(3))
    server = replica_server(ray_cluster, url, "--warm-pool", "0", "--shared-snapshots",
                            str(ray_cluster.state_dir / "shared")).start()
    for node in ray_cluster.nodes[1:]:
        wait_for_edge(server, ray_cluster.edge_of(node))
    yield server
    server.kill(signal.SIGTERM)


def exported(cluster: LocalRayCluster, snapshot_id: str, within_s: float = 60) -> Path:
    path = cluster.state_dir / "shared" / f"{snapshot_id}.img"
    deadline = time.monotonic() + within_s
    while not path.exists():
        assert time.monotonic() < deadline, f"snapshot {snapshot_id} was never exported"
        time.sleep(0.05)
    return path


def node_of(cluster: LocalRayCluster, edge: str) -> Any:
    return next(node for node in cluster.nodes if cluster.edge_of(node) == edge)


async def test_a_snapshot_outlives_its_node(ray_cluster: LocalRayCluster, replica: Server) -> None:
    async with replica.client() as client:
        box = await client.create(memory_mb=256, ttl_s=600)
        edge_a = box.info.edge
        fn = await client.create(substrate="fn", image=FN_IMAGE, ttl_s=600)
        while fn.info.edge != edge_a:  # both on one node, the one to be killed
            await fn.stop()
            fn = await client.create(substrate="fn", image=FN_IMAGE, ttl_s=600)
        await box.run("mkdir -p /opt/state && echo container-state > /opt/state/f && "
                      "dd if=/dev/urandom of=/work/blob bs=1M count=20 2>/dev/null && "
                      "md5sum /work/blob > /opt/state/sum")
        await fn.run("echo fn-state > /work/f && mkdir /tmp/d && ln -s /etc/passwd /tmp/d/l")
        started = time.monotonic()
        snap_box, snap_fn = await box.snapshot(), await fn.snapshot()
        taken = time.monotonic() - started
        for snap in (snap_box, snap_fn):
            exported(ray_cluster, snap.id)
        export_s = time.monotonic() - started
        tampered = await box.snapshot()
        path = exported(ray_cluster, tampered.id)
        with open(path, "r+b") as f:  # one flipped byte, where the disk has data
            f.seek(1 << 20)
            byte = f.read(1)
            f.seek(1 << 20)
            f.write(bytes([byte[0] ^ 0xFF]))

        ray_cluster.kill_node(node_of(ray_cluster, edge_a))
        await died(box)

        started = time.monotonic()
        child = await client.create(snapshot=snap_box.id, memory_mb=256, ttl_s=300)
        cross_node_s = time.monotonic() - started
        assert child.info.edge != edge_a
        assert (await child.run("cat /opt/state/f && md5sum -c /opt/state/sum")).stdout == \
            "container-state\n/work/blob: OK\n"
        fn_child = await client.create(snapshot=snap_fn.id, ttl_s=300)
        assert fn_child.info.edge != edge_a and fn_child.info.substrate == "fn"
        assert (await fn_child.run("cat /work/f; readlink /tmp/d/l")).stdout == \
            "fn-state\n/etc/passwd\n"
        print(f"\nsnapshots taken {taken * 1000:.0f} ms, both exported {export_s * 1000:.0f} ms "
              f"after; container child on the other node (fetch of a 20 MB disk included) "
              f"{cross_node_s * 1000:.0f} ms")

        live = {sb.id for sb in await client.list()}
        with pytest.raises(dsec.SnapshotCorrupt):
            await client.create(snapshot=tampered.id, memory_mb=256, ttl_s=60)
        assert {sb.id for sb in await client.list()} == live  # nothing half-made
        edge_b = child.info.edge
        assert not (ray_cluster.state_dir / edge_b / VOLUME_DIR / "snapshots" / tampered.id).exists()

        for snap in (snap_box, snap_fn, tampered):  # their node is dead: another edge deletes
            await client.delete_snapshot(snap.id)
            assert not (ray_cluster.state_dir / "shared" / f"{snap.id}.img").exists()
            assert not (ray_cluster.state_dir / edge_b / VOLUME_DIR / "snapshots" / snap.id).exists()
        assert await client.snapshots() == []
        await asyncio.gather(child.stop(), fn_child.stop())


async def test_a_full_node_sends_a_create_from_its_snapshot_elsewhere(
        ray_cluster: LocalRayCluster, replica: Server) -> None:
    """The snapshot's node is alive but full: the create goes to another node (one joins
    here, the first test having killed a node), which fetches the snapshot."""
    joined = ray_cluster.edge_of(ray_cluster.add_node(8))
    wait_for_edge(replica, joined)
    async with replica.client() as client:
        parent = await client.create(memory_mb=128, ttl_s=600)
        edge = parent.info.edge
        await parent.write_file("/work/f", b"from a full node")
        snap = await parent.snapshot()
        exported(ray_cluster, snap.id)
        filler = []
        while True:  # the snapshot's node to capacity (placement spreads: keep those there)
            sb = await client.create(memory_mb=128, ttl_s=600)
            if sb.info.edge == edge:
                filler.append(sb)
            else:
                await sb.stop()
            if len(filler) + 1 == 8:
                break
        child = await client.create(snapshot=snap.id, memory_mb=128, ttl_s=120)
        try:
            assert child.info.edge != edge
            assert await child.read_file("/work/f") == b"from a full node"
        finally:
            await asyncio.gather(child.stop(), parent.stop(), *(sb.stop() for sb in filler))
        await client.delete_snapshot(snap.id)  # on its own edge, the other's copy swept soon
        assert not (ray_cluster.state_dir / "shared" / f"{snap.id}.img").exists()
        fetched = ray_cluster.state_dir / child.info.edge / VOLUME_DIR / "snapshots" / snap.id
        deadline = time.monotonic() + 60
        while fetched.exists():
            assert time.monotonic() < deadline, "the fetched copy outlived its snapshot"
            await asyncio.sleep(0.5)
