"""The sandbox API end to end: a real server, real sandboxes, the public SDK; each test that
takes ``substrate`` runs on every substrate in ``conftest.SUBSTRATES``."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

import dsec
from conftest import VM_SUBSTRATES, image_for, pool_filled, skip_on_vms


def _init_pid(sandbox_hostname: str) -> int:
    """The host pid of a sandbox's init: the process of its cgroup that is pid 1 inside."""
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and f"/{sandbox_hostname}\n" in (proc / "cgroup").read_text()
                    and (proc / "status").read_text().split("NSpid:")[1].split("\n")[0].split()[-1] == "1"):
                return int(proc.name)
        except (OSError, IndexError):
            pass
    raise AssertionError(f"no init process for {sandbox_hostname}")


def _cgroup_file(controller: str, sandbox_hostname: str, name: str) -> Path:
    """A sandbox's cgroup file. os.walk, not a recursive glob: other sandboxes' cgroups (fn
    workers) come and go during the walk, and a glob fails on a directory that vanished."""
    found = [Path(d) / name for d, _, _ in os.walk(f"/sys/fs/cgroup/{controller}")
             if "/dsec-" in d and os.path.basename(d) == sandbox_hostname]
    assert len(found) == 1, found
    return found[0]


async def _hostname(sb: dsec.AsyncSandbox) -> str:
    """Both substrates name a sandbox's cgroup after its hostname (container: the sandbox id)."""
    return (await sb.run("cat /proc/sys/kernel/hostname")).stdout.strip()


async def test_issue_example(client: dsec.DSecClient, substrate: str) -> None:
    sb = await client.create(substrate=substrate, image="python-3.11", cpu=1, memory_mb=512,
                             ttl_s=300, network="none")
    r = await sb.run("python3 -c 'print(6*7)'", timeout_s=10)
    assert r.stdout == "42\n" and r.exit_code == 0
    await sb.write_file("/work/a.txt", b"hi")
    assert await sb.read_file("/work/a.txt") == b"hi"
    chunks = [c.text async for c in sb.stream("for i in 1 2 3; do echo $i; sleep 0.1; done")]
    assert "".join(chunks) == "1\n2\n3\n"
    p = await sb.start("sleep 100")
    await p.kill()
    assert (await p.wait()).signal == 9
    await sb.stop()
    with pytest.raises(dsec.SandboxNotFound):
        await sb.run("true")


async def test_exit_codes_stderr_env_cwd_stdin(sandbox: dsec.AsyncSandbox) -> None:
    r = await sandbox.run("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    r = await sandbox.run("echo $GREETING; pwd", env={"GREETING": "hello"}, cwd="/tmp")
    assert r.stdout == "hello\n/tmp\n"
    assert (await sandbox.run("pwd")).stdout == "/work\n"
    assert (await sandbox.run("cat", stdin=b"fed via stdin")).stdout == "fed via stdin"
    r = await sandbox.run(["printf", "%s|", "a b", "c"])
    assert r.stdout == "a b|c|"
    assert (await sandbox.run("no-such-command")).exit_code == 127


async def test_binary_output_is_exact(sandbox: dsec.AsyncSandbox) -> None:
    r = await sandbox.run("printf '\\000\\001\\377\\376'")
    assert r.stdout_bytes == b"\x00\x01\xff\xfe"


async def test_large_output_is_capped_and_flagged(sandbox: dsec.AsyncSandbox) -> None:
    r = await sandbox.run("head -c 50000000 /dev/zero", max_output_bytes=1 << 20, timeout_s=60)
    assert r.exit_code == 0 and r.stdout_truncated
    assert len(r.stdout_bytes) == 1 << 20


async def test_timeout_kills_the_whole_process_tree(sandbox: dsec.AsyncSandbox) -> None:
    with pytest.raises(dsec.CommandTimeout) as info:
        await sandbox.run("echo started; sleep 100 & sleep 100", timeout_s=1)
    assert info.value.result.stdout == "started\n"  # type: ignore[attr-defined]
    left = await sandbox.run("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done")
    assert "sleep 100" not in left.stdout


async def test_background_processes(sandbox: dsec.AsyncSandbox) -> None:
    p = await sandbox.start("echo begin; sleep 0.3; echo end; exit 4")
    assert any(x.id == p.id and x.running for x in await sandbox.processes())
    first = await p.wait()
    again = await p.wait()  # output is kept and can be fetched again
    assert first.exit_code == again.exit_code == 4
    assert first.stdout == again.stdout == "begin\nend\n"
    assert not next(x for x in await sandbox.processes() if x.id == p.id).running
    ghost = dsec.AsyncProcess(sandbox, dsec.ProcessInfo(id="999999", pid=0, command="", running=False))
    with pytest.raises(dsec.ProcessNotFound):
        await ghost.kill()


async def test_streaming_is_incremental(sandbox: dsec.AsyncSandbox) -> None:
    stamps = []
    stream = sandbox.stream("for i in 1 2 3; do echo $i; sleep 0.3; done; exit 2")
    async for chunk in stream:
        stamps.append((time.monotonic(), chunk.text))
    assert "".join(t for _, t in stamps) == "1\n2\n3\n"
    assert stamps[-1][0] - stamps[0][0] > 0.4
    assert stream.result is not None and stream.result.exit_code == 2


async def test_sessions_keep_cwd_and_env(sandbox: dsec.AsyncSandbox) -> None:
    a, b = sandbox.session("a"), sandbox.session("b")
    await a.run("mkdir -p /tmp/s && cd /tmp/s && export COLOR=blue")
    assert (await a.run("pwd; echo $COLOR")).stdout == "/tmp/s\nblue\n"
    assert (await b.run("pwd; echo ${COLOR:-none}")).stdout == "/work\nnone\n"
    await a.run("cd /; exit 5")
    assert (await a.run("pwd")).stdout == "/\n"


async def test_files(sandbox: dsec.AsyncSandbox) -> None:
    await sandbox.mkdir("/work/d/e", parents=True)
    await sandbox.write_file("/work/d/e/f.bin", bytes(range(256)))
    await sandbox.write_file("/work/d/e/f.bin", b"!", append=True)
    assert await sandbox.read_file("/work/d/e/f.bin") == bytes(range(256)) + b"!"
    assert await sandbox.read_file("d/e/f.bin") == bytes(range(256)) + b"!"  # relative to /work
    entries = {e.name: e for e in await sandbox.list_files("/work/d/e")}
    assert entries["f.bin"].size == 257 and entries["f.bin"].type == "file"
    assert (await sandbox.stat("/work/d")).type == "dir"
    assert (await sandbox.run("cat /work/d/e/f.bin | wc -c")).stdout.strip() == "257"
    await sandbox.remove("/work/d", recursive=True)
    assert not await sandbox.exists("/work/d")
    with pytest.raises(dsec.FileNotFound):
        await sandbox.read_file("/work/nope")


async def test_paths_never_escape(sandbox: dsec.AsyncSandbox, tmp_path: Path) -> None:
    for bad in ("../../etc/passwd", "/work/../../etc/passwd", "a/../../b", "/..", "/work/x\x00y"):
        with pytest.raises(dsec.InvalidRequest):
            await sandbox.read_file(bad)
        with pytest.raises(dsec.InvalidRequest):
            await sandbox.write_file(bad, b"x")
    # A symlink that names a host-only file resolves inside the sandbox, never on the host.
    secret = Path("/run/dsec-test") / f"host-secret-{os.getpid()}"
    secret.write_text("host only")
    try:
        await sandbox.run(f"ln -s {secret} /work/link")
        with pytest.raises(dsec.FileNotFound):
            await sandbox.read_file("/work/link")
        await sandbox.run(f"ln -s {secret} /work/link2")
        await sandbox.write_file("/work/link2", b"stays inside")  # replaces the link itself
        assert (await sandbox.stat("/work/link2")).type == "file"
        assert await sandbox.read_file("/work/link2") == b"stays inside"
        assert secret.read_text() == "host only"
    finally:
        secret.unlink()


async def test_upload_download(sandbox: dsec.AsyncSandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("A")
    (src / "sub" / "b.bin").write_bytes(b"\x00B")
    await sandbox.upload(src, "/work/up")
    assert (await sandbox.run("cat /work/up/a.txt /work/up/sub/b.bin")).stdout_bytes == b"A\x00B"
    out = tmp_path / "out"
    out.mkdir()
    await sandbox.download("/work/up", out)
    assert (out / "sub" / "b.bin").read_bytes() == b"\x00B"


async def test_network_none_has_only_loopback(sandbox: dsec.AsyncSandbox, substrate: str) -> None:
    nets = (await sandbox.run("ls /sys/class/net")).stdout.split()
    routes = (await sandbox.run("cat /proc/net/route")).stdout.strip().splitlines()
    if substrate in VM_SUBSTRATES:
        # agent0 is the agent's link: QEMU user networking with restrict=on, one subnet, no
        # gateway; eth0, the network policies' NIC, is down and connected to nothing
        assert nets == ["agent0", "eth0", "lo"] and len(routes) == 2
        with socket.create_server(("127.0.0.1", 0)) as host:  # QEMU maps 10.0.2.2 to the host
            port = host.getsockname()[1]
            r = await sandbox.run(f"timeout 5 bash -c 'echo > /dev/tcp/10.0.2.2/{port}'")
            assert r.exit_code != 0
        r = await sandbox.run("timeout 5 bash -c 'echo > /dev/tcp/1.1.1.1/80'")
        assert r.exit_code != 0
    else:
        assert nets == ["lo"]
        assert len(routes) == 1  # the header only: no route leaves the sandbox


async def test_loopback_works_and_caps_are_dropped(py_sandbox: dsec.AsyncSandbox, substrate: str) -> None:
    code = ("import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen();"
            "c=socket.create_connection(s.getsockname()); print('loopback ok')")
    assert (await py_sandbox.run(["python3", "-c", code])).stdout == "loopback ok\n"
    if substrate in VM_SUBSTRATES:
        return  # root of its own kernel: the VM itself is the boundary
    status = (await py_sandbox.run("grep -E 'CapEff|NoNewPrivs|Seccomp:' /proc/self/status")).stdout
    fields = dict(line.split(":\t") for line in status.strip().splitlines())
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2"
    assert int(fields["CapEff"], 16) & (1 << 21) == 0  # no CAP_SYS_ADMIN
    assert (await py_sandbox.run("mount -t tmpfs x /mnt")).exit_code != 0


async def test_fork_bomb_hits_pids_limit(client: dsec.DSecClient, substrate: str) -> None:
    skip_on_vms(substrate, "pids caps QEMU's threads on the host, the guest's processes are "
                "its kernel's (test_vm: the limits asked)")
    async with await client.create(substrate=substrate, image=image_for(substrate), pids=64,
                                   memory_mb=256) as sb:
        name = await _hostname(sb)
        try:
            # the time-out ends the whole process group, bomb and all (exec: no fork needed)
            await sb.run("bomb() { bomb | bomb & }; bomb; exec sleep 100", timeout_s=5)
        except dsec.CommandTimeout:
            pass
        events = _cgroup_file("pids", name, "pids.events")
        refused_forks = int(events.read_text().split()[1])
        assert refused_forks > 0  # the kernel refused forks at the limit...
        assert (await sb.run("echo still here")).stdout == "still here\n"  # ...and we live


async def test_memory_hog_is_oom_killed_and_reported(client: dsec.DSecClient, substrate: str) -> None:
    skip_on_vms(substrate, "memory_mb is the guest's RAM, and 64 MB is below a VM's minimum "
                "(test_vm: the minimum is a typed error)")
    async with await client.create(substrate=substrate, image=image_for(substrate), memory_mb=64) as sb:
        for _ in range(2):  # each exec reports the kills made while it ran, and only those
            r = await sb.run("head -c 500000000 /dev/zero | tail", timeout_s=30)
            assert r.oom_killed and r.exit_code != 0
            after = await sb.run("echo alive")
            assert after.stdout == "alive\n" and not after.oom_killed


async def test_dead_sandbox_is_reported_died(client: dsec.DSecClient, substrate: str) -> None:
    skip_on_vms(substrate, "its init is in the guest (test_vm: a killed QEMU is reported died)")
    sb = await client.create(substrate=substrate, image=image_for(substrate))
    # Kill the sandbox's init (the agent) from the host, as a crash would.
    os.kill(_init_pid(await _hostname(sb)), 9)
    await asyncio.sleep(0.2)
    with pytest.raises(dsec.SandboxDied) as info:
        await sb.run("true")
    assert "exited" in str(info.value) or "died" in str(info.value)
    assert (await sb.refresh()).state == "died"


async def test_ttl_expiry(client: dsec.DSecClient, substrate: str) -> None:
    sb = await client.create(substrate=substrate, image=image_for(substrate), ttl_s=1)
    assert (await sb.run("echo up")).stdout == "up\n"
    await asyncio.sleep(2.5)
    with pytest.raises(dsec.SandboxDied) as info:
        await sb.run("true")
    assert "TTL" in str(info.value)


async def test_bad_requests_are_typed(client: dsec.DSecClient, substrate: str) -> None:
    with pytest.raises(dsec.ImageNotFound):
        await client.create(substrate=substrate, image="no-such-image")
    with pytest.raises(dsec.InvalidRequest):  # "none" or a NetworkPolicy (docs/NETWORK.md)
        await client.create(substrate=substrate, image=image_for(substrate), network="host")
    with pytest.raises(dsec.InvalidRequest):
        await client.create(substrate=substrate, memory_mb=1)
    with pytest.raises(dsec.SandboxNotFound):
        await client.get("sb-e000000-000000000000")


async def test_create_many(client: dsec.DSecClient, substrate: str) -> None:
    made = await client.create_many(10, concurrency=5, ttl_s=120, substrate=substrate,
                                    image=image_for(substrate))
    assert all(isinstance(s, dsec.AsyncSandbox) for s in made)
    results = await asyncio.gather(*(s.run("cat /proc/sys/kernel/hostname") for s in made))  # type: ignore[union-attr]
    assert len({r.stdout for r in results}) == 10
    await asyncio.gather(*(s.stop() for s in made))  # type: ignore[union-attr]


def test_sync_facade(server, substrate: str) -> None:  # type: ignore[no-untyped-def]
    with dsec.Client(server.url, server.key, autostart=False) as client:
        with client.create(substrate=substrate, image=image_for(substrate)) as sb:
            assert sb.run("echo sync").stdout == "sync\n"
            sb.write_file("/work/s.txt", "text")
            assert sb.read_file("/work/s.txt") == b"text"
            assert "".join(c.text for c in sb.stream("echo a; echo b")) == "a\nb\n"
            p = sb.start("sleep 30")
            p.kill()
            assert p.wait().signal == 9
            assert any(s.id == sb.id for s in client.list())


async def test_api_key_is_required(server) -> None:  # type: ignore[no-untyped-def]
    async with dsec.DSecClient(server.url, "dsk_wrong", autostart=False) as bad:
        with pytest.raises(dsec.Unauthorized):
            await bad.list()


THREAD_STARTS = "import threading; t = threading.Thread(target=print, args=('thread ran',)); " \
    "t.start(); t.join()"


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
async def test_other_runtimes(client: dsec.DSecClient, runtime: str, substrate: str) -> None:
    if substrate != "container":  # OCI runtimes are a container matter
        with pytest.raises(dsec.NotSupported):
            await client.create(substrate=substrate, image=image_for(substrate), runtime=runtime)
        return
    async with await client.create(runtime=runtime, image="python-3.11", ttl_s=120) as sb:
        kernel = (await sb.run("cat /proc/version")).stdout
        assert ("Linux version 4.4.0" in kernel) == (runtime == "runsc")  # gVisor's own kernel
        await sb.write_file("/work/f", b"data")
        assert (await sb.run("cat /work/f")).stdout == "data"
        threads = await sb.run(["python3", "-c", THREAD_STARTS])  # glibc's clone3, then clone
        assert (threads.exit_code, threads.stdout) == (0, "thread ran\n"), threads.stderr
        routes = (await sb.run("cat /proc/net/route 2>/dev/null")).stdout.strip().splitlines()
        assert routes[1:] == []  # no route out, under either runtime


async def test_warm_pool_sandboxes_run_at_normal_priority(client: dsec.DSecClient,
                                                         substrate: str) -> None:
    skip_on_vms(substrate, "the VM warm pool is opt-in, --vm-warm-pool (test_vm: a pooled VM "
                "runs at normal priority)")
    image = image_for(substrate)
    await (await client.create(substrate=substrate, image=image, ttl_s=60)).stop()  # its pool fills
    await pool_filled(client, substrate, image)
    async with await client.create(substrate=substrate, image=image, ttl_s=60, memory_mb=96,
                                   pids=40) as sb:
        name = await _hostname(sb)
        # The pool starts sandboxes at idle CPU priority; a claimed one runs at normal priority
        # with the limits asked for.
        r = await sb.run("grep -h '^policy' /proc/1/sched /proc/self/sched")
        assert [line.split()[-1] for line in r.stdout.splitlines()] == ["0", "0"]  # SCHED_OTHER
        mem = _cgroup_file("memory", name, "memory.limit_in_bytes")
        pids = _cgroup_file("pids", name, "pids.max")
        assert int(mem.read_text()) == 96 << 20 and pids.read_text().strip() == "40"
