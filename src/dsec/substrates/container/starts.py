"""How many container starts run at once.

A start is CPU work for the host: its bundle (a mount namespace, the disk's clone, attach
and mount, the overlay), then ``crun run`` (namespaces, cgroups, the seccomp filter, the
agent's start and claim). Started all together, a burst's starts share the host's cores
and all end near the burst's end: in a burst of 100 creates on 2 cores, the first returned
after about 0.5 s and the median after 1.4 s, nearly as late as the last. Admitted a few at a
time, in the order they came, they end one after another in about the same total time, and
the median create of the burst waits a third less (issue 15, docs/BENCHMARKS.md). One
create alone never waits here.

Bundles and runtime starts are each admitted two per core (both spend part of their time
waiting on the kernel, not on a core). On 2 cores, bundles one per core gave the burst the
same median but made 1,000 creates at 64 in flight about 7 % slower; two per core kept their
rate. A warm pool's refills are not admitted here: they run at idle priority and must never
hold a slot a create waits for.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any


class StartSlots:
    def __init__(self) -> None:
        cores = len(os.sched_getaffinity(0))  # the cores this server may run on
        self._bundles = asyncio.Semaphore(2 * cores)
        self._runs = asyncio.Semaphore(2 * cores)

    def bundle(self, warm: bool) -> AbstractAsyncContextManager[Any]:
        """Held while a start's bundle is made."""
        return nullcontext() if warm else self._bundles

    def run(self, warm: bool) -> AbstractAsyncContextManager[Any]:
        """Held from a start's ``crun run`` until its agent is claimed."""
        return nullcontext() if warm else self._runs
