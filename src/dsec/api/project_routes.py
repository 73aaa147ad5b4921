"""HTTP routes of projects and project keys (``/v1/projects``, ``/v1/keys``)."""

from __future__ import annotations

from fastapi import APIRouter, Path

from ..control.projects import Projects
from ..protocol.project_models import (
    PROJECT_NAME,
    KeyRequest,
    ProjectCreate,
    ProjectInfo,
    ProjectKey,
    QuotaUpdate,
)


def project_routes(projects: Projects) -> APIRouter:
    api = APIRouter(responses={400: {"description": "invalid_request: a malformed request"},
                               401: {"description": "unauthorized"}})
    Name = Path(pattern=PROJECT_NAME, max_length=63)

    @api.get("/v1/projects")
    async def list_projects() -> list[ProjectInfo]:
        """The key's project and its descendants (every project, for an admin key)."""
        return projects.list()

    @api.post("/v1/projects", status_code=201, responses={404: {}, 409: {}})
    async def create_project(spec: ProjectCreate) -> ProjectInfo:
        """A child project; its quota is delegated from the parent's (``delegation_exceeded``
        when the parent lacks the room)."""
        return projects.create(spec)

    @api.get("/v1/projects/{name}", responses={404: {}})
    async def get_project(name: str = Name) -> ProjectInfo:
        return projects.get(name)

    @api.put("/v1/projects/{name}/quota", responses={403: {}, 404: {}, 409: {}})
    async def set_quota(update: QuotaUpdate, name: str = Name) -> ProjectInfo:
        """Change a project's quota: for a child, how much its parent delegates to it."""
        return projects.set_quota(name, update)

    @api.post("/v1/keys", status_code=201, responses={404: {}})
    async def create_key(req: KeyRequest) -> ProjectKey:
        """A key of a project (the secret is shown once)."""
        return projects.create_key(req)

    return api
