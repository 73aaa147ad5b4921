"""Wire models of projects, quotas and project keys, shared by the SDK and the API server.

Every number is bounded and strictly typed (no strings, booleans, fractions for counts, NaN or
infinities), so a malformed request is a typed 400, never a server error.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

PROJECT_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"
KEY_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"
ROOT_PROJECT = "default"
MAX_SANDBOXES = 1_000_000
MAX_CPU = 1_000_000.0
MAX_MEMORY_MB = 1 << 40
MAX_SNAPSHOT_BYTES = 1 << 60


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 2.0: take a float with no fraction as an int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_Count = Annotated[int, BeforeValidator(_integral), Field(ge=0)]  # bounded by each use


def _up_to(most: int) -> WithJsonSchema:
    """The JSON schema of a count up to ``most``, spelled out: pydantic's loses the bounds
    behind a before-validator."""
    return WithJsonSchema({"type": "integer", "minimum": 0, "maximum": most})


Sandboxes = Annotated[_Count, Field(le=MAX_SANDBOXES), _up_to(MAX_SANDBOXES)]
Cpu = Annotated[float, Field(ge=0, le=MAX_CPU, allow_inf_nan=False)]
MemoryMB = Annotated[_Count, Field(le=MAX_MEMORY_MB), _up_to(MAX_MEMORY_MB)]
SnapshotBytes = Annotated[_Count, Field(le=MAX_SNAPSHOT_BYTES), _up_to(MAX_SNAPSHOT_BYTES)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Quota(_Strict):
    """Concurrent sandboxes, CPUs (cores, to a thousandth), memory (MB) and the bytes the
    project's snapshots may hold (each counts its sandbox's ``disk_mb``: docs/API.md)."""

    sandboxes: Sandboxes = 0
    cpu: Cpu = 0.0
    memory_mb: MemoryMB = 0
    snapshot_bytes: SnapshotBytes = 0


class QuotaUpdate(_Strict):
    """A new quota; a field left out (or null) keeps its value."""

    sandboxes: Sandboxes | None = None
    cpu: Cpu | None = None
    memory_mb: MemoryMB | None = None
    snapshot_bytes: SnapshotBytes | None = None


class ProjectCreate(_Strict):
    name: str = Field(pattern=PROJECT_NAME, description="lower-case letters, digits, - and _")
    parent: str | None = Field(None, pattern=PROJECT_NAME,
                               description="the project that delegates the quota; default: "
                                           "the key's project (default, for an admin key)")
    quota: Quota = Field(default_factory=Quota, description="delegated from the parent's quota")


class ProjectInfo(_Strict):
    name: str
    parent: str | None
    quota: Quota = Field(description="what the project may hold")
    used: Quota = Field(description="held by its live sandboxes (and creates in flight)")
    delegated: Quota = Field(description="handed to its child projects")
    available: Quota = Field(description="quota - used - delegated: what a create may still take")
    created_at: float


class KeyRequest(_Strict):
    name: str = Field(pattern=KEY_NAME)
    project: str = Field(pattern=PROJECT_NAME)


class ProjectKey(_Strict):
    id: str
    name: str
    project: str
    created_at: float
    key: str = Field(description="the secret; shown once")
