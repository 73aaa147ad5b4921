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
State (snapshots, rollback, pause): a ``filesystem`` snapshot runs ``sync`` in the guest
(dsec's busybox, through the agent: the guest's page cache reaches its disk), stops QEMU's
CPUs (QMP ``stop``: QEMU flushes its writes to ``disk.ext4``), copies the disk
(``host/image_copy.py``) and continues. A ``full`` snapshot saves the whole VM
(``vmsnapshot.save``: memory and devices) beside the disk copy. A sandbox made from either
starts on a copy of the disk (booting, or ``-incoming`` from the saved state), and its agent
gets its own token, name, clock and random seed over the boot port, which the agent keeps
open for exactly that (a restored guest holds the saved one's until then). A rollback kills
QEMU and starts it again the same way, under the same id and token. A pause saves the VM to
``paused.bin`` and lets QEMU exit (its memory goes back to the host); a resume (any call)
starts QEMU on it. QEMU's command line is kept in ``qemu.json`` for these restarts (with
``@PORT@`` for the agent's port, chosen anew each time).
Network policies use a second NIC, connected to the host only while a policy is set
(``substrates/vm/vmnet.py``); QEMU's QMP socket, ``qmp.sock``, is how it is plugged in and out.
Acceleration is KVM, or TCG (full emulation: slower, still a hardware-level VM boundary) by
choice; KVM without ``/dev/kvm`` is refused, never replaced by something unisolated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import secrets
import select
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable

from ...agent.client import AgentClient, AgentUnavailable
from ...agent.tools import BUSYBOX
from ...network.policy import Egress
from ...network.wired import WiredSandboxes
from ...network.wiring import Slot
from ...protocol.errors import InvalidRequest, NotSupported, SandboxError
from ...protocol.models import CreateRequest
from ..base import StartPlan, Substrate
from ..host import cgroups, spawn
from ..host.image_copy import clone_file
from ..host.pidwatch import PidWatch
from ..host.spawn import Spawned
from . import vmnet, vmsnapshot
from .guest import (
    AGENT_PORT,
    BOOT_PORT,
    CONSOLE_READY,
    GuestBoot,
    guest_boot,
    host_tsc_khz,
)

ACCELS = ("kvm", "tcg")
log = logging.getLogger("dsec.qemu")
START_TIMEOUT_S = 180.0  # a TCG boot on a loaded host takes tens of seconds
QEMU_OVERHEAD_MB = 256  # QEMU itself (device model, TCG translation cache) above guest RAM
TCG_CACHE_MB = 64  # translation cache; QEMU's default of 1 GiB would dwarf small guests
PORT_ATTEMPTS = 5  # a freshly chosen free port can be taken before QEMU binds it
BOOT_SOCKET = "boot.sock"  # QEMU's end of the guest's boot port (guest.BOOT_PORT)
HOSTNAME_MAX = 64  # the kernel's limit
MIN_MEMORY_MB = 128  # the guest kernel and its initramfs do not boot in less
SEED_BYTES = 64  # random bytes for the guest's pool in each boot message (agent.c SEED_BYTES)
DISK = "disk.ext4"  # the writable disk, raw
ARGV_FILE = "qemu.json"  # QEMU's command line, for restarts (rollback, resume)
PAUSED_STATE = "paused.bin"  # a paused VM, saved
PORT = "@PORT@"  # in ARGV_FILE: the agent's host port, chosen at each launch
EXIT_TIMEOUT_S = 10.0


class QemuSubstrate(Substrate):
    """Subclasses say which machine QEMU emulates and which devices carry disks and network."""

    machine: str
    disk_device: str
    net_device: str
    serial_device: str  # the virtio-serial controller that carries the boot port
    pvh: bool  # enter the uncompressed kernel directly instead of through firmware
    network_policies = True
    rollback_keeps_network = True  # the host's tap outlives QEMU: plugged again on restart
    terminals = True  # the guest's own devpts (guest.py)

    def __init__(self, state_dir: Path, edge_id: str, accel: str = "kvm",
                 kvm_device: Path = Path("/dev/kvm"), snapshots: bool = False,
                 template_idle_s: float = 86400) -> None:
        if accel not in ACCELS:
            raise NotSupported(f"unknown VM acceleration {accel!r}; choose one of {ACCELS}")
        self.accel = accel
        self.kvm_device = kvm_device
        self.snapshots = snapshots  # restore a saved booted VM instead of booting (vmsnapshot.py)
        self.template_idle_s = template_idle_s  # a template none restored this long is swept
        self.root = state_dir / "vms"
        self.cgroup_parent = f"/dsec-{edge_id}-{self.name}"
        self._pids = PidWatch(self.cgroup_parent)
        self._boot: GuestBoot | None = None
        # not "<edge>/": that prefix is the container substrate's, whose links these are not
        self.network = WiredSandboxes(f"{self.name}@{edge_id}/")

    async def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        await self.network.recover()
        await self._sweep_templates()

    async def _sweep_templates(self) -> None:
        await asyncio.to_thread(vmsnapshot.sweep, vmsnapshot.templates_root(), time.time(),
                                self.template_idle_s)

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
        incoming = plan.memory_from
        if plan.disk_from is not None:  # a snapshot's: a copy of its disk (and its saved state)
            await asyncio.to_thread(clone_file, plan.disk_from, d / DISK)
            disk = (d / DISK, "raw")
        elif self.snapshots:
            template = await self._template(plan, boot, d)
            await vmsnapshot.overlay(template, d / "disk.qcow2")
            disk, incoming = (d / "disk.qcow2", "qcow2"), template / "state.bin"
        else:
            await _mkfs(d / DISK, plan.request.disk_mb)
            disk = (d / DISK, "raw")
        (d / ARGV_FILE).write_text(json.dumps(self._argv(plan, boot, d, PORT, disk)))
        return await self._bring_up(plan.sandbox_id, d, secrets.token_hex(32), incoming,
                                    plan.request, plan.warm)

    async def _bring_up(self, sandbox_id: str, d: Path, token: str, incoming: Path | None,
                        limits: CreateRequest | None = None, warm: bool = False) -> dict[str, Any]:
        """Launch QEMU from ``d``'s command line (booting, or loading the saved state
        ``incoming``), put it in the sandbox's cgroups (``limits`` set on them, when given)
        and give its agent ``token``; the runtime dict."""
        argv = json.loads((d / ARGV_FILE).read_text())
        extra = vmsnapshot.incoming(incoming) if incoming is not None else []
        pid, port = await self._launch(argv, d, extra, warm)
        try:
            self._pids.adopt(sandbox_id, pid)
            cgroups.create_for_process(self.cgroup_parent, sandbox_id, pid)
        except ProcessLookupError:  # adopt: QEMU exited already
            raise self._stopped_booting(d) from None
        except OSError as exc:  # the cgroup refuses a pid that exited
            if self._pids.alive(sandbox_id, pid):
                raise
            raise self._stopped_booting(d) from exc
        if limits is not None:
            self._set_limits(sandbox_id, limits)
        alive = functools.partial(self._pids.alive, sandbox_id, pid)
        if incoming is not None:  # a restored agent listens already
            await vmsnapshot.resume(d / "qmp.sock")
        else:
            await self._wait_until_listening(alive, d)
        await self._boot_agent(alive, d, token, sandbox_id, restored=incoming is not None)
        runtime = {"pid": pid, "port": port, "accel": self.accel, "token": token}
        slot = self.network.slot(sandbox_id)
        if slot is not None:  # restarted with a policy (resume, rollback): its tap plugged again
            await vmnet.plug(d / "qmp.sock", slot)
            if incoming is None:  # a fresh boot's eth0 is bare; a restored one kept its set-up
                await vmnet.configure_guest(self.agent(sandbox_id, runtime), slot)
        return runtime

    async def _launch(self, argv: list[str], d: Path, extra: list[str],
                      warm: bool = False) -> tuple[int, int]:
        """Start QEMU (it daemonizes once set up); its pid and the host port of the agent."""
        for _ in range(PORT_ATTEMPTS):
            port = _free_port()
            qemu = await Spawned.start([*(a.replace(PORT, str(port)) for a in argv), *extra],
                                       capture_stdout=False, stderr=d / "qemu.log",
                                       idle_priority=warm)
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
        """The saved, booted VM that sandboxes of this shape restore, recorded as used by the
        sandbox ``d`` belongs to; made on first use, by that sandbox (which records the
        template QEMU's pid, for clean-up), and then the other templates swept."""
        req = plan.request
        target = vmsnapshot.snapshot_dir([self.name, self.machine, self.accel, str(boot.kernel),
                                          str(boot.initramfs), plan.image.digest, str(req.memory_mb),
                                          str(_cpus(req)), str(req.disk_mb)])
        async with vmsnapshot.TemplateLock(target):
            built = not target.exists()
            if built:
                await self._build_template(plan, boot, d, target)
            vmsnapshot.use(target, d)
        if built:
            await self._sweep_templates()
        return target

    async def _build_template(self, plan: StartPlan, boot: GuestBoot, d: Path,
                              target: Path) -> None:
        scratch = vmsnapshot.scratch_for(target)
        try:
            await _mkfs(scratch / DISK, plan.request.disk_mb)
            argv = self._argv(plan, boot, scratch, PORT, (scratch / DISK, "raw"))
            vmsnapshot.record_inputs(scratch, [self._kernel(boot), boot.initramfs,
                                               *(layer.path for layer in plan.image.layers)])
            pid, _ = await self._launch(argv, scratch, [])
            (d / "template.pid").write_text(str(pid))
            try:  # saved unclaimed: its agent waits for a boot message, one per restore
                await self._wait_until_listening(lambda: _is_our_qemu(pid, plan.sandbox_id), scratch)
                await vmsnapshot.save(scratch / "qmp.sock", scratch / "state.bin")
            finally:
                if _is_our_qemu(pid, plan.sandbox_id):
                    os.kill(pid, 9)
            vmsnapshot.commit(scratch, target)
        except BaseException:
            with contextlib.suppress(OSError):  # else the next sweep's
                vmsnapshot.discard(scratch)
            raise

    def _kernel(self, boot: GuestBoot) -> Path:
        return boot.pvh_kernel if self.pvh and boot.pvh_kernel else boot.kernel

    def _argv(self, plan: StartPlan, boot: GuestBoot, d: Path, port: str,
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
                "-kernel", str(self._kernel(boot)),
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
        """Until a booting guest's agent listens: it prints ``CONSOLE_READY`` on the console,
        then waits for its boot message (so the message's clock is read at once, and a
        template is saved with its agent waiting, not in the firmware)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while CONSOLE_READY not in _read(d / "console.log"):
            if not alive():
                raise self._stopped_booting(d)
            if time.monotonic() > deadline:
                raise SandboxError(f"the {self.name}'s agent did not start within "
                                   f"{START_TIMEOUT_S:.0f}s: {_tail(d / 'console.log')}")
            await asyncio.sleep(0.02)

    async def _boot_agent(self, alive: Callable[[], bool], d: Path, token: str, hostname: str,
                          restored: bool) -> None:
        """Claim the agent out of band: its token, the guest's name, the time and a random
        seed, over the guest's boot port (a virtio-serial port whose host end only root can
        open). The agent serves nothing before it has them, and answers ``OK`` or ``ERR
        reason`` (and then stops the guest). A restored guest's agent takes a new message
        the same way, in place of the saved one's token (agent.c ``boot_read``); its console
        is new and empty, so a timeout says what QEMU and the port were doing instead."""
        now = time.time_ns()
        seed = secrets.token_hex(SEED_BYTES)  # the guest's random pool is reseeded with it
        message = f"{token} {hostname[:HOSTNAME_MAX]} {now // 10**9} {now % 10**9} {seed}\n"
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
                            raise SandboxError(
                                f"the {self.name}'s agent did not take its token within "
                                f"{START_TIMEOUT_S:.0f}s ({'restored from a saved state' if restored else 'booted'}; "
                                f"{await vmsnapshot.describe(d / 'qmp.sock')}): "
                                f"{_tail(d / 'console.log')}") from None
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

    async def claim(self, sandbox_id: str, runtime: dict[str, Any], request: CreateRequest,
                    started: CreateRequest) -> None:
        self._set_limits(sandbox_id, request)
        for tid in os.listdir(f"/proc/{runtime['pid']}/task"):  # every vCPU and I/O thread
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))

    # inspection
    def agent(self, sandbox_id: str, runtime: dict[str, Any]) -> AgentClient:
        """Over the port forward, which only QEMU (running as the edge's user) may hold."""
        return AgentClient(("127.0.0.1", runtime["port"]), runtime.get("token"), peer_uid=os.geteuid())

    def alive(self, sandbox_id: str, runtime: dict[str, Any]) -> bool:
        """QEMU runs, or the VM is paused on disk (saved whole; no QEMU until it resumes)."""
        return self._pids.alive(sandbox_id, runtime.get("pid")) or self._saved(sandbox_id)

    def _saved(self, sandbox_id: str) -> bool:
        return (self._dir(sandbox_id) / PAUSED_STATE).exists()

    def watch(self, sandbox_id: str, runtime: dict[str, Any], on_exit: Callable[[], None]) -> None:
        """QEMU's exit; nothing to watch while the VM is saved (its resume watches again)."""
        if self._saved(sandbox_id) and not self._pids.alive(sandbox_id, runtime.get("pid")):
            return
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

    # state: snapshots, rollback, pause
    def _own_disk(self, sandbox_id: str) -> Path:
        disk = self._dir(sandbox_id) / DISK
        if not disk.exists():
            raise NotSupported(f"snapshots of a {self.name} restored from a boot template "
                               "(--vm-snapshots) are not supported: its disk is an overlay "
                               "over the template's")
        return disk

    async def snapshot_disk(self, sandbox_id: str, runtime: dict[str, Any], dest: Path) -> None:
        """The guest's writes synced to its disk, QEMU stopped (its own writes flushed), the
        disk copied, QEMU continued: a copy of one instant, taken while processes run."""
        disk, qmp = self._own_disk(sandbox_id), self._dir(sandbox_id) / "qmp.sock"
        await self._guest_sync(sandbox_id, runtime)
        await vmsnapshot.stop(qmp)
        try:
            await asyncio.to_thread(clone_file, disk, dest)
        finally:
            await vmsnapshot.cont(qmp)

    async def _guest_sync(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        """``sync`` in the guest, with dsec's busybox: its page cache onto its disk (the disk
        has no journal, so an unsynced copy could be torn)."""
        try:
            done = await self.agent(sandbox_id, runtime).run(
                [BUSYBOX, "sync"], env={}, cwd="/", timeout_ms=int(START_TIMEOUT_S * 1000))
        except AgentUnavailable as exc:
            raise SandboxError(f"could not sync the {self.name}'s disk: {exc}") from None
        if done.exit_code != 0:
            raise SandboxError(f"sync in the {self.name} failed (exit {done.exit_code}, "
                               f"{'timed out' if done.timed_out else done.stderr[-200:]!r})")

    async def snapshot_full(self, sandbox_id: str, runtime: dict[str, Any], disk: Path,
                            memory: Path) -> None:
        """The whole VM saved (memory, devices: every process, mid-instruction) and its disk
        copied while QEMU is stopped, then continued."""
        own, qmp = self._own_disk(sandbox_id), self._dir(sandbox_id) / "qmp.sock"
        try:
            await vmsnapshot.save(qmp, memory)
            await asyncio.to_thread(clone_file, own, disk)
        finally:
            await vmsnapshot.cont(qmp)

    async def rollback(self, plan: StartPlan, runtime: dict[str, Any]) -> dict[str, Any]:
        """QEMU killed, the disk swapped for a copy of the snapshot's, QEMU started again:
        booting (``filesystem``) or loading the snapshot's saved state (``full``). Same id
        and token; a new pid and port."""
        assert plan.disk_from is not None
        d = self._dir(plan.sandbox_id)
        disk = self._own_disk(plan.sandbox_id)
        await self._kill_qemu(plan.sandbox_id, d)
        (d / PAUSED_STATE).unlink(missing_ok=True)
        disk.unlink()
        await asyncio.to_thread(clone_file, plan.disk_from, disk)
        return await self._bring_up(plan.sandbox_id, d, runtime["token"], plan.memory_from)

    async def undo_interrupted(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        """An edge killed mid-snapshot leaves QEMU stopped (``stop`` for the disk's copy, or a
        save under way): it runs again (``cont`` is a no-op on a running VM)."""
        (self._dir(sandbox_id) / f"{PAUSED_STATE}.part").unlink(missing_ok=True)
        await vmsnapshot.cont(self._dir(sandbox_id) / "qmp.sock")

    async def set_paused(self, sandbox_id: str, runtime: dict[str, Any],
                         paused: bool) -> dict[str, Any]:
        """Paused: the VM saved to ``paused.bin`` and QEMU gone (the guest's memory goes back
        to the host). Resumed: QEMU started on that file, its agent given its own token again
        (with the time, which stood still while saved). The file appears whole (renamed once
        the save completed), so a crash leaves either a running QEMU or a saved VM."""
        d = self._dir(sandbox_id)
        saved, pid = d / PAUSED_STATE, runtime.get("pid")
        if paused:
            if saved.exists():
                return runtime
            part = d / f"{PAUSED_STATE}.part"
            try:
                await vmsnapshot.save(d / "qmp.sock", part)
            except BaseException:
                part.unlink(missing_ok=True)
                await vmsnapshot.cont(d / "qmp.sock")
                raise
            self._pids.forget(sandbox_id)  # QEMU's exit below is no death
            os.rename(part, saved)
            await self._kill_qemu(sandbox_id, d)
            return {**runtime, "pid": None}
        if self._pids.alive(sandbox_id, pid):  # still in RAM: a crash mid-pause (or frozen)
            await asyncio.to_thread(cgroups.thaw_if_frozen, self.cgroup_parent, sandbox_id)
            await vmsnapshot.cont(d / "qmp.sock")
            saved.unlink(missing_ok=True)
            return runtime
        if not saved.exists():
            raise FileNotFoundError(f"the {self.name} is neither running nor saved")
        try:
            runtime = await self._bring_up(sandbox_id, d, runtime["token"], saved)
        except BaseException:  # still paused, on disk: the next call tries again
            await self._kill_qemu(sandbox_id, d)
            raise
        saved.unlink()
        return runtime

    async def _kill_qemu(self, sandbox_id: str, d: Path) -> None:
        """Kill the sandbox's QEMU and wait until it is gone (its cgroups and files stay)."""
        self._pids.forget(sandbox_id)
        await asyncio.to_thread(self._kill, sandbox_id, d, ("qemu.pid",), True)

    # teardown
    async def destroy(self, sandbox_id: str) -> None:
        self._pids.forget(sandbox_id)
        d = self._dir(sandbox_id)
        await asyncio.to_thread(self._teardown, sandbox_id, d)
        await self.network.remove(sandbox_id)  # QEMU is gone: its tap goes with the rules

    def _teardown(self, sandbox_id: str, d: Path) -> None:
        """Kill QEMU (through its cgroup, or its pid file if it never got one; also a
        snapshot template's QEMU that this sandbox's start was booting), then remove its
        cgroups, its use of a template and its directory."""
        self._kill(sandbox_id, d, ("qemu.pid", "template.pid"), False)
        cgroups.remove_cgroups(cgroups.sandbox_dirs(self.cgroup_parent, sandbox_id))
        vmsnapshot.release(d)
        shutil.rmtree(d, ignore_errors=True)

    def _kill(self, sandbox_id: str, d: Path, pid_files: tuple[str, ...], wait: bool) -> None:
        cgroups.thaw_if_frozen(self.cgroup_parent, sandbox_id)  # frozen tasks ignore SIGKILL
        for pid_file in pid_files:
            try:
                pid = int((d / pid_file).read_text())
                if not _is_our_qemu(pid, sandbox_id):
                    continue
                fd = os.pidfd_open(pid)
            except (OSError, ValueError):
                continue
            try:
                os.kill(pid, 9)
                if wait and not select.select([fd], [], [], EXIT_TIMEOUT_S)[0]:
                    raise SandboxError(f"the {self.name}'s QEMU did not exit on SIGKILL "
                                       f"within {EXIT_TIMEOUT_S:.0f}s")
            finally:
                os.close(fd)

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
