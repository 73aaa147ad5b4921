"""HTTP routes of trajectories (``/v1/trajectories``).

A trajectory id is path-like (``run-7/ep-123``), so it is the rest of the path up to ``/-/``,
which starts a sub-resource (as in GitLab's URLs); no id segment may be ``-``.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import Response, StreamingResponse

from ..control.routing import Router
from ..protocol.errors import InvalidRequest, TrajectoryNotFound
from ..protocol.models import (
    STEP_MAX,
    TRAJECTORY_ID,
    ForkTrajectoryRequest,
    ReplayReport,
    ReplayRequest,
    StepPage,
    StepRecord,
    TrajectoryInfo,
)
from ..store.sqlite import StateStore
from ..trajectory.export import export_lines
from ..trajectory.log import StepRow

NDJSON = "application/x-ndjson"
MAX_PAGE = 5000


def trajectory_routes(router: Router, store: StateStore,
                      authenticated: Callable[..., Awaitable[str]]) -> APIRouter:
    """The routes; ``authenticated`` is the dependency that names the caller's key."""
    api = APIRouter(prefix="/v1/trajectories")
    TrajectoryId = Path(pattern=TRAJECTORY_ID, max_length=256)

    def visible(trajectory: str) -> str:
        """The trajectory, if the caller's key may see its sandbox (its project's)."""
        sandbox_id = router.trajectories().log.get(trajectory).sandbox_id
        if router.access is not None and not router.access.sees(sandbox_id):
            raise TrajectoryNotFound(f"no trajectory {trajectory!r}", trajectory=trajectory)
        return trajectory

    @api.get("")
    async def list_trajectories(limit: int = Query(100, ge=1, le=1000)) -> list[TrajectoryInfo]:
        recorder = router.trajectories()
        rows = recorder.log.list(limit)
        if router.access is not None:
            rows = [row for row in rows if router.access.sees(row.sandbox_id)]
        return [recorder.info(row.id) for row in rows]

    @api.get("/{trajectory:path}/-/steps")
    async def steps(trajectory: str = TrajectoryId, generation: int | None = Query(None, ge=0, le=STEP_MAX),
                    after: int = Query(0, ge=0, le=STEP_MAX),
                    limit: int = Query(1000, ge=1, le=MAX_PAGE)) -> StepPage:
        """Logged steps after ``after``, in order, with their outcomes (bytes above 4 KiB as
        blob references). The SDK prefetches these to fast-forward without a round trip."""
        log = router.trajectories().log
        visible(trajectory)
        generation = generation or log.get(trajectory).generation
        rows = log.steps(trajectory, generation, after=after, limit=limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        checkpoints = log.checkpoints(trajectory, generation, after=after,
                                      upto=rows[-1].step if rows else None)
        return StepPage(trajectory=trajectory, generation=generation,
                        steps=[_record(r, checkpoints.get(r.step)) for r in rows],
                        next_after=rows[-1].step if more else None)

    @api.get("/{trajectory:path}/-/export", response_class=StreamingResponse)
    async def export(trajectory: str = TrajectoryId,
                     format: str = Query("jsonl")) -> StreamingResponse:
        if format != "jsonl":
            raise InvalidRequest("the only export format is jsonl", format=format)
        visible(trajectory)
        lines = export_lines(router.trajectories().log, store, trajectory)
        first = next(lines)  # an unknown trajectory is an ordinary HTTP error

        async def body() -> AsyncIterator[bytes]:
            yield json.dumps(first).encode() + b"\n"
            for n, line in enumerate(lines):
                yield json.dumps(line).encode() + b"\n"
                if n % 100 == 99:
                    await asyncio.sleep(0)  # let other requests in during a long export

        return StreamingResponse(body(), media_type=NDJSON)

    @api.post("/{trajectory:path}/-/resume")
    async def resume(trajectory: str = TrajectoryId) -> TrajectoryInfo:
        """The trajectory and its live sandbox; ``sandbox_died`` (or ``sandbox_not_found``
        for a stopped one) with ``last_step`` in the details otherwise."""
        return router.trajectories().resume(visible(trajectory))

    @api.post("/{trajectory:path}/-/replay")
    async def replay(req: ReplayRequest, trajectory: str = TrajectoryId) -> ReplayReport:
        return await router.trajectories().replay(visible(trajectory), req)

    @api.post("/{trajectory:path}/-/fork")
    async def fork(req: ForkTrajectoryRequest, trajectory: str = TrajectoryId,
                   caller: str = Depends(authenticated)) -> list[TrajectoryInfo]:
        """New trajectories from the checkpoint of one step (see ``fork_trajectory``)."""
        return await router.trajectories().fork_trajectory(
            visible(trajectory), req.at_step, req.n, caller)

    @api.delete("/{trajectory:path}", status_code=204)
    async def delete(trajectory: str = TrajectoryId) -> Response:
        """The trajectory forgotten: its sandbox stopped, its log and its checkpoints'
        snapshots (those no fork of it links) deleted."""
        await router.trajectories().delete(visible(trajectory))
        return Response(status_code=204)

    @api.get("/{trajectory:path}")
    async def get(trajectory: str = TrajectoryId) -> TrajectoryInfo:
        return router.trajectories().info(visible(trajectory))

    return api


def _record(row: StepRow, checkpoint: str | None) -> StepRecord:
    fields = vars(row).copy()
    del fields["payload"]  # the request names it by size and SHA-256
    return StepRecord(**fields, checkpoint=checkpoint)
