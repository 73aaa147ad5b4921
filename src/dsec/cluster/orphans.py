"""What an edge whose Ray node died left on its host.

When a host's Ray node dies and comes back, it is a new node with a new edge; the old edge's
sandboxes may still run there (a raylet crash, unlike a power loss, leaves them). The first
edge started on the host removes them and records them died. Edge directories sit side by
side in the state directory, named by edge id; one whose node Ray does not list as alive is
an orphan.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import ray

from ..images.mount import locked
from ..store.sqlite import StateStore
from ..substrates.container import ContainerSubstrate
from ..substrates.tree import remove_tree
from .ids import edge_id_for

log = logging.getLogger("dsec.cluster")
EDGE_DIR = re.compile(r"r[0-9a-f]{8}")


def edge_dirs(state_dir: Path) -> list[Path]:
    return [p for p in state_dir.glob("r*") if p.is_dir() and EDGE_DIR.fullmatch(p.name)]


async def sweep_edge(edge_dir: Path) -> int:
    """Destroy every sandbox of the edge whose directory this is; the number destroyed."""
    substrate = ContainerSubstrate(edge_dir, edge_dir.name)
    removed = 0
    for sandbox_id in await substrate.leftovers():
        try:
            await substrate.destroy(sandbox_id)
        except Exception:  # one sandbox's remains never stop the sweep
            log.exception("could not remove sandbox %s of dead edge %s", sandbox_id, edge_dir.name)
            continue
        removed += 1
    await substrate.close()
    return removed


async def reclaim_dead_edges(state_dir: Path, own: str, store: StateStore) -> list[str]:
    """Remove the sandboxes of this host's edges whose node is not alive; their ids."""
    alive = {edge_id_for(n["NodeID"]) for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}
    reclaimed = []
    for edge_dir in edge_dirs(state_dir):
        edge = edge_dir.name
        if edge == own or edge in alive:
            continue
        with locked(state_dir / f".{edge}.lock"):
            if not edge_dir.exists():
                continue  # another edge of this host got there first
            for row in store.sandboxes(edge=edge, live_only=True):
                store.mark_ended(row.id, "died", f"its node died (removed by edge {own})")
            removed = await sweep_edge(edge_dir)
            try:
                remove_tree(edge_dir)  # iterative, and never into a disk still mounted
            except OSError:
                log.exception("could not remove all of dead edge %s's directory", edge)
        log.warning("edge %s: removed %d sandboxes of dead edge %s", own, removed, edge)
        reclaimed.append(edge)
    return reclaimed
