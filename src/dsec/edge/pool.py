"""Warm pool: sandboxes started ahead of demand, so that a create is a claim, not a boot.

A pooled sandbox is an ordinary sandbox of an image, started with default limits and not yet
recorded in the state store: a claim applies the request's limits, records it, and the pool
refills in the background. Only images that started once get a pool. After a crash, pooled
sandboxes are leftovers like any other and the restarted edge removes them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..images.store import Image
from ..protocol.models import DEFAULT_DISK_MB, CreateRequest
from ..substrates.base import StartPlan, Substrate

log = logging.getLogger("dsec.pool")


@dataclass(frozen=True)
class Pooled:
    sandbox_id: str
    image: Image
    runtime: dict[str, Any]


class WarmPool:
    def __init__(self, substrate: Substrate, edge_id: str, size: int) -> None:
        self.substrate = substrate
        self.edge_id = edge_id
        self.size = size
        self._ready: dict[str, deque[Pooled]] = {}
        self._fillers: dict[str, asyncio.Task[None]] = {}

    @staticmethod
    def fits(req: CreateRequest) -> bool:
        """Whether a pooled sandbox (default runtime and disk size) can serve ``req``: a claim
        changes cpu, memory and pids in place, not the runtime or the writable layer's size."""
        return req.runtime is None and req.disk_mb == DEFAULT_DISK_MB

    def take(self, image: Image) -> Pooled | None:
        """A live pooled sandbox of exactly this image (same digest), if one is ready."""
        ready = self._ready.setdefault(image.digest, deque())
        while ready:
            candidate = ready.popleft()
            if self.substrate.alive(candidate.sandbox_id, candidate.runtime):
                return candidate
            asyncio.ensure_future(self.substrate.destroy(candidate.sandbox_id))
        return None

    def counts(self) -> dict[str, int]:
        """Ready sandboxes by image name."""
        counts: dict[str, int] = {}
        for ready in self._ready.values():
            for pooled in ready:
                counts[pooled.image.name] = counts.get(pooled.image.name, 0) + 1
        return counts

    def refill(self, image: Image) -> None:
        """Top the image's pool up in the background; the edge calls it after a create of the
        image succeeded, so an image that cannot start never gets a pool."""
        if self.size <= 0:
            return
        filler = self._fillers.get(image.digest)
        if filler is None or filler.done():
            self._fillers[image.digest] = asyncio.create_task(self._fill(image),
                                                              name=f"dsec-pool-{image.name}")

    async def _fill(self, image: Image) -> None:
        """One start at a time and at idle CPU priority, so refilling never slows live work."""
        ready = self._ready.setdefault(image.digest, deque())
        while len(ready) < self.size:
            sandbox_id = f"sb-{self.edge_id}-{secrets.token_hex(6)}"
            request = CreateRequest(substrate=self.substrate.name, image=image.name)
            try:
                runtime = await self.substrate.start(StartPlan(sandbox_id, request, image, warm=True))
            except Exception:
                log.exception("warm pool could not start a sandbox of %s", image.name)
                return
            ready.append(Pooled(sandbox_id, image, runtime))

    async def close(self) -> None:
        for filler in self._fillers.values():
            filler.cancel()
        await asyncio.gather(*self._fillers.values(), return_exceptions=True)
        for ready in self._ready.values():
            while ready:
                await self.substrate.destroy(ready.popleft().sandbox_id)
