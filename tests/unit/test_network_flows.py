"""Which open flows a new policy keeps: the conntrack cut's test must match the nft rules'."""

from __future__ import annotations

import ipaddress
import socket

from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

from dsec.network.flows import allowed
from dsec.network.policy import Rule

SANDBOX = "10.200.0.6"
RULES = (Rule(ipaddress.IPv4Network("10.1.2.3/32"), 443), Rule(ipaddress.IPv4Network("10.9.0.0/24")))


def flow(daddr: str, proto: int, dport: int | None = None) -> NFCTAttrTuple:
    if proto == socket.IPPROTO_ICMP:
        return NFCTAttrTuple(saddr=SANDBOX, daddr=daddr, proto=proto, icmp_id=1, icmp_type=8)
    return NFCTAttrTuple(saddr=SANDBOX, daddr=daddr, proto=proto, sport=40000, dport=dport)


def test_a_port_rule_keeps_tcp_and_udp_to_that_port_only() -> None:
    assert allowed(flow("10.1.2.3", socket.IPPROTO_TCP, 443), RULES)
    assert allowed(flow("10.1.2.3", socket.IPPROTO_UDP, 443), RULES)
    assert not allowed(flow("10.1.2.3", socket.IPPROTO_TCP, 8000), RULES)
    assert not allowed(flow("10.1.2.3", socket.IPPROTO_ICMP), RULES)
    assert not allowed(flow("10.1.2.3", 132, None), RULES)  # SCTP: the rule says tcp, udp


def test_a_network_rule_keeps_any_protocol_inside_it_only() -> None:
    for proto, port in ((socket.IPPROTO_TCP, 1), (socket.IPPROTO_UDP, 53), (socket.IPPROTO_ICMP, None)):
        assert allowed(flow("10.9.0.200", proto, port), RULES)
        assert not allowed(flow("10.9.1.1", proto, port), RULES)


def test_no_rules_keep_nothing() -> None:
    assert not allowed(flow("10.1.2.3", socket.IPPROTO_TCP, 443), ())
