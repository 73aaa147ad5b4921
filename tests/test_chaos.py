"""Chaos: a burst of 200 mixed calls from concurrent SDK clients, and a fault injected in the
middle of it (SIGKILL of the server — API and edge are one process —, with or without a
restart while the burst goes on; SIGKILL of some sandboxes' in-sandbox agent). Every call ends
with a result or a typed error within a bound, the restarted server adopts the survivors and
reports the killed as died, a trajectory's log stays consistent and fast-forwards, and once
everything is stopped the host holds nothing of the server's sandboxes. Also: calls in flight
when the server's host vanishes (half-open TCP) or the server is stuck (SIGSTOP) end with
ServerUnavailable, and the blocking facade behaves as the async SDK.

Tallies go to /tmp/dsec-test-logs/chaos-<fault>.json (see docs/RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import os
import secrets
import signal
import time
from typing import Iterator

import pytest

import dsec
from conftest import Server, make_server, make_tcp_server, stop_server
from support.chaos import (
    CALL_BOUND_S,
    Burst,
    Tally,
    TrajectoryWorker,
    blackhole,
    edge_id,
    host_traces,
    kill_agent,
    step_command,
    when,
)

CLIENTS = 4
FAULT_AT = 60  # operations issued before the fault: well into the burst


@pytest.fixture
def chaos_server(images) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "16", "--warm-pool", "1").start()
    yield srv
    stop_server(srv)


def _clients(server: Server) -> list[dsec.DSecClient]:
    # a create is retried (same idempotency key) while the server is away: a short retry keeps
    # the burst going through a server that stays dead
    return [server.client(retry_s=2) for _ in range(CLIENTS)]


async def _close(clients: list[dsec.DSecClient]) -> None:
    await asyncio.gather(*(c.aclose() for c in clients))


@pytest.mark.parametrize("fault", ["server_kill", "server_kill_restart"])
async def test_server_killed_mid_burst(chaos_server: Server, fault: str) -> None:
    srv, started = chaos_server, time.monotonic()
    edge = edge_id(srv)
    tally = Tally(fault)
    clients = _clients(srv)
    burst = Burst(clients, tally)
    worker = TrajectoryWorker(srv.client(retry_s=10), f"chaos-{secrets.token_hex(4)}", tally)

    async def inject() -> None:
        await when(lambda: burst.issued >= FAULT_AT and len(worker.results) >= 3)
        srv.kill()  # SIGKILL: API server and edge at once, calls in flight
        tally.injected(f"server SIGKILL after {burst.issued} operations")
        victim = next((sb.id for sb in burst.sandboxes), None)
        if victim is not None:  # an agent dies while no server watches it
            await kill_agent(srv, burst, victim)
            tally.injected(f"agent SIGKILL of {victim} while the server is down")
        if fault == "server_kill_restart":
            await asyncio.to_thread(srv.start)  # on the same state dir, while the burst goes on
            tally.fault_log.append(f"server restarted after {burst.issued} operations")

    await asyncio.gather(burst.run(), worker.run(lambda: burst.issued >= burst.operations),
                         inject())
    await _close(clients)
    await worker.client.aclose()
    if srv.proc is None or srv.proc.poll() is not None:
        srv.start()

    async with srv.client() as client:
        tally.trajectory = await _check_trajectory(client, worker)
        await _check_adoption(client, burst, set(burst.dead))
    await _finish(srv, edge, burst, tally, started)
    assert tally.errors["ServerUnavailable"] > 0, "the kill hit no call"


async def test_agents_killed_mid_burst(chaos_server: Server) -> None:
    srv, started = chaos_server, time.monotonic()
    edge = edge_id(srv)
    tally = Tally("agent_kill")
    clients = _clients(srv)
    burst = Burst(clients, tally)
    worker = TrajectoryWorker(srv.client(), f"chaos-{secrets.token_hex(4)}", tally)

    async def inject() -> None:
        await when(lambda: burst.issued >= FAULT_AT and len(burst.sandboxes) >= 2
                   and len(worker.results) >= 3)
        victims = [sb.id for sb in burst.sandboxes[:2]] + [worker.sandbox_id]
        for victim in victims:  # burst sandboxes stay in the burst: calls on them go on
            await kill_agent(srv, burst, victim)
            tally.injected(f"agent SIGKILL of {victim} after {burst.issued} operations")

    injector = asyncio.ensure_future(inject())
    # The rollout goes on until it meets its sandbox's death (or the injection failed).
    failed = lambda: injector.done() and injector.exception() is not None  # noqa: E731
    await asyncio.gather(burst.run(), worker.run(failed), injector)
    await _close(clients)
    await worker.client.aclose()
    async with srv.client() as client:
        for sandbox_id in burst.dead:  # never an empty success
            with pytest.raises(dsec.SandboxDied):
                await (await client.get(sandbox_id)).run("echo hi")
        # The rollout's log ends at the death: its steps ran, the step that met the death
        # (if it got that far) holds the SandboxDied, and resuming says so with the last step.
        assert worker.error == "SandboxDied"
        steps = await client.trajectory_steps(worker.trajectory)
        assert [s.step for s in steps] == list(range(1, len(steps) + 1))
        assert all(s.status == "ok" for s in steps[:len(worker.results)])
        assert all(s.status == "error" and s.outcome is not None and
                   s.outcome["error"]["code"] == "sandbox_died"  # type: ignore[index]
                   for s in steps[len(worker.results):])
        with pytest.raises(dsec.SandboxDied) as died:
            await client.resume(worker.trajectory)
        assert died.value.details["last_step"] == len(steps)
        tally.trajectory = {"steps": len(steps), "finished": len(worker.results),
                            "worker_error": worker.error}
    srv.kill()  # and a restart still tells the dead from the living
    srv.start()
    async with srv.client() as client:
        await _check_adoption(client, burst, set(burst.dead))
    await _finish(srv, edge, burst, tally, started)
    assert tally.errors["SandboxDied"] > 0, "no call met a killed agent"
    assert tally.errors["SandboxError"] == 0, tally.examples  # a dead agent is a death


async def test_server_host_vanishing_mid_call_is_typed(images) -> None:  # type: ignore[no-untyped-def]
    """A server whose host vanishes mid-call (no FIN, no RST: a half-open TCP connection)
    fails a blocking call and a stream with ServerUnavailable, not after the read timeout."""
    srv = make_tcp_server("--capacity", "4", "--warm-pool", "0").start()
    port = int(srv.url.rpartition(":")[2])
    tally = Tally("server_host_vanishes")
    try:
        async with srv.client() as client:
            sb = await client.create(memory_mb=128, ttl_s=120)
            run = asyncio.ensure_future(sb.run("touch /work/a; sleep 300", timeout_s=600))
            stream = sb.stream("touch /work/b; echo started; sleep 300", timeout_s=600)
            streamed = asyncio.ensure_future(stream.wait())
            while not (await sb.exists("/work/a") and await sb.exists("/work/b")):
                await asyncio.sleep(0.05)
            with blackhole(port):
                srv.kill()
                tally.injected("server SIGKILL behind a blackhole (its host vanished)")
                for call in (run, streamed):
                    tally.operations += 1
                    with pytest.raises(dsec.ServerUnavailable) as info:
                        await asyncio.wait_for(call, CALL_BOUND_S)
                    tally.typed(info.value, "in-flight call")
        tally.write()
    finally:
        stop_server(srv)


async def test_stuck_server_is_bounded_by_the_client_timeout(chaos_server: Server) -> None:
    """A server that is alive but stuck (SIGSTOP) still holds its connections open and its
    kernel answers keepalives: the client's read timeout is the bound, then
    ServerUnavailable. The request it sent may still run (once) when the server goes on."""
    srv = chaos_server
    tally = Tally("server_stuck")
    async with srv.client() as client, srv.client(timeout_s=5) as impatient:
        sb = await client.create(memory_mb=128, ttl_s=120)
        same = await impatient.get(sb.id)
        os.kill(srv.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        tally.injected("server SIGSTOP")
        try:
            for call in (same.run("echo late >> /work/late"), same.read_file("/work/late")):
                tally.operations += 1
                with pytest.raises(dsec.ServerUnavailable) as info:
                    await asyncio.wait_for(call, CALL_BOUND_S)
                tally.typed(info.value, "call to a stuck server")
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        # The server goes on. The append, whose client gave up, ran once or not at all
        # (depending on whether the server read its body before it saw the disconnect).
        assert (await sb.run("echo on", timeout_s=30)).stdout == "on\n"
        late = await sb.run("cat /work/late 2>/dev/null", timeout_s=30)
        assert late.stdout in ("", "late\n")
        tally.notes = {"late_call_ran": late.stdout == "late\n"}
        await sb.stop()
    tally.write()


def test_blocking_client_gets_server_unavailable_mid_call(chaos_server: Server) -> None:
    """The blocking facade ends a call and a stream cut by a server SIGKILL the same way."""
    srv = chaos_server
    with dsec.Client(srv.url, srv.key, autostart=False) as client:
        sb = client.create(memory_mb=128, ttl_s=120)
        stream = iter(sb.stream("echo started; sleep 300", timeout_s=600))
        assert next(stream).text == "started\n"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            run = pool.submit(sb.run, "touch /work/a; sleep 300", timeout_s=600)
            while not sb.exists("/work/a"):
                time.sleep(0.05)
            srv.kill()
            with pytest.raises(dsec.ServerUnavailable):
                run.result(timeout=CALL_BOUND_S)
        with pytest.raises(dsec.ServerUnavailable):
            next(stream)
    srv.start()  # the sandbox outlived it
    with dsec.Client(srv.url, srv.key, autostart=False) as client:
        assert client.get(sb.id).run("echo ok").stdout == "ok\n"


async def _check_adoption(client: dsec.DSecClient, burst: Burst, killed: set[str]) -> None:
    """Every sandbox the server lists answers; the burst's survivors are among them; the
    killed ones are reported died, and a call on one raises SandboxDied."""
    listed = {info.id for info in await client.list()}
    assert not listed & killed
    assert {sb.id for sb in burst.sandboxes} - killed <= listed
    for sandbox_id in listed:
        assert (await (await client.get(sandbox_id)).run("echo ok")).stdout == "ok\n"
    for sandbox_id in killed:
        sb = await client.get(sandbox_id)
        assert sb.info.state == "died", sb.info
        with pytest.raises(dsec.SandboxDied):
            await sb.run("echo hi")


async def _check_trajectory(client: dsec.DSecClient, worker: TrajectoryWorker) -> dict[str, object]:
    """The log after the crash: steps 1..n contiguous, each finished with its outcome except
    possibly the last (interrupted: its server died while it ran); each step ran at most once;
    a resumed handle re-issuing the finished steps gets the logged results without running."""
    steps = await client.trajectory_steps(worker.trajectory)
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    finished = [s for s in steps if s.status == "ok"]
    assert len(finished) >= len(steps) - 1 and [s.step for s in finished] == \
        list(range(1, len(finished) + 1))
    interrupted = steps[-1].step if steps and steps[-1].status == "interrupted" else None
    assert all(s.outcome is not None for s in finished)
    assert interrupted is None or steps[-1].outcome is None
    logged = {s.step: base64.b64decode(s.outcome["bytes"]["stdout"]["b64"]).decode()  # type: ignore[index]
              for s in finished}
    for step, stdout in worker.results.items():  # what the worker saw is what was logged
        assert logged[step] == stdout

    resumed = await client.resume(worker.trajectory)
    for step in range(1, len(finished) + 1):
        assert (await resumed.run(step_command(step), timeout_s=30)).stdout == logged[step]
    assert resumed.fast_forwarded == len(finished)
    if interrupted is not None:
        with pytest.raises(dsec.StepInterrupted):
            await resumed.run(step_command(interrupted), timeout_s=30)
    appends = (await resumed.read_file("/work/appends")).decode().split()
    ran = [f"step-{i}" for i in range(1, len(finished) + 1)]
    # at most once: the interrupted step ran once or not at all, the others exactly once
    assert appends in (ran, ran + [f"step-{interrupted}"])
    return {"steps": len(steps), "finished": len(finished), "interrupted": interrupted,
            "fast_forwarded": resumed.fast_forwarded, "worker_error": worker.error,
            "worker_failed_step": worker.failed_step}


async def _finish(srv: Server, edge: str, burst: Burst, tally: Tally, started: float) -> None:
    """Stop every sandbox and the server, then count what the host still holds."""
    async with srv.client() as client:
        for info in await client.list():
            await (await client.get(info.id)).stop()
    srv.kill(signal.SIGTERM)
    tally.leaks = host_traces(srv, edge, burst.created)
    tally.seconds = round(time.monotonic() - started, 1)
    path = tally.write()
    assert tally.hung == 0 and not tally.untyped and not tally.wrong, path.read_text()
    assert not tally.success_after_death, path.read_text()
    assert tally.leaks == {k: [] for k in tally.leaks}, path.read_text()
    assert tally.operations >= burst.operations and tally.faults_injected > 0
