"""Asyncio client for the in-sandbox agent: one connection per request, over a Unix socket
(containers) or TCP (VMs: a loopback port forwarded into the guest).

Streams (``exec``, ``attach``) are async generators. Closing one early (``aclose()``, or leaving
an ``aclosing`` block) closes its connection; the agent then stops streaming to it but does
NOT kill the process, which runs on (and, for ``exec``, until its own end or timeout).
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import os
import socket
import stat
import struct
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing
from dataclasses import dataclass

from .peer import loopback_peer_uid
from .protocol import Frame, Value, encode, read_frame

_READ_LIMIT = 4 << 20  # StreamReader buffer; frames carry up to 1 MiB of data
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class AgentError(Exception):
    """The agent answered ``X``: ``errno`` is symbolic (``ENOENT``, ``ESRCH``, ...)."""

    def __init__(self, errno: str, message: str) -> None:
        super().__init__(f"{errno}: {message}")
        self.errno = errno
        self.message = message


class AgentUnavailable(ConnectionError):
    """The socket could not be reached, or the connection dropped before the final frame."""


@dataclass(frozen=True, slots=True)
class Output:
    fd: int  # 1 stdout, 2 stderr
    data: bytes


@dataclass(frozen=True, slots=True)
class Exit:
    exit_code: int  # -1 if killed by a signal
    signal: int  # 0 if none
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    duration_ms: int


@dataclass(frozen=True, slots=True)
class RunResult:
    exit_code: int
    signal: int
    timed_out: bool
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    duration_ms: int


@dataclass(frozen=True, slots=True)
class ProcInfo:
    id: str
    pid: int
    command: str
    running: bool
    exit_code: int | None  # None while running
    signal: int | None
    tty: bool


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    type: str  # file, dir, symlink, other
    size: int
    mode: int
    mtime: int


def _exit(f: Frame) -> Exit:
    return Exit(
        exit_code=f.num("exit_code"),
        signal=f.num("signal"),
        timed_out=bool(f.num("timed_out")),
        stdout_truncated=bool(f.num("stdout_truncated")),
        stderr_truncated=bool(f.num("stderr_truncated")),
        duration_ms=f.num("duration_ms"),
    )


def _event(f: Frame) -> Output | Exit:
    return Output(f.num("fd"), f.data("data")) if f.type == "o" else _exit(f)


def _entry(f: Frame) -> Entry:
    return Entry(f.text("name"), f.text("type"), f.num("size"), f.num("mode", base=8), f.num("mtime"))


def _exec_fields(
    argv: list[str], env: dict[str, str], cwd: str | None, stdin: bytes | None,
    timeout_ms: int, max_output: int, mode: str | None, privileged: bool = False,
) -> list[tuple[str, Value]]:
    if not argv:
        raise ValueError("argv must not be empty")
    fields: list[tuple[str, Value]] = [("argv", a) for a in argv]
    fields += [("env", f"{k}={v}") for k, v in env.items()]
    if cwd is not None:
        fields.append(("cwd", cwd))
    if stdin is not None:
        fields.append(("stdin", stdin))
    if privileged:
        fields.append(("privileged", 1))
    fields += [("timeout_ms", timeout_ms), ("max_output", max_output)]
    return fields if mode is None else [*fields, ("mode", mode)]


class AgentClient:
    """``address`` is a Unix socket path, or a ``(host, port)`` pair for TCP. ``token`` is sent
    with every request (see ``claim``). ``peer_pid``, when given, must be the pid that listens
    on the Unix socket (SO_PEERCRED): a process in the sandbox that replaced the socket file
    with its own cannot receive the token or answer in the agent's name. ``peer_uid``, for a
    loopback TCP address, must own the socket at the other end (``peer.py``): a local user
    who bound a VM's port once its QEMU had gone gets nothing either."""

    def __init__(self, address: str | os.PathLike[str] | tuple[str, int], token: str | None = None,
                 peer_pid: int | None = None, peer_uid: int | None = None) -> None:
        self.address = address if isinstance(address, tuple) else os.fspath(address)
        self.token = token
        self.peer_pid = peer_pid
        self.peer_uid = peer_uid

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if isinstance(self.address, tuple):
            return await asyncio.open_connection(*self.address, limit=_READ_LIMIT)
        # The socket file sits in a directory the sandbox writes: a link it put there must not
        # take the edge to another socket on the host (runsc has no peer pid to check). So the
        # file itself is opened without following links, must be a socket, and is connected
        # to through that descriptor.
        fd = os.open(self.address, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                raise ConnectionRefusedError(errno.ENOTSOCK, f"{self.address} is not a socket")
            return await asyncio.open_unix_connection(f"/proc/self/fd/{fd}", limit=_READ_LIMIT)
        finally:
            os.close(fd)

    async def claim(self) -> None:
        """Make the agent ours: it accepts one claim, then only requests with this token."""
        if not self.token:
            raise ValueError("claim needs a token")
        await self._call("C", [("token", self.token)], authenticated=False)

    def _check_peer(self, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if self.peer_uid is not None:
            uid = loopback_peer_uid(sock)
            if uid != self.peer_uid:
                raise AgentUnavailable(f"agent port {self.address} is served by uid {uid}, "
                                       f"not the agent's {self.peer_uid}")
        if self.peer_pid is None:
            return
        pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _PEERCRED.size))
        if pid != self.peer_pid:
            raise AgentUnavailable(f"agent socket {self.address} is served by pid {pid}, "
                                   f"not the agent's {self.peer_pid}")

    async def _send(self, kind: str, fields: Iterable[tuple[str, Value]],
                    authenticated: bool = True) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to the agent, check who serves its socket and send one request: the open
        connection (closed here if any of that fails)."""
        if authenticated and self.token:
            fields = [("token", self.token), *fields]
        request = encode(kind, fields)
        try:
            reader, writer = await self._connect()
        except OSError as e:
            raise AgentUnavailable(f"agent at {self.address}: {e}") from e
        try:
            self._check_peer(writer)
            writer.write(request)
            await writer.drain()
        except BaseException as e:
            writer.close()
            if isinstance(e, OSError):
                raise AgentUnavailable(f"agent connection lost: {e!r}") from e
            raise
        return reader, writer

    async def _frames(self, kind: str, fields: Iterable[tuple[str, Value]], until: str,
                      authenticated: bool = True) -> AsyncGenerator[Frame, None]:
        """Send one request and yield reply frames up to and including one whose type is in
        ``until``; an ``X`` reply raises AgentError. The connection is closed on exit."""
        reader, writer = await self._send(kind, fields, authenticated)
        try:
            while True:
                frame = await read_frame(reader)
                if frame.type == "X":
                    raise AgentError(frame.text("errno"), frame.text("message"))
                yield frame
                if frame.type in until:
                    return
        except (OSError, asyncio.IncompleteReadError) as e:
            raise AgentUnavailable(f"agent connection lost: {e!r}") from e
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def _call(self, kind: str, fields: Iterable[tuple[str, Value]] = (), until: str = "O",
                    authenticated: bool = True) -> list[Frame]:
        async with aclosing(self._frames(kind, fields, until, authenticated)) as frames:
            return [f async for f in frames]

    async def _stream(self, kind: str, fields: Iterable[tuple[str, Value]]) -> AsyncGenerator[Output | Exit, None]:
        async with aclosing(self._frames(kind, fields, "x")) as frames:
            async for f in frames:
                yield _event(f)

    async def open_port(self, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to ``127.0.0.1:port`` inside the sandbox, as the agent's raw byte
        pipe (``N``): what is written goes to the port, what is read came from it (hostile
        bytes). The caller closes the writer to end it; AgentError ``ECONNREFUSED`` when
        nothing listens. The agent does not bound the connect: the caller does."""
        reader, writer = await self._send("N", [("port", port)])
        try:
            frame = await read_frame(reader)
        except BaseException as e:
            writer.close()
            if isinstance(e, (OSError, asyncio.IncompleteReadError)):
                raise AgentUnavailable(f"agent connection lost: {e!r}") from e
            raise
        if frame.type != "O":
            writer.close()
            raise AgentError(frame.text("errno", "EPROTO"), frame.text("message", "unexpected reply"))
        return reader, writer

    async def ping(self) -> None:
        await self._call("H")

    def exec(
        self, argv: list[str], *, env: dict[str, str], cwd: str | None = None, stdin: bytes | None = None,
        timeout_ms: int = 0, max_output: int = 16 << 20, privileged: bool = False,
    ) -> AsyncGenerator[Output | Exit, None]:
        """Run ``argv`` and stream its output; the last item is its Exit. ``env`` is the whole
        environment; ``stdin=None`` means /dev/null. ``privileged`` keeps the capabilities a
        ``--confine``d agent takes from commands (for dsec's own, e.g. a VM's network set-up)."""
        return self._stream("E", _exec_fields(argv, env, cwd, stdin, timeout_ms, max_output, "wait",
                                              privileged))

    async def run(
        self, argv: list[str], *, env: dict[str, str], cwd: str | None = None, stdin: bytes | None = None,
        timeout_ms: int = 0, max_output: int = 16 << 20, privileged: bool = False,
    ) -> RunResult:
        """``exec`` collected: the whole output and the exit status."""
        out = {1: bytearray(), 2: bytearray()}
        async with aclosing(self.exec(argv, env=env, cwd=cwd, stdin=stdin, timeout_ms=timeout_ms,
                                      max_output=max_output, privileged=privileged)) as events:
            async for ev in events:
                if isinstance(ev, Output):
                    out[ev.fd] += ev.data
                else:
                    return RunResult(ev.exit_code, ev.signal, ev.timed_out, bytes(out[1]), bytes(out[2]),
                                     ev.stdout_truncated, ev.stderr_truncated, ev.duration_ms)
        raise AgentUnavailable("exec stream ended without an exit frame")

    async def start(
        self, argv: list[str], *, env: dict[str, str], cwd: str | None = None, stdin: bytes | None = None,
        timeout_ms: int = 0, max_output: int = 16 << 20, stdin_open: bool = False,
    ) -> tuple[str, int]:
        """Start ``argv`` in the background; returns ``(id, pid)``. Its output (up to
        ``max_output`` per stream) is kept for ``attach``. ``stdin_open`` keeps its stdin open
        after ``stdin`` for ``send_input`` until ``close_stdin``."""
        fields = _exec_fields(argv, env, cwd, stdin, timeout_ms, max_output, "background")
        if stdin_open:
            fields.append(("stdin_open", 1))
        (f,) = await self._call("E", fields, until="S")
        return f.text("id"), f.num("pid")

    async def start_pty(
        self, argv: list[str], *, env: dict[str, str], cwd: str | None = None, cols: int = 80,
        rows: int = 24, timeout_ms: int = 0, max_output: int = 16 << 20,
    ) -> tuple[str, int]:
        """Start ``argv`` on a new pseudo-terminal of ``cols`` x ``rows``, in the background;
        returns ``(id, pid)``. Its terminal output is one stream (fd 1) of which the last
        ``max_output`` bytes are kept for ``attach``; input goes through ``send_input``."""
        fields = _exec_fields(argv, env, cwd, None, timeout_ms, max_output, None)
        (f,) = await self._call("P", [*fields, ("cols", cols), ("rows", rows)], until="S")
        return f.text("id"), f.num("pid")

    async def send_input(self, id: str, data: bytes) -> None:
        """Queue ``data`` for a background process's stdin (or terminal). AgentError
        ``EAGAIN`` while 1 MiB of earlier input is still unread (nothing is queued),
        ``EPIPE`` once its stdin is closed, ``ECHILD`` once it has exited."""
        await self._call("I", [("id", id), ("data", data)])

    async def close_stdin(self, id: str) -> None:
        """Close a background process's stdin once the input queued so far is written."""
        await self._call("W", [("id", id)])

    async def resize(self, id: str, cols: int, rows: int) -> None:
        """Set a terminal's size (its foreground process group gets SIGWINCH)."""
        await self._call("Z", [("id", id), ("cols", cols), ("rows", rows)])

    def attach(self, id: str) -> AsyncGenerator[Output | Exit, None]:
        """Output of a background process from its start, then live, then its Exit."""
        return self._stream("A", [("id", id)])

    async def signal(self, id: str, sig: int) -> None:
        """Send ``sig`` to the process group of a running background process."""
        await self._call("K", [("id", id), ("sig", sig)])

    async def list(self) -> builtins.list[ProcInfo]:
        """Background processes: running ones and the most recent finished ones."""
        return [
            ProcInfo(
                f.text("id"), f.num("pid"), f.text("argv"), bool(f.num("running")),
                None if f.get("exit_code") is None else f.num("exit_code"),
                None if f.get("signal") is None else f.num("signal"),
                bool(f.num("tty")),
            )
            for f in await self._call("L")
            if f.type == "p"
        ]

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The file's bytes; past ``max_bytes``, ``AgentError("EFBIG")`` and the rest is not
        read (the sandbox may have put anything at ``path``)."""
        data = bytearray()
        async with aclosing(self._frames("F", [("op", "read"), ("path", path)], "O")) as frames:
            async for f in frames:
                if f.type == "D":
                    data += f.data("data")
                    if max_bytes is not None and len(data) > max_bytes:
                        raise AgentError("EFBIG", f"{path} is larger than {max_bytes} bytes")
        return bytes(data)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, append: bool = False) -> None:
        """Replace ``path`` atomically (temp file + rename) or append to it. Parent
        directories are never created. ``mode`` applies when the agent creates the file."""
        await self._call("F", [("op", "write"), ("path", path), ("data", data), ("mode", f"{mode:o}"),
                               ("append", int(append))])

    async def list_dir(self, path: str) -> builtins.list[Entry]:
        """Entries of a directory (symlinks not followed), sorted by name."""
        frames = await self._call("F", [("op", "list"), ("path", path)])
        return sorted((_entry(f) for f in frames if f.type == "e"), key=lambda e: e.name)

    async def stat(self, path: str) -> Entry:
        """lstat ``path``; ``name`` is its basename."""
        (f,) = await self._call("F", [("op", "stat"), ("path", path)], until="e")
        return _entry(f)

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, symlink or empty directory; ``recursive`` removes a tree without
        following symlinks or crossing mount points."""
        await self._call("F", [("op", "remove"), ("path", path), ("recursive", int(recursive))])

    async def mkdir(self, path: str, parents: bool = False, mode: int = 0o755) -> None:
        await self._call("F", [("op", "mkdir"), ("path", path), ("parents", int(parents)),
                               ("mode", f"{mode:o}")])
