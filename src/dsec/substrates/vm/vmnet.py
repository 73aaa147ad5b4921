"""Network policies for VM sandboxes: a second NIC, connected to the host only while the
sandbox has a policy.

Every VM boots with two NICs, told apart by MAC address (the guest's init names them):
``agent0`` is QEMU user networking with ``restrict=on``, which carries the port forward to
the agent and nothing else (no route leaves the guest through it); ``eth0`` is plugged into
an emulated hub that has no other way out, so it goes nowhere. Applying a policy makes a tap
``dsec<n>`` on the host (``Wiring.attach_tap``: the slot, rules and clean-up that containers
use, unchanged), hot-plugs it into that hub over QMP (``netdev_add`` of the tap, then of a hub
port joined to it), and gives the guest's ``eth0`` its address and default route through the
agent, with the busybox that the guest's init left in ``/.dsec/bin``, run ``privileged``
(commands of the sandbox itself have no ``CAP_NET_ADMIN`` in a VM: see agent.c). Going back to ``"none"``
unplugs the tap and removes it. Hot-plugging a backend rather than a device works on both
machines: a microvm has no bus to hot-plug a device into.
"""

from __future__ import annotations

from pathlib import Path

from ...agent.client import AgentClient, AgentError, AgentUnavailable
from ...agent.tools import BUSYBOX
from ...network.wiring import Slot
from ...protocol.errors import SandboxError
from .vmsnapshot import QMP

AGENT_MAC = "52:54:00:12:34:56"
POLICY_MAC = "52:54:00:d5:ec:00"
HUB, TAP_ID, PORT_ID = 0, "policy-tap", "policy-port"


def nic_args(net_device: str, host_port: int | str, agent_port: int) -> list[str]:
    """QEMU's options for the two NICs: the agent's link, and the policy NIC's empty hub."""
    return ["-netdev", f"user,id=agent,restrict=on,hostfwd=tcp:127.0.0.1:{host_port}-:{agent_port}",
            "-device", f"{net_device},netdev=agent,mac={AGENT_MAC}",
            "-netdev", f"hubport,id=policy,hubid={HUB}",
            "-device", f"{net_device},netdev=policy,mac={POLICY_MAC}",
            # A port joined to nothing, which drops what it gets: a hub with no port that can
            # take a packet queues the NIC's, and the NIC then sends nothing more, ever.
            "-netdev", f"hubport,id=policy-sink,hubid={HUB}"]


async def plug(qmp_socket: Path, slot: Slot) -> None:
    """Connect the tap of ``slot`` to the policy NIC's hub."""
    qmp = await QMP.connect(qmp_socket)
    try:
        await qmp.call("netdev_add", type="tap", id=TAP_ID, ifname=slot.link, script="no",
                       downscript="no")
        try:
            await qmp.call("netdev_add", type="hubport", id=PORT_ID, hubid=HUB, netdev=TAP_ID)
        except SandboxError:
            await qmp.call("netdev_del", id=TAP_ID)
            raise
    finally:
        qmp.close()


async def unplug(qmp_socket: Path) -> None:
    """Disconnect the tap from the hub and close QEMU's end of it (either may be gone)."""
    qmp = await QMP.connect(qmp_socket)
    try:
        for netdev in (PORT_ID, TAP_ID):
            try:
                await qmp.call("netdev_del", id=netdev)
            except SandboxError as exc:
                if "not found" not in str(exc):
                    raise
    finally:
        qmp.close()


async def configure_guest(agent: AgentClient, slot: Slot | None) -> None:
    """The guest's ``eth0``: the slot's address and default route, or (None) down and bare."""
    steps = ["ip addr flush dev eth0"]
    if slot is None:
        steps.append("ip link set eth0 down")
    else:
        steps += [f"ip addr add {slot.sandbox_address}/30 dev eth0", "ip link set eth0 up",
                  f"ip route replace default via {slot.host_address} dev eth0"]
    script = " && ".join(f"{BUSYBOX} {step}" for step in steps)
    try:
        done = await agent.run([BUSYBOX, "sh", "-c", script], env={}, cwd="/",
                               timeout_ms=30_000, privileged=True)
    except (AgentError, AgentUnavailable) as exc:
        raise SandboxError(f"could not configure the guest's network: {exc}") from None
    if done.exit_code != 0:
        raise SandboxError("could not configure the guest's network: "
                           f"{done.stderr.decode(errors='replace').strip()[-500:]}")
