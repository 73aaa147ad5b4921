"""The edge: one per host. Admission, lifecycle, and every call into a live sandbox.

Its operations (``create``, ``run``, ``read_file``, ...) are the ones of the table in
``dsec.protocol.ops``, with the table's signatures (tests/unit/test_operations.py checks).

The edge is the only component that touches substrates. It keeps an in-memory table of live
sandboxes (rebuilt from the state store after a restart) and turns substrate and agent
failures into the SDK's typed errors: a call into a sandbox that died raises ``SandboxDied``
with the cause, never an empty result.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import dataclasses
import hashlib
import logging
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from ..agent.client import AgentClient, AgentError, AgentUnavailable, Exit, Output
from ..agent.tools import TAR
from ..images.node_uses import NodeUses
from ..images.store import Image, ImageConfig, ImageStore
from ..images.upper import copy_upper
from ..network.hosts import pin_in_sandbox
from ..network.policy import Egress, ServiceTable, resolve
from ..protocol.build import BuildLog, ImageBuildRequest, ImageBuilt
from ..protocol.errors import (
    CapacityExhausted,
    DSecError,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    NotSupported,
    PayloadTooLarge,
    ProcessExited,
    ProcessNotFound,
    SandboxDied,
    SandboxError,
    SandboxNotFound,
    SnapshotNotFound,
    StdinClosed,
    StdinFull,
)
from ..protocol.fn import CodeResult, RunCodeRequest
from ..protocol.models import (
    CreateRequest,
    ExecRequest,
    ExecResult,
    FileEntry,
    Network,
    ProcessInfo,
    PtyRequest,
    SandboxInfo,
    Snapshot,
    b64,
)
from ..store.sqlite import SandboxRow, SnapshotRow, StateStore
from ..substrates.base import StartPlan, Substrate
from ..substrates.fn.fn import FnSubstrate
from ..substrates.host.image_copy import allocated_bytes
from ..substrates.host.openfiles import RESERVE, ensure_open_files
from ..substrates.host.tree import remove_tree
from ..substrates.host.volume import DiskVolume
from .commands import DEFAULT_CWD, as_user, check_env, exec_argv, sandbox_path
from .dockerbuild import build_events, sweep_scratch
from .inherit import from_snapshot, inheritance
from .metrics import EdgeMetrics
from .pool import Pooled, WarmPool
from .ports import PortConnections
from .shared_snapshots import SharedSnapshots

DESTROYS_AT_ONCE = 16  # background destroys of stopped sandboxes running at a time
log = logging.getLogger("dsec.edge")

T = TypeVar("T")
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "LANG": "C.UTF-8"}
ARCHIVE_LIMIT = 1 << 30
SNAPSHOT_DISK = "disk.img"  # a snapshot's disk (or packed trees), in <state>/snapshots/<id>/
SNAPSHOT_MEMORY = "memory.bin"  # and a `full` snapshot's saved memory and devices (VMs)
EXPORT_WAIT_S = 60.0  # how long a create elsewhere waits for a snapshot's export to finish
FETCHED_SWEEP_S = 10.0  # how often an edge drops its copies of snapshots deleted elsewhere
AGENT_DEATH_GRACE_S = 5.0  # how long a dying sandbox may take to be seen dead (see _still_alive)
STDIN_CHUNK_MAX = 1 << 20  # one send_stdin: at most what the agent holds for a process
STDIN_WAIT_S = 10.0  # how long send_stdin waits for a process to read earlier input
TERM = "xterm-256color"  # a terminal's TERM unless the sandbox's or the call's env sets one


def default_edge_id(state_dir: Path) -> str:
    """Stable per host and state directory, so two edges on one host never share ids."""
    digest = hashlib.sha256(f"{socket.gethostname()}:{state_dir.resolve()}".encode()).hexdigest()
    return "e" + digest[:6]


@dataclass
class EdgeConfig:
    state_dir: Path
    edge_id: str = ""
    capacity: int = 256
    warm_pool: int = 2
    warm_pool_max: int = 0  # what a burst grows an image's pool to, at most (pool.py)
    warm_pool_hold_s: int = 600  # how long after the burst, in seconds
    reap_interval_s: float = 0.5
    network_services: Path | None = None  # the operator's service table (TOML)
    shared_snapshots: Path | None = None  # snapshots exported for every node (shared_snapshots.py)
    port_idle_s: float = 60.0  # a sandbox's port that sends nothing for this long: cut (ports.py)
    pull: str = "never"  # "missing": a create of a registry reference not stored pulls it

    def __post_init__(self) -> None:
        self.edge_id = self.edge_id or default_edge_id(self.state_dir)
        self.network_services = self.network_services or self.state_dir / "network-services.toml"


@dataclass
class Live:
    row: SandboxRow
    substrate: Substrate
    agent: AgentClient
    env: dict[str, str]  # the base environment of every command: image, then request
    user: str = ""  # the image's USER: its commands run as it (commands.as_user)
    cwd: str = DEFAULT_CWD  # the image's working directory: a command's default cwd
    rolling_back: bool = False  # its init is being restarted: a failed call is not its death
    # Its last snapshot and the disk's write count as of it (Substrate.disk_writes): an equal
    # count later means the disk is still that snapshot's.
    last_snapshot: tuple[str, int] | None = None
    # One change of its processes or disk at a time: pause, resume, snapshot, rollback, and
    # stop, which waits for the one under way (a rollback finishing after a stop's clean-up
    # would leave a running container; a snapshot, a disk shut down under it).
    changing: asyncio.Lock = field(default_factory=asyncio.Lock)


class Edge:
    def __init__(self, config: EdgeConfig, store: StateStore, images: ImageStore,
                 substrates: dict[str, Substrate], metrics: EdgeMetrics,
                 volume: DiskVolume) -> None:
        self.config = config
        self.volume = volume  # disk images and snapshots: one reflink file system
        self.id = config.edge_id
        self.store = store
        self.images = images
        self.uses = NodeUses(images, self.id)  # the layers this node uses, for the image GC
        self.substrates = substrates
        self.metrics = metrics
        self.ports = PortConnections(config.port_idle_s)
        self.services = ServiceTable(config.network_services)
        metrics.watch(self)
        self.pools = {name: WarmPool(substrate, self.id, config.warm_pool, config.warm_pool_max,
                                     config.warm_pool_hold_s, self._pool_room)
                      for name, substrate in substrates.items()}
        self._live: dict[str, Live] = {}
        self._paused: set[str] = set()  # the live ones paused: ``load`` counts without a scan
        self._tasks: set[asyncio.Future[None]] = set()
        # Destroys of halted sandboxes, off their stop's path (``_remove``): bounded, so a
        # burst of stops never forks a runtime per sandbox at once; awaited by ``close``.
        self._destroying: set[asyncio.Future[None]] = set()
        self._destroy_slots = asyncio.Semaphore(DESTROYS_AT_ONCE)
        self._starting = 0
        self._calling = 0  # fn calls in flight
        self._reaper: asyncio.Task[None] | None = None
        self.shared = SharedSnapshots(config.shared_snapshots) if config.shared_snapshots else None
        self._fetching: dict[str, asyncio.Lock] = {}  # one fetch of a snapshot at a time
        self._pulls: dict[str, asyncio.Future[Image]] = {}  # one pull of a reference at a time
        self.on_end: list[Callable[[str, str, str], None]] = []  # (sandbox id, state, reason)
        self.on_snapshot_deleted: list[Callable[[str], None]] = []  # (snapshot id)

    # lifecycle of the edge itself
    async def start(self) -> None:
        self._size_open_files()
        await asyncio.to_thread(self.volume.open)
        for substrate in self.substrates.values():
            await substrate.prepare()
        await self.recover()
        await asyncio.to_thread(self.uses.start, [image for live in self._live.values()
                                                  if (image := self._image_of(live.row))])
        self._reaper = asyncio.create_task(self._reap_forever(), name="dsec-reaper")

    def _size_open_files(self) -> None:
        """The server's limit on open files raised to what the capacity needs, or the start
        refused: a node would otherwise fail creates with EMFILE below its capacity."""
        per_sandbox = max((s.open_files for s in self.substrates.values()), default=0)
        needed = self.config.capacity * per_sandbox + RESERVE
        allowed = ensure_open_files(needed)
        if allowed < needed:
            raise NotSupported(
                f"a capacity of {self.config.capacity} sandboxes needs {needed} open files of "
                f"the server ({per_sandbox} per sandbox, {RESERVE} of its own), and it may "
                f"open {allowed} (ulimit -n): raise the limit, or lower --capacity")

    async def close(self) -> None:
        """Stop serving; sandboxes keep running and are adopted by the next start. Warm-pool
        sandboxes were never handed out, so they go."""
        if self._reaper:
            self._reaper.cancel()
        await asyncio.gather(*self._destroying)  # nothing half removed is left for recover()
        for pool in self.pools.values():
            await pool.close()
        for substrate in self.substrates.values():
            await substrate.close()
        await asyncio.to_thread(self.uses.stop, {live.row.image_digest
                                                 for live in self._live.values()})
        if not self._live:  # their disks are on it (a container's mounts, in its own mount
            await asyncio.to_thread(self.volume.close)  # namespace, do not keep it busy)

    def _image_of(self, row: SandboxRow) -> Image | None:
        """The image version an adopted sandbox runs on; None (logged) if no record of it
        is left (its layers cannot be kept for it)."""
        try:
            return self.images.version(row.image_digest)
        except DSecError as exc:
            log.warning("sandbox %s: %s", row.id, exc)
            return None

    async def recover(self) -> None:
        """Adopt the sandboxes that survived a restart; remove everything else we left."""
        adopted = set()
        for row in self.store.sandboxes(edge=self.id, live_only=True):
            substrate = self.substrates.get(row.substrate)
            # a paused (frozen) sandbox is alive: adopted paused, resumed by its next call
            if substrate and row.state in ("running", "paused") and substrate.alive(row.id, row.runtime):
                if row.state == "running":
                    await self._undo_interrupted(row, substrate)
                self._adopt(row, substrate)
                adopted.add(row.id)
            else:
                reason = ("interrupted while starting" if row.state == "starting"
                          else "found gone when the edge restarted")
                self.store.mark_ended(row.id, "died", reason)
        for substrate in self.substrates.values():
            for sandbox_id in await substrate.leftovers() - adopted:
                log.info("removing leftover sandbox %s", sandbox_id)
                try:
                    await substrate.destroy(sandbox_id)
                except Exception as exc:  # one sandbox's remains never stop the edge starting
                    log.exception("could not remove leftover sandbox %s", sandbox_id)
                    self.store.event("cleanup_failed", sandbox_id, reason=repr(exc)[:500])
                    continue
                self.store.event("cleanup", sandbox_id, reason="leftover after restart")
        for d in self._snapshot_dir("-").parent.glob("sn-*"):
            if self.store.get_snapshot(d.name) is None:  # a crash before its row was written
                log.info("removing unrecorded snapshot files %s", d)
                await asyncio.to_thread(remove_tree, d)
        if self.shared is not None:
            for name in await asyncio.to_thread(self.shared.sweep, self._recorded):
                log.info("removed %s from the shared snapshot directory", name)
        for name in await asyncio.to_thread(sweep_scratch, self):
            log.info("removed %s, the scratch image of a build cut short", name)

    async def _undo_interrupted(self, row: SandboxRow, substrate: Substrate) -> None:
        """A freeze an interrupted snapshot left is undone; a failure is the sandbox's (its
        calls will say so), never the edge's start."""
        try:
            await substrate.undo_interrupted(row.id, row.runtime)
        except Exception as exc:
            log.exception("could not undo an interrupted operation on sandbox %s", row.id)
            self.store.event("cleanup_failed", row.id, reason=repr(exc)[:500])

    def _adopt(self, row: SandboxRow, substrate: Substrate,
                config: ImageConfig | None = None) -> None:
        """Serve the sandbox. ``config``: its image's run config as the create resolved it;
        when an edge adopts running sandboxes, the recorded version's (a version is its
        layers: a name rebuilt with the same layers and another USER keeps its first)."""
        if config is None:
            image = self._image_of(row)
            config = image.config if image is not None else ImageConfig()
        self._live[row.id] = Live(row, substrate, substrate.agent(row.id, row.runtime),
                                  row.request["env"], user=config.user,
                                  cwd=config.working_dir or DEFAULT_CWD)
        self._count_paused(row)
        substrate.watch(row.id, row.runtime, lambda: self._exited(row.id))

    def _exited(self, sandbox_id: str) -> None:
        live = self._live.get(sandbox_id)
        if live is not None:
            cause = live.substrate.death_cause(sandbox_id, live.row.runtime)
            self._background(self.stop(sandbox_id, "died", cause))

    def _background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # create / stop
    def load(self) -> int:
        """Sandboxes running or starting, and fn calls in flight: each holds a slot. A paused
        sandbox uses no CPU and holds none (its resume is never refused: it may overcommit)."""
        return len(self._live) - len(self._paused) + self._starting + self._calling

    def _pool_room(self) -> int:
        """Sandboxes the warm pools may still add: the free capacity beside the load and
        what they hold (pooled sandboxes are no load, but hold the same files)."""
        return self.config.capacity - self.load() - sum(p.held() for p in self.pools.values())

    def _admit(self) -> None:
        if self.load() >= self.config.capacity:
            raise CapacityExhausted(f"edge {self.id} is at its capacity of "
                                    f"{self.config.capacity} sandboxes", edge=self.id)

    async def create(self, req: CreateRequest) -> SandboxInfo:
        started = time.perf_counter()
        try:
            info, warm = await self._create(req)
        except DSecError as exc:
            self.metrics.create_failures.labels(req.substrate, exc.code).inc()
            raise
        self.metrics.create_seconds.labels(req.substrate, "warm" if warm else "cold").observe(
            time.perf_counter() - started)
        return info

    async def _create(self, req: CreateRequest) -> tuple[SandboxInfo, bool]:
        """The sandbox, and whether it came from the warm pool."""
        snap, disk_from, memory_from = None, None, None
        if req.snapshot is not None:  # the snapshot's image and disk, the parent's limits
            snap = self.store.get_snapshot(req.snapshot)  # any edge's: fetched if not here
            if snap is None or snap.expired(time.time()):
                raise SnapshotNotFound(f"no snapshot {req.snapshot!r}", snapshot=req.snapshot)
            req = from_snapshot(req, snap, self.store)
        substrate = self.substrates.get(req.substrate)
        if substrate is None:
            raise NotSupported(f"substrate {req.substrate!r} is not served by edge {self.id}",
                               served=sorted(self.substrates))
        egress = await self._egress(substrate, req.network)
        check_env(req.env)
        self._admit()
        if substrate.disk_volume:
            self.volume.check_room(req.disk_mb << 20)
        self._starting += 1
        try:
            # pulled first, where the server may
            found = await self._image(req.image) if snap is None else None
            # A snapshot's own image version, whatever its name points at now (its writable
            # layer fits only those layers): the version is kept while the snapshot is.
            image = found if found is not None and self.uses.recorded(found) else \
                await asyncio.to_thread(
                    self.uses.resolve, lambda: self.images.get(req.image) if snap is None
                    else self.images.version(snap.image_digest))
            if snap is not None:
                disk_from = await self._snapshot_file(snap)
                memory_from = self._snapshot_files(snap)[1]
            image_env = dict(kv.partition("=")[::2] for kv in image.config.env)
            req = req.model_copy(update={"env": {**BASE_ENV, **image_env, **req.env}})
            pool = self.pools.get(req.substrate)
            pooled = (pool.take(image) if pool and pool.fits(req) and disk_from is None
                      else None)
            plan = StartPlan("", req, image, disk_from=disk_from,  # the id is _start's
                             memory_from=memory_from)
            try:
                row = await (self._claim(substrate, req, pooled, egress) if pooled
                             else self._start(substrate, plan, egress))
            except FileNotFoundError:
                if snap is None or self.store.get_snapshot(snap.id) is not None:
                    raise
                raise SnapshotNotFound(f"snapshot {snap.id} was deleted while a sandbox was "
                                       "being made from it", snapshot=snap.id) from None
            self._adopt(row, substrate, image.config)
            if pool:
                pool.refill(image)
        finally:
            self._starting -= 1
        self.store.event("created", row.id, image=req.image, warm=pooled is not None)
        return self.info(row), pooled is not None

    async def _image(self, ref: str) -> Image:
        """The image of a create: pulled first when missing and the server may (``--pull
        missing``); concurrent creates of one new image wait for one pull (the store's lock
        makes it one across processes too)."""
        try:
            return self.images.get(ref)
        except ImageNotFound as exc:
            if not self.images.pullable(ref):
                raise
            if self.config.pull != "missing":
                raise ImageNotFound(f"{exc.message}. {ref!r} is a registry reference: pull it "
                                    f"first (dsec image pull {ref}), or serve with --pull "
                                    "missing", ref=ref) from None
        pull = self._pulls.get(ref)
        if pull is None:
            pull = self._pulls[ref] = asyncio.ensure_future(
                asyncio.to_thread(self.images.pull, ref, missing_only=True))
            pull.add_done_callback(lambda _: self._pulls.pop(ref, None))
        return await asyncio.shield(pull)

    def _row(self, sandbox_id: str, req: CreateRequest, image_digest: str, state: str) -> SandboxRow:
        now = time.time()
        return SandboxRow(id=sandbox_id, edge=self.id, substrate=req.substrate, image=req.image,
                          image_digest=image_digest, state=state, request=req.model_dump(),
                          created_at=now, expires_at=now + req.ttl_s)

    async def _start(self, substrate: Substrate, plan: StartPlan,
                     egress: Egress | None) -> SandboxRow:
        """Start ``plan`` under a new id. Record the sandbox as starting first, so a crash
        mid-start leaves a trace to clean."""
        req = plan.request
        row = self._row(f"sb-{self.id}-{secrets.token_hex(6)}", req, plan.image.digest, "starting")
        self.store.insert_sandbox(row)
        try:
            row.runtime = await substrate.start(dataclasses.replace(plan, sandbox_id=row.id))
            if egress is not None:
                await self._apply_network(substrate, row.id, row.runtime, egress, fresh=True)
        except BaseException as exc:
            self.store.mark_ended(row.id, "died", f"failed to start: {exc}")
            if row.runtime:
                await substrate.destroy(row.id)
            raise
        row.state = "running"
        row.expires_at = time.time() + req.ttl_s  # the TTL counts from when it can serve
        self.store.mark_running(row.id, row.runtime, row.expires_at)
        return row

    async def _claim(self, substrate: Substrate, req: CreateRequest, pooled: Pooled,
                     egress: Egress | None) -> SandboxRow:
        try:
            await substrate.claim(pooled.sandbox_id, pooled.runtime, req, pooled.request)
            if egress is not None:  # pooled sandboxes start with no network: wired on claim
                await self._apply_network(substrate, pooled.sandbox_id, pooled.runtime, egress,
                                          fresh=True)
        except BaseException as exc:
            await substrate.destroy(pooled.sandbox_id)
            if isinstance(exc, OSError):
                raise SandboxError(f"could not apply limits to a warm sandbox: {exc}") from exc
            raise
        row = self._row(pooled.sandbox_id, req, pooled.image.digest, "running")
        row.runtime = pooled.runtime
        self.store.insert_sandbox(row)
        return row

    async def stop(self, sandbox_id: str, state: str = "stopped", reason: str = "stopped by client") -> None:
        """Never called with the sandbox's ``changing`` lock held: it waits for it."""
        live = self._end(sandbox_id, state, reason)
        if live is None:
            self.get_row(sandbox_id)  # raises the right error for an unknown or ended sandbox
            return
        await self._remove(live, state, reason)

    def _end(self, sandbox_id: str, state: str, reason: str) -> Live | None:
        """The sandbox recorded ended and out of reach of any later call; None if it was
        not live. Its removal (``_remove``) follows."""
        live = self._live.pop(sandbox_id, None)
        self._paused.discard(sandbox_id)
        if live is not None:
            self.store.mark_ended(sandbox_id, state, reason)
            self.metrics.ended.labels(live.row.substrate, state).inc()
        return live

    async def _remove(self, live: Live, state: str, reason: str) -> None:
        """Halt the sandbox, then destroy it: off the caller's path when the substrate could
        halt it (it can no longer run; the removal of its mounts, disk, cgroups and runtime
        record follows in the background, and a crash before it ends leaves leftovers that
        the next start's ``recover`` removes), else before returning."""
        sandbox_id = live.row.id
        try:
            async with live.changing:  # a rollback or snapshot under way finishes first
                if await live.substrate.halt(sandbox_id, live.row.runtime):
                    task = asyncio.ensure_future(self._destroy_halted(live.substrate, sandbox_id))
                    self._destroying.add(task)
                    task.add_done_callback(self._destroying.discard)
                else:
                    await live.substrate.destroy(sandbox_id)
        finally:
            for listener in self.on_end:
                try:
                    listener(sandbox_id, state, reason)
                except Exception:  # a listener's failure must not fail the stop
                    log.exception("sandbox end listener failed for %s", sandbox_id)
        self.store.event(state, sandbox_id, reason=reason)

    async def _destroy_halted(self, substrate: Substrate, sandbox_id: str) -> None:
        """A halted sandbox's removal; a failure is logged and recorded, and what is left is
        a leftover for the next start's ``recover`` (as after a crash)."""
        async with self._destroy_slots:
            try:
                await substrate.destroy(sandbox_id)
            except Exception as exc:
                log.exception("could not remove stopped sandbox %s", sandbox_id)
                self.store.event("cleanup_failed", sandbox_id, reason=repr(exc)[:500])

    async def set_ttl(self, sandbox_id: str, ttl_s: int) -> SandboxInfo:
        live = self._get(sandbox_id)
        live.row.expires_at = time.time() + ttl_s
        self.store.set_expiry(sandbox_id, live.row.expires_at)
        return self.info(live.row)

    # snapshots: files in <volume>/snapshots/<id>/, a row each in the state store
    def _snapshot_dir(self, snapshot_id: str) -> Path:
        return self.volume.root / "snapshots" / snapshot_id

    def _snapshot_files(self, snap: SnapshotRow) -> tuple[Path, Path | None]:
        """The snapshot's disk on this node, and its saved memory if it is a `full` one."""
        d = self._snapshot_dir(snap.id)
        return d / SNAPSHOT_DISK, d / SNAPSHOT_MEMORY if snap.mode == "full" else None

    def _recorded(self, snapshot_id: str) -> bool:
        return self.store.get_snapshot(snapshot_id) is not None

    def _snapshot_row(self, snapshot_id: str) -> SnapshotRow:
        row = self.store.get_snapshot(snapshot_id)
        if row is None or row.edge != self.id or row.expired(time.time()):
            raise SnapshotNotFound(f"no snapshot {snapshot_id!r}", snapshot=snapshot_id)
        return row

    async def snapshot(self, sandbox_id: str, mode: str = "filesystem",
                       previous: str | None = None, ttl_s: int | None = None) -> Snapshot:
        """A copy of the sandbox's writable layer (``full``: and of its memory and devices),
        kept until deleted, or until ``ttl_s`` seconds pass (then the reaper deletes it); it
        outlives the sandbox and restarts. ``create(snapshot=...)`` starts sandboxes from it.
        A paused sandbox stays paused where the substrate snapshots it so (containers), and
        is resumed first elsewhere; no pause or resume runs meanwhile. With ``previous`` (one
        of this sandbox's snapshots): that snapshot, if nothing has been written to the disk
        since it was taken (a trajectory's checkpoints; `filesystem` ones only)."""
        live = self._get(sandbox_id)
        if not live.substrate.snapshots_paused:
            live = await self._awake(sandbox_id)
        if previous is not None and mode == "filesystem":
            unchanged = await self._unchanged_since(live, previous)
            if unchanged is not None:
                return snapshot_info(unchanged)
        if live.substrate.disk_volume:  # a clone shares blocks until its source is rewritten
            self.volume.check_room(live.row.request["disk_mb"] << 20)
        snap_id = f"sn-{self.id}-{secrets.token_hex(6)}"
        d = self._snapshot_dir(snap_id)
        d.mkdir(parents=True)
        d.chmod(0o700)  # a saved VM's memory holds its agent's token: root's alone
        try:
            try:
                async with live.changing:
                    self._still_live(live)
                    if mode == "full":
                        await live.substrate.snapshot_full(sandbox_id, live.row.runtime,
                                                           d / SNAPSHOT_DISK, d / SNAPSHOT_MEMORY)
                        count = None
                    else:
                        count = await live.substrate.snapshot_disk(sandbox_id, live.row.runtime,
                                                                   d / SNAPSHOT_DISK)
            except FileNotFoundError as exc:  # its cgroup or disk is gone: it died meanwhile
                raise await self._agent_failed(live, exc) from None
            except OSError as exc:
                raise SandboxError(f"could not snapshot sandbox {sandbox_id}: {exc}",
                                   sandbox_id=sandbox_id) from exc
            row = SnapshotRow(snap_id, self.id, sandbox_id, live.row.substrate, live.row.image,
                              live.row.image_digest, mode, live.row.request["disk_mb"],
                              sum(allocated_bytes(f) for f in d.iterdir()), time.time(),
                              inherited=inheritance(live.row.request))
            if ttl_s is not None:
                row.expires_at = row.created_at + ttl_s
            self.store.insert_snapshot(row)
        except BaseException:
            await asyncio.to_thread(remove_tree, d)
            raise
        live.last_snapshot = None if count is None else (snap_id, count)
        self.store.event("snapshot", sandbox_id, snapshot=snap_id, size_bytes=row.size_bytes)
        if self.shared is not None and mode == "filesystem":  # a `full` one stays on its node
            self._background(self._export(row, self.shared))
        return snapshot_info(row)

    async def _unchanged_since(self, live: Live, previous: str) -> SnapshotRow | None:
        """``previous``'s record if it is this sandbox's last snapshot and the disk has not
        been written since; None if it has, or it cannot be told, or ``previous`` is another
        (another sandbox's, an older one, one deleted)."""
        if live.last_snapshot is None or live.last_snapshot[0] != previous:
            return None
        try:
            count = await live.substrate.disk_writes(live.row.id, live.row.runtime)
        except OSError as exc:
            raise SandboxError(f"could not sync sandbox {live.row.id}'s disk: {exc}",
                               sandbox_id=live.row.id) from exc
        if count != live.last_snapshot[1]:
            return None
        return self.store.get_snapshot(previous)  # None if deleted meanwhile

    async def _export(self, row: SnapshotRow, shared: SharedSnapshots) -> None:
        """Copy a new snapshot to the shared directory, for every node; recorded once whole.
        A snapshot deleted meanwhile takes its copy with it."""
        started = time.perf_counter()
        try:
            digest, size = await asyncio.to_thread(
                shared.export, row.id, self._snapshot_dir(row.id) / SNAPSHOT_DISK)
        except OSError as exc:  # (deleted under the copy, or the shared mount failed)
            log.warning("could not export snapshot %s: %s", row.id, exc)
            self.store.event("export_failed", row.sandbox_id, snapshot=row.id, reason=str(exc)[:500])
            return
        if self.store.get_snapshot(row.id) is not None:
            self.store.insert_export(row.id, digest, size)
        if self.store.get_snapshot(row.id) is None:  # a delete raced the export
            self.store.delete_snapshot(row.id)
            await asyncio.to_thread(shared.remove, row.id)
            return
        self.store.event("exported", row.sandbox_id, snapshot=row.id, size_bytes=size,
                         seconds=round(time.perf_counter() - started, 4))

    async def _snapshot_file(self, snap: SnapshotRow) -> Path:
        """The snapshot's file on this node: its own, or a copy fetched (now, or by an earlier
        create) from the shared directory, waiting for its export if it is under way."""
        local = self._snapshot_dir(snap.id) / SNAPSHOT_DISK
        if snap.edge == self.id or local.exists():
            return local
        if snap.mode == "full":
            raise SnapshotNotFound(f"snapshot {snap.id} is a `full` one on the node of edge "
                                   f"{snap.edge}: its saved memory is not shared between nodes",
                                   snapshot=snap.id)
        if self.shared is None:
            raise SnapshotNotFound(f"snapshot {snap.id} is on the node of edge {snap.edge}, and "
                                   "this server shares no snapshots between nodes "
                                   "(--shared-snapshots)", snapshot=snap.id)
        digest, size = await self._exported(snap.id)
        async with self._fetching.setdefault(snap.id, asyncio.Lock()):
            if not local.exists():
                local.parent.mkdir(parents=True, exist_ok=True)
                started = time.perf_counter()
                try:
                    await asyncio.to_thread(self.shared.fetch, snap.id, digest, size, local)
                except BaseException:
                    await asyncio.to_thread(remove_tree, local.parent)
                    raise
                self.store.event("fetched", None, snapshot=snap.id, size_bytes=size,
                                 seconds=round(time.perf_counter() - started, 4))
        self._fetching.pop(snap.id, None)
        return local

    async def _exported(self, snapshot_id: str) -> tuple[str, int]:
        """The export's digest and size, once its node has finished it."""
        deadline = time.monotonic() + EXPORT_WAIT_S
        while (export := self.store.get_export(snapshot_id)) is None:
            if self.store.get_snapshot(snapshot_id) is None:
                raise SnapshotNotFound(f"no snapshot {snapshot_id!r}", snapshot=snapshot_id)
            if time.monotonic() > deadline:
                raise SnapshotNotFound(f"snapshot {snapshot_id} was not exported within "
                                       f"{EXPORT_WAIT_S:.0f}s (its node may have died first)",
                                       snapshot=snapshot_id)
            await asyncio.sleep(0.1)
        return export

    async def rollback(self, sandbox_id: str, snapshot: str) -> SandboxInfo:
        """The sandbox back at one of its own snapshots: same id, processes fresh (a `full`
        snapshot's: as they were). A failed rollback leaves no half-restored sandbox: it is
        stopped (died, with the cause); a snapshot found deleted before the substrate touched
        anything (a delete or its TTL racing the rollback) is ``SnapshotNotFound``, and the
        sandbox runs on as it was."""
        live = await self._awake(sandbox_id)
        snap = self._snapshot_row(snapshot)
        if snap.sandbox_id != sandbox_id:
            raise InvalidRequest(f"snapshot {snapshot} is of another sandbox; a rollback takes "
                                 "the sandbox's own (create(snapshot=...) starts a new one)",
                                 snapshot=snapshot, sandbox_id=sandbox_id)
        network = live.row.request.get("network", "none")
        if network != "none" and not live.substrate.rollback_keeps_network:
            raise NotSupported(f"rollback of a {live.row.substrate} sandbox with a network "
                               "policy is not supported yet (its wiring is its init's network "
                               "namespace)")
        disk_from, memory_from = self._snapshot_files(snap)
        plan = StartPlan(sandbox_id, CreateRequest.model_validate(live.row.request),
                         await asyncio.to_thread(self.uses.resolve, lambda: self.images.version(
                             live.row.image_digest)),
                         disk_from=disk_from, memory_from=memory_from)
        # Resolved before anything is killed; wired again into the restarted sandbox.
        egress = await self._egress(live.substrate, plan.request.network)
        async with live.changing:  # a stop meanwhile waits, then removes what this started
            self._still_live(live)
            live.rolling_back = True
            try:
                runtime = await live.substrate.rollback(plan, live.row.runtime)
                if egress is not None:  # and its hosts pinned again over the snapshot's
                    await self._apply_network(live.substrate, sandbox_id, runtime, egress)
            except BaseException as exc:
                failed: BaseException | None = exc
            else:
                failed = None
                live.last_snapshot = None  # a new disk (and loop device): counts start afresh
                if self._live.get(sandbox_id) is live:
                    self._restarted(live, runtime)
                else:  # a stop waits to remove it
                    live.row.runtime = runtime
            finally:
                live.rolling_back = False
        if isinstance(failed, SnapshotNotFound):  # gone before anything was touched
            raise SnapshotNotFound(f"snapshot {snapshot} was deleted before the rollback "
                                   f"could copy it; sandbox {sandbox_id} runs on as it was",
                                   snapshot=snapshot) from None
        if failed is not None:  # outside the lock: stop takes it
            await self.stop(sandbox_id, "died", f"rollback to {snapshot} failed: {failed}")
            if isinstance(failed, DSecError) or not isinstance(failed, Exception):
                raise failed
            raise SandboxError(f"rollback of sandbox {sandbox_id} to {snapshot} failed, and the "
                               f"sandbox was stopped: {failed}", sandbox_id=sandbox_id) from failed
        self._still_live(live)  # stopped during the rollback: the stop's end is the answer
        self.store.event("rollback", sandbox_id, snapshot=snapshot)
        return self.info(live.row)

    def _restarted(self, live: Live, runtime: dict[str, Any]) -> None:
        """The substrate restarted the sandbox's process (rollback, a VM's resume): its new
        runtime facts recorded, its agent reached and its exit watched through them."""
        live.row.runtime = runtime
        live.agent = live.substrate.agent(live.row.id, runtime)
        self.store.set_runtime(live.row.id, runtime)
        live.substrate.watch(live.row.id, runtime, lambda: self._exited(live.row.id))

    def _still_live(self, live: Live) -> None:
        """Under its ``changing`` lock: raise the recorded end of a sandbox stopped while the
        caller waited for the lock."""
        if self._live.get(live.row.id) is not live:
            self._get(live.row.id)
            raise SandboxNotFound(f"sandbox {live.row.id} was stopped", sandbox_id=live.row.id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Forget the snapshot, then remove its files here and its exported copy (a create
        copying it already holds its file open and finishes). Any edge may (its own is
        asked first); copies other nodes fetched go at those edges' next sweep."""
        row = self.store.get_snapshot(snapshot_id)
        if row is None or row.expired(time.time()):
            raise SnapshotNotFound(f"no snapshot {snapshot_id!r}", snapshot=snapshot_id)
        await self._remove_snapshot(snapshot_id)

    async def _remove_snapshot(self, snapshot_id: str) -> bool:
        """Whether this call removed it (a concurrent delete finds it gone)."""
        if not self.store.delete_snapshot(snapshot_id):
            return False
        await asyncio.to_thread(remove_tree, self._snapshot_dir(snapshot_id))
        if self.shared is not None:
            await asyncio.to_thread(self.shared.remove, snapshot_id)
        self.store.event("snapshot_deleted", None, snapshot=snapshot_id)
        for listener in self.on_snapshot_deleted:
            try:
                listener(snapshot_id)
            except Exception:  # a listener's failure must not fail the delete
                log.exception("snapshot delete listener failed for %s", snapshot_id)
        return True

    # pause / resume
    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process of the sandbox (a VM: saved to disk, its QEMU gone); a no-op
        if it is paused. Recorded paused before the freeze and running after the thaw, so a
        crash in between never leaves a frozen sandbox recorded running (whose calls would
        hang)."""
        live = self._get(sandbox_id)
        try:
            async with live.changing:
                self._still_live(live)
                if live.row.state != "paused":
                    self._set_state(live, "paused")
                    try:
                        await self._freeze(live, True)
                    except BaseException:
                        self._set_state(live, "running")
                        raise
                    self.store.event("paused", sandbox_id)
        except FileNotFoundError as exc:  # its cgroup is gone: the sandbox died meanwhile
            raise await self._agent_failed(live, exc) from None
        return self.info(live.row)

    async def commit_layer(self, sandbox_id: str, digest: str, source: dict[str, Any],
                           max_bytes: int) -> tuple[str, builtins.list[str]]:
        """The sandbox's writable layer (its overlay upper: its changes over the image, with
        whiteouts) stored as the layer ``digest`` (a Dockerfile step's cache key), copied
        with every process of the sandbox frozen (paused, as ``pause``; it stays paused) by
        ``images/upper.py``, which trusts nothing in it. Returns the layer's digest and what
        the copy dropped (devices, fifos, sockets). ``NotSupported`` where the substrate has
        no upper on the host (containers have)."""
        live = self._get(sandbox_id)
        upper = live.substrate.writable_layer(sandbox_id)
        await self.pause(sandbox_id)
        dropped: builtins.list[str] = []

        def build(scratch: Path) -> None:
            dropped.extend(copy_upper(upper, scratch / "rootfs", max_bytes, skip_top=(".dsec",)))
        layer, _ = await asyncio.to_thread(self.images.layers.ensure, digest, source, build)
        return layer.digest, dropped

    async def build_image(self, req: ImageBuildRequest,
                          context: bytes) -> AsyncIterator[BuildLog | ImageBuilt]:
        """A Dockerfile build on this edge, each step in a sandbox of it, ``context`` the
        uploaded build context tar (edge/dockerbuild.py): its log lines, then its result."""
        async for event in build_events(self, req, context):
            yield event

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Let a paused sandbox run again; a no-op if it runs."""
        return self.info((await self._awake(sandbox_id)).row)

    async def _awake(self, sandbox_id: str) -> Live:
        """The live sandbox, resumed first if it is paused: every call that reaches the
        sandbox's agent goes through here, so a paused sandbox answers as if it never was."""
        live = self._get(sandbox_id)
        if live.row.state == "paused":
            try:
                async with live.changing:
                    self._still_live(live)
                    if live.row.state == "paused":
                        await self._freeze(live, False)
                        self._set_state(live, "running")
                        self.store.event("resumed", sandbox_id)
            except FileNotFoundError as exc:  # its cgroup is gone: it died meanwhile
                raise await self._agent_failed(live, exc) from None
        return live

    async def _freeze(self, live: Live, frozen: bool) -> None:
        """FileNotFoundError when its cgroup is gone (the sandbox died): the caller turns it
        into the death, once it no longer holds the ``changing`` lock (stop takes it)."""
        try:
            runtime = await live.substrate.set_paused(live.row.id, live.row.runtime, frozen)
        except TimeoutError as exc:
            raise SandboxError(f"sandbox {live.row.id} could not be "
                               f"{'paused' if frozen else 'resumed'}: {exc}",
                               sandbox_id=live.row.id) from None
        if runtime != live.row.runtime:  # a VM saved to disk, or restarted from it
            self._restarted(live, runtime)

    def _set_state(self, live: Live, state: str) -> None:
        live.row.state = state
        self._count_paused(live.row)
        self.store.set_state(live.row.id, state)

    def _count_paused(self, row: SandboxRow) -> None:
        if row.state == "paused":
            self._paused.add(row.id)
        else:
            self._paused.discard(row.id)

    # network
    async def _egress(self, substrate: Substrate, network: Network) -> Egress | None:
        """The policy resolved to concrete rules, refused if the substrate cannot enforce it."""
        if network != "none" and not substrate.network_policies:
            raise NotSupported(f"the {substrate.name} substrate cannot enforce network "
                               "policies yet; use network='none'", substrate=substrate.name)
        return await resolve(network, self.services)

    async def _apply_network(self, substrate: Substrate, sandbox_id: str,
                             runtime: dict[str, Any], egress: Egress | None,
                             fresh: bool = False) -> None:
        """The rules, all or nothing; then, once they are in force, the sandbox's /etc/hosts
        pins (a convenience whose failure is logged: that file is the sandbox's). A ``fresh``
        sandbox has no pins yet."""
        await substrate.set_network(sandbox_id, runtime, egress)
        if not fresh or (egress is not None and egress.hosts):
            await pin_in_sandbox(sandbox_id, substrate.agent(sandbox_id, runtime),
                                 egress.hosts if egress is not None else ())

    async def set_network(self, sandbox_id: str, network: Network) -> SandboxInfo:
        """Replace a running sandbox's policy. Rules that cannot be applied leave the previous
        ones in force (one atomic nft batch); the record changes once the new ones are."""
        live = await self._awake(sandbox_id)
        egress = await self._egress(live.substrate, network)
        await self._apply_network(live.substrate, sandbox_id, live.row.runtime, egress)
        live.row.request["network"] = network if network == "none" else network.model_dump()
        self.store.set_request(sandbox_id, live.row.request)
        return self.info(live.row)

    # fn calls: a fresh worker of the fn substrate per call, no sandbox kept
    def _fn(self) -> FnSubstrate:
        fn = self.substrates.get("fn")
        if not isinstance(fn, FnSubstrate):
            raise NotSupported(f"edge {self.id} does not serve the fn substrate",
                               served=sorted(self.substrates))
        return fn

    async def _fn_call(self, work: Callable[[FnSubstrate], Awaitable[T]]) -> T:
        fn = self._fn()
        self._admit()
        self._calling += 1
        try:
            return await work(fn)
        finally:
            self._calling -= 1

    async def call_fn(self, image: str, payload: bytes, timeout_s: float) -> bytes:
        """Run a cloudpickled ``(fn, args, kwargs)``; its pickled return value (passed through
        unread: it is untrusted). RemoteError when the function raised."""
        async def call(fn: FnSubstrate) -> bytes:
            return await fn.call(await self._named(image), payload, timeout_s)
        return await self._fn_call(call)

    async def run_code(self, req: RunCodeRequest) -> CodeResult:
        """Write, compile if needed and run a program; what it did."""
        async def run(fn: FnSubstrate) -> dict[str, Any]:
            return await fn.run_code(await self._named(req.image), req.language, req.code,
                                     req.stdin, req.timeout_s, req.max_output_bytes)
        return CodeResult.model_validate(await self._fn_call(run))

    async def _named(self, name: str) -> Image:
        """The image named ``name``, recorded as used by this node (the image GC keeps it)."""
        return await asyncio.to_thread(self.uses.resolve, lambda: self.images.get(name))

    # queries
    def info(self, row: SandboxRow) -> SandboxInfo:
        return sandbox_info(row)

    def get_row(self, sandbox_id: str) -> SandboxRow:
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.edge != self.id:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
        return row

    def list(self) -> list[SandboxInfo]:
        return [self.info(live.row) for live in self._live.values()]

    def trajectory_of(self, sandbox_id: str) -> str | None:
        """The trajectory a sandbox of this edge is attached to (an in-memory lookup for a
        live sandbox; a row read for an ended one)."""
        live = self._live.get(sandbox_id)
        if live is not None:
            return live.row.request.get("trajectory")
        row = self.store.get_sandbox(sandbox_id)
        return row.request.get("trajectory") if row is not None and row.edge == self.id else None

    def require_live(self, sandbox_id: str) -> None:
        """Raise the typed error of a sandbox that cannot take calls (ended or unknown)."""
        self._get(sandbox_id)

    def _get(self, sandbox_id: str) -> Live:
        """The live sandbox a call may reach; the typed error of one that ended, and of one
        whose TTL ran out that the reaper has not stopped yet (a TTL is a promise: no call
        is served after it, however busy the reaper is)."""
        live = self._live.get(sandbox_id)
        if live is not None:
            if live.row.expires_at <= time.time():  # ended now; removed in the background
                reason = _expiry_reason(live.row)
                self._end(sandbox_id, "expired", reason)
                self._background(self._remove(live, "expired", reason))
                raise SandboxDied(f"sandbox {sandbox_id} expired: {reason}",
                                  sandbox_id=sandbox_id, reason=reason)
            return live
        row = self.get_row(sandbox_id)
        if row.state in ("died", "expired"):
            raise SandboxDied(f"sandbox {sandbox_id} {row.state}: {row.reason}",
                              sandbox_id=sandbox_id, reason=row.reason)
        raise SandboxNotFound(f"sandbox {sandbox_id} was {row.state}", sandbox_id=sandbox_id,
                              state=row.state)

    async def _agent_failed(self, live: Live, exc: Exception) -> DSecError:
        """The agent did not answer: either the sandbox died (report why) or the agent is
        wedged while the sandbox lives (a sandbox error)."""
        if live.rolling_back:
            return SandboxError(f"sandbox {live.row.id} was rolled back during the call: its "
                                "processes were killed", sandbox_id=live.row.id)
        if live.row.state == "paused":  # a VM saved to disk: QEMU, and the call's link, gone
            return SandboxError(f"sandbox {live.row.id} was paused during the call: its "
                                "connection was cut (its processes go on when it resumes)",
                                sandbox_id=live.row.id)
        if await self._still_alive(live):
            return SandboxError(f"sandbox {live.row.id} is running but its agent does not "
                                f"answer: {exc}", sandbox_id=live.row.id)
        reason = live.substrate.death_cause(live.row.id, live.row.runtime)
        await self.stop(live.row.id, "died", reason)  # a no-op if it was ended meanwhile
        try:
            self._get(live.row.id)
        except DSecError as ended:  # the end as recorded: died, or stopped by a client
            return ended
        raise AssertionError("a stopped sandbox is not live")

    async def _still_alive(self, live: Live) -> bool:
        """Whether the sandbox's init lives on after its agent failed a call. A killed agent
        closes its socket before its exit is visible (the kernel first ends every process in
        the sandbox), so a short wait tells a death from a wedged agent."""
        deadline = time.monotonic() + AGENT_DEATH_GRACE_S
        while live.substrate.alive(live.row.id, live.row.runtime):
            if time.monotonic() > deadline:
                return True
            await asyncio.sleep(0.02)
        return False

    # exec
    def _exec_args(self, live: Live, req: ExecRequest) -> dict[str, Any]:
        argv, cwd = exec_argv(req, live.cwd)
        if argv[0] != TAR:  # dsec's own tar (upload/download) runs as root, as the file API
            argv = as_user(live.user, argv)
        env = {**live.env, **req.env} if req.session is None else live.env
        return dict(argv=argv, env=env, cwd=cwd,
                    stdin=base64.b64decode(req.stdin_b64) if req.stdin_b64 is not None else None,
                    timeout_ms=int(req.timeout_s * 1000) if req.timeout_s else 0,
                    max_output=req.max_output_bytes)

    async def run(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        out: dict[int, list[bytes]] = {1: [], 2: []}
        async for event in self.stream(sandbox_id, req):
            if isinstance(event, Output):
                out[event.fd].append(event.data)
            else:
                return event.model_copy(update={"stdout_b64": b64(b"".join(out[1])),
                                                "stderr_b64": b64(b"".join(out[2]))})
        raise AssertionError("stream ends with a result")

    async def stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[Output | ExecResult]:
        """Output chunks as they come, then one ExecResult (with empty stdout/stderr)."""
        if req.stdin_open:
            raise InvalidRequest("stdin_open is for background processes (start_process)")
        live = await self._awake(sandbox_id)
        args = self._exec_args(live, req)
        self.metrics.execs.labels(live.row.substrate).inc()
        oom_before = live.substrate.oom_kills(sandbox_id, live.row.runtime)
        try:
            async for event in live.agent.exec(**args):
                if isinstance(event, Exit):
                    oom = live.substrate.oom_kills(sandbox_id, live.row.runtime) > oom_before
                    yield _result(event, b"", b"", oom)
                    return
                yield event
        except AgentUnavailable as exc:
            raise await self._agent_failed(live, exc) from None
        except AgentError as exc:
            raise _path_error(args["cwd"])(exc) from None

    async def _call(self, sandbox_id: str, call: Callable[[AgentClient], Awaitable[T]],
                    on_error: Callable[[AgentError], DSecError]) -> T:
        live = await self._awake(sandbox_id)
        try:
            return await call(live.agent)
        except AgentUnavailable as exc:
            raise await self._agent_failed(live, exc) from None
        except AgentError as exc:
            raise on_error(exc) from None

    async def start_process(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        live = self._get(sandbox_id)
        args = self._exec_args(live, req)
        self.metrics.execs.labels(live.row.substrate).inc()
        proc_id, pid = await self._call(
            sandbox_id, lambda a: a.start(**args, stdin_open=req.stdin_open),
            _path_error(args["cwd"]))
        return ProcessInfo(id=proc_id, pid=pid, command=" ".join(args["argv"]), running=True)

    async def start_pty(self, sandbox_id: str, req: PtyRequest) -> ProcessInfo:
        """A background process on a new pseudo-terminal: its output is one stream, of which
        the most recent ``max_output_bytes`` are kept for attach."""
        live = self._get(sandbox_id)
        if not live.substrate.terminals:
            raise NotSupported(f"{live.substrate.name} sandboxes have no terminals; use a "
                               "container or a VM", substrate=live.substrate.name)
        args = self._exec_args(live, ExecRequest(
            command=req.command, env=req.env, cwd=req.cwd, timeout_s=req.timeout_s,
            max_output_bytes=req.max_output_bytes))
        del args["stdin"]
        args["env"] = {"TERM": TERM, **args["env"]}
        self.metrics.execs.labels(live.row.substrate).inc()
        proc_id, pid = await self._call(
            sandbox_id, lambda a: a.start_pty(**args, cols=req.cols, rows=req.rows),
            _pty_error(args["cwd"]))
        return ProcessInfo(id=proc_id, pid=pid, command=" ".join(args["argv"]), running=True,
                           pty=True)

    async def processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        procs = await self._call(sandbox_id, lambda a: a.list(), _path_error(""))
        return [ProcessInfo(id=p.id, pid=p.pid, command=p.command, running=p.running,
                            exit_code=p.exit_code, signal=p.signal or 0, pty=p.tty)
                for p in procs]

    async def send_stdin(self, sandbox_id: str, process: str, data: bytes) -> None:
        """Queue ``data`` for the process's stdin (or terminal). Back-pressure: while the
        process leaves 1 MiB of earlier input unread this waits, up to STDIN_WAIT_S, then
        raises StdinFull with nothing of ``data`` taken."""
        if len(data) > STDIN_CHUNK_MAX:
            raise PayloadTooLarge(f"one input is at most {STDIN_CHUNK_MAX} bytes",
                                  limit=STDIN_CHUNK_MAX)
        deadline = time.monotonic() + STDIN_WAIT_S
        delay = 0.005
        while True:
            try:
                return await self._call(sandbox_id, lambda a: a.send_input(process, data),
                                        _process_error(process))
            except StdinFull:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.1)

    async def close_stdin(self, sandbox_id: str, process: str) -> None:
        await self._call(sandbox_id, lambda a: a.close_stdin(process), _process_error(process))

    async def resize_pty(self, sandbox_id: str, process: str, cols: int, rows: int) -> None:
        if not (1 <= cols <= 10_000 and 1 <= rows <= 10_000):
            raise InvalidRequest("cols and rows are 1 to 10000", cols=cols, rows=rows)
        await self._call(sandbox_id, lambda a: a.resize(process, cols, rows),
                         _process_error(process))

    async def attach(self, sandbox_id: str, process: str) -> AsyncIterator[Output | ExecResult]:
        live = await self._awake(sandbox_id)
        try:
            async for event in live.agent.attach(process):
                yield _result(event, b"", b"") if isinstance(event, Exit) else event
        except AgentUnavailable as exc:
            raise await self._agent_failed(live, exc) from None
        except AgentError as exc:
            raise _process_error(process)(exc) from None

    async def signal(self, sandbox_id: str, process: str, signal: int) -> None:
        await self._call(sandbox_id, lambda a: a.signal(process, signal), _process_error(process))

    # ports
    async def proxy_port(self, sandbox_id: str, port: int, request: bytes,
                         session: str | None = None) -> AsyncIterator[bytes]:
        """``request`` (an HTTP request's bytes) to ``127.0.0.1:port`` in the sandbox; its
        answer's bytes as they come (hostile, bounded: edge/ports.py). With ``session``, the
        connection stays open for ``port_send`` while this lasts (a WebSocket)."""
        live = await self._awake(sandbox_id)
        try:
            async for chunk in self.ports.exchange(sandbox_id, live.agent, port, request, session):
                yield chunk
        except AgentUnavailable as exc:
            raise await self._agent_failed(live, exc) from None

    async def port_send(self, sandbox_id: str, session: str, data: bytes) -> None:
        """More bytes into the two-way port connection ``session`` (open in ``proxy_port``)."""
        await self.ports.send(sandbox_id, session, data)

    # files
    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        path = sandbox_path(path)
        return await self._call(sandbox_id, lambda a: a.read_file(path), _path_error(path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644,
                         append: bool = False) -> None:
        path = sandbox_path(path)
        await self._call(sandbox_id, lambda a: a.write_file(path, data, mode=mode, append=append),
                         _path_error(path))

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        path = sandbox_path(path)
        entries = await self._call(sandbox_id, lambda a: a.list_dir(path), _path_error(path))
        return [_entry(e, path.rstrip("/") + "/" + e.name) for e in entries]

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        path = sandbox_path(path)
        return _entry(await self._call(sandbox_id, lambda a: a.stat(path), _path_error(path)), path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        path = sandbox_path(path)
        if path == "/":
            raise InvalidRequest("refusing to remove the sandbox's root")
        await self._call(sandbox_id, lambda a: a.remove(path, recursive=recursive), _path_error(path))

    async def mkdir(self, sandbox_id: str, path: str, parents: bool = False) -> None:
        path = sandbox_path(path)
        await self._call(sandbox_id, lambda a: a.mkdir(path, parents=parents), _path_error(path))

    async def upload_tar(self, sandbox_id: str, path: str, tar: bytes) -> None:
        path = sandbox_path(path)
        await self._tar(sandbox_id, [TAR, "-x", "-o", "-C", path, "-f", "-"], tar)

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        return await self._tar(sandbox_id, [TAR, "-c", "-C", sandbox_path(path), "-f", "-", "."])

    async def _tar(self, sandbox_id: str, argv: builtins.list[str], stdin: bytes | None = None) -> bytes:
        """dsec's own tar (busybox's, read-only in the sandbox), never the image's."""
        req = ExecRequest(command=argv, stdin_b64=b64(stdin) if stdin is not None else None,
                          timeout_s=600, max_output_bytes=ARCHIVE_LIMIT)
        result = await self.run(sandbox_id, req)
        if result.exit_code != 0 or result.stdout_truncated:
            raise InvalidRequest(f"tar failed: {result.stderr_bytes.decode(errors='replace')[-500:]}"
                                 if not result.stdout_truncated else "archive exceeds 1 GiB")
        return result.stdout_bytes

    # reaper
    async def _reap_forever(self) -> None:
        swept = time.monotonic()
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            try:
                await self.reap()
                for pool in self.pools.values():
                    await pool.tend()
                await asyncio.to_thread(self.uses.renew)
                if self.shared is not None and time.monotonic() - swept > FETCHED_SWEEP_S:
                    swept = time.monotonic()
                    await self._drop_deleted_copies()
            except Exception:  # the reaper must outlive any single failure
                log.exception("reaper pass failed")

    async def _drop_deleted_copies(self) -> None:
        """Remove the copies this node fetched of snapshots deleted elsewhere (a delete runs
        on the snapshot's own edge)."""
        for d in self._snapshot_dir("-").parent.glob("sn-*"):
            if not d.name.startswith(f"sn-{self.id}-") and not self._recorded(d.name):
                log.info("removing the fetched copy of deleted snapshot %s", d.name)
                await asyncio.to_thread(remove_tree, d)

    async def reap(self) -> None:
        """Stop expired sandboxes (deaths arrive through the substrate's watch) and delete
        this edge's expired snapshots (sandboxes made from one have their own copy)."""
        now = time.time()
        for sandbox_id, live in list(self._live.items()):
            if live.row.expires_at <= now:
                await self.stop(sandbox_id, "expired", _expiry_reason(live.row))
        for snapshot_id in self.store.expired_snapshots(self.id, now):
            if await self._remove_snapshot(snapshot_id):
                self.metrics.snapshots_expired.inc()
                log.info("removed snapshot %s: its TTL ended", snapshot_id,
                         extra={"kind": "snapshots", "snapshot": snapshot_id})


def _expiry_reason(row: SandboxRow) -> str:
    return f"TTL of {row.request['ttl_s']}s expired"


def sandbox_info(row: SandboxRow) -> SandboxInfo:
    """What a client sees of a sandbox's record."""
    req = row.request
    return SandboxInfo(id=row.id, substrate=row.substrate, image=row.image,
                       image_digest=row.image_digest, state=row.state, edge=row.edge,
                       created_at=row.created_at, expires_at=row.expires_at, cpu=req["cpu"],
                       memory_mb=req["memory_mb"], labels=req.get("labels", {}),
                       reason=row.reason, trajectory=req.get("trajectory"),
                       network=req.get("network", "none"))


def snapshot_info(row: SnapshotRow) -> Snapshot:
    return Snapshot(id=row.id, mode=row.mode, size_bytes=row.size_bytes,
                    sandbox_id=row.sandbox_id, image=row.image, created_at=row.created_at,
                    expires_at=row.expires_at)


def _result(event: Exit, stdout: bytes, stderr: bytes, oom: bool = False) -> ExecResult:
    return ExecResult(exit_code=event.exit_code, signal=event.signal, stdout_b64=b64(stdout),
                      stderr_b64=b64(stderr), stdout_truncated=event.stdout_truncated,
                      stderr_truncated=event.stderr_truncated, timed_out=event.timed_out,
                      oom_killed=oom, duration_ms=event.duration_ms)


def _entry(e: Any, path: str) -> FileEntry:
    return FileEntry(name=e.name, path=path, type=e.type, size=e.size, mode=e.mode, mtime=e.mtime)


def _path_error(path: str) -> Callable[[AgentError], DSecError]:
    def error(exc: AgentError) -> DSecError:
        if exc.errno == "ENOENT":
            return FileNotFound(f"{path}: no such file or directory", path=path)
        return InvalidRequest(f"{path}: {exc.message} ({exc.errno})", path=path, errno=exc.errno)
    return error


def _pty_error(cwd: str) -> Callable[[AgentError], DSecError]:
    """A terminal's start: the sandbox's own /dev/ptmx (which it may have replaced) gave no
    terminal, else as for any exec."""
    for_exec = _path_error(cwd)

    def error(exc: AgentError) -> DSecError:
        if exc.message.startswith("terminal:"):
            return InvalidRequest(f"the sandbox's /dev/ptmx gives no terminal: {exc.message}",
                                  errno=exc.errno)
        return for_exec(exc)
    return error


def _process_error(proc_id: str) -> Callable[[AgentError], DSecError]:
    def error(exc: AgentError) -> DSecError:
        if exc.errno in ("ENOENT", "ESRCH"):
            return ProcessNotFound(f"no process {proc_id!r}", process_id=proc_id)
        if exc.errno == "ECHILD":
            return ProcessExited(f"process {proc_id} has exited", process_id=proc_id)
        if exc.errno == "EPIPE":
            return StdinClosed(f"the stdin of process {proc_id} is closed", process_id=proc_id)
        if exc.errno == "EAGAIN":
            return StdinFull(f"process {proc_id} has not read 1 MiB of earlier input",
                             process_id=proc_id)
        return InvalidRequest(f"{exc.message} ({exc.errno})", process_id=proc_id)
    return error
