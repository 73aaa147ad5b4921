"""SWE-ReX's remote-runtime protocol (``/swerex/<id>``), driven by the real swe-rex 1.4.0
``RemoteRuntime`` from PyPI (in its cached venv, ``support/swerex_driver.py``), made by
``dsec.integrations.swerex.DsecDeployment``: sessions, interactive commands, interrupts,
execute, files, upload, and request-id retries that do not run a command twice; then as a
hostile caller and a hostile sandbox would try it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Server, make_tcp_server, stop_server
from support.compat_venvs import SRC, compat_python
from test_projects import unique

SWEREX = "1.4.0"
AIOHTTP = "aiohttp==3.14.5"  # swe-rex imports it without declaring it (pyproject's swerex extra)
DRIVER = Path(__file__).parent / "support" / "swerex_driver.py"
PS1 = "SHELLPS1PREFIX"


def swerex_python() -> Path:
    return compat_python("swe-rex", SWEREX, with_dsec_deps=True, also=(AIOHTTP,))


def drive(server: Server, key: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "DSEC_URL": server.url, "DSEC_API_KEY": key, "PYTHONPATH": str(SRC),
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    done = subprocess.run([str(swerex_python()), str(DRIVER), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    # swe-rex prints the module and class of every exception it re-raises: the report is last
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_swerex_runtime(server: Server) -> dict[str, Any]:
    """The runtime scenario on ``server`` (also run under Ray: test_cluster_parity)."""
    return drive(server, server.key, "runtime")


@pytest.fixture(scope="module")
def swerex_server(images: object) -> Iterator[Server]:
    srv = make_tcp_server("--capacity", "16").start()
    yield srv
    stop_server(srv)


def obs(output: str, exit_code: int | None = 0, expect: str = PS1) -> dict[str, Any]:
    return {"output": output, "exit_code": exit_code, "failure_reason": "", "expect_string": expect,
            "session_type": "bash"}


def raised(name: str, message: str | None = None) -> Any:
    class Raised:
        def __eq__(self, other: object) -> bool:
            return (isinstance(other, dict) and other.get("raised") == name
                    and (message is None or message in other.get("message", "")))

        def __repr__(self) -> str:
            return f"raised({name!r}, {message!r})"
    return Raised()


def test_runtime(swerex_server: Server) -> None:
    check_runtime(run_swerex_runtime(swerex_server))


def check_runtime(r: dict[str, Any]) -> None:
    assert r["alive"] == {"is_alive": True, "message": ""}
    assert r["create"] == {"output": "", "session_type": "bash"}
    assert r["create_again"] == raised("swerex.exceptions.SessionExistsError")
    # a session keeps its shell: env and cwd persist; one line per command whatever it holds
    assert r["set_env"] == obs("")
    assert r["env_persists"] == obs("bar\n/tmp\n")
    assert r["multiline"] == obs("one\nq'uo\"te $X\n")
    # check: raise (the client's own class), silent, ignore
    assert r["check_raise"] == raised("swerex.exceptions.NonZeroExitCodeError", "'failing\\n'")
    assert r["check_silent"] == obs("", 7)
    assert r["check_ignore"] == obs("", None)
    # a command that does not parse is SWE-ReX's BashIncorrectSyntaxError, and nothing of it runs
    assert r["syntax"] == raised("swerex.exceptions.BashIncorrectSyntaxError", "syntax error")
    assert "syntax error" in r["syntax"]["extra_info"]["bash_stderr"]  # SWE-agent's template reads it
    assert r["syntax_not_run"] == obs("not run\n")
    assert r["own_ps1"] == obs("set\n", 3)  # a command's own PS1 does not hide the prompt
    # timeout, then an interrupt returns the session to its prompt with the output so far
    assert r["timeout"] == raised("swerex.exceptions.CommandTimeoutError", "1.0 seconds")
    assert r["interrupt"] == obs("started")
    assert r["after_interrupt"] == obs("alive\nbar\n")
    # interactive: wait for the program's prompt, answer it, back at the shell's prompt
    assert r["prompt_read"] == obs("", 0, "name? ")
    assert r["answer_read"] == obs("")
    assert r["after_read"] == obs("got bob\n")
    assert r["interrupt_sleep_started"] == raised("swerex.exceptions.CommandTimeoutError")
    assert r["interrupt_sleep"] == obs("")
    assert r["after_sleep"] == obs("back\n")
    assert r["fallback_started"] == raised("swerex.exceptions.CommandTimeoutError")
    assert r["fallback"]["exit_code"] == 0 and r["fallback"]["expect_string"] == PS1
    assert "Killed" in r["fallback"]["output"] + r["after_fallback"]["output"]  # bash's notice
    assert "fine" in r["after_fallback"]["output"].splitlines()
    # sessions are separate shells; a closed or unknown one is the client's own error
    assert r["create_second"] == {"output": "", "session_type": "bash"}
    assert r["second_env"] == obs("FOO=\n")
    assert r["close_second"] == {"session_type": "bash"}
    assert r["closed_session"] == raised("swerex.exceptions.SessionDoesNotExistError", "'two'")
    assert r["missing_session"] == raised("swerex.exceptions.SessionDoesNotExistError", "'nope'")
    # execute, as subprocess.run reads its arguments
    assert r["exec_list"] == {"stdout": "out\n", "stderr": "err\n", "exit_code": 4}
    assert r["exec_shell"] == {"stdout": "X2\n", "stderr": "", "exit_code": 0}
    assert r["exec_merge"] == {"stdout": "a\nb\n", "stderr": "", "exit_code": 0}
    assert r["exec_env_cwd"] == {"stdout": "zz\n/tmp\n", "stderr": "", "exit_code": 0}
    assert r["exec_check"] == raised("swerex.exceptions.NonZeroExitCodeError", "boom: ")
    assert r["exec_timeout"] == raised("swerex.exceptions.CommandTimeoutError")
    # files
    assert r["write"] == {}
    assert r["read"] == {"content": "héllo\nworld\n"}
    assert r["read_latin1"] == {"content": "héllo\nworld\n".encode().decode("latin-1")}
    assert r["read_missing"] == raised("builtins.FileNotFoundError", "/tmp/nope.txt")
    assert r["read_dir"] == raised("builtins.IsADirectoryError")
    # upload: a file, and a directory (zipped by the client, unzipped in the sandbox)
    assert r["upload_file"] == r["upload_dir"] == {}
    assert r["uploaded"] == "one\n./run.sh\n./sub/leaf.py\n./top.txt\nprint('leaf')\nran\n"
    # one request id, sent twice (in turn, and at once): run once, answered alike
    assert r["retry"] == [obs("1\n"), obs("1\n")]
    assert r["retry_concurrent"][0] == r["retry_concurrent"][1] == {
        "stdout": "1\n", "stderr": "", "exit_code": 0}
    assert r["gave_up"] == "timeout"
    assert r["retry_after_giving_up"] == {"stdout": "1\n", "stderr": "", "exit_code": 0}
    assert r["counts"] == "1\n1\n1\n"
    assert r["close"] == {}
    assert r["after_close"] == raised("swerex.exceptions.SessionDoesNotExistError")
    assert r["stopped_alive"] is False  # the deployment stopped its sandbox
    assert r["unix_url"] == raised("builtins.ValueError", "http(s) URL")  # RemoteRuntime needs HTTP
    # a python3 REPL: its prompt as the expect string, a block, an interrupt, back to bash
    repl = r["repl"]
    assert repl["start"] == obs("", 0, ">>> ")
    assert repl["expr"] == obs("42", 0, ">>> ")  # trimmed, as SWE-ReX trims interactive output
    assert repl["block"]["output"].replace("... ", "") == "i 0\ni 1"
    assert repl["interrupt"] == raised("swerex.exceptions.CommandTimeoutError")
    assert repl["interrupted"]["expect_string"] == ">>> "
    assert "KeyboardInterrupt" in repl["interrupted"]["output"]
    assert repl["quit"] == obs("")
    assert repl["shell_again"] == obs("back in bash\n")


async def _two_projects(server: Server) -> tuple[str, str, str]:
    """(my key, a sandbox of mine, a sandbox of another project)."""
    async with server.client() as admin:
        keys = []
        for prefix in ("swerex-mine", "swerex-theirs"):
            name = unique(prefix)
            await admin.projects().create(name, sandboxes=4, cpu=8, memory_mb=2048)
            keys.append((await admin.projects().create_key(name, "sdk")).key)
    ids = []
    for key in keys:
        async with type(admin)(server.url, key, autostart=False) as client:
            ids.append((await client.create(image="debian-minbase", memory_mb=256, ttl_s=600)).id)
    return keys[0], ids[0], ids[1]


def test_hostile(swerex_server: Server, tmp_path: Path) -> None:
    key, mine, theirs = asyncio.run(_two_projects(swerex_server))
    canary = str(tmp_path / "pwned")
    r = drive(swerex_server, key, "hostile", mine, theirs, canary)
    # keys and sandboxes that are not the caller's: refused in FastAPI's shape, nothing run
    for name, status in (("wrong_key", 401), ("no_key", 403), ("other_project", 404),
                         ("unknown", 404)):
        assert r[name]["alive"]["is_alive"] is False
        assert f"Status code {status}" in r[name]["alive"]["message"], name
        assert r[name]["execute"]["raised"] == "aiohttp.client_exceptions.ClientResponseError"
        assert r[name]["execute"]["status"] == status
    assert sorted(str(o.get("raised")) for o in r["create_race"]) == [
        "None", "swerex.exceptions.SessionExistsError"]
    assert r["long_request_id"] == 422
    # a sandbox printing SWE-ReX's error body, its exit-code markers and prompts of dsec's
    # shape: plain output, its real exit code, no exception, nothing run on the client
    for output in (r["forge_session"]["output"], r["forge_execute"]["stdout"]):
        assert '"class_path": "os.system"' in output and "EXITCODESTART0EXITCODEEND" in output
        assert "@@2:0:2@@" in output
    assert r["forge_session"]["exit_code"] == 9
    assert r["forge_execute"]["exit_code"] == 9 and "raised" not in r["forge_execute"]
    assert "os.system" in r["forge_read"]["content"]
    assert r["canary_exists"] is False
    # floods: capped, the session still answers
    assert r["flood_session"]["exit_code"] == 0
    assert r["flood_session"]["output_len"] < 1_200_000
    assert r["after_flood"] == obs("ok\n")
    assert r["flood_execute"]["exit_code"] == 0 and r["flood_execute"]["stdout_len"] < 50_000_000
    # escaping paths are refused; zip members land under the target, links as plain files
    assert r["write_dotdot"] == raised("builtins.ValueError", "'..'")
    assert r["upload_dotdot"]["status"] == 511
    assert r["upload_dotdot"]["body"]["swerexception"]["class_path"] == "builtins.ValueError"
    assert r["upload_zip"] == {"status": 200, "body": {}}
    assert r["zip_tree"] == (".\n./a\n./a/dotdot.txt\n./abs.txt\n./escape.txt\n./link\n"
                             "./ok.txt\n/\n4\n")
    assert r["not_a_zip"]["status"] == 511
    assert r["not_a_zip"]["body"]["swerexception"]["class_path"] == "swerex.exceptions.SwerexException"


async def test_a_trajectory_logs_what_swerex_runs(swerex_server: Server) -> None:
    """A sandbox attached to a trajectory: the front-end's calls are the trajectory's steps
    (through the router's recorded edge, as the E2B front-end's are)."""
    trajectory = unique("swerex-traj")
    async with swerex_server.client() as client:
        sb = await client.create(image="debian-minbase", memory_mb=256, ttl_s=300,
                                 trajectory=trajectory)
        base, key = f"/swerex/{sb.id}", {"X-API-Key": swerex_server.key}
        async with httpx.AsyncClient(base_url=swerex_server.url, headers=key, timeout=60) as http:
            async def post(route: str, body: dict[str, Any]) -> Any:
                response = await http.post(f"{base}/{route}", json=body)
                assert response.status_code == 200, response.text
                return response.json()
            assert (await post("write_file", {"path": "/tmp/t.txt", "content": "hi"})) == {}
            assert (await post("execute", {"command": "cat /tmp/t.txt", "shell": True}))["stdout"] == "hi"
            await post("create_session", {})
            assert (await post("run_in_session", {"command": "echo $((1+2))", "action_type": "bash"}))["output"] == "3\n"
            await post("close", {})
        ops = [step.op for step in await client.trajectory_steps(trajectory)]
        await sb.stop()
    assert ops[:2] == ["write", "exec"], ops
    assert {"pty", "stdin", "output"} <= set(ops), ops  # the terminal, its input and output


SURROGATE = '"\\udc80"'  # JSON text for a lone surrogate


async def test_non_finite_numbers_and_lone_surrogates_are_422(swerex_server: Server) -> None:
    """Bodies no SWE-ReX client sends but a hostile caller could: FastAPI's 422 with a detail,
    nothing run, nothing echoed that is not text; the sandbox answers as before."""
    async with swerex_server.client() as client:
        sb = await client.create(image="debian-minbase", memory_mb=256, ttl_s=300)
        headers = {"X-API-Key": swerex_server.key, "content-type": "application/json"}
        async with httpx.AsyncClient(base_url=f"{swerex_server.url}/swerex/{sb.id}", headers=headers,
                                     timeout=60) as http:
            assert (await http.post("/create_session", content=b"{}")).status_code == 200
            touch = '"touch /tmp/ran"'
            for route, body in (
                    ("execute", f'{{"command": {touch}, "shell": true, "timeout": Infinity}}'),
                    ("execute", f'{{"command": {touch}, "shell": true, "timeout": NaN}}'),
                    ("execute", f'{{"command": {touch}, "shell": true, "env": {{"A": {SURROGATE}}}}}'),
                    ("execute", f'{{"command": [{SURROGATE}]}}'),
                    ("run_in_session", f'{{"command": {touch}, "timeout": Infinity, "action_type": "bash"}}'),
                    ("run_in_session", f'{{"command": {SURROGATE}, "action_type": "bash"}}'),
                    ("run_in_session", f'{{"command": {touch}, "action_type": "other"}}'),
                    ("write_file", f'{{"path": "/tmp/ran", "content": {SURROGATE}}}'),
                    ("write_file", f'{{"path": {SURROGATE}, "content": "x"}}'),
                    ("read_file", f'{{"path": "/etc/hostname", "encoding": {SURROGATE}}}'),
                    ("create_session", f'{{"session": {SURROGATE}}}'),
                    ("create_session", '{"startup_timeout": -Infinity}'),
                    ("execute", "not json")):
                answer = await http.post(f"/{route}", content=body.encode())
                assert answer.status_code == 422, (route, body, answer.text)
                assert "detail" in answer.json()
            ran = await http.post("/execute", json={"command": "test -e /tmp/ran; echo $?", "shell": True})
            assert ran.json()["stdout"] == "1\n"
        await sb.stop()
