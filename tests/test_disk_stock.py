"""The stock of mounted disks (``substrates/container/disk_stock.py``) as a user and the host
see it: a cold create of the default size takes a fresh disk of its own, with none of an
earlier sandbox's files and its whole quota; the stock never shows in the host's mount table
and fills again once creates are quiet; neither a server's stop nor its crash leaves a loop
device or a file of it; the warm pool's spawns, on no caller's path, leave it to the callers;
and a stocked disk, mounted ahead through the mount API, is as nosuid and nodev as one
attached on the create's path."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import Server, make_server, stop_server, warm_count
from dsec.images.store import ImageStore
from dsec.protocol.models import DEFAULT_DISK_MB
from dsec.substrates.container.disk_stock import DEPTH, DiskStock
from dsec.substrates.host.disk import DiskPool
from dsec.substrates.host.loop import wait_detached
from dsec.substrates.host.mountns import inside, new_private, own_fs
from support.disks import attached_disks, full_stock
from test_mount_namespaces import host_mounts


@pytest.fixture
def server(images: ImageStore) -> Iterator[Server]:
    srv = make_server("--capacity", "16", "--warm-pool", "0").start()
    yield srv
    stop_server(srv)


def stock(server: Server) -> Path:
    return server.volume / "disks" / "stock"


def stocked(server: Server) -> set[str]:
    return {p.name for p in stock(server).glob("*.img")}


async def test_each_cold_create_takes_a_fresh_disk_of_its_own(server: Server) -> None:
    async with server.client() as client:
        first = await client.create(ttl_s=120)  # the image's layers are mounted once
        await first.write_file("/work/secret", b"the first sandbox's answer")
        await first.run("sync")
        await first.stop()
        before = sorted(host_mounts())
        names = await full_stock(stock(server))
        boxes = []
        for i in range(DEPTH + 2):  # the whole stock, then disks attached on the create's path
            boxes.append(await client.create(ttl_s=120))
            if i == 0:
                assert len(names - stocked(server)) == 1  # it took one of the stock
        for i, sb in enumerate(boxes):
            await sb.write_file("/work/mine", f"box {i}".encode())
        for i, sb in enumerate(boxes):
            seen = await sb.run("cat /work/secret 2>&1; cat /work/mine; echo; "
                                "df -k /work | tail -1")
            lines = seen.stdout.splitlines()
            assert "No such file" in lines[0] and lines[1] == f"box {i}"
            size_kb = int(lines[2].split()[1])
            assert 0.9 * DEFAULT_DISK_MB * 1024 < size_kb <= DEFAULT_DISK_MB * 1024
        assert sorted(host_mounts()) == before
        await asyncio.gather(*(sb.stop() for sb in boxes))
        refilled = await full_stock(stock(server))
        assert not refilled & names  # fresh disks, none given back
        assert len(attached_disks(stock(server))) == DEPTH
        assert sorted(host_mounts()) == before


async def test_neither_a_stop_nor_a_crash_leaves_anything_of_the_stock(server: Server) -> None:
    names = await full_stock(stock(server))
    assert len(attached_disks(stock(server))) == DEPTH
    server.kill(signal.SIGKILL)
    # the mounts went with the process's fds: the kernel unmounts, autoclear detaches
    deadline = time.monotonic() + 10
    while attached_disks(stock(server)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert attached_disks(stock(server)) == []
    server.start()
    again = await full_stock(stock(server))
    assert not again & names and set(stock(server).iterdir()) == {
        stock(server) / n for n in again}  # the dead server's files and mount points are gone
    async with server.client() as client:
        sb = await client.create(ttl_s=120)
        assert (await sb.run("echo alive")).stdout == "alive\n"
        await sb.stop()
    server.kill(signal.SIGTERM)  # (the volume is unmounted too, since nothing holds it)
    assert attached_disks(stock(server)) == [] and list(stock(server).glob("*")) == []


async def test_the_warm_pools_spawns_leave_the_stock_to_callers(images: ImageStore) -> None:
    srv = make_server("--capacity", "16", "--warm-pool", "3").start()
    try:
        async with srv.client() as client:
            await (await client.create(ttl_s=60)).stop()  # cold; the image gets a pool
            names = await full_stock(stock(srv))
            for _ in range(2):  # the pool filled, then its three claimed and spawned again
                deadline = time.monotonic() + 60
                while await warm_count(client, "container") < 3 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert await warm_count(client, "container") == 3
                assert stocked(srv) == names
                claimed = [await client.create(ttl_s=60) for _ in range(3)]
                await asyncio.gather(*(sb.stop() for sb in claimed))
    finally:
        stop_server(srv)


def test_a_stocked_disk_gives_no_device_node_or_set_uid_file_more_than_an_attached_one(
        tmp_path: Path) -> None:
    """What a sandbox leaves on its disk, a device node or a set-uid file, is nothing through
    the disk's mount: a stocked disk's mount is nosuid and nodev like an attached one's. (The
    node is made here by root, standing in for a runtime that would let a sandbox make one.)"""
    disks = DiskPool(tmp_path / "disks", (64,))
    disks.prepare()
    stocked_disks = DiskStock(disks, tmp_path / "stock", 64, depth=1)
    stocked_disks.prepare()

    def mounted(how: str) -> tuple[list[str], bool]:
        """The disk's mount options, and whether a node on it opened, in a sandbox's namespace."""
        namespace, dev = new_private(), None
        image, target = tmp_path / f"{how}.img", tmp_path / how
        try:
            dev = (stocked_disks.take(image, target, 64, namespace) if how == "stocked"
                   else disks.attach(image, target, 64, namespace))
            assert dev is not None
            with inside(namespace), open("/proc/thread-self/mountinfo") as table:
                options = next(line.split()[5] for line in table
                               if line.split()[4] == str(target)).split(",")
                os.mknod(target / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
                try:
                    os.close(os.open(target / "null", os.O_RDONLY))
                except PermissionError:
                    return options, False
                return options, True
        finally:
            os.close(namespace)
            if dev is not None:
                wait_detached(dev, image)

    try:
        with ThreadPoolExecutor(1, initializer=own_fs) as sandbox_thread:
            for how in ("stocked", "attached"):
                options, opened = sandbox_thread.submit(mounted, how).result()
                assert {"nosuid", "nodev"} <= set(options) and not opened, how
    finally:
        stocked_disks.close()
