"""Hostile sandboxes against stdin and terminals (issue 17): written as an agent trying to
cheat would. It talks to the agent's socket itself to type into a process the harness feeds,
writes into every terminal it can open hoping one is another sandbox's, replaces /dev/ptmx
so the next terminal is its own device, and floods its terminal; the harness's calls get
typed errors and nothing it did reaches past its sandbox or its bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

import dsec
from conftest import Server
from test_hostile import create, hostile  # noqa: F401

RUNTIMES = ["crun", "runsc"]

# Frames the agent's socket takes (docs/AGENT_PROTOCOL.md), built with the standard library
# inside the sandbox: input for processes 1-32 with no token and a guessed one, a claim, a
# frame that does not parse and one of a forbidden size. Prints each reply's type and errno.
INJECT = r"""
import socket, struct

def frame(kind, fields):
    body = kind.encode() + b"".join(
        bytes([len(k)]) + k.encode() + struct.pack(">I", len(v)) + v for k, v in fields)
    return struct.pack(">I", len(body)) + body

def ask(raw):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect("/.dsec/run/agent.sock")
    except OSError:  # gVisor: the host's socket is not the sandbox's to connect to
        return "no-connect"
    s.sendall(raw)
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    body = reply[4:]
    at = body.find(b"\x05errno")
    errno = b""
    if at >= 0:
        (n,) = struct.unpack(">I", body[at + 6:at + 10])
        errno = body[at + 10:at + 10 + n]
    return body[:1].decode() + ":" + errno.decode(errors="replace")

out = []
for id_ in range(1, 33):
    out.append(ask(frame("I", [("id", str(id_).encode()), ("data", b"INJECTED\n")])))
    out.append(ask(frame("I", [("token", b"0" * 64), ("id", str(id_).encode()),
                               ("data", b"INJECTED\n")])))
out.append(ask(frame("C", [("token", b"a" * 64)])))
out.append(ask(struct.pack(">I", 3) + b"I\x05x"))
out.append(ask(struct.pack(">I", 0)))
print(" ".join(sorted(set(out))))
"""

# Writes to every terminal device this sandbox can open, and to every process's stdin it
# can reach through /proc (its own sandbox's only: that is its own business).
SPRAY = r"""
import glob, os
hit = []
for path in glob.glob("/dev/pts/*") + ["/dev/tty", "/dev/console"]:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
        os.write(fd, b"INJECTED\n")
        os.close(fd)
        hit.append(path)
    except OSError:
        pass
print(" ".join(hit))
"""


@pytest.fixture
async def python_sb(client: dsec.DSecClient, hostile: list[dsec.AsyncSandbox],  # noqa: F811
                    request: pytest.FixtureRequest) -> AsyncIterator[dsec.AsyncSandbox]:
    yield await create(client, hostile, image="python-3.11", memory_mb=256,
                       runtime=getattr(request, "param", "crun"))


@pytest.mark.parametrize("python_sb", RUNTIMES, indirect=True)
async def test_a_process_cannot_type_into_another_through_the_agent(python_sb) -> None:
    sb = python_sb
    fed = await sb.start("cat", stdin_open=True)
    await sb.write_file("/work/inject.py", INJECT)
    replies = await sb.run("python3 /work/inject.py", timeout_s=60)
    assert replies.exit_code == 0, replies.stderr
    # no token, a guessed one, a second claim, garbage, a bad length: all refused, none served
    answers = set(replies.stdout.split())
    assert answers == {"no-connect"} or (
        answers <= {"X:EACCES", "X:EPERM", "X:EINVAL", "X:EMSGSIZE"} and
        {"X:EACCES", "X:EPERM"} <= answers), answers
    await fed.send_stdin("from the harness\n")
    await fed.close_stdin()
    result = await fed.wait()
    assert result.stdout == "from the harness\n"


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_a_terminal_cannot_be_reached_from_another_sandbox(
        client: dsec.DSecClient, hostile: list[dsec.AsyncSandbox], runtime: str) -> None:  # noqa: F811
    victim = await create(client, hostile, image="python-3.11", memory_mb=256, runtime=runtime)
    attacker = await create(client, hostile, image="python-3.11", memory_mb=256, runtime=runtime)
    term = await victim.pty(80, 24, command="cat")  # echoes what it is typed, and what it reads
    await attacker.write_file("/work/spray.py", SPRAY)
    sprayed = await attacker.run("python3 /work/spray.py", timeout_s=60)
    assert sprayed.exit_code == 0, sprayed.stderr
    await term.send_stdin("mine\n")
    await asyncio.sleep(0.5)
    await term.kill()
    result = await term.wait()
    assert "mine" in result.stdout and "INJECTED" not in result.stdout


@pytest.mark.parametrize("python_sb", RUNTIMES, indirect=True)
async def test_a_replaced_ptmx_fails_the_terminal_not_the_agent(python_sb) -> None:
    sb = python_sb
    for swap in ("mkfifo /dev/ptmx", "touch /work/f && ln -s /work/f /dev/ptmx",
                 "ln -s /dev/zero /dev/ptmx"):
        swapped = await sb.run(f"rm -f /dev/ptmx && {swap}")
        assert swapped.exit_code == 0, swapped.stderr
        started = time.monotonic()
        with pytest.raises(dsec.InvalidRequest):
            await sb.pty(80, 24, command="sh")
        assert time.monotonic() - started < 30  # the agent was not held by what it opened
        assert (await sb.run("echo agent fine")).stdout == "agent fine\n"


# Bytes a terminal floods, per runtime. gVisor's terminal (Debian's runsc 20221219) takes
# writes without back-pressure, holding what the agent has not read yet in its sentry's heap,
# charged to the sandbox's memory: a 300 MB flood OOM-kills a 256 MB runsc sandbox (its own
# bound, reported died). 40 MB is still 40 times the agent's 1 MiB cap, and most of it is
# still queued when the flood's process exits, so the output's end tests the agent's drain.
FLOOD_BYTES = {"crun": 300_000_000, "runsc": 40_000_000}


@pytest.mark.parametrize("python_sb", RUNTIMES, indirect=True)
async def test_a_terminal_flood_stays_in_its_bound(python_sb,
                                                   request: pytest.FixtureRequest) -> None:
    sb = python_sb
    flood = FLOOD_BYTES[request.node.callspec.params["python_sb"]]
    term = await sb.pty(80, 24, command=f"yes FLOOD | head -c {flood}; echo; echo END",
                        max_output_bytes=1 << 20)
    deadline = time.monotonic() + 120
    while next(p for p in await sb.processes() if p.id == term.id).running:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    result = await term.wait()
    assert result.stdout_truncated and result.stdout.endswith("END\r\n")
    assert len(result.stdout_bytes) <= 1 << 20
    assert (await sb.run("echo still here")).stdout == "still here\n"


async def test_bad_input_calls_are_typed_refusals(server: Server, client: dsec.DSecClient,
                                                  hostile: list[dsec.AsyncSandbox]) -> None:  # noqa: F811
    sb = await create(client, hostile, image="debian-minbase", memory_mb=256)
    fed = await sb.start("cat", stdin_open=True)
    base = f"/v1/sandboxes/{sb.id}"
    with server.http(authenticated=True) as http:  # what the SDK would refuse before sending
        refusals = {
            "huge": http.post(f"{base}/processes/{fed.id}/stdin", content=b"x" * (2 << 20)),
            "unknown": http.post(f"{base}/processes/99999/stdin", content=b"x"),
            "not a number": http.post(f"{base}/processes/1x/stdin", content=b"x"),
            "zero cols": http.post(f"{base}/processes/{fed.id}/resize", json={"cols": 0, "rows": 5}),
            "giant pty": http.post(f"{base}/ptys", json={"cols": 10 ** 6, "rows": 5}),
            "run with stdin_open": http.post(f"{base}/exec", json={"command": "cat",
                                                                   "stdin_open": True}),
            "not a terminal": http.post(f"{base}/processes/{fed.id}/resize",
                                        json={"cols": 80, "rows": 24}),
        }
    codes = {name: (r.status_code, r.json()["error"]["code"]) for name, r in refusals.items()}
    assert codes == {
        "huge": (413, "payload_too_large"), "unknown": (404, "process_not_found"),
        "not a number": (404, "process_not_found"), "zero cols": (400, "invalid_request"),
        "giant pty": (400, "invalid_request"), "run with stdin_open": (400, "invalid_request"),
        "not a terminal": (400, "invalid_request"),
    }
    await fed.send_stdin("still open\n")  # none of it touched the process
    await fed.close_stdin()
    assert (await fed.wait()).stdout == "still open\n"
