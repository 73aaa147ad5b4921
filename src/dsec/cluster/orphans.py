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
import shutil
from pathlib import Path

import ray

from ..images.mount import locked
from ..store.sqlite import StateStore
from ..substrates.container import ContainerSubstrate
from .ids import edge_id_for

log = logging.getLogger("dsec.cluster")
EDGE_DIR = re.compile(r"r[0-9a-f]{8}")


def edge_dirs(state_dir: Path) -> list[Path]:
    return [p for p in state_dir.glob("r*") if p.is_dir() and EDGE_DIR.fullmatch(p.name)]


async def sweep_edge(edge_dir: Path) -> int:
    """Destroy every sandbox of the edge whose directory this is; the number destroyed."""
    substrate = ContainerSubstrate(edge_dir, edge_dir.name)
    left = await substrate.leftovers()
    for sandbox_id in left:
        await substrate.destroy(sandbox_id)
    await substrate.close()
    return len(left)


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
            shutil.rmtree(edge_dir, ignore_errors=True)
        log.warning("edge %s: removed %d sandboxes of dead edge %s", own, removed, edge)
        reclaimed.append(edge)
    return reclaimed
