"""Projects: which sandboxes a key sees, and how much its project may hold.

Projects form a tree under ``default``. A project's quota (concurrent sandboxes, CPUs, memory)
is what its sandboxes may hold plus what it delegates to its children: ``used + delegated <=
quota`` always. Every create (plain, trajectory, replay, fork, E2B, SandboxFusion) reserves
its share at admission, atomically in the state store, and gives it back when the create
fails or the sandbox ends (stopped, expired, died), exactly once. An fn call (and
``run_code``) holds one sandbox with an fn worker's CPU and memory while it runs. A snapshot
holds its sandbox's ``disk_mb`` in bytes of snapshot room, from before it is taken until it
is deleted (by a client, or by its edge when its TTL ends).

Who calls is a context variable set when the request's key is checked. An admin key (a key
with no project: the local key, ``dsec key create NAME``) sees everything and creates in
``default``. A project key sees, and creates in, its own project only -- not its
descendants' -- and answers ``SandboxNotFound`` for any other sandbox, so nothing tells it
another project's sandbox exists. It may read its project and its descendants, make child
projects under them, change its descendants' quotas (never its own) and make keys for them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from contextvars import ContextVar
from typing import Any, Awaitable, Callable, Iterable, Iterator, TypeVar

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..protocol.errors import (
    CapacityExhausted,
    DelegationExceeded,
    DSecError,
    Forbidden,
    ProjectExists,
    ProjectNotFound,
    QuotaExceeded,
    RemoteError,
    SandboxNotFound,
)
from ..protocol.models import CreateRequest, SandboxInfo, Snapshot
from ..protocol.project_models import (
    MAX_CPU,
    MAX_MEMORY_MB,
    MAX_SANDBOXES,
    MAX_SNAPSHOT_BYTES,
    ROOT_PROJECT,
    KeyRequest,
    ProjectCreate,
    ProjectInfo,
    ProjectKey,
    Quota,
    QuotaUpdate,
)
from ..store.projects import Amounts, NameTaken, ProjectRow, ProjectStore
from ..store.sqlite import StateStore
from ..substrates.fn.fn import FN_CALL_CPU, FN_CALL_MEMORY_MB

log = logging.getLogger("dsec.projects")

ROOT_QUOTA: Amounts = (MAX_SANDBOXES, int(MAX_CPU * 1000), MAX_MEMORY_MB, MAX_SNAPSHOT_BYTES)
RESOURCE_NAMES = ("sandboxes", "cpu", "memory_mb", "snapshot_bytes")
RECENT_FAILURES = 100
T = TypeVar("T")
_caller_project: ContextVar[str | None] = ContextVar("dsec_caller_project", default=None)


def amounts(quota: Quota) -> Amounts:
    return quota.sandboxes, round(quota.cpu * 1000), quota.memory_mb, quota.snapshot_bytes


def quota(values: Iterable[int]) -> Quota:
    sandboxes, cpu_milli, memory_mb, snapshot_bytes = values
    return Quota(sandboxes=sandboxes, cpu=cpu_milli / 1000, memory_mb=memory_mb,
                 snapshot_bytes=snapshot_bytes)


def info(row: ProjectRow) -> ProjectInfo:
    free = (q - u - d for q, u, d in zip(row.quota, row.used, row.delegated))
    return ProjectInfo(name=row.name, parent=row.parent, quota=quota(row.quota),
                       used=quota(row.used), delegated=quota(row.delegated),
                       available=quota(free), created_at=row.created_at)


def _unit(resource: str, value: int) -> float | int:
    return value / 1000 if resource == "cpu" else value


def _shortage(row: ProjectRow, asked: Iterable[int], limit: Amounts | None = None) -> dict[str, Any]:
    """Which resource lacks room on ``row`` for ``asked`` more (under ``limit``, by default its
    quota), as the error's details."""
    for name, q, u, d, a in zip(RESOURCE_NAMES, limit or row.quota, row.used, row.delegated, asked):
        if u + d + a > q:
            return dict(project=row.name, resource=name, quota=_unit(name, q),
                        used=_unit(name, u), delegated=_unit(name, d), asked=_unit(name, a))
    return dict(project=row.name)


class Projects:
    def __init__(self, store: StateStore, registry: CollectorRegistry) -> None:
        self.keys = store
        self.store = ProjectStore(store.url, ROOT_PROJECT, ROOT_QUOTA)
        self.started_at = time.time()
        self.failures: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_FAILURES)
        self._key_projects: dict[str, str | None] = {}
        self._owners: dict[str, str] = {}  # sandbox id -> project (ownership never changes)
        self.refusals = Counter("dsec_refusals_total", "Creates refused before any edge was "
                                "asked (quota) or by every edge (capacity)",
                                ["project", "reason"], registry=registry)
        registry.register(ProjectCollector(self.store))

    # who calls
    def enter(self, key_id: str) -> None:
        """Make the key's project the caller's for the rest of this request."""
        if key_id not in self._key_projects:
            self._key_projects[key_id] = self.store.key_project(key_id)
        _caller_project.set(self._key_projects[key_id])

    @staticmethod
    def caller() -> str | None:
        """The caller's project; None for an admin key (and internal work)."""
        return _caller_project.get()

    def require_admin(self) -> None:
        if self.caller() is not None:
            raise Forbidden("this needs an admin key (a key of no project)")

    # sandboxes
    def project_of(self, sandbox_id: str) -> str:
        project = self._owners.get(sandbox_id)
        if project is None:
            project = self.store.project_of(sandbox_id)
            if project is None:  # unknown, or made before projects existed: not cached
                return ROOT_PROJECT
            if len(self._owners) > 100_000:
                self._owners.clear()
            self._owners[sandbox_id] = project
        return project

    def sees(self, sandbox_id: str) -> bool:
        caller = self.caller()
        return caller is None or self.project_of(sandbox_id) == caller

    def check(self, sandbox_id: str) -> None:
        if not self.sees(sandbox_id):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)

    def visible(self, infos: Iterable[SandboxInfo]) -> list[SandboxInfo]:
        return [i for i in infos if self.sees(i.id)]

    async def admit(self, req: CreateRequest,
                    place: Callable[[CreateRequest], Awaitable[SandboxInfo]]) -> SandboxInfo:
        """Reserve the sandbox's share of the caller's project, then place it; the share is
        held until the sandbox ends."""
        project, reservation = self._reserve(req.cpu, req.memory_mb)
        sandbox = await self._holding(project, reservation, lambda: place(req))
        self.store.bind(reservation, sandbox.id)
        self._owners[sandbox.id] = project
        return sandbox

    async def admit_call(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run an fn call (or run_code) holding what it costs of the caller's project: one
        sandbox with an fn worker's CPU and memory limits, for as long as it runs."""
        project, reservation = self._reserve(FN_CALL_CPU, FN_CALL_MEMORY_MB)
        result = await self._holding(project, reservation, call)  # gives it back if it fails
        self.store.release(reservation)
        return result

    @contextlib.contextmanager
    def holding_one(self, cpu: float, memory_mb: int) -> Iterator[None]:
        """Hold one sandbox with ``cpu`` and ``memory_mb`` of the caller's project for the
        block (a Dockerfile build: one step sandbox at a time); QuotaExceeded when it has no
        room, before the block runs."""
        _, reservation = self._reserve(cpu, memory_mb)
        try:
            yield
        finally:
            self.store.release(reservation)

    def _reserve(self, cpu: float, memory_mb: int) -> tuple[str, str]:
        """(the caller's project, a reservation of one sandbox, ``cpu`` and ``memory_mb`` of
        its quota); QuotaExceeded when it has no room."""
        project = self.caller() or ROOT_PROJECT
        cpu_milli = round(cpu * 1000)
        reservation = self.store.reserve(project, cpu_milli, memory_mb)
        if reservation is None:
            # Sandboxes that ended out of this server's hearing (another replica's, in a
            # cluster) may still hold their share: give those back, then ask once more.
            self.reconcile()
            reservation = self.store.reserve(project, cpu_milli, memory_mb)
        if reservation is None:
            raise self._refused(project, (1, cpu_milli, memory_mb, 0), "create", "the sandbox")
        return project, reservation

    def _refused(self, project: str, asked: Amounts, kind: str, what: str) -> DSecError:
        """The error refusing a ``kind`` of operation ``asked`` more of the project (counted
        and remembered)."""
        row = self.store.get(project)
        if row is None:
            return ProjectNotFound(f"the key's project {project!r} is gone", project=project)
        details = _shortage(row, asked)
        self.refusals.labels(project, f"quota_{details.get('resource', 'unknown')}").inc()
        self._failed(project, None, QuotaExceeded.code, "quota exceeded")
        log.info("refused a %s in %s: quota of %s", kind, project, details.get("resource"))
        return QuotaExceeded(f"project {project!r} has no room for {what}: "
                             f"{details.get('resource')} would exceed its quota", **details)

    async def _holding(self, project: str, reservation: str, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` under a reservation, which goes back if the work fails. A function
        that raised (RemoteError) is the call's answer, not a failure of the platform."""
        try:
            return await work()
        except BaseException as exc:
            self.store.release(reservation)
            if isinstance(exc, CapacityExhausted):
                self.refusals.labels(project, "capacity").inc()
            if isinstance(exc, DSecError) and not isinstance(exc, RemoteError):
                self._failed(project, None, exc.code, exc.message)
            raise

    # snapshots: each holds bytes of its sandbox's project from before it is taken until deleted
    async def admit_snapshot(self, sandbox_id: str, size: int,
                             take: Callable[[], Awaitable[Snapshot]]) -> Snapshot:
        """Hold ``size`` bytes of the snapshot room of the sandbox's project, then take the
        snapshot (``take()``); QuotaExceeded, and nothing taken, when the room is short.
        The hold goes back if taking fails, else when the snapshot is deleted."""
        project = self.project_of(sandbox_id)
        hold = self.store.hold_snapshot(project, size)
        if hold is None:  # holds of snapshots deleted out of this server's hearing go back
            self.reconcile()
            hold = self.store.hold_snapshot(project, size)
        if hold is None:
            raise self._refused(project, (0, 0, 0, size), "snapshot", f"a snapshot of {size} bytes")
        try:
            snap = await take()
        except BaseException:
            self.store.release_snapshot(hold)
            raise
        if self.store.snapshot_hold_of(snap.id) is not None:  # an unchanged one answered again
            self.store.release_snapshot(hold)
        else:
            self.store.bind_snapshot(hold, snap.id)
        return snap

    def snapshot_deleted(self, snapshot_id: str) -> None:
        """A snapshot was deleted: give its bytes back (once, however often told)."""
        hold = self.store.snapshot_hold_of(snapshot_id)
        if hold is not None:
            self.store.release_snapshot(hold)

    def ended(self, sandbox_id: str, state: str, reason: str) -> None:
        """An edge ended a sandbox: give its share back."""
        reservation = self.store.reservation_of(sandbox_id)
        if reservation is not None:
            self.store.release(reservation)
        if state == "died":
            self._failed(self.project_of(sandbox_id), sandbox_id, "sandbox_died", reason)

    def reconcile(self) -> None:
        """Give back what sandboxes that ended, and snapshots deleted (their TTL's reaper is
        their edge's), while no server watched still hold."""
        for reservation in self.store.stale(self.started_at):
            self.store.release(reservation)
        for hold in self.store.stale_snapshot_holds(self.started_at):
            self.store.release_snapshot(hold)

    def _failed(self, project: str, sandbox_id: str | None, code: str, message: str) -> None:
        self.failures.append(dict(at=time.time(), project=project, sandbox_id=sandbox_id,
                                  code=code, message=message[:300]))

    def recent_failures(self) -> list[dict[str, Any]]:
        caller = self.caller()
        return [f for f in reversed(self.failures) if caller is None or f["project"] == caller]

    # projects
    def _tree(self) -> dict[str, ProjectRow]:
        return {row.name: row for row in self.store.all()}

    def _visible_rows(self) -> list[ProjectRow]:
        """The caller's project and its descendants (all, for an admin)."""
        rows = self._tree()
        caller = self.caller()
        return [row for row in rows.values() if caller is None or caller in _lineage(rows, row.name)]

    def _visible(self, name: str) -> ProjectRow:
        for row in self._visible_rows():
            if row.name == name:
                return row
        raise ProjectNotFound(f"no project {name!r}", project=name)

    def list(self) -> list[ProjectInfo]:
        return [info(row) for row in self._visible_rows()]

    def get(self, name: str) -> ProjectInfo:
        return info(self._visible(name))

    def create(self, spec: ProjectCreate) -> ProjectInfo:
        parent = self._visible(spec.parent or self.caller() or ROOT_PROJECT)
        asked = amounts(spec.quota)
        try:
            made = self.store.create(spec.name, parent.name, asked)
        except NameTaken:
            raise ProjectExists(f"project {spec.name!r} exists", project=spec.name) from None
        if not made:
            row = self.store.get(parent.name)
            assert row is not None
            details = _shortage(row, asked)
            raise DelegationExceeded(f"project {parent.name!r} cannot delegate that much to "
                                     f"{spec.name!r}: its {details.get('resource')} would exceed "
                                     "its quota", **details)
        log.info("project %s created under %s", spec.name, parent.name)
        return self.get(spec.name)

    def set_quota(self, name: str, update: QuotaUpdate) -> ProjectInfo:
        row = self._visible(name)
        caller = self.caller()
        if caller is not None and name == caller:
            raise Forbidden(f"a key of project {name!r} cannot change its own quota; its "
                            "parent's keys (or an admin key) can", project=name)
        old = quota(row.quota)
        new = Quota(**{**old.model_dump(), **update.model_dump(exclude_none=True)})
        asked = amounts(new)
        short = self.store.set_quota(name, asked)
        if short is not None:
            now = self.store.get(short)
            assert now is not None
            if short == name:  # it holds (used and delegated) more than the new quota
                details = _shortage(now, (0, 0, 0, 0), limit=asked)
                raise DelegationExceeded(f"project {name!r} holds more {details.get('resource')} "
                                         "(used and delegated) than the new quota", **details)
            change = (a - b for a, b in zip(asked, row.quota))
            details = _shortage(now, change)
            raise DelegationExceeded(f"project {short!r} cannot delegate that much to {name!r}: "
                                     f"its {details.get('resource')} would exceed its quota",
                                     **details)
        log.info("project %s quota set to %s", name, new.model_dump())
        return self.get(name)

    def create_key(self, req: KeyRequest) -> ProjectKey:
        project = self._visible(req.project)
        key_id, secret, created_at = self.keys.create_key(req.name)
        self.store.set_key_project(key_id, project.name)
        return ProjectKey(id=key_id, name=req.name, project=project.name, created_at=created_at,
                          key=secret)


def _lineage(rows: dict[str, ProjectRow], name: str) -> Iterator[str]:
    """The project and its ancestors, up to the root."""
    seen: set[str] = set()
    current: str | None = name
    while current is not None and current not in seen:
        seen.add(current)
        yield current
        row = rows.get(current)
        current = row.parent if row else None


class ProjectCollector(Collector):
    """Per-project quota, use and delegation, read from the store when scraped."""

    def __init__(self, store: ProjectStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        families = {
            kind: GaugeMetricFamily(f"dsec_project_{kind}", help_text, labels=["project", "resource"])
            for kind, help_text in (("quota", "What the project may hold"),
                                    ("used", "What its live sandboxes hold"),
                                    ("delegated", "What it handed to its child projects"))}
        for row in self.store.all():
            for kind, values in (("quota", row.quota), ("used", row.used),
                                 ("delegated", row.delegated)):
                for name, value in zip(RESOURCE_NAMES, values):
                    families[kind].add_metric([row.name, name], value / 1000 if name == "cpu" else value)
        yield from families.values()
