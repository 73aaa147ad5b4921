"""A stock of fresh disks, each already mounted in a mount namespace of its own: what a cold
create of the default disk size takes instead of attaching a disk on its path.

Attaching a sandbox's disk (``host/disk.py``: a clone of the golden image, a loop device
configured over it, its ext4 file system mounted) and making the namespace it is mounted in
(``spaces.py``) take 2–3 ms of every cold create, ahead of its runtime's start. A stocked disk
has had all of it done: a create renames its image file into the sandbox's bundle dir, moves
its mount (``MS_MOVE``, inside its namespace) onto the bundle's ``disk`` dir, and the namespace
becomes the sandbox's ``MountSpace``. One thread refills the stock behind the takes, one disk
at a time, once no disk was taken for ``QUIET_S``: off every create's path; a burst that
empties it attaches its disks as before.

A disk is stocked fresh and is never given back: what one sandbox wrote never reaches another.
The quota is the same: a stocked disk is the same file system of ``DEFAULT_DISK_MB``.

Nothing of the stock is in the host's mount table, and nothing but this process's fds holds
its namespaces: if the server dies, the kernel drops their mounts and autoclear detaches the
loop devices; the next start deletes the image files and empty mount points left in the
stock's directory (dsec's own: no sandbox can write there).
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
from ..host.loop import wait_detached
from ..host.mountns import inside, move_mount, new_private, own_fs

log = logging.getLogger("dsec.disk_stock")

DEPTH = 8  # disks kept mounted: a few creates in a row, and a small burst's first
# A refill waits until no disk was taken for this long: a mount takes the kernel's mount lock,
# which the creates under way need for their overlays, so the stock refills after a burst,
# not during it (creates that find it empty attach their disks themselves, as before).
QUIET_S = 0.05


@dataclass
class Stocked:
    """A fresh disk: its image file, mounted at ``mount`` in ``namespace`` through ``dev``."""

    namespace: int
    image: Path
    mount: Path
    dev: str


class DiskStock:
    """Up to ``depth`` fresh ``size_mb`` disks of ``disks``, mounted, in ``directory``."""

    def __init__(self, disks: DiskPool, directory: Path, size_mb: int, depth: int = DEPTH) -> None:
        self.disks, self.dir, self.size_mb, self.depth = disks, directory, size_mb, depth
        self._ready: list[Stocked] = []
        self._lock = threading.Lock()
        self._closed = False
        self._last_take = 0.0
        # one disk at a time, in a thread that may enter namespaces (mountns.own_fs)
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="dsec-disk-stock",
                                          initializer=own_fs)

    def prepare(self) -> None:
        """Remove what a server that died left (image files; mount points, empty since its
        namespaces went with it), then fill the stock (blocking)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for entry in self.dir.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                try:
                    entry.rmdir()
                except OSError as exc:  # never emptied by recursion: left, and said
                    log.warning("disk stock: %s left in place: %s", entry, exc.strerror)
            else:
                entry.unlink(missing_ok=True)
        for _ in range(self.depth):
            self._filler.submit(self._fill).result()

    def take(self, image: Path, target: Path) -> tuple[int, str] | None:
        """A stocked disk made ``image`` and mounted at ``target`` (a new dir) in its
        namespace: (that namespace's fd, now the caller's, and the loop device's name); None
        when the stock is empty. A disk that fails to move is dropped, and None is returned."""
        with self._lock:
            if not self._ready:
                return None
            disk = self._ready.pop()
            self._last_take = time.monotonic()
            self._filler.submit(self._fill)  # under the lock: never after close's shutdown
        try:
            os.rename(disk.image, image)
            target.mkdir()
            with inside(disk.namespace):
                move_mount(disk.mount, target)
        except OSError as exc:
            log.warning("disk stock: %s could not be moved to %s (%s); the create attaches "
                        "a disk itself", disk.image, target, exc)
            self._drop(disk, image if image.exists() else disk.image)
            if target.is_dir():
                target.rmdir()
            return None
        disk.mount.rmdir()
        return disk.namespace, disk.dev

    def _fill(self) -> None:
        """One more disk in the stock once takes are quiet, unless it is full or closed; a
        failure is logged."""
        while (wait := self._last_take + QUIET_S - time.monotonic()) > 0 and not self._closed:
            time.sleep(wait)
        with self._lock:
            if self._closed or len(self._ready) >= self.depth:
                return
        name = secrets.token_hex(6)
        image, mount = self.dir / f"{name}.img", self.dir / f"{name}.mnt"
        namespace = new_private()
        try:
            dev = self.disks.attach(image, mount, self.size_mb, namespace)
        except OSError as exc:
            log.warning("disk stock: no disk made (%s); creates attach their own", exc)
            os.close(namespace)
            image.unlink(missing_ok=True)
            if mount.is_dir():
                mount.rmdir()
            return
        disk = Stocked(namespace, image, mount, dev)
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
        """The disk's namespace closed (the kernel unmounts its file system, and autoclear
        detaches the device), then its file and mount point removed."""
        os.close(disk.namespace)
        wait_detached(disk.dev, image)
        image.unlink(missing_ok=True)
        if disk.mount.is_dir():
            disk.mount.rmdir()
