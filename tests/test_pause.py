"""Pause and resume: a paused container sandbox is frozen by the cgroup freezer (no CPU, no
progress), any call on it resumes it transparently, it stays paused across a server crash,
and stop, the reaper and a hostile workload cannot get around the freeze."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import dsec
from conftest import (
    VM_SUBSTRATES,
    Server,
    SharedVMs,
    _any_sandbox,
    _sandbox,
    make_server,
    stop_server,
)
from dsec.substrates.host import cgroups
from test_hostile import assert_no_trace
from test_recovery import first_edge_id
from test_vm import _traces as vm_traces

COUNTER = "while :; do printf . >> /work/n; done"  # progress: the file's size


@pytest.fixture
async def sandbox(client: dsec.DSecClient) -> AsyncIterator[dsec.AsyncSandbox]:
    async for sb in _sandbox(client, "debian-minbase", 256):
        yield sb


@pytest.fixture
def fresh_server(images) -> Server:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "8").start()
    yield srv
    stop_server(srv)


def _procs(server: Server, sandbox_id: str) -> list[int]:
    """The sandbox's processes, read on the host (reading them in the sandbox would resume it)."""
    parent = f"/dsec-{first_edge_id(server)}"
    text = (cgroups.freezer_file(parent, sandbox_id).parent / "cgroup.procs").read_text()
    return [int(p) for p in text.split()]


def _counter(server: Server, sandbox_id: str) -> int:
    """The progress of COUNTER, read on the host through the init's root."""
    return Path(f"/proc/{_procs(server, sandbox_id)[0]}/root/work/n").stat().st_size


def _frozen(server: Server, sandbox_id: str) -> bool:
    return cgroups.is_frozen(f"/dsec-{first_edge_id(server)}", sandbox_id)


async def _advancing(server: Server, sandbox_id: str) -> int:
    """Wait until the counter runs; its value."""
    deadline = time.monotonic() + 30
    while True:
        try:
            first = _counter(server, sandbox_id)
            await asyncio.sleep(0.2)
            if _counter(server, sandbox_id) > first:
                return first
        except FileNotFoundError:
            await asyncio.sleep(0.05)
        assert time.monotonic() < deadline, "the counter never started"


async def test_paused_sandbox_makes_no_progress_and_any_call_resumes_it(
        client: dsec.DSecClient, server: Server, sandbox: dsec.AsyncSandbox) -> None:
    await sandbox.start(["sh", "-c", COUNTER])
    await _advancing(server, sandbox.id)
    info = await sandbox.pause()
    assert info.state == "paused" and (await client.get(sandbox.id)).info.state == "paused"
    assert [s.state for s in await client.list() if s.id == sandbox.id] == ["paused"]
    assert _frozen(server, sandbox.id)
    frozen_at = _counter(server, sandbox.id)
    await asyncio.sleep(1.0)
    assert _counter(server, sandbox.id) == frozen_at  # no progress at all while paused
    # any call reaches a paused sandbox: it resumes first, transparently
    assert (await sandbox.run("cat /work/n")).exit_code == 0
    assert (await client.get(sandbox.id)).info.state == "running"
    assert not _frozen(server, sandbox.id)
    await asyncio.sleep(0.3)
    assert _counter(server, sandbox.id) > frozen_at
    # files and processes resume it too
    await sandbox.pause()
    assert await sandbox.read_file("/etc/hostname")
    assert (await client.get(sandbox.id)).info.state == "running"
    await sandbox.pause()
    assert any(p.running for p in await sandbox.processes())
    assert (await client.get(sandbox.id)).info.state == "running"


async def test_pause_and_resume_are_idempotent_and_typed(client: dsec.DSecClient, server: Server,
                                                          sandbox: dsec.AsyncSandbox) -> None:
    assert (await sandbox.resume()).state == "running"  # resuming a running one: a no-op
    assert (await sandbox.pause()).state == "paused"
    assert (await sandbox.pause()).state == "paused"  # pausing a paused one: a no-op
    assert _frozen(server, sandbox.id)
    assert (await sandbox.resume()).state == "running"
    assert (await sandbox.resume()).state == "running"
    assert not _frozen(server, sandbox.id)
    await sandbox.stop()
    with pytest.raises(dsec.SandboxNotFound):
        await sandbox.pause()
    with pytest.raises(dsec.SandboxNotFound):
        await sandbox.resume()


def sandbox_cgroup(server: Server, substrate: str, sandbox_id: str) -> tuple[str, str]:
    """The cgroup parent and name of a sandbox's processes: an fn sandbox's are its worker's."""
    edge = first_edge_id(server)
    if substrate == "fn":
        with sqlite3.connect(f"file:{server.state_dir / 'state.db'}?mode=ro", uri=True) as db:
            runtime = json.loads(db.execute("SELECT runtime FROM sandboxes WHERE id = ?",
                                            (sandbox_id,)).fetchone()[0])
        return f"/dsec-fn-{edge}/{runtime['template']}", runtime["worker"]
    return f"/dsec-{edge}" + (f"-{substrate}" if substrate in VM_SUBSTRATES else ""), sandbox_id


async def test_pause_on_each_substrate(client: dsec.DSecClient, server: Server, substrate: str,
                                       shared_vms: SharedVMs) -> None:
    """Containers and fn workers freeze: no CPU used while paused, even by a busy loop; VMs
    are saved to disk and their QEMU exits (tests/test_vm_state.py); any call resumes."""
    async for sb in _any_sandbox(client, substrate, shared_vms, "debian-minbase", 256):
        if substrate in VM_SUBSTRATES:
            await sb.pause()
            assert not [t for t in vm_traces(server, sb.id) if t.startswith("process")]
            assert (server.state_dir / "vms" / sb.id / "paused.bin").exists()
        else:
            await sb.start(["sh", "-c", "while :; do :; done"])
            await sb.pause()
            parent, name = sandbox_cgroup(server, substrate, sb.id)
            assert cgroups.is_frozen(parent, name)
            usage = _cpu_usage(parent, name)
            await asyncio.sleep(1.0)
            assert _cpu_usage(parent, name) - usage < 0.005
        assert (await sb.run("echo still", timeout_s=60)).stdout == "still\n"
        if substrate not in VM_SUBSTRATES:
            assert not cgroups.is_frozen(parent, name)
        assert (await client.get(sb.id)).info.state == "running"
        if substrate == "fn":  # stopped while paused: the worker and its cgroups go
            await sb.pause()
            await sb.stop()
            deadline = time.monotonic() + 10
            while cgroups.freezer_file(parent, name).parent.exists():
                assert time.monotonic() < deadline, "a paused fn sandbox's cgroup outlived its stop"
                await asyncio.sleep(0.05)


async def test_a_call_in_flight_waits_and_its_timeout_is_wall_clock(
        sandbox: dsec.AsyncSandbox) -> None:
    """A command running when its sandbox is paused answers once it resumes; its timeout
    counted the paused time."""
    call = asyncio.ensure_future(sandbox.run("sleep 5; echo finished", timeout_s=2))
    await asyncio.sleep(0.5)
    await sandbox.pause()
    await asyncio.sleep(2.5)
    assert not call.done()  # frozen: the command's timeout has passed, but nothing ran
    await sandbox.resume()
    with pytest.raises(dsec.CommandTimeout) as timed_out:
        await asyncio.wait_for(call, 10)
    assert "finished" not in timed_out.value.result.stdout  # type: ignore[attr-defined]


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
async def test_pause_under_other_runtimes(client: dsec.DSecClient, server: Server,
                                          runtime: str) -> None:
    """crun is the default (above); runc's and gVisor's sandboxes freeze the same way (for
    runsc, its sentry and gofer with the sandbox)."""
    sb = await client.create(runtime=runtime, ttl_s=120)
    try:
        await sb.start(["sh", "-c", COUNTER])
        await _advancing(server, sb.id)
        await sb.pause()
        parent = f"/dsec-{first_edge_id(server)}"
        usage = _cpu_usage(parent, sb.id)
        await asyncio.sleep(1.0)
        assert _cpu_usage(parent, sb.id) - usage < 0.005
        assert (await sb.run("echo awake")).stdout == "awake\n"
    finally:
        await sb.stop()
    await assert_no_trace(server, sb.id)


async def test_paused_sandbox_survives_a_server_crash(fresh_server: Server) -> None:
    async with fresh_server.client() as client:
        sb = await client.create(ttl_s=300)
        await sb.start(["sh", "-c", COUNTER])
        await _advancing(fresh_server, sb.id)
        await sb.pause()
    fresh_server.kill(signal.SIGKILL)
    fresh_server.start()
    assert _frozen(fresh_server, sb.id)  # adoption left it frozen, not dead
    frozen_at = _counter(fresh_server, sb.id)
    async with fresh_server.client() as client:
        again = await client.get(sb.id)
        assert again.info.state == "paused"
        await asyncio.sleep(0.5)
        assert _counter(fresh_server, sb.id) == frozen_at
        assert (await again.run("echo after")).stdout == "after\n"
        assert (await client.get(sb.id)).info.state == "running"
        await again.stop()
        await assert_no_trace(fresh_server, sb.id)


async def test_paused_capacity_is_freed(images) -> None:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "1").start()
    try:
        async with srv.client() as client:
            first = await client.create(ttl_s=120)
            with pytest.raises(dsec.CapacityExhausted):
                await client.create(ttl_s=120)
            await first.pause()
            second = await client.create(ttl_s=120)  # a paused sandbox holds no slot
            assert (await first.run("echo back")).stdout == "back\n"  # resume never refused
            await second.stop()
            await first.stop()
    finally:
        stop_server(srv)


async def test_stop_and_reaper_of_a_paused_sandbox_leak_nothing(client: dsec.DSecClient,
                                                                server: Server) -> None:
    stopped = await client.create(ttl_s=120)
    await stopped.start(["sh", "-c", COUNTER])
    await stopped.pause()
    await stopped.stop()
    await assert_no_trace(server, stopped.id)

    expiring = await client.create(ttl_s=120)
    await expiring.start(["sh", "-c", COUNTER])
    await expiring.pause()
    await expiring.set_ttl(1)  # the TTL keeps running while paused
    deadline = time.monotonic() + 30
    while (await client.get(expiring.id)).info.state == "paused":
        assert time.monotonic() < deadline, "the reaper never ended a paused sandbox"
        await asyncio.sleep(0.2)
    with pytest.raises(dsec.SandboxDied):
        await expiring.run("true")
    await assert_no_trace(server, expiring.id)


async def test_stop_of_a_paused_vm_leaks_nothing(client: dsec.DSecClient, server: Server) -> None:
    """A frozen QEMU is thawed, then killed: nothing of it stays (cgroups, dir, process)."""
    sb = await client.create(substrate="microvm", memory_mb=256, ttl_s=120)
    await sb.pause()
    await sb.stop()
    deadline = time.monotonic() + 30
    while vm_traces(server, sb.id):
        assert time.monotonic() < deadline, vm_traces(server, sb.id)
        await asyncio.sleep(0.1)


# hostile: the sandbox's own processes against the freezer
async def test_sandbox_cannot_write_its_freezer(sandbox: dsec.AsyncSandbox) -> None:
    attempt = await sandbox.run(
        "for f in $(find /sys/fs/cgroup -name freezer.state -o -name cgroup.freeze 2>/dev/null); "
        "do (echo THAWED > $f || echo 0 > $f) 2>/dev/null && echo WROTE $f; done; "
        "mount -o remount,rw /sys/fs/cgroup 2>/dev/null && echo REMOUNTED; "
        "mkdir -p /tmp/cg; mount -t cgroup -o freezer cgroup /tmp/cg 2>/dev/null && echo MOUNTED; "
        "mount -t cgroup2 none /tmp/cg 2>/dev/null && echo MOUNTED; "
        "touch /sys/fs/cgroup/x 2>/dev/null && echo TOUCHED; echo done")
    assert attempt.stdout == "done\n"  # no freezer file written, no cgroup tree of its own


async def test_forking_storm_is_fully_frozen(server: Server, sandbox: dsec.AsyncSandbox) -> None:
    """Processes forking as fast as they can (bounded by the pids limit) right up to the pause:
    every one of them is frozen, and none is born while paused."""
    await sandbox.start(["sh", "-c", "while :; do (sh -c 'while :; do :; done' &); done"])
    await asyncio.sleep(1.0)
    await sandbox.pause()
    before = sorted(_procs(server, sandbox.id))
    parent = f"/dsec-{first_edge_id(server)}"
    usage = _cpu_usage(parent, sandbox.id)
    await asyncio.sleep(1.0)
    assert sorted(_procs(server, sandbox.id)) == before
    assert _cpu_usage(parent, sandbox.id) - usage < 0.005  # seconds of CPU while paused
    assert (await sandbox.run("echo alive", timeout_s=60)).stdout == "alive\n"


def _cpu_usage(parent: str, sandbox_id: str) -> float:
    """CPU seconds the sandbox's cgroup has used (for a VM's cgroup, which has no cpuacct on
    cgroup v1: its QEMU's own count, in clock ticks)."""
    rel = f"{parent.strip('/')}/{sandbox_id}"
    if cgroups.is_cgroup2_only():
        stat = (cgroups.CGROUP_ROOT / rel / "cpu.stat").read_text().split()
        return int(stat[stat.index("usage_usec") + 1]) / 1e6
    acct = cgroups.CGROUP_ROOT / "cpuacct" / rel / "cpuacct.usage"
    if acct.exists():
        return int(acct.read_text()) / 1e9
    procs = (cgroups.freezer_file(parent, sandbox_id).parent / "cgroup.procs").read_text().split()
    ticks = 0
    for pid in procs:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")
