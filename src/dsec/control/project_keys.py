"""Making a project's key straight in the state store (``dsec key create NAME --project P``,
run as root on the server's host, with no server needed)."""

from __future__ import annotations

from pydantic import ValidationError

from ..protocol.errors import InvalidRequest, ProjectNotFound
from ..protocol.project_models import ROOT_PROJECT, KeyRequest
from ..store.projects import ProjectStore
from ..store.sqlite import StateStore
from .projects import ROOT_QUOTA


def create_project_key(store: StateStore, name: str, project: str) -> tuple[str, str]:
    """(key id, secret) of a new key of ``project``."""
    try:
        req = KeyRequest(name=name, project=project)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid key: {exc.errors(include_url=False)}") from None
    projects = ProjectStore(store.url, ROOT_PROJECT, ROOT_QUOTA)
    try:
        if projects.get(req.project) is None:
            raise ProjectNotFound(f"no project {req.project!r}", project=req.project)
        key_id, secret, _ = store.create_key(req.name)
        projects.set_key_project(key_id, req.project)
    finally:
        projects.close()
    return key_id, secret
