"""A sandbox made from a snapshot (fork, create(snapshot=...)) inherits its parent's limits,
network policy, runtime, environment and TTL unless given others (edge/inherit.py), and
really has them: checked on the host's cgroups, its disk, and what its network reaches. The
project quota is charged the inherited limits, so a child cannot slip a bigger sandbox past
it than its request shows. Real sandboxes on the session's server."""

from __future__ import annotations

import pytest

import dsec
from conftest import DEST_PORTS as PORTS
from conftest import Server
from dsec.network.testbed import Destination
from dsec.substrates.host.cgroups import sandbox_dirs
from test_cli import dsec_cli
from test_network import fetch
from test_projects import key_client, unique, used
from test_recovery import first_edge_id

DISK_MB = 256
LIMIT_FILES = ("cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us", "memory.max",
               "memory.limit_in_bytes", "pids.max")


def cgroup_limits(server: Server, sandbox_id: str) -> tuple[float, int, int]:
    """(CPUs, memory bytes, processes) the host's cgroups hold a container sandbox to."""
    found: dict[str, list[str]] = {}
    for d in sandbox_dirs(f"/dsec-{first_edge_id(server)}", sandbox_id):
        for name in LIMIT_FILES:
            if (d / name).exists():
                found[name] = (d / name).read_text().split()
    if "cpu.max" in found:  # cgroup v2
        quota, period = found["cpu.max"]
        memory = found["memory.max"][0]
    else:  # v1 hierarchies (a hybrid host)
        quota, period = found["cpu.cfs_quota_us"][0], found["cpu.cfs_period_us"][0]
        memory = found["memory.limit_in_bytes"][0]
    return int(quota) / int(period), int(memory), int(found["pids.max"][0])


async def disk_mb(sb: dsec.AsyncSandbox) -> int:
    return int((await sb.run("df -m --output=size /work | tail -1")).stdout)


async def test_children_have_the_parents_limits_and_network_unless_given_others(
        client: dsec.DSecClient, server: Server, dest: Destination) -> None:
    policy = {"allow": [f"{dest.address}:{PORTS[0]}"]}
    parent = await client.create(cpu=0.5, memory_mb=192, pids=48, disk_mb=DISK_MB, ttl_s=300,
                                 network=policy, env={"STAGE": "prepared"})
    try:
        await parent.write_file("/work/f", b"prepared")
        limits = cgroup_limits(server, parent.id)
        assert limits == (0.5, 192 << 20, 48)
        made = await parent.fork(2) + await parent.fork(
            1, cpu=1.0, memory_mb=256, pids=64, network="none", env={"SEED": "7"}, ttl_s=60)
        assert all(isinstance(k, dsec.AsyncSandbox) for k in made), made
        *kids, explicit = [k for k in made if isinstance(k, dsec.AsyncSandbox)]
        for kid in kids:
            assert (kid.info.cpu, kid.info.memory_mb) == (0.5, 192)
            assert kid.info.network == parent.info.network != "none"
            assert cgroup_limits(server, kid.id) == limits
            assert await kid.read_file("/work/f") == b"prepared"
            assert await fetch(kid, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            assert await fetch(kid, dest.address, PORTS[1]) is None  # the policy, not open
            assert (await kid.run("echo $STAGE")).stdout == "prepared\n"
            assert 300 <= kid.info.expires_at - kid.info.created_at < 600  # the parent's TTL
        assert (explicit.info.cpu, explicit.info.memory_mb, explicit.info.network) == \
            (1.0, 256, "none")
        assert cgroup_limits(server, explicit.id) == (1.0, 256 << 20, 64)
        assert await fetch(explicit, dest.address, PORTS[0]) is None  # no network at all
        assert (await explicit.run("echo $STAGE $SEED")).stdout == "prepared 7\n"  # added
        assert explicit.info.expires_at - explicit.info.created_at < 300
        for kid in (*kids, explicit):  # the disk is always the snapshot's
            assert DISK_MB - 32 < await disk_mb(kid) <= DISK_MB
            await kid.stop()
        # a policy changed in place is what the next snapshot's children get
        await parent.set_network("none")
        (later,) = await parent.fork(1)
        assert isinstance(later, dsec.AsyncSandbox), later
        assert later.info.network == "none" and later.info.memory_mb == 192
        assert await fetch(later, dest.address, PORTS[0]) is None
        await later.stop()
    finally:
        await parent.stop()


async def test_inherited_limits_are_held_to_the_projects_quota(client: dsec.DSecClient,
                                                               server: Server) -> None:
    """An agent's project has room for one more sandbox of the defaults (1 CPU, 512 MB) but
    not for a copy of its big one: children inheriting the big limits are QuotaExceeded, on
    the resource they would exceed, and nothing of them starts; children asking for less fit
    and are charged what they have."""
    name = unique("inherit")
    await client.projects().create(name, sandboxes=4, cpu=3, memory_mb=768 + 512,
                                   snapshot_bytes=2 * DISK_MB << 20)
    async with key_client(server, (await client.projects().create_key(name, "k")).key) as me:
        parent = await me.create(cpu=2, memory_mb=768, disk_mb=DISK_MB, ttl_s=120)
        try:
            refused = await parent.fork(2)
            assert all(isinstance(k, dsec.QuotaExceeded) for k in refused), refused
            assert {k.details["resource"] for k in refused if isinstance(k, dsec.DSecError)} == \
                {"cpu"}  # 2 CPUs inherited, 1 left (memory too would exceed: checked after)
            (memory_refused,) = await parent.fork(1, cpu=1)  # still 768 MB: 512 are left
            assert isinstance(memory_refused, dsec.QuotaExceeded), memory_refused
            assert memory_refused.details["resource"] == "memory_mb"
            assert await used(client, name) == (1, 2.0, 768)
            snap = await parent.snapshot()
            with pytest.raises(dsec.QuotaExceeded):
                await me.create(snapshot=snap.id)
            child = await me.create(snapshot=snap.id, cpu=1, memory_mb=256)
            assert (child.info.cpu, child.info.memory_mb) == (1.0, 256)
            assert cgroup_limits(server, child.id)[:2] == (1.0, 256 << 20)
            assert await used(client, name) == (2, 3.0, 1024)
            await child.stop()
            await me.delete_snapshot(snap.id)
        finally:
            await parent.stop()
    assert await used(client, name) == (0, 0.0, 0)


def test_fork_and_snapshot_take_mode_on_the_command_line(server: Server) -> None:
    with dsec.Client(server.url, server.key, autostart=False) as client:
        sb = client.create(memory_mb=160, ttl_s=120)
        try:
            (kid_id,) = dsec_cli(server, "fork", sb.id, "-n", "1", "--mode", "filesystem").stdout.split()
            kid = client.get(kid_id)
            assert kid.info.memory_mb == 160  # inherited
            kid.stop()
            for args in (("fork", sb.id, "--mode", "full"), ("snapshot", "take", sb.id, "--mode", "full")):
                refused = dsec_cli(server, *args, check=False)  # containers: no CRIU here
                assert refused.returncode == 1 and "not_supported" in refused.stderr
            bad = dsec_cli(server, "fork", sb.id, "--mode", "memory", check=False)
            assert bad.returncode == 2 and "memory" in bad.stderr  # click's usage error
            assert all(s.sandbox_id != sb.id for s in client.snapshots())  # none left
        finally:
            sb.stop()
