"""A zip archive from a client, re-packed as a tar for dsec's own tar to extract inside the
sandbox (``Edge.upload_tar``): SWE-ReX uploads a directory as a zip with ``unzip=true``.

Nothing is extracted on the host: the zip is only read here, member by member, and its
members become tar entries under names made safe the way Python's ``ZipFile.extractall`` (what
SWE-ReX's own server uses) makes them: absolute paths lose their leading ``/``, drive letters
and ``..`` components are dropped, so every entry lands under the target directory. Members
are regular files and directories only: a symlink member is written as a file holding its
link text (``extractall`` does the same), so no entry can point outside the target for a
later one to write through. The total unpacked size and the member count are bounded (a zip
bomb is refused before anything is written).
"""

from __future__ import annotations

import io
import tarfile
import zipfile

from ..protocol.errors import UnsafeArchive

MAX_UNPACKED = 1 << 30  # bytes, all members together
MAX_MEMBERS = 100_000


def safe_name(name: str) -> str:
    """A zip member's name as ``extractall`` would place it, relative; "" when nothing is left."""
    parts = name.replace("\\", "/").split("/")
    kept = [p for p in parts if p not in ("", ".", "..")]
    if kept and len(kept[0]) == 2 and kept[0][1] == ":":  # a drive letter
        kept = kept[1:]
    return "/".join(kept)


def zip_to_tar(data: bytes, max_unpacked: int = MAX_UNPACKED) -> bytes:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise UnsafeArchive(f"not a zip archive: {exc}") from None
    if len(members) > MAX_MEMBERS:
        raise UnsafeArchive(f"a zip upload holds at most {MAX_MEMBERS} members")
    if sum(m.file_size for m in members) > max_unpacked:
        raise UnsafeArchive(f"a zip upload unpacks to at most {max_unpacked} bytes")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        total = 0
        for member in members:
            name = safe_name(member.filename)
            if not name:
                continue
            entry = tarfile.TarInfo(name)
            entry.mtime = 0
            if member.is_dir():
                entry.type, entry.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(entry)
                continue
            try:
                content = archive.read(member)
            except (zipfile.BadZipFile, ValueError, OSError, NotImplementedError, RuntimeError) as exc:
                raise UnsafeArchive(f"cannot read zip member {name!r}: {exc}") from None
            total += len(content)  # the sizes the headers declared may lie
            if total > max_unpacked:
                raise UnsafeArchive(f"a zip upload unpacks to at most {max_unpacked} bytes")
            entry.size, entry.mode = len(content), 0o644 | (0o111 if member.external_attr >> 16 & 0o100 else 0)
            tar.addfile(entry, io.BytesIO(content))
    return out.getvalue()
