"""The blocking facade: the same classes and method names as the async SDK, for scripts and
for code that is not async. One background thread runs the event loop for a client and
everything made from it."""

from __future__ import annotations

import asyncio
import builtins
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterable, AsyncIterator, Callable, Coroutine, Iterator, TypeVar

from . import aio
from .aio import CommandResult, OutputChunk
from .errors import DSecError
from .models import FileEntry, ProcessInfo, SandboxInfo, StepDiff, StepRecord
from .projects import SyncProjects

T = TypeVar("T")


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dsec-sync", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, stream: AsyncIterable[T]) -> Iterator[T]:
        chunks = aiter(stream)
        while True:
            try:
                yield self.call(_next(chunks))
            except StopAsyncIteration:
                return

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _next(chunks: AsyncIterator[T]) -> T:
    """The next item, from a coroutine: the loop runs coroutines, and ``anext`` only promises
    an awaitable."""
    return await anext(chunks)


def _blocking(name: str) -> Callable[..., Any]:
    """A method that runs the wrapped async object's method of the same name to completion."""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._loop.call(getattr(self._async, name)(*args, **kwargs))
    method.__name__ = name
    method.__doc__ = getattr(getattr(aio.Sandbox, name, None) or getattr(aio.DSecClient, name, None)
                             or getattr(aio.Process, name), "__doc__", None)
    return method


class OutputStream:
    def __init__(self, loop: _Loop, stream: aio.OutputStream) -> None:
        self._loop, self._async = loop, stream

    def __iter__(self) -> Iterator[OutputChunk]:
        return self._loop.iterate(self._async)

    @property
    def result(self) -> CommandResult | None:
        return self._async.result

    wait = _blocking("wait")


class Process:
    def __init__(self, loop: _Loop, process: aio.Process) -> None:
        self._loop, self._async = loop, process
        self.id, self.pid, self.command = process.id, process.pid, process.command

    def stream(self) -> OutputStream:
        return OutputStream(self._loop, self._async.stream())

    wait = _blocking("wait")
    signal = _blocking("signal")
    kill = _blocking("kill")


class Sandbox:
    def __init__(self, loop: _Loop, sandbox: aio.Sandbox) -> None:
        self._loop, self._async = loop, sandbox

    @property
    def id(self) -> str:  # changes when its trajectory forks into a new sandbox
        return self._async.id

    @property
    def info(self) -> SandboxInfo:
        return self._async.info

    @property
    def trajectory(self) -> str | None:
        return self._async.trajectory

    @property
    def next_step(self) -> int | None:
        return self._async.next_step

    @property
    def fast_forwarded(self) -> int:
        return self._async.fast_forwarded

    @property
    def generation(self) -> int | None:
        return self._async.generation

    def __repr__(self) -> str:
        return repr(self._async)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stream(self, command: str | list[str], **kwargs: Any) -> OutputStream:
        return OutputStream(self._loop, self._async.stream(command, **kwargs))

    def start(self, command: str | list[str], **kwargs: Any) -> Process:
        return Process(self._loop, self._loop.call(self._async.start(command, **kwargs)))

    run = _blocking("run")
    processes = _blocking("processes")
    read_file = _blocking("read_file")
    write_file = _blocking("write_file")
    list_files = _blocking("list_files")
    stat = _blocking("stat")
    exists = _blocking("exists")
    remove = _blocking("remove")
    mkdir = _blocking("mkdir")
    upload = _blocking("upload")
    download = _blocking("download")
    refresh = _blocking("refresh")
    set_ttl = _blocking("set_ttl")
    set_network = _blocking("set_network")
    stop = _blocking("stop")


class Client:
    """Blocking twin of ``DSecClient``."""

    def __init__(self, url: str | None = None, api_key: str | None = None, **kwargs: Any) -> None:
        self._loop = _Loop()
        self._async = self._loop.call(_make_client(url, api_key, kwargs))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._loop.call(self._async.aclose())
        self._loop.close()

    def create(self, substrate: str = "container", image: str = "debian-minbase",
               **options: Any) -> Sandbox:
        return Sandbox(self._loop, self._loop.call(self._async.create(substrate, image, **options)))

    def create_many(self, n: int, **options: Any) -> list[Sandbox | DSecError]:
        made = self._loop.call(self._async.create_many(n, **options))
        return [Sandbox(self._loop, s) if isinstance(s, aio.Sandbox) else s for s in made]

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self._loop, self._loop.call(self._async.get(sandbox_id)))

    def resume(self, trajectory: str, **kwargs: Any) -> Sandbox:
        return Sandbox(self._loop, self._loop.call(self._async.resume(trajectory, **kwargs)))

    def replay(self, trajectory: str, into: str = "new", **kwargs: Any) -> Replay:
        done = self._loop.call(self._async.replay(trajectory, into, **kwargs))
        return Replay(done.trajectory, done.generation, Sandbox(self._loop, done.sandbox),
                      done.steps, done.attached_generation)

    def trajectory_steps(self, trajectory: str,
                         generation: int | None = None) -> builtins.list[StepRecord]:
        return self._loop.call(self._async.trajectory_steps(trajectory, generation))

    def export_trajectory(self, trajectory: str) -> Iterator[dict[str, Any]]:
        return self._loop.iterate(self._async.export_trajectory(trajectory))

    def projects(self) -> SyncProjects:
        return SyncProjects(self._loop.call, self._async.projects())

    list = _blocking("list")
    health = _blocking("health")
    call = _blocking("call")
    run_code = _blocking("run_code")
    map = _blocking("map")
    trajectory = _blocking("trajectory")
    trajectories = _blocking("trajectories")


@dataclass
class Replay:
    """Blocking twin of ``dsec.AsyncReplay``: ``steps``, ``differences``, ``sandbox``."""

    trajectory: str
    generation: int
    sandbox: Sandbox
    steps: builtins.list[StepDiff]
    attached_generation: int | None = None

    @property
    def differences(self) -> builtins.list[StepDiff]:
        return [s for s in self.steps if not s.same]

    @property
    def first_difference(self) -> StepDiff | None:
        return next((s for s in self.steps if not s.same), None)


async def _make_client(url: str | None, api_key: str | None, kwargs: dict[str, Any]) -> aio.DSecClient:
    """The async client is made on the loop thread, so its connections belong to that loop."""
    return aio.DSecClient(url, api_key, **kwargs)


__all__ = ["Client", "Sandbox", "Process", "OutputStream", "Replay", "CommandResult",
           "FileEntry", "ProcessInfo", "SandboxInfo"]
