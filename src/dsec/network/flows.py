"""Cutting a sandbox's open flows that its new policy forbids.

The rules judge every packet a sandbox sends, so a narrowed policy stops its side of a flow at
once; but the host's conntrack entry of that flow would still let the other end's packets
through (replies are accepted by conntrack state, and de-masqueraded to the sandbox). So, when
a policy changes, the entries of the sandbox's flows (original source: the sandbox's address)
that no rule of the new policy allows are deleted, over conntrack netlink. A packet of a cut
flow that comes in afterwards matches no entry: it is no reply, and never reaches the sandbox.

Entries are told apart by protocol, destination address and port, the same way the rules
are. pyroute2 knows the ports of TCP and UDP only; an entry of another protocol that has ports
(SCTP, DCCP, UDP-Lite: possible only to a destination allowed without a port) cannot be named
for deletion and stays until it times out (its sandbox-side packets are refused all the same).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from types import TracebackType

from pyroute2 import Conntrack
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

from ..protocol.errors import SandboxError
from .policy import Rule

PORTED = (socket.IPPROTO_TCP, socket.IPPROTO_UDP)


class Cutter:
    """A conntrack socket, opened before a policy is committed so that what can fail does
    so while the previous policy is still in force."""

    def __enter__(self) -> Cutter:
        try:
            self._ct = Conntrack()
        except (OSError, NetlinkError) as exc:
            raise SandboxError(f"could not open conntrack to apply the policy: {exc}") from exc
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._ct.close()

    def cut(self, address: str, rules: tuple[Rule, ...]) -> None:
        """Delete the entries of flows from ``address`` that ``rules`` do not allow."""
        try:
            doomed = [entry.tuple_orig for entry in
                      self._ct.dump_entries(tuple_orig=NFCTAttrTuple(saddr=address))
                      if not allowed(entry.tuple_orig, rules)]
            for flow in doomed:
                try:
                    self._ct.entry("del", tuple_orig=flow)
                except NetlinkError as exc:
                    if exc.code != errno.ENOENT:  # gone already: it timed out or closed
                        raise
        except (OSError, NetlinkError) as exc:
            raise SandboxError(f"could not cut the flows the policy forbids: {exc}") from exc


def allowed(flow: NFCTAttrTuple, rules: tuple[Rule, ...]) -> bool:
    """Whether a rule allows this flow (its original direction), as the nft rules would."""
    destination = ipaddress.IPv4Address(flow.daddr)
    return any(destination in rule.network
               and (rule.port is None or (flow.proto in PORTED and flow.dport == rule.port))
               for rule in rules)
