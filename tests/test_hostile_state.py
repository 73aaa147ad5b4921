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
