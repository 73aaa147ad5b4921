"""Network policies: sandboxes reach exactly what their policy allows.

Destinations are test-made network namespaces with TCP servers on their veth addresses
(10.201.0.0/16), wired to the host by the test: nothing outside this host is ever contacted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

import dsec
from conftest import DEST_PORTS as PORTS
from conftest import Server, make_server, pool_filled, stop_server
from dsec.network.hosts import pin_hosts
from dsec.network.testbed import Destination
from dsec.protocol.rules import Destination as Rule
from dsec.protocol.rules import parse_rule


@pytest.fixture(scope="module", autouse=True)
def uplinks_untouched() -> Iterator[None]:
    """The tests only ever allow test-made destinations: the host's other interfaces keep
    their forwarding setting."""
    def forwarding() -> dict[str, str]:
        return {p.parent.name: p.read_text() for p in Path("/proc/sys/net/ipv4/conf").glob("*/forwarding")
                if not p.parent.name.startswith(("dsec", "dth"))}
    before = forwarding()
    yield
    after = forwarding()
    assert {k: v for k, v in after.items() if k in before} == before


@pytest.fixture(scope="module")
def net_server(images, dest: Destination, tmp_path_factory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    table = tmp_path_factory.mktemp("net") / "services.toml"
    table.write_text(f'[services.testsvc]\nallow = ["{dest.address}:{PORTS[0]}"]\n')
    srv = make_server("--capacity", "16", "--network-services", str(table)).start()
    yield srv
    stop_server(srv)


def edge_id(server: Server) -> str:
    with server.http() as http:
        return http.get("/v1/health").json()["edges"][0]["id"]


async def fetch(sb: dsec.AsyncSandbox, address: str, port: int) -> str | None:
    """The server's greeting, or None if the sandbox cannot connect: refused at once, by the
    policy (no route to host) or for want of any network (network is unreachable)."""
    r = await sb.run(["timeout", "20", "bash", "-c",
                      f"exec 3<>/dev/tcp/{address}/{port} && head -c 64 <&3"], timeout_s=60)
    if r.exit_code == 0:
        return r.stdout.strip()
    assert "No route to host" in r.stderr or "Network is unreachable" in r.stderr, r.stderr
    return None


@dataclass
class Traces:
    links: list[str] = field(default_factory=list)
    chains: list[str] = field(default_factory=list)
    elements: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)


def net_traces(edge: str, slots: set[str] = frozenset()) -> Traces:  # type: ignore[assignment]
    """What the host holds of this edge's wiring (links by alias) and of the given slots."""
    t = Traces()
    for link in _ip("link"):
        if link.get("ifalias", "").startswith(edge + "/") or link["ifname"] in slots:
            t.links.append(link["ifname"])
    for link in _ip("-4", "addr"):
        if link["ifname"] in slots:
            t.addresses += [a["local"] for a in link.get("addr_info", [])]
    listing = subprocess.run(["nft", "list", "table", "inet", "dsec"], capture_output=True,
                             text=True).stdout
    for slot in slots:
        n = slot.removeprefix("dsec")
        if f"chain sb{n} " in listing:
            t.chains.append(f"sb{n}")
        if f'"{slot}"' in listing:
            t.elements.append(slot)
    t.netns = [n for n in subprocess.run(["ip", "netns"], capture_output=True, text=True)
               .stdout.split() if n.startswith("dsec")]
    return t


def _ip(*args: str) -> list[dict]:  # type: ignore[type-arg]
    return json.loads(subprocess.run(["ip", "-j", *args], capture_output=True, check=True,
                                     text=True).stdout)


def slot_of(edge: str, sandbox_id: str) -> str:
    for link in _ip("link"):
        if link.get("ifalias") == f"{edge}/{sandbox_id}":
            return link["ifname"]
    raise AssertionError(f"{sandbox_id} has no veth on the host")


def assert_clean(edge: str, slots: set[str]) -> None:
    deadline = time.monotonic() + 30
    while (traces := net_traces(edge, slots)) != Traces() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert traces == Traces()


async def test_default_sandbox_has_no_network(net_server: Server, dest: Destination) -> None:
    async with net_server.client() as client:
        sb = await client.create(ttl_s=120)
        try:
            assert sb.info.network == "none"
            assert (await sb.run("ls /sys/class/net")).stdout.split() == ["lo"]
            assert await fetch(sb, dest.address, PORTS[0]) is None
            assert net_traces(edge_id(net_server)).links == []  # no veth for it
        finally:
            await sb.stop()


async def test_allowed_destination_reachable_others_not(net_server: Server, dest: Destination,
                                                         other: Destination) -> None:
    edge = edge_id(net_server)
    async with net_server.client() as client:
        sb = await client.create(ttl_s=120, network={"allow": [f"{dest.address}:{PORTS[0]}"]})
        slot = slot_of(edge, sb.id)
        try:
            assert sb.info.network == dsec.NetworkPolicy(allow=[f"{dest.address}:{PORTS[0]}"])
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            assert await fetch(sb, dest.address, PORTS[1]) is None  # same host, other port
            assert await fetch(sb, other.address, PORTS[0]) is None  # other host
            gateway = (await sb.run("cat /proc/net/route")).stdout
            assert "eth0" in gateway
            assert await fetch(sb, other.host_side, PORTS[0]) is None  # the host itself
            # a network rule opens every port of every address in it
            await sb.set_network({"allow": [dest.network]})
            assert await fetch(sb, dest.address, PORTS[1]) == f"hello-{PORTS[1]}"
            assert await fetch(sb, other.address, PORTS[1]) is None
        finally:
            await sb.stop()
        assert_clean(edge, {slot})


async def test_sandboxes_never_reach_each_other(net_server: Server) -> None:
    edge = edge_id(net_server)
    async with net_server.client() as client:
        server = await client.create(image="python-3.11", ttl_s=120, network={"allow": []})
        n = int(slot_of(edge, server.id).removeprefix("dsec"))
        address = str(ipaddress.IPv4Address("10.200.0.0") + 4 * n + 2)
        # (its exact address: a wider rule would be routed by the host's uplink, and switch
        # forwarding on there, on a shared test host)
        peer = await client.create(ttl_s=120, network={"allow": [address]})
        try:
            await server.start("python3 -m http.server 8001")
            deadline = time.monotonic() + 60
            while "8001" not in (await server.run("cat /proc/net/tcp")).stdout.upper().replace(
                    "1F41", "8001"):
                assert time.monotonic() < deadline, "the server in the sandbox did not listen"
                await asyncio.sleep(0.2)
            assert await fetch(peer, address, 8001) is None
        finally:
            await server.stop()
            await peer.stop()


async def test_named_service_allowed_and_blocked(net_server: Server, dest: Destination) -> None:
    async with net_server.client() as client:
        on = await client.create(ttl_s=120, network={"testsvc": True})
        off = await client.create(ttl_s=120, network={"testsvc": False})
        try:
            assert await fetch(on, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            assert await fetch(on, dest.address, PORTS[1]) is None  # not in the service
            assert await fetch(off, dest.address, PORTS[0]) is None
            with pytest.raises(dsec.InvalidRequest, match="unknown network service"):
                await client.create(ttl_s=60, network={"no-such-service": True})
            # the operator edits the table: the next policy applied sees the change
            table = net_server.args[net_server.args.index("--network-services") + 1]
            text = Path(table).read_text()
            Path(table).write_text(text + f'[services.second]\nallow = ["{dest.address}:{PORTS[1]}"]\n')
            try:
                await off.set_network({"second": True})
                assert await fetch(off, dest.address, PORTS[1]) == f"hello-{PORTS[1]}"
                assert await fetch(off, dest.address, PORTS[0]) is None
            finally:
                Path(table).write_text(text)
        finally:
            await on.stop()
            await off.stop()


async def test_set_network_flips_reachability(net_server: Server, dest: Destination) -> None:
    edge = edge_id(net_server)
    rule = f"{dest.address}:{PORTS[0]}"
    async with net_server.client() as client:
        sb = await client.create(ttl_s=120)
        try:
            assert await fetch(sb, dest.address, PORTS[0]) is None
            info = await sb.set_network([rule])
            assert info.network == dsec.NetworkPolicy(allow=[rule])
            assert (await client.get(sb.id)).info.network == info.network
            first_slot = slot_of(edge, sb.id)
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            await sb.set_network({"allow": []})  # wired, nothing allowed
            assert await fetch(sb, dest.address, PORTS[0]) is None
            await sb.set_network({"testsvc": True})
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            # concurrent changes are applied one at a time: never two veths for one sandbox
            await asyncio.gather(*(sb.set_network(p) for p in ([rule], {"testsvc": True}, "none",
                                                                 [rule], {"allow": [rule]})))
            await sb.set_network([rule])
            mine = [link["ifname"] for link in _ip("link")
                    if link.get("ifalias") == f"{edge}/{sb.id}"]
            assert len(mine) == 1
            slot = mine[0]
            await sb.set_network("none")  # back to loopback only, the veth goes
            assert (await sb.run("ls /sys/class/net")).stdout.split() == ["lo"]
            assert_clean(edge, {slot, first_slot})
            assert (await client.get(sb.id)).info.network == "none"
        finally:
            await sb.stop()


async def test_a_rollback_wires_the_current_policy_into_the_new_init(
        net_server: Server, dest: Destination) -> None:
    """The policy is the sandbox's, not its snapshot's: a rollback kills the init whose
    namespace held the wiring, and the restarted one is wired with the policy in force."""
    edge = edge_id(net_server)
    async with net_server.client() as client:
        sb = await client.create(ttl_s=120, network={"allow": [f"{dest.address}:{PORTS[0]}"]})
        slots = {slot_of(edge, sb.id)}
        try:
            snap = await sb.snapshot()
            await sb.rollback(snap)
            slots.add(slot_of(edge, sb.id))
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            assert await fetch(sb, dest.address, PORTS[1]) is None
            await sb.set_network({"allow": [dest.network]})
            await sb.rollback(snap)
            slots.add(slot_of(edge, sb.id))
            assert await fetch(sb, dest.address, PORTS[1]) == f"hello-{PORTS[1]}"
            mine = [link for link in _ip("link") if link.get("ifalias") == f"{edge}/{sb.id}"]
            assert len(mine) == 1  # the old init's veth went with it
            await client.delete_snapshot(snap.id)
        finally:
            await sb.stop()
        assert_clean(edge, slots)


async def test_host_names_are_pinned_in_etc_hosts(net_server: Server, dest: Destination) -> None:
    async with net_server.client() as client:
        sb = await client.create(ttl_s=120, network={"allow": ["localhost:9"]})
        try:
            hosts = (await sb.read_file("/etc/hosts")).decode()
            assert "127.0.0.1\tlocalhost" in hosts.split("network policy: begin")[1]
            await sb.set_network({"allow": [f"{dest.address}:9"]})
            assert "network policy" not in (await sb.read_file("/etc/hosts")).decode()
        finally:
            await sb.stop()


def test_sync_client_set_network(net_server: Server, dest: Destination) -> None:
    with dsec.Client(net_server.url, net_server.key, autostart=False) as client:
        with client.create(ttl_s=120) as sb:
            sb.set_network({"testsvc": True})
            r = sb.run(["bash", "-c", f"exec 3<>/dev/tcp/{dest.address}/{PORTS[0]} && head <&3"],
                       timeout_s=60)
            assert r.stdout.strip() == f"hello-{PORTS[0]}"


@pytest.mark.parametrize("network", [
    "all", {"allow": ["10.0.0.1:0"]}, {"allow": ["10.0.0.999"]}, {"allow": ["10.0.0.1/24"]},
    {"allow": ["::1"]}, {"allow": ["10.0.0.0/8:80"]}, {"pypi": "yes"}, {"allow": "10.0.0.1"},
])
async def test_invalid_policy_is_refused(net_server: Server, network: object) -> None:
    async with net_server.client() as client:
        with pytest.raises(dsec.InvalidRequest):
            await client.create(ttl_s=60, network=network)
        sb = await client.create(ttl_s=60)
        try:
            with pytest.raises(dsec.InvalidRequest):
                await sb.set_network(network)
        finally:
            await sb.stop()
    with net_server.http(authenticated=True) as http:  # the server checks too, not only the SDK
        r = http.post("/v1/sandboxes", json={"network": network, "ttl_s": 60})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


async def test_unresolvable_host_is_refused(net_server: Server) -> None:
    async with net_server.client() as client:
        with pytest.raises(dsec.InvalidRequest, match="cannot resolve"):
            await client.create(ttl_s=60, network={"allow": ["no-such-host.invalid:443"]})


async def test_warm_pool_sandbox_wired_at_claim(net_server: Server, dest: Destination) -> None:
    async with net_server.client() as client:
        await (await client.create(ttl_s=60)).stop()  # the image gets a warm pool
        await pool_filled(client, "container")
        sb = await client.create(ttl_s=120, network={"testsvc": True})
        try:
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
        finally:
            await sb.stop()


async def test_failed_create_leaves_nothing(net_server: Server) -> None:
    """runsc has its own network stack: a policy fails after the sandbox started."""
    edge = edge_id(net_server)

    def sandboxes() -> set[str]:
        dirs = {p.name for p in (net_server.volume / "sandboxes").iterdir()}
        return dirs | {p.name for p in Path("/sys/fs/cgroup").glob(f"*/dsec-{edge}/*") if p.is_dir()}

    before = sandboxes()
    async with net_server.client() as client:
        with pytest.raises(dsec.NotSupported, match="runsc"):
            await client.create(ttl_s=60, runtime="runsc", network={"testsvc": True})
    assert sandboxes() <= before  # earlier tests' stopped sandboxes may still be going
    assert net_traces(edge) == Traces()


async def test_nothing_left_when_a_wired_sandbox_dies(net_server: Server) -> None:
    edge = edge_id(net_server)
    async with net_server.client() as client:
        sb = await client.create(ttl_s=120, network={"testsvc": True})
        slot = slot_of(edge, sb.id)
        os.kill(int((net_server.volume / "sandboxes" / sb.id / "pid").read_text()),
                signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (await sb.refresh()).state != "died":
            assert time.monotonic() < deadline, "the death was not noticed"
            await asyncio.sleep(0.1)
    assert_clean(edge, {slot})


async def test_nothing_leaks_after_kill9_and_restart(images, dest: Destination) -> None:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "8", "--warm-pool", "0").start()
    try:
        edge = edge_id(srv)
        policy = {"allow": [f"{dest.address}:{PORTS[0]}"]}
        async with srv.client() as client:
            kept = await client.create(ttl_s=300, network=policy)
            dying = await client.create(ttl_s=300, network=policy)
        slots = {slot_of(edge, kept.id), slot_of(edge, dying.id)}
        srv.kill(signal.SIGKILL)
        # While the edge is down, one sandbox dies: its netns and veth go with it, its rules
        # stay until the restarted edge sweeps them.
        os.kill(int((srv.volume / "sandboxes" / dying.id / "pid").read_text()), signal.SIGKILL)
        srv.start()
        async with srv.client() as client:
            adopted = await client.get(kept.id)
            assert await fetch(adopted, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            assert await fetch(adopted, dest.address, PORTS[1]) is None
            assert net_traces(edge, {slot_of(edge, kept.id)}).chains  # still enforced
            await adopted.stop()
        assert_clean(edge, slots)
    finally:
        stop_server(srv)


def test_rule_grammar() -> None:
    assert parse_rule("10.1.2.3:443") == Rule("10.1.2.3", 443)
    assert parse_rule("192.168.0.0/24") == Rule("192.168.0.0/24")
    assert parse_rule("10.1.2.3") == Rule("10.1.2.3")
    assert parse_rule("Files.PythonHosted.org.:443") == Rule("files.pythonhosted.org", 443)
    for bad in ("", "10.1.2.3:", "10.1.2.3:65536", "host:x", "10.0.0.0/33", "fe80::1",
                "[::1]:443", "-bad-.com:80", "10.1.2.3.4", "a b:80"):
        with pytest.raises(ValueError):
            parse_rule(bad)


def test_etc_hosts_block_is_replaced_not_appended() -> None:
    image = b"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n"
    pinned = pin_hosts(image, (("pypi.org", "151.101.0.223"),))
    assert pinned.startswith(image) and b"151.101.0.223\tpypi.org" in pinned
    again = pin_hosts(pinned, (("npm.org", "1.2.3.4"),))
    assert b"pypi.org" not in again and again.count(b"network policy: begin") == 1
    assert pin_hosts(again, ()) == image
