"""Import of OCI image layout archives and ``docker save`` archives into the layer store.

Each image layer becomes one store layer. OCI whiteouts are turned into overlay ones
(``.wh.NAME`` → char device 0:0 ``NAME``; ``.wh..wh..opq`` → ``trusted.overlay.opaque=y`` on
its directory), so the layers stack directly as overlay lowers. A last, tiny layer makes sure
``/work`` exists, as in every dsec image.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import posixpath
import stat
import subprocess
import tarfile
import tempfile
import time
import zlib
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dsec.images.builder import BuildProgress, layer_key
from dsec.images.spec import WORKDIR
from dsec.protocol.errors import ImageBuildError, InvalidRequest, NotSupported

if TYPE_CHECKING:
    from rich.console import Console

    from dsec.images.store import Layer, LayerStore

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_OPAQUE_MARKER = ".wh..wh..opq"
_WHITEOUT_PREFIX = ".wh."
_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def import_archive(
    tar_path: Path, store: LayerStore, console: Console | None = None
) -> tuple[list[Layer], dict[str, Any]]:
    """Import the image in ``tar_path``; returns its layers (bottom→top) and its run config
    settings: those of ``env``, ``working_dir``, ``entrypoint``, ``cmd`` the image config sets."""
    progress = BuildProgress(console)
    with _open_archive(tar_path) as archive:
        blobs = _Blobs(archive, tar_path)
        try:
            read = _read_oci_layout if blobs.has("index.json") else _read_docker_save
            layer_names, config = read(blobs)
            diff_ids = config["rootfs"]["diff_ids"]
        except (KeyError, TypeError, IndexError) as exc:
            raise InvalidRequest(f"{tar_path}: malformed image metadata ({exc!r})") from exc
        if len(diff_ids) != len(layer_names):
            raise InvalidRequest(
                f"{tar_path}: config lists {len(diff_ids)} diff_ids for {len(layer_names)} layers"
            )
        layers: list[Layer] = []
        for index, (name, diff_id) in enumerate(zip(layer_names, diff_ids, strict=True), 1):
            content = {"section": "oci", "diff_id": diff_id}
            label = f"{tar_path.name}: layer {index}/{len(layer_names)}"
            started = time.monotonic()
            with progress.layer(label):
                layer, fresh = store.ensure(
                    layer_key(layers[-1].digest if layers else None, content),
                    content,
                    partial(_extract_layer, blobs, name, diff_id),
                )
            progress.finished(label, layer, time.monotonic() - started if fresh else None)
            layers.append(layer)
    content = {"section": "workdir", "path": WORKDIR}
    workdir, _ = store.ensure(
        layer_key(layers[-1].digest if layers else None, content), content, _make_workdir
    )
    return [*layers, workdir], _run_config(config.get("config") or {})


def _open_archive(tar_path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(tar_path)
    except (OSError, tarfile.TarError) as exc:
        raise InvalidRequest(f"{tar_path}: not a readable tar archive: {exc}") from exc


class _Blobs:
    """Members of the outer archive by normalised path."""

    def __init__(self, archive: tarfile.TarFile, tar_path: Path) -> None:
        self._archive, self._tar_path = archive, tar_path
        self._members = {posixpath.normpath(m.name): m for m in archive.getmembers() if m.isfile()}

    def has(self, name: str) -> bool:
        return posixpath.normpath(name) in self._members

    def open(self, name: str) -> IO[bytes]:
        member = self._members.get(posixpath.normpath(name))
        if member is None:
            raise InvalidRequest(f"{self._tar_path}: {name} is missing from the archive")
        fileobj = self._archive.extractfile(member)
        assert fileobj is not None  # regular members always have data
        return fileobj

    def json(self, name: str) -> Any:
        try:
            return json.load(self.open(name))
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{self._tar_path}: {name} is not valid JSON: {exc}") from exc

    def descriptor(self, descriptor: dict[str, Any]) -> Any:
        algorithm, _, digest = descriptor["digest"].partition(":")
        return self.json(f"blobs/{algorithm}/{digest}")


def _read_oci_layout(blobs: _Blobs) -> tuple[list[str], dict[str, Any]]:
    descriptor = _pick_manifest(blobs.json("index.json").get("manifests", []))
    manifest = blobs.descriptor(descriptor)
    while descriptor.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:  # a multi-platform index
        descriptor = _pick_manifest(manifest["manifests"])
        manifest = blobs.descriptor(descriptor)
    layers = []
    for layer in manifest.get("layers", []):
        algorithm, _, digest = layer["digest"].partition(":")
        layers.append(f"blobs/{algorithm}/{digest}")
    return layers, blobs.descriptor(manifest["config"])


def _read_docker_save(blobs: _Blobs) -> tuple[list[str], dict[str, Any]]:
    if not blobs.has("manifest.json"):
        raise InvalidRequest(
            "not an image archive: it has neither index.json (OCI) nor manifest.json (docker save)"
        )
    entries = blobs.json("manifest.json")
    if len(entries) != 1:
        raise InvalidRequest(f"the archive holds {len(entries)} images; import one image per archive")
    return list(entries[0]["Layers"]), blobs.json(entries[0]["Config"])


def _pick_manifest(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    if len(manifests) == 1:
        return manifests[0]
    for descriptor in manifests:
        platform_ = descriptor.get("platform", {})
        if platform_.get("os") == "linux" and platform_.get("architecture") == _ARCH:
            return descriptor
    raise NotSupported(f"the archive has {len(manifests)} manifests and none for linux/{_ARCH}")


def _extract_layer(blobs: _Blobs, name: str, diff_id: str, scratch: Path) -> None:
    """Extract one layer into ``scratch/"rootfs"`` with GNU tar (owners, modes, xattrs, hard
    links; it refuses members that would land outside), check its diff_id, convert whiteouts."""
    blob, rootfs = blobs.open(name), scratch / "rootfs"
    magic = blob.read(4)
    blob.seek(0)
    if magic.startswith(_ZSTD_MAGIC):
        raise NotSupported("zstd-compressed layers are not supported; re-export the image with gzip layers")
    stream = gzip.GzipFile(fileobj=blob) if magic.startswith(_GZIP_MAGIC) else blob
    rootfs.mkdir()
    tar = [
        "tar",
        "-x",
        "-p",
        "--numeric-owner",
        "--xattrs",
        "--xattrs-include=*",
        "-C",
        str(rootfs),
        "-f",
        "-",
    ]
    digest = hashlib.sha256()
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(tar, stdin=subprocess.PIPE, stderr=errors)
        assert proc.stdin is not None
        try:
            with proc.stdin:
                while chunk := stream.read(1 << 20):
                    digest.update(chunk)
                    proc.stdin.write(chunk)
        except BrokenPipeError:
            pass  # tar exited early: its exit status and message below say why
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise InvalidRequest(f"layer {diff_id} is corrupt: {exc}") from exc
        finally:
            returncode = proc.wait()
        errors.seek(0)
        message = errors.read().decode(errors="replace").strip()
    if returncode != 0:
        raise ImageBuildError(f"extracting layer {diff_id} failed (exit {returncode}): {message}")
    if f"sha256:{digest.hexdigest()}" != diff_id:
        raise InvalidRequest(
            f"layer content does not match its diff_id {diff_id} (got sha256:{digest.hexdigest()})"
        )
    _convert_whiteouts(rootfs)


def _convert_whiteouts(rootfs: Path) -> None:
    for directory, _, files in os.walk(rootfs):
        for name in files:
            if not name.startswith(_WHITEOUT_PREFIX):
                continue
            os.remove(os.path.join(directory, name))
            if name == _OPAQUE_MARKER:
                os.setxattr(directory, "trusted.overlay.opaque", b"y")
                continue
            hidden = name.removeprefix(_WHITEOUT_PREFIX)
            if hidden.startswith(_WHITEOUT_PREFIX):
                raise InvalidRequest(f"unsupported whiteout {os.path.join(directory, name)}")
            target = os.path.join(directory, hidden)
            if os.path.lexists(target):
                raise InvalidRequest(f"layer both removes and contains {target}")
            os.mknod(target, stat.S_IFCHR, os.makedev(0, 0))


def _make_workdir(scratch: Path) -> None:
    (scratch / "rootfs" / WORKDIR.lstrip("/")).mkdir(mode=0o755, parents=True)


def _run_config(config: dict[str, Any]) -> dict[str, Any]:
    """The run settings the image sets (unset ones are left out, for the store's defaults)."""
    settings = {
        "env": tuple(config.get("Env") or ()),
        "working_dir": config.get("WorkingDir") or "",
        "entrypoint": tuple(config.get("Entrypoint") or ()),
        "cmd": tuple(config.get("Cmd") or ()),
    }
    return {key: value for key, value in settings.items() if value}
