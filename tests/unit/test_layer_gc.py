"""The image store's garbage collection on real stores (small imported images, directory
layers): what keeps a layer (a name, a snapshot's version, any node's record, the grace),
dry runs, two collectors racing, a build holding the store, and what an odd entry in the
store cannot make the collector do."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dsec.images import gc as image_gc
from dsec.images.gc import UnusedLayers
from dsec.images.mount import locked
from dsec.images.node_uses import STALE_S, NodeUses, forget
from dsec.images.store import Image, ImageStore
from dsec.protocol.errors import ImageNotFound, InvalidRequest
from test_images import _layer_tar, make_oci_archive

HOUR = 3600.0
LATER = 2 * HOUR  # past the collectors' grace


def image(store: ImageStore, tmp: Path, name: str, *tops: str) -> Image:
    """An image of a shared base layer and one layer per ``tops`` (a file each)."""
    base = _layer_tar([("etc", None, 0o755), ("etc/base", b"base\n", 0o644)])
    layers = [base, *(_layer_tar([(f"{t}.txt", t.encode(), 0o644)]) for t in tops)]
    return store.import_oci(make_oci_archive(tmp / f"{name}.tar", layers), name)


def layer_dirs(store: ImageStore) -> set[str]:
    return {f"sha256:{p.name}" for p in (store.root / "layers").iterdir()}


def collector(store: ImageStore, pinned: set[str] | None = None) -> UnusedLayers:
    return UnusedLayers(store, lambda: set(pinned or ()), HOUR)


def counts(removed: list) -> dict[str, tuple[int, int]]:  # type: ignore[type-arg]
    return {r.kind: (r.count, r.bytes) for r in removed}


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store", layer_format="dir")


async def test_removed_image_layers_go_after_the_grace_shared_ones_stay(
        store: ImageStore, tmp_path: Path) -> None:
    a = image(store, tmp_path, "a", "only-a")
    b = image(store, tmp_path, "b", "only-b")
    assert a.layers[0] == b.layers[0]
    store.remove("a")  # the name only: every layer is still there
    assert layer_dirs(store) == {layer.digest for layer in (*a.layers, *b.layers)}
    gc, now = collector(store), time.time()

    assert counts(await gc.collect(now, dry_run=False)) == {"layers": (0, 0),
                                                          "image_versions": (0, 0)}
    before = sorted(os.walk(store.root))
    dry = counts(await gc.collect(now + LATER, dry_run=True))
    unique = [layer for layer in a.layers if layer not in b.layers]  # (an import adds a top)
    assert dry["layers"] == (len(unique), sum(layer.size_bytes for layer in unique)) >= (1, 1)
    assert dry["image_versions"][0] == 1
    assert sorted(os.walk(store.root)) == before  # a dry run changes nothing

    assert counts(await gc.collect(now + LATER, dry_run=False)) == dry
    assert layer_dirs(store) == {layer.digest for layer in b.layers}
    assert store.get("b") == b and store.version(b.digest) == b
    with pytest.raises(ImageNotFound):
        store.version(a.digest)
    assert counts(await gc.collect(now + LATER, dry_run=False))["layers"] == (0, 0)


async def test_a_snapshots_version_keeps_its_layers_until_the_snapshot_goes(
        store: ImageStore, tmp_path: Path) -> None:
    a = image(store, tmp_path, "a", "one")
    again = image(store, tmp_path, "a", "two")  # the name rebuilt: a new version
    pinned = {a.digest}
    gc = UnusedLayers(store, lambda: set(pinned), HOUR)
    assert counts(await gc.collect(time.time() + LATER, False))["layers"] == (0, 0)
    assert store.version(a.digest).layers == a.layers  # what a create from it starts on
    assert store.get("a") == again
    pinned.clear()  # the snapshot deleted
    gone = [layer for layer in a.layers if layer not in again.layers]
    assert counts(await gc.collect(time.time() + LATER, False))["layers"][0] == len(gone) >= 1
    assert layer_dirs(store) == {layer.digest for layer in again.layers}


async def test_a_layer_another_node_uses_survives_a_collection_on_this_one(
        store: ImageStore, tmp_path: Path) -> None:
    a = image(store, tmp_path, "a", "mounted-elsewhere")
    other_node = NodeUses(ImageStore(store.root, layer_format="dir"), "e-other")
    other_node.start([])
    assert other_node.resolve(lambda: other_node.images.get("a")) == a
    store.remove("a")
    gc = collector(store)  # this node's collector, over the same (shared) store
    assert counts(await gc.collect(time.time() + LATER, False))["layers"] == (0, 0)

    record = json.loads(other_node.path.read_text())  # the other node stops renewing it
    record["written_at"] = time.time() - 10 * STALE_S
    other_node.path.write_text(json.dumps(record))
    assert counts(await gc.collect(time.time() + LATER, False))["layers"] == (0, 0)

    other_node.stop({a.digest})  # stopped with a sandbox of it still running: still kept
    assert counts(await gc.collect(time.time() + LATER, False))["layers"] == (0, 0)
    other_node.stop(set())  # nothing runs on it any more: the record goes, so do the layers
    assert not other_node.path.exists()
    assert counts(await gc.collect(time.time() + LATER, False))["layers"] == (len(a.layers),
                                                                             a.size_bytes)
    assert layer_dirs(store) == set()


async def test_an_unreadable_node_record_stops_layer_collection(
        store: ImageStore, tmp_path: Path) -> None:
    image(store, tmp_path, "a", "x")
    store.remove("a")
    (store.root / "nodes").mkdir(exist_ok=True)
    (store.root / "nodes" / "e-broken.json").write_text("{not json")
    before = layer_dirs(store)
    with pytest.raises(ValueError, match="e-broken.json cannot be read"):
        await collector(store).collect(time.time() + LATER, False)
    assert layer_dirs(store) == before


async def test_two_collectors_on_one_store_remove_and_count_each_layer_once(
        store: ImageStore, tmp_path: Path) -> None:
    kept = image(store, tmp_path, "kept")  # the base layer, which every image shares
    names, garbage = [f"i{n}" for n in range(8)], set()
    for name in names:
        garbage |= set(image(store, tmp_path, name, f"{name}-a", f"{name}-b").layers[1:])
        store.remove(name)
    first = collector(store)
    second = collector(ImageStore(store.root, layer_format="dir"))  # another replica
    when = time.time() + LATER
    results = await asyncio.gather(first.collect(when, False), second.collect(when, False))
    total = sum(counts(r)["layers"][0] for r in results)
    assert total == len(garbage) >= 2 * len(names)
    assert sum(counts(r)["image_versions"][0] for r in results) == len(names)
    assert layer_dirs(store) == {layer.digest for layer in kept.layers}
    assert not list((store.root / "tmp").iterdir())


async def test_a_build_holding_the_store_makes_the_collector_wait_or_leave_it(
        store: ImageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image(store, tmp_path, "a", "x")
    store.remove("a")
    before = layer_dirs(store)
    monkeypatch.setattr(image_gc, "LOCK_WAIT_S", 0.2)
    held, release = threading.Event(), threading.Event()

    def build() -> None:  # as ImageStore.build holds it, for the whole build
        with locked(store.lock_path, shared=True):
            held.set()
            release.wait()

    builder = threading.Thread(target=build)
    builder.start()
    held.wait()
    try:
        assert counts(await collector(store).collect(time.time() + LATER, False))["layers"] == (0, 0)
        assert layer_dirs(store) == before
    finally:
        release.set()
        builder.join()
    assert counts(await collector(store).collect(time.time() + LATER, False))["layers"][0] == len(
        before)


async def test_odd_entries_in_the_store_are_neither_followed_nor_removed(
        store: ImageStore, tmp_path: Path) -> None:
    a = image(store, tmp_path, "a", "x")
    store.remove("a")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_text("keep me")
    layers = store.root / "layers"
    link = layers / ("ab" * 32)  # a digest-shaped link to a directory outside the store
    link.symlink_to(outside)
    (layers / "not-a-digest").mkdir()
    (layers / ("cd" * 32)).write_text("a file, not a layer")
    (store.root / "images" / "versions" / f"{'ef' * 32}.json").symlink_to(outside / "canary")
    (store.root / "nodes").mkdir(exist_ok=True)
    (store.root / "nodes" / "e-link.json").symlink_to(outside / "canary")  # not read
    removed = counts(await collector(store).collect(time.time() + LATER, False))
    assert removed["layers"] == (len(a.layers), a.size_bytes)  # a's, and nothing else
    assert {p.name for p in layers.iterdir()} == {"ab" * 32, "not-a-digest", "cd" * 32}
    assert link.is_symlink() and (outside / "canary").read_text() == "keep me"
    assert (layers / ("cd" * 32)).is_file()


def test_locked_waits_at_most_wait_s(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    with locked(path, shared=True):
        with locked(path, shared=True, wait_s=0.1):
            pass  # shared holders share
        with pytest.raises(TimeoutError):
            with locked(path, wait_s=0.1):
                pass
    with locked(path, wait_s=0.1):
        pass


def test_a_node_that_only_reads_the_store_still_starts_its_images(
        store: ImageStore, tmp_path: Path) -> None:
    a = image(store, tmp_path, "a", "x")
    shutil.rmtree(store.root / "images" / "versions")  # a store from before versions
    read_only = tmp_path / "ro"
    read_only.mkdir()
    subprocess.run(["mount", "--bind", str(store.root), str(read_only)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(read_only)], check=True)
        reader = ImageStore(read_only, layer_format="dir")
        uses = NodeUses(reader, "e-reader")
        uses.start([])
        assert uses.read_only
        assert uses.resolve(lambda: reader.version(a.digest)).layers == tuple(
            dataclasses.replace(layer, path=read_only / layer.path.relative_to(store.root))
            for layer in a.layers)
        uses.renew()
        uses.stop(set())
    finally:
        subprocess.run(["umount", str(read_only)], check=True)
    assert not (store.root / "nodes").exists()


def test_a_node_record_is_a_plain_name_in_the_store_whatever_the_edge_id(
        store: ImageStore) -> None:
    for edge_id in ("../../etc/passwd", ".hidden", "e" * 200, "rdeadbeef"):
        uses = NodeUses(store, edge_id)
        assert uses.path.parent == store.root / "nodes"
        uses.start([])
        assert uses.path.is_file()
        forget(store.root, edge_id)  # a dead edge's, once its node's sandboxes are gone
        assert not uses.path.exists()
    assert NodeUses(store, "rdeadbeef").path.name == "rdeadbeef.json"


def test_a_version_is_found_by_a_whole_digest_only(store: ImageStore, tmp_path: Path) -> None:
    a = image(store, tmp_path, "a", "x")
    assert store.version(a.digest) == a
    for bad in (a.digest[:20], "sha256:../../images/a", a.digest.upper(), "a"):
        with pytest.raises(InvalidRequest):
            store.version(bad)
    with pytest.raises(ImageNotFound):
        store.version("sha256:" + "0" * 64)


async def test_what_a_dead_collector_moved_aside_goes_at_the_next_collection(
        store: ImageStore) -> None:
    aside = store.root / "tmp" / f"{'ab' * 32}.gc.dead"
    (aside / "rootfs").mkdir(parents=True)
    (aside / "rootfs" / "f").write_text("x")
    building = store.root / "tmp" / f"{'cd' * 32}.k3j2h1x0"  # a running build's scratch
    building.mkdir()
    await collector(store).collect(time.time(), dry_run=True)
    assert aside.exists()
    with locked(store.root / "locks" / f"{'cd' * 32}.lock"):  # its builder holds its lock
        await collector(store).collect(time.time(), dry_run=False)
    assert not aside.exists() and building.exists()
    await collector(store).collect(time.time(), dry_run=False)  # the builder died
    assert not building.exists()


async def test_a_pulled_images_name_keeps_its_layers_and_its_removal_frees_them(
        store: ImageStore, tmp_path: Path) -> None:
    """A pulled image is named by its canonical reference ('/' and '@' escaped in its
    manifest's file name): the collector reads it like any name."""
    ref = "registry.test:5000/team/task@sha256:" + "ab" * 32
    layers = [_layer_tar([("etc", None, 0o755), ("etc/base", b"base\n", 0o644)]),
              _layer_tar([("only-pulled.txt", b"pulled", 0o644)])]
    pulled = store.import_oci(make_oci_archive(tmp_path / "pulled.tar", layers), ref)
    other = image(store, tmp_path, "other", "only-other")
    gc, later = collector(store), time.time() + LATER
    assert counts(await gc.collect(later, dry_run=False))["layers"] == (0, 0)
    assert store.get(ref) == pulled and store.version(pulled.digest) == pulled

    store.remove(ref)
    unique = [layer for layer in pulled.layers if layer not in other.layers]
    assert counts(await gc.collect(later, dry_run=False))["layers"][0] == len(unique) >= 1
    assert layer_dirs(store) == {layer.digest for layer in other.layers}
