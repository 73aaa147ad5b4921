"""Sandbox state: filesystem snapshots of container sandboxes, sandboxes created from them,
fork(n), their project quota in bytes and TTLs, and their trust boundary (projects, hostile
trees, leaks), on a real server."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import dsec
from conftest import LOG_DIR, Server, make_server, own_server, stop_server
from dsec.substrates.host.cgroups import freezer_file
from support.disks import bundle_with_mounts
from test_cli import dsec_cli
from test_hostile import assert_no_trace
from test_projects import key_client, raw, unique
from test_recovery import first_edge_id

srv, client = own_server("--capacity", "64", "--warm-pool", "0")


def snapshot_dirs(srv: Server) -> set[str]:
    return {p.name for p in (srv.volume / "snapshots").glob("*")}


def snapshot_loops(srv: Server) -> list[str]:
    """Loop devices backed by a snapshot's file (a snapshot is never mounted)."""
    root = str(srv.volume / "snapshots") + "/"
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
    half_made = srv.volume / "snapshots" / "sn-crashed-000000000000"  # a crash mid-snapshot
    half_made.mkdir()
    (half_made / "disk.img").write_bytes(b"half")
    srv.start()
    assert not half_made.exists()
    async with srv.client() as fresh:
        assert [s.id for s in await fresh.snapshots()] == [snap.id]
        child = await fresh.create(snapshot=snap.id, ttl_s=300, memory_mb=256)
        try:
            assert (await child.read_file("/work/checkpoint")) == b"step 41"
            assert child.info.memory_mb == 256  # a limit given is the request's
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
    await assert_no_trace(srv, sb.id)  # its removal follows its stop (Edge._remove)
    assert await client.list() == []
    assert not list((srv.volume / "sandboxes").iterdir())  # nor the child that failed
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


async def test_a_paused_sandbox_stays_paused_through_a_snapshot(
        client: dsec.DSecClient, srv: Server) -> None:
    sb = await client.create(ttl_s=300)
    try:
        await sb.write_file("/work/kept", b"before")
        await sb.start("while :; do echo tick >> /work/ticks; sleep 0.01; done")
        await sb.pause()
        ticks = bundle_with_mounts(srv, sb.id) / "disk" / "upper" / "work" / "ticks"
        frozen_at = ticks.stat().st_size
        snap = await sb.snapshot()
        assert (await client.get(sb.id)).info.state == "paused"
        await asyncio.sleep(0.3)
        assert ticks.stat().st_size == frozen_at  # not one tick while it was snapshotted
        kid = await client.create(snapshot=snap.id, ttl_s=60)
        assert (await kid.read_file("/work/kept")) == b"before"
        assert (await kid.read_file("/work/ticks")).count(b"tick\n") == frozen_at // 5
        await kid.stop()
        await assert_no_trace(srv, kid.id)
        await sb.write_file("/work/kept", b"after")  # resumes it
        await sb.pause()
        await sb.rollback(snap)  # processes start afresh: it runs
        assert (await client.get(sb.id)).info.state == "running"
        assert (await sb.read_file("/work/kept")) == b"before"
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


async def test_a_stop_racing_a_rollback_wins_and_leaves_nothing(
        client: dsec.DSecClient, srv: Server) -> None:
    """A client's stop at any point of a rollback: the sandbox ends stopped, the rollback
    either finished first or fails typed, and nothing of either is left (a rollback that
    restarted the container after the stop's clean-up would leak it)."""
    for delay_s in (0.0, 0.005, 0.015, 0.03, 0.06):
        sb = await client.create(ttl_s=300)
        snap = await sb.snapshot()
        await sb.write_file("/work/later", b"x")

        async def stop_after(sb: dsec.AsyncSandbox = sb, delay_s: float = delay_s) -> None:
            await asyncio.sleep(delay_s)
            await sb.stop()
        rolled, stopped = await asyncio.gather(sb.rollback(snap), stop_after(),
                                               return_exceptions=True)
        assert stopped is None, stopped
        assert not isinstance(rolled, BaseException) or isinstance(
            rolled, (dsec.SandboxNotFound, dsec.SandboxDied)), rolled
        assert (await client.get(sb.id)).info.state == "stopped"
        await assert_no_trace(srv, sb.id)
        await client.delete_snapshot(snap.id)
    assert snapshot_dirs(srv) == set()


async def test_the_ttl_reaper_racing_rollbacks_leaves_nothing(
        client: dsec.DSecClient, srv: Server) -> None:
    sb = await client.create(ttl_s=300)
    snap = await sb.snapshot()
    await sb.set_ttl(1)
    ended = None
    deadline = time.monotonic() + 30
    while ended is None and time.monotonic() < deadline:
        try:
            await sb.rollback(snap)
        except (dsec.SandboxNotFound, dsec.SandboxDied) as exc:
            ended = exc
    assert ended is not None, "the TTL never expired"
    assert (await client.get(sb.id)).info.state == "expired"
    await assert_no_trace(srv, sb.id)
    await client.delete_snapshot(snap.id)


RECORD = 64  # bytes: an 8-digit counter, 55 zeros, a newline
APPENDER = "i=0; while :; do i=$((i+1)); printf '%08d%055d\\n' $i 0 >> /work/app; done"
REWRITER = ("while :; do head -c 4194304 /dev/zero | tr '\\0' x > /work/blob.tmp && "
            "mv /work/blob.tmp /work/blob; done")
FORKER = "while :; do /bin/true; done"
# What e2fsck says of any image of a mounted, journal-less ext4 taken after a syncfs: the
# superblock's summary counters are stale (ext4 recomputes them from the group descriptors
# when it mounts); anything else would be a torn file system.
SUMMARY_ONLY = ("Free blocks count wrong", "Free inodes count wrong",
                "Padding at end of inode bitmap")


def e2fsck_findings(image: Path) -> list[str]:
    """What a read-only full check of the image finds, beyond the stale summary counters."""
    done = subprocess.run(["e2fsck", "-fn", str(image)], capture_output=True, text=True)
    assert done.returncode in (0, 1, 4), done
    return [line for line in done.stdout.splitlines()
            if line.strip() and not line.startswith(("Pass ", "Fix? no", *SUMMARY_ONLY))
            and not line.startswith(f"{image}: ") and "check forced" not in line]


async def test_snapshots_of_a_sandbox_writing_and_forking_flat_out_are_whole(
        client: dsec.DSecClient, srv: Server) -> None:
    """Hostile: an appender, a rewriter of a 4 MiB file and two fork loops run flat out
    while snapshots are taken (processes frozen, syncfs, clone): every image is a clean
    file system apart from its summary counters, and sandboxes started from them hold only
    whole records, in order, and only whole rewrites."""
    sb = await client.create(ttl_s=300, pids=256)
    snaps: list[dsec.Snapshot] = []
    try:
        for script in (APPENDER, REWRITER, FORKER, FORKER):
            await sb.start(["sh", "-c", script])
        await asyncio.sleep(1.0)
        for _ in range(8):
            t0 = time.perf_counter()
            snaps.append(await sb.snapshot())
            assert time.perf_counter() - t0 < 5
            await asyncio.sleep(0.1)
        assert (await client.get(sb.id)).info.state == "running"  # thawed after each
        for snap in snaps:
            assert e2fsck_findings(srv.volume / "snapshots" / snap.id / "disk.img") == []
        for snap in (snaps[0], snaps[len(snaps) // 2], snaps[-1]):
            kid = await client.create(snapshot=snap.id, ttl_s=60)
            try:
                app = await kid.read_file("/work/app")
                assert len(app) % RECORD == 0 and app, len(app)
                counters = [int(app[i:i + 8]) for i in range(0, len(app), RECORD)]
                assert counters == list(range(1, len(counters) + 1))
                assert all(app[i + 8:i + RECORD] == b"0" * 55 + b"\n"
                           for i in range(0, len(app), RECORD))
                blob = await kid.stat("/work/blob")
                assert blob.size == 4 << 20
                check = await kid.run("tr -d x < /work/blob | wc -c")
                assert check.stdout.strip() == "0"
            finally:
                await kid.stop()
            await assert_no_trace(srv, kid.id)
    finally:
        await sb.stop()
        for snap in snaps:
            await client.delete_snapshot(snap.id)
    await assert_no_trace(srv, sb.id)
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


async def test_the_disk_volume_refuses_what_may_not_fit_and_goes_when_the_server_stops(
        images) -> None:  # type: ignore[no-untyped-def]
    """A 1 GiB volume: a sandbox whose whole disk would not fit beside the reserve is
    refused typed (CapacityExhausted), a small one is made and snapshotted as clones; the
    server stopped with no sandbox unmounts the volume; a --disk-volume directory that
    cannot clone is refused at start."""
    server = make_server("--warm-pool", "0", "--disk-volume-gb", "1").start()
    try:
        async with server.client() as client:
            with pytest.raises(dsec.CapacityExhausted, match="reserve"):
                await client.create(disk_mb=1024, ttl_s=60)
            sb = await client.create(disk_mb=64, ttl_s=60)
            await sb.write_file("/work/f", b"fits")
            kid = (await sb.fork(1, ttl_s=60))[0]
            assert isinstance(kid, dsec.AsyncSandbox)
            assert await kid.read_file("/work/f") == b"fits"
            for done in (kid, sb):
                await done.stop()
                await assert_no_trace(server, done.id)
        assert os.path.ismount(server.volume)
    finally:
        server.kill(signal.SIGTERM)
    assert not os.path.ismount(server.volume)  # nothing on it was in use
    assert str(server.state_dir / "volume.xfs") not in Path("/proc/self/mountinfo").read_text()
    stop_server(server)
    not_reflink = server.state_dir.parent / f"not-reflink-{secrets.token_hex(3)}"  # host ext4
    not_reflink.mkdir()
    plain = make_server("--disk-volume", str(not_reflink))
    try:
        with pytest.raises(RuntimeError, match="cannot clone"):
            plain.start()
        assert not any(not_reflink.iterdir())
    finally:
        not_reflink.rmdir()
        shutil.rmtree(plain.state_dir, ignore_errors=True)


async def test_a_restarted_server_mounts_its_volume_while_another_namespace_pins_it(
        images) -> None:  # type: ignore[no-untyped-def]
    """A process that made a mount namespace while the volume was mounted keeps its file system
    alive after the server unmounts it; the next start mounts that same file system again
    (a second loop device would be refused as a duplicate XFS) and serves."""
    server = make_server("--warm-pool", "0", "--disk-volume-gb", "4").start()
    pin = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "600"])
    try:
        async with server.client() as client:
            await (await client.create(ttl_s=60)).stop()
        server.kill(signal.SIGTERM)
        assert not os.path.ismount(server.volume)
        server.start()
        async with server.client() as client:
            sb = await client.create(ttl_s=60)
            await sb.write_file("/work/f", b"served")
            assert (await sb.fork(1, ttl_s=60))[0].id != sb.id  # the volume clones again
            assert (await sb.run("cat /work/f")).stdout == "served"
    finally:
        pin.kill()
        pin.wait()
        stop_server(server)


async def test_a_rollback_kills_a_forking_storm_to_the_last_process(
        client: dsec.DSecClient, srv: Server) -> None:
    """Hostile: the sandbox forks sleepers flat out up to its pids limit when it is rolled
    back; the restart (in the same cgroups) starts with none of them left."""
    sb = await client.create(ttl_s=300, pids=96)
    procs = freezer_file(f"/dsec-{first_edge_id(srv)}", sb.id).parent / "cgroup.procs"
    try:
        snap = await sb.snapshot()
        for _ in range(2):
            await sb.start(["sh", "-c", "while :; do sleep 1000 & done"])
        await asyncio.sleep(1.0)
        assert len(procs.read_text().split()) > 40
        await sb.rollback(snap)
        assert len(procs.read_text().split()) == 1  # the new agent alone
        assert await sb.processes() == []
        assert (await sb.run("echo fresh")).stdout == "fresh\n"
        await client.delete_snapshot(snap.id)
    finally:
        await sb.stop()
    await assert_no_trace(srv, sb.id)


async def test_with_the_volume_off_snapshots_freeze_the_file_system_and_copy(
        images) -> None:  # type: ignore[no-untyped-def]
    """``--disk-volume off`` keeps the images on the state dir (host ext4 here, which cannot
    clone): snapshots take the FIFREEZE path and sparse copies, a paused sandbox comes back
    paused, children and rollbacks still work, nothing is mounted for a volume."""
    server = make_server("--warm-pool", "0", "--disk-volume", "off").start()
    try:
        assert not os.path.ismount(server.volume) and not server.volume.exists()
        async with server.client() as client:
            sb = await client.create(ttl_s=120)
            await sb.write_file("/work/kept", b"before")
            await sb.pause()
            snap = await sb.snapshot()
            assert (await client.get(sb.id)).info.state == "paused"
            assert (server.state_dir / "snapshots" / snap.id / "disk.img").exists()
            kid = await client.create(snapshot=snap.id, ttl_s=60)
            assert await kid.read_file("/work/kept") == b"before"
            await sb.write_file("/work/kept", b"after")
            await sb.rollback(snap)
            assert await sb.read_file("/work/kept") == b"before"
            for done in (kid, sb):
                await done.stop()
            await client.delete_snapshot(snap.id)
        log = (LOG_DIR / f"{server.state_dir.name}.log").read_text()
        assert "copying its data instead" in log  # the fallback says so (once per pair)
    finally:
        stop_server(server)
