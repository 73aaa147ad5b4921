"""Whether a sandbox's disk has been written since a snapshot, without looking at its files.

A trajectory checkpoints after every step, and most steps (``exec true``, a read, a test
run that writes nothing) leave the disk as it was: copying it again would be wasted. The
block layer counts the sectors written to each device (``/sys/dev/block/MAJ:MIN/stat``, the
7th field; ext4's ``lifetime_write_kbytes`` is the same counter). After ``syncfs`` of the
disk's file system, every change made so far (data, metadata, mmap-ed pages) has been
written to the device and counted, so an equal count means an unchanged file system.

What the count must be compared with is taken while the snapshot is consistent: for a
FIFREEZE snapshot, read while frozen (nothing is written then). ext4 writes its superblock
at thaw (one block, synchronously, before the ioctl returns), so a count read after the
thaw that is exactly one block higher means nothing else was written in between, and is
the one to keep; anything else keeps the frozen count (the next comparison then differs
and takes a new snapshot: never a false "unchanged").

The disk is mounted ``relatime``: a read updates a file's atime (a write) only the first
time after the file changed, so a step that reads what an earlier step wrote costs one more
snapshot, and later reads none.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
SECTOR = 512
_WRITE_SECTORS_FIELD = 6  # Documentation/block/stat.rst: "write sectors"


def sync(fd: int) -> None:
    """Write out every dirty page and inode of the file system that ``fd`` is on."""
    if _libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def sectors_written(fd: int) -> int:
    """Sectors written so far to the block device of the file system ``fd`` is on."""
    dev = os.fstat(fd).st_dev
    with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat", "rb") as f:
        return int(f.read().split()[_WRITE_SECTORS_FIELD])


def synced_count(fd: int) -> int:
    """The count after every change so far has reached the device."""
    sync(fd)
    return sectors_written(fd)


def count_after_thaw(fd: int, frozen: int) -> int:
    """The count to compare later ones with, for a snapshot taken while the file system was
    frozen at count ``frozen`` and has just been thawed (see the module docstring)."""
    thawed = sectors_written(fd)
    return thawed if thawed - frozen == os.fstatvfs(fd).f_bsize // SECTOR else frozen
