"""A destination for trying policies without touching any outside address: a network
namespace wired to the host by a veth pair (10.201.0.0/16), with TCP servers on its address
that greet with ``hello-<port>``. Used by the tests and by ``dsec bench --only network``."""

from __future__ import annotations

import ipaddress
import secrets
import subprocess
import sys
from dataclasses import dataclass

SERVE = """
import socket, sys, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], port)); s.listen(64)
    while True:
        c, _ = s.accept(); c.sendall(b"hello-%d\\n" % port); c.close()
for port in map(int, sys.argv[2:]):
    threading.Thread(target=serve, args=(port,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


@dataclass
class Destination:
    ns: str
    link: str  # the host side of its veth
    address: str
    network: str  # its /30
    server: subprocess.Popen[bytes] | None = None

    @property
    def host_side(self) -> str:
        return str(ipaddress.IPv4Address(self.address) - 1)

    def remove(self) -> None:
        if self.server:
            self.server.kill()
            self.server.wait()
        subprocess.run(["ip", "netns", "del", self.ns])
        subprocess.run(["ip", "link", "del", self.link], stderr=subprocess.DEVNULL)
        # an edge that allowed this destination let the link forward replies to sandboxes
        subprocess.run(["nft", f'delete element inet dsec forwarders {{ "{self.link}" }}'],
                       stderr=subprocess.DEVNULL)


def make_destination(ports: tuple[int, ...]) -> Destination:
    """A fresh namespace serving on ``ports``, up and listening when this returns."""
    slot = secrets.randbelow(16000) + 1
    net = ipaddress.IPv4Network(f"10.201.{slot // 64}.{(slot % 64) * 4}/30")
    host_addr, addr = str(net.network_address + 1), str(net.network_address + 2)
    tag = secrets.token_hex(3)
    d = Destination(f"dtst{tag}", f"dth{tag}", addr, str(net))
    try:
        for cmd in (f"ip netns add {d.ns}",
                    f"ip link add {d.link} type veth peer name dtp{tag}",
                    f"ip link set dtp{tag} netns {d.ns}",
                    f"ip addr add {host_addr}/30 dev {d.link}", f"ip link set {d.link} up",
                    f"ip -n {d.ns} addr add {addr}/30 dev dtp{tag}",
                    f"ip -n {d.ns} link set dtp{tag} up", f"ip -n {d.ns} link set lo up",
                    f"ip -n {d.ns} route add default via {host_addr}"):
            subprocess.run(cmd.split(), check=True)
        d.server = subprocess.Popen(["ip", "netns", "exec", d.ns, sys.executable, "-c", SERVE,
                                     addr, *map(str, ports)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert d.server.stdout is not None
        if d.server.stdout.readline() != b"ready\n":
            raise RuntimeError("the destination's server did not start")
    except BaseException:
        d.remove()
        raise
    return d
