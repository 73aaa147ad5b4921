"""Which edge owns a sandbox, and where a new one goes.

A sandbox id is ``sb-<edge id>-<random>``, so any API replica routes any call without shared
state. Placement tries edges least-loaded first and moves on when one refuses. Calls on a
sandbox attached to a trajectory go through the trajectory recorder (``edge_for``).
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..client.errors import CapacityExhausted, NotSupported, SandboxNotFound
from ..client.models import CreateRequest, SandboxInfo
from ..edge.edge import Edge
from ..trajectory.log import TrajectoryLog
from ..trajectory.recorder import Call, RecordedEdge, Recorder

if TYPE_CHECKING:
    from .idempotency import Idempotency
    from .projects import Projects


def edge_of(sandbox_id: str) -> str:
    prefix, _, rest = sandbox_id.partition("-")
    edge_id = rest.partition("-")[0]
    if prefix != "sb" or not edge_id:
        raise SandboxNotFound(f"{sandbox_id!r} is not a sandbox id", sandbox_id=sandbox_id)
    return edge_id


class Router:
    def __init__(self, edges: list[Edge], trajectories: TrajectoryLog | None = None) -> None:
        self.edges = {edge.id: edge for edge in edges}
        self.recorder = Recorder(trajectories, self) if trajectories is not None else None
        self.access: Projects | None = None  # who sees and creates which sandboxes (quotas)
        self.idempotency: Idempotency | None = None  # creates under an Idempotency-Key

    async def start(self) -> None:
        for edge in self.edges.values():
            await edge.start()
        if self.access is not None:
            self.access.reconcile()

    async def close(self) -> None:
        for edge in self.edges.values():
            await edge.close()
        if self.recorder is not None:
            self.recorder.log.close()

    def owner(self, sandbox_id: str) -> Edge:
        """The edge that owns a sandbox, itself."""
        edge = self.edges.get(edge_of(sandbox_id))
        if edge is None:
            raise SandboxNotFound(f"no edge owns {sandbox_id!r}", sandbox_id=sandbox_id)
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
        project; True when an earlier request with the key made it (see api/idempotency.py)."""
        if key is None:
            return await make(), False
        if self.idempotency is None:
            raise NotSupported("this server keeps no idempotency keys")
        return await self.idempotency.create(key, kind, req, make)

    async def place(self, req: CreateRequest) -> SandboxInfo:
        """Start a sandbox on the least-loaded edge that takes it, once the caller's project
        quota admits it."""
        if self.access is not None:
            return await self.access.admit(req, self._place)
        return await self._place(req)

    async def _place(self, req: CreateRequest) -> SandboxInfo:
        refusals = []
        for edge in sorted(self.edges.values(), key=Edge.load):
            try:
                return await edge.create(req)
            except CapacityExhausted as exc:
                refusals.append(exc.message)
        raise CapacityExhausted("every edge is full: " + "; ".join(refusals))

    def list(self) -> list[SandboxInfo]:
        return [info for edge in self.edges.values() for info in edge.list()]

    def list_visible(self) -> builtins.list[SandboxInfo]:
        """The live sandboxes the caller's key may see."""
        infos = self.list()
        return infos if self.access is None else self.access.visible(infos)

    def describe(self) -> builtins.list[dict[str, Any]]:
        return [{"id": e.id, "load": e.load(), "capacity": e.config.capacity,
                 "substrates": sorted(e.substrates),
                 "warm": {name: pool.counts() for name, pool in e.pools.items()}}
                for e in self.edges.values()]
