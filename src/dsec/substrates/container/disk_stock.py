"""A stock of fresh disks, each attached and mounted already, in no mount namespace yet: what a
cold create of the default disk size takes instead of attaching a disk on its path.

Attaching a sandbox's disk (``host/disk.py``: a clone of the golden image, a loop device
configured over it, its ext4 file system mounted) takes 2–3 ms of every cold create, ahead of
its runtime's start. A stocked disk has had all of it done: its file system is mounted with
the mount API (``host/loop.py``: ``loop_mount_detached``), a mount held by an fd and in no
namespace. A create renames the disk's image file into the sandbox's bundle dir and attaches
the mount at the bundle's ``disk`` dir inside the sandbox's new namespace (``spaces.py``). One
thread refills the stock, one disk at a time, once no disk was taken for ``QUIET_S``: off
every create's path; a burst that empties the stock attaches its disks as before. The warm
pool's spawns are on no caller's path: they attach their own and leave the stock to callers.

A disk is stocked fresh and never given back: what one sandbox wrote never reaches another.
The quota is the same: a stocked disk is the same file system of the same size.

Nothing of the stock is in any mount table, and nothing but this process's fds holds its
mounts: if the server dies, the kernel drops them and autoclear detaches the loop devices;
the next start deletes the image files left in the stock's directory (dsec's own: no sandbox
can write there).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..host.disk import DiskPool
from ..host.loop import attach_detached, loop_mount_detached, wait_detached
from ..host.mountns import inside

log = logging.getLogger("dsec.disk_stock")

DEPTH = 8  # disks kept mounted: a few creates in a row, and a small burst's first
# A refill waits until no disk was taken for this long: a mount takes the kernel's mount lock,
# which the creates under way need for their overlays, so the stock refills after a burst,
# not during it.
QUIET_S = 0.05


@dataclass
class Stocked:
    """A fresh disk: its image file, mounted through ``dev`` in the mount held by ``mount``."""

    mount: int
    image: Path
    dev: str


class DiskStock:
    """Up to ``depth`` fresh ``size_mb`` disks of ``disks``, mounted, their files in
    ``directory``."""

    def __init__(self, disks: DiskPool, directory: Path, size_mb: int, depth: int = DEPTH) -> None:
        self.disks, self.dir, self.size_mb, self.depth = disks, directory, size_mb, depth
        self._ready: list[Stocked] = []
        self._lock = threading.Lock()
        self._closed = False
        self._last_take = 0.0
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="dsec-disk-stock")

    def prepare(self) -> None:
        """Delete the image files a server that died left, then fill the stock (blocking)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for entry in self.dir.iterdir():
            if entry.is_file():
                entry.unlink(missing_ok=True)
        for _ in range(self.depth):
            self._filler.submit(self._fill).result()

    def take(self, image: Path, target: Path, size_mb: int, namespace: int) -> str | None:
        """A stocked disk made ``image`` and mounted at ``target`` (a new dir) in the mount
        namespace ``namespace``, from an ``own_fs`` thread: its loop device's name. None for
        another size than the stock's, when the stock is empty, or when the disk failed to
        move (it is dropped, and said). Its arguments are ``DiskPool.attach``'s."""
        with self._lock:
            if size_mb != self.size_mb or not self._ready:
                return None
            disk = self._ready.pop()
            self._last_take = time.monotonic()
            self._filler.submit(self._fill)  # under the lock: never after close's shutdown
        try:
            os.rename(disk.image, image)
            target.mkdir()
            with inside(namespace):
                attach_detached(disk.mount, target)
        except OSError as exc:
            log.warning("disk stock: %s could not become %s (%s); the create attaches a disk "
                        "itself", disk.image, image, exc)
            self._drop(disk, image if image.exists() else disk.image)
            if target.is_dir():
                target.rmdir()
            return None
        os.close(disk.mount)  # the namespace holds the mount now
        return disk.dev

    def _fill(self) -> None:
        """One more disk in the stock once takes are quiet, unless it is full or closed; a
        failure is logged (creates attach their own disks meanwhile)."""
        while (wait := self._last_take + QUIET_S - time.monotonic()) > 0 and not self._closed:
            time.sleep(wait)
        with self._lock:
            if self._closed or len(self._ready) >= self.depth:
                return
        image = self.dir / f"{secrets.token_hex(6)}.img"
        try:
            self.disks.fresh(image, self.size_mb)
            mount, dev = loop_mount_detached(image)
        except OSError as exc:
            log.warning("disk stock: no disk made (%s); creates attach their own", exc)
            image.unlink(missing_ok=True)
            return
        disk = Stocked(mount, image, dev)
        with self._lock:
            if not self._closed:
                self._ready.append(disk)
                return
        self._drop(disk, image)

    def close(self) -> None:
        """Let every stocked disk go and wait until its loop device let go of its file."""
        with self._lock:
            self._closed, ready, self._ready = True, self._ready, []
        self._filler.shutdown(wait=True, cancel_futures=True)
        for disk in ready:
            self._drop(disk, disk.image)

    @staticmethod
    def _drop(disk: Stocked, image: Path) -> None:
        """The disk's mount closed (the kernel unmounts its file system and autoclear detaches
        the device), then its file ``image`` removed."""
        os.close(disk.mount)
        wait_detached(disk.dev, image)
        image.unlink(missing_ok=True)
