"""Images a project builds through the server are its own: named ``p.PROJECT.NAME``.

The image store is one namespace for the whole server (builtin specs, pulls, the command
line's builds are everyone's). A project key's build (``POST /v1/images/build``, an E2B
template with RUN/COPY steps) is stored under its project's prefix, so no other project's
build can take or replace its name, and any call naming an image (create, fn calls, a build's
FROM, a template's ``fromImage``) by another project's prefix is answered ``ImageNotFound``,
as if it did not exist; so is any image named by digest (a prefix is matched against every
project's images). An admin key (no project) names images as it likes and sees all.
Project names hold no ``.`` (``PROJECT_NAME``), and a registry reference's canonical name
holds a ``/``, so the prefix is read without ambiguity.
"""

from __future__ import annotations

from ..images.spec import IMAGE_NAME
from ..protocol.errors import ImageNotFound, InvalidRequest

PREFIX = "p."


def built_name(name: str, project: str | None) -> str:
    """The store name of an image ``project`` builds as ``name`` (admin: ``name`` itself)."""
    full = name if project is None else f"{PREFIX}{project}.{name}"
    if (not IMAGE_NAME.fullmatch(name) or not IMAGE_NAME.fullmatch(full)
            or (project is not None and name.startswith(PREFIX))):
        raise InvalidRequest(f"{name!r} is not a valid image name (letters, digits, '.', '_', "
                             f"':', '-', with its project's prefix at most 128; not starting "
                             f"with '{PREFIX}', the projects' prefix)")
    return full


# What a project's key never names, besides other projects' builds: an image by digest (a
# digest prefix is matched against every image of the store, every project's, and ``sha256:``
# matches them all), and the scratch image of a build under way as older servers named it
# (edge/dockerbuild.py names it in the ``p._build.`` namespace now).
DIGEST_REF, LEGACY_SCRATCH = "sha256:", "dsec-build-"


def check_visible(image: str, project: str | None) -> None:
    """ImageNotFound if ``image`` is not one a caller of ``project`` may name: another
    project's build, an image by digest, a build's scratch image. An admin (no project)
    names any."""
    if project is None:
        return
    if (image.startswith((DIGEST_REF, LEGACY_SCRATCH))
            or (image.startswith(PREFIX) and "/" not in image
                and not image.startswith(f"{PREFIX}{project}."))):
        raise ImageNotFound(f"no image {image!r}", ref=image)
