"""The SDK alone (``pip install dsec``, no extras) on the oldest and newest Pythons it supports:
a wheel of this checkout goes into a fresh venv of pyenv's 3.10 and 3.13, which then drives a
real sandbox of the test server (``support/sdk_driver.py``), async and blocking, and finds
that the server's dependencies were never installed and none of its modules were loaded. The
``dsec`` command of that install serves the client commands and refuses ``serve`` with exit
code 3, naming the ``server`` extra, which the SDK's autostart of a local server reports as
``NotSupported`` at once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Server

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).parent / "support" / "sdk_driver.py"
PYENV = Path.home() / ".pyenv" / "versions"
PIP_TIMEOUT_S = 600


def _interpreter(minor: str) -> Path | None:
    found = sorted(PYENV.glob(f"3.{minor}.*/bin/python3"))
    return found[-1] if found else None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout, built from a copy (the build writes beside its sources)."""
    source = tmp_path_factory.mktemp("source")
    shutil.copytree(ROOT / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(source)], check=True, timeout=PIP_TIMEOUT_S)
    (built,) = out.glob("dsec-*.whl")
    return built


@pytest.mark.parametrize("minor", ["10", "13"])
def test_sdk_alone_drives_a_sandbox(minor: str, wheel: Path, server: Server,
                                    tmp_path: Path) -> None:
    python = _interpreter(minor)
    if python is None:
        pytest.skip(f"no Python 3.{minor} under {PYENV} (pyenv provides it on dsec's machines)")
    venv = tmp_path / "venv"
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
                   check=True, timeout=PIP_TIMEOUT_S)

    done = subprocess.run([str(venv / "bin" / "python"), str(DRIVER), server.url, server.key],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["python"] == [3, int(minor)]
    assert report["server_modules_installed"] == []
    assert report["async"] == {"stdout": "hi-42\n", "stderr": "err\n", "exit_code": 3,
                               "read": "written by the SDK\n", "listed": True,
                               "after_stop": "SandboxNotFound"}
    assert report["sync"] == {"hostname_is_id": True}
    foreign = [m for m in report["dsec_modules_loaded"]
               if m != "dsec" and not m.startswith(("dsec.client", "dsec.protocol"))]
    assert foreign == []

    env = {**os.environ, "DSEC_URL": server.url, "DSEC_API_KEY": server.key}
    listed = subprocess.run([str(venv / "bin" / "dsec"), "ls"], env=env, capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    refused = subprocess.run([str(venv / "bin" / "dsec"), "serve", "--state-dir",
                              str(tmp_path / "state")], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "dsec serve needs the server: pip install 'dsec[server]'" in refused.stderr

    autostart = ("import asyncio, dsec\n"
                 "async def main():\n"
                 "    async with dsec.DSecClient() as client:\n"
                 "        await client.list()\n"
                 "try:\n"
                 "    asyncio.run(main())\n"
                 "except dsec.NotSupported as exc:\n"
                 "    print(exc.message)\n")
    local = {k: v for k, v in os.environ.items() if k not in ("DSEC_URL", "DSEC_API_KEY")}
    started = subprocess.run([str(venv / "bin" / "python"), "-c", autostart], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path,
                             env={**local, "DSEC_STATE_DIR": str(tmp_path / "local")})
    assert started.returncode == 0, started.stderr
    assert "needs the server: pip install 'dsec[server]'" in started.stdout
