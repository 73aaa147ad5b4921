"""Which edge owns a sandbox, and where a new sandbox or an fn call goes.

A sandbox id is ``sb-<edge id>-<random>``, so any API replica routes any call without shared
state. The edges are a directory's (``control.directory``: this process's, or a Ray
cluster's); placement is the directory's, admission (the caller's project quota) the
router's, the same for every create path (native, trajectory, E2B, SandboxFusion) and for fn
calls. Calls on a sandbox attached to a trajectory go through the trajectory recorder
(``edge_for``).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..edge.edge import Edge, snapshot_info
from ..edge.inherit import from_snapshot
from ..images.dockerfile import base_image
from ..protocol.build import BuildLog, ImageBuildRequest, ImageBuilt
from ..protocol.errors import (
    CapacityExhausted,
    NotSupported,
    SandboxDied,
    SandboxNotFound,
    SnapshotNotFound,
)
from ..protocol.fn import CodeResult, RunCodeRequest
from ..protocol.models import CreateRequest, SandboxInfo, Snapshot
from ..store.idempotency import IdempotencyStore
from ..store.sqlite import SnapshotRow, StateStore
from ..trajectory.log import TrajectoryLog
from ..trajectory.recorder import Call, RecordedEdge, Recorder
from .directory import EdgeDirectory
from .idempotency import Idempotency
from .image_names import built_name, check_visible

if TYPE_CHECKING:
    from .projects import Projects

log = logging.getLogger("dsec.control")


class Router:
    def __init__(self, directory: EdgeDirectory, access: Projects | None = None,
                 trajectories: TrajectoryLog | None = None,
                 idempotency: IdempotencyStore | None = None,
                 store: StateStore | None = None) -> None:
        """``access``: who sees and creates which sandboxes (quotas), None admits all;
        ``trajectories``: the log of trajectories; ``idempotency``: the keys of creates made
        once (``create_once``); ``store``: the state store (snapshots' records). Without
        them, those features answer NotSupported."""
        self.directory = directory
        self.access = access
        self.store = store
        self.recorder = Recorder(trajectories, self) if trajectories is not None else None
        self.idempotency = Idempotency(idempotency, self) if idempotency is not None else None
        if access is not None:
            directory.on_end(access.ended)
            directory.on_snapshot_deleted(access.snapshot_deleted)

    async def start(self) -> None:
        await self.directory.start()
        if self.access is not None:
            self.access.reconcile()

    async def close(self) -> None:
        await self.directory.close()
        if self.recorder is not None:
            self.recorder.log.close()

    def owner(self, sandbox_id: str) -> Edge:
        """The edge that owns a sandbox the caller may see, itself."""
        edge: Edge = self.directory.owner(sandbox_id)
        if self.access is not None:
            self.access.check(sandbox_id)
        return edge

    def edge_for(self, sandbox_id: str, call: Call | None = None) -> Edge | RecordedEdge:
        """The edge to make a call on: for a sandbox attached to a trajectory, the edge as
        the trajectory recorder serves it (calls logged and fast-forwarded)."""
        edge = self.owner(sandbox_id)
        return edge if self.recorder is None else self.recorder.wrap(edge, sandbox_id, call)

    def trajectories(self) -> Recorder:
        if self.recorder is None:
            raise NotSupported("this server keeps no trajectory log")
        return self.recorder

    async def create(self, req: CreateRequest, caller: str | None = None) -> SandboxInfo:
        if req.trajectory is not None:
            return await self.trajectories().create(req, caller)
        return await self.place(req)

    async def create_once(self, key: str | None, kind: str, req: CreateRequest,
                          make: Callable[[], Awaitable[SandboxInfo]]) -> tuple[SandboxInfo, bool]:
        """``make()``'s sandbox, made once per Idempotency-Key (``key``) of the caller's
        project; True when an earlier request with the key made it (see control/idempotency.py)."""
        if key is None:
            return await make(), False
        if self.idempotency is None:
            raise NotSupported("this server keeps no idempotency keys")
        return await self.idempotency.create(key, kind, req, make)

    def effective(self, req: CreateRequest) -> CreateRequest:
        """``req`` as its sandbox will be made: from a snapshot (one the caller may see), with
        the snapshot's image and disk and what it inherits of its parent (edge/inherit.py)."""
        if req.snapshot is None:
            return req
        return from_snapshot(req, self.visible_snapshot(req.snapshot), self._snapshots())

    def _caller(self) -> str | None:
        return None if self.access is None else self.access.caller()

    async def place(self, req: CreateRequest) -> SandboxInfo:
        """Start a sandbox on an edge that takes it, once the caller's project quota admits it
        with the limits it will have (a snapshot's child: those it inherits)."""
        req = self.effective(req)
        check_visible(req.image, self._caller())
        if self.access is not None:
            return await self.access.admit(req, self._place)
        return await self._place(req)

    async def _place(self, req: CreateRequest) -> SandboxInfo:
        if req.snapshot is not None:
            return await self._place_from_snapshot(req, self.visible_snapshot(req.snapshot))
        return await self.directory.place(req.substrate, req.image, lambda edge: edge.create(req))

    async def _place_from_snapshot(self, req: CreateRequest, snap: SnapshotRow) -> SandboxInfo:
        """On the snapshot's own edge, where its file is, if that edge is alive and has room;
        else on any edge serving its substrate and image (which fetches the snapshot's
        exported copy, or says it cannot reach it). A `full` snapshot's saved memory is not
        exported: it starts on its own edge or not at all. ``req`` is ``effective``'s."""
        try:
            return await self.directory.owner(snap.sandbox_id).create(req)
        except (CapacityExhausted, SandboxDied, SandboxNotFound) as exc:
            if snap.mode == "full":
                raise
            log.info("snapshot %s: its edge cannot start it (%s); placing elsewhere",
                     snap.id, exc.code)
        return await self.directory.place(req.substrate, req.image, lambda edge: edge.create(req))

    async def call_fn(self, image: str, payload: bytes, timeout_s: float) -> bytes:
        """A function call (a cloudpickled ``(fn, args, kwargs)``) on an edge serving fn and
        the image, admitted like a sandbox (``Projects.admit_call``)."""
        return await self._fn_call(image, lambda edge: edge.call_fn(image, payload, timeout_s))

    async def run_code(self, req: RunCodeRequest) -> CodeResult:
        """A program run in a fresh fn worker, placed and admitted like ``call_fn``."""
        return await self._fn_call(req.image, lambda edge: edge.run_code(req))

    async def _fn_call(self, image: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
        check_visible(image, self._caller())

        async def placed() -> Any:
            return await self.directory.place("fn", image, call)
        if self.access is not None:
            return await self.access.admit_call(placed)
        return await placed()

    async def build_image(self, req: ImageBuildRequest,
                          context: bytes) -> AsyncIterator[BuildLog | ImageBuilt]:
        """A Dockerfile build on the least loaded edge serving containers: its Dockerfile
        checked first (a bad one is InvalidRequest, nothing started), a project key's image
        named in its project's namespace and built only from images it may see
        (control/image_names.py), one sandbox of the request's cpu and memory held against
        the project's quota while it runs (its steps run one at a time)."""
        project = self._caller()
        base = base_image(req.dockerfile, req.build_args)
        check_visible(base, project)
        req = req.model_copy(update={"name": built_name(req.name, project)})

        async def chosen(edge: Any) -> Any:
            return edge
        with (self.access.holding_one(req.cpu, req.memory_mb) if self.access is not None
              else contextlib.nullcontext()):
            edge = await self.directory.place("container", base, chosen)
            async for event in edge.build_image(req, context):
                yield event

    # snapshots: a snapshot is its parent sandbox's project's, on its parent's edge
    def _snapshots(self) -> StateStore:
        if self.store is None:
            raise NotSupported("this server keeps no snapshots")
        return self.store

    def visible_snapshot(self, snapshot_id: str) -> SnapshotRow:
        """The record of a snapshot the caller may see; SnapshotNotFound for any other, and
        for one whose TTL ended (its edge's reaper deletes it)."""
        row = self._snapshots().get_snapshot(snapshot_id)
        if (row is None or row.expired(time.time())
                or (self.access is not None and not self.access.sees(row.sandbox_id))):
            raise SnapshotNotFound(f"no snapshot {snapshot_id!r}", snapshot=snapshot_id)
        return row

    async def snapshot(self, sandbox_id: str, mode: str = "filesystem",
                       previous: str | None = None, ttl_s: int | None = None) -> Snapshot:
        """A snapshot of a sandbox the caller may see, held against its project's snapshot
        room (``Projects.admit_snapshot``) at its disk size (and memory size for a `full`
        one): the most its files can hold,
        known before a byte is copied and the same wherever the image lives (a reflinked
        copy's allocated blocks count extents it shares). ``previous`` must be a snapshot
        the caller may see; answered again (nothing written since), it holds nothing more."""
        edge = self.owner(sandbox_id)
        if previous is not None:
            self.visible_snapshot(previous)

        async def take() -> Snapshot:
            return await edge.snapshot(sandbox_id, mode, previous, ttl_s)
        if self.access is None:
            return await take()
        request = edge.get_row(sandbox_id).request
        size_mb = int(request["disk_mb"]) + (int(request["memory_mb"]) if mode == "full" else 0)
        return await self.access.admit_snapshot(sandbox_id, size_mb << 20, take)

    def snapshots(self) -> builtins.list[Snapshot]:
        """The snapshots the caller's key may see."""
        return [snapshot_info(row) for row in self._snapshots().snapshots()
                if self.access is None or self.access.sees(row.sandbox_id)]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """On the snapshot's edge; if its node is gone, on any edge (the record and the
        exported copy go; the dead node's file goes when its edge next starts)."""
        snap = self.visible_snapshot(snapshot_id)
        try:
            await self.directory.owner(snap.sandbox_id).delete_snapshot(snapshot_id)
        except (SandboxDied, SandboxNotFound):
            await self.directory.place(snap.substrate, snap.image,
                                       lambda edge: edge.delete_snapshot(snapshot_id))
        if self.access is not None:  # heard from the edge too where it is local: given back once
            self.access.snapshot_deleted(snapshot_id)

    def list(self) -> list[SandboxInfo]:
        return self.directory.sandboxes()

    def list_visible(self) -> builtins.list[SandboxInfo]:
        """The live sandboxes the caller's key may see."""
        infos = self.list()
        return infos if self.access is None else self.access.visible(infos)

    def describe(self) -> builtins.list[dict[str, Any]]:
        return self.directory.describe()
