"""The SDK side of a sandbox attached to a trajectory: step numbering, fast-forward from a
prefetched log, retries, and following a fork.

Every call of an attached sandbox handle gets the next step number (from 1) when it is made,
and carries it in ``X-DSec-Step``; the server matches it against the log at that position.
A resumed handle prefetches the logged steps (pages of 1,000, as it gets to them): a call
whose digest equals the logged one is answered from the page without a round trip; anything
else (a different call, a step not logged, an outcome too big to be inline) goes to the
server, which is the authority: it fast-forwards, executes, forks or raises
``TrajectoryDiverged``. A call that fails because the server is unreachable is sent again
with the same step until ``retry_s`` has passed: the log makes that safe (a step that ran is
answered from the log; one that was running when the server died raises ``StepInterrupted``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal, Union

from ..protocol.digest import StepRequest
from ..protocol.errors import InvalidRequest
from ..protocol.models import StepPage
from ..protocol.outcome import inline

PAGE = 1000
OnDivergence = Literal["raise", "fork"]
Checkpoint = Union[Literal["every_step"], int]  # create(checkpoint=): after every step, or every k-th


@dataclass(frozen=True)
class Logged:
    op: str
    outcome: dict[str, Any]


@dataclass
class Attachment:
    trajectory: str
    on_divergence: OnDivergence = "raise"
    generation: int | None = None
    logged: int = 0  # last logged step when attached: prefetch goes no further
    prefetch: bool = False
    retry_s: float = 30.0
    next_step: int = 1
    fast_forwarded: int = 0  # calls answered from the log (here or by the server)
    _cache: dict[int, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    _fetched: int = 0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def take_step(self) -> int:
        step, self.next_step = self.next_step, self.next_step + 1
        return step

    def headers(self, step: int) -> dict[str, str]:
        if self.on_divergence == "raise":  # the server's default
            return {"x-dsec-step": str(step)}
        return {"x-dsec-step": str(step), "x-dsec-on-divergence": self.on_divergence}

    def may_be_logged(self, step: int) -> bool:
        """Whether ``step`` could be answered from the prefetched log."""
        return self.prefetch and step <= self.logged

    async def logged_outcome(self, step: int, request: Callable[[], StepRequest],
                             fetch: Callable[[int, int], Awaitable[StepPage]]) -> Logged | None:
        """The prefetched outcome of ``step`` if the call (made by ``request``) is the one
        logged there."""
        if not self.may_be_logged(step):
            return None
        if step > self._fetched:
            async with self._lock:
                while step > self._fetched and self.prefetch:
                    page = await fetch(self._fetched, PAGE)
                    if page.generation != self.generation:  # forked meanwhile
                        self.stop_prefetch()
                        return None
                    for s in page.steps:
                        if s.status in ("ok", "error") and s.outcome is not None and inline(s.outcome):
                            self._cache[s.step] = (s.digest, s.outcome)
                    self._fetched = self.logged if page.next_after is None else page.next_after
        entry = self._cache.pop(step, None)
        if entry is None:
            return None
        call = request()
        if entry[0] != call.digest:
            return None
        self.fast_forwarded += 1
        return Logged(call.op, entry[1])

    def stop_prefetch(self) -> None:
        self.prefetch = False
        self._cache.clear()

    def observe(self, headers: Any) -> str | None:
        """Take note of a response's ``X-DSec-Trajectory`` header (``SOURCE GENERATION
        SANDBOX``); returns the sandbox that now serves the trajectory."""
        value = headers.get("x-dsec-trajectory")
        if value is None:
            return None
        source, generation, sandbox_id = value.split(" ")
        if source == "log":
            self.fast_forwarded += 1
        if self.generation is not None and int(generation) != self.generation:
            self.stop_prefetch()  # a fork: the prefetched log is of the old generation
        self.generation = int(generation)
        return sandbox_id


def check_on_divergence(value: str) -> OnDivergence:
    if value not in ("raise", "fork"):
        raise InvalidRequest("on_divergence is 'raise' or 'fork'", on_divergence=value)
    return value  # type: ignore[return-value]
