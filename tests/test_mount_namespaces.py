"""Each container sandbox's disk and overlay are mounted in a mount namespace of its own,
never in the host's table (``substrates/host/mountns.py``): what a user sees of that. The
host's table stays as it was however many sandboxes run; each still has its own disk and
quota; a restarted server gets an adopted sandbox's disk back (files, snapshots, rollback)
without letting the sandbox name what it mounts; and nothing is left after the stops."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

import pytest

import dsec
from conftest import Server, make_server, stop_server
from dsec.substrates.host.loop import holder, mount_device
from test_recovery import first_edge_id, host_traces, settled


@pytest.fixture
def fresh_server(images) -> Server:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "16", "--warm-pool", "0").start()
    yield srv
    stop_server(srv)


def host_mounts() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


async def test_sandboxes_leave_the_hosts_mount_table_as_it_was(fresh_server: Server) -> None:
    edge = first_edge_id(fresh_server)
    async with fresh_server.client() as client:
        await (await client.create(ttl_s=120)).stop()  # the image's layers are mounted once
        before = sorted(host_mounts())
        boxes = await asyncio.gather(*(client.create(ttl_s=120, disk_mb=64) for _ in range(6)))
        assert sorted(host_mounts()) == before
        for i, sb in enumerate(boxes):
            await sb.write_file("/work/mine", f"box {i}".encode())
        for i, sb in enumerate(boxes):  # each its own disk: no box sees another's file
            assert await sb.read_file("/work/mine") == f"box {i}".encode()
        full = await boxes[0].run("dd if=/dev/zero of=/work/fill bs=1M count=100 2>&1; echo rc=$?")
        assert "No space left on device" in full.stdout  # its disk quota holds
        assert (await boxes[1].run("echo roomy > /work/ok && cat /work/ok")).stdout == "roomy\n"
        assert sorted(host_mounts()) == before
        await asyncio.gather(*(sb.stop() for sb in boxes))
    assert await settled(lambda: host_traces(fresh_server, edge)) == {
        k: [] for k in host_traces(fresh_server, edge)}


async def test_an_adopted_sandbox_gets_its_disk_back_after_a_crash(fresh_server: Server) -> None:
    edge = first_edge_id(fresh_server)
    async with fresh_server.client() as client:
        sb = await client.create(ttl_s=300)
        await sb.write_file("/work/kept", b"at the snapshot")
        snap = await sb.snapshot()
        await sb.write_file("/work/kept", b"after the snapshot")
    fresh_server.kill(signal.SIGKILL)
    fresh_server.start()
    async with fresh_server.client() as client:
        again = await client.get(sb.id)
        assert await again.read_file("/work/kept") == b"after the snapshot"
        assert (await again.run("echo alive")).stdout == "alive\n"
        second = await again.snapshot()  # syncs and copies the disk mounted again
        await again.rollback(snap)
        assert await again.read_file("/work/kept") == b"at the snapshot"
        await again.rollback(second)
        assert await again.read_file("/work/kept") == b"after the snapshot"
        await again.stop()
    assert await settled(lambda: host_traces(fresh_server, edge)) == {
        k: [] for k in host_traces(fresh_server, edge)}


async def test_a_full_disk_stays_full_across_a_server_restart(fresh_server: Server) -> None:
    """A sandbox that filled its disk cannot get more room by outliving the server: the
    restarted server mounts the same file system, quota and all."""
    async with fresh_server.client() as client:
        sb = await client.create(ttl_s=300, disk_mb=64)
        await sb.run("dd if=/dev/zero of=/work/fill bs=1M count=100 2>/dev/null; sync")
    fresh_server.kill(signal.SIGKILL)
    fresh_server.start()
    async with fresh_server.client() as client:
        again = await client.get(sb.id)
        r = await again.run("dd if=/dev/zero of=/work/more bs=1M count=8 2>&1; echo rc=$?")
        assert "No space left on device" in r.stdout
        await again.snapshot()  # the snapshot of a full disk still works
        await again.stop()


async def test_a_linked_agent_socket_stays_refused_after_a_server_restart(
        fresh_server: Server, tmp_path: Path) -> None:
    """The sandbox points its agent socket at a host socket, then waits for the server to
    restart, hoping the disk mounted again is reached some other way: the next call still
    fails typed and the host socket never sees a connection."""
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.bind(str(tmp_path / "host.sock"))
    host.listen()
    host.setblocking(False)
    try:
        async with fresh_server.client() as client:
            sb = await client.create(ttl_s=300)
            await sb.run(f"(sleep 1; ln -sfn {tmp_path / 'host.sock'} /.dsec/run/agent.sock) "
                         "> /dev/null 2>&1 &")
            await asyncio.sleep(1.5)
        fresh_server.kill(signal.SIGKILL)
        fresh_server.start()
        async with fresh_server.client() as client:
            again = await client.get(sb.id)
            with pytest.raises(dsec.DSecError, match="not a socket"):
                await again.run("echo this must not reach the host")
            with pytest.raises(BlockingIOError):
                host.accept()
            await again.stop()
    finally:
        host.close()


async def test_a_disk_left_mounted_in_the_hosts_table_goes_with_its_sandbox(
        fresh_server: Server) -> None:
    """A dsec from before mount namespaces mounted a sandbox's disk in the host's table; an
    adopted sandbox of it still has that mount when it stops: the removal unmounts it too,
    and nothing is left."""
    edge = first_edge_id(fresh_server)
    async with fresh_server.client() as client:
        sb = await client.create(ttl_s=120)
        bundle = fresh_server.volume / "sandboxes" / sb.id
        dev = holder(bundle / "disk.img")
        assert dev is not None
        mount_device(dev, bundle / "disk", "ext4")
        assert str(bundle / "disk") in host_mounts()
        await sb.stop()
    assert await settled(lambda: host_traces(fresh_server, edge)) == {
        k: [] for k in host_traces(fresh_server, edge)}
