"""``Client.build_image``: a Dockerfile built by the server (``POST /v1/images/build``), each
step in a sandbox on one of its edges.

The context (a directory here, or a tar already made) is sent whole as a plain tar, symlinks
as links (the server refuses a link out of the context, and any name out of it); the
server's extraction applies ``.dockerignore`` to COPY sources, not to what is sent, so keep
the context small (at most the server's body limit, 64 MiB). Log lines arrive as they come
(``on_log``); a failing step is ``ImageBuildError`` with its line and output tail.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any, Callable

from ..protocol.build import ImageBuildRequest, ImageBuilt
from .transport import Transport

Context = str | os.PathLike[str] | bytes | None


def context_tar(context: Context) -> bytes:
    """The build context as a plain tar: ``bytes`` as given, a directory packed (its
    contents at the tar's top), None: empty."""
    if context is None or isinstance(context, bytes):
        return context or b""
    root = Path(context)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name)
    return buffer.getvalue()


def dockerfile_text(dockerfile: str | os.PathLike[str] | None, context: Context) -> str:
    """The Dockerfile's text: ``dockerfile`` if it is a path to a file or text with a newline
    (``FROM x\\nRUN ...``), else ``Dockerfile`` in the context directory."""
    if dockerfile is None:
        if not isinstance(context, (str, os.PathLike)):
            raise ValueError("give dockerfile= (a path or the text) with a tar or no context")
        return (Path(context) / "Dockerfile").read_text()
    if isinstance(dockerfile, str) and "\n" in dockerfile:
        return dockerfile
    return Path(dockerfile).read_text()


async def build(t: Transport, req: ImageBuildRequest, context: bytes,
                on_log: Callable[[str], Any] | None) -> ImageBuilt:
    files = {"request": (None, req.model_dump_json(), "application/json"),
             "context": ("context.tar", context, "application/x-tar")}
    async for event in t.ndjson("POST", "/v1/images/build", files=files):
        if event["type"] == "log":
            if on_log is not None:
                on_log(str(event["message"]))
        elif event["type"] == "result":
            return ImageBuilt.model_validate(event["result"])
    raise ValueError(f"the build's stream ended without a result: {json.dumps(event)[:200]}")
