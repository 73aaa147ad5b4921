"""The router of an API replica in cluster mode (``dsec serve --ray ADDRESS``).

Replicas are stateless: the edges are Ray actors found through Ray, sandbox records are in
the shared state store (PostgreSQL), and a sandbox id names its edge. Creates go through
power-of-k placement; an edge that refuses (full) or dies mid-create sends the create to
another edge, and ``CapacityExhausted`` means every edge is full.
"""

from __future__ import annotations

import builtins
import logging
import secrets
import time
from typing import Any

import ray
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from ..api.app import create_app
from ..api.routing import Router, edge_of
from ..client.errors import CapacityExhausted, SandboxDied, SandboxNotFound
from ..client.models import CreateRequest, SandboxInfo
from ..compat import mount_compat
from ..store.blobs import BlobStore
from ..store.sqlite import StateStore
from ..trajectory.log import TrajectoryLog
from .edge_actor import EdgeSettings
from .ids import NAMESPACE
from .members import Member, Members, existing_edge
from .placement import Placement
from .remote import RemoteEdge

log = logging.getLogger("dsec.cluster")


class ClusterRouter(Router):
    def __init__(self, store: StateStore, settings: EdgeSettings | None,
                 trajectories: TrajectoryLog | None = None, k: int = 2) -> None:
        super().__init__([], trajectories)
        self.store = store
        self.placement = Placement(k)
        self.members = Members(settings, self.placement, self._edge_died)
        self.remotes: dict[str, RemoteEdge] = {}
        self.decision_seconds: list[float] = []  # placement decision times (for the benchmark)

    async def start(self) -> None:
        await self.members.start()

    async def close(self) -> None:
        await self.members.close()
        if self.recorder is not None:
            self.recorder.log.close()

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

    def owner(self, sandbox_id: str) -> RemoteEdge:  # type: ignore[override]
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
        if self.access is not None:
            self.access.check(sandbox_id)
        return self._remote(member)

    async def _place(self, req: CreateRequest) -> SandboxInfo:
        """Power-of-k placement; a refusing or dying edge passes the create on."""
        tried: set[str] = set()
        while True:
            started = time.perf_counter()
            loads = self.members.loads()
            choice = (self.placement.choose(loads, req.substrate, req.image, tried)
                      or self.placement.choose(loads, req.substrate, req.image, tried,
                                               count_sent=False))
            self.decision_seconds.append(time.perf_counter() - started)
            if choice is None:
                raise CapacityExhausted("every edge of the cluster is full or unavailable",
                                        tried=sorted(tried))
            tried.add(choice.edge)
            self.placement.sent(choice.edge)
            try:
                return await self._remote(self.members.edges[choice.edge]).create(req)
            except CapacityExhausted:
                choice.load = max(choice.load, choice.capacity)  # full until it reports again
            except SandboxDied:
                log.info("edge %s died during a create; placing elsewhere", choice.edge)

    def list(self) -> list[SandboxInfo]:
        return [RemoteEdge.info(row) for row in self.store.sandboxes(live_only=True)]

    def describe(self) -> builtins.list[dict[str, Any]]:
        return self.members.describe()


def cluster_app(config: Any, store: StateStore) -> FastAPI:
    """The API app of one replica over the Ray cluster at ``config.ray_address``."""
    ray.init(address=config.ray_address, namespace=NAMESPACE, log_to_driver=False,
             ignore_reinit_error=True)
    settings = EdgeSettings(state_dir=str(config.state_dir), state_url=store.url,
                            image_store=str(config.image_store) if config.image_store else None,
                            capacity=config.capacity, warm_pool=config.warm_pool,
                            runtime=config.runtime, vm_accel=config.vm_accel,
                            kvm_device=str(config.kvm_device), vm_snapshots=config.vm_snapshots)
    trajectories = TrajectoryLog(store.url, BlobStore(config.state_dir / "blobs"),
                                 owner=secrets.token_hex(8))
    router = ClusterRouter(store, settings, trajectories)
    return mount_compat(create_app(router, store, CollectorRegistry()), router, store,
                        config.state_dir)
