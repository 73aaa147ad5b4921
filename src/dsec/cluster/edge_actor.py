"""The edge of one Ray node, run as a Ray actor pinned to that node.

The actor wraps the ordinary ``Edge`` (admission, lifecycle, reaper, recovery) and serves its
operations (the table in ``dsec.protocol.ops``) to API replicas: ``call`` for
request/response methods, ``stream`` (a streaming generator) for output chunks. Sandboxes are
plain substrate sandboxes on the node, never Ray actors. The actor is named after its edge
id, detached (it outlives the API replica that started it) and restarted by Ray on its node
after a crash; the restarted edge adopts its sandboxes like a restarted single-node server.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any, AsyncIterator

from prometheus_client import CollectorRegistry

from ..config import Settings, install
from ..edge.assemble import build_edge
from ..edge.edge import Edge
from ..edge.metrics import EdgeMetrics
from ..protocol.errors import InvalidRequest
from ..protocol.ops import OPERATIONS
from ..store.sqlite import StateStore
from .orphans import reclaim_dead_edges

CAPACITY_RESOURCE = "dsec_capacity"  # a node's own capacity: `ray start --resources '{"dsec_capacity": 64}'`
IMAGES_TTL_S = 5.0
CALLS = frozenset(op.method for op in OPERATIONS if op.kind == "call")  # served by ``call``
STREAMS = frozenset(op.method for op in OPERATIONS if op.kind == "stream")  # by ``stream``


class EdgeActor:
    """Decorated with ``ray.remote`` where it is started (``members.ensure_edge``)."""

    def __init__(self, edge_id: str, node_id: str, settings: Settings, capacity: int) -> None:
        """``settings``: the API replica's, whole (``state_url`` set: the cluster's shared
        store); ``capacity``: the node's own (its ``dsec_capacity`` resource)."""
        # Ray makes uvloop the event loop policy of its workers. pyroute2 runs netlink
        # (AF_NETLINK) sockets on a loop of its own, which uvloop cannot open: new loops of
        # this process are the standard library's (the actor's own loop stays as it is).
        asyncio.set_event_loop_policy(None)
        install(settings)
        self.settings = settings
        self.node_id = node_id
        self.edge = build_edge(settings, StateStore(settings.store_target),
                               EdgeMetrics(CollectorRegistry()), settings.state_dir / edge_id,
                               edge_id, capacity)
        self.images = self.edge.images
        self._started: asyncio.Future[None] | None = None
        self._image_names: tuple[float, list[str]] = (0.0, [])

    async def _ready(self) -> Edge:
        """The edge, started on the actor's event loop by the first call."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)
        return self.edge

    async def _start(self) -> None:
        await self.edge.start()
        await reclaim_dead_edges(self.settings, self.edge.id, self.edge.store)

    async def status(self) -> dict[str, Any]:
        edge = await self._ready()
        return {"edge": edge.id, "node": self.node_id, "pid": os.getpid(), "load": edge.load(),
                "capacity": edge.config.capacity, "substrates": sorted(edge.substrates),
                "images": self._images(), "at": time.time(),
                "sandboxes": dict(Counter(info.substrate for info in edge.list())),
                "warm": {name: pool.counts() for name, pool in edge.pools.items()},
                "settings": self.settings.as_dict()}

    def _images(self) -> list[str]:
        """Names and digests of the images this node can start (the store may be shared)."""
        at, names = self._image_names
        if time.monotonic() - at > IMAGES_TTL_S:
            names = [ref for image in self.images.list() for ref in (image.name, image.digest)]
            self._image_names = (time.monotonic(), names)
        return names

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method not in CALLS:
            raise InvalidRequest(f"edge method {method!r} is not served")
        edge = await self._ready()
        return await getattr(edge, method)(*args, **kwargs)

    async def stream(self, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        if method not in STREAMS:
            raise InvalidRequest(f"edge stream {method!r} is not served")
        edge = await self._ready()
        async for event in getattr(edge, method)(*args, **kwargs):
            yield event

    async def shutdown(self) -> None:
        """Stop serving (sandboxes keep running; a new actor on this node adopts them)."""
        if self._started is not None:
            await self.edge.close()
