"""What a server's HTTP front-ends are built on: one control plane, composed once
(``control.compose``), never rewired by the routes."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from ..config import Settings
from ..store.sqlite import StateStore
from .gc import GarbageCollector
from .projects import Projects
from .routing import Router


@dataclass(frozen=True)
class ControlPlane:
    settings: Settings
    store: StateStore  # sandbox records and API keys
    registry: CollectorRegistry  # the server's metrics
    projects: Projects  # access control and quotas (the router admits through them)
    router: Router  # the edges (a directory), placement, trajectories, idempotency
    gc: GarbageCollector  # retention, in the background (and ``dsec gc``)

    async def start(self) -> None:
        await self.router.start()
        self.gc.start()

    async def close(self) -> None:
        try:
            await self.gc.close()
        finally:  # the edges close (and unmount) whatever the lease's give-up met
            await self.router.close()
