"""Warm starts for VM sandboxes (opt-in, ``--vm-snapshots``): restore a booted VM instead of
booting one.

Once per (machine, guest, image, memory, cpus, disk size), a template VM boots, its agent
answers, and QEMU saves it (``stop`` + ``migrate`` to a file, over QMP) next to its writable
disk, under ``$DSEC_CACHE/vm-snapshots/<key>/``. A sandbox then starts a QEMU with the same
devices, ``-incoming`` from that file, and a qcow2 overlay over the template's disk, and
continues the guest (QMP ``cont``) once the state is loaded.

Every restored guest starts from the same memory, so its kernel's random pool is the saved
one; this kernel has no vmgenid driver to force a reseed, so the edge's boot message (which
gives each restored guest its own token, hostname and clock: ``qemu._boot_agent``) carries 64
random bytes of the host that the agent mixes into the pool and reseeds the kernel's CRNG
with (``RNDADDENTROPY``, ``RNDRESEEDCRNG``) before it answers. Values a program drew from
the pool before the save stay in its memory: programs that keep their own generator state
must reseed themselves.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path

from ...config import current
from ...protocol.errors import SandboxError
from ..host import spawn

SAVE_TIMEOUT_S = 120.0
MAX_BANDWIDTH = 1 << 40  # bytes/s: a save to a local file is never throttled (QEMU's default is)


def snapshot_dir(parts: list[str]) -> Path:
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return current().cache / "vm-snapshots" / key


class TemplateLock:
    """Serialises builders of one template (across processes): an flock beside it."""

    def __init__(self, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(target.parent / f".{target.name}.lock", "w")

    async def __aenter__(self) -> TemplateLock:
        await asyncio.to_thread(fcntl.flock, self._file, fcntl.LOCK_EX)
        return self

    async def __aexit__(self, *exc: object) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def scratch_for(target: Path) -> Path:
    """A fresh build directory for ``target``; the caller holds its TemplateLock, so any
    older one is what a builder that died left."""
    for stale in target.parent.glob(f".{target.name}.*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))


class QMP:
    """A QEMU machine protocol connection: one command at a time, events skipped."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, path: Path) -> QMP:
        for _ in range(200):  # QEMU creates the socket while it sets up
            try:
                qmp = cls(*await asyncio.open_unix_connection(str(path)))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.01)
        else:
            raise SandboxError(f"no QMP socket at {path}")
        await qmp.reader.readline()  # the greeting
        await qmp.call("qmp_capabilities")
        return qmp

    async def call(self, command: str, **arguments: object) -> dict:
        self.writer.write(json.dumps({"execute": command, "arguments": arguments}).encode() + b"\n")
        while True:
            line = await self.reader.readline()
            if not line:
                raise SandboxError(f"QEMU closed its QMP socket during {command}")
            reply = json.loads(line)
            if "error" in reply:
                raise SandboxError(f"QMP {command} failed: {reply['error']}")
            if "return" in reply:
                return reply["return"]

    def close(self) -> None:
        self.writer.close()


def incoming(state_file: Path) -> list[str]:
    """QEMU's options to start from a saved state (it waits, stopped, once loaded)."""
    return ["-incoming", f"exec:cat {shlex.quote(str(state_file))}"]


async def save(qmp_socket: Path, state_file: Path) -> None:
    """Stop the VM behind ``qmp_socket`` and write its whole state to ``state_file``. The VM
    stays stopped, its disks flushed and released: ``cont`` runs it again."""
    # The guest's memory holds its agent's token: root's alone, before QEMU writes a byte.
    os.close(os.open(state_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
    qmp = await QMP.connect(qmp_socket)
    try:
        await qmp.call("stop")  # the disk and the memory saved are of one instant
        await qmp.call("migrate-set-parameters", **{"max-bandwidth": MAX_BANDWIDTH})
        await qmp.call("migrate", uri=f"exec:cat > {shlex.quote(str(state_file))}")
        for _ in range(int(SAVE_TIMEOUT_S / 0.05)):
            status = (await qmp.call("query-migrate")).get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise SandboxError(f"saving the VM failed: migration {status}")
            await asyncio.sleep(0.05)
        raise SandboxError(f"saving the VM took more than {SAVE_TIMEOUT_S:.0f}s")
    finally:
        qmp.close()


async def cont(qmp_socket: Path) -> None:
    """Run a stopped VM again (after ``save``, or a stop); a no-op on a running one."""
    qmp = await QMP.connect(qmp_socket)
    try:
        await qmp.call("cont")
    finally:
        qmp.close()


async def stop(qmp_socket: Path) -> None:
    """Stop the VM's CPUs; QEMU flushes its disks' writes to the host files first."""
    qmp = await QMP.connect(qmp_socket)
    try:
        await qmp.call("stop")
    finally:
        qmp.close()


async def resume(qmp_socket: Path) -> None:
    """Run a restored VM once its state is loaded (it was saved paused, so it stays paused)."""
    qmp = await QMP.connect(qmp_socket)
    try:
        for _ in range(int(SAVE_TIMEOUT_S / 0.01)):
            if (await qmp.call("query-status"))["status"] != "inmigrate":
                await qmp.call("cont")
                return
            await asyncio.sleep(0.01)
        raise SandboxError(f"loading the VM took more than {SAVE_TIMEOUT_S:.0f}s")
    finally:
        qmp.close()


async def describe(qmp_socket: Path) -> str:
    """QEMU's run state and its virtio-serial ports' (``info qtree``: whether the guest and
    the host have each port open), for an error that has nothing else to say."""
    try:
        qmp = await asyncio.wait_for(QMP.connect(qmp_socket), 5)
    except (OSError, SandboxError, TimeoutError) as exc:
        return f"QMP unreachable: {exc}"
    try:
        status = (await asyncio.wait_for(qmp.call("query-status"), 5))["status"]
        tree = await asyncio.wait_for(qmp.call("human-monitor-command", **{"command-line": "info qtree"}), 5)
    except (OSError, SandboxError, TimeoutError) as exc:
        return f"QMP failed: {exc}"
    finally:
        qmp.close()
    ports = [line.strip() for line in str(tree).splitlines() if line.strip().startswith("port ")]
    return f"QEMU {status}, {'; '.join(ports) or 'no serial port'}"


def commit(scratch: Path, target: Path) -> None:
    """Make a finished template visible at once (rename), dropping what only building needed."""
    for name in os.listdir(scratch):
        if name not in ("state.bin", "disk.ext4"):
            path = scratch / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    os.rename(scratch, target)


async def overlay(template: Path, disk: Path) -> None:
    """A per-sandbox qcow2 disk whose unwritten blocks read from the template's disk."""
    code = await spawn.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b",
                            str(template / "disk.ext4"), "-F", "raw", str(disk)])
    if code != 0:
        raise SandboxError(f"qemu-img could not create the sandbox's disk overlay (exit {code})")
