"""Host side of one fn template: starting it, the pool of jailed workers it hands over, and
the one-request exchange with a worker.

The template sends each ready worker's socket and a pidfd over a SOCK_SEQPACKET control
socket; the server keeps them in a queue and asks for one more for every one it takes, so
the pool refills in the background while calls run. A call writes one frame to the worker and
reads one back: the template is not on the call's path. Deaths (wait status, OOM kills) come
back from the template, which is the workers' parent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...protocol.errors import SandboxError

log = logging.getLogger("dsec.fn")
LAUNCHER = Path(__file__).with_name("fn_launch.py")
DEATH_REPORT_TIMEOUT_S = 5.0
START_TIMEOUT_S = 60.0
MAX_REPLY = 1 << 30  # a reply is held in memory once on the server


class WorkerGone(Exception):
    """The worker closed its socket before answering (it died)."""


@dataclass(frozen=True)
class Death:
    status: int  # a wait status
    oom_kills: int

    def describe(self) -> str:
        if self.oom_kills:
            return "out of memory: the kernel killed the worker"
        if os.WIFSIGNALED(self.status):
            sig = os.WTERMSIG(self.status)
            return f"the worker was killed by signal {sig} ({signal.Signals(sig).name})"
        return f"the worker exited with code {os.waitstatus_to_exitcode(self.status)} before answering"


class Worker:
    """A jailed, idle worker process: one request, one reply, then it ends."""

    def __init__(self, template: Template, wid: str, pid: int, sock: socket.socket, pidfd: int) -> None:
        self.template = template
        self.wid = wid
        self.pid = pid
        self.sock = sock
        self.pidfd = pidfd
        self.death: asyncio.Future[Death] = asyncio.get_running_loop().create_future()

    def alive(self) -> bool:
        return self.pidfd >= 0 and not select.select([self.pidfd], [], [], 0)[0]

    async def send(self, frame: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, struct.pack(">I", len(frame)) + frame)

    async def recv_exact(self, n: int) -> bytes:
        loop = asyncio.get_running_loop()
        buf = bytearray()
        while len(buf) < n:
            chunk = await loop.sock_recv(self.sock, n - len(buf))
            if not chunk:
                raise WorkerGone
            buf += chunk
        return bytes(buf)

    async def exchange(self, frame: bytes) -> bytes:
        """Send one request frame and read the reply frame."""
        try:
            await self.send(frame)
            size = struct.unpack(">I", await self.recv_exact(4))[0]
            if size > MAX_REPLY:
                raise SandboxError(f"the worker's reply of {size} bytes exceeds {MAX_REPLY}")
            return await self.recv_exact(size)
        except (ConnectionError, BrokenPipeError):
            raise WorkerGone from None

    async def ended(self) -> Death | None:
        """How the worker ended, as its parent saw it (None if no report came in time)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.death), DEATH_REPORT_TIMEOUT_S)
        except asyncio.TimeoutError:
            return None

    def kill(self) -> None:
        if self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Forget the worker (it ends by itself after answering, or was killed)."""
        self.sock.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        self.template.forget(self.wid)


class Template:
    """One image's template process and its queue of ready workers."""

    def __init__(self, key: str, pool_size: int, launch: dict[str, Any], log_path: Path,
                 on_exit: Callable[[], None]) -> None:
        self.key = key
        self._on_unexpected_exit = on_exit
        self.pool_size = pool_size
        self._launch = launch
        self._log_path = log_path
        self._ready: deque[Worker] = deque()
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._live: dict[str, Worker] = {}  # every worker handed over and not yet forgotten
        self._ctl: socket.socket | None = None
        self.pid = 0
        self._exited = False
        self._closing = False

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._launch["template"]["ctl_fd"] = 3
        self._launch["server_pid"] = os.getpid()
        with open(self._log_path, "ab") as logf:
            actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                       (os.POSIX_SPAWN_DUP2, logf.fileno(), 1),
                       (os.POSIX_SPAWN_DUP2, logf.fileno(), 2),
                       (os.POSIX_SPAWN_DUP2, theirs.fileno(), 3)]
            self.pid = os.posix_spawn(sys.executable, [sys.executable, "-I", str(LAUNCHER),
                                                       json.dumps(self._launch)],
                                      {}, file_actions=actions)
        theirs.close()
        ours.setblocking(False)
        self._ctl = ours
        loop = asyncio.get_running_loop()
        loop.add_reader(ours.fileno(), self._on_message)
        self._pidfd = os.pidfd_open(self.pid)
        loop.add_reader(self._pidfd, self._on_exit)
        self.request(self.pool_size)

    def request(self, n: int) -> None:
        """Ask the template for ``n`` more workers. A template that was just killed has
        closed its end before its pidfd says it exited: the ask is lost with it, and its
        exit is handled when the pidfd fires (a call on one of its workers runs again on
        the next template), never raised to the caller that took a worker."""
        if self._ctl is not None and not self._exited:
            try:
                self._ctl.send(str(n).encode())
            except (BrokenPipeError, ConnectionResetError):
                pass

    async def take(self) -> Worker:
        """A jailed worker, waiting for one if the pool is empty; asks for a replacement."""
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while True:
            while self._ready:
                worker = self._ready.popleft()
                if worker.alive():
                    self.request(1)
                    return worker
                worker.close()
                self.request(1)
            if not self.alive():
                raise SandboxError(f"the fn template of image {self.key} exited; see {self._log_path}")
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(waiter, max(remaining, 0))
            except asyncio.TimeoutError:
                raise SandboxError(f"no fn worker of image {self.key} became ready within "
                                   f"{START_TIMEOUT_S:.0f}s; see {self._log_path}") from None

    def forget(self, wid: str) -> None:
        self._live.pop(wid, None)

    def _on_message(self) -> None:
        assert self._ctl is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._ctl, 4096, 2)
            except BlockingIOError:
                return
            if not data:
                self._on_exit()
                return
            message = json.loads(data)
            if "dead" in message:
                worker = self._live.get(message["dead"])
                if worker is not None and not worker.death.done():
                    worker.death.set_result(Death(message["status"], message["oom"]))
                continue
            sock = socket.socket(fileno=fds[0])
            sock.setblocking(False)
            worker = Worker(self, message["wid"], message["pid"], sock, fds[1])
            self._live[worker.wid] = worker
            self._ready.append(worker)
            while self._waiting:
                waiter = self._waiting.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    break

    def _on_exit(self) -> None:
        if self._exited:
            return
        self._exited = True
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        if self._ctl is not None:
            loop.remove_reader(self._ctl.fileno())
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)
        for worker in self._live.values():
            if not worker.death.done():
                worker.death.set_result(Death(signal.SIGKILL, 0))
        if not self._closing:
            log.warning("fn template %s exited; its workers end with it, the next call starts "
                        "a new one; see %s", self.key, self._log_path)
            self._on_unexpected_exit()

    def alive(self) -> bool:
        """Asks the pidfd, so a template that just died is known dead before the event loop
        has run its exit callback."""
        return not self._exited and not select.select([self._pidfd], [], [], 0)[0]

    def _reap(self) -> None:
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass

    async def close(self) -> None:
        """Kill the template; its workers follow by their parent-death signal."""
        for worker in list(self._live.values()):
            worker.kill()
            worker.close()
        self._closing = True  # an exit from here on is ours, not unexpected
        if not self._exited:
            os.kill(self.pid, signal.SIGKILL)
            self._on_exit()
        self._reap()
        os.close(self._pidfd)
        if self._ctl is not None:
            self._ctl.close()
