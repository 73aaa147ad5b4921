"""Hostile sandbox state: what a sandbox shapes on its own disk, or does around a snapshot,
a fork, a rollback or a pause, must neither reach the host or another sandbox nor cost the
trainer its rollout without a typed error. Each test is an agent trying to cheat or to hurt
its neighbours through the state operations, on a real server (containers under crun)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest

import dsec
from conftest import Server, make_server, own_server, stop_server
from dsec.edge.shared_snapshots import SharedSnapshots
from dsec.images.store import ImageStore
from dsec.substrates.host.cgroups import freezer_file
from test_hostile import assert_no_trace
from test_projects import key_client, unique
from test_recovery import first_edge_id
from test_state import snapshot_dirs, snapshot_loops

srv, client = own_server("--capacity", "64", "--warm-pool", "0")


async def _stop(*boxes: dsec.AsyncSandbox) -> None:
    for sb in boxes:
        try:
            await sb.stop()
        except dsec.DSecError:  # stopped already, or died on purpose
            pass


async def test_a_rollback_to_a_snapshot_with_no_inode_left_is_a_typed_error(
        client: dsec.DSecClient, srv: Server) -> None:
    """The agent uses up every inode of its disk before the trainer's checkpoint: a create
    from that snapshot is a typed ``SandboxError`` (tests/test_state.py), and so must a
    rollback to it be: never an untyped ``internal`` error. The sandbox is then ended as
    died, and nothing of it is left."""
    sb = await client.create(ttl_s=300, disk_mb=64)
    try:
        filled = await sb.run("mkdir /work/many && cd /work/many && seq 40000 | xargs touch",
                              timeout_s=300)
        assert "No space left" in filled.stderr
        snap = await sb.snapshot()
        await sb.run("rm -rf /work/many")
        with pytest.raises(dsec.SandboxError, match="full"):
            await sb.rollback(snap)
        with pytest.raises(dsec.SandboxDied, match="rollback"):
            await sb.run("true")
        await client.delete_snapshot(snap.id)
    finally:
        await _stop(sb)
    await assert_no_trace(srv, sb.id)
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


RUN_JUNK = 30000  # files the agent leaves in dsec's run dir before its snapshot


async def _fill_run_dir(sb: dsec.AsyncSandbox) -> None:
    """dsec's run dir (/.dsec/run, on the sandbox's own disk and in its snapshots) made a
    tree the host would have to walk to clear: many files, a deep chain, odd names, and a
    session state the trainer's next session must not pick up in a child."""
    made = await sb.run(
        f"cd /.dsec/run && mkdir -p junk && cd junk && seq {RUN_JUNK} | xargs touch && "
        "mkdir -p chain && cd chain && i=0; while [ $i -lt 300 ]; do mkdir d && cd d; "
        "i=$((i+1)); done; cd /.dsec/run && touch \"$(printf 'a\\nb')\" && "
        "mkfifo fifo && echo 'export LEAKED=parent' > session-s.sh", timeout_s=300)
    assert made.exit_code == 0, made.stderr


async def _assert_fresh_run_dir(sb: dsec.AsyncSandbox) -> None:
    """The parent's agent state is gone from where dsec reads it (sessions start fresh), and
    what the parent made is the sandbox's own to remove: on its disk, never walked by the
    host (it is all still there), and removable from inside."""
    seen = await sb.run("ls -A /.dsec/run; echo ---; test -e /.dsec/run/session-s.sh || "
                        "echo no-session", session="s")
    assert seen.stdout.split("---\n")[1] == "no-session\n", seen.stdout
    assert (await sb.run("echo ${LEAKED:-unset}", session="s")).stdout == "unset\n"
    kept = await sb.run("find /.dsec/run -mindepth 1 ! -name agent.sock | wc -l", timeout_s=120)
    assert int(kept.stdout) > RUN_JUNK, "the host walked (and removed) the sandbox's tree"
    removed = await sb.run("cd /.dsec/run && rm -rf -- $(ls -A | grep -v '^agent.sock$') && "
                           "ls -A", timeout_s=120)
    assert removed.stdout == "agent.sock\n", removed.stdout
    assert (await sb.run("echo alive")).stdout == "alive\n"


async def test_a_child_and_a_rollback_never_walk_the_run_dir_the_sandbox_filled(
        client: dsec.DSecClient, srv: Server) -> None:
    """Clearing what a snapshot's agent left in /.dsec/run used to walk the whole run dir on
    the host, in the edge's shared thread pool, for every child and every rollback: a tree
    the sandbox shaped (as many files as its disk has inodes: millions for a large
    ``disk_mb``), so a fork cost the host minutes of unlinks. Now the host looks at a few
    entries at most; a run dir holding more is moved, whole, into the fresh one."""
    sb = await client.create(ttl_s=600)
    kid = None
    try:
        await _fill_run_dir(sb)
        snap = await sb.snapshot()
        kid = await client.create(snapshot=snap.id, ttl_s=300)
        await _assert_fresh_run_dir(kid)
        await sb.rollback(snap)
        await _assert_fresh_run_dir(sb)
        await client.delete_snapshot(snap.id)
    finally:
        await _stop(sb, *([kid] if kid else []))
    for box in (sb, *([kid] if kid else [])):
        await assert_no_trace(srv, box.id)
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


async def test_a_child_of_a_tidy_run_dir_starts_with_only_its_agent_socket(
        client: dsec.DSecClient, srv: Server) -> None:
    """The usual case: the parent's run dir holds its agent's socket and a few sessions'
    state. The child's holds its own socket alone, and no session state of its parent."""
    sb = await client.create(ttl_s=300)
    try:
        for name in ("a", "b", "c"):
            await sb.run(f"export FROM_{name}=parent", session=name)
        snap = await sb.snapshot()
        kid = await client.create(snapshot=snap.id, ttl_s=120)
        try:
            assert (await kid.run("ls -A /.dsec/run")).stdout == "agent.sock\n"
            assert (await kid.run("echo ${FROM_a:-unset}", session="a")).stdout == "unset\n"
        finally:
            await _stop(kid)
        await sb.rollback(snap)
        assert (await sb.run("ls -A /.dsec/run")).stdout == "agent.sock\n"
        await client.delete_snapshot(snap.id)
    finally:
        await _stop(sb)


async def test_a_run_dir_filled_to_the_last_inode_makes_its_children_a_typed_error(
        client: dsec.DSecClient, srv: Server) -> None:
    """The agent spends its disk's last inode in /.dsec/run before the checkpoint. Its tree
    is not walked to win the inodes back (above), so a child or a rollback has no inode for
    a fresh run dir: a typed ``SandboxError`` "full", as for a disk filled through /work,
    and nothing left."""
    sb = await client.create(ttl_s=300, disk_mb=64)
    try:
        filled = await sb.run("mkdir /.dsec/run/many && cd /.dsec/run/many && "
                              "seq 40000 | xargs touch", timeout_s=300)
        assert "No space left" in filled.stderr
        snap = await sb.snapshot()
        with pytest.raises(dsec.SandboxError, match="full"):
            await client.create(snapshot=snap.id, ttl_s=60)
        with pytest.raises(dsec.SandboxError, match="full"):
            await sb.rollback(snap)
        await client.delete_snapshot(snap.id)
    finally:
        await _stop(sb)
    await assert_no_trace(srv, sb.id)
    assert not list((srv.volume / "sandboxes").iterdir())  # nor the child that failed
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


ODD_IDS = ["..", ".", "../../etc/passwd", "sn-x/../../sandboxes", "/", "sn-*", "sn-?",
           "sn-a\nb", "sn-\x00", "%2e%2e%2f", "a" * 5000, "sn-e000000-000000000000",
           "sn-ë", "~root", "sn-" + "/" * 200]


async def test_snapshot_ids_shaped_like_paths_are_typed_and_reach_nothing(
        client: dsec.DSecClient, srv: Server) -> None:
    """An agent (or a trainer passing on what an agent printed) names snapshots by paths,
    globs, NULs and huge strings, in every place a snapshot id goes: each answer is a typed
    4xx, no sandbox or snapshot is made, the sandbox still runs as it was and the snapshot
    directory holds what it held."""
    sb = await client.create(ttl_s=300)
    try:
        await sb.write_file("/work/state", b"kept")
        mine = await sb.snapshot()
        before = snapshot_dirs(srv)
        with srv.http(authenticated=True) as http:
            for odd in ODD_IDS:
                answers = [
                    http.post("/v1/sandboxes", json={"snapshot": odd, "ttl_s": 30}),
                    http.post(f"/v1/sandboxes/{sb.id}/rollback", json={"snapshot": odd}),
                    http.post(f"/v1/sandboxes/{sb.id}/snapshots", json={"previous": odd}),
                    http.delete("/v1/snapshots/" + quote(odd, safe="")),
                ]
                for answer in answers:
                    if 300 <= answer.status_code < 400:  # a trailing "/": Starlette's redirect
                        continue
                    assert 400 <= answer.status_code < 500, (odd, answer.text)
                    assert answer.json()["error"]["code"] in (
                        "snapshot_not_found", "invalid_request", "route_not_found",
                        "method_not_allowed"), (odd, answer.text)
        assert [s.id for s in await client.snapshots()] == [mine.id]
        assert snapshot_dirs(srv) == before
        assert [s.id for s in await client.list()] == [sb.id]
        assert await sb.read_file("/work/state") == b"kept"
        await client.delete_snapshot(mine.id)
    finally:
        await _stop(sb)
    assert snapshot_dirs(srv) == set()


async def test_a_child_asking_for_a_bigger_disk_gets_its_snapshots(
        client: dsec.DSecClient) -> None:
    """An agent's parent has a small disk; a create from its snapshot that asks for a big
    one (to get room it was not given) gets the snapshot's size: the disk is its copy."""
    sb = await client.create(ttl_s=120, disk_mb=64)
    try:
        snap = await sb.snapshot()
        kid = await client.create(snapshot=snap.id, disk_mb=8192, ttl_s=60)
        try:
            size = int((await kid.run("df -m --output=size /work | tail -1")).stdout)
            assert 32 < size <= 64
            filled = await kid.run("dd if=/dev/zero of=/work/f bs=1M count=200", timeout_s=60)
            assert "No space left" in filled.stderr
        finally:
            await _stop(kid)
        await client.delete_snapshot(snap.id)
    finally:
        await _stop(sb)


def _sandbox_loops(srv: Server, sandbox_id: str) -> list[str]:
    """Loop devices backed by a file of the sandbox's bundle dir."""
    root = str(srv.volume / "sandboxes" / sandbox_id) + "/"
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().startswith(root):
                found.append(backing.parent.parent.name)
        except OSError:  # detached meanwhile
            pass
    return found


BUSY = [
    # a writer appending flat out through a descriptor it keeps open
    "exec 3>>/work/log; while :; do echo after-snapshot >&3; done",
    # a process whose cwd is deep in a tree and that holds a file mapped
    "mkdir -p /work/a/b/c && cd /work/a/b/c && exec sleep 1000",
    # a FIFO with a blocked reader, and a reader of a socket it listens on
    "mkfifo /work/fifo; exec cat /work/fifo",
    "exec /.dsec/bin/busybox nc -l -p 7000",
    # a disk filler that retries after ENOSPC
    "while :; do cat /dev/zero > /work/fill; rm -f /work/fill; done",
]


@pytest.mark.parametrize("runtime", ["crun", "runc", "runsc"])
async def test_a_rollback_under_busy_open_files_leaves_the_snapshot_and_no_process(
        client: dsec.DSecClient, srv: Server, runtime: str) -> None:
    """The agent keeps files open, writes and fills its disk flat out, blocks on a FIFO and
    a socket, and has a call in flight when the trainer rolls it back: the call is a typed
    ``SandboxError`` (never a result), the disk is exactly the snapshot's, no process of
    before is left, only the new disk's loop device is attached, and the sandbox snapshots
    and forks again."""
    sb = await client.create(ttl_s=300, disk_mb=128, runtime=runtime)
    try:
        await sb.write_file("/work/log", b"before\n")
        snap = await sb.snapshot()
        for command in BUSY:
            await sb.start(["/.dsec/bin/sh", "-c", command])
        in_flight = asyncio.ensure_future(sb.run("sleep 60"))
        await asyncio.sleep(2)
        assert len(await sb.processes()) == len(BUSY)
        await sb.rollback(snap)
        with pytest.raises(dsec.SandboxError, match="rolled back"):
            await in_flight
        assert await sb.read_file("/work/log") == b"before\n"
        assert (await sb.run("echo /work/*")).stdout == "/work/log\n"  # no statx: runsc
        assert await sb.processes() == []
        procs = freezer_file(f"/dsec-{first_edge_id(srv)}", sb.id).parent / "cgroup.procs"
        if runtime != "runsc":  # gVisor's own processes share the cgroup
            assert len(procs.read_text().split()) == 1  # the new agent alone
        assert len(_sandbox_loops(srv, sb.id)) == 1
        again = await sb.snapshot()
        kid = await client.create(snapshot=again.id, ttl_s=60)
        assert await kid.read_file("/work/log") == b"before\n"
        await _stop(kid)
        for s in (snap, again):
            await client.delete_snapshot(s.id)
    finally:
        await _stop(sb)
    await assert_no_trace(srv, sb.id)
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


async def test_a_sandbox_cannot_make_files_the_host_could_not_remove_or_overlay_would_obey(
        client: dsec.DSecClient, srv: Server) -> None:
    """What would make a clean-up, a snapshot's child or a rollback fail on the host: the
    immutable and append-only flags (``chattr +i/+a``: no ``CAP_LINUX_IMMUTABLE``), and
    overlayfs's own ``trusted.overlay.*`` attributes in its layer (an opaque directory or a
    redirect it would follow in a child): all refused, in /work and in dsec's run dir. The
    sandbox then snapshots, forks, rolls back and stops as any other."""
    probe = r"""
import errno, fcntl, os, struct
SETFLAGS = 0x40086602
for path in ("/work/f", "/.dsec/run/f"):
    open(path, "w").close()
    fd = os.open(path, os.O_RDONLY)
    for flag, name in ((0x10, "immutable"), (0x20, "append")):
        try:
            fcntl.ioctl(fd, SETFLAGS, struct.pack("i", flag))
            print(path, name, "set")
        except OSError as exc:
            print(path, name, errno.errorcode[exc.errno])
    os.close(fd)
    for attr in ("trusted.overlay.opaque", "trusted.overlay.redirect"):
        try:
            os.setxattr(os.path.dirname(path), attr, b"y")
            print(path, attr, "set")
        except OSError as exc:
            print(path, attr, errno.errorcode[exc.errno])
"""
    sb = await client.create(image="python-3.11", ttl_s=300)
    kid = None
    try:
        seen = (await sb.run(["python3", "-c", probe])).stdout.splitlines()
        assert len(seen) == 8 and all(line.endswith(" EPERM") for line in seen), seen
        snap = await sb.snapshot()
        kid = await client.create(snapshot=snap.id, ttl_s=60)
        assert (await kid.run("rm /work/f && echo gone")).stdout == "gone\n"
        await sb.rollback(snap)
        assert (await sb.run("rm /work/f && echo gone")).stdout == "gone\n"
        await client.delete_snapshot(snap.id)
    finally:
        await _stop(sb, *([kid] if kid else []))
    for box in (sb, *([kid] if kid else [])):
        await assert_no_trace(srv, box.id)


async def test_a_paused_sandbox_writes_nothing_its_checkpoints_could_miss(
        client: dsec.DSecClient, srv: Server) -> None:
    """A paused agent with a writer flat out must make no progress at all, not even on its
    disk: a snapshot with ``previous`` taken later while it is still paused is the same
    snapshot (its disk's write count did not move), forks of it leave it paused, and a
    rollback runs it again from the snapshot, its writer gone."""
    sb = await client.create(ttl_s=300)
    try:
        await sb.start("i=0; while :; do i=$((i+1)); echo $i >> /work/n; done")
        await asyncio.sleep(0.5)
        await sb.pause()
        first = await sb.snapshot()
        await asyncio.sleep(1.0)
        second = await sb.snapshot(previous=first.id)
        assert second.id == first.id  # nothing written while paused
        kids = await sb.fork(2, ttl_s=60)
        assert (await client.get(sb.id)).info.state == "paused"
        counts = set()
        for kid in kids:
            assert isinstance(kid, dsec.AsyncSandbox), kid
            counts.add(len(await kid.read_file("/work/n")))
            assert await kid.processes() == []
            await kid.stop()
        assert len(counts) == 1 and counts.pop() > 0  # both are the paused instant
        await sb.rollback(first)
        assert (await client.get(sb.id)).info.state == "running"
        assert await sb.processes() == []
        await client.delete_snapshot(first.id)
    finally:
        await _stop(sb)
    await assert_no_trace(srv, sb.id)
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


async def test_a_server_killed_mid_rollback_leaves_a_whole_sandbox_or_a_typed_death(
        srv: Server) -> None:
    """SIGKILL of the server at several points of a rollback of a busy sandbox: after the
    restart the sandbox either runs, on a whole disk (the snapshot's, or the one it had),
    or is ``SandboxDied``; its snapshot still makes children; once stopped nothing of it
    is left, and no unrecorded snapshot file or loop device either."""
    for delay in (0.0, 0.03, 0.1, 0.3):
        async with srv.client() as c:
            sb = await c.create(ttl_s=300)
            await sb.write_file("/work/answer", b"v1")
            snap = await sb.snapshot()
            await sb.write_file("/work/answer", b"v2")
            await sb.start("while :; do date >> /work/log; done")
            rolling = asyncio.ensure_future(sb.rollback(snap))
            await asyncio.sleep(delay)
            srv.kill(signal.SIGKILL)
            await asyncio.gather(rolling, return_exceptions=True)
        srv.start()
        async with srv.client() as fresh:
            again = await fresh.get(sb.id)
            if again.info.state == "running":
                answer = await asyncio.wait_for(again.read_file("/work/answer"), 30)
                assert answer in (b"v1", b"v2"), (delay, answer)
                assert (await again.run("echo alive")).stdout == "alive\n"
            else:
                assert again.info.state == "died", (delay, again.info)
                with pytest.raises(dsec.SandboxDied):
                    await again.run("true")
            kid = await fresh.create(snapshot=snap.id, ttl_s=60)
            assert await kid.read_file("/work/answer") == b"v1"
            await _stop(kid, again)
            await fresh.delete_snapshot(snap.id)
        for box in (sb.id, kid.id):
            await assert_no_trace(srv, box)
        assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


async def test_a_server_killed_mid_fork_leaves_whole_children_or_none(srv: Server) -> None:
    """SIGKILL of the server while four children of a snapshot are being made: after the
    restart each child is running on the snapshot's disk or ended, the parent and the
    snapshot are untouched, and once everything is stopped nothing is left (no half-made
    child's disk copy, mount or loop device)."""
    for delay in (0.0, 0.05, 0.2):
        async with srv.client() as c:
            parent = await c.create(ttl_s=300)
            await parent.write_file("/work/answer", b"v1")
            snap = await parent.snapshot()
            making = [asyncio.ensure_future(c.create(snapshot=snap.id, ttl_s=60))
                      for _ in range(4)]
            await asyncio.sleep(delay)
            srv.kill(signal.SIGKILL)
            await asyncio.gather(*making, return_exceptions=True)
        srv.start()
        async with srv.client() as fresh:
            kids = [await fresh.get(sb.id) for sb in await fresh.list() if sb.id != parent.id]
            for kid in kids:
                assert await asyncio.wait_for(kid.read_file("/work/answer"), 30) == b"v1"
            assert (await (await fresh.get(parent.id)).read_file("/work/answer")) == b"v1"
            again = await fresh.create(snapshot=snap.id, ttl_s=60)
            assert await again.read_file("/work/answer") == b"v1"
            gone = [kid.id for kid in kids] + [again.id, parent.id]
            for box in (*kids, again, await fresh.get(parent.id)):
                await _stop(box)
            await fresh.delete_snapshot(snap.id)
        for box_id in gone:
            await assert_no_trace(srv, box_id)
        assert not list((srv.volume / "sandboxes").iterdir()), delay
        assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


FS_PROBE = r"""
import errno, fcntl, os, struct, sys
base = sys.argv[1]
os.mkdir(f"{base}/empty")
open(f"{base}/f", "w").close()
d = os.open(f"{base}/empty", os.O_RDONLY | os.O_DIRECTORY)
f = os.open(f"{base}/f", os.O_RDONLY)
root = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
verity = struct.pack("IIIIQIIQ", 1, 1, 4096, 0, 0, 0, 0, 0) + bytes(88)
calls = {
    "encrypt": (d, 0x800C6613, struct.pack("BBBB8s", 0, 1, 4, 0, b"dsectest")),
    "verity": (f, 0x40806685, verity),
    "casefold": (d, 0x40086602, struct.pack("i", 0x40000000)),
    "journal_data": (f, 0x40086602, struct.pack("i", 0x4000)),
    "resize": (root, 0x40086610, struct.pack("Q", 1 << 40)),
    "label": (root, 0x41009432, b"hostile".ljust(256, b"\0")),
    "fitrim": (root, 0xC0185879, struct.pack("QQQ", 0, 1 << 62, 0)),
    "shutdown": (root, 0x8004587D, struct.pack("I", 2)),
}
for name, (fd, request, arg) in calls.items():
    try:
        fcntl.ioctl(fd, request, arg)
        print(name, "ok")
    except OSError as exc:
        print(name, errno.errorcode[exc.errno])
"""


def _features(image: Path) -> str:
    header = subprocess.run(["dumpe2fs", "-h", str(image)], capture_output=True, text=True)
    return next(line for line in header.stdout.splitlines()
                if line.startswith("Filesystem features:"))


async def test_a_sandbox_cannot_turn_on_file_system_features_its_snapshots_carry(
        client: dsec.DSecClient, srv: Server) -> None:
    """Its own disk is an ext4 file system the host mounts again for every child and
    rollback: the sandbox, root inside, tries to change what that file system is: turn on
    encryption, verity or casefolding by using them, journal data, resize it, relabel it,
    trim it, shut it down. All refused; its snapshot has exactly the features of a fresh
    sandbox's, and a child of it starts and writes."""
    clean = await client.create(ttl_s=120)
    sb = await client.create(image="python-3.11", ttl_s=300)
    snaps = []
    try:
        # /work is the overlay; /.dsec/run is the ext4 disk itself, its ioctls unfiltered
        for base in ("/work", "/.dsec/run"):
            probed = await sb.run(["python3", "-c", FS_PROBE, base])
            seen = dict(line.split() for line in probed.stdout.splitlines())
            assert len(seen) == 8 and "ok" not in seen.values(), (base, seen, probed.stderr)
        assert (await sb.run("echo still writable > /work/g && cat /work/g")).stdout == \
            "still writable\n"
        snaps = [await clean.snapshot(), await sb.snapshot()]
        expected, got = (_features(srv.volume / "snapshots" / s.id / "disk.img") for s in snaps)
        assert got == expected
        kid = await client.create(snapshot=snaps[1].id, ttl_s=60)
        assert (await kid.run("echo x > /work/h && cat /work/g")).stdout == "still writable\n"
        await _stop(kid)
    finally:
        await _stop(sb, clean)
        for s in snaps:
            await client.delete_snapshot(s.id)
    await assert_no_trace(srv, sb.id)


async def test_another_projects_snapshot_as_previous_is_not_found_and_costs_nothing(
        client: dsec.DSecClient, srv: Server) -> None:
    """An agent learns another project's snapshot id (a shared log, a printed checkpoint)
    and names it as the ``previous`` of its own snapshot, hoping to be answered with it:
    ``snapshot_not_found``, nothing is made, and its project's snapshot room is untouched;
    the victim's snapshot is still whole for its own project."""
    mine, theirs = unique("prev-mine"), unique("prev-theirs")
    for name in (mine, theirs):
        await client.projects().create(name, sandboxes=2, cpu=2, memory_mb=1024,
                                       snapshot_bytes=2 << 30)
    async with key_client(srv, (await client.projects().create_key(mine, "a")).key) as me, \
            key_client(srv, (await client.projects().create_key(theirs, "b")).key) as them:
        victim = await them.create(memory_mb=256, ttl_s=120)
        agent = await me.create(memory_mb=256, ttl_s=120)
        try:
            await victim.write_file("/work/secret", b"their reward model")
            snap = await victim.snapshot()
            with pytest.raises(dsec.SnapshotNotFound):
                await agent.snapshot(previous=snap.id)
            assert await me.snapshots() == []
            assert (await client.projects().get(mine)).used.snapshot_bytes == 0
            with pytest.raises(dsec.FileNotFound):
                await agent.read_file("/work/secret")
            kid = await them.create(snapshot=snap.id, memory_mb=256, ttl_s=60)
            assert await kid.read_file("/work/secret") == b"their reward model"
            await _stop(kid)
            await them.delete_snapshot(snap.id)
        finally:
            await _stop(victim, agent)


async def test_a_snapshot_deleted_under_a_rollback_leaves_the_sandbox_running(
        client: dsec.DSecClient, srv: Server) -> None:
    """A rollback to a snapshot that a delete (or its TTL) removes meanwhile: the copy of the
    snapshot's disk is made before anything of the sandbox is touched, so a rollback that
    finds it gone is ``snapshot_not_found`` and the sandbox runs on as it was (its rollout
    is not lost); one that got its copy first completes. (On the old code the sandbox was
    stopped as died, and the answer an untyped 500 naming the snapshot's host path.)"""
    outcomes = set()
    for _ in range(6):
        sb = await client.create(ttl_s=120)
        try:
            await sb.write_file("/work/answer", b"v1")
            snap = await sb.snapshot()
            await sb.write_file("/work/answer", b"v2")
            rolled, _ = await asyncio.gather(sb.rollback(snap), client.delete_snapshot(snap.id),
                                             return_exceptions=True)
            if isinstance(rolled, BaseException):
                assert isinstance(rolled, dsec.SnapshotNotFound), repr(rolled)
                assert await sb.read_file("/work/answer") == b"v2"
                outcomes.add("not found")
            else:
                assert await sb.read_file("/work/answer") == b"v1"
                outcomes.add("rolled back")
        finally:
            await _stop(sb)
        await assert_no_trace(srv, sb.id)
    assert snapshot_dirs(srv) == set() and snapshot_loops(srv) == []


def _bundle_fd(server: Server, bundle: Path) -> Path:
    """The server's fd on a sandbox's bundle dir, opened in the sandbox's mount namespace:
    its disk seen from the host (``support.disks.bundle_with_mounts``, for any root)."""
    assert server.proc is not None
    for fd in Path(f"/proc/{server.proc.pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd) == str(bundle):
                return fd
    raise AssertionError(f"the server holds no fd on {bundle}")


async def test_with_the_volume_off_a_paused_sandbox_makes_no_progress_through_a_snapshot(
        images: ImageStore) -> None:
    """``--disk-volume off`` (no reflinks): a snapshot freezes the file system (FIFREEZE)
    for a copy, and FIFREEZE cannot wait on writers the cgroup freezer holds, so the old
    code thawed a paused sandbox for the copy: a paused agent writing flat out made
    progress while its trainer held it paused (about 600 appends across one snapshot
    here). Now its processes stay frozen for the copy; the snapshot is whole and the
    sandbox resumes where it was paused."""
    server = make_server("--warm-pool", "0", "--disk-volume", "off").start()
    try:
        async with server.client() as c:
            sb = await c.create(ttl_s=120)
            await sb.run("head -c 64M /dev/urandom > /work/ballast", timeout_s=60)
            await sb.start("while :; do echo tick >> /work/ticks; done")
            await asyncio.sleep(0.5)
            await sb.pause()
            ticks = _bundle_fd(server, server.state_dir / "sandboxes" / sb.id) / \
                "disk" / "upper" / "work" / "ticks"
            frozen_at = ticks.stat().st_size
            snap = await sb.snapshot()
            assert (await c.get(sb.id)).info.state == "paused"
            assert ticks.stat().st_size == frozen_at, "the paused sandbox wrote meanwhile"
            kid = await c.create(snapshot=snap.id, ttl_s=60)
            assert len(await kid.read_file("/work/ticks")) == frozen_at
            await kid.stop()
            assert (await sb.run("echo resumed")).stdout == "resumed\n"
            await c.delete_snapshot(snap.id)
            await sb.stop()
    finally:
        stop_server(server)


async def test_a_shared_snapshot_directory_holding_odd_entries_never_stops_a_start(
        images: ImageStore, tmp_path: Path) -> None:
    """The shared snapshot directory is a mount every node reaches (NFS, 3FS), only as
    trusted as the mount: whoever else writes there can leave a directory where an export
    goes (``sn-<id>.img``), directories and links in its ``tmp/``, all older than the
    sweep's cut-off. A start's sweep of that directory must skip what it cannot remove (and
    say so), never fail the edge's start; the server then serves snapshots as before."""
    shared = tmp_path / "shared"
    (shared / "tmp" / "a-dir" / "deep").mkdir(parents=True)
    (shared / "sn-e000000-000000000000.img" / "x").mkdir(parents=True)
    (shared / "tmp" / "a-link").symlink_to("/etc/passwd")
    old = time.time() - 7 * 86400
    for path in (shared / "tmp" / "a-dir", shared / "sn-e000000-000000000000.img"):
        os.utime(path, (old, old))
    os.utime(shared / "tmp" / "a-link", (old, old), follow_symlinks=False)
    server = make_server("--warm-pool", "0", "--shared-snapshots", str(shared)).start()
    try:
        async with server.client() as c:
            sb = await c.create(ttl_s=120)
            await sb.write_file("/work/f", b"kept")
            snap = await sb.snapshot()
            kid = await c.create(snapshot=snap.id, ttl_s=60)
            assert await kid.read_file("/work/f") == b"kept"
            for box in (kid, sb):
                await box.stop()
            await c.delete_snapshot(snap.id)
    finally:
        stop_server(server)
    assert Path("/etc/passwd").exists()  # a link is removed, never followed
    assert not (shared / "tmp" / "a-link").is_symlink()


@pytest.mark.parametrize("shape", ["fifo", "link", "directory"])
def test_an_export_replaced_in_the_shared_directory_is_refused_at_once(
        tmp_path: Path, shape: str) -> None:
    """Whoever else writes to the shared mount puts, in place of a snapshot's export, a FIFO
    (reading it would hold the fetch, and every create from that snapshot on the node,
    forever), a link to a host file (it would be read and copied onto the node), or a
    directory: the fetch is ``SnapshotCorrupt`` within a second, reads nothing through the
    link and leaves nothing on the node."""
    shared = SharedSnapshots(tmp_path / "shared")
    local = tmp_path / "disk.img"
    local.write_bytes(os.urandom(1 << 20))
    digest, size = shared.export("sn-a", local)
    exported = shared.path("sn-a")
    exported.unlink()
    if shape == "fifo":
        os.mkfifo(exported)
    elif shape == "link":
        exported.symlink_to(local)  # the very content: only the link is wrong
    else:
        exported.mkdir()
    node = tmp_path / "node-b"
    node.mkdir()
    started = time.monotonic()
    with pytest.raises(dsec.SnapshotCorrupt):
        shared.fetch("sn-a", digest, size, node / "disk.img")
    assert time.monotonic() - started < 1
    assert list(node.iterdir()) == []
    shared.remove("sn-a")  # a delete of the snapshot: never fails over what it finds there
    assert local.exists()


def test_an_export_never_writes_through_a_linked_tmp_dir(tmp_path: Path) -> None:
    """Whoever else writes to the shared mount makes its ``tmp/`` a link to a host
    directory: an export (the sandbox's bytes, written as root) would land there. It is
    refused, and nothing is written into that directory."""
    shared = SharedSnapshots(tmp_path / "shared")
    victim = tmp_path / "host-dir"
    victim.mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "tmp").symlink_to(victim)
    local = tmp_path / "disk.img"
    local.write_bytes(b"sandbox bytes" * 1000)
    with pytest.raises(OSError):
        shared.export("sn-a", local)
    assert list(victim.iterdir()) == []
    assert not shared.path("sn-a").exists()
