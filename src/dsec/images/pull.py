"""Pull an image from an OCI distribution registry into the layer store.

Why it is short: the registry client (registry.py) verifies every byte, and the per-layer
conversion is the archive import's (``oci.unpacking``). What is left is the order: resolve
the reference to one manifest (picking the platform from an index), fetch and verify the config,
then for each layer ask the store for its key (parent + diff_id): a layer already stored —
by an earlier pull, or an archive import of the same image — is neither downloaded nor converted.
A missing one streams from the registry straight into its unpacking (gunzip and tar while
it downloads, in its scratch directory, which may be a tmpfs: LayerStore.ensure) and is committed
only once the blob's digest, the gzip stream and the diff_id have all been checked; layers do
this in parallel (their keys are known up front). Nothing is named until every layer is in; a
failure leaves at most complete, verified layers (reused by the next try) and no image.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.config import current
from dsec.images.builder import BuildProgress
from dsec.images.oci import (
    oci_layer_key,
    pick_manifest,
    run_config,
    unpacking,
    workdir_layer,
)
from dsec.images.registry import INDEX_TYPES, MAX_DOCUMENT, Registry, check_descriptor
from dsec.protocol.errors import NotSupported, RegistryError

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from dsec.images.reference import Reference
    from dsec.images.store import Layer, LayerStore

MAX_LAYERS = 128  # overlayfs stacks a few hundred lowers; real images stay far below
# Layers download and convert in parallel (their keys chain through diff_ids, known from the
# config): gunzip, tar and mkfs.erofs of one layer keep about one core busy.
_WORKERS = min(4, os.cpu_count() or 1)
_MAX_INDEX_ENTRIES = 256
_LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
}


def pull_layers(ref: Reference, store: LayerStore, platform: str | None = None,
                console: Console | None = None) -> tuple[list[Layer], dict[str, Any], str]:
    """The image's layers (bottom→top, with the /work layer), its run settings, and the
    digest of the manifest they came from."""
    progress = BuildProgress(console)
    with Registry(ref) as registry:
        digest, manifest, media_type = registry.manifest(ref.pinned)
        if media_type in INDEX_TYPES:
            entries = manifest.get("manifests")
            if not isinstance(entries, list) or not 0 < len(entries) <= _MAX_INDEX_ENTRIES:
                raise RegistryError(f"{ref}: the index lists no usable manifests (or more than "
                                    f"{_MAX_INDEX_ENTRIES})", registry=ref.registry)
            descriptor = pick_manifest([e for e in entries if isinstance(e, dict)], platform)
            chosen, _ = check_descriptor(descriptor, MAX_DOCUMENT, ref)
            digest, manifest, media_type = registry.manifest(chosen)  # verified: fetched by digest
            if media_type in INDEX_TYPES:
                raise RegistryError(f"{ref}: an index inside an index", registry=ref.registry)
        descriptors = manifest.get("layers")
        if (not isinstance(descriptors, list) or len(descriptors) > MAX_LAYERS
                or not all(isinstance(d, dict) for d in descriptors)):
            raise RegistryError(f"{ref}: the manifest must list at most {MAX_LAYERS} layers",
                                registry=ref.registry)
        config = registry.document(manifest.get("config"))
        rootfs = config.get("rootfs")
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if (not isinstance(diff_ids, list) or len(diff_ids) != len(descriptors)
                or not all(isinstance(d, str) and d.startswith("sha256:") for d in diff_ids)):
            raise RegistryError(f"{ref}: the config's diff_ids do not match the manifest's "
                                f"{len(descriptors)} layers", registry=ref.registry)
        keys: list[str] = []
        for diff_id in diff_ids:
            keys.append(oci_layer_key(keys[-1] if keys else None, diff_id))
        labels = [f"{ref}: layer {i}/{len(keys)}" for i in range(1, len(keys) + 1)]
        workers = max(1, min(_WORKERS, len(keys)))
        with progress.layers(labels) as shows, ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(_layer, store, key, descriptor, diff_id, registry, progress,
                                   label, show)
                       for key, descriptor, diff_id, label, show
                       in zip(keys, descriptors, diff_ids, labels, shows, strict=True)]
            try:
                layers = [future.result() for future in futures]
            except BaseException:
                pool.shutdown(cancel_futures=True)  # no more downloads after a failure
                raise
    settings = config.get("config")
    return ([*layers, workdir_layer(store, layers)],
            run_config(settings if isinstance(settings, dict) else {}), digest)


def _layer(store: LayerStore, key: str, descriptor: dict[str, Any], diff_id: str,
           registry: Registry, progress: BuildProgress, label: str,
           show: Callable[[str], None]) -> Layer:
    """One layer from the store, or downloaded, verified and converted into it (in a worker)."""
    started = time.monotonic()
    layer, fresh = store.ensure(key, {"section": "oci", "diff_id": diff_id,
                                      "blob": descriptor.get("digest")},
                                partial(_fetch_layer, registry, descriptor, diff_id, show),
                                in_memory=True)
    show("stored" if fresh else "already stored")
    progress.finished(label, layer, time.monotonic() - started if fresh else None)
    return layer


def _fetch_layer(registry: Registry, descriptor: dict[str, Any], diff_id: str,
                 show: Callable[[str], None], scratch: Path) -> None:
    media_type = descriptor.get("mediaType")
    if media_type not in _LAYER_TYPES:
        raise NotSupported(f"{registry.ref}: layers of type {media_type!r} are not supported "
                           "(dsec takes tar and tar+gzip layers)")
    total = descriptor.get("size", 0)
    with unpacking(diff_id, scratch) as unpacker:  # finished only once the blob's digest matched
        registry.blob(descriptor, unpacker.write, current().image_layer_max_mb << 20,
                      lambda done: show(f"{done / 1e6:.1f} / {total / 1e6:.1f} MB"))
        show("converting")
