"""Who holds the other end of a loopback TCP connection: the uid that owns it, from the
kernel's socket diagnostics (``NETLINK_SOCK_DIAG``, one exact lookup by address and ports).

A VM's agent is reached through a QEMU port forward on host loopback. Any local user could
bind that port once its QEMU has gone and answer in the agent's name (and receive the edge's
token); TCP has no ``SO_PEERCRED``, so the client asks the kernel who owns the socket it is
connected to before it sends anything.
"""

from __future__ import annotations

import socket
import struct

SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NETLINK_SOCK_DIAG = 4
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQ = struct.Struct("=BBBxI")  # family, protocol, ext, pad, states
_SOCKID = struct.Struct("!HH16s16s")  # sport, dport (network order), src, dst; then if, cookie
_MSG_UID = 4 + 48 + 12  # inet_diag_msg: family, state, timer, retrans; sockid; expires, queues


def loopback_peer_uid(sock: socket.socket) -> int:
    """The uid owning the socket at the other end of ``sock``, an IPv4 TCP connection over
    loopback (both ends are sockets of this host). ``OSError`` if the kernel cannot say."""
    local, peer = sock.getsockname(), sock.getpeername()
    sockid = _SOCKID.pack(peer[1], local[1], socket.inet_aton(peer[0]).ljust(16, b"\0"),
                          socket.inet_aton(local[0]).ljust(16, b"\0"))
    sockid += struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)  # any interface, no cookie
    body = _REQ.pack(socket.AF_INET, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
                + body)
        reply = nl.recv(8192)
    _, kind, _, _, _ = _NLMSGHDR.unpack_from(reply)
    if kind == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", reply, _NLMSGHDR.size)
        raise OSError(-code, f"sock_diag: no socket for {peer[0]}:{peer[1]}")
    if kind != SOCK_DIAG_BY_FAMILY:
        raise OSError(f"sock_diag: unexpected reply type {kind}")
    (uid,) = struct.unpack_from("=I", reply, _NLMSGHDR.size + _MSG_UID)
    return uid
