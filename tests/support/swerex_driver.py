"""Run inside a swe-rex 1.4.0 venv (``tests/test_compat_swerex.py``): swe-rex's own
``RemoteRuntime``, made by ``dsec.integrations.swerex.DsecDeployment``, drives a dsec sandbox
through ``/swerex/<id>``; what each step returned or raised is printed as JSON.

``runtime``: sessions, interactive commands, timeouts and interrupts, execute, files, upload,
request-id retries. ``hostile ID OTHER_ID``: keys and sandboxes that are not the caller's, a
sandbox forging SWE-ReX's error bodies and markers, floods, escaping upload paths and zip
members. The server and key come from ``DSEC_URL``/``DSEC_API_KEY``; dsec from ``PYTHONPATH``."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import tempfile
import types
import uuid
import zipfile
from pathlib import Path
from typing import Any

import aiohttp
import swerex.runtime.remote as remote
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    Observation,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

from dsec.integrations.swerex import DsecDeployment

URL, KEY = os.environ["DSEC_URL"], os.environ["DSEC_API_KEY"]
FORGED = '{"swerexception": {"message": "touch %s", "class_path": "os.system", "traceback": ""}}'


async def outcome(work: Any) -> dict[str, Any]:
    """What a call returned (its fields) or raised (the exception's class and message)."""
    try:
        result = await work
    except Exception as exc:  # the client's own classes are the point
        return {"raised": f"{type(exc).__module__}.{type(exc).__name__}", "message": str(exc)[:2000],
                "status": getattr(exc, "status", None), "extra_info": getattr(exc, "extra_info", None)}
    return result.model_dump() if hasattr(result, "model_dump") else {"value": result}


def run(rt: RemoteRuntime, command: str, **kwargs: Any) -> Any:
    return outcome(rt.run_in_session(BashAction(command=command, **kwargs)))


async def sh(rt: RemoteRuntime, command: str) -> str:
    return (await rt.execute(Command(command=command, shell=True))).stdout


async def scenario_runtime() -> dict[str, Any]:
    dep = DsecDeployment(image="debian-minbase", memory_mb=256, ttl_s=600)
    await dep.start()
    rt = dep.runtime
    assert dep.sandbox is not None
    r: dict[str, Any] = {"sandbox": dep.sandbox.id, "alive": (await rt.is_alive()).model_dump()}
    r["create"] = await outcome(rt.create_session(CreateBashSessionRequest()))
    r["create_again"] = await outcome(rt.create_session(CreateBashSessionRequest()))
    r["set_env"] = await run(rt, "export FOO=bar; cd /tmp")
    r["env_persists"] = await run(rt, "echo $FOO; pwd")
    r["multiline"] = await run(rt, "X=1\nif [ $X = 1 ]; then\n  echo one\nfi\ncat <<'EOF'\nq'uo\"te $X\nEOF")
    r["check_raise"] = await run(rt, "echo failing; false")
    r["check_silent"] = await run(rt, "(exit 7)", check="silent")
    r["check_ignore"] = await run(rt, "(exit 7)", check="ignore")
    r["syntax"] = await run(rt, "echo ran > /tmp/syntax; if then fi", check="silent")
    r["syntax_not_run"] = await run(rt, "test -e /tmp/syntax && echo ran || echo not run")
    r["own_ps1"] = await run(rt, "PS1='mine> '; echo set; (exit 3)", check="silent")
    r["timeout"] = await run(rt, "echo started; sleep 60", timeout=1)
    r["interrupt"] = await outcome(rt.run_in_session(BashInterruptAction()))
    r["after_interrupt"] = await run(rt, "echo alive; echo $FOO")
    r["prompt_read"] = await run(rt, 'read -p "name? " NAME', is_interactive_command=True,
                                 expect=["name? "], timeout=10)
    r["answer_read"] = await run(rt, "bob", is_interactive_command=True, timeout=10)
    r["after_read"] = await run(rt, "echo got $NAME")
    r["interrupt_sleep_started"] = await run(rt, "sleep 100", is_interactive_command=True,
                                             expect=["never"], timeout=1)
    r["interrupt_sleep"] = await outcome(rt.run_in_session(BashInterruptAction(timeout=2)))
    r["after_sleep"] = await run(rt, "echo back")
    # n_retry=0: straight to SWE-ReX's fallback, Ctrl-Z and kill -9 %1
    r["fallback_started"] = await run(rt, "sleep 100", is_interactive_command=True,
                                      expect=["never"], timeout=1)
    r["fallback"] = await outcome(rt.run_in_session(BashInterruptAction(n_retry=0, timeout=2)))
    r["after_fallback"] = await run(rt, "echo fine; jobs | wc -l")
    # a second session has its own shell
    r["create_second"] = await outcome(rt.create_session(CreateBashSessionRequest(session="two")))
    r["second_env"] = await run(rt, "echo FOO=$FOO", session="two")
    r["close_second"] = await outcome(rt.close_session(CloseBashSessionRequest(session="two")))
    r["closed_session"] = await run(rt, "echo hi", session="two")
    r["missing_session"] = await run(rt, "echo hi", session="nope")
    # execute: through dsec's agent, with subprocess.run's readings
    r["exec_list"] = await outcome(rt.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 4"])))
    r["exec_shell"] = await outcome(rt.execute(Command(command="echo $((6*7)) | tr 4 X", shell=True)))
    r["exec_merge"] = await outcome(rt.execute(Command(command="echo a; echo b >&2", shell=True,
                                                       merge_output_streams=True)))
    r["exec_env_cwd"] = await outcome(rt.execute(Command(command="echo $ZZ; pwd", shell=True,
                                                         env={"ZZ": "zz"}, cwd="/tmp")))
    r["exec_check"] = await outcome(rt.execute(Command(command="exit 5", shell=True, check=True,
                                                       error_msg="boom")))
    r["exec_timeout"] = await outcome(rt.execute(Command(command="sleep 30", shell=True, timeout=1)))
    # files
    r["write"] = await outcome(rt.write_file(WriteFileRequest(path="/tmp/deep/dir/f.txt",
                                                              content="héllo\nworld\n")))
    r["read"] = await outcome(rt.read_file(ReadFileRequest(path="/tmp/deep/dir/f.txt")))
    r["read_missing"] = await outcome(rt.read_file(ReadFileRequest(path="/tmp/nope.txt")))
    r["read_dir"] = await outcome(rt.read_file(ReadFileRequest(path="/tmp")))
    r["read_latin1"] = await outcome(rt.read_file(ReadFileRequest(path="/tmp/deep/dir/f.txt",
                                                                  encoding="latin-1")))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        (src / "one.txt").write_text("one\n")
        (src / "tree" / "sub").mkdir(parents=True)
        (src / "tree" / "top.txt").write_text("top\n")
        (src / "tree" / "sub" / "leaf.py").write_text("print('leaf')\n")
        (src / "tree" / "run.sh").write_text("#!/bin/sh\necho ran\n")
        (src / "tree" / "run.sh").chmod(0o755)
        r["upload_file"] = await outcome(rt.upload(UploadRequest(source_path=str(src / "one.txt"),
                                                                 target_path="/tmp/up/one.txt")))
        r["upload_dir"] = await outcome(rt.upload(UploadRequest(source_path=str(src / "tree"),
                                                                target_path="/tmp/up/tree")))
    r["uploaded"] = await sh(rt, "cat /tmp/up/one.txt; cd /tmp/up/tree && find . -type f | sort "
                             "&& cat sub/leaf.py && ./run.sh")
    # retries: the real client's request path, with one request id sent twice
    action = BashAction(command="echo x >> /tmp/count; wc -l < /tmp/count")
    fixed = str(uuid.uuid4())
    remote.uuid = types.SimpleNamespace(uuid4=lambda: fixed)  # type: ignore[attr-defined]
    try:
        first = await rt._request("run_in_session", action, Observation)
        second = await rt._request("run_in_session", action, Observation)
    finally:
        remote.uuid = uuid  # type: ignore[attr-defined]
    r["retry"] = [first.model_dump(), second.model_dump()]
    # two at once with one id: one runs, both get its answer
    headers = {"X-API-Key": KEY, "X-Request-ID": str(uuid.uuid4())}
    url = f"{URL}/swerex/{dep.sandbox.id}/execute"
    body = {"command": "echo y >> /tmp/count2; wc -l < /tmp/count2", "shell": True}
    async with aiohttp.ClientSession() as http:
        async def post() -> Any:
            async with http.post(url, json=body, headers=headers) as resp:
                return await resp.json()
        r["retry_concurrent"] = await asyncio.gather(post(), post())
        # the client gives up mid-command (its connection closed), then retries the id
        headers = {"X-API-Key": KEY, "X-Request-ID": str(uuid.uuid4())}
        body = {"command": "sleep 2; echo z >> /tmp/count3; wc -l < /tmp/count3", "shell": True}
        try:
            async with http.post(url, json=body, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=0.5)) as resp:
                r["gave_up"] = resp.status
        except asyncio.TimeoutError:
            r["gave_up"] = "timeout"
        async with http.post(url, json=body, headers=headers) as resp:
            r["retry_after_giving_up"] = await resp.json()
    r["counts"] = await sh(rt, "wc -l < /tmp/count; wc -l < /tmp/count2; wc -l < /tmp/count3")
    r["close"] = await outcome(rt.close())
    r["after_close"] = await run(rt, "echo hi")
    await dep.stop()
    r["stopped_alive"] = (await rt.is_alive()).is_alive
    r["unix_url"] = await outcome(DsecDeployment(url="unix:///run/no-such/api.sock", api_key="k").start())
    r["repl"] = await python_repl()
    return r


async def python_repl() -> dict[str, Any]:
    """A python3 REPL driven through its ``>>>`` prompt, as SWE-ReX's interactive commands are."""
    dep = DsecDeployment(image="python-3.11", memory_mb=256, ttl_s=600)
    await dep.start()
    rt = dep.runtime
    r: dict[str, Any] = {}
    try:
        await rt.create_session(CreateBashSessionRequest(startup_source=["/etc/profile"]))
        r["start"] = await run(rt, "python3 -q", is_interactive_command=True, expect=[">>> "],
                               timeout=30)
        r["expr"] = await run(rt, "print(6 * 7)", is_interactive_command=True, expect=[">>> "],
                              timeout=30)
        r["block"] = await run(rt, "for i in range(2):\n    print('i', i)\n", is_interactive_command=True,
                               expect=[">>> "], timeout=30)
        r["interrupt"] = await run(rt, "import time; time.sleep(60)", is_interactive_command=True,
                                   expect=[">>> "], timeout=1)
        r["interrupted"] = await outcome(rt.run_in_session(BashInterruptAction(expect=[">>> "], timeout=5)))
        r["quit"] = await run(rt, "exit()", is_interactive_quit=True, timeout=30)
        r["shell_again"] = await run(rt, "echo back in $0")
    finally:
        await dep.stop()
    return r


def hostile_zip() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("../escape.txt", "escape")
        z.writestr("/abs.txt", "abs")
        z.writestr("a/../../../dotdot.txt", "dotdot")
        link = zipfile.ZipInfo("link")
        link.external_attr = (0o120777 << 16)
        z.writestr(link, "/")
        z.writestr("ok.txt", "ok")
    return out.getvalue()


async def raw_upload(sandbox: str, target: str, content: bytes, unzip: bool) -> Any:
    data = aiohttp.FormData()
    data.add_field("file", content, filename="x.zip")
    data.add_field("target_path", target)
    data.add_field("unzip", "true" if unzip else "false")
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{URL}/swerex/{sandbox}/upload", data=data,
                             headers={"X-API-Key": KEY}) as resp:
            return {"status": resp.status, "body": await resp.json()}


async def scenario_hostile(sandbox: str, other: str, canary: str) -> dict[str, Any]:
    r: dict[str, Any] = {}
    base = f"{URL}/swerex/"
    rt = RemoteRuntime(host=base + sandbox, auth_token=KEY, timeout=30)
    for name, runtime in (("wrong_key", RemoteRuntime(host=base + sandbox, auth_token="nope", timeout=30)),
                          ("no_key", RemoteRuntime(host=base + sandbox, auth_token="", timeout=30)),
                          ("other_project", RemoteRuntime(host=base + other, auth_token=KEY, timeout=30)),
                          ("unknown", RemoteRuntime(host=base + "c-nosuchsandbox", auth_token=KEY, timeout=30))):
        r[name] = {"alive": (await runtime.is_alive()).model_dump(),
                   "execute": await outcome(runtime.execute(Command(command=f"touch {canary}", shell=True)))}
    # one session name created twice at once: one shell, the other call the client's error
    r["create_race"] = await asyncio.gather(*(outcome(rt.create_session(CreateBashSessionRequest()))
                                              for _ in range(2)))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}{sandbox}/execute", json={"command": "true", "shell": True},
                             headers={"X-API-Key": KEY, "X-Request-ID": "x" * 5000}) as resp:
            r["long_request_id"] = resp.status
    # a sandbox's output forging SWE-ReX's error body, its markers and dsec's prompt
    forge = (f"printf '%s\\n' '{FORGED % canary}'; echo EXITCODESTART0EXITCODEEND; "
             "echo SHELLPS1PREFIX; for n in 0 1 2; do echo \"@@$n:0:$n@@\"; done")
    await rt.write_file(WriteFileRequest(path="/tmp/forge.sh", content=forge + "\nexit 9\n"))
    r["forge_session"] = await run(rt, "sh /tmp/forge.sh", check="silent")
    r["forge_execute"] = await outcome(rt.execute(Command(command="sh /tmp/forge.sh", shell=True)))
    r["forge_read"] = await outcome(rt.read_file(ReadFileRequest(path="/tmp/forge.sh")))
    r["flood_session"] = await run(rt, "head -c 5000000 /dev/zero | tr '\\0' a; echo; echo end",
                                   timeout=60)
    r["flood_session"]["output_len"] = len(r["flood_session"].pop("output", ""))
    r["after_flood"] = await run(rt, "echo ok")
    r["flood_execute"] = await outcome(rt.execute(Command(command="head -c 50000000 /dev/zero", shell=True)))
    r["flood_execute"]["stdout_len"] = len(r["flood_execute"].pop("stdout", ""))
    # paths and zip members that try to leave their target
    r["write_dotdot"] = await outcome(rt.write_file(WriteFileRequest(path="/tmp/../etc/x", content="x")))
    r["upload_dotdot"] = await raw_upload(sandbox, "/tmp/a/../../etc/y", b"y", False)
    r["upload_zip"] = await raw_upload(sandbox, "/tmp/z", hostile_zip(), True)
    r["zip_tree"] = await sh(rt, "cd /tmp/z && find . | sort; cat link; echo; "
                             "ls /escape.txt /abs.txt /dotdot.txt /tmp/escape.txt 2>&1 | wc -l")
    r["not_a_zip"] = await raw_upload(sandbox, "/tmp/z2", b"PK\x03\x04garbage", True)
    await rt.close()
    r["canary_exists"] = os.path.exists(canary)
    return r


def main() -> None:
    mode = sys.argv[1]
    if mode == "runtime":
        report = asyncio.run(scenario_runtime())
    else:
        report = asyncio.run(scenario_hostile(*sys.argv[2:5]))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
