"""Hostile tests of the VM substrates (issue 12, items 14 and 7): a local user racing a
booting microVM for its agent, and a sandbox attacking dsec's own execution path in its
guest. Real QEMU VMs (TCG unless DSEC_TEST_VM_ACCEL=kvm) behind real servers; see
docs/SECURITY.md ("VM sandboxes")."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

import dsec
from conftest import VM_ACCEL, VM_SUBSTRATES, Server, make_server, stop_server
from dsec.agent.client import AgentUnavailable
from dsec.edge.edge import default_edge_id
from dsec.substrates.vm.qemu import QemuSubstrate
from test_vm import _qemu_pids, _traces

NOBODY = 65534
# What an unprivileged local user can do against every booting VM of the server: watch for
# new QEMU processes, read each one's argv for the agent's port forward and its sockets, then
# hammer the port (a thread each): claim the agent with its own token, run a command with that
# token; and connect to every Unix socket QEMU names. One JSON line per attempt.
RACER = r"""
import json, os, re, socket, struct, sys, threading, time
prefix = sys.argv[1].encode()
def frame(kind, fields):
    body = kind.encode() + b"".join(bytes([len(k)]) + k.encode() + struct.pack(">I", len(v)) + v
                                    for k, v in fields)
    return struct.pack(">I", len(body)) + body
MINE = b"r" * 64
CLAIM = frame("C", [("token", MINE)])
EXEC = frame("E", [("token", MINE), ("argv", b"/bin/sh"), ("argv", b"-c"),
                   ("argv", b"touch /work/racer-was-here"), ("mode", b"wait")])
lock = threading.Lock()
def report(**what):
    with lock:
        sys.stdout.write(json.dumps(what) + "\n")
        sys.stdout.flush()
def ask(port, request):
    try:
        with socket.create_connection(("127.0.0.1", int(port)), timeout=0.2) as s:
            s.settimeout(1)
            s.sendall(request)
            return s.recv(4096).decode("latin1")
    except OSError as e:
        return type(e).__name__
def hammer(pid, port):  # claim, then run a command, as fast as the port answers
    while True:
        for name, request in (("claim", CLAIM), ("exec", EXEC)):
            report(pid=pid, port=port, what=name, reply=ask(port, request))
        time.sleep(0.02)
def unix(pid, path):
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            got = "connected"
    except OSError as e:
        got = type(e).__name__
    report(pid=pid, path=path, what="unix", reply=got)
seen = set()
while True:
    for pid in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if pid in seen or b"-name" not in argv or not any(a.startswith(prefix) for a in argv):
            continue
        seen.add(pid)
        text = b" ".join(argv).decode()
        for port in re.findall(r"hostfwd=tcp:127\.0\.0\.1:(\d+)", text):
            threading.Thread(target=hammer, args=(pid, port), daemon=True).start()
        for path in re.findall(r"(?:path=|unix:)([^,\s]+)", text):
            unix(pid, path)
    time.sleep(0.005)
"""


class Racer:
    """The RACER loop as uid 65534, against the server's VMs (and no one else's), until stopped."""

    def __init__(self, server: Server, out: Path) -> None:
        self.out = out
        prefix = f"sb-{default_edge_id(server.state_dir)}-"
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(["/usr/bin/python3", "-c", RACER, prefix],
                                         user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                                         stdout=f, stderr=subprocess.STDOUT)

    async def answered(self, server: Server, sandboxes: list[dsec.AsyncSandbox]) -> None:
        """Until the racer has had an answer from each sandbox's agent (a connection made while
        a guest does not listen yet waits out slirp's SYN retransmission: seconds)."""
        pids = {(server.state_dir / "vms" / sb.id / "qemu.pid").read_text().strip() for sb in sandboxes}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = self.out.read_text().splitlines()[:-1]
            if pids <= {r["pid"] for r in map(json.loads, lines) if r["reply"].startswith("\0")}:
                return
            await asyncio.sleep(0.2)

    def results(self) -> list[dict[str, str]]:
        self.proc.terminate()
        assert self.proc.wait(timeout=60) == -signal.SIGTERM, self.out.read_text()[-2000:]
        lines = self.out.read_text().splitlines()
        return [json.loads(line) for line in lines[:-1]]  # the last may be cut by the kill


def _runtime(server: Server, sandbox_id: str) -> dict[str, object]:
    """The sandbox's runtime facts as the edge keeps them (the token among them)."""
    with sqlite3.connect(f"file:{server.state_dir / 'state.db'}?mode=ro", uri=True) as db:
        (runtime,) = db.execute("SELECT runtime FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
    return json.loads(runtime)


def _token(server: Server, sandbox_id: str) -> str:
    return str(_runtime(server, sandbox_id)["token"])


def _assert_racer_got_nothing(results: list[dict[str, str]], sandboxes: list[dsec.AsyncSandbox],
                              server: Server) -> None:
    """The racer reached each VM's port (so it did race) and was refused everything: no
    claim, no command; every QEMU socket it found was closed to it."""
    answered = [r for r in results if r["what"] in ("claim", "exec") and r["reply"].startswith("\0")]
    pids = {(server.state_dir / "vms" / sb.id / "qemu.pid").read_text().strip() for sb in sandboxes}
    seen = Counter((r["pid"], r["what"], r["reply"][:40]) for r in results)
    assert pids <= {r["pid"] for r in answered}, f"the racer did not reach every agent: {seen}"
    for r in answered:
        assert r["reply"][4] == "X", r  # an error frame, never O (claimed) nor output
        assert ("EPERM" in r["reply"]) if r["what"] == "claim" else ("EACCES" in r["reply"]), r
    unix = [r for r in results if r["what"] == "unix"]
    assert unix and all(r["reply"] == "PermissionError" for r in unix), unix
    for sb in sandboxes:
        pid = int((server.state_dir / "vms" / sb.id / "qemu.pid").read_text())
        token = _token(server, sb.id).encode()
        for leak in (f"/proc/{pid}/cmdline", f"/proc/{pid}/environ"):
            data = Path(leak).read_bytes()
            assert token not in data, leak
        world_readable = [p for p in (server.state_dir / "vms" / sb.id).iterdir()
                          if p.stat().st_mode & 0o004 and token in p.read_bytes()]
        assert world_readable == [] and (server.state_dir / "vms" / sb.id).stat().st_mode & 0o077 == 0


async def _works_and_untouched(sb: dsec.AsyncSandbox) -> None:
    r = await sb.run("hostname; ls /work")
    assert r.exit_code == 0 and r.stdout == f"{sb.id}\n"  # no racer-was-here


async def test_local_user_racing_a_cold_boot_gets_nothing(client, server, tmp_path) -> None:
    racer = Racer(server, tmp_path / "racer.jsonl")
    try:
        sb = await client.create(substrate="microvm", image="debian-minbase", memory_mb=256, ttl_s=300)
        await racer.answered(server, [sb])  # the racer tries the claimed agent too
    finally:
        results = racer.results()
    try:
        await _works_and_untouched(sb)
        _assert_racer_got_nothing(results, [sb], server)
        await _unreachable_from_a_container(client, server, sb)
    finally:
        await sb.stop()
    assert _traces(server, sb.id) == []


async def _unreachable_from_a_container(client: dsec.DSecClient, server: Server,
                                        vm: dsec.AsyncSandbox) -> None:
    """Another sandbox cannot reach the VM's agent port: a container has its own loopback."""
    port = _runtime(server, vm.id)["port"]
    box = await client.create(image="python-3.11", memory_mb=256, ttl_s=120)
    try:
        r = await box.run(["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)"])
        assert r.exit_code != 0 and "ConnectionRefused" in r.stderr, r
    finally:
        await box.stop()


async def test_local_user_racing_snapshot_restores_gets_nothing(tmp_path) -> None:
    srv = make_server("--vm-accel", VM_ACCEL, "--vm-snapshots", "--warm-pool", "0").start()
    racer = Racer(srv, tmp_path / "racer.jsonl")
    try:
        async with srv.client() as client:
            try:  # the first builds the template (saved unclaimed) then restores it; so does the second
                made = [await client.create(substrate="microvm", image="debian-minbase", memory_mb=256)
                        for _ in range(2)]
                await racer.answered(srv, made)
            finally:
                results = racer.results()
            for sb in made:
                await _works_and_untouched(sb)
            assert _token(srv, made[0].id) != _token(srv, made[1].id)
            _assert_racer_got_nothing(results, made, srv)
            for sb in made:
                await sb.stop()
                assert _traces(srv, sb.id) == []
    finally:
        stop_server(srv)


async def test_a_create_whose_agent_is_never_claimed_fails_typed_and_leaks_nothing(
        client, server) -> None:
    """Whatever keeps the edge from claiming a booting agent (here: the boot port is taken
    first, by root, with a message the agent refuses, so it stops the guest), the create
    fails with a typed error that says why, and nothing of the VM is left."""
    before, qemus = set((server.state_dir / "vms").iterdir()), _qemu_pids(server)
    interloper: list[Path] = []

    async def take_the_boot_port() -> None:
        while True:
            for d in set((server.state_dir / "vms").iterdir()) - before:
                if (d / "boot.sock").exists():
                    try:
                        reader, writer = await asyncio.open_unix_connection(str(d / "boot.sock"))
                    except ConnectionRefusedError:  # bound, not listening yet
                        continue
                    writer.write(b"short host 0 0\n")
                    await writer.drain()
                    interloper.append(d)
                    await reader.read()  # the agent's ERR, then QEMU goes
                    writer.close()
                    return
            await asyncio.sleep(0.002)

    grab = asyncio.create_task(take_the_boot_port())
    try:
        with pytest.raises(dsec.SandboxError) as info:
            await client.create(substrate="microvm", image="debian-minbase", memory_mb=256, ttl_s=60)
    finally:
        grab.cancel()
    assert interloper, "the boot port was never seen"
    assert "stopped while booting" in str(info.value) and "boot message" in str(info.value)
    assert set((server.state_dir / "vms").iterdir()) == before and _qemu_pids(server) <= qemus
    assert not [p for p in Path("/sys/fs/cgroup").glob(f"*/dsec-*-microvm/{interloper[0].name}")]


# Run by the sandbox, as root of its guest: replace what a careless edge would run, then go
# for dsec's own path in every way root without the confined capabilities has left.
ATTACK = r"""
import ctypes, glob, hashlib, os, socket, subprocess, time
libc = ctypes.CDLL(None, use_errno=True)
def err(rc):
    return "ok" if rc == 0 else os.strerror(ctypes.get_errno())
def sh(cmd):
    return subprocess.run(["/.dsec/bin/busybox", "sh", "-c", cmd], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True).stdout.strip()
before = hashlib.sha256(open("/.dsec/bin/busybox", "rb").read()).hexdigest()
fake = "#!/.dsec/bin/busybox sh\necho ALL TESTS PASSED; exit 0\n"
for p in ["/usr/bin/tar", "/usr/bin/dash", "/usr/bin/bash", *glob.glob("/usr/local/bin/python3*")]:
    if os.path.lexists(p):
        os.unlink(p); open(p, "w").write(fake); os.chmod(p, 0o755)
print("write=" + sh("echo x > /.dsec/bin/sh"))
print("rm=" + sh("/.dsec/bin/busybox rm -f /.dsec/bin/tar"))
print("remount=" + err(libc.mount(b"none", b"/.dsec", None, 32, None)))  # MS_REMOUNT
print("mount_over=" + err(libc.mount(b"none", b"/.dsec/bin", b"tmpfs", 0, None)))
print("umount=" + err(libc.umount2(b"/.dsec", 2)))  # MNT_DETACH
print("ptrace=" + err(libc.ptrace(16, 1, 0, 0)))  # PTRACE_ATTACH to the agent
try:
    open("/proc/1/mem", "rb"); print("agent_mem=ok")
except OSError as e:
    print("agent_mem=" + e.strerror)
for what, family, kind, proto in (("packet", 17, 3, 768), ("raw", 2, 3, 1)):  # sniff the agent's NIC
    try:
        socket.socket(family, kind, proto); print(what + "=ok")
    except OSError as e:
        print(what + "=" + e.strerror)
print("agent_nic=" + sh("/.dsec/bin/busybox ip addr add 10.0.2.99/24 dev agent0"))
print("init_module=" + err(libc.syscall(175, None, 0, b"")))
print("core_pattern=" + sh("echo '|/work/x' > /proc/sys/kernel/core_pattern"))
open("/usr/sbin/request-key", "w").write("#!/.dsec/bin/busybox sh\n/.dsec/bin/busybox mount -o remount,rw /.dsec "
                                         "&& echo pwned > /.dsec/bin/sh\n")
os.chmod("/usr/sbin/request-key", 0o755)
libc.syscall(249, b"user", b"dsec-hostile", b"callout", -2)  # request_key: the kernel's helper runs
time.sleep(1)
for node in ("/dev/console", "/dev/ttyS0"):  # the console is a file on the host's disk
    try:
        os.write(os.open(node, os.O_WRONLY), b"x" * 100000); print("console=ok")
    except OSError as e:
        print("console=" + e.strerror)
print("mknod=" + err(libc.mknod(b"/tmp/ttyS0", 0o20600, os.makedev(4, 64))))
print("console_level=" + err(libc.klogctl(8, None, 8)))
print("bnd=" + sh("grep CapBnd /proc/self/status").split()[-1])
print("nnp=" + sh("grep NoNewPrivs /proc/self/status").split()[-1])
print("same=" + str(hashlib.sha256(open("/.dsec/bin/busybox", "rb").read()).hexdigest() == before))
"""
CONFINED = {21: "CAP_SYS_ADMIN", 19: "CAP_SYS_PTRACE", 16: "CAP_SYS_MODULE", 17: "CAP_SYS_RAWIO",
            12: "CAP_NET_ADMIN", 13: "CAP_NET_RAW", 39: "CAP_BPF", 27: "CAP_MKNOD", 34: "CAP_SYSLOG"}


@pytest.mark.parametrize("substrate", VM_SUBSTRATES)
async def test_dsec_path_in_a_guest_survives_a_hostile_root(client, server, substrate) -> None:
    sb = await client.create(substrate=substrate, image="python-3.11", memory_mb=512, ttl_s=300)
    try:
        await sb.write_file("/work/attack.py", ATTACK.encode())
        r = await sb.run(["python3", "/work/attack.py"], timeout_s=120)
        got = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        assert r.exit_code == 0, r.stderr
        assert "Read-only file system" in got["write"] and "Read-only file system" in got["rm"]
        assert {got[k] for k in ("remount", "mount_over", "umount", "ptrace", "init_module")} == {
            "Operation not permitted"}, got
        assert got["agent_mem"] == "Permission denied" and got["raw"] == "Operation not permitted"
        # no CAP_NET_RAW; and packet sockets are a module that no one can load
        assert got["packet"] in ("Operation not permitted", "Address family not supported by protocol"), got
        assert "Operation not permitted" in got["agent_nic"] and "Read-only" in got["core_pattern"]
        bounding = int(got["bnd"], 16)
        assert not [name for bit, name in CONFINED.items() if bounding >> bit & 1]
        assert got["nnp"] == "1" and got["same"] == "True"
        assert got["console"] == "No such file or directory"
        assert got["mknod"] == got["console_level"] == "Operation not permitted"
        assert (server.state_dir / "vms" / sb.id / "console.log").stat().st_size < 16384
        # The fakes took /bin/sh's and tar's places; dsec's own shell and tar did not move.
        forged = await sb.run("exit 7")  # a command string runs in dsec's shell, not the faked /bin/sh
        assert (forged.exit_code, forged.stdout) == (7, "")
        assert (await sb.run(["/.dsec/bin/sh", "-c", "exit 7"])).exit_code == 7
        listed = await sb.run(["/.dsec/bin/sh", "-c", "/.dsec/bin/tar -c -f - -C /work . | /.dsec/bin/tar -t"])
        assert "./attack.py" in listed.stdout.splitlines()
        assert (await sb.run(["/.dsec/bin/busybox", "cat", "/.dsec/bin/sh"])).stdout_bytes[:4] == b"\x7fELF"
    finally:
        await sb.stop()
    assert _traces(server, sb.id) == []


# A guest's root trying to fill its console, a file on the host's disk outside the sandbox's
# quota, through the kernel: the kernel's log (emergencies reach every console) and sysrq (its
# output ignores the console's level).
CONSOLE_FLOOD = r"""
import os
try:
    kmsg = os.open("/dev/kmsg", os.O_WRONLY)
    for _ in range(20):
        os.write(kmsg, b"<0>dsec-agent: listening " + b"k" * 400 + b"\n")
    print("kmsg=ok")
except OSError as e:
    print("kmsg=" + e.strerror)
try:
    for _ in range(5):
        with open("/proc/sysrq-trigger", "w") as f:
            f.write("m")  # the kernel's memory report
    print("sysrq=ok")
except OSError as e:
    print("sysrq=" + e.strerror)
with open("/proc/sys/kernel/printk") as f:  # what the kernel itself still prints on it
    print("console_level=" + f.read().split()[0])
"""


@pytest.mark.parametrize("substrate", VM_SUBSTRATES)
async def test_a_guest_cannot_fill_its_console_through_the_kernel(client, server, substrate) -> None:
    sb = await client.create(substrate=substrate, image="python-3.11", memory_mb=256, ttl_s=300)
    try:
        console = server.state_dir / "vms" / sb.id / "console.log"
        booted = console.stat().st_size
        await sb.write_file("/work/flood.py", CONSOLE_FLOOD.encode())
        r = await sb.run(["python3", "/work/flood.py"], timeout_s=120)
        got = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        assert r.exit_code == 0, r.stderr
        assert got["kmsg"] == "No such file or directory"
        assert got["sysrq"] == "Read-only file system"
        assert got["console_level"] == "1"  # emergencies only: not an OOM kill's report
        assert console.stat().st_size == booted  # not a byte since the boot
    finally:
        await sb.stop()


# A local user's fake agent on a port: it reports every byte it receives, then answers `O`.
IMPOSTOR = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(2)
    try:
        print("received", len(c.recv(65536)), flush=True)
    except OSError:
        print("received 0", flush=True)
    c.sendall(b"\0\0\0\1O")
    c.close()
"""


async def test_a_local_user_on_a_dead_vms_port_gets_no_token(client, server) -> None:
    """Once a VM's QEMU has gone, a local user can bind its agent port. The edge's client
    checks who owns the socket it reached (the kernel's sock_diag) before sending anything:
    the impostor receives no byte, so no token, and answers nothing that is believed."""
    sb = await client.create(substrate="microvm", image="debian-minbase", memory_mb=256, ttl_s=300)
    runtime = _runtime(server, sb.id)
    await sb.stop()
    impostor = subprocess.Popen(["/usr/bin/python3", "-c", IMPOSTOR, str(runtime["port"])], user=NOBODY,
                                group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout.readline() == "listening\n"
        agent = QemuSubstrate.agent(None, sb.id, runtime)  # what the edge would use for this VM
        with pytest.raises(AgentUnavailable) as info:
            await agent.run(["true"], env={})
        assert "served by uid 65534" in str(info.value)
        with pytest.raises(AgentUnavailable):
            await agent.ping()
    finally:
        impostor.kill()
    received = impostor.communicate()[0].split()[1::2]  # "received N" per connection made
    assert set(received) <= {"0"}, received


async def test_server_restarts_with_vms_and_their_tokens() -> None:
    """A restarted edge still talks to a VM it claimed (the token is in its state), and the
    VM's agent still refuses a claim from anyone."""
    srv = make_server("--vm-accel", VM_ACCEL, "--warm-pool", "0").start()
    try:
        async with srv.client() as client:
            sb = await client.create(substrate="microvm", image="debian-minbase", memory_mb=256)
        srv.kill(signal.SIGTERM)
        srv.start()
        async with srv.client() as client:
            sb = await client.get(sb.id)
            assert (await sb.run("echo still")).stdout == "still\n"
            await sb.stop()
        deadline = time.monotonic() + 30
        while _traces(srv, sb.id) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert _traces(srv, sb.id) == []
    finally:
        stop_server(srv)

