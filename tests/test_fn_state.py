"""fn sandboxes' state on a real server: filesystem snapshots of a worker's tmpfs trees
(/tmp, /work), sandboxes created from them, fork and rollback, and their trust boundary
(another sandbox or project, a hostile tree, a tampered snapshot file)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

import dsec
from conftest import Server, make_server, own_server, stop_server
from test_fn import _edge_cgroups, _fn_pids
from test_projects import key_client, unique
from test_state import snapshot_dirs

IMAGE = "python-3.11"  # fn runs the image's own Python


srv, client = own_server("--capacity", "64", "--warm-pool", "0")


async def fn_sandbox(client: dsec.DSecClient, **options: object) -> dsec.AsyncSandbox:
    return await client.create(substrate="fn", image=IMAGE, ttl_s=300, **options)  # type: ignore[arg-type]


TREE = ("mkdir -p /work/a/b && echo prompt > /work/a/b/f && ln /work/a/b/f /work/hard && "
        "ln -s /etc/hostname /work/link && mkfifo /work/fifo && echo scratch > /tmp/t && "
        "chmod 751 /work/a && truncate -s 1G /work/sparse")
CHECK = ("cat /work/a/b/f /tmp/t; readlink /work/link; test -p /work/fifo && echo fifo; "
         "stat -c '%h %a' /work/hard /work/a; stat -c %s /work/sparse")
SEEN = "prompt\nscratch\n/etc/hostname\nfifo\n2 644\n3 751\n1073741824\n"


async def test_fn_snapshot_fork_and_rollback(client: dsec.DSecClient, srv: Server) -> None:
    parent = await fn_sandbox(client)
    try:
        assert (await parent.run(TREE)).exit_code == 0
        background = await parent.start("sleep 1000")
        snap = await parent.snapshot()
        assert snap.size_bytes < 1 << 20  # the sparse GiB costs nothing
        assert (await parent.run("echo after > /work/after")).exit_code == 0
        child = await client.create(snapshot=snap.id, ttl_s=60)  # the tree as it was then
        assert (await child.run(CHECK)).stdout.split("\n") == SEEN.split("\n")
        assert (await child.run("test -e /work/after || echo absent")).stdout == "absent\n"
        await child.stop()
        await client.delete_snapshot(snap.id)
        children = await parent.fork(3)
        kids = [k for k in children if isinstance(k, dsec.AsyncSandbox)]
        assert len(kids) == 3, children
        for i, kid in enumerate(kids):
            assert (await kid.run(CHECK + "; cat /work/after")).stdout == SEEN + "after\n"
            await kid.write_file("/work/mine", str(i).encode())
        for i, kid in enumerate(kids):  # each its own copy
            assert await kid.read_file("/work/mine") == str(i).encode()
            await kid.stop()
        assert (await parent.run("test -e /work/mine || echo parent-untouched")).stdout == \
            "parent-untouched\n"
        # rollback: same id, the files of the snapshot, processes fresh
        snap = await parent.snapshot()
        await parent.run("rm -rf /work/a /tmp/t && echo junk > /work/junk")
        info = await parent.rollback(snap)
        assert info.id == parent.id and info.state == "running"
        assert (await parent.run(CHECK)).stdout == SEEN
        assert (await parent.run("cat /work/after; test -e /work/junk || echo no-junk")).stdout \
            == "after\nno-junk\n"
        assert not any(p.running and p.id == background.id for p in await parent.processes())
        await client.delete_snapshot(snap.id)
    finally:
        await parent.stop()
    assert snapshot_dirs(srv) == set()


async def test_a_paused_fn_sandbox_snapshots_and_its_child_starts(client: dsec.DSecClient) -> None:
    sb = await fn_sandbox(client)
    try:
        await sb.write_file("/work/x", b"1")
        await sb.pause()
        snap = await sb.snapshot()  # resumed to be snapshotted, like a container
        child = await client.create(snapshot=snap.id, ttl_s=60)
        try:
            assert await child.read_file("/work/x") == b"1"
            assert (await client.get(child.id)).info.substrate == "fn"
        finally:
            await child.stop()
        await client.delete_snapshot(snap.id)
    finally:
        await sb.stop()


async def test_a_hostile_tree_packs_within_bound_and_time(client: dsec.DSecClient,
                                                          srv: Server) -> None:
    """Tmpfs filled to the last byte, a 1 TB sparse file, a hard-link bomb, a chain deeper
    than PATH_MAX, links to host paths, a fifo no reader will ever open: the snapshot
    finishes in time, costs at most what the tmpfs holds, never follows a link on the host,
    and its child has the same tree."""
    canary = srv.state_dir / "canary"
    canary.write_bytes(b"host file")
    sb = await fn_sandbox(client)
    try:
        script = (
            "cd /work && truncate -s 1T sparse && mkfifo fifo && "
            f"ln -s {canary} host-link && ln -s / root-link && "
            "dd if=/dev/urandom of=big bs=1M count=40 2>/dev/null && "
            "for i in $(seq 300); do ln big l$i; done && "
            "mkdir -p d && cd d && for i in $(seq 1200); do mkdir d && cd d; done && "
            "dd if=/dev/urandom of=/tmp/fill bs=1M 2>/dev/null; echo done")
        assert (await sb.run(script, timeout_s=300)).stdout.endswith("done\n")
        started = time.monotonic()
        snap = await sb.snapshot()
        assert time.monotonic() - started < 60
        assert 40 << 20 < snap.size_bytes < (40 << 20) + (300 << 20)  # big once, tmp's fill
    finally:
        await sb.stop()
    assert canary.read_bytes() == b"host file"
    child = await client.create(snapshot=snap.id, ttl_s=120)
    try:
        seen = await child.run("cd /work && stat -c %s sparse && stat -c %h big && readlink "
                               "host-link && find d | wc -l && test -p fifo && echo fifo",
                               timeout_s=120)
        assert seen.stdout == f"{1 << 40}\n301\n{canary}\n1201\nfifo\n"
        # the link is the sandbox's own: it does not reach the host file
        assert (await child.run("cat /work/host-link")).exit_code != 0
    finally:
        await child.stop()
    assert canary.read_bytes() == b"host file"
    await client.delete_snapshot(snap.id)
    assert snapshot_dirs(srv) == set()


async def test_another_fn_sandbox_or_project_cannot_reach_a_snapshot(client: dsec.DSecClient,
                                                                     srv: Server) -> None:
    theirs = unique("theirs")
    await client.projects().create(theirs, sandboxes=4, cpu=4, memory_mb=4096, snapshot_bytes=8 << 30)
    mine = unique("mine")
    await client.projects().create(mine, sandboxes=4, cpu=4, memory_mb=4096, snapshot_bytes=8 << 30)
    async with key_client(srv, (await client.projects().create_key(theirs, "a")).key) as them, \
            key_client(srv, (await client.projects().create_key(mine, "b")).key) as me:
        victim = await them.create(substrate="fn", image=IMAGE, ttl_s=120)
        try:
            await victim.write_file("/work/secret", b"their-reward-model-7f3a")
            snap = await victim.snapshot()
        finally:
            await victim.stop()
        with pytest.raises(dsec.SnapshotNotFound):
            await me.create(snapshot=snap.id)
        spy = await me.create(substrate="fn", image=IMAGE, ttl_s=120)
        try:  # the snapshot's file is on the host: nothing of it is in a worker's view
            found = await spy.run("grep -rl their-reward-model-7f3a / --exclude-dir=proc "
                                  "--exclude-dir=sys 2>/dev/null; echo end", timeout_s=120)
            assert found.stdout == "end\n"
            with pytest.raises(dsec.SnapshotNotFound):
                await spy.rollback(snap.id)
        finally:
            await spy.stop()
        await them.delete_snapshot(snap.id)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
async def test_a_tampered_snapshot_file_starts_nothing(client: dsec.DSecClient, srv: Server,
                                                       damage: str) -> None:
    sb = await fn_sandbox(client)
    try:
        await sb.run("mkdir -p /work/d && for i in $(seq 50); do echo $i > /work/d/$i; done")
        snap = await sb.snapshot()
    finally:
        await sb.stop()
    path = srv.volume / "snapshots" / snap.id / "disk.img"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncate"
                     else data[:40] + bytes([data[40] ^ 0xFF]) + data[41:])
    before = {s.id for s in await client.list()}
    with pytest.raises(dsec.SandboxError, match="restore"):
        await client.create(snapshot=snap.id, ttl_s=60)
    assert {s.id for s in await client.list()} == before
    await client.delete_snapshot(snap.id)


async def test_fn_rollback_survives_concurrent_calls(client: dsec.DSecClient) -> None:
    """Calls racing a rollback answer or fail typed; the sandbox answers after."""
    sb = await fn_sandbox(client)
    try:
        await sb.write_file("/work/v", b"1")
        snap = await sb.snapshot()
        await sb.write_file("/work/v", b"2")
        racing = [asyncio.ensure_future(sb.run("cat /work/v")) for _ in range(5)]
        await sb.rollback(snap)
        for call in racing:
            try:
                await call
            except dsec.SandboxError:
                pass
        assert await sb.read_file("/work/v") == b"1"
        await client.delete_snapshot(snap.id)
    finally:
        await sb.stop()


async def test_a_paused_fn_sandbox_ends_with_a_crashed_server(images) -> None:  # type: ignore[no-untyped-def]
    """fn sandboxes end with their server: a frozen worker (which a SIGKILL alone does not
    end on cgroup v1) is thawed and killed by the next server's sweep, and recorded died."""
    srv = make_server().start()
    try:
        async with srv.client() as client:
            edge = (await client.health())["edges"][0]["id"]
            sb = await fn_sandbox(client)
            await sb.start("sleep 1000")
            await sb.pause()
        srv.kill(signal.SIGKILL)
        srv.start()
        async with srv.client() as client:
            again = await client.get(sb.id)
            assert again.info.state == "died"
            with pytest.raises(dsec.SandboxDied):
                await again.run("true")
        deadline = time.monotonic() + 30
        while _fn_pids(edge, template_only=False) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        srv.kill(signal.SIGTERM)
        assert not _fn_pids(edge) and not _edge_cgroups(edge)
    finally:
        stop_server(srv)
