"""The grammar of one raw egress rule, shared by the SDK (to reject a bad rule before it is
sent) and the edge: ``"10.1.2.3:443"``, ``"192.168.0.0/24"``, ``"10.1.2.3"``,
``"host.name:80"``. IPv4 only: sandboxes get an IPv4 address and no IPv6 route."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
                      r"[A-Za-z][A-Za-z0-9-]{0,61}[A-Za-z0-9]$")


@dataclass(frozen=True, order=True)
class Destination:
    """A network (an address is a /32) or a host name to resolve, and a port (None: any)."""

    host: str
    port: int | None = None

    @property
    def network(self) -> ipaddress.IPv4Network | None:
        """The destination's network, or None for a host name."""
        try:
            return ipaddress.IPv4Network(self.host)
        except ValueError:
            return None


def parse_rule(text: str) -> Destination:
    """One rule; ``ValueError`` saying what is wrong with it."""
    if not isinstance(text, str) or not text or len(text) > 300:
        raise ValueError(f"a rule is a non-empty string, not {text!r}")
    host, port = text, None
    if ":" in text:
        host, _, port_text = text.rpartition(":")
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
        port = int(port_text)
    if "/" in host:
        if port is not None:
            raise ValueError(f"{text!r}: a CIDR rule takes no port")
        try:
            net = ipaddress.IPv4Network(host, strict=True)
        except ValueError as exc:
            raise ValueError(f"{text!r}: not an IPv4 network ({exc})") from None
        return Destination(str(net))
    try:
        return Destination(str(ipaddress.IPv4Address(host)), port)
    except ValueError:
        pass
    name = host.removesuffix(".").lower()  # a fully qualified "name." is the same name
    if ":" in name or not HOSTNAME.match(name) or name.replace(".", "").isdigit():
        raise ValueError(f"{text!r}: expected an IPv4 address, an IPv4 CIDR or a host name "
                         "(IPv6 is not supported)")
    return Destination(name, port)
