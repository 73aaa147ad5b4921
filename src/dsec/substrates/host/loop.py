"""File systems in files, mounted through loop devices: a sandbox's disk image (disk.py) and
the edge's reflink volume (volume.py).

Attach and mount are ioctls and mount(2), never mount(8): ``mount -o loop`` scans every loop
device and grows steeply with their number (52 ms each at 3,000 in the design measurements),
the ioctl path stays at a few ms. Each device is configured with autoclear, so the unmount of
its file system detaches it, and a process that dies between attach and mount detaches it by
closing it: no loop device outlives its mount.

Teardown needs no scan of the other devices either: the mount is the record of its device
(the mounted root's ``st_dev`` is the loop device's number), so ``unmount_image`` reads it
from the mount point before unmounting and then waits on that one device's sysfs file until
its autoclear is done. That works the same after a crash, when nothing but the mount is left.

Nor does an attach, usually: ``LOOP_CTL_GET_FREE`` walks every loop device under the loop
driver's lock until an unbound one (at 3,000 sandboxes, 2.4 % of a node's CPU while it fills,
perf), so the devices this process saw unbound (listed once from sysfs, then each one its
teardown saw detach) are tried first; the kernel's walk is the fallback. A device another
process took meanwhile refuses the configure (EBUSY) and is dropped from the list.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import logging
import os
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ...images.mount import unmount_or_detach
from .mountns import inside

log = logging.getLogger("dsec.loop")

# linux/loop.h and linux/mount.h
LOOP_CTL_GET_FREE, LOOP_CONFIGURE, LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
LOOP_MAJOR = 7
_LOOP_INFO64_SIZE, _LO_FLAGS_OFFSET, _LO_FILE_NAME_OFFSET = 232, 52, 56
MS_NOSUID, MS_NODEV = 2, 4
# the mount API's calls (one number on every architecture) and flags
_MOVE_MOUNT, _FSOPEN, _FSCONFIG, _FSMOUNT = 429, 430, 431, 432
_MOUNT_API = {_MOVE_MOUNT: "move_mount", _FSOPEN: "fsopen", _FSCONFIG: "fsconfig", _FSMOUNT: "fsmount"}
_CLOEXEC, _FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 1, 6
_MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOVE_MOUNT_F_EMPTY_PATH, _AT_FDCWD = 2, 4, 4, -100
FS_IOC_SHUTDOWN, SHUTDOWN_NOLOGFLUSH = 0x8004587D, 2  # linux/fs.h: _IOR('X', 125, __u32)
DETACH_TIMEOUT_S = 4.0
TRIES_FROM_LIST = 8  # devices of the list tried per attach before the kernel's walk
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]


def loop_mount(image: Path, target: Path, fstype: str = "ext4", data: str | None = None,
               namespace: int | None = None) -> str:
    """Attach ``image`` to a free loop device with autoclear and mount it at ``target``
    (nosuid, nodev), in the mount namespace ``namespace`` (an fd) if given; the device's
    name (``loop12``). The image is opened in the calling thread's namespace, the host's, so
    the device's backing file keeps its host path (``holder``) whatever becomes of the
    other."""
    with _attached(image) as dev:
        with inside(namespace):
            mount_device(dev, target, fstype, data)
    return dev


def loop_mount_detached(image: Path, fstype: str = "ext4") -> tuple[int, str]:
    """Attach ``image`` as ``loop_mount`` does and mount it (nosuid, nodev) in no namespace
    yet: (an fd holding the mount, the device's name). ``attach_detached`` puts the mount
    in place; closing the fd before that unmounts it, and autoclear detaches the device."""
    with _attached(image) as dev:
        return detached_mount(dev, fstype), dev


@contextmanager
def _attached(image: Path) -> Iterator[str]:
    """``image`` on a free loop device with autoclear, meanwhile: the device is held open
    until a mount holds it, or autoclear would detach it at once."""
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        loop, dev = _free_loop(backing, image)
    finally:
        os.close(backing)
    try:
        yield dev
    finally:
        os.close(loop)  # without a mount, the last close detaches the device (autoclear)


def detached_mount(dev: str, fstype: str) -> int:
    """The file system on ``dev`` mounted (nosuid, nodev) in no namespace: an fd holding it
    (the mount API of Linux 5.2: fsopen, fsconfig, fsmount)."""
    fs = _mount_api(_FSOPEN, fstype.encode(), _CLOEXEC)
    try:
        _mount_api(_FSCONFIG, fs, _FSCONFIG_SET_STRING, b"source", f"/dev/{dev}".encode(), 0)
        _mount_api(_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0)
        return _mount_api(_FSMOUNT, fs, _CLOEXEC, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV)
    finally:
        os.close(fs)


def attach_detached(mount: int, target: Path) -> None:
    """The mount held by the fd ``mount`` (``detached_mount``) attached at ``target``, in the
    calling thread's mount namespace."""
    _mount_api(_MOVE_MOUNT, mount, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH)


def _mount_api(number: int, *args: int | bytes | None) -> int:
    result = _libc.syscall(ctypes.c_long(number), *(
        ctypes.c_long(a) if isinstance(a, int) else ctypes.c_char_p(a) for a in args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{_MOUNT_API[number]}: {os.strerror(err)}")
    return int(result)


def mount_device(dev: str, target: Path, fstype: str, data: str | None = None) -> None:
    """Mount the attached loop device ``dev`` at ``target`` (nosuid, nodev)."""
    if _libc.mount(f"/dev/{dev}".encode(), os.fsencode(target), fstype.encode(),
                   MS_NOSUID | MS_NODEV, data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {backing_file(dev)} ({dev}) on {target}: {os.strerror(err)}")


def holder(image: Path) -> str | None:
    """The loop device attached to ``image``, if any. Scans every loop device: for rare
    paths only (an edge's start), never per sandbox."""
    target = os.path.realpath(image)
    for entry in Path("/sys/block").glob("loop*"):
        if backing_file(entry.name) == target:
            return entry.name
    return None


def _free_loop(backing: int, image: Path) -> tuple[int, str]:
    """An open, configured loop device over ``backing`` and its name; retries when another
    process configures the free device first."""
    info = bytearray(_LOOP_INFO64_SIZE)
    struct.pack_into("=I", info, _LO_FLAGS_OFFSET, LO_FLAGS_AUTOCLEAR)
    name = os.fsencode(image)[:63]
    info[_LO_FILE_NAME_OFFSET:_LO_FILE_NAME_OFFSET + len(name)] = name
    config = struct.pack("=II", backing, 0) + bytes(info) + bytes(64)
    for dev in _unbound.take(TRIES_FROM_LIST):
        try:
            loop = os.open(f"/dev/{dev}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # removed since
            continue
        if _configured(loop, config):
            return loop, dev
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(100):
            dev = f"loop{fcntl.ioctl(control, LOOP_CTL_GET_FREE)}"
            loop = os.open(f"/dev/{dev}", os.O_RDWR | os.O_CLOEXEC)
            if _configured(loop, config):
                return loop, dev
        raise OSError(errno.EBUSY, f"no free loop device for {image}")
    finally:
        os.close(control)


def _configured(loop: int, config: bytes) -> bool:
    """Whether the open device ``loop`` took ``config``; closed if not (another process
    configured it first: EBUSY)."""
    try:
        fcntl.ioctl(loop, LOOP_CONFIGURE, config)
        return True
    except OSError as exc:
        os.close(loop)
        if exc.errno != errno.EBUSY:
            raise
        return False


class _Unbound:
    """Loop devices this process saw unbound, to try before the kernel's walk: listed from
    sysfs at the first attach, lowest first; each one a teardown saw detach goes first."""

    def __init__(self) -> None:
        self._devices: collections.deque[str] = collections.deque()
        self._listed = False
        self._lock = threading.Lock()

    def take(self, n: int) -> Iterator[str]:
        """Up to ``n`` of them, each out of the list: one another process took since (other
        edges of the host take from the same devices) is not tried again."""
        for _ in range(n):
            with self._lock:
                if not self._listed:
                    self._listed = True
                    self._devices.extend(_unbound_in_sysfs())
                if not self._devices:
                    return
                dev = self._devices.popleft()
            yield dev

    def give(self, dev: str) -> None:
        with self._lock:
            self._devices.appendleft(dev)  # the next tried


def _unbound_in_sysfs() -> list[str]:
    names = [e.name for e in Path("/sys/block").glob("loop*") if e.name[4:].isdigit()]
    return sorted((n for n in names if backing_file(n) is None), key=lambda n: int(n[4:]))


_unbound = _Unbound()


def mounted_loop(target: Path) -> str | None:
    """The loop device mounted at ``target`` (``loop12``), or None when ``target`` is not the
    root of a loop-backed mount (absent, a plain directory, another file system)."""
    try:
        st, parent = os.stat(target), os.stat(target.parent)
    except FileNotFoundError:
        return None
    if st.st_dev == parent.st_dev or os.major(st.st_dev) != LOOP_MAJOR:
        return None
    return f"loop{os.minor(st.st_dev)}"


def backing_file(dev: str) -> str | None:
    """The file a loop device is attached to, as sysfs names it (its real path, without the
    " (deleted)" of an unlinked one); None once the device is detached."""
    try:
        name = Path(f"/sys/block/{dev}/loop/backing_file").read_text().strip()
    except OSError:  # detached (or the device was removed)
        return None
    return name.removesuffix(" (deleted)")


def unmount_image(target: Path, image: Path, discard: bool = False, wait: bool = True) -> None:
    """Unmount the loop-backed file system at ``target`` (lazily if it is still in use: it
    goes when its last user does) and, with ``wait``, wait until its device no longer holds
    ``image``. ``discard``: its content is being thrown away (the sandbox is destroyed, or
    its disk replaced), so the file system is shut down first and its dirty data is dropped,
    not written out into an image about to go. A ``target`` not mounted is left alone."""
    dev = mounted_loop(target)
    if dev is None:
        return
    if discard:
        shut_down(target)
    unmount_or_detach(target)
    if wait:
        wait_detached(dev, image)


def shut_down(target: Path) -> None:
    """FS_IOC_SHUTDOWN without a log flush: every later write of the file system mounted at
    ``target`` fails, and the data not yet written is dropped rather than written out."""
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FS_IOC_SHUTDOWN, struct.pack("=I", SHUTDOWN_NOLOGFLUSH))
    finally:
        os.close(fd)


def wait_detached(dev: str, image: Path, timeout_s: float = DETACH_TIMEOUT_S) -> bool:
    """Wait until ``dev`` no longer holds ``image`` (its autoclear may still be under way when
    the unmount returns; the device may hold another image by then); whether it let go.
    Polls from 1 ms, doubling up to 16 ms: many removals wait at once (a burst of stops),
    and each poll takes the GIL from the event loop serving creates."""
    target = os.path.realpath(image)
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while backing_file(dev) == target:
        if time.monotonic() > deadline:
            log.warning("loop device %s still holds %s after %.0fs", dev, image, timeout_s)
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.016)
    _unbound.give(dev)  # unless another image took it since: then its configure says EBUSY
    return True
