"""Sandbox state: filesystem snapshots of container sandboxes, sandboxes created from them,
fork(n), their project quota in bytes and TTLs, and their trust boundary (projects, hostile
trees, leaks), on a real server."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import dsec
from conftest import Server, make_server, stop_server
from test_cli import dsec_cli
from test_hostile import assert_no_trace
from test_projects import key_client, raw, unique


@pytest.fixture(scope="module")
def srv(images) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    server = make_server("--capacity", "64", "--warm-pool", "0").start()
    yield server
    stop_server(server)


@pytest.fixture
async def client(srv: Server) -> AsyncIterator[dsec.DSecClient]:
    async with srv.client() as c:
        yield c


def snapshot_dirs(srv: Server) -> set[str]:
    return {p.name for p in (srv.state_dir / "snapshots").glob("*")}


def snapshot_loops(srv: Server) -> list[str]:
    """Loop devices backed by a snapshot's file (a snapshot is never mounted)."""
    root = str(srv.state_dir / "snapshots") + "/"
    return [b.read_text().strip() for b in Path("/sys/block").glob("loop*/loop/backing_file")
            if b.read_text().startswith(root)]


async def test_group_rollout_forks_see_the_parent_and_never_each_other(
        client: dsec.DSecClient, srv: Server) -> None:
    parent = await client.create(ttl_s=300)
    try:
        await parent.write_file("/work/prompt.txt", b"solve it")
        await parent.run("mkdir -p /opt/env && echo ready > /opt/env/state && rm /etc/hostname")
        background = await parent.start("sleep 1000")
        children = await parent.fork(8, ttl_s=300)
        assert all(isinstance(c, dsec.AsyncSandbox) for c in children), children
        kids = [c for c in children if isinstance(c, dsec.AsyncSandbox)]
        assert len({k.id for k in kids} | {parent.id}) == 9
        for i, kid in enumerate(kids):
            await kid.write_file(f"/work/rollout-{i}", str(i).encode())
        for i, kid in enumerate(kids):
            seen = (await kid.run("cat /work/prompt.txt /opt/env/state; ls /work; "
                                  "test -e /etc/hostname || echo no-hostname")).stdout
            assert seen == f"solve itready\nprompt.txt\nrollout-{i}\nno-hostname\n"
            assert await kid.processes() == []  # processes start fresh
        assert (await parent.run("ls /work")).stdout == "prompt.txt\n"
        assert [p.id for p in await parent.processes()] == [background.id]
        assert await client.snapshots() == []  # the fork's snapshot is gone
        assert snapshot_dirs(srv) == set()
        for kid in kids:
            await kid.stop()
            await assert_no_trace(srv, kid.id)
    finally:
        await parent.stop()
    await assert_no_trace(srv, parent.id)
    assert snapshot_loops(srv) == []


async def test_a_snapshot_outlives_its_sandbox_and_a_server_restart(
        client: dsec.DSecClient, srv: Server) -> None:
    source = await client.create(ttl_s=300, disk_mb=256)
    await source.write_file("/work/checkpoint", b"step 41")
    snap = await source.snapshot()
    assert (snap.mode, snap.sandbox_id, snap.image) == ("filesystem", source.id, "debian-minbase")
    assert 0 < snap.size_bytes < 256 << 20  # the blocks used, not the disk's size
    await source.stop()
    srv.kill(signal.SIGKILL)
    half_made = srv.state_dir / "snapshots" / "sn-crashed-000000000000"  # a crash mid-snapshot
    half_made.mkdir()
    (half_made / "disk.img").write_bytes(b"half")
    srv.start()
    assert not half_made.exists()
    async with srv.client() as fresh:
        assert [s.id for s in await fresh.snapshots()] == [snap.id]
        child = await fresh.create(snapshot=snap.id, ttl_s=300, memory_mb=256)
        try:
            assert (await child.read_file("/work/checkpoint")) == b"step 41"
            assert child.info.memory_mb == 256  # limits are the request's
            assert (await child.run("df -m --output=size /work | tail -1")).stdout.strip() in \
                {str(n) for n in range(230, 257)}  # the snapshot's disk size
        finally:
            await child.stop()
        await fresh.delete_snapshot(snap.id)
    assert snapshot_dirs(srv) == set()


async def test_rollback_restores_the_files_under_the_same_id(client: dsec.DSecClient,
                                                             srv: Server) -> None:
    sb = await client.create(ttl_s=300, memory_mb=256)
    other = await client.create(ttl_s=300)
    try:
        await sb.write_file("/work/answer", b"v1")
        snap = await sb.snapshot()
        theirs = await other.snapshot()
        await sb.write_file("/work/answer", b"v2 (reward hacked)")
        await sb.run("rm -rf /etc/apt && touch /work/stray")
        await sb.start("sleep 1000")
        info = await sb.rollback(snap)
        assert (info.id, info.state, info.memory_mb) == (sb.id, "running", 256)
        assert await sb.read_file("/work/answer") == b"v1"
        assert (await sb.run("ls /work; test -d /etc/apt && echo apt")).stdout == "answer\napt\n"
        assert await sb.processes() == []
        with pytest.raises(dsec.InvalidRequest, match="another sandbox"):
            await sb.rollback(theirs)
        await sb.write_file("/work/answer", b"v3")
        busy = asyncio.ensure_future(sb.run("sleep 30"))  # a call cut by the rollback
        await asyncio.sleep(0.5)
        await sb.rollback(snap.id)  # again, from the same snapshot
        with pytest.raises(dsec.SandboxError, match="rolled back"):  # not SandboxDied
            await busy
        assert await sb.read_file("/work/answer") == b"v1"
        srv.kill(signal.SIGKILL)  # the restarted sandbox is adopted after a restart
        srv.start()
        async with srv.client() as fresh:
            again = await fresh.get(sb.id)
            assert (await again.run("cat /work/answer")).stdout == "v1"
            await fresh.delete_snapshot(snap.id)
            await fresh.delete_snapshot(theirs.id)
            await again.stop()
    finally:
        async with srv.client() as fresh:  # the handles' client may predate the restart
            for box in (sb, other):
                try:
                    await (await fresh.get(box.id)).stop()
                except dsec.DSecError:  # stopped already
                    pass
    await assert_no_trace(srv, sb.id)
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


async def test_a_deleted_snapshot_is_not_found(client: dsec.DSecClient, srv: Server) -> None:
    source = await client.create(ttl_s=120)
    try:
        snap = await source.snapshot()
    finally:
        await source.stop()
    await client.delete_snapshot(snap.id)
    with pytest.raises(dsec.SnapshotNotFound):
        await client.create(snapshot=snap.id)
    with pytest.raises(dsec.SnapshotNotFound):
        await client.delete_snapshot(snap.id)
    with pytest.raises(dsec.SnapshotNotFound):
        await client.create(snapshot="sn-nope-000000000000")
    assert snapshot_dirs(srv) == set()
    assert await client.list() == []  # no half-made sandbox


async def test_full_snapshots_are_typed_not_supported(client: dsec.DSecClient, srv: Server) -> None:
    sb = await client.create(ttl_s=120)
    try:
        with pytest.raises(dsec.NotSupported, match="full") as refused:
            await sb.snapshot(mode="full")
        # the host's own reason: criu missing, or `criu check` failing on this kernel
        assert "CRIU" in str(refused.value) and "criu" in str(refused.value).split("CRIU", 1)[1]
    finally:
        await sb.stop()
    assert snapshot_dirs(srv) == set()


async def test_another_projects_snapshots_are_invisible(client: dsec.DSecClient,
                                                        srv: Server) -> None:
    mine, theirs = unique("mine"), unique("theirs")
    for name in (mine, theirs):
        await client.projects().create(name, sandboxes=4, cpu=4, memory_mb=2048,
                                       snapshot_bytes=4 << 30)
    my_key = (await client.projects().create_key(mine, "a")).key
    async with key_client(srv, my_key) as me, \
            key_client(srv, (await client.projects().create_key(theirs, "b")).key) as them:
        victim = await them.create(memory_mb=256, ttl_s=120)
        try:
            await victim.write_file("/work/secret", b"their reward model")
            snap = await victim.snapshot()
            assert await me.snapshots() == []
            with pytest.raises(dsec.SnapshotNotFound):
                await me.create(snapshot=snap.id, memory_mb=256)
            with pytest.raises(dsec.SnapshotNotFound):
                await me.delete_snapshot(snap.id)
            with raw(srv, my_key) as http:  # nor snapshot nor roll back their sandbox
                answer = http.post(f"/v1/sandboxes/{victim.id}/snapshots", json={})
                assert answer.json()["error"]["code"] == "sandbox_not_found"
                answer = http.post(f"/v1/sandboxes/{victim.id}/rollback",
                                   json={"snapshot": snap.id})
                assert answer.json()["error"]["code"] == "sandbox_not_found"
            own = await me.create(memory_mb=256, ttl_s=60)
            try:  # nor roll their snapshot into a sandbox of mine
                with pytest.raises(dsec.SnapshotNotFound):
                    await own.rollback(snap.id)
                with pytest.raises(dsec.FileNotFound):
                    await own.read_file("/work/secret")
            finally:
                await own.stop()
            assert [s.id for s in await them.snapshots()] == [snap.id]
        finally:
            await victim.stop()
        await them.delete_snapshot(snap.id)
    assert snapshot_dirs(srv) == set()


async def test_a_hostile_tree_snapshots_within_its_disk_and_time(client: dsec.DSecClient,
                                                                 srv: Server) -> None:
    """A 1,000-deep chain, a 10 GB sparse file and a disk filled to the last block: the
    snapshot costs at most the sandbox's disk_mb, completes, and a sandbox starts from it with
    the same tree. Then every inode used up (100k files): that snapshot's children cannot
    start (no inode for their overlay's work dir), a typed error that leaves nothing."""
    sb = await client.create(ttl_s=600, disk_mb=256)
    snaps = []
    try:
        await sb.run("cd /work && for i in $(seq 1000); do mkdir d && cd d; done", timeout_s=300)
        await sb.run("dd if=/dev/zero of=/work/sparse bs=1M count=1 seek=10000", timeout_s=60)
        filled = await sb.run("dd if=/dev/urandom of=/work/fill bs=1M", timeout_s=300)
        assert "No space left" in filled.stderr
        started = time.monotonic()
        snaps.append(await sb.snapshot())
        assert time.monotonic() - started < 60
        assert 200 << 20 < snaps[0].size_bytes <= 256 << 20
        await sb.run("rm /work/fill")
        inodes = await sb.run("mkdir /work/many && cd /work/many && seq 200000 | xargs touch",
                              timeout_s=300)
        assert "No space left" in inodes.stderr
        snaps.append(await sb.snapshot())
        assert snaps[1].size_bytes <= 256 << 20
    finally:
        await sb.stop()
    child = await client.create(snapshot=snaps[0].id, ttl_s=120)
    try:
        tree = await child.run("ls -ls /work/sparse | cut -d' ' -f6; stat -c %s /work/fill; "
                               "find /work/d | wc -l", timeout_s=120)
        size, fill, depth = tree.stdout.split()
        assert (int(size), int(depth)) == ((10000 + 1) << 20, 1000)
        assert 200 << 20 < int(fill) <= 256 << 20
    finally:
        await child.stop()
    with pytest.raises(dsec.SandboxError, match="full"):
        await client.create(snapshot=snaps[1].id, ttl_s=120)
    for snap in snaps:
        await client.delete_snapshot(snap.id)
    await assert_no_trace(srv, child.id)
    assert await client.list() == []
    assert not list((srv.state_dir / "sandboxes").iterdir())  # nor the child that failed
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


async def test_a_snapshot_with_its_work_dir_made_a_symlink_starts_and_touches_no_host_path(
        client: dsec.DSecClient, srv: Server) -> None:
    """The host makes /work in a new sandbox's layer: in a snapshot, /work is the sandbox's
    to shape (a symlink to a host path, a dangling one); the host never follows it."""
    for target in ("/nonexistent-on-the-host", "/etc/dsec-statefs-probe"):
        sb = await client.create(ttl_s=120)
        try:
            await sb.run(f"cd / && mv work work.real && ln -s {target} work", cwd="/")
            snap = await sb.snapshot()
        finally:
            await sb.stop()
        child = await client.create(snapshot=snap.id, ttl_s=120)
        try:
            assert (await child.run("readlink /work", cwd="/")).stdout == f"{target}\n"
        finally:
            await child.stop()
            await client.delete_snapshot(snap.id)
        assert not Path(target).exists()


async def test_concurrent_forks_and_deletes_leave_nothing(client: dsec.DSecClient,
                                                          srv: Server) -> None:
    parent = await client.create(ttl_s=300)
    try:
        snap = await parent.snapshot()
        racing = [client.create(snapshot=snap.id, ttl_s=60) for _ in range(4)]
        made = await asyncio.gather(*racing, client.delete_snapshot(snap.id),
                                    return_exceptions=True)
        kids = [m for m in made if isinstance(m, dsec.AsyncSandbox)]
        assert all(isinstance(m, (dsec.AsyncSandbox, dsec.SnapshotNotFound)) or m is None
                   for m in made), made
        for kid in kids:
            await kid.stop()
            await assert_no_trace(srv, kid.id)
    finally:
        await parent.stop()
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


def test_snapshot_ls_and_rm_on_the_command_line(srv: Server) -> None:
    with dsec.Client(srv.url, srv.key, autostart=False) as client:
        sb = client.create(ttl_s=120)
        try:
            snap = sb.snapshot()
        finally:
            sb.stop()
        assert snap.id in dsec_cli(srv, "snapshot", "ls").stdout
        assert dsec_cli(srv, "snapshot", "rm", snap.id).stdout == f"{snap.id}\n"
        assert client.snapshots() == []
        gone = dsec_cli(srv, "snapshot", "rm", snap.id, check=False)
        assert gone.returncode == 1 and "snapshot_not_found" in gone.stderr
    assert snapshot_dirs(srv) == set()


async def test_a_paused_sandbox_is_resumed_to_be_snapshotted_and_rolled_back(
        client: dsec.DSecClient, srv: Server) -> None:
    sb = await client.create(ttl_s=300)
    try:
        await sb.write_file("/work/kept", b"before")
        await sb.pause()
        snap = await sb.snapshot()
        assert (await client.get(sb.id)).info.state == "running"
        await sb.write_file("/work/kept", b"after")
        await sb.pause()
        await sb.rollback(snap)
        assert (await sb.read_file("/work/kept")) == b"before"
        kid = await client.create(snapshot=snap.id, ttl_s=60)
        assert (await kid.read_file("/work/kept")) == b"before"
        await kid.stop()
        await assert_no_trace(srv, kid.id)
        await client.delete_snapshot(snap.id)
    finally:
        await sb.stop()
    await assert_no_trace(srv, sb.id)
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


DISK_MB = 256  # the sandboxes' disk in the quota tests: a snapshot holds as much of the quota


async def snapshot_room(admin: dsec.DSecClient, project: str) -> tuple[int, int]:
    """(used, available) snapshot bytes of a project."""
    p = await admin.projects().get(project)
    return p.used.snapshot_bytes, p.available.snapshot_bytes


async def test_snapshots_hold_their_disk_of_the_project_quota_and_spam_is_refused(
        client: dsec.DSecClient, srv: Server) -> None:
    """Room for two snapshots: twenty at once (an agent spamming) make exactly two, the rest
    are QuotaExceeded and leave no files; a delete gives its bytes back; a fork of three
    children holds one snapshot while it forks."""
    name = unique("snapquota")
    await client.projects().create(name, sandboxes=6, cpu=6, memory_mb=6 * 256,
                                   snapshot_bytes=2 * DISK_MB << 20)
    async with key_client(srv, (await client.projects().create_key(name, "k")).key) as me:
        sb = await me.create(memory_mb=256, disk_mb=DISK_MB, ttl_s=120)
        try:
            await sb.write_file("/work/f", b"x")
            made = await asyncio.gather(*(sb.snapshot() for _ in range(20)), return_exceptions=True)
            snaps = [m for m in made if isinstance(m, dsec.Snapshot)]
            refused = [m for m in made if not isinstance(m, dsec.Snapshot)]
            assert len(snaps) == 2 and len(refused) == 18, [repr(e) for e in refused]
            assert all(isinstance(e, dsec.QuotaExceeded) for e in refused), refused
            assert refused[0].details["resource"] == "snapshot_bytes"
            assert snapshot_dirs(srv) == {s.id for s in snaps}
            assert await snapshot_room(client, name) == (2 * DISK_MB << 20, 0)
            with pytest.raises(dsec.QuotaExceeded):  # a fork needs one snapshot's room too
                await sb.fork(2, memory_mb=256)
            await me.delete_snapshot(snaps[0].id)
            assert await snapshot_room(client, name) == (DISK_MB << 20, DISK_MB << 20)
            kids = await sb.fork(3, memory_mb=256, ttl_s=60)  # one snapshot for three children
            assert not any(isinstance(k, dsec.DSecError) for k in kids), kids
            assert [await k.read_file("/work/f") for k in kids] == [b"x"] * 3
            assert await snapshot_room(client, name) == (DISK_MB << 20, DISK_MB << 20)
            for k in kids:
                await k.stop()
            await me.delete_snapshot(snaps[1].id)
        finally:
            await sb.stop()
    assert await snapshot_room(client, name) == (0, 2 * DISK_MB << 20)
    assert snapshot_dirs(srv) == set()


async def test_a_snapshot_ttl_deletes_it_in_the_background_and_spares_its_children(
        client: dsec.DSecClient, srv: Server) -> None:
    """A TTL'd snapshot is listed with its end, is deleted by the server when it ends (its
    files too), is then not found for a create, and gives its bytes back; a child started
    from it keeps running on its own copy."""
    name = unique("snapttl")
    await client.projects().create(name, sandboxes=4, cpu=4, memory_mb=1024,
                                   snapshot_bytes=DISK_MB << 20)
    async with key_client(srv, (await client.projects().create_key(name, "k")).key) as me:
        sb = await me.create(memory_mb=256, disk_mb=DISK_MB, ttl_s=120)
        try:
            await sb.write_file("/work/f", b"from the snapshot")
            snap = await sb.snapshot(ttl_s=3)
            assert snap.expires_at is not None and snap.expires_at - snap.created_at == 3
            assert [s.expires_at for s in await me.snapshots()] == [snap.expires_at]
            kid = await me.create(snapshot=snap.id, memory_mb=256, ttl_s=120)
            deadline = time.monotonic() + 10
            while snap.id in snapshot_dirs(srv) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert snapshot_dirs(srv) == set() and await me.snapshots() == []
            for _ in range(20):  # its edge, in this server's process, tells the projects
                if await snapshot_room(client, name) == (0, DISK_MB << 20):
                    break
                await asyncio.sleep(0.1)
            assert await snapshot_room(client, name) == (0, DISK_MB << 20)
            with pytest.raises(dsec.SnapshotNotFound):
                await me.create(snapshot=snap.id, memory_mb=256)
            with pytest.raises(dsec.SnapshotNotFound):
                await me.delete_snapshot(snap.id)
            assert await kid.read_file("/work/f") == b"from the snapshot"
            await kid.write_file("/work/g", b"still writable")
            assert (await kid.run("cat /work/f /work/g")).stdout == "from the snapshotstill writable"
            again = await sb.snapshot()  # the expired one's bytes came back
            await me.delete_snapshot(again.id)
            await kid.stop()
        finally:
            await sb.stop()
    assert await snapshot_room(client, name) == (0, DISK_MB << 20)
    assert snapshot_dirs(srv) == set()


def test_fork_and_snapshot_ttl_on_the_command_line(srv: Server) -> None:
    with dsec.Client(srv.url, srv.key, autostart=False) as client:
        sb = client.create(ttl_s=120)
        try:
            sb.write_file("/work/f", b"forked")
            forked = dsec_cli(srv, "fork", sb.id, "-n", "2", "--ttl", "60").stdout.split()
            assert len(forked) == 2 and all(k.startswith("sb-") for k in forked)
            for kid_id in forked:
                kid = client.get(kid_id)
                assert kid.read_file("/work/f") == b"forked"
                kid.stop()
            snap_id = dsec_cli(srv, "snapshot", "take", sb.id, "--ttl", "600").stdout.strip()
            listed = dsec_cli(srv, "snapshot", "ls").stdout
            assert snap_id in listed and ("600s" in listed or "599s" in listed)
            dsec_cli(srv, "snapshot", "rm", snap_id)
        finally:
            sb.stop()
        gone = dsec_cli(srv, "fork", sb.id, "-n", "1", check=False)
        assert gone.returncode == 1 and "sandbox_not_found" in gone.stderr
    assert snapshot_dirs(srv) == set()
