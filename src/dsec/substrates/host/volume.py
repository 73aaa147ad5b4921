"""The one reflink file system an edge keeps its disk images on (design B of
docs/design/WRITABLE_LAYER.md).

Why: a sandbox's writable layer is an ext4 image (disk.py), and a new disk, a snapshot, a
sandbox made from one, a fork and a rollback are each a copy of an image. On a file system
that shares blocks (XFS with reflink, btrfs) that copy is one FICLONE, O(extents), reading and
writing no data (``image_copy.clone_file``); on the host's ext4 it copies every block written.
So the edge keeps ``sandboxes/``, ``disks/`` (golden images) and ``snapshots/`` under the
``root`` of one such volume, chosen by the ``disk_volume`` setting:

- ``auto`` (the default): ``<state>/volume``. A plain directory when the state directory's
  own file system reflinks; otherwise the mount point of an XFS file system (``mkfs.xfs -m
  reflink=1``) made once in the sparse file ``<state>/volume.xfs`` and loop-mounted with
  ``discard`` (freed extents are punched out of the file, so the host pays only for blocks in
  use). A volume still mounted (sandboxes outlive the edge process) is reused as it is; after
  a reboot the file is mounted again, never formatted again.
- a directory: the operator's reflink file system (``<dir>/<edge id>``); refused if it cannot
  clone.
- ``off``: the state directory as it is (copies cost the bytes written; snapshots freeze the
  sandbox's file system instead, container.py).

The volume is unmounted when the edge closes with nothing on it in use (the kernel says so:
the unmount is refused while a sandbox's disk is attached), so a server stopped with no
sandboxes leaves no mount and no loop device.

Room: a sparse volume is bigger than what its host file system can hold, and a full host file
system would fail the volume's own writes (XFS shuts down on a failed metadata write). So a
create or snapshot is refused (``CapacityExhausted``) while the volume, or the file system
under its file, has less free space than the sandbox's whole disk plus a reserve.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ...images.mount import kernel_supports, unmount
from ...protocol.errors import CapacityExhausted, NotSupported
from .image_copy import reflinks
from .loop import (
    backing_file,
    holder,
    loop_mount,
    mount_device,
    mounted_loop,
    wait_detached,
)

log = logging.getLogger("dsec.volume")

AUTO, OFF = "auto", "off"
VOLUME_DIR, VOLUME_FILE = "volume", "volume.xfs"
# A fixed 64 MiB log: mkfs zeroes the log, and its default grows with the size (512 MiB
# written at 1 TiB); the volume's metadata traffic is a few files per sandbox.
MKFS_XFS = ["mkfs.xfs", "-q", "-m", "reflink=1", "-l", "size=64m"]
XFS_OPTIONS = "discard"
RESERVE_BYTES = 512 << 20
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Room:
    """Free bytes of one file system the volume depends on."""
    what: str
    path: Path
    free: int


def refusal(rooms: list[Room], need: int, reserve: int = RESERVE_BYTES) -> str | None:
    """Why a sandbox needing up to ``need`` bytes must be refused, or None if it fits."""
    for room in rooms:
        if room.free < need + reserve:
            return (f"the {room.what} ({room.path}) has {room.free >> 20} MiB free, less than "
                    f"the {need >> 20} MiB disk plus a {reserve >> 20} MiB reserve")
    return None


class DiskVolume:
    def __init__(self, state_dir: Path, edge_id: str, setting: str = AUTO,
                 size_gb: int = 1024) -> None:
        self.state_dir = state_dir
        self.setting = setting
        self.size_gb = size_gb
        if setting == AUTO:
            self.root = state_dir / VOLUME_DIR
        elif setting == OFF:
            self.root = state_dir
        else:
            self.root = Path(setting) / edge_id
        self.file = state_dir / VOLUME_FILE  # only in auto mode, when the state dir cannot clone
        self.reflinks = False  # known once open
        self.file_backed = False  # whether root is the mount of ``file`` (known once open)

    def _mounted_here(self) -> bool:
        """Whether ``root`` is the mount of this edge's volume file now."""
        dev = mounted_loop(self.root)
        return dev is not None and backing_file(dev) == os.path.realpath(self.file)

    def open(self) -> str:
        """Make the volume ready (blocking; at edge start); how it was found, for the log."""
        if self.setting == OFF:
            self.root.mkdir(parents=True, exist_ok=True)
            how = "off: images on the state directory as it is"
        elif self.setting != AUTO:
            if not self.root.parent.is_dir():
                raise NotSupported(f"--disk-volume {self.root.parent} is not a directory")
            if not reflinks(self.root.parent):
                raise NotSupported(f"--disk-volume {self.root.parent} cannot clone files "
                                   "(FICLONE): name a directory on XFS (reflink=1) or btrfs, "
                                   "or use 'auto'")
            self.root.mkdir(exist_ok=True)
            how = f"the operator's directory {self.root}"
        elif self._mounted_here():
            how = f"reused, still mounted at {self.root}"
        elif self.file.exists():
            self._mount()
            how = f"{self.file} mounted again at {self.root}"
        else:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            if reflinks(self.state_dir):
                self.root.mkdir(exist_ok=True)
                how = f"the state directory clones: {self.root} is a plain directory"
            else:
                self._make()
                self._mount()
                how = f"made {self.file} ({self.size_gb} GiB sparse XFS), mounted at {self.root}"
        self.file_backed = self._mounted_here()
        self.reflinks = reflinks(self.root)
        log.info("disk volume: %s; copies of images are %s", how,
                 "clones (FICLONE)" if self.reflinks else "data copies")
        return how

    def _make(self) -> None:
        """A new XFS file system in ``volume.xfs``, whole or not at all."""
        if shutil.which("mkfs.xfs", path=SBIN_PATH) is None or not kernel_supports("xfs"):
            raise NotSupported("the disk volume needs XFS (the xfsprogs package and the xfs "
                               "kernel module); install them, or serve with --disk-volume off "
                               "(copies of disk images then cost the bytes written)")
        tmp = self.file.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        try:
            with open(tmp, "wb") as f:
                f.truncate(self.size_gb << 30)
            done = subprocess.run([*MKFS_XFS, str(tmp)], capture_output=True, text=True)
            if done.returncode != 0:
                raise OSError(f"mkfs.xfs {tmp}: {done.stderr.strip()}")
            os.rename(tmp, self.file)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _mount(self) -> None:
        """Mount the volume file at ``root``. If a loop device still holds the file, its file
        system is still alive: unmounted here, but kept by a mount namespace made while it was
        mounted (a process that unshared then). That device is mounted again, the same
        superblock: a second device would be a second XFS of the same UUID, which the kernel
        refuses (EINVAL), and two live superblocks over one file would corrupt it."""
        self.root.mkdir(exist_ok=True)
        dev = holder(self.file)
        if dev is not None:
            try:
                mount_device(dev, self.root, "xfs", XFS_OPTIONS)
                log.info("disk volume %s: its file system was still alive on %s (kept by "
                         "another mount namespace); mounted that device again", self.root, dev)
                return
            except OSError as exc:  # detached meanwhile (its last holder went): a new device
                if holder(self.file) is not None:
                    raise
                log.info("disk volume %s: %s detached while mounting it (%s)", self.root, dev,
                         exc.strerror)
        loop_mount(self.file, self.root, "xfs", XFS_OPTIONS)

    def close(self) -> None:
        """Unmount the volume if nothing on it is in use (blocking); it stays mounted while
        sandboxes live on it, for the next edge to adopt them."""
        dev = mounted_loop(self.root) if self.setting == AUTO else None
        if dev is None or backing_file(dev) != os.path.realpath(self.file):
            return
        try:
            unmount(self.root)
        except OSError as exc:
            log.info("disk volume %s stays mounted: %s", self.root, exc.strerror)
            return
        self.file_backed = False
        wait_detached(dev, self.file)

    def rooms(self) -> list[Room]:
        rooms = [Room("disk volume", self.root, _free(self.root))]
        if self.file_backed:
            rooms.append(Room("file system under the disk volume", self.state_dir,
                              _free(self.state_dir)))
        return rooms

    def check_room(self, need: int) -> None:
        """Refuse (CapacityExhausted) what may write ``need`` bytes more than there is room."""
        why = refusal(self.rooms(), need)
        if why is not None:
            raise CapacityExhausted(f"no room for another disk: {why}", need_bytes=need)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
