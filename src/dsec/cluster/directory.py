"""The edges of a Ray cluster as a control plane's directory (``dsec serve --ray ADDRESS``).

API replicas are stateless: the edges are Ray actors found through Ray (``members``),
sandbox records are in the shared state store (PostgreSQL), and a sandbox id names its edge.
Work goes through power-of-k placement; an edge that refuses (full) or dies mid-attempt
passes it to another edge, and ``CapacityExhausted`` means every edge is full.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..config import Settings
from ..control.directory import EdgeDirectory, EndListener, SnapshotListener, edge_of
from ..control.placement import Placement
from ..protocol.errors import (
    CapacityExhausted,
    NotSupported,
    SandboxDied,
    SandboxNotFound,
)
from ..protocol.models import SandboxInfo
from ..store.sqlite import StateStore
from .members import Member, Members, existing_edge
from .remote import RemoteEdge

log = logging.getLogger("dsec.cluster")
T = TypeVar("T")


class RayEdges(EdgeDirectory):
    def __init__(self, store: StateStore, settings: Settings | None, k: int = 2) -> None:
        """``settings`` None: observe the edges only (start none)."""
        self.store = store
        self.placement = Placement(k)
        self.members = Members(settings, self.placement, self._edge_died)
        self.remotes: dict[str, RemoteEdge] = {}
        self.decision_seconds: list[float] = []  # placement decision times (for the benchmark)

    async def start(self) -> None:
        await self.members.start()

    async def close(self) -> None:
        await self.members.close()

    def _edge_died(self, edge: str, reason: str) -> None:
        """Every live sandbox of a dead node's edge is recorded died (idempotent: every
        replica does it, the first reason stays)."""
        rows = self.store.sandboxes(edge=edge, live_only=True)
        for row in rows:
            self.store.mark_ended(row.id, "died", reason)
        if rows:
            log.warning("edge %s: %s; %d sandboxes recorded died", edge, reason, len(rows))

    def _remote(self, member: Member) -> RemoteEdge:
        remote = self.remotes.get(member.edge)
        if remote is None or remote.member is not member:
            remote = self.remotes[member.edge] = RemoteEdge(member, self.store, self._edge_died)
        return remote

    def owner(self, sandbox_id: str) -> RemoteEdge:
        edge = edge_of(sandbox_id)
        member = self.members.edges.get(edge)
        if member is None:  # an edge this replica has not polled yet, or one long dead
            handle = existing_edge(edge)
            if handle is None and self.store.get_sandbox(sandbox_id) is None:
                raise SandboxNotFound(f"no edge owns {sandbox_id!r}", sandbox_id=sandbox_id)
            member = Member(edge, "", handle)
            if handle is None:
                member.dead.set()
            else:
                self.members.edges[edge] = member
        return self._remote(member)

    async def place(self, substrate: str, image: str, attempt: Callable[[Any], Awaitable[T]]) -> T:
        """Power-of-k placement over the edges serving the substrate (those that know the
        image first); a refusing or dying edge passes the work on."""
        tried: set[str] = set()
        while True:
            started = time.perf_counter()
            loads = self.members.loads()
            choice = (self.placement.choose(loads, substrate, image, tried)
                      or self.placement.choose(loads, substrate, image, tried, count_sent=False))
            self.decision_seconds.append(time.perf_counter() - started)
            if choice is None:
                if loads and not any(substrate in load.substrates for load in loads):
                    raise NotSupported(f"no edge of the cluster serves the {substrate} substrate",
                                       substrate=substrate)
                raise CapacityExhausted("every edge of the cluster is full or unavailable",
                                        tried=sorted(tried))
            tried.add(choice.edge)
            self.placement.sent(choice.edge)
            try:
                return await attempt(self._remote(self.members.edges[choice.edge]))
            except CapacityExhausted:
                choice.load = max(choice.load, choice.capacity)  # full until it reports again
            except SandboxDied:
                log.info("edge %s died during a placement; placing elsewhere", choice.edge)

    def sandboxes(self) -> list[SandboxInfo]:
        return [RemoteEdge.info(row) for row in self.store.sandboxes(live_only=True)]

    def describe(self) -> list[dict[str, Any]]:
        return self.members.describe()

    def on_end(self, listener: EndListener) -> None:
        """Ends happen on other nodes: the projects' reconciliation gives their shares back."""

    def on_snapshot_deleted(self, listener: SnapshotListener) -> None:
        """So do snapshots' TTL deletions: reconciliation gives their bytes back (a client's
        delete through this replica gives them back at once: ``Router.delete_snapshot``)."""
