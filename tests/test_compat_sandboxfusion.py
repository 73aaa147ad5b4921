"""SandboxFusion compatibility: the real ``sandbox-fusion`` client (sync and async) and
verl-style direct HTTP calls against a real dsec server, each call in its own sandbox."""

from __future__ import annotations

import base64
import json
from typing import Iterator

import httpx
import pytest
import requests
import sandbox_fusion
from sandbox_fusion import (
    CommandRunStatus,
    RunCodeRequest,
    RunStatus,
    run_code,
    run_code_async,
    run_concurrent,
)

from conftest import Server, make_tcp_server, stop_server


@pytest.fixture(scope="module")
def sf_server(images: object) -> Iterator[Server]:
    srv = make_tcp_server("--capacity", "32").start()
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def endpoint(sf_server: Server) -> str:
    """The endpoint as a SandboxFusion user writes it: the dsec key as the URL's password."""
    host = sf_server.url.removeprefix("http://")
    return f"http://dsec:{sf_server.key}@{host}/sandboxfusion"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_python_with_stdin_files_and_fetch(endpoint: str) -> None:
    code = ("import sys\n"
            "name = sys.stdin.read().strip()\n"
            "print('hello', name, open('data/in.txt').read())\n"
            "open('out.txt', 'w').write(name[::-1])\n")
    r = run_code(RunCodeRequest(code=code, language="python", stdin="world",
                                files={"data/in.txt": b64("from a file")},
                                fetch_files=["out.txt", "not-there.txt"]),
                 endpoint=endpoint, max_attempts=1)
    assert r.status == RunStatus.Success and r.message == ""
    assert r.compile_result is None
    assert r.run_result.status == CommandRunStatus.Finished
    assert r.run_result.return_code == 0
    assert r.run_result.stdout == "hello world from a file\n" and r.run_result.stderr == ""
    assert 0 <= r.run_result.execution_time < 5
    assert r.files == {"out.txt": b64("dlrow")}


def test_failures_and_time_limit(endpoint: str) -> None:
    sandbox_fusion.set_endpoint(endpoint)  # the module-level configuration works too
    failed = run_code(RunCodeRequest(code="import sys; print('so far'); sys.exit(3)", language="python"),
                      max_attempts=1)
    assert failed.status == RunStatus.Failed
    assert failed.run_result.status == CommandRunStatus.Finished
    assert failed.run_result.return_code == 3 and failed.run_result.stdout == "so far\n"

    raised = run_code(RunCodeRequest(code="raise ValueError('boom')", language="python"), max_attempts=1)
    assert raised.status == RunStatus.Failed and "ValueError: boom" in raised.run_result.stderr

    slow = run_code(RunCodeRequest(code="import time\nprint('started', flush=True)\ntime.sleep(30)",
                                   language="python", run_timeout=1), max_attempts=1)
    assert slow.status == RunStatus.Failed
    assert slow.run_result.status == CommandRunStatus.TimeLimitExceeded
    assert slow.run_result.return_code is None
    assert slow.run_result.stdout == "started\n"
    assert 1 <= slow.run_result.execution_time < 5


def test_bash(endpoint: str) -> None:
    r = run_code(RunCodeRequest(code="read x; echo $((x * 7)); echo note >&2", language="bash", stdin="6\n"),
                 endpoint=endpoint, max_attempts=1)
    assert r.status == RunStatus.Success
    assert (r.run_result.stdout, r.run_result.stderr) == ("42\n", "note\n")


def test_missing_tool_chain_is_a_sandbox_error(endpoint: str, sf_server: Server) -> None:
    """C++ needs g++, which dsec's images lack: a SandboxError saying so, never Failed."""
    with pytest.raises(Exception, match="needs g\\+\\+"):
        run_code(RunCodeRequest(code="int main() { return 0; }", language="cpp"),
                 endpoint=endpoint, max_attempts=1)
    body = requests.post(f"{endpoint}/run_code", json={"code": "x", "language": "lua"}).json()
    assert body["status"] == "SandboxError" and "not supported" in body["message"]


def test_verl_style_direct_http(endpoint: str) -> None:
    """verl posts to the full /run_code URL with requests and reads the JSON itself."""
    payload = json.dumps({"compile_timeout": 5, "run_timeout": 5, "code": "print(input()[::-1])",
                          "stdin": "abc", "language": "python", "files": {}, "fetch_files": [],
                          "memory_limit_MB": 256})
    response = requests.post(f"{endpoint}/run_code", data=payload, timeout=30,
                             headers={"Content-Type": "application/json", "Accept": "application/json"})
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "Success"
    assert body["run_result"]["status"] == "Finished" and body["run_result"]["stdout"] == "cba\n"
    assert set(body) >= {"status", "message", "compile_result", "run_result", "files"}


async def test_async_client(endpoint: str) -> None:
    r = await run_code_async(RunCodeRequest(code="print(sum(range(10)))", language="python"),
                             endpoint=endpoint, max_attempts=1)
    assert r.status == RunStatus.Success and r.run_result.stdout == "45\n"


def test_concurrent_calls_each_get_a_fresh_sandbox(endpoint: str, sf_server: Server) -> None:
    code = ("import os\n"
            "print(os.path.exists('marker'))\n"
            "open('marker', 'w').write('x')\n")
    results = run_concurrent(run_code, kwargs=[
        {"request": RunCodeRequest(code=code, language="python"), "endpoint": endpoint,
         "max_attempts": 1} for _ in range(6)], concurrency=6)
    assert [r.run_result.stdout for r in results] == ["False\n"] * 6
    assert len({r.executor_pod_name for r in results}) == 6
    with sf_server.http(authenticated=True) as http:  # and every one of them is gone
        left = [s for s in http.get("/v1/sandboxes").json()
                if s["labels"].get("dsec.compat") == "sandboxfusion"]
    assert left == []


def test_auth_and_ping(sf_server: Server) -> None:
    base = f"{sf_server.url}/sandboxfusion"
    assert httpx.get(f"{base}/v1/ping").json() == "pong"
    unauthenticated = httpx.post(f"{base}/run_code", json={"code": "print(1)", "language": "python"})
    assert unauthenticated.status_code == 401
    bearer = httpx.post(f"{base}/run_code", json={"code": "print(1)", "language": "python"},
                        headers={"Authorization": f"Bearer {sf_server.key}"}, timeout=30)
    assert bearer.status_code == 200 and bearer.json()["run_result"]["stdout"] == "1\n"
    wrong = httpx.post(f"{base}/run_code", json={"code": "print(1)", "language": "python"},
                       auth=("dsec", "not-a-key"))
    assert wrong.status_code == 401
