"""The embedded composition root of a server's control plane (one edge in this process), and
``plane``, the pieces every root builds the same way around its directory of edges (projects,
trajectory log, router, idempotency). The cluster's root is ``cluster.compose``: the control
plane knows no Ray; ``dsec.server`` picks the root by ``ray_address``."""

from __future__ import annotations

import secrets

from prometheus_client import CollectorRegistry

from ..config import Settings
from ..edge.assemble import build_edge
from ..edge.metrics import EdgeMetrics
from ..store.blobs import BlobStore
from ..store.idempotency import IdempotencyStore
from ..store.sqlite import StateStore
from ..trajectory.log import TrajectoryLog
from .directory import EdgeDirectory, LocalEdges
from .plane import ControlPlane
from .projects import Projects
from .routing import Router


def embedded(settings: Settings) -> ControlPlane:
    """One edge in this process, keeping its sandboxes in the state directory."""
    store = StateStore(settings.store_target)
    registry = CollectorRegistry()
    edge = build_edge(settings, store, EdgeMetrics(registry), settings.state_dir)
    return plane(settings, store, registry, LocalEdges([edge]))


def plane(settings: Settings, store: StateStore, registry: CollectorRegistry,
          directory: EdgeDirectory) -> ControlPlane:
    """The control plane over ``directory``: what both composition roots build alike."""
    projects = Projects(store, registry)
    trajectories = TrajectoryLog(store.url, BlobStore(settings.state_dir / "blobs"),
                                 owner=secrets.token_hex(8))
    router = Router(directory, projects, trajectories, IdempotencyStore(store.url), store)
    return ControlPlane(settings, store, registry, projects, router)
