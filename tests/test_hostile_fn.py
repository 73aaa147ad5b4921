"""Hostile fn calls, run_code programs and fn sandboxes (issue 12): written as an RL agent that
wants the host, the trainer's process or its own reward would write them. Each asserts what
the attacker gets (nothing), that the host, the template, a bystander and later calls are
unaffected, and that nothing leaks.

The attacks are module-level functions: a call ships them by value, and ``as_program`` turns
one into a python program for ``run_code`` and fn sandboxes, so every channel gets the same
attack. They return plain data: what they reached.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

import dsec
from conftest import Server, make_server, stop_server, warm_count
from test_fn import _edge_cgroups, _fn_pids
from test_hostile import create, hostile  # noqa: F401  (fixture)

IMAGE = "python-3.11"


def as_program(attack: Callable[..., Any], *args: Any) -> str:
    """The attack as a python program that prints its findings as JSON."""
    return (f"from __future__ import annotations\n{inspect.getsource(attack)}\n"
            f"import json\nprint(json.dumps({attack.__name__}(*{args!r})))\n")


async def in_sandbox(sb: dsec.AsyncSandbox, attack: Callable[..., Any], *args: Any) -> Any:
    await sb.write_file("/work/attack.py", as_program(attack, *args).encode())
    r = await sb.run(["python3", "/work/attack.py"], timeout_s=120)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


async def in_run_code(client: dsec.DSecClient, attack: Callable[..., Any], *args: Any) -> Any:
    r = await client.run_code("python", as_program(attack, *args), timeout_s=60)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


# --- item 1, 8, 9: /proc, /sys, io_uring ---------------------------------------------------

def proc_attack(swappiness: str) -> dict[str, Any]:
    """Write host-global kernel settings, read the host kernel's tables, set up io_uring."""
    import ctypes
    import errno
    import os

    def write(path: str, data: str) -> str:
        try:
            with open(path, "w") as f:
                f.write(data)
            return "written"
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc.errno))

    def current(path: str) -> str:
        try:
            return open(path).read()
        except OSError:
            return "0"

    def read(path: str) -> int | str:
        try:
            with open(path, "rb") as f:
                return len(f.read(1 << 16))
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc.errno))

    found: dict[str, Any] = {
        "core_pattern": write("/proc/sys/kernel/core_pattern", current("/proc/sys/kernel/core_pattern")),
        "swappiness": write("/proc/sys/vm/swappiness", swappiness),
        "sysrq_trigger": write("/proc/sysrq-trigger", "h"),  # h: help, harmless if it went through
        "sysrq": write("/proc/sys/kernel/sysrq", current("/proc/sys/kernel/sysrq")),
        "irq": write("/proc/irq/default_smp_affinity", current("/proc/irq/default_smp_affinity")),
    }
    found["masked"] = {name: read(f"/proc/{name}") for name in (
        "kpagecgroup", "kpageflags", "kpagecount", "slabinfo", "vmallocinfo", "kcore",
        "timer_list", "sched_debug", "pagetypeinfo", "keys")}
    found["sys_firmware"] = os.listdir("/sys/firmware") if os.path.isdir("/sys/firmware") else []
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = ctypes.create_string_buffer(120)
    rc = libc.syscall(425, 8, params)  # io_uring_setup
    found["io_uring_setup"] = errno.errorcode[ctypes.get_errno()] if rc < 0 else "allowed"
    # the read-only /proc/sys is a mount: taking it off or remounting it must fail too
    found["umount_proc_sys"] = libc.umount2(b"/proc/sys", 2)
    found["remount_proc_sys"] = libc.mount(None, b"/proc/sys", None, 32 | 4096, None)
    return found


WRITTEN = {"core_pattern": "/proc/sys/kernel/core_pattern", "swappiness": "/proc/sys/vm/swappiness",
           "sysrq_trigger": "/proc/sysrq-trigger", "sysrq": "/proc/sys/kernel/sysrq",
           "irq": "/proc/irq/default_smp_affinity"}


def _assert_proc_contained(found: dict[str, Any]) -> None:
    for key, path in WRITTEN.items():  # (a kernel built without sysrq has neither file)
        refused = {"EROFS", "EACCES", "EPERM"} | (set() if Path(path).exists() else {"ENOENT"})
        assert found[key] in refused, (key, found[key])
    assert all(v in (0, "ENOENT", "EACCES", "EPERM") for v in found["masked"].values()), found["masked"]
    assert found["sys_firmware"] == []
    assert found["io_uring_setup"] in ("EPERM", "ENOSYS")
    assert found["umount_proc_sys"] == -1 and found["remount_proc_sys"] == -1


@pytest.fixture
def host_settings() -> Any:
    """The host's values before the attack; after it, unchanged (restored if not, and failed)."""
    before = {Path(p): Path(p).read_text() for p in WRITTEN.values() if Path(p).is_file()
              and "sysrq-trigger" not in p}
    yield before
    changed = {str(p): (v, p.read_text()) for p, v in before.items() if p.read_text() != v}
    for p, v in before.items():
        if p.read_text() != v:
            p.write_text(v)
    assert not changed, f"the host's settings were changed: {changed}"


def _other_swappiness(before: dict[Path, str]) -> str:
    value = int(before[Path("/proc/sys/vm/swappiness")])
    return str(value + 1 if value < 100 else value - 1)  # a change would show on the host


async def test_call_cannot_write_host_proc_or_read_kernel_tables(client: dsec.DSecClient, host_settings) -> None:
    _assert_proc_contained(await client.call(proc_attack, _other_swappiness(host_settings)))


async def test_run_code_cannot_write_host_proc_or_read_kernel_tables(client: dsec.DSecClient, host_settings) -> None:
    _assert_proc_contained(await in_run_code(client, proc_attack, _other_swappiness(host_settings)))


async def test_fn_sandbox_cannot_write_host_proc_or_read_kernel_tables(client: dsec.DSecClient, hostile,  # noqa: F811
                                                                        host_settings) -> None:
    sb = await create(client, hostile, substrate="fn", image=IMAGE)
    _assert_proc_contained(await in_sandbox(sb, proc_attack, _other_swappiness(host_settings)))
    r = await sb.run("echo 1 > /proc/sys/vm/drop_caches; echo h > /proc/sysrq-trigger; echo done")
    assert r.stdout == "done\n" and "Read-only file system" in r.stderr


# --- item 2: the result channel ------------------------------------------------------------

def channel_attack(marker: str, forged: bytes, own_fds: bool) -> dict[str, Any]:
    """Write a forged reply frame wherever the result might travel: every fd (``own_fds``),
    /proc/self/fd, the parent's and pid 1's fds, fds taken with pidfd_getfd, pid 1's memory,
    and ptrace. What it reached (nothing, if contained)."""
    import ctypes
    import errno
    import os
    import signal

    reached: dict[str, Any] = {}
    if own_fds:
        for fd in range(256):
            try:
                os.write(fd, forged)
                reached[f"fd {fd}"] = "written"
            except OSError:
                pass
    dirs = ["/proc/1/fd", f"/proc/{os.getppid()}/fd"] + (["/proc/self/fd"] if own_fds else [])
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError as exc:
            reached[d] = errno.errorcode.get(exc.errno or 0)
            continue
        for name in names:
            try:
                with open(f"{d}/{name}", "wb") as f:
                    f.write(forged)
                reached[f"{d}/{name}"] = "written"
            except OSError:
                pass
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    for pid in {1, os.getppid()} - {os.getpid()}:
        pidfd = libc.syscall(434, pid, 0)  # pidfd_open
        for fd in range(64):
            got = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
            if got >= 0:
                reached[f"pidfd_getfd {pid}/{fd}"] = "taken"
                try:
                    os.write(got, forged)
                except OSError:
                    pass
        if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
            reached[f"ptrace {pid}"] = "attached"
        try:
            with open(f"/proc/{pid}/mem", "r+b"):
                reached[f"mem {pid}"] = "opened"
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)  # pid 1 ignores it from inside; the parent is pid 1
        except OSError:
            pass
    reached["marker"] = os.path.exists(marker)  # the client's file system is not here
    return reached


class Marker:
    """A value whose unpickling creates a file in the client's file system."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os
        return (os.system, (f"touch {self.path}",))


def _forged_reply(marker: Path) -> bytes:
    import pickle
    import struct
    payload = b"O" + pickle.dumps(Marker(str(marker)))
    return struct.pack(">I", len(payload)) + payload


async def test_a_call_cannot_reach_its_reply_channel_or_run_code_in_the_client(
        client: dsec.DSecClient, tmp_path: Path) -> None:
    marker = tmp_path / "ran-in-the-client"
    forged = _forged_reply(marker)
    reached = await client.call(channel_attack, str(marker), forged, False)
    assert reached["marker"] is False
    assert not [k for k, v in reached.items() if v in ("written", "taken", "attached", "opened")], reached
    # writing everywhere, its own pipe included: what it wrote is at most its own result,
    # which the client decodes as plain data (or a typed error), never by running it
    with pytest.raises((dsec.RemoteError, dsec.ResultRefused)):
        await client.call(channel_attack, str(marker), forged, True)
    assert not marker.exists()
    assert await client.call(lambda: "next") == "next"


async def test_a_hostile_result_never_runs_in_the_client(client: dsec.DSecClient, tmp_path: Path) -> None:
    marker = tmp_path / "ran-in-the-client"

    def returns_marker(path: str) -> Marker:
        return Marker(path)

    def exits_after_writing_its_own_pipe(path: str) -> None:
        import os
        import pickle
        import struct
        reply = b"O" + pickle.dumps(Marker(path))
        payload = struct.pack(">Q", len(reply)) + reply  # framed as the worker expects it
        for fd in range(3, 64):
            try:
                os.write(fd, payload)
            except OSError:
                pass
        os._exit(0)

    def raises_hostile_exception(path: str) -> None:
        class Hostile(Exception):
            def __reduce__(self):  # type: ignore[no-untyped-def]
                import os
                return (os.system, (f"touch {path}",))

            def __str__(self) -> str:
                raise RuntimeError("no message for you")
        raise Hostile()

    with pytest.raises(dsec.ResultRefused):
        await client.call(returns_marker, str(marker))
    with pytest.raises(dsec.ResultRefused):
        await client.call(exits_after_writing_its_own_pipe, str(marker))
    results = await client.map(returns_marker, [str(marker)] * 3, return_exceptions=True)
    assert all(isinstance(r, dsec.ResultRefused) for r in results)
    with pytest.raises(dsec.RemoteError) as info:
        await client.call(raises_hostile_exception, str(marker))
    assert isinstance(info.value.traceback, str)
    assert not marker.exists()
    # the caller who trusts the code in the call may still opt in to full pickles
    made = await client.call(lambda: __import__("fractions").Fraction(1, 3), trusted_result=True)
    assert str(made) == "1/3"


async def test_a_forged_error_reply_is_plain_and_typed(client: dsec.DSecClient) -> None:
    def forges_error(framed: bool) -> None:
        import os
        import struct
        reply = b'E{"type": 1, "message": ["x"], "traceback": {"a": 2}}'
        for fd in range(3, 64):
            try:
                os.write(fd, struct.pack(">Q", len(reply)) + reply if framed else reply)
            except OSError:
                pass
        os._exit(0)

    def huge_message() -> None:
        raise ValueError("x" * (8 << 20))

    with pytest.raises(dsec.RemoteError) as info:
        await client.call(forges_error, True)  # framed as the worker expects: its fields are not
    assert info.value.remote_type == ""
    with pytest.raises(dsec.RemoteError) as info:
        await client.call(forges_error, False)  # not even framed
    assert info.value.remote_type == "dsec.MalformedReply"
    with pytest.raises(dsec.RemoteError) as info:
        await client.call(huge_message)
    assert len(info.value.message) < 128 << 10


def verdict_attack(expected: str) -> dict[str, Any]:
    """In a run_code program: forge the worker's reply (exit 0, the expected stdout) on every
    fd it can find, then exit 3."""
    import json
    import os
    import struct
    body = b"J" + json.dumps({"exit_code": 0, "signal": 0, "stdout": expected, "stderr": "",
                              "timed_out": False, "duration_ms": 1}).encode()
    forged = struct.pack(">I", len(body)) + body
    found = channel_attack("/nonexistent", forged, True)
    if os.fork() == 0:  # and a child that tries again once its parent has exited
        import time
        time.sleep(0.2)
        channel_attack("/nonexistent", forged, True)
        os._exit(0)
    print(expected, flush=True)
    os._exit(3)
    return found


async def test_run_code_cannot_forge_its_verdict(client: dsec.DSecClient) -> None:
    program = (f"from __future__ import annotations\n{inspect.getsource(channel_attack)}\n"
               f"{inspect.getsource(verdict_attack)}\nverdict_attack('ALL TESTS PASSED')\n")
    r = await client.run_code("python", program, timeout_s=30)
    assert r.exit_code == 3 and not r.ok
    r = await client.run_code("bash", (
        "for f in /proc/1/fd/* /proc/$PPID/fd/* /proc/self/fd/*; do "
        "printf '\\0\\0\\0\\x10J{\"exit_code\":0}' > $f; done 2>/dev/null\n"
        "kill -9 1 $PPID 2>/dev/null\necho 'ALL TESTS PASSED'\nexit 3\n"))
    assert (r.exit_code, r.ok) == (3, False)


# --- items 3 and 4: the template, its pool, the run dir, the host's disk ---------------------

def litter(depth: int, files: int) -> dict[str, Any]:
    """Leave what a clean-up might trip over, where it might look: a directory, a deep tree,
    many files, fifos, symlinks out, in the run dir, /tmp, /work and /dev/shm; fill the run dir;
    and leave a process behind. How far it got in each place."""
    import errno
    import os
    import subprocess

    def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
        try:
            fn(*args, **kwargs)
            return "ok"
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc.errno))

    found: dict[str, Any] = {}
    for base in ("/.dsec/run", "/tmp", "/work", "/dev/shm"):
        if not os.access(base, os.W_OK):
            found[base] = "not writable"
            continue
        found[f"{base} dir"] = attempt(os.makedirs, f"{base}/agent.sock/x", exist_ok=True)
        found[f"{base} fifo"] = attempt(os.mkfifo, f"{base}/fifo")
        found[f"{base} link"] = attempt(os.symlink, "/", f"{base}/root")
        made = 0
        fd = os.open(base, os.O_DIRECTORY)
        try:  # deeper than PATH_MAX, one directory at a time
            for _ in range(depth):
                os.mkdir("d", dir_fd=fd)
                inner = os.open("d", os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = inner
                made += 1
        except OSError:
            pass
        os.close(fd)
        found[f"{base} depth"] = made
        made = 0
        try:
            for i in range(files):
                open(f"{base}/f{i}", "w").close()
                made += 1
        except OSError:
            pass
        found[f"{base} files"] = made
    written = 0
    try:  # fill the run dir, as `yes > file` would
        with open("/.dsec/run/fill", "wb") as f:
            while written < 64 << 20:
                written += f.write(b"y" * 65536)
                f.flush()
    except OSError:
        pass
    found["run dir bytes"] = written
    subprocess.Popen(["sleep", "600"], start_new_session=True)  # left running
    return found


def writable_mounts() -> dict[str, str]:
    """Every mount this process can create a file in, and its file system type."""
    import os
    writable = {}
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        point, fstype = fields[4], fields[fields.index("-") + 1]
        if not os.path.isdir(point) or point.startswith("/proc/"):
            continue
        probe = os.path.join(point, ".dsec-write-probe")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError:
            continue
        os.unlink(probe)
        writable[point] = fstype
    return writable


def _assert_littered(found: dict[str, Any]) -> None:
    assert found["run dir bytes"] <= 64 << 10  # a 64 KiB tmpfs of its own, not the host's disk
    assert found["/.dsec/run files"] <= 16


def _assert_only_tmpfs(mounts: dict[str, str]) -> None:
    assert mounts and set(mounts.values()) == {"tmpfs"}, mounts
    assert {"/tmp", "/work", "/dev/shm", "/.dsec/run"} >= set(mounts), mounts


async def test_no_writable_path_reaches_the_host_disk(client: dsec.DSecClient, hostile) -> None:  # noqa: F811
    _assert_only_tmpfs(await client.call(writable_mounts))
    _assert_only_tmpfs(await in_run_code(client, writable_mounts))
    sb = await create(client, hostile, substrate="fn", image=IMAGE)
    _assert_only_tmpfs(await in_sandbox(sb, writable_mounts))
    r = await sb.run("yes > /.dsec/run/fill; du -k /.dsec/run/fill | cut -f1", timeout_s=60)
    assert int(r.stdout) <= 64 and "No space left" in r.stderr


def _templates(edge: str) -> set[int]:
    """The template processes (a worker being born is in the template's cgroup for a moment)."""
    pids = set(_fn_pids(edge, template_only=True))
    return {pid for pid in pids if _ppid(pid) not in pids}


def _ppid(pid: int) -> int:
    stat = _read(Path(f"/proc/{pid}/stat"))
    return int(stat.rpartition(")")[2].split()[1]) if ")" in stat else 0


def _worker_cgroups(edge: str) -> list[Path]:
    return [d for base in _edge_cgroups(edge) for key in base.iterdir() if key.is_dir()
            for d in key.iterdir() if d.is_dir() and d.name != "template"]


async def _assert_fn_settles(client: dsec.DSecClient, server: Server, edge: str,
                             live_sandboxes: int, pool_size: int = 8) -> None:
    """Nothing of ended workers is left: each worker cgroup still has its worker, no more of
    them than the pool, the live fn sandboxes and the warm ones, no process but workers (and
    their call processes) and agents, and no run dirs on the host."""
    deadline = time.monotonic() + 30
    while True:
        allowed = pool_size + live_sandboxes + await warm_count(client, "fn", IMAGE)
        cgroups = _worker_cgroups(edge)
        procs = {d.name: [_read(Path(f"/proc/{pid}/cmdline")).replace("\0", " ")
                          for pid in _read(d / "cgroup.procs").split()] for d in cgroups}
        empty = [name for name, cmds in procs.items() if not cmds]
        strays = [cmd for cmds in procs.values() for cmd in cmds
                  if cmd and not cmd.startswith(("/usr/bin/python3 -I /.dsec/fn/template.py", "/.dsec/agent "))]
        run_dirs = list((server.state_dir / "fn").glob("run/*/*"))
        if not empty and not strays and len(procs) <= allowed and not run_dirs:
            return
        assert time.monotonic() < deadline, f"left behind: empty cgroups {empty}, " \
            f"stray processes {strays}, {len(procs)} worker cgroups, run dirs {run_dirs}"
        await asyncio.sleep(0.2)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:  # the worker ended meanwhile
        return "gone"
    except OSError as exc:  # its cgroup was removed between listing and reading it
        if exc.errno != errno.ENODEV:
            raise
        return "gone"


@pytest.fixture
async def own_server(images) -> AsyncIterator[Server]:  # type: ignore[no-untyped-def]
    """A server of its own: the test restarts it, and watches its templates."""
    srv = make_server().start()
    try:
        yield srv
    finally:
        stop_server(srv)


async def test_litter_never_hurts_the_template_a_bystander_or_later_calls(own_server: Server) -> None:
    srv = own_server
    async with srv.client() as client:
        edge = (await client.health())["edges"][0]["id"]
        bystander = await client.create(substrate="fn", image=IMAGE, ttl_s=300)
        templates = _templates(edge)
        assert templates
        for depth, files in ((3000, 20000), (10, 100)):
            found = await client.call(litter, depth, files, timeout_s=120)
            _assert_littered(found)
            assert (found["/tmp depth"], found["/tmp files"], found["/tmp fifo"]) == (depth, files, "ok")
        results = await client.map(lambda depth: litter(depth, 300), [200] * 6, concurrency=3,
                                   timeout_s=120)
        for found in results:
            _assert_littered(found)
        littering = await client.create(substrate="fn", image=IMAGE, ttl_s=300)
        _assert_littered(await in_sandbox(littering, litter, 3000, 5000))
        await littering.stop()
        assert _templates(edge) == templates, "the template died"
        assert (await bystander.run("echo still here")).stdout == "still here\n"
        assert await client.map(lambda x: x + 1, range(10)) == list(range(1, 11))
        await _assert_fn_settles(client, srv, edge, live_sandboxes=1)
        await bystander.stop()
        await _assert_fn_settles(client, srv, edge, live_sandboxes=0)
    srv.kill(signal.SIGTERM)  # the server still stops clean and restarts
    assert not _edge_cgroups(edge)
    srv.start()
    async with srv.client() as client:
        assert await client.call(lambda: "restarted") == "restarted"


async def test_a_template_that_dies_anyway_is_replaced_and_leaks_nothing(own_server: Server) -> None:
    srv = own_server
    async with srv.client() as client:
        edge = (await client.health())["edges"][0]["id"]
        # the first call of a cold template runs inside its worker's limits (cgroups), not
        # the template's: a process the worker forks before it was placed would not be
        cgroups = await client.call(lambda: Path("/proc/self/cgroup").read_text().splitlines())
        limited = [line for line in cgroups if any(c in line for c in ("memory", "pids", "0::"))]
        assert limited and all(not line.endswith("/template") for line in limited), cgroups
        await _assert_fn_settles(client, srv, edge, live_sandboxes=0)
        before = {d.name for d in _worker_cgroups(edge)}
        templates = _templates(edge)
        for pid in templates:
            os.kill(pid, signal.SIGKILL)
        while _templates(edge) & templates:
            await asyncio.sleep(0.05)  # a call racing the death may get SandboxDied; not this one
        assert await client.call(lambda: "replaced") == "replaced"
        deadline = time.monotonic() + 30
        while before & {d.name for d in _worker_cgroups(edge)}:
            assert time.monotonic() < deadline, "the dead template's worker cgroups leaked"
            await asyncio.sleep(0.2)
        await _assert_fn_settles(client, srv, edge, live_sandboxes=0)
        with srv.http(authenticated=True) as http:
            assert f'dsec_fn_template_deaths_total{{edge="{edge}"}} 1.0' in http.get("/metrics").text
    log = (Path("/tmp/dsec-test-logs") / f"{srv.state_dir.name}.log").read_text()
    assert "fn template" in log and "exited" in log


async def test_run_code_that_leaves_a_daemon_holding_its_output_still_gets_a_verdict(
        client: dsec.DSecClient) -> None:
    """A program whose child leaves its session and keeps stdout open: the time-out ends it
    (and the program) and the result is a verdict, not a hung call."""
    program = ("import os, time\n"
               "if os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
               "print('ALL TESTS PASSED', flush=True)\ntime.sleep(600)\n")
    r = await client.run_code("python", program, timeout_s=2)
    assert r.timed_out and not r.ok and r.stdout == "ALL TESTS PASSED\n"


async def test_an_fn_sandbox_pointing_its_agent_socket_at_a_host_socket_gets_nothing(
        client: dsec.DSecClient, hostile, tmp_path: Path) -> None:  # noqa: F811
    """The server reaches an fn sandbox's agent through /proc/<pid>/root, where an absolute
    symlink would resolve in the server's own root: the sandbox swaps its socket for a link to
    a host socket. The server opens the socket file without following links, so it never
    connects there: the host listener sees no connection and no byte."""
    import socket
    host_socket = tmp_path / "host.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(host_socket))
    listener.listen(16)
    listener.setblocking(False)
    try:
        sb = await create(client, hostile, substrate="fn", image=IMAGE)
        r = await sb.run(f"rm /.dsec/run/agent.sock && ln -s {host_socket} /.dsec/run/agent.sock && echo swapped")
        assert r.stdout == "swapped\n"
        with pytest.raises(dsec.DSecError):
            await sb.run("echo again")
        received, connections = b"", 0
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                break
            connections += 1
            conn.settimeout(5)
            with conn:
                while chunk := conn.recv(4096):
                    received += chunk
        assert (connections, received) == (0, b"")
    finally:
        listener.close()
