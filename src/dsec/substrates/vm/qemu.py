"""What the two VM substrates share: one QEMU process per sandbox, booting the guest of
``substrates/vm/guest.py`` with the image's layers as read-only disks and an ext4 disk of its own.

Per sandbox, under ``<state>/vms/<id>/``: ``disk.ext4`` (the writable layer, ``disk_mb``
big: a real size limit; ``disk.qcow2`` over a template's disk when restoring a snapshot), ``qemu.pid``, ``qemu.log`` (QEMU's own errors) and ``console.log``
(the guest's serial console). QEMU daemonizes once it is set up (like ``crun run
--detach``), so a failed set-up is its exit code and a live VM outlives a restarted edge.
QEMU runs in the cgroup ``/dsec-<edge>-<substrate>/<id>``: host-side cpu and memory limits,
OOM counts, and the proof of ownership of a stored pid.

The agent is reached over TCP: QEMU user networking with ``restrict=on`` (the guest can reach
nothing outside) forwards one loopback port of the host to the agent's port in the guest.
Any local user can connect to that port (and read it in QEMU's argv), so it is never how the
agent is claimed: the edge hands the agent its token (with the guest's name and the time)
over a virtio-serial port whose host end, ``boot.sock``, is in the sandbox's directory,
which only root can enter (``_boot_agent``); the agent serves nothing before, and refuses
every request without the token after. Nothing secret is in QEMU's argv or environment.
A snapshot template is saved with its agent still waiting for that message, so each restore
gets its own token.
Network policies use a second NIC, connected to the host only while a policy is set
(``substrates/vm/vmnet.py``); QEMU's QMP socket, ``qmp.sock``, is how it is plugged in and out.
Acceleration is KVM, or TCG (full emulation: slower, still a hardware-level VM boundary) by
choice; KVM without ``/dev/kvm`` is refused, never replaced by something unisolated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable

from ...agent.client import AgentClient
from ...network.policy import Egress
from ...network.wired import WiredSandboxes
from ...network.wiring import Slot
from ...protocol.errors import InvalidRequest, NotSupported, SandboxError
from ...protocol.models import CreateRequest
from ..base import StartPlan, Substrate
from ..host import cgroups, spawn
from ..host.pidwatch import PidWatch
from ..host.spawn import Spawned
from . import vmnet, vmsnapshot
from .guest import AGENT_PORT, BOOT_PORT, GuestBoot, guest_boot, host_tsc_khz

ACCELS = ("kvm", "tcg")
log = logging.getLogger("dsec.qemu")
START_TIMEOUT_S = 180.0  # a TCG boot on a loaded host takes tens of seconds
QEMU_OVERHEAD_MB = 256  # QEMU itself (device model, TCG translation cache) above guest RAM
TCG_CACHE_MB = 64  # translation cache; QEMU's default of 1 GiB would dwarf small guests
PORT_ATTEMPTS = 5  # a freshly chosen free port can be taken before QEMU binds it
BOOT_SOCKET = "boot.sock"  # QEMU's end of the guest's boot port (guest.BOOT_PORT)
HOSTNAME_MAX = 64  # the kernel's limit
MIN_MEMORY_MB = 128  # the guest kernel and its initramfs do not boot in less


class QemuSubstrate(Substrate):
    """Subclasses say which machine QEMU emulates and which devices carry disks and network."""

    machine: str
    disk_device: str
    net_device: str
    serial_device: str  # the virtio-serial controller that carries the boot port
    pvh: bool  # enter the uncompressed kernel directly instead of through firmware
    network_policies = True

    def __init__(self, state_dir: Path, edge_id: str, accel: str = "kvm",
                 kvm_device: Path = Path("/dev/kvm"), snapshots: bool = False) -> None:
        if accel not in ACCELS:
            raise NotSupported(f"unknown VM acceleration {accel!r}; choose one of {ACCELS}")
        self.accel = accel
        self.kvm_device = kvm_device
        self.snapshots = snapshots  # restore a saved booted VM instead of booting (vmsnapshot.py)
        self.root = state_dir / "vms"
        self.cgroup_parent = f"/dsec-{edge_id}-{self.name}"
        self._pids = PidWatch(self.cgroup_parent)
        self._boot: GuestBoot | None = None
        # not "<edge>/": that prefix is the container substrate's, whose links these are not
        self.network = WiredSandboxes(f"{self.name}@{edge_id}/")

    async def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        await self.network.recover()

    async def close(self) -> None:
        cgroups.remove_parent_if_unused(self.cgroup_parent)

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    async def _check_host(self) -> GuestBoot:
        """The guest to boot, once this host can run it (else ``NotSupported`` saying why).
        Found on the first create, not at edge start: servers that run no VM never pay."""
        if self.accel == "kvm" and not self.kvm_device.exists():
            raise NotSupported(f"{self.kvm_device} missing: this host cannot run KVM VMs "
                               "(a server started with --vm-accel tcg emulates them instead)",
                               device=str(self.kvm_device))
        spawn.resolve("qemu-system-x86_64")
        if self._boot is None:
            self._boot = await asyncio.to_thread(guest_boot)
        return self._boot

    # start
    async def start(self, plan: StartPlan) -> dict[str, Any]:
        boot = await self._check_host()
        if plan.request.runtime is not None:
            raise NotSupported(f"runtime={plan.request.runtime!r} is a container option; "
                               f"a {self.name} sandbox has no OCI runtime")
        if plan.request.memory_mb < MIN_MEMORY_MB:
            raise InvalidRequest(f"a {self.name} needs memory_mb >= {MIN_MEMORY_MB} (its guest "
                                 "kernel's RAM)", memory_mb=plan.request.memory_mb)
        try:
            return await self._start(plan, boot, self._dir(plan.sandbox_id))
        except BaseException:
            await self.destroy(plan.sandbox_id)
            raise

    async def _start(self, plan: StartPlan, boot: GuestBoot, d: Path) -> dict[str, Any]:
        d.mkdir(mode=0o700)  # QEMU's sockets in it (QMP, the boot port) are root's alone
        if self.snapshots:
            template = await self._template(plan, boot, d)
            await vmsnapshot.overlay(template, d / "disk.qcow2")
            disk, extra = (d / "disk.qcow2", "qcow2"), ["-incoming", f"exec:cat {template / 'state.bin'}"]
        else:
            await _mkfs(d / "disk.ext4", plan.request.disk_mb)
            disk, extra = (d / "disk.ext4", "raw"), []
        pid, port = await self._launch(plan, boot, d, disk, extra)
        try:
            self._pids.adopt(plan.sandbox_id, pid)
            cgroups.create_for_process(self.cgroup_parent, plan.sandbox_id, pid)
        except ProcessLookupError:  # adopt: QEMU exited already
            raise self._stopped_booting(d) from None
        except OSError as exc:  # the cgroup refuses a pid that exited
            if self._pids.alive(plan.sandbox_id, pid):
                raise
            raise self._stopped_booting(d) from exc
        self._set_limits(plan.sandbox_id, plan.request)
        if self.snapshots:
            await vmsnapshot.resume(d / "qmp.sock")
        alive = functools.partial(self._pids.alive, plan.sandbox_id, pid)
        if not self.snapshots:  # a restored agent listens already: it was saved waiting
            await self._wait_until_listening(alive, d)
        token = secrets.token_hex(32)
        await self._boot_agent(alive, d, token, plan.sandbox_id)
        return {"pid": pid, "port": port, "accel": self.accel, "token": token}

    async def _launch(self, plan: StartPlan, boot: GuestBoot, d: Path, disk: tuple[Path, str],
                      extra: list[str]) -> tuple[int, int]:
        """Start QEMU (it daemonizes once set up); its pid and the host port of the agent."""
        for _ in range(PORT_ATTEMPTS):
            port = _free_port()
            qemu = Spawned([*self._argv(plan, boot, d, port, disk), *extra], capture_stdout=False,
                           stderr=d / "qemu.log", idle_priority=plan.warm)
            code = await qemu.wait()
            log = (d / "qemu.log").read_text(errors="replace").strip()
            if code == 0 or "host forwarding rule" not in log:
                break
        if code != 0:
            raise SandboxError(f"QEMU failed to start the {self.name} (exit {code}): "
                               f"{log[-2000:] or 'no output'}")
        try:
            return int((d / "qemu.pid").read_text()), port
        except FileNotFoundError:  # QEMU removes its pid file when it exits: the guest stopped
            raise self._stopped_booting(d) from None

    async def _template(self, plan: StartPlan, boot: GuestBoot, d: Path) -> Path:
        """The saved, booted VM that sandboxes of this shape restore; made on first use, by
        the sandbox ``d`` belongs to (which records the template QEMU's pid, for clean-up)."""
        req = plan.request
        target = vmsnapshot.snapshot_dir([self.name, self.machine, self.accel, str(boot.kernel),
                                          str(boot.initramfs), plan.image.digest, str(req.memory_mb),
                                          str(_cpus(req)), str(req.disk_mb)])
        async with vmsnapshot.TemplateLock(target):
            if target.exists():
                return target
            scratch = vmsnapshot.scratch_for(target)
            try:
                await _mkfs(scratch / "disk.ext4", req.disk_mb)
                pid, _ = await self._launch(plan, boot, scratch, (scratch / "disk.ext4", "raw"), [])
                (d / "template.pid").write_text(str(pid))
                try:  # saved unclaimed: its agent waits for a boot message, one per restore
                    await self._wait_until_listening(lambda: _is_our_qemu(pid, plan.sandbox_id), scratch)
                    await vmsnapshot.save(scratch / "qmp.sock", scratch / "state.bin")
                finally:
                    if _is_our_qemu(pid, plan.sandbox_id):
                        os.kill(pid, 9)
                vmsnapshot.commit(scratch, target)
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
        return target

    def _argv(self, plan: StartPlan, boot: GuestBoot, d: Path, port: int,
              disk: tuple[Path, str]) -> list[str]:
        req, layers = plan.request, plan.image.layers
        if any(layer.format != "erofs" for layer in layers):
            raise NotSupported("VM sandboxes need EROFS image layers (this image store keeps "
                               "plain directories)")
        accel = "kvm" if self.accel == "kvm" else f"tcg,tb-size={TCG_CACHE_MB}"
        cmdline = f"console=ttyS0 quiet panic=-1 dsec.layers={len(layers)}"
        if self.accel == "tcg":
            cmdline += f" tsc_early_khz={host_tsc_khz()} tsc=reliable"
        argv = ["qemu-system-x86_64", "-name", plan.sandbox_id, "-M", self.machine,
                "-accel", accel, "-cpu", "host" if self.accel == "kvm" else "max",
                "-m", str(req.memory_mb), "-smp", str(_cpus(req)),
                "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
                "-kernel", str(boot.pvh_kernel if self.pvh and boot.pvh_kernel else boot.kernel),
                "-initrd", str(boot.initramfs), "-append", cmdline,
                "-serial", f"file:{d / 'console.log'}",
                "-qmp", f"unix:{d / 'qmp.sock'},server=on,wait=off",
                "-chardev", f"socket,id=boot,path={d / BOOT_SOCKET},server=on,wait=off",
                "-device", f"{self.serial_device},id=serial",
                "-device", f"virtserialport,bus=serial.0,chardev=boot,name={BOOT_PORT}",
                "-daemonize", "-pidfile", str(d / "qemu.pid")]
        disks = [(layer.path, "raw", f"layer{i}", "on") for i, layer in enumerate(layers)]
        for i, (path, fmt, serial, readonly) in enumerate([*disks, (*disk, "rw", "off")]):
            argv += ["-drive", f"id=d{i},file={path},format={fmt},if=none,readonly={readonly}",
                     "-device", f"{self.disk_device},drive=d{i},serial={serial}"]
        return argv + vmnet.nic_args(self.net_device, port, AGENT_PORT)

    async def _wait_until_listening(self, alive: Callable[[], bool], d: Path) -> None:
        """Until a booting guest's agent listens: it prints ``R`` on the console, then waits
        for its boot message (so the message's clock is read at once)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"R" not in _read(d / "console.log"):
            if not alive():
                raise self._stopped_booting(d)
            if time.monotonic() > deadline:
                raise SandboxError(f"the {self.name}'s agent did not start within "
                                   f"{START_TIMEOUT_S:.0f}s: {_tail(d / 'console.log')}")
            await asyncio.sleep(0.02)

    async def _boot_agent(self, alive: Callable[[], bool], d: Path, token: str, hostname: str) -> None:
        """Claim the agent out of band: its token, the guest's name and the time, over the
        guest's boot port (a virtio-serial port whose host end only root can open). The
        agent serves nothing before it has them, and answers ``OK`` or ``ERR reason`` (and
        then stops the guest)."""
        now = time.time_ns()
        message = f"{token} {hostname[:HOSTNAME_MAX]} {now // 10**9} {now % 10**9}\n"
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            reader, writer = await asyncio.open_unix_connection(str(d / BOOT_SOCKET))
            try:
                writer.write(message.encode())
                await writer.drain()
                while True:  # the guest reads it once its agent runs; QEMU may die meanwhile
                    try:
                        answer = await asyncio.wait_for(reader.readline(), 0.2)
                        break
                    except TimeoutError:
                        if not alive():
                            raise self._stopped_booting(d) from None
                        if time.monotonic() > deadline:
                            raise SandboxError(f"the {self.name}'s agent did not take its token within "
                                               f"{START_TIMEOUT_S:.0f}s: {_tail(d / 'console.log')}") from None
            finally:
                writer.close()
        except OSError as exc:
            answer = f"boot port: {exc}".encode()
        if answer != b"OK\n":
            raise await self._not_claimed(alive, d, answer.decode(errors="replace").strip()[:200])

    async def _not_claimed(self, alive: Callable[[], bool], d: Path, why: str) -> SandboxError:
        """Why a claim failed: a guest that stops (as the agent does when it refuses its boot
        message) says so on its console, which is the better reason once QEMU has exited."""
        for _ in range(100):
            if not alive():
                return self._stopped_booting(d)
            await asyncio.sleep(0.02)
        return SandboxError(f"the {self.name}'s agent could not be claimed: {why or 'no answer'}")

    def _stopped_booting(self, d: Path) -> SandboxError:
        return SandboxError(f"the {self.name} stopped while booting: {_tail(d / 'console.log')}")

    def _set_limits(self, sandbox_id: str, req: CreateRequest) -> None:
        """Host-side limits on the QEMU process; the guest's own size is its -m and -smp."""
        cgroups.set_limits(self.cgroup_parent, sandbox_id, req.cpu,
                           (req.memory_mb + QEMU_OVERHEAD_MB) << 20, req.pids)

    async def claim(self, sandbox_id: str, runtime: dict[str, Any], request: CreateRequest) -> None:
        self._set_limits(sandbox_id, request)
        for tid in os.listdir(f"/proc/{runtime['pid']}/task"):  # every vCPU and I/O thread
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))

    # inspection
    def agent(self, sandbox_id: str, runtime: dict[str, Any]) -> AgentClient:
        """Over the port forward, which only QEMU (running as the edge's user) may hold."""
        return AgentClient(("127.0.0.1", runtime["port"]), runtime.get("token"), peer_uid=os.geteuid())

    def alive(self, sandbox_id: str, runtime: dict[str, Any]) -> bool:
        return self._pids.alive(sandbox_id, runtime.get("pid"))

    def watch(self, sandbox_id: str, runtime: dict[str, Any], on_exit: Callable[[], None]) -> None:
        self._pids.watch(sandbox_id, runtime.get("pid"), on_exit)

    def death_cause(self, sandbox_id: str, runtime: dict[str, Any]) -> str:
        if self.oom_kills(sandbox_id, runtime):
            return f"out of memory: the host killed the {self.name}'s QEMU process"
        return f"the {self.name}'s QEMU process exited (guest console: {_tail(self._dir(sandbox_id) / 'console.log')})"

    def oom_kills(self, sandbox_id: str, runtime: dict[str, Any]) -> int:
        """Host OOM kills of QEMU; the guest kernel's own OOM kills are inside the VM."""
        return cgroups.oom_kills(self.cgroup_parent, sandbox_id)

    # network
    async def set_network(self, sandbox_id: str, runtime: dict[str, Any],
                          egress: Egress | None) -> None:
        qmp, agent = self._dir(sandbox_id) / "qmp.sock", self.agent(sandbox_id, runtime)

        async def wire() -> Slot:
            slot = await self.network.run(self.network.wiring.attach_tap,
                                          self.network.owner(sandbox_id))
            try:
                await vmnet.plug(qmp, slot)
                await vmnet.configure_guest(agent, slot)
            except BaseException:
                with contextlib.suppress(SandboxError):  # QEMU may hold the tap, or be gone
                    await vmnet.unplug(qmp)
                await self.network.run(self.network.wiring.detach, slot)
                raise
            return slot

        async def unwire(slot: Slot) -> None:
            await vmnet.unplug(qmp)
            await self.network.run(self.network.wiring.detach, slot)
            try:  # the host holds nothing of it any more: the guest's side is tidying only
                await vmnet.configure_guest(agent, None)
            except SandboxError as exc:
                log.warning("%s: unplugged, but its eth0 could not be taken down: %s",
                            sandbox_id, exc)

        await self.network.set(sandbox_id, egress, wire, unwire)

    async def set_paused(self, sandbox_id: str, runtime: dict[str, Any], paused: bool) -> None:
        """QEMU frozen whole by its cgroup's freezer: no CPU, its memory kept (saving the VM
        to disk and letting QEMU exit, as vmsnapshot.py does for templates, is not done yet)."""
        await asyncio.to_thread(cgroups.set_frozen, self.cgroup_parent, sandbox_id, paused)

    # teardown
    async def destroy(self, sandbox_id: str) -> None:
        self._pids.forget(sandbox_id)
        d = self._dir(sandbox_id)
        await asyncio.to_thread(self._teardown, sandbox_id, d)
        await self.network.remove(sandbox_id)  # QEMU is gone: its tap goes with the rules

    def _teardown(self, sandbox_id: str, d: Path) -> None:
        """Kill QEMU (through its cgroup, or its pid file if it never got one; also a
        snapshot template's QEMU that this sandbox's start was booting), then remove its
        cgroups and directory."""
        cgroups.thaw_if_frozen(self.cgroup_parent, sandbox_id)
        for pid_file in ("qemu.pid", "template.pid"):
            try:
                pid = int((d / pid_file).read_text())
                if _is_our_qemu(pid, sandbox_id):
                    os.kill(pid, 9)
            except (OSError, ValueError):
                pass
        cgroups.remove_cgroups(cgroups.sandbox_dirs(self.cgroup_parent, sandbox_id))
        shutil.rmtree(d, ignore_errors=True)

    async def leftovers(self) -> set[str]:
        ids = {p.name for p in self.root.iterdir()} if self.root.exists() else set()
        return ids | set(cgroups.sandbox_cgroups(self.cgroup_parent)) | self.network.ids()


def _cpus(req: CreateRequest) -> int:
    return max(1, math.ceil(req.cpu))


async def _mkfs(disk: Path, size_mb: int) -> None:
    """An empty ext4 file system of ``size_mb`` (sparse: only its metadata takes space)."""
    code = await spawn.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "root_owner=0:0",
                            str(disk), f"{size_mb}M"])
    if code != 0:
        raise SandboxError(f"mkfs.ext4 failed (exit {code}) for the writable disk")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_our_qemu(pid: int, sandbox_id: str) -> bool:
    """The pid is a QEMU named after this sandbox (pid files outlive their process)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"-name" in argv and sandbox_id.encode() in argv


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no console output"
    return " | ".join(text[-lines:]) or "no console output"
