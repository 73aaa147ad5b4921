"""The server's limit on open files, sized to its capacity.

Each live sandbox holds a few files of the server open for as long as it lives (a container:
its pidfd, its mount namespace and its bundle dir seen from there; ``Substrate.open_files``),
so an edge admitting ``capacity`` sandboxes needs that many times as many beside its own. The
usual soft limit of 1,024 (systemd's default, many shells') would stop a node near 300
containers, and a hard limit below the need would fail the create that crosses it with EMFILE
half-way through its set-up. So an edge raises its soft limit to its hard limit, and a
privileged edge the hard limit too when the need is above it (up to the kernel's
``fs.nr_open``); an edge that still cannot open what its capacity needs refuses to start,
naming both figures (``Edge.start``).
"""

from __future__ import annotations

import resource
from pathlib import Path

RESERVE = 1024  # the server's own: databases, listening and client sockets, image files, pipes


def ensure_open_files(needed: int) -> int:
    """This process's soft limit on open files raised to its hard limit, and both to
    ``needed`` when the hard limit is lower and the process may raise it
    (CAP_SYS_RESOURCE); never lowered. The new soft limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < needed:
        ceiling = int(Path("/proc/sys/fs/nr_open").read_text())
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, ceiling),) * 2)
        except (PermissionError, ValueError):  # unprivileged: the hard limit is the operator's
            pass
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # Linux bounds the hard limit (fs.nr_open): never infinite for files
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
