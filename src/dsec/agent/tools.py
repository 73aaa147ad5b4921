"""dsec's own files inside a sandbox: the agent, and the shell and tar the edge runs commands
and archives with, in a read-only directory the sandbox cannot change.

A sandbox may replace any program of its image (``/bin/sh``, ``tar``, ``python3``); if dsec ran
those, a fake shell would report ``exit 7`` as exit 0 and a fake tar an upload it never
extracted. So the edge only ever runs ``/.dsec/bin/sh`` and ``/.dsec/bin/tar`` (absolute paths,
never a name looked up in the sandbox's PATH):

- ``sh`` is dash (what Debian's /bin/sh is) built against klibc, from klibc-utils. klibc's one
  shared object is the program's interpreter, and it reads no file and no ``LD_*`` variable;
  the copy here names ``/.dsec/bin/klibc.so`` as its interpreter. A glibc shell would load the
  image's libraries and obey the image's ``/etc/ld.so.preload``, both writable by the sandbox.
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
import struct
from pathlib import Path

from ..client.errors import NotSupported
from .build import agent_binary

DSEC_DIR = "/.dsec"
AGENT_PATH = DSEC_DIR + "/agent"
RUN_DIR = DSEC_DIR + "/run"
BIN = DSEC_DIR + "/bin"
SHELL = BIN + "/sh"
TAR = BIN + "/tar"
BUSYBOX = BIN + "/busybox"
KLIBC = BIN + "/klibc.so"  # the interpreter named by SHELL

HOST_BUSYBOX = Path("/bin/busybox")
HOST_DASH = Path("/usr/lib/klibc/bin/sh")
APPLETS = ("tar",)
_PT_INTERP = 3


def install_tools(dest: Path) -> None:
    """Make ``dest`` (absent) hold ``sh``, its interpreter, busybox and the applets: the
    contents of ``/.dsec/bin`` in every sandbox."""
    for host, package in ((HOST_BUSYBOX, "busybox-static"), (HOST_DASH, "klibc-utils")):
        if not host.is_file():
            raise NotSupported(f"dsec runs sandbox commands with its own tools and needs "
                               f"{host}: apt-get install {package}")
    dash = HOST_DASH.read_bytes()
    offset, size, interp = _interpreter(dash)
    new = KLIBC.encode()
    if len(new) >= size:
        raise NotSupported(f"{HOST_DASH}'s interpreter field is too short for {KLIBC}")
    dest.mkdir(parents=True)
    shutil.copyfile(interp, dest / "klibc.so")
    (dest / "sh").write_bytes(dash[:offset] + new.ljust(size, b"\0") + dash[offset + size:])
    shutil.copyfile(HOST_BUSYBOX, dest / "busybox")
    for name in ("klibc.so", "sh", "busybox"):
        os.chmod(dest / name, 0o755)
    for applet in APPLETS:
        os.link(dest / "busybox", dest / applet)  # busybox picks the applet by its name


def _interpreter(elf: bytes) -> tuple[int, int, Path]:
    """(offset, size, path) of the PT_INTERP of a little-endian 64-bit ELF."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise NotSupported(f"{HOST_DASH} is not a little-endian 64-bit ELF program")
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        at = phoff + i * phentsize
        if struct.unpack_from("<I", elf, at)[0] == _PT_INTERP:
            offset, = struct.unpack_from("<Q", elf, at + 8)
            size, = struct.unpack_from("<Q", elf, at + 32)
            return offset, size, Path(elf[offset:offset + size].rstrip(b"\0").decode())
    raise NotSupported(f"{HOST_DASH} has no program interpreter (klibc-utils changed?)")


def sandbox_tree() -> Path:
    """The read-only directory mounted at ``/.dsec``, built once per content: the agent,
    ``bin/`` and the ``run/`` mount point. It appears by an atomic rename, whole or not at all."""
    agent = agent_binary()
    digest = hashlib.sha256()
    for part in (agent, HOST_DASH, HOST_BUSYBOX, Path(__file__)):
        digest.update(part.read_bytes() if part.is_file() else b"")
    cache = Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec")) / "sandbox"
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
