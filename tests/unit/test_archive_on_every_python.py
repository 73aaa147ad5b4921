"""The archive extractor must behave the same on every Python the SDK supports (the stdlib's
tarfile filters differ between them, which is why dsec does not rely on them): run its unit
tests on the oldest and newest interpreters pyenv has on this machine kind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("stdlib_runner.py")
PYENV = Path.home() / ".pyenv" / "versions"


def _interpreter(minor: str) -> Path | None:
    found = sorted(PYENV.glob(f"3.{minor}.*/bin/python3"))
    return found[-1] if found else None


@pytest.mark.parametrize("minor", ["10", "13"])
def test_extractor_on_oldest_and_newest_python(minor: str) -> None:
    python = _interpreter(minor)
    if python is None:
        pytest.skip(f"no Python 3.{minor} under {PYENV} (pyenv provides it on dsec's machines)")
    done = subprocess.run([str(python), str(RUNNER)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout and " 0 failed" in done.stdout, done.stdout
