"""An edge on another node as the API routes see it: the operations of ``Edge`` (the table in
``dsec.protocol.ops``), each a call to that node's edge actor; reads of a sandbox's record go
to the shared state store.

A call never outlives its node: it races the member's ``dead`` event (set when Ray's health
checks declare the node dead), and an actor that died answers ``SandboxDied``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ActorUnschedulableError,
    RayTaskError,
)

from ..edge.edge import sandbox_info
from ..protocol.build import BuildLog, ImageBuildRequest, ImageBuilt
from ..protocol.errors import DSecError, SandboxDied, SandboxError, SandboxNotFound
from ..protocol.fn import CodeResult, RunCodeRequest
from ..protocol.models import CreateRequest, SandboxInfo
from ..protocol.ops import Operation, derive_operations
from ..store.sqlite import LIVE_STATES, SandboxRow, StateStore
from .members import Member

UNAVAILABLE_GRACE_S = 30.0  # an unreachable actor: how long to wait for Ray's verdict on its node
# A stream's events the node's actor may produce ahead of the API replica: without a bound a
# sandbox's output (a flooding port's answer, up to 1 GiB) would pile up in the object store
# as fast as the sandbox makes it, whatever the client reads.
STREAM_AHEAD = 16


def _unwrap(exc: BaseException) -> BaseException:
    """The typed error an edge raised, out of Ray's wrapper."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, DSecError):
        return exc.cause
    return exc


def _forwarded(op: Operation) -> Callable[..., Any]:
    """RemoteEdge's method for ``op``: a call or a stream of the node's edge actor."""
    if op.kind == "stream":
        def stream(self: RemoteEdge, sandbox_id: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            return self._stream(op.method, sandbox_id, *args, **kwargs)
        return stream

    async def call(self: RemoteEdge, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return await self._call(op.method, sandbox_id, *args, **kwargs)
    return call


@derive_operations(_forwarded)
class RemoteEdge:
    """Every operation of the table (``dsec.protocol.ops``) forwarded to the node's edge
    actor, but ``create`` (no sandbox yet) and ``set_ttl`` (kept in the shared store), which
    are written out below."""

    def __init__(self, member: Member, store: StateStore,
                 on_dead: Callable[[str, str], None]) -> None:
        """``on_dead(edge, reason)``: called when a call finds the edge's actor gone for good."""
        self.member = member
        self.id = member.edge
        self.store = store
        self.on_dead = on_dead

    if TYPE_CHECKING:  # the table's methods, made when the class is (mypy cannot see them)
        def __getattr__(self, name: str) -> Any: ...

    # what the routes read from the shared state store
    info = staticmethod(sandbox_info)

    def get_row(self, sandbox_id: str) -> SandboxRow:
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.edge != self.id:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
        return row

    def trajectory_of(self, sandbox_id: str) -> str | None:
        row = self.store.get_sandbox(sandbox_id)
        return row.request.get("trajectory") if row is not None and row.edge == self.id else None

    def require_live(self, sandbox_id: str) -> None:
        row = self.get_row(sandbox_id)
        if row.state in ("died", "expired") or self.member.dead.is_set():
            raise self._died(sandbox_id, row.reason)
        if row.state not in LIVE_STATES:
            raise SandboxNotFound(f"sandbox {sandbox_id} was {row.state}", sandbox_id=sandbox_id,
                                  state=row.state)

    async def set_ttl(self, sandbox_id: str, ttl_s: int) -> SandboxInfo:
        """Recorded in the store now; the edge's reaper learns it by a call sent in order."""
        self.require_live(sandbox_id)
        self.member.handle.call.remote("set_ttl", sandbox_id, ttl_s)
        row = self.get_row(sandbox_id)
        row.expires_at = time.time() + ttl_s
        self.store.set_expiry(sandbox_id, row.expires_at)
        return sandbox_info(row)

    def list(self) -> list[SandboxInfo]:
        return [sandbox_info(row) for row in self.store.sandboxes(edge=self.id, live_only=True)]

    # calls into the node
    def _died(self, sandbox_id: str, reason: str | None = None) -> SandboxDied:
        reason = reason or f"the node of edge {self.id} died"
        return SandboxDied(f"sandbox {sandbox_id} died: {reason}", sandbox_id=sandbox_id,
                           reason=reason)

    async def _guarded(self, sandbox_id: str, work: Awaitable[Any]) -> Any:
        """``work``, or SandboxDied as soon as the node is declared dead."""
        if self.member.dead.is_set():
            raise self._died(sandbox_id)
        task = asyncio.ensure_future(work)
        dead = asyncio.ensure_future(self.member.dead.wait())
        try:
            await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        if not task.done():
            task.cancel()
            raise self._died(sandbox_id)
        try:
            return task.result()
        except (ActorDiedError, ActorUnschedulableError):  # its node is gone (no restart)
            if not self.member.dead.is_set():
                self.member.dead.set()
                self.on_dead(self.id, "its edge actor died with its node")
            raise self._died(sandbox_id) from None
        except ActorUnavailableError:
            return await self._unavailable(sandbox_id)
        except RayTaskError as exc:
            raise _unwrap(exc) from None

    async def _unavailable(self, sandbox_id: str) -> Any:
        """The actor went away under the call: its node died (SandboxDied), or the actor
        crashed and Ray restarted it (the call's outcome is unknown: SandboxError)."""
        failed_at = time.monotonic()
        while time.monotonic() < failed_at + UNAVAILABLE_GRACE_S:
            if self.member.dead.is_set():
                raise self._died(sandbox_id)
            load = self.member.load
            if load is not None and load.healthy and load.asked_at > failed_at:
                break  # the edge answers again
            await asyncio.sleep(0.1)
        raise SandboxError(f"edge {self.id} went away during the call (restarted); the call's "
                           "outcome is unknown", sandbox_id=sandbox_id)

    async def _call(self, method: str, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return await self._guarded(sandbox_id, self._await(method, sandbox_id, *args, **kwargs))

    async def _await(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await self.member.handle.call.remote(method, *args, **kwargs)

    def _stream(self, method: str, sandbox_id: str, *args: Any,
                **kwargs: Any) -> AsyncIterator[Any]:
        return self._events(sandbox_id, method, sandbox_id, *args, **kwargs)

    async def _events(self, label: str, method: str, *args: Any,
                      **kwargs: Any) -> AsyncIterator[Any]:
        """The actor's stream ``method(*args)``; ``label``: what a death is reported of."""
        refs = self.member.handle.stream.options(
            num_returns="streaming", _generator_backpressure_num_objects=STREAM_AHEAD).remote(
            method, *args, **kwargs)
        try:
            while True:
                try:
                    ref = await self._guarded(label, refs.__anext__())
                except StopAsyncIteration:
                    refs = None
                    return
                yield await self._guarded(label, _get(ref))
        finally:
            if refs is not None:  # left early (the client went away): end the actor's side
                with contextlib.suppress(Exception):  # too, or it would wait on STREAM_AHEAD
                    ray.cancel(refs)  # holding what it holds; an actor gone has ended it

    async def create(self, req: CreateRequest) -> SandboxInfo:
        return await self._guarded("(new)", self._await("create", req))

    async def call_fn(self, image: str, payload: bytes, timeout_s: float) -> bytes:
        return await self._guarded("(fn call)", self._await("call_fn", image, payload, timeout_s))

    async def run_code(self, req: RunCodeRequest) -> CodeResult:
        return await self._guarded("(fn call)", self._await("run_code", req))

    async def delete_snapshot(self, snapshot_id: str) -> None:
        return await self._guarded("(snapshot)", self._await("delete_snapshot", snapshot_id))

    def build_image(self, req: ImageBuildRequest,
                    context: bytes) -> AsyncIterator[BuildLog | ImageBuilt]:
        return self._events("(image build)", "build_image", req, context)


async def _get(ref: Any) -> Any:
    return await ref
