"""Image references as Docker and the OCI distribution spec write them: ``[REGISTRY/]PATH[:TAG][@DIGEST]``.

Why a module of its own: the reference a user types (``python:3.11-slim``) names a stored image,
a registry to pull from and a name to store under, and all three must agree. The rules are
Docker's: a first component with a ``.`` or ``:`` (or ``localhost``) is a registry, anything else
is on Docker Hub, where a one-component path is under ``library/``; no tag and no digest means
``:latest``. ``canonical`` (``docker.io/library/python:3.11-slim``) is the store's name for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsec.protocol.errors import InvalidRequest

DOCKER_HUB = "docker.io"
_DOCKER_HUB_API = "registry-1.docker.io"
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_DOMAIN = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"(?::[0-9]{1,5})?$|^\[[0-9A-Fa-f:.]+\](?::[0-9]{1,5})?$"
)
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")
_MAX_NAME = 255


@dataclass(frozen=True)
class Reference:
    registry: str  # "docker.io", "127.0.0.1:5000", "registry.example"
    repository: str  # "library/python", "team/swe-task"
    tag: str | None  # None when pinned by digest alone
    digest: str | None  # "sha256:<hex>"

    @property
    def api_host(self) -> str:
        """Where the registry's API answers (Docker Hub's API is not at docker.io)."""
        return _DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def pinned(self) -> str:
        """What the manifest is fetched by: the digest when given, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def canonical(self) -> str:
        tag = f":{self.tag}" if self.tag else ""
        digest = f"@{self.digest}" if self.digest else ""
        return f"{self.registry}/{self.repository}{tag}{digest}"

    def __str__(self) -> str:
        return self.canonical


def parse_reference(text: str) -> Reference:
    """The reference ``text`` names; ``InvalidRequest`` saying what is wrong otherwise."""
    if not text or len(text) > 512 or text != text.strip():
        raise InvalidRequest(f"{text!r} is not an image reference", ref=text)
    rest, _, digest = text.partition("@")
    if digest and not _DIGEST.match(digest):
        raise InvalidRequest(f"{text!r}: the digest must be sha256:<64 hex digits>", ref=text)
    name, tag = rest, None
    slash, colon = rest.rfind("/"), rest.rfind(":")
    if colon > slash:  # a tag (a ':' before the last '/' is a registry's port)
        name, tag = rest[:colon], rest[colon + 1:]
        if not _TAG.match(tag):
            raise InvalidRequest(f"{text!r}: {tag!r} is not a valid tag", ref=text)
    first, sep, path = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry = first
        if not _DOMAIN.match(registry):
            raise InvalidRequest(f"{text!r}: {registry!r} is not a registry host", ref=text)
    else:
        registry, path = DOCKER_HUB, name
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if len(path) > _MAX_NAME or not all(_COMPONENT.match(c) for c in path.split("/")):
        raise InvalidRequest(
            f"{text!r}: {path!r} is not a repository name (lower-case components separated by '/')",
            ref=text,
        )
    return Reference(registry, path, tag if tag or digest else "latest", digest or None)


def is_reference(text: str) -> bool:
    try:
        parse_reference(text)
    except InvalidRequest:
        return False
    return True
