"""Which layers each node's sandboxes use, recorded in the (possibly shared) image store, so
that a garbage collector on any node never removes a layer mounted on another.

Each edge keeps one small file, ``nodes/<edge id>.json`` (its image versions and their layer
digests, and when it was last written), rewritten whole by rename. An edge takes an image
into use through ``resolve``: the image is looked up and, if it is new to the edge, recorded,
both under the store's shared lock, before anything of it is mounted. The collector reads
every record under the exclusive lock (images/gc.py), so it sees either the name that made
the image reachable or the record that now holds it, never neither.

What an edge holds: every image version it took into use since it started (a sandbox, a warm
pool, an fn template, a rollback), and on a restart the versions of the sandboxes it adopts.
That is what it really keeps: EROFS layers stay loop-mounted on the node (``LayerMounter``)
and warm pools and fn templates of an image last as long as the edge, so a version is let go
only when the edge stops; then its record keeps just the versions of sandboxes still running
(they outlive the edge and are adopted by its next start), and is removed if there are none.

A record is never ignored for being old. An edge renews its record every ``RENEW_S``; one
not renewed for ``STALE_S`` is logged by the collector as stale, but its layers are still
kept: its node may only be cut off from the shared store or hung, with sandboxes still
reading those layers (a removed directory layer breaks them at once; a removed EROFS file is
only freed at unmount anyway). A node gone for good costs disk until its edge starts again
(which rewrites the record from what it adopts), a cluster's edge on its host has swept what
it left (``cluster.orphans``: then its record goes), or an operator removes its file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.images.mount import locked
from dsec.images.store import write_whole

if TYPE_CHECKING:
    from dsec.images.store import Image, ImageStore

log = logging.getLogger(__name__)

RENEW_S = 60.0
STALE_S = 600.0
EDGE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class NodeUses:
    """This edge's record of the image versions (and so the layers) it uses."""

    def __init__(self, images: ImageStore, edge_id: str) -> None:
        self.images = images
        self.path = record_path(images.root, edge_id)
        self.edge_id = edge_id
        self._held: dict[str, list[str]] = {}  # image digest -> its layer digests
        self._lock = threading.Lock()  # resolve runs in worker threads
        self._written_at = 0.0
        self.read_only = False  # a store this node cannot write: nothing recorded (start)

    def resolve(self, find: Callable[[], Image]) -> Image:
        """``find()`` (a lookup by name or digest), recorded as used by this node before the
        caller mounts it; both under the store's shared lock (see the module docstring). An
        image this node holds already needs neither: its record keeps the layers."""
        image = find()
        if self.read_only:
            return image
        with self._lock:
            if image.digest in self._held:
                return image
        with locked(self.images.lock_path, shared=True):
            image = find()
            with self._lock:
                if image.digest not in self._held:  # held once the record says so
                    self._write({**self._held, image.digest: [layer.digest
                                                              for layer in image.layers]})
            return image

    def recorded(self, image: Image) -> bool:
        """Whether ``resolve`` has nothing to do for ``image`` (this node holds it already,
        or records nothing): a create then skips its worker-thread hop."""
        with self._lock:
            return self.read_only or image.digest in self._held

    def start(self, images: list[Image]) -> None:
        """A starting edge's record: the versions of the sandboxes it adopted, and nothing
        its previous run held. A store mounted read-only on this node (or not writable by
        it) is logged: its layers cannot be kept for it, so the store must not be collected
        by another node (``--layer-grace-s`` very long there)."""
        try:
            with locked(self.images.lock_path, shared=True), self._lock:
                self._write({image.digest: [layer.digest for layer in image.layers]
                             for image in images})
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            self.read_only = True
            log.warning("edge %s cannot write the image store %s (%s): the layers it uses "
                        "are not recorded, and a layer collector elsewhere may remove them",
                        self.edge_id, self.images.root, exc)

    def renew(self) -> None:
        """Called often (the edge's reaper): rewrites the record every ``RENEW_S``."""
        with self._lock:
            if not self.read_only and time.time() - self._written_at >= RENEW_S:
                self._write(self._held)

    def stop(self, still_running: set[str]) -> None:
        """The edge stops: only the versions (digests) of sandboxes that keep running stay
        held, until the edge's next start adopts them; no record at all if none do."""
        with self._lock:
            held = {d: ls for d, ls in self._held.items() if d in still_running}
            if self.read_only:
                self._held = held
            elif held:
                self._write(held)
            else:
                self.path.unlink(missing_ok=True)
                self._held = held

    def _write(self, held: dict[str, list[str]]) -> None:
        """Record ``held`` (whole, by rename); it is what this node holds once written."""
        written_at = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(self.path, json.dumps({"edge": self.edge_id, "written_at": written_at,
                                           "images": held}).encode())
        self._held, self._written_at = held, written_at


def nodes_dir(root: Path) -> Path:
    return root / "nodes"


def record_path(root: Path, edge_id: str) -> Path:
    """The edge's record: named by its id, or by a digest of an id (``--edge-id``) that is
    no plain file name."""
    if not EDGE_ID.fullmatch(edge_id) or edge_id.startswith("."):
        edge_id = "h" + hashlib.sha256(edge_id.encode()).hexdigest()[:32]
    return nodes_dir(root) / f"{edge_id}.json"


def forget(root: Path, edge_id: str) -> None:
    """Remove a dead edge's record, once nothing of it runs (``cluster.orphans``)."""
    record_path(root, edge_id).unlink(missing_ok=True)


def read_all(root: Path, now: float) -> tuple[set[str], set[str], list[str]]:
    """Every node's record: (image digests, layer digests) they use, and the stale nodes.
    Only regular files named like an edge's record are read; one that cannot be read raises
    (``ValueError``), as the layers it names cannot be known."""
    versions: set[str] = set()
    layers: set[str] = set()
    stale: list[str] = []
    directory = nodes_dir(root)
    if not directory.is_dir():
        return versions, layers, stale
    for entry in os.scandir(directory):
        name = entry.name.removesuffix(".json")
        if not (entry.name.endswith(".json") and EDGE_ID.fullmatch(name)
                and not name.startswith(".") and entry.is_file(follow_symlinks=False)):
            continue
        try:
            record = json.loads(Path(entry.path).read_text())
            held = {str(d): [str(x) for x in ls] for d, ls in record["images"].items()}
            written_at = float(record["written_at"])
        except FileNotFoundError:
            continue  # its edge stopped meanwhile
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # Its layers may be mounted: no layer is collected until it is readable again.
            raise ValueError(f"node record {entry.path} cannot be read ({exc}): layers are "
                             "not collected until it is fixed or removed") from exc
        versions.update(held)
        for ls in held.values():
            layers.update(ls)
        if now - written_at > STALE_S:
            stale.append(name)
    return versions, layers, stale
