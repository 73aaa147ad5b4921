"""Private mount namespaces, made and entered by threads of the server.

Why: an OCI runtime starts a container by copying the mount table of the namespace it runs
in (crun unshares CLONE_NEWNS, pivots into the rootfs, then detaches the copy of the rest):
about 2 µs a mount, under a lock every start shares. With each sandbox's disk and overlay in
the host's table, a node of 3,000 sandboxes holds 6,000 mounts and a bare ``crun run`` takes
50 ms instead of 10 (``benchmarks/mount_table.py``): creates slowed fivefold as a node
filled. A sandbox's mounts are made in a namespace of its own instead (a private copy of the
host's few dozen mounts), where its runtime is started too: the host's table stays as it
is, whatever the density.

Such a namespace lives while something holds it: an fd (``new_private``'s) or a process in
it. It is never bound on a file: the kernel binds a mount namespace's file only into an
older namespace, and on kernels that hand out namespace ids in per-CPU batches (6.18 here),
"older" does not follow the order of creation.

Entering a mount namespace (setns) needs a thread that does not share its root and cwd with
the others, so ``own_fs`` is the initializer of every pool whose threads enter one;
``inside`` always takes the thread back to the host's namespace.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# linux/sched.h, linux/mount.h
CLONE_FS, CLONE_NEWNS = 0x200, 0x20000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_host_lock = threading.Lock()
_host: list[int] = []  # an fd on the process's own mount namespace, opened once


def _call(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def own_fs() -> None:
    """This thread's root and cwd made its own (a pool's initializer), so it may enter
    another mount namespace without taking the process's other threads along."""
    _call(_libc.unshare(CLONE_FS), "unshare(CLONE_FS)")


def _host_namespace() -> int:
    with _host_lock:
        if not _host:  # /proc/self is the main thread, which never leaves the host's namespace
            _host.append(os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
        return _host[0]


def _back_to_host() -> None:
    _call(_libc.setns(_host_namespace(), CLONE_NEWNS), "setns back into the host's mount namespace")


@contextmanager
def inside(namespace: int | None) -> Iterator[None]:
    """The calling thread (see ``own_fs``) in the mount namespace ``namespace`` meanwhile;
    None: where it is."""
    if namespace is None:
        yield
        return
    _host_namespace()
    _call(_libc.setns(namespace, CLONE_NEWNS), "setns into a sandbox's mount namespace")
    try:
        yield
    finally:
        _back_to_host()


def new_private() -> int:
    """A new mount namespace, a copy of the host's where no mount propagates in or out; an
    fd on it. The calling thread (see ``own_fs``) is back in the host's namespace after."""
    _host_namespace()
    _call(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    try:
        _call(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        _back_to_host()
