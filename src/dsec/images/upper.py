"""A sandbox's writable upper directory, copied as a new image layer (a Dockerfile RUN step).

The upper directory of an overlay is already a layer in the store's own form (overlay
whiteouts: char 0:0 devices and the ``trusted.overlay.opaque`` xattr), but its every name,
link and byte was made by hostile code. So the copy:

- walks by directory file descriptor, opening each name with ``O_NOFOLLOW`` relative to its
  parent: a symlink is copied as a symlink (its target is text, resolved only inside the
  sandboxes that mount the layer) and never followed on the host;
- keeps character devices 0:0 (overlay whiteouts) and drops every other device, fifo and
  socket: a layer never carries a device node a later sandbox could open. What it drops is
  logged once per layer (a count and the first names, quoted): one line each would let a
  RUN of 50,000 fifos write 50,000 lines to the server's log, a host file in no quota;
- keeps only the overlay's opaque xattr; a file named ``.wh.*`` is an ordinary file here;
- counts the bytes it copies (apparent sizes: a sparse file counts whole) against the
  sandbox's disk size, so a layer never holds more than the quota the step ran under;
- copies a file's data only, its holes left holes: a ``truncate -s 60G`` costs the step's
  disk nothing, and so costs the host's scratch nothing either (written out as zeros, it
  would have been the host's disk the step filled, past any quota);
- writes only under ``dest``, a fresh scratch directory of the store: nothing of the step
  reaches another layer or the host;
- refuses trees deeper than ``MAX_DEPTH`` directories, and drops every other xattr (file
  capabilities included), as a typed ``ImageBuildError``/by design, never a crash.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from dsec.protocol.errors import ImageBuildError

log = logging.getLogger(__name__)

OPAQUE = "trusted.overlay.opaque"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 1 << 20
MAX_DEPTH = 256  # directories deep: the walk holds a descriptor per level (and recurses)
MAX_NAMED = 10  # dropped entries named, in the log and to the build; the rest are counted


class _Dropped:
    """What the copy left out: how many, and the first ``MAX_NAMED`` paths."""

    def __init__(self) -> None:
        self.count = 0
        self.names: list[str] = []

    def add(self, path: str) -> None:
        self.count += 1
        if len(self.names) < MAX_NAMED:
            self.names.append(path)

    def listed(self) -> list[str]:
        more = self.count - len(self.names)
        return self.names + ([f"and {more} more"] if more else [])


class _Budget:
    def __init__(self, max_bytes: int) -> None:
        self.left = max_bytes
        self.max = max_bytes

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise ImageBuildError(f"the step's writable layer holds more than its disk "
                                  f"({self.max >> 20} MB): not kept as a layer")


def copy_upper(upper: Path, dest: Path, max_bytes: int, skip_top: tuple[str, ...] = ()) -> list[str]:
    """Copy the tree under ``upper`` into the new directory ``dest``; returns the names of
    what was dropped (devices, fifos, sockets: the first ``MAX_NAMED``, then how many more).
    ``skip_top`` names top-level entries that are the substrate's mount points, not the
    step's work."""
    dropped = _Dropped()
    src = os.open(upper, _DIR_FLAGS)
    try:
        os.mkdir(dest, 0o755)
        _copy_dir(src, dest, "", _Budget(max_bytes), {}, dropped, skip_top)
        _attributes(src, dest, is_dir=True)
    except OSError as exc:
        raise ImageBuildError(f"could not copy the step's writable layer: {exc}") from None
    finally:
        os.close(src)
    if dropped.count:  # the names are the sandbox's: quoted, so no newline starts a log line
        log.warning("layer from a writable layer: dropped %d devices, fifos or sockets (none "
                    "in layers): %s", dropped.count, ", ".join(map(repr, dropped.listed())))
    return dropped.listed()


def _copy_dir(src: int, dest: Path, rel: str, budget: _Budget, links: dict[tuple[int, int], Path],
              dropped: _Dropped, skip: tuple[str, ...]) -> None:
    for name in os.listdir(src):
        if name in skip:
            continue
        target = dest / name
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            if rel.count("/") >= MAX_DEPTH:
                raise ImageBuildError(f"the step's writable layer is more than {MAX_DEPTH} "
                                      "directories deep: not kept as a layer")
            child = os.open(name, _DIR_FLAGS, dir_fd=src)
            try:
                os.mkdir(target, 0o700)
                _copy_dir(child, target, f"{rel}/{name}", budget, links, dropped, ())
                _attributes(child, target, is_dir=True)
            finally:
                os.close(child)
        elif stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in links:
                os.link(links[key], target, follow_symlinks=False)
                continue
            _copy_file(src, name, target, budget)
            if st.st_nlink > 1:
                links[key] = target
        elif stat.S_ISLNK(mode):
            budget.take(st.st_size)
            os.symlink(os.readlink(name, dir_fd=src), target)
            os.lchown(target, st.st_uid, st.st_gid)
            os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
        elif stat.S_ISCHR(mode) and st.st_rdev == 0:
            os.mknod(target, stat.S_IFCHR | 0o000, 0)  # an overlay whiteout
            os.lchown(target, st.st_uid, st.st_gid)
        else:
            dropped.add(f"{rel}/{name}")


def _copy_file(src: int, name: str, target: Path, budget: _Budget) -> None:
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=src)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link since the stat: the tree is frozen,
            raise ImageBuildError(f"{name!r} changed while its layer was copied") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageBuildError(f"{name!r} changed while its layer was copied")
        budget.take(st.st_size)
        out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600)
        try:
            _copy_data(fd, out, st.st_size)
        finally:
            os.close(out)
        _attributes(fd, target, is_dir=False)
    finally:
        os.close(fd)


def _copy_data(fd: int, out: int, size: int) -> None:
    """The data extents of ``fd`` at their offsets in ``out``, then ``out`` cut to ``size``:
    the holes between (and after) them stay holes."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break  # nothing but a hole to the end
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        os.lseek(out, start, os.SEEK_SET)
        while start < end:
            sent = os.sendfile(out, fd, start, min(end - start, _CHUNK))
            if sent == 0:
                break  # shorter than its stat said: it cannot grow (frozen), so it shrank
            start += sent
        offset = end
    os.ftruncate(out, size)


def _attributes(fd: int, target: Path, is_dir: bool) -> None:
    """Owner, mode (set-id bits included: sandboxes run with no new privileges), times, and
    for a directory the opaque xattr."""
    st = os.fstat(fd)
    os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
    os.chmod(target, stat.S_IMODE(st.st_mode))  # a directory or file this copy made
    if is_dir:
        try:
            value = os.getxattr(fd, OPAQUE)
        except OSError:
            value = None
        if value == b"y":
            os.setxattr(target, OPAQUE, b"y", follow_symlinks=False)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
