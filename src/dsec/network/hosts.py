"""The block of a sandbox's /etc/hosts that pins the host names of its network policy.

Names are resolved on the host when the policy is applied; pinning them means the sandbox
needs no DNS egress, and reaches exactly the addresses its rules allow.
"""

from __future__ import annotations

from ..agent.client import AgentClient, AgentError
from ..client.errors import SandboxError

BEGIN = "# dsec network policy: begin (managed, rewritten on set_network)"
END = "# dsec network policy: end"


def pin_hosts(current: bytes, pins: tuple[tuple[str, str], ...]) -> bytes:
    """``current`` with its managed block replaced by ``pins`` (removed when empty)."""
    lines, inside = [], False
    for line in current.decode(errors="replace").splitlines():
        if line == BEGIN:
            inside = True
        elif line == END:
            inside = False
        elif not inside:
            lines.append(line)
    if pins:
        lines += [BEGIN, *(f"{address}\t{name}" for name, address in pins), END]
    return ("\n".join(lines) + "\n").encode() if lines else b""


async def pin_in_sandbox(agent: AgentClient, pins: tuple[tuple[str, str], ...]) -> None:
    """Rewrite the sandbox's /etc/hosts block through its agent: the path is resolved inside
    the sandbox, never on the host."""
    try:
        current = await agent.read_file("/etc/hosts")
    except AgentError:
        current = b""  # none yet
    updated = pin_hosts(current, pins)
    try:
        if updated != current:
            await agent.write_file("/etc/hosts", updated)
    except AgentError as exc:
        raise SandboxError(f"could not pin the policy's host names in /etc/hosts: {exc}") from None
