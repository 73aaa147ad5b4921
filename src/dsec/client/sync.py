"""The blocking facade: the same classes, methods and signatures as the async SDK
(``dsec.AsyncClient``), for scripts and for code that is not async. One background thread runs
the event loop for a client and everything made from it.

Every method is written out with its signature and docstring, so an IDE and mypy see them;
tests/unit/test_operations.py checks that each class here has exactly its async twin's public
methods, with the same signatures.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import threading
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
)
from dataclasses import dataclass
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    TypeVar,
)

from ..protocol import archive
from ..protocol.build import ImageBuilt
from ..protocol.errors import DSecError
from ..protocol.fn import DEFAULT_IMAGE, CodeResult, Language
from ..protocol.gc_models import GcReport
from ..protocol.models import (
    FileEntry,
    ProcessInfo,
    SandboxInfo,
    Snapshot,
    StepDiff,
    StepRecord,
    TrajectoryInfo,
)
from . import aio
from .aio import CommandResult, CreateOptions, OutputChunk
from .build import Context as BuildContext
from .projects import SyncProjects
from .trajectory import Checkpoint, OnDivergence

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")
V = TypeVar("V")


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


class OutputStream:
    """Iterate for output chunks as they arrive; ``result`` holds the outcome afterwards."""

    def __init__(self, loop: _Loop, stream: aio.OutputStream) -> None:
        self._loop, self._async = loop, stream

    def __iter__(self) -> Iterator[OutputChunk]:
        return self._loop.iterate(self._async)

    @property
    def result(self) -> CommandResult | None:
        """The finished command (None until the stream has ended)."""
        return self._async.result

    def wait(self) -> CommandResult:
        """Read the stream to its end; the finished command."""
        return self._loop.call(self._async.wait())


class Process:
    """A command started in the background; its output is kept so it can be read again."""

    def __init__(self, loop: _Loop, process: aio.Process) -> None:
        self._loop, self._async = loop, process
        self.id, self.pid, self.command = process.id, process.pid, process.command

    def stream(self) -> OutputStream:
        """Everything the process printed from its start, then live output until it ends."""
        return OutputStream(self._loop, self._async.stream())

    def wait(self) -> CommandResult:
        """Wait for the process to end; its whole output and exit."""
        return self._loop.call(self._async.wait())

    def signal(self, sig: int) -> None:
        """Send signal ``sig`` to the process."""
        self._loop.call(self._async.signal(sig))

    def kill(self) -> None:
        """SIGKILL the process."""
        self._loop.call(self._async.kill())

    def send_stdin(self, data: bytes | str) -> None:
        """Write to the process's stdin (started with ``stdin_open=True``) or terminal; see
        ``AsyncProcess.send_stdin`` for the bounds (``StdinFull``, ``StdinClosed``)."""
        self._loop.call(self._async.send_stdin(data))

    def close_stdin(self) -> None:
        """Close the process's stdin (EOF) once the input already sent is written."""
        self._loop.call(self._async.close_stdin())


class Pty(Process):
    """A command on a pseudo-terminal (``Sandbox.pty``): ``send_stdin`` types, ``stream``
    gives the terminal's output, ``resize``, ``wait``, ``kill``."""

    def __init__(self, loop: _Loop, pty: aio.Pty) -> None:
        super().__init__(loop, pty)
        self._pty = pty

    def resize(self, cols: int, rows: int) -> None:
        """The terminal's new size; its foreground programs get SIGWINCH."""
        self._loop.call(self._pty.resize(cols, rows))


class Session:
    """A named shell session: cwd and exported environment persist between its commands."""

    def __init__(self, loop: _Loop, session: aio.Session) -> None:
        self._loop, self._async = loop, session

    def run(self, command: str | list[str], *, cwd: str | None = None,
            stdin: bytes | str | None = None, timeout_s: float | None = 60.0,
            max_output_bytes: int | None = None) -> CommandResult:
        """``Sandbox.run`` in this session (its environment is the session's)."""
        return self._loop.call(self._async.run(command, cwd=cwd, stdin=stdin, timeout_s=timeout_s,
                                               max_output_bytes=max_output_bytes))

    def stream(self, command: str | list[str], *, cwd: str | None = None,
               stdin: bytes | str | None = None, timeout_s: float | None = 60.0,
               max_output_bytes: int | None = None) -> OutputStream:
        """``Sandbox.stream`` in this session."""
        return OutputStream(self._loop, self._async.stream(
            command, cwd=cwd, stdin=stdin, timeout_s=timeout_s, max_output_bytes=max_output_bytes))


class Sandbox:
    """A sandbox (blocking twin of ``dsec.AsyncSandbox``). Attached to a trajectory, each call
    is numbered (``next_step``), logged by the server, and answered from the log when it
    repeats the logged call at its step (``fast_forwarded`` counts those)."""

    def __init__(self, loop: _Loop, sandbox: aio.Sandbox) -> None:
        self._loop, self._async = loop, sandbox

    @property
    def id(self) -> str:
        """The sandbox id (changes when its trajectory forks into a new sandbox)."""
        return self._async.id

    @property
    def info(self) -> SandboxInfo:
        return self._async.info

    @property
    def trajectory(self) -> str | None:
        return self._async.trajectory

    @property
    def next_step(self) -> int | None:
        """The step number the next call gets (None when not attached)."""
        return self._async.next_step

    @property
    def fast_forwarded(self) -> int:
        """Calls of this handle answered from the trajectory log instead of executed."""
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

    # commands
    def run(self, command: str | list[str], *, env: dict[str, str] | None = None,
            cwd: str | None = None, stdin: bytes | str | None = None,
            timeout_s: float | None = 60.0, max_output_bytes: int | None = None,
            session: str | None = None) -> CommandResult:
        """Run a command to completion. A string runs under dsec's ``/.dsec/bin/sh -c``; a list
        is an argv. Raises ``CommandTimeout`` (with ``.result`` holding partial output) on timeout."""
        return self._loop.call(self._async.run(
            command, env=env, cwd=cwd, stdin=stdin, timeout_s=timeout_s,
            max_output_bytes=max_output_bytes, session=session))

    def stream(self, command: str | list[str], *, env: dict[str, str] | None = None,
               cwd: str | None = None, stdin: bytes | str | None = None,
               timeout_s: float | None = 60.0, max_output_bytes: int | None = None,
               session: str | None = None) -> OutputStream:
        """Run a command and iterate over its output as it arrives."""
        return OutputStream(self._loop, self._async.stream(
            command, env=env, cwd=cwd, stdin=stdin, timeout_s=timeout_s,
            max_output_bytes=max_output_bytes, session=session))

    def start(self, command: str | list[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None, stdin: bytes | str | None = None,
              timeout_s: float | None = None, max_output_bytes: int | None = None,
              stdin_open: bool = False) -> Process:
        """Start a command in the background and return at once. With ``stdin_open`` its
        stdin stays open (after ``stdin``) for ``Process.send_stdin`` until ``close_stdin``."""
        return Process(self._loop, self._loop.call(self._async.start(
            command, env=env, cwd=cwd, stdin=stdin, timeout_s=timeout_s,
            max_output_bytes=max_output_bytes, stdin_open=stdin_open)))

    def pty(self, cols: int = 80, rows: int = 24, command: str | list[str] = "bash", *,
            env: dict[str, str] | None = None, cwd: str | None = None,
            timeout_s: float | None = None, max_output_bytes: int | None = None) -> Pty:
        """Start ``command`` on a new pseudo-terminal of ``cols`` x ``rows``."""
        return Pty(self._loop, self._loop.call(self._async.pty(
            cols, rows, command, env=env, cwd=cwd, timeout_s=timeout_s,
            max_output_bytes=max_output_bytes)))

    def processes(self) -> builtins.list[ProcessInfo]:
        """The sandbox's background processes, running and ended."""
        return self._loop.call(self._async.processes())

    def process(self, process_id: str) -> Process:
        """A background process (a ``Pty`` for a terminal) by id, e.g. after a reconnect."""
        found = self._loop.call(self._async.process(process_id))
        return Pty(self._loop, found) if isinstance(found, aio.Pty) else Process(self._loop, found)

    def session(self, name: str) -> Session:
        """A named shell session: cwd and exported environment persist between its commands."""
        return Session(self._loop, self._async.session(name))

    # files
    def url(self, port: int) -> str:
        """The URL of ``port`` inside the sandbox with a token for it (see the async twin)."""
        return self._loop.call(self._async.url(port))

    def read_file(self, path: str) -> bytes:
        """The file's bytes (``FileNotFound`` if there is none)."""
        return self._loop.call(self._async.read_file(path))

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644,
                   append: bool = False) -> None:
        """Write (or with ``append``, add to) a file; text is written as UTF-8."""
        self._loop.call(self._async.write_file(path, data, mode=mode, append=append))

    def list_files(self, path: str = "/work") -> builtins.list[FileEntry]:
        """The entries of a directory."""
        return self._loop.call(self._async.list_files(path))

    def stat(self, path: str) -> FileEntry:
        """A file's type, size, mode and mtime (``FileNotFound`` if there is none)."""
        return self._loop.call(self._async.stat(path))

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists in the sandbox."""
        return self._loop.call(self._async.exists(path))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or with ``recursive`` a directory tree."""
        self._loop.call(self._async.remove(path, recursive=recursive))

    def mkdir(self, path: str, *, parents: bool = True) -> None:
        """Make a directory (and its parents, unless ``parents=False``)."""
        self._loop.call(self._async.mkdir(path, parents=parents))

    def upload(self, local: str | Path, remote_dir: str) -> None:
        """Copy a local file or directory into ``remote_dir`` (created if missing) as one tar."""
        self._loop.call(self._async.upload(local, remote_dir))

    def download(self, remote_dir: str, local_dir: str | Path, *,
                 max_bytes: int = archive.DEFAULT_MAX_BYTES,
                 max_members: int = archive.DEFAULT_MAX_MEMBERS) -> None:
        """Copy the contents of ``remote_dir`` into ``local_dir``, member by member under it
        only (``UnsafeArchive`` otherwise, or past ``max_bytes``/``max_members``)."""
        self._loop.call(self._async.download(remote_dir, local_dir, max_bytes=max_bytes,
                                             max_members=max_members))

    # state
    def snapshot(self, mode: str = "filesystem", previous: Snapshot | str | None = None,
                 ttl_s: int | None = None) -> Snapshot:
        """A copy of the sandbox's file system, kept until ``delete_snapshot`` or its
        ``ttl_s`` ends: ``create(snapshot=snap.id)`` starts sandboxes from it; ``previous`` is
        the answer if nothing was written since it; ``mode="full"``: memory and processes
        too, VMs only (see ``AsyncSandbox.snapshot``)."""
        return self._loop.call(self._async.snapshot(mode, previous, ttl_s))

    def rollback(self, snapshot: Snapshot | str) -> SandboxInfo:
        """This sandbox back at one of its own snapshots (see ``AsyncSandbox.rollback``)."""
        return self._loop.call(self._async.rollback(snapshot))

    def fork(self, n: int, *, mode: str = "filesystem", concurrency: int = 32,
             keep_snapshot: bool = False,
             **options: Unpack[CreateOptions]) -> builtins.list[Sandbox | DSecError]:
        """``n`` new sandboxes starting from this one's file system now (``mode="full"``: and
        its processes), each with this one's limits and network unless ``options`` give
        others: one entry per child in order, the Sandbox or the typed error that stopped it
        (see ``AsyncSandbox.fork``)."""
        made = self._loop.call(self._async.fork(n, mode=mode, concurrency=concurrency,
                                                keep_snapshot=keep_snapshot, **options))
        return [Sandbox(self._loop, s) if isinstance(s, aio.Sandbox) else s for s in made]

    # lifecycle
    def refresh(self) -> SandboxInfo:
        """The sandbox's record, read again."""
        return self._loop.call(self._async.refresh())

    def set_ttl(self, ttl_s: int) -> SandboxInfo:
        """Stop the sandbox ``ttl_s`` seconds from now (instead of when it was due)."""
        return self._loop.call(self._async.set_ttl(ttl_s))

    def pause(self) -> SandboxInfo:
        """Freeze every process of the sandbox: it uses no CPU until resumed. Any later call
        on it resumes it first; the TTL keeps running."""
        return self._loop.call(self._async.pause())

    def resume(self) -> SandboxInfo:
        """Let a paused sandbox run again (a no-op if it runs)."""
        return self._loop.call(self._async.resume())

    def set_network(self, network: Any) -> SandboxInfo:
        """Replace the sandbox's egress policy while it runs: ``"none"`` or a policy such as
        ``{"pypi": True, "allow": ["10.1.2.3:443"]}``. Atomic: on error the previous stays."""
        return self._loop.call(self._async.set_network(network))

    def stop(self) -> None:
        """Stop the sandbox and remove everything it had."""
        self._loop.call(self._async.stop())


@dataclass
class Replay:
    """What a replay found (blocking twin of ``dsec.AsyncReplay``): one ``StepDiff`` per
    replayed step, and the sandbox it ran in (yours to stop)."""

    trajectory: str
    generation: int
    sandbox: Sandbox
    steps: builtins.list[StepDiff]
    attached_generation: int | None = None
    restored_step: int | None = None

    @property
    def differences(self) -> builtins.list[StepDiff]:
        return [s for s in self.steps if not s.same]

    @property
    def first_difference(self) -> StepDiff | None:
        return next((s for s in self.steps if not s.same), None)


class Client:
    """The entry point of the blocking SDK (twin of ``dsec.AsyncClient``). With no arguments
    it uses this host's local dsec server."""

    def __init__(self, url: str | None = None, api_key: str | None = None, *,
                 timeout_s: float = 600.0, autostart: bool = True, retry_s: float = 30.0) -> None:
        """``retry_s``: how long a call of an attached sandbox is retried (same step) while
        the server cannot be reached."""
        self._loop = _Loop()
        self._async = self._loop.call(_make_client(url, api_key, timeout_s, autostart, retry_s))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections and stop the client's event-loop thread."""
        self._loop.call(self._async.aclose())
        self._loop.close()

    def _sandbox(self, sandbox: aio.Sandbox) -> Sandbox:
        return Sandbox(self._loop, sandbox)

    def create(self, substrate: str = "container", image: str = "debian-minbase", *,
               cpu: float | None = None, memory_mb: int | None = None,
               pids: int | None = None, disk_mb: int | None = None,
               ttl_s: int | None = None, network: Any = None,
               env: dict[str, str] | None = None, runtime: str | None = None,
               labels: dict[str, str] | None = None, trajectory: str | None = None,
               on_divergence: OnDivergence = "raise",
               idempotency_key: str | None = None, snapshot: str | None = None,
               checkpoint: Checkpoint | None = None,
               trajectory_ttl_s: int | None = None) -> Sandbox:
        """Start a sandbox of ``image`` on ``substrate``; options left None take the server's
        defaults (see ``AsyncClient.create``). With ``trajectory``, every call is logged under
        that new trajectory id (snapshotted after each step with ``checkpoint``; deleted
        ``trajectory_ttl_s`` after its creation, if given). With ``snapshot``, it starts from
        that file system, with its parent's limits and network for options left None. Retried
        under one ``Idempotency-Key`` while the server cannot be reached: never a second sandbox."""
        return self._sandbox(self._loop.call(self._async.create(
            substrate, image, cpu=cpu, memory_mb=memory_mb, pids=pids, disk_mb=disk_mb,
            ttl_s=ttl_s, network=network, env=env, runtime=runtime, labels=labels,
            trajectory=trajectory, on_divergence=on_divergence, idempotency_key=idempotency_key,
            snapshot=snapshot, checkpoint=checkpoint, trajectory_ttl_s=trajectory_ttl_s)))

    def create_many(self, n: int, *, concurrency: int = 32,
                    idempotency_key: str | None = None,
                    **options: Unpack[CreateOptions]) -> builtins.list[Sandbox | DSecError]:
        """Start ``n`` sandboxes, at most ``concurrency`` at a time: one entry per sandbox in
        order, the Sandbox or the typed error that stopped it."""
        made = self._loop.call(self._async.create_many(
            n, concurrency=concurrency, idempotency_key=idempotency_key, **options))
        return [self._sandbox(s) if isinstance(s, aio.Sandbox) else s for s in made]

    def snapshots(self) -> builtins.list[Snapshot]:
        """The snapshots your key may see (those of your project's sandboxes)."""
        return self._loop.call(self._async.snapshots())

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot and its files (sandboxes started from it keep running)."""
        self._loop.call(self._async.delete_snapshot(snapshot_id))

    def resume(self, trajectory: str, *, on_divergence: OnDivergence = "raise",
               prefetch: bool = True) -> Sandbox:
        """The sandbox of a trajectory, attached from step 1: re-issued logged calls are
        answered from the log (fast-forward), the first new one runs."""
        return self._sandbox(self._loop.call(self._async.resume(
            trajectory, on_divergence=on_divergence, prefetch=prefetch)))

    def replay(self, trajectory: str, into: str = "new", *, upto: int | None = None,
               generation: int | None = None, attach: bool = False,
               on_divergence: OnDivergence = "raise", restore: bool = True) -> Replay:
        """Re-execute a trajectory's logged calls into a fresh sandbox and report step by
        step where the results differ; with ``attach`` the trajectory goes on there. From
        the newest checkpoint at or before ``upto`` unless ``restore=False``."""
        done = self._loop.call(self._async.replay(trajectory, into, upto=upto, generation=generation,
                                                  attach=attach, on_divergence=on_divergence,
                                                  restore=restore))
        return Replay(done.trajectory, done.generation, self._sandbox(done.sandbox),
                      done.steps, done.attached_generation, done.restored_step)

    def delete_trajectory(self, trajectory: str) -> None:
        """Forget a trajectory, its sandbox and its checkpoints (see
        ``AsyncClient.delete_trajectory``)."""
        self._loop.call(self._async.delete_trajectory(trajectory))

    def fork_trajectory(self, trajectory: str, at_step: int, n: int = 1, *,
                        on_divergence: OnDivergence = "raise") -> builtins.list[Sandbox]:
        """``n`` new sandboxes from the checkpoint of step ``at_step``, each on a new
        trajectory holding the steps up to it: nothing re-executed (see
        ``AsyncClient.fork_trajectory``)."""
        return [self._sandbox(s) for s in self._loop.call(self._async.fork_trajectory(
            trajectory, at_step, n, on_divergence=on_divergence))]

    def trajectory(self, trajectory: str) -> TrajectoryInfo:
        """A trajectory's record: its sandbox, generations and logged steps."""
        return self._loop.call(self._async.trajectory(trajectory))

    def trajectories(self, limit: int = 100) -> builtins.list[TrajectoryInfo]:
        """The most recently created trajectories."""
        return self._loop.call(self._async.trajectories(limit))

    def trajectory_steps(self, trajectory: str,
                         generation: int | None = None) -> builtins.list[StepRecord]:
        """Every logged step of a generation (default: the current one), in order."""
        return self._loop.call(self._async.trajectory_steps(trajectory, generation))

    def export_trajectory(self, trajectory: str) -> Iterator[dict[str, Any]]:
        """The provenance export, one JSON object per line: the trajectory, then its steps."""
        return self._loop.iterate(self._async.export_trajectory(trajectory))

    def get(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox (not attached to its trajectory)."""
        return self._sandbox(self._loop.call(self._async.get(sandbox_id)))

    def list(self) -> builtins.list[SandboxInfo]:
        """The live sandboxes the client's key may see."""
        return self._loop.call(self._async.list())

    def health(self) -> dict[str, Any]:
        """The server's health and its edges."""
        return self._loop.call(self._async.health())

    def endpoint(self) -> tuple[str, str]:
        """The server's URL and the API key in use (``AsyncClient.endpoint``)."""
        return self._loop.call(self._async.endpoint())

    def projects(self) -> SyncProjects:
        """Projects, quotas and project keys (see docs/PROJECTS.md)."""
        return SyncProjects(self._loop.call, self._async.projects())

    def gc(self, dry_run: bool = False) -> GcReport:
        """Collect garbage now (admin key); see ``AsyncClient.gc``."""
        return self._loop.call(self._async.gc(dry_run))

    # fn substrate
    def call(self, fn: Callable[..., V], *args: Any, substrate: str = "fn",
             image: str = DEFAULT_IMAGE, timeout_s: float = 60.0,
             kwargs: dict[str, Any] | None = None, trusted_result: bool = False) -> V:
        """``fn(*args, **kwargs)`` in a fresh jailed worker of ``image``; its return value,
        which must be plain data unless ``trusted_result`` (see ``AsyncClient.call``)."""
        return self._loop.call(self._async.call(fn, *args, substrate=substrate, image=image,
                                                timeout_s=timeout_s, kwargs=kwargs,
                                                trusted_result=trusted_result))

    def run_code(self, language: Language, code: str, *, stdin: str = "",
                 image: str = DEFAULT_IMAGE, timeout_s: float = 10.0,
                 max_output_bytes: int | None = None,
                 substrate: str = "fn") -> CodeResult:
        """Run a python, bash, c or cpp program with ``stdin``; a time-out is
        ``result.timed_out``."""
        return self._loop.call(self._async.run_code(
            language, code, stdin=stdin, image=image, timeout_s=timeout_s,
            max_output_bytes=max_output_bytes, substrate=substrate))

    def build_image(self, name: str, context: BuildContext = None, *,
                    dockerfile: str | os.PathLike[str] | None = None,
                    build_args: dict[str, str] | None = None, network: Any = "none",
                    disk_mb: int = 4096, memory_mb: int = 2048, cpu: float = 1.0,
                    on_log: Callable[[str], Any] | None = None) -> ImageBuilt:
        """Build a Dockerfile on the server (see ``AsyncClient.build_image``); ``on_log`` is
        called from the client's event loop thread."""
        return self._loop.call(self._async.build_image(
            name, context, dockerfile=dockerfile, build_args=build_args, network=network,
            disk_mb=disk_mb, memory_mb=memory_mb, cpu=cpu, on_log=on_log))

    def map(self, fn: Callable[..., V], items: Iterable[Any], *, concurrency: int = 16,
            substrate: str = "fn", image: str = DEFAULT_IMAGE,
            timeout_s: float = 60.0, return_exceptions: bool = False,
            trusted_result: bool = False) -> builtins.list[Any]:
        """``[fn(item) for item in items]``, each in its own worker, ``concurrency`` at a
        time, in order; with ``return_exceptions`` a failed item is its typed error."""
        return self._loop.call(self._async.map(
            fn, items, concurrency=concurrency, substrate=substrate, image=image,
            timeout_s=timeout_s, return_exceptions=return_exceptions,
            trusted_result=trusted_result))


async def _make_client(url: str | None, api_key: str | None, timeout_s: float, autostart: bool,
                       retry_s: float) -> aio.AsyncClient:
    """The async client is made on the loop thread, so its connections belong to that loop."""
    return aio.AsyncClient(url, api_key, timeout_s=timeout_s, autostart=autostart, retry_s=retry_s)


__all__ = ["Client", "Sandbox", "Process", "Session", "OutputStream", "Replay", "CommandResult",
           "FileEntry", "ProcessInfo", "SandboxInfo"]
