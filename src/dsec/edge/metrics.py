"""Prometheus metrics of an edge: what it created (and how fast), ran, refused and reaped
(sandboxes past their TTL, snapshots past theirs).

Counts of live and warm sandboxes are read from the edge when scraped (``EdgeCollector``),
so they can never drift from the truth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..store.sqlite import LIVE_STATES
from ..substrates.fn.fn import FnSubstrate

if TYPE_CHECKING:
    from .edge import Edge

CREATE_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.create_seconds = Histogram(
            "dsec_create_seconds", "Time to create a sandbox, from request to running agent",
            ["substrate", "source"], buckets=CREATE_BUCKETS, registry=registry)
        self.create_failures = Counter(
            "dsec_create_failures_total", "Creates that failed, by error code",
            ["substrate", "code"], registry=registry)
        self.execs = Counter("dsec_execs_total", "Commands started in sandboxes",
                             ["substrate"], registry=registry)
        self.ended = Counter(
            "dsec_sandboxes_ended_total",
            "Sandboxes that ended: stopped by a client, expired (TTL, by the reaper) or died",
            ["substrate", "state"], registry=registry)
        self.snapshots_expired = Counter(
            "dsec_snapshots_expired_total",
            "Snapshots whose TTL ended, deleted by their edge's reaper (the snapshots' part of "
            "retention: see docs/RETENTION.md)", registry=registry)

    def watch(self, edge: Edge) -> None:
        self.registry.register(EdgeCollector(edge))


class EdgeCollector(Collector):
    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    def collect(self) -> Iterator[Metric]:
        live = GaugeMetricFamily("dsec_sandboxes", "Live sandboxes", labels=["edge", "substrate"])
        counts: dict[str, int] = {name: 0 for name in self.edge.substrates}
        for info in self.edge.list():
            counts[info.substrate] = counts.get(info.substrate, 0) + 1
        for substrate, n in counts.items():
            live.add_metric([self.edge.id, substrate], n)
        warm = GaugeMetricFamily("dsec_warm_sandboxes", "Started sandboxes waiting to be claimed",
                                 labels=["edge", "substrate", "image"])
        for substrate, pool in self.edge.pools.items():
            for image, n in pool.counts().items():
                warm.add_metric([self.edge.id, substrate, image], n)
        capacity = GaugeMetricFamily("dsec_capacity", "Sandboxes the edge admits", labels=["edge"])
        capacity.add_metric([self.edge.id], self.edge.config.capacity)
        states = GaugeMetricFamily("dsec_sandboxes_by_state", "Live sandboxes by substrate and "
                                   "state, as recorded (starting: being created; paused: frozen)",
                                   labels=["edge", "substrate", "state"])
        recorded = self.edge.store.live_counts(self.edge.id)
        for substrate in self.edge.substrates:
            for state in LIVE_STATES:
                recorded.setdefault((substrate, state), 0)
        for (substrate, state), n in sorted(recorded.items()):
            states.add_metric([self.edge.id, substrate, state], n)
        yield from (live, warm, capacity, states)
        fn = self.edge.substrates.get("fn")
        if isinstance(fn, FnSubstrate):
            deaths = CounterMetricFamily(
                "dsec_fn_template_deaths", "fn templates that exited while the server ran (no "
                "call can cause it; its workers and fn sandboxes ended with it)", labels=["edge"])
            deaths.add_metric([self.edge.id], fn.template_deaths)
            yield deaths
