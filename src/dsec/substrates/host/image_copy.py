"""Copies of a sandbox's disk image (disk.py) for snapshots: O(1) where the host file system
shares blocks, else reading only the blocks the image uses.

A disk image is a sparse file of ``disk_mb`` of which a sandbox has usually written little.
On xfs and btrfs, ``FICLONE`` makes the copy share every block (copy-on-write, no data
read). Other file systems (ext4, tmpfs) refuse it; then the copy walks the image's data
extents (``SEEK_DATA``/``SEEK_HOLE``) and copies only those with ``copy_file_range``, so
holes stay holes and a copy costs the bytes the sandbox wrote, never ``disk_mb``. Which way a
copy went is returned, for the logs and the benchmark.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Literal

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
# What FICLONE answers on a file system that cannot share blocks (or across two of them).
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.EXDEV, errno.ENOSYS}
CHUNK = 1 << 30

Method = Literal["clone", "sparse"]


def copy_image(src: Path, dst: Path) -> Method:
    """``dst`` (new) becomes a copy of ``src``, of the same size; on failure no ``dst`` is left."""
    fd_in = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.ioctl(fd_out, FICLONE, fd_in)
                return "clone"
            except OSError as exc:
                if exc.errno not in _NO_CLONE:
                    raise
            _sparse_copy(fd_in, fd_out)
            return "sparse"
        except BaseException:
            os.unlink(dst)
            raise
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _sparse_copy(fd_in: int, fd_out: int) -> None:
    size = os.fstat(fd_in).st_size
    os.ftruncate(fd_out, size)
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd_in, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                return
            raise
        end = os.lseek(fd_in, start, os.SEEK_HOLE)
        pos = start
        while pos < end:
            n = os.copy_file_range(fd_in, fd_out, min(end - pos, CHUNK), pos, pos)
            if n == 0:
                raise OSError(errno.EIO, "the disk image shrank while it was copied")
            pos += n
        offset = end


def allocated_bytes(path: Path) -> int:
    """Bytes the file holds on the host (its blocks, not its apparent size)."""
    return os.stat(path).st_blocks * 512
