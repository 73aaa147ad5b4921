"""Chaos helpers for test_chaos.py (and benchmarks/chaos.py): a burst of mixed SDK operations
from concurrent clients, the faults injected into it, what the host holds of a server's
sandboxes, and the tallies a run writes.

Every operation of a burst runs under ``asyncio.wait_for(..., CALL_BOUND_S)``: one that hits
the bound is a *hang* (the thing that must never happen); any other ending is a result or a
typed ``DSecError`` counted by kind; anything else is *untyped* (a bug too).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import dsec
from conftest import LOG_DIR, Server
from dsec.substrates.container.container import RUNTIME_DIR
from support.disks import attached_disks

CALL_BOUND_S = 90.0  # generous: a loaded 2-core host; a typed error comes far sooner
BACKOFF_S = 0.5  # a worker whose server is unreachable pauses, as a trainer would
TALLY_DIR = LOG_DIR


@dataclass
class Tally:
    """What one faulted burst did."""

    fault: str
    operations: int = 0
    results: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # typed errors by class name
    examples: dict[str, str] = field(default_factory=dict)  # the first message of each kind
    hung: int = 0
    untyped: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # a result that is not what the call asked
    faults_injected: int = 0
    fault_log: list[str] = field(default_factory=list)
    success_after_death: list[str] = field(default_factory=list)  # must stay empty
    leaks: dict[str, list[str]] = field(default_factory=dict)
    trajectory: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)  # what else a fault's test observed
    seconds: float = 0.0

    def typed(self, exc: dsec.DSecError, what: str) -> None:
        self.errors[type(exc).__name__] += 1
        self.examples.setdefault(type(exc).__name__, f"{what}: {exc}"[:300])

    def injected(self, what: str) -> None:
        self.faults_injected += 1
        self.fault_log.append(what)

    def write(self) -> Path:
        TALLY_DIR.mkdir(exist_ok=True)
        path = TALLY_DIR / f"chaos-{self.fault}.json"
        body = asdict(self)
        body["errors"] = dict(self.errors)
        body["leak_count"] = sum(map(len, self.leaks.values()))
        path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        return path


class Burst:
    """``operations`` mixed calls (create, run, write+read, stream, stop) from ``clients``
    workers over a shared set of sandboxes. ``dead`` holds ids whose agent a fault killed
    (with the time it was confirmed dead): a call started on one after that must not succeed."""

    def __init__(self, clients: list[dsec.DSecClient], tally: Tally, operations: int = 200,
                 seed: int = 7, max_sandboxes: int = 6) -> None:
        self.clients = clients
        self.tally = tally
        self.operations = operations
        self.rng = random.Random(seed)
        self.max_sandboxes = max_sandboxes
        self.sandboxes: list[dsec.AsyncSandbox] = []
        self.dead: dict[str, float] = {}
        self.created: set[str] = set()
        self._issued = 0

    @property
    def issued(self) -> int:
        return self._issued

    async def run(self) -> None:
        await asyncio.gather(*(self._worker(c) for c in self.clients))

    async def _worker(self, client: dsec.DSecClient) -> None:
        while self._issued < self.operations:
            self._issued += 1
            name, op, target = self._pick(client)
            await self._bounded(name, op, target)

    def _pick(self, client: dsec.DSecClient) -> tuple[str, Callable[[], Awaitable[None]], str | None]:
        live = len(self.sandboxes)
        if live < 2 or (live < self.max_sandboxes and self.rng.random() < 0.12):
            return "create", lambda: self._create(client), None
        sb = self.rng.choice(self.sandboxes)
        kind = self.rng.choices(["run", "files", "stream", "stop"], [40, 25, 25, 10])[0]
        if kind == "stop":
            self.sandboxes.remove(sb)
        n = self._issued
        ops = {"run": lambda: self._run(sb), "files": lambda: self._files(sb, n),
               "stream": lambda: self._stream(sb), "stop": sb.stop}
        return kind, ops[kind], sb.id

    async def _bounded(self, name: str, op: Callable[[], Awaitable[None]], target: str | None) -> None:
        started = time.monotonic()
        self.tally.operations += 1
        try:
            await asyncio.wait_for(op(), CALL_BOUND_S)
        except asyncio.TimeoutError:
            self.tally.hung += 1
        except dsec.DSecError as exc:
            self.tally.typed(exc, f"{name} (operation {self.tally.operations})")
            if isinstance(exc, dsec.SandboxDied) and target not in self.dead:
                self.tally.wrong.append(f"{name}: {target} reported died, nobody killed it: {exc}")
            if isinstance(exc, dsec.ServerUnavailable):
                await asyncio.sleep(BACKOFF_S)
        except Exception as exc:  # untyped: a bug the test reports
            self.tally.untyped.append(f"{name}: {exc!r}")
        else:
            self.tally.results += 1
            if target is not None and name != "stop" and self.dead.get(target, started) < started:
                self.tally.success_after_death.append(f"{name} on {target}")

    async def _create(self, client: dsec.DSecClient) -> None:
        sb = await client.create(memory_mb=128, ttl_s=240)
        self.created.add(sb.id)
        self.sandboxes.append(sb)

    async def _run(self, sb: dsec.AsyncSandbox) -> None:
        r = await sb.run("echo $((6*7))", timeout_s=30)
        self._expect("run", r.stdout == "42\n" and r.exit_code == 0, r)

    async def _files(self, sb: dsec.AsyncSandbox, n: int) -> None:
        data = os.urandom(64) + str(n).encode()
        await sb.write_file(f"/work/f{n}", data)
        self._expect("files", await sb.read_file(f"/work/f{n}") == data, n)

    async def _stream(self, sb: dsec.AsyncSandbox) -> None:
        stream = sb.stream("for i in 1 2 3; do echo $i; sleep 0.05; done", timeout_s=30)
        text = "".join([chunk.text async for chunk in stream])
        self._expect("stream", text == "1\n2\n3\n" and stream.result is not None
                     and stream.result.exit_code == 0, text)

    def _expect(self, name: str, ok: bool, what: object) -> None:
        if not ok:
            self.tally.wrong.append(f"{name}: {what!r}"[:300])


def step_command(i: int) -> str:
    """Not idempotent: appends a line, and prints something a re-run would not reproduce."""
    return f"echo step-{i} >> /work/appends; sleep 0.05; echo out-{i}-$(date +%s%N)"


class TrajectoryWorker:
    """A rollout on a sandbox attached to a trajectory: one step after another until told to
    stop or until a call fails (then it records the typed error and the step it hit)."""

    def __init__(self, client: dsec.DSecClient, trajectory: str, tally: Tally) -> None:
        self.client = client
        self.trajectory = trajectory
        self.tally = tally
        self.sandbox_id = ""
        self.results: dict[int, str] = {}  # step -> stdout the worker saw
        self.failed_step: int | None = None
        self.error: str | None = None

    async def run(self, done: Callable[[], bool]) -> None:
        sb = await self.client.create(memory_mb=128, ttl_s=240, trajectory=self.trajectory)
        self.sandbox_id = sb.id
        step = 0
        while not done():
            step += 1
            self.tally.operations += 1
            try:
                r = await asyncio.wait_for(sb.run(step_command(step), timeout_s=30), CALL_BOUND_S)
            except asyncio.TimeoutError:
                self.tally.hung += 1
                return
            except dsec.DSecError as exc:
                self.tally.typed(exc, f"trajectory step {step}")
                self.failed_step, self.error = step, type(exc).__name__
                return
            except Exception as exc:  # untyped: a bug the test reports
                self.tally.untyped.append(f"trajectory step {step}: {exc!r}")
                return
            self.tally.results += 1
            self.results[step] = r.stdout


async def when(condition: Callable[[], bool], timeout_s: float = 120.0) -> None:
    """Wait (polling) for ``condition``; the burst is paced by the host, not by a clock."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


# faults
def agent_pid(server: Server, sandbox_id: str) -> int:
    """The sandbox's init: the in-sandbox agent."""
    return int((server.volume / "sandboxes" / sandbox_id / "pid").read_text())


async def kill_agent(server: Server, burst: Burst, sandbox_id: str) -> None:
    """SIGKILL the sandbox's agent and wait until the kernel has ended it. The burst knows it
    dies from the moment of the kill (a SandboxDied may come before the wait ends), and that
    it is dead once the wait ends (no call started later may succeed)."""
    pid = agent_pid(server, sandbox_id)
    burst.dead[sandbox_id] = float("inf")
    os.kill(pid, signal.SIGKILL)
    await when(lambda: _gone_or_zombie(pid))
    burst.dead[sandbox_id] = time.monotonic()


def _gone_or_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


@contextmanager
def blackhole(port: int) -> Iterator[None]:
    """Drop every loopback packet to or from ``port``: the server's host, as the client sees
    it, vanished (no FIN, no RST ever arrives). An nftables table of its own, removed after."""
    table = f"dsec_chaos_{secrets.token_hex(3)}"
    rules = (f"table inet {table} {{\n chain input {{\n type filter hook input priority -10\n"
             f" tcp dport {port} drop\n tcp sport {port} drop\n }}\n}}\n")
    subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)
    try:
        yield
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], check=True)


# what the host holds
def edge_id(server: Server) -> str:
    with server.http() as http:
        return http.get("/v1/health").json()["edges"][0]["id"]


def host_traces(server: Server, edge: str, sandbox_ids: set[str]) -> dict[str, list[str]]:
    """Every trace of this server's sandboxes on the host: cgroups, mounts, live processes
    (in its cgroups, or holding its state dir), OCI runtime state, sandbox dirs, and network
    namespaces named after one of its sandboxes or its edge."""
    state = str(server.state_dir)
    layers = str(server.state_dir / "layers") + "/"  # the node's image layers: a cache its
    # sandboxes share, kept mounted across restarts (stop_server unmounts them); the disk
    # volume is mounted while the server runs (it unmounts it when it stops with no sandbox)
    mounts = [m for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if (m := line.split()[4]).startswith(state + "/") and not m.startswith(layers)
              and m != str(server.volume)]
    cgroups = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/dsec-{edge}/*") if p.is_dir()]
    cgroups += [str(p) for p in Path("/sys/fs/cgroup").glob(f"dsec-{edge}/*") if p.is_dir()]
    procs = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if _gone_or_zombie(int(proc.name)):
                continue
            if f"/dsec-{edge}/" in (proc / "cgroup").read_text() or \
                    state in (proc / "cmdline").read_bytes().decode(errors="replace"):
                procs.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:120]!r}")
        except OSError:
            pass
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    named = [n for n in netns if n and (edge in n or any(s in n for s in sandbox_ids))]
    return {"mounts": mounts, "cgroups": cgroups, "processes": procs, "netns": named,
            "containers": [p.name for p in (server.volume / RUNTIME_DIR).glob("*/*")],
            "dirs": [p.name for p in (server.volume / "sandboxes").glob("*")],
            "loops": attached_disks(server.volume / "sandboxes")}
