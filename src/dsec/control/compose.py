"""The two composition roots of a server's control plane: ``embedded`` (one edge in this
process) and ``cluster`` (the edge actors of a Ray cluster). Both build the same pieces in
the same order (state store, projects, trajectory log, router over a directory of edges,
idempotency) and differ only in the directory; ``compose`` picks by ``ray_address``."""

from __future__ import annotations

import secrets

from prometheus_client import CollectorRegistry

from .projects import Projects
from .routing import Router
from ..config import Settings
from ..edge.assemble import build_edge
from ..edge.metrics import EdgeMetrics
from ..store.blobs import BlobStore
from ..store.idempotency import IdempotencyStore
from ..store.sqlite import StateStore
from ..trajectory.log import TrajectoryLog
from .directory import EdgeDirectory, LocalEdges
from .plane import ControlPlane


def compose(settings: Settings) -> ControlPlane:
    return cluster(settings) if settings.ray_address is not None else embedded(settings)


def embedded(settings: Settings) -> ControlPlane:
    """One edge in this process, keeping its sandboxes in the state directory."""
    store = StateStore(settings.store_target)
    registry = CollectorRegistry()
    edge = build_edge(settings, store, EdgeMetrics(registry), settings.state_dir)
    return _plane(settings, store, registry, LocalEdges([edge]))


def cluster(settings: Settings) -> ControlPlane:
    """An API replica over the Ray cluster at ``settings.ray_address``: one edge actor per
    node, each given these settings whole."""
    import ray

    from ..cluster.directory import RayEdges
    from ..cluster.ids import NAMESPACE
    ray.init(address=settings.ray_address, namespace=NAMESPACE, log_to_driver=False,
             ignore_reinit_error=True)
    store = StateStore(settings.store_target)
    return _plane(settings, store, CollectorRegistry(), RayEdges(store, settings))


def _plane(settings: Settings, store: StateStore, registry: CollectorRegistry,
           directory: EdgeDirectory) -> ControlPlane:
    projects = Projects(store, registry)
    trajectories = TrajectoryLog(store.url, BlobStore(settings.state_dir / "blobs"),
                                 owner=secrets.token_hex(8))
    router = Router(directory, projects, trajectories, IdempotencyStore(store.url))
    return ControlPlane(settings, store, registry, projects, router)
