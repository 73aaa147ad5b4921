"""Import of OCI image layout archives and ``docker save`` archives into the layer store, and
the one conversion of an OCI layer into a store layer (``extract_layer``), which registry pulls
(pull.py) share.

Each image layer becomes one store layer, keyed by its parent and its diff_id (so an archive
import and a pull of the same image share layers). OCI whiteouts are turned into overlay ones
(``.wh.NAME`` → char device 0:0 ``NAME``; ``.wh..wh..opq`` → ``trusted.overlay.opaque=y`` on
its directory), so the layers stack directly as overlay lowers. A last, tiny layer makes sure
``/work`` exists, as in every dsec image.

Layers are hostile data: GNU tar extracts them under the scratch directory only (it refuses
``..``, strips leading ``/``, and does not write through symlinks it made); device nodes are
dropped; a layer bigger than ``image_layer_max_mb`` (its tar, or its files' sizes: sparse
bombs) is refused with ``UnsafeArchive``, and content that does not match its diff_id with
``DigestMismatch``.
"""

from __future__ import annotations

import contextlib
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
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from isal import isal_zlib

from dsec.config import current
from dsec.images.builder import BuildProgress, layer_key
from dsec.images.spec import WORKDIR
from dsec.protocol.errors import (
    DigestMismatch,
    DSecError,
    InvalidRequest,
    NotSupported,
    UnsafeArchive,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

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
            label = f"{tar_path.name}: layer {index}/{len(layer_names)}"
            started = time.monotonic()
            with progress.layer(label):
                layer, fresh = store.ensure(
                    oci_layer_key(layers[-1].digest if layers else None, diff_id),
                    {"section": "oci", "diff_id": diff_id},
                    partial(_extract_member, blobs, name, diff_id), in_memory=True,
                )
            progress.finished(label, layer, time.monotonic() - started if fresh else None)
            layers.append(layer)
    return [*layers, workdir_layer(store, layers)], run_config(config.get("config") or {})


def _extract_member(blobs: _Blobs, name: str, diff_id: str, scratch: Path) -> None:
    extract_layer(blobs.open(name), diff_id, scratch)


def oci_layer_key(parent: str | None, diff_id: str) -> str:
    """The store key of an OCI layer: its parent's key and its diff_id (the registry's digest
    of its uncompressed tar, as the verified image config lists it)."""
    return layer_key(parent, {"section": "oci", "diff_id": diff_id})


def workdir_layer(store: LayerStore, layers: list[Layer]) -> Layer:
    """The last layer of every imported or pulled image: it makes sure ``/work`` exists."""
    content = {"section": "workdir", "path": WORKDIR}
    workdir, _ = store.ensure(
        layer_key(layers[-1].digest if layers else None, content), content, _make_workdir
    )
    return workdir


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
    descriptor = pick_manifest(blobs.json("index.json").get("manifests", []))
    manifest = blobs.descriptor(descriptor)
    while descriptor.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:  # a multi-platform index
        descriptor = pick_manifest(manifest["manifests"])
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


def pick_manifest(manifests: list[dict[str, Any]], platform_: str | None = None) -> dict[str, Any]:
    """The entry of an index for ``platform_`` (``os/arch[/variant]``; default this host's
    linux/arch, or the only entry)."""
    if len(manifests) == 1 and platform_ is None:
        return manifests[0]
    wanted = (platform_ or f"linux/{_ARCH}").split("/")
    for descriptor in manifests:
        have = descriptor.get("platform") or {}
        if [have.get("os"), have.get("architecture"), *([have.get("variant")] if len(wanted) > 2
                                                         else [])] == wanted:
            return descriptor
    raise NotSupported(f"the image has {len(manifests)} manifests and none for {'/'.join(wanted)}")


_TAR = ("tar", "-x", "-p", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-f", "-", "-C")
_GZIP_WBITS = 31  # zlib's "a gzip member"
_GZIP_ERROR = cast("type[Exception]", isal_zlib.error)  # a class; the stubs say an instance
_FULL = 64 << 10  # less free space than this where tar failed: the layer did not fit
_PIECE = 1 << 20  # at most this much gunzipped at once: a gzip bomb inflates 1000-fold


def extract_layer(blob: IO[bytes], diff_id: str, scratch: Path) -> None:
    """Extract one layer read from ``blob`` (a tar, gzip or plain) into ``scratch/"rootfs"``."""
    with unpacking(diff_id, scratch) as unpacker:
        while chunk := blob.read(_PIECE):
            unpacker.write(chunk)


@contextmanager
def unpacking(diff_id: str, scratch: Path) -> Iterator[LayerUnpacker]:
    """A ``LayerUnpacker`` into ``scratch/"rootfs"`` to write the layer's bytes to as they come
    (a registry download, an archive member). Leaving the block normally checks and finishes
    the layer (``LayerUnpacker.finish``); an exception stops tar, and what it wrote stays in the
    scratch directory, which the store removes uncommitted."""
    unpacker = LayerUnpacker(diff_id, scratch)
    try:
        yield unpacker
    except BaseException:
        unpacker.stop()
        raise
    unpacker.finish()


class LayerUnpacker:
    """One layer streamed into GNU tar while it arrives: gunzip (ISA-L, about twice zlib's
    speed), the diff_id's sha256 and the size cap here, extraction in tar (owners, modes,
    xattrs, hard links; it refuses members that would land outside). The first failure (zstd, a
    corrupt gzip, the cap, tar refusing a member) stops tar, drops the rest and is raised by
    ``finish``: a caller that checks the compressed blob's digest while it streams reports a
    bad blob before anything else. Nothing is trusted before ``finish`` returns."""

    def __init__(self, diff_id: str, scratch: Path) -> None:
        self.diff_id, self._rootfs = diff_id, scratch / "rootfs"
        self._limit = current().image_layer_max_mb << 20
        self._rootfs.mkdir(exist_ok=True)  # the store may have mounted its staging tmpfs there
        self._errors = tempfile.TemporaryFile()
        self._tar = subprocess.Popen([*_TAR, str(self._rootfs)], stdin=subprocess.PIPE,
                                     stderr=self._errors)
        self._head = b""  # the first bytes, until there are enough to tell gzip from tar
        self._inflater: Any = None  # a decompressobj (gzip), False (a plain tar), None (not yet)
        self._digest, self._unpacked = hashlib.sha256(), 0
        self._failure: DSecError | None = None

    def write(self, data: bytes) -> int:
        if self._failure is None:
            try:
                self._feed(data)
            except DSecError as exc:
                self._failure = exc
                self.stop()
        return len(data)

    def finish(self) -> None:
        """Check the layer (a complete gzip stream, tar's exit, the diff_id) and convert its
        whiteouts; else raise the first failure, typed."""
        try:
            if self._failure is None:
                self._end_of_stream()
            if self._failure is not None:
                raise self._failure
            if self._close_input() != 0:  # tar refuses what would land outside, and truncated tars
                raise self._refused()
            got = f"sha256:{self._digest.hexdigest()}"
            if got != self.diff_id:
                raise DigestMismatch(f"layer content does not match its diff_id {self.diff_id} "
                                     f"(got {got})", expected=self.diff_id, got=got)
        finally:
            self.stop()
        _convert_whiteouts(self._rootfs, self.diff_id, self._limit)

    def stop(self) -> None:
        """Stop tar if it still runs, and let go of its pipe and messages."""
        if self._tar.returncode is None:
            self._tar.kill()
        self._close_input()
        self._errors.close()

    def _close_input(self) -> int:
        """tar's exit status, once its input is closed and it has exited."""
        with contextlib.suppress(BrokenPipeError):  # it exited early: its status says why
            assert self._tar.stdin is not None
            self._tar.stdin.close()
        return self._tar.wait()

    def _feed(self, data: bytes) -> None:
        if self._inflater is None:
            self._head += data
            if len(self._head) < len(_ZSTD_MAGIC):
                return
            data, self._head = self._head, b""
            self._start(data)
        if self._inflater is False:
            self._emit(data)
            return
        try:
            while True:
                if self._inflater.eof:  # a gzip stream may hold several members
                    data = self._inflater.unused_data + data
                    if not data:
                        return
                    self._inflater = isal_zlib.decompressobj(_GZIP_WBITS)
                elif not data:
                    return
                self._emit(self._inflater.decompress(data, _PIECE))
                data = self._inflater.unconsumed_tail
        except _GZIP_ERROR as exc:
            raise self._corrupt(str(exc)) from exc

    def _start(self, head: bytes) -> None:
        if head.startswith(_ZSTD_MAGIC):
            raise NotSupported("zstd-compressed layers are not supported; re-export the image "
                               "with gzip layers")
        self._inflater = (isal_zlib.decompressobj(_GZIP_WBITS) if head.startswith(_GZIP_MAGIC)
                          else False)

    def _end_of_stream(self) -> None:
        if self._inflater is None:  # fewer than four bytes in all: a (truncated) plain tar
            head, self._head = self._head, b""
            self._start(head)
            self._emit(head)
        elif self._inflater is not False:
            try:
                self._emit(self._inflater.flush())
            except _GZIP_ERROR as exc:
                raise self._corrupt(str(exc)) from exc
            if not self._inflater.eof:
                raise self._corrupt("the gzip stream ends early")

    def _emit(self, data: bytes) -> None:
        if not data:
            return
        self._unpacked += len(data)
        if self._unpacked > self._limit:
            raise UnsafeArchive(f"layer {self.diff_id} unpacks to more than "
                                f"{self._limit >> 20} MiB", layer=self.diff_id, limit=self._limit)
        self._digest.update(data)
        assert self._tar.stdin is not None
        try:
            self._tar.stdin.write(data)
        except BrokenPipeError:
            self._close_input()  # tar exited early: its status and message say why
            raise self._refused() from None

    def _refused(self) -> UnsafeArchive:
        self._errors.seek(0)
        message = self._errors.read().decode(errors="replace").strip()
        space = os.statvfs(self._rootfs)
        if space.f_bavail * space.f_frsize < _FULL or space.f_favail == 0:
            message += (" (the layer's files do not fit where they are unpacked: a tmpfs of "
                        "DSEC_IMAGE_LAYER_STAGING_MB, or the image store's disk if that is 0)")
        return UnsafeArchive(f"layer {self.diff_id} cannot be extracted safely (tar exit "
                             f"{self._tar.returncode}): {message[-2000:]}", layer=self.diff_id)

    def _corrupt(self, why: str) -> DigestMismatch:
        return DigestMismatch(f"layer {self.diff_id} is corrupt: {why}", expected=self.diff_id,
                              got="corrupt")


def _convert_whiteouts(rootfs: Path, diff_id: str, limit: int) -> None:
    """Turn whiteouts into overlay ones, drop device nodes, and refuse a layer whose files
    (sparse ones at their full size, each inode once) add up to more than ``limit``."""
    seen, total = set(), 0
    for directory, _, files in os.walk(rootfs):
        for name in files:
            if not name.startswith(_WHITEOUT_PREFIX):
                path = os.path.join(directory, name)
                st = os.lstat(path)
                if stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode):
                    os.remove(path)  # a host device is no business of an image
                elif stat.S_ISREG(st.st_mode) and (st.st_ino not in seen):
                    seen.add(st.st_ino)
                    total += st.st_size
                    if total > limit:
                        raise UnsafeArchive(f"layer {diff_id}'s files add up to more than "
                                            f"{limit >> 20} MiB", layer=diff_id, limit=limit)
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


def run_config(config: dict[str, Any]) -> dict[str, Any]:
    """The run settings the image sets (unset ones are left out, for the store's defaults)."""
    settings = {
        "env": tuple(config.get("Env") or ()),
        "working_dir": config.get("WorkingDir") or "",
        "entrypoint": tuple(config.get("Entrypoint") or ()),
        "cmd": tuple(config.get("Cmd") or ()),
    }
    return {key: value for key, value in settings.items() if value}
