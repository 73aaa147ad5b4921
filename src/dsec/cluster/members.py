"""Who is in the cluster: the live Ray nodes, the edge actor of each, and their load.

Every API replica polls on its own (no registry to keep consistent): the node table from
Ray's GCS, which marks a node dead after its health checks fail (see docs/CLUSTER.md for the
settings), and a cheap ``status`` call to each edge. A joining node gets its edge from the
first replica that sees it; a dead node's edge is reported once to ``on_dead``. When some
nodes declare a ``dsec_capacity`` resource, only those run edges (a Ray cluster shared with
training keeps sandboxes off its GPU nodes); otherwise every node does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..config import Settings
from ..control.placement import EdgeLoad, Placement
from .edge_actor import CAPACITY_RESOURCE, EdgeActor
from .ids import NAMESPACE, actor_name, edge_id_for

log = logging.getLogger("dsec.cluster")
STATUS_TIMEOUT_S = 10.0
RemoteEdgeActor = ray.remote(EdgeActor)


@dataclass
class Member:
    edge: str
    node: str
    handle: Any  # ray ActorHandle
    load: EdgeLoad | None = None
    sandboxes: dict[str, int] = field(default_factory=dict)
    warm: dict[str, dict[str, int]] = field(default_factory=dict)  # pooled, by substrate and image
    pid: int | None = None  # of the edge actor's process, as last reported
    dead: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None  # why it last failed to report, logged once per change


def ensure_edge(node: dict[str, Any], settings: Settings) -> Any:
    """The edge actor of a node, started there if it has none yet (races between replicas
    end in the same named actor)."""
    edge = edge_id_for(node["NodeID"])
    capacity = int(node["Resources"].get(CAPACITY_RESOURCE, settings.capacity))
    return RemoteEdgeActor.options(
        name=actor_name(edge), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_concurrency=10_000, max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
    ).remote(edge, node["NodeID"], settings, capacity)


def existing_edge(edge: str) -> Any | None:
    try:
        return ray.get_actor(actor_name(edge), namespace=NAMESPACE)
    except ValueError:
        return None


class Members:
    def __init__(self, settings: Settings | None, placement: Placement,
                 on_dead: Callable[[str, str], None], poll_s: float = 0.5) -> None:
        """``settings`` None: observe only (start no edges)."""
        self.settings = settings
        self.placement = placement
        self.on_dead = on_dead
        self.poll_s = poll_s
        self.edges: dict[str, Member] = {}
        self.dead_nodes: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def start(self, wait_s: float = 120.0) -> None:
        """First poll until every live node's edge answered, then keep polling."""
        deadline = time.monotonic() + wait_s
        while True:
            await self.poll()
            if all(m.load is not None for m in self.live()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(self.poll_s)
        self._task = asyncio.create_task(self._poll_forever(), name="dsec-members")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def live(self) -> list[Member]:
        return [m for m in self.edges.values() if not m.dead.is_set()]

    def loads(self) -> list[EdgeLoad]:
        return [m.load for m in self.live() if m.load is not None]

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.poll()
            except Exception:  # the poller must outlive a GCS hiccup
                log.exception("membership poll failed")

    async def poll(self) -> None:
        nodes = await asyncio.to_thread(ray.nodes)
        listed = {node["NodeID"] for node in nodes}
        for member in self.live():  # a node dead so long that Ray no longer lists it
            if member.node and member.node not in listed:
                self._died(member.node)
        labeled = any(CAPACITY_RESOURCE in n["Resources"] for n in nodes if n["Alive"])
        for node in nodes:
            node_id, edge = node["NodeID"], edge_id_for(node["NodeID"])
            if not node["Alive"]:
                self._died(node_id)
            elif labeled and CAPACITY_RESOURCE not in node["Resources"]:
                continue  # a cluster shared with other work: edges only where dsec_capacity is
            elif edge not in self.edges:
                handle = (ensure_edge(node, self.settings) if self.settings is not None
                          else existing_edge(edge))
                if handle is not None:
                    self.edges[edge] = Member(edge, node_id, handle)
        await asyncio.gather(*(self._status(m) for m in self.live()))

    def _died(self, node_id: str) -> None:
        if node_id in self.dead_nodes:
            return
        self.dead_nodes.add(node_id)
        edge = edge_id_for(node_id)
        member = self.edges.get(edge)
        if member is not None:
            member.dead.set()
        self.on_dead(edge, f"its node {node_id[:12]} died")

    async def _status(self, member: Member) -> None:
        asked_at = time.monotonic()
        try:
            status = await asyncio.wait_for(member.handle.status.remote(), STATUS_TIMEOUT_S)
        except Exception as exc:  # unreachable for now: no placements until it answers again
            if member.load is not None:
                member.load.healthy = False
            error = "no answer in time" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
            if error != member.error:  # an edge that cannot start says why, once
                log.warning("edge %s did not report: %s", member.edge, error)
            member.error = error
            return
        member.error = None
        member.load = EdgeLoad(edge=member.edge, load=status["load"], capacity=status["capacity"],
                               substrates=status["substrates"], images=status["images"],
                               asked_at=asked_at)
        member.sandboxes = status["sandboxes"]
        member.warm = status.get("warm", {})  # an edge of an earlier dsec reports none
        member.pid = status["pid"]
        self.placement.reported(member.load)

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for m in self.edges.values():
            load = m.load
            out.append({"id": m.edge, "node": m.node, "pid": m.pid, "alive": not m.dead.is_set(),
                        "healthy": bool(load and load.healthy and not m.dead.is_set()),
                        "load": load.load if load else None,
                        "capacity": load.capacity if load else None,
                        "substrates": load.substrates if load else [],
                        "sandboxes": m.sandboxes, "warm": m.warm})
        return out
