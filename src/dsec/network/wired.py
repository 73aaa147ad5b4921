"""The network slots of one substrate's sandboxes: which sandbox is wired to which slot, one
change at a time per sandbox, found again by link alias after a restart. How a sandbox is
wired (a veth into a container's netns, a tap hot-plugged into a VM) is the substrate's; the
rules are ``Wiring.apply``'s, the same for every substrate."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Awaitable, Callable, TypeVar

from .policy import Egress
from .wiring import Slot, Wiring

T = TypeVar("T")


class WiredSandboxes:
    def __init__(self, owner_prefix: str, io: Executor | None = None) -> None:
        self.wiring = Wiring()
        self.owner_prefix = owner_prefix  # link aliases are ``<prefix><sandbox id>``
        self._io = io
        self._slots: dict[str, Slot] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def owner(self, sandbox_id: str) -> str:
        return self.owner_prefix + sandbox_id

    def ids(self) -> set[str]:
        return set(self._slots)

    def slot(self, sandbox_id: str) -> Slot | None:
        """The sandbox's slot while it has a policy."""
        return self._slots.get(sandbox_id)

    async def run(self, work: Callable[..., T], *args: object) -> T:
        """Blocking wiring work, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._io, work, *args)

    async def recover(self) -> None:
        """After a (re)start: adopt the slots whose alias is ours, sweep rules left by
        sandboxes that died while no edge watched."""
        self._slots = await self.run(self.wiring.owned, self.owner_prefix)
        await self.run(self.wiring.sweep)

    async def set(self, sandbox_id: str, egress: Egress | None,
                  wire: Callable[[], Awaitable[Slot]],
                  unwire: Callable[[Slot], Awaitable[None]]) -> None:
        """Make ``egress`` the sandbox's policy: ``wire`` gives it a slot when it has none,
        ``unwire`` takes the slot away when the policy goes back to none (or when the rules
        of a slot just wired cannot be applied: a failure leaves the previous policy)."""
        async with self._lock(sandbox_id):
            slot = self._slots.get(sandbox_id)
            if egress is None:
                if slot is not None:
                    await unwire(slot)
                    del self._slots[sandbox_id]
                return
            if slot is not None:
                await self.run(self.wiring.apply, slot, egress)
                return
            slot = await wire()
            try:
                await self.run(self.wiring.apply, slot, egress)
            except BaseException:
                await unwire(slot)  # all or nothing: back to no network
                raise
            self._slots[sandbox_id] = slot

    async def remove(self, sandbox_id: str) -> None:
        """The sandbox is gone: remove its rules and host link, if it had any."""
        async with self._lock(sandbox_id):
            slot = self._slots.pop(sandbox_id, None)
            if slot is not None:
                await self.run(self.wiring.detach, slot)
        self._locks.pop(sandbox_id, None)

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())
