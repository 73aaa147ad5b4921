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

Templates are a cache, collected by ``sweep`` (at the edge's start and after each new
template). A restored sandbox's disk is an overlay whose backing file is its template's
disk, so a template stays while a sandbox uses it: each restore links its sandbox's
directory in the template's ``users/`` (under the template's lock, which the sweep takes),
and a link whose directory is gone (the sandbox destroyed, by its edge or by the recovery of
a dead one) no longer counts. A template no sandbox uses goes once no create can restore it
any more (a file it was made from, recorded in its ``meta.json``: the kernel, the initramfs
that holds the agent, an image layer, is gone: a new dsec or a collected image) or once
none restored it for ``--vm-template-idle-s``. The sweep reads only what dsec wrote there
(names of its own pattern, one level down, links never followed); a template's disk is the
file its template VM wrote to, removed as a file.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ...config import current
from ...protocol.errors import SandboxError
from ..host import spawn

log = logging.getLogger("dsec.vm")
SAVE_TIMEOUT_S = 120.0
MAX_BANDWIDTH = 1 << 40  # bytes/s: a save to a local file is never throttled (QEMU's default is)
META, USERS = "meta.json", "users"
USED_TEMPLATE = "template"  # in a restored sandbox's directory: its template's path
KEPT = ("state.bin", "disk.ext4", META)  # a template's files; the rest only built it
# The names the cache holds, each with its template's key: a template, a scratch directory
# (a builder's, from mkdtemp, or a template being removed) and a template's lock file.
TEMPLATE = re.compile(r"([0-9a-f]{16})")
SCRATCH = re.compile(r"\.([0-9a-f]{16})\.[a-z0-9_]{8}")
LOCK = re.compile(r"\.([0-9a-f]{16})\.lock")


def templates_root() -> Path:
    return current().cache / "vm-snapshots"


def snapshot_dir(parts: list[str]) -> Path:
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return templates_root() / key


def _lock_path(root: Path, key: str) -> Path:
    return root / f".{key}.lock"


def _locked(file: IO[str], path: Path) -> bool:
    """Whether the file just locked is still the one at ``path`` (a sweep may have removed
    it, under the lock, while this holder waited)."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(file.fileno())
    return (held.st_dev, held.st_ino) == (here.st_dev, here.st_ino)


class TemplateLock:
    """Serialises builders, users and the sweep of one template (across processes): an
    flock on a file beside it."""

    def __init__(self, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        self._path = _lock_path(target.parent, target.name)
        self._file: IO[str] | None = None

    async def __aenter__(self) -> TemplateLock:
        while self._file is None:
            file = open(self._path, "a")
            await asyncio.to_thread(fcntl.flock, file, fcntl.LOCK_EX)
            if _locked(file, self._path):
                self._file = file
            else:
                file.close()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._file is not None
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def _try_lock(path: Path) -> IO[str] | None:
    """The lock at ``path``, held, or None while another holds it."""
    file = open(path, "a")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        return None
    if _locked(file, path):
        return file
    file.close()
    return None


def scratch_for(target: Path) -> Path:
    """A fresh build directory for ``target``; the caller holds its TemplateLock, so any
    older one is what a builder that died left."""
    for entry in _entries(target.parent):
        match = SCRATCH.fullmatch(entry.name)
        if match and match[1] == target.name and entry.is_dir(follow_symlinks=False):
            discard(Path(entry.path))
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))


def record_inputs(scratch: Path, inputs: list[Path]) -> None:
    """Name the files a template is made from (for ``sweep``: none gone, it may be used)."""
    (scratch / META).write_text(json.dumps({"inputs": [str(p) for p in inputs]}))


def use(target: Path, sandbox_dir: Path) -> None:
    """Record, under ``target``'s TemplateLock, that the sandbox of ``sandbox_dir`` restores
    from it (and when: the template's time); the sandbox's directory names the template, for
    ``release``."""
    users = target / USERS
    users.mkdir(exist_ok=True)
    try:
        os.symlink(sandbox_dir, users / sandbox_dir.name)
    except FileExistsError:
        pass
    (sandbox_dir / USED_TEMPLATE).write_text(str(target))
    os.utime(target)


def release(sandbox_dir: Path) -> None:
    """The sandbox of ``sandbox_dir``, being destroyed, no longer uses its template: its link
    goes (else the next sweep finds it dangling)."""
    try:
        template = Path((sandbox_dir / USED_TEMPLATE).read_text())
    except FileNotFoundError:
        return
    if TEMPLATE.fullmatch(template.name):
        (template / USERS / sandbox_dir.name).unlink(missing_ok=True)


def sweep(root: Path, now: float, idle_s: float) -> int:
    """Remove the templates under ``root`` that no sandbox uses and that either no create can
    restore (a file named in ``meta.json`` is gone) or none restored for ``idle_s``, what
    dead builders and sweeps left, and lock files of no template; the bytes freed. A template
    locked now (being built or taken into use) is left for the next sweep; a failure is
    logged and the sweep goes on."""
    freed = 0
    try:
        entries = list(_entries(root))
    except OSError as exc:
        log.warning("vm template sweep: %s unreadable: %s", root, exc)
        return 0
    for entry in entries:
        try:
            freed += _sweep_one(root, entry, now, idle_s)
        except OSError as exc:
            log.warning("vm template sweep: %s left: %s", entry.name, exc)
    if freed:
        log.info("vm template sweep freed %d bytes", freed)
    return freed


def _sweep_one(root: Path, entry: os.DirEntry[str], now: float, idle_s: float) -> int:
    kind, key = next(((pattern, m[1]) for pattern in (TEMPLATE, SCRATCH, LOCK)
                      if (m := pattern.fullmatch(entry.name))), (None, ""))
    if kind is None or (kind is not LOCK and not entry.is_dir(follow_symlinks=False)):
        return 0
    lock_path = _lock_path(root, key)
    lock = _try_lock(lock_path)
    if lock is None:
        return 0
    try:
        if kind is LOCK:  # of no template? (none is being built: the lock was free)
            if not (root / key).exists():
                os.unlink(lock_path)
            return 0
        path = Path(entry.path)
        if kind is SCRATCH:  # a dead builder's, or a removal cut short
            return discard(path)
        if _in_use(path) or not _stale(path, now, idle_s):
            return 0
        dead = root / f".{key}.{secrets.token_hex(4)}"
        os.rename(path, dead)  # gone for creates at once, whatever the removal meets
        os.unlink(lock_path)
        return discard(dead)
    finally:
        lock.close()


def _in_use(template: Path) -> bool:
    """Whether a sandbox restores from it: a link in ``users/`` to a directory that still
    exists. Links to directories gone are removed."""
    used = False
    for link in _entries(template / USERS):
        if os.path.isdir(os.readlink(link.path)):
            used = True
        else:
            os.unlink(link.path)
    return used


def _stale(template: Path, now: float, idle_s: float) -> bool:
    if now - os.stat(template).st_mtime > idle_s:
        return True
    try:
        inputs = json.loads((template / META).read_text())["inputs"]
    except (OSError, ValueError, KeyError, TypeError):  # made before meta.json: idle only
        return False
    return isinstance(inputs, list) and not all(isinstance(p, str) and os.path.exists(p)
                                                for p in inputs)


def discard(path: Path) -> int:
    """Remove a template's (or a scratch) directory: its files and ``users/``' links, one
    level down, nothing followed; the bytes it held. Anything else stops the removal."""
    freed = 0
    for entry in _entries(path):
        if entry.name == USERS and entry.is_dir(follow_symlinks=False):
            for link in _entries(Path(entry.path)):
                os.unlink(link.path)
            os.rmdir(entry.path)
        else:
            freed += entry.stat(follow_symlinks=False).st_blocks * 512
            os.unlink(entry.path)
    os.rmdir(path)
    return freed


def _entries(path: Path) -> Iterator[os.DirEntry[str]]:
    """``path``'s entries (none if it is gone)."""
    try:
        with os.scandir(path) as it:
            yield from it
    except FileNotFoundError:
        return


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
    for entry in _entries(scratch):
        if entry.name not in KEPT:
            os.unlink(entry.path)
    os.rename(scratch, target)


async def overlay(template: Path, disk: Path) -> None:
    """A per-sandbox qcow2 disk whose unwritten blocks read from the template's disk."""
    code = await spawn.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b",
                            str(template / "disk.ext4"), "-F", "raw", str(disk)])
    if code != 0:
        raise SandboxError(f"qemu-img could not create the sandbox's disk overlay (exit {code})")
