"""Per-sandbox disk quota: each sandbox's writable layer is its own ext4 file system in a
loop-mounted sparse file of ``disk_mb``.

The kernels dsec runs on may lack quota support (no project quotas on an overlay's upper
directory), so a file system per sandbox is the limit that always works: a sandbox that fills
its disk gets ENOSPC and the host's disk is untouched.

Formatting is kept off the create path by one formatted *golden* image per pooled size (the
default ``disk_mb``), made once per volume: a sandbox's disk is a clone of it (``clone_file``:
one FICLONE on the reflink volume, 0.1 ms, sharing every block; a sparse copy of the few
hundred KiB mkfs wrote elsewhere). Other sizes are formatted on demand. No spare files are
kept: a clone is as fast as taking one. What a create does wait for is the loop device and
the mount (``attach``): the container substrate keeps a few disks of the default size
attached and mounted ahead (``container/disk_stock.py``, which makes them with ``fresh``).

Every fresh disk already holds the directories its substrate lays out on it (``skeleton``:
mkfs writes them), so a create makes none: a ``mkdir`` on a fresh file system reads its
bitmaps and inode table through the loop device, 0.75 ms of a cold create and about 1.8 ms of
thread time per create when 3,000 sandboxes fill a node. A golden image's name carries a
digest of its format and skeleton: one made by another version is replaced, never cloned.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import subprocess
import tempfile
import threading
from pathlib import Path

from .image_copy import clone_file
from .loop import loop_mount

log = logging.getLogger("dsec.disk")

# No journal (a sandbox's layer does not outlive a host crash), no reserved blocks (disk_mb is
# what the sandbox gets), no discard pass over the sparse file, and inode tables taken as
# zeroed (a sparse file reads zeros), so no lazy-init thread writes them in every sandbox.
MKFS = ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
        "-E", "nodiscard,assume_storage_prezeroed=1"]


class DiskPool:
    """New formatted disk files: clones of a golden image per pooled size, else a mkfs."""

    def __init__(self, disk_dir: Path, sizes: tuple[int, ...], skeleton: tuple[str, ...] = ()) -> None:
        """``skeleton``: the directories (relative paths) every fresh disk holds."""
        self.dir = disk_dir
        self.sizes = sizes
        self.skeleton = skeleton
        self._format = hashlib.sha256(repr((MKFS, skeleton)).encode()).hexdigest()[:12]
        self._lock = threading.Lock()  # one mkfs of a golden image at a time

    def prepare(self) -> None:
        """Drop files a crash left half-made, golden images of another format or skeleton,
        and the spares of dsec versions that kept them (the directory is dsec's own: no
        sandbox writes there); a finished golden image is kept for reuse, the missing ones
        are made."""
        self.dir.mkdir(parents=True, exist_ok=True)
        current = {self._golden_path(size_mb).name for size_mb in self.sizes}
        for entry in self.dir.iterdir():
            if entry.name not in current and entry.is_file():
                entry.unlink(missing_ok=True)
        for size_mb in self.sizes:
            self.golden(size_mb)

    def _golden_path(self, size_mb: int) -> Path:
        return self.dir / f"golden-{size_mb}mb-{self._format}.img"

    def golden(self, size_mb: int) -> Path:
        """The golden image of a pooled size, formatted the first time it is asked for."""
        path = self._golden_path(size_mb)
        with self._lock:
            if not path.exists():
                tmp = self.dir / f"golden-{size_mb}mb-{secrets.token_hex(4)}.tmp"
                format_image(tmp, size_mb, self.skeleton)
                os.rename(tmp, path)  # only a whole golden image is ever cloned
        return path

    def fresh(self, image: Path, size_mb: int) -> None:
        """A fresh ``size_mb`` file system at ``image`` (blocking)."""
        if size_mb in self.sizes:
            method = clone_file(self.golden(size_mb), image)
            log.debug("disk %s: a %s of the golden image", image, method)
        else:
            format_image(image, size_mb, self.skeleton)

    def attach(self, image: Path, target: Path, size_mb: int, namespace: int | None = None) -> str:
        """A fresh ``size_mb`` file system at ``image``, mounted at ``target`` (in the mount
        namespace ``namespace``, if given; blocking); the loop device's name."""
        self.fresh(image, size_mb)
        target.mkdir()
        return loop_mount(image, target, namespace=namespace)


def format_image(image: Path, size_mb: int, skeleton: tuple[str, ...] = ()) -> None:
    """A fresh file system in a new sparse file ``image``, holding the directories of
    ``skeleton`` (root's, 0755); on any failure, no file is left."""
    try:
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size_mb << 20)  # sparse: the host pays only for blocks written
        finally:
            os.close(fd)
        with tempfile.TemporaryDirectory(prefix="dsec-disk-") as staged:
            for rel in skeleton:
                (Path(staged) / rel).mkdir(parents=True, exist_ok=True)
            for parent, dirs, _ in os.walk(staged):  # 0755 whatever the umask
                for name in dirs:
                    os.chmod(os.path.join(parent, name), 0o755)
            done = subprocess.run([*MKFS, "-d", staged, str(image)], capture_output=True,
                                  text=True)
        if done.returncode != 0:
            raise OSError(f"mkfs.ext4 {image}: {done.stderr.strip()}")
    except BaseException:
        image.unlink(missing_ok=True)
        raise
