"""Compile the agent (shipped as C source) into a per-source-hash cache directory."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ..config import current

SOURCE = Path(__file__).with_name("agent.c")
CFLAGS = ["-O2", "-static", "-Wall", "-Wextra"]


def agent_binary() -> Path:
    """Path of ``dsec-agent`` built from the current agent.c, compiling it once if needed.

    Lives at ``${DSEC_CACHE:-/var/cache/dsec}/agent/<sha256(source)[:16]>/dsec-agent``; an
    flock serialises concurrent builders and the binary appears by atomic rename.
    """
    source = SOURCE.read_bytes()
    cache = current().cache
    out_dir = cache / "agent" / hashlib.sha256(source).hexdigest()[:16]
    binary = out_dir / "dsec-agent"
    if binary.exists():
        return binary
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists():  # another process built it while we waited
            return binary
        gcc = shutil.which("gcc")
        if gcc is None:
            raise RuntimeError("cannot build dsec-agent: gcc not found on PATH (apt-get install gcc libc6-dev)")
        tmp = out_dir / f".dsec-agent.{os.getpid()}.tmp"
        proc = subprocess.run([gcc, *CFLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"cannot build dsec-agent: gcc exited {proc.returncode}:\n{proc.stderr}{proc.stdout}")
        os.replace(tmp, binary)
    return binary
