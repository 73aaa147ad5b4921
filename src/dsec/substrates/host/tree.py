"""Removing a directory tree that a sandbox may have shaped, without trusting its shape.

dsec is designed so that it never has to walk what a sandbox wrote: a container's writable
layer and its run dir live on the sandbox's own disk image, which is unmounted and unlinked
as one file. Where a walk is still needed (a directory of dsec's that may hold something of a
sandbox's, or a layout from an older version), ``remove_tree`` is the one way to do it:

- iterative, with one open directory at a time: any depth (``shutil.rmtree`` recursed, and a
  1,500-deep chain raised RecursionError, failed ``stop`` and then the server's start-up);
- every directory is opened relative to its parent with ``O_NOFOLLOW``: a symlink is unlinked,
  never followed, and a directory swapped for a link fails to open instead of being entered;
- the way back up (``..``) is checked against the device and inode it came down from;
- it never crosses a mount point: a directory on another device is left and reported;
- names are taken as the kernel gives them (newlines, non-UTF-8 bytes, 255 bytes), and
  entries are listed once per directory, so a million files cost one pass.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class _Level:
    name: bytes  # in the level above
    ino: int
    subdirs: list[bytes] = field(default_factory=list)


def remove_tree(path: Path) -> None:
    """Remove ``path`` and everything below it, on ``path``'s file system only. A missing
    ``path`` is fine; anything that could not be removed raises OSError naming it."""
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(top.st_mode):
        os.unlink(path)
        return
    parent = os.open(path.parent, _DIR_FLAGS)
    try:
        _remove_dir(parent, os.fsencode(path.name), top.st_dev, path)
    finally:
        os.close(parent)


def _remove_dir(parent: int, name: bytes, dev: int, shown: Path) -> None:
    """Empty and remove directory ``name`` of the open directory ``parent``, depth first with
    a stack of names (never of open descriptors)."""
    fd = _open_dir(parent, name, dev, shown)
    stack = [_Level(name, os.fstat(fd).st_ino, _clear_files(fd))]
    skipped: list[str] = []
    try:
        while stack:
            level = stack[-1]
            if level.subdirs:
                child = level.subdirs.pop()
                try:
                    sub = _open_dir(fd, child, dev, shown)
                except _Foreign as exc:
                    skipped.append(str(exc))
                    continue
                except FileNotFoundError:
                    continue
                os.close(fd)
                fd = sub
                stack.append(_Level(child, os.fstat(fd).st_ino, _clear_files(fd)))
                continue
            stack.pop()
            up = parent if not stack else _up(fd, stack[-1], shown)
            os.close(fd)
            fd = up
            _rmdir(fd, level.name, shown, skipped)
    finally:
        if fd != parent:
            os.close(fd)
    if skipped:
        raise OSError(errno.EBUSY, f"left under {shown}: {'; '.join(skipped[:5])}")


class _Foreign(OSError):
    """A directory on another file system (a mount point): never entered."""


def _open_dir(parent: int, name: bytes, dev: int, shown: Path) -> int:
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    if os.fstat(fd).st_dev != dev:
        os.close(fd)
        raise _Foreign(errno.EXDEV, f"a mount point in {shown}: {name!r}")
    return fd


def _up(fd: int, above: _Level, shown: Path) -> int:
    """The directory above ``fd``, which must still be the one we came down from."""
    up = os.open(b"..", _DIR_FLAGS, dir_fd=fd)
    if os.fstat(up).st_ino != above.ino:
        os.close(up)
        raise OSError(errno.ESTALE, f"the tree under {shown} moved while it was removed")
    return up


def _clear_files(fd: int) -> list[bytes]:
    """Unlink every non-directory in ``fd`` (symlinks included, never followed); the names
    of its subdirectories."""
    subdirs = []
    with os.scandir(fd) as entries:
        for entry in entries:
            name = os.fsencode(entry.name)
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(name)
                continue
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
    return subdirs


def _rmdir(parent: int, name: bytes, shown: Path, skipped: list[str]) -> None:
    try:
        os.rmdir(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if not skipped:  # a mount point below explains it already
            raise OSError(exc.errno, f"cannot remove {name!r} under {shown}: {exc.strerror}") from None
