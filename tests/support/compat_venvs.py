"""Virtualenvs holding one third-party package from PyPI at an exact version, for tests that
drive dsec through the real client package (e2b) or harness (mini-swe-agent, harbor).

Each lives under ``$DSEC_COMPAT_VENVS`` (``/var/cache/dsec/compat-venvs``), is built on first
use and reused afterwards (a lock serialises concurrent builders; ``.complete`` marks a
finished build). ``with_dsec_deps`` also installs the dsec SDK's own pinned dependencies (read
from pyproject.toml), resolved together with the package as ``pip install dsec PACKAGE`` would,
so that a driver runs this checkout's SDK with ``PYTHONPATH=src``; the venv's name carries a
digest of those pins, so changing them builds a new one."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

VENVS = Path(os.environ.get("DSEC_COMPAT_VENVS", "/var/cache/dsec/compat-venvs"))
ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PIP_TIMEOUT_S = 900


def dsec_requirements() -> list[str]:
    """What ``pip install dsec`` (the SDK, no extras) installs besides dsec itself."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def compat_python(package: str, version: str, *, base: str | Path = sys.executable,
                  with_dsec_deps: bool = False, also: tuple[str, ...] = ()) -> Path:
    """The interpreter of a virtualenv made by ``base`` with exactly ``package==version``
    (and the SDK's dependencies with ``with_dsec_deps``; ``also``: pinned requirements the
    package needs but does not declare), built once."""
    extra = [*also, *(dsec_requirements() if with_dsec_deps else [])]
    name = f"{package}-{version}"
    if base != sys.executable:
        name += "-py" + subprocess.run([str(base), "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
                                       check=True, capture_output=True, text=True).stdout.strip()
    if extra:
        name += "+dsec-" + hashlib.sha256("\n".join(extra).encode()).hexdigest()[:12]
    root = VENVS / name
    python, done = root / "bin" / "python", root / ".complete"
    VENVS.mkdir(parents=True, exist_ok=True)
    with open(VENVS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done.exists() and python.exists()):
            shutil.rmtree(root, ignore_errors=True)
            subprocess.run([str(base), "-m", "venv", str(root)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            f"{package}=={version}", *extra], check=True, timeout=PIP_TIMEOUT_S)
            done.write_text("\n".join([f"{package}=={version}", *extra]) + "\n")
    return python
