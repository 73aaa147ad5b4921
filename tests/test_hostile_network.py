"""Hostile sandboxes against network policies (issue 12, items 12, 13 and 15).

A policy change holds for every packet from the moment ``set_network`` returns: flows the new
policy forbids are cut, in both directions, on containers and on a microVM. A sandbox cannot
make a policy change fail or half-apply through the files it owns (/etc/hosts,
/etc/resolv.conf, /etc/nsswitch.conf). A policy leaves the host's forwarding settings as it
found them. A sandbox with a narrow policy reaches nothing else: not the host, not another
sandbox, not a metadata address, not over IPv6, ICMP or DNS.

Destinations are test-made network namespaces (``dsec.network.testbed``) and loopback only.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from pyroute2 import Conntrack
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

import dsec
from conftest import VM_ACCEL, Server, make_server, stop_server
from dsec.network.testbed import Destination
from dsec.network.wiring import Slot
from test_network import PORTS, edge_id, fetch, slot_of

PROBE = Path(__file__).parent / "support" / "hostile_net_probe.py"
ECHO_PORT = 8000
# On a destination: TCP and UDP echo on ECHO_PORT; a UDP "sub" makes the server push "tick"
# to that flow every 50 ms (what a destination that keeps talking to a cut flow would do).
ECHO = """
import socket, sys, threading, time
address, port = sys.argv[1], int(sys.argv[2])
def echo(c):
    while (data := c.recv(4096)):
        c.sendall(data)
def tcp():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port)); s.listen(64)
    while True:
        threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()
def tick(u, peer):
    for _ in range(2400):
        try:
            u.sendto(b"tick", peer)
        except OSError:
            pass
        time.sleep(0.05)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((address, port))
threading.Thread(target=tcp, daemon=True).start()
print("ready", flush=True)
while True:
    data, peer = u.recvfrom(4096)
    if data == b"sub":
        threading.Thread(target=tick, args=(u, peer), daemon=True).start()
    else:
        u.sendto(data, peer)
"""


def _echo(d: Destination) -> Iterator[None]:
    proc = subprocess.Popen(["ip", "netns", "exec", d.ns, sys.executable, "-c", ECHO, d.address,
                             str(ECHO_PORT)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        yield
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def echo_a(dest: Destination) -> Iterator[None]:
    yield from _echo(dest)


@pytest.fixture(scope="module")
def echo_b(other: Destination) -> Iterator[None]:
    yield from _echo(other)


@pytest.fixture(scope="module")
def hnet_server(images) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    srv = make_server("--vm-accel", VM_ACCEL, "--warm-pool", "0").start()
    yield srv
    stop_server(srv)


def _create_options(substrate: str) -> dict[str, object]:
    return {"substrate": substrate, "image": "python-3.11", "ttl_s": 600,
            "memory_mb": 512 if substrate == "microvm" else 256}


async def _phase(sb: dsec.AsyncSandbox, n: int) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 120
    while True:
        try:
            return json.loads(await sb.read_file(f"/tmp/phase{n}.json"))
        except dsec.FileNotFound:
            assert time.monotonic() < deadline, f"the probe did not finish phase {n}"
            await asyncio.sleep(0.2)


# --- item 12: narrowing a policy cuts the flows it forbids ---------------------------------

@pytest.mark.parametrize("substrate", ["container", "microvm"])
async def test_narrowing_cuts_open_flows(hnet_server: Server, dest: Destination, other: Destination,
                                         echo_a, echo_b, substrate: str) -> None:  # type: ignore[no-untyped-def]
    """An open TCP flow, an open UDP flow, a flow the destination keeps pushing into, and a
    new socket on the old source port: all cut when the policy narrows; all kept when it
    widens (only what the new policy forbids is cut)."""
    a, b = f"{dest.address}:{ECHO_PORT}", f"{other.address}:{ECHO_PORT}"
    async with hnet_server.client() as client:
        sb = await client.create(**_create_options(substrate), network={"allow": [a]})
        try:
            await sb.write_file("/tmp/probe.py", PROBE.read_bytes())
            await sb.start(["python3", "/tmp/probe.py", "flows", dest.address, str(ECHO_PORT)])
            opened = await _phase(sb, 0)
            assert all(opened["tcp"]) and all(opened["udp"]) and opened["ticks"] > 10, opened

            await sb.set_network({"allow": [a, b]})  # widened: A's flows are still allowed
            await sb.write_file("/tmp/go1", b"")
            kept = await _phase(sb, 1)
            assert all(kept["tcp"]) and all(kept["udp"]) and kept["ticks"] > 10, kept

            # narrowed: from now on, nothing of A's echo port (A's other port stays allowed,
            # so the host still forwards from A's link: only the policy can cut the flows)
            await sb.set_network({"allow": [b, f"{dest.address}:{PORTS[0]}"]})
            await sb.write_file("/tmp/go2", b"")
            cut = await _phase(sb, 2)
            assert cut == {"tcp": [False] * 3, "udp": [False] * 3, "ticks": 0,
                           "old_port": [False] * 3, "new_tcp": False}, cut
            # the new policy itself is in force
            r = await sb.run(["python3", "-c", "import socket; s = socket.create_connection("
                              f"('{other.address}', {ECHO_PORT}), timeout=5); s.sendall(b'hi');"
                              " print(s.recv(2).decode())"], timeout_s=60)
            assert r.stdout == "hi\n", r.stderr

            # back to none: no flow of its address is left for a later holder of its slot
            owner = edge_id(hnet_server) if substrate == "container" else f"{substrate}@{edge_id(hnet_server)}"
            address = Slot(int(slot_of(owner, sb.id).removeprefix("dsec"))).sandbox_address
            assert await asyncio.to_thread(_flows_from, address) != []
            await sb.set_network("none")
            assert await asyncio.to_thread(_flows_from, address) == []
        finally:
            await sb.stop()


# --- item 13: the sandbox's own files cannot make a policy change fail or half-apply -------

async def greeting(sb: dsec.AsyncSandbox, address: str) -> str:
    """A test destination's greeting, fetched without the sandbox's resolver (which the
    sabotage below breaks for the sandbox's own tools: a FIFO nsswitch.conf hangs them)."""
    r = await sb.run(["python3", "-c", "import socket, sys\n"
                      "s = socket.socket(); s.settimeout(10)\n"
                      f"try: s.connect(('{address}', {PORTS[0]}))\n"
                      "except OSError: sys.exit('refused')\n"
                      "print(s.recv(64).decode().strip())"], timeout_s=60)
    return r.stdout.strip() or r.stderr.strip()


SABOTAGE = {
    "hosts is a directory": "rm -f /etc/hosts && mkdir /etc/hosts",
    "hosts is a FIFO": "rm -rf /etc/hosts && mkfifo /etc/hosts",
    "hosts is a symlink to a host path": "rm -rf /etc/hosts && ln -s {canary} /etc/hosts",
    "hosts is huge": "rm -rf /etc/hosts && head -c 3000000 /dev/zero | tr '\\0' '#' > /etc/hosts",
    "hosts is the kernel's memory": "rm -rf /etc/hosts && ln -s /proc/kcore /etc/hosts",
    "resolver files are dirs and FIFOs": "rm -rf /etc/hosts /etc/resolv.conf /etc/nsswitch.conf"
                                         " && mkdir /etc/resolv.conf && mkfifo /etc/nsswitch.conf"
                                         " && ln -s /proc/self/fd/0 /etc/hosts",
}


@pytest.mark.parametrize("substrate", ["container", "microvm"])
async def test_sandbox_files_cannot_break_a_policy_change(hnet_server: Server, dest: Destination,
                                                          other: Destination, tmp_path: Path,
                                                          substrate: str) -> None:
    """Built: host names are resolved on the host; the /etc/hosts pins are a convenience
    written after the rules are in force, bounded in size and time, whose failure is only
    logged. So each change succeeds fully (rules, info.network) whatever the sandbox did to
    its files; a change that cannot be applied (an unresolvable name) is a typed error that
    leaves the previous policy in force and recorded."""
    canary = tmp_path / "host-canary"
    canary.write_text("host file\n")
    to_a = {"allow": ["localhost:9", f"{dest.address}:{PORTS[0]}"]}
    to_b = {"allow": ["localhost:9", f"{other.address}:{PORTS[0]}"]}
    async with hnet_server.client() as client:
        sb = await client.create(**_create_options(substrate), network=to_a)
        try:
            for i, (what, script) in enumerate(SABOTAGE.items()):
                r = await sb.run(script.format(canary=canary), timeout_s=60)
                assert r.exit_code == 0, (what, r.stderr)
                policy, reached, refused = (to_b, other, dest) if i % 2 == 0 else (to_a, dest, other)
                started = time.monotonic()
                info = await sb.set_network(policy)
                assert time.monotonic() - started < 30, what
                assert info.network == dsec.NetworkPolicy(**policy), what
                assert (await client.get(sb.id)).info.network == info.network, what
                assert await greeting(sb, reached.address) == f"hello-{PORTS[0]}", what
                assert await greeting(sb, refused.address) == "refused", what

                with pytest.raises(dsec.InvalidRequest):  # cannot apply: nothing changes
                    await sb.set_network({"allow": ["no-such-host.invalid:80",
                                                    f"{refused.address}:{PORTS[0]}"]})
                assert (await client.get(sb.id)).info.network == info.network, what
                assert await greeting(sb, reached.address) == f"hello-{PORTS[0]}", what
                assert await greeting(sb, refused.address) == "refused", what
            assert canary.read_text() == "host file\n"
            assert (await sb.run("echo alive")).stdout == "alive\n"
        finally:
            await sb.stop()


# --- item 15: a policy leaves the host's forwarding settings as it found them ---------------

def _forwarding() -> dict[str, str]:
    """The host's forwarding sysctls: global, default, and each interface that is neither
    dsec's (``dsec*``) nor a test destination's (``dth*``: other tests make and drop them)."""
    found = {"ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text()}
    for family in ("ipv4", "ipv6"):
        for p in Path(f"/proc/sys/net/{family}/conf").glob("*/forwarding"):
            if not p.parent.name.startswith(("dsec", "dth")):
                found[f"{family} {p.parent.name}"] = p.read_text()
    return found


def _link_forwarding(d: Destination) -> str:
    return Path(f"/proc/sys/net/ipv4/conf/{d.link}/forwarding").read_text().strip()


async def test_host_forwarding_settings_are_restored(images, dest: Destination,  # type: ignore[no-untyped-def]
                                                     other: Destination) -> None:
    before = _forwarding()
    assert _link_forwarding(dest) == _link_forwarding(other) == "0"
    srv = make_server("--warm-pool", "0").start()
    try:
        async with srv.client() as client:
            sb = await client.create(ttl_s=600, network={"allow": [f"{dest.address}:{PORTS[0]}"]})
            # replies come in on the destination's link: it forwards while a rule needs it
            assert (_forwarding(), _link_forwarding(dest), _link_forwarding(other)) == (before, "1", "0")
            await sb.set_network({"allow": [f"{other.address}:{PORTS[0]}"]})
            assert (_forwarding(), _link_forwarding(dest), _link_forwarding(other)) == (before, "0", "1")
            await sb.set_network("none")
            assert (_forwarding(), _link_forwarding(dest), _link_forwarding(other)) == (before, "0", "0")
            await sb.set_network({"allow": [dest.address]})
            assert _link_forwarding(dest) == "1"
            await sb.stop()
            assert (_forwarding(), _link_forwarding(dest)) == (before, "0")
            # a sandbox outlives its edge, and so does what its policy needs, until it ends
            kept = await client.create(ttl_s=600, network={"allow": [f"{dest.address}:{PORTS[0]}"]})
            assert await fetch(kept, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
        srv.kill(signal.SIGTERM)
        assert (_forwarding(), _link_forwarding(dest)) == (before, "1")
    finally:
        stop_server(srv)  # a fresh edge stops what was left
    assert (_forwarding(), _link_forwarding(dest), _link_forwarding(other)) == (before, "0", "0")


# --- beyond: a narrow policy reaches nothing else ------------------------------------------

class Listener:
    """A TCP listener on all the host's addresses (IPv4 and IPv6), counting connections."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.sock.bind(("::", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[object] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.accepted.append(peer)
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _ipv6_link_local(link: str) -> str | None:
    out = subprocess.run(["ip", "-6", "-o", "addr", "show", "dev", link, "scope", "link"],
                         capture_output=True, text=True).stdout.split()
    return out[3].split("/")[0] if len(out) > 3 else None


async def _host_loopback_via_gateway(sb: dsec.AsyncSandbox, gateway: str, port: int) -> str:
    """A guest tries to route 127.0.0.0/8 out of its NIC to the host and connect to 127.0.0.1.
    Its commands run confined (no CAP_NET_ADMIN, /proc/sys read-only), so each step is refused
    and the connection stays on the guest's own loopback."""
    bb = "/.dsec/bin/busybox"
    r = await sb.run(f"echo 1 > /proc/sys/net/ipv4/conf/all/route_localnet; "
                     f"echo 1 > /proc/sys/net/ipv4/conf/eth0/route_localnet; "
                     f"{bb} ip route del local 127.0.0.0/8 dev lo table local; "
                     f"{bb} ip route del local 127.0.0.1 dev lo table local; "
                     f"{bb} ip route add 127.0.0.0/8 via {gateway} dev eth0; "
                     "python3 -c \"import socket\n"
                     "try:\n"
                     f"    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
                     "    print('through')\n"
                     "except OSError as e:\n"
                     "    print('blocked')\"", timeout_s=120)
    assert "Read-only file system" in r.stderr and "Operation not permitted" in r.stderr, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("substrate", ["container", "microvm"])
async def test_narrow_policy_reaches_nothing_else(hnet_server: Server, dest: Destination,
                                                  other: Destination, echo_a, substrate: str) -> None:  # type: ignore[no-untyped-def]
    """Allowed: A's echo port only. The host (through the sandbox's gateway, the host side of
    a test destination, its loopback), another sandbox, a metadata-style address, A's other
    ports, IPv6, ICMP, DNS to A and to the gateway: nothing answers, nothing is accepted."""
    listener = Listener()
    owner = edge_id(hnet_server) if substrate == "container" else f"{substrate}@{edge_id(hnet_server)}"
    try:
        async with hnet_server.client() as client:
            sb = await client.create(**_create_options(substrate),
                                     network={"allow": [f"{dest.address}:{ECHO_PORT}"]})
            bystander = await client.create(ttl_s=600, network={"allow": [f"{dest.address}:{ECHO_PORT}"]})
            try:
                gateway = Slot(int(slot_of(owner, sb.id).removeprefix("dsec"))).host_address
                neighbour_slot = Slot(int(slot_of(edge_id(hnet_server), bystander.id).removeprefix("dsec")))
                port = listener.port
                plan = {
                    "tcp": [[gateway, port], [dest.host_side, port], ["127.0.0.1", port],
                            [neighbour_slot.sandbox_address, port], [neighbour_slot.host_address, port],
                            ["169.254.169.254", 80], [dest.address, PORTS[0]],
                            [other.address, PORTS[0]]],
                    "dns": [[dest.address, 53], [gateway, 53], [other.address, 53]],
                    "ping": [gateway, dest.address, other.address, "169.254.169.254"],
                    "tcp6": [[f"{ll}%eth0", port] for ll in
                             filter(None, [_ipv6_link_local(slot_of(owner, sb.id))])] + [["::1", port]],
                }
                await sb.write_file("/tmp/probe.py", PROBE.read_bytes())
                r = await sb.run(["python3", "/tmp/probe.py", "escape", json.dumps(plan)], timeout_s=300)
                assert r.exit_code == 0, r.stderr
                got = json.loads(r.stdout)
                through = {k: v for k, v in got.items() if v and k != "raw_socket"}
                assert through == {}, got
                if substrate == "container":
                    assert got["raw_socket"] is False  # no CAP_NET_RAW
                assert listener.accepted == []
                # the allowed destination still answers: the policy itself works
                r = await sb.run(["python3", "-c", "import socket; s = socket.create_connection("
                                  f"('{dest.address}', {ECHO_PORT}), timeout=5); s.sendall(b'ok');"
                                  " print(s.recv(2).decode())"], timeout_s=60)
                assert r.stdout == "ok\n", r.stderr
                if substrate == "microvm":  # root in its kernel: the host's loopback, by the gateway
                    assert await _host_loopback_via_gateway(sb, gateway, port) == "blocked"
                    assert listener.accepted == []
                # the bystander next door still works, its own policy included
                r = await bystander.run(["bash", "-c", f"exec 3<>/dev/tcp/{dest.address}/{ECHO_PORT}"
                                         " && echo -n by >&3 && head -c 2 <&3"], timeout_s=60)
                assert r.stdout == "by", r.stderr
            finally:
                await sb.stop()
                await bystander.stop()
    finally:
        listener.close()


def _flows_from(address: str) -> list[object]:
    """The host's conntrack entries whose original source is ``address``."""
    with Conntrack() as ct:
        return list(ct.dump_entries(tuple_orig=NFCTAttrTuple(saddr=address)))


@pytest.mark.parametrize("substrate", ["microvm"])
async def test_guest_forging_its_source_is_dropped(hnet_server: Server, dest: Destination,
                                                   echo_a, substrate: str) -> None:  # type: ignore[no-untyped-def]
    """A VM's guest is root in its own kernel: it tries to give its NIC another address and
    MAC and send from there, to an allowed destination. Its commands run without
    CAP_NET_ADMIN, so the guest refuses; and no flow of the forged source reaches the host
    (behind that, the host's chain drops any source but the sandbox's own)."""
    async with hnet_server.client() as client:
        sb = await client.create(**_create_options(substrate),
                                 network={"allow": [f"{dest.address}:{ECHO_PORT}"]})
        try:
            gateway = Slot(int(slot_of(f"microvm@{edge_id(hnet_server)}", sb.id)
                               .removeprefix("dsec"))).host_address
            # another sandbox's address, say: whoever it is, nothing from it may pass
            forged = Slot(secrets.randbelow(16000) + 1).sandbox_address
            busybox = "/.dsec/bin/busybox"
            r = await sb.run(f"{busybox} ip link set eth0 address 52:54:00:aa:bb:cc && "
                             f"{busybox} ip addr flush dev eth0 && "
                             f"{busybox} ip addr add {forged}/16 dev eth0 && "
                             f"{busybox} ip route replace default via {gateway} dev eth0 && "
                             "python3 -c \"import socket\n"
                             f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'sub', ('{dest.address}', {ECHO_PORT}))\"",
                             timeout_s=120)
            # the guest's commands run without CAP_NET_ADMIN: the forging is refused in the guest
            assert r.exit_code != 0 and "Operation not permitted" in r.stderr, (r.stdout, r.stderr)
            # and the host forwarded nothing from it: no flow of the forged source exists
            assert await asyncio.to_thread(_flows_from, forged) == []
        finally:
            await sb.stop()
