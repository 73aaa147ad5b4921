"""Cluster parity: what the embedded server serves, ``dsec serve --ray`` serves too.

A real one-node Ray cluster, real PostgreSQL, a real API replica given every ``serve``
option (and some settings by environment only): its edge actor reports the settings it got,
field by field as serve was given them; ``set_network`` applies a policy on a cluster edge;
fn calls, ``map`` and ``run_code`` run on the cluster's fn substrate, SandboxFusion's
``run_code`` too; a checkpointed trajectory forks from a step's checkpoint; the dashboard
lists the node; an fn call counts against the caller's
project quota (embedded and cluster alike); and what a dead edge's fn substrate left on the
host (template cgroups, its directory) is removed when the node's new edge starts.

A WebSocket to a sandbox's port goes through the edge actor like its HTTP requests do.
The E2B front's snapshots and fork and its templates (built with the real SDK), snapshot quotas and TTLs, mini-swe-agent's agent loop
through dsec.integrations, swe-rex's RemoteRuntime through the SWE-ReX front, and a
Dockerfile build through the server (``Client.build_image``) run on the Ray edge too.

A VM leftover is not made here: booting a VM under TCG takes minutes on this host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import time
from dataclasses import fields
from pathlib import Path
from typing import Iterator

import cloudpickle
import httpx
import pytest
from websockets.exceptions import InvalidStatus

import dsec
from conftest import TEST_ROOT, Server, free_port, make_tcp_server, scrape, stop_server
from dsec.config import Settings
from dsec.images.mount import LayerMounter
from dsec.images.store import ImageStore
from dsec.network.testbed import Destination
from dsec.substrates.fn.fn import FnSubstrate
from test_compat_e2b_templates import drive
from test_compat_swerex import check_runtime, run_swerex_runtime
from test_integrations import check_mini_swe_agent_run, run_mini_swe_agent
from test_network import fetch
from test_projects import unique

pytest.importorskip("ray", reason="the cluster tests need the `cluster` extra (Ray)")
import ray  # noqa: E402

from dsec.cluster.ids import NAMESPACE, actor_name  # noqa: E402
from dsec.cluster.local import TOLERANT_HEALTH_CHECKS, LocalRayCluster  # noqa: E402
from dsec.store.local_postgres import LocalPostgres  # noqa: E402

NODE_CAPACITY = 16
DEAD_EDGE = "rdeadbeef"  # an edge directory whose node Ray never listed: an orphan
FN_IMAGE = "python-3.11"
# Settings given by environment only (no serve option), as an operator's unit file would.
ENV_ONLY = {"DSEC_FN_PRELOAD": "numpy,fractions", "DSEC_E2B_TEMPLATES": "mine=python-3.11",
            "DSEC_SANDBOXFUSION_IMAGE": FN_IMAGE, "DSEC_REGISTRY_HTTP": "registry.invalid:5000",
            "DSEC_IMAGE_LAYER_MAX_MB": "4096", "DSEC_PORT_IDLE_S": "45"}


def fn_cgroups(edge: str) -> list[Path]:
    root = Path("/sys/fs/cgroup")
    return [p for p in [root / f"dsec-fn-{edge}", *root.glob(f"*/dsec-fn-{edge}")] if p.is_dir()]


def leave_fn_leftovers(state: Path, images: ImageStore) -> None:
    """What a node's fn substrate leaves when the node is killed mid-work: a template that
    served a call, killed (its workers die with it), its cgroups and directory left behind."""
    async def work() -> None:
        fn = FnSubstrate(state / DEAD_EDGE, DEAD_EDGE, pool_size=1,
                         mounter=LayerMounter(state / "layers"))
        await fn.prepare()
        payload = cloudpickle.dumps((lambda: 41 + 1, (), {}))
        assert cloudpickle.loads(await fn.call(images.get(FN_IMAGE), payload, 60)) == 42
    asyncio.run(work())
    # the node dies: every process in the edge's fn cgroups is killed (the template is ours).
    # Worker cgroups come and go while this runs, so the walk tolerates vanished directories.
    for group in fn_cgroups(DEAD_EDGE):
        for directory, _, files in os.walk(group):
            if "cgroup.procs" not in files:
                continue
            with contextlib.suppress(FileNotFoundError):
                pids = (Path(directory) / "cgroup.procs").read_text().split()
                for pid in map(int, pids):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, 0)


@pytest.fixture(scope="module")
def cluster_state(images: ImageStore) -> Iterator[Path]:
    state = TEST_ROOT / f"cp-{secrets.token_hex(3)}"
    state.mkdir(parents=True)
    leave_fn_leftovers(state, images)
    assert fn_cgroups(DEAD_EDGE) and (state / DEAD_EDGE / "fn").is_dir()
    try:
        yield state
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster(cluster_state: Path) -> Iterator[LocalRayCluster]:
    cluster = LocalRayCluster(cluster_state, [NODE_CAPACITY], TOLERANT_HEALTH_CHECKS)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def services(dest: Destination, tmp_path_factory: pytest.TempPathFactory) -> Path:
    table = tmp_path_factory.mktemp("services") / "services.toml"
    table.write_text(f'[services.testsvc]\nallow = ["{dest.address}:8001"]\n')
    return table


@pytest.fixture(scope="module")
def serve_args(ray_cluster: LocalRayCluster, local_postgres: LocalPostgres, services: Path,
               images: ImageStore) -> dict[str, str | None]:
    """Every ``serve`` option (None: a flag), none at its default where that can be told."""
    url = local_postgres.fresh_database("parity_" + secrets.token_hex(3))
    return {"--host": "127.0.0.1", "--port": str(free_port()), "--capacity": "5",
            "--warm-pool": "0", "--warm-pool-max": "3", "--warm-pool-hold-s": "30",
            "--runtime": "crun", "--edge-id": "ignored-in-a-cluster",
            "--log-format": "json", "--network-services": str(services), "--vm-accel": "tcg",
            "--kvm-device": "/dev/kvm", "--vm-warm-pool": "1", "--vm-snapshots": None,
            "--vm-template-idle-s": "172800",
            "--state-url": url, "--ray": ray_cluster.address, "--image-store": str(images.root),
            "--shared-snapshots": str(ray_cluster.state_dir / "shared-snapshots"),
            # garbage collection: a retention long past the tests, and no pass before the
            # GC test's own replicas take the lease (its loop sleeps an interval first)
            "--retain-ended-s": "86400", "--retain-failed-s": "86400", "--trajectory-ttl-s": "86400",
            "--gc-interval-s": "3600", "--blob-grace-s": "600", "--pull": "missing",
            "--layer-grace-s": str(200 * 365 * 86400)}  # the shared images cache: never collected


@pytest.fixture(scope="module")
def replica(ray_cluster: LocalRayCluster, serve_args: dict[str, str | None]) -> Iterator[Server]:
    args = [part for option, value in serve_args.items()
            for part in ([option] if value is None else [option, value])]
    saved = {name: os.environ.get(name) for name in ENV_ONLY}
    os.environ.update(ENV_ONLY)  # inherited by the server process only: restored at once
    try:
        server = Server(ray_cluster.state_dir, args).start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    yield server
    server.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def embedded(images: ImageStore) -> Iterator[Server]:
    server = make_tcp_server("--warm-pool", "0").start()
    yield server
    stop_server(server)


def edge_status(cluster: LocalRayCluster) -> dict:  # type: ignore[type-arg]
    """The edge actor's own report, asked through Ray (not through the replica)."""
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        edge = cluster.edge_of(cluster.nodes[0])
        return ray.get(ray.get_actor(actor_name(edge), namespace=NAMESPACE).status.remote())
    finally:
        ray.shutdown()  # a driver on the head node would keep the cluster from stopping


def test_every_setting_reaches_the_ray_edge(replica: Server, ray_cluster: LocalRayCluster,
                                            serve_args: dict[str, str | None]) -> None:
    status = edge_status(ray_cluster)
    options = {name.removeprefix("--").replace("-", "_"): value
               for name, value in serve_args.items()}
    options["ray_address"] = options.pop("ray")
    given = Settings.load({**os.environ, **ENV_ONLY}, state_dir=str(ray_cluster.state_dir),
                          **{k: (True if v is None else v) for k, v in options.items()})
    reported = status["settings"]
    assert set(reported) == {f.name for f in fields(Settings)}
    for name, value in given.as_dict().items():
        assert reported[name] == value, name
    # the environment-only ones arrived too
    assert reported["fn_preload"] == ["numpy", "fractions"]
    assert reported["e2b_templates"] == "mine=python-3.11"
    assert reported["port_idle_s"] == 45
    assert status["capacity"] == NODE_CAPACITY  # the node's own dsec_capacity


async def test_set_network_under_ray(replica: Server, dest: Destination) -> None:
    rule = f"{dest.address}:8001"
    async with replica.client() as client:
        sb = await client.create(ttl_s=300)
        try:
            assert await fetch(sb, dest.address, 8001) is None
            info = await sb.set_network([rule])
            assert info.network == dsec.NetworkPolicy(allow=[rule])
            assert (await client.get(sb.id)).info.network == info.network
            assert await fetch(sb, dest.address, 8001) == "hello-8001"
            await sb.set_network({"testsvc": True})  # the table given by --network-services
            assert await fetch(sb, dest.address, 8001) == "hello-8001"
            await sb.set_network("none")
            assert (await sb.run("ls /sys/class/net")).stdout.split() == ["lo"]
        finally:
            await sb.stop()


async def test_pause_and_resume_under_ray(replica: Server) -> None:
    async with replica.client() as client:
        sb = await client.create(ttl_s=300)
        try:
            assert (await sb.pause()).state == "paused"
            assert (await client.get(sb.id)).info.state == "paused"
            assert (await sb.run("echo awake")).stdout == "awake\n"  # resumed by the call
            assert (await client.get(sb.id)).info.state == "running"
            await sb.pause()
            assert (await sb.resume()).state == "running"
        finally:
            await sb.stop()


async def test_stdin_and_a_terminal_under_ray(replica: Server) -> None:
    """send_stdin, close_stdin, a PTY's input, resize and output through the Ray edge actor."""
    async with replica.client() as client:
        sb = await client.create(ttl_s=300)
        try:
            fed = await sb.start("cat", stdin_open=True)
            await fed.send_stdin("through ray\n")
            await fed.close_stdin()
            assert (await fed.wait()).stdout == "through ray\n"
            with pytest.raises(dsec.ProcessExited):
                await fed.send_stdin("late")
            term = await sb.pty(100, 30, command="sh")
            await term.resize(132, 43)
            await term.send_stdin("stty size; exit 4\n")
            result = await term.wait()
            assert result.exit_code == 4 and "43 132" in result.stdout
            assert isinstance(await sb.process(term.id), dsec.AsyncPty)
        finally:
            await sb.stop()


async def test_a_sandbox_port_under_ray(replica: Server) -> None:
    """A server in the sandbox, reached through the API replica and the node's edge actor:
    with the key, with the port's token, a large answer streamed, nothing listening typed."""
    from test_ports import PORT, assert_the_port_serves, auth, seen, serving
    async with replica.client() as client:
        sb = await serving(client, replica)
        try:
            async with httpx.AsyncClient(base_url=replica.url, headers=auth(replica),
                                         timeout=120) as http:
                await assert_the_port_serves(http, replica, sb.id, (24 << 20) + 7)
                # a flood read slowly: the actor runs at most STREAM_AHEAD chunks ahead
                async with http.stream("GET", f"/v1/sandboxes/{sb.id}/ports/{PORT}/flood") as flood:
                    taken = 0
                    async for chunk in flood.aiter_raw():
                        taken += len(chunk)
                        if taken > 16 << 20:
                            break
                    assert seen(await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers"))
                # floods left after one chunk, more of them than a sandbox may hold open: each
                # abandoned stream is cancelled on the actor, its connection given back
                for _ in range(70):
                    async with http.stream("GET", f"/v1/sandboxes/{sb.id}/ports/{PORT}/flood") as flood:
                        async for _chunk in flood.aiter_raw():
                            break
                assert seen(await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers"))
            async with httpx.AsyncClient(timeout=120) as plain:
                assert seen(await plain.get(await sb.url(PORT) + "headers"))["path"] == "/headers"
        finally:
            await sb.stop()


async def test_a_websocket_to_a_sandbox_port_under_ray(replica: Server) -> None:
    """A WebSocket through the API replica and the node's edge actor (the proxy_port stream
    opened with a session, port_send calls for the client's messages): echo by key and by
    token, the handshake without credentials, a refusal relayed, a flood bounded, a message
    over the bound closed with 1009, and a client that vanishes closing the sandbox's side."""
    from test_ports import PORT, auth, serving
    from test_ports_ws import dial, echoes, floods_are_bounded, ws_url
    async with replica.client() as client:
        sb = await serving(client, replica)
        try:
            base = f"{ws_url(replica.url)}/v1/sandboxes/{sb.id}/ports/{PORT}"
            key = auth(replica)
            async with dial(f"{base}/ws", additional_headers={**key, "x-api-key": replica.key},
                            subprotocols=["two"]) as ws:
                assert ws.subprotocol == "two"
                await echoes(ws)
                await ws.send("headers")
                got = {k.lower() for k, _ in json.loads(await ws.recv())}
                assert not {"authorization", "x-api-key"} & got
            async with dial(ws_url(await sb.url(PORT)) + "ws") as ws:
                await echoes(ws)
            with pytest.raises(InvalidStatus) as refused:
                async with dial(f"{base}/ws/refuse", additional_headers=key):
                    pass
            assert refused.value.response.status_code == 403
            async with httpx.AsyncClient(base_url=replica.url, headers=key, timeout=120) as http:
                await floods_are_bounded(http, sb, base, key)
        finally:
            await sb.stop()


async def test_fork_trajectory_under_ray(replica: Server) -> None:
    """Checkpoints are taken on the Ray edge (the snapshot op through the actor) and logged
    in PostgreSQL; a fork restores one without running a step again."""
    trajectory = f"parity/fork-{secrets.token_hex(3)}"
    async with replica.client() as client:
        sb = await client.create(trajectory=trajectory, checkpoint="every_step", ttl_s=300)
        try:
            await sb.run("date +%s%N >> /work/clock")
            await sb.run("true")
            steps = await client.trajectory_steps(trajectory)
            assert steps[0].checkpoint and steps[1].checkpoint == steps[0].checkpoint
            (fork,) = await client.fork_trajectory(trajectory, at_step=2)
            try:
                assert await fork.read_file("/work/clock") == await sb.read_file("/work/clock")
                assert fork.trajectory and fork.trajectory.startswith(f"{trajectory}/fork-2-")
            finally:
                await fork.stop()
        finally:
            await sb.stop()


async def test_fn_call_map_and_run_code_under_ray(replica: Server) -> None:
    async with replica.client() as client:
        assert await client.call(lambda: 1) == 1
        assert await client.call(lambda x, y: x + y, 2, 3) == 5
        assert await client.map(lambda x: x * x, range(10), concurrency=4) == [x * x for x in range(10)]
        with pytest.raises(dsec.RemoteError) as raised:
            await client.call(lambda: {}["missing"])
        assert raised.value.remote_type == "builtins.KeyError"

        def preloaded() -> bool:
            import sys
            return "fractions" in sys.modules  # imported by the template: DSEC_FN_PRELOAD
        assert await client.call(preloaded) is True
        r = await client.run_code("python", "print(int(input()) * 2)", stdin="21\n")
        assert (r.stdout, r.exit_code, r.ok) == ("42\n", 0, True)
        with pytest.raises(dsec.NotSupported):
            await client.run_code("c", "int main(){return 0;}")  # python-3.11 has no gcc


def test_sandboxfusion_on_fn_under_ray(replica: Server) -> None:
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code
    host = replica.url.removeprefix("http://")
    endpoint = f"http://dsec:{replica.key}@{host}/sandboxfusion"
    r = run_code(RunCodeRequest(code="import sys; print(sys.stdin.read()[::-1])",
                                language="python", stdin="olleh"),
                 endpoint=endpoint, max_attempts=1)
    assert r.status == RunStatus.Success and r.run_result.stdout == "hello\n"
    with replica.http(authenticated=True) as http:
        ran_on = http.get(f"/v1/sandboxes/{r.executor_pod_name}").json()
    assert ran_on["substrate"] == "fn" and ran_on["state"] == "stopped"


async def test_dashboard_lists_the_node_under_ray(replica: Server,
                                                  ray_cluster: LocalRayCluster) -> None:
    async with replica.client() as client:
        sb = await client.create(ttl_s=300)
        try:
            with replica.http(authenticated=True) as http:
                data = http.get("/v1/dashboard").json()
        finally:
            await sb.stop()
    edge = ray_cluster.edge_of(ray_cluster.nodes[0])
    [node] = [n for n in data["nodes"] if n["edge"] == edge]
    assert node["capacity"] == NODE_CAPACITY and node["live"] >= 1
    assert node["substrates"]["container"] >= 1 and "fn" in node["substrates"]
    assert data["live_total"] >= 1


@pytest.mark.parametrize("where", ["embedded", "cluster"])
async def test_an_fn_call_counts_against_the_project_quota(
        where: str, request: pytest.FixtureRequest) -> None:
    server: Server = request.getfixturevalue("embedded" if where == "embedded" else "replica")
    project = f"fnq-{secrets.token_hex(3)}"
    async with server.client() as admin:
        await admin.projects().create(project, sandboxes=1, cpu=4, memory_mb=4096)
        key = (await admin.projects().create_key(project, "k")).key
        async with dsec.DSecClient(server.url, key, autostart=False) as client:
            assert await client.call(lambda: 7) == 7
            with pytest.raises(dsec.RemoteError):
                await client.call(lambda: 1 // 0)
            used = (await admin.projects().get(project)).used
            assert (used.sandboxes, used.cpu, used.memory_mb) == (0, 0.0, 0)  # given back
            with server.http() as http:  # a function that raised is no failure of the platform
                failures = http.get("/v1/dashboard", headers={
                    "authorization": f"Bearer {key}"}).json()["failures"]
            assert [f["code"] for f in failures] == []
            sb = await client.create(ttl_s=300, memory_mb=256, cpu=0.5)
            try:
                with pytest.raises(dsec.QuotaExceeded) as refused:
                    await client.call(lambda: 7)
                assert refused.value.details["resource"] == "sandboxes"
                with pytest.raises(dsec.QuotaExceeded):
                    await client.run_code("python", "print(1)")
            finally:
                await sb.stop()
            await admin.projects().set_quota(project, sandboxes=2, memory_mb=256)
            with pytest.raises(dsec.QuotaExceeded) as refused:  # a call holds 512 MB
                await client.call(lambda: 7)
            assert refused.value.details["resource"] == "memory_mb"


def test_a_dead_edges_fn_leftovers_are_removed(replica: Server, cluster_state: Path) -> None:
    """The node's edge started after the fixture left a dead edge's fn remains: it removed
    them (before the replica could serve, since the edge answers only once started)."""
    assert fn_cgroups(DEAD_EDGE) == []
    assert not (cluster_state / DEAD_EDGE).exists()


@pytest.mark.parametrize("where", ["embedded", "cluster"])
async def test_every_create_path_is_admitted_by_the_project_quota(
        where: str, request: pytest.FixtureRequest) -> None:
    """A project with no room: the native API, an fn call, run_code, E2B and SandboxFusion
    are all refused by the same admission, and nothing is held."""
    from sandbox_fusion import RunCodeRequest, run_code
    server: Server = request.getfixturevalue("embedded" if where == "embedded" else "replica")
    project = f"full-{secrets.token_hex(3)}"
    async with server.client() as admin:
        await admin.projects().create(project, sandboxes=0, cpu=4, memory_mb=4096)
        key = (await admin.projects().create_key(project, "k")).key
        async with dsec.DSecClient(server.url, key, autostart=False) as client:
            with pytest.raises(dsec.QuotaExceeded):
                await client.create(ttl_s=60)
            with pytest.raises(dsec.QuotaExceeded):
                await client.call(lambda: 1)
            with pytest.raises(dsec.QuotaExceeded):
                await client.run_code("python", "print(1)")
        with server.http() as http:
            e2b = http.post("/e2b/sandboxes", headers={"x-api-key": key},
                            json={"templateID": "base"})
        assert e2b.status_code == 429 and "quota" in e2b.json()["message"]
        host = server.url.removeprefix("http://")
        with pytest.raises(Exception, match="quota_exceeded"):  # the client raises on SandboxError
            run_code(RunCodeRequest(code="print(1)", language="python"),
                     endpoint=f"http://dsec:{key}@{host}/sandboxfusion", max_attempts=1)
        used = (await admin.projects().get(project)).used
        assert (used.sandboxes, used.cpu, used.memory_mb) == (0, 0.0, 0)


@pytest.mark.parametrize("where", ["embedded", "cluster"])
async def test_snapshot_quota_ttl_and_fork(where: str, request: pytest.FixtureRequest) -> None:
    """A project with room for one snapshot: a second is refused; a TTL'd one is deleted by
    its edge (the Ray edge actor, in a cluster) while its child runs on; its bytes come back,
    so a fork (one snapshot for its children) then fits, and nothing stays held."""
    server: Server = request.getfixturevalue("embedded" if where == "embedded" else "replica")
    project = f"snap-{secrets.token_hex(3)}"
    async with server.client() as admin:
        await admin.projects().create(project, sandboxes=4, cpu=4, memory_mb=1024,
                                      snapshot_bytes=256 << 20)
        key = (await admin.projects().create_key(project, "k")).key
        async with dsec.DSecClient(server.url, key, autostart=False) as client:
            sb = await client.create(ttl_s=300, memory_mb=256, cpu=0.5, disk_mb=256)
            try:
                await sb.write_file("/work/f", b"kept")
                snap = await sb.snapshot(ttl_s=2)
                with pytest.raises(dsec.QuotaExceeded):
                    await sb.snapshot()
                kid = await client.create(snapshot=snap.id, ttl_s=120, memory_mb=256, cpu=0.5)
                await asyncio.sleep(2)
                assert await client.snapshots() == []  # expired: not listed, not usable
                with pytest.raises(dsec.SnapshotNotFound):
                    await client.create(snapshot=snap.id, memory_mb=256, cpu=0.5)
                for _ in range(50):  # its bytes come back once its edge deleted it
                    with contextlib.suppress(dsec.QuotaExceeded):
                        await client.delete_snapshot((await sb.snapshot()).id)
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise AssertionError("the expired snapshot's bytes never came back")
                assert await kid.read_file("/work/f") == b"kept"
                await kid.stop()
                kids = await sb.fork(2, ttl_s=120, memory_mb=256, cpu=0.5)
                assert [await k.read_file("/work/f") for k in kids] == [b"kept", b"kept"]  # type: ignore[union-attr]
                for k in kids:
                    await k.stop()  # type: ignore[union-attr]
            finally:
                await sb.stop()
        assert (await admin.projects().get(project)).used.snapshot_bytes == 0


def test_e2b_snapshot_and_fork_under_ray(replica: Server) -> None:
    """The E2B front's snapshot, create-from-snapshot and fork go through the same router
    operations on a Ray edge."""
    key = {"X-API-Key": replica.key}
    with replica.http() as http:
        sb = http.post("/e2b/sandboxes", json={"templateID": "base", "timeout": 120},
                       headers=key).json()
        try:
            snap = http.post(f"/e2b/sandboxes/{sb['sandboxID']}/snapshots", json={}, headers=key)
            assert snap.status_code == 201
            snapshot_id = snap.json()["snapshotID"]
            assert [s["snapshotID"] for s in http.get(
                "/e2b/snapshots", params={"sandboxID": sb["sandboxID"]}, headers=key).json()] == [snapshot_id]
            child = http.post("/e2b/v2/sandboxes", json={"templateID": snapshot_id, "timeout": 60},
                              headers=key)
            assert child.status_code == 201
            http.delete(f"/e2b/sandboxes/{child.json()['sandboxID']}", headers=key)
            assert http.delete(f"/e2b/templates/{snapshot_id}", headers=key).status_code == 204
            forks = http.post(f"/e2b/sandboxes/{sb['sandboxID']}/fork",
                              json={"count": 2, "timeout": 60}, headers=key)
            assert forks.status_code == 201 and len(forks.json()) == 2
            for fork in forks.json():
                http.delete(f"/e2b/sandboxes/{fork['sandbox']['sandboxID']}", headers=key)
            assert http.get("/e2b/snapshots", params={"sandboxID": sb["sandboxID"]},
                            headers=key).json() == []  # the fork's snapshot went with it
        finally:
            http.delete(f"/e2b/sandboxes/{sb['sandboxID']}", headers=key)


def test_e2b_template_under_ray(replica: Server) -> None:
    """An E2B template built with the real SDK on the API replica (recorded in PostgreSQL),
    and a sandbox made from it on a Ray edge, with the template's env and workdir."""
    name = unique("tpl-ray")
    built, exists, ran, listed, deleted, gone = drive(replica, [
        ["build", name, FN_IMAGE, "", "/tmp"], ["exists", name],
        ["run", name, "echo $TPL_GREETING; pwd"], ["list"], ["delete", name], ["exists", name]])
    assert "raised" not in built, built
    assert exists == [True, True]
    assert ran == {"stdout": "from-template\n/tmp\n", "exit_code": 0}
    assert [t["status"] for t in listed["templates"] if t["aliases"] == [name]] == ["ready"]
    assert deleted == 204 and gone == [False, False]


@pytest.mark.parametrize("where", ["embedded", "ray"])
def test_a_dockerfile_build_through_the_server(where: str, request: pytest.FixtureRequest,
                                               tmp_path: Path) -> None:
    """``Client.build_image`` on an edge (under Ray: the edge actor's stream), its progress
    streamed, a project key's image in its namespace, a failing step typed, then run.
    (Synchronous: the cluster's fixtures start outside an event loop.)"""
    server: Server = request.getfixturevalue("embedded" if where == "embedded" else "replica")
    project, name = unique("build"), unique("parity-build")
    (tmp_path / "in.txt").write_text(f"{name}\n")
    text = "FROM debian-minbase\nCOPY in.txt /in.txt\nRUN cat /in.txt > /out.txt && echo ran\n"

    async def build() -> str:
        async with server.client() as admin:
            await admin.projects().create(project, sandboxes=4, cpu=8, memory_mb=4096)
            key = (await admin.projects().create_key(project, "sdk")).key
        async with dsec.DSecClient(server.url, key, autostart=False) as client:
            lines: list[str] = []
            built = await client.build_image(name, tmp_path, dockerfile=text, on_log=lines.append)
            assert (built.image, built.steps_run) == (f"p.{project}.{name}", 2)
            assert "  │ ran" in lines
            async with await client.create(image=built.image, ttl_s=120) as sb:
                assert (await sb.run("cat /out.txt")).stdout == f"{name}\n"
            with pytest.raises(dsec.ImageBuildError) as failed:
                await client.build_image(name + "-bad",
                                         dockerfile="FROM debian-minbase\nRUN exit 9\n")
            assert failed.value.details["exit_code"] == 9
            return built.image
    ImageStore().remove(asyncio.run(build()))


def test_mini_swe_agent_under_ray(replica: Server, tmp_path: Path) -> None:
    """The mini-swe-agent integration's agent loop, on a sandbox of a Ray edge."""
    check_mini_swe_agent_run(run_mini_swe_agent(replica, tmp_path))


def test_swerex_runtime_under_ray(replica: Server) -> None:
    """swe-rex's RemoteRuntime (sessions on a terminal, interrupts, execute, files, upload,
    retries) through the SWE-ReX front-end, on a sandbox of a Ray edge."""
    check_runtime(run_swerex_runtime(replica))


def test_two_replicas_collect_each_record_once(ray_cluster: LocalRayCluster, replica: Server,
                                               serve_args: dict[str, str | None]) -> None:
    """Two more API replicas on the cluster and its PostgreSQL, with a short retention,
    collecting every second: the records the sandboxes ended by this module left go, and
    the replicas' counts of what they removed add up to what went, exactly."""
    import psycopg  # the cluster extra's

    url = serve_args["--state-url"]
    assert url is not None
    with dsec.Client(replica.url, replica.key, autostart=False) as client:
        ended = [client.create(ttl_s=60) for _ in range(4)]
        for sb in ended:
            sb.stop()

    def records() -> int:
        with psycopg.connect(url) as db:
            return db.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0]  # type: ignore[index]

    before = records()
    short = {**serve_args, "--retain-ended-s": "2", "--retain-failed-s": "2", "--gc-interval-s": "1",
             "--blob-grace-s": "2"}
    replicas = []
    try:
        for _ in range(2):
            short["--port"] = str(free_port())
            args = [part for option, value in short.items()
                    for part in ([option] if value is None else [option, value])]
            replicas.append(Server(ray_cluster.state_dir, args).start())
        with dsec.Client(replica.url, replica.key, autostart=False) as client:
            deadline = time.monotonic() + 120
            for sb in ended:
                while True:
                    try:
                        client.get(sb.id)
                    except dsec.SandboxNotFound:
                        break
                    assert time.monotonic() < deadline, "the replicas did not collect"
                    time.sleep(0.5)
        counted = None
        while True:  # until a collection or two removed nothing more
            now = sum(scrape(r).get("dsec_gc_removed_total{kind=sandboxes}", 0) for r in replicas)
            if now == counted:
                break
            counted = now
            time.sleep(2.5)
        assert counted == before - records() >= len(ended)
        dry = httpx.post(f"{replicas[0].url}/v1/admin/gc", params={"dry_run": "true"},
                         headers={"authorization": f"Bearer {replica.key}"}, timeout=60)
        assert dry.status_code == 200 and dry.json()["dry_run"] is True
    finally:
        for r in replicas:
            r.kill(signal.SIGTERM)
