"""How many container starts run at once.

A start is CPU work for the host: its bundle (a mount namespace, the disk's clone, attach
and mount, the overlay), then ``crun run`` (namespaces, cgroups, the seccomp filter, the
agent's start and claim). Started all together, a burst's starts share the host's cores and
end together near the burst's end: in bursts of 100 creates on 2 cores, a tenth of them had
their first output only after 1.0-1.5 s, the median after 1.3-1.6 s, the last after 1.4-1.7
s. Admitted a few at a time, in the order they came, they end one after another in about the
same total time, and the burst's median create waits 15-30 % less (issue 15,
docs/BENCHMARKS.md). One create alone never waits here.

Bundles are admitted two per core, runtime starts four per core: both spend part of their
time waiting on the kernel, not on a core, and a runtime start the more so on a full node. On
2 cores, two runtime starts per core gave a burst about the same median, but made 1,000
creates at 64 in flight 5-10 % slower and the fill of a node with 3,000 sandboxes 11 %
slower; four per core kept both rates. A warm pool's refills are not admitted here: they run
at idle priority and must never hold a slot a create waits for.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any


class StartSlots:
    def __init__(self) -> None:
        cores = len(os.sched_getaffinity(0))  # the cores this server may run on
        self.bundles_at_once = 2 * cores
        self.runs_at_once = 4 * cores
        self._bundles = asyncio.Semaphore(self.bundles_at_once)
        self._runs = asyncio.Semaphore(self.runs_at_once)

    def bundle(self, warm: bool) -> AbstractAsyncContextManager[Any]:
        """Held while a start's bundle is made."""
        return nullcontext() if warm else self._bundles

    def run(self, warm: bool) -> AbstractAsyncContextManager[Any]:
        """Held from a start's ``crun run`` until its agent is claimed."""
        return nullcontext() if warm else self._runs
