"""Warm pool: sandboxes started ahead of demand, so that a create is a claim, not a boot.

A pooled sandbox is an ordinary sandbox of an image, started with default limits and not yet
recorded in the state store: a claim applies the request's limits, records it, and the pool
refills in the background, one start at a time and, while it holds more than half its
target, only once claims pause (a start's work would otherwise slow the claims it refills
for; at half or below it refills at once, so steady claims never drain it). Only images
that started once get a pool. After a crash, pooled sandboxes are leftovers like any other
and the restarted edge removes them.

An image's pool holds ``size`` sandboxes, and after a burst of its creates as many as the
burst asked for (up to ``grow_to``) until ``hold_s`` after the last burst that large: a
trainer opens its rollouts' sandboxes at every training step, so its next burst is served
from the pool instead of starting every sandbox cold (a burst of 100 from a grown pool took
0.6-0.7 of a bare runtime's burst, cold 1.5-1.9: docs/BENCHMARKS.md). Then it shrinks back to
``size``, the sandboxes beyond it stopped. A burst is the creates of the image within
``BURST_S`` of each other's arrival, counted whether the pool had one ready or not. Pooled
sandboxes are not an edge's load (a create is never refused for them), so a pool grows beyond
``size`` only into the edge's free capacity (``room``): live and pooled sandboxes together
stay within what the edge sized its open files for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ..images.store import Image
from ..protocol.models import DEFAULT_DISK_MB, CreateRequest
from ..substrates.base import StartPlan, Substrate

log = logging.getLogger("dsec.pool")

BURST_S = 10.0  # creates of an image this close together are one burst
QUIET_S = 0.05  # above half its target, a pool's refill starts after no claim for this long


@dataclass(frozen=True)
class Pooled:
    sandbox_id: str
    image: Image
    runtime: dict[str, Any]
    request: CreateRequest  # what it was started with: its limits until it is claimed


class Demand:
    """The creates of one image: the largest burst seen, kept until ``hold_s`` after a
    burst last reached it."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._recent: deque[float] = deque()  # arrivals within BURST_S of the last one
        self._peak = 0
        self._peak_until = -math.inf

    def add(self, now: float) -> None:
        while self._recent and self._recent[0] < now - BURST_S:
            self._recent.popleft()
        self._recent.append(now)
        if now > self._peak_until:
            self._peak = 0
        if len(self._recent) >= self._peak:
            self._peak, self._peak_until = len(self._recent), now + self.hold_s

    def peak(self, now: float) -> int:
        return self._peak if now <= self._peak_until else 0

    def quiet_in(self, now: float, quiet_s: float) -> float:
        """Seconds until no create arrived for ``quiet_s``; 0 once none did."""
        return max(0.0, self._recent[-1] + quiet_s - now) if self._recent else 0.0


class WarmPool:
    def __init__(self, substrate: Substrate, edge_id: str, size: int, grow_to: int,
                 hold_s: float, room: Callable[[], int]) -> None:
        self.substrate = substrate
        self.edge_id = edge_id
        self.size = size  # 0: no pool at all
        self.grow_to = grow_to  # at most this many after a burst (size or less: no growth)
        self.hold_s = hold_s
        self.room = room  # sandboxes the edge has free capacity for, beside its load and pools
        self._images: dict[str, Image] = {}  # by digest: those that started once
        self._ready: dict[str, deque[Pooled]] = {}
        self._demand: dict[str, Demand] = {}
        self._fillers: dict[str, asyncio.Task[None]] = {}
        self._claimed: dict[str, asyncio.Event] = {}  # wakes a filler waiting for a pause

    @staticmethod
    def fits(req: CreateRequest) -> bool:
        """Whether a pooled sandbox (default runtime and disk size) can serve ``req``: a claim
        changes cpu, memory and pids in place, not the runtime or the writable layer's size."""
        return req.runtime is None and req.disk_mb == DEFAULT_DISK_MB

    def take(self, image: Image) -> Pooled | None:
        """A live pooled sandbox of exactly this image (same digest), if one is ready; the
        create counts towards the image's demand either way."""
        self._demand.setdefault(image.digest, Demand(self.hold_s)).add(time.monotonic())
        ready = self._ready.setdefault(image.digest, deque())
        while ready:
            candidate = ready.popleft()
            if self.substrate.alive(candidate.sandbox_id, candidate.runtime):
                self._claimed.setdefault(image.digest, asyncio.Event()).set()
                return candidate
            asyncio.ensure_future(self.substrate.destroy(candidate.sandbox_id))
        return None

    def target(self, image: Image) -> int:
        """How many of the image the pool keeps now: ``size``, more after a burst."""
        if self.size <= 0:
            return 0
        demand = self._demand.get(image.digest)
        peak = demand.peak(time.monotonic()) if demand else 0
        return max(self.size, min(peak, self.grow_to))

    def held(self) -> int:
        return sum(map(len, self._ready.values()))

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
        self._images[image.digest] = image
        if not self._filling(image):
            self._fillers[image.digest] = asyncio.create_task(self._fill(image),
                                                              name=f"dsec-pool-{image.name}")

    async def _fill(self, image: Image) -> None:
        """One start at a time, at idle CPU priority and, while the pool holds more than half
        its target, only once claims pause (``QUIET_S``): a start's own work in the server's
        event loop would otherwise delay the claim just made and the next. Claims that never
        pause (a steady rate) still find it refilled from half its target on."""
        ready = self._ready.setdefault(image.digest, deque())
        while self._short(image, ready):
            demand = self._demand.get(image.digest)
            ample = len(ready) > self.target(image) // 2
            wait = demand.quiet_in(time.monotonic(), QUIET_S) if demand and ample else 0.0
            if wait > 0:  # woken by each claim meanwhile: it may have taken it to half
                claimed = self._claimed.setdefault(image.digest, asyncio.Event())
                claimed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(claimed.wait(), wait)
                continue
            sandbox_id = f"sb-{self.edge_id}-{secrets.token_hex(6)}"
            request = CreateRequest(substrate=self.substrate.name, image=image.name)
            try:
                runtime = await self.substrate.start(StartPlan(sandbox_id, request, image, warm=True))
            except Exception:
                log.exception("warm pool could not start a sandbox of %s", image.name)
                return
            ready.append(Pooled(sandbox_id, image, runtime, request))

    async def tend(self) -> None:
        """Bring each image's pool to its target (the edge's reaper calls it): what it holds
        beyond it (a burst's hold is over), or beyond ``size`` and the edge's free capacity
        (live sandboxes took it meanwhile), is stopped, newest first; one short refills."""
        for image in list(self._images.values()):  # a create may add one meanwhile
            if self._filling(image):
                continue  # a filler stops at the target itself; what it adds goes next time
            ready = self._ready.setdefault(image.digest, deque())
            while len(ready) > self.target(image) or (len(ready) > self.size and self.room() < 0):
                await self.substrate.destroy(ready.pop().sandbox_id)
            if self._short(image, ready):
                self.refill(image)

    def _filling(self, image: Image) -> bool:
        filler = self._fillers.get(image.digest)
        return filler is not None and not filler.done()

    def _short(self, image: Image, ready: deque[Pooled]) -> bool:
        """Whether the image's pool should start one more: below ``size``, or below its
        target with free capacity."""
        return len(ready) < self.target(image) and (len(ready) < self.size or self.room() > 0)

    async def close(self) -> None:
        for filler in self._fillers.values():
            filler.cancel()
        await asyncio.gather(*self._fillers.values(), return_exceptions=True)
        for ready in self._ready.values():
            while ready:
                await self.substrate.destroy(ready.popleft().sandbox_id)
