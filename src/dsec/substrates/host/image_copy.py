"""Copies of disk images (a sandbox's, a VM's, a snapshot's, a golden one): ``clone_file``,
the one copy dsec makes of an image, O(extents) where the file system shares blocks.

A disk image is a sparse file of ``disk_mb`` of which a sandbox has usually written little.
On the edge's reflink volume (volume.py: XFS with reflink, or btrfs) ``FICLONE`` makes the
copy share every block (copy-on-write, no data read or written). Other file systems (ext4,
tmpfs), or two of them, refuse it; then the copy walks the image's data extents
(``SEEK_DATA``/``SEEK_HOLE``) and copies only those with ``copy_file_range``, so holes stay
holes and a copy costs the bytes written, never ``disk_mb``. That fallback is loud: a
warning names the file system that refused, the first time each one does, and the method
is returned for the caller's log and the benchmark.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
from pathlib import Path
from typing import Literal

log = logging.getLogger("dsec.clone")

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
# What FICLONE answers on a file system that cannot share blocks (or across two of them).
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.EXDEV, errno.ENOSYS}
CHUNK = 1 << 30
BUFFER = 4 << 20  # a copy through user space, between file systems, goes this much at a time

Method = Literal["clone", "sparse"]
_warned: set[tuple[int, int]] = set()  # (source device, destination device) pairs


def clone_file(src: Path, dst: Path) -> Method:
    """``dst`` (new, mode 0600) becomes a copy of ``src``, of the same size: ``"clone"`` when
    it shares ``src``'s blocks, ``"sparse"`` when they had to be copied. On failure no
    ``dst`` is left."""
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
                _warn_once(fd_in, fd_out, src, dst, exc)
            _sparse_copy(fd_in, fd_out)
            return "sparse"
        except BaseException:
            os.unlink(dst)
            raise
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _warn_once(fd_in: int, fd_out: int, src: Path, dst: Path, exc: OSError) -> None:
    pair = (os.fstat(fd_in).st_dev, os.fstat(fd_out).st_dev)
    if pair not in _warned:
        _warned.add(pair)
        log.warning("cannot clone %s to %s (%s): copying its data instead; this and later "
                    "copies between these file systems cost the bytes written (put them on a "
                    "reflink volume: --disk-volume)", src, dst, os.strerror(exc.errno or 0))


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
            n = _copy_range(fd_in, fd_out, min(end - pos, CHUNK), pos)
            if n == 0:
                raise OSError(errno.EIO, "the disk image shrank while it was copied")
            pos += n
        offset = end


def _copy_range(fd_in: int, fd_out: int, count: int, pos: int) -> int:
    """Up to ``count`` bytes at ``pos`` copied to the same place: in the kernel where it
    can (``copy_file_range``); through a buffer between two kinds of file system, which
    the kernel refuses (EXDEV: ext4 to XFS, the volume to a shared store)."""
    try:
        return os.copy_file_range(fd_in, fd_out, count, pos, pos)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    data = os.pread(fd_in, min(count, BUFFER), pos)
    written = 0
    while written < len(data):
        written += os.pwrite(fd_out, data[written:], pos + written)
    return len(data)


def reflinks(directory: Path) -> bool:
    """Whether files in ``directory`` can be cloned (FICLONE) into it: a probe with two
    small files, removed after."""
    probe = directory / f".reflink-probe-{secrets.token_hex(4)}"
    fd_in = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd_in, b"x" * 4096)
        fd_out = os.open(probe.with_suffix(".clone"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.ioctl(fd_out, FICLONE, fd_in)
            return True
        except OSError as exc:
            if exc.errno not in _NO_CLONE:
                raise
            return False
        finally:
            os.close(fd_out)
            os.unlink(probe.with_suffix(".clone"))
    finally:
        os.close(fd_in)
        os.unlink(probe)


def allocated_bytes(path: Path) -> int:
    """Bytes the file holds on the host (its blocks, not its apparent size; for a clone, the
    blocks it shares count too)."""
    return os.stat(path).st_blocks * 512
