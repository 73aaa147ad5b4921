"""The SDK's projects sub-API: ``client.projects()`` (async) and its blocking twin.

    projects = client.projects()
    await projects.create("team-a", sandboxes=20, cpu=40, memory_mb=65536)
    key = await projects.create_key("team-a", "trainer")     # key.key is the secret
"""

from __future__ import annotations

from typing import Any, Callable, Coroutine, TypeVar

from pydantic import BaseModel, ValidationError

from ..protocol.errors import InvalidRequest
from ..protocol.project_models import (
    KeyRequest,
    ProjectCreate,
    ProjectInfo,
    ProjectKey,
    Quota,
    QuotaUpdate,
)
from .transport import Transport

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def _checked(model: type[M], **fields: Any) -> M:
    try:
        return model(**fields)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid {model.__name__}: {exc.errors(include_url=False)}") from None


def _name(name: str) -> str:
    """A project name as a path segment, checked first so it cannot change the path."""
    return _checked(ProjectCreate, name=name).name


class Projects:
    """Projects the client's key may see: its own and its descendants (all, for an admin)."""

    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def list(self) -> list[ProjectInfo]:
        return [ProjectInfo.model_validate(p) for p in await self._t.json("GET", "/v1/projects")]

    async def get(self, name: str) -> ProjectInfo:
        return ProjectInfo.model_validate(await self._t.json("GET", f"/v1/projects/{_name(name)}"))

    async def create(self, name: str, *, parent: str | None = None, sandboxes: int = 0,
                     cpu: float = 0.0, memory_mb: int = 0,
                     snapshot_bytes: int = 0) -> ProjectInfo:
        """A child of ``parent`` (default: the key's project; ``default`` for an admin key);
        its quota is delegated from the parent's (``DelegationExceeded`` when the parent
        lacks the room)."""
        spec = _checked(ProjectCreate, name=name, parent=parent,
                        quota=_checked(Quota, sandboxes=sandboxes, cpu=float(cpu),
                                       memory_mb=memory_mb, snapshot_bytes=snapshot_bytes))
        return ProjectInfo.model_validate(
            await self._t.json("POST", "/v1/projects", json=spec.model_dump(exclude_none=True)))

    async def set_quota(self, name: str, *, sandboxes: int | None = None,
                        cpu: float | None = None, memory_mb: int | None = None,
                        snapshot_bytes: int | None = None) -> ProjectInfo:
        """Change a descendant's quota (what its parent delegates to it); None keeps a value."""
        update = _checked(QuotaUpdate, sandboxes=sandboxes, memory_mb=memory_mb,
                          cpu=None if cpu is None else float(cpu), snapshot_bytes=snapshot_bytes)
        return ProjectInfo.model_validate(await self._t.json(
            "PUT", f"/v1/projects/{_name(name)}/quota", json=update.model_dump(exclude_none=True)))

    async def create_key(self, project: str, name: str) -> ProjectKey:
        """A key of ``project``: it sees and creates that project's sandboxes only."""
        req = _checked(KeyRequest, name=name, project=project)
        return ProjectKey.model_validate(await self._t.json("POST", "/v1/keys", json=req.model_dump()))


class SyncProjects:
    """Blocking twin of ``Projects`` (``dsec.Client().projects()``)."""

    def __init__(self, call: Callable[[Coroutine[Any, Any, Any]], Any], projects: Projects) -> None:
        self._call, self._async = call, projects

    def list(self) -> list[ProjectInfo]:
        """The projects the client's key may see: its own and its descendants."""
        return self._call(self._async.list())

    def get(self, name: str) -> ProjectInfo:
        """One project, with its quota and use."""
        return self._call(self._async.get(name))

    def create(self, name: str, *, parent: str | None = None, sandboxes: int = 0,
               cpu: float = 0.0, memory_mb: int = 0, snapshot_bytes: int = 0) -> ProjectInfo:
        """A child of ``parent`` (default: the key's project); its quota is delegated from
        the parent's (``DelegationExceeded`` when the parent lacks the room)."""
        return self._call(self._async.create(name, parent=parent, sandboxes=sandboxes, cpu=cpu,
                                             memory_mb=memory_mb, snapshot_bytes=snapshot_bytes))

    def set_quota(self, name: str, *, sandboxes: int | None = None,
                  cpu: float | None = None, memory_mb: int | None = None,
                  snapshot_bytes: int | None = None) -> ProjectInfo:
        """Change a descendant's quota (what its parent delegates to it); None keeps a value."""
        return self._call(self._async.set_quota(name, sandboxes=sandboxes, cpu=cpu,
                                                memory_mb=memory_mb,
                                                snapshot_bytes=snapshot_bytes))

    def create_key(self, project: str, name: str) -> ProjectKey:
        """A key of ``project``: it sees and creates that project's sandboxes only."""
        return self._call(self._async.create_key(project, name))
