"""An edge holds a pidfd per live sandbox: its process's soft limit on open files is raised to
the hard limit, or a node started from a shell or unit with the usual 1,024 stops near 1,000
sandboxes (issue 15's density)."""

import subprocess
import sys

PROGRAM = """
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
from dsec.substrates.host.pidwatch import PidWatch
PidWatch("/dsec-test")
print(*resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def test_a_watch_raises_the_soft_limit_to_the_hard_one() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          check=True)
    soft, hard = done.stdout.split()
    assert soft == hard
