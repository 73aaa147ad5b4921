"""``dsec bench --only pull``: pull and convert time of a multi-layer image from a registry on
loopback (Debian's ``docker-registry``), against ``skopeo copy`` of the same image to a
directory, alternating rounds (``bench.compare``) in the same run.

The image is ``python-3.11``'s layers (built if missing) as gzip tars in an OCI layout, pushed
once with skopeo. A dsec round pulls into a fresh store (download, sha256 check, gunzip, tar
extract, mkfs.erofs of every layer); a skopeo round downloads and verifies the blobs into a
fresh ``dir:`` (no decompression, no conversion). Also: a second pull into the same store,
every layer already stored (manifest and config only).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
from rich.console import Console

from dsec.images.mount import LayerMounter
from dsec.images.store import Image, ImageStore

from .bench import BENCH_ROOT, Sample, compare, phase

IMAGE = "python-3.11"


async def pull_series(console: Console, quick: bool = False) -> list[Sample]:
    rounds = 2 if quick else 5
    for tool in ("docker-registry", "skopeo"):
        if shutil.which(tool) is None:
            raise SystemExit(f"the pull series needs {tool} (apt-get install docker-registry skopeo)")
    root = BENCH_ROOT / secrets.token_hex(3)
    root.mkdir(parents=True)
    mounter = LayerMounter(root / "layers")
    registry: subprocess.Popen[bytes] | None = None
    try:
        with phase(console, f"making an OCI layout of {IMAGE} and pushing it"):
            layout, count = _oci_layout(ImageStore().ensure(IMAGE, console=console), mounter, root)
            registry, host = _start_registry(root / "registry")
            subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                            f"oci:{layout}:1", f"docker://{host}/bench/python:1"], check=True)
        ref = f"{host}/bench/python:1"
        runs = iter(range(1 << 30))

        async def skopeo() -> float:
            t0 = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                "skopeo", "copy", "--quiet", "--src-tls-verify=false", f"docker://{ref}",
                f"dir:{root / f'skopeo-{next(runs)}'}")
            if await proc.wait() != 0:
                raise RuntimeError("skopeo copy failed")
            return (time.perf_counter() - t0) * 1000

        async def pull(store: Path) -> float:
            t0 = time.perf_counter()
            await asyncio.to_thread(ImageStore(store).pull, ref)
            return (time.perf_counter() - t0) * 1000

        async def clean_up() -> None:
            for path in root.glob("skopeo-*"):
                shutil.rmtree(path)
            for path in root.glob("store-*"):
                shutil.rmtree(path)

        with phase(console, f"pull of {count} layers, {rounds} rounds each"):
            samples = await compare(
                Sample(f"skopeo copy to a directory ({count} layers)", []), skopeo,
                Sample(f"dsec image pull (download + convert to EROFS, {count} layers)", []),
                lambda: pull(root / f"store-{next(runs)}"), 1, rounds, between=clean_up)
        again = Sample("dsec image pull again (every layer stored)", [])
        with phase(console, "pull again into the same store"):
            await pull(root / "store-again")
            for _ in range(rounds * 4):
                again.values_ms.append(await pull(root / "store-again"))
        return [*samples, again]
    finally:
        if registry is not None:
            registry.terminate()
            registry.wait()
        mounter.unmount_all()
        shutil.rmtree(root, ignore_errors=True)


def _oci_layout(image: Image, mounter: LayerMounter, root: Path) -> tuple[Path, int]:
    """An OCI layout (directory) of the image's layers as gzip tars; returns it and its layer count."""
    layout = root / "layout"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data_path: Path) -> dict[str, object]:
        digest = hashlib.sha256(data_path.read_bytes()).hexdigest()
        data_path.rename(blobs / digest)
        return {"digest": f"sha256:{digest}", "size": (blobs / digest).stat().st_size}

    layers, diff_ids = [], []
    for index, directory in enumerate(reversed(mounter.lowerdirs(image))):  # bottom → top
        tar = subprocess.Popen(["tar", "-C", str(directory), "--numeric-owner", "--xattrs", "-c", "."],
                               stdout=subprocess.PIPE)
        assert tar.stdout is not None
        raw, out = hashlib.sha256(), root / f"layer{index}.tar.gz"
        with gzip.open(out, "wb", compresslevel=1) as gz:
            while chunk := tar.stdout.read(1 << 20):
                raw.update(chunk)
                gz.write(chunk)
        if tar.wait() != 0:
            raise RuntimeError(f"tar of layer {directory} failed")
        diff_ids.append(f"sha256:{raw.hexdigest()}")
        layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **blob(out)})
    config = root / "config.json"
    config.write_text(json.dumps({"architecture": "amd64", "os": "linux",
                                  "config": {"Env": ["PATH=/usr/bin:/bin"]},
                                  "rootfs": {"type": "layers", "diff_ids": diff_ids}}))
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(config)},
        "layers": layers}))
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", **blob(manifest),
        "annotations": {"org.opencontainers.image.ref.name": "1"}}]}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return layout, len(layers)


def _start_registry(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The CNCF registry on a free loopback port, storing under ``root``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (root / "storage").mkdir(parents=True)
    (root / "config.yml").write_text(json.dumps({  # JSON is YAML
        "version": 0.1, "log": {"level": "error"},
        "storage": {"filesystem": {"rootdirectory": str(root / "storage")}},
        "http": {"addr": f"127.0.0.1:{port}"}}))
    proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with httpx.Client() as http:
        for _ in range(600):
            try:
                http.get(f"http://127.0.0.1:{port}/v2/")
                return proc, f"127.0.0.1:{port}"
            except httpx.TransportError:
                time.sleep(0.05)
    proc.terminate()
    raise RuntimeError("docker-registry did not start")
