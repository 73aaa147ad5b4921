"""A Ray cluster on this host, for tests and the benchmark: a head and worker nodes, each a
real raylet with its own ``dsec_capacity`` resource (Ray's ``cluster_utils``), with Ray's
health checks tightened so a killed node is declared dead in seconds.

``stop`` ends every Ray process it started and removes what the edges left on the host
(a killed node's sandboxes keep running here, since the host itself did not die).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..config import Settings
from ..images.mount import LayerMounter
from .edge_actor import CAPACITY_RESOURCE
from .ids import edge_id_for
from .orphans import edge_dirs, sweep_edge

# Ray's defaults take ~15 s to declare a node dead; these take ~2 s (period x threshold).
HEALTH_CHECKS = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 500,
                 "health_check_timeout_ms": 1000, "health_check_failure_threshold": 4}
# For a machine busy with other work, where a starved raylet may miss 2 s of checks: ~10 s.
TOLERANT_HEALTH_CHECKS = {**HEALTH_CHECKS, "health_check_period_ms": 1000,
                          "health_check_timeout_ms": 2000, "health_check_failure_threshold": 10}
OBJECT_STORE_BYTES = 80 * 1024 * 1024


class LocalRayCluster:
    def __init__(self, state_dir: Path, capacities: list[int],
                 health_checks: dict[str, int] = HEALTH_CHECKS) -> None:
        """``state_dir``: where the API replicas keep their state (the edges' dirs are in it)."""
        self.state_dir = state_dir
        self.settings = Settings.load(state_dir=state_dir)  # what the sweep of its edges uses
        self.capacities = capacities
        self.health_checks = health_checks
        self.cluster: Any = None
        self.nodes: list[Any] = []

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def start(self) -> LocalRayCluster:
        from ray.cluster_utils import Cluster
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        head, *workers = self.capacities
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **self._node_args(head), "_system_config": self.health_checks, "include_dashboard": False})
        self.nodes = [self.cluster.head_node]
        for capacity in workers:
            self.add_node(capacity)
        return self

    def _node_args(self, capacity: int | None) -> dict[str, Any]:
        resources = {CAPACITY_RESOURCE: capacity} if capacity is not None else {}
        return {"num_cpus": 1, "resources": resources, "object_store_memory": OBJECT_STORE_BYTES}

    def add_node(self, capacity: int | None) -> Any:
        """A node with this ``dsec_capacity`` (None: a node for other work, no edge)."""
        node = self.cluster.add_node(**self._node_args(capacity))
        self.nodes.append(node)
        return node

    def kill_node(self, node: Any) -> None:
        """Kill every process of a node at once, the way a host dies."""
        self.cluster.remove_node(node, allow_graceful=False)

    @staticmethod
    def edge_of(node: Any) -> str:
        return edge_id_for(node.node_id)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        with ThreadPoolExecutor(1) as thread:  # callable with or without a running event loop
            thread.submit(asyncio.run, sweep_edges(self.settings)).result()
        LayerMounter(self.settings.state_dir / "layers").unmount_all()  # the node's, shared


async def sweep_edges(settings: Settings) -> None:
    """Destroy every sandbox the edges under the state directory left on this host."""
    for edge_dir in edge_dirs(settings.state_dir):
        await sweep_edge(settings, edge_dir)
