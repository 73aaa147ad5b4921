"""The one interface of garbage collection: a ``Collector`` removes one family of things
that are no longer needed (ended sandboxes' records, unreferenced blobs, unused image
layers...) and says what it removed.

Why this small: the server's background loop (``dsec.control.gc``), ``dsec gc`` and the admin
route run every collector the same way, count what each returns in ``/metrics`` and log it;
a collector only decides what is garbage and removes it. Rules every collector keeps:

- ``collect(now, dry_run)`` removes what is garbage at ``now`` (a wall-clock time, so tests
  and ``dsec gc`` can look ahead); with ``dry_run`` it removes nothing and returns what it
  would have removed.
- It removes in small batches, each committed on its own, awaiting between them: a large
  backlog never holds the database or the event loop for long.
- Two collectors of the same kind may run at once (a lease can lapse while its holder
  stalls): a removal is a conditional delete (or an atomic rename), and only what this call
  itself removed is counted, so nothing is counted twice.
- What a sandbox made (file names, trees, row contents) is data: a collector never follows
  it without bounds, and a malformed item is skipped (and logged), never an abort.

A collector is registered with the loop as *shared* (state every replica of a cluster sees:
run by the one replica holding the GC lease) or *local* (files of this process's host: run by
every replica for its own).
"""

from __future__ import annotations

from typing import Protocol

from ..protocol.gc_models import Removed


class Collector(Protocol):
    name: str  # for logs and errors: "sandboxes", "blobs", "layers"...

    async def collect(self, now: float, dry_run: bool) -> list[Removed]:
        """Remove (or, ``dry_run``, only count) what is garbage at ``now``; one ``Removed``
        per kind of thing it handles (zero counts included)."""
        ...
