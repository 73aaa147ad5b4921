"""Checkpointed trajectories: a snapshot per logged step (shared while steps write nothing),
``fork_trajectory`` from a step's checkpoint, and forks and replays that restore a
checkpoint instead of re-executing steps. Real server, real containers; steps that append to
a file and read the clock show any step that runs twice."""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import dsec
from conftest import Server, make_server, stop_server
from dsec.substrates.container.container import FIFREEZE, FITHAW
from dsec.substrates.host import disk_writes
from dsec.substrates.host.disk import MKFS
from dsec.substrates.host.loop import loop_mount, unmount_image
from test_cli import dsec_cli
from test_projects import key_client, unique

APPEND = "echo step >> /work/log; date +%s%N >> /work/clock"  # never the same twice


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def srv(request: pytest.FixtureRequest, images) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    """The checkpoint table on both state stores."""
    args = ["--capacity", "64", "--warm-pool", "0"]
    if request.param == "postgres":
        args += ["--state-url", request.getfixturevalue("postgres_url")]
    server = make_server(*args).start()
    yield server
    stop_server(server)


@pytest.fixture
async def client(srv: Server) -> AsyncIterator[dsec.DSecClient]:
    async with srv.client() as c:
        yield c


def new_id(prefix: str) -> str:
    return f"test/{prefix}-{secrets.token_hex(3)}"


async def checkpoints(client: dsec.DSecClient, trajectory: str) -> list[str | None]:
    return [s.checkpoint for s in await client.trajectory_steps(trajectory)]


async def files(sb: dsec.AsyncSandbox) -> tuple[str, str]:
    return ((await sb.read_file("/work/log")).decode(), (await sb.read_file("/work/clock")).decode())


async def test_fork_at_a_step_restores_it_and_never_runs_a_step_again(
        client: dsec.DSecClient) -> None:
    trajectory = new_id("fork")
    sb = await client.create(trajectory=trajectory, checkpoint="every_step", ttl_s=300)
    try:
        await sb.run(APPEND)                                # 1: writes
        await sb.run("true")                                # 2: writes nothing
        await sb.run("cat /etc/hostname")                   # 3: reads (not written since boot)
        await sb.write_file("/work/after", b"step 4")       # 4: writes
        clock = (await sb.read_file("/work/clock")).decode()  # 5
        cps = await checkpoints(client, trajectory)
        assert all(cps), cps
        assert cps[1] == cps[0] and cps[2] == cps[1], "unchanged disks share one snapshot"
        assert cps[3] != cps[2], "a step that writes a file gets a checkpoint of its own"
        listed = {s.id for s in await client.snapshots()}
        assert set(cps) <= listed, "checkpoints are snapshots"

        forks = await client.fork_trajectory(trajectory, at_step=3, n=2)
        assert len(forks) == 2 and len({f.id for f in forks} | {sb.id}) == 3
        for fork in forks:
            assert fork.trajectory and fork.trajectory.startswith(f"{trajectory}/fork-3-")
            # Step 4 is the fork's own, and runs in the fork (which has no /work/after).
            assert await fork.exists("/work/after") is False
            assert await files(fork) == ("step\n", clock), "step 1 ran once, in the parent"
            steps = await client.trajectory_steps(fork.trajectory)
            assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6]  # exists, 2 reads
            assert [s.digest for s in steps[:3]] == \
                [s.digest for s in (await client.trajectory_steps(trajectory))[:3]]
        await forks[0].write_file("/work/mine", b"0")
        assert await forks[1].exists("/work/mine") is False
        assert await sb.exists("/work/mine") is False
        # The parent goes on, untouched.
        assert await sb.read_file("/work/after") == b"step 4"
        for fork in forks:
            await fork.stop()
    finally:
        await sb.stop()


async def test_fork_at_step_zero_and_every_kth_step(client: dsec.DSecClient) -> None:
    trajectory = new_id("every2")
    sb = await client.create(trajectory=trajectory, checkpoint=2, ttl_s=300)
    try:
        for _ in range(4):
            await sb.run(APPEND)
        cps = await checkpoints(client, trajectory)
        assert cps[0] is None and cps[2] is None and cps[1] and cps[3] and cps[1] != cps[3]
        with pytest.raises(dsec.CheckpointNotFound):
            await client.fork_trajectory(trajectory, at_step=3)
        (zero,) = await client.fork_trajectory(trajectory, at_step=0)
        (two,) = await client.fork_trajectory(trajectory, at_step=2)
        try:
            assert await zero.exists("/work/log") is False
            log, clock = await files(two)
            assert log == "step\nstep\n"
            assert clock.splitlines() == (await sb.read_file("/work/clock")).decode().splitlines()[:2]
        finally:
            await zero.stop()
            await two.stop()
    finally:
        await sb.stop()


async def test_resume_fork_and_replay_restore_the_checkpoint(client: dsec.DSecClient) -> None:
    trajectory = new_id("restore")
    sb = await client.create(trajectory=trajectory, checkpoint="every_step", ttl_s=300)
    for _ in range(3):
        await sb.run(APPEND)
    clock = (await sb.read_file("/work/clock")).decode().splitlines()  # step 4

    # A divergence at step 3, forking: the new generation starts from step 2's checkpoint.
    resumed = await client.resume(trajectory, on_divergence="fork")
    await resumed.run(APPEND)
    await resumed.run(APPEND)
    await resumed.run("echo another step 3")
    assert resumed.id != sb.id
    assert (await resumed.read_file("/work/clock")).decode().splitlines() == clock[:2]
    info = await client.trajectory(trajectory)
    assert info.generation == 2 and info.generations[1].replay_differences == []

    replay = await client.replay(trajectory, generation=1, upto=3)
    try:
        assert replay.restored_step == 3 and replay.steps == []
        assert (await replay.sandbox.read_file("/work/clock")).decode().splitlines() == clock
    finally:
        await replay.sandbox.stop()
    again = await client.replay(trajectory, generation=1, upto=3, restore=False)
    try:  # re-executed: the clock moved on
        assert again.restored_step is None and [s.step for s in again.steps] == [1, 2, 3]
        assert (await again.sandbox.read_file("/work/clock")).decode().splitlines() != clock
    finally:
        await again.sandbox.stop()
    await resumed.stop()


def test_the_blocking_client_checkpoints_forks_and_deletes(srv: Server) -> None:
    trajectory = new_id("sync")
    with dsec.Client(srv.url, srv.key, autostart=False) as client:
        sb = client.create(trajectory=trajectory, checkpoint=1, ttl_s=120)
        sb.run(APPEND)
        (fork,) = client.fork_trajectory(trajectory, at_step=1)
        assert fork.read_file("/work/clock") == sb.read_file("/work/clock")
        assert fork.trajectory is not None
        replay = client.replay(trajectory, upto=1)
        assert replay.restored_step == 1 and replay.steps == []
        replay.sandbox.stop()
        client.delete_trajectory(fork.trajectory)
        client.delete_trajectory(trajectory)
        with pytest.raises(dsec.TrajectoryNotFound):
            client.trajectory(trajectory)


async def test_a_trajectory_started_from_a_snapshot_forks_and_replays_from_it(
        client: dsec.DSecClient) -> None:
    base = await client.create(ttl_s=120)
    await base.write_file("/work/base", b"from the snapshot")
    snap = await base.snapshot()
    await base.stop()
    trajectory = new_id("from-snap")
    sb = await client.create(snapshot=snap.id, trajectory=trajectory, checkpoint="every_step",
                             ttl_s=300)
    try:
        await sb.run(APPEND)
        (zero,) = await client.fork_trajectory(trajectory, at_step=0)
        replay = await client.replay(trajectory, restore=False)
        try:
            assert await zero.read_file("/work/base") == b"from the snapshot"
            assert await zero.exists("/work/log") is False
            assert await replay.sandbox.read_file("/work/base") == b"from the snapshot"
            assert await replay.sandbox.read_file("/work/log") == b"step\n"
        finally:
            await zero.stop()
            await replay.sandbox.stop()
    finally:
        await sb.stop()
        await client.delete_snapshot(snap.id)


async def test_a_deleted_checkpoint_is_a_typed_error_never_a_re_execution(
        client: dsec.DSecClient) -> None:
    trajectory = new_id("deleted")
    sb = await client.create(trajectory=trajectory, checkpoint="every_step", ttl_s=300)
    try:
        await sb.run(APPEND)
        await sb.run(APPEND)
        cps = await checkpoints(client, trajectory)
        await client.delete_snapshot(cps[1])
        with pytest.raises(dsec.CheckpointNotFound) as caught:
            await client.fork_trajectory(trajectory, at_step=2)
        assert caught.value.status == 404
        with pytest.raises(dsec.CheckpointNotFound):
            await client.replay(trajectory, upto=2)
        (one,) = await client.fork_trajectory(trajectory, at_step=1)  # still there
        try:
            assert await files(one) == ("step\n", (await files(sb))[1].splitlines()[0] + "\n")
        finally:
            await one.stop()
        # The next step of the parent takes a new checkpoint (its previous one is gone).
        await sb.run(APPEND)
        assert (await checkpoints(client, trajectory))[-1] not in (None, cps[1])
    finally:
        await sb.stop()
    with pytest.raises(dsec.CheckpointNotFound):
        await client.fork_trajectory(trajectory, at_step=9)


async def test_a_trajectory_without_checkpoints_cannot_be_forked(client: dsec.DSecClient) -> None:
    trajectory = new_id("plain")
    sb = await client.create(trajectory=trajectory, ttl_s=120)
    try:
        await sb.run(APPEND)
        with pytest.raises(dsec.CheckpointNotFound):
            await client.fork_trajectory(trajectory, at_step=1)
        replay = await client.replay(trajectory)  # as before: every step re-executed
        assert replay.restored_step is None and [s.step for s in replay.steps] == [1]
        await replay.sandbox.stop()
    finally:
        await sb.stop()
    with pytest.raises(dsec.InvalidRequest):
        await client.create(checkpoint="every_step")  # checkpoints are a trajectory's


async def test_fn_sandboxes_checkpoint_their_tmpfs_trees(client: dsec.DSecClient) -> None:
    """An fn sandbox's checkpoints are its packed /tmp and /work: a fork at a step holds what
    that step wrote, and nothing a later step did."""
    trajectory = new_id("fn")
    sb = await client.create(substrate="fn", image="python-3.11", trajectory=trajectory,
                             checkpoint="every_step", ttl_s=300)
    try:
        await sb.run("echo one > /work/steps")
        await sb.run("echo two >> /work/steps")
        (child,) = await client.fork_trajectory(trajectory, at_step=1)
        try:
            assert (await child.read_file("/work/steps")).decode() == "one\n"
        finally:
            await child.stop()
        assert (await sb.read_file("/work/steps")).decode() == "one\ntwo\n"
    finally:
        await sb.stop()


async def test_hostile_a_writer_during_checkpoints(client: dsec.DSecClient) -> None:
    """A background process appends as fast as it can while steps are checkpointed: every
    checkpoint is a snapshot of its own, and a fork holds a consistent file between what
    the step saw and what the next step saw."""
    trajectory = new_id("writer")
    sb = await client.create(trajectory=trajectory, checkpoint="every_step", ttl_s=300)
    try:
        await sb.start("while :; do echo 0123456789 >> /work/busy; done")
        seen = []
        for _ in range(4):
            await asyncio.sleep(0.05)
            seen.append(len((await sb.read_file("/work/busy")).splitlines()))
        cps = await checkpoints(client, trajectory)
        assert all(cps) and len(set(cps[1:])) == 4, cps
        (fork,) = await client.fork_trajectory(trajectory, at_step=3)
        try:
            data = await fork.read_file("/work/busy")
            lines = data.splitlines()
            assert seen[1] <= len(lines) <= seen[2]
            assert set(lines) <= {b"0123456789"} | ({lines[-1]} if lines else set())
            assert await fork.processes() == [], "processes are not restored"
        finally:
            await fork.stop()
    finally:
        await sb.stop()


async def test_hostile_forks_into_another_trajectory_or_project_are_not_found(
        client: dsec.DSecClient, srv: Server) -> None:
    mine, theirs = unique("cp-mine"), unique("cp-theirs")
    for name in (mine, theirs):
        await client.projects().create(name, sandboxes=6, cpu=6, memory_mb=4096)
    async with key_client(srv, (await client.projects().create_key(mine, "a")).key) as me, \
            key_client(srv, (await client.projects().create_key(theirs, "b")).key) as them:
        victim_id = new_id("victim")
        victim = await them.create(trajectory=victim_id, checkpoint="every_step", ttl_s=120,
                                   memory_mb=256)
        own_id = new_id("own")
        own = await me.create(trajectory=own_id, checkpoint="every_step", ttl_s=120,
                              memory_mb=256)
        try:
            await victim.write_file("/work/secret", b"their reward model")
            (their_cp,) = [c for c in await checkpoints(them, victim_id)]
            assert their_cp is not None
            with pytest.raises(dsec.TrajectoryNotFound) as caught:
                await me.fork_trajectory(victim_id, at_step=1)
            assert caught.value.status == 404
            with pytest.raises(dsec.SnapshotNotFound):
                await me.create(snapshot=their_cp, memory_mb=256)
            # A step whose output claims to be their checkpoint is only data.
            result = await own.run(f"echo {their_cp}; echo {their_cp} > /work/cp")
            assert result.stdout.strip() == their_cp
            (fork,) = await me.fork_trajectory(own_id, at_step=1)
            try:
                assert await fork.exists("/work/secret") is False
                assert (await fork.read_file("/work/cp")).decode().strip() == their_cp
            finally:
                await fork.stop()
            with pytest.raises(dsec.CheckpointNotFound):  # a step it never logged
                await me.fork_trajectory(own_id, at_step=7)
        finally:
            await victim.stop()
            await own.stop()


async def test_deleting_a_trajectory_deletes_the_checkpoints_no_fork_links(
        client: dsec.DSecClient, srv: Server) -> None:
    trajectory = new_id("rm")
    sb = await client.create(trajectory=trajectory, checkpoint="every_step", ttl_s=300)
    await sb.run(APPEND)
    await sb.run(APPEND)
    own = set(await checkpoints(client, trajectory))
    done = dsec_cli(srv, "trajectory", "fork", trajectory, "--at-step", "1", "-n", "1")
    fork_id, fork_sandbox = done.stdout.split()
    fork = await client.get(fork_sandbox)
    assert fork.info.trajectory == fork_id
    await fork.run("echo fork >> /work/log")
    linked = set((await checkpoints(client, fork_id))[:1])  # step 1's, the parent's snapshot
    assert linked <= own

    dsec_cli(srv, "trajectory", "rm", trajectory)
    with pytest.raises(dsec.TrajectoryNotFound):
        await client.trajectory(trajectory)
    assert (await client.get(sb.id)).info.state == "stopped"
    left = {s.id for s in await client.snapshots()}
    assert own & left == linked, "the fork's linked checkpoint is kept, the others deleted"
    (again,) = await client.fork_trajectory(fork_id, at_step=1)  # still restorable
    assert (await again.read_file("/work/log")) == b"step\n"
    await client.delete_trajectory(fork_id)
    assert linked <= {s.id for s in await client.snapshots()}, "the fork's fork links it"
    assert again.trajectory is not None
    await client.delete_trajectory(again.trajectory)  # and stops its sandbox
    assert (await client.get(again.id)).info.state == "stopped"
    assert {s.id for s in await client.snapshots()}.isdisjoint(own)
    assert not any((srv.volume / "snapshots" / snapshot).exists() for snapshot in own)


async def test_a_fork_that_cannot_be_made_whole_leaves_nothing(client: dsec.DSecClient,
                                                                srv: Server) -> None:
    name = unique("cp-quota")
    await client.projects().create(name, sandboxes=3, cpu=8, memory_mb=4096)
    async with key_client(srv, (await client.projects().create_key(name, "a")).key) as me:
        trajectory = f"test/{'x' * 230}-{secrets.token_hex(3)}"  # no room for a fork's suffix
        sb = await me.create(trajectory=trajectory, checkpoint="every_step", memory_mb=256,
                             ttl_s=120)
        try:
            await sb.run(APPEND)
            with pytest.raises(dsec.InvalidRequest):
                await me.fork_trajectory(trajectory, at_step=1)
            trajectory = new_id("quota")
            sb2 = await me.create(trajectory=trajectory, checkpoint="every_step", memory_mb=256,
                                  ttl_s=120)
            await sb2.run(APPEND)
            before = {t.id for t in await me.trajectories()}
            with pytest.raises(dsec.QuotaExceeded):  # 2 running + 4 > 3: one fork fits, not four
                await me.fork_trajectory(trajectory, at_step=1, n=4)
            assert {t.id for t in await me.trajectories()} == before
            assert sorted(i.id for i in await me.list()) == sorted([sb.id, sb2.id])
            (one,) = await me.fork_trajectory(trajectory, at_step=1)  # the quota is back
            await one.stop()
            await sb2.stop()
        finally:
            await sb.stop()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A sandbox disk as the container substrate makes one: ext4 in a sparse file,
    loop-mounted nosuid,nodev (relatime, the kernel's default). Its inode tables are zeroed
    by mkfs, not by the kernel's lazy init after the mount, whose writes would land in the
    middle of the test (on a sandbox's disk they only cost an extra snapshot or two)."""
    image, mount = tmp_path / "disk.img", tmp_path / "disk"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run([*MKFS, "-E", "nodiscard,lazy_itable_init=0", str(image)], check=True)
    mount.mkdir()
    loop_mount(image, mount)
    try:
        yield mount
    finally:
        unmount_image(mount, image)


def test_the_write_count_sees_every_change_and_no_read(disk: Path) -> None:
    """The soundness of "unchanged count => unchanged disk" on the real kernel: each kind of
    change raises the synced count; reading does not (after the one atime update relatime
    makes after a change); the count read while frozen, then after the thaw, is kept only
    when the thaw wrote exactly its superblock."""
    fd = os.open(disk, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (disk / "f").write_bytes(b"x" * 10000)
        (disk / "d").mkdir()

        def mmap_write() -> None:
            with open(disk / "f", "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
                m[0:1] = b"y"  # no msync: only syncfs writes it out

        changes = {
            "write": lambda: (disk / "g").write_bytes(b"1"),
            "overwrite in place": lambda: (disk / "g").write_bytes(b"2"),
            "mmap": mmap_write,
            "chmod": lambda: os.chmod(disk / "f", 0o600),
            "rename": lambda: os.rename(disk / "g", disk / "d" / "g"),
            "truncate": lambda: os.truncate(disk / "f", 5000),
            "xattr": lambda: os.setxattr(disk / "f", "user.k", b"v"),
            "symlink": lambda: os.symlink("/etc/passwd", disk / "l"),
            "unlink": lambda: os.unlink(disk / "d" / "g"),
            "utime": lambda: os.utime(disk / "f", (1, 1)),
        }
        for name, change in changes.items():
            before = disk_writes.synced_count(fd)
            change()
            assert disk_writes.synced_count(fd) > before, f"{name} was not counted"
        (disk / "f").read_bytes()  # the atime update relatime makes after the changes
        os.listdir(disk / "d")
        settled = disk_writes.synced_count(fd)
        for _ in range(3):
            (disk / "f").read_bytes()
            os.listdir(disk / "d")
            os.stat(disk / "f")
        assert disk_writes.synced_count(fd) == settled, "reads were counted as writes"

        fcntl.ioctl(fd, FIFREEZE, 0)
        frozen = disk_writes.sectors_written(fd)
        fcntl.ioctl(fd, FITHAW, 0)
        assert disk_writes.count_after_thaw(fd, frozen) == disk_writes.synced_count(fd) > frozen
        fcntl.ioctl(fd, FIFREEZE, 0)
        frozen = disk_writes.sectors_written(fd)
        fcntl.ioctl(fd, FITHAW, 0)
        (disk / "h").write_bytes(b"written right after the thaw")
        disk_writes.sync(fd)
        assert disk_writes.count_after_thaw(fd, frozen) == frozen, \
            "a write after the thaw was taken for the thaw's own"
    finally:
        os.close(fd)
