"""The wire models of a Dockerfile build through the server (``POST /v1/images/build``):
its request, the log lines it streams and its result. Shared by the SDK
(``Client.build_image``), the routes, the edge that builds (``edge/dockerbuild.py``) and the
E2B template builds, which translate their steps into the same request."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import Field

from .models import Network, NetworkPolicy, _Model, _Request

MAX_DOCKERFILE_BYTES = 1 << 20


class ImageBuildRequest(_Request):
    name: str = Field(min_length=1, max_length=128, description="the built image's name "
                      "(a project key's build is stored as p.PROJECT.NAME: docs/IMAGES.md)")
    dockerfile: str = Field(min_length=1, max_length=MAX_DOCKERFILE_BYTES,
                            description="the Dockerfile's text")
    build_args: dict[str, str] = Field(default_factory=dict, description="ARG values")
    network: Network = Field("none", description="egress of RUN steps (as a sandbox's)")
    disk_mb: int = Field(4096, ge=64, le=1 << 20, description="each step's disk")
    memory_mb: int = Field(2048, ge=64, le=1 << 20)
    cpu: float = Field(1.0, gt=0, le=64)


class BuildLog(_Model):
    """One line of a build's progress (a step starting, a cache hit, a line of a RUN's
    output): plain text, no terminal escapes."""

    message: str


class ImageBuilt(_Model):
    """A finished build: the image's name in the store (what ``create(image=...)`` takes)."""

    image: str
    digest: str
    steps_run: int
    steps_cached: int


def allow_network(allow: Iterable[str]) -> Network:
    """RUN steps' egress from ``--allow`` items (the CLI's, ``DSEC_E2B_BUILD_ALLOW``'s): a name
    is a service of the server's table (``pypi``), anything else a raw rule (``host:port``,
    CIDR); none: no network. ValueError for a bad rule."""
    items = [item.strip() for item in allow if item.strip()]
    if not items:
        return "none"
    services = {a: True for a in items if ":" not in a and "/" not in a and not a[0].isdigit()}
    return NetworkPolicy(services=services, allow=[a for a in items if a not in services])
