"""The state store's blob area: immutable byte strings named by their SHA-256.

``<root>/sha256/<first two hex digits>/<hex digest>``. A blob is written to a temporary file
and renamed into place, so a reader never sees half a blob, and writing one that exists is a
no-op. Rows refer to blobs; blobs are written before the row that names them is committed.
Durability is that of the database (``synchronous=NORMAL``): a crash of any process loses
nothing written; a power cut may lose the last writes. Blobs are not collected yet.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..protocol.errors import DSecError


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise DSecError(f"not a sha256 blob name: {digest!r}")
        return self.root / "sha256" / digest[:2] / digest

    def put(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        path = self.path(digest)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{digest}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return digest

    def get(self, digest: str) -> bytes:
        try:
            return self.path(digest).read_bytes()
        except FileNotFoundError:
            raise DSecError(f"blob sha256:{digest} is missing from {self.root}") from None
