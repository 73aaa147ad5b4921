"""Network policies on VM sandboxes (microvm, vm): the same rules as containers, on a second
NIC that a tap on the host connects only while a policy is set.

One VM per substrate goes through every step (a boot under emulation takes a while):
created with a policy, its policy replaced and removed while it runs, set again from none,
its edge killed and restarted, stopped; nothing of its wiring is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from typing import Iterator

import pytest

import dsec
from conftest import (
    VM_ACCEL,
    VM_SUBSTRATES,
    Server,
    make_server,
    pool_filled,
    scrape,
    stop_server,
)
from dsec.network.testbed import Destination
from dsec.network.wiring import Slot
from dsec.substrates.vm.guest import AGENT_PORT
from test_network import (
    PORTS,
    Traces,
    assert_clean,
    edge_id,
    fetch,
    net_traces,
    slot_of,
)


@pytest.fixture(scope="module")
def vm_server(images, dest: Destination, tmp_path_factory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    table = tmp_path_factory.mktemp("net") / "services.toml"
    table.write_text(f'[services.testsvc]\nallow = ["{dest.address}:{PORTS[0]}"]\n')
    srv = make_server("--vm-accel", VM_ACCEL, "--warm-pool", "0",
                      "--network-services", str(table)).start()
    yield srv
    stop_server(srv)


async def tcp_listeners(sb: dsec.AsyncSandbox, port: int) -> set[str]:
    """The addresses the guest listens on for TCP ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in (await sb.run("cat /proc/net/tcp")).stdout.splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, listening = local.split(":")
        if state == "0A" and int(listening, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@pytest.mark.parametrize("substrate", VM_SUBSTRATES)
async def test_vm_reaches_exactly_what_its_policy_allows(vm_server: Server, dest: Destination,
                                                         other: Destination, substrate: str) -> None:
    owner = f"{substrate}@{edge_id(vm_server)}"  # the links' alias prefix (not the containers')
    slots: set[str] = set()
    async with vm_server.client() as client:
        sb = await client.create(substrate=substrate, image="debian-minbase", memory_mb=256,
                                 ttl_s=900, network={"allow": [f"{dest.address}:{PORTS[0]}"]})
        try:
            slots.add(slot_of(owner, sb.id))
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            assert await fetch(sb, dest.address, PORTS[1]) is None
            await sb.pause()  # saved to disk, QEMU gone: the resumed one is plugged again
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            snap = await sb.snapshot()  # a rollback boots again: plugged and set up again
            await sb.rollback(snap)
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            assert await fetch(sb, dest.address, PORTS[1]) is None
            await client.delete_snapshot(snap.id)
            # A `full` snapshot's child (the parent's eth0 set-up in its memory) is wired in
            # its own slot, to its own policy.
            snap = await sb.snapshot(mode="full")
            child = await client.create(snapshot=snap.id, ttl_s=300,
                                        network={"allow": [f"{other.address}:{PORTS[0]}"]})
            try:
                slots.add(slot_of(owner, child.id))
                assert slot_of(owner, child.id) != slot_of(owner, sb.id)
                assert await fetch(child, other.address, PORTS[0]) == f"hello-{PORTS[0]}"
                assert await fetch(child, dest.address, PORTS[0]) is None
                assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            finally:
                await child.stop()
            await client.delete_snapshot(snap.id)
            # the agent listens on its own link only: over the policy NIC, nothing answers
            # (nor could it: the guest's packets to the host are judged by its policy too)
            guest = Slot(int(slot_of(owner, sb.id).removeprefix("dsec"))).sandbox_address
            listening = await tcp_listeners(sb, AGENT_PORT)
            assert listening and {"0.0.0.0", guest}.isdisjoint(listening), listening
            with pytest.raises(OSError):
                socket.create_connection((guest, AGENT_PORT), timeout=3).close()
            assert await fetch(sb, other.address, PORTS[0]) is None
            # the agent's link (QEMU user networking) still routes nowhere but its subnet
            routes = (await sb.run("cat /proc/net/route")).stdout
            assert [line.split()[0] for line in routes.splitlines()[1:] if line.split()[1] == "00000000"] == ["eth0"]

            await sb.set_network({"allow": [other.address]})  # replaced while it runs
            assert await fetch(sb, other.address, PORTS[1]) == f"hello-{PORTS[1]}"
            assert await fetch(sb, dest.address, PORTS[0]) is None

            await sb.set_network("none")  # unplugged: the host keeps nothing of it
            assert await fetch(sb, other.address, PORTS[1]) is None
            assert net_traces(owner, slots) == Traces()
            assert (await sb.refresh()).network == "none"

            await sb.set_network({"testsvc": True})  # plugged in again, from none
            slots.add(slot_of(owner, sb.id))
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            assert await fetch(sb, other.address, PORTS[1]) is None

            # A restarted edge finds the VM's wiring again (the rules live in the kernel).
            vm_server.kill(signal.SIGKILL)
            vm_server.start()
            async with vm_server.client() as again:
                sb = await again.get(sb.id)
                assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
                await sb.set_network({"allow": [other.address]})
                assert await fetch(sb, other.address, PORTS[0]) == f"hello-{PORTS[0]}"
                assert await fetch(sb, dest.address, PORTS[0]) is None
        finally:
            async with vm_server.client() as last:
                await (await last.get(sb.id)).stop()
    assert_clean(owner, slots)
    assert not [line for line in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True)
                .stdout.splitlines() if "dsectmp" in line]


async def test_pooled_restored_microvm_is_wired_at_claim(images, dest: Destination) -> None:  # type: ignore[no-untyped-def]
    """A VM from the warm pool, restored from a snapshot (its NICs came with the template's
    memory), gets its policy when a create claims it."""
    srv = make_server("--vm-accel", VM_ACCEL, "--vm-snapshots", "--vm-warm-pool", "1",
                      "--warm-pool", "0").start()
    try:
        owner = f"microvm@{edge_id(srv)}"
        async with srv.client() as client:
            await (await client.create(substrate="microvm", memory_mb=256)).stop()  # pool fills
            await pool_filled(client, "microvm")
            sb = await client.create(substrate="microvm", memory_mb=256,
                                     network={"allow": [f"{dest.address}:{PORTS[0]}"]})
            assert scrape(srv)["dsec_create_seconds_count{source=warm,substrate=microvm}"] == 1
            slot = slot_of(owner, sb.id)
            assert await fetch(sb, dest.address, PORTS[0]) == f"hello-{PORTS[0]}"
            assert await fetch(sb, dest.address, PORTS[1]) is None
            await sb.stop()
        assert_clean(owner, {slot})
    finally:
        stop_server(srv)


async def test_nothing_left_when_a_wired_vm_dies(vm_server: Server, dest: Destination) -> None:
    """Its tap outlives QEMU: the edge deletes it when it sees the death, and a restarted
    edge deletes it for a VM that died while no edge watched."""
    owner = f"microvm@{edge_id(vm_server)}"
    policy = {"allow": [f"{dest.address}:{PORTS[0]}"]}

    def kill_qemu(sandbox_id: str) -> None:
        os.kill(int((vm_server.state_dir / "vms" / sandbox_id / "qemu.pid").read_text()), signal.SIGKILL)

    async with vm_server.client() as client:
        watched = await client.create(substrate="microvm", memory_mb=256, ttl_s=600, network=policy)
        slot = slot_of(owner, watched.id)
        kill_qemu(watched.id)
        for _ in range(600):
            if (await watched.refresh()).state == "died":
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the death was not noticed")
        assert_clean(owner, {slot})
        unwatched = await client.create(substrate="microvm", memory_mb=256, ttl_s=600, network=policy)
        slot = slot_of(owner, unwatched.id)
    vm_server.kill(signal.SIGKILL)
    kill_qemu(unwatched.id)
    vm_server.start()
    assert_clean(owner, {slot})
