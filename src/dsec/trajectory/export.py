"""Provenance export: a trajectory as JSON lines.

The first line describes the trajectory (``"type": "trajectory"``): its id, when and by whom
(API key id and name) it was created, the create request, and every generation with its
sandbox, image name and image digest, and how that sandbox ended. Then one line per logged
step of every generation (``"type": "step"``), in order: who ran it, when, in which sandbox
and image, the request and the digest it was matched by, the status and the full outcome.
Every byte field is given inline as ``{"size", "sha256", "b64"}``, blobs included, so an
export is self-contained.
"""

from __future__ import annotations

import base64
import hashlib
import time
from typing import TYPE_CHECKING, Any, Iterator

from .. import __version__

if TYPE_CHECKING:
    from ..store.sqlite import StateStore
    from .log import StepRow, TrajectoryLog

PAGE = 500


def export_lines(log: TrajectoryLog, store: StateStore, trajectory: str) -> Iterator[dict[str, Any]]:
    row = log.get(trajectory)
    keys = {r["id"]: r["name"] for r in store.keys()}
    generations = log.generations(trajectory)
    images = {g.generation: g.image_digest for g in generations}
    yield {
        "type": "trajectory", "id": row.id, "created_at": row.created_at,
        "created_by": _caller(row.created_by, keys), "request": row.request,
        "generation": row.generation, "exported_at": time.time(), "dsec_version": __version__,
        "generations": [_generation(g, store) for g in generations],
    }
    for g in generations:
        after = 0
        while page := log.steps(trajectory, g.generation, after=after, limit=PAGE):
            for step in page:
                yield _step(log, step, images[g.generation], keys)
            after = page[-1].step


def _generation(g: Any, store: StateStore) -> dict[str, Any]:
    sandbox = store.get_sandbox(g.sandbox_id)
    return {"generation": g.generation, "sandbox_id": g.sandbox_id, "image": g.image,
            "image_digest": g.image_digest, "started_at": g.started_at,
            "forked_at_step": g.forked_at_step, "reason": g.reason,
            "replay_differences": g.replay_differences,
            "sandbox_state": sandbox.state if sandbox else None,
            "sandbox_reason": sandbox.reason if sandbox else None,
            "sandbox_ended_at": sandbox.ended_at if sandbox else None}


def _step(log: TrajectoryLog, step: StepRow, image_digest: str,
          keys: dict[str, str]) -> dict[str, Any]:
    request = dict(step.request)
    payload = log.request_of(step).payload
    if payload is not None:
        request["payload"] = _bytes(payload)
    outcome = step.outcome
    if outcome is not None and "bytes" in outcome:
        outcome = {**outcome, "bytes": {k: _inline(log, ref) for k, ref in outcome["bytes"].items()}}
    return {"type": "step", "trajectory": step.trajectory, "generation": step.generation,
            "step": step.step, "op": step.op, "digest": step.digest, "request": request,
            "status": step.status, "outcome": outcome, "sandbox_id": step.sandbox_id,
            "image_digest": image_digest, "caller": _caller(step.caller, keys),
            "started_at": step.started_at, "ended_at": step.ended_at}


def _inline(log: TrajectoryLog, ref: dict[str, Any]) -> dict[str, Any]:
    return _bytes(base64.b64decode(ref["b64"]) if "b64" in ref else log.load(ref["sha256"]))


def _bytes(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "b64": base64.b64encode(data).decode()}


def _caller(key_id: str | None, keys: dict[str, str]) -> dict[str, Any] | None:
    return None if key_id is None else {"key_id": key_id, "key_name": keys.get(key_id)}
