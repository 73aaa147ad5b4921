"""What a sandbox made from a snapshot takes from the sandbox the snapshot was taken of.

A child (``create(snapshot=...)``, ``fork``, E2B's fork and create from a snapshot, a
trajectory's forks and replays) is its parent again with a new identity, so it has its
parent's limits, network policy, runtime, environment and TTL for every field its request
does not set (``model_fields_set``); its image, substrate and disk size are the snapshot's
whatever the request says, and a `full` snapshot's child has its parent's machine (memory and
CPUs: the saved memory is that size). This is decided here, once, for every front-end: the
router applies it before a project's quota admits the create, so the quota is charged the cpu
and memory the child will have, not the request's defaults (a child must not slip past its
project's quota by inheriting bigger limits); the edge applies it again when it starts the
child (a no-op then: every inherited field is set), so an edge called on its own agrees.

What is inherited is kept in the snapshot's own record when it is taken (its parent's policy
in force then, later ``set_network`` calls aside), so a snapshot that outlives its parent's
record still gives it. A record of before inheritance falls back to the parent's record, and
without that to the request's defaults (a `full` one cannot: SnapshotNotFound).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..protocol.errors import InvalidRequest, SnapshotNotFound
from ..protocol.models import CreateRequest
from ..store.sqlite import SnapshotRow, StateStore

# The request's fields a child inherits. Not inherited: labels (they name the sandbox, not
# what it can do), trajectory and checkpoints (a trajectory is one sandbox's). ``ttl_s`` is
# the lifetime the parent was created with, counted afresh from the child's start; ``env``
# is merged: the request's variables over the parent's.
INHERITED = ("cpu", "memory_mb", "pids", "ttl_s", "network", "env", "runtime")
MACHINE = ("cpu", "memory_mb")  # a `full` snapshot's saved machine


def inheritance(request: dict[str, Any]) -> dict[str, Any]:
    """What a snapshot of a sandbox created with ``request`` (its record's) keeps for the
    sandboxes made from it."""
    return {name: request[name] for name in INHERITED if name in request}


def from_snapshot(req: CreateRequest, snap: SnapshotRow, store: StateStore) -> CreateRequest:
    """``req`` (a create from ``snap``) as the child will be made: validated again whole, so
    an inherited network policy passes the checks an explicit one does."""
    parent = _inherited(snap, store)
    given = req.model_dump(exclude_unset=True)
    fields = {**parent, **given, "env": {**parent.get("env", {}), **req.env},
              "image": snap.image, "substrate": snap.substrate, "disk_mb": snap.disk_mb}
    if snap.mode == "full":
        missing = [name for name in MACHINE if name not in parent]
        if missing:
            raise SnapshotNotFound(f"snapshot {snap.id} is a `full` one whose parent's machine "
                                   f"({', '.join(missing)}) is no longer recorded",
                                   snapshot=snap.id)
        fields.update({name: parent[name] for name in MACHINE})
    try:
        return CreateRequest.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest(f"what a sandbox from snapshot {snap.id} inherits of its parent "
                             f"is no longer valid; set it in the request: "
                             f"{exc.errors(include_url=False)}", snapshot=snap.id) from None


def _inherited(snap: SnapshotRow, store: StateStore) -> dict[str, Any]:
    if snap.inherited is not None:
        return snap.inherited
    parent = store.get_sandbox(snap.sandbox_id)  # a snapshot of before inheritance was kept
    return {} if parent is None else inheritance(parent.request)
