"""Sandbox state of VMs (microvm, vm): filesystem and full snapshots, sandboxes made from
them, rollback, pause saved to disk; on a real server with real QEMU (TCG here: slow, so few
VMs, each doing several checks)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import pytest

import dsec
from conftest import (
    VM_ACCEL,
    VM_SUBSTRATES,
    Server,
    make_server,
    own_server,
    stop_server,
)
from dsec.agent.client import AgentClient, AgentError
from test_hostile_vm import NOBODY, _runtime
from test_projects import key_client, unique
from test_vm import _traces

VM = dict(substrate="microvm", image="debian-minbase", memory_mb=256, disk_mb=128, ttl_s=600)
# A process that keeps its state in memory only: a counter, and random bytes it drew once.
# /tmp/count is replaced whole (a rename): a read, or a snapshot, never sees it truncated
COUNTER = ("head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n' > /tmp/drawn; "
           "i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; "
           "sleep 0.2; done")


async def counting(sb: dsec.AsyncSandbox) -> None:
    """Until COUNTER has drawn and counted once: a fixed sleep is too short for TCG under load."""
    await sb.run("for i in $(seq 600); do test -s /tmp/count && break; sleep 0.1; done")


srv, client = own_server("--capacity", "16", "--warm-pool", "0", "--vm-accel", VM_ACCEL)


def snapshot_dirs(srv: Server) -> set[str]:
    return {p.name for p in (srv.volume / "snapshots").glob("*")}


async def assert_gone(srv: Server, sandbox_id: str) -> None:
    deadline = time.monotonic() + 30
    while _traces(srv, sandbox_id):
        assert time.monotonic() < deadline, _traces(srv, sandbox_id)
        await asyncio.sleep(0.1)


async def _stop_all(client: dsec.DSecClient, *boxes: dsec.AsyncSandbox) -> None:
    for box in boxes:
        try:
            await box.stop()
        except dsec.DSecError:
            pass


async def _agent_run(srv: Server, sandbox_id: str, token: str, command: str) -> str:
    """A command sent straight to the sandbox's agent (as the edge would) with ``token``."""
    port = int(str(_runtime(srv, sandbox_id)["port"]))
    done = await AgentClient(("127.0.0.1", port), token, peer_uid=0).run(
        ["/.dsec/bin/sh", "-c", command], env={}, cwd="/", timeout_ms=30_000)
    return done.stdout.decode()


async def test_filesystem_snapshot_fork_and_rollback_of_a_vm(client: dsec.DSecClient,
                                                             srv: Server) -> None:
    parent = await client.create(**VM)
    children: list[dsec.AsyncSandbox] = []
    try:
        await parent.write_file("/work/answer", b"v1")
        await parent.run("echo unsynced > /work/fresh")  # in the guest's page cache only
        await parent.start(["sh", "-c", "while :; do date >> /tmp/busy; sleep 0.1; done"])
        snap = await parent.snapshot()
        assert snap.mode == "filesystem" and 0 < snap.size_bytes <= 128 << 20
        assert (await parent.run("echo alive")).stdout == "alive\n"  # continued after the copy

        children = [c for c in await parent.fork(2) if isinstance(c, dsec.AsyncSandbox)]
        assert len(children) == 2
        for child in children:
            assert child.id != parent.id
            r = await child.run("cat /work/answer /work/fresh; hostname; pgrep -f busy || true")
            assert r.stdout == f"v1unsynced\n{child.id}\n"  # the files; fresh processes
            await child.write_file("/work/answer", b"child")
        assert await parent.read_file("/work/answer") == b"v1"  # children never touch it

        await parent.write_file("/work/answer", b"v2 (reward hacked)")
        await parent.run("rm -rf /etc/apt; touch /work/stray")
        pid = _runtime(srv, parent.id)["pid"]
        info = await parent.rollback(snap)
        assert (info.id, info.state) == (parent.id, "running")
        assert _runtime(srv, parent.id)["pid"] != pid  # QEMU restarted on the restored disk
        r = await parent.run("cat /work/answer; ls /work; test -d /etc/apt && echo apt")
        assert r.stdout == "v1answer\nfresh\napt\n"
        assert await parent.processes() == []
        await client.delete_snapshot(snap.id)
    finally:
        await _stop_all(client, parent, *children)
    for box in (parent, *children):
        await assert_gone(srv, box.id)
    assert snapshot_dirs(srv) == set()


@pytest.mark.parametrize("substrate", VM_SUBSTRATES)
async def test_full_snapshot_children_keep_processes_and_get_their_own_identity(
        client: dsec.DSecClient, srv: Server, substrate: str) -> None:
    parent = await client.create(**{**VM, "substrate": substrate})
    children: list[dsec.AsyncSandbox] = []
    try:
        proc = await parent.start(["sh", "-c", COUNTER])
        await counting(parent)
        parent_token = str(_runtime(srv, parent.id)["token"])
        snap = await parent.snapshot(mode="full")
        assert snap.mode == "full"
        children = [await client.create(snapshot=snap.id, ttl_s=600)]
        forked = await parent.fork(1, mode="full", ttl_s=600)  # another snapshot, deleted after
        children += [c for c in forked if isinstance(c, dsec.AsyncSandbox)]
        assert len(children) == 2, forked
        drawn = (await parent.run("cat /tmp/drawn")).stdout
        seen = set()
        for child in children:
            info = await child.refresh()
            assert (info.memory_mb, info.substrate) == (256, substrate)  # the parent's machine
            procs = await child.processes()
            assert [p.id for p in procs if p.running] == [proc.id]  # the parent's process runs on
            before = int((await child.run("cat /tmp/count")).stdout)
            await asyncio.sleep(1.0)
            after = int((await child.run("cat /tmp/count")).stdout)
            assert after > before  # and counts on, from where the parent was
            assert (await child.run("cat /tmp/drawn")).stdout == drawn  # the parent's memory
            r = await child.run("hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
            hostname, fresh = r.stdout.splitlines()
            assert hostname == child.id
            seen.add(fresh)
            # hostile: the parent's token (in the guest's saved memory) does not work on the child
            with pytest.raises(AgentError, match="bad token"):
                await _agent_run(srv, child.id, parent_token, "echo stolen")
            child_token = str(_runtime(srv, child.id)["token"])
            assert child_token != parent_token
            assert await _agent_run(srv, child.id, child_token, "echo mine") == "mine\n"
            with pytest.raises(AgentError, match="bad token"):  # nor the child's on the parent
                await _agent_run(srv, parent.id, child_token, "echo stolen")
        assert len(seen) == 2  # each child's random pool was reseeded apart
        await client.delete_snapshot(snap.id)
    finally:
        await _stop_all(client, parent, *children)
    for box in (parent, *children):
        await assert_gone(srv, box.id)
    assert snapshot_dirs(srv) == set()


def _qemu(srv: Server, sandbox_id: str) -> list[int]:
    return [int(t.split()[1]) for t in _traces(srv, sandbox_id) if t.startswith("process")]


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_full_rollback_restores_the_processes_too(client: dsec.DSecClient,
                                                        srv: Server) -> None:
    sb = await client.create(**VM)
    try:
        proc = await sb.start(["sh", "-c", COUNTER])
        await counting(sb)
        await sb.write_file("/work/answer", b"v1")
        snap = await sb.snapshot(mode="full")
        at_snapshot = int((await sb.run("cat /tmp/count")).stdout)
        await sb.run(f"kill {proc.pid}; echo v2 > /work/answer")
        await asyncio.sleep(0.5)
        assert [p for p in await sb.processes() if p.running] == []
        await sb.rollback(snap)
        assert [p.id for p in await sb.processes() if p.running] == [proc.id]
        count = int((await sb.run("cat /tmp/count")).stdout)
        assert at_snapshot - 3 <= count  # counting on from the snapshot's instant, not from 0
        assert await sb.read_file("/work/answer") == b"v1"
        await sb.stop()  # the snapshot outlives its sandbox: a child still continues it
        child = await client.create(snapshot=snap.id, ttl_s=60)
        assert [p.id for p in await child.processes() if p.running] == [proc.id]
        assert (await child.read_file("/work/answer")) == b"v1"
        await child.stop()
        await assert_gone(srv, child.id)
        await client.delete_snapshot(snap.id)
    finally:
        await _stop_all(client, sb)
    await assert_gone(srv, sb.id)


async def test_a_paused_vm_is_saved_to_disk_and_its_qemu_exits(client: dsec.DSecClient,
                                                               srv: Server) -> None:
    sb = await client.create(**VM)
    try:
        await sb.start(["sh", "-c", COUNTER])
        await sb.run("head -c 100M /dev/zero > /dev/shm/fill")  # guest memory in use
        (pid,) = _qemu(srv, sb.id)
        rss = _rss_kb(pid)
        busy = asyncio.ensure_future(sb.run("sleep 3; echo done > /work/late"))
        await asyncio.sleep(1.0)
        await sb.pause()
        with pytest.raises(dsec.SandboxError, match="paused during the call"):  # not died
            await busy
        assert (await client.get(sb.id)).info.state == "paused"
        assert _qemu(srv, sb.id) == []  # QEMU exited: its memory went back to the host
        assert rss > 100 << 10
        count = int((await sb.run("cat /tmp/count")).stdout)  # any call resumes it
        assert (await client.get(sb.id)).info.state == "running"
        await asyncio.sleep(1.0)
        assert int((await sb.run("cat /tmp/count")).stdout) > count  # the process counts on
        assert (await sb.run("wc -c < /dev/shm/fill")).stdout == f"{100 << 20}\n"
        late = await sb.run("for i in $(seq 100); do test -e /work/late && break; sleep 0.1; done; "
                            "cat /work/late")
        assert late.stdout == "done\n"  # the cut command went on
        await sb.pause()
        await sb.pause()  # idempotent
        await sb.resume()
        await sb.resume()
        assert len(_qemu(srv, sb.id)) == 1
    finally:
        await _stop_all(client, sb)
    await assert_gone(srv, sb.id)


async def test_a_paused_vm_survives_a_server_kill_and_holds_no_capacity(images) -> None:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "1", "--warm-pool", "0", "--vm-accel", VM_ACCEL).start()
    try:
        async with srv.client() as client:
            sb = await client.create(**VM)
            await sb.start(["sh", "-c", COUNTER])
            await counting(sb)
            await sb.pause()
        srv.kill(signal.SIGKILL)
        srv.start()
        async with srv.client() as client:
            again = await client.get(sb.id)
            assert again.info.state == "paused" and _qemu(srv, sb.id) == []  # adopted, not dead
            other = await client.create(**VM)  # a paused VM holds no slot of the capacity of 1
            assert int((await again.run("cat /tmp/count")).stdout) > 0  # resumed, never refused
            assert (await client.get(sb.id)).info.state == "running"
            await other.stop()
            await again.stop()
            for box in (sb, other):
                await assert_gone(srv, box.id)
    finally:
        stop_server(srv)


def _readable_by_nobody(path: Path) -> bool:
    done = subprocess.run(["/usr/bin/python3", "-c", "import sys; open(sys.argv[1], 'rb').read(1)",
                           str(path)], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                          capture_output=True, check=False)
    return done.returncode == 0


async def test_saved_vms_are_out_of_reach_of_the_guest_and_local_users(
        client: dsec.DSecClient, srv: Server) -> None:
    """A saved VM's memory holds its agent's token: a local user of the host cannot read a
    full snapshot's or a paused VM's files; the guest sees its own disks only, and cannot
    open the boot port to read the next boot message (its agent holds it)."""
    sb = await client.create(**VM)
    try:
        snap = await sb.snapshot(mode="full")
        await sb.pause()
        saved = [srv.volume / "snapshots" / snap.id / name for name in ("memory.bin", "disk.img")]
        saved.append(srv.state_dir / "vms" / sb.id / "paused.bin")
        for path in saved:
            assert path.exists() and path.stat().st_mode & 0o077 == 0, path
            assert not _readable_by_nobody(path), path
        r = await sb.run("for s in /sys/block/*/serial; do cat $s; echo; done; echo --; "
                         "for f in /dev/vport*; do cat $f; done 2>&1; find / -xdev \\( -name "
                         "memory.bin -o -name paused.bin -o -name disk.img \\) 2>/dev/null; echo end")
        serials, _, rest = r.stdout.partition("--\n")
        names = serials.split()
        assert "rw" in names and all(n == "rw" or n.startswith("layer") for n in names), names
        assert "busy" in rest.lower() and rest.strip().endswith("end"), rest
        assert _runtime(srv, sb.id)["token"] not in rest  # nothing of the token came out
        await client.delete_snapshot(snap.id)
    finally:
        await _stop_all(client, sb)
    await assert_gone(srv, sb.id)


async def test_a_full_snapshots_child_is_admitted_with_its_parents_machine(
        client: dsec.DSecClient, srv: Server) -> None:
    """Hostile: asking a small memory_mb for the child of a big VM's `full` snapshot does not
    slip it under the project's quota: it is admitted (and made) with the parent's."""
    project = unique("vmq")
    await client.projects().create(project, sandboxes=4, cpu=4, memory_mb=600,
                                   snapshot_bytes=8 << 30)
    async with key_client(srv, (await client.projects().create_key(project, "k")).key) as mine:
        parent = await mine.create(**{**VM, "memory_mb": 384})
        try:
            snap = await parent.snapshot(mode="full")
            with pytest.raises(dsec.QuotaExceeded) as refused:  # 384 + 384 > 600
                await mine.create(snapshot=snap.id, memory_mb=128, ttl_s=60)
            assert refused.value.details["asked"] == 384 or "384" in str(refused.value)
            await mine.delete_snapshot(snap.id)
        finally:
            await parent.stop()
    await assert_gone(srv, parent.id)
