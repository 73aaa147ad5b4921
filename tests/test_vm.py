"""The microvm and vm substrates end to end: real QEMU VMs (emulated with TCG unless
DSEC_TEST_VM_ACCEL=kvm) behind a real server, through the public SDK."""

from __future__ import annotations

import asyncio
import os
import platform
import signal
import tempfile
import time
from pathlib import Path

import pytest

import dsec
from conftest import (
    VM_ACCEL,
    VM_SUBSTRATES,
    Server,
    make_server,
    pool_filled,
    scrape,
    stop_server,
)
from dsec.edge.edge import default_edge_id
from dsec.images.store import ImageStore


def _traces(server: Server, sandbox_id: str) -> list[str]:
    """Everything of the sandbox left on the host: its directory, cgroups, QEMU process."""
    found = [str(p) for p in (server.state_dir / "vms").glob(sandbox_id)]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/dsec-*/{sandbox_id}")]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if sandbox_id.encode() in (proc / "cmdline").read_bytes():
                found.append(f"process {proc.name}")
        except OSError:
            pass
    return found


def _qemu_pids(server: Server) -> set[int]:
    """Running (not zombie) QEMU processes of the server's sandboxes."""
    prefix = f"sb-{default_edge_id(server.state_dir)}-".encode()
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, _, rest = stat.read_text().rpartition(")")
            if ("(qemu-system" in comm and rest.split()[0] != "Z"
                    and prefix in (stat.parent / "cmdline").read_bytes()):
                pids.add(int(stat.parent.name))
        except OSError:
            continue
    return pids


async def _guest_clock_error(sb: dsec.AsyncSandbox) -> float:
    """Seconds the guest's wall clock lies outside the host's, read before and after it (0
    when between them). The agent sets it from its boot message, which the edge sends once the
    agent listens; a message sent early (while the guest still booted) leaves it behind."""
    before = time.time()
    guest = float((await sb.run("date +%s.%N")).stdout)
    return max(before - guest, guest - time.time(), 0.0)


async def _until_died(sb: dsec.AsyncSandbox) -> None:
    for _ in range(600):
        if (await sb.refresh()).state == "died":
            return
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("substrate", VM_SUBSTRATES)
async def test_vm_runs_its_own_kernel_with_the_limits_asked(
        client: dsec.DSecClient, server: Server, substrate: str) -> None:
    sb = await client.create(substrate=substrate, image="debian-minbase", cpu=2, memory_mb=300,
                             disk_mb=200, ttl_s=300)
    try:
        r = await sb.run("uname -r; nproc; grep MemTotal /proc/meminfo; df -m / | tail -1")
        kernel, cpus, mem, disk = r.stdout.splitlines()
        assert kernel != platform.release() and kernel.endswith("-amd64")  # the guest's kernel
        assert cpus == "2"
        assert 200_000 < int(mem.split()[1]) <= 300 * 1024  # kB: the guest has 300 MiB
        assert 150 < int(disk.split()[1]) <= 200  # the writable disk is disk_mb big
        assert await _guest_clock_error(sb) < 1
        await sb.write_file("/work/a.txt", b"in the guest")
        assert (await sb.run("cat /work/a.txt")).stdout == "in the guest"
        # The QEMU process runs under a host cgroup limit: guest memory plus QEMU's own.
        (limit,) = Path("/sys/fs/cgroup").glob(f"memory/dsec-*-{substrate}/{sb.id}/memory.limit_in_bytes")
        assert int(limit.read_text()) > 300 << 20
    finally:
        await sb.stop()
    assert _traces(server, sb.id) == []
    with pytest.raises(dsec.SandboxNotFound):
        await sb.run("true")


async def test_killed_qemu_is_reported_died_and_leaves_nothing(
        client: dsec.DSecClient, server: Server) -> None:
    sb = await client.create(substrate="microvm", image="debian-minbase", memory_mb=256, ttl_s=300)
    assert (await sb.run("echo up")).stdout == "up\n"
    pid = int((server.state_dir / "vms" / sb.id / "qemu.pid").read_text())
    os.kill(pid, 9)  # the VM crashes, as seen from the host
    await _until_died(sb)
    with pytest.raises(dsec.SandboxDied) as info:
        await sb.run("true")
    assert "QEMU process exited" in str(info.value)
    for _ in range(600):  # the edge records the death, then cleans up
        if not _traces(server, sb.id):
            break
        await asyncio.sleep(0.1)
    assert _traces(server, sb.id) == []


async def test_guest_that_cannot_boot_fails_the_create_and_leaves_nothing(
        client: dsec.DSecClient, server: Server) -> None:
    def traces() -> set[Path]:
        edge = default_edge_id(server.state_dir)  # this server's only: others come and go
        cgroups = [p for p in Path("/sys/fs/cgroup").glob(f"*/dsec-{edge}-microvm/*") if p.is_dir()]
        return {*(server.state_dir / "vms").iterdir(), *cgroups}
    from test_images import _busybox_layers, _layer_tar, make_oci_archive
    with tempfile.TemporaryDirectory() as tmp:  # its /proc is a file: the guest's init fails
        layers = [*_busybox_layers(), _layer_tar([("proc", b"not a directory", 0o644)])]
        broken = ImageStore().import_oci(make_oci_archive(Path(tmp) / "bad.tar", layers),
                                         "test-broken-proc")
    before, qemus = traces(), _qemu_pids(server)
    with pytest.raises(dsec.SandboxError) as info:
        await client.create(substrate="microvm", image=broken.name, memory_mb=256, ttl_s=60)
    assert "stopped while booting" in str(info.value)
    assert traces() == before and _qemu_pids(server) <= qemus


async def test_kvm_missing_is_not_supported_never_unisolated(tmp_path: Path) -> None:
    srv = make_server("--vm-accel", "kvm", "--kvm-device", str(tmp_path / "no-kvm"),
                      "--warm-pool", "0").start()
    try:
        async with srv.client() as client:
            for substrate in VM_SUBSTRATES:
                with pytest.raises(dsec.NotSupported) as info:
                    await client.create(substrate=substrate, image="debian-minbase")
                assert "no-kvm missing" in str(info.value)
            assert await client.list() == []
        assert list((srv.state_dir / "vms").iterdir()) == []
    finally:
        stop_server(srv)


async def test_vm_refuses_container_options_and_too_little_memory(client: dsec.DSecClient) -> None:
    with pytest.raises(dsec.NotSupported):
        await client.create(substrate="microvm", runtime="runsc")
    with pytest.raises(dsec.InvalidRequest):  # below what its guest kernel boots in
        await client.create(substrate="vm", memory_mb=64)
    sb = await client.create(substrate="microvm", memory_mb=128)  # the minimum boots
    assert (await sb.run("echo up")).stdout == "up\n"
    await sb.stop()


@pytest.mark.parametrize("substrate", VM_SUBSTRATES)
async def test_snapshot_restores_are_separate_sandboxes_with_their_own_name_and_clock(
        substrate: str) -> None:
    srv = make_server("--vm-accel", VM_ACCEL, "--vm-snapshots", "--warm-pool", "0").start()
    try:
        async with srv.client() as client:
            # The first create boots and saves the template (cached by content); both restore it.
            a = await client.create(substrate=substrate, image="debian-minbase", memory_mb=256)
            began = time.monotonic()
            b = await client.create(substrate=substrate, image="debian-minbase", memory_mb=256)
            uptime = float((await b.run("cat /proc/uptime")).stdout.split()[0])
            # Restored, not booted again: b's guest has been up since its template booted (in
            # a's create), longer than b's create has run; a guest booted by the create (as
            # from a template saved in the firmware, before its agent listened) could not be.
            assert uptime > time.monotonic() - began
            await a.write_file("/work/only-a", b"a")
            assert (await b.run("ls /work")).stdout == ""
            assert (await a.run("cat /work/only-a")).stdout == "a"
            assert [(await sb.run("hostname")).stdout.strip() for sb in (a, b)] == [a.id, b.id]
            assert await _guest_clock_error(b) < 1  # not the template's save time
            await a.stop()
            await b.stop()
            assert _traces(srv, a.id) == [] and _traces(srv, b.id) == []
    finally:
        stop_server(srv)


def _template_used_by(sandbox_id: str) -> Path:
    """The snapshot template whose ``users/`` names the sandbox (vmsnapshot.use)."""
    (template,) = [p for p in (Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec"))
                               / "vm-snapshots").glob(f"*/users/{sandbox_id}")]
    return template.parent.parent


def _idle_for_two_days(template: Path) -> None:
    then = time.time() - 2 * 86400
    os.utime(template, (then, then))


async def test_a_snapshot_template_stays_while_used_and_goes_once_idle(images: ImageStore) -> None:
    """Templates are a cache the edge sweeps at its start: one a live sandbox restored from
    (its disk's backing file) stays however long unused; once that sandbox is gone and none
    restored it for --vm-template-idle-s (a day), it is removed, and the next create makes it
    again."""
    srv = make_server("--vm-accel", VM_ACCEL, "--vm-snapshots", "--warm-pool", "0").start()
    try:
        async with srv.client() as client:
            sb = await client.create(substrate="microvm", image="debian-minbase", memory_mb=256)
        template = _template_used_by(sb.id)
        _idle_for_two_days(template)
        srv.kill(signal.SIGKILL)
        srv.start()  # the edge sweeps: the template is in use
        async with srv.client() as client:
            sb = await client.get(sb.id)
            assert template.exists() and (await sb.run("echo adopted")).stdout == "adopted\n"
            await sb.stop()
            assert _traces(srv, sb.id) == []
            assert not (template / "users" / sb.id).is_symlink()  # released by its teardown
        _idle_for_two_days(template)
        srv.kill(signal.SIGKILL)
        srv.start()  # nothing uses it, none restored it for a day
        assert not template.exists()
        async with srv.client() as client:
            again = await client.create(substrate="microvm", image="debian-minbase", memory_mb=256)
            assert _template_used_by(again.id) == template  # made again, same shape
            assert (await again.run("echo restored")).stdout == "restored\n"
            await again.stop()
    finally:
        stop_server(srv)


async def test_vm_warm_pool_hands_out_a_booted_vm_at_normal_priority() -> None:
    srv = make_server("--vm-accel", VM_ACCEL, "--vm-warm-pool", "1", "--warm-pool", "0").start()
    try:
        async with srv.client() as client:
            await (await client.create(substrate="microvm", memory_mb=256)).stop()  # pool fills
            await pool_filled(client, "microvm")
            sb = await client.create(substrate="microvm", memory_mb=256, cpu=0.5)
            assert scrape(srv)["dsec_create_seconds_count{source=warm,substrate=microvm}"] == 1
            assert (await sb.run("echo warm")).stdout == "warm\n"
            pid = int((srv.state_dir / "vms" / sb.id / "qemu.pid").read_text())
            policies = {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
            assert policies == {os.SCHED_OTHER}
            (quota,) = Path("/sys/fs/cgroup").glob(f"cpu/dsec-*-microvm/{sb.id}/cpu.cfs_quota_us")
            assert int(quota.read_text()) == 50_000  # the claim's cpu=0.5
            await sb.stop()
    finally:
        stop_server(srv)
