"""What one private server of a series holds on the host, read from ``/proc``, ``/sys`` and
its state dir: the density series' leftovers, the soak's curves and the cluster series' pauses
count the same things the same way (a mount or loop device is the server's when it lies under
its state dir). A stopped sandbox's removal and the disk stock's refill run after the stop has
answered: ``steady`` waits until such counts hold still."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .bench import Created

T = TypeVar("T")


def meminfo_kb(text: str, field: str) -> int:
    """One ``Field:  N kB`` line of /proc/meminfo (or of a process's /proc/PID/status), in kB."""
    found = re.search(rf"^{re.escape(field)}:\s+(\d+) kB$", text, re.M)
    if found is None:
        raise ValueError(f"no {field} in the text given")
    return int(found.group(1))


def loop_devices_under(directory: Path) -> int:
    """Loop devices whose backing file lies under ``directory``."""
    count = 0
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with suppress(OSError):  # detached meanwhile
            count += backing.read_text().startswith(str(directory) + "/")
    return count


async def steady(read: Callable[[], T], quiet_s: float = 1.0, timeout_s: float = 15.0) -> T:
    """``read()`` once it returned the same for ``quiet_s`` (or as it is after ``timeout_s``)."""
    t0 = time.perf_counter()
    value, since = read(), t0
    while time.perf_counter() - since < quiet_s and time.perf_counter() - t0 < timeout_s:
        await asyncio.sleep(0.1)
        if (now := read()) != value:
            value, since = now, time.perf_counter()
    return value


@dataclass(frozen=True)
class Host:
    """Where one private server keeps what its sandboxes hold on the host."""
    pid: int  # the server process, leader of its session
    state: Path
    cgroup_parent: str  # ``/dsec-<edge id>``

    def counts(self) -> dict[str, int]:
        """What a sandbox of this server holds while it lives, and none may hold after."""
        return {"mounts under the state dir": self.mounts(),
                "loop devices under the state dir": self.loops(),
                "sandbox cgroups": self.cgroups(),
                "processes in the server's session": self.session_processes(),
                "live rows in the state store": self.live_rows()}

    def mounts(self) -> int:
        lines = Path(f"/proc/{self.pid}/mountinfo").read_text().splitlines()
        return sum(line.split()[4].startswith(str(self.state) + "/") for line in lines)

    def loops(self) -> int:
        return loop_devices_under(self.state)

    def cgroups(self) -> int:
        return sum(1 for h in Path("/sys/fs/cgroup").iterdir()
                   for d in (h / self.cgroup_parent.lstrip("/")).glob("*") if d.is_dir())

    def session_processes(self) -> int:
        count = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with suppress(OSError):
                count += stat.read_text().rpartition(")")[2].split()[3] == str(self.pid)
        return count

    def live_rows(self) -> int:
        db = sqlite3.connect(f"file:{self.state / 'state.db'}?mode=ro", uri=True, timeout=30)
        try:
            return int(db.execute("SELECT count(*) FROM sandboxes WHERE state IN "
                                  "('starting','running','paused')").fetchone()[0])
        finally:
            db.close()

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def rss_kb(self) -> int:
        return meminfo_kb(Path(f"/proc/{self.pid}/status").read_text(), "VmRSS")


async def server_host(created: Created, state: Path) -> Host:
    """The ``Host`` of the server behind ``created``, whose state dir is ``state``."""
    edge = (await created.client.health())["edges"][0]["id"]
    return Host(created.server_pid, state, f"/dsec-{edge}")
