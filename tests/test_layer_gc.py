"""Image-layer garbage collection on a real server with its own image store (never the shared
cache) and a short grace: a layer a running sandbox uses survives, a removed image's own
layers go and shared ones stay, a snapshot keeps its image version's layers until it is
deleted (and a create from it still starts after its image's name was removed), a dry run
changes nothing, and what a sandbox plants or prints does not steer the collector. Then two
servers as two nodes sharing one image store and one PostgreSQL: a layer a sandbox uses on
one survives a collection on the other."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import TEST_ROOT, Server, make_server, scrape, stop_server
from dsec.images.store import Image, ImageStore
from dsec.store.local_postgres import LocalPostgres
from test_cli import dsec_cli
from test_images import _busybox_layers, _layer_tar, make_oci_archive

GRACE_S = 2


def import_image(store: ImageStore, name: str) -> Image:
    """busybox (shared by every image here) under one layer of the image's own."""
    own = _layer_tar([(f"{name}.txt", f"{name}\n".encode(), 0o644)])
    with tempfile.TemporaryDirectory() as tmp:
        return store.import_oci(make_oci_archive(Path(tmp) / "i.tar", [*_busybox_layers(), own]),
                                name)


def on_disk(store: ImageStore) -> set[str]:
    return {f"sha256:{p.name}" for p in (store.root / "layers").iterdir()}


def own_layers(image: Image, *others: Image) -> set[str]:
    return {layer.digest for layer in image.layers} - {
        layer.digest for other in others for layer in other.layers}


@pytest.fixture(scope="module")
def store() -> Iterator[ImageStore]:
    root = TEST_ROOT / f"images-{secrets.token_hex(3)}"
    yield ImageStore(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(store: ImageStore) -> Iterator[Server]:
    for name in ("kept", "running", "doomed", "snapped"):
        import_image(store, name)
    server = make_server("--image-store", str(store.root), "--layer-grace-s", str(GRACE_S),
                         "--gc-interval-s", "3600", "--warm-pool", "0").start()
    yield server
    stop_server(server)


def restart(server: Server) -> None:
    """Stop and start the server: its edge lets go of the images it took into use."""
    server.kill(signal.SIGTERM)
    server.start()


async def test_running_sandbox_keeps_its_layers_a_removed_images_own_layers_go(
        srv: Server, store: ImageStore) -> None:
    kept, running, doomed = store.get("kept"), store.get("running"), store.get("doomed")
    async with srv.client() as client:
        sb = await client.create(image="running", ttl_s=300)
        # Hostile: the sandbox names the doomed layers, plants digest-named files and links
        # into the store's paths, and prints digests; none of it is the collector's input.
        planted = " ".join(layer.digest.removeprefix("sha256:") for layer in doomed.layers)
        await sb.run(f"mkdir -p /layers /nodes; for d in {planted}; do mkdir -p /layers/$d; "
                     f"ln -s {store.root}/layers/$d /layers/$d/link; echo sha256:$d; done; "
                     f"echo '{{\"images\": {{}}}}' > /nodes/evil.json")
        store.remove("running")  # the names only: the layers stay for now
        store.remove("doomed")
        assert on_disk(store) >= own_layers(running) | own_layers(doomed)
        await asyncio.sleep(GRACE_S + 1)

        before = sorted(p.name for p in (store.root / "layers").iterdir())
        dry = json.loads(dsec_cli(srv, "gc", "--dry-run", "--json").stdout)
        would = {r["kind"]: (r["count"], r["bytes"]) for r in dry["removed"]}
        doomed_own = own_layers(doomed, kept, running)
        assert would["layers"][0] == len(doomed_own) >= 1 and would["layers"][1] > 0
        assert would["image_versions"][0] == 1  # doomed's: running's is the sandbox's
        assert sorted(p.name for p in (store.root / "layers").iterdir()) == before
        assert not any(k.startswith("dsec_gc_removed_total{kind=layers") and v
                       for k, v in scrape(srv).items())

        removed = {r.kind: (r.count, r.bytes) for r in (await client.gc()).removed}
        assert removed["layers"] == would["layers"]
        assert on_disk(store) == {layer.digest for image in (kept, running, store.get("snapped"))
                                  for layer in image.layers}
        assert (await sb.run("cat /running.txt")).stdout == "running\n"  # still reads its layers
        assert scrape(srv)["dsec_gc_removed_total{kind=layers}"] == len(doomed_own)
        assert {r.kind: r.count for r in (await client.gc()).removed}["layers"] == 0
        await sb.stop()
    restart(srv)  # its edge let go of running's image: nothing names it any more
    await asyncio.sleep(GRACE_S + 1)
    async with srv.client() as client:
        removed = {r.kind: r.count for r in (await client.gc()).removed}
        assert removed["layers"] == len(own_layers(running, kept, store.get("snapped")))
    assert store.get("kept") == kept


async def test_a_snapshot_keeps_its_layers_until_it_is_deleted(
        srv: Server, store: ImageStore) -> None:
    snapped = store.get("snapped")
    own = own_layers(snapped, store.get("kept"))
    async with srv.client() as client:
        sb = await client.create(image="snapped", ttl_s=300)
        await sb.write_file("/work.txt", b"made before the snapshot\n")
        snap = await sb.snapshot()
        await sb.stop()
        store.remove("snapped")
    restart(srv)  # nothing but the snapshot keeps snapped's version now
    await asyncio.sleep(GRACE_S + 1)
    async with srv.client() as client:
        assert {r.kind: r.count for r in (await client.gc()).removed}["layers"] == 0
        assert on_disk(store) >= own
        async with await client.create(snapshot=snap.id, ttl_s=300) as child:  # no name needed
            r = await child.run("cat /snapped.txt /work.txt")
            assert r.stdout == "snapped\nmade before the snapshot\n"
        await client.delete_snapshot(snap.id)
    restart(srv)
    await asyncio.sleep(GRACE_S + 1)
    async with srv.client() as client:
        removed = {r.kind: r.count for r in (await client.gc()).removed}
    assert removed["layers"] == len(own) and removed["image_versions"] == 1
    assert not on_disk(store) & own


async def test_a_layer_in_use_on_one_node_survives_a_collection_on_another(
        local_postgres: LocalPostgres) -> None:
    shared = ImageStore(TEST_ROOT / f"images-{secrets.token_hex(3)}")
    elsewhere = import_image(shared, "elsewhere")
    url = local_postgres.fresh_database("layers_" + secrets.token_hex(3))
    args = ("--image-store", str(shared.root), "--state-url", url, "--layer-grace-s",
            str(GRACE_S), "--gc-interval-s", "3600", "--warm-pool", "0")
    node_a, node_b = make_server(*args).start(), make_server(*args).start()
    try:
        async with node_a.client() as a, node_b.client() as b:
            sb = await a.create(image="elsewhere", ttl_s=300)
            shared.remove("elsewhere")
            await asyncio.sleep(GRACE_S + 1)
            removed = {r.kind: r.count for r in (await b.gc()).removed}
            assert removed["layers"] == 0 and removed["image_versions"] == 0
            assert (await sb.run("cat /elsewhere.txt")).stdout == "elsewhere\n"
            await sb.stop()
        restart(node_a)  # its edge lets go: nothing on any node uses the layers now
        await asyncio.sleep(GRACE_S + 1)
        async with node_b.client() as b:
            removed = {r.kind: r.count for r in (await b.gc()).removed}
        assert removed["layers"] == len(elsewhere.layers) and removed["image_versions"] == 1
        assert not on_disk(shared)
    finally:
        stop_server(node_a)
        stop_server(node_b)
        shutil.rmtree(shared.root, ignore_errors=True)
