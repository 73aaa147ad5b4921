"""The container substrate's admission of starts (``substrates/container/starts.py``): a
burst beyond the slots waits in the order it came; a pool refill never waits."""

from __future__ import annotations

import asyncio

import pytest

from dsec.substrates.container.starts import StartSlots


@pytest.mark.parametrize("stage", ["bundle", "run"])
async def test_a_burst_beyond_the_slots_is_admitted_in_order_and_refills_pass(stage: str) -> None:
    slots = StartSlots()
    admit = getattr(slots, stage)
    holding = [admit(False) for _ in range(getattr(slots, f"{stage}s_at_once"))]
    for slot in holding:
        await slot.__aenter__()
    admitted: list[int] = []

    async def create(i: int) -> None:
        async with admit(False):
            admitted.append(i)

    waiting = [asyncio.create_task(create(i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert admitted == []  # every slot is held
    async with admit(True):  # a warm pool's refill
        pass
    for slot in holding:
        await slot.__aexit__(None, None, None)
    await asyncio.gather(*waiting)
    assert admitted == [0, 1, 2, 3, 4]
