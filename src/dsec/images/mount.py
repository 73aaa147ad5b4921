"""Mounting image layers: EROFS layers once per node, an overlay stack per sandbox.

The overlay mount sits on the sandbox create path, so it is a direct mount(2) call through
ctypes (about 0.3 ms) rather than the ``mount`` command (about 2 ms of fork/exec).

A layer's files were made by sandboxes (a Dockerfile RUN, a pulled image): setuid-root
programs among them. Sandboxes run them with no new privileges, but the host runs its own
mount of a layer as it finds it, so EROFS layers are mounted ``nosuid,nodev`` and under a
directory only root may enter (``private_dir``): no local user of the host runs a layer's
setuid program as root, or reads a project's image files through the node's mounts.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import stat
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.config import current
from dsec.images.node_cache import node_copy
from dsec.protocol.errors import NotSupported

if TYPE_CHECKING:
    from dsec.images.store import Image, Layer

log = logging.getLogger(__name__)

_MNT_DETACH = 2
_MS_NOSUID, _MS_NODEV = 2, 4
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Every upper must stay a self-contained diff (it becomes a layer, or a snapshot): no
# metadata-only copy-ups or directory redirects pointing into the lower layers.
_SELF_CONTAINED_UPPER = ("index=off", "redirect_dir=off", "metacopy=off")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def private_dir(path: Path) -> Path:
    """``path`` as a directory only root may enter (made if missing, its mode set if not:
    a store or cache made before this held its layers open to every local user). A mode
    that cannot be set (a shared store this node only reads) is left as it is, logged."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if stat.S_IMODE(path.stat().st_mode) != 0o700:
            path.chmod(0o700)
    except OSError as exc:
        log.warning("could not make %s private to root: %s", path, exc)
    return path


def kernel_supports(fstype: str) -> bool:
    """Whether the running kernel can mount ``fstype`` (it is listed in /proc/filesystems)."""
    with open("/proc/filesystems") as f:
        return any(line.split()[-1] == fstype for line in f if line.strip())


def overlay_options(lowerdirs: Sequence[Path], upper: Path, work: Path) -> str:
    """The overlay mount data for ``lowerdirs`` (top first); ValueError for a path it cannot
    name, NotSupported for more layers than one mount takes."""
    for path in (*lowerdirs, upper, work):
        if any(c in str(path) for c in ",:\\"):
            raise ValueError(f"overlay paths must not contain ',', ':' or '\\': {path}")
    options = ",".join(
        (
            f"lowerdir={':'.join(map(str, lowerdirs))}",
            f"upperdir={upper}",
            f"workdir={work}",
            *_SELF_CONTAINED_UPPER,
        )
    )
    if len(options.encode()) >= _PAGE_SIZE:  # an image's to make (a build of many steps): typed
        raise NotSupported(
            f"an image of {len(lowerdirs)} layers cannot be mounted here: the overlay mount "
            f"options are {len(options)} bytes, the kernel takes at most {_PAGE_SIZE - 1}: "
            f"use fewer layers (fewer steps) or a shorter layer cache directory",
            layers=len(lowerdirs))
    return options


def overlay_mount(lowerdirs: Sequence[Path], upper: Path, work: Path, target: Path) -> None:
    """Mount an overlay of ``lowerdirs`` (top first) with a writable ``upper`` at ``target``."""
    data = overlay_options(lowerdirs, upper, work).encode()
    if _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, data) != 0:
        raise _os_error(f"mount overlay on {target}")


def tmpfs_mount(target: Path, size_bytes: int) -> None:
    """Mount a tmpfs of at most ``size_bytes`` at ``target`` (nosuid, nodev)."""
    data = f"size={size_bytes},mode=0755".encode()
    if _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV, data) != 0:
        raise _os_error(f"mount tmpfs on {target}")


def unmount(target: Path, lazy: bool = False) -> None:
    """Unmount ``target``; ``lazy`` detaches it even while still in use (MNT_DETACH)."""
    if _libc.umount2(os.fsencode(target), _MNT_DETACH if lazy else 0) != 0:
        raise _os_error(f"unmount {target}")


def unmount_or_detach(target: Path) -> None:
    """Unmount ``target``; if it is still in use, detach it now (it is freed when its last
    user goes)."""
    try:
        unmount(target)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        unmount(target, lazy=True)


def mountpoints() -> set[Path]:
    """Mount points of this process's mount namespace, from /proc/self/mountinfo."""
    with open("/proc/self/mountinfo") as f:
        return {Path(_unescape(line.split(" ", 5)[4])) for line in f}


@contextmanager
def locked(path: Path, shared: bool = False, wait_s: float | None = None) -> Iterator[None]:
    """Hold a flock on ``path`` (created if missing), exclusive unless ``shared``; works across
    processes. With ``wait_s``, raise ``TimeoutError`` if it is not had within that time."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, mode if deadline is None else mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{path} is held by another process") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


class LayerMounter:
    """Makes an image's layers available as read-only directories on this node.

    EROFS layers are loop-mounted once per node at ``cache_dir/<digest>`` and stay mounted
    for every later sandbox; directory layers are used where they are.
    """

    def __init__(self, cache_dir: Path | None = None) -> None:
        # Resolved, so paths compare equal to the ones in /proc/self/mountinfo.
        self.cache_dir = Path(cache_dir or current().state_dir / "layers").resolve()
        # Layers this mounter has seen mounted: they stay mounted until unmount_all(), so the
        # sandbox create path need not parse /proc/self/mountinfo (long on a busy node) again.
        self._known: set[Path] = set()

    def lowerdirs(self, image: Image) -> list[Path]:
        """The image's layer directories top→bottom, ready for an overlay ``lowerdir=``. Fast
        once the image's layers are mounted; the first call per layer mounts it."""
        targets = [self._target(layer) for layer in reversed(image.layers)]
        if all(t in self._known for t in targets if t is not None):
            return [t or layer.path for t, layer in zip(targets, reversed(image.layers), strict=True)]
        mounted = mountpoints()
        dirs = [
            self._mount(layer, mounted) if layer.format == "erofs" else layer.path
            for layer in reversed(image.layers)
        ]
        self._known.update(t for t in targets if t is not None)
        return dirs

    def _target(self, layer: Layer) -> Path | None:
        return self.cache_dir / layer.digest.removeprefix("sha256:") if layer.format == "erofs" else None

    def unmount_all(self) -> list[Path]:
        """Unmount every layer mounted under ``cache_dir``; returns those still busy."""
        busy = []
        self._known.clear()
        for target in sorted(p for p in mountpoints() if p.parent == self.cache_dir):
            try:
                unmount(target)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                busy.append(target)  # a sandbox still uses it
            else:
                target.rmdir()
        return busy

    def _mount(self, layer: Layer, mounted: set[Path]) -> Path:
        target = self.cache_dir / layer.digest.removeprefix("sha256:")  # == self._target(layer)
        private_dir(self.cache_dir)  # also where an older server left its layers mounted
        if target in mounted:
            return target
        if not kernel_supports("erofs"):
            raise NotSupported(f"layer {layer.digest} is EROFS, but this kernel cannot mount erofs")
        with locked(target.with_name(target.name + ".lock")):
            if target not in mountpoints():  # another process may have mounted it meanwhile
                target.mkdir(exist_ok=True)
                mount_erofs(node_copy(layer.path), target)  # a local copy if configured
                log.info("mounted layer %s at %s", layer.digest, target)
        return target


def mount_erofs(image_file: Path, target: Path) -> None:
    """Loop-mount an EROFS image read-only, its setuid bits and devices inert on the host (a
    one-off per layer and node, so the command is fine)."""
    result = subprocess.run(
        ["mount", "-t", "erofs", "-o", "ro,loop,nosuid,nodev", str(image_file), str(target)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise OSError(f"mount erofs {image_file} on {target}: {result.stderr.strip()}")


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")
