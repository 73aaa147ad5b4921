"""Hostile workloads and hostile requests: each must leave the host, the other sandboxes and
the next sandbox unaffected, and nothing of the sandbox behind once it is stopped.

Attacks that run inside a sandbox use ``tests/support/hostile_probe.py`` (copied in) where a shell is
not enough. See docs/SECURITY.md for the threat model.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import dsec
from conftest import Server, _sandbox
from dsec.api.limits import MAX_BODY_BYTES
from dsec.protocol.models import DEFAULT_MAX_OUTPUT
from dsec.substrates.host.disk import DiskPool
from dsec.substrates.host.loop import backing_file, mounted_loop, unmount_image
from dsec.substrates.host.sealed import F_ADD_SEALS
from dsec.substrates.host.volume import DiskVolume
from support.disks import bundle_with_mounts
from test_recovery import first_edge_id, host_traces

PROBE = Path(__file__).parent / "support" / "hostile_probe.py"


async def assert_no_trace(server: Server, sandbox_id: str) -> None:
    """Nothing of a stopped sandbox is left on the host (mounts, loops, cgroups, processes,
    runtime state, dirs). Polls: a killed init is reaped by the host's init in its own time."""
    edge_id = first_edge_id(server)
    deadline = time.monotonic() + 60
    while True:
        traces = host_traces(server, edge_id)
        mine = {k: [t for t in v if sandbox_id in t] for k, v in traces.items() if k != "processes"}
        procs = [p for p in traces["processes"] if _in_sandbox(p, sandbox_id)]
        if not any(mine.values()) and not procs:
            return
        assert time.monotonic() < deadline, f"left on the host: {mine}, processes {procs}"
        await asyncio.sleep(0.1)


def _in_sandbox(pid: str, sandbox_id: str) -> bool:
    try:
        return f"/{sandbox_id}\n" in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


async def assert_host_fine(neighbour: dsec.AsyncSandbox) -> None:
    """The host still forks and has disk; a sandbox next door still answers."""
    assert os.system("true") == 0
    assert (await neighbour.run("echo neighbour ok", timeout_s=60)).stdout == "neighbour ok\n"


@pytest.fixture
async def sandbox(client: dsec.DSecClient) -> AsyncIterator[dsec.AsyncSandbox]:
    """A bystander container: what its hostile neighbours do must leave it working."""
    async for sb in _sandbox(client, "debian-minbase", 256):
        yield sb


@pytest.fixture
async def hostile(client: dsec.DSecClient, server: Server) -> AsyncIterator[list[dsec.AsyncSandbox]]:
    """Sandboxes a test makes hostile; each is stopped and checked for leftovers after it."""
    made: list[dsec.AsyncSandbox] = []
    yield made
    for sb in made:
        try:
            await sb.stop()
        except dsec.DSecError:  # died on purpose
            pass
        await assert_no_trace(server, sb.id)


async def create(client: dsec.DSecClient, made: list[dsec.AsyncSandbox], **options: object) -> dsec.AsyncSandbox:
    sb = await client.create(ttl_s=300, **options)  # type: ignore[arg-type]
    made.append(sb)
    return sb


async def with_probe(client: dsec.DSecClient, made: list[dsec.AsyncSandbox]) -> dsec.AsyncSandbox:
    sb = await create(client, made, image="python-3.11", memory_mb=256)
    await sb.write_file("/work/probe.py", PROBE.read_bytes())
    return sb


async def probe(sb: dsec.AsyncSandbox, *args: str) -> dict[str, str]:
    """What the probe found, from its ``key=value`` lines."""
    r = await sb.run(["python3", "/work/probe.py", *args], timeout_s=120)
    assert r.exit_code == 0, r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines())


# --- resource bombs ---------------------------------------------------------------------

async def test_output_shaped_like_the_sdks_stream_events_stays_output(client, sandbox) -> None:  # type: ignore[no-untyped-def]
    """The SDK reads a command's stream as NDJSON events (client/transport.py). A command
    prints lines shaped like those events (an error, a result with exit 0, a half line
    split over writes) and a 1 MiB line with no newline, then exits 3: the caller gets every
    byte back as stdout and exit 3, never a forged result or a raised error."""
    forged = ('{"type":"error","error":{"code":"sandbox_not_found","message":"x","details":{}}}\n'
              '{"type":"result","result":{"exit_code":0,"stdout_b64":"","stderr_b64":""}}\n'
              '{"type":"stdout","da')
    command = (f"printf '%s' '{forged}'; sleep 0.1; printf 'ta\\n'; "
               "head -c 1048576 /dev/zero | tr '\\0' x; exit 3")
    expected = forged.encode() + b"ta\n" + b"x" * (1 << 20)
    done = await sandbox.run(command)
    assert (done.exit_code, done.stdout_bytes) == (3, expected)
    stream = sandbox.stream(command)
    chunks = [c async for c in stream]
    assert b"".join(c.data for c in chunks if c.stream == "stdout") == expected
    assert stream.result is not None and stream.result.exit_code == 3


async def test_fork_bomb(client, sandbox, hostile) -> None:
    sb = await create(client, hostile, pids=64)
    with pytest.raises(dsec.CommandTimeout):
        # exec: the shell becomes the sleep, with no fork of its own for the bomb to refuse
        await sb.run("bomb() { bomb | bomb & }; bomb; exec sleep 100", timeout_s=5)
    await assert_host_fine(sandbox)
    deadline = time.monotonic() + 60
    while (r := await sb.run("echo recovered", timeout_s=30)).stdout != "recovered\n":
        assert time.monotonic() < deadline, r  # the timeout killed the bomb's process group
        await asyncio.sleep(0.2)


async def test_memory_bomb_is_oom_killed_and_reported(client, sandbox, hostile) -> None:
    sb = await create(client, hostile, memory_mb=64)
    r = await sb.run("head -c 1000000000 /dev/zero | tail", timeout_s=60)
    assert r.oom_killed and r.exit_code != 0
    assert (await sb.run("echo alive")).stdout == "alive\n"
    await assert_host_fine(sandbox)


async def test_output_bomb_in_the_agents_memory_is_reported_died(client, sandbox, hostile) -> None:
    """A background process's output is kept by the agent (up to max_output), in the
    sandbox's memory: a big enough one gets the agent itself OOM-killed, and the sandbox is
    reported died, with the cause."""
    sb = await create(client, hostile, memory_mb=64)
    await sb.start("yes", max_output_bytes=1 << 30)
    deadline = time.monotonic() + 120
    with pytest.raises(dsec.SandboxDied) as info:
        while time.monotonic() < deadline:
            await sb.run("true")
            await asyncio.sleep(0.2)
    assert "out of memory" in str(info.value)
    assert (await sb.refresh()).state == "died"
    await assert_host_fine(sandbox)


async def test_unbounded_output_is_capped_and_flagged(client, sandbox, hostile) -> None:
    sb = await create(client, hostile)
    with pytest.raises(dsec.CommandTimeout) as info:
        await sb.run("yes", timeout_s=3, max_output_bytes=1 << 20)
    result = info.value.result  # type: ignore[attr-defined]
    assert result.stdout_truncated and len(result.stdout_bytes) == 1 << 20
    r = await sb.run("head -c 20000000 /dev/zero; head -c 100 /dev/zero >&2")  # default cap
    assert r.stdout_truncated and len(r.stdout_bytes) == DEFAULT_MAX_OUTPUT
    assert not r.stderr_truncated and len(r.stderr_bytes) == 100
    chunks = [c async for c in sb.stream("head -c 5000000 /dev/zero", max_output_bytes=1000)]
    assert sum(len(c.data) for c in chunks) == 1000
    proc = await sb.start("head -c 5000000 /dev/zero", max_output_bytes=1000)
    done = await proc.wait()
    assert done.stdout_truncated and len(done.stdout_bytes) == 1000
    with pytest.raises(dsec.InvalidRequest):
        await sb.run("true", max_output_bytes=(1 << 30) + 1)
    await assert_host_fine(sandbox)


async def test_disk_fill_ends_with_enospc(client, sandbox, hostile, server) -> None:
    host_free = shutil.disk_usage(server.state_dir).free
    sb = await create(client, hostile, disk_mb=32)
    r = await sb.run("yes > /work/f", timeout_s=120)
    assert r.exit_code != 0 and "No space left on device" in r.stderr
    size = int((await sb.run("stat -c %s /work/f")).stdout)
    assert 16 << 20 < size <= 32 << 20
    assert shutil.disk_usage(server.state_dir).free > host_free - (256 << 20)
    # While it is full, sandboxes still start and stop: the runtime's records of containers
    # are on the volume that holds its disk.
    other = await create(client, hostile)
    assert (await other.run("echo started")).stdout == "started\n"
    await other.stop()
    await sb.remove("/work/f")
    await sb.write_file("/work/after", b"room again")  # freed space is usable again
    assert (await sandbox.run("head -c 64000000 /dev/zero > /work/big && echo ok")).stdout == "ok\n"
    await sandbox.remove("/work/big")
    await assert_host_fine(sandbox)


def test_disk_pool_clones_a_golden_image(tmp_path: Path) -> None:
    volume = DiskVolume(tmp_path, "e0", size_gb=8)
    volume.open()
    disks = volume.root / "disks"
    disks.mkdir()
    (disks / "16mb-halfmade.tmp").write_bytes(b"crashed mid-mkfs")
    (disks / "16mb-0a1b2c3d.img").write_bytes(b"a spare of an older dsec")
    (disks / "golden-16mb.img").write_bytes(b"a golden image of an older format")
    pool = DiskPool(disks, (16,), ("upper/.dsec", "run"))
    pool.prepare()
    golden = [pool.golden(16).name]
    assert sorted(p.name for p in disks.iterdir()) == golden
    mounted = []
    try:
        for name in ("a", "b"):
            pool.attach(volume.root / f"{name}.img", volume.root / name, 16)
            mounted.append(volume.root / name)
            (volume.root / name / "mine").write_text(name)
        assert [(volume.root / n / "mine").read_text() for n in "ab"] == ["a", "b"]
        fs = os.statvfs(volume.root / "b")
        assert 12 << 20 < fs.f_blocks * fs.f_frsize <= 16 << 20
        pool.attach(volume.root / "c.img", volume.root / "c", 20)  # not pooled: formatted
        mounted.append(volume.root / "c")
        assert sorted(p.name for p in disks.iterdir()) == golden
        for name in "abc":  # every fresh disk comes with the skeleton, root's, 0755
            for rel in ("upper", "upper/.dsec", "run"):
                st = os.lstat(volume.root / name / rel)
                assert (stat.S_ISDIR(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid) == (True, 0o755, 0)
            assert sorted(os.listdir(volume.root / name / "upper")) == [".dsec"]
        again = DiskPool(disks, (16,), ("upper/.dsec", "run", "work"))  # another skeleton
        again.prepare()  # the old golden image goes; the disks cloned from it stay whole
        assert sorted(p.name for p in disks.iterdir()) == [again.golden(16).name] != golden
        assert (volume.root / "a" / "mine").read_text() == "a"
    finally:
        for target in mounted:
            dev = mounted_loop(target)
            unmount_image(target, target.with_suffix(".img"))
            assert dev is not None and backing_file(dev) != str(target.with_suffix(".img"))
        volume.close()
    assert mounted_loop(volume.root) is None  # nothing on it in use: unmounted


def test_a_loop_device_another_process_took_is_never_shared(tmp_path: Path) -> None:
    """The devices a teardown saw detach are tried first at the next attach: one another
    process configured meanwhile is skipped, never configured over."""
    volume = DiskVolume(tmp_path, "e0", size_gb=8)
    volume.open()
    pool = DiskPool(volume.root / "disks", (16,))
    pool.prepare()
    other = volume.root / "other.img"
    other.write_bytes(bytes(1 << 20))
    mounted: list[Path] = []
    try:
        released = pool.attach(volume.root / "a.img", volume.root / "a", 16)
        unmount_image(volume.root / "a", volume.root / "a.img")  # waits until it detached
        subprocess.run(["losetup", f"/dev/{released}", str(other)], check=True)  # taken first
        try:
            for name in "bcd":
                dev = pool.attach(volume.root / f"{name}.img", volume.root / name, 16)
                mounted.append(volume.root / name)
                assert dev != released
                assert backing_file(dev) == str(volume.root / f"{name}.img")
            assert backing_file(released) == str(other)
        finally:
            subprocess.run(["losetup", "-d", f"/dev/{released}"], check=True)
    finally:
        for target in mounted:
            unmount_image(target, target.with_suffix(".img"))
        volume.close()


# --- probing the host --------------------------------------------------------------------

async def test_proc_and_sys_show_nothing_of_the_host(client, hostile) -> None:
    sb = await with_probe(client, hostile)
    facts = await probe(sb, "proc")
    assert int(facts["pids"]) < 10  # the agent, the probe and its children: no host processes
    assert facts["host_cmdlines"] == ""  # no dsec server, pytest or systemd in sight
    assert facts["pid1"] == "/.dsec/agent --listen /.dsec/run/agent.sock"
    assert facts["kcore"] == "0" and facts["keys"] == "0"  # masked: empty
    assert facts["sys_write"].startswith("denied") and facts["proc_sys_write"].startswith("denied")
    assert facts["firmware"] == "" and facts["hostname"] == sb.id
    assert facts["agent_environ"].startswith("denied") and facts["agent_mem"].startswith("denied")


async def test_ptrace_and_signals_cannot_reach_the_host(client, hostile, server) -> None:
    sb = await with_probe(client, hostile)
    assert server.proc is not None
    facts = await probe(sb, "ptrace", str(server.proc.pid), str(os.getpid()))
    assert facts["agent"] == "EPERM"  # pid 1, non-dumpable, no CAP_SYS_PTRACE
    for pid in (server.proc.pid, os.getpid()):  # host pids do not exist in the sandbox
        assert facts[f"attach_{pid}"] in ("ESRCH", "EPERM") and facts[f"kill_{pid}"] == "ESRCH"
    assert server.proc.poll() is None


async def test_mounts_and_namespaces_are_denied(client, hostile) -> None:
    sb = await with_probe(client, hostile)
    for command in ("mount -t tmpfs x /mnt", "mount --bind / /mnt", "unshare -m true",
                    "unshare -U true", "umount /proc", "mount -o remount,rw /sys"):
        r = await sb.run(command)
        assert r.exit_code != 0, command
    assert "/mnt" not in (await sb.run("cat /proc/mounts")).stdout
    assert await probe(sb, "mount") == {"mount": "EPERM"}


async def test_the_seccomp_filter_holds_in_every_abi_a_process_can_call_in(client, hostile) -> None:
    """A filter is a program per ABI: an agent that finds the x86-64 door shut tries the
    i386 one (int 0x80) and the x32 one (the syscall number's bit 30) with a call the filter
    denies and nothing else does (unshare(0) changes nothing and needs no privilege). The
    server loads its compiled form of the profile into crun (``seccomp.container_filter_bpf``):
    every ABI the host's kernel offers is open to what the profile allows, and refuses
    unshare with EPERM: none is left unfiltered, none kills its caller. The same probe run on
    the host, unfiltered, says which ABIs the kernel offers."""
    sb = await with_probe(client, hostile)
    unfiltered = subprocess.run([sys.executable, str(PROBE), "abis"], capture_output=True,
                                text=True, check=True).stdout
    host = dict(line.split("=", 1) for line in unfiltered.splitlines())
    facts = await probe(sb, "abis")
    assert host["x86_64_unshare"] == "0", host
    for abi in ("x86_64", "i386", "x32"):
        assert facts[f"{abi}_getpid"] == host[f"{abi}_getpid"], (abi, facts, host)
        if not host[f"{abi}_unshare"].startswith("killed"):  # the kernel takes the call
            assert facts[f"{abi}_unshare"] == "EPERM", (abi, facts, host)


async def test_overwritten_image_tools_come_back_in_the_next_sandbox(client, hostile) -> None:
    first = await create(client, hostile, image="python-3.11")
    running = await create(client, hostile, image="python-3.11")  # alive during the attack
    digest = (await first.run("sha256sum /usr/bin/python3.11 /bin/cat")).stdout
    r = await first.run("rm -rf /bin/bash /usr/bin/ls && echo evil > /usr/bin/python3.11 && "
                        "echo evil > /bin/cat; ls /; /bin/bash -c true")
    assert r.exit_code != 0  # bash and ls are gone from this sandbox
    await first.stop()
    second = await create(client, hostile, image="python-3.11")
    assert (await second.run("sha256sum /usr/bin/python3.11 /bin/cat")).stdout == digest
    assert (await second.run(["/bin/bash", "-c", "ls / >/dev/null && echo fine"])).stdout == "fine\n"
    assert (await running.run("sha256sum /usr/bin/python3.11 /bin/cat")).stdout == digest


async def test_the_runtime_runs_from_a_sealed_copy_no_sandbox_can_reach(client, hostile,
                                                                       server) -> None:
    """CVE-2019-5736's target is the runtime binary every sandbox starts from. The server
    starts crun from one sealed in-memory copy (substrates/host/sealed.py): a sandbox sees
    no trace of it among everything it can open, writing what it can reach changes nothing,
    root on the host cannot write, shrink or unseal the copy, and the next sandbox starts
    from the same bytes as /usr/bin/crun."""
    sb = await create(client, hostile)
    r = await sb.run("for f in /proc/[0-9]*/exe /proc/[0-9]*/fd/* /proc/[0-9]*/map_files/*; "
                     "do l=$(readlink $f) && echo \"$f -> $l\"; done; "
                     "for f in /proc/[0-9]*/exe; do (echo evil >> $f) 2>/dev/null && "
                     "echo WROTE $f; done; true")
    assert r.exit_code == 0 and "->" in r.stdout, r
    assert "memfd:" not in r.stdout and "crun" not in r.stdout and "WROTE" not in r.stdout
    assert server.proc is not None
    copies = [fd for fd in Path(f"/proc/{server.proc.pid}/fd").iterdir()
              if os.readlink(fd).startswith("/memfd:crun")]
    assert len(copies) == 1, copies
    fd = await _open_for_writing(copies[0])  # root on the host, through the server's fd
    try:
        for change in (lambda: os.write(fd, b"evil"), lambda: os.pwrite(fd, b"evil", 1 << 20),
                       lambda: os.ftruncate(fd, 0),
                       lambda: fcntl.fcntl(fd, F_ADD_SEALS, 0)):  # a seal added: none may be
            with pytest.raises(PermissionError):
                change()
        assert os.pread(fd, 64 << 20, 0) == Path(shutil.which("crun") or "crun").read_bytes()
    finally:
        os.close(fd)
    nxt = await create(client, hostile)
    assert (await nxt.run("echo started")).stdout == "started\n"


async def _open_for_writing(path: Path) -> int:
    """``path`` opened read-write: refused (ETXTBSY) while a runtime runs from it."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return os.open(path, os.O_RDWR)
        except OSError as exc:
            if exc.errno != errno.ETXTBSY or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.01)


# --- the in-sandbox agent ------------------------------------------------------------------

async def test_forged_agent_requests_from_inside_are_refused(client, hostile) -> None:
    sb = await with_probe(client, hostile)
    facts = await probe(sb, "agent")
    assert facts["claim"] == "X EPERM agent already claimed"
    assert facts["exec_without_token"] == "X EACCES bad token"
    assert facts["exec_with_guess"] == "X EACCES bad token"
    assert facts["list_without_token"] == "X EACCES bad token"
    assert facts["marker"] == "absent"  # nothing the forged execs asked for ran
    assert (await sb.run("echo edge still in charge")).stdout == "edge still in charge\n"


async def test_a_fake_agent_socket_gets_no_token(client, hostile, server) -> None:
    sb = await with_probe(client, hostile)
    run_dir = bundle_with_mounts(server, sb.id) / "disk" / "run"
    await sb.start(["python3", "/work/probe.py", "impostor"])
    deadline = time.monotonic() + 60
    while not (run_dir / "impostor-ready").exists():
        assert time.monotonic() < deadline, "the impostor did not take the socket's place"
        await asyncio.sleep(0.05)
    with pytest.raises(dsec.SandboxError, match="served by pid"):
        await sb.run("echo this must not reach the impostor")
    (run_dir / "impostor-done").touch()
    while not (run_dir / "impostor-restored").exists():
        assert time.monotonic() < deadline, "the impostor did not give the socket back"
        await asyncio.sleep(0.05)
    assert (await sb.read_file("/work/impostor-got")) == b""  # not one byte, so no token


# --- file APIs -----------------------------------------------------------------------------

async def test_path_traversal_and_symlinks_stay_inside(client, hostile) -> None:
    """Links to directories out of the sandbox; ``..`` paths and a link to a host file are
    test_sandbox.py's test_paths_never_escape."""
    sb = await create(client, hostile)
    marker = Path("/tmp") / f"dsec-host-marker-{sb.id}"
    marker.write_text("host secret")
    try:
        await sb.run("ln -s / /work/root && ln -s /tmp /work/tmp && ln -s ../../.. /work/up")
        with pytest.raises(dsec.FileNotFound):  # resolved in the sandbox, where it is absent
            await sb.read_file(f"/work/tmp/{marker.name}")
        names = {e.name for e in await sb.list_files("/work/root")}
        assert ".dsec" in names and "work" in names  # the sandbox's root, not the host's
        assert {e.name for e in await sb.list_files("/work/up")} == names
        await sb.write_file("/work/tmp/through-link", b"x")  # lands in the sandbox's /tmp
        assert marker.read_text() == "host secret"
        assert not (Path("/tmp") / "through-link").exists()
        assert (await sb.read_file("/tmp/through-link")) == b"x"
        await sb.remove("/work/root")  # removes the link, not what it points to
        assert (await sb.run("test -d /etc && echo intact")).stdout == "intact\n"
    finally:
        marker.unlink()


def _tar(members: list[tuple[str, str, bytes | str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, name, body in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                assert isinstance(body, bytes)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
            else:
                info.type, info.linkname = (tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE), str(body)
                tar.addfile(info)
    return buf.getvalue()


async def test_upload_tar_with_escaping_members_stays_inside(client, hostile, server) -> None:
    sb = await create(client, hostile)
    marker = Path("/tmp") / f"dsec-tar-marker-{sb.id}"
    archive = _tar([
        ("file", "../../escaped-dotdot", b"x"),
        ("file", "/escaped-absolute", b"x"),
        ("symlink", "etc-link", "/etc"),
        ("file", "etc-link/passwd", b"owned"),
        ("symlink", "host-link", str(marker.parent)),
        ("file", f"host-link/{marker.name}", b"owned"),
        ("hardlink", "shadow-link", "/etc/shadow"),
        ("file", "ok.txt", b"fine"),
    ])
    await sb.mkdir("/work/up")
    with server.http(authenticated=True) as http:  # the raw route: the SDK only uploads dirs
        resp = http.put(f"/v1/sandboxes/{sb.id}/archive", params={"path": "/work/up"}, content=archive)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request", resp.text
    passwd = (await sb.read_file("/etc/passwd")).decode()
    assert passwd.startswith("root:") and "owned" not in passwd
    for escaped in ("/escaped-dotdot", "/escaped-absolute", "/work/escaped-dotdot"):
        assert not await sb.exists(escaped)
    assert not marker.exists()  # nothing on the host
    entries = {e.name: e for e in await sb.list_files("/work/up")}
    # dsec's tar (busybox) defers links: etc-link/passwd made a directory in the upload dir
    assert entries.get("etc-link") is None or entries["etc-link"].type in ("symlink", "dir")
    # a download of a tree with a link to / carries the link, not the whole file system
    await sb.run("ln -sfn / /work/up/root-link")
    with server.http(authenticated=True) as http:
        tar_bytes = http.get(f"/v1/sandboxes/{sb.id}/archive", params={"path": "/work/up"}).content
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        names = tar.getnames()
        assert tar.getmember("./root-link").issym() and len(names) < 20


# --- the HTTP API ----------------------------------------------------------------------------

async def test_oversized_and_malformed_requests_are_typed(server: Server, sandbox) -> None:
    with pytest.raises(dsec.PayloadTooLarge) as refused:
        await sandbox.write_file("/work/big", b"\0" * (MAX_BODY_BYTES + 1))
    assert refused.value.details["limit"] == MAX_BODY_BYTES
    await sandbox.write_file("/work/max", b"\1" * MAX_BODY_BYTES)  # the limit itself gets through
    assert (await sandbox.stat("/work/max")).size == MAX_BODY_BYTES
    await sandbox.remove("/work/max")
    with server.http(authenticated=True) as http:

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
                yield b"\0" * (1 << 20)
        chunked = http.put(f"/v1/sandboxes/{sandbox.id}/files", params={"path": "/work/big"},
                           content=chunks())
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "payload_too_large"
        assert not await sandbox.exists("/work/big")
        chunked_json = http.post(f"/v1/sandboxes/{sandbox.id}/exec", content=chunks(),
                                 headers={"content-type": "application/json"})
        assert chunked_json.status_code == 413, chunked_json.text  # also where FastAPI parses it
        assert chunked_json.json()["error"]["details"] == {"limit": MAX_BODY_BYTES}

        for body in (b"{", b"[]", b"null", b'{"command": 5}', b"\xff\xfe", b'{"command": "x", "bogus": 1}'):
            r = http.post(f"/v1/sandboxes/{sandbox.id}/exec", content=body,
                          headers={"content-type": "application/json"})
            assert r.status_code in (400, 422) and r.json()["error"]["code"] == "invalid_request", body
        for method, path, status, code in (("GET", "/v1/nope", 404, "route_not_found"),
                                           ("GET", "/v1/sandboxes/x/y/z", 404, "route_not_found"),
                                           ("PATCH", "/v1/sandboxes", 405, "method_not_allowed")):
            r = http.request(method, path)
            assert r.status_code == status and r.json()["error"]["code"] == code, (method, path, r.text)
            assert r.json()["error"]["details"] == {}
        r = http.get("/v1/sandboxes", headers={"authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert (await sandbox.run("echo fine")).stdout == "fine\n"
