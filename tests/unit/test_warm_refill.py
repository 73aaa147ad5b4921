"""When a warm pool refills (``edge/pool.py: WarmPool``): while it holds more than half its
target, its next start waits until claims pause (``QUIET_S``), so a start's work never lands
between a claim and the command that follows it; at half or below it starts at once, so
claims that never pause do not drain it. The substrate is a recorder of starts (the pool is
what is under test); the pool, its demand and its filler task are the real ones."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dsec.edge import pool as pool_module
from dsec.edge.pool import QUIET_S, Demand, WarmPool
from dsec.images.store import Image
from dsec.substrates.base import StartPlan

IMAGE = Image(name="base", digest="sha256:" + "0" * 64, layers=(), created_at=0.0, size_bytes=0)


class Starts:
    """A substrate that starts sandboxes instantly and counts them."""

    name = "container"

    def __init__(self) -> None:
        self.started: list[str] = []

    async def start(self, plan: StartPlan) -> dict[str, Any]:
        self.started.append(plan.sandbox_id)
        return {}

    def alive(self, sandbox_id: str, runtime: dict[str, Any]) -> bool:
        return True

    async def destroy(self, sandbox_id: str) -> None:
        pass


async def turns(n: int = 20) -> None:
    """Let the event loop run every ready task ``n`` times over, no clock time."""
    for _ in range(n):
        await asyncio.sleep(0)


async def full_pool(size: int) -> tuple[WarmPool, Starts]:
    starts = Starts()
    pool = WarmPool(starts, "e1", size=size, grow_to=size, hold_s=60, room=lambda: 100)  # type: ignore[arg-type]
    pool.refill(IMAGE)
    await turns()
    assert pool.counts() == {"base": size}
    starts.started.clear()
    return pool, starts


async def test_claims_in_a_row_start_nothing_until_they_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_s = 0.5  # a longer pause than the server's: a test process stalled for one starts
    monkeypatch.setattr(pool_module, "QUIET_S", quiet_s)
    pool, starts = await full_pool(8)
    for _ in range(3):  # three claims back to back, each followed by its refill request
        assert pool.take(IMAGE) is not None
        pool.refill(IMAGE)
        await turns()
        assert starts.started == []
    await asyncio.sleep(quiet_s * 3)
    assert len(starts.started) == 3
    assert pool.counts() == {"base": 8}
    await pool.close()


async def test_claims_that_never_pause_never_drain_the_pool() -> None:
    pool, starts = await full_pool(8)
    for _ in range(40):  # a steady stream, a claim every fifth of the pause a refill waits for
        assert pool.take(IMAGE) is not None
        pool.refill(IMAGE)
        await asyncio.sleep(QUIET_S / 5)
        assert pool.counts()["base"] >= 4  # refilled from half its target on, pause or not
    assert len(starts.started) >= 36
    await pool.close()


async def test_an_emptied_pool_starts_at_once() -> None:
    pool, starts = await full_pool(2)
    pool.take(IMAGE)
    pool.take(IMAGE)
    pool.refill(IMAGE)
    await turns()
    assert len(starts.started) >= 1  # the first start did not wait for a pause
    await asyncio.sleep(QUIET_S * 4)
    assert pool.counts() == {"base": 2}
    await pool.close()


def test_quiet_counts_from_the_last_create() -> None:
    demand = Demand(hold_s=60)
    assert demand.quiet_in(1000.0, QUIET_S) == 0.0  # no create yet
    demand.add(1000.0)
    demand.add(1000.02)
    assert abs(demand.quiet_in(1000.03, QUIET_S) - (QUIET_S - 0.01)) < 1e-9
    assert demand.quiet_in(1000.02 + QUIET_S, QUIET_S) == 0.0
