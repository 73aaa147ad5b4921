"""The blocking facade: the same classes and method names as the async SDK, for scripts and
for code that is not async. One background thread runs the event loop for a client and
everything made from it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Coroutine, Iterator, TypeVar

from . import aio
from .aio import CommandResult, OutputChunk
from .errors import DSecError
from .models import FileEntry, ProcessInfo, SandboxInfo

T = TypeVar("T")


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dsec-sync", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, stream: aio.OutputStream) -> Iterator[OutputChunk]:
        chunks = aiter(stream)
        while True:
            try:
                yield self.call(anext(chunks))
            except StopAsyncIteration:
                return

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


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
        self.id = sandbox.id

    @property
    def info(self) -> SandboxInfo:
        return self._async.info

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

    list = _blocking("list")
    health = _blocking("health")


async def _make_client(url: str | None, api_key: str | None, kwargs: dict[str, Any]) -> aio.DSecClient:
    """The async client is made on the loop thread, so its connections belong to that loop."""
    return aio.DSecClient(url, api_key, **kwargs)


__all__ = ["Client", "Sandbox", "Process", "OutputStream", "CommandResult", "FileEntry",
           "ProcessInfo", "SandboxInfo"]
