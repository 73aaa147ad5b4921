"""Extracting an archive that came out of a sandbox, member by member, under a destination:
the SDK's downloads, and the server's extraction of an uploaded Dockerfile build context
(client data, held to the same checks). Pure standard library, so both sides share it here.

The archive's content is sandbox-made (names, link targets, types, modes, sizes), so it is
hostile data. ``tarfile``'s own extraction filters differ between Python releases and have
been bypassed (CVE-2025-4517: the ``data`` filter passed a forged archive on 3.11.7), so this
module uses ``tarfile`` only to parse headers and read member data, and creates every file
itself, the same on every supported Python:

- names are relative paths of plain components: no absolute names, no ``..``, bounded depth
  and component length; only regular files, directories, symlinks and hard links (no devices,
  FIFOs or unknown types); modes lose setuid/setgid/sticky and group/other write bits;
- every parent directory is opened component by component from the destination with
  ``O_NOFOLLOW`` (``dir_fd`` creation): a symlink, pre-existing or made by the archive, is
  never followed, so ``link/file`` cannot land where ``link`` points;
- an existing file or symlink is unlinked (never followed) before its member is created with
  ``O_EXCL``; a directory is never replaced, so no symlink can take a directory's place;
- hard links only name regular files this extraction already wrote;
- symlinks are made last, once every member is known, and only if their target, resolved
  through the archive's other symlinks and what the destination already holds, stays inside,
  with ``..`` only out of real directories (no member may lie under one of the archive's
  symlinks);
- the member count and the bytes written (sparse members count at their full size) are capped
  before anything is written.

Any refusal is ``UnsafeArchive``; nothing is ever written outside the destination.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from .errors import UnsafeArchive

DEFAULT_MAX_MEMBERS = 100_000
DEFAULT_MAX_BYTES = 2 << 30  # the server's archives hold at most 1 GiB of plain tar
MAX_DEPTH = 256  # path components of one member
MAX_COMPONENT = 255  # bytes, as NAME_MAX
MAX_SYMLINK_HOPS = 40  # as the kernel's ELOOP limit
MAX_RESOLVE_STEPS = 4096  # path components one symlink's resolution may walk
CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Parts = tuple[str, ...]


@dataclass
class _Plan:
    """What the archive asks for, checked on its own before anything is written."""

    members: list[tuple[tarfile.TarInfo, Parts]] = field(default_factory=list)
    symlinks: dict[Parts, str] = field(default_factory=dict)


def extract(archive: bytes | BinaryIO, destination: str | Path, *,
            max_members: int = DEFAULT_MAX_MEMBERS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Extract a plain (uncompressed) tar into ``destination`` (created if missing), or raise
    ``UnsafeArchive``. ``max_bytes`` caps the bytes written, ``max_members`` the entries."""
    fileobj = io.BytesIO(archive) if isinstance(archive, (bytes, bytearray)) else archive
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            plan = _plan(tar, max_members, max_bytes)
            Path(destination).mkdir(parents=True, exist_ok=True)
            root = os.open(destination, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                _Writer(tar, root).write(plan)
            finally:
                os.close(root)
    except (tarfile.TarError, EOFError, ValueError, OverflowError) as exc:
        raise UnsafeArchive(f"unreadable archive: {exc}") from None


def _plan(tar: tarfile.TarFile, max_members: int, max_bytes: int) -> _Plan:
    plan = _Plan()
    total = 0
    for count, member in enumerate(tar):
        if count >= max_members:
            raise UnsafeArchive(f"the archive holds more than {max_members} members",
                                max_members=max_members)
        parts = _parts(member.name, member.name)
        if not parts:  # the destination itself ("./")
            if not member.isdir():
                raise UnsafeArchive("a member without a name", member=member.name)
            continue
        if member.issym():
            if member.linkname.startswith("/") or not member.linkname:
                raise UnsafeArchive("a symlink to an absolute path", member=member.name,
                                    target=member.linkname)
            plan.symlinks[parts] = member.linkname
        elif member.islnk():
            _parts(member.linkname, member.name)
        elif member.isreg():
            total += member.size
            if total > max_bytes:
                raise UnsafeArchive(f"the archive holds more than {max_bytes} bytes",
                                    max_bytes=max_bytes, member=member.name)
        elif not member.isdir():
            raise UnsafeArchive("only files, directories and links may be extracted",
                                member=member.name, type=member.type.decode(errors="replace"))
        plan.members.append((member, parts))
    for _, parts in plan.members:
        if any(parts[:depth] in plan.symlinks for depth in range(1, len(parts))):
            raise UnsafeArchive("a member under one of the archive's symlinks",
                                member="/".join(parts))
    return plan


def _parts(name: str, member: str) -> Parts:
    """A member (or hard link target) name as its path components under the destination."""
    if name.startswith("/"):
        raise UnsafeArchive("an absolute name", member=member, name=name)
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise UnsafeArchive("a name with '..'", member=member, name=name)
    if len(parts) > MAX_DEPTH:
        raise UnsafeArchive(f"a name deeper than {MAX_DEPTH} components", member=member)
    if any(len(os.fsencode(p)) > MAX_COMPONENT for p in parts):
        raise UnsafeArchive(f"a name component longer than {MAX_COMPONENT} bytes", member=member)
    return parts


def _file_mode(mode: int) -> int:
    return (mode & 0o755) | 0o600


def _dir_mode(mode: int) -> int:
    return (mode & 0o755) | 0o700


class _Writer:
    """Creates the plan's entries relative to the destination's descriptor."""

    def __init__(self, tar: tarfile.TarFile, root: int) -> None:
        self.tar = tar
        self.root = root
        self.files: set[Parts] = set()  # regular files written: what hard links may name
        self.dirs: dict[Parts, int] = {}  # directories to chmod at the end

    def write(self, plan: _Plan) -> None:
        for member, parts in plan.members:
            if member.isdir():
                self._dir(parts, member.mode)
            elif member.isreg():
                self._file(parts, member)
            elif member.islnk():
                self._hardlink(parts, member)
        resolver = _Resolver(self.root, plan.symlinks)
        for parts, target in plan.symlinks.items():
            with self._parent(parts) as parent:  # real directories: no symlink on the way
                resolver.check(parts, target)
                self._vacate(parent, parts)
                os.symlink(target, parts[-1], dir_fd=parent)
        for parts, mode in sorted(self.dirs.items(), key=lambda item: -len(item[0])):
            with self._parent(parts) as parent:
                fd = self._open_dir(parent, parts)
                try:
                    os.fchmod(fd, _dir_mode(mode))
                finally:
                    os.close(fd)

    def _dir(self, parts: Parts, mode: int) -> None:
        with self._parent(parts) as parent:
            try:
                os.mkdir(parts[-1], 0o700, dir_fd=parent)
            except FileExistsError:
                os.close(self._open_dir(parent, parts))  # an existing real directory is reused
        self.dirs[parts] = mode

    def _file(self, parts: Parts, member: tarfile.TarInfo) -> None:
        source = self.tar.extractfile(member)
        assert source is not None  # a regular member always has data
        with self._parent(parts) as parent:
            self._vacate(parent, parts)
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600, dir_fd=parent)
            with os.fdopen(fd, "wb") as out:
                remaining = member.size
                while remaining > 0:
                    chunk = source.read(min(CHUNK, remaining))
                    if not chunk:
                        raise UnsafeArchive("a member's data ends early", member=member.name)
                    out.write(chunk)
                    remaining -= len(chunk)
                os.fchmod(out.fileno(), _file_mode(member.mode))
                if 0 <= member.mtime < 1 << 40:
                    os.utime(out.fileno(), (member.mtime, member.mtime))
        self.files.add(parts)

    def _hardlink(self, parts: Parts, member: tarfile.TarInfo) -> None:
        target = _parts(member.linkname, member.name)
        if target not in self.files:
            raise UnsafeArchive("a hard link to something this archive did not write as a file",
                                member=member.name, target=member.linkname)
        with self._parent(target) as source, self._parent(parts) as parent:
            self._vacate(parent, parts)
            os.link(target[-1], parts[-1], src_dir_fd=source, dst_dir_fd=parent,
                    follow_symlinks=False)
        self.files.add(parts)

    def _vacate(self, parent: int, parts: Parts) -> None:
        """Make room for a new entry: a file or symlink there is unlinked (never followed); a
        directory is never replaced."""
        try:
            existing = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(existing.st_mode):
            raise UnsafeArchive("a member would replace a directory", member="/".join(parts))
        os.unlink(parts[-1], dir_fd=parent)

    @staticmethod
    def _open_dir(parent: int, parts: Parts) -> int:
        try:
            return os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            raise
        except OSError:  # ELOOP: a symlink; ENOTDIR: a file
            raise UnsafeArchive("a member's path goes through a symlink or a file",
                                member="/".join(parts)) from None

    @contextmanager
    def _parent(self, parts: Parts) -> Iterator[int]:
        """The directory that holds ``parts[-1]``, reached without following any symlink;
        missing directories are made on the way (as tar does for members without one)."""
        fds: list[int] = []
        try:
            fd = self.root
            for depth in range(1, len(parts)):
                try:
                    os.mkdir(parts[depth - 1], 0o700, dir_fd=fd)
                    self.dirs.setdefault(parts[:depth], 0o755)
                except FileExistsError:
                    pass
                fd = self._open_dir(fd, parts[:depth])
                fds.append(fd)
                if len(fds) > 1:
                    os.close(fds.pop(0))
            yield fd
        finally:
            for f in fds:
                os.close(f)


class _Resolver:
    """Where a symlink's target leads, followed through the archive's symlinks and whatever
    the destination already holds, without leaving the destination (``..`` at the top is out).
    Each step is bounded (``MAX_RESOLVE_STEPS`` components, ``MAX_SYMLINK_HOPS`` links), so a
    forged chain costs the client little time."""

    def __init__(self, root: int, symlinks: dict[Parts, str]) -> None:
        self.root = root
        self.symlinks = symlinks

    def check(self, link: Parts, target: str) -> None:
        hops = steps = 0
        pending = list(reversed(target.split("/")))
        resolved: list[str] = list(link[:-1])
        while pending:
            steps += 1
            if steps > MAX_RESOLVE_STEPS:
                raise UnsafeArchive("a symlink too long to resolve", member="/".join(link))
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":  # only out of a real directory: a missing one could later
                # become a symlink (another download into the destination) and move the ".."
                if not resolved or not self._is_dir(tuple(resolved)):
                    raise UnsafeArchive("a symlink that points outside the destination or "
                                        "climbs out of a missing directory",
                                        member="/".join(link), target=target)
                resolved.pop()
                continue
            resolved.append(part)
            next_target = self._link_at(tuple(resolved))
            if next_target is None:
                continue
            hops += 1
            if hops > MAX_SYMLINK_HOPS or next_target.startswith("/"):
                raise UnsafeArchive("a symlink that points outside the destination (or loops)",
                                    member="/".join(link), target=target)
            resolved.pop()
            pending.extend(reversed(next_target.split("/")))

    def _link_at(self, parts: Parts) -> str | None:
        """The target of the symlink at ``parts`` (the archive's, or one already there). Every
        component before the last was checked not to be a symlink as it was added, so the
        kernel's walk of the path follows none."""
        if parts in self.symlinks:
            return self.symlinks[parts]
        try:
            return os.readlink("/".join(parts), dir_fd=self.root)
        except (FileNotFoundError, NotADirectoryError):
            return None  # not there
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return None  # there, and not a symlink
            raise UnsafeArchive(f"a symlink whose target cannot be checked: {exc.strerror}",
                                member="/".join(parts)) from None

    def _is_dir(self, parts: Parts) -> bool:
        try:
            return stat.S_ISDIR(os.stat("/".join(parts), dir_fd=self.root,
                                        follow_symlinks=False).st_mode)
        except OSError:
            return False
