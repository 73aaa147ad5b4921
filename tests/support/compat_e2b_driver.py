"""Drives a dsec server with the real ``e2b`` SDK, through its public API only.

Run with an interpreter that has the ``e2b`` version under test installed (the compat
virtualenvs of test_compat_e2b.py), with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY
pointing at dsec. It prints one JSON object: what each step observed (values, or the class
and MRO of the exception it raised). The test decides what is right; this script only
records, so a failing step does not hide the others.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import io
import json
import os
import sys
import time
import traceback
from typing import Any, Awaitable, Callable

import e2b
from e2b import AsyncSandbox, Sandbox

observed: dict[str, Any] = {"sdk": importlib.metadata.version("e2b")}


def raised(exc: BaseException) -> dict[str, Any]:
    return {"raised": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc)[:500], "exit_code": getattr(exc, "exit_code", None),
            "stdout": getattr(exc, "stdout", None), "stderr": getattr(exc, "stderr", None)}


def step(name: str, fn: Callable[[], Any]) -> Any:
    try:
        value = fn()
    except Exception as exc:  # recorded, not fatal
        observed[name] = raised(exc)
        return None
    observed[name] = value
    return value


async def astep(name: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    try:
        value = await fn()
    except Exception as exc:
        observed[name] = raised(exc)
        return None
    observed[name] = value
    return value


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def result(r: Any) -> dict[str, Any]:
    return {"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code}


def sync_scenario() -> None:
    short = Sandbox.create(template="base", timeout=1)  # left to expire
    short_created = time.monotonic()
    sb = Sandbox.create(template="base", timeout=120, metadata={"suite": "compat", "sdk": observed["sdk"]}, envs={"GLOBAL": "g"})
    observed["sync.id"] = sb.sandbox_id
    cmds, files = sb.commands, sb.files

    step("sync.run", lambda: result(cmds.run("echo hello; echo err >&2")))
    step("sync.cwd_env", lambda: result(cmds.run("pwd; echo $GLOBAL $FOO", envs={"FOO": "bar"})))
    step("sync.cwd_arg", lambda: result(cmds.run("pwd", cwd="/tmp")))
    chunks: list[tuple[float, str]] = []
    errs: list[str] = []
    started = time.monotonic()
    step("sync.stream", lambda: result(cmds.run(
        "for i in 1 2 3; do echo $i; echo e$i >&2; sleep 0.2; done",
        on_stdout=lambda s: chunks.append((time.monotonic() - started, s)), on_stderr=errs.append)))
    observed["sync.stream_chunks"] = chunks
    observed["sync.stream_errs"] = errs
    step("sync.exit", lambda: result(cmds.run("echo out; exit 3")))
    step("sync.timeout", lambda: result(cmds.run("sleep 10", timeout=1)))

    background = cmds.run("echo started; touch /tmp/started; sleep 30", background=True)
    observed["sync.bg_pid"] = background.pid
    step("sync.bg_list", lambda: [p.pid for p in cmds.list()])
    attached = cmds.connect(background.pid)
    wait_for(lambda: files.exists("/tmp/started"))
    step("sync.bg_kill", lambda: cmds.kill(background.pid))
    step("sync.bg_wait", lambda: result(attached.wait()))
    step("sync.bg_kill_again", lambda: cmds.kill(background.pid))
    quick = cmds.run("sleep 0.3; echo bg done", background=True)
    step("sync.bg_finished", lambda: result(quick.wait()))

    step("sync.write_read", lambda: (files.write("/home/user/a.txt", "hi there").path,
                                     files.read("/home/user/a.txt")))
    blob = os.urandom(2 << 20) + b"\r\n\x00\r"
    step("sync.binary", lambda: (files.write("data/blob.bin", blob).path,
                                 bytes(files.read("data/blob.bin", format="bytes")) == blob))
    step("sync.write_files", lambda: [w.path for w in files.write_files(
        [{"path": "/home/user/m1.txt", "data": "one"}, {"path": "/tmp/x/m2.txt", "data": b"two"}])])
    step("sync.list", lambda: sorted((e.name, e.type.value if hasattr(e.type, "value") else str(e.type))
                                     for e in files.list("/home/user")))
    step("sync.make_dir", lambda: [files.make_dir("/home/user/d/e"), files.make_dir("/home/user/d/e")])
    step("sync.exists", lambda: [files.exists("/home/user/d/e"), files.exists("/home/user/nope")])
    step("sync.remove", lambda: (files.remove("/home/user/d"), files.exists("/home/user/d"))[1])
    step("sync.read_missing", lambda: files.read("/home/user/nope.txt"))
    step("sync.python", lambda: (files.write("/home/user/main.py", "print(6 * 7)"),
                                 result(cmds.run("python3 main.py")))[1])
    stdin_and_pty_scenario(sb)  # after the listings: the PTY's login bash leaves a history

    before = sb.get_info().end_at
    step("sync.set_timeout", lambda: (sb.set_timeout(300), sb.get_info().end_at > before)[1])
    step("sync.list_sandboxes", lambda: sb.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()])
    step("sync.list_metadata", lambda: [s.sandbox_id for s in Sandbox.list(
        query=e2b.SandboxQuery(metadata={"suite": "compat", "sdk": observed["sdk"]})).next_items()])
    step("sync.connect", lambda: result(Sandbox.connect(sb.sandbox_id).commands.run("echo again")))
    step("sync.is_running", lambda: sb.is_running())
    step("sync.kill", lambda: sb.kill())
    step("sync.after_kill_run", lambda: result(cmds.run("echo x")))
    step("sync.after_kill_is_running", lambda: sb.is_running())
    step("sync.kill_again", lambda: Sandbox.kill(sb.sandbox_id))
    step("sync.bad_key", lambda: Sandbox.create(template="base", api_key="not-a-dsec-key").sandbox_id)
    step("sync.bad_template", lambda: Sandbox.create(template="no-such-template").sandbox_id)

    time.sleep(max(0.0, 2.5 - (time.monotonic() - short_created)))
    step("sync.expired_run", lambda: result(short.commands.run("echo x")))
    step("sync.expired_info", lambda: short.get_info().sandbox_id)


def stdin_and_pty_scenario(sb: Sandbox) -> None:
    """``stdin=True`` + ``send_stdin`` (+ ``close_stdin`` where the SDK has it) and a PTY:
    create, type, resize, wait, kill."""
    cmds, files = sb.commands, sb.files
    reader = cmds.run("read line; echo got:$line", background=True, stdin=True)
    step("stdin.send", lambda: cmds.send_stdin(reader.pid, "hello\n"))
    step("stdin.read_line", lambda: result(reader.wait()))
    step("stdin.after_end", lambda: cmds.send_stdin(reader.pid, "late\n"))
    closed = cmds.run("sleep 30", background=True)
    step("stdin.not_open", lambda: cmds.send_stdin(closed.pid, "x"))
    cmds.kill(closed.pid)
    if hasattr(cmds, "close_stdin"):  # newer SDKs
        cat = cmds.run("cat", background=True, stdin=True)
        cmds.send_stdin(cat.pid, "one\n")
        cmds.send_stdin(cat.pid, "two\n")
        step("stdin.close", lambda: cmds.close_stdin(cat.pid))
        step("stdin.cat", lambda: result(cat.wait()))
    if hasattr(cmds, "stream_input"):  # newer SDKs: one client stream of input
        streamed = cmds.run("cat", background=True, stdin=True)
        step("stdin.stream_input", lambda: cmds.stream_input(
            streamed.pid, (f"chunk{i}\n" for i in range(50))))
        cmds.close_stdin(streamed.pid)
        step("stdin.streamed", lambda: result(streamed.wait()))
        step("stdin.stream_unknown", lambda: cmds.stream_input(999999, ["x"]))

    out: list[bytes] = []
    term = sb.pty.create(e2b.PtySize(rows=30, cols=100))
    observed["pty.pid_in_list"] = term.pid in [p.pid for p in cmds.list()]
    sb.pty.send_stdin(term.pid, b"stty size > /tmp/size1\n")
    wait_for(lambda: files.exists("/tmp/size1") and bool(files.read("/tmp/size1")), 20)
    step("pty.size1", lambda: files.read("/tmp/size1"))
    step("pty.resize", lambda: sb.pty.resize(term.pid, e2b.PtySize(rows=43, cols=132)))
    sb.pty.send_stdin(term.pid, b"stty size; echo $TERM; exit 3\n")
    step("pty.wait", lambda: result(term.wait(on_pty=lambda data: out.append(bytes(data)))))
    observed["pty.output"] = b"".join(out).decode(errors="replace")
    doomed = sb.pty.create(e2b.PtySize(rows=24, cols=80))
    step("pty.kill", lambda: sb.pty.kill(doomed.pid))
    step("pty.killed_wait", lambda: result(doomed.wait()))
    step("pty.kill_again", lambda: sb.pty.kill(doomed.pid))


async def async_scenario() -> None:
    sb = await AsyncSandbox.create(template="base", timeout=120)
    observed["async.id"] = sb.sandbox_id
    cmds, files = sb.commands, sb.files
    await astep("async.run", lambda: _aresult(cmds.run("echo hello; echo err >&2")))
    chunks: list[str] = []
    await astep("async.stream", lambda: _aresult(cmds.run(
        "for i in 1 2 3; do echo $i; sleep 0.1; done", on_stdout=chunks.append)))
    observed["async.stream_chunks"] = chunks
    await astep("async.exit", lambda: _aresult(cmds.run("exit 4")))
    await astep("async.timeout", lambda: _aresult(cmds.run("sleep 10", timeout=1)))
    background = await cmds.run("echo started; touch /tmp/started; sleep 30", background=True)
    for _ in range(100):  # the SDK's own 1 s timeout can fire before the server's kills `sleep 10`
        if len(await cmds.list()) <= 1:
            break
        await asyncio.sleep(0.05)
    await astep("async.bg_list", lambda: _pids(cmds.list()))
    attached = await cmds.connect(background.pid)
    for _ in range(100):
        if await files.exists("/tmp/started"):
            break
        await asyncio.sleep(0.05)
    await astep("async.bg_kill", lambda: cmds.kill(background.pid))
    await astep("async.bg_wait", lambda: _aresult(attached.wait()))
    await astep("async.write_read", lambda: _write_read(files))
    await astep("async.list", lambda: _names(files.list("/home/user")))
    await astep("async.make_dir", lambda: files.make_dir("/home/user/ad"))
    await astep("async.remove", lambda: _remove(files, "/home/user/ad"))
    await astep("async.read_missing", lambda: files.read("/home/user/nope.txt"))
    await astep("async.set_timeout", lambda: sb.set_timeout(200))
    await astep("async.list_sandboxes", lambda: _listed(sb.sandbox_id))
    await astep("async.kill", lambda: sb.kill())
    await astep("async.after_kill_run", lambda: _aresult(cmds.run("echo x")))


async def _aresult(call: Awaitable[Any]) -> dict[str, Any]:
    return result(await call)


async def _pids(call: Awaitable[Any]) -> list[int]:
    return [p.pid for p in await call]


async def _names(call: Awaitable[Any]) -> list[str]:
    return sorted(e.name for e in await call)


async def _write_read(files: Any) -> list[Any]:
    written = await files.write("/home/user/b.txt", io.BytesIO(b"file-like body"))
    return [written.path, await files.read("/home/user/b.txt")]


async def _remove(files: Any, path: str) -> bool:
    await files.remove(path)
    return await files.exists(path)


async def _listed(sandbox_id: str) -> bool:
    return sandbox_id in [s.sandbox_id for s in await AsyncSandbox.list().next_items()]


def proto_scenario() -> None:
    """The Connect binary protobuf codec, checked against Google's protobuf runtime with the
    message classes older SDKs ship (generated from envd's .proto files). Raw HTTP: the SDKs
    themselves speak JSON."""
    import struct

    import httpx
    from e2b.envd.filesystem import filesystem_pb2
    from e2b.envd.process import process_pb2

    api, key = os.environ["E2B_API_URL"], os.environ["E2B_API_KEY"]
    with httpx.Client(timeout=30) as http:
        created = http.post(f"{api}/sandboxes", json={"templateID": "base", "timeout": 60},
                            headers={"X-API-Key": key}).json()
        headers = {"E2b-Sandbox-Id": created["sandboxID"], "X-Access-Token": created["envdAccessToken"],
                   "Connect-Protocol-Version": "1"}
        start = process_pb2.StartRequest(process=process_pb2.ProcessConfig(
            cmd="/bin/sh", args=["-c", "printf out; printf err >&2; exit 5"]), stdin=False)
        body = start.SerializeToString()
        answer = http.post(f"{api}/process.Process/Start", content=struct.pack(">BI", 0, len(body)) + body,
                           headers={**headers, "Content-Type": "application/connect+proto"})
        observed["proto.start_content_type"] = answer.headers.get("content-type")
        events, data, end_stream = [], answer.content, None
        while data:
            flags, size = struct.unpack(">BI", data[:5])
            payload, data = data[5:5 + size], data[5 + size:]
            if flags & 2:
                end_stream = json.loads(payload)
                break
            message = process_pb2.StartResponse()
            message.ParseFromString(payload)
            events.append(message.event.WhichOneof("event"))
            if message.event.HasField("data"):
                which = message.event.data.WhichOneof("output")
                events.append([which, getattr(message.event.data, which).decode()])
            if message.event.HasField("end"):
                events.append([message.event.end.exit_code, message.event.end.status])
        observed["proto.start_events"] = events
        observed["proto.end_stream"] = end_stream
        stat = http.post(f"{api}/filesystem.Filesystem/Stat",
                         content=filesystem_pb2.StatRequest(path="/home/user").SerializeToString(),
                         headers={**headers, "Content-Type": "application/proto"})
        entry = filesystem_pb2.StatResponse()
        entry.ParseFromString(stat.content)
        observed["proto.stat"] = [stat.status_code, stat.headers.get("content-type"), entry.entry.name,
                                  entry.entry.type, entry.entry.path, entry.entry.permissions]
        missing = http.post(f"{api}/filesystem.Filesystem/Stat",
                            content=filesystem_pb2.StatRequest(path="/nope").SerializeToString(),
                            headers={**headers, "Content-Type": "application/proto"})
        observed["proto.stat_missing"] = [missing.status_code, missing.json().get("code")]
        http.delete(f"{api}/sandboxes/{created['sandboxID']}", headers={"X-API-Key": key})


def _state(sb: Any) -> str:
    state = sb.get_info().state
    return str(getattr(state, "value", state))


def _read(sb: Any, path: str) -> str:
    return str(sb.files.read(path))


def state_scenario() -> None:
    """Pause, connect, snapshots and forks under a project key (E2B_API_KEY), and what
    another project's key (DSEC_OTHER_KEY) may do to them. Steps the SDK version lacks are
    left out of what it observes."""
    other = os.environ["DSEC_OTHER_KEY"]
    sb = Sandbox.create(template="base", timeout=120)
    sb.files.write("/home/user/state.txt", "before")
    step("state.pause", lambda: (sb.pause(), _state(sb))[1])
    step("state.connect", lambda: _read(Sandbox.connect(sb.sandbox_id), "/home/user/state.txt"))
    step("state.resumed", lambda: _state(sb))
    newest = hasattr(sb, "fork")  # the generation with fork and snapshot/pause modes
    if newest:
        step("state.pause_filesystem", lambda: sb.pause(mode="filesystem"))
    snap = step("state.create_snapshot", lambda: sb.create_snapshot().snapshot_id)
    if newest:
        step("state.snapshot_full", lambda: sb.create_snapshot(mode="full").snapshot_id)
        step("state.snapshot_filesystem", lambda: Sandbox.delete_snapshot(
            sb.create_snapshot(mode="filesystem").snapshot_id))
    sb.files.write("/home/user/state.txt", "after")
    step("state.listed", lambda: [s.snapshot_id for s in sb.list_snapshots().next_items()])
    child = step("state.child", lambda: Sandbox.create(snap, timeout=60))
    if child is not None:
        step("state.child_reads", lambda: _read(child, "/home/user/state.txt"))
        step("state.child_runs", lambda: result(child.commands.run("echo child")))
        child.kill()
    if newest:
        forks = step("state.fork", lambda: sb.fork(count=2, timeout=60)) or []
        step("state.fork_reads", lambda: [_read(f, "/home/user/state.txt") for f in forks])
        step("state.fork_ids", lambda: len({f.sandbox_id for f in forks} | {sb.sandbox_id}))
        step("state.fork_count_refused", lambda: sb.fork(count=21))
        for f in forks:
            f.kill()
        many = step("state.fork_many", lambda: sb.fork(count=9, timeout=60)) or []  # 7 fit
        observed["state.fork_many"] = [type(f).__name__ for f in many]
        for f in many:
            if isinstance(f, Sandbox):
                f.kill()
    step("state.listed_after_fork", lambda: [s.snapshot_id for s in sb.list_snapshots().next_items()])
    # another project's key
    step("other.create_from", lambda: Sandbox.create(snap, api_key=other).sandbox_id)
    step("other.delete", lambda: Sandbox.delete_snapshot(snap, api_key=other))
    step("other.connect", lambda: Sandbox.connect(sb.sandbox_id, api_key=other).sandbox_id)
    step("other.snapshot", lambda: Sandbox.create_snapshot(sb.sandbox_id, api_key=other).snapshot_id)
    if newest:
        step("other.fork", lambda: Sandbox.fork(sb.sandbox_id, count=1, api_key=other))
    step("state.still_listed", lambda: [s.snapshot_id for s in sb.list_snapshots().next_items()])
    # snapshot spam beyond the project's snapshot quota (two disks' worth)
    spam = [step(f"state.spam{i}", lambda: sb.create_snapshot().snapshot_id) for i in range(3)]
    observed["state.deleted"] = [Sandbox.delete_snapshot(s) for s in [snap, *spam] if s]
    step("state.delete_again", lambda: Sandbox.delete_snapshot(snap))
    step("state.create_deleted", lambda: Sandbox.create(snap).sandbox_id)
    observed["state.snap"] = snap
    observed["state.spam"] = spam
    sb.kill()


def ports_scenario() -> None:
    """``get_host(port)`` and a plain HTTP client (httpx), the two ways a request names a
    sandbox's port at dsec: E2B's ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers to
    ``E2B_SANDBOX_URL``, or the ``get_host`` name as the ``Host`` header."""
    import httpx

    port = int(os.environ["DSEC_PORT"])
    base, key = os.environ["E2B_SANDBOX_URL"], os.environ["E2B_API_KEY"]
    sb = Sandbox.create(template="base", timeout=300)
    with open(os.environ["DSEC_PORT_SERVER"], "rb") as f:
        sb.files.write("/tmp/port_server.py", f.read())
    sb.commands.run(f"python3 /tmp/port_server.py {port}", background=True)
    host = sb.get_host(port)
    observed["ports.host"] = host
    observed["ports.id"] = sb.sandbox_id
    named = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": str(port), "X-API-Key": key}
    with httpx.Client(base_url=base, timeout=30) as http:
        deadline = time.monotonic() + 60
        while http.get("/headers", headers=named).status_code == 502 and time.monotonic() < deadline:
            time.sleep(0.1)
        step("ports.by_headers", lambda: http.get("/headers?q=1", headers=named).json())
        step("ports.by_host", lambda: http.get("/headers", headers={"Host": host,
                                                                    "X-API-Key": key}).json())
        step("ports.post", lambda: http.post("/echo", content=b"e2b body", headers=named).text)
        step("ports.no_key", lambda: http.get("/headers", headers={"Host": host}).status_code)
        step("ports.other_key", lambda: http.get("/headers", headers={
            "Host": host, "X-API-Key": "dsk_not_a_key"}).status_code)
        closed = {**named, "E2b-Sandbox-Port": str(port + 1)}
        step("ports.closed", lambda: (lambda r: [r.status_code, r.json()])(
            http.get("/", headers=closed)))
    sb.kill()


def main() -> None:
    if "--ports" in sys.argv:
        scenarios: tuple[Callable[[], None], ...] = (ports_scenario,)
    elif "--proto" in sys.argv:
        scenarios = (proto_scenario,)
    elif "--state" in sys.argv:
        scenarios = (state_scenario,)
    else:
        scenarios = (sync_scenario, lambda: asyncio.run(async_scenario()))
    for scenario in scenarios:
        try:
            scenario()
        except Exception:
            observed.setdefault("crashed", []).append(traceback.format_exc())
    print(json.dumps(observed, default=str), flush=True)
    # Exit without the interpreter's finalization: twice in about ten CI runs the process
    # aborted (SIGABRT) after printing, in the SDK's own native teardown at exit (faulthandler:
    # the one thread with no Python frame). What it observed is all printed by now.
    os._exit(0)


if __name__ == "__main__":
    main()
