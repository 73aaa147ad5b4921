"""An E2B template's build steps as a Dockerfile build (``Router.build_image``: the one builder).

The e2b SDK sends a template as steps (``RUN cmd [user]``, ``COPY src dest [user] [mode]``
with a ``filesHash``, ``ENV k v ...``, ``WORKDIR``, ``USER``) on top of ``fromImage`` /
``fromTemplate``; a COPY's files are uploaded first, one tar (gzip or plain) per files hash,
to the link the server answers for it (``Uploads``). Here the steps become Dockerfile
instructions (exec forms and shell quoting: a step's text never becomes another
instruction) and the uploads one context tar, each under ``<hash>/``, so a COPY names
``<hash>/<src>``. The uploads are the client's data: members are re-packed one by one (only
files, directories, symlinks and hard links inside the upload; sizes capped, gzip bombs
included) and the build's checked extraction checks them again.

Upload links carry a token (HMAC of project, template and hash with a secret of the state
directory): the SDK PUTs the tar there without its API key. An upload is kept under the state
directory until its template's build ends or the template is deleted. A link names any
files hash, and a template may wait for its build for ever, so what a project keeps there
is bounded (``MAX_UPLOAD_BYTES`` over all its templates): without that, one key filled the
host's disk with uploads no build would read, outside every quota.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import hmac
import io
import json
import os
import re
import shlex
import shutil
import tarfile
import zlib
from collections.abc import Iterable
from pathlib import Path

from ..protocol.archive import DEFAULT_MAX_MEMBERS
from ..protocol.errors import InvalidRequest, UnsafeArchive
from ..store.secret import load_secret

FILES_HASH = re.compile(r"[0-9a-f]{64}")
MAX_CONTEXT_BYTES = 256 << 20  # the uploads of one build, unpacked
MAX_CONTEXT_MEMBERS = DEFAULT_MAX_MEMBERS  # of one build's uploads: what its extraction takes
_HEADER = 512  # bytes of a tar header: what each member costs at least
MAX_UPLOAD_BYTES = 1 << 30  # the uploads a project's templates hold on the host, as sent
_GZIP_MAGIC = b"\x1f\x8b"


class Uploads:
    """The COPY uploads of template builds: ``<root>/<template id>/<files hash>``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._secret = load_secret(root.parent / "e2b-uploads.secret")

    def token(self, project: str, template_id: str, files_hash: str) -> str:
        mac = hmac.new(self._secret, f"upload {project} {template_id} {files_hash}".encode(),
                       hashlib.sha256).hexdigest()
        return f"{project}.{mac}"

    def project_of(self, token: str, template_id: str, files_hash: str) -> str | None:
        """The project a token was minted for (for this template and hash), else None."""
        project = token.partition(".")[0]
        good = hmac.compare_digest(self.token(project, template_id, files_hash), token)
        return project if good else None

    def path(self, template_id: str, files_hash: str) -> Path:
        if not FILES_HASH.fullmatch(files_hash):
            raise InvalidRequest("a files hash is 64 lowercase hex digits")
        return self.root / template_id / files_hash

    def held(self, template_ids: Iterable[str]) -> int:
        """The bytes the uploads of these templates take on the host (as sent)."""
        total = 0
        for template_id in template_ids:
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(self.root / template_id):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat(follow_symlinks=False).st_size
        return total

    def present(self, template_id: str, files_hash: str) -> bool:
        return self.path(template_id, files_hash).is_file()

    def put(self, template_id: str, files_hash: str, data: bytes) -> None:
        path = self.path(template_id, files_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.rename(path)

    def drop(self, template_id: str) -> None:
        shutil.rmtree(self.root / template_id, ignore_errors=True)

    def context(self, template_id: str, hashes: list[str]) -> bytes:
        """One plain tar of the uploads of ``hashes``, each under ``<hash>/``."""
        out, budget = io.BytesIO(), _Budget()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for files_hash in dict.fromkeys(hashes):
                path = self.path(template_id, files_hash)
                if not path.is_file():
                    raise InvalidRequest(f"the files of hash {files_hash} were not uploaded")
                _repack(path.read_bytes(), files_hash, tar, budget)
        return out.getvalue()


class _Budget:
    """What a build's uploads may unpack to, in memory as the re-packed tar: its members
    (the build's extraction takes no more) and its bytes, a header's 512 counted for every
    member. Counting file bytes only, a 1.5 MiB upload of one directory header repeated
    300,000 times re-packed into 357 MiB of the server's memory (64 MiB of it: gigabytes)."""

    def __init__(self) -> None:
        self.bytes, self.members = MAX_CONTEXT_BYTES, MAX_CONTEXT_MEMBERS

    def take(self, member: tarfile.TarInfo) -> None:
        self.members -= 1
        self.bytes -= _HEADER + (member.size if member.isfile() else 0)
        if self.members < 0:
            raise UnsafeArchive(f"a template's uploads hold more than {MAX_CONTEXT_MEMBERS} "
                                "members")
        if self.bytes < 0:
            raise UnsafeArchive(f"a template's uploads unpack to more than "
                                f"{MAX_CONTEXT_BYTES >> 20} MiB")


def _repack(upload: bytes, prefix: str, out: tarfile.TarFile, budget: _Budget) -> None:
    stream = gzip.GzipFile(fileobj=io.BytesIO(upload)) if upload.startswith(_GZIP_MAGIC) \
        else io.BytesIO(upload)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                budget.take(member)
                name = _relative(member.name)
                if member.isfile():
                    data = tar.extractfile(member)
                    member.name = f"{prefix}/{name}"
                    out.addfile(member, data)
                elif member.isdir() or member.issym() or member.islnk():
                    member.name = f"{prefix}/{name}"
                    if member.islnk():  # a hard link names a member of the same upload
                        member.linkname = f"{prefix}/{_relative(member.linkname)}"
                    out.addfile(member)
                else:
                    raise UnsafeArchive(f"{member.name!r}: an upload holds only files, "
                                        "directories and links")
                # both tars are streamed, nothing looks a member up again: their lists of
                # members (TarFile keeps every one) would hold 100,000 of them in memory
                tar.members.clear()  # type: ignore[attr-defined]  # not in typeshed
                out.members.clear()  # type: ignore[attr-defined]
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise UnsafeArchive(f"an uploaded tar is unreadable: {exc}") from None


def _relative(name: str) -> str:
    """A member's name without its leading ``./`` (as tar writes them); anything else, ``..``
    and absolute names included, is left for the build's checked extraction to refuse."""
    while name.startswith("./"):
        name = name[2:]
    return name or "."


def dockerfile(base: str, steps: list[tuple[str, list[str]]], hashes: list[str | None],
               user: str | None) -> str:
    """The Dockerfile of ``steps`` (already checked by shape) on ``base``; ``hashes``: each
    step's files hash (COPY); ``user``: the user in force at the start (a base template's)."""
    lines = [f"FROM {base}"]
    if user:
        lines.append(f"USER {_word(user)}")
    for (kind, args), files_hash in zip(steps, hashes, strict=True):
        if kind == "RUN":  # the exec form: the command's newlines stay in its JSON string
            command = ["/bin/sh", "-c", args[0]]
            if len(args) > 1 and args[1]:  # as this user, then back to the one in force
                lines += [f"USER {_word(args[1])}", f"RUN {json.dumps(command)}",
                          f"USER {_word(user or 'root')}"]
            else:
                lines.append(f"RUN {json.dumps(command)}")
        elif kind == "COPY":
            if files_hash is None:
                raise InvalidRequest("a COPY step needs its filesHash")
            src, dest = args[0], args[1]
            owner, mode = (args[2] if len(args) > 2 else ""), (args[3] if len(args) > 3 else "")
            flags = f"--chmod={_word(mode)} " if mode else ""
            numeric = bool(re.fullmatch(r"\d+(:\d+)?", owner))
            if owner and numeric:
                flags += f"--chown={owner} "
            lines.append(f"COPY {flags}{json.dumps([f'{files_hash}/{_line(src)}', _line(dest)])}")
            if owner and not numeric:  # a user by name: dsec's COPY takes numeric owners
                lines.append(f"RUN {json.dumps(['chown', '-R', _word(owner), _line(dest)])}")
        elif kind == "ENV":
            lines.append("ENV " + " ".join(shlex.quote(f"{_line(k)}={_line(v)}")
                                           for k, v in zip(args[::2], args[1::2], strict=True)))
        elif kind == "WORKDIR":
            lines.append(f"WORKDIR {shlex.quote(_line(args[0]))}")
        else:  # USER
            user = args[0]
            lines.append(f"USER {_word(user)}")
    return "\n".join(lines) + "\n"


def _line(text: str) -> str:
    """A step's argument, one line (a newline would start another instruction)."""
    if "\n" in text or "\r" in text or "\0" in text:
        raise InvalidRequest("a template step's arguments are single lines (RUN: join "
                             "commands with && or ;)")
    return text


def _word(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.:@+-]{1,255}", text):
        raise InvalidRequest(f"{text!r}: a user or mode is letters, digits and ._:@+-")
    return text
