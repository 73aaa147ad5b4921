"""Packs an fn sandbox's writable tree into a file, and unpacks one into a fresh worker
(host side, run by the server as ``python -I fn_tree.py pack|unpack ...``; stdlib only).

An fn worker's writable state is its own tmpfs mounts (``TREES``), in its own mount
namespace; the server reaches them through ``/proc/<pid>/root``. The tree is hostile: a
sandbox made it to be snapshotted, so this runs in a process of its own (killed at a
deadline, its memory its own), chrooted into the worker's root (a symlink it followed by
mistake would stay in the sandbox's view), and it never follows one anyway: every name is
opened relative to its directory's fd with ``O_NOFOLLOW``, one component at a time, and only
after ``lstat`` said what it is; ``..`` is checked to be the directory it came from, so any
depth is walked holding one directory fd. Only data extents are read (``SEEK_DATA``), so a
sparse file costs what it holds; a hard-linked file is written once; device nodes and
sockets are skipped (a worker cannot make the former; the latter mean nothing in a file);
the output is capped (``--max-bytes``). Unpacking joins the new worker's cgroups first, so
what it writes into the worker's tmpfs is charged to the worker, and creates every name
itself (``O_EXCL``), so a packed file can make nothing outside the trees however it was
tampered with; each name is checked again.

Format: ``MAGIC``, then records: a kind byte, a name (u16 length + bytes) and the fixed
header ``META``; ``D`` (a directory: its records follow, up to ``U``), ``F`` (a file: its
size, hard-link id and link count, then extents of offset, length and bytes up to an empty
one), ``H`` (another name of the file with that link id), ``L`` (a symlink: its target),
``P`` (a fifo); ``E`` ends the stream.
"""

from __future__ import annotations

import ctypes
import os
import stat
import struct
import sys
from typing import BinaryIO

MAGIC = b"DSECFNT1"
TREES = ("tmp", "work")  # the worker's writable tmpfs mounts that a snapshot keeps
META = struct.Struct(">IIIq")  # mode, uid, gid, mtime_ns
FILE = struct.Struct(">QQI")  # size, link id (0: not hard-linked), link count
EXTENT = struct.Struct(">QQ")  # offset, length (0, 0 ends the file)
NAME = struct.Struct(">H")
CHUNK = 1 << 20
MAX_LINK = 4096
MAX_OPEN_LINKS = 8192  # hard-linked files whose other names are still to come, at once
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
AT_EMPTY_PATH = 0x1000
_libc = ctypes.CDLL(None, use_errno=True)


class TreeError(Exception):
    """The tree, or a packed file, is not one this module makes or can restore."""


def _enter_root(pid: int) -> None:
    """Chroot into the worker's root (through /proc/<pid>/root, its mount namespace's view)."""
    # the kernel's magic link (the one link followed): the worker's root in its namespace
    fd = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    os.fchdir(fd)
    os.chroot(".")
    os.close(fd)


def _open_dir(parent: int, name: bytes, expect: os.stat_result) -> int:
    fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino):
        os.close(fd)
        raise TreeError(f"{name!r} changed while it was read")
    return fd


# packing ------------------------------------------------------------------------------------

class Packer:
    def __init__(self, out: BinaryIO, max_bytes: int) -> None:
        self.out = out
        self.max_bytes = max_bytes
        self.written = 0
        self.links: dict[tuple[int, int], int] = {}

    def write(self, data: bytes) -> None:
        self.written += len(data)
        if self.written > self.max_bytes:
            raise TreeError(f"the packed tree exceeds {self.max_bytes} bytes")
        self.out.write(data)

    def record(self, kind: bytes, name: bytes, st: os.stat_result) -> None:
        self.write(kind + NAME.pack(len(name)) + name
                   + META.pack(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns))

    def pack(self, root: int, trees: tuple[str, ...]) -> None:
        """The directories ``trees`` of the directory ``root`` (an fd)."""
        self.write(MAGIC)
        for tree in trees:
            name = tree.encode()
            st = os.stat(name, dir_fd=root, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                raise TreeError(f"/{tree} is not a directory")
            self.record(b"D", name, st)
            self.walk(_open_dir(root, name, st), st)
            self.write(b"U")
        self.write(b"E")

    def walk(self, fd: int, top: os.stat_result) -> None:
        """Depth first, holding one directory fd: ``..`` leads back up, checked."""
        stack: list[tuple[list[str], os.stat_result]] = [(sorted(os.listdir(fd), reverse=True), top)]
        while stack:
            pending, here = stack[-1]
            if not pending:
                stack.pop()
                if stack:
                    self.write(b"U")
                    up = _open_dir(fd, b"..", stack[-1][1])
                    os.close(fd)
                    fd = up
                continue
            name = os.fsencode(pending.pop())
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if st.st_dev != here.st_dev:
                continue  # a mount point under the tree (none is made there): not the tree's
            if stat.S_ISDIR(st.st_mode):
                self.record(b"D", name, st)
                down = _open_dir(fd, name, st)
                os.close(fd)
                fd = down
                stack.append((sorted(os.listdir(fd), reverse=True), st))
            elif stat.S_ISREG(st.st_mode):
                self.file(fd, name, st)
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=fd)
                self.record(b"L", name, st)
                self.write(NAME.pack(len(os.fsencode(target))) + os.fsencode(target))
            elif stat.S_ISFIFO(st.st_mode):
                self.record(b"P", name, st)
        os.close(fd)

    def file(self, dir_fd: int, name: bytes, st: os.stat_result) -> None:
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in self.links:
            self.write(b"H" + NAME.pack(len(name)) + name + struct.pack(">Q", self.links[key]))
            return
        link_id = 0
        if st.st_nlink > 1:
            link_id = self.links[key] = len(self.links) + 1
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                     dir_fd=dir_fd)
        try:
            if (os.fstat(fd).st_ino, os.fstat(fd).st_dev) != (st.st_ino, st.st_dev):
                raise TreeError(f"{name!r} changed while it was read")
            self.record(b"F", name, st)
            self.write(FILE.pack(st.st_size, link_id, st.st_nlink))
            for offset, length in _extents(fd, st.st_size):
                self.write(EXTENT.pack(offset, length))
                done = 0
                while done < length:
                    chunk = os.pread(fd, min(CHUNK, length - done), offset + done)
                    if not chunk:
                        raise TreeError(f"{name!r} shrank while it was read")
                    self.write(chunk)
                    done += len(chunk)
            self.write(EXTENT.pack(0, 0))
        finally:
            os.close(fd)


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The data extents of a file (holes skipped): what a sparse file really holds."""
    extents, pos = [], 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after pos
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end > start:
            extents.append((start, end - start))
        pos = end
    return extents


# unpacking ----------------------------------------------------------------------------------

class Unpacker:
    def __init__(self, src: BinaryIO) -> None:
        self.src = src
        self.links: dict[int, list[int]] = {}  # link id -> [O_PATH fd, names still to come]

    def read(self, n: int) -> bytes:
        data = self.src.read(n)
        if len(data) != n:
            raise TreeError("the packed tree is truncated")
        return data

    def name(self) -> bytes:
        name = self.read(NAME.unpack(self.read(NAME.size))[0])
        if not name or name in (b".", b"..") or b"/" in name or b"\0" in name or len(name) > 255:
            raise TreeError(f"the packed tree holds a bad name {name[:80]!r}")
        return name

    def unpack(self, root: int, trees: tuple[str, ...]) -> None:
        """Into the existing, empty directories ``trees`` of the directory ``root`` (an fd)."""
        if self.read(len(MAGIC)) != MAGIC:
            raise TreeError("not a packed fn tree")
        seen = set()
        while (kind := self.read(1)) != b"E":
            name = self.name()
            if kind != b"D" or name.decode(errors="replace") not in trees or name in seen:
                raise TreeError(f"the packed tree's top level holds {kind!r} {name[:80]!r}")
            seen.add(name)
            mode, uid, gid, mtime = META.unpack(self.read(META.size))
            st = os.stat(name, dir_fd=root, follow_symlinks=False)
            self.walk(_open_dir(root, name, st), st, (mode, uid, gid, mtime))
        if self.links:
            raise TreeError("the packed tree names fewer links of a file than it said")

    def walk(self, fd: int, top: os.stat_result, meta: tuple[int, int, int, int]) -> None:
        """Records up to the ``U`` closing ``top``; one directory fd held, as in packing. A
        directory's owner, mode and time are set (through its fd) once its records are in."""
        stack = [(top, meta)]
        while True:
            kind = self.read(1)
            if kind == b"U":
                _, (mode, uid, gid, mtime) = stack.pop()
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
                os.utime(fd, ns=(mtime, mtime))
                if not stack:
                    os.close(fd)
                    return
                up = _open_dir(fd, b"..", stack[-1][0])
                os.close(fd)
                fd = up
                continue
            if kind == b"H":
                name = self.name()
                self.hard_link(fd, name, struct.unpack(">Q", self.read(8))[0])
                continue
            name = self.name()
            meta = META.unpack(self.read(META.size))
            mode, uid, gid, mtime = meta
            if kind == b"D":
                os.mkdir(name, 0o700, dir_fd=fd)
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                down = _open_dir(fd, name, st)
                os.close(fd)
                fd = down
                stack.append((st, meta))
            elif kind == b"F":
                self.file(fd, name, meta)
            elif kind == b"L":
                os.symlink(self.read(NAME.unpack(self.read(NAME.size))[0]), name, dir_fd=fd)
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
                os.utime(name, ns=(mtime, mtime), dir_fd=fd, follow_symlinks=False)
            elif kind == b"P":
                os.mkfifo(name, mode, dir_fd=fd)  # (umask 0: the mode as packed)
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
                os.utime(name, ns=(mtime, mtime), dir_fd=fd, follow_symlinks=False)
            else:
                raise TreeError(f"the packed tree holds an unknown record {kind!r}")

    def file(self, dir_fd: int, name: bytes, meta: tuple[int, int, int, int]) -> None:
        mode, uid, gid, mtime = meta
        size, link_id, nlink = FILE.unpack(self.read(FILE.size))
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)
        try:
            os.ftruncate(fd, size)
            while True:
                offset, length = EXTENT.unpack(self.read(EXTENT.size))
                if length == 0:
                    break
                if offset + length > size:
                    raise TreeError(f"an extent of {name[:80]!r} lies beyond its size")
                while length:
                    chunk = self.read(min(CHUNK, length))
                    os.pwrite(fd, chunk, offset)
                    offset += len(chunk)
                    length -= len(chunk)
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
            os.utime(fd, ns=(mtime, mtime))
        finally:
            os.close(fd)
        if link_id:
            if link_id in self.links or len(self.links) >= MAX_OPEN_LINKS or nlink < 2:
                raise TreeError("the packed tree's hard links are inconsistent or too many")
            self.links[link_id] = [os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC,
                                           dir_fd=dir_fd), nlink - 1]

    def hard_link(self, dir_fd: int, name: bytes, link_id: int) -> None:
        held = self.links.get(link_id)
        if held is None:
            raise TreeError(f"the packed tree links {name[:80]!r} to an unknown file")
        if _libc.linkat(held[0], b"", dir_fd, name, AT_EMPTY_PATH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"link {name[:80]!r}: {os.strerror(err)}")
        held[1] -= 1
        if held[1] == 0:
            os.close(held[0])
            del self.links[link_id]


def main() -> None:
    """``pack PID MAX_BYTES`` (stdout: the packed tree) or ``unpack PID CGROUP_PROCS...``
    (stdin: one). Exit 0, or 2 with the reason on stderr."""
    command, pid = sys.argv[1], int(sys.argv[2])
    try:
        if command == "pack":
            out = os.fdopen(1, "wb", buffering=CHUNK)
            _enter_root(pid)
            Packer(out, int(sys.argv[3])).pack(os.open("/", DIR_FLAGS), TREES)
            out.flush()
        else:
            for procs in sys.argv[3:]:  # charged to the worker, as its own writes are
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            src = os.fdopen(0, "rb", buffering=CHUNK)
            os.umask(0)
            _enter_root(pid)
            Unpacker(src).unpack(os.open("/", DIR_FLAGS), TREES)
    except (TreeError, OSError, ValueError) as exc:
        sys.stderr.write(f"{exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
