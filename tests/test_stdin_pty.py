"""stdin for background processes and terminals (``Sandbox.pty``) end to end: a real server,
real container sandboxes, the public SDK; the trajectory log of a terminal's input and
output; a terminal found again after the client reconnects. (Floods and attacks:
test_hostile_stdin.py.)"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import AsyncIterator

import pytest

import dsec
from conftest import Server, _sandbox


@pytest.fixture
async def sb(client: dsec.DSecClient) -> AsyncIterator[dsec.AsyncSandbox]:
    async for sandbox in _sandbox(client, "debian-minbase", 256):
        yield sandbox


async def read_until(process: dsec.AsyncProcess, marker: str, timeout_s: float = 30) -> str:
    """The process's output from its start until ``marker`` shows (the stream is left)."""
    seen = ""
    async with asyncio.timeout(timeout_s):
        async for chunk in process.stream():
            seen += chunk.text
            if marker in seen:
                return seen
    raise AssertionError(f"{marker!r} never came: {seen!r}")


async def test_stdin_of_a_background_process(sb: dsec.AsyncSandbox) -> None:
    p = await sb.start("cat", stdin="first ", stdin_open=True)
    await p.send_stdin("second\n")
    await p.send_stdin(b"third\n")
    assert await read_until(p, "third\n") == "first second\nthird\n"  # live, before the EOF
    await p.close_stdin()
    result = await p.wait()
    assert (result.exit_code, result.stdout) == (0, "first second\nthird\n")


async def test_stdin_errors_are_typed(sb: dsec.AsyncSandbox) -> None:
    done = await sb.start("true", stdin_open=True)
    await done.wait()
    with pytest.raises(dsec.ProcessExited):
        await done.send_stdin("late")
    plain = await sb.start("sleep 60")
    with pytest.raises(dsec.StdinClosed):
        await plain.send_stdin("x")
    with pytest.raises(dsec.PayloadTooLarge):
        await (await sb.start("cat", stdin_open=True)).send_stdin(b"x" * ((1 << 20) + 1))
    with pytest.raises(dsec.ProcessNotFound):
        await dsec.AsyncProcess(sb, dsec.ProcessInfo(id="424242", pid=0, command="",
                                                    running=False)).send_stdin("x")
    await plain.kill()


async def test_input_a_process_does_not_read_is_refused_once_full(sb: dsec.AsyncSandbox) -> None:
    stuck = await sb.start("sleep 600", stdin_open=True)
    chunk = b"y" * (1 << 20)
    await stuck.send_stdin(chunk)  # the agent holds 1 MiB (the pipe another 64 KiB)
    started = time.monotonic()
    with pytest.raises(dsec.StdinFull):
        for _ in range(3):
            await stuck.send_stdin(chunk)
    assert time.monotonic() - started >= 5  # it waited for the process to make room
    await stuck.kill()
    await stuck.wait()


async def test_a_terminal_types_resizes_and_exits(sb: dsec.AsyncSandbox) -> None:
    term = await sb.pty(100, 30)  # bash
    await term.send_stdin("stty size; echo ready-$((6*7))\n")
    seen = await read_until(term, "ready-42")
    assert "30 100" in seen
    await term.resize(132, 43)
    await term.send_stdin("stty size; tty; echo $TERM; exit 3\n")
    result = await term.wait()
    assert result.exit_code == 3
    assert "43 132" in result.stdout and "/dev/pts/" in result.stdout
    assert "xterm-256color" in result.stdout
    with pytest.raises(dsec.ProcessExited):
        await term.resize(80, 24)
    plain = await sb.start("sleep 5")
    with pytest.raises(dsec.InvalidRequest):  # not a terminal
        await dsec.AsyncPty(sb, dsec.ProcessInfo(id=plain.id, pid=plain.pid, command="",
                                                running=True)).resize(80, 24)


async def test_a_terminal_ends_with_its_process_and_keeps_its_last_output(
        sb: dsec.AsyncSandbox) -> None:
    # a child left holding the terminal open does not keep its process from being reported
    # exited, and what the process wrote last (after a burst) reaches the output
    term = await sb.pty(80, 24, command="sleep 600 & head -c 2000000 /dev/zero | tr '\\0' x;"
                                       " echo; echo LAST; exit 4")
    result = await term.wait()
    assert result.exit_code == 4 and result.stdout.endswith("LAST\r\n")
    with pytest.raises(dsec.ProcessExited):
        await term.send_stdin("late\n")


async def test_a_terminal_outlives_its_client(server: Server, sb: dsec.AsyncSandbox) -> None:
    term = await sb.pty(80, 24, command="sh")
    await term.send_stdin("echo before\n")
    await read_until(term, "before")
    async with server.client() as again:  # a new client, as after a crash of the harness
        found = await (await again.get(sb.id)).process(term.id)
        assert isinstance(found, dsec.AsyncPty)
        await found.send_stdin("echo after; exit\n")
        result = await found.wait()
    assert result.exit_code == 0 and "before" in result.stdout and "after" in result.stdout


async def test_a_terminal_is_logged_in_its_trajectory(client: dsec.DSecClient) -> None:
    trajectory = f"test/pty-{secrets.token_hex(3)}"
    sb = await client.create(ttl_s=120, memory_mb=256, trajectory=trajectory)
    try:
        term = await sb.pty(80, 24, command="sh")
        await term.send_stdin("echo logged-$((40+2)); exit 0\n")
        result = await term.wait()
        assert "logged-42" in result.stdout
    finally:
        await sb.stop()
    steps = await client.trajectory_steps(trajectory)
    assert [s.op for s in steps] == ["pty", "stdin", "output"]
    assert steps[1].request["payload"]["size"] == len("echo logged-$((40+2)); exit 0\n")
    assert steps[2].outcome is not None and steps[2].outcome["chunks"]
    replay = await client.replay(trajectory)  # the terminal again, typed into, in a new sandbox
    try:
        assert [s.op for s in replay.steps] == ["pty", "stdin", "output"]
        # a terminal echoes input when it comes, around the shell's prompt: its output may
        # be ordered otherwise in a replay, which the report then says; the rest is the same
        assert {d.op for d in replay.differences} <= {"output"}
    finally:
        await replay.sandbox.stop()



async def test_stdin_and_a_terminal_on_every_substrate(sandbox: dsec.AsyncSandbox,
                                                       substrate: str) -> None:
    fed = await sandbox.start("cat", stdin_open=True)
    await fed.send_stdin("fed\n")
    await fed.close_stdin()
    assert (await fed.wait()).stdout == "fed\n"
    if substrate == "fn":  # its workers have no devpts
        with pytest.raises(dsec.NotSupported):
            await sandbox.pty(90, 20, command="sh")
        return
    term = await sandbox.pty(90, 20, command="sh")
    await term.send_stdin("stty size; exit 5\n")
    result = await term.wait()
    assert result.exit_code == 5 and "20 90" in result.stdout


def test_the_blocking_client_types_into_a_terminal(server: Server) -> None:
    with dsec.Client(server.url, server.key, autostart=False) as client:
        sb = client.create(ttl_s=120, memory_mb=256)
        try:
            term = sb.pty(80, 24, command="sh")
            term.resize(100, 40)
            term.send_stdin(b"stty size; exit\n")
            assert "40 100" in term.wait().stdout
            fed = sb.start("cat", stdin_open=True)
            fed.send_stdin("blocking\n")
            fed.close_stdin()
            assert fed.wait().stdout == "blocking\n"
            assert isinstance(sb.process(term.id), dsec.Pty)
        finally:
            sb.stop()
