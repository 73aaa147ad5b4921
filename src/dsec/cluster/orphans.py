"""What an edge whose Ray node died left on its host.

When a host's Ray node dies and comes back, it is a new node with a new edge; the old edge's
sandboxes may still run there (a raylet crash, unlike a power loss, leaves them). The first
edge started on the host removes them and records them died. Edge directories sit side by
side in the state directory, named by edge id; one whose node Ray does not list as alive is
an orphan.

Every substrate is asked, as a restarting edge asks its own (``Edge.recover``): its
leftovers of the dead edge's directory are destroyed one by one (containers, QEMU processes
with their taps and cgroups), then ``close`` removes what is not a sandbox's (the fn
substrate's template cgroups, the substrates' cgroup parents). A leftover that cannot be
removed is logged and the sweep goes on. Once all of it is gone, so is the dead edge's record
of the image layers it used (``images.node_uses``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import ray

from ..config import Settings
from ..images.mount import locked
from ..images.node_uses import forget
from ..images.store import ImageStore
from ..store.sqlite import StateStore
from ..substrates.host.tree import remove_tree
from ..substrates.registry import all_substrates, disk_volume
from .ids import edge_id_for

log = logging.getLogger("dsec.cluster")
EDGE_DIR = re.compile(r"r[0-9a-f]{8}")


def edge_dirs(state_dir: Path) -> list[Path]:
    return [p for p in state_dir.glob("r*") if p.is_dir() and EDGE_DIR.fullmatch(p.name)]


async def sweep_edge(settings: Settings, edge_dir: Path) -> int:
    """Destroy every sandbox, of every substrate, of the edge whose directory this is, and
    what its substrates kept beside them; the number of sandboxes destroyed."""
    removed = 0
    volume = disk_volume(settings, edge_dir, edge_dir.name)
    for name, substrate in all_substrates(settings, edge_dir, edge_dir.name, volume).items():
        try:
            leftovers = await substrate.leftovers()
        except Exception:
            log.exception("could not list the %s leftovers of dead edge %s", name, edge_dir.name)
            leftovers = set()
        for sandbox_id in leftovers:
            try:
                await substrate.destroy(sandbox_id)
            except Exception:  # one sandbox's remains never stop the sweep
                log.exception("could not remove %s sandbox %s of dead edge %s", name, sandbox_id,
                              edge_dir.name)
                continue
            removed += 1
        try:
            await substrate.close()
        except Exception:
            log.exception("could not remove the %s remains of dead edge %s", name, edge_dir.name)
    try:
        await asyncio.to_thread(volume.close)
    except Exception:
        log.exception("could not unmount the disk volume of dead edge %s", edge_dir.name)
    return removed


async def reclaim_dead_edges(settings: Settings, own: str, store: StateStore) -> list[str]:
    """Remove the sandboxes of this host's edges whose node is not alive; their ids."""
    alive = {edge_id_for(n["NodeID"]) for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}
    reclaimed = []
    for edge_dir in edge_dirs(settings.state_dir):
        edge = edge_dir.name
        if edge == own or edge in alive:
            continue
        with locked(settings.state_dir / f".{edge}.lock"):
            if not edge_dir.exists():
                continue  # another edge of this host got there first
            for row in store.sandboxes(edge=edge, live_only=True):
                store.mark_ended(row.id, "died", f"its node died (removed by edge {own})")
            removed = await sweep_edge(settings, edge_dir)
            try:
                remove_tree(edge_dir)  # iterative, and never into a disk still mounted
            except OSError:
                log.exception("could not remove all of dead edge %s's directory", edge)
            else:  # nothing of it runs any more: the layers it used are no longer its
                forget(ImageStore(settings.image_store).root, edge)
        log.warning("edge %s: removed %d sandboxes of dead edge %s", own, removed, edge)
        reclaimed.append(edge)
    return reclaimed
