"""An edge with its substrates, image store and pools, made from the server's ``Settings``:
the one mapping from settings to an edge, for the embedded edge and each Ray edge actor."""

from __future__ import annotations

from pathlib import Path

from ..config import Settings
from ..images.store import ImageStore
from ..store.sqlite import StateStore
from ..substrates.registry import VM_SUBSTRATES, all_substrates, disk_volume
from .edge import Edge, EdgeConfig
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
                        warm_pool=settings.warm_pool, port_idle_s=settings.port_idle_s,
                        shared_snapshots=shared_snapshots(settings), pull=settings.pull,
                        network_services=(settings.network_services
                                          or settings.state_dir / "network-services.toml"))
    volume = disk_volume(settings, state_dir, config.edge_id)
    edge = Edge(config, store, ImageStore(settings.image_store),
                all_substrates(settings, state_dir, config.edge_id, volume), metrics, volume)
    for vm in VM_SUBSTRATES:
        edge.pools[vm.name].size = settings.vm_warm_pool
    return edge
