"""Fast-forward and recording at the edge boundary.

The router hands out a ``RecordedEdge`` instead of the ``Edge`` for a sandbox that is attached
to a trajectory (``Recorder.wrap``); it has the edge's operations (derived from the table in
``dsec.protocol.ops``), so routes do not know the difference, and a sandbox with no
trajectory gets the bare edge (one dict lookup).

A call carries its position (``Call.step``, numbered by the SDK from 1 per attached handle).
For the trajectory's current generation, at that step:

- logged, same request digest: the logged result is returned; nothing runs (fast-forward);
- logged, different digest: ``TrajectoryDiverged``, or with ``on_divergence="fork"`` a fork;
- being run by this server, same digest: the call joins it and gets its result (a client that
  was killed mid-call and re-issues it gets the one execution, not a second one);
- logged as running by a server that is gone: ``StepInterrupted`` (or a fork);
- not logged: the step is claimed (a ``running`` row), run, and its outcome made durable
  before the result is returned (journaled on SQLite, and folded into the log's table right
  after). A client that disconnects does not stop the run, and its outcome is logged all the
  same: a stream runs in a task of its own (a streaming response is cancelled when its
  client goes), any other call in its request's task (which the server never cancels for a
  disconnect: uvicorn and Starlette cancel only streaming responses).

Calls on one trajectory may run concurrently; each is logged at its own position, so the
log's order is the client's issue order. Gaps are allowed (a later step may finish first); a
re-issued missing step simply runs then. Replays and forks run steps one at a time in order.
A call without a step (a compat API, an SDK handle from ``client.get``) is appended after
the last step and never fast-forwarded.

A fork (divergence at step k with ``on_divergence="fork"``, or ``replay(attach=True)``)
starts a fresh sandbox from the trajectory's create request, replays the logged steps before k
into it, starts the next generation with those steps copied (results as the client saw them;
steps whose replay differed are noted on the generation), stops the old sandbox, and goes on
there. Calls addressed to an older generation's sandbox are served by the current one; the
response header names it, and the SDK follows. A fork waits for the calls still running before
its step; one still running after it finishes in the old generation (and sandbox, which the
fork stops). A call that differs from one still running at its step always raises.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine, Literal

from pydantic import ValidationError

from ..agent.client import Output
from ..protocol.digest import STREAM_OPS, StepRequest, step_request
from ..protocol.errors import (
    CheckpointNotFound,
    DSecError,
    InvalidRequest,
    SandboxDied,
    SandboxNotFound,
    SnapshotNotFound,
    StepInterrupted,
    TrajectoryDiverged,
    TrajectoryExists,
)
from ..protocol.models import (
    CreateRequest,
    ExecResult,
    GenerationInfo,
    ReplayReport,
    ReplayRequest,
    SandboxInfo,
    StepDiff,
    TrajectoryInfo,
    checkpointed,
)
from ..protocol.ops import Operation, bind, derive_operations
from ..protocol.outcome import Outcome, decode, encode, encode_error, output_chunks
from . import ops
from .log import StepRow, TrajectoryLog
from .replay import replay_rows

if TYPE_CHECKING:
    from ..control.routing import Router
    from ..edge.edge import Edge
    from ..store.sqlite import SandboxRow

log = logging.getLogger("dsec.trajectory")

OFFLOAD_BYTES = 256 << 10  # outcomes larger than this are written to the blob area off-loop
MAX_STATES = 10_000  # trajectories kept in memory (idle ones beyond this are reloaded on use)
FORK_CONCURRENCY = 16  # sandboxes a fork_trajectory starts at a time


@dataclass
class Call:
    """Who makes a call, and at which position of the sandbox's trajectory (request headers
    ``X-DSec-Step`` and ``X-DSec-On-Divergence``). The recorder fills in where the answer
    came from, for the response header."""

    caller: str | None = None
    step: int | None = None
    on_divergence: Literal["raise", "fork"] = "raise"
    source: Literal["log", "live", "joined"] | None = None
    sandbox_id: str | None = None
    generation: int | None = None

    def response_header(self) -> tuple[bytes, bytes]:
        """``X-DSec-Trajectory: SOURCE GENERATION SANDBOX``: where the answer came from
        (``log``, ``live``, ``joined``), and the generation and sandbox that serve the
        trajectory now (they change when it forks)."""
        return (b"x-dsec-trajectory", f"{self.source} {self.generation} {self.sandbox_id}".encode())


class Flight:
    """A live call being run: its output events so far, and its end."""

    def __init__(self, step: int, request: StepRequest) -> None:
        self.step = step
        self.request = request
        self.events: list[Output | ExecResult] = []
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.run: Coroutine[Any, Any, None] | None = None  # for its caller to run, if not a task
        self._waiters: list[asyncio.Future[None]] = []

    def push(self, event: Output | ExecResult) -> None:
        self.events.append(event)
        self._wake()

    def end(self, value: Any = None, error: BaseException | None = None) -> None:
        if error is not None:
            self.done.set_exception(error)
            self.done.exception()  # retrieved: whoever awaits it gets it, nobody else must
        else:
            self.done.set_result(value)
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def follow(self) -> AsyncIterator[Output | ExecResult]:
        """Every event from the start, then live ones, until the end; raises its error."""
        seen = 0
        while True:
            while seen < len(self.events):
                seen += 1
                yield self.events[seen - 1]
            if self.done.done():
                self.done.result()  # raises the call's error
                return
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter


@dataclass
class TrajectoryState:
    id: str
    generation: int
    sandbox_id: str
    request: dict[str, Any]
    head: int = 0  # no step above this is logged in the current generation
    last_checkpoint: str | None = None  # the snapshot of the newest checkpoint
    flights: dict[tuple[int, int], Flight] = field(default_factory=dict)
    fork_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Recorder:
    def __init__(self, log_: TrajectoryLog, router: Router) -> None:
        self.log = log_
        self.router = router
        self._states: dict[str, TrajectoryState] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def wrap(self, edge: Edge, sandbox_id: str, call: Call | None) -> Edge | RecordedEdge:
        trajectory = edge.trajectory_of(sandbox_id)
        if trajectory is None:
            return edge
        return RecordedEdge(self, edge, trajectory, call or Call())

    def state(self, trajectory: str) -> TrajectoryState:
        """The in-memory state of a trajectory, loaded from the log on first use; idle ones
        are dropped (and reloaded when needed) beyond ``MAX_STATES``."""
        state = self._states.get(trajectory)
        if state is None:
            row = self.log.get(trajectory)
            last = self.log.last_step(row.id, row.generation)[1]
            checkpoint = self.log.checkpoint(row.id, row.generation, last)
            state = TrajectoryState(row.id, row.generation, row.sandbox_id, row.request,
                                    head=last, last_checkpoint=checkpoint and checkpoint[1])
            self._states[trajectory] = state
            if len(self._states) > MAX_STATES:
                self._forget_idle()
        return state

    def _forget_idle(self) -> None:
        for trajectory, state in list(self._states.items()):  # oldest first
            if len(self._states) <= MAX_STATES // 2:
                return
            if not state.flights and not state.fork_lock.locked():
                del self._states[trajectory]

    # attaching
    async def create(self, req: CreateRequest, caller: str | None) -> SandboxInfo:
        """A new sandbox with a new trajectory, its request logged as it is made (from a
        snapshot: with what it inherits), which its forks and replays repeat."""
        req = self.router.effective(req)
        assert req.trajectory is not None
        if self.log.exists(req.trajectory):
            raise TrajectoryExists(f"trajectory {req.trajectory!r} exists; resume it, or pick "
                                   "a new id", trajectory=req.trajectory)
        info = await self.router.place(req)
        try:
            first = None
            if req.checkpointed(0):  # also says now whether the substrate can snapshot
                first = await self.router.owner(info.id).snapshot(info.id)
            self.log.create(req.trajectory, info.id, req.model_dump(), info.image,
                            info.image_digest, caller)
            if first is not None:
                self.log.add_checkpoint(req.trajectory, 1, 0, first.id)
        except BaseException:
            await self.router.owner(info.id).stop(info.id,
                                                  reason="its trajectory could not be created")
            raise
        return info

    def info(self, trajectory: str) -> TrajectoryInfo:
        row = self.log.get(trajectory)
        edge = self.router.owner(row.sandbox_id)
        count, last = self.log.last_step(trajectory, row.generation)
        generations = []
        for g in self.log.generations(trajectory):
            sandbox = self.router.owner(g.sandbox_id).store.get_sandbox(g.sandbox_id)
            generations.append(GenerationInfo(
                generation=g.generation, sandbox_id=g.sandbox_id, image=g.image,
                image_digest=g.image_digest, started_at=g.started_at,
                forked_at_step=g.forked_at_step, reason=g.reason,
                replay_differences=g.replay_differences,
                sandbox_state=sandbox.state if sandbox else None,
                sandbox_reason=sandbox.reason if sandbox else None))
        return TrajectoryInfo(id=row.id, generation=row.generation,
                              sandbox=edge.info(edge.get_row(row.sandbox_id)),
                              created_at=row.created_at, created_by=row.created_by, steps=count,
                              last_step=last, generations=generations,
                              expires_at=row.expires_at)

    def resume(self, trajectory: str) -> TrajectoryInfo:
        """The trajectory, if its sandbox still runs; else the typed error, with the last step."""
        info = self.info(trajectory)
        sandbox = info.sandbox
        details = dict(trajectory=trajectory, sandbox_id=sandbox.id, reason=sandbox.reason,
                       last_step=info.last_step, generation=info.generation)
        if sandbox.state in ("died", "expired"):
            raise SandboxDied(f"the sandbox of trajectory {trajectory} {sandbox.state} "
                              f"({sandbox.reason}) after step {info.last_step}; replay the "
                              "trajectory into a new sandbox", **details)
        if sandbox.state == "stopped":
            raise SandboxNotFound(f"the sandbox of trajectory {trajectory} was stopped after "
                                  f"step {info.last_step}; replay the trajectory into a new "
                                  "sandbox", **details)
        return info

    async def delete(self, trajectory: str) -> None:
        """Forget a trajectory: its sandbox is stopped if it still runs, its log removed, and
        its checkpoints' snapshots deleted unless a fork of it still links them."""
        row = self.log.get(trajectory)
        state = self._states.get(trajectory)
        if state is not None and (state.flights or state.fork_lock.locked()):
            raise InvalidRequest(f"trajectory {trajectory} has calls under way; delete it "
                                 "when they are done", trajectory=trajectory)
        try:
            await self.router.owner(row.sandbox_id).stop(
                row.sandbox_id, reason=f"its trajectory {trajectory} was deleted")
        except (SandboxDied, SandboxNotFound):
            pass  # it had already ended
        self._states.pop(trajectory, None)
        for snapshot in self.log.delete(trajectory):
            try:
                await self.router.delete_snapshot(snapshot)
            except SnapshotNotFound:
                pass  # deleted by its owner already

    # replay
    async def replay(self, trajectory: str, req: ReplayRequest) -> ReplayReport:
        state = self.state(trajectory)
        if req.attach:
            if req.generation not in (None, state.generation) or req.upto is not None:
                raise InvalidRequest("attach replays the whole current generation: leave "
                                     "generation and upto unset")
            replayed = state.generation
            last = self.log.last_step(trajectory, replayed)[1]
            info, diffs = await self._fork(state, last + 1, f"replayed into a new sandbox "
                                                            f"after step {last}")
            return ReplayReport(trajectory=trajectory, generation=replayed, sandbox=info,
                                attached_generation=state.generation, steps=diffs)
        generation = req.generation or state.generation
        upto = req.upto if req.upto is not None else self.log.last_step(trajectory, generation)[1]
        restored = self._restorable(trajectory, generation, upto) if req.restore else None
        rows = self.log.steps(trajectory, generation, after=restored[0] if restored else 0,
                              upto=upto)
        create = CreateRequest(**{**_start_from(state.request, restored), "trajectory": None,
                                  "checkpoint": None})
        info = await self.router.place(create)
        edge = self.router.owner(info.id)
        try:
            diffs = await replay_rows(self.log, edge, info.id, rows)
        except BaseException:
            await edge.stop(info.id, reason=f"replay of trajectory {trajectory} failed")
            raise
        return ReplayReport(trajectory=trajectory, generation=generation, sandbox=info,
                            restored_step=restored and restored[0], steps=diffs)

    def _restorable(self, trajectory: str, generation: int, upto: int) -> tuple[int, str] | None:
        """(step, snapshot) of the newest checkpoint at or before ``upto`` to start a sandbox
        from instead of replaying the steps up to it; None without checkpoints (replay all).
        A checkpoint whose snapshot was deleted is ``CheckpointNotFound``: the steps it
        stood for are never re-executed silently instead."""
        found = self.log.checkpoint(trajectory, generation, upto)
        if found is None or found[0] == 0:  # step 0 is a fresh sandbox: nothing to restore
            return None
        self._checkpoint_snapshot(trajectory, *found)
        return found

    def _checkpoint_snapshot(self, trajectory: str, step: int, snapshot: str) -> None:
        """Raise ``CheckpointNotFound`` if the checkpoint's snapshot is gone."""
        try:
            self.router.visible_snapshot(snapshot)
        except SnapshotNotFound:
            raise CheckpointNotFound(f"the checkpoint of step {step} of trajectory {trajectory} "
                                     f"was deleted (snapshot {snapshot})", trajectory=trajectory,
                                     step=step, snapshot=snapshot) from None

    async def fork_trajectory(self, trajectory: str, at_step: int, n: int,
                              caller: str | None) -> list[TrajectoryInfo]:
        """``n`` new trajectories, each in a new sandbox started from ``trajectory``'s
        checkpoint of step ``at_step``, holding its steps up to ``at_step`` (nothing is
        re-executed) and going on from the step after it. Their ids are
        ``<trajectory>/fork-<at_step>-<hex>``. All or none: if one cannot be made, those
        made are deleted and the error raised."""
        state = self.state(trajectory)
        generation = state.generation
        found = self.log.checkpoint(trajectory, generation, at_step)
        if found is None or found[0] != at_step:  # a row is written once its step is logged
            raise CheckpointNotFound(f"trajectory {trajectory} has no checkpoint at step "
                                     f"{at_step} (create it with checkpoint=...)",
                                     trajectory=trajectory, step=at_step)
        snapshot = found[1]
        self._checkpoint_snapshot(trajectory, at_step, snapshot)
        requests = []
        for _ in range(n):
            fork_id = f"{trajectory}/fork-{at_step}-{secrets.token_hex(4)}"
            try:
                requests.append(CreateRequest(**{**state.request, "trajectory": fork_id,
                                                 "snapshot": snapshot}))
            except ValidationError as exc:
                raise InvalidRequest(f"cannot fork trajectory {trajectory}: {fork_id!r} is not "
                                     f"a trajectory id ({exc.errors()[0]['msg']})",
                                     trajectory=trajectory) from None
        slots = asyncio.Semaphore(FORK_CONCURRENCY)

        async def one(req: CreateRequest) -> str:
            assert req.trajectory is not None
            logged = {**state.request, "trajectory": req.trajectory}  # replays start afresh
            async with slots:
                return await self._branch(trajectory, generation, at_step, req, logged, caller)
        made = await asyncio.gather(*map(one, requests), return_exceptions=True)
        failed = [m for m in made if isinstance(m, BaseException)]
        if failed:
            for fork_id in (m for m in made if isinstance(m, str)):
                try:
                    await self.delete(fork_id)
                except DSecError:
                    log.exception("could not delete fork %s of a failed fork_trajectory", fork_id)
            if isinstance(failed[0], SnapshotNotFound):  # deleted while forks were made
                self._checkpoint_snapshot(trajectory, at_step, snapshot)
            raise failed[0]
        return [self.info(fork_id) for fork_id in made if isinstance(fork_id, str)]

    async def _branch(self, trajectory: str, generation: int, at_step: int,
                      req: CreateRequest, logged: dict[str, Any], caller: str | None) -> str:
        """One fork of ``fork_trajectory``: its sandbox (``req``), then its log, which
        holds ``logged`` as its create request."""
        assert req.trajectory is not None
        info = await self.router.place(req)
        try:
            self.log.branch(trajectory, generation, at_step, req.trajectory, info.id, logged,
                            info.image, info.image_digest, caller)
        except BaseException:
            await self.router.owner(info.id).stop(
                info.id, reason=f"fork of trajectory {trajectory} failed")
            raise
        return req.trajectory

    # calls
    async def call(self, trajectory: str, call: Call, request: StepRequest) -> Any:
        """A call's value (for ``exec``/``output``: the ExecResult with all its output)."""
        state = self.state(trajectory)
        found = await self._resolve(state, call, request, streaming=False)
        if isinstance(found, StepRow):
            assert found.outcome is not None
            return decode(found.op, found.outcome, self.log.load)
        run, found.run = found.run, None  # the caller that started it runs it; joiners wait
        if run is not None:
            await run
        return await asyncio.shield(found.done)

    async def stream(self, trajectory: str, call: Call,
                     request: StepRequest) -> AsyncIterator[Output | ExecResult]:
        """Output events then the ExecResult without output, as ``Edge.stream`` yields them."""
        found = await self._resolve(self.state(trajectory), call, request, streaming=True)
        if isinstance(found, Flight):
            async for event in found.follow():
                yield event
            return
        assert found.outcome is not None
        result: ExecResult = decode(found.op, found.outcome, self.log.load)
        for fd, data in output_chunks(result, found.outcome.get("chunks")):
            yield Output(fd, data)
        yield result.model_copy(update={"stdout_b64": "", "stderr_b64": ""})

    async def _resolve(self, state: TrajectoryState, call: Call, request: StepRequest,
                       streaming: bool) -> Flight | StepRow:
        """The logged step to answer from, or the flight (live or joined) to follow. A live
        flight of a ``streaming`` caller runs in a task; else the caller runs ``flight.run``."""
        while True:
            if state.fork_lock.locked():  # a fork is under way: go on in its new generation
                async with state.fork_lock:
                    pass
            generation = state.generation
            call.sandbox_id, call.generation = state.sandbox_id, generation
            step = call.step
            if step is None:
                return self._append(state, call, request, streaming)
            flight = state.flights.get((generation, step))
            if flight is not None:
                if flight.request.digest == request.digest:
                    call.source = "joined"
                    return flight
                self._diverged(state, step, flight.request.describe(), request, False, fork=False)
            # Above the head nothing is logged: claim at once (the claim is the check).
            row = self.log.step(state.id, generation, step) if step <= state.head else None
            if row is None:
                flight = self._start(state, generation, step, request, call, streaming)
                if flight is not None:
                    return flight
                continue  # someone claimed it meanwhile: look again
            interrupted = row.status in ("running", "interrupted")
            if row.digest != request.digest or interrupted:
                logged = self.log.request_of(row).describe()
                fork = call.on_divergence == "fork"
                self._diverged(state, step, logged, request, interrupted, fork)
                await self._fork(state, step, f"diverged at step {step}" if not interrupted
                                 else f"step {step} was interrupted")
                continue
            call.source = "log"
            return row

    def _diverged(self, state: TrajectoryState, step: int, logged: dict[str, Any],
                  issued: StepRequest, interrupted: bool, fork: bool) -> None:
        """Raise the divergence, unless the caller asked to fork."""
        if fork:
            return
        details = dict(trajectory=state.id, generation=state.generation, step=step,
                       logged=logged, issued=issued.describe())
        if interrupted:
            raise StepInterrupted(
                f"step {step} of trajectory {state.id} was interrupted (its server stopped "
                "while running it): its effect on the sandbox is unknown; fork or replay", **details)
        raise TrajectoryDiverged(
            f"step {step} of trajectory {state.id} differs from the logged call: logged "
            f"{_brief(logged)}, issued {_brief(issued.describe())}", **details)

    def _append(self, state: TrajectoryState, call: Call, request: StepRequest,
                streaming: bool) -> Flight:
        """The call as the step after the generation's last. Claimed at this server's head
        first, without a read: only when that position is taken (by another server sharing
        the log) is the log asked where it ends."""
        generation = state.generation
        step = state.head + 1
        while (flight := self._start(state, generation, step, request, call, streaming)) is None:
            step = max(step, self.log.last_step(state.id, generation)[1]) + 1
        return flight

    def _start(self, state: TrajectoryState, generation: int, step: int, request: StepRequest,
               call: Call, streaming: bool) -> Flight | None:
        """Claim the step and set it up to run: in a task of its own for a ``streaming``
        caller, else as ``flight.run`` for the caller to await. None if the step was taken."""
        sandbox_id = state.sandbox_id
        edge = self.router.owner(sandbox_id)
        edge.require_live(sandbox_id)  # a dead sandbox: the error, and nothing is logged
        if not self.log.claim(state.id, generation, step, request, sandbox_id, call.caller):
            state.head = max(state.head, step)  # taken by another server: look it up
            return None
        state.head = max(state.head, step)
        flight = Flight(step, request)
        state.flights[(generation, step)] = flight
        run = self._run(state, generation, edge, sandbox_id, flight)
        if streaming:
            task = asyncio.create_task(run, name=f"dsec-step-{state.id}-{step}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            flight.run = run
        call.source = "live"
        return flight

    async def _run(self, state: TrajectoryState, generation: int, edge: Edge, sandbox_id: str,
                   flight: Flight) -> None:
        request = flight.request
        value: Any = None
        error: DSecError | None = None
        last: list[Output | ExecResult] = []  # a stream's result event, held back
        try:
            try:
                if request.op in STREAM_OPS:
                    value, chunks = await ops.collect(ops.events(edge, sandbox_id, request),
                                                      on_event=_output_then(flight, last))
                    outcome = encode(request.op, value, chunks)
                else:
                    value, _ = await ops.call(edge, sandbox_id, request)
                    outcome = encode(request.op, value)
            except DSecError as exc:
                error, outcome = exc, encode_error(exc)
            except Exception as exc:  # a bug: log it as the step's outcome all the same
                log.exception("step %s of %s failed", flight.step, state.id)
                error = DSecError(f"internal error: {exc!r}")
                outcome = encode_error(error)
            stored = await self._stored(outcome)
            self.log.finish(state.id, generation, flight.step, stored)
            if checkpointed(state.request.get("checkpoint"), flight.step):
                await self._checkpoint(state, generation, flight.step, edge, sandbox_id)
            if last:  # a stream's result goes out once its step is checkpointed
                flight.push(last[0])
        except asyncio.CancelledError:  # the server is stopping: the step stays 'running'
            flight.end(error=DSecError("the server stopped while running this step"))
            raise
        except Exception as exc:
            log.exception("could not log step %s of %s", flight.step, state.id)
            flight.end(error=DSecError(f"could not log step {flight.step}: {exc!r}"))
        else:
            flight.end(value, error)
        finally:
            state.flights.pop((generation, flight.step), None)
            asyncio.get_running_loop().call_soon(self._fold)  # once the answer is on its way

    def _fold(self) -> None:
        """The log's journaled outcomes into its table (see ``TrajectoryLog.fold``); one
        that fails stays journaled, and the next fold or read of the log tries again."""
        try:
            self.log.fold()
        except Exception:
            log.exception("could not fold the trajectory journal into the log")

    async def _checkpoint(self, state: TrajectoryState, generation: int, step: int, edge: Edge,
                          sandbox_id: str) -> None:
        """Link the step to a snapshot of the sandbox's file system now: the previous
        checkpoint's when nothing was written since (no copy). A step after which no
        snapshot can be taken (it killed its sandbox) has no checkpoint: a fork there is
        ``CheckpointNotFound``."""
        try:
            snap = await edge.snapshot(sandbox_id, "filesystem", state.last_checkpoint)
        except DSecError as exc:
            log.warning("no checkpoint after step %d of %s: %s", step, state.id, exc)
            return
        self.log.add_checkpoint(state.id, generation, step, snap.id)
        if generation == state.generation:
            state.last_checkpoint = snap.id

    async def _stored(self, outcome: Outcome) -> dict[str, Any]:
        if sum(map(len, outcome.data.values())) > OFFLOAD_BYTES:
            return await asyncio.to_thread(self.log.stored_outcome, outcome)
        return self.log.stored_outcome(outcome)

    # forks
    async def _fork(self, state: TrajectoryState, at_step: int,
                    reason: str) -> tuple[SandboxInfo, list[StepDiff]]:
        """Continue the trajectory in a fresh sandbox holding the replayed steps before
        ``at_step``; the old sandbox is stopped."""
        before = state.generation
        async with state.fork_lock:
            if state.generation != before:  # another call forked meanwhile
                edge = self.router.owner(state.sandbox_id)
                return edge.info(edge.get_row(state.sandbox_id)), []
            pending = [f.done for (g, s), f in state.flights.items() if g == before and s < at_step]
            await asyncio.gather(*map(asyncio.shield, pending), return_exceptions=True)
            restored = self._restorable(state.id, before, at_step - 1)
            rows = self.log.steps(state.id, before, after=restored[0] if restored else 0,
                                  upto=at_step - 1)
            info = await self.router.place(CreateRequest(**_start_from(state.request, restored)))
            new_edge = self.router.owner(info.id)
            try:
                diffs = await replay_rows(self.log, new_edge, info.id, rows)
                state.generation = self.log.fork(
                    state.id, before, at_step, info.id, info.image, info.image_digest, reason,
                    [d.step for d in diffs if not d.same])
            except BaseException:
                await new_edge.stop(info.id, reason=f"fork of trajectory {state.id} failed")
                raise
            state.head = at_step - 1
            state.last_checkpoint = restored and restored[1]
            old, state.sandbox_id = state.sandbox_id, info.id
            log.info("trajectory %s forked at step %d: %s -> %s", state.id, at_step, old, info.id)
            try:
                await self.router.owner(old).stop(
                    old, reason=f"trajectory {state.id} forked at step {at_step} into {info.id}")
            except (SandboxDied, SandboxNotFound):
                pass  # it had already ended
            return info, diffs


def _recorded(op: Operation) -> Callable[..., Any]:
    """The RecordedEdge's method for ``op``: a trajectory step is answered by the recorder
    (logged, fast-forwarded); any other operation is the edge's own."""
    if op.step is None and op.kind == "stream":
        def passed(self: RecordedEdge, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            return getattr(self._edge, op.method)(*args, **kwargs)
        return passed
    if op.step is None:
        async def direct(self: RecordedEdge, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self._edge, op.method)(*args, **kwargs)
        return direct
    if op.kind == "stream":
        def stream(self: RecordedEdge, sandbox_id: str, *args: Any,
                   **kwargs: Any) -> AsyncIterator[Output | ExecResult]:
            return self._recorder.stream(self.trajectory, self.call,
                                         step_request(op, bind(op, args, kwargs)))
        return stream

    async def call(self: RecordedEdge, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return await self._recorder.call(self.trajectory, self.call,
                                         step_request(op, bind(op, args, kwargs)))
    return call


@derive_operations(_recorded)
class RecordedEdge:
    """An edge as seen by a call on an attached sandbox: every operation of the table
    (``dsec.protocol.ops``), those that are trajectory steps answered by the recorder in the
    trajectory's current sandbox, the others (stop, ttl, network) the edge's own. There is
    no fallback to the edge: an operation missing from the table is missing here."""

    def __init__(self, recorder: Recorder, edge: Edge, trajectory: str, call: Call) -> None:
        self._recorder = recorder
        self._edge = edge
        self.trajectory = trajectory
        self.call = call

    if TYPE_CHECKING:  # the table's methods, made when the class is (mypy cannot see them)
        def __getattr__(self, name: str) -> Any: ...

    # what routes read of a sandbox's record
    def info(self, row: SandboxRow) -> SandboxInfo:
        return self._edge.info(row)

    def get_row(self, sandbox_id: str) -> SandboxRow:
        return self._edge.get_row(sandbox_id)


def _output_then(flight: Flight, last: list[Output | ExecResult]) -> Callable[[Output | ExecResult], None]:
    """A stream's events to its flight as they come, but its result into ``last``."""
    def on_event(event: Output | ExecResult) -> None:
        if isinstance(event, Output):
            flight.push(event)
        else:
            last.append(event)
    return on_event


def _start_from(request: dict[str, Any], checkpoint: tuple[int, str] | None) -> dict[str, Any]:
    """A trajectory's create request, started from ``checkpoint``'s snapshot if there is one
    (else from what the trajectory itself started from)."""
    return request if checkpoint is None else {**request, "snapshot": checkpoint[1]}


def _brief(request: dict[str, Any]) -> str:
    params = request["params"]
    what = params.get("command", params.get("path", params.get("process", "")))
    return f"{request['op']} {str(what)[:80]!r}"
