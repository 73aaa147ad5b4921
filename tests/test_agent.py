"""The agent binary, run directly on the host, driven through AgentClient."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import threading
import time
from contextlib import aclosing
from pathlib import Path

import pytest

from dsec.agent import (
    AgentClient,
    AgentError,
    AgentUnavailable,
    Exit,
    Output,
    agent_binary,
    build,
)
from dsec.agent.protocol import decode, encode

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C"}
TOKEN = "t" * 64


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory):
    sock = tmp_path_factory.mktemp("agent") / "agent.sock"
    proc = subprocess.Popen([agent_binary(), "--listen", sock], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.read(1) == b"R"
    asyncio.run(AgentClient(sock, TOKEN).claim())
    yield proc, sock
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def client(agent) -> AgentClient:
    return AgentClient(agent[1], TOKEN, peer_pid=agent[0].pid)


async def wait_until(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_codec_roundtrip():
    frame = encode("E", [("argv", "echo"), ("argv", "ü"), ("stdin", bytes(range(256))), ("timeout_ms", 5)])
    decoded = decode(frame[4:])
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert decoded.type == "E"
    assert decoded.all("argv") == [b"echo", "ü".encode()]
    assert decoded.get("stdin") == bytes(range(256))
    assert decoded.num("timeout_ms") == 5
    with pytest.raises(ValueError):
        decode(frame[4:-1])


def test_build_once_under_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("DSEC_CACHE", str(tmp_path))
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(agent_binary())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and os.access(paths[0], os.X_OK)
    assert paths[0].parent.parent == tmp_path / "agent"
    assert not list(paths[0].parent.glob("*.tmp"))


def test_build_failure_is_explained(tmp_path, monkeypatch):
    bad = tmp_path / "agent.c"
    bad.write_text("int main(void) { return nope; }\n")
    monkeypatch.setattr(build, "SOURCE", bad)
    monkeypatch.setenv("DSEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="nope"):
        agent_binary()


async def test_startup_socket_mode(agent, client):
    assert os.stat(agent[1]).st_mode & 0o777 == 0o600
    await client.ping()


async def test_second_claim_is_refused(agent, client):
    with pytest.raises(AgentError) as refused:
        await AgentClient(agent[1], "x" * 64).claim()
    assert refused.value.errno == "EPERM"
    await client.ping()  # the first claim still holds


@pytest.mark.parametrize("token", [None, "x" * 64, "t" * 63, "t" * 65])
async def test_request_without_the_token_is_refused(agent, token, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(AgentError) as refused:
        await AgentClient(agent[1], token).run(["touch", str(marker)], env=ENV)
    assert refused.value.errno == "EACCES"
    assert not marker.exists()


async def test_unclaimed_agent_runs_nothing(tmp_path):
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen([agent_binary(), "--listen", sock], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.read(1) == b"R"
        with pytest.raises(AgentError, match="not claimed"):
            await AgentClient(sock).run(["touch", str(tmp_path / "ran")], env=ENV)
        assert not (tmp_path / "ran").exists()
        with pytest.raises(AgentError, match="16 to 256"):
            await AgentClient(sock, "short").claim()
        await AgentClient(sock, TOKEN).claim()
        await AgentClient(sock, TOKEN).ping()
    finally:
        proc.kill()
        proc.wait()


async def test_wrong_peer_pid_is_refused(agent):
    with pytest.raises(AgentUnavailable, match="served by pid"):
        await AgentClient(agent[1], TOKEN, peer_pid=agent[0].pid + 1).ping()


async def test_unreachable_socket(tmp_path):
    with pytest.raises(AgentUnavailable):
        await AgentClient(tmp_path / "missing.sock").ping()


async def test_exit_code_and_stderr(client):
    r = await client.run(["sh", "-c", "echo out; echo err >&2; exit 3"], env=ENV)
    assert (r.exit_code, r.signal, r.timed_out) == (3, 0, False)
    assert (r.stdout, r.stderr) == (b"out\n", b"err\n")


async def test_killed_by_signal(client):
    r = await client.run(["sh", "-c", "kill -TERM $$"], env=ENV)
    assert (r.exit_code, r.signal) == (-1, signal.SIGTERM)


async def test_command_not_found_is_127(client):
    r = await client.run(["definitely-not-a-command"], env=ENV)
    assert r.exit_code == 127
    assert b"definitely-not-a-command: command not found" in r.stderr


async def test_binary_safe_stdin_and_stdout(client):
    data = bytes(range(256)) * 4096  # 1 MiB: more than a pipe buffer in both directions
    r = await client.run(["cat"], env=ENV, stdin=data)
    assert r.stdout == data and r.exit_code == 0


async def test_stdin_not_read_does_not_hang(client):
    r = await client.run(["true"], env=ENV, stdin=b"x" * (4 << 20))
    assert r.exit_code == 0


async def test_env_is_the_whole_environment_and_cwd(client, tmp_path):
    r = await client.run(["/usr/bin/env"], env={"A": "1", "B": "x=y"})
    assert sorted(r.stdout.decode().splitlines()) == ["A=1", "B=x=y"]
    r = await client.run(["sh", "-c", "pwd; echo $FOO"], env={**ENV, "FOO": "bar"}, cwd=str(tmp_path))
    assert r.stdout == f"{tmp_path}\nbar\n".encode()


async def test_missing_cwd_is_enoent(client, tmp_path):
    with pytest.raises(AgentError) as err:
        await client.run(["pwd"], env=ENV, cwd=str(tmp_path / "nope"))
    assert err.value.errno == "ENOENT"


async def test_child_gets_clean_process_state(client):
    script = "ls /proc/$$/fd; grep -E '^Sig(Blk|Ign)' /proc/self/status; echo $$ $(cut -d' ' -f5,6 /proc/$$/stat)"
    words = (await client.run(["sh", "-c", script], env=ENV)).stdout.decode().split()
    assert words[:3] == ["0", "1", "2"]  # only stdio is inherited
    assert words[3:7] == ["SigBlk:", "0" * 16, "SigIgn:", "0" * 16]
    assert len(set(words[7:])) == 1  # pid == process group == session: setsid


async def test_output_streams_incrementally(client):
    stamps = []
    async for ev in client.exec(["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.2; done"], env=ENV):
        if isinstance(ev, Output):
            stamps.append((time.monotonic(), ev.data))
    assert b"".join(d for _, d in stamps) == b"1\n2\n3\n"
    assert len(stamps) == 3 and stamps[2][0] - stamps[0][0] > 0.3


async def test_timeout_kills_the_whole_group(client):
    events = [ev async for ev in client.exec(["sh", "-c", "echo $$; sleep 100 & sleep 100"], env=ENV, timeout_ms=300)]
    pgid = int(events[0].data)
    exit_ = events[-1]
    assert isinstance(exit_, Exit) and exit_.timed_out and exit_.signal == signal.SIGKILL
    assert 250 <= exit_.duration_ms < 2000
    await wait_until(lambda: group_gone(pgid))  # the backgrounded sleep died with its group


async def test_output_over_max_is_dropped_and_flagged(client):
    t = time.monotonic()
    r = await client.run(["sh", "-c", "head -c 50000000 /dev/zero; echo tail >&2"], env=ENV, max_output=1 << 20)
    assert time.monotonic() - t < 5
    assert len(r.stdout) == 1 << 20 and r.stdout_truncated
    assert r.stderr == b"tail\n" and not r.stderr_truncated and r.exit_code == 0


async def test_slow_reader_gets_everything(agent, client):
    """Back-pressure: a stalled client loses nothing and the agent does not buffer the stream."""
    n, got = 128 << 20, 0
    async with aclosing(client.exec(["head", "-c", str(n), "/dev/zero"], env=ENV, max_output=n)) as events:
        async for ev in events:
            if isinstance(ev, Output):
                if not got:
                    await asyncio.sleep(0.3)  # the child would be long done without back-pressure
                    rss = Path(f"/proc/{agent[0].pid}/status").read_text().split("VmRSS:")[1].split()[0]
                    assert int(rss) < 48 << 10, f"agent RSS {rss} kB"
                got += len(ev.data)
            else:
                assert ev.exit_code == 0 and not ev.stdout_truncated
    assert got == n


async def test_exec_returns_when_main_process_exits(client, tmp_path):
    """A backgrounded descendant holding the pipe neither delays the reply nor gets SIGPIPE."""
    marker = tmp_path / "late"
    t = time.monotonic()
    r = await client.run(["sh", "-c", f"(sleep 0.3; echo late; echo ok > {marker}) & echo now"], env=ENV)
    assert r.stdout == b"now\n" and time.monotonic() - t < 0.25
    await wait_until(marker.exists)


async def test_background_start_list_attach(client):
    pid_id, pid = await client.start(["sh", "-c", "echo a; echo b >&2; sleep 0.3; echo c"], env=ENV)
    assert pid > 0
    info = {p.id: p for p in await client.list()}[pid_id]
    assert info.running and info.exit_code is None and info.command.startswith("sh -c echo a")

    async def collect():
        return [ev async for ev in client.attach(pid_id)]

    first, second = await asyncio.gather(collect(), collect())
    later = await collect()  # after the end: everything replayed from the start
    for events in (first, second, later):
        out = b"".join(ev.data for ev in events if isinstance(ev, Output) and ev.fd == 1)
        err = b"".join(ev.data for ev in events if isinstance(ev, Output) and ev.fd == 2)
        assert (out, err) == (b"a\nc\n", b"b\n")
        assert events[-1].exit_code == 0
    info = {p.id: p for p in await client.list()}[pid_id]
    assert not info.running and (info.exit_code, info.signal) == (0, 0)


async def test_background_signal(client):
    pid_id, pid = await client.start(["sh", "-c", "sleep 100 & sleep 100"], env=ENV)
    await client.signal(pid_id, signal.SIGKILL)
    events = [ev async for ev in client.attach(pid_id)]
    assert (events[-1].exit_code, events[-1].signal) == (-1, signal.SIGKILL)
    await wait_until(lambda: group_gone(pid))
    with pytest.raises(AgentError) as err:
        await client.signal(pid_id, signal.SIGTERM)
    assert err.value.errno == "ESRCH"
    with pytest.raises(AgentError):
        await client.signal("999999", signal.SIGTERM)


async def test_background_timeout(client):
    pid_id, _ = await client.start(["sleep", "100"], env=ENV, timeout_ms=100)
    exit_ = [ev async for ev in client.attach(pid_id)][-1]
    assert exit_.timed_out and exit_.signal == signal.SIGKILL


async def test_attach_unknown_id(client):
    with pytest.raises(AgentError) as err:
        [ev async for ev in client.attach("123456789")]
    assert err.value.errno == "ESRCH"


async def test_hundred_concurrent_execs(client):
    results = await asyncio.gather(
        *(client.run(["sh", "-c", 'sleep 0.1; echo "$0"', str(i)], env=ENV) for i in range(100))
    )
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(100)]


async def test_early_close_keeps_process_running(client, tmp_path):
    marker = tmp_path / "done"
    events = client.exec(["sh", "-c", f"echo start; sleep 0.3; echo done > {marker}"], env=ENV)
    assert (await anext(events)).data == b"start\n"
    await events.aclose()
    await wait_until(marker.exists)
    await client.ping()


async def test_agent_survives_abrupt_disconnects(agent, client):
    # mid-stream, with the agent blocked on a full socket
    events = client.exec(["head", "-c", "100000000", "/dev/zero"], env=ENV, timeout_ms=5000)
    await anext(events)
    await events.aclose()
    # mid-request: half a frame, then gone
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(agent[1]))
        s.sendall(encode("E", [("argv", "true")])[:7])
    # a frame length over the limit
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(agent[1]))
        s.sendall((1 << 31).to_bytes(4, "big"))
        assert decode(s.recv(4096)[4:]).type == "X"
    await client.ping()
    assert agent[0].poll() is None


async def test_file_roundtrip(client, tmp_path):
    path = str(tmp_path / "blob")
    data = bytes(range(256)) * (12 << 10)  # 3 MiB: several D chunks
    await client.write_file(path, data, mode=0o600)
    assert await client.read_file(path) == data
    assert os.stat(path).st_mode & 0o777 == 0o600
    await client.write_file(path, b"new")  # replace
    await client.write_file(path, b"+more", append=True)
    assert await client.read_file(path) == b"new+more"
    await client.write_file(str(tmp_path / "appended"), b"x", append=True, mode=0o640)
    assert os.stat(tmp_path / "appended").st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path)) == ["appended", "blob"]  # no temp files left behind


async def test_file_errors(client, tmp_path):
    for call in (
        client.read_file(str(tmp_path / "missing")),
        client.write_file(str(tmp_path / "no" / "parent"), b"x"),
        client.stat(str(tmp_path / "missing")),
        client.list_dir(str(tmp_path / "missing")),
        client.remove(str(tmp_path / "missing")),
        client.mkdir(str(tmp_path / "a" / "b")),
    ):
        with pytest.raises(AgentError) as err:
            await call
        assert err.value.errno == "ENOENT"
    with pytest.raises(AgentError) as err:
        await client.read_file(str(tmp_path))
    assert err.value.errno == "EISDIR"
    with pytest.raises(AgentError) as err:
        await client.read_file("relative/path")
    assert err.value.errno == "EINVAL"


async def test_list_stat_mkdir_remove(client, tmp_path):
    root = tmp_path / "tree"
    await client.mkdir(str(root / "a" / "b"), parents=True, mode=0o700)
    await client.mkdir(str(root / "a" / "b"), parents=True)  # exists: fine with parents
    assert os.stat(root / "a" / "b").st_mode & 0o777 == 0o700
    with pytest.raises(AgentError) as err:
        await client.mkdir(str(root / "a"))
    assert err.value.errno == "EEXIST"
    await client.write_file(str(root / "a" / "f"), b"12345")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    os.symlink(outside, root / "a" / "link")

    entries = {e.name: e for e in await client.list_dir(str(root / "a"))}
    assert {n: e.type for n, e in entries.items()} == {"b": "dir", "f": "file", "link": "symlink"}
    assert entries["f"].size == 5 and entries["f"].mode == 0o644
    assert abs(entries["f"].mtime - time.time()) < 60
    st = await client.stat(str(root / "a" / "b") + "/")
    assert (st.name, st.type, st.mode) == ("b", "dir", 0o700)
    assert (await client.stat("/")).name == "/"

    with pytest.raises(AgentError) as err:
        await client.remove(str(root))
    assert err.value.errno == "ENOTEMPTY"
    await client.remove(str(root / "a" / "f"))
    await client.remove(str(root), recursive=True)
    assert not root.exists()
    assert (outside / "keep").read_text() == "keep"  # the symlink was not followed


async def test_tcp_listen_mode_serves_the_same_protocol() -> None:
    """What VM guests run: ``--listen tcp:ADDRESS:PORT``, one request per TCP connection,
    on that address only."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([agent_binary(), "--listen", f"tcp:127.0.0.1:{port}"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.read(1) == b"R"
        tcp = AgentClient(("127.0.0.1", port), TOKEN)
        await tcp.claim()
        await tcp.ping()
        r = await tcp.run(["sh", "-c", "echo out; echo err >&2; exit 3"], env=ENV)
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
        with pytest.raises(AgentUnavailable):  # another address of this host
            await AgentClient(("127.0.0.2", port)).ping()
    finally:
        proc.terminate()
        proc.wait(5)
    with pytest.raises(AgentUnavailable):
        await AgentClient(("127.0.0.1", port)).ping()


def test_tcp_listen_mode_refuses_a_bad_port() -> None:
    for spec in ("tcp:127.0.0.1:70000", "tcp:7000", "tcp:no.such.address:7000"):
        done = subprocess.run([agent_binary(), "--listen", spec], capture_output=True)
        assert done.returncode == 2 and b"bad TCP address" in done.stderr


# stdin for background processes, and terminals


async def collect_output(client: AgentClient, id: str) -> tuple[bytes, Exit]:
    events = [ev async for ev in client.attach(id)]
    assert isinstance(events[-1], Exit)
    return b"".join(ev.data for ev in events if isinstance(ev, Output)), events[-1]


async def output_until(client: AgentClient, id: str, marker: bytes) -> bytes:
    seen = b""
    async with aclosing(client.attach(id)) as events:
        async for ev in events:
            seen += ev.data if isinstance(ev, Output) else b""
            if marker in seen:
                return seen
    raise AssertionError(f"{marker!r} never came: {seen!r}")


async def test_open_stdin_takes_input_until_closed(client):
    id_, _ = await client.start(["cat"], env=ENV, stdin=b"first ", stdin_open=True)
    await client.send_input(id_, b"second\n")
    await client.send_input(id_, bytes(range(256)))
    await client.close_stdin(id_)
    out, exit_ = await collect_output(client, id_)
    assert out == b"first second\n" + bytes(range(256)) and exit_.exit_code == 0
    with pytest.raises(AgentError) as ended:
        await client.send_input(id_, b"late")
    assert ended.value.errno == "ECHILD"


async def test_input_errors_are_typed(client):
    with pytest.raises(AgentError) as unknown:
        await client.send_input("987654", b"x")
    assert unknown.value.errno == "ESRCH"
    closed, _ = await client.start(["sleep", "30"], env=ENV)  # stdin not kept open
    with pytest.raises(AgentError) as not_open:
        await client.send_input(closed, b"x")
    assert not_open.value.errno == "EPIPE"
    open_, _ = await client.start(["sleep", "30"], env=ENV, stdin_open=True)
    await client.close_stdin(open_)
    with pytest.raises(AgentError) as after_close:
        await client.send_input(open_, b"x")
    assert after_close.value.errno == "EPIPE"
    with pytest.raises(AgentError) as not_tty:
        await client.resize(open_, 80, 24)
    assert not_tty.value.errno == "ENOTTY"
    for id_ in (closed, open_):
        await client.signal(id_, signal.SIGKILL)


async def test_input_is_bounded_when_the_process_does_not_read(client):
    id_, _ = await client.start(["sleep", "30"], env=ENV, stdin_open=True)
    chunk = b"x" * (256 << 10)
    accepted = 0
    with pytest.raises(AgentError) as full:
        for _ in range(64):  # the pipe takes 64 KiB, the agent 1 MiB more, then refuses
            await client.send_input(id_, chunk)
            accepted += len(chunk)
    assert full.value.errno == "EAGAIN" and accepted <= (1 << 20) + (64 << 10)
    await client.signal(id_, signal.SIGKILL)
    await collect_output(client, id_)


async def test_malformed_input_frames_are_refused(client):
    id_, _ = await client.start(["sleep", "30"], env=ENV, stdin_open=True)
    for kind, fields in (("I", [("id", id_)]), ("Z", [("id", id_), ("cols", 0), ("rows", 5)]),
                         ("I", [("id", "abc"), ("data", b"x")]),
                         ("P", [("argv", "sh"), ("mode", "wait")])):
        with pytest.raises(AgentError) as refused:
            await client._call(kind, fields)
        assert refused.value.errno in ("EINVAL", "ESRCH")
    with pytest.raises(AgentError) as no_token:
        await AgentClient(client.address).send_input(id_, b"x")
    assert no_token.value.errno == "EACCES"
    await client.signal(id_, signal.SIGKILL)


async def test_pty_runs_on_a_terminal_of_its_size(client):
    script = "stty size; read line; stty size; echo got:$line; exit 3"
    id_, _ = await client.start_pty(["sh", "-c", script], env=ENV, cols=100, rows=30)
    await output_until(client, id_, b"30 100\r\n")
    await client.resize(id_, 132, 43)
    await client.send_input(id_, b"hello\n")
    out, exit_ = await collect_output(client, id_)
    assert b"30 100\r\n" in out and b"43 132\r\n" in out and b"got:hello\r\n" in out
    assert exit_.exit_code == 3
    with pytest.raises(AgentError) as ended:
        await client.resize(id_, 80, 24)
    assert ended.value.errno == "ECHILD"


async def test_pty_is_the_controlling_terminal_and_input_can_interrupt(client):
    id_, _ = await client.start_pty(["sh", "-c", "tty; sleep 30; echo not-interrupted"], env=ENV)
    with pytest.raises(AgentError) as not_closable:
        await client.close_stdin(id_)
    assert not_closable.value.errno == "EINVAL"
    await output_until(client, id_, b"/dev/pts/")
    await asyncio.sleep(0.2)  # sh is now in sleep
    await client.send_input(id_, b"\x03")  # ^C: SIGINT to the terminal's foreground group
    out, exit_ = await collect_output(client, id_)
    assert b"/dev/pts/" in out and b"not-interrupted" not in out
    assert exit_.signal == signal.SIGINT


async def test_pty_output_keeps_only_the_last_max_output_bytes(client):
    id_, _ = await client.start_pty(
        ["sh", "-c", "head -c 8000000 /dev/zero | tr '\\0' y; echo; echo END"], env=ENV,
        max_output=64 << 10)

    async def running() -> bool:
        return {p.id: p for p in await client.list()}[id_].running

    deadline = time.monotonic() + 30
    while await running():  # nobody attached: the agent alone bounds what it keeps
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    out, exit_ = await collect_output(client, id_)
    assert exit_.exit_code == 0 and exit_.stdout_truncated
    assert len(out) <= 64 << 10 and out.endswith(b"END\r\n")


# ports (`N`): the agent runs on the host here, so 127.0.0.1 is the host's loopback


async def _tcp_server(handle) -> tuple[asyncio.base_events.Server, int]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=8 << 20)
    return server, server.sockets[0].getsockname()[1]


async def test_a_port_pipe_carries_bytes_both_ways_then_the_ports_eof(client):
    async def shout(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (line := await reader.readline()) != b"bye\n":
            writer.write(line.upper())
        writer.write(b"done")
        writer.close()

    server, port = await _tcp_server(shout)
    async with server:
        reader, writer = await client.open_port(port)
        for n in (1, 70_000, 3 << 20):  # more than one chunk each way
            writer.write(b"a" * n + b"\n")
            assert await reader.readexactly(n + 1) == b"A" * n + b"\n"
        writer.write(b"bye\n")
        assert await reader.read() == b"done"  # then EOF: the port closed
        writer.close()


async def test_a_port_connection_ends_when_its_client_leaves(client):
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # the agent's close reaches the port as EOF
        closed.set()
        writer.close()

    server, port = await _tcp_server(silent)
    async with server:
        _, writer = await client.open_port(port)
        writer.write(b"partial request")
        writer.close()
        await asyncio.wait_for(closed.wait(), 10)


async def test_a_closed_or_bad_port_is_refused_and_a_port_needs_the_token(agent, client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        unused = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(AgentError) as refused:
            await client.open_port(unused)
    assert refused.value.errno == "ECONNREFUSED"
    for bad in (0, 65536, -1):
        with pytest.raises(AgentError) as invalid:
            await client.open_port(bad)
        assert invalid.value.errno == "EINVAL"
    server, port = await _tcp_server(lambda r, w: w.close())
    async with server:
        with pytest.raises(AgentError) as no_token:
            await AgentClient(agent[1], "x" * 32).open_port(port)
    assert no_token.value.errno == "EACCES"


async def test_a_flooding_port_is_read_only_as_fast_as_its_client_reads(agent, client):
    sent = 0

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        chunk = b"f" * (1 << 20)
        try:
            while True:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
        except ConnectionError:
            pass

    def rss_kib() -> int:
        status = Path(f"/proc/{agent[0].pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])

    server, port = await _tcp_server(flood)
    async with server:
        before = rss_kib()
        reader, writer = await client.open_port(port)
        last, steady = -1, 0
        while steady < 10:  # the flood stalls: every buffer on the way is full
            await asyncio.sleep(0.05)
            steady, last = (steady + 1, last) if sent == last else (0, sent)
        assert sent < 64 << 20  # socket buffers and the agent's one chunk, not the flood
        assert rss_kib() - before < 4 << 10
        assert len(await reader.readexactly(sent // 2)) == sent // 2  # and it flows on
        writer.close()
