"""The embedded composition root of a server's control plane (one edge in this process), and
``plane``, the pieces every root builds the same way around its directory of edges (projects,
trajectory log, router, idempotency, garbage collection). The cluster's root is
``cluster.compose``: the control plane knows no Ray; ``dsec.server`` picks the root by
``ray_address``."""

from __future__ import annotations

import secrets

from prometheus_client import CollectorRegistry

from ..config import Settings
from ..edge.assemble import build_edge
from ..edge.metrics import EdgeMetrics
from ..images.gc import UnusedLayers
from ..images.store import ImageStore
from ..store.blobs import BlobStore
from ..store.gc import Collector
from ..store.idempotency import IdempotencyStore
from ..store.lease import Leases
from ..store.sqlite import StateStore
from ..trajectory.log import TrajectoryLog
from .collectors import (
    ExpiredTrajectories,
    SandboxRecords,
    SnapshotImages,
    UnreferencedBlobs,
)
from .directory import EdgeDirectory, LocalEdges
from .gc import GarbageCollector
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
    blobs = BlobStore(settings.state_dir / "blobs")
    trajectories = TrajectoryLog(store.url, blobs, owner=secrets.token_hex(8))
    router = Router(directory, projects, trajectories, IdempotencyStore(store.url), store)
    return ControlPlane(settings, store, registry, projects, router,
                        garbage_collector(settings, store, registry, router, blobs))


def garbage_collector(settings: Settings, store: StateStore, registry: CollectorRegistry,
                      router: Router, blobs: BlobStore) -> GarbageCollector:
    """The collectors of the settings' retention: shared ones (the state store's records and
    trajectories, and the image store, which every node of a cluster shares: run by one
    replica at a time), local ones (this host's blob area)."""
    recorder = router.trajectories()
    shared: list[Collector] = [
        SandboxRecords(store.url, settings.retain_ended_s, settings.retain_failed_s),
        ExpiredTrajectories(recorder.log, recorder.delete, settings.trajectory_ttl_s),
        UnusedLayers(ImageStore(settings.image_store), SnapshotImages(store.url),
                     settings.layer_grace_s)]
    local: list[Collector] = [UnreferencedBlobs(recorder.log, blobs, settings.blob_grace_s)]
    return GarbageCollector(Leases(store.url), shared, local, settings.gc_interval_s, registry)
