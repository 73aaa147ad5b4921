"""A node-local cache of layer files from a shared image store (NFS, 3FS, any POSIX mount).

With ``DSEC_LAYER_CACHE`` (``Settings.layer_cache``) set to a local directory, a node copies each EROFS layer file it
uses there once (to a temporary name, then an atomic rename) and loop-mounts the copy: later
sandboxes read local disk, and a node keeps running its images when the shared mount is slow
or briefly away. Layers are immutable and named by digest, so a copy never goes stale.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..config import current


def node_copy(layer_file: Path) -> Path:
    """The file to mount for ``layer_file``: a local copy when a cache is configured."""
    cache = current().layer_cache
    if not cache:
        return layer_file
    target = Path(cache) / f"{layer_file.parent.name}{layer_file.suffix}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        shutil.copyfile(layer_file, scratch)
        os.replace(scratch, target)
    return target
