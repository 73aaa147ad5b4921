"""Trajectory log: fast-forward after a preempted client or a crashed server, divergence and
forks, deterministic replay, a dead sandbox, provenance export. Real servers, real sandboxes,
a real SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import dsec
from conftest import Server, make_server, stop_server
from support.trajectory_worker import SLOW_STEP, STEPS, result_record, step_command

WORKER = Path(__file__).parent / "support" / "trajectory_worker.py"


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(request: pytest.FixtureRequest, images) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    """The log on both state stores: embedded SQLite, and PostgreSQL as when scaled out."""
    args = ["--capacity", "64"]
    if request.param == "postgres":
        args += ["--state-url", request.getfixturevalue("postgres_url")]
    srv = make_server(*args).start()
    yield srv
    stop_server(srv)


def new_id(prefix: str) -> str:
    return f"test/{prefix}-{secrets.token_hex(3)}"


async def check_state(sb: dsec.AsyncSandbox, steps: int) -> None:
    """The sandbox ran each step exactly once: `steps` appends in order, counter at `steps`."""
    # Read by a fresh, unattached look at the sandbox's files would itself be a logged call,
    # so read through the handle: these become the next steps of the trajectory.
    appends = (await sb.read_file("/work/appends")).decode().splitlines()
    assert appends == [f"step-{i}" for i in range(1, steps + 1)]
    assert (await sb.read_file("/work/counter")).decode().strip() == str(steps)


async def test_client_killed_mid_trajectory_resumes_without_rerunning(server: Server) -> None:
    trajectory = new_id("sigkill")
    worker = subprocess.Popen([sys.executable, str(WORKER), server.url, server.key, trajectory,
                               "create"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    original = {}
    try:
        assert worker.stdout is not None
        for line in worker.stdout:
            record = json.loads(line)
            original[record["step"]] = record
            if record["step"] == 30:
                await asyncio.sleep(0.3)  # step 31 (which takes 1 s) is running now
                worker.send_signal(signal.SIGKILL)
                killed_at = time.time()
                break
    finally:
        worker.kill()
        worker.wait()
    assert worker.returncode == -signal.SIGKILL and sorted(original) == list(range(1, 31)), \
        worker.stderr.read().decode() if worker.stderr else ""

    async with server.client() as client:
        sb = await client.resume(trajectory)
        for i in range(1, STEPS + 1):
            record = result_record(i, await sb.run(step_command(i)))
            if i <= 30:
                assert record == original[i], f"step {i} differs from its first result"
        assert sb.fast_forwarded >= 30
        # Step 31 was the killed worker's: the resumed call got that one execution's result.
        assert (await client.trajectory_steps(trajectory))[SLOW_STEP - 1].started_at < killed_at
        await check_state(sb, STEPS)
        await sb.stop()


async def test_server_killed_between_steps(images) -> None:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "8").start()
    trajectory = new_id("server-kill")
    try:
        async with srv.client() as client:
            sb = await client.create(ttl_s=300, memory_mb=256, trajectory=trajectory)
            original = {i: result_record(i, await sb.run(step_command(i))) for i in range(1, 31)}
            srv.kill()  # SIGKILL, between steps
            srv.start()
            # The same handle carries on (its first call retries until the server is back).
            original.update({i: result_record(i, await sb.run(step_command(i)))
                             for i in range(31, 41)})

        async with srv.client() as client:  # a restarted worker re-issues everything
            sb = await client.resume(trajectory)
            for i in range(1, STEPS + 1):
                record = result_record(i, await sb.run(step_command(i)))
                if i in original:
                    assert record == original[i], f"step {i} differs from its first result"
            assert sb.fast_forwarded == 40
            await check_state(sb, STEPS)

            # A server killed *during* a step: nobody knows what the step did.
            slow = asyncio.ensure_future(sb.run("sleep 1.5; echo slow >> /work/appends"))
            await asyncio.sleep(0.5)
            srv.kill()
            srv.start()
            with pytest.raises(dsec.StepInterrupted) as info:
                await slow  # retried with its step after the restart: the log says interrupted
            assert info.value.details["step"] == STEPS + 3

            # Forking at the interrupted step replays the steps before it into a new sandbox.
            forked = await client.resume(trajectory, on_divergence="fork")
            for i in range(1, STEPS + 1):
                await forked.run(step_command(i))
            await forked.read_file("/work/appends")
            await forked.read_file("/work/counter")
            r = await forked.run("sleep 1.5; echo slow >> /work/appends")
            assert r.exit_code == 0 and forked.id != sb.id
            assert (await forked.read_file("/work/appends")).decode().splitlines() == \
                [f"step-{i}" for i in range(1, STEPS + 1)] + ["slow"]
            info_now = await client.trajectory(trajectory)
            assert info_now.generation == 2 and info_now.generations[1].forked_at_step == STEPS + 3
            # The fork's replay re-ran steps that print the time: those differ, and are noted.
            assert set(info_now.generations[1].replay_differences) == set(range(1, STEPS + 1))
            await forked.stop()
    finally:
        stop_server(srv)


async def test_names_shaped_like_log_records_survive_a_server_kill_as_names(images) -> None:  # type: ignore[no-untyped-def]
    """An agent names files like records of the server's outcome journal finishing its
    grader's step with exit 0, then the server is killed: after the restart every logged
    step answers as it first did, and the names come back as the names they were."""
    srv = make_server("--capacity", "8").start()
    trajectory = f"forged-records-{secrets.token_hex(3)}"  # no "/": it goes in file names
    forged_key = json.dumps(["ok", 1.0, trajectory, 1, 1, "x"], separators=(",", ":"))
    names = [f'\n{forged_key}\t{{"value":{{"exit_code":0}},"bytes":{{}}}}\n', "\t" + forged_key,
             "\r\n" + forged_key]
    try:
        async with srv.client() as client:
            sb = await client.create(ttl_s=300, memory_mb=256, trajectory=trajectory)
            grader = await sb.run("echo graded; exit 3")
            made = await sb.run(["sh", "-c", 'mkdir -p /work/d && cd /work/d && touch -- "$@"',
                                 "sh", *names])
            listed = sorted(e.name for e in await sb.list_files("/work/d"))
            assert grader.exit_code == 3 and made.exit_code == 0 and listed == sorted(names)
            srv.kill()
            srv.start()
            resumed = await client.resume(trajectory)
            again = await resumed.run("echo graded; exit 3")
            assert (again.exit_code, again.stdout) == (3, "graded\n")
            await resumed.run(["sh", "-c", 'mkdir -p /work/d && cd /work/d && touch -- "$@"',
                               "sh", *names])
            assert sorted(e.name for e in await resumed.list_files("/work/d")) == listed
            assert resumed.fast_forwarded == 3
            steps = await client.trajectory_steps(trajectory)
            assert [s.status for s in steps] == ["ok", "ok", "ok"]
    finally:
        stop_server(srv)


async def test_divergence_raises_and_fork_continues(client: dsec.DSecClient) -> None:
    trajectory = new_id("diverge")
    sb = await client.create(ttl_s=120, memory_mb=256, trajectory=trajectory)
    await sb.write_file("/work/a", "one\n")
    await sb.run("echo two >> /work/a")
    assert (await sb.run("cat /work/a")).stdout == "one\ntwo\n"

    resumed = await client.resume(trajectory)
    await resumed.write_file("/work/a", "one\n")
    with pytest.raises(dsec.TrajectoryDiverged) as info:
        await resumed.run("echo TWO >> /work/a")
    d = info.value.details
    assert d["step"] == 2 and d["logged"]["params"]["command"] == "echo two >> /work/a"
    assert d["issued"]["params"]["command"] == "echo TWO >> /work/a"
    assert not isinstance(info.value, dsec.StepInterrupted)

    forked = await client.resume(trajectory, on_divergence="fork")
    await forked.write_file("/work/a", "one\n")
    r = await forked.run("echo TWO >> /work/a")  # diverges: a fork, then runs there
    assert r.exit_code == 0 and forked.id != sb.id and forked.generation == 2
    assert (await forked.run("cat /work/a")).stdout == "one\nTWO\n"
    old = await client.get(sb.id)
    assert old.info.state == "stopped" and "forked at step 2" in (old.info.reason or "")

    again = await client.resume(trajectory)  # the fork is the trajectory now
    assert again.id == forked.id
    await again.write_file("/work/a", "one\n")
    await again.run("echo TWO >> /work/a")
    assert (await again.run("cat /work/a")).stdout == "one\nTWO\n"
    assert again.fast_forwarded == 3
    await again.stop()


async def test_replay_reports_exactly_the_nondeterministic_step(client: dsec.DSecClient) -> None:
    deterministic = new_id("replay-same")
    sb = await client.create(ttl_s=120, memory_mb=256, trajectory=deterministic)
    await sb.mkdir("/work/src")
    await sb.write_file("/work/src/main.sh", "echo hello from main\n", mode=0o755)
    await sb.run("sh src/main.sh > out.txt; echo built")
    assert [e.name for e in await sb.list_files("/work/src")] == ["main.sh"]
    assert (await sb.stat("/work/out.txt")).size == len("hello from main\n")
    assert await sb.read_file("/work/out.txt") == b"hello from main\n"
    assert not await sb.exists("/work/missing")  # a logged error is part of the trajectory
    p = await sb.start("for i in 1 2 3; do echo $i; done; echo done >&2")
    assert (await p.wait()).stdout == "1\n2\n3\n"
    assert "".join([c.text async for c in sb.stream("seq 3; echo e >&2")]) == "1\n2\n3\ne\n"
    session = sb.session("s")
    assert (await session.run("cd /tmp && export X=1")).exit_code == 0
    assert (await session.run("echo $X $PWD")).stdout == "1 /tmp\n"

    report = await client.replay(deterministic)
    assert [s.op for s in report.steps] == ["mkdir", "write", "exec", "list", "stat", "read",
                                            "stat", "start", "output", "exec", "exec", "exec"]
    assert report.differences == [], report.differences
    assert report.sandbox.id != sb.id and report.sandbox.trajectory is None
    await report.sandbox.stop()

    clocked = new_id("replay-date")
    sb = await client.create(ttl_s=120, memory_mb=256, trajectory=clocked)
    await sb.run("echo before > /work/f")
    await sb.run("date +%s%N")
    await sb.run("cat /work/f")
    report = await client.replay(clocked)
    assert [(d.step, d.fields) for d in report.differences] == [(2, ["stdout"])]
    assert report.first_difference is not None and report.first_difference.op == "exec"
    await report.sandbox.stop()
    await sb.stop()


async def test_dead_sandbox_resume_reports_and_replay_carries_on(client: dsec.DSecClient,
                                                                 server: Server) -> None:
    trajectory = new_id("died")
    sb = await client.create(ttl_s=120, memory_mb=256, trajectory=trajectory)
    await sb.write_file("/work/notes", "first\n")
    await sb.run("echo second >> /work/notes")
    pid_file = server.volume / "sandboxes" / sb.id / "pid"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the sandbox dies under the trainer
    await asyncio.sleep(0.3)
    with pytest.raises(dsec.SandboxDied) as info:
        await client.resume(trajectory)
    assert info.value.details["last_step"] == 2 and info.value.details["sandbox_id"] == sb.id

    replay = await client.replay(trajectory, attach=True)
    assert replay.differences == [] and replay.attached_generation == 2
    carried = replay.sandbox
    await carried.write_file("/work/notes", "first\n")
    await carried.run("echo second >> /work/notes")
    assert carried.fast_forwarded == 2
    assert (await carried.run("echo third >> /work/notes; cat /work/notes")).stdout == \
        "first\nsecond\nthird\n"
    await carried.stop()


async def test_large_outputs_go_to_blobs_and_streams_replay_in_order(client: dsec.DSecClient,
                                                                    server: Server) -> None:
    trajectory = new_id("blobs")
    sb = await client.create(ttl_s=120, memory_mb=256, trajectory=trajectory)
    big = await sb.run("head -c 200000 /dev/urandom | base64 -w 0")
    script = "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.05; done"
    live = [(c.stream, c.data) async for c in sb.stream(script)]
    await sb.write_file("/work/big.bin", os.urandom(100_000))

    steps = await client.trajectory_steps(trajectory)
    stdout_ref = steps[0].outcome["bytes"]["stdout"]  # type: ignore[index]
    assert "sha256" in stdout_ref and stdout_ref["size"] == len(big.stdout_bytes)
    digest = stdout_ref["sha256"]
    assert (server.state_dir / "blobs" / "sha256" / digest[:2] / digest).exists()
    payload = steps[2].request["payload"]["sha256"]  # the written data, also a blob
    assert (server.state_dir / "blobs" / "sha256" / payload[:2] / payload).stat().st_size == 100_000

    for prefetch in (True, False):
        again = await client.resume(trajectory, prefetch=prefetch)
        assert (await again.run("head -c 200000 /dev/urandom | base64 -w 0")).stdout == big.stdout
        replayed = [(c.stream, c.data) async for c in again.stream(script)]
        assert b"".join(d for s, d in replayed if s == "stdout") == b"out1\nout2\nout3\n"
        assert [s for s, _ in replayed] == [s for s, _ in _merged(live)]
        assert again.fast_forwarded == 2
    await sb.stop()


def _merged(chunks: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for stream, data in chunks:
        if out and out[-1][0] == stream:
            out[-1] = (stream, out[-1][1] + data)
        else:
            out.append((stream, data))
    return out


async def test_trajectory_ids_and_plain_sandboxes(client: dsec.DSecClient, server: Server) -> None:
    trajectory = new_id("ids")
    sb = await client.create(ttl_s=60, trajectory=trajectory)
    with pytest.raises(dsec.TrajectoryExists):
        await client.create(ttl_s=60, trajectory=trajectory)
    with pytest.raises(dsec.TrajectoryNotFound):
        await client.resume("test/no-such-trajectory")
    with pytest.raises(dsec.InvalidRequest):
        await client.create(trajectory="bad/-/id")
    await sb.stop()
    plain = await client.create(ttl_s=60)  # no trajectory: no headers, nothing logged
    with server.http(authenticated=True) as http:
        r = http.post(f"/v1/sandboxes/{plain.id}/exec", json={"command": "true"},
                      headers={"x-dsec-step": "1"})
        assert r.status_code == 200 and "x-dsec-trajectory" not in r.headers
    assert plain.info.trajectory is None and plain.trajectory is None
    await plain.stop()


def test_cli_show_and_export(server: Server) -> None:
    env = {**os.environ, "DSEC_URL": server.url, "DSEC_API_KEY": server.key, "COLUMNS": "200"}
    trajectory = new_id("cli")
    with dsec.Client(server.url, server.key, autostart=False) as client:
        sb = client.create(ttl_s=60, trajectory=trajectory)
        sb.run("echo provenance")
        sb.write_file("/work/x", b"data")
        image_digest = sb.info.image_digest
        resumed = client.resume(trajectory)
        assert resumed.run("echo provenance").stdout == "provenance\n"
        assert resumed.fast_forwarded == 1
        sb.stop()

    def cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "dsec", "trajectory", *args], env=env,
                              capture_output=True, text=True, timeout=60, check=True).stdout

    lines = [json.loads(line) for line in cli("export", trajectory, "--format", "jsonl").splitlines()]
    head, steps = lines[0], lines[1:]
    assert head["type"] == "trajectory" and head["id"] == trajectory
    assert head["created_by"]["key_name"] == "local"
    assert head["generations"][0]["image_digest"] == image_digest
    assert [(s["step"], s["op"], s["status"]) for s in steps] == [(1, "exec", "ok"), (2, "write", "ok")]
    assert steps[0]["image_digest"] == image_digest and steps[0]["caller"]["key_name"] == "local"
    assert steps[0]["outcome"]["bytes"]["stdout"]["b64"] == "cHJvdmVuYW5jZQo="
    assert steps[1]["request"]["payload"]["b64"] == "ZGF0YQ=="
    shown = cli("show", trajectory)
    assert "echo provenance" in shown and "exit 0" in shown and "/work/x" in shown
