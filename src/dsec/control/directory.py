"""The edges a control plane reaches, behind one interface: the embedded edges of this
process (``LocalEdges``) or the edge actors of a Ray cluster (``cluster.directory.RayEdges``).

The router asks a directory three things: which edge owns a sandbox (its id names the edge),
which edges to try, in order, for a new sandbox or an fn call (``place``), and what runs
where (``sandboxes``, ``describe``). Everything else (admission, trajectories, idempotency)
is the router's and the same for both kinds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..edge.edge import Edge
from ..protocol.errors import CapacityExhausted, SandboxNotFound
from ..protocol.models import SandboxInfo

T = TypeVar("T")
EndListener = Callable[[str, str, str], None]  # (sandbox id, state, reason)
SnapshotListener = Callable[[str], None]  # (snapshot id)


def edge_of(sandbox_id: str) -> str:
    """The edge id in a sandbox id (``sb-<edge id>-<random>``)."""
    prefix, _, rest = sandbox_id.partition("-")
    edge_id = rest.partition("-")[0]
    if prefix != "sb" or not edge_id:
        raise SandboxNotFound(f"{sandbox_id!r} is not a sandbox id", sandbox_id=sandbox_id)
    return edge_id


class EdgeDirectory(ABC):
    """The edges of one control plane. An edge handle has ``Edge``'s methods (a
    ``cluster.remote.RemoteEdge`` forwards them to its node)."""

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def owner(self, sandbox_id: str) -> Any:
        """The handle of the edge that owns the sandbox; SandboxNotFound if none does."""

    @abstractmethod
    async def place(self, substrate: str, image: str, attempt: Callable[[Any], Awaitable[T]]) -> T:
        """``attempt(edge)`` on the edges that may take work of this substrate and image, best
        first, until one does not refuse (``CapacityExhausted``); CapacityExhausted when
        every one did."""

    @abstractmethod
    def sandboxes(self) -> list[SandboxInfo]:
        """Every live sandbox of every edge."""

    @abstractmethod
    def describe(self) -> list[dict[str, Any]]:
        """One dict per edge: ``id``, ``capacity``, ``load``, ``substrates`` (names) at least."""

    @abstractmethod
    def on_end(self, listener: EndListener) -> None:
        """Call ``listener`` when an edge ends a sandbox, where the directory hears of it (a
        Ray cluster's ends are heard by reconciling the state store instead)."""

    @abstractmethod
    def on_snapshot_deleted(self, listener: SnapshotListener) -> None:
        """Call ``listener`` when an edge deletes a snapshot (a client's delete, or its TTL
        ended), where the directory hears of it (as ``on_end``)."""

    def substrates(self) -> set[str]:
        """The substrates some edge serves."""
        return {name for edge in self.describe() for name in edge["substrates"]}


class LocalEdges(EdgeDirectory):
    """Edges running in this process (``dsec serve`` without ``--ray``)."""

    def __init__(self, edges: list[Edge]) -> None:
        self.edges = {edge.id: edge for edge in edges}

    async def start(self) -> None:
        for edge in self.edges.values():
            await edge.start()

    async def close(self) -> None:
        for edge in self.edges.values():
            await edge.close()

    def owner(self, sandbox_id: str) -> Edge:
        edge = self.edges.get(edge_of(sandbox_id))
        if edge is None:
            raise SandboxNotFound(f"no edge owns {sandbox_id!r}", sandbox_id=sandbox_id)
        return edge

    async def place(self, substrate: str, image: str, attempt: Callable[[Any], Awaitable[T]]) -> T:
        """Least loaded first. An edge that does not serve the substrate says so itself
        (NotSupported), as a single edge should."""
        refusals = []
        for edge in sorted(self.edges.values(), key=Edge.load):
            try:
                return await attempt(edge)
            except CapacityExhausted as exc:
                refusals.append(exc.message)
        raise CapacityExhausted("every edge is full: " + "; ".join(refusals))

    def sandboxes(self) -> list[SandboxInfo]:
        return [info for edge in self.edges.values() for info in edge.list()]

    def describe(self) -> list[dict[str, Any]]:
        return [{"id": e.id, "load": e.load(), "capacity": e.config.capacity,
                 "substrates": sorted(e.substrates),
                 "warm": {name: pool.counts() for name, pool in e.pools.items()}}
                for e in self.edges.values()]

    def on_end(self, listener: EndListener) -> None:
        for edge in self.edges.values():
            edge.on_end.append(listener)

    def on_snapshot_deleted(self, listener: SnapshotListener) -> None:
        for edge in self.edges.values():
            edge.on_snapshot_deleted.append(listener)
