"""Why this host cannot checkpoint a container's processes: a ``full`` snapshot of a
container (memory and processes, not only files) needs CRIU, and CRIU needs kernel features
that ``criu check`` probes. Asked once per process, on the first ``full`` snapshot, so the
refusal names the host's actual reason rather than a generic one."""

from __future__ import annotations

import functools
import shutil
import subprocess

CHECK_TIMEOUT_S = 30


@functools.cache
def why_not() -> str:
    """A sentence saying why process checkpointing is unavailable here."""
    criu = shutil.which("criu")
    if criu is None:
        return "criu is not installed"
    try:
        done = subprocess.run([criu, "check"], capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"`criu check` did not finish within {CHECK_TIMEOUT_S}s"
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "Error" in line]
    if done.returncode != 0:
        first = errors[0] if errors else f"exit {done.returncode}"
        return f"`criu check` fails on this kernel: {first.split(': ', 1)[-1].strip()}"
    return "`criu check` passes, but dsec does not drive CRIU yet"
