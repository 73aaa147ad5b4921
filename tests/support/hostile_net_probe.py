"""Run INSIDE a sandbox by tests/test_hostile_network.py: a hostile agent's network attempts.

``python3 hostile_net_probe.py MODE ARGS`` writes JSON results. Standard library only (it
runs in the sandbox's Python, without dsec).

- ``flows ADDRESS PORT``: opens a TCP flow and a UDP flow to an echo server, subscribes the
  UDP flow to the server's ticks, then, at each phase (the test creates ``/tmp/go<n>``),
  measures what still goes through, written to ``/tmp/phase<n>.json``.
- ``escape JSON``: tries each way out of the policy listed in the JSON; prints what worked.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def _write(path: str, result: object) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(path + ".tmp", path)


def _tcp_round_trip(sock: socket.socket) -> bool:
    try:
        sock.sendall(b"x")
        return sock.recv(16) == b"x"
    except OSError:
        return False


def _udp_round_trip(sock: socket.socket) -> bool:
    try:
        sock.send(b"echo")
        return sock.recv(64) == b"echo"
    except OSError:
        return False


def _ticks(sock: socket.socket, seconds: float) -> int:
    """Ticks the server pushes on this flow, counted for ``seconds``."""
    count, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(64) == b"tick":
                count += 1
        except socket.timeout:
            break
        except OSError:  # an ICMP error on the flow: not a tick
            continue
    sock.settimeout(1.0)
    return count


def _drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while True:
            sock.recv(64)
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:  # an ICMP error queued on the flow
        _drain(sock)
    finally:
        sock.settimeout(1.0)


def _udp(address: str, port: int, source_port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", source_port))
    sock.connect((address, port))
    sock.settimeout(1.0)
    return sock


def _new_tcp(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def flows(address: str, port: int) -> None:
    tcp = socket.create_connection((address, port), timeout=5)
    tcp.settimeout(1.0)
    udp = _udp(address, port)
    ticked = _udp(address, port)
    ticked.send(b"sub")
    for phase in range(3):
        if phase:
            while not os.path.exists(f"/tmp/go{phase}"):
                time.sleep(0.02)
            _drain(ticked)  # ticks that came before the policy changed
        result = {"tcp": [_tcp_round_trip(tcp) for _ in range(3)],
                  "udp": [_udp_round_trip(udp) for _ in range(3)],
                  "ticks": _ticks(ticked, 1.5)}
        if phase == 2:  # a fresh socket on the old flow's source port, and a new connection
            old_port = udp.getsockname()[1]
            udp.close()
            again = _udp(address, port, old_port)
            result["old_port"] = [_udp_round_trip(again) for _ in range(3)]
            result["new_tcp"] = _new_tcp(address, port)
        _write(f"/tmp/phase{phase}.json", result)


def _udp_answer(address: str, port: int, payload: bytes) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(2)
            s.sendto(payload, (address, port))
            s.recv(512)
            return True
    except OSError:
        return False


def _raw_socket() -> bool:
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
        return True
    except OSError:
        return False


def _ping(address: str) -> bool:
    """An ICMP echo through an unprivileged ping socket (what an ICMP tunnel rides on)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP) as s:
            s.settimeout(2)
            s.sendto(b"\x08\x00\x00\x00\x00\x01\x00\x01tunnelled-data", (address, 0))
            s.recv(512)
            return True
    except OSError:
        return False


def _tcp6(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


DNS_QUERY = bytes.fromhex("abcd01000001000000000000") + b"\x07example\x03com\x00\x00\x01\x00\x01"


def escape(plan: dict[str, list]) -> dict[str, object]:  # type: ignore[type-arg]
    """Every attempt in ``plan``; the value is whether it got through."""
    found: dict[str, object] = {"raw_socket": _raw_socket()}
    for address, port in plan.get("tcp", []):
        found[f"tcp {address}:{port}"] = _new_tcp(address, port)
    for address, port in plan.get("dns", []):
        found[f"dns {address}:{port}"] = _udp_answer(address, port, DNS_QUERY)
    for address in plan.get("ping", []):
        found[f"ping {address}"] = _ping(address)
    for address, port in plan.get("tcp6", []):
        found[f"tcp6 {address}:{port}"] = _tcp6(address, port)
    return found


if __name__ == "__main__":
    if sys.argv[1] == "flows":
        flows(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(escape(json.loads(sys.argv[2]))))
