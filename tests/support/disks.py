"""The host's trace of sandbox disks: the loop devices backed by their files. A container
sandbox's disk and overlay are mounted in a mount namespace of its own, never in the host's
table, so a leak check that reads the host's mounts alone would not see a disk left
attached: it looks at the loop devices too. The same goes for a server's disk stock
(``substrates/container/disk_stock.py``): its disks are mounted in no namespace at all."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from conftest import Server
from dsec.substrates.container.disk_stock import DEPTH


def attached_disks(sandboxes: Path) -> list[str]:
    """The files under ``sandboxes`` that a loop device is attached to."""
    root = str(sandboxes) + "/"
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            name = backing.read_text().strip()
        except OSError:  # detached while being read
            continue
        if name.startswith(root):
            found.append(name)
    return found


def bundle_with_mounts(server: Server, sandbox_id: str) -> Path:
    """A container sandbox's bundle dir with its disk and rootfs mounted, as its server sees
    it: through the server's fd on the dir opened in the sandbox's mount namespace (the
    host's table has neither mount)."""
    assert server.proc is not None, "the server runs"
    bundle = str(server.volume / "sandboxes" / sandbox_id)
    for fd in Path(f"/proc/{server.proc.pid}/fd").iterdir():
        try:
            if os.readlink(fd) == bundle:
                return fd
        except OSError:  # closed meanwhile
            continue
    raise AssertionError(f"server {server.proc.pid} holds no fd on {bundle}")


async def full_stock(stock: Path, timeout_s: float = 30) -> set[str]:
    """The image files of the disk stock in ``stock`` once it is full: ``DEPTH`` files, each
    attached, and no other file of it attached (an eventual state, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = {p.name for p in stock.glob("*.img")}
        if len(names) == DEPTH and sorted(attached_disks(stock)) == sorted(
                str(stock / n) for n in names):
            return names
        await asyncio.sleep(0.05)
    raise AssertionError(f"{stock}: {sorted(stock.glob('*'))}, {attached_disks(stock)}")
