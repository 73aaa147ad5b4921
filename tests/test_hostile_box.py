"""Hostile containers against dsec's own files and execution path (issue 12, items 4, 5, 7, 8
and 9): what a sandbox writes stays in its quota, no tree it makes breaks clean-up or start-up,
and replacing the image's shell and tools forges no result.

Written as an RL agent trying to cheat would: it fills dsec's run dir, leaves trees no
recursive walker survives, swaps /bin/sh for a program that says "ALL TESTS PASSED", and tries
to change dsec's own tools at /.dsec/bin. Each test checks what the attacker got (nothing),
that the host and the server are unaffected, and that nothing is left.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

import dsec
from conftest import Server, make_server, stop_server
from dsec.substrates.host.oci_spec import MASKED_PATHS
from dsec.substrates.host.tree import remove_tree
from support.disks import bundle_with_mounts
from test_hostile import assert_host_fine, assert_no_trace, create, hostile, sandbox  # noqa: F401
from test_recovery import first_edge_id, host_traces, settled

RUNTIMES = ["crun", "runsc"]
FAKE = "#!/usr/bin/python3.11 -S\nprint('ALL TESTS PASSED')\n"
# The image's programs an agent replaces to forge its verdict; /usr/bin/python3.11 stays real
# so that the fakes (python scripts) can run.
FORGED = ("/usr/bin/sh", "/usr/bin/dash", "/usr/bin/bash", "/usr/bin/python3", "/usr/bin/tar",
          "/usr/bin/busybox", "/usr/bin/mv", "/usr/bin/env")

# Trees no recursive walker survives, and names no text-minded one expects (run in the
# sandbox's Python, standard library only).
MAKE_TREES = r"""
import os, sys

def chain(top, depth):
    os.mkdir(top)
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = below
    os.close(fd)

for arg in sys.argv[1:]:
    top, files = arg.rsplit(":", 1)
    os.makedirs(top, exist_ok=True)
    chain(top + "/deep1500", 1500)
    chain(top + "/deep5000", 5000)
    os.mkdir(top + "/new\nline")
    open(top + "/new\nline/f", "w").close()
    bad = os.fsencode(top) + b"/bad\xff\xfe"
    os.mkdir(bad)
    open(bad + b"/" + b"n" * 255, "w").close()
    os.mkdir(top + "/many")
    for i in range(int(files)):
        open(f"{top}/many/{i}", "w").close()
    os.symlink("/", top + "/root-link")
    os.symlink("/proc/self/root/etc", top + "/etc-link")
print("made")
"""


async def make_trees(sb: dsec.AsyncSandbox, *places: str) -> None:
    """``places`` as ``DIR:FILES``: the trees, and that many files, under each DIR."""
    r = await sb.run(["python3.11", "-c", MAKE_TREES, *places], timeout_s=300)
    assert r.stdout == "made\n", r.stderr


def host_usage(path: Path) -> tuple[int, int]:
    """(free bytes, free inodes) of the file system holding ``path``."""
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize, fs.f_favail


# --- item 4: the run dir is in the sandbox's quota -----------------------------------------

@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_filling_the_run_dir_hits_the_sandboxs_quota(client, server, sandbox, hostile,
                                                          runtime: str) -> None:
    sb = await create(client, hostile, image="python-3.11", disk_mb=16, runtime=runtime)
    run_dir = bundle_with_mounts(server, sb.id) / "disk" / "run"
    assert os.stat(run_dir).st_dev != os.stat(run_dir.parent.parent).st_dev  # on its own disk
    free_before, inodes_before = host_usage(server.state_dir)
    r = await sb.run("yes > /.dsec/run/fill", timeout_s=120)
    assert r.exit_code != 0 and "No space left on device" in r.stderr
    r = await sb.run("mkdir /.dsec/run/many && cd /.dsec/run/many && i=0; "
                     "while [ $i -lt 20000 ]; do echo -n > f$i || exit 9; i=$((i+1)); done",
                     timeout_s=300)
    assert r.exit_code == 9 and "No space left on device" in r.stderr
    # Seen from the host: all of it is on the sandbox's disk, within its size.
    assert (run_dir / "fill").stat().st_size <= 16 << 20
    assert len(os.listdir(run_dir / "many")) < 20000
    free_after, inodes_after = host_usage(server.state_dir)
    # The host paid at most the sandbox's disk (a sparse file), and not one inode per file:
    # other tests share this disk, so the bounds leave them room, far below what was written.
    assert free_before - free_after < 100 << 20
    assert inodes_before - inodes_after < 2000
    assert (await sb.run("echo still answering")).stdout == "still answering\n"  # its socket
    await assert_host_fine(sandbox)


# --- item 5: trees a sandbox makes --------------------------------------------------------

async def test_hostile_trees_everywhere_then_stop(client, server, sandbox, hostile) -> None:
    """1,500- and 5,000-deep chains, newline and non-UTF-8 names, 20,000 files and links out,
    in dsec's run dir and /work (and /tmp, /dev/shm): stop answers, nothing is left."""
    sb = await create(client, hostile, image="python-3.11")
    await make_trees(sb, "/.dsec/run/t:20000", "/work/t:5000", "/tmp/t:1000", "/dev/shm/t:1000")
    assert (await sb.run("echo alive")).stdout == "alive\n"
    started = time.monotonic()
    await sb.stop()
    assert time.monotonic() - started < 60  # clean-up is an unmount, not a walk
    await assert_no_trace(server, sb.id)
    await assert_host_fine(sandbox)


@pytest.fixture
def own_server(images) -> Server:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "8").start()
    yield srv
    stop_server(srv)


def _kill_init(server: Server, sandbox_id: str) -> None:
    pid = int((server.volume / "sandboxes" / sandbox_id / "pid").read_text())
    os.kill(pid, signal.SIGKILL)


async def test_restart_with_hostile_trees_and_unremovable_leftovers(own_server: Server) -> None:
    """Killed with -9 while a sandbox holds hostile trees, another sandbox dies while the
    server is down, an older layout left a deep tree on the host, and one leftover cannot be
    removed at all: the server starts, adopts the live one, cleans the rest, and says what it
    could not remove."""
    edge_id = first_edge_id(own_server)
    root = own_server.volume / "sandboxes"
    async with own_server.client() as client:
        live = await client.create(image="python-3.11", ttl_s=600)
        dead = await client.create(image="python-3.11", ttl_s=600)
        for sb in (live, dead):
            await make_trees(sb, "/.dsec/run/t:5000", "/work/t:1000")
    own_server.kill(signal.SIGKILL)
    _kill_init(own_server, dead.id)
    old = root / f"sb-{edge_id}-01d1ay0u7000"  # a run dir on the host, as dsec once had
    fd = os.open(_mkdirs(old / "run"), os.O_RDONLY)
    for _ in range(3000):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = below
    os.close(fd)
    stuck = root / f"sb-{edge_id}-57ucc0000000"
    _mkdirs(stuck / "run")
    (stuck / "run" / "immutable").write_text("x")
    subprocess.run(["chattr", "+i", str(stuck / "run" / "immutable")], check=True)
    try:
        own_server.start()
        log = (Path("/tmp/dsec-test-logs") / f"{own_server.state_dir.name}.log").read_text()
        assert f"could not remove all of sandbox {stuck.name}'s directory" in log
        async with own_server.client() as client:
            assert [s.id for s in await client.list()] == [live.id]
            again = await client.get(live.id)
            assert (await again.run("exit 7")).exit_code == 7
            assert (await client.get(dead.id)).info.state == "died"
            assert not old.exists()
            await again.stop()
        def removable() -> dict[str, list[str]]:
            traces = host_traces(own_server, edge_id)
            return {"mounts": traces["mounts"], "loops": traces["loops"],
                    "dirs": [d for d in traces["dirs"] if d != stuck.name]}
        assert await settled(removable) == {"mounts": [], "loops": [], "dirs": []}
        assert host_traces(own_server, edge_id)["dirs"] == [stuck.name]
    finally:
        subprocess.run(["chattr", "-i", str(stuck / "run" / "immutable")], check=True)


def test_remove_tree_never_crosses_a_mount(tmp_path: Path) -> None:
    """A disk still mounted in a dir being removed (an unmount that failed) is left whole,
    and the removal says so."""
    top = tmp_path / "sandbox"
    mounted = top / "disk"
    mounted.mkdir(parents=True)
    (top / "config.json").write_text("{}")
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mounted)], check=True)
    try:
        (mounted / "work").write_text("the sandbox's")
        with pytest.raises(OSError, match="mount point"):
            remove_tree(top)
        assert (mounted / "work").read_text() == "the sandbox's"
        assert not (top / "config.json").exists()
    finally:
        subprocess.run(["umount", str(mounted)], check=True)
    remove_tree(top)
    assert not top.exists()


def _mkdirs(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


# --- item 7: dsec's shell and tar are its own -----------------------------------------------

async def _forge_tools(sb: dsec.AsyncSandbox) -> None:
    """Replace the image's shell, tar, python3 and friends by programs that say they passed."""
    for path in FORGED:
        await sb.write_file(path, FAKE, mode=0o755)
    r = await sb.run(["/usr/bin/bash", "-c", "exit 7"])  # the image's bash now lies
    assert r.exit_code == 0 and r.stdout == "ALL TESTS PASSED\n"


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_replaced_shell_and_tar_forge_nothing(client, hostile, tmp_path: Path,
                                                    runtime: str) -> None:
    sb = await create(client, hostile, image="python-3.11", runtime=runtime)
    await _forge_tools(sb)
    r = await sb.run("exit 7")
    assert (r.exit_code, r.stdout) == (7, "")
    r = await sb.run("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    session = sb.session("grader")
    await session.run("cd /tmp && export VERDICT=pending")
    r = await session.run("echo $PWD $VERDICT; exit 5")
    assert (r.exit_code, r.stdout) == (5, "/tmp pending\n")
    assert (await session.run("echo $VERDICT")).stdout == "pending\n"
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "tests.py").write_text("assert False\n")
    await sb.upload(tmp_path / "up", "/work/up")
    assert await sb.read_file("/work/up/tests.py") == b"assert False\n"  # really extracted
    await sb.write_file("/work/up/result", b"FAILED 3 tests\n")
    await sb.download("/work/up", tmp_path / "down")
    assert (tmp_path / "down" / "result").read_bytes() == b"FAILED 3 tests\n"
    assert (tmp_path / "down" / "tests.py").read_text() == "assert False\n"
    # What the command names itself is the image's, and may lie: docs/SECURITY.md says so.
    assert (await sb.run("python3 -c 'raise SystemExit(7)'")).stdout == "ALL TESTS PASSED\n"


async def test_a_failed_upload_is_reported_despite_a_fake_tar(client, hostile, server) -> None:
    sb = await create(client, hostile, image="python-3.11")
    await _forge_tools(sb)
    broken = io.BytesIO()
    with tarfile.open(fileobj=broken, mode="w") as tar:
        info = tarfile.TarInfo("file")
        info.size = 100
        tar.addfile(info, io.BytesIO(b"x" * 100))
    with server.http(authenticated=True) as http:
        resp = http.put(f"/v1/sandboxes/{sb.id}/archive", params={"path": "/work"},
                        content=broken.getvalue()[:700])  # cut in the middle of the member
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request", resp.text


async def test_a_fresh_sandbox_grades_what_the_agent_left(client, hostile, tmp_path: Path) -> None:
    """The pristine check of docs/SECURITY.md: only /work crosses, as files, into a fresh
    sandbox of the same image, where the grader's own commands run the image's real tools."""
    agent = await create(client, hostile, image="python-3.11")
    await agent.write_file("/work/solution.py", "def add(a, b):\n    return a - b\n")
    await agent.write_file("/work/test_solution.py",
                           "from solution import add\nassert add(2, 2) == 4, 'wrong'\n")
    await _forge_tools(agent)
    await agent.download("/work", tmp_path / "work")
    grader = await create(client, hostile, image="python-3.11")
    await grader.upload(tmp_path / "work", "/work")
    r = await grader.run("cd /work && python3 test_solution.py")
    assert r.exit_code == 1 and "wrong" in r.stderr and "ALL TESTS PASSED" not in r.stdout


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_dsec_bin_cannot_be_changed(client, hostile, runtime: str) -> None:
    sb = await create(client, hostile, image="python-3.11", runtime=runtime)
    before = (await sb.run("sha256sum /.dsec/bin/* /.dsec/agent")).stdout
    attempts = {
        "write": "echo fake > /.dsec/bin/sh",
        "rm": "rm -f /.dsec/bin/sh",
        "chmod": "chmod 777 /.dsec/bin/sh",
        "rename_bin": "mv /.dsec/bin /.dsec/old",
        "rename_dsec": "mv /.dsec /dsec-old",
        "rmdir_run": "rmdir /.dsec/run",
        "new_file": "touch /.dsec/bin/new",
        "bind_over": "mkdir -p /tmp/fake && mount --bind /tmp/fake /.dsec/bin",
        "tmpfs_over": "mount -t tmpfs x /.dsec",
        "remount_rw": "mount -o remount,rw /.dsec",
        "unmount": "umount -l /.dsec",
        "hard_link": "ln /.dsec/bin/sh /work/sh",
    }
    for what, command in attempts.items():
        assert (await sb.run(command)).exit_code != 0, what
    probe = ("import ctypes, os\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "rc = libc.mount(b'/tmp', b'/.dsec/bin', None, 4096, None)\n"  # MS_BIND
             "print(rc, os.strerror(ctypes.get_errno()))\n"
             "eff = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0]\n"
             "caps = int(eff.split()[1], 16)\n"
             "print('sys_admin' if caps & (1 << 21) else 'no sys_admin')\n")
    r = await sb.run(["python3.11", "-c", probe])
    assert r.stdout.splitlines() == ["-1 Operation not permitted", "no sys_admin"], r
    assert (await sb.run("sha256sum /.dsec/bin/* /.dsec/agent")).stdout == before
    assert (await sb.run("exit 7")).exit_code == 7


async def test_fn_sandbox_runs_dsecs_own_shell(client, hostile, tmp_path: Path) -> None:
    sb = await create(client, hostile, substrate="fn", image="python-3.11")
    assert (await sb.run("exit 7")).exit_code == 7
    assert (await sb.run("readlink /proc/$$/exe")).stdout == "/.dsec/bin/sh\n"
    for command in ("echo fake > /.dsec/bin/sh", "rm -f /.dsec/bin/tar", "echo x > /bin/sh"):
        assert (await sb.run(command)).exit_code != 0, command
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "in").write_bytes(b"through dsec's tar")
    await sb.upload(tmp_path / "up", "/work/up")
    await sb.download("/work/up", tmp_path / "down")
    assert (tmp_path / "down" / "in").read_bytes() == b"through dsec's tar"


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_a_linked_agent_socket_never_reaches_a_host_socket(client, hostile, tmp_path: Path,
                                                                 runtime: str) -> None:
    """The sandbox puts a link to a host socket where its agent's socket was: the edge's
    next call fails typed, and the host socket never sees a connection (under runsc there
    is no listener pid to check, so this is what keeps the token on the edge)."""
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.bind(str(tmp_path / "host.sock"))
    host.listen()
    host.setblocking(False)
    try:
        sb = await create(client, hostile, runtime=runtime)
        r = await sb.run(f"ln -sfn {tmp_path / 'host.sock'} /.dsec/run/agent.sock")
        if runtime == "runsc":  # gVisor does not let the sandbox unlink the host's socket
            assert r.exit_code != 0 and "not permitted" in r.stderr
            assert (await sb.run("echo agent")).stdout == "agent\n"
        else:
            with pytest.raises(dsec.SandboxError, match="not a socket"):
                await sb.run("echo this must not reach the host")
        with pytest.raises(BlockingIOError):
            host.accept()
    finally:
        host.close()


# --- items 8 and 9 ------------------------------------------------------------------------------

@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_host_kernel_tables_read_empty_and_io_uring_is_denied(client, hostile,
                                                                    runtime: str) -> None:
    # crun masks paths this kernel lacks without complaint (the sandbox starts)
    assert any(not os.path.exists(p) for p in MASKED_PATHS)
    sb = await create(client, hostile, image="python-3.11", runtime=runtime)
    probe = ("import ctypes, os\n"
             "for p in ('kpagecgroup', 'kpageflags', 'kpagecount', 'slabinfo', 'vmallocinfo'):\n"
             "    try:\n"
             "        with open('/proc/' + p, 'rb') as f:\n"
             "            print(p, len(f.read(1 << 16)))\n"
             "    except OSError as e:\n"
             "        print(p, 'denied')\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "params = ctypes.create_string_buffer(120)\n"
             "rc = libc.syscall(425, 8, params)\n"  # io_uring_setup
             "print('io_uring', rc, os.strerror(ctypes.get_errno()))\n")
    r = await sb.run(["python3.11", "-c", probe])
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    for table in ("kpagecgroup", "kpageflags", "kpagecount", "slabinfo", "vmallocinfo"):
        assert lines[table] in ("0", "denied"), (table, r.stdout)
    assert lines["io_uring"] in ("-1 Operation not permitted", "-1 Function not implemented"), r.stdout
    # a recursive grep through /proc (DSec's kernel crash) ends, and the sandbox lives on
    await sb.run("timeout 15 grep -r x /proc/ > /dev/null 2>&1", timeout_s=60)
    assert (await sb.run("echo alive")).stdout == "alive\n"

