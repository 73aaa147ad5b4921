"""An edge with its substrates, image store and pools, made from the server's ``Settings``:
the one mapping from settings to an edge, for the embedded edge and each Ray edge actor."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CollectorRegistry

from ..config import Settings
from ..images.mount import locked
from ..images.store import ImageStore
from ..store.sqlite import StateStore
from ..substrates.registry import VM_SUBSTRATES, all_substrates, disk_volume
from .edge import Edge, EdgeConfig, default_edge_id
from .metrics import EdgeMetrics


def shared_snapshots(settings: Settings) -> Path | None:
    """Where snapshots are exported for every node: given, or in a cluster the shared image
    store's ``snapshots/``; None embedded (one node: its own copy serves)."""
    if settings.shared_snapshots is not None or settings.ray_address is None:
        return settings.shared_snapshots
    return ImageStore(settings.image_store).root / "snapshots"


def build_edge(settings: Settings, store: StateStore, metrics: EdgeMetrics, state_dir: Path,
               edge_id: str = "", capacity: int | None = None) -> Edge:
    """The edge keeping its sandboxes under ``state_dir``; ``edge_id`` and ``capacity``
    default to the settings' (a Ray node brings its own)."""
    config = EdgeConfig(state_dir=state_dir, edge_id=edge_id or settings.edge_id,
                        capacity=settings.capacity if capacity is None else capacity,
                        warm_pool=settings.warm_pool, warm_pool_max=settings.warm_pool_max,
                        warm_pool_hold_s=settings.warm_pool_hold_s, port_idle_s=settings.port_idle_s,
                        shared_snapshots=shared_snapshots(settings), pull=settings.pull,
                        network_services=(settings.network_services
                                          or settings.state_dir / "network-services.toml"))
    volume = disk_volume(settings, state_dir, config.edge_id)
    edge = Edge(config, store, ImageStore(settings.image_store),
                all_substrates(settings, state_dir, config.edge_id, volume), metrics, volume)
    for vm in VM_SUBSTRATES:
        pool = edge.pools[vm.name]
        pool.size = pool.grow_to = settings.vm_warm_pool  # a VM's memory is too dear to grow on
    return edge


@contextlib.asynccontextmanager
async def builder_edge(settings: Settings) -> AsyncIterator[Edge]:
    """An edge of its own for a Dockerfile build from the command line (edge/dockerbuild.py),
    under ``<state>/builder``: no warm pools, its sandboxes removed when it starts (a build
    that died left them) and when the build ends. One build at a time per state directory
    (a lock): a second edge on these files would remove the first's sandboxes."""
    state_dir = settings.state_dir / "builder"
    state_dir.mkdir(parents=True, exist_ok=True)
    with locked(state_dir / "build.lock"):
        store = StateStore(state_dir / "state.db")
        edge = build_edge(settings.replace(warm_pool=0, vm_warm_pool=0), store,
                          EdgeMetrics(CollectorRegistry()), state_dir,
                          edge_id=default_edge_id(state_dir))
        await edge.start()
        try:
            for info in edge.list():  # left by a build that died
                await edge.stop(info.id, reason="left by an earlier build")
            yield edge
        finally:
            for info in edge.list():
                await edge.stop(info.id, reason="build ended")
            await edge.close()
