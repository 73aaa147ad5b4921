"""Which edge owns a sandbox, and where a new one goes.

A sandbox id is ``sb-<edge id>-<random>``, so any API replica routes any call without shared
state. Placement tries edges least-loaded first and moves on when one refuses.
"""

from __future__ import annotations

from typing import Any

from ..client.errors import CapacityExhausted, SandboxNotFound
from ..client.models import CreateRequest, SandboxInfo
from ..edge.edge import Edge


def edge_of(sandbox_id: str) -> str:
    prefix, _, rest = sandbox_id.partition("-")
    edge_id = rest.partition("-")[0]
    if prefix != "sb" or not edge_id:
        raise SandboxNotFound(f"{sandbox_id!r} is not a sandbox id", sandbox_id=sandbox_id)
    return edge_id


class Router:
    def __init__(self, edges: list[Edge]) -> None:
        self.edges = {edge.id: edge for edge in edges}

    async def start(self) -> None:
        for edge in self.edges.values():
            await edge.start()

    async def close(self) -> None:
        for edge in self.edges.values():
            await edge.close()

    def edge_for(self, sandbox_id: str) -> Edge:
        edge = self.edges.get(edge_of(sandbox_id))
        if edge is None:
            raise SandboxNotFound(f"no edge owns {sandbox_id!r}", sandbox_id=sandbox_id)
        return edge

    async def create(self, req: CreateRequest) -> SandboxInfo:
        refusals = []
        for edge in sorted(self.edges.values(), key=Edge.load):
            try:
                return await edge.create(req)
            except CapacityExhausted as exc:
                refusals.append(exc.message)
        raise CapacityExhausted("every edge is full: " + "; ".join(refusals))

    def list(self) -> list[SandboxInfo]:
        return [info for edge in self.edges.values() for info in edge.list()]

    def describe(self) -> list[dict[str, Any]]:
        return [{"id": e.id, "load": e.load(), "capacity": e.config.capacity,
                 "substrates": sorted(e.substrates),
                 "warm": {name: pool.counts() for name, pool in e.pools.items()}}
                for e in self.edges.values()]
