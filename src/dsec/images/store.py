"""The image store: content-addressed layers and named image manifests in a plain directory.

Layout under the root (plain files only, so the store can live on NFS or 3FS)::

    layers/<hex>/layer.json     layer metadata (digest, format, size, what built it)
    layers/<hex>/layer.erofs    the layer as an EROFS image, or
    layers/<hex>/rootfs/        the layer as a directory (kernels without erofs)
    images/<name>.json          manifest: layer digests bottom→top, config, source (a pulled
                                image's name is its canonical reference, '/' and '@' escaped)
    images/versions/<hex>.json  every version a name pointed at, by image digest: what a
                                snapshot or a running sandbox was made from, found again
                                after its name was rebuilt or removed
    nodes/<edge>.json           the layers each node's sandboxes use (node_uses.py)
    locks/                      flock files: one per layer, one per pulled reference, one for
                                the whole store
    tmp/                        layers under construction, renamed into layers/ when complete
                                (a pull's or import's unpacked files: a tmpfs on tmp/<hex>.*/rootfs)

Nothing here is removed on a request's path: removing an image removes its name; its
layers and versions go with garbage collection (gc.py), when nothing uses them any more.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.config import current
from dsec.images.builder import build_layers, plan_layers
from dsec.images.mount import (
    kernel_supports,
    locked,
    private_dir,
    tmpfs_mount,
    unmount_or_detach,
)
from dsec.images.oci import import_archive
from dsec.images.pull import pull_layers
from dsec.images.reference import is_reference, parse_reference
from dsec.images.spec import IMAGE_NAME, WORKDIR, ImageSpec, builtin_names, load_spec
from dsec.protocol.errors import ImageBuildError, ImageNotFound, InvalidRequest

if TYPE_CHECKING:
    from rich.console import Console

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/var/cache/dsec/images")
LAYER_FORMATS = ("erofs", "dir")
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# lz4, not lz4hc: python-3.11's big layer (179 MB of files) packs to 101.7 MB in 0.62 s of CPU
# against 94.1 MB in 2.65 s with lz4hc (8 % smaller for 4.3 times the time) and 165 MB in 0.43 s
# uncompressed (erofs-utils 1.5); lz4 decompression is cheap next to the page cache it fills.
_EROFS_OPTIONS = ("-zlz4", "--quiet")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# Projects' images and builds under way (control/image_names.py, edge/dockerbuild.py): never
# named to a caller who did not ask for them (an error answering one project's create must
# not list another's images, nor the scratch image of its build under way).
PRIVATE_PREFIXES = ("p.", "dsec-build-")  # the second: scratch images of older servers


@dataclass(frozen=True)
class Layer:
    digest: str  # "sha256:<hex>", the build cache key (parent digest + what the layer holds)
    path: Path  # the EROFS image file, or the directory
    format: str  # "erofs" | "dir"
    size_bytes: int


@dataclass(frozen=True)
class ImageConfig:
    """How a sandbox runs the image by default (from the OCI config for imported images)."""

    env: tuple[str, ...] = (DEFAULT_PATH,)
    working_dir: str = WORKDIR
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    user: str = ""  # a Dockerfile's USER (name or uid[:gid]): commands run as it; "" is root
    labels: tuple[str, ...] = ()  # a Dockerfile's LABELs, "key=value"


@dataclass(frozen=True)
class Image:
    name: str
    digest: str  # "sha256:<hex>" over the layer digests
    layers: tuple[Layer, ...]  # bottom → top
    created_at: float  # unix time
    size_bytes: int
    config: ImageConfig = ImageConfig()


def image_digest(layers: tuple[Layer, ...] | list[Layer]) -> str:
    return "sha256:" + hashlib.sha256("\n".join(layer.digest for layer in layers).encode()).hexdigest()


def detect_layer_format() -> str:
    """EROFS where the kernel mounts it and mkfs.erofs exists, else plain directories."""
    if not kernel_supports("erofs"):
        log.warning("kernel does not list erofs in /proc/filesystems: storing layers as directories")
        return "dir"
    if shutil.which("mkfs.erofs") is None:
        log.warning("mkfs.erofs not found (install erofs-utils): storing layers as directories")
        return "dir"
    return "erofs"


class LayerStore:
    """Immutable layers keyed by digest; each is built once, under a lock, then renamed into place."""

    def __init__(self, root: Path, layer_format: str) -> None:
        if layer_format not in LAYER_FORMATS:
            raise InvalidRequest(f"layer format must be one of {LAYER_FORMATS}, got {layer_format!r}")
        self.format = layer_format
        self._layers, self._locks, self._tmp = root / "layers", root / "locks", root / "tmp"
        self._locks.mkdir(parents=True, exist_ok=True)
        for d in (self._layers, self._tmp):  # sandboxes' files, setuid ones too: root's alone
            private_dir(d)

    def get(self, digest: str) -> Layer | None:
        directory = self._layers / _hex(digest)
        try:
            meta = json.loads((directory / "layer.json").read_text())
        except FileNotFoundError:
            return None
        name = "layer.erofs" if meta["format"] == "erofs" else "rootfs"
        return Layer(
            digest=digest, path=directory / name, format=meta["format"], size_bytes=meta["size_bytes"]
        )

    def ensure(
        self, digest: str, source: dict[str, Any], build: Callable[[Path], None],
        in_memory: bool = False,
    ) -> tuple[Layer, bool]:
        """The layer ``digest``, built if missing; returns (layer, whether it was built now).

        ``build(scratch)`` must leave the layer's files in ``scratch/"rootfs"``; the scratch
        directory is removed afterwards, whether the build succeeded or not. ``in_memory``
        (EROFS layers only, and when ``image_layer_staging_mb`` is not 0): ``rootfs`` is a
        tmpfs of at most that size (and of ``image_layer_max_mb``) — unpacking thousands of
        small files to memory and dropping them with one unmount costs a fraction of doing it
        on disk; a layer that does not fit fails (tar: no space left), never moves to disk.
        """
        with locked(self._locks / f"{_hex(digest)}.lock"):
            if layer := self.get(digest):
                self.touch(digest)  # used again: its garbage-collection grace starts afresh
                return layer, False
            for stale in self._tmp.glob(f"{_hex(digest)}.*"):  # left by a builder that died: we hold the lock
                _remove_scratch(stale)
            scratch = Path(tempfile.mkdtemp(prefix=f"{_hex(digest)}.", dir=self._tmp))
            try:
                staging_mb = min(current().image_layer_staging_mb, current().image_layer_max_mb)
                if in_memory and self.format == "erofs" and staging_mb > 0:
                    (scratch / "rootfs").mkdir()
                    tmpfs_mount(scratch / "rootfs", staging_mb << 20)
                build(scratch)
                return self._commit(digest, scratch, source), True
            finally:
                _remove_scratch(scratch)

    def digests(self) -> dict[str, tuple[float, int]]:
        """Every complete layer: digest -> (when last written or used, size in bytes). Only
        directories named by a 64-hex digest count; anything else under layers/ (a link, an
        odd name) is no layer and is left alone."""
        found = {}
        for entry in os.scandir(self._layers):
            if not (DIGEST.fullmatch(f"sha256:{entry.name}") and entry.is_dir(follow_symlinks=False)):
                continue
            try:
                st = os.stat(os.path.join(entry.path, "layer.json"), follow_symlinks=False)
                size = json.loads(Path(entry.path, "layer.json").read_text())["size_bytes"]
            except (OSError, ValueError, KeyError):
                continue  # not complete: no layer (a rename makes layers appear whole)
            found[f"sha256:{entry.name}"] = (st.st_mtime, int(size))
        return found

    def touch(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._layers / _hex(digest) / "layer.json")

    def take_out(self, digest: str) -> Path | None:
        """Move the layer out of the store (atomic rename into tmp/, under its lock, so no
        build of it is half-way); the caller removes what it returns. None if it was gone."""
        with locked(self._locks / f"{_hex(digest)}.lock"):
            aside = self._tmp / f"{_hex(digest)}.gc.{secrets.token_hex(4)}"
            try:
                os.rename(self._layers / _hex(digest), aside)
            except FileNotFoundError:
                return None
        (self._locks / f"{_hex(digest)}.lock").unlink(missing_ok=True)
        return aside

    def taken_out(self) -> list[Path]:
        """Layers a collector moved aside and did not remove (it died): theirs to remove."""
        return [p for p in self._tmp.glob("*.gc.*") if not p.is_symlink()]

    def sweep_scratch(self) -> None:
        """Remove the scratch directories of builders that died (their staging tmpfs too, which
        would otherwise hold memory until the same layer is built again): those whose layer
        lock is free. A build in progress holds its lock and is left alone."""
        for path in self._tmp.iterdir():
            hexdigest, dot, rest = path.name.partition(".")
            if (not dot or rest.startswith("gc.") or not DIGEST.fullmatch(f"sha256:{hexdigest}")
                    or path.is_symlink() or not path.is_dir()):
                continue  # a collector's (taken_out) or no scratch directory of ours
            try:
                with locked(self._locks / f"{hexdigest}.lock", wait_s=0):
                    if path.exists():
                        _remove_scratch(path)
            except TimeoutError:
                continue  # being built

    def _commit(self, digest: str, scratch: Path, source: dict[str, Any]) -> Layer:
        out = scratch / "out"
        out.mkdir()
        if self.format == "erofs":
            image_file = out / "layer.erofs"
            _mkfs_erofs(scratch / "rootfs", image_file)
            size = image_file.stat().st_size
        else:
            os.rename(scratch / "rootfs", out / "rootfs")
            size = _disk_usage(out / "rootfs")
        meta = {
            "digest": digest,
            "format": self.format,
            "size_bytes": size,
            "source": source,
            "created_at": time.time(),
        }
        _write_durably(out / "layer.json", json.dumps(meta, indent=2).encode())
        os.rename(out, self._layers / _hex(digest))  # atomic: the layer appears complete or not at all
        layer = self.get(digest)
        assert layer is not None
        return layer


class ImageStore:
    """Named images over shared layers; see the module docstring for the on-disk layout."""

    def __init__(self, root: Path | None = None, layer_format: str | None = None) -> None:
        self.root = Path(root or current().image_store or DEFAULT_ROOT)
        self._images = self.root / "images"
        self._images.mkdir(parents=True, exist_ok=True)
        self._versions = self._images / "versions"  # made by the first version recorded
        self.layers = LayerStore(self.root, layer_format or detect_layer_format())
        self._store_lock = self.root / "locks" / "store.lock"
        self._loaded: dict[str, tuple[tuple[int, int], Image]] = {}

    def build(self, spec: ImageSpec, console: Console | None = None) -> Image:
        """Build (or find in the cache) every layer of ``spec`` and name the result ``spec.name``."""
        with locked(self._store_lock, shared=True):
            layers = build_layers(spec, self.layers, console)
            return self._save(spec.name, layers, ImageConfig(), {"spec": spec.name})

    def import_oci(self, tar_path: Path, name: str, console: Console | None = None) -> Image:
        """Import an OCI image layout or ``docker save`` archive as image ``name``."""
        _check_name(name)
        with locked(self._store_lock, shared=True):
            layers, run_config = import_archive(Path(tar_path), self.layers, console)
            return self._save(name, layers, ImageConfig(**run_config), {"oci": str(tar_path)})

    def pull(self, ref: str, platform: str | None = None, console: Console | None = None,
             missing_only: bool = False) -> Image:
        """Pull image reference ``ref`` from its registry, stored under its canonical reference
        (``python:3.11-slim`` → ``docker.io/library/python:3.11-slim``). One pull of a reference
        at a time (across processes): a concurrent ``missing_only`` pull finds the image the
        first one stored and fetches nothing."""
        reference = parse_reference(ref)
        name = reference.canonical
        lock = hashlib.sha256(name.encode()).hexdigest()[:32]
        with locked(self.root / "locks" / f"pull-{lock}.lock"):
            if missing_only and (image := self._find(name)):
                return image
            with locked(self._store_lock, shared=True):
                layers, run_config, manifest = pull_layers(reference, self.layers, platform, console)
                return self._save(name, layers, ImageConfig(**run_config),
                                  {"registry": name, "manifest": manifest, "platform": platform})

    def save_built(self, name: str, layers: list[Layer], config: ImageConfig,
                   source: dict[str, Any]) -> Image:
        """Name the layers a build made elsewhere (a Dockerfile build, edge/dockerbuild.py)."""
        _check_name(name)
        with locked(self._store_lock, shared=True):
            missing = [layer.digest for layer in layers if self.layers.get(layer.digest) is None]
            if missing:
                raise ImageBuildError(f"layers {missing} vanished before {name!r} was saved")
            return self._save(name, layers, config, source)

    def sources(self, prefix: str) -> dict[str, dict[str, Any]]:
        """The stored names starting with ``prefix``, each with what its manifest says made
        it (``source``); a manifest that cannot be read is skipped."""
        found: dict[str, dict[str, Any]] = {}
        for path in self._images.glob("*.json"):
            if path.stem.startswith(prefix) and not path.is_symlink():
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    manifest = json.loads(path.read_text())
                    found[str(manifest["name"])] = dict(manifest.get("source") or {})
        return found

    def pullable(self, ref: str) -> bool:
        """Whether ``ref`` names a registry image (not a builtin spec, not a digest prefix)."""
        return ref not in builtin_names() and not ref.startswith("sha256:") and is_reference(ref)

    def get(self, ref: str) -> Image:
        """The image named ``ref`` (a pulled one also by any spelling of its reference:
        ``python:3.11-slim``), or whose digest starts with ``ref`` (``sha256:ab12...``)."""
        if ref.startswith("sha256:"):
            matches = [image for image in self.list() if image.digest.startswith(ref)]
            if len(matches) > 1:
                shared = [i.name for i in matches if not i.name.startswith(PRIVATE_PREFIXES)]
                raise InvalidRequest(
                    f"digest prefix {ref} is ambiguous: {len(matches)} images "
                    f"({', '.join(shared) or 'none of them shared'})"
                )
            if matches:
                return matches[0]
        elif image := self._lookup(ref):
            return image
        known = ", ".join(image.name for image in self.list()
                          if not image.name.startswith(PRIVATE_PREFIXES)) or "none"
        raise ImageNotFound(
            f"no image {ref!r} in {self.root} (known images: {known}; "
            f"builtin specs that ensure() builds on demand: {', '.join(builtin_names())})",
            ref=ref,
        )

    def ensure(self, ref_or_builtin_name: str, console: Console | None = None) -> Image:
        """``get``, except that a builtin spec name is built when missing or out of date."""
        if ref_or_builtin_name not in builtin_names():
            return self.get(ref_or_builtin_name)
        spec = load_spec(ref_or_builtin_name)
        image = self._find(spec.name)
        if image and [layer.digest for layer in image.layers] == [plan.digest for plan in plan_layers(spec)]:
            return image
        return self.build(spec, console)

    def remove(self, ref: str) -> Image:
        """Remove an image's name. Its layers stay while anything uses them (another image,
        a snapshot, a sandbox on any node) and go with garbage collection after that (gc.py)."""
        image = self.get(ref)
        self._manifest(image.name).unlink()
        log.info("removed image %s (its unused layers go with garbage collection)", image.name)
        return image

    def version(self, digest: str) -> Image:
        """The image version ``digest`` (``Image.digest``), whatever its name is now: what a
        snapshot or a sandbox was made from."""
        if not DIGEST.fullmatch(digest):
            raise InvalidRequest(f"{digest!r} is not an image digest (sha256:<64 hex>)")
        path = self.version_path(digest)
        if path.exists():
            return self._load(path)
        for named in self._images.glob("*.json"):  # named before versions were recorded
            if (manifest := _read_manifest(named)) and manifest["digest"] == digest:
                with contextlib.suppress(OSError):  # a store this node only reads
                    self._record_version(named)
                return self._load(named)
        raise ImageNotFound(f"no image version {digest} in {self.root}; its name was rebuilt "
                            "or removed and nothing kept it", ref=digest)

    def references(self) -> tuple[dict[str, list[str]], dict[str, tuple[float, int, list[str]]]]:
        """What the store's own records name, as the collector reads it: the named images'
        layers by image digest, and every recorded version's (mtime, file size, layers). A
        record that cannot be read is skipped (logged): it names nothing."""
        named: dict[str, list[str]] = {}
        for path in self._images.glob("*.json"):
            if not path.is_symlink() and (manifest := _read_manifest(path)):
                named[manifest["digest"]] = manifest["layers"]
        versions: dict[str, tuple[float, int, list[str]]] = {}
        for path in self._versions.glob("*.json"):  # none if the directory is not there yet
            if path.is_symlink():
                continue  # dsec never makes one: not a record
            if (manifest := _read_manifest(path)) and path.stem == _hex(manifest["digest"]):
                st = path.stat()
                versions[manifest["digest"]] = (st.st_mtime, st.st_size, manifest["layers"])
        return named, versions

    def remove_version(self, digest: str) -> bool:
        """Forget a version record; False if it was already gone."""
        try:
            self.version_path(digest).unlink()
        except FileNotFoundError:
            return False
        return True

    def version_path(self, digest: str) -> Path:
        return self._versions / f"{_hex(digest)}.json"

    @property
    def lock_path(self) -> Path:
        """The store's lock: shared by builds, imports and edges taking an image into use;
        exclusive for garbage collection."""
        return self._store_lock

    def _record_version(self, path: Path) -> None:
        """The version the name's manifest ``path`` points at, recorded by digest (once;
        touched again when named again, so its collection grace starts afresh)."""
        manifest = json.loads(path.read_text())
        target = self.version_path(manifest["digest"])
        try:
            os.utime(target)
        except FileNotFoundError:
            self._versions.mkdir(exist_ok=True)
            write_whole(target, json.dumps(manifest, indent=2).encode())

    def _lookup(self, ref: str) -> Image | None:
        """A stored name first, then a reference's canonical name."""
        if not is_reference(ref):
            return self._find(ref)  # refused unless a valid store name
        if IMAGE_NAME.match(ref) and (image := self._find(ref)):
            return image
        return self._find(parse_reference(ref).canonical)

    def _manifest(self, name: str) -> Path:
        # Names have no '%': escaping '/' and '@' this way cannot make two names collide.
        return self._images / (name.replace("/", "%2F").replace("@", "%40") + ".json")

    def _find(self, name: str) -> Image | None:
        """The named image; a manifest is parsed once per version (it is replaced by rename,
        so its inode and mtime name the version), as sandbox creates look images up often."""
        _check_name(name)
        path = self._manifest(name)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        version = (st.st_ino, st.st_mtime_ns)
        cached = self._loaded.get(name)
        if cached is None or cached[0] != version:
            cached = self._loaded[name] = (version, self._load(path))
        return cached[1]

    def _save(self, name: str, layers: list[Layer], config: ImageConfig, source: dict[str, Any]) -> Image:
        digest = image_digest(layers)
        existing = self._find(name)
        if existing and existing.digest == digest and existing.config == config:
            self._record_version(self._manifest(name))
            return existing  # nothing changed: keep the manifest (and its created_at) as it is
        manifest = {
            "name": name,
            "digest": digest,
            "layers": [layer.digest for layer in layers],
            "created_at": time.time(),
            "config": asdict(config),
            "source": source,
        }
        path = self._manifest(name)
        write_whole(path, json.dumps(manifest, indent=2).encode())
        self._record_version(path)
        return self._load(path)

    def _load(self, path: Path) -> Image:
        manifest = json.loads(path.read_text())
        layers = []
        for digest in manifest["layers"]:
            layer = self.layers.get(digest)
            if layer is None:
                raise ImageNotFound(
                    f"image {manifest['name']!r} is incomplete: layer {digest} is missing; rebuild it"
                )
            layers.append(layer)
        config = manifest["config"]
        return Image(
            name=manifest["name"],
            digest=manifest["digest"],
            layers=tuple(layers),
            created_at=manifest["created_at"],
            size_bytes=sum(layer.size_bytes for layer in layers),
            config=ImageConfig(
                env=tuple(config["env"]),
                working_dir=config["working_dir"],
                entrypoint=tuple(config["entrypoint"]),
                cmd=tuple(config["cmd"]),
                user=config.get("user", ""),
                labels=tuple(config.get("labels", ())),
            ),
        )

    def list(self) -> list[Image]:  # last, so that ``list`` in the annotations above is the builtin
        return [self._load(path) for path in sorted(self._images.glob("*.json"))]


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """A manifest's digest and layer digests, checked; None (logged) if it is not one."""
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None  # removed meanwhile: it names nothing
    except (OSError, ValueError):
        manifest = None
    try:
        if (DIGEST.fullmatch(manifest["digest"]) and isinstance(manifest["layers"], list)
                and all(isinstance(d, str) and DIGEST.fullmatch(d) for d in manifest["layers"])):
            return manifest
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.warning("%s is not an image manifest: skipped", path)
    return None


def _check_name(name: str) -> None:
    """A store name: letters, digits and ``._:-``, or a pulled image's canonical reference."""
    if IMAGE_NAME.match(name) or (is_reference(name) and parse_reference(name).canonical == name):
        return
    raise InvalidRequest(f"{name!r} is not a valid image name (letters, digits, '.', '_', ':', '-')")


def _hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


def _remove_scratch(scratch: Path) -> None:
    """Remove a layer's scratch directory, unmounting its staging tmpfs first if it has one."""
    if os.path.ismount(scratch / "rootfs"):
        unmount_or_detach(scratch / "rootfs")
    shutil.rmtree(scratch)


def _mkfs_erofs(rootfs: Path, image_file: Path) -> None:
    """Pack a layer directory; overlay whiteouts (char 0:0) and opaque xattrs are kept as they are."""
    result = subprocess.run(
        ["mkfs.erofs", *_EROFS_OPTIONS, str(image_file), str(rootfs)], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ImageBuildError(f"mkfs.erofs failed (exit {result.returncode}): {result.stderr.strip()}")
    _write_durably(image_file, None)


def write_whole(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it): readers on any
    node see the old content or the new."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; other nodes' readers need it
    _write_durably(Path(tmp), data)
    os.rename(tmp, path)


def _write_durably(path: Path, data: bytes | None) -> None:
    """Write ``data`` (or keep the content, if None) and fsync, before a rename publishes it."""
    with open(path, "r+b" if data is None else "wb") as f:
        if data is not None:
            f.write(data)
        os.fsync(f.fileno())


def _disk_usage(root: Path) -> int:
    seen, total = set(), 0
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            st = os.lstat(os.path.join(directory, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total
