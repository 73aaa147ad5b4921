"""The one interface every substrate implements.

The edge owns bookkeeping (ids, admission, TTLs, the state store); a substrate only starts,
inspects and destroys the isolation around one in-sandbox agent, and says how to reach it.
Everything a substrate must remember about a sandbox goes into the ``runtime`` dict it
returns from ``start``; the edge stores it, so a restarted edge can find the sandbox again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..agent.client import AgentClient
from ..images.store import Image
from ..network.policy import Egress
from ..protocol.errors import NotSupported
from ..protocol.models import CreateRequest


@dataclass(frozen=True)
class StartPlan:
    sandbox_id: str
    request: CreateRequest
    image: Image
    warm: bool = False  # for the warm pool: start at idle priority, to be claimed later
    disk_from: Path | None = None  # a snapshot's file to start from (snapshot_disk's output)
    memory_from: Path | None = None  # a `full` snapshot's saved memory and devices, with disk_from


class Substrate(ABC):
    name: str
    # Whether ``set_network`` can enforce an egress policy; the edge refuses a policy for a
    # substrate that cannot, before starting anything.
    network_policies: bool = False
    # Whether ``rollback`` keeps the sandbox's network wiring (plugged again into the restarted
    # sandbox); the edge refuses a rollback of a sandbox with a policy otherwise.
    rollback_keeps_network: bool = False
    # Whether its sandboxes' disks live on the edge's disk volume (host/volume.py): the edge
    # refuses a create or snapshot that may not fit there.
    disk_volume: bool = False
    # Whether ``snapshot_disk`` takes a paused sandbox as it is and leaves it paused; the edge
    # resumes a paused sandbox before snapshotting it otherwise.
    snapshots_paused: bool = False
    # Whether its sandboxes have a devpts of their own for terminals (``Edge.start_pty``); the
    # edge refuses a terminal otherwise.
    terminals: bool = False
    # Files of the server a live sandbox holds open (its pidfd): the edge's limit on open
    # files is sized to its capacity times the largest of these (host/openfiles.py).
    open_files: int = 1

    async def prepare(self) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """One-time host preparation when the edge starts."""

    async def close(self) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """The edge stops serving; live sandboxes stay, to be adopted by the next edge."""

    @abstractmethod
    async def start(self, plan: StartPlan) -> dict[str, Any]:
        """Start the sandbox and return once its agent answers and is claimed: the agent obeys
        only the first client to claim it (``AgentClient.claim``), so claim it before any user
        command can run, and keep the token in the returned runtime dict. On failure, leave
        nothing."""

    @abstractmethod
    async def claim(self, sandbox_id: str, runtime: dict[str, Any], request: CreateRequest,
                    started: CreateRequest) -> None:
        """Make a warm-pool sandbox the request's: apply its cpu, memory and pids limits and
        give it normal priority. ``started``: the request the pool started it with, whose
        limits it runs under until then."""

    @abstractmethod
    def agent(self, sandbox_id: str, runtime: dict[str, Any]) -> AgentClient: ...

    @abstractmethod
    def alive(self, sandbox_id: str, runtime: dict[str, Any]) -> bool: ...

    @abstractmethod
    def watch(self, sandbox_id: str, runtime: dict[str, Any], on_exit: Callable[[], None]) -> None:
        """Call ``on_exit`` (on the event loop) when the sandbox's init ends, or at once if it
        already has: deaths are noticed when they happen, not by polling."""

    @abstractmethod
    def death_cause(self, sandbox_id: str, runtime: dict[str, Any]) -> str:
        """Best explanation of why a sandbox that is no longer alive ended."""

    @abstractmethod
    def oom_kills(self, sandbox_id: str, runtime: dict[str, Any]) -> int: ...

    async def set_network(self, sandbox_id: str, runtime: dict[str, Any],
                          egress: Egress | None) -> None:
        """Make ``egress`` the running sandbox's policy, replacing any earlier one atomically;
        None takes it back to no network (loopback only). ``destroy`` removes the wiring."""
        raise NotSupported(f"the {self.name} substrate cannot enforce network policies yet; "
                           "use network='none'")

    def writable_layer(self, sandbox_id: str) -> Path:
        """The host directory that is the sandbox's overlay upper (its changes over the image,
        with overlay whiteouts), to be read only while its processes are frozen: how a
        Dockerfile RUN step becomes a layer (``Edge.commit_layer``)."""
        raise NotSupported(f"{self.name} sandboxes have no overlay upper directory on the "
                           "host; Dockerfile RUN steps run in container sandboxes")

    async def snapshot_disk(self, sandbox_id: str, runtime: dict[str, Any],
                            dest: Path) -> int | None:
        """Write a consistent copy of the running sandbox's writable layer to ``dest`` (a
        new file, in the substrate's own format: a container's disk image, an fn worker's
        packed tmpfs trees), from which ``start`` can begin another (``StartPlan.disk_from``).
        Returns the disk's write count as of the copy (see ``disk_writes``), or None if
        unknown."""
        raise NotSupported(f"filesystem snapshots of {self.name} sandboxes are not supported "
                           "yet: their writable layer is not a disk image dsec can copy")

    async def disk_writes(self, sandbox_id: str, runtime: dict[str, Any]) -> int | None:
        """How much has been written to the sandbox's writable layer so far, every change
        included (synced first): equal to what ``snapshot_disk`` returned means the layer
        is the snapshot's. None where the substrate cannot tell (a snapshot is then taken)."""
        return None

    async def snapshot_full(self, sandbox_id: str, runtime: dict[str, Any], disk: Path,
                            memory: Path) -> None:
        """Write the running sandbox's writable layer to ``disk`` and its memory, devices and
        processes to ``memory`` (new files), of one instant; ``start`` with both
        (``StartPlan.disk_from``, ``memory_from``) continues another from that instant."""
        raise NotSupported(f"'full' snapshots (memory and processes) of {self.name} sandboxes "
                           "are not supported; take mode='filesystem'")

    async def rollback(self, plan: StartPlan, runtime: dict[str, Any]) -> dict[str, Any]:
        """Restart the running sandbox ``plan.sandbox_id`` from ``plan.disk_from`` (its own
        snapshot; with ``plan.memory_from`` its processes too, else fresh): the same id and
        agent token; its new runtime dict. Where ``rollback_keeps_network``, the edge plugs
        the policy in force into the restarted sandbox again. ``SnapshotNotFound`` only when
        the snapshot's files were found gone before anything of the sandbox was touched (it
        runs on as it was); any other failure leaves it to be stopped."""
        raise NotSupported(f"rollback of {self.name} sandboxes is not supported yet")

    async def set_paused(self, sandbox_id: str, runtime: dict[str, Any],
                         paused: bool) -> dict[str, Any]:
        """Stop the whole sandbox so it uses no CPU (``paused``), or let it run again; both
        idempotent, and a paused sandbox is still ``alive``. ``destroy`` works on a paused one.
        Its runtime dict: the same, or a new one if the substrate restarted its process."""
        raise NotSupported(f"the {self.name} substrate cannot pause a sandbox yet")

    async def undo_interrupted(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        """Undo what an edge killed in the middle of an operation can leave on a sandbox it
        had recorded running: its processes or file system frozen for a snapshot, a VM
        stopped for a copy of its disk. Idempotent; called when a restarted edge adopts the
        sandbox. Nothing to undo by default."""
        return None

    async def halt(self, sandbox_id: str, runtime: dict[str, Any]) -> bool:
        """Make the sandbox unable to run anything more, at once (no process of it runs
        user code again), without removing it; True when done, so its ``destroy`` may finish
        off the caller's path (``Edge.stop``). False (the default): this substrate has no
        such step, and a stop waits for the whole ``destroy``."""
        return False

    @abstractmethod
    async def destroy(self, sandbox_id: str) -> None:
        """Remove every trace of the sandbox; idempotent, works from the id alone."""

    @abstractmethod
    async def leftovers(self) -> set[str]:
        """Ids of sandboxes that have anything (process, mount, cgroup, dir) on this host."""
