"""Wire models of garbage collection: what one collection removed (or, dry, would remove),
by kind. Shared by the server's collectors, its admin route and the SDK's ``gc``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Removed(BaseModel):
    """``count`` things of one ``kind`` (``sandboxes``, ``events``, ``blobs``, ``layers``...)
    removed, holding ``bytes`` (on disk for files; the recorded text for database rows)."""

    model_config = ConfigDict(frozen=True)
    kind: str
    count: int = Field(ge=0)
    bytes: int = Field(ge=0)


class GcReport(BaseModel):
    """One collection: every collector's ``Removed``; ``dry_run``: nothing was removed, the
    counts are what would have been."""

    dry_run: bool
    removed: list[Removed]
