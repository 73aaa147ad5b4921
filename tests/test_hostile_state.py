"""Hostile sandbox state: what a sandbox shapes on its own disk, or does around a snapshot,
a fork, a rollback or a pause, must neither reach the host or another sandbox nor cost the
trainer its rollout without a typed error. Each test is an agent trying to cheat or to hurt
its neighbours through the state operations, on a real server (containers under crun)."""

from __future__ import annotations

import pytest

import dsec
from conftest import Server, own_server
from test_hostile import assert_no_trace
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
