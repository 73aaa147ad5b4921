"""The harness integrations shipped in ``dsec.integrations``, driven by the real harnesses from
PyPI against the session's dsec server: mini-swe-agent's agent loop with a scripted model
completes a task through ``minisweagent.DsecEnvironment``, and harbor's factory runs a task's
environment (start, exec, uploads and downloads, network phases, stop) through
``harbor:DsecEnvironment``, and a whole harbor Trial (oracle agent, verifier, per-phase
network) runs on it, including a sandbox that plants traps in a directory harbor downloads.

Each harness lives in its own cached venv (``support/compat_venvs.py``) with the SDK's pinned
dependencies, and imports this checkout's dsec from ``PYTHONPATH``: what a user has after
``pip install dsec mini-swe-agent`` (or ``harbor``)."""

from __future__ import annotations

import json
import os
import subprocess
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import pytest

from conftest import Server
from support.compat_venvs import SRC, compat_python

MINI_SWE_AGENT = "2.4.6"
HARBOR = "0.26.0"
PYENV = Path.home() / ".pyenv" / "versions"
SUPPORT = Path(__file__).parent / "support"
CAP = 1 << 20  # the mini-swe-agent driver's max_output_bytes


def harness_env(server: Server, home: Path) -> dict[str, str]:
    """What a user sets: dsec's URL and key; dsec importable; the harness's config at home."""
    return {**os.environ, "DSEC_URL": server.url, "DSEC_API_KEY": server.key,
            "PYTHONPATH": str(SRC), "HOME": str(home), "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"), "PYTHONFAULTHANDLER": "1"}


def drive(python: Path, driver: str, env: dict[str, str], *args: str) -> dict[str, Any]:
    done = subprocess.run([str(python), str(SUPPORT / driver), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def run_mini_swe_agent(server: Server, home: Path) -> dict[str, Any]:
    """mini-swe-agent's agent loop on ``server`` (also run under Ray: test_cluster_parity)."""
    python = compat_python("mini-swe-agent", MINI_SWE_AGENT, with_dsec_deps=True)
    return drive(python, "minisweagent_driver.py", harness_env(server, home))


def test_mini_swe_agent_completes_a_task(server: Server, tmp_path: Path) -> None:
    check_mini_swe_agent_run(run_mini_swe_agent(server, tmp_path))


def check_mini_swe_agent_run(mini: dict[str, Any]) -> None:
    assert mini["env_type"] == mini["serialized_type"] == \
        "dsec.integrations.minisweagent.DsecEnvironment"
    assert mini["result"] == {"exit_status": "Submitted", "submission": "hi world\n"}
    # mini-swe-agent's default templates render with the sandbox's uname
    assert "<system_information>\nLinux " in mini["instance_message"]
    assert mini["template_vars"] == {"sandbox_id": mini["sandbox"], "system": "Linux",
                                     "machine": "x86_64", "image": "debian-minbase"}
    first, second, timed_out, flood, forged = mini["observations"][:5]
    assert "<returncode>0</returncode>" in first and "/tmp/work" in first
    # stdout and stderr merged in order, the exit code kept
    assert "<returncode>3</returncode>" in second and "hi world\nto-stderr\n" in second
    assert "<returncode>-1</returncode>" in timed_out and "timed out" in timed_out
    assert "forged" in forged and "<returncode>1</returncode>" in forged  # no early submit
    # the flood: capped at 1 MiB (the template then tells the model it was too long)
    assert "too long" in flood and CAP < mini["flood_bytes"] < CAP + 4096
    assert mini["direct"] == {"output": "hi from /\n", "returncode": 0, "exception_info": ""}
    assert mini["after_cleanup"] == "SandboxNotFound"


async def test_mini_swe_agent_sandbox_stops_at_exit(server: Server, tmp_path: Path) -> None:
    """A script that never calls ``cleanup()`` exits (no hang on the SDK's loop thread) and its
    sandbox is stopped."""
    python = compat_python("mini-swe-agent", MINI_SWE_AGENT, with_dsec_deps=True)
    done = drive(python, "minisweagent_driver.py", harness_env(server, tmp_path),
                 "--exit-without-cleanup")
    assert done["ran"]["output"] == "hi\n"
    async with server.client() as client:
        assert done["sandbox"] not in {s.id for s in await client.list()}


def harbor_python() -> Path:
    found = sorted(PYENV.glob("3.1[2-9].*/bin/python3"))
    if not found:
        pytest.skip(f"harbor needs Python >= 3.12; none under {PYENV} (pyenv provides it on "
                    "dsec's machines)")
    return compat_python("harbor", HARBOR, base=found[0], with_dsec_deps=True)


@pytest.fixture(scope="module")
def harbor(server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = harbor_python()
    home = tmp_path_factory.mktemp("harbor-home")
    return drive(python, "harbor_driver.py", harness_env(server, home),
                 str(tmp_path_factory.mktemp("harbor-scratch")))


def test_harbor_trial_with_the_oracle_agent(harbor: dict[str, Any]) -> None:
    """harbor's own Trial: the oracle agent solves, the verifier rewards, the logs come back;
    the agent phase ran without network, the verifier phase with the task's allowlist."""
    assert harbor["trial"]["exception"] is None
    assert harbor["trial"]["rewards"] == {"reward": 1.0}
    assert harbor["trial"]["routes"]["agent"] == "0\n"
    assert int(harbor["trial"]["routes"]["verifier"]) > 0


def test_harbor_task_lifecycle(harbor: dict[str, Any]) -> None:
    assert harbor["type"] == "dsec.integrations.harbor:DsecEnvironment"
    assert harbor["sandbox_network"] == "none"  # the agent phase: no network
    assert harbor["exec"] == ["/\ntask x\n", "err\n", 4]  # cwd, task and call env, stderr apart
    assert harbor["workdir"] == "/app\n"
    # streamed to a trial's callback as it came; a character split across chunks stays whole,
    # a sequence cut at the end arrives as a replacement character
    streamed = harbor["streamed"]
    assert [t for s, t in streamed["chunks"] if s == "stdout"] == ["1\n", "2\n", "3\n"]
    assert "".join(t for s, t in streamed["chunks"] if s == "stderr") == "\u00e9\n\ufffd"
    assert streamed["result"] == ["1\n2\n3\n", "\u00e9\n\ufffd"]
    assert harbor["timeout"]["raised"] == "CommandTimeout" and harbor["timeout"]["timeout_error"]
    assert harbor["other_user"] == ["agent\n/home/agent task\n/tmp\n", True, 1]  # as docker -u
    assert harbor["default_user"] == "agent\n"
    assert harbor["uid_user"]["raised"] == "NotSupported"
    assert harbor["uploaded"] == ["verifying\nnested\nverifying\n", 0]  # modes kept
    assert harbor["downloaded"] == ["1\n", ["n", "n/x.txt", "reward.txt"]]
    assert harbor["is_dir"] == [True, True, False]
    assert harbor["network_verifier"]["allow"] == ["10.9.8.7"]  # the verifier phase's policy
    assert harbor["network_back"] == "none"


def test_hostile_harbor_public_network_is_not_the_host(harbor: dict[str, Any]) -> None:
    """harbor's "public" mode: the internet, not the host, its LAN or the cloud's metadata
    service."""
    public = [IPv4Network(rule) for rule in harbor["network_public"]]
    for inside in ("127.0.0.1", "10.1.2.3", "172.17.0.1", "192.168.1.1", "169.254.169.254",
                   "100.64.0.1"):
        assert not any(IPv4Address(inside) in net for net in public), inside
    for outside in ("1.1.1.1", "8.8.8.8", "151.101.0.223"):
        assert any(IPv4Address(outside) in net for net in public), outside
    assert "No route to host" in harbor["public_to_host"]
    assert "Connection refused" in harbor["allowed_to_host"]  # the probe tells them apart
    assert harbor["exec_after_stop"]["raised"] == "RuntimeError"


def test_harbor_refuses_what_dsec_cannot_do(harbor: dict[str, Any]) -> None:
    assert harbor["dockerfile"]["raised"] == "NotSupported"
    assert "issue 16" in harbor["dockerfile"]["message"]
    assert harbor["bad_option"]["raised"] == "ValueError"
    assert "nope" in harbor["bad_option"]["message"]
    assert harbor["wildcard"]["raised"] == "ValueError"  # harbor's own check of capabilities


def test_hostile_harbor_download_stays_in_its_destination(harbor: dict[str, Any]) -> None:
    """Symlinks to the host and a directory swapped for a symlink: nothing outside changes."""
    assert harbor["trap_symlinks"]["raised"] == "UnsafeArchive"
    # the sandbox's own tar resolves the link inside the sandbox, where the host path is not
    assert harbor["trap_dir_link"]["raised"] == "InvalidRequest"
    assert harbor["outside_after"] == ["victim.txt"]
    assert harbor["victim_after"] == "untouched\n"
    flood_chars, code = harbor["flood"]
    assert code == 0 and flood_chars < 64 << 20  # capped by the server


def test_hostile_harbor_filtered_downloads_ignore_the_images_tar(harbor: dict[str, Any]) -> None:
    """harbor's own filtered downloads would pack with the image's tar; the sandbox replaced
    it by one that hands over a forged archive. dsec's environment downloads the real files
    through its checked extraction, filters them, and refuses a symlink out."""
    assert harbor["filtered"] == {"dl-excluded": {"a.txt": "real\n"},
                                  "dl-filtered": {"a.txt": "real\n"},
                                  "dl-control": {"a.txt": "forged\n"}}  # harbor's own: forged
    assert harbor["filtered_trap"]["raised"] == "UnsafeArchive"
