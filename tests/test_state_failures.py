"""Sandbox state when things go wrong: a fork of 8 that fails halfway, and a server killed
in the middle of a snapshot. Either a whole result or nothing: no half-made snapshot, no
sandbox left frozen, nothing of a failed child left on the host."""

from __future__ import annotations

import asyncio
import signal

import dsec
from conftest import Server, own_server
from test_hostile import assert_no_trace
from test_projects import key_client, unique
from test_state import snapshot_dirs, snapshot_loops

srv, client = own_server("--capacity", "64", "--warm-pool", "0")


async def test_a_fork_of_8_that_fails_halfway_leaves_nothing_of_its_failures(
        client: dsec.DSecClient, srv: Server) -> None:
    """Room for the parent and three children: the fork answers three sandboxes and five
    typed refusals; the refused children left nothing, and once all are stopped neither
    does anything else (sandboxes, snapshot, quota)."""
    project = unique("fork8")
    await client.projects().create(project, sandboxes=4, cpu=16, memory_mb=16384,
                                   snapshot_bytes=8 << 30)
    async with key_client(srv, (await client.projects().create_key(project, "k")).key) as mine:
        parent = await mine.create(ttl_s=300)
        await parent.write_file("/work/state", b"prepared")
        children = await parent.fork(8, ttl_s=300)
        made = [c for c in children if isinstance(c, dsec.AsyncSandbox)]
        refused = [c for c in children if not isinstance(c, dsec.AsyncSandbox)]
        assert len(made) == 3 and len(refused) == 5, children
        assert all(isinstance(e, dsec.QuotaExceeded) for e in refused), refused
        for child in made:
            assert await child.read_file("/work/state") == b"prepared"
        assert {s.id for s in await mine.list()} == {parent.id, *(c.id for c in made)}
        assert await mine.snapshots() == []  # the fork's one snapshot went after the creates
        for sb in (*made, parent):
            await sb.stop()
            await assert_no_trace(srv, sb.id)
    used = (await client.projects().get(project)).used
    assert (used.sandboxes, used.snapshot_bytes) == (0, 0)
    assert snapshot_dirs(srv) == set()
    assert snapshot_loops(srv) == []


async def test_a_server_killed_mid_snapshot_leaves_a_whole_snapshot_or_none(
        client: dsec.DSecClient, srv: Server) -> None:
    """SIGKILL while a snapshot of a disk with 200 MB not yet written back is under way:
    after the restart the sandbox answers and writes (neither its processes nor its file
    system are left frozen), a snapshot is either
    recorded and whole or absent, and no unrecorded snapshot file or loop device remains."""
    sb = await client.create(ttl_s=300, disk_mb=1024)
    await sb.run("head -c 200M /dev/urandom > /work/big && echo marker > /work/small",
                 timeout_s=120)
    taking = asyncio.ensure_future(sb.snapshot())
    await asyncio.sleep(0.05)
    srv.kill(signal.SIGKILL)
    await asyncio.gather(taking, return_exceptions=True)  # cut, or done just before the kill
    srv.start()
    async with srv.client() as fresh:
        again = await fresh.get(sb.id)
        # bounded here: the calls of a sandbox left frozen would never answer
        assert (await asyncio.wait_for(again.run("cat /work/small"), 30)).stdout == "marker\n"
        wrote = await asyncio.wait_for(again.run(  # its file system is not left frozen either
            "echo more >> /work/small && sync -f /work/small && echo ok"), 30)
        assert wrote.stdout == "ok\n"
        recorded = {s.id for s in await fresh.snapshots()}
        assert snapshot_dirs(srv) == recorded
        for snap_id in recorded:  # a recorded one is whole: a child reads what was written
            child = await fresh.create(snapshot=snap_id, ttl_s=120)
            try:
                assert (await child.run("head -1 /work/small; stat -c %s /work/big")).stdout \
                    == "marker\n209715200\n"
            finally:
                await child.stop()
            await fresh.delete_snapshot(snap_id)
        await again.stop()
    await assert_no_trace(srv, sb.id)
    assert snapshot_dirs(srv) == set()
    assert snapshot_loops(srv) == []
