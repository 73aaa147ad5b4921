"""The cluster composition root: an API replica's control plane over the edge actors of a Ray
cluster (one per node, each given the replica's settings whole), built like the embedded one
(``control.compose.plane``) around a directory of Ray edges."""

from __future__ import annotations

import ray
from prometheus_client import CollectorRegistry

from ..config import Settings
from ..control.compose import plane
from ..control.plane import ControlPlane
from ..store.sqlite import StateStore
from .directory import RayEdges
from .ids import NAMESPACE


def cluster(settings: Settings) -> ControlPlane:
    """The control plane of a replica of the cluster at ``settings.ray_address``."""
    ray.init(address=settings.ray_address, namespace=NAMESPACE, log_to_driver=False,
             ignore_reinit_error=True)
    store = StateStore(settings.store_target)
    return plane(settings, store, CollectorRegistry(), RayEdges(store, settings))
