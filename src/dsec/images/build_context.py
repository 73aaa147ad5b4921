"""COPY / ADD sources from a Dockerfile build's context (a host directory), as one tar.

The context is the user's, but a Dockerfile names paths in it that may try to leave it:
``../secret``, an absolute path, a symlink to ``/etc``. Every source is resolved inside the
context (``InvalidRequest`` if its real path leaves it), a symlink inside a copied tree is
kept as a link only if it points inside the context, and the tar carries only regular files,
directories and such links, owned by root (or ``--chown``): the build driver extracts it in
a sandbox of the parent image (so the destination is resolved in that root file system, as
Docker does) and takes the result as a layer. The digest of what the tar holds (names, types,
modes, owners, link targets and contents; not mtimes, as Docker's COPY checksum: a context
extracted again from an upload is the same context) is part of the step's cache key: a
changed file makes a new layer. The context's ``.dockerignore`` leaves paths out.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import io
import os
import posixpath
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.protocol.errors import InvalidRequest, NotSupported

MAX_CONTEXT_BYTES = 1 << 30  # what one COPY may carry (the tar is built in memory)
_ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".txz")


@dataclass(frozen=True)
class ContextCopy:
    directory: str  # absolute, in the image: where the tar is extracted
    target: str  # absolute, in the image: the destination as written (normalised)
    into_dir: bool  # the sources go into ``target`` (else ``target`` is the one file's path)
    tar: bytes
    digest: str  # sha256 of the tar's members but their mtimes: the cache key's share


def context_copy(context: Path, sources: list[str], dest: str, workdir: str, keyword: str,
                 chown: str | None = None, chmod: str | None = None,
                 into_dir: bool = False) -> ContextCopy:
    """The tar a ``COPY sources dest`` (or ``ADD``) extracts, and where. ``into_dir``: the
    destination is known to be a directory of the image (one file is copied into it)."""
    root = Path(os.path.realpath(context))
    if not root.is_dir():
        raise InvalidRequest(f"the build context {context} is not a directory")
    uid, gid = _owner(chown)
    mode = _mode(chmod)
    ignore = _Ignore(root)
    paths: list[tuple[Path, str]] = []  # (real path, the name it was given by)
    for source in sources:
        if keyword == "ADD" and "://" in source:
            raise NotSupported(f"ADD {source}: ADD of URLs is not supported; download in a RUN "
                               "with an egress policy instead")
        if keyword == "ADD" and source.endswith(_ARCHIVES):
            raise NotSupported(f"ADD {source}: ADD's extraction of local archives is not "
                               "supported; COPY it and extract it in a RUN")
        paths.extend(found for found in _resolve(root, source) if not ignore(found[0]))
    if not paths:
        raise InvalidRequest(f"{keyword} {' '.join(sources)}: every source is in .dockerignore")
    full_dest = dest if dest.startswith("/") else posixpath.join(workdir or "/", dest)
    into_dir = (into_dir or dest.endswith(("/", "/.")) or dest == "." or len(paths) > 1
                or paths[0][0].is_dir())
    directory = posixpath.normpath(full_dest) if into_dir else posixpath.dirname(
        posixpath.normpath(full_dest))
    buffer, content = io.BytesIO(), hashlib.sha256()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, given in paths:
            if path.is_dir():
                _add_tree(_Tar(tar, content), root, path, ".", uid, gid, mode, ignore)
            else:
                name = given if into_dir else posixpath.basename(posixpath.normpath(full_dest))
                _add(_Tar(tar, content), root, path, name, uid, gid, mode)
            if buffer.tell() > MAX_CONTEXT_BYTES:
                raise InvalidRequest(f"{keyword} carries more than {MAX_CONTEXT_BYTES >> 20} MB")
    data = buffer.getvalue()
    return ContextCopy(directory or "/", posixpath.normpath(full_dest), into_dir, data,
                       "sha256:" + content.hexdigest())


class _Tar:
    """The tar being written, and the digest of its members but their mtimes."""

    def __init__(self, tar: tarfile.TarFile, digest: Any) -> None:
        self.tar, self.digest = tar, digest

    def addfile(self, info: tarfile.TarInfo, data: bytes | None = None) -> None:
        self.digest.update(repr((info.name, info.type, info.mode, info.uid, info.gid,
                                 info.linkname, info.size)).encode())
        if data is not None:
            self.digest.update(data)
        self.tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _resolve(root: Path, source: str) -> list[tuple[Path, str]]:
    """The context paths ``source`` names (a glob pattern may name several), each checked to
    stay inside the context after following every symlink."""
    relative = posixpath.normpath(source.lstrip("/") or ".")
    if relative == ".." or relative.startswith("../"):
        raise InvalidRequest(f"COPY source {source!r} leaves the build context")
    pattern = str(root / relative)
    matches = sorted(glob.glob(glob.escape(str(root)) + "/" + relative)) if glob.has_magic(
        relative) else [pattern]
    if not matches:
        raise InvalidRequest(f"COPY source {source!r} matches nothing in the build context")
    found = []
    for match in matches:
        real = Path(os.path.realpath(match))
        if real != root and root not in real.parents:
            raise InvalidRequest(f"COPY source {source!r} resolves outside the build context "
                                 f"(to {real})")
        if not real.exists():
            raise InvalidRequest(f"COPY source {source!r} does not exist in the build context")
        found.append((real, os.path.basename(match)))
    return found


def _add_tree(tar: _Tar, root: Path, top: Path, prefix: str, uid: int, gid: int,
              mode: int | None, ignore: _Ignore) -> None:
    for directory, dirs, files in os.walk(top):  # does not descend into links to directories
        dirs[:] = sorted(d for d in dirs if not ignore(Path(directory, d)))
        rel = os.path.relpath(directory, top)
        for name in dirs + sorted(f for f in files if not ignore(Path(directory, f))):
            path = Path(directory, name)
            _add(tar, root, path, posixpath.normpath(posixpath.join(prefix, rel, name)), uid, gid,
                 mode)


def _add(tar: _Tar, root: Path, path: Path, name: str, uid: int, gid: int,
         mode: int | None) -> None:
    st = os.lstat(path)
    info = tarfile.TarInfo(name)
    info.uid, info.gid, info.uname, info.gname = uid, gid, "", ""
    info.mtime = int(st.st_mtime)
    info.mode = mode if mode is not None else stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        real = Path(os.path.realpath(Path(path).parent / target))
        if real != root and root not in real.parents:
            raise InvalidRequest(f"{path.relative_to(root)} is a symlink out of the build "
                                 f"context (to {target})")
        info.type, info.linkname = tarfile.SYMTYPE, target
        tar.addfile(info)
    elif stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    elif stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            data = f.read()
        info.size = len(data)
        tar.addfile(info, data)
    else:
        raise InvalidRequest(f"{path.relative_to(root)} is not a file, directory or symlink")


class _Ignore:
    """The context's ``.dockerignore``: patterns on paths relative to the context (``*``
    and ``?`` as in fnmatch, so ``*`` also crosses ``/``, more than Docker's), a pattern
    matching a directory excluding what is under it, ``!pattern`` taking paths back."""

    def __init__(self, root: Path) -> None:
        self.root = root
        try:
            lines = (root / ".dockerignore").read_text().splitlines()
        except FileNotFoundError:
            lines = []
        self.rules = [(line.startswith("!"), posixpath.normpath(line.lstrip("!").strip("/ ")))
                      for line in (raw.strip() for raw in lines)
                      if line and not line.startswith("#")]

    def __call__(self, path: Path) -> bool:
        rel = os.path.relpath(path, self.root)
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        excluded = False
        for negated, pattern in self.rules:
            if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
                excluded = not negated
        return excluded


def _owner(chown: str | None) -> tuple[int, int]:
    if not chown:
        return 0, 0
    user, _, group = chown.partition(":")
    if not user.isdigit() or (group and not group.isdigit()):
        raise NotSupported(f"--chown={chown}: only numeric uid[:gid] is supported")
    return int(user), int(group or user)


def _mode(chmod: str | None) -> int | None:
    if chmod is None:
        return None
    try:
        return int(chmod, 8) & 0o7777
    except ValueError:
        raise InvalidRequest(f"--chmod={chmod} is not an octal mode") from None
