"""Knowing whether a sandbox's main process lives, and hearing when it ends, through pidfds.

A pid stored before an edge restart is trusted only while the process is still in the
sandbox's cgroup (pids are reused); a pidfd, once open, names the process for good.

A pidfd is an open file of the edge's process for as long as its sandbox lives: the edge sizes
its limit on open files to its capacity (``host/openfiles.py``).
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
from pathlib import Path
from typing import Callable


class PidWatch:
    def __init__(self, cgroup_parent: str) -> None:
        self.cgroup_parent = cgroup_parent
        self._pidfds: dict[str, int] = {}

    def adopt(self, sandbox_id: str, pid: int) -> None:
        """Our own freshly started process: no ownership check needed."""
        self._pidfds[sandbox_id] = os.pidfd_open(pid)

    def owns(self, pid: int, sandbox_id: str) -> bool:
        try:
            return f"{self.cgroup_parent}/{sandbox_id}\n" in Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return False

    def pidfd(self, sandbox_id: str, pid: int | None) -> int | None:
        """A pidfd on the sandbox's process, or None if it is gone."""
        fd = self._pidfds.get(sandbox_id)
        if fd is None and pid and self.owns(pid, sandbox_id):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return None
            if not self.owns(pid, sandbox_id):  # exited and reused in between
                os.close(fd)
                return None
            self._pidfds[sandbox_id] = fd
        return fd

    def alive(self, sandbox_id: str, pid: int | None) -> bool:
        fd = self.pidfd(sandbox_id, pid)
        return fd is not None and not select.select([fd], [], [], 0)[0]  # readable once exited

    def watch(self, sandbox_id: str, pid: int | None, on_exit: Callable[[], None]) -> None:
        fd = self.pidfd(sandbox_id, pid)
        if fd is None:
            on_exit()
            return
        loop = asyncio.get_running_loop()

        def exited() -> None:
            loop.remove_reader(fd)
            on_exit()
        loop.add_reader(fd, exited)

    def kill(self, sandbox_id: str, pid: int | None) -> None:
        """SIGKILL to the sandbox's process, if it still lives."""
        fd = self.pidfd(sandbox_id, pid)
        if fd is not None:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:  # it has exited already
                pass

    def forget(self, sandbox_id: str) -> None:
        fd = self._pidfds.pop(sandbox_id, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
