"""Scale-out on Ray: a real local Ray cluster (a head and two worker nodes, each a raylet with
its own ``dsec_capacity``), real PostgreSQL, two real API replicas (``dsec serve --ray``).

300 sandboxes fill the three nodes exactly to capacity through both replicas at once; a
worker node killed mid-burst has its sandboxes reported died while every create still
succeeds elsewhere; a joining node receives placements; nothing is left on surviving nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest

import dsec
from conftest import TEST_ROOT, Server, free_port
from support.disks import attached_disks, full_stock
from test_recovery import settled

pytest.importorskip("ray", reason="the cluster tests need the `cluster` extra (Ray)")
from dsec.cluster.local import TOLERANT_HEALTH_CHECKS, LocalRayCluster  # noqa: E402
from dsec.store.local_postgres import LocalPostgres  # noqa: E402
from dsec.substrates.container.container import RUNTIME_DIR  # noqa: E402
from dsec.substrates.host.volume import VOLUME_DIR  # noqa: E402

CAPACITY = 100
IMAGE = "debian-minbase"


@contextlib.contextmanager
def started_cluster(prefix: str, capacities: list[int | None]) -> Iterator[LocalRayCluster]:
    """A local Ray cluster of one node per capacity (None: the head, with no edge) in a state
    dir of its own, stopped and removed afterwards. Its health checks are ones a loaded
    machine does not fail by starving a raylet (the benchmark measures death reports with
    tight ones)."""
    state = TEST_ROOT / f"{prefix}-{secrets.token_hex(3)}"
    state.mkdir(parents=True)
    cluster = LocalRayCluster(state, capacities, TOLERANT_HEALTH_CHECKS)  # type: ignore[arg-type]
    try:
        yield cluster.start()
    finally:
        cluster.stop()  # every Ray process it started, and what the killed node left
        shutil.rmtree(state, ignore_errors=True)


def replica_server(cluster: LocalRayCluster, state_url: str, *args: str) -> Server:
    """An API replica over ``cluster`` (not started yet) on a free loopback port, its state in
    the PostgreSQL database ``state_url``, with ``args`` on top."""
    return Server(cluster.state_dir, ["--host", "127.0.0.1", "--port", str(free_port()),
                                      "--ray", cluster.address, "--state-url", state_url, *args])


@pytest.fixture(scope="module")
def ray_cluster(images) -> Iterator[LocalRayCluster]:  # type: ignore[no-untyped-def]
    with started_cluster("cl", [CAPACITY] * 3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def replicas(ray_cluster: LocalRayCluster, local_postgres: LocalPostgres) -> Iterator[list[Server]]:
    """Two stateless API replicas over the cluster, sharing one PostgreSQL database."""
    url = local_postgres.fresh_database("cluster_" + secrets.token_hex(3))
    servers = []
    try:
        for _ in range(2):
            servers.append(replica_server(ray_cluster, url, "--warm-pool", "0").start())
        yield servers
    finally:
        for server in servers:
            server.kill(signal.SIGTERM)


def host_traces(state_dir: Path, edge: str) -> dict[str, list[str]]:
    """What the host still holds of an edge's sandboxes: mounts, cgroups, dirs, containers."""
    root = state_dir / edge
    sandboxes = root / VOLUME_DIR / "sandboxes"
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(str(sandboxes))]
    cgroups = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/dsec-{edge}/*") if p.is_dir()]
    return {"mounts": mounts, "cgroups": cgroups, "loops": attached_disks(sandboxes),
            "dirs": [p.name for p in sandboxes.glob("*")],
            "containers": [p.name for p in (root / VOLUME_DIR / RUNTIME_DIR).glob("*/*")]}


async def burst(clients: list[dsec.DSecClient], n: int, on_created=None) -> list[dsec.AsyncSandbox]:  # type: ignore[no-untyped-def]
    """``n`` creates spread over the clients, 24 in flight; raises if any fails."""
    gate = asyncio.Semaphore(24)
    created: list[dsec.AsyncSandbox] = []

    async def one(i: int) -> dsec.AsyncSandbox:
        async with gate:
            sb = await clients[i % len(clients)].create(image=IMAGE, memory_mb=128, ttl_s=900)
        created.append(sb)
        if on_created is not None:
            await on_created(len(created))
        return sb

    return await asyncio.gather(*(one(i) for i in range(n)))


async def stop_all(sandboxes: list[dsec.AsyncSandbox]) -> None:
    gate = asyncio.Semaphore(24)

    async def one(sb: dsec.AsyncSandbox) -> None:
        async with gate:
            await sb.stop()

    await asyncio.gather(*(one(sb) for sb in sandboxes))


def wait_for_edge(replica: Server, edge: str, within_s: float = 120) -> set[str]:
    """Wait until the replica places on ``edge``; the edges it knows then."""
    deadline = time.monotonic() + within_s
    with replica.http() as http:
        while True:
            edges = http.get("/v1/health").json()["edges"]
            if any(e["id"] == edge and e["healthy"] for e in edges):
                return {e["id"] for e in edges}
            assert time.monotonic() < deadline, f"edge {edge} never came up"
            time.sleep(0.5)


async def died(sb: dsec.AsyncSandbox, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            await sb.run("true", timeout_s=30)
        except dsec.SandboxDied:
            return
        assert time.monotonic() < deadline, f"{sb.id} still answers {within_s} s after its node died"
        await asyncio.sleep(0.2)


async def test_300_sandboxes_fill_three_nodes_through_two_replicas(
        ray_cluster: LocalRayCluster, replicas: list[Server]) -> None:
    edges = {ray_cluster.edge_of(node) for node in ray_cluster.nodes}
    async with replicas[0].client() as a, replicas[1].client() as b:
        sandboxes = await burst([a, b], 3 * CAPACITY)
        # Both replicas placed at once, without a lock: no node took more than its capacity.
        assert Counter(sb.info.edge for sb in sandboxes) == {edge: CAPACITY for edge in edges}
        for client in (a, b):
            with pytest.raises(dsec.CapacityExhausted):
                await client.create(image=IMAGE, ttl_s=60)

        status = subprocess.run(
            [sys.executable, "-m", "dsec", "cluster", "status", "--ray", ray_cluster.address],
            capture_output=True, text=True, timeout=120, check=True,
            env={**os.environ, "COLUMNS": "200"}).stdout
        assert f"3 edges, load {3 * CAPACITY} of {3 * CAPACITY}; 0 dead nodes" in status
        assert all(edge in status for edge in edges) and "container: 100" in status

        results = await asyncio.gather(*(sb.run("echo $((6*7))") for sb in sandboxes[::10]))
        assert [r.stdout for r in results] == ["42\n"] * len(results)
        # Output streams from the node in chunks as it comes; files go both ways.
        chunks = [c.text async for c in sandboxes[1].stream("for i in 1 2 3; do echo $i; sleep 0.2; done")]
        assert "".join(chunks) == "1\n2\n3\n" and len(chunks) >= 2
        await sandboxes[2].write_file("/work/data.bin", bytes(range(256)) * 64)
        assert await sandboxes[2].read_file("/work/data.bin") == bytes(range(256)) * 64
        await stop_all(sandboxes)
        assert await a.list() == []
    for edge in edges:
        assert await settled(functools.partial(host_traces, ray_cluster.state_dir, edge)) == {
            "mounts": [], "cgroups": [], "loops": [], "dirs": [], "containers": []}


async def test_a_trajectory_resumes_through_the_other_replica(replicas: list[Server]) -> None:
    """Replicas are stateless: the log is in PostgreSQL, the sandbox id routes the calls."""
    trajectory = f"test/cluster-{secrets.token_hex(3)}"
    async with replicas[0].client() as a, replicas[1].client() as b:
        sb = await a.create(image=IMAGE, ttl_s=120, trajectory=trajectory)
        first = await sb.run("echo $RANDOM > /work/r; cat /work/r")
        resumed = await b.resume(trajectory)
        assert (await resumed.run("echo $RANDOM > /work/r; cat /work/r")).stdout == first.stdout
        assert resumed.fast_forwarded == 1
        assert (await resumed.run("cat /work/r")).stdout == first.stdout  # ran, not logged
        # An unnumbered call (as a harness without the SDK makes) through the first replica,
        # which last saw step 1: it is appended after step 2.
        assert (await (await a.get(sb.id)).run("echo appended")).stdout == "appended\n"
        steps = await b.trajectory_steps(trajectory)
        assert [(s.step, s.status) for s in steps] == [(1, "ok"), (2, "ok"), (3, "ok")]
        await resumed.stop()


async def test_sandboxes_outlive_a_killed_replica(replicas: list[Server]) -> None:
    """A replica holds nothing: killed, its sandboxes answer through the other replica, and
    through it again once restarted."""
    async with replicas[0].client() as a:
        sb = await a.create(image=IMAGE, ttl_s=120)
        await sb.write_file("/work/state", b"kept")
    replicas[0].kill()
    async with replicas[1].client() as b:
        assert await (await b.get(sb.id)).read_file("/work/state") == b"kept"
    replicas[0].start()
    async with replicas[0].client() as a:
        again = await a.get(sb.id)
        assert (await again.run("cat /work/state")).stdout == "kept"
        await again.stop()


def edge_pid(replica: Server, edge: str, other_than: int | None = None,
             within_s: float = 120) -> int:
    """The pid of an edge's actor process once it reports healthy (and not ``other_than``)."""
    deadline = time.monotonic() + within_s
    with replica.http() as http:
        while True:
            for e in http.get("/v1/health").json()["edges"]:
                if e["id"] == edge and e["healthy"] and e["pid"] not in (None, other_than):
                    return int(e["pid"])
            assert time.monotonic() < deadline, f"edge {edge} did not come back"
            time.sleep(0.5)


async def test_a_crashed_edge_actor_is_restarted_and_adopts_its_sandboxes(
        replicas: list[Server]) -> None:
    async with replicas[0].client() as a:
        sb = await a.create(image=IMAGE, ttl_s=120)
        await sb.write_file("/work/state", b"kept")
        stock = replicas[0].state_dir / sb.info.edge / VOLUME_DIR / "disks" / "stock"
        killed_stock = await full_stock(stock)
        pid = edge_pid(replicas[0], sb.info.edge)
        os.kill(pid, signal.SIGKILL)
        edge_pid(replicas[0], sb.info.edge, other_than=pid)  # Ray restarted it on its node
        assert (await sb.run("cat /work/state")).stdout == "kept"
        await sb.stop()
    # the killed actor's stocked disks went with it (no loop device, no file); a new stock
    assert not await full_stock(stock) & killed_stock


async def test_node_killed_mid_burst(ray_cluster: LocalRayCluster, replicas: list[Server]) -> None:
    victim = ray_cluster.nodes[2]
    dead_edge = ray_cluster.edge_of(victim)
    killed_at: list[float] = []

    async def kill_halfway(done: int) -> None:
        if done == 45:
            killed_at.append(time.monotonic())
            await asyncio.to_thread(ray_cluster.kill_node, victim)

    async with replicas[0].client() as a, replicas[1].client() as b:
        sandboxes = await burst([a, b], 90, kill_halfway)  # every create succeeded somewhere
        assert killed_at
        on_victim = [sb for sb in sandboxes if sb.info.edge == dead_edge]
        survivors = [sb for sb in sandboxes if sb.info.edge != dead_edge]
        assert on_victim and len(survivors) >= 45

        # Until Ray's health checks declare the node dead its edge may still answer (here its
        # processes die a moment after the raylet); then every call is SandboxDied.
        await died(on_victim[0])
        print(f"\nnode death reported to clients {time.monotonic() - killed_at[0]:.1f} s "
              "after the kill (an upper bound: includes the rest of the burst)")
        for sb in on_victim:
            with pytest.raises(dsec.SandboxDied):
                await sb.run("true", timeout_s=30)
        with replicas[1].http(authenticated=True) as http:  # the other replica agrees
            assert http.get(f"/v1/sandboxes/{on_victim[0].id}").json()["state"] == "died"

        results = await asyncio.gather(*(sb.run("echo ok") for sb in survivors))
        assert [r.stdout for r in results] == ["ok\n"] * len(survivors)

        # A node that joins receives placements; one without dsec_capacity (other work) gets
        # no edge.
        other = ray_cluster.edge_of(ray_cluster.add_node(None))
        joined = ray_cluster.edge_of(ray_cluster.add_node(40))
        for replica in replicas:
            edges = wait_for_edge(replica, joined)
            assert other not in edges  # polled at the same time as the joining node
        # Its edge removed what the dead node's edge left on this host (the raylet died,
        # its sandboxes did not): nothing of them remains.
        assert host_traces(ray_cluster.state_dir, dead_edge) == {
            "mounts": [], "cgroups": [], "loops": [], "dirs": [], "containers": []}
        more = await burst([a], 12)
        assert joined in {sb.info.edge for sb in more} and other not in {sb.info.edge for sb in more}

        await stop_all(survivors + more)
        assert await a.list() == [] and await b.list() == []
    for node in ray_cluster.nodes:
        edge = ray_cluster.edge_of(node)
        if edge != dead_edge:
            assert await settled(functools.partial(host_traces, ray_cluster.state_dir, edge)) == {
                "mounts": [], "cgroups": [], "loops": [], "dirs": [], "containers": []}


def test_shared_image_store_with_a_node_local_layer_cache(images, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The image store (here the shared test cache) is read once per layer: a node with
    DSEC_LAYER_CACHE mounts local copies."""
    from dsec.images.mount import LayerMounter
    monkeypatch.setenv("DSEC_LAYER_CACHE", str(tmp_path / "cache"))
    image = images.get(IMAGE)
    if not any(layer.format == "erofs" for layer in image.layers):
        pytest.skip("the image store holds directory layers (no EROFS here): nothing to copy")
    mounter = LayerMounter(tmp_path / "mnt")
    try:
        dirs = mounter.lowerdirs(image)
        assert (dirs[-1] / "bin" / "sh").exists() or (dirs[-1] / "usr" / "bin" / "sh").exists()
        erofs = [layer for layer in image.layers if layer.format == "erofs"]
        backing = {Path(p.read_text().strip()) for p in Path("/sys/block").glob("loop*/loop/backing_file")}
        for layer in erofs:
            copy = tmp_path / "cache" / f"{layer.path.parent.name}.erofs"
            assert copy.read_bytes() == layer.path.read_bytes() and copy in backing
    finally:
        assert mounter.unmount_all() == []


def test_placement_counts_its_own_placements_not_yet_reported() -> None:
    from dsec.control.placement import EdgeLoad, Placement

    def report(edge: str, load: int) -> EdgeLoad:
        return EdgeLoad(edge, load, capacity=2, substrates=["container"], images=[IMAGE],
                        asked_at=time.monotonic())

    placement = Placement(k=2)
    a, b = report("a", 0), report("b", 1)
    assert placement.choose([a, b], "container", IMAGE).edge == "a"  # type: ignore[union-attr]
    placement.sent("a")
    placement.sent("a")  # two creates on their way to a: a is full for this replica
    assert placement.choose([a, b], "container", IMAGE).edge == "b"  # type: ignore[union-attr]
    placement.sent("b")
    assert placement.choose([a, b], "container", IMAGE) is None  # the whole cluster is full
    # ... as far as this replica knows: by the reports alone both have room (edges decide).
    assert placement.choose([a, b], "container", IMAGE, count_sent=False).edge == "a"  # type: ignore[union-attr]
    a = report("a", 1)  # a fresh report counts what was sent before it was asked for
    placement.reported(a)
    assert placement.choose([a, b], "container", IMAGE).edge == "a"  # type: ignore[union-attr]
    assert placement.choose([a, b], "microvm", IMAGE) is None  # nobody serves the substrate
    assert placement.choose([a, b], "container", IMAGE, exclude={"a"}) is None  # a refused
