"""The state store's blob area: immutable byte strings named by their SHA-256.

``<root>/sha256/<first two hex digits>/<hex digest>``. A blob is written to a temporary file
and renamed into place, so a reader never sees half a blob; writing one that exists only
touches it (its mtime is when it was last written: what the collector's grace counts from).
Rows refer to blobs; blobs are written before the row that names them is committed.
Durability is that of the database (``synchronous=NORMAL``): a crash of any process loses
nothing written; a power cut may lose the last writes.

Collection (``sweep``) removes the blobs no row names, safely against a concurrent write:
the caller reads the names every committed row holds *after* the sweep's cut-off time was
taken, and only blobs last written before ``cutoff`` are candidates. A candidate is first
renamed aside (atomic), then its mtime is read again: a write that touched it before the
rename shows there and the blob is put back; a write after the rename finds no blob and
writes it afresh. So a blob written by a step that commits after the scan is never lost, as
long as a step commits within the grace (``blob_grace_s``) of writing its blob.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from ..protocol.errors import DSecError

HEX = frozenset("0123456789abcdef")
ASIDE = ".gc."  # a candidate renamed aside: ``.gc.<digest>.<token>``


def is_digest(name: str) -> bool:
    return len(name) == 64 and all(c in HEX for c in name)


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        if not is_digest(digest):
            raise DSecError(f"not a sha256 blob name: {digest!r}")
        return self.root / "sha256" / digest[:2] / digest

    def put(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        path = self.path(digest)
        try:
            os.utime(path)  # written again: the collector's grace starts over
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{digest}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return digest

    def get(self, digest: str) -> bytes:
        """The blob's bytes; also while a sweep holds it aside to re-check it (a step that
        committed after the sweep's scan reads it then)."""
        path = self.path(digest)
        for candidate in (path, *path.parent.glob(f"{ASIDE}{digest}.*"), path):
            try:
                return candidate.read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                continue
        raise DSecError(f"blob sha256:{digest} is missing from {self.root}")

    # collection
    def candidates(self, cutoff: float) -> Iterator[tuple[str, int]]:
        """(digest, size) of each blob last written before ``cutoff``; also puts back what a
        sweep that crashed left aside, and removes temporary files of writes that died.
        Looks at ``sha256/<2 hex>/`` only, never follows a link, skips any other name."""
        top = self.root / "sha256"
        for fan in _entries(top):
            if len(fan.name) != 2 or not all(c in HEX for c in fan.name) or not _is_dir(fan):
                continue
            for entry in _entries(Path(fan.path)):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                name = entry.name
                if name.startswith(ASIDE):
                    self._put_back(Path(entry.path), name[len(ASIDE):len(ASIDE) + 64])
                elif name.startswith(".") and name.endswith(".tmp") and st.st_mtime < cutoff:
                    Path(entry.path).unlink(missing_ok=True)
                elif is_digest(name) and entry.is_file(follow_symlinks=False) \
                        and st.st_mtime < cutoff:
                    yield name, st.st_size

    def remove_if_unwritten(self, digest: str, cutoff: float) -> int | None:
        """Remove a candidate unless it was written again since ``cutoff``: its size if it
        was removed by this call, else None."""
        path = self.path(digest)
        aside = path.with_name(f"{ASIDE}{digest}.{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return None  # removed by another collector meanwhile
        try:
            st = os.lstat(aside)
        except FileNotFoundError:
            return None  # another collector's scan put it back
        if st.st_mtime >= cutoff:  # a write touched it before the rename: it stays
            self._put_back(aside, digest)
            return None
        try:
            aside.unlink()
        except FileNotFoundError:
            return None  # another collector's scan put it back after the check
        return st.st_size

    def _put_back(self, aside: Path, digest: str) -> None:
        if not is_digest(digest):
            return
        try:
            os.link(aside, self.path(digest))
        except FileExistsError:
            pass  # written afresh meanwhile: the same bytes
        except FileNotFoundError:
            return  # put back (or removed) by another collector
        aside.unlink(missing_ok=True)


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False
