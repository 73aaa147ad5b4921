"""dsec's own files inside a sandbox: the agent, and the shell and tar the edge runs commands
and archives with, in a read-only directory the sandbox cannot change.

A sandbox may replace any program of its image (``/bin/sh``, ``tar``, ``python3``); if dsec ran
those, a fake shell would report ``exit 7`` as exit 0 and a fake tar an upload it never
extracted. So the edge only ever runs ``/.dsec/bin/sh`` and ``/.dsec/bin/tar`` (absolute paths,
never a name looked up in the sandbox's PATH):

- ``sh`` is mksh (the MirBSD Korn shell) built statically against musl, from Debian's mksh
  package: a static program loads no library and reads no ``LD_*`` variable or
  ``/etc/ld.so.preload``, so nothing of the image runs inside it (a glibc shell would load the
  image's libraries; a static glibc one would still load the image's NSS modules). It is POSIX
  with what agents' commands reach for beyond it: ``set -o pipefail``, ``trap ... EXIT``,
  ``[[ ]]``, ``local``, ``ulimit``.
- ``tar`` is an applet of the host's static busybox (busybox-static), a hard link named after
  it; dsec's scripts run other applets as ``/.dsec/bin/busybox mv``. Busybox's ash is not the
  shell: Debian builds it to prefer its applets over PATH, so a user's ``ls`` or ``grep``
  would silently become busybox's.

The directory is built once per content under ``$DSEC_CACHE/sandbox/<digest>/`` (as the agent
is) and holds ``agent``, ``bin/`` and ``run/`` (the mount point of the per-sandbox run dir).
Containers bind it read-only at ``/.dsec``; fn sandboxes get ``bin/`` in their read-only support
layer. What the command itself names (``python3 -m pytest``) is still the image's: see
docs/SECURITY.md.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from ..config import current
from ..protocol.errors import NotSupported
from .build import agent_binary

DSEC_DIR = "/.dsec"
AGENT_PATH = DSEC_DIR + "/agent"
RUN_DIR = DSEC_DIR + "/run"
BIN = DSEC_DIR + "/bin"
SHELL = BIN + "/sh"
TAR = BIN + "/tar"
BUSYBOX = BIN + "/busybox"

HOST_BUSYBOX = Path("/bin/busybox")
HOST_SHELL = Path("/usr/lib/x86_64-linux-musl/bin/mksh")
APPLETS = ("tar",)


def install_tools(dest: Path) -> None:
    """Make ``dest`` (absent) hold ``sh``, busybox and the applets: the contents of
    ``/.dsec/bin`` in every sandbox."""
    for host, package in ((HOST_BUSYBOX, "busybox-static"), (HOST_SHELL, "mksh")):
        if not host.is_file():
            raise NotSupported(f"dsec runs sandbox commands with its own tools and needs "
                               f"{host}: apt-get install {package}")
    dest.mkdir(parents=True)
    shutil.copyfile(HOST_SHELL, dest / "sh")
    shutil.copyfile(HOST_BUSYBOX, dest / "busybox")
    for name in ("sh", "busybox"):
        os.chmod(dest / name, 0o755)
    for applet in APPLETS:
        os.link(dest / "busybox", dest / applet)  # busybox picks the applet by its name


def sandbox_tree() -> Path:
    """The read-only directory mounted at ``/.dsec``, built once per content: the agent,
    ``bin/`` and the ``run/`` mount point. It appears by an atomic rename, whole or not at all."""
    agent = agent_binary()
    digest = hashlib.sha256()
    for part in (agent, HOST_SHELL, HOST_BUSYBOX, Path(__file__)):
        digest.update(part.read_bytes() if part.is_file() else b"")
    cache = current().cache / "sandbox"
    tree = cache / digest.hexdigest()[:16]
    if tree.is_dir():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{tree.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # our own half-made copy from an earlier crash
    try:
        install_tools(tmp / "bin")
        shutil.copyfile(agent, tmp / "agent")
        os.chmod(tmp / "agent", 0o755)
        (tmp / "run").mkdir()
        os.chmod(tmp, 0o755)
        os.rename(tmp, tree)
    except OSError:
        if not tree.is_dir():  # not another builder's rename that won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tree
