"""E2B compatibility: the real ``e2b`` SDK, in every version of the matrix, drives a real dsec
server end to end (sync and async clients, public API only), plus the Connect protocol on
the wire (binary protobuf, keepalives) and the gateway's refusals.

Each SDK version lives in its own virtualenv under ``$DSEC_COMPAT_VENVS``
(``/var/cache/dsec/compat-venvs``), built on first use from PyPI and reused afterwards; it
runs ``tests/support/compat_e2b_driver.py``, which reports what each step observed as JSON.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import Server, make_tcp_server, stop_server
from support.compat_venvs import compat_python
from test_projects import unique

DISK = 1024 << 20  # an E2B sandbox's disk (dsec's default disk_mb): what a snapshot of it holds

# The compatibility matrix: the oldest SDK generation served (a vendored Connect client on
# httpcore, protobuf's json_format) and the newest (connectrpc on pyqwest, protobuf-py).
E2B_VERSIONS = ["2.20.0", "2.63.0"]
DRIVER = Path(__file__).parent / "support" / "compat_e2b_driver.py"


@pytest.fixture(scope="module")
def e2b_server(images: object) -> Iterator[Server]:
    srv = make_tcp_server("--capacity", "32").start()
    yield srv
    stop_server(srv)


def e2b_env(server: Server) -> dict[str, str]:
    """What a user sets to point the SDK at dsec (docs/COMPAT.md)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    return {**env, "E2B_API_URL": f"{server.url}/e2b", "E2B_SANDBOX_URL": f"{server.url}/e2b",
            "E2B_API_KEY": server.key, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            # a driver that dies of a signal (a SIGABRT was seen once, with nothing on stderr)
            # leaves its Python stacks on stderr, which the assertion shows
            "PYTHONFAULTHANDLER": "1", "RUST_BACKTRACE": "1"}


@pytest.fixture(scope="module")
def observed(e2b_server: Server) -> dict[str, dict[str, Any]]:
    """Every version's driver run, concurrently: version -> what it observed."""
    pythons = {version: compat_python("e2b", version) for version in E2B_VERSIONS}
    runs = {version: subprocess.Popen([str(python), str(DRIVER)], env=e2b_env(e2b_server),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for version, python in pythons.items()}
    out = {}
    for version, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr.decode()[-3000:]
        out[version] = json.loads(stdout)
        assert out[version]["sdk"] == version
        assert "crashed" not in out[version], out[version]["crashed"]
    return out


def raised(value: Any) -> str | None:
    return value.get("raised") if isinstance(value, dict) else None


def ok(stdout: str, stderr: str = "", exit_code: int = 0) -> dict[str, Any]:
    return {"stdout": stdout, "stderr": stderr, "exit_code": exit_code}


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_commands(observed: dict[str, dict[str, Any]], version: str) -> None:
    o = observed[version]
    assert o["sync.id"].startswith("sb-")
    assert o["sync.run"] == ok("hello\n", "err\n")
    assert o["sync.cwd_env"] == ok("/home/user\ng bar\n")  # E2B's home; create-time and call env
    assert o["sync.cwd_arg"] == ok("/tmp\n")
    assert o["sync.stream"] == ok("1\n2\n3\n", "e1\ne2\ne3\n")
    chunks = o["sync.stream_chunks"]
    assert [text for _, text in chunks] == ["1\n", "2\n", "3\n"]
    assert chunks[-1][0] - chunks[0][0] > 0.3  # callbacks came as the output did
    assert o["sync.stream_errs"] == ["e1\n", "e2\n", "e3\n"]
    assert raised(o["sync.exit"]) == "CommandExitException"
    assert (o["sync.exit"]["exit_code"], o["sync.exit"]["stdout"]) == (3, "out\n")
    assert "TimeoutException" in o["sync.timeout"]["mro"]
    assert o["sync.python"] == ok("42\n")


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_background_connect_kill(observed: dict[str, dict[str, Any]], version: str) -> None:
    o = observed[version]
    assert o["sync.bg_pid"] in o["sync.bg_list"]
    assert o["sync.bg_kill"] is True
    assert raised(o["sync.bg_wait"]) == "CommandExitException"  # killed: exit code -1, like envd
    assert (o["sync.bg_wait"]["exit_code"], o["sync.bg_wait"]["stdout"]) == (-1, "started\n")
    assert o["sync.bg_kill_again"] is False
    assert o["sync.bg_finished"] == ok("bg done\n")


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_stdin_and_pty(observed: dict[str, dict[str, Any]], version: str) -> None:
    o = observed[version]
    assert o["stdin.send"] is None and o["stdin.read_line"] == ok("got:hello\n")
    assert raised(o["stdin.after_end"]) == "NotFoundException"
    assert raised(o["stdin.not_open"]) == "SandboxException"
    assert "stdin not enabled or closed" in o["stdin.not_open"]["message"]
    if version == E2B_VERSIONS[-1]:  # close_stdin came with envd 0.5.2's SDKs
        assert o["stdin.close"] is None and o["stdin.cat"] == ok("one\ntwo\n")
    if version == E2B_VERSIONS[-1]:  # its stream_input is StreamInput, a client stream
        assert o["stdin.stream_input"] is None
        assert o["stdin.streamed"] == ok("".join(f"chunk{i}\n" for i in range(50)))
        assert raised(o["stdin.stream_unknown"]) == "NotFoundException"
    assert o["pty.pid_in_list"] is True
    assert o["pty.size1"] == "30 100\n"
    assert o["pty.resize"] is None
    assert raised(o["pty.wait"]) == "CommandExitException" and o["pty.wait"]["exit_code"] == 3
    assert "43 132" in o["pty.output"] and "xterm-256color" in o["pty.output"]
    assert o["pty.kill"] is True and o["pty.kill_again"] is False
    assert raised(o["pty.killed_wait"]) == "CommandExitException"


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_files(observed: dict[str, dict[str, Any]], version: str) -> None:
    o = observed[version]
    assert o["sync.write_read"] == ["/home/user/a.txt", "hi there"]
    assert o["sync.binary"] == ["/home/user/data/blob.bin", True]  # relative to home, 2 MiB, exact
    assert o["sync.write_files"] == ["/home/user/m1.txt", "/tmp/x/m2.txt"]
    assert o["sync.list"] == [["a.txt", "file"], ["data", "dir"], ["m1.txt", "file"]]
    assert o["sync.make_dir"] == [True, False]
    assert o["sync.exists"] == [True, False]
    assert o["sync.remove"] is False
    assert raised(o["sync.read_missing"]) == "FileNotFoundException"


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_lifecycle_and_errors(observed: dict[str, dict[str, Any]], version: str) -> None:
    o = observed[version]
    assert o["sync.set_timeout"] is True
    assert o["sync.list_sandboxes"] is True
    assert o["sync.list_metadata"] == [o["sync.id"]]
    assert o["sync.connect"] == ok("again\n")
    assert o["sync.is_running"] is True and o["sync.kill"] is True
    # a killed or expired sandbox: the SDK's "sandbox is gone" exception (TimeoutException, or
    # its subclass SandboxNotRunningException in newer SDKs), as behind E2B's own gateway
    for step in ("sync.after_kill_run", "sync.expired_run"):
        assert "TimeoutException" in o[step]["mro"], o[step]
        assert "was not found" in o[step]["message"]
    if version == E2B_VERSIONS[-1]:
        assert raised(o["sync.after_kill_run"]) == "SandboxNotRunningException"
    assert o["sync.after_kill_is_running"] is False
    assert o["sync.kill_again"] is False
    assert "NotFoundException" in o["sync.expired_info"]["mro"]
    assert raised(o["sync.bad_key"]) == "AuthenticationException"
    assert raised(o["sync.bad_template"]) == "SandboxException"
    assert "no-such-template" in o["sync.bad_template"]["message"]


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_async_sdk(observed: dict[str, dict[str, Any]], version: str) -> None:
    o = observed[version]
    assert o["async.id"].startswith("sb-")
    assert o["async.run"] == ok("hello\n", "err\n")
    assert o["async.stream"] == ok("1\n2\n3\n") and o["async.stream_chunks"] == ["1\n", "2\n", "3\n"]
    assert (raised(o["async.exit"]), o["async.exit"]["exit_code"]) == ("CommandExitException", 4)
    assert "TimeoutException" in o["async.timeout"]["mro"]
    assert len(o["async.bg_list"]) == 1
    assert o["async.bg_kill"] is True and o["async.bg_wait"]["exit_code"] == -1
    assert o["async.write_read"] == ["/home/user/b.txt", "file-like body"]
    assert o["async.list"] == ["b.txt"]
    assert o["async.make_dir"] is True and o["async.remove"] is False
    assert raised(o["async.read_missing"]) == "FileNotFoundException"
    assert o["async.set_timeout"] is None and o["async.list_sandboxes"] is True
    assert o["async.kill"] is True
    assert "TimeoutException" in o["async.after_kill_run"]["mro"]


async def _project_keys(server: Server, snapshot_bytes: int) -> list[tuple[str, str]]:
    """Two projects (name, key), each with room for a few E2B sandboxes and
    ``snapshot_bytes`` of snapshots."""
    async with server.client() as admin:
        made = []
        for prefix in ("e2b-mine", "e2b-theirs"):
            name = unique(prefix)
            await admin.projects().create(name, sandboxes=8, cpu=16, memory_mb=4096,
                                          snapshot_bytes=snapshot_bytes)
            made.append((name, (await admin.projects().create_key(name, "sdk")).key))
        return made


async def _snapshot_bytes_used(server: Server, project: str) -> int:
    async with server.client() as admin:
        return (await admin.projects().get(project)).used.snapshot_bytes


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_pause_snapshots_and_forks(e2b_server: Server, version: str) -> None:
    """The SDK's pause, connect (resumes), create_snapshot, list/delete of snapshots, create
    from a snapshot and fork, under a project key with room for two snapshots; another
    project's key can neither use, delete nor take them; snapshot spam is refused at the
    quota and leaves nothing."""
    (mine, my_key), (_, their_key) = asyncio.run(_project_keys(e2b_server, 2 * DISK))
    python = compat_python("e2b", version)
    run = subprocess.run([str(python), str(DRIVER), "--state"], capture_output=True, timeout=300,
                         env={**e2b_env(e2b_server), "E2B_API_KEY": my_key,
                              "DSEC_OTHER_KEY": their_key})
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    o = json.loads(run.stdout)
    assert "crashed" not in o, o["crashed"]
    newest = version == E2B_VERSIONS[-1]
    assert o["state.pause"] == "paused"
    assert o["state.connect"] == "before" and o["state.resumed"] == "running"
    snap = o["state.snap"]
    assert snap.startswith("sn-")
    assert o["state.listed"] == [snap]
    assert o["state.child_reads"] == "before"  # the file as it was when snapshotted
    assert o["state.child_runs"] == ok("child\n")
    if newest:
        assert raised(o["state.pause_filesystem"]) == "SandboxException"
        assert "filesystem-only pause" in o["state.pause_filesystem"]["message"]
        assert raised(o["state.snapshot_full"]) == "SandboxException"
        assert "mode='filesystem'" in o["state.snapshot_full"]["message"]
        assert o["state.snapshot_filesystem"] is True
        assert o["state.fork_reads"] == ["after", "after"]  # the parent's file when forked
        assert o["state.fork_ids"] == 3
        assert raised(o["state.fork_count_refused"]) == "InvalidArgumentException"
        assert "NotFoundException" in o["other.fork"]["mro"]
        # room for eight sandboxes, the parent is one: seven children start, two are refused
        assert sorted(o["state.fork_many"]) == ["RateLimitException"] * 2 + ["Sandbox"] * 7
    assert o["state.listed_after_fork"] == [snap]  # a fork's snapshot is gone once it forked
    # another project's key: not found, whatever it tries
    assert raised(o["other.create_from"]) == "SandboxException"
    assert "not found" in o["other.create_from"]["message"]
    assert o["other.delete"] is False
    assert "NotFoundException" in o["other.connect"]["mro"]
    assert "NotFoundException" in o["other.snapshot"]["mro"]
    assert o["state.still_listed"] == [snap]
    # two disks of room: the first spam fits beside ``snap``, the rest are refused
    assert o["state.spam0"].startswith("sn-")
    for refused in ("state.spam1", "state.spam2"):
        assert raised(o[refused]) == "RateLimitException", o[refused]
        assert "snapshot_bytes" in o[refused]["message"]
    assert o["state.spam"][1:] == [None, None]
    assert o["state.deleted"] == [True, True]
    assert o["state.delete_again"] is False
    assert "not found" in o["state.create_deleted"]["message"]
    with httpx.Client(base_url=f"{e2b_server.url}/e2b", timeout=30) as http:
        assert http.get("/snapshots", headers={"X-API-Key": their_key}).json() == []
    assert asyncio.run(_snapshot_bytes_used(e2b_server, mine)) == 0
    assert not list((e2b_server.state_dir / "snapshots").glob("*"))


def test_binary_protobuf_codec(e2b_server: Server) -> None:
    """Connect with application/proto, decoded by Google's protobuf runtime."""
    python = compat_python("e2b", E2B_VERSIONS[0])  # ships protobuf and envd's generated classes
    run = subprocess.run([str(python), str(DRIVER), "--proto"], env=e2b_env(e2b_server),
                         capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    o = json.loads(run.stdout)
    assert o["proto.start_content_type"] == "application/connect+proto"
    assert o["proto.start_events"] == ["start", "data", ["stdout", "out"], "data", ["stderr", "err"],
                                       "end", [5, "exit status 5"]]
    assert o["proto.end_stream"] == {}
    assert o["proto.stat"] == [200, "application/proto", "user", 2, "/home/user", "drwxr-xr-x"]
    assert o["proto.stat_missing"] == [404, "not_found"]


def envelope(message: dict[str, Any]) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(body)) + body


def envelopes(data: bytes) -> list[tuple[int, Any]]:
    out = []
    while data:
        flags, size = struct.unpack(">BI", data[:5])
        out.append((flags, json.loads(data[5:5 + size])))
        data = data[5 + size:]
    return out


def test_connect_wire_and_gateway(e2b_server: Server) -> None:
    """Raw Connect JSON: keepalives while a command is silent, the gateway's answers for a bad
    token, another port, a dead sandbox, and control-plane calls dsec does not serve."""
    base = f"{e2b_server.url}/e2b"
    with httpx.Client(base_url=base, timeout=30) as http:
        sb = http.post("/sandboxes", json={"templateID": "base", "timeout": 60},
                       headers={"X-API-Key": e2b_server.key}).json()
        headers = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"],
                   "Content-Type": "application/connect+json", "Keepalive-Ping-Interval": "1"}
        start = {"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 2.3; echo late"]}}
        answer = http.post("/process.Process/Start", content=envelope(start), headers=headers)
        assert answer.status_code == 200
        frames = envelopes(answer.content)
        events = [next(iter(m["event"])) for flags, m in frames if not flags & 2]
        assert events[0] == "start" and events[-2:] == ["data", "end"]
        assert events.count("keepalive") >= 2
        assert frames[-1] == (2, {})

        unary = {**headers, "Content-Type": "application/json"}
        assert http.post("/process.Process/List", content=b"{}", headers=unary).json() == {}
        bad = http.post("/process.Process/List", content=b"{}",
                        headers={**unary, "X-Access-Token": sb["sandboxID"] + ".forged"})
        assert bad.status_code == 401
        port = http.post("/process.Process/List", content=b"{}", headers={**unary, "E2b-Sandbox-Port": "8080"})
        assert port.status_code == 502 and "port is not open" in port.json()["message"]
        pty = http.post("/process.Process/Start", headers=headers, content=envelope(
            {"process": {"cmd": "/bin/sh", "args": ["-c", "tty"]},
             "pty": {"size": {"cols": 80, "rows": 24}}}))
        data = [m["event"]["data"] for flags, m in envelopes(pty.content)
                if not flags & 2 and "data" in m["event"]]
        assert data and all(set(d) == {"pty"} for d in data)  # a terminal's output is pty data
        assert b"/dev/pts/" in b"".join(base64.b64decode(d["pty"]) for d in data)
        other = http.post("/sandboxes", json={"templateID": "base", "timeout": 60},
                          headers={"X-API-Key": e2b_server.key}).json()
        try:  # another sandbox's token cannot type into this one's processes
            typed = http.post("/process.Process/SendInput", headers={
                **unary, "X-Access-Token": other["envdAccessToken"]},
                content=json.dumps({"process": {"pid": 1}, "input": {"stdin": "eA=="}}))
            assert typed.status_code == 401
        finally:
            http.delete(f"/sandboxes/{other['sandboxID']}", headers={"X-API-Key": e2b_server.key})
        # StreamInput, a client stream: a start event, input, then a truncated envelope
        streamed = {**headers, "Content-Type": "application/connect+json"}
        no_start = http.post("/process.Process/StreamInput", headers=streamed,
                             content=envelope({"data": {"input": {"stdin": "eA=="}}}))
        assert envelopes(no_start.content)[-1][1]["error"]["code"] == "failed_precondition"
        unknown = http.post("/process.Process/StreamInput", headers=streamed,
                            content=envelope({"start": {"process": {"pid": 999999}}}))
        assert envelopes(unknown.content)[-1][1]["error"]["code"] == "not_found"
        cut = http.post("/process.Process/StreamInput", headers=streamed,
                        content=envelope({"keepalive": {}})[:-2])
        assert envelopes(cut.content)[-1][1]["error"]["code"] == "invalid_argument"
        watch = http.post("/filesystem.Filesystem/WatchDir", content=b"{}", headers=unary)
        assert watch.status_code == 501 and watch.json()["code"] == "unimplemented"
        key = {"X-API-Key": e2b_server.key}
        assert http.post(f"/sandboxes/{sb['sandboxID']}/pause", json={}, headers=key).status_code == 204
        assert http.get(f"/sandboxes/{sb['sandboxID']}", headers=key).json()["state"] == "paused"
        resumed = http.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 60}, headers=key)
        assert resumed.status_code == 200
        assert http.get(f"/sandboxes/{sb['sandboxID']}", headers=key).json()["state"] == "running"
        http.post(f"/sandboxes/{sb['sandboxID']}/pause", json={}, headers=key)
        assert http.post("/process.Process/List", content=b"{}", headers=unary).json() == {}  # resumed
        assert http.get(f"/sandboxes/{sb['sandboxID']}", headers=key).json()["state"] == "running"
        assert http.post(f"/sandboxes/{sb['sandboxID']}/snapshots", json={"memory": True},
                         headers=key).status_code == 400

        assert http.delete(f"/sandboxes/{sb['sandboxID']}", headers={"X-API-Key": e2b_server.key}).status_code == 204
        dead = http.post("/process.Process/Start", content=envelope(start), headers=headers)
        assert dead.status_code == 502 and dead.json()["message"] == "The sandbox was not found"
        assert http.get("/health", headers=headers).status_code == 502


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_get_host_reaches_a_server_in_the_sandbox(e2b_server: Server, version: str) -> None:
    """``get_host(port)`` with httpx: by E2B's routing headers to E2B_SANDBOX_URL, and by the
    ``Host`` name; the key is required and never reaches the sandbox's server (which reports
    the headers it got: tests/support/port_server.py)."""
    port = 18438
    python = compat_python("e2b", version)
    run = subprocess.run([str(python), str(DRIVER), "--ports"], capture_output=True, timeout=300,
                         env={**e2b_env(e2b_server), "DSEC_PORT": str(port),
                              "DSEC_PORT_SERVER": str(DRIVER.parent / "port_server.py")})
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    o = json.loads(run.stdout)
    assert "crashed" not in o, o["crashed"]
    assert o["ports.host"].startswith(f"{port}-{o['ports.id']}.")
    for way in ("ports.by_headers", "ports.by_host"):
        got = {k.lower(): v for k, v in o[way]}
        assert got["host"] == f"localhost:{port}", way
        assert not {"x-api-key", "authorization", "e2b-sandbox-id", "e2b-sandbox-port"} & set(got)
        assert e2b_server.key not in json.dumps(o[way])
    assert dict(o["ports.by_headers"])["path"] == "/headers?q=1"
    assert o["ports.post"] == "e2b body"
    assert o["ports.no_key"] == 401 and o["ports.other_key"] == 401
    status, body = o["ports.closed"]
    assert status == 502 and body["port"] == port + 1
    assert body["message"].startswith("The sandbox is running but port is not open")
