"""Power-of-k choices over the edges' reported load, without any lock between API replicas.

Each replica samples ``k`` healthy edges that serve the request's substrate and image and
picks the least loaded, counting its own placements that the edge's last report cannot
include yet (sent after the report was asked for). Replicas never coordinate: an edge admits
against its own capacity, and a refusal moves the create to another edge.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field


@dataclass
class EdgeLoad:
    """An edge as its last status report saw it."""

    edge: str
    load: int
    capacity: int
    substrates: list[str]
    images: list[str] = field(default_factory=list)
    asked_at: float = 0.0  # monotonic time the report was asked for
    healthy: bool = True


class Placement:
    def __init__(self, k: int = 2, rng: random.Random | None = None) -> None:
        self.k = k
        self.rng = rng or random.Random()
        self._sent: dict[str, list[float]] = defaultdict(list)  # edge -> monotonic send times

    def reported(self, load: EdgeLoad) -> None:
        """A fresh report: placements sent before it was asked for are counted in it."""
        self._sent[load.edge] = [t for t in self._sent[load.edge] if t >= load.asked_at]

    def sent(self, edge: str) -> None:
        self._sent[edge].append(time.monotonic())

    def estimate(self, load: EdgeLoad, count_sent: bool = True) -> int:
        return load.load + (len(self._sent[load.edge]) if count_sent else 0)

    def choose(self, edges: list[EdgeLoad], substrate: str, image: str,
               exclude: AbstractSet[str] = frozenset(),
               count_sent: bool = True) -> EdgeLoad | None:
        """The least loaded of ``k`` sampled eligible edges; None when none has room.

        ``count_sent=False`` trusts the reports alone: a report may already include a
        placement sent after it was asked for, so an edge this replica estimates full may
        still have room (only its own admission knows)."""
        eligible = [e for e in edges if e.healthy and substrate in e.substrates
                    and e.edge not in exclude and self.estimate(e, count_sent) < e.capacity]
        with_image = [e for e in eligible if image in e.images]
        if with_image:  # no edge knowing the image: let an edge answer ImageNotFound
            eligible = with_image
        if not eligible:
            return None
        sample = self.rng.sample(eligible, min(self.k, len(eligible)))
        return min(sample, key=lambda e: self.estimate(e, count_sent) / e.capacity)
