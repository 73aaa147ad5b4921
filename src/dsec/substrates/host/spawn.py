"""Starting helper programs (the OCI runtime) on the create path, cheaply.

``os.posix_spawn`` (vfork + exec in glibc) plus a pidfd watched by the event loop: no fork of
the whole server process (the event loop's own subprocess support forks, which costs about
10 ms for a server of this size) and no thread per child.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from ...protocol.errors import NotSupported


def resolve(program: str) -> str:
    """The program's absolute path (posix_spawn does not search PATH)."""
    path = program if os.path.isabs(program) else shutil.which(program)
    if path is None:
        raise NotSupported(f"{program!r} is not installed on this edge")
    return path


class Spawned:
    """A child process; its stdout is a pipe when asked for, stdin is /dev/null. With
    ``idle_priority`` it (and all it starts) only gets CPU time nothing else wants."""

    def __init__(self, argv: list[str], capture_stdout: bool, stderr: Path | None,
                 idle_priority: bool = False) -> None:
        self._out_r = self._out_w = -1
        actions: list[tuple] = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0)]
        if capture_stdout:
            self._out_r, self._out_w = os.pipe2(os.O_CLOEXEC)
            actions.append((os.POSIX_SPAWN_DUP2, self._out_w, 1))
        else:
            actions.append((os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0))
        actions.append((os.POSIX_SPAWN_OPEN, 2, str(stderr or "/dev/null"),
                        os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        argv = [resolve(argv[0]), *argv[1:]]
        if idle_priority:  # SCHED_IDLE, inherited by all the child starts (posix_spawn refuses it)
            argv = [resolve("chrt"), "--idle", "0", *argv]
        try:
            self.pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions)
        finally:
            if self._out_w >= 0:
                os.close(self._out_w)
        self._pidfd = os.pidfd_open(self.pid)
        self.returncode: int | None = None

    async def first_byte(self) -> bytes:
        """The first byte the child (or a process it left holding the pipe) writes; b"" at EOF."""
        await _readable(self._out_r)
        data = os.read(self._out_r, 1)
        os.close(self._out_r)
        self._out_r = -1
        return data

    async def wait(self) -> int:
        if self.returncode is None:
            await _readable(self._pidfd)  # a pidfd turns readable when the process exits
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
            self.close()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, 9)

    def close(self) -> None:
        for fd in (self._out_r, self._pidfd):
            if fd >= 0:
                os.close(fd)
        self._out_r = self._pidfd = -1


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, ready.set_result, None)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def run(argv: list[str]) -> int:
    """Run a program to completion, output discarded; its exit code."""
    return await Spawned(argv, capture_stdout=False, stderr=None).wait()
