"""multipart/form-data bodies (RFC 7578) as the compatibility front-ends receive them: envd's
file uploads and SWE-ReX's ``/upload`` (a ``file`` part with ``target_path`` and ``unzip``
fields). One parser for both; contents are kept byte for byte."""

from __future__ import annotations

import email.message
import email.parser
import email.policy
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    name: str  # the form field's name
    filename: str | None  # set for a file part
    content: bytes


def form_parts(content_type: str, body: bytes) -> list[Part]:
    """The parts of a multipart body; ValueError when it is not one."""
    params = email.message.Message()
    params["content-type"] = content_type
    boundary = params.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise ValueError("no boundary in the content type")
    parts = []
    delimiter = b"\r\n--" + boundary.encode()
    for raw in (b"\r\n" + body).split(delimiter)[1:]:
        if raw.startswith(b"--"):
            break  # the closing delimiter
        head, separator, content = raw.partition(b"\r\n\r\n")
        if not separator:
            raise ValueError("a part without headers")
        headers = email.parser.BytesHeaderParser(policy=email.policy.HTTP).parsebytes(
            head.lstrip(b" \t").removeprefix(b"\r\n") + b"\r\n\r\n")
        name = headers.get_param("name", header="content-disposition")
        filename = headers.get_filename()
        parts.append(Part(str(name or ""), None if filename is None else str(filename), content))
    return parts
