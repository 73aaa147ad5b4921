"""Per-sandbox disk quota: each sandbox's writable layer is its own ext4 file system in a
loop-mounted sparse file of ``disk_mb``.

The kernels dsec runs on may lack quota support (no project quotas on an overlay's upper
directory), so a file system per sandbox is the limit that always works: a sandbox that fills
its disk gets ENOSPC and the host's disk is untouched. Formatting is kept off the create path
by a few spare, pre-formatted files of the pooled sizes (the default one), refilled in a
background thread; other sizes are formatted on demand. The loop device is set up with
autoclear, so unmounting the file system releases it; ``release`` also detaches any loop
device still backed by the file (a crash between set-up and mount).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import secrets
import struct
import subprocess
import threading
import time
from pathlib import Path

log = logging.getLogger("dsec.disk")

SPARES_PER_SIZE = 2
# No journal (a sandbox's layer does not outlive a host crash), no reserved blocks (disk_mb is
# what the sandbox gets), no discard pass over the sparse file.
MKFS = ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "nodiscard"]
RELEASE_TRIES = 2000
# linux/loop.h and linux/mount.h
LOOP_CTL_GET_FREE, LOOP_CONFIGURE, LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
_LOOP_INFO64_SIZE, _LO_FLAGS_OFFSET, _LO_FILE_NAME_OFFSET = 232, 52, 56
MS_NOSUID, MS_NODEV = 2, 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]


class DiskPool:
    """Formatted disk files of the pooled sizes, ready to be taken by a create."""

    def __init__(self, spare_dir: Path, sizes: tuple[int, ...]) -> None:
        self.dir = spare_dir
        self.sizes = sizes
        self._lock = threading.Lock()
        self._filling: set[int] = set()

    def prepare(self) -> None:
        """Drop spares a crash left half-made; finished spares are kept for reuse."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)

    def attach(self, image: Path, target: Path, size_mb: int) -> None:
        """A fresh ``size_mb`` file system at ``image``, mounted at ``target`` (blocking)."""
        if not self._take(size_mb, image):
            _format(image, size_mb)
        target.mkdir()
        loop_mount(image, target)
        self._refill(size_mb)

    def _take(self, size_mb: int, image: Path) -> bool:
        """Move a spare of ``size_mb`` to ``image``; under the lock, as creates run in threads."""
        with self._lock:
            for spare in self.dir.glob(f"{size_mb}mb-*.img"):
                os.rename(spare, image)
                return True
        return False

    def _refill(self, size_mb: int) -> None:
        with self._lock:
            if size_mb not in self.sizes or size_mb in self._filling:
                return
            self._filling.add(size_mb)
        threading.Thread(target=self._fill, args=(size_mb,), daemon=True,
                         name=f"dsec-disks-{size_mb}").start()

    def _fill(self, size_mb: int) -> None:
        try:
            while self._short_of_spares(size_mb):
                name = f"{size_mb}mb-{secrets.token_hex(4)}"
                tmp = self.dir / f"{name}.tmp"
                _format(tmp, size_mb)
                os.rename(tmp, self.dir / f"{name}.img")  # only whole spares are ever taken
        except Exception:
            log.exception("could not format a spare disk of %d MB", size_mb)
            with self._lock:
                self._filling.discard(size_mb)

    def _short_of_spares(self, size_mb: int) -> bool:
        """Whether the filler must make another spare; if not, it is done. Counted and marked
        done under the lock: a take between the count and the mark would otherwise find the
        filler still running, start none, and its spare would not be replaced."""
        with self._lock:
            short = len(list(self.dir.glob(f"{size_mb}mb-*.img"))) < SPARES_PER_SIZE
            if not short:
                self._filling.discard(size_mb)
            return short


def _format(image: Path, size_mb: int) -> None:
    """A fresh file system in a new sparse file ``image``; on any failure, no file is left."""
    try:
        with open(image, "wb") as f:
            f.truncate(size_mb << 20)  # sparse: the host pays only for blocks written
        done = subprocess.run([*MKFS, str(image)], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"mkfs.ext4 {image}: {done.stderr.strip()}")
    except BaseException:
        image.unlink(missing_ok=True)
        raise


def loop_mount(image: Path, target: Path) -> None:
    """Attach ``image`` to a free loop device with autoclear and mount it at ``target``, with
    ioctls and mount(2) rather than mount(8): a fork and exec less on the create path. The
    loop device is held open until the mount holds it, or autoclear would detach it at once."""
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        loop, dev = _free_loop(backing, image)
    finally:
        os.close(backing)
    try:
        if _libc.mount(dev.encode(), os.fsencode(target), b"ext4", MS_NOSUID | MS_NODEV, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {image} ({dev}) on {target}: {os.strerror(err)}")
    finally:
        os.close(loop)  # without a mount, the last close detaches the device (autoclear)


def _free_loop(backing: int, image: Path) -> tuple[int, str]:
    """An open, configured loop device over ``backing``; retries when another process
    configures the free device first."""
    info = bytearray(_LOOP_INFO64_SIZE)
    struct.pack_into("=I", info, _LO_FLAGS_OFFSET, LO_FLAGS_AUTOCLEAR)
    name = os.fsencode(image)[:63]
    info[_LO_FILE_NAME_OFFSET:_LO_FILE_NAME_OFFSET + len(name)] = name
    config = struct.pack("=II", backing, 0) + bytes(info) + bytes(64)
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(100):
            dev = f"/dev/loop{fcntl.ioctl(control, LOOP_CTL_GET_FREE)}"
            loop = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(loop, LOOP_CONFIGURE, config)
                return loop, dev
            except OSError as exc:
                os.close(loop)
                if exc.errno != errno.EBUSY:
                    raise
        raise OSError(errno.EBUSY, f"no free loop device for {image}")
    finally:
        os.close(control)


def loop_devices_of(image: Path) -> list[str]:
    """Loop devices whose backing file is ``image`` (from sysfs, without a fork). Sysfs names
    the file by its real path, so a state directory reached through a symlink still matches."""
    found = []
    target = os.path.realpath(image)
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            name = backing.read_text().strip().removesuffix(" (deleted)")
        except OSError:  # detached meanwhile
            continue
        if name == target:
            found.append("/dev/" + backing.parent.parent.name)
    return found


def release(image: Path) -> None:
    """Detach loop devices still backed by ``image`` (once its file system is unmounted), and
    wait until they are gone: an autoclear may still be under way when the unmount returns.
    Each device is detached once: on a device still open or mounted, ``losetup -d`` only sets
    autoclear and returns, so asking again would fork for nothing."""
    asked: set[str] = set()
    for _ in range(RELEASE_TRIES):
        devices = loop_devices_of(image)
        if not devices:
            return
        for dev in set(devices) - asked:
            subprocess.run(["losetup", "-d", dev], capture_output=True)
            asked.add(dev)
        time.sleep(0.002)
    log.warning("loop devices of %s still attached: %s", image, loop_devices_of(image))
