"""Garbage collection of the image store: layers (and recorded image versions) that nothing
uses any more, after a grace period. A ``Collector`` (``dsec.store.gc``) of kinds ``layers``
and ``image_versions``.

What keeps a layer: a named image's manifest; an image version a snapshot was made from
(``pinned()``, the state store's snapshot records: a snapshot restores onto exactly those
layers, whatever its image's name points at now); a version or layer any node's sandboxes
use (``node_uses``: every node of a cluster sharing the store writes its own record there);
and the grace: a layer is kept ``grace_s`` after it was last written or used by a build, so
one being built or picked up by a build at the scan is never taken. A version record is kept
while a name, a snapshot or a node names it, and ``grace_s`` after it was last named.

Against concurrent use, the collector first scans without a lock (a dry run stops there, and
a pass with nothing to remove never takes the lock), then takes the store's lock exclusively
(builds, imports and edges taking an image into use hold it shared) and reads every record
again before it moves each layer aside by an atomic rename; the files are removed after the
lock is given back. A build that picked up a layer holds the lock until its manifest is
written; an edge, until its node record names the layer. Two collectors (a lapsed lease, or
two deployments on one store) take turns on the lock and a rename happens once: each layer
is removed and counted once. A collector that dies between the rename and the removal
leaves ``tmp/<hex>.gc.*``, removed by the next one; a builder that dies leaves its scratch
directory (with a pull's staging tmpfs mounted), removed by the next collection.

Trust: what is removed is named only by the store's own directory listing (a 64-hex
directory under ``layers/``, never a link) and its records; nothing a sandbox makes is read.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..protocol.gc_models import Removed
from .mount import locked
from .node_uses import read_all
from .store import ImageStore

log = logging.getLogger("dsec.gc")
LOCK_WAIT_S = 10.0  # a build holds the store's lock for minutes: this pass then leaves layers


@dataclass(frozen=True)
class Garbage:
    layers: dict[str, int]  # digest -> bytes
    versions: dict[str, int]


class UnusedLayers:
    name = "layers"

    def __init__(self, images: ImageStore, pinned: Callable[[], set[str]], grace_s: float) -> None:
        self.images = images
        self.pinned = pinned  # image digests the snapshots were made from (thread-safe)
        self.grace_s = grace_s

    async def collect(self, now: float, dry_run: bool) -> list[Removed]:
        garbage = await asyncio.to_thread(self._scan, now)
        if not dry_run:
            for path in self.images.layers.taken_out():  # a dead collector's
                await asyncio.to_thread(shutil.rmtree, path, True)
            await asyncio.to_thread(self.images.layers.sweep_scratch)  # dead builders'
        if not dry_run and (garbage.layers or garbage.versions):
            garbage = await asyncio.to_thread(self._remove, now)
        return [Removed(kind="layers", count=len(garbage.layers), bytes=sum(garbage.layers.values())),
                Removed(kind="image_versions", count=len(garbage.versions),
                        bytes=sum(garbage.versions.values()))]

    def _scan(self, now: float) -> Garbage:
        """What is garbage at ``now``, from every record as it is read now."""
        cutoff = now - self.grace_s
        named, versions = self.images.references()
        in_use, used_layers, stale = read_all(self.images.root, time.time())
        for node in stale:
            log.warning("node %s has not renewed its layer uses for over 10 minutes: its "
                        "layers are kept until its edge starts again or its record "
                        "(%s/nodes/%s.json) is removed", node, self.images.root, node)
        kept = set(named) | self.pinned() | in_use
        dead_versions = {d: size for d, (mtime, size, _) in versions.items()
                         if d not in kept and mtime < cutoff}
        keep = used_layers | {layer for layers in named.values() for layer in layers}
        keep |= {layer for d, (_, _, layers) in versions.items() if d not in dead_versions
                 for layer in layers}
        dead_layers = {d: size for d, (mtime, size) in self.images.layers.digests().items()
                       if d not in keep and mtime < cutoff}
        return Garbage(dead_layers, dead_versions)

    def _remove(self, now: float) -> Garbage:
        """Under the store's exclusive lock: scan again, and take out what is garbage then;
        what this call removed."""
        aside: list[Path] = []
        layers, versions = {}, {}
        try:
            with locked(self.images.lock_path, wait_s=LOCK_WAIT_S):
                garbage = self._scan(now)
                for digest in garbage.versions:
                    if self.images.remove_version(digest):
                        versions[digest] = garbage.versions[digest]
                for digest, size in garbage.layers.items():
                    if (path := self.images.layers.take_out(digest)) is not None:
                        aside.append(path)
                        layers[digest] = size
        except TimeoutError:
            log.info("image store busy (a build or import holds it): layers are collected "
                     "at a later pass")
        for path in aside:
            shutil.rmtree(path, ignore_errors=True)
        for digest in layers:
            log.info("removed layer %s (%d bytes)", digest, layers[digest])
        return Garbage(layers, versions)
