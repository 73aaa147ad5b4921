"""The block of a sandbox's /etc/hosts that pins the host names of its network policy.

Names are resolved on the host when the policy is applied (``policy.resolve``, with the host's
own resolver files); the rules allow the addresses found, whatever the sandbox's files say.
Pinning them in the sandbox's /etc/hosts is a convenience, so that the sandbox needs no DNS
egress: that file is the sandbox's, which may have made it a directory, a FIFO, a symlink or a
huge file. So pinning happens after the policy is in force, is bounded in size and time, and
its failure is logged, never the policy's: a sandbox cannot make a policy change fail or
half-apply, nor hold it up.
"""

from __future__ import annotations

import asyncio
import logging

from ..agent.client import AgentClient, AgentError, AgentUnavailable

BEGIN = "# dsec network policy: begin (managed, rewritten on set_network)"
END = "# dsec network policy: end"
MAX_HOSTS_BYTES = 1 << 20  # a larger /etc/hosts is not read, and gets no pins
PIN_TIMEOUT_S = 10.0
log = logging.getLogger("dsec.network")


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


async def pin_in_sandbox(sandbox_id: str, agent: AgentClient,
                         pins: tuple[tuple[str, str], ...]) -> None:
    """Rewrite the sandbox's /etc/hosts block through its agent (the path is resolved inside
    the sandbox, never on the host). A failure is logged, never raised."""
    try:
        await asyncio.wait_for(_pin(agent, pins), PIN_TIMEOUT_S)
    except (AgentError, AgentUnavailable, TimeoutError) as exc:
        log.warning("%s: the policy is in force, but its host names could not be pinned in "
                    "the sandbox's /etc/hosts: %s", sandbox_id, exc)


async def _pin(agent: AgentClient, pins: tuple[tuple[str, str], ...]) -> None:
    try:
        current = await agent.read_file("/etc/hosts", max_bytes=MAX_HOSTS_BYTES)
    except AgentError as exc:
        if exc.errno != "ENOENT":
            raise
        current = b""  # none yet
    updated = pin_hosts(current, pins)
    if updated != current:
        await agent.write_file("/etc/hosts", updated)
