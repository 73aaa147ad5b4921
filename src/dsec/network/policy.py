"""From a sandbox's ``NetworkPolicy`` to concrete allow rules (``Egress``).

Named services come from the service table: the defaults shipped in ``services.toml``, then
the operator's file, whose entries replace the defaults of the same name. Host names are
resolved here, on the host, when a policy is applied: the addresses found are both what the
rules allow and what the sandbox's /etc/hosts pins, so a sandbox needs no DNS egress.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..protocol.errors import InvalidRequest
from ..protocol.models import Network
from ..protocol.rules import Destination, parse_rule

DEFAULT_TABLE = Path(__file__).with_name("services.toml")
log = logging.getLogger("dsec.network")


@dataclass(frozen=True)
class Service:
    name: str
    allow: tuple[Destination, ...]
    description: str = ""


class ServiceTable:
    """The service table; the operator's file is read again when it changes, so an edit
    takes effect at the next policy applied, without a restart."""

    def __init__(self, operator_file: Path | None = None) -> None:
        self.operator_file = operator_file
        self._stamp: float | None = None
        self.services: dict[str, Service] = {}
        self._refresh()

    def _refresh(self) -> None:
        path = self.operator_file
        stamp = path.stat().st_mtime if path is not None and path.exists() else None
        if self.services and stamp == self._stamp:
            return
        try:
            services = _read(DEFAULT_TABLE)
            if stamp is not None:
                assert path is not None
                services.update(_read(path))
        except ValueError:
            if not self.services:
                raise  # at start: refuse to serve with a broken table
            log.exception("keeping the previous network service table")
            self._stamp = stamp
            return
        self.services, self._stamp = services, stamp

    def destinations(self, name: str) -> tuple[Destination, ...]:
        self._refresh()
        service = self.services.get(name)
        if service is None:
            raise InvalidRequest(f"unknown network service {name!r}", service=name,
                                 known=sorted(self.services))
        return service.allow


def _read(path: Path) -> dict[str, Service]:
    try:
        data = tomllib.loads(path.read_text())
        return {name: Service(name, tuple(parse_rule(r) for r in entry["allow"]),
                              entry.get("description", ""))
                for name, entry in data.get("services", {}).items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad network service table {path}: {exc}") from exc


@dataclass(frozen=True)
class Rule:
    """Allow traffic to ``network`` (on ``port`` over TCP and UDP; None: any protocol)."""

    network: ipaddress.IPv4Network
    port: int | None = None


@dataclass(frozen=True)
class Egress:
    """A resolved policy: what the sandbox may reach, and the host names to pin."""

    rules: tuple[Rule, ...]
    hosts: tuple[tuple[str, str], ...]  # (name, address), one line of /etc/hosts each


async def resolve(network: Network, table: ServiceTable) -> Egress | None:
    """The policy's concrete rules (None for "none"); ``InvalidRequest`` for an unknown
    service or a host name that does not resolve."""
    if network == "none":
        return None
    wanted: list[Destination] = [parse_rule(r) for r in network.allow]
    for name, on in sorted(network.services.items()):
        found = table.destinations(name)
        if on:
            wanted.extend(found)
    rules: set[Rule] = set()
    hosts: set[tuple[str, str]] = set()
    names = sorted({d.host for d in wanted if d.network is None})
    addresses = await asyncio.gather(*(asyncio.to_thread(_addresses, n) for n in names))
    resolved = dict(zip(names, addresses))
    for d in wanted:
        if d.network is not None:
            rules.add(Rule(d.network, d.port))
            continue
        for address in resolved[d.host]:
            rules.add(Rule(ipaddress.IPv4Network(address), d.port))
            hosts.add((d.host, address))
    return Egress(tuple(sorted(rules, key=_rule_key)), tuple(sorted(hosts)))


def _addresses(name: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InvalidRequest(f"network policy: cannot resolve {name!r}: {exc.strerror}",
                             host=name) from None
    return sorted({str(info[4][0]) for info in infos})  # AF_INET: (dotted address, port)


def _rule_key(rule: Rule) -> tuple[int, int, int]:
    return int(rule.network.network_address), rule.network.prefixlen, rule.port or 0
