"""The server's limit on open files, sized to its capacity (``substrates/host/openfiles.py``):
each live sandbox holds a few files of the server, so a node started from a shell or a unit
with the usual 1,024 would stop near 300 containers (issue 15's density). Each case runs in a
child process of its own, whose limits it may change."""

import subprocess
import sys

import pytest

# The child starts with a soft limit of 256 and a hard one of 512.
PROGRAM = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))
from dsec.substrates.host.openfiles import ensure_open_files
allowed = ensure_open_files(int(sys.argv[1]))
print(allowed, *resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def limits_after(needed: int) -> list[int]:
    """(what ensure_open_files returned, the soft limit, the hard one) in a child."""
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(needed)], capture_output=True,
                          text=True, check=True)
    return [int(n) for n in done.stdout.split()]


def may_raise_the_hard_limit() -> bool:
    effective = next(line for line in open("/proc/self/status") if line.startswith("CapEff:"))
    return bool(int(effective.split()[1], 16) >> 24 & 1)  # CAP_SYS_RESOURCE


def test_the_soft_limit_is_raised_to_the_hard_one_and_never_lowered() -> None:
    assert limits_after(300) == [512, 512, 512]
    assert limits_after(10) == [512, 512, 512]  # a small need lowers nothing


@pytest.mark.skipif(may_raise_the_hard_limit(), reason="this process may raise its hard limit")
def test_an_unprivileged_process_keeps_the_operators_hard_limit() -> None:
    assert limits_after(5000) == [512, 512, 512]  # below the need: Edge.start refuses


@pytest.mark.skipif(not may_raise_the_hard_limit(), reason="needs CAP_SYS_RESOURCE")
def test_a_privileged_process_raises_the_hard_limit_to_the_need() -> None:
    assert limits_after(5000) == [5000, 5000, 5000]
