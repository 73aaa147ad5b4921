"""Writing a whole file into a sandbox for a compatibility front-end: parent directories made
as needed (envd and SWE-ReX both do), large contents in chunks an agent frame carries."""

from __future__ import annotations

import posixpath

from ..edge.edge import Edge
from ..protocol.errors import FileNotFound

WRITE_CHUNK = 32 << 20  # one agent frame carries at most 64 MiB


async def write_creating(edge: Edge, sandbox_id: str, path: str, data: bytes) -> None:
    """Replace ``path`` with ``data``, creating its parent directories; chunks after the first
    are appended."""
    first, rest = data[:WRITE_CHUNK], data[WRITE_CHUNK:]
    try:
        await edge.write_file(sandbox_id, path, first)
    except FileNotFound:
        await edge.mkdir(sandbox_id, posixpath.dirname(path), parents=True)
        await edge.write_file(sandbox_id, path, first)
    for offset in range(0, len(rest), WRITE_CHUNK):
        await edge.write_file(sandbox_id, path, rest[offset:offset + WRITE_CHUNK], append=True)
