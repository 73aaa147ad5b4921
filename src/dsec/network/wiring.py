"""Enforcing egress policies on one host: a host link per sandbox (a veth pair into a
container's network namespace, or a tap device a VM's QEMU attaches to) and nftables rules in
one table, ``inet dsec``.

Per wired sandbox, a slot ``n`` of 10.200.0.0/16 cut in /30s: host link ``dsec<n>``
(10.200.x.1) whose other end is the sandbox's ``eth0`` (10.200.x.2, default route via the
host side), and a chain ``sb<n>`` that the map ``egress`` sends the link's traffic to (forward and
input hooks alike, so the host itself is just another destination). The chain judges every
packet the sandbox sends, of new and open flows alike, and accepts those to the allowed
destinations; everything else from a ``dsec*`` link is rejected, and nothing may open a
connection into one (replies to the sandbox pass by conntrack state; a policy change deletes
the entries of the flows it forbids, see ``flows``). Sandboxes never reach each other,
whatever their rules. Sandbox sources are masqueraded on their way out.

A slot is claimed by creating its link: the kernel refuses a second ``dsec<n>``, so edges
sharing the host never collide. The link's alias ``<edge>/<sandbox id>`` says whose it is,
which is all a restarted edge needs to find its wiring. The sandbox's netns lives and dies
with the sandbox, taking the veth pair with it (a VM's tap outlives its QEMU: whoever
destroys the VM deletes it); chains whose link is gone are swept.
IPv4 forwarding is enabled per interface, on the sandbox's link and on the interface that
routes each allowed destination (replies come in there), never host-wide. An interface on
which dsec turned forwarding on joins the set ``forwarders``: it forwards nothing that is
not to or from a sandbox, so the host does not become a router for its neighbours, and is
switched back off as soon as no sandbox's rule (of any edge: the table is the record) routes
through it. A host-wide lock serialises these decisions between the edges of a host.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import random
import re
import secrets
import struct
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from ..protocol.errors import SandboxError
from . import flows
from .policy import Egress

POOL = ipaddress.IPv4Network("10.200.0.0/16")
SLOTS = range(1, POOL.num_addresses // 4)
LINK_PREFIX, TABLE = "dsec", "inet dsec"
LINK_NAME = re.compile(r"^dsec(\d+)$")
HOST_LOCK = "/run/dsec-network.lock"
CLONE_NEWNET = 0x40000000
TUNSETIFF, TUNSETPERSIST, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x400454CB, 0x0002, 0x1000
T = TypeVar("T")

BASE_RULES = f"""
add table {TABLE}
add map {TABLE} egress {{ type ifname : verdict; }}
add set {TABLE} forwarders {{ type ifname; }}
add chain {TABLE} forward {{ type filter hook forward priority -10; policy accept; }}
flush chain {TABLE} forward
add rule {TABLE} forward iifname "{LINK_PREFIX}*" oifname "{LINK_PREFIX}*" reject with icmpx type admin-prohibited
add rule {TABLE} forward iifname "{LINK_PREFIX}*" iifname vmap @egress
add rule {TABLE} forward iifname "{LINK_PREFIX}*" reject with icmpx type admin-prohibited
add rule {TABLE} forward oifname "{LINK_PREFIX}*" ct state established,related accept
add rule {TABLE} forward oifname "{LINK_PREFIX}*" drop
add rule {TABLE} forward iifname @forwarders drop
add chain {TABLE} input {{ type filter hook input priority -10; policy accept; }}
flush chain {TABLE} input
add rule {TABLE} input iifname "{LINK_PREFIX}*" iifname vmap @egress
add rule {TABLE} input iifname "{LINK_PREFIX}*" reject with icmpx type admin-prohibited
add chain {TABLE} postrouting {{ type nat hook postrouting priority 100; policy accept; }}
flush chain {TABLE} postrouting
add rule {TABLE} postrouting ip saddr {POOL} oifname != "{LINK_PREFIX}*" masquerade
"""


@dataclass(frozen=True)
class Slot:
    index: int

    @property
    def link(self) -> str:
        return f"{LINK_PREFIX}{self.index}"

    @property
    def chain(self) -> str:
        return f"sb{self.index}"

    @property
    def host_address(self) -> str:
        return str(POOL.network_address + 4 * self.index + 1)

    @property
    def sandbox_address(self) -> str:
        return str(POOL.network_address + 4 * self.index + 2)


class Wiring:
    """Host-wide operations; blocking, so the substrate runs them in worker threads."""

    def __init__(self) -> None:
        self._table_ready = False
        self._lock = threading.Lock()
        # the uplinks of each slot's rules, as applied by this process (unknown after a restart)
        self._uplinks_of: dict[int, set[str]] = {}

    # links
    def attach(self, owner: str, netns: int) -> Slot:
        """Wire the network namespace open as ``netns`` to the host by a veth pair; the
        link's alias is ``owner``."""
        def add(ipr: IPRoute, name: str) -> None:
            # the peer is made as ``eth0`` right in the sandbox's netns (moving a link between
            # namespaces waits for an RCU grace period: 15-25 ms, against under 1 ms)
            ipr.link("add", ifname=name, kind="veth", peer={"ifname": "eth0", "net_ns_fd": netns})
        return self._attach(owner, add, lambda slot: _in_netns(netns, lambda: _configure_inside(slot)))

    def attach_tap(self, owner: str) -> Slot:
        """A persistent tap device as the host link, for a VM: QEMU attaches to it by name,
        and the guest's side is configured in the guest. The link's alias is ``owner``."""
        return self._attach(owner, _add_tap, lambda slot: None)

    def _attach(self, owner: str, add: Callable[[IPRoute, str], None],
                inside: Callable[[Slot], None]) -> Slot:
        """Claim a slot by making its host link with ``add``, give the link its alias,
        address and forwarding, then let ``inside`` configure the sandbox's side."""
        try:
            with IPRoute() as ipr:
                slot = self._claim_slot(ipr, add)
                try:
                    (host,) = ipr.link_lookup(ifname=slot.link)
                    ipr.link("set", index=host, ifalias=owner)
                    ipr.addr("add", index=host, address=slot.host_address, prefixlen=30)
                    _set_forwarding(slot.link, True)
                    ipr.link("set", index=host, state="up")
                    inside(slot)
                except BaseException:
                    _delete_link(ipr, slot.link)
                    raise
            self._uplinks_of[slot.index] = set()  # no rules yet: its first policy frees none
            return slot
        except (OSError, NetlinkError) as exc:
            raise SandboxError(f"could not wire the sandbox's network: {exc}") from exc

    def _claim_slot(self, ipr: IPRoute, add: Callable[[IPRoute, str], None]) -> Slot:
        """A free slot, claimed by creating its host link (``add`` fails with EEXIST when
        another edge took the name first)."""
        used = {int(m.group(1)) for link in ipr.get_links()
                if (m := LINK_NAME.match(link.get("ifname") or ""))}
        free = [i for i in SLOTS if i not in used]
        random.shuffle(free)  # edges sharing the host rarely race for the same slot
        for index in free[:64]:
            try:
                add(ipr, f"{LINK_PREFIX}{index}")
                return Slot(index)
            except NetlinkError as exc:
                if exc.code != errno.EEXIST:
                    raise
        raise SandboxError("no free network slot in " + str(POOL))

    def owned(self, prefix: str) -> dict[str, Slot]:
        """Wired sandboxes whose link alias starts with ``prefix``: {rest of alias: slot}."""
        found = {}
        with IPRoute() as ipr:
            for link in ipr.get_links():
                m = LINK_NAME.match(link.get("ifname") or "")
                alias = link.get("ifalias") or ""
                if m and alias.startswith(prefix):
                    found[alias[len(prefix):]] = Slot(int(m.group(1)))
        return found

    # nftables
    def apply(self, slot: Slot, egress: Egress) -> None:
        """Make ``egress`` the slot's rules, all or nothing. What can fail is done first (route
        lookups, the uplinks' forwarding, opening the conntrack socket); the rules are then
        replaced in one atomic nft batch. Every packet the sandbox sends is judged by the
        rules (no blanket accept of established flows), and the flows the new rules forbid
        lose their conntrack entries before this returns, so no reply reaches the sandbox
        through them either."""
        lines = [f"add chain {TABLE} {slot.chain}", f"flush chain {TABLE} {slot.chain}",
                 # a VM's guest (root in its own kernel) may pick any source address; dropped,
                 # not rejected: a reject would go to whoever owns the forged address
                 f"add rule {TABLE} {slot.chain} ip saddr != {slot.sandbox_address} drop"]
        for rule in egress.rules:
            port = f" meta l4proto {{ tcp, udp }} th dport {rule.port}" if rule.port else ""
            lines.append(f"add rule {TABLE} {slot.chain} ip daddr {rule.network}{port} accept")
        lines.append(f'add element {TABLE} egress {{ "{slot.link}" : jump {slot.chain} }}')
        uplinks = _uplinks(str(r.network.network_address) for r in egress.rules)
        with _host_lock(), flows.Cutter() as cutter:
            try:
                self._forward_through(uplinks)
                self._nft("\n".join(lines))
            finally:
                before = self._uplinks_of.pop(slot.index, None)
                if before is None or not before <= uplinks:  # one may be needed no more
                    self._release_uplinks()
            self._uplinks_of[slot.index] = uplinks
            cutter.cut(slot.sandbox_address, egress.rules)

    def _forward_through(self, uplinks: set[str]) -> None:
        """Let each of ``uplinks`` forward (replies to sandboxes come in there); one that did
        not already is guarded first (set ``forwarders``: it forwards nothing but sandbox
        traffic) and switched back off once no rule needs it (``_release_uplinks``)."""
        for uplink in sorted(uplinks):
            try:
                if not _forwarding(uplink):
                    self._nft(f'add element {TABLE} forwarders {{ "{uplink}" }}')
                    _set_forwarding(uplink, True)
            except OSError as exc:  # the interface went away since its route was looked up
                raise SandboxError(f"could not let {uplink} forward replies: {exc}") from exc

    def _release_uplinks(self) -> None:
        """Switch forwarding back off on the uplinks dsec turned it on for that no sandbox's
        rule (of any edge on the host: the table is the record) routes through any more.
        Called under the host lock."""
        guarded = _forwarders(_nft_list("set", TABLE, "forwarders"))
        if not guarded:
            return
        needed = _uplinks(re.findall(r"ip daddr ([0-9./]+)", _nft_list("table", TABLE)))
        for uplink in sorted(guarded - needed):
            if Path(f"/proc/sys/net/ipv4/conf/{uplink}").exists():
                _set_forwarding(uplink, False)
            self._nft(f'delete element {TABLE} forwarders {{ "{uplink}" }}')

    def detach(self, slot: Slot) -> None:
        """Remove the slot's rules and link (either may be gone already)."""
        self.remove_rules(slot)
        with IPRoute() as ipr:
            _delete_link(ipr, slot.link)

    def remove_rules(self, slot: Slot) -> None:
        """Remove the slot's chain and map element, and cut its address's flows: a later
        sandbox of the same slot gets the same address, and must inherit none of them."""
        with _host_lock(), flows.Cutter() as cutter:
            self._nft(f"add chain {TABLE} {slot.chain}\n"  # so that the deletes cannot fail
                      f'add element {TABLE} egress {{ "{slot.link}" : jump {slot.chain} }}\n'
                      f'delete element {TABLE} egress {{ "{slot.link}" }}\n'
                      f"delete chain {TABLE} {slot.chain}")
            if self._uplinks_of.pop(slot.index, None) != set():
                self._release_uplinks()
            cutter.cut(slot.sandbox_address, ())

    def sweep(self) -> None:
        """Remove chains whose link is gone (their sandbox died while its edge was down),
        forwarders that no longer exist, and forwarding that no rule needs any more."""
        listing = _nft_list("table", TABLE)
        chains = {int(i) for i in re.findall(r"chain sb(\d+) ", listing)}
        with IPRoute() as ipr:
            links = {link.get("ifname") for link in ipr.get_links()}
        for index in chains:
            if Slot(index).link not in links:
                self.remove_rules(Slot(index))
        with _host_lock():
            for name in _forwarders(listing) - links:
                self._nft(f'delete element {TABLE} forwarders {{ "{name}" }}')
            self._release_uplinks()

    def _nft(self, batch: str) -> None:
        """Run a batch, setting the table up first (once per process, and again if the batch
        fails: someone may have flushed the host's ruleset)."""
        with self._lock:
            if not self._table_ready:
                _run_nft(BASE_RULES)
                self._table_ready = True
        try:
            _run_nft(batch)
        except SandboxError:
            _run_nft(BASE_RULES)
            _run_nft(batch)


def _run_nft(batch: str) -> None:
    done = subprocess.run(["nft", "-f", "-"], input=batch, capture_output=True, text=True)
    if done.returncode != 0:
        raise SandboxError(f"nft refused the sandbox's rules: {done.stderr.strip()[-1000:]}")


def _add_tap(ipr: IPRoute, name: str) -> None:
    """A persistent tap ``name``. The tun driver attaches to an existing tap of that name
    instead of refusing it, so the tap is made under a unique name and then renamed: the
    rename is what the kernel refuses (EEXIST) when ``name`` is taken."""
    temp = f"dsectmp{secrets.token_hex(4)}"
    with open("/dev/net/tun", "rb", buffering=0) as tun:
        fcntl.ioctl(tun, TUNSETIFF, struct.pack("16sH22x", temp.encode(), IFF_TAP | IFF_NO_PI))
        fcntl.ioctl(tun, TUNSETPERSIST, 1)
    try:
        (index,) = ipr.link_lookup(ifname=temp)
        ipr.link("set", index=index, ifname=name)
    except BaseException:
        _delete_link(ipr, temp)
        raise


def _configure_inside(slot: Slot) -> None:
    with IPRoute() as ipr:
        (lo,) = ipr.link_lookup(ifname="lo")
        (eth0,) = ipr.link_lookup(ifname="eth0")
        ipr.link("set", index=lo, state="up")
        ipr.addr("add", index=eth0, address=slot.sandbox_address, prefixlen=30)
        ipr.link("set", index=eth0, state="up")
        ipr.route("add", dst="0.0.0.0/0", gateway=slot.host_address)


def _in_netns(netns: int, work: Callable[[], T]) -> T:
    """Run ``work`` in a fresh thread that joined the netns: a thread's namespace is its own,
    and a throwaway thread can never leak a namespace into later work."""
    outcome: list[T | BaseException] = []

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            if libc.setns(netns, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the sandbox's netns failed")
            outcome.append(work())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name="dsec-netns")
    thread.start()
    thread.join()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _delete_link(ipr: IPRoute, name: str) -> None:
    try:
        ipr.link("del", ifname=name)
    except NetlinkError as exc:
        if exc.code != errno.ENODEV:
            raise


def _set_forwarding(link: str, on: bool) -> None:
    with open(f"/proc/sys/net/ipv4/conf/{link}/forwarding", "w") as f:
        f.write("1" if on else "0")


def _forwarding(link: str) -> bool:
    with open(f"/proc/sys/net/ipv4/conf/{link}/forwarding") as f:
        return f.read().strip() == "1"


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """Serialises, across the edges of this host, the changes that decide which uplinks
    must forward (each edge's rules count)."""
    with open(HOST_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _nft_list(kind: str, *names: str) -> str:
    """``nft list`` of a table or set (empty if there is none yet)."""
    return subprocess.run(["nft", "list", kind, *" ".join(names).split()], capture_output=True,
                          text=True).stdout


def _forwarders(listing: str) -> set[str]:
    found = re.search(r"set forwarders \{[^}]*?elements = \{([^}]*)\}", listing)
    return set(re.findall(r'"([^"]+)"', found.group(1))) if found else set()


def _uplinks(addresses: Iterable[str]) -> set[str]:
    with IPRoute() as ipr:
        return {name for address in set(addresses)
                if (name := _uplink(ipr, address.split("/")[0])) is not None}


def _uplink(ipr: IPRoute, address: str) -> str | None:
    """The interface that routes ``address`` (None: the host itself, or no route). Replies
    to a sandbox come in there and are forwarded, so it must forward."""
    try:
        route = ipr.route("get", dst=address)[0]
    except NetlinkError:
        return None
    oif = route.get("RTA_OIF")
    name = ipr.link("get", index=oif)[0].get("ifname") if oif is not None else None
    return None if not name or name == "lo" or LINK_NAME.match(name) else name
