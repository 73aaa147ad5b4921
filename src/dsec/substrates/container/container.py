"""The container substrate: an OCI runtime (crun, runc or runsc) over an overlayfs rootfs.

Per sandbox, under ``<volume>/sandboxes/<id>/``: ``disk.img`` mounted at ``disk`` (an ext4 file
system of ``disk_mb``, see disk.py) holding ``upper`` and ``work`` (the writable layer) and
``run`` (bind-mounted at /.dsec/run: the agent socket and session state), ``rootfs`` (the
overlay of the image's read-only layers under ``upper``), ``config.json``, ``pid`` and
``runtime.log``. Everything a sandbox can write is on its own disk, in its quota; the host
never walks it: clean-up unmounts the disk and unlinks its file. dsec's agent and tools are
one read-only bind at /.dsec (agent/tools.py). The agent is the container's init; it prints
``R`` on stdout once it listens, so start-up waits on an event, never a poll.

The two mounts are made in a mount namespace of the sandbox's own, where its runtime is
started, never in the host's table (``spaces.py``: a runtime's start copies the table it
starts in); the host reaches them through ``MountSpace.path()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import itertools
import json
import logging
import os
import secrets
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ...agent.client import AgentClient
from ...agent.tools import sandbox_tree
from ...images.mount import LayerMounter, overlay_mount, unmount_or_detach
from ...network.policy import Egress
from ...network.wired import WiredSandboxes
from ...network.wiring import Slot
from ...protocol.errors import NotSupported, SandboxError, SnapshotNotFound
from ...protocol.models import DEFAULT_DISK_MB, CreateRequest
from ..base import StartPlan, Substrate
from ..host import cgroups, criu, disk_writes, spawn
from ..host.disk import DiskPool
from ..host.image_copy import clone_file
from ..host.loop import loop_mount, unmount_image
from ..host.mountns import inside, own_fs
from ..host.oci_spec import container_config
from ..host.pidwatch import PidWatch
from ..host.sealed import sealed_copy
from ..host.seccomp import container_filter_b64
from ..host.spawn import Spawned
from ..host.tree import remove_tree
from ..host.volume import DiskVolume
from .disk_stock import DiskStock
from .spaces import MountSpace, MountSpaces
from .starts import StartSlots

log = logging.getLogger("dsec.container")
RUNTIMES = ("crun", "runc", "runsc")
# Runtimes that copy their own binary at each call unless it is a sealed memfd (sealed.py)
SELF_COPYING = ("crun", "runc")
FIFREEZE, FITHAW = 0xC0045877, 0xC0045878  # linux/fs.h: _IOWR('X', 119|120, int)
START_TIMEOUT_S = 30.0
RUNTIME_DIR = "runtime"  # the runtimes' records of their containers (see state_root)
NEW_DISK = "disk.img.new"  # a copy of a snapshot's image, before it becomes disk.img
# A sandbox's disk holds the overlay's work dir and the agent's run dir, and in the overlay's
# upper dir the mount point of /.dsec and the default cwd. A fresh disk comes with them
# (DiskPool's skeleton); a snapshot's may not (``_layers``).
DISK_DIRS = ("work", "run")
UPPER_DIRS = ("upper/.dsec", "upper/work")
# A snapshot's run dir is cleared by the host only while it holds at most this many plain
# files (the agent's socket, a few sessions' state); else it is moved, whole, to this name
# in the new run dir, for the sandbox to remove (``_fresh_run``).
RUN_CLEARED = 64
RUN_DISCARDED = ".discarded-run"
_libc = ctypes.CDLL(None, use_errno=True)


class ContainerSubstrate(Substrate):
    """Network policies: a sandbox starts with loopback only (warm-pool ones too);
    ``set_network`` wires its netns to the host when a policy is first applied, at create
    or claim time or later (see ``dsec.network.wiring``)."""

    name = "container"
    network_policies = True
    disk_volume = True
    snapshots_paused = True  # the cgroup freezer is how it snapshots: a paused one stays so
    rollback_keeps_network = True  # its wiring is removed at the kill; the edge wires the new init
    terminals = True  # a devpts instance of its own (oci_spec.py)
    open_files = 3  # its pidfd, its mount namespace and its bundle dir seen from there (spaces.py)

    def __init__(self, state_dir: Path, edge_id: str, volume: DiskVolume, runtime: str = "crun",
                 mounter: LayerMounter | None = None) -> None:
        if runtime not in RUNTIMES:
            raise NotSupported(f"unknown container runtime {runtime!r}; choose one of {RUNTIMES}")
        self.default_runtime = runtime
        self.volume = volume  # opened by the edge before prepare()
        self.root = volume.root / "sandboxes"
        self.runtime_root = volume.root / RUNTIME_DIR  # see state_root; set by prepare()
        self._earlier_runtime_root = state_dir / RUNTIME_DIR
        self.sealed_links = state_dir / "bin"  # links to the runtimes' sealed copies (sealed.py)
        self.cgroup_parent = f"/dsec-{edge_id}"
        self.edge_id = edge_id
        self.mounter = mounter or LayerMounter()
        self.disks = DiskPool(volume.root / "disks", (DEFAULT_DISK_MB,), DISK_DIRS + UPPER_DIRS)
        self.stock = DiskStock(self.disks, volume.root / "disks" / "stock", DEFAULT_DISK_MB)
        self.spaces = MountSpaces(self._dir)
        self._tree: Path | None = None  # mounted read-only at /.dsec
        self._seccomp_bpf: str | None = None  # the sandboxes' seccomp filter, compiled once
        self._pids = PidWatch(self.cgroup_parent)
        # Bundle set-up and teardown wait on kernel locks (mounts, cgroups) under load: in
        # threads, they never stall the event loop. They enter sandboxes' mount namespaces.
        self._io = ThreadPoolExecutor(16, thread_name_prefix="dsec-fs", initializer=own_fs)
        self.network = WiredSandboxes(f"{edge_id}/", self._io)
        self._slots = StartSlots()  # a burst's starts a few at a time, in order (starts.py)
        self._favoring: int | None = None  # the fd of cgroups.hold_favordynmods, while held

    async def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.disks.prepare()
        await asyncio.to_thread(self.stock.prepare)
        self.runtime_root = state_root(self._earlier_runtime_root, self.volume.root / RUNTIME_DIR)
        for runtime in RUNTIMES:
            (self.runtime_root / runtime).mkdir(parents=True, exist_ok=True)
        if self.default_runtime == "crun":
            cgroups.prepare_hybrid_host()
        if not cgroups.is_cgroup2_only():
            await self._favor_dynmods()
        self._tree = await asyncio.to_thread(sandbox_tree)
        self._seccomp_bpf = await asyncio.to_thread(_compiled_seccomp)
        await self.network.recover()

    async def _favor_dynmods(self) -> None:
        """Starts no longer wait for an RCU grace period where the runtime moves them into v1
        cgroups (``cgroups.hold_favordynmods``). Not a guarantee: a kernel without the mode
        starts sandboxes as before, and the log says so."""
        try:
            self._favoring = await asyncio.to_thread(cgroups.hold_favordynmods)
        except OSError as exc:
            log.warning("cgroup v1 host: each sandbox start waits for an RCU grace period (about "
                        "10 ms) where its runtime joins its cgroups; the kernel's favordynmods "
                        "mode would spare it, but it refused it: %s", exc)
        else:
            log.info("cgroup v1 host: the kernel is in its favordynmods mode while this server "
                     "runs (sandbox starts join their cgroups without an RCU grace period)")

    async def close(self) -> None:
        await asyncio.to_thread(self.stock.close)
        cgroups.remove_parent_if_unused(self.cgroup_parent)
        if self._favoring is not None:
            os.close(self._favoring)
            self._favoring = None

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def _runtime_cmd(self, runtime: str) -> list[str]:
        binary = spawn.resolve(runtime)  # NotSupported if absent
        if runtime in SELF_COPYING:
            binary = sealed_copy(binary, self.sealed_links)
        cmd = [binary, "--root", str(self.runtime_root / runtime)]
        if runtime == "runsc":
            # --host-uds: the agent binds its socket on the host; --oci-seccomp: the deny-list of
            # oci_spec.py holds inside gVisor too (io_uring, mount, ...), not only on its sentry
            cmd += ["--network=none", "--host-uds=create", "--oci-seccomp"]
        return cmd

    async def start(self, plan: StartPlan) -> dict[str, Any]:
        runtime = plan.request.runtime or self.default_runtime
        base = self._runtime_cmd(runtime)
        d = self._dir(plan.sandbox_id)
        try:
            return await self._start(plan, runtime, base, d)
        except BaseException:
            await self.destroy(plan.sandbox_id)
            raise

    async def _start(self, plan: StartPlan, runtime: str, base: list[str], d: Path) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        try:
            async with self._slots.bundle(plan.warm):
                await loop.run_in_executor(self._io, self._bundle, plan, d)
        except OSError as exc:
            if (full := _snapshot_full(plan, exc)) is None:
                raise
            raise full from exc
        return await self._run(plan.sandbox_id, runtime, base, d, secrets.token_hex(32), plan.warm)

    async def _run(self, sandbox_id: str, runtime: str, base: list[str], d: Path, token: str,
                   warm: bool = False) -> dict[str, Any]:
        """Run the bundle at ``d`` in its mount namespace and claim its agent with ``token``:
        the runtime facts."""
        async with self._slots.run(warm):
            space = self.spaces.get(sandbox_id)
            crun = await Spawned.start([*base, "run", "--detach", "--bundle", str(d), "--pid-file",
                                        str(d / "pid"), sandbox_id], capture_stdout=True,
                                       stderr=d / "runtime.log", idle_priority=warm,
                                       mount_namespace=space.namespace)
            try:
                ready = await asyncio.wait_for(crun.first_byte(), START_TIMEOUT_S)
                code = await asyncio.wait_for(crun.wait(), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                crun.kill()
                await crun.wait()
                raise SandboxError(f"{runtime} did not start the sandbox within {START_TIMEOUT_S:.0f}s") from None
            finally:
                crun.close()
            if ready != b"R" or code != 0:
                log_text = (d / "runtime.log").read_text(errors="replace").strip()
                raise SandboxError(f"{runtime} failed to start the sandbox (exit {code}): "
                                   f"{log_text[-2000:] or 'no output'}")
            pid = int((d / "pid").read_text())
            self._pids.adopt(sandbox_id, pid)  # it is ours: it just said R
            facts = {"runtime": runtime, "pid": pid, "token": token, "disk": space.disk}
            # Claimed before this returns: no user command can have run yet to claim it first.
            # Bounded like the start: a slot of starts.py is held until then.
            try:
                await asyncio.wait_for(self.agent(sandbox_id, facts).claim(), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise SandboxError(f"the agent did not answer within {START_TIMEOUT_S:.0f}s of the "
                                   "sandbox's start") from None
            return facts

    async def rollback(self, plan: StartPlan, runtime: dict[str, Any]) -> dict[str, Any]:
        """Its processes killed, its disk's content replaced by a copy of ``plan.disk_from``,
        its init started again under the same id and agent token, with the request's limits.
        The copy is made first (a snapshot gone meanwhile leaves the sandbox as it was). The
        new bundle is mounted while the runtime kills the old processes: the old overlay and
        disk are only detached from the host's mount table (the old container's namespace
        holds them until its last process is gone, then the disk's loop device detaches
        itself), and the old disk is shut down first, so its unwritten data is dropped.
        A network policy's wiring went with the old init's namespace: the edge wires the
        new one (``set_network``)."""
        assert plan.disk_from is not None, "a rollback starts from a snapshot"
        name = runtime["runtime"]
        base = self._runtime_cmd(name)
        d = self._dir(plan.sandbox_id)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._io, _clone_disk, plan.disk_from, d)
        except FileNotFoundError:
            if plan.disk_from.exists():
                raise
            raise SnapshotNotFound("the snapshot was deleted before its disk was copied: "
                                   "nothing of the sandbox was touched") from None
        space = await loop.run_in_executor(self._io, self.spaces.get, plan.sandbox_id, runtime)
        await self.network.remove(plan.sandbox_id)  # its wiring is the old init's netns
        self._pids.forget(plan.sandbox_id)
        kill = asyncio.ensure_future(self._kill(name, base, plan.sandbox_id))
        try:
            await loop.run_in_executor(self._io, self._swap_disk, plan, d, space)
        except OSError as exc:
            if (full := _snapshot_full(plan, exc)) is None:
                raise
            raise full from exc
        finally:
            await kill  # the same id: the old container is gone before the new one runs
        return await self._run(plan.sandbox_id, name, base, d, runtime["token"])

    async def _kill(self, runtime: str, base: list[str], sandbox_id: str) -> None:
        """The container's processes killed and the runtime's record of it gone. crun's
        record is one directory: its processes are killed through the cgroup and the
        directory removed, so the cgroups stay for the restart; other runtimes delete."""
        if runtime != "crun":
            await spawn.run([*base, "delete", "--force", sandbox_id])
            return
        await asyncio.get_running_loop().run_in_executor(
            self._io, cgroups.kill_all, self.cgroup_parent, sandbox_id)
        await asyncio.get_running_loop().run_in_executor(
            self._io, remove_tree, self.runtime_root / runtime / sandbox_id)

    def _swap_disk(self, plan: StartPlan, d: Path, space: MountSpace) -> None:
        """The new disk and overlay mounted in place of the old, in the sandbox's namespace."""
        lowers = self.mounter.lowerdirs(plan.image)
        with inside(space.namespace):
            _unmount_bundle(d, wait=False)
        space.disk = _mount_disk(d, space.namespace)
        with inside(space.namespace):
            self._layers(plan, d, lowers)

    async def claim(self, sandbox_id: str, runtime: dict[str, Any], request: CreateRequest,
                    started: CreateRequest) -> None:
        """The limits are written only where they differ from ``started``'s, which crun set
        at the start (its config.json) and nothing has changed since: nothing but the agent
        ran in the sandbox. A cgroup write costs 50-100 µs of a claim on this kind of host
        (docs/BENCHMARKS.md); a claim with the pool's limits makes none."""
        if _limits(request) != _limits(started):
            cgroups.set_limits(self.cgroup_parent, sandbox_id, request.cpu,
                               request.memory_mb << 20, request.pids)
        os.sched_setscheduler(runtime["pid"], os.SCHED_OTHER, os.sched_param(0))

    async def set_network(self, sandbox_id: str, runtime: dict[str, Any],
                          egress: Egress | None) -> None:
        if egress is not None and runtime.get("runtime") == "runsc":
            raise NotSupported("network policies need a runtime that uses the host kernel's "
                               "network stack (crun or runc), not runsc")

        async def wire() -> Slot:
            netns = self._netns(sandbox_id, runtime)
            try:
                return await self.network.run(self.network.wiring.attach,
                                              self.network.owner(sandbox_id), netns)
            finally:
                os.close(netns)

        async def unwire(slot: Slot) -> None:
            await self.network.run(self.network.wiring.detach, slot)

        await self.network.set(sandbox_id, egress, wire, unwire)

    def _netns(self, sandbox_id: str, runtime: dict[str, Any]) -> int:
        """An fd on the sandbox's network namespace. Its init must still be alive once the
        fd is open (its pidfd says so), or the pid may name another process by now."""
        try:
            fd = os.open(f"/proc/{runtime['pid']}/ns/net", os.O_RDONLY)
        except OSError:
            fd = -1
        if fd < 0 or not self.alive(sandbox_id, runtime):
            if fd >= 0:
                os.close(fd)
            raise SandboxError(f"sandbox {sandbox_id}'s init is gone: no network to wire",
                               sandbox_id=sandbox_id)
        return fd


    def _bundle(self, plan: StartPlan, d: Path) -> None:
        """The OCI bundle: the disk and the overlay rootfs, mounted in a new mount namespace
        of the sandbox's, and config.json (in a worker thread)."""
        d.mkdir()
        lowers = self.mounter.lowerdirs(plan.image)  # in the host's namespace: every sandbox's
        space = self.spaces.make(plan.sandbox_id)
        if plan.disk_from is None:
            # a warm pool's spawn is on no caller's path: the stock is kept for those that are
            disk = (d / "disk.img", d / "disk", plan.request.disk_mb, space.namespace)
            space.disk = (None if plan.warm else self.stock.take(*disk)) or self.disks.attach(*disk)
        else:
            _clone_disk(plan.disk_from, d)
            space.disk = _mount_disk(d, space.namespace)
        (d / "rootfs").mkdir()
        with inside(space.namespace):
            self._layers(plan, d, lowers)

    def _layers(self, plan: StartPlan, d: Path, lowers: list[Path]) -> None:
        """The overlay of the image's layers under the disk's upper dir, and config.json."""
        disk = d / "disk"
        for rel in DISK_DIRS:
            (disk / rel).mkdir(exist_ok=True)
        # Mount points and the default cwd exist in the writable layer before it is mounted. A
        # snapshot's layer has them, or whatever its sandbox made of them (a symlink, maybe
        # dangling, a whiteout): that is left as it is, never followed.
        for rel in UPPER_DIRS:
            if not os.path.lexists(disk / rel):
                (disk / rel).mkdir(parents=True)
        run, rootfs = disk / "run", d / "rootfs"
        overlay_mount(lowers, disk / "upper", disk / "work", rootfs)
        assert self._tree is not None, "prepare() runs before start()"
        config = container_config(plan.sandbox_id, plan.request, str(rootfs), str(self._tree),
                                  str(run), self.cgroup_parent, self._seccomp_bpf,
                                  plan.request.runtime or self.default_runtime)
        (d / "config.json").write_text(json.dumps(config))

    def _open_disk(self, sandbox_id: str) -> int:
        """An fd on the root of the sandbox's mounted disk (for syncfs, FIFREEZE, its counters)."""
        return os.open(self.spaces.get(sandbox_id).path() / "disk",
                       os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def writable_layer(self, sandbox_id: str) -> Path:
        return self.spaces.get(sandbox_id).path() / "disk" / "upper"

    async def snapshot_disk(self, sandbox_id: str, runtime: dict[str, Any], dest: Path) -> int:
        """A consistent copy of the disk image. On the reflink volume: every process of the
        sandbox frozen (the cgroup freezer, as ``pause``), its file system synced, the image
        cloned, the processes thawed (a paused sandbox stays paused): about 1 ms of
        stopped processes, no data copied. Where images cannot be cloned, the file system
        itself is frozen (FIFREEZE: ~40 ms alone) for a copy of the blocks written, or, for
        a paused sandbox, its processes stay frozen for it (``_copy_fs_frozen``). Returns
        the disk's write count as of the copy (see ``disk_writes``)."""
        work = self._clone_stopped if self.volume.reflinks else self._copy_fs_frozen
        return await asyncio.get_running_loop().run_in_executor(self._io, work, sandbox_id, dest)

    def _clone_stopped(self, sandbox_id: str, dest: Path) -> int:
        d = self._dir(sandbox_id)
        paused = cgroups.is_frozen(self.cgroup_parent, sandbox_id)
        if not paused:
            cgroups.set_frozen(self.cgroup_parent, sandbox_id, True)
        try:
            mount = self._open_disk(sandbox_id)
            try:  # nothing writes while frozen: the count after the sync is the clone's
                count = disk_writes.synced_count(mount)
            finally:
                os.close(mount)
            method = clone_file(d / "disk.img", dest)
        finally:
            if not paused:
                cgroups.set_frozen(self.cgroup_parent, sandbox_id, False)
        log.info("snapshot of %s to %s: processes frozen, syncfs, %s", sandbox_id, dest, method)
        return count

    def _copy_fs_frozen(self, sandbox_id: str, dest: Path) -> int:
        """FIFREEZE writes dirty data out and blocks writers until FITHAW; it cannot wait
        on writers the cgroup freezer holds. A paused sandbox is never thawed for it (it
        would run, and write, while its trainer holds it paused): nothing of it runs, so
        nothing writes, and its disk is synced and copied as the reflink path does."""
        if cgroups.is_frozen(self.cgroup_parent, sandbox_id):
            return self._clone_stopped(sandbox_id, dest)
        d = self._dir(sandbox_id)
        mount = self._open_disk(sandbox_id)
        try:
            fcntl.ioctl(mount, FIFREEZE, 0)
            try:
                frozen = disk_writes.sectors_written(mount)
                method = clone_file(d / "disk.img", dest)
            finally:
                fcntl.ioctl(mount, FITHAW, 0)
            count = disk_writes.count_after_thaw(mount, frozen)
        finally:
            os.close(mount)
        log.info("snapshot of %s to %s: file system frozen (FIFREEZE), %s copy", sandbox_id,
                 dest, method)
        return count

    async def undo_interrupted(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        """An edge killed mid-snapshot leaves the sandbox's processes frozen (the reflink
        path) or its file system frozen (FIFREEZE): both are thawed."""
        await asyncio.get_running_loop().run_in_executor(self._io, self._unfreeze, sandbox_id)

    def _unfreeze(self, sandbox_id: str) -> None:
        mount = self._open_disk(sandbox_id)
        try:
            fcntl.ioctl(mount, FITHAW, 0)
            log.warning("thawed the file system of %s, left frozen by an interrupted snapshot",
                        sandbox_id)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: it was not frozen
                raise
        finally:
            os.close(mount)
        cgroups.thaw_if_frozen(self.cgroup_parent, sandbox_id)

    async def disk_writes(self, sandbox_id: str, runtime: dict[str, Any]) -> int:
        return await asyncio.get_running_loop().run_in_executor(
            self._io, self._synced_count, sandbox_id)

    def _synced_count(self, sandbox_id: str) -> int:
        mount = self._open_disk(sandbox_id)
        try:
            return disk_writes.synced_count(mount)
        finally:
            os.close(mount)

    def agent(self, sandbox_id: str, runtime: dict[str, Any]) -> AgentClient:
        # gVisor's sentry, not the agent, holds the host end of the socket: no pid to check.
        peer = None if runtime["runtime"] == "runsc" else runtime["pid"]
        # No token: a sandbox started before agents were claimed (its agent takes none).
        return AgentClient(self.spaces.get(sandbox_id, runtime).path() / "disk" / "run" / "agent.sock",
                           runtime.get("token"), peer)

    def alive(self, sandbox_id: str, runtime: dict[str, Any]) -> bool:
        return self._pids.alive(sandbox_id, runtime.get("pid"))

    def watch(self, sandbox_id: str, runtime: dict[str, Any], on_exit: Callable[[], None]) -> None:
        self._pids.watch(sandbox_id, runtime.get("pid"), on_exit)

    def death_cause(self, sandbox_id: str, runtime: dict[str, Any]) -> str:
        if self.oom_kills(sandbox_id, runtime):
            return "out of memory: the kernel killed the sandbox's init"
        return "the sandbox's init process exited"

    def oom_kills(self, sandbox_id: str, runtime: dict[str, Any]) -> int:
        return cgroups.oom_kills(self.cgroup_parent, sandbox_id)

    async def set_paused(self, sandbox_id: str, runtime: dict[str, Any],
                         paused: bool) -> dict[str, Any]:
        """The cgroup freezer, written directly (``crun pause`` does the same write, plus a
        fork and its state files). Under gVisor it freezes the sentry with the sandbox."""
        await asyncio.get_running_loop().run_in_executor(
            self._io, cgroups.set_frozen, self.cgroup_parent, sandbox_id, paused)
        return runtime

    async def snapshot_full(self, sandbox_id: str, runtime: dict[str, Any], disk: Path,
                            memory: Path) -> None:
        why = await asyncio.to_thread(criu.why_not)
        raise NotSupported("'full' snapshots of container sandboxes (memory and processes) "
                           f"need process checkpointing with CRIU, which this host cannot do: "
                           f"{why}; take mode='filesystem', or a microvm/vm sandbox")

    async def halt(self, sandbox_id: str, runtime: dict[str, Any]) -> bool:
        """SIGKILL to its init through the pidfd: the kernel kills every process of the
        init's pid namespace, which holds all of the sandbox's (the agent runs commands as
        its children; nothing enters the container from outside). A frozen (paused) sandbox
        dies once ``destroy`` thaws it, without running again. Its network policy's rules and
        host link go too, before the stop returns (the host's forwarding settings are as
        if it had never run). runsc's init is gVisor's sandbox, not the container's: it is
        not halted here (its destroy is awaited)."""
        if runtime.get("runtime") not in ("crun", "runc"):
            return False
        self._pids.kill(sandbox_id, runtime.get("pid"))
        self._pids.forget(sandbox_id)
        await self.network.remove(sandbox_id)
        return True

    async def destroy(self, sandbox_id: str) -> None:
        d = self._dir(sandbox_id)
        self._pids.forget(sandbox_id)
        await asyncio.get_running_loop().run_in_executor(
            self._io, cgroups.thaw_if_frozen, self.cgroup_parent, sandbox_id)
        await self._delete_state(sandbox_id)
        await self.network.remove(sandbox_id)
        await asyncio.get_running_loop().run_in_executor(self._io, self._teardown, sandbox_id, d)

    async def _delete_state(self, sandbox_id: str) -> None:
        """The runtimes' records of the sandbox, deleted by their runtime; asked twice, since a
        signal to the server's whole process group (systemd's stop, a terminal's Ctrl-C) also
        ends the ``delete`` under way, and a stop returns before its removal is done. What is
        still held after that is logged and left to the next start's ``recover``. The looks
        run in a thread: in a burst of starts a lookup in a runtime's directory waits for the
        runtimes making entries there (up to 11 ms seen), which must not stall the loop."""
        loop = asyncio.get_running_loop()
        for runtime in await loop.run_in_executor(self._io, self._holding_state, sandbox_id):
            for _ in range(2):
                await spawn.run([*self._runtime_cmd(runtime), "delete", "--force", sandbox_id])
                if not await loop.run_in_executor(self._io, _holds_state,
                                                  self.runtime_root / runtime, sandbox_id):
                    break
            else:
                log.warning("sandbox %s: %s still holds state after two deletes; the next "
                            "start removes it", sandbox_id, runtime)

    def _holding_state(self, sandbox_id: str) -> list[str]:
        return [rt for rt in RUNTIMES if _holds_state(self.runtime_root / rt, sandbox_id)]

    def _teardown(self, sandbox_id: str, d: Path) -> None:
        """What the runtime leaves or never made: cgroups, the overlay, the disk, their mount
        namespace, the bundle dir. Once the disk is unmounted, the dir holds only what dsec
        wrote (see tree.py)."""
        cgroups.remove_cgroups(cgroups.sandbox_dirs(self.cgroup_parent, sandbox_id))
        space = self.spaces.removing(sandbox_id)
        try:
            if space is not None:  # none: nothing of it is mounted where this server can reach
                try:
                    with inside(space.namespace):
                        _unmount_bundle(d)
                finally:
                    space.close()
            _unmount_bundle(d)  # what a dsec before mount namespaces mounted in the host's
            try:
                remove_tree(d)
            except OSError:  # the stop still answers; the next start finds the dir and retries
                log.exception("could not remove all of sandbox %s's directory", sandbox_id)
        finally:
            self.spaces.removed(sandbox_id)

    async def leftovers(self) -> set[str]:
        ids = {p.name for p in self.root.iterdir()} if self.root.exists() else set()
        for runtime in RUNTIMES:
            ids.update(_state_ids(self.runtime_root / runtime))
        ids.update(cgroups.sandbox_cgroups(self.cgroup_parent))
        ids.update(self.network.ids())
        return ids


def state_root(earlier: Path, volume: Path) -> Path:
    """Where the runtimes keep their records of the containers (``--root``, a dir each):
    ``volume``, the edge's disk volume beside the bundles, unless a dsec from before this one
    kept them at ``earlier`` (the state dir) and some are still there. Then there, until they
    are gone, so that no live sandbox's record is lost; an emptied ``earlier`` is removed.

    Why the volume: a runtime makes and removes a few files per container at every start
    and stop. The state dir's file system is whatever the host has; on this project's
    machines, ext4 without a journal mounted with ``discard``, where each removal waits for
    its discard and each new inode is searched for past every inode freed in the last 12
    hours (8-10 % of all CPU in a burst of creates, ``perf``). The volume is dsec's own XFS
    file system (volume.py): bursts of 100 and ``create_many`` ran 10-15 % faster there."""
    held = [rt for rt in RUNTIMES if _state_ids(earlier / rt)]
    if held:
        log.warning("the runtimes keep their records of containers in %s while it holds some "
                    "an earlier dsec made (%s); once it holds none, they keep them in %s",
                    earlier, ", ".join(held), volume)
        return earlier
    for d in [*(earlier / rt for rt in RUNTIMES), earlier]:
        with contextlib.suppress(OSError):  # absent, or holding something no runtime made
            d.rmdir()
    return volume


def _state_ids(runtime_root: Path) -> set[str]:
    """Sandboxes a runtime holds state for: a directory each under crun and runc, files
    ``<id>_sandbox:<id>.state`` and ``.lock`` under runsc (which ``runsc delete`` removes)."""
    if not runtime_root.exists():
        return set()
    return {p.name if p.is_dir() else p.name.partition("_sandbox:")[0]
            for p in runtime_root.iterdir() if p.is_dir() or "_sandbox:" in p.name}


def _holds_state(runtime_root: Path, sandbox_id: str) -> bool:
    """Whether ``sandbox_id`` is among ``_state_ids(runtime_root)``, from its own entries: a
    stop must not list every sandbox's (O(N) per stop on the event loop, minutes of a node's
    3,000 stops)."""
    runsc = f"{sandbox_id}_sandbox:{sandbox_id}"
    return ((runtime_root / sandbox_id).is_dir() or (runtime_root / f"{runsc}.state").exists()
            or (runtime_root / f"{runsc}.lock").exists())


def _limits(request: CreateRequest) -> tuple[float, int, int]:
    """What a start and a claim write to the sandbox's cgroups."""
    return request.cpu, request.memory_mb, request.pids


def _compiled_seccomp() -> str | None:
    """The sandboxes' seccomp filter compiled (base64), or None where the server cannot load
    libseccomp (a static runtime needs none): the runtime then compiles config.json's
    profile, the same filter, at each start."""
    try:
        return container_filter_b64()
    except NotSupported as exc:
        log.warning("%s: the runtime compiles the seccomp profile at each sandbox start "
                    "(about 1 ms of CPU each)", exc)
        return None


def _snapshot_full(plan: StartPlan, exc: OSError) -> SandboxError | None:
    """A start from a snapshot (a create, or a rollback) that found no room on the
    snapshot's disk: the sandbox used up its inodes (or blocks) before it was taken, so its
    overlay's work dir cannot be made. That is the sandbox's doing and a typed error, never
    the server's ``internal``. None for any other ``exc``."""
    if plan.disk_from is None or exc.errno != errno.ENOSPC:
        return None
    return SandboxError("the snapshot's disk is full (its inodes, most likely): no room for "
                        "the sandbox's overlay work dir")


def _clone_disk(image: Path, d: Path) -> None:
    """A copy of a snapshot's disk image, to be the sandbox's disk (``_mount_disk``)."""
    fresh = d / NEW_DISK
    fresh.unlink(missing_ok=True)
    method = clone_file(image, fresh)
    log.info("sandbox %s: disk from %s (%s)", d.name, image, method)


def _mount_disk(d: Path, namespace: int) -> str:
    """The copy ``_clone_disk`` made as the sandbox's disk, mounted in its mount namespace,
    with a fresh run dir (``_fresh_run``): processes start fresh."""
    os.rename(d / NEW_DISK, d / "disk.img")
    (d / "disk").mkdir(exist_ok=True)
    dev = loop_mount(d / "disk.img", d / "disk", namespace=namespace)
    with inside(namespace):
        _fresh_run(d / "disk")
    return dev


def _fresh_run(disk: Path) -> None:
    """A snapshot's run dir made fresh on the new sandbox's ``disk``: what its agent left
    there (its socket, its sessions' state) goes. The sandbox may have filled the dir with
    anything (as many files as its disk has inodes, deep chains), so the host removes its
    entries only while they are a few plain files (RUN_CLEARED: the usual socket and
    sessions); otherwise the whole dir is moved, unread, into a new one (``RUN_DISCARDED``),
    where it stays in the sandbox's disk and quota for the sandbox to remove. Never walked."""
    run = disk / "run"
    try:
        mode: int | None = os.lstat(run).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISDIR(mode):  # not what dsec made: never followed
        os.unlink(run)
    elif mode is not None and not _cleared(run):
        aside = disk / f"run.{secrets.token_hex(4)}"
        os.rename(run, aside)
        run.mkdir(0o755)
        os.rename(aside, run / RUN_DISCARDED)
    run.mkdir(0o755, exist_ok=True)


def _cleared(run: Path) -> bool:
    """Whether ``run``'s entries, if they are at most RUN_CLEARED non-directories, were
    removed (then ``run`` is empty); False, with nothing removed, for anything more."""
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with os.scandir(fd) as entries:
            first = list(itertools.islice(entries, RUN_CLEARED + 1))
        if len(first) > RUN_CLEARED or any(e.is_dir(follow_symlinks=False) for e in first):
            return False
        for entry in first:
            os.unlink(entry.name, dir_fd=fd)
        return True
    finally:
        os.close(fd)


def _unmount_bundle(d: Path, wait: bool = True) -> None:
    """The sandbox's two mounts, the overlay before the disk under it. The disk's content is
    thrown away (loop.unmount_image: discard); its loop device is known from its mount, so no
    other device is looked at, and ``wait`` waits until it is detached."""
    rootfs = d / "rootfs"
    if os.path.ismount(rootfs):
        unmount_or_detach(rootfs)
    unmount_image(d / "disk", d / "disk.img", discard=True, wait=wait)
