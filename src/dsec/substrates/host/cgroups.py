"""Host cgroup facts for sandboxes: preparing a hybrid host, finding leftovers, OOM counts.

The OCI runtime creates and removes each sandbox's cgroups (``<parent>/<id>`` in every
hierarchy); dsec only prepares the host, reads counters and sweeps what a crash left.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import time
from pathlib import Path

from ...protocol.errors import NotSupported

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000


@functools.cache
def is_cgroup2_only() -> bool:
    """Whether the host has the unified hierarchy alone: fixed at boot, so asked once (every
    exec reads an OOM count through it)."""
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def prepare_hybrid_host() -> list[str]:
    """On a hybrid (v1 + v2) host, crun refuses to run while the v2 hierarchy holds any
    controller. Bind each such controller to a v1 hierarchy of its own; returns the ones bound.
    """
    unified = CGROUP_ROOT / "unified" / "cgroup.controllers"
    if is_cgroup2_only() or not unified.exists():
        return []
    bound = []
    for controller in unified.read_text().split():
        target = CGROUP_ROOT / controller
        target.mkdir(exist_ok=True)
        done = subprocess.run(["mount", "-t", "cgroup", "-o", controller, "cgroup", str(target)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise NotSupported(
                f"crun cannot run on this hybrid cgroup host: the v2 hierarchy holds "
                f"'{controller}' and binding it to v1 failed ({done.stderr.strip()}); "
                "use runtime='runc' instead")
        bound.append(controller)
    return bound


# A cgroup v1 hierarchy of dsec's own, without controllers, whose only job is its mount option
# (see ``hold_favordynmods``).
FAVOR_HIERARCHY = "dsec-favordynmods"
# fsopen(2), fsconfig(2), fsmount(2): numbered alike on every architecture
_SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 430, 431, 432
_FSOPEN_CLOEXEC = _FSMOUNT_CLOEXEC = 1
_FSCONFIG_SET_FLAG, _FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 0, 1, 6
_MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOUNT_ATTR_NOEXEC = 2, 4, 8
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def hold_favordynmods() -> int:
    """Keep the kernel in its ``favordynmods`` mode while the returned fd is open (blocking:
    the mode waits for an RCU grace period to begin); on a host with cgroup v1 hierarchies.

    Why: moving a task into a v1 cgroup (crun writes ``cgroup.procs`` at every start)
    takes the kernel's thread-group lock for writing, and that lock, idle, waits for an RCU
    grace period first: about 10 ms of each cold create here, half of it (``perf sched``:
    ``synchronize_rcu <- rcu_sync_enter <- cgroup_procs_write_start``, 11 ms in each of 16
    creates). A hierarchy mounted with ``favordynmods`` keeps the lock's readers on their
    slow path instead, so a writer never waits; forks and exits pay a memory barrier more.
    It is a mode of the whole kernel, held for as long as such a hierarchy is mounted: this
    one is a mount attached nowhere (``fsmount``), alive while its fd is open, so the mode
    ends with the server (a crash included) and no mount table shows it. Every server of a
    host mounts the same hierarchy. Raises OSError where the kernel has no such option
    (before 6.0), no new mount API (before 5.2) or no v1 cgroups."""
    context = _syscall(_SYS_FSOPEN, b"cgroup", _FSOPEN_CLOEXEC)
    try:
        _syscall(_SYS_FSCONFIG, context, _FSCONFIG_SET_FLAG, b"none", None, 0)
        _syscall(_SYS_FSCONFIG, context, _FSCONFIG_SET_STRING, b"name",
                 FAVOR_HIERARCHY.encode(), 0)
        _syscall(_SYS_FSCONFIG, context, _FSCONFIG_SET_FLAG, b"favordynmods", None, 0)
        _syscall(_SYS_FSCONFIG, context, _FSCONFIG_CMD_CREATE, None, None, 0)
        return _syscall(_SYS_FSMOUNT, context, _FSMOUNT_CLOEXEC,
                        _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOEXEC)
    finally:
        os.close(context)


def _syscall(*args: int | bytes | None) -> int:
    result = int(_libc.syscall(*args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting cgroup {FAVOR_HIERARCHY} with favordynmods: "
                           f"{os.strerror(err)}")
    return result


def sandbox_cgroups(parent: str) -> dict[str, list[Path]]:
    """Every sandbox cgroup directory under ``parent``, by sandbox id, in all hierarchies."""
    found: dict[str, list[Path]] = {}
    for base in _hierarchies():
        d = base / parent.strip("/")
        if d.is_dir():
            for child in d.iterdir():
                if child.is_dir():
                    found.setdefault(child.name, []).append(child)
    return found


def remove_parent_if_unused(parent: str) -> None:
    """Remove the edge's parent cgroup in every hierarchy once no sandbox is left under it."""
    for base in _hierarchies():
        try:
            (base / parent.strip("/")).rmdir()
        except OSError:  # absent, or sandboxes still live in it
            pass


def _hierarchies() -> list[Path]:
    return [CGROUP_ROOT] if is_cgroup2_only() else [p for p in CGROUP_ROOT.iterdir() if p.is_dir()]


def sandbox_dirs(parent: str, sandbox_id: str) -> list[Path]:
    """One sandbox's cgroup directories, in every hierarchy that has one."""
    return [d for base in _hierarchies() if (d := base / parent.strip("/") / sandbox_id).is_dir()]


def remove_cgroups(dirs: list[Path]) -> None:
    """Kill what is left in each cgroup, then remove it (deepest first)."""
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        for sub in sorted(d.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if sub.is_dir():
                _kill_and_rmdir(sub)
        _kill_and_rmdir(d)


def _kill_and_rmdir(d: Path) -> None:
    procs = d / "cgroup.procs"
    _thaw_dir(d)  # a frozen task does not die of SIGKILL until thawed (cgroup v1)
    for _ in range(50):
        try:
            pids = [int(p) for p in procs.read_text().split()]
        except FileNotFoundError:
            return
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # still emptying
            time.sleep(0.02)


def kill_all(parent: str, sandbox_id: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process of the sandbox and wait until its cgroups are empty, keeping
    the cgroups (a restart in them skips removing and making a dozen v1 cgroups, ~10 ms each
    here). Frozen while the kills are sent, so no fork escapes them."""
    set_frozen(parent, sandbox_id, True)
    procs = freezer_file(parent, sandbox_id).parent / "cgroup.procs"
    try:
        for pid in procs.read_text().split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
    finally:
        set_frozen(parent, sandbox_id, False)
    deadline = time.monotonic() + timeout_s
    while procs.read_text().strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"sandbox {sandbox_id}'s processes did not die in {timeout_s:.0f}s")
        time.sleep(0.001)


# The kernel counts ``oom`` (the cgroup hit its limit and the OOM killer ran) before it sends
# the kill, and ``oom_kill`` only after: a reader woken by the victim's death can still see
# ``oom_kill 0``. Counting whichever is larger closes that race; cgroup v1 has no early count.
OOM_KEYS = {"memory.events": ("oom_kill", "oom"), "memory.oom_control": ("oom_kill",)}


def oom_count(text: str, keys: tuple[str, ...]) -> int:
    """The OOM kills a cgroup's events file reports, counting one the kernel is still making."""
    counts = dict(line.partition(" ")[::2] for line in text.splitlines())
    return max((int(counts[key]) for key in keys if key in counts), default=0)


def oom_kills(parent: str, sandbox_id: str) -> int:
    """How many processes the kernel's OOM killer ended in this sandbox's memory cgroup.
    Read twice per exec, so with one ``read`` of the small file rather than a text file
    object (a third of the cost)."""
    hierarchy, name = ("", "memory.events") if is_cgroup2_only() else ("memory/", "memory.oom_control")
    path = f"{CGROUP_ROOT}/{hierarchy}{parent.strip('/')}/{sandbox_id}/{name}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 4096).decode()
        finally:
            os.close(fd)
    except OSError:  # gone, or being removed (ENODEV on cgroup v1)
        return 0
    return oom_count(text, OOM_KEYS[name])


def set_limits(parent: str, sandbox_id: str, cpu: float, memory_bytes: int, pids: int) -> None:
    """Change a running sandbox's limits in place (what ``crun update`` does, without a fork)."""
    rel = f"{parent.strip('/')}/{sandbox_id}"
    quota = int(cpu * CPU_PERIOD_US)
    if is_cgroup2_only():
        writes = {f"{rel}/cpu.max": f"{quota} {CPU_PERIOD_US}", f"{rel}/memory.max": str(memory_bytes),
                  f"{rel}/pids.max": str(pids)}
    else:
        writes = {f"cpu/{rel}/cpu.cfs_quota_us": str(quota),
                  f"memory/{rel}/memory.limit_in_bytes": str(memory_bytes),
                  f"pids/{rel}/pids.max": str(pids)}
    for path, value in writes.items():
        (CGROUP_ROOT / path).write_text(value)


def create_for_process(parent: str, sandbox_id: str, pid: int) -> None:
    """Create the sandbox's cgroups (cpu, memory, pids, freezer) and move ``pid`` into them: for
    substrates whose process no OCI runtime places (a VM's QEMU)."""
    if is_cgroup2_only():
        for d in (CGROUP_ROOT, CGROUP_ROOT / parent.strip("/")):
            d.mkdir(exist_ok=True)
            (d / "cgroup.subtree_control").write_text("+cpu +memory +pids")
        dirs = [CGROUP_ROOT / parent.strip("/") / sandbox_id]
    else:
        dirs = [CGROUP_ROOT / c / parent.strip("/") / sandbox_id
                for c in ("cpu", "memory", "pids", "freezer")]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text(str(pid))


FREEZE_TIMEOUT_S = 10.0
FREEZE_KICK_S = 0.1


def freezer_file(parent: str, sandbox_id: str) -> Path:
    """The file that freezes a sandbox's cgroup: ``cgroup.freeze`` on cgroup v2, the v1
    freezer hierarchy's ``freezer.state`` on a hybrid host (its v2 tree holds no sandbox)."""
    rel = f"{parent.strip('/')}/{sandbox_id}"
    if is_cgroup2_only():
        return CGROUP_ROOT / rel / "cgroup.freeze"
    return CGROUP_ROOT / "freezer" / rel / "freezer.state"


def set_frozen(parent: str, sandbox_id: str, frozen: bool) -> None:
    """Freeze (or thaw) every process of the sandbox's cgroup and wait until the kernel says
    it is done: a frozen task runs no instruction, so a fork racing the freeze lands in the
    same cgroup and is frozen too. Idempotent. NotSupported when the sandbox has no freezer
    cgroup (``FileNotFoundError`` is left to the caller for a sandbox whose cgroup is gone)."""
    path = freezer_file(parent, sandbox_id)
    if not path.parent.is_dir():
        raise FileNotFoundError(path.parent)
    if not path.exists():
        raise NotSupported(f"sandbox {sandbox_id} has no freezer cgroup ({path} is missing)")
    v2 = path.name == "cgroup.freeze"
    state = ("1" if frozen else "0") if v2 else ("FROZEN" if frozen else "THAWED")
    path.write_text(state)
    started = time.monotonic()
    kicked = started
    while not _settled(path, frozen):
        now = time.monotonic()
        if not v2 and frozen and now - kicked > FREEZE_KICK_S:
            # v1 freezes a task by waking it once; one that missed the wake (busy forking,
            # or stopped under gVisor's ptrace platform) leaves the cgroup FREEZING until
            # FROZEN is written again
            path.write_text(state)
            kicked = now
        if now - started > FREEZE_TIMEOUT_S:
            if frozen:  # never leave it half frozen
                path.write_text("0" if v2 else "THAWED")
            raise TimeoutError(f"{path} did not settle {'frozen' if frozen else 'thawed'} "
                               f"within {FREEZE_TIMEOUT_S:.0f}s")
        time.sleep(0.001)


def _settled(path: Path, frozen: bool) -> bool:
    if path.name == "cgroup.freeze":  # v2: cgroup.events says when every task is frozen
        events = dict(line.partition(" ")[::2] for line in
                      (path.parent / "cgroup.events").read_text().splitlines())
        return events.get("frozen") == ("1" if frozen else "0")
    return path.read_text().strip() == ("FROZEN" if frozen else "THAWED")  # v1: FREEZING between


def is_frozen(parent: str, sandbox_id: str) -> bool:
    """Whether the sandbox's cgroup is frozen or freezing (False when it has no freezer)."""
    path = freezer_file(parent, sandbox_id)
    try:
        text = path.read_text().strip()
    except OSError:
        return False
    return text == "1" if path.name == "cgroup.freeze" else text != "THAWED"


def _thaw_dir(d: Path) -> None:
    for name, thawed in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
        try:
            (d / name).write_text(thawed)
        except OSError:  # not a freezer cgroup, or gone
            pass


def thaw_if_frozen(parent: str, sandbox_id: str) -> None:
    """Before killing a sandbox: on cgroup v1 a frozen task does not die of SIGKILL until
    it is thawed (and ``crun delete --force`` would wait on it)."""
    if is_frozen(parent, sandbox_id):
        set_frozen(parent, sandbox_id, False)
