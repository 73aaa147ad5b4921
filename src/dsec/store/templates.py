"""E2B templates, in the state database (SQLite or PostgreSQL): per project, an alias naming a
dsec image plus the E2B metadata the SDK reads back (build id and status, build logs, the
template's env, workdir, user, start and ready commands).

A template belongs to the project of the key that requested it; the ``(project, alias)``
primary key makes one project's alias invisible to (and independent of) another's. The
server's own static mapping (``DSEC_E2B_TEMPLATES``) is not stored here: compat/e2b_templates.py
puts the two together in one lookup.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .db import Row, open_database

SCHEMA = """
CREATE TABLE IF NOT EXISTS e2b_templates (
    project TEXT NOT NULL,
    alias TEXT NOT NULL,
    template_id TEXT NOT NULL UNIQUE,
    build_id TEXT NOT NULL,
    status TEXT NOT NULL,
    image TEXT,
    reason TEXT,
    logs TEXT NOT NULL,
    tags TEXT NOT NULL,
    settings TEXT NOT NULL,
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (project, alias)
);
"""

Status = Literal["waiting", "building", "ready", "error"]


@dataclass
class TemplateRow:
    project: str
    alias: str
    template_id: str
    build_id: str
    status: Status
    image: str | None  # the dsec image a ready build names
    reason: str | None  # why a build failed
    logs: list[dict[str, Any]]
    tags: list[str]  # the build's tags (E2B's name:tag), the default one first
    # env, workdir, user, start_cmd, ready_cmd: what the build's steps set
    settings: dict[str, Any] = field(default_factory=dict)
    cpu_count: int = 2
    memory_mb: int = 512
    created_at: float = 0.0
    updated_at: float = 0.0

    @classmethod
    def of(cls, row: Row) -> TemplateRow:
        return cls(row["project"], row["alias"], row["template_id"], row["build_id"],
                   row["status"], row["image"], row["reason"], json.loads(row["logs"]),
                   json.loads(row["tags"]), json.loads(row["settings"]), row["cpu_count"], row["memory_mb"],
                   row["created_at"], row["updated_at"])


class TemplateStore:
    def __init__(self, target: Path | str) -> None:
        """``target``: the state store's SQLite file or URL (``StateStore.url``)."""
        self._db = open_database(target, SCHEMA)

    def close(self) -> None:
        self._db.close()

    def get(self, project: str, alias: str) -> TemplateRow | None:
        row = self._db.execute("SELECT * FROM e2b_templates WHERE project=? AND alias=?",
                               (project, alias)).fetchone()
        return TemplateRow.of(row) if row else None

    def by_id(self, project: str, template_id: str) -> TemplateRow | None:
        row = self._db.execute("SELECT * FROM e2b_templates WHERE project=? AND template_id=?",
                               (project, template_id)).fetchone()
        return TemplateRow.of(row) if row else None

    def of_project(self, project: str) -> list[TemplateRow]:
        rows = self._db.execute("SELECT * FROM e2b_templates WHERE project=? ORDER BY created_at",
                                (project,)).fetchall()
        return [TemplateRow.of(row) for row in rows]

    def request(self, project: str, alias: str, template_id: str, build_id: str,
                tags: list[str], cpu_count: int, memory_mb: int) -> TemplateRow:
        """A new build of ``alias`` (waiting for its steps): a new template, or the next build
        of an existing one, which keeps its id and its image until the build is ready."""
        now = time.time()
        # one statement: two first builds of one alias at once make one template (the later
        # request's build is the current one), never a constraint error
        self._db.execute(
            "INSERT INTO e2b_templates (project, alias, template_id, build_id, status, image, "
            "reason, logs, tags, settings, cpu_count, memory_mb, created_at, updated_at) "
            "VALUES (?,?,?,?,'waiting',NULL,NULL,'[]',?,'{}',?,?,?,?) "
            "ON CONFLICT (project, alias) DO UPDATE SET build_id=excluded.build_id, "
            "status='waiting', reason=NULL, logs='[]', tags=excluded.tags, "
            "cpu_count=excluded.cpu_count, memory_mb=excluded.memory_mb, "
            "updated_at=excluded.updated_at",
            (project, alias, template_id, build_id, json.dumps(tags), cpu_count, memory_mb,
             now, now))
        row = self.get(project, alias)
        assert row is not None
        return row

    def update(self, row: TemplateRow) -> bool:
        """Write a build's progress; False when the template was deleted or rebuilt meanwhile."""
        return self._db.execute(
            "UPDATE e2b_templates SET status=?, image=?, reason=?, logs=?, settings=?, "
            "updated_at=? WHERE project=? AND alias=? AND build_id=?",
            (row.status, row.image, row.reason, json.dumps(row.logs), json.dumps(row.settings),
             time.time(), row.project, row.alias, row.build_id)).rowcount == 1

    def touch(self, project: str, alias: str, build_id: str) -> None:
        """A running build's heartbeat."""
        self._db.execute("UPDATE e2b_templates SET updated_at=? WHERE project=? AND alias=? AND "
                         "build_id=? AND status='building'", (time.time(), project, alias, build_id))

    def delete(self, project: str, template_id_or_alias: str) -> bool:
        return self._db.execute(
            "DELETE FROM e2b_templates WHERE project=? AND (template_id=? OR alias=?)",
            (project, template_id_or_alias, template_id_or_alias)).rowcount > 0
