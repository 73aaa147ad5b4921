"""Snapshots usable on every node: a copy of each snapshot's file in a directory every node
reaches (the image store's shared mount in a cluster: NFS, 3FS), fetched into a node's own
state directory when a sandbox is made from it there.

A snapshot is taken on its sandbox's node (``<state>/snapshots/<id>/disk.img``), then exported
in the background: a sparse-aware copy (``image_copy.clone_file``: a clone where the two
directories share a file system) to ``tmp/`` of the shared directory, flushed, and renamed to
``<id>.img``, so a reader never sees half a file; its content digest and size are recorded
in the state store (``snapshot_exports``) only then. Any node fetches it the same way back
into its state directory and checks size and digest before it renames the copy into place:
a truncated or altered export (the shared directory is only as trusted as the mount) is
``SnapshotCorrupt`` and leaves nothing.

The digest is of the content, not of the layout: the file in 1 MiB blocks, a block that is
all zeros (a hole, or written zeros) hashed as such, every other block by its bytes. Copies
on two file systems lay holes out differently and still agree; only data blocks are read.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path

from ..protocol.errors import SnapshotCorrupt
from ..substrates.host.image_copy import clone_file

log = logging.getLogger("dsec.shared_snapshots")
BLOCK = 1 << 20
STALE_TMP_S = 3600.0  # a temp copy this old belongs to an export or fetch that a crash cut
_ZEROS = bytes(BLOCK)


class SharedSnapshots:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, snapshot_id: str) -> Path:
        return self.root / f"{snapshot_id}.img"

    def export(self, snapshot_id: str, local: Path) -> tuple[str, int]:
        """Copy ``local`` (a complete snapshot file) to the shared directory, whole or not at
        all; its digest and size. The copy is made in ``tmp/`` opened without following a
        link: a ``tmp`` someone else made a link (to a host directory) is refused, never
        written through."""
        tmp_dir = self.root / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        dir_fd = os.open(tmp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            tmp = Path(f"/proc/self/fd/{dir_fd}") / f"{snapshot_id}.{secrets.token_hex(4)}"
            clone_file(local, tmp)
            try:
                digest, size = content_digest(tmp), tmp.stat().st_size
                _fsync(tmp)
                os.rename(tmp, self.path(snapshot_id))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        finally:
            os.close(dir_fd)
        _fsync(self.root)
        return digest, size

    def fetch(self, snapshot_id: str, digest: str, size: int, dest: Path) -> None:
        """``dest`` (new) becomes the exported copy, checked against what was recorded. The
        copy is read only if it is a regular file, opened without following a link and
        without waiting (a FIFO put in its place would hold the fetch forever)."""
        tmp = dest.with_name(f".fetch-{secrets.token_hex(4)}")
        src = self._open_export(snapshot_id)
        try:
            clone_file(Path(f"/proc/self/fd/{src}"), tmp)  # that very file, not the name
        finally:
            os.close(src)
        try:
            found = tmp.stat().st_size
            if found != size or content_digest(tmp) != digest:
                raise SnapshotCorrupt(
                    f"snapshot {snapshot_id}'s exported copy does not match what was exported "
                    f"({found} bytes, {size} expected, or its content differs): refused",
                    snapshot=snapshot_id)
            os.rename(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _open_export(self, snapshot_id: str) -> int:
        """An fd on the exported copy; SnapshotCorrupt if it is missing or not a regular
        file (a link, a FIFO, a directory someone else made in the shared directory)."""
        try:
            fd = os.open(self.path(snapshot_id),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise SnapshotCorrupt(f"snapshot {snapshot_id}'s exported copy cannot be read from "
                                  f"{self.root}: {exc.strerror}", snapshot=snapshot_id) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SnapshotCorrupt(f"snapshot {snapshot_id}'s exported copy in {self.root} is "
                                  "not a regular file: refused", snapshot=snapshot_id)
        return fd

    def remove(self, snapshot_id: str) -> None:
        """The export gone; what cannot be unlinked there is left and logged (``_unlink``):
        a snapshot's delete never fails over the shared directory."""
        _unlink(self.path(snapshot_id), snapshot_id, [])

    def sweep(self, recorded: Callable[[str], bool], stale_after_s: float = STALE_TMP_S) -> list[str]:
        """Remove exports whose snapshot has no record (its delete ran where the export was
        not yet in place, or on a node that died), and temp copies older than
        ``stale_after_s`` (an export or fetch cut by a crash); the names removed. A snapshot
        is recorded before its export starts, so no export under way is taken."""
        removed: list[str] = []
        for path in self.root.glob("sn-*.img"):
            if not recorded(path.name.removesuffix(".img")):
                _unlink(path, path.name, removed)
        cutoff = time.time() - stale_after_s
        for path in (self.root / "tmp").glob("*"):
            try:
                if path.lstat().st_mtime < cutoff:
                    _unlink(path, f"tmp/{path.name}", removed)
            except FileNotFoundError:  # another node's sweep got there first
                pass
        return removed


def _unlink(path: Path, name: str, removed: list[str]) -> None:
    """Unlink ``path`` (a link itself, never what it names) and note ``name`` as removed.
    What cannot be unlinked (a directory someone else made in the shared directory) is left
    and logged: the sweep never walks it, and never fails the edge's start over it."""
    try:
        path.unlink()
    except FileNotFoundError:  # another node's sweep got there first
        return
    except OSError as exc:
        log.warning("left %s in the shared snapshot directory: %s", path, exc.strerror)
        return
    removed.append(name)


def content_digest(path: Path) -> str:
    """sha256 over the file's 1 MiB blocks: ``z`` for an all-zero block, else ``d`` and its
    sha256; then the size. Holes are skipped without being read."""
    outer = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        block = 0
        while block * BLOCK < size:
            try:
                data_at = os.lseek(fd, block * BLOCK, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                data_at = size  # only a hole is left
            for _ in range(block, min(data_at, size) // BLOCK):  # whole blocks of hole
                outer.update(b"z")
            block = max(block, data_at // BLOCK)
            if block * BLOCK >= size:
                break
            chunk = os.pread(fd, BLOCK, block * BLOCK)
            outer.update(b"z" if chunk == _ZEROS[:len(chunk)] else b"d" + hashlib.sha256(chunk).digest())
            block += 1
    finally:
        os.close(fd)
    outer.update(str(size).encode())
    return "sha256:" + outer.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
