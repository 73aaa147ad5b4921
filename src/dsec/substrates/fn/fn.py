"""The fn substrate: calls into a pre-warmed pool of jailed worker processes.

Per image, one template process runs the image's own Python inside the image's read-only
root with chosen libraries imported (``fn_launch`` starts it, ``fn_template`` is its code);
it forks workers, each jailed before it takes a call (namespaces, cgroup, seccomp, rlimits,
no capabilities, private /tmp and /work) and waiting. A call takes one, sends the pickled
function, reads the result, and the worker ends; the pool refills in the background
(``fn_pool``). An fn *sandbox* is a worker that execs the in-sandbox agent as its init and
answers ``run``/files for its lifetime; it lives as long as the server that made it.

Host layout under ``<state>/fn/``: ``support/`` (the top, read-only layer every template root
gets: the template code, cloudpickle, the agent, dsec's shell and tar in ``.dsec/bin``, the
seccomp filter, mount points),
``roots/<key>`` (mount points, used only inside each template's mount namespace),
``<key>.log``. Nothing a worker writes is on the host's disk: its /tmp, /work, /dev/shm and
run directory (an fn sandbox's agent socket, reached at ``/proc/<pid>/root/.dsec/run``) are
tmpfs mounts of its own namespace, charged to its memory cgroup. Cgroups:
``/dsec-fn-<edge>/<key>/{template,<worker>}`` in the cpu, memory, pids and freezer
hierarchies (cgroup v2: one tree, whose ``cgroup.freeze`` pauses an fn sandbox).

What a worker answers is hostile data: the server passes a call's pickle through without
unpickling it, parses its errors as plain JSON with sizes capped, and the SDK decodes results
as plain data unless the caller opts in (``client/fn.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import sys
from pathlib import Path
from typing import IO, Any, Callable

import cloudpickle

from ...agent.build import agent_binary
from ...agent.client import AgentClient
from ...agent.tools import install_tools
from ...config import current
from ...images.mount import LayerMounter
from ...images.store import Image
from ...protocol.errors import (
    CommandTimeout,
    NotSupported,
    RemoteError,
    SandboxDied,
    SandboxError,
)
from ...protocol.models import CreateRequest
from ..base import StartPlan, Substrate
from ..host import cgroups, spawn
from ..host.oci_spec import AGENT_SOCKET, MASKED_PATHS, READONLY_PATHS
from ..host.seccomp import fn_filter_bpf
from .fn_pool import START_TIMEOUT_S, Death, Template, Worker, WorkerGone
from .fn_tree import TREES

log = logging.getLogger("dsec.fn")
LANGUAGES = {"python": "python3", "bash": "bash", "c": "gcc", "cpp": "g++"}
IMAGE_PYTHON = "/usr/bin/python3"
COMPILE_TIMEOUT_S = 30.0
MAX_ERROR_FIELD = 64 << 10  # of a remote error's type, message and traceback, each
# A call's worker's limits: also what a call holds of its project's quota while it runs.
FN_CALL_CPU = 1.0
FN_CALL_MEMORY_MB = 512
FN_CONTROLLERS = ("cpu", "memory", "pids", "freezer")  # the v1 hierarchies a worker joins
FN_TREE = Path(__file__).with_name("fn_tree.py")  # packs and unpacks a worker's tmpfs trees
TREE_TIMEOUT_S = 120.0
TREE_RECORD_BYTES = 512  # the most one packed record (a name of 255 bytes and headers) takes


class FnSubstrate(Substrate):
    name = "fn"

    def __init__(self, state_dir: Path, edge_id: str, pool_size: int = 8,
                 preload: tuple[str, ...] | None = None, cpu: float = FN_CALL_CPU,
                 memory_mb: int = FN_CALL_MEMORY_MB,
                 pids: int = 64, tmp_mb: int = 256, mounter: LayerMounter | None = None) -> None:
        self.root = state_dir / "fn"
        self.cgroup_parent = f"/dsec-fn-{edge_id}"
        self.pool_size = pool_size
        # Modules every template imports before it forks (those the image lacks are skipped).
        self.preload = preload if preload is not None else current().fn_preload
        self.limits = (cpu, memory_mb, pids)
        self.tmp_mb = tmp_mb
        self.mounter = mounter or LayerMounter()
        self._templates: dict[str, Template] = {}
        self._template_lock = asyncio.Lock()
        self._sandboxes: dict[str, Worker] = {}
        self.template_deaths = 0  # templates that exited while the server ran

    # host preparation --------------------------------------------------------------------
    async def prepare(self) -> None:
        """Sweep what an earlier server left (fn workers never outlive their server), then
        lay out the support layer."""
        await asyncio.to_thread(self._sweep)
        await asyncio.to_thread(self._support)

    def _sweep(self) -> None:
        dirs = [d for base in _hierarchies() if (d := base / self.cgroup_parent.strip("/")).is_dir()]
        cgroups.remove_cgroups(dirs)
        shutil.rmtree(self.root, ignore_errors=True)

    def _support(self) -> None:
        support = self.root / "support"
        fn_dir = support / ".dsec" / "fn"
        for d in (fn_dir / "lib", support / ".dsec" / "run", support / ".dsec" / "oldroot",
                  support / "work", self.root / "roots"):
            d.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(__file__).with_name("fn_template.py"), fn_dir / "template.py")
        shutil.copytree(Path(cloudpickle.__file__).parent, fn_dir / "lib" / "cloudpickle",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (fn_dir / "seccomp.bpf").write_bytes(fn_filter_bpf())
        shutil.copy(agent_binary(), support / ".dsec" / "agent")
        install_tools(support / ".dsec" / "bin")  # dsec's shell and tar (agent/tools.py)

    async def close(self) -> None:
        for sandbox_id in list(self._sandboxes):
            await self.destroy(sandbox_id)
        for template in self._templates.values():
            await template.close()
        self._templates.clear()
        await asyncio.to_thread(self._sweep)

    # templates -----------------------------------------------------------------------------
    async def template(self, image: Image) -> Template:
        key = image.digest.removeprefix("sha256:")[:16]
        template = self._templates.get(key)
        if template is not None and template.alive():
            return template
        async with self._template_lock:
            template = self._templates.get(key)
            if template is None or not template.alive():
                if template is not None:
                    await template.close()
                template = await asyncio.to_thread(self._new_template, image, key)
                template.start()
                self._templates[key] = template
        return template

    def _new_template(self, image: Image, key: str) -> Template:
        lowers = [str(p) for p in self.mounter.lowerdirs(image)]
        if not _in_layers(lowers, IMAGE_PYTHON):
            raise NotSupported(f"the fn substrate runs the image's own Python, and image "
                               f"{image.name!r} has no {IMAGE_PYTHON}", image=image.name)
        root = self.root / "roots" / key
        root.mkdir(parents=True, exist_ok=True)
        parents, limits = _cgroup_parents(f"{self.cgroup_parent}/{key}", *self.limits)
        prefix = "w" + secrets.token_hex(3)
        launch = {
            "root": str(root), "python": IMAGE_PYTHON,
            "lowers": [str(self.root / "support"), *lowers],
            "template_cgroup_procs": [str(p / "template" / "cgroup.procs") for p in parents],
            "worker_cgroup_parents": [str(p) for p in parents],
            "template": {"preload": list(self.preload), "tmp_mb": self.tmp_mb, "nofile": 1024,
                         "prefix": prefix, "cgroups": limits,
                         "masked_paths": MASKED_PATHS, "readonly_paths": READONLY_PATHS},
        }
        return Template(key, self.pool_size, launch, self.root / f"{key}.log",
                        on_exit=lambda: self._after_template(parents, prefix))

    def _after_template(self, parents: list[Path], prefix: str) -> None:
        """A template died (it should not: nothing a call does reaches it): its workers
        follow it by their parent-death signal, and their cgroups, which it removed, go
        now. The next call or create starts a new template."""
        self.template_deaths += 1
        asyncio.get_running_loop().run_in_executor(None, _remove_worker_cgroups, parents, prefix)

    def _cgroup_of(self, template_key: str) -> str:
        return f"{self.cgroup_parent}/{template_key}"

    # calls -------------------------------------------------------------------------------
    async def call(self, image: Image, payload: bytes, timeout_s: float) -> bytes:
        """Run a cloudpickled ``(fn, args, kwargs)`` in a fresh worker; the pickled value.
        Raises RemoteError (the function raised), CommandTimeout, or SandboxDied."""
        kind, body = await self._exchange(image, b"C" + payload, timeout_s)
        if kind == b"E":
            raise _remote_error(body)
        return body

    async def run_code(self, image: Image, language: str, code: str, stdin: str,
                       timeout_s: float, max_output_bytes: int) -> dict[str, Any]:
        """Write, compile (C, C++) and run a program in a fresh worker: the result fields."""
        tool = LANGUAGES.get(language)
        if tool is None:
            raise NotSupported(f"run_code knows {sorted(LANGUAGES)}, not {language!r}")
        lowers = [str(p) for p in await asyncio.to_thread(self.mounter.lowerdirs, image)]
        if not _in_layers(lowers, f"/usr/bin/{tool}"):
            raise NotSupported(f"image {image.name!r} has no {tool}: {language} cannot run there",
                               image=image.name, language=language)
        request = {"language": language, "code": code, "stdin": stdin, "timeout_s": timeout_s,
                   "max_output_bytes": max_output_bytes}
        outer = timeout_s + (COMPILE_TIMEOUT_S if language in ("c", "cpp") else 0) + 10
        _, body = await self._exchange(image, b"X" + json.dumps(request).encode(), outer)
        return json.loads(body)

    async def _exchange(self, image: Image, frame: bytes, timeout_s: float,
                        retry: bool = True) -> tuple[bytes, bytes]:
        """One request to a fresh worker. A worker that dies because its template did (which
        no call can cause) is not the call's doing: the call runs once more, on the new
        template; it had no effect outside its worker (no network, private files)."""
        worker = await (await self.template(image)).take()
        orphaned = False
        try:
            reply = await asyncio.wait_for(worker.exchange(frame), timeout_s)
            if reply[:1] == b"D":  # the call's process died; the worker saw how
                raise _died(await self._call_death(worker, json.loads(reply[1:])["status"]))
        except asyncio.TimeoutError:
            raise CommandTimeout(f"the call did not return within {timeout_s}s; its worker "
                                 "was killed", timeout_s=timeout_s) from None
        except WorkerGone:
            death = await worker.ended()
            orphaned = retry and not worker.template.alive()
            if not orphaned:
                raise _died(death) from None
        finally:
            worker.kill()  # it ends by itself after answering; whatever it left behind goes too
            worker.close()
        if orphaned:
            log.warning("an fn call's worker died with its template %s; running it again",
                        worker.template.key)
            return await self._exchange(image, frame, timeout_s, retry=False)
        return reply[:1], reply[1:]

    async def _call_death(self, worker: Worker, status: int) -> Death:
        """How a call's process died. A SIGKILL with no OOM kill counted yet may be one the
        kernel has not counted (cgroup v1 counts after the kill): the template's report,
        read once the worker has also exited, settles it."""
        oom = cgroups.oom_kills(self._cgroup_of(worker.template.key), worker.wid)
        if not oom and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            reported = await worker.ended()
            oom = reported.oom_kills if reported is not None else 0
        return Death(status, oom)

    # sandboxes: a worker running the agent as its init ------------------------------------
    async def start(self, plan: StartPlan) -> dict[str, Any]:
        if plan.request.runtime is not None:
            raise NotSupported("fn sandboxes have no OCI runtime to choose", runtime=plan.request.runtime)
        worker, facts = await self._start_worker(plan, secrets.token_hex(32))
        self._sandboxes[plan.sandbox_id] = worker
        return facts

    async def _start_worker(self, plan: StartPlan, token: str) -> tuple[Worker, dict[str, Any]]:
        """A fresh worker running the agent, claimed with ``token``; its tmpfs trees restored
        from ``plan.disk_from`` (a packed tree) before the agent starts."""
        packed = open(plan.disk_from, "rb") if plan.disk_from else None  # gone: FileNotFoundError
        try:
            template = await self.template(plan.image)
            worker = await template.take()
            try:
                parent = self._cgroup_of(template.key)
                cgroups.set_limits(parent, worker.wid, plan.request.cpu,
                                   plan.request.memory_mb << 20, plan.request.pids)
                # A sandbox's loopback works, as a container's does (a call's stays down).
                if await spawn.run(["nsenter", f"--net=/proc/{worker.pid}/ns/net",
                                    "ip", "link", "set", "lo", "up"]) != 0:
                    raise SandboxError("could not bring up the fn sandbox's loopback")
                if packed is not None:
                    procs = [str(h / parent.strip("/") / worker.wid / "cgroup.procs")
                             for h in _hierarchies()]
                    await _tree("restore", ["unpack", str(worker.pid), *procs], stdin=packed)
                await worker.send(b"A")
                ready = await asyncio.wait_for(worker.recv_exact(1), START_TIMEOUT_S)
                if ready != b"R":
                    raise WorkerGone
                facts = {"pid": worker.pid, "worker": worker.wid, "template": template.key,
                         "token": token}
                await self.agent(plan.sandbox_id, facts).claim()  # before any user command can run
            except BaseException as exc:
                worker.kill()
                worker.close()
                if isinstance(exc, (WorkerGone, asyncio.TimeoutError)):
                    raise SandboxError("the fn worker did not start the agent") from None
                raise
        finally:
            if packed is not None:
                packed.close()
        return worker, facts

    async def snapshot_disk(self, sandbox_id: str, runtime: dict[str, Any], dest: Path) -> None:
        """The worker's tmpfs trees (``fn_tree.TREES``) packed into ``dest`` while it is frozen
        (a consistent copy: nothing in it runs), by a separate process that never follows
        the sandbox's links; at most what the trees can hold."""
        parent, wid = self._cgroup_of(runtime["template"]), runtime["worker"]
        await asyncio.to_thread(cgroups.set_frozen, parent, wid, True)
        try:
            with open(dest, "xb") as out:
                await _tree("snapshot", ["pack", str(runtime["pid"]), str(self.max_tree_bytes)],
                            stdout=out)
        finally:
            await asyncio.to_thread(cgroups.set_frozen, parent, wid, False)

    @property
    def max_tree_bytes(self) -> int:
        """The most a packed tree can take: every tree's tmpfs full of data, and every inode
        it allows (``nr_inodes``, one per 4 KiB) a record of a maximal name."""
        per_tree = (self.tmp_mb << 20) + self.tmp_mb * 256 * TREE_RECORD_BYTES
        return len(TREES) * per_tree + (1 << 20)

    async def rollback(self, plan: StartPlan, runtime: dict[str, Any]) -> dict[str, Any]:
        """A fresh worker restored from the snapshot takes the sandbox's id and token; the old
        one (and everything it ran) is killed once the new one answers."""
        worker, facts = await self._start_worker(plan, runtime["token"])
        old = self._sandboxes.get(plan.sandbox_id)
        self._sandboxes[plan.sandbox_id] = worker
        if old is not None:
            await self._retire(old)
        return facts

    async def claim(self, sandbox_id: str, runtime: dict[str, Any], request: CreateRequest,
                    started: CreateRequest) -> None:
        cgroups.set_limits(self._cgroup_of(runtime["template"]), runtime["worker"], request.cpu,
                           request.memory_mb << 20, request.pids)

    def agent(self, sandbox_id: str, runtime: dict[str, Any]) -> AgentClient:
        # the socket is in the worker's own tmpfs; SO_PEERCRED tells a reused pid apart
        return AgentClient(f"/proc/{runtime['pid']}/root{AGENT_SOCKET}", runtime["token"],
                           runtime["pid"])

    def alive(self, sandbox_id: str, runtime: dict[str, Any]) -> bool:
        worker = self._sandboxes.get(sandbox_id)
        return worker is not None and worker.alive()

    def watch(self, sandbox_id: str, runtime: dict[str, Any], on_exit: Callable[[], None]) -> None:
        worker = self._sandboxes.get(sandbox_id)
        if worker is None or not worker.alive():
            on_exit()
            return
        loop = asyncio.get_running_loop()
        fd = worker.pidfd

        def exited() -> None:
            loop.remove_reader(fd)
            on_exit()
        loop.add_reader(fd, exited)

    def death_cause(self, sandbox_id: str, runtime: dict[str, Any]) -> str:
        worker = self._sandboxes.get(sandbox_id)
        if self.oom_kills(sandbox_id, runtime) or (
                worker is not None and worker.death.done() and worker.death.result().oom_kills):
            return "out of memory: the kernel killed the sandbox's init"
        if worker is None:
            return "fn sandboxes end with the server that started them"
        return "the sandbox's init process exited"

    def oom_kills(self, sandbox_id: str, runtime: dict[str, Any]) -> int:
        return cgroups.oom_kills(self._cgroup_of(runtime["template"]), runtime["worker"])

    async def set_paused(self, sandbox_id: str, runtime: dict[str, Any],
                         paused: bool) -> dict[str, Any]:
        """The worker's freezer cgroup, as a container's: the agent and everything it started."""
        await asyncio.to_thread(cgroups.set_frozen, self._cgroup_of(runtime["template"]),
                                runtime["worker"], paused)
        return runtime

    async def destroy(self, sandbox_id: str) -> None:
        worker = self._sandboxes.pop(sandbox_id, None)
        if worker is not None:
            await self._retire(worker)

    async def _retire(self, worker: Worker) -> None:
        """Kill a sandbox's worker, unwatched (its end is no death the edge must hear of)."""
        if worker.pidfd >= 0:
            asyncio.get_running_loop().remove_reader(worker.pidfd)
        # a frozen task does not die of SIGKILL until thawed (cgroup v1)
        await asyncio.to_thread(cgroups.thaw_if_frozen, self._cgroup_of(worker.template.key),
                                worker.wid)
        worker.kill()
        worker.close()  # the template reaps it and removes its cgroup

    async def leftovers(self) -> set[str]:
        return set()  # fn sandboxes end with their server; prepare() sweeps what they left


async def _tree(what: str, args: list[str], stdin: IO[bytes] | None = None,
                stdout: IO[bytes] | None = None) -> None:
    """Run ``fn_tree.py`` (pack or unpack a worker's trees) in a process of its own, killed
    at TREE_TIMEOUT_S or when the caller gives up; SandboxError with its reason on failure."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", str(FN_TREE), *args, stdin=stdin or asyncio.subprocess.DEVNULL,
        stdout=stdout or asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), TREE_TIMEOUT_S)
    except BaseException as exc:
        proc.kill()
        await proc.wait()
        if isinstance(exc, asyncio.TimeoutError):
            raise SandboxError(f"the fn sandbox's {what} did not finish within "
                               f"{TREE_TIMEOUT_S:.0f}s") from None
        raise
    if proc.returncode != 0:
        reason = err.decode(errors="replace").strip()[-500:] or f"exit status {proc.returncode}"
        raise SandboxError(f"the fn sandbox's {what} failed: {reason}", reason=reason)


def _died(death: Death | None) -> SandboxDied:
    reason = death.describe() if death else "the worker ended without answering"
    return SandboxDied(f"fn worker died: {reason}", reason=reason,
                       oom_killed=bool(death and death.oom_kills))


def _remote_error(body: bytes) -> RemoteError:
    """The error a call raised, as its worker's child reported it: untrusted plain data,
    so only strings, each capped."""
    try:
        error = json.loads(body)
        fields = [error[k][:MAX_ERROR_FIELD] for k in ("type", "message", "traceback")]
        if not all(isinstance(f, str) for f in fields):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return RemoteError("the call answered a malformed error", remote_type="", traceback="")
    kind, message, tb = fields
    return RemoteError(f"{kind}: {message}", remote_type=kind, traceback=tb)


def _remove_worker_cgroups(parents: list[Path], prefix: str) -> None:
    try:
        cgroups.remove_cgroups([d for parent in parents if parent.is_dir() for d in parent.iterdir()
                                if d.is_dir() and d.name.startswith(prefix + "-")])
    except OSError as exc:  # the server's stop sweeps them at the latest
        log.warning("could not remove the worker cgroups of a dead fn template (%s): %s", prefix, exc)


def _hierarchies() -> list[Path]:
    root = cgroups.CGROUP_ROOT
    return [root] if cgroups.is_cgroup2_only() else [root / c for c in FN_CONTROLLERS]


def _cgroup_parents(parent: str, cpu: float, memory_mb: int,
                    pids: int) -> tuple[list[Path], list[dict[str, Any]]]:
    """Make ``parent`` and its ``template`` child in each hierarchy the workers need; the
    parents, and what the template writes into each worker's cgroup there."""
    quota, period, memory = int(cpu * cgroups.CPU_PERIOD_US), cgroups.CPU_PERIOD_US, memory_mb << 20
    rel = parent.strip("/")
    if cgroups.is_cgroup2_only():
        base = cgroups.CGROUP_ROOT
        for level in (base / rel.split("/")[0], base / rel):
            level.mkdir(exist_ok=True)
            (level / "cgroup.subtree_control").write_text("+cpu +memory +pids")
        (base / rel / "template").mkdir(exist_ok=True)
        return [base / rel], [{"limits": {"cpu.max": f"{quota} {period}", "memory.max": str(memory),
                                          "pids.max": str(pids)}, "oom": ["memory.events", *cgroups.OOM_KEYS["memory.events"]]}]
    limits = {"cpu": {"cpu.cfs_period_us": str(period), "cpu.cfs_quota_us": str(quota)},
              "memory": {"memory.limit_in_bytes": str(memory)},
              "pids": {"pids.max": str(pids)}, "freezer": {}}
    parents, specs = [], []
    for base in _hierarchies():
        d = base / rel
        (d / "template").mkdir(parents=True, exist_ok=True)
        parents.append(d)
        specs.append({"limits": limits[base.name],
                      "oom": ["memory.oom_control", *cgroups.OOM_KEYS["memory.oom_control"]] if base.name == "memory" else None})
    return parents, specs


def _in_layers(lowers: list[str], path: str) -> bool:
    return any(os.path.lexists(os.path.join(lower, path.lstrip("/"))) for lower in lowers)

