"""Starting helper programs (the OCI runtime) on the create path, cheaply.

glibc's ``posix_spawn`` (vfork + exec) plus a pidfd watched by the event loop: no fork of the
whole server process (the event loop's own subprocess support forks, which costs about 10 ms
for a server of this size) and no thread per child.

A vfork parent waits until its child has exec'd, and on a loaded machine (64 creates at
once, each ``crun`` copying a mount namespace) that wait is long. ``os.posix_spawn`` waits
holding the GIL: every thread of the server stood still for each spawn (a third of the event
loop's time in a burst, issue 15). The spawn is therefore called through ctypes, which lets
the GIL go, from a small pool of threads of its own: the event loop and the I/O threads run
while a child is being started.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ...protocol.errors import NotSupported
from .mountns import inside, own_fs

_libc = ctypes.CDLL(None, use_errno=True)
_libc.posix_spawn_file_actions_addopen.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p,
                                                   ctypes.c_int, ctypes.c_uint]
_libc.posix_spawn_file_actions_init.argtypes = [ctypes.c_void_p]
_libc.posix_spawn_file_actions_destroy.argtypes = [ctypes.c_void_p]
_libc.posix_spawn_file_actions_adddup2.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
_libc.posix_spawn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p),
                              ctypes.POINTER(ctypes.c_char_p)]
# posix_spawn_file_actions_t is 80 bytes in glibc (x86-64, arm64): room to spare
_FILE_ACTIONS_BYTES = 256
# Threads that wait for a child's exec: enough for a burst's runtimes to start in parallel;
# each may start its child in a sandbox's mount namespace (mountns.py).
_spawner = ThreadPoolExecutor(8, thread_name_prefix="dsec-spawn", initializer=own_fs)


_found: dict[str, str] = {}  # program name -> the path PATH gave it


def resolve(program: str) -> str:
    """The program's absolute path (posix_spawn does not search PATH). PATH is searched
    once per program and process: a search stats each of its directories (a tenth of a
    millisecond each on a busy node), and the runtime is resolved on the event loop for
    every create and stop. One installed later, earlier in PATH, is taken at the next
    start."""
    if os.path.isabs(program):
        return program
    path = _found.get(program)
    if path is None:
        path = shutil.which(program)
        if path is None:
            raise NotSupported(f"{program!r} is not installed on this edge")
        _found[program] = path
    return path


def _c(text: str | bytes) -> bytes:
    """``text`` as a C string; a NUL inside would cut it short (ctypes passes it as it is),
    so it is refused, as ``os.posix_spawn`` refuses it."""
    data = os.fsencode(text)
    if b"\0" in data:
        raise ValueError(f"embedded null byte in {data[:80]!r}")
    return data


def _strings(items: list[bytes]) -> ctypes.Array[ctypes.c_char_p]:
    """A NULL-terminated ``char *[]``."""
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


def posix_spawn(argv: list[str], stdout: int | str, stderr: str, keep: int | None = None) -> int:
    """glibc's posix_spawn of ``argv`` (an absolute path first) with the server's
    environment; stdin /dev/null, stdout a path or dup2'd from an fd, stderr a path
    (created, 0600); the fd ``keep``, if given, stays open across the exec (every other fd
    of the server is close-on-exec). The GIL is released for the call (ctypes). The
    child's pid."""
    args = _strings([_c(a) for a in argv])
    env = _strings([_c(k + b"=" + v) for k, v in os.environb.items()])
    buffer = ctypes.create_string_buffer(_FILE_ACTIONS_BYTES)
    actions = ctypes.addressof(buffer)
    _check(_libc.posix_spawn_file_actions_init(actions))
    try:
        _check(_libc.posix_spawn_file_actions_addopen(actions, 0, b"/dev/null", os.O_RDONLY, 0))
        if isinstance(stdout, int):
            _check(_libc.posix_spawn_file_actions_adddup2(actions, stdout, 1))
        else:
            _check(_libc.posix_spawn_file_actions_addopen(actions, 1, _c(stdout),
                                                          os.O_WRONLY, 0))
        _check(_libc.posix_spawn_file_actions_addopen(
            actions, 2, _c(stderr), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        if keep is not None:  # dup2 onto itself clears its close-on-exec flag (glibc >= 2.29)
            _check(_libc.posix_spawn_file_actions_adddup2(actions, keep, keep))
        pid = ctypes.c_int()
        _check(_libc.posix_spawn(ctypes.byref(pid), args[0], actions, None,
                                 args, env))
        return pid.value
    finally:
        _libc.posix_spawn_file_actions_destroy(actions)


def _own_fd(program: str) -> int | None:
    """The fd of this process ``program`` is run from, if it is a link to one
    (``/proc/self/fd/N``: sealed.py)."""
    try:
        head, _, fd = os.readlink(program).rpartition("/")
    except OSError:  # not a link
        return None
    return int(fd) if head == "/proc/self/fd" and fd.isdigit() else None


def _check(err: int) -> None:
    if err != 0:
        raise OSError(err, os.strerror(err))


class Spawned:
    """A child process; its stdout is a pipe when asked for, stdin is /dev/null. With
    ``idle_priority`` it (and all it starts) only gets CPU time nothing else wants. Made by
    ``start``."""

    def __init__(self, pid: int, out_r: int) -> None:
        self.pid = pid
        self._out_r = out_r
        self._pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None

    @classmethod
    async def start(cls, argv: list[str], capture_stdout: bool, stderr: Path | None,
                    idle_priority: bool = False, mount_namespace: int | None = None) -> Spawned:
        """The child started from a spawn thread (see the module's docstring), in the mount
        namespace ``mount_namespace`` (an fd) if given. If the caller is cancelled meanwhile,
        the child is killed and reaped once it has started."""
        spawning = asyncio.get_running_loop().run_in_executor(
            _spawner, cls._spawn, argv, capture_stdout, stderr, idle_priority, mount_namespace)
        try:
            return await asyncio.shield(spawning)
        except asyncio.CancelledError:
            spawning.add_done_callback(_abandon)
            raise

    @classmethod
    def _spawn(cls, argv: list[str], capture_stdout: bool, stderr: Path | None,
               idle_priority: bool, mount_namespace: int | None) -> Spawned:
        out_r, out_w = os.pipe2(os.O_CLOEXEC) if capture_stdout else (-1, -1)
        argv = [resolve(argv[0]), *argv[1:]]
        keep = None
        if idle_priority:  # SCHED_IDLE, inherited by all the child starts (posix_spawn refuses it)
            keep = _own_fd(argv[0])  # a program run from an fd of ours (sealed.py): chrt runs it
            argv = [resolve("chrt"), "--idle", "0", *argv]
        try:
            with inside(mount_namespace):  # the child is made in this thread's namespaces
                pid = posix_spawn(argv, out_w if capture_stdout else "/dev/null",
                                  str(stderr or "/dev/null"), keep)
        except BaseException:
            if out_r >= 0:
                os.close(out_r)
            raise
        finally:
            if out_w >= 0:
                os.close(out_w)
        return cls(pid, out_r)

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


def _abandon(spawning: asyncio.Future[Spawned] | Future[Spawned]) -> None:
    """A child whose starter was cancelled: killed, reaped, its fds closed."""
    if spawning.cancelled() or spawning.exception() is not None:
        return
    _spawner.submit(_reap, spawning.result())  # a child in the kernel's locks takes a while


def _reap(child: Spawned) -> None:
    child.kill()
    os.waitpid(child.pid, 0)
    child.close()


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
    return await (await Spawned.start(argv, capture_stdout=False, stderr=None)).wait()
