"""One sealed in-memory copy of an OCI runtime's binary, which the server starts it from.

Why: crun and runc defend against CVE-2019-5736 (a container process writing the runtime's
binary through ``/proc/<pid>/exe`` while the runtime joins it) by executing themselves again
from a copy nobody can write, at every call. crun 1.8 does it by bind-mounting
``/proc/self/exe`` read-only over a new file in ``/tmp``, opening it, unmounting it and
``execveat``-ing it: two mounts and an unmount (under the kernel's mount lock, which every
other start waits on) and a second dynamic link, in each ``crun run``, ``kill`` and
``delete`` (about 1.5 ms of a bare ``crun run`` of 9.5 ms here). A runtime whose
``/proc/self/exe`` is already a memfd with every seal (write, grow, shrink, and no more
seals) skips that: its ``is_self_cloned`` check, the one runc's ``memfd-bind`` relies on.

The copy is made at a binary's first use and again whenever its file changed (a ``stat``
per start: an upgraded runtime runs from the next start on): the file read into a memfd,
then sealed, so neither the server, the runtime nor anything a sandbox runs can change it,
ever (a sealed memfd refuses writes, truncation and growth to root too). A copy stays open
for the process's life, as a start may still run from it. The runtime runs from
``/proc/self/fd/N`` of the process that starts it (``spawn.posix_spawn`` execs in the child,
which holds a copy of the server's fds until the exec closes them: the fd is close-on-exec,
so the runtime does not inherit it), through a link named like the binary in a directory of
the server's state for this process (the kernel names a process after the path it was
executed by: ``crun`` in ``ps`` and ``pgrep``, not ``33``; the link names an fd of this
process, so no other process may use it). A warm pool's refill reaches the runtime through
``chrt``, so there the runtime keeps the fd; crun and runc mark every fd above 2
close-on-exec before they exec a container's init, so no sandbox holds it.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

# linux/fcntl.h
F_ADD_SEALS, F_GET_SEALS = 1033, 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 0x1, 0x2, 0x4, 0x8
ALL_SEALS = F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE  # what runtimes check for

Version = tuple[int, int, int, int]  # a file's device, inode, size and mtime
_lock = threading.Lock()
_copies: dict[str, tuple[Version, int]] = {}  # the binary's path -> (its version, its copy's fd)
_links: dict[tuple[str, Path], tuple[int, str]] = {}  # (binary, dir) -> (the fd linked, link)


def sealed_copy(binary: str, links: Path) -> str:
    """The path to run ``binary`` (an absolute path) from: a link in ``links`` (made if
    need be) to a sealed copy of it. The copy is made at the first call, and again when the
    file was replaced or changed since (an upgrade of the runtime applies to the next
    start); a copy is held open for the process's life (a start may still run from it)."""
    current = _version(os.stat(binary))
    with _lock:
        copy = _copies.get(binary)
        if copy is None or copy[0] != current:
            copy = _copies[binary] = _seal(binary)
        linked = _links.get((binary, links))
        if linked is None or linked[0] != copy[1]:
            linked = _links[binary, links] = (copy[1], _link(
                links, os.path.basename(binary), f"/proc/self/fd/{copy[1]}"))
        return linked[1]


def _version(st: os.stat_result) -> Version:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _link(links: Path, name: str, target: str) -> str:
    """``links/<pid>/name`` made a symlink to ``target`` (an fd of this process: each process
    links its own), replacing what was there; the links of processes gone are removed."""
    mine = links / str(os.getpid())
    if not mine.exists():
        _forget_the_dead(links)
    mine.mkdir(mode=0o700, parents=True, exist_ok=True)
    staged = mine / f".{name}"
    staged.unlink(missing_ok=True)
    os.symlink(target, staged)
    os.replace(staged, mine / name)
    return str(mine / name)


def _forget_the_dead(links: Path) -> None:
    """The link dirs of processes that no longer run (a dir holds only links this module
    made). A pid reused since keeps its dir: a few bytes, replaced if it is a server's."""
    for d in links.glob("[0-9]*") if links.is_dir() else ():
        if d.name.isdigit() and not Path(f"/proc/{d.name}").exists():
            for link in d.iterdir():
                link.unlink(missing_ok=True)
            d.rmdir()


def _seal(binary: str) -> tuple[Version, int]:
    """The version of ``binary`` copied and the sealed copy's fd."""
    fd = os.memfd_create(os.path.basename(binary), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(binary, "rb") as source:
            st = os.fstat(source.fileno())
            size = st.st_size
            copied = 0
            while copied < size:
                sent = os.sendfile(fd, source.fileno(), copied, size - copied)
                if sent == 0:
                    raise OSError(f"{binary} shrank while it was being copied")
                copied += sent
        fcntl.fcntl(fd, F_ADD_SEALS, ALL_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return _version(st), fd
