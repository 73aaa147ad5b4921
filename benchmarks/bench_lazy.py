"""``dsec bench --only lazy``: how much of a large image a sandbox reads from the image store,
and what a large image's first create costs from a cold node against a warm one.

The image is ``bench-lazy-1g``: ``debian-minbase`` plus one EROFS layer of 1,000 files of 1 MiB
of seeded random bytes (incompressible), built once into the image store and kept there
(``dsec image rm bench-lazy-1g`` frees it). The layer is loop-mounted over its file in the
store, so what the store serves is that file's pages: the figures are the file's bytes in the
page cache (``fincore``) after ``drop_caches`` and a fresh mount by a new private server, which
counts the store side's own readahead too. The loop device's sectors read during the ``cat``
(``/sys/block/loopN/stat``, a difference: loop devices are reused and keep counting) are
what EROFS itself asked for, reported alongside.

- **bytes read**: a sandbox runs ``cat`` of 50 of the 1,000 files (5 %); baseline: the same
  ``cat`` on a plain ``mount -o loop`` of the same layer file outside dsec;
- **first create**: cold (``drop_caches``, layers not mounted) for ``debian-minbase`` (the
  baseline) and for the 1 GiB image, warm (layers mounted, pages cached) for the 1 GiB image;
- **DSEC_LAYER_CACHE**: the first create with a node-local layer cache, empty (the whole layer
  file is copied before the mount: not lazy) and already holding the copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import secrets
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from rich.console import Console

from dsec.images.mount import mountpoints, unmount
from dsec.images.store import Image, ImageStore, Layer
from dsec.protocol.errors import ImageNotFound

from .bench import BENCH_ROOT, IMAGE, Created, Sample, bench_server, phase

LAZY_IMAGE = "bench-lazy-1g"
FILES, FILE_BYTES, TOUCHED = 1000, 1 << 20, 50
MIB = float(1 << 20)


async def lazy_series(console: Console, quick: bool = False) -> list[Sample]:
    rounds = 2 if quick else 5
    with phase(console, f"the {LAZY_IMAGE} image (built once, kept in the image store)"):
        image, layer = _ensure_image()
    touched = [f"/lazy/f{i:04d}.bin" for i in range(0, FILES, FILES // TOUCHED)]
    cat = "cat " + " ".join(touched) + " | wc -c"
    touched_mib = len(touched) * FILE_BYTES / MIB
    plain = Sample("plain loop mount, cat 5 % (MiB read from the store, not ms)", [])
    ours = Sample("dsec sandbox, cat 5 % (MiB read from the store, not ms)", [], baseline=plain)
    mount_reads = Sample("dsec first create, 1 GiB image (KiB read from the store, not ms)", [])
    cold_small = Sample(f"first create, cold node, {IMAGE}", [])
    cold_big = Sample("first create, cold node, 1 GiB image", [], baseline=cold_small)
    warm_big = Sample("create, warm node (layers mounted), 1 GiB image", [], baseline=cold_small)
    copy_cold = Sample("first create, DSEC_LAYER_CACHE empty (copies the layer), 1 GiB image", [],
                       baseline=cold_small)
    copy_warm = Sample("first create, DSEC_LAYER_CACHE holds the copy, cold pages, 1 GiB image", [],
                       baseline=cold_small)
    copy_read = Sample("DSEC_LAYER_CACHE empty: MiB read from the store (not ms)", [])
    plain_loop: list[float] = []  # what the loop device read for the cat alone
    ours_loop: list[float] = []
    root = BENCH_ROOT / secrets.token_hex(3)
    try:
        for n in range(rounds):
            with phase(console, f"round {n + 1}/{rounds}: plain mount"):
                read, by_loop = _plain_mount_reads(layer, touched, root / f"plain-{n}")
                plain.values_ms.append(read / MIB)
                plain_loop.append(by_loop / MIB)
            with phase(console, f"round {n + 1}/{rounds}: cold and warm creates"):
                async with _server(root / f"small-{n}") as created:
                    _drop_caches()
                    cold_small.values_ms.append(await created.first_output(image=IMAGE))
                async with _server(root / f"big-{n}") as created:
                    _drop_caches()
                    cold_big.values_ms.append(await created.first_output(image=LAZY_IMAGE))
                    loop = _source_of(root / f"big-{n}" / "layers" / layer.digest.removeprefix("sha256:"))
                    at_create, loop_before = _resident(layer.path), _sectors_read(loop)
                    result = await created.sandboxes[-1].run(cat, timeout_s=300)
                    if result.stdout.strip() != str(len(touched) * FILE_BYTES):
                        raise RuntimeError(f"cat read {result.stdout!r} bytes: {result.stderr!r}")
                    mount_reads.values_ms.append(at_create / 1024)
                    ours.values_ms.append(_resident(layer.path) / MIB)
                    ours_loop.append((_sectors_read(loop) - loop_before) * 512 / MIB)
                    for _ in range(3):
                        warm_big.values_ms.append(await created.first_output(image=LAZY_IMAGE))
            with phase(console, f"round {n + 1}/{rounds}: DSEC_LAYER_CACHE"):
                cache = root / f"layer-cache-{n}"
                async with _server(root / f"copy-{n}", layer_cache=cache) as created:
                    _drop_caches()
                    copy_cold.values_ms.append(await created.first_output(image=LAZY_IMAGE))
                    copy_read.values_ms.append(_resident(layer.path) / MIB)
                async with _server(root / f"copied-{n}", layer_cache=cache) as created:
                    _drop_caches()
                    copy_warm.values_ms.append(await created.first_output(image=LAZY_IMAGE))
                shutil.rmtree(cache)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    image_mib = layer.size_bytes / MIB
    plain.extra = {"loop_device_mib_for_cat_p50": round(_median(plain_loop), 2)}
    ours.extra = {"touched_mib": touched_mib, "layer_mib": round(image_mib, 1),
                  "p50_ratio_to_touched": round(ours.pct(50) / touched_mib, 3),
                  "p50_fraction_of_layer": round(ours.pct(50) / image_mib, 4),
                  "loop_device_mib_for_cat_p50": round(_median(ours_loop), 2),
                  "image": f"{image.name} {image.digest}"}
    console.print(f"touched {touched_mib:.0f} MiB of a {image_mib:.0f} MiB layer; the sandbox "
                  f"read {ours.pct(50):.1f} MiB from the store ({ours.pct(50) / touched_mib:.2f}× "
                  f"what it touched, target ≤ 2×; {mount_reads.pct(50):.0f} KiB of it to create); "
                  f"its loop device read {_median(ours_loop):.1f} MiB for the cat")
    return [plain, ours, mount_reads, cold_small, cold_big, warm_big, copy_cold, copy_warm, copy_read]


@asynccontextmanager
async def _server(state: Path, layer_cache: Path | None = None) -> AsyncIterator[Created]:
    """A private server without a warm pool (so no create happens before the timed one)."""
    saved = os.environ.get("DSEC_LAYER_CACHE")
    if layer_cache is not None:
        os.environ["DSEC_LAYER_CACHE"] = str(layer_cache)
    try:
        async with bench_server(state, "--warm-pool", "0") as created:
            created.options["ttl_s"] = 600
            yield created
    finally:
        os.environ.pop("DSEC_LAYER_CACHE", None)
        if saved is not None:
            os.environ["DSEC_LAYER_CACHE"] = saved


def _ensure_image() -> tuple[Image, Layer]:
    """``bench-lazy-1g`` and its 1 GiB layer, built if missing (seeded: the same bytes each time)."""
    store = ImageStore()
    base = store.ensure(IMAGE)
    key = hashlib.sha256(f"dsec-bench-lazy/{base.digest}/{FILES}x{FILE_BYTES}/seed0".encode())

    def build(scratch: Path) -> None:
        data = scratch / "rootfs" / "lazy"
        data.mkdir(parents=True)
        for i in range(FILES):
            (data / f"f{i:04d}.bin").write_bytes(random.Random(i).randbytes(FILE_BYTES))

    layer, _ = store.layers.ensure(f"sha256:{key.hexdigest()}", {"bench": "lazy"}, build)
    with contextlib.suppress(ImageNotFound):
        image = store.get(LAZY_IMAGE)
        if image.layers[-1].digest == layer.digest:
            return image, layer
    return store.save_built(LAZY_IMAGE, [*base.layers, layer], base.config, {"bench": "lazy"}), layer


def _plain_mount_reads(layer: Layer, touched: list[str], target: Path) -> tuple[int, int]:
    """What a plain loop mount of the layer file reads of it to mount and ``cat`` the touched
    files: (bytes of the file read, bytes the loop device read for the ``cat``)."""
    target.mkdir(parents=True)
    _drop_caches()
    subprocess.run(["mount", "-t", "erofs", "-o", "ro,loop", str(layer.path), str(target)], check=True)
    try:
        loop = _source_of(target)
        before = _sectors_read(loop)
        for path in touched:
            with open(target / path.lstrip("/"), "rb") as f:
                while f.read(1 << 20):
                    pass
        return _resident(layer.path), (_sectors_read(loop) - before) * 512
    finally:
        unmount(target)


def _source_of(target: Path) -> str:
    """The block device (``loopN``) mounted at ``target``."""
    target = target.resolve()
    if target not in mountpoints():
        raise RuntimeError(f"nothing is mounted at {target}")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(target):
                return Path(fields[fields.index("-") + 2]).name
    raise RuntimeError(f"no source for {target}")


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _sectors_read(loop: str) -> int:
    """Sectors (512 B) read from the loop device (``/sys/block/*/stat``). Loop devices are
    reused and keep counting across attachments: only differences mean anything."""
    return int(Path(f"/sys/block/{loop}/stat").read_text().split()[2])


def _resident(path: Path) -> int:
    """Bytes of ``path`` in the page cache (``fincore``): after ``drop_caches``, what was read."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    time.sleep(0.2)
