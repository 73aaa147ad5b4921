"""Images: spec validation, real builds (mmdebstrap), layer caching, mounting, OCI import.

Builds use the default store (``$DSEC_IMAGE_STORE`` or /var/cache/dsec/images), so reruns
are cache hits; everything mounted here is unmounted again.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dsec.images import (
    Image,
    ImageBuildError,
    ImageSpec,
    ImageStore,
    LayerMounter,
    load_spec,
    overlay_mount,
    parse_spec,
    unmount,
)
from dsec.images.builder import plan_layers
from dsec.images.mount import mountpoints
from dsec.protocol.errors import DigestMismatch, ImageNotFound, InvalidRequest

BUSYBOX = Path("/usr/bin/busybox")  # busybox-static


# --- helpers -------------------------------------------------------------------------------


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator[LayerMounter]:
    mounter = LayerMounter(tmp_path / "layer-cache")
    yield mounter
    assert mounter.unmount_all() == []


@contextmanager
def mounted(image: Image, mounter: LayerMounter, scratch: Path) -> Iterator[tuple[Path, Path]]:
    """The image as an overlay with a fresh upper: yields (merged root, upper)."""
    upper, work, merged = scratch / "upper", scratch / "work", scratch / "merged"
    for d in (upper, work, merged):
        d.mkdir(parents=True)
    overlay_mount(mounter.lowerdirs(image), upper, work, merged)
    try:
        yield merged, upper
    finally:
        unmount(merged)


def chroot(root: Path, *argv: str) -> str:
    return subprocess.run(["chroot", str(root), *argv], check=True, capture_output=True, text=True).stdout


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def identities(image: Image) -> list[tuple[int, int]]:
    """(inode, mtime) of each layer: unchanged exactly when a layer was not rebuilt."""
    return [(os.stat(layer.path).st_ino, os.stat(layer.path).st_mtime_ns) for layer in image.layers]


SPEC = """
name = "t"
[base]
suite = "bookworm"
"""


# --- spec ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top", "tables", "message"),
    [
        ("colour = 'red'", "", "colour: unknown key"),
        ("workspace = 3", "", "workspace: must be a table, got int"),
        (
            "",
            "[toolkit]\npacakges = ['jq']",
            "toolkit.pacakges: unknown key (expected one of: packages, pip)",
        ),
        ("", "[toolkit]\npackages = 'jq'", "toolkit.packages: must be a list of strings, got string"),
        ("", "[toolkit]\npackages = ['jq', 3]", "toolkit.packages: must be a list of strings, item 1 is int"),
        ("", "[toolkit]\npackages = ['Not A Package']", "is not a Debian package name"),
        ("", "[toolkit]\npip = ['requests']", "add 'python3-pip' to toolkit.packages"),
        ("", "[toolkit]\npackages = ['python3-pip']\npip = ['--index-url=x']", "options are not allowed"),
        ("", "[workspace]\nfiles = { 'work/x' = 'y' }", "normalised absolute file path"),
        ("", "[workspace]\nfiles = { '/work/../x' = 'y' }", "normalised absolute file path"),
        ("", "[workspace]\nfiles = { '/work/x' = 1 }", "must be a string, got int"),
        ("", "[workspace]\ncommands = 'make'", "workspace.commands: must be a list of strings"),
    ],
)
def test_spec_errors_name_the_key(top: str, tables: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        parse_spec(tomllib.loads(f"{top}\n{SPEC}\n{tables}"), source="t.toml")


def test_spec_requires_name_and_base_suite() -> None:
    with pytest.raises(InvalidRequest, match="name: missing required key"):
        parse_spec({"base": {"suite": "bookworm"}})
    with pytest.raises(InvalidRequest, match=r"base\.suite: missing required key"):
        parse_spec({"name": "x", "base": {}})
    with pytest.raises(InvalidRequest, match=r"base\.variant: 'tiny' is not one of"):
        parse_spec({"name": "x", "base": {"suite": "bookworm", "variant": "tiny"}})


def test_load_spec_builtins_files_and_errors(tmp_path: Path) -> None:
    python = load_spec("python-3.11")
    assert python.name == "python-3.11" and "python3" in python.toolkit.packages
    assert load_spec("debian-minbase").toolkit.empty
    path = tmp_path / "mine.toml"
    path.write_text(SPEC + "[workspace]\nfiles = { '/work/a.txt' = 'hello' }\n")
    assert load_spec(path).workspace.files == (("/work/a.txt", "hello"),)
    with pytest.raises(InvalidRequest, match=r"builtins: debian-minbase, python-3\.11"):
        load_spec("python-2.7")
    path.write_text("name = ")
    with pytest.raises(InvalidRequest, match="invalid TOML"):
        load_spec(path)


def test_cache_keys_chain_through_parents() -> None:
    spec = parse_spec({"name": "a", "base": {"suite": "bookworm"}, "toolkit": {"packages": ["jq"]}})
    changed_workspace = parse_spec({**_as_data(spec), "workspace": {"files": {"/work/x": "1"}}})
    changed_toolkit = parse_spec({**_as_data(spec), "toolkit": {"packages": ["jq", "curl"]}})
    keys = [p.digest for p in plan_layers(spec)]
    assert [p.section for p in plan_layers(spec)] == ["base", "toolkit", "workspace"]
    assert [p.digest for p in plan_layers(changed_workspace)][:2] == keys[:2]
    assert [p.digest for p in plan_layers(changed_workspace)][2] != keys[2]
    other = [p.digest for p in plan_layers(changed_toolkit)]
    assert other[0] == keys[0] and other[1:] != keys[1:]  # a changed parent changes every key above
    assert [p.section for p in plan_layers(load_spec("debian-minbase"))] == ["base", "workspace"]


def _as_data(spec: ImageSpec) -> dict[str, object]:
    return {"name": spec.name, "base": spec.base.to_dict(), "toolkit": spec.toolkit.to_dict()}


# --- OCI import (fast: no mmdebstrap) -------------------------------------------------------


def _layer_tar(entries: list[tuple[str, bytes | None, int]], symlinks: dict[str, str] | None = None) -> bytes:
    """A layer tar: (path, data or None for a directory, mode) entries plus symlinks."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path, data, mode in entries:
            info = tarfile.TarInfo(path)
            info.mode, info.mtime = mode, 1_700_000_000
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        for path, target in (symlinks or {}).items():
            info = tarfile.TarInfo(path)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, 1_700_000_000
            tar.addfile(info)
    return buffer.getvalue()


def _busybox_layers() -> list[bytes]:
    bottom = _layer_tar(
        [
            ("bin", None, 0o755),
            ("bin/busybox", BUSYBOX.read_bytes(), 0o755),
            ("etc", None, 0o755),
            ("etc/hidden.txt", b"remove me\n", 0o644),
            ("etc/keep.txt", b"kept\n", 0o644),
            ("data", None, 0o755),
            ("data/old.txt", b"old\n", 0o644),
        ],
        symlinks={"bin/sh": "busybox", "bin/cat": "busybox", "bin/ls": "busybox"},
    )
    top = _layer_tar(
        [
            ("etc/.wh.hidden.txt", b"", 0o644),
            ("data", None, 0o755),
            ("data/.wh..wh..opq", b"", 0o644),
            ("data/new.txt", b"new\n", 0o644),
        ]
    )
    return [gzip.compress(bottom), top]  # one gzip, one plain layer


IMAGE_CONFIG = {
    "Env": ["PATH=/bin", "GREETING=hi"],
    "WorkingDir": "/data",
    "Entrypoint": ["/bin/sh"],
    "Cmd": ["-c", "ls"],
}


def _config(layers: list[bytes]) -> bytes:
    diff_ids = [
        "sha256:" + hashlib.sha256(gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b).hexdigest()
        for b in layers
    ]
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": IMAGE_CONFIG,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    return json.dumps(config).encode()


def _write_archive(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _blob(data: bytes) -> tuple[str, dict]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return f"blobs/sha256/{digest.removeprefix('sha256:')}", {"digest": digest, "size": len(data)}


def make_oci_archive(path: Path, layers: list[bytes] | None = None, config: bytes | None = None) -> Path:
    layers = layers or _busybox_layers()
    config_name, config_desc = _blob(config or _config(layers))
    files = {config_name: config or _config(layers)}
    layer_descs = []
    for data in layers:
        name, desc = _blob(data)
        files[name] = data
        media = "tar+gzip" if data[:2] == b"\x1f\x8b" else "tar"
        layer_descs.append({"mediaType": f"application/vnd.oci.image.layer.v1.{media}", **desc})
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
            "layers": layer_descs,
        }
    ).encode()
    manifest_name, manifest_desc = _blob(manifest)
    files[manifest_name] = manifest
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest_desc}],
    }
    files["oci-layout"] = b'{"imageLayoutVersion": "1.0.0"}'
    files["index.json"] = json.dumps(index).encode()
    return _write_archive(path, files)


def make_docker_archive(path: Path) -> Path:
    layers = _busybox_layers()
    files = {"config.json": _config(layers)}
    for index, data in enumerate(layers):
        files[f"layer{index}/layer.tar"] = data
    manifest = [
        {
            "Config": "config.json",
            "RepoTags": ["busybox:test"],
            "Layers": [f"layer{i}/layer.tar" for i in range(2)],
        }
    ]
    files["manifest.json"] = json.dumps(manifest).encode()
    return _write_archive(path, files)


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


@pytest.mark.parametrize("layer_format", ["erofs", "dir"])
def test_oci_import_whiteouts_hide_lower_files(
    tmp_path: Path, mounter: LayerMounter, layer_format: str
) -> None:
    store = ImageStore(tmp_path / "store", layer_format=layer_format)
    image = store.import_oci(make_oci_archive(tmp_path / "busybox.tar"), "busybox")
    assert len(image.layers) == 3  # two image layers and the /work layer
    assert {layer.format for layer in image.layers} == {layer_format}
    assert image.config.env == ("PATH=/bin", "GREETING=hi")
    assert (image.config.working_dir, image.config.entrypoint, image.config.cmd) == (
        "/data",
        ("/bin/sh",),
        ("-c", "ls"),
    )
    with mounted(image, mounter, tmp_path / "sandbox") as (root, _):
        assert not (root / "etc/hidden.txt").exists()  # whiteout
        assert (root / "etc/keep.txt").read_text() == "kept\n"
        assert sorted(os.listdir(root / "data")) == ["new.txt"]  # opaque directory
        assert (root / "work").is_dir()
        assert chroot(root, "/bin/sh", "-c", "cat /etc/keep.txt /data/new.txt") == "kept\nnew\n"


def test_docker_save_archive_shares_layers_with_oci_import(tmp_path: Path, store: ImageStore) -> None:
    oci = store.import_oci(make_oci_archive(tmp_path / "oci.tar"), "from-oci")
    docker = store.import_oci(make_docker_archive(tmp_path / "docker.tar"), "from-docker")
    assert [layer.digest for layer in docker.layers] == [layer.digest for layer in oci.layers]
    assert docker.config == oci.config and docker.digest == oci.digest


def test_corrupt_layer_is_rejected_and_leaves_nothing(tmp_path: Path, store: ImageStore) -> None:
    layers = _busybox_layers()
    config = json.loads(_config(layers))
    config["rootfs"]["diff_ids"][1] = "sha256:" + "0" * 64
    archive = make_oci_archive(tmp_path / "bad.tar", layers, json.dumps(config).encode())
    with pytest.raises(DigestMismatch, match="does not match its diff_id"):
        store.import_oci(archive, "bad")
    assert len(os.listdir(store.root / "layers")) == 1  # the good bottom layer is kept for reuse
    assert os.listdir(store.root / "tmp") == []
    assert store.list() == []


def test_import_rejects_what_is_not_an_image(tmp_path: Path, store: ImageStore) -> None:
    with pytest.raises(InvalidRequest, match="not a readable tar archive"):
        store.import_oci(tmp_path / "missing.tar", "x")
    with pytest.raises(InvalidRequest, match=r"neither index\.json"):
        store.import_oci(_write_archive(tmp_path / "other.tar", {"hello.txt": b"hi"}), "x")
    with pytest.raises(InvalidRequest, match="malformed image metadata"):
        store.import_oci(_write_archive(tmp_path / "odd.tar", {"manifest.json": b"[{}]"}), "x")


def test_get_list_and_remove(tmp_path: Path, store: ImageStore) -> None:
    first = store.import_oci(make_oci_archive(tmp_path / "a.tar"), "first")
    only_bottom = [_busybox_layers()[0]]
    second = store.import_oci(make_oci_archive(tmp_path / "b.tar", only_bottom), "second")
    assert first.layers[0] == second.layers[0]
    assert [image.name for image in store.list()] == ["first", "second"]
    assert store.get(first.digest[:15]) == first == store.get("first")
    assert first.size_bytes == sum(layer.size_bytes for layer in first.layers) > BUSYBOX.stat().st_size // 2
    with pytest.raises(ImageNotFound, match="known images: first, second"):
        store.get("third")
    with pytest.raises(InvalidRequest, match="not a valid image name"):
        store.get("../etc/passwd")
    store.remove("first")
    assert [image.name for image in store.list()] == ["second"]
    remaining = {f"sha256:{name}" for name in os.listdir(store.root / "layers")}
    # the name only: layers go with garbage collection (tests/unit/test_layer_gc.py)
    assert remaining == {layer.digest for layer in (*first.layers, *second.layers)}
    assert store.version(first.digest) == first  # what a snapshot of it was made from


def _race(script: str, go: Path, processes: int = 2) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` in several interpreters that start together once ``go`` exists."""
    wait = f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.001)\n"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", wait + script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(processes)
    ]
    time.sleep(1.0)  # every interpreter is up and waiting
    go.touch()
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=60)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert all(result.returncode == 0 for result in results), [result.stderr for result in results]
    return results


def test_concurrent_imports_build_each_layer_once(tmp_path: Path) -> None:
    archive, root = make_oci_archive(tmp_path / "busybox.tar"), tmp_path / "store"
    script = f"""
import logging
from pathlib import Path
from dsec.images import ImageStore
logging.basicConfig(level=logging.INFO, format="%(message)s")
print(ImageStore(Path({str(root)!r})).import_oci(Path({str(archive)!r}), "busybox").digest)
"""
    results = _race(script, tmp_path / "go")
    assert results[0].stdout == results[1].stdout
    logs = results[0].stderr + results[1].stderr
    assert logs.count(": built ") == 2 and logs.count(": cached ") == 2  # two image layers, built once
    assert len(os.listdir(root / "layers")) == 3 and os.listdir(root / "tmp") == []


def test_concurrent_lowerdirs_mount_each_layer_once(tmp_path: Path, store: ImageStore) -> None:
    image = store.import_oci(make_oci_archive(tmp_path / "busybox.tar"), "busybox")
    cache = tmp_path / "layer-cache"
    script = f"""
from pathlib import Path
from dsec.images import ImageStore, LayerMounter
image = ImageStore(Path({str(store.root)!r})).get("busybox")
print(LayerMounter(Path({str(cache)!r})).lowerdirs(image))
"""
    mounter = LayerMounter(cache)
    try:
        results = _race(script, tmp_path / "go")
        assert results[0].stdout == results[1].stdout
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        assert sorted(m for m in mounts if m.startswith(str(cache))) == sorted(
            str(cache / layer.digest[7:]) for layer in image.layers
        )  # each layer once
        assert mounter.lowerdirs(image) == [cache / layer.digest[7:] for layer in reversed(image.layers)]
    finally:
        assert mounter.unmount_all() == []
    assert not any(str(m).startswith(str(cache)) for m in mountpoints())


# --- real builds (mmdebstrap, default store) ------------------------------------------------

JQ_SPEC = {
    "name": "test-images-jq",
    "base": {"suite": "bookworm", "variant": "minbase"},
    "toolkit": {"packages": ["jq"]},
    "workspace": {
        "files": {"/work/README.txt": "hello", "/etc/dsec-test.conf": "x=1\n"},
        "commands": ["echo built > made.txt"],
    },
}


@pytest.fixture(scope="module")
def default_store() -> ImageStore:
    return ImageStore()


@pytest.fixture(scope="module")
def minbase(default_store: ImageStore) -> Image:
    return default_store.build(load_spec("debian-minbase"))


@pytest.mark.slow
def test_build_minbase_then_rebuild_is_a_cache_hit(default_store: ImageStore, minbase: Image) -> None:
    assert [layer.format for layer in minbase.layers] == ["erofs", "erofs"]
    before = identities(minbase)
    started = time.monotonic()
    again = default_store.build(load_spec("debian-minbase"))
    assert time.monotonic() - started < 2
    assert again == minbase and identities(again) == before
    assert default_store.ensure("debian-minbase") == minbase


@pytest.mark.slow
def test_custom_spec_reuses_base_and_changed_workspace_reuses_toolkit(
    default_store: ImageStore, minbase: Image
) -> None:
    image = default_store.build(parse_spec(JQ_SPEC))
    assert image.layers[0] == minbase.layers[0]
    changed = dict(JQ_SPEC, workspace={"files": {"/work/README.txt": "changed"}})
    before = identities(image)
    other = default_store.build(parse_spec(changed))
    assert other.layers[:2] == image.layers[:2] and identities(other)[:2] == before[:2]
    assert other.layers[2] != image.layers[2]


@pytest.mark.slow
def test_overlay_shows_every_layer_and_writes_go_to_upper(
    default_store: ImageStore, minbase: Image, mounter: LayerMounter, tmp_path: Path
) -> None:
    image = default_store.build(parse_spec(JQ_SPEC))
    digests = [sha256_file(layer.path) for layer in image.layers]
    with mounted(image, mounter, tmp_path / "sandbox") as (root, upper):
        assert chroot(root, "/bin/bash", "-c", "echo base") == "base\n"  # base layer
        assert chroot(root, "jq", "-n", "1+1") == "2\n"  # toolkit layer
        assert (root / "work/README.txt").read_text() == "hello"  # workspace layer
        assert (root / "work/made.txt").read_text() == "built\n"  # workspace command, run in /work
        assert not (root / "usr/sbin/policy-rc.d").exists()  # build-only files stay out of layers
        chroot(
            root,
            "/bin/sh",
            "-c",
            "echo new > /work/new.txt; echo changed > /etc/hostname; rm /etc/dsec-test.conf",
        )
        assert (upper / "work/new.txt").read_text() == "new\n"
        assert (upper / "etc/hostname").read_text() == "changed\n"
        assert os.major(os.lstat(upper / "etc/dsec-test.conf").st_rdev) == 0  # a whiteout
        lowers = mounter.lowerdirs(image)
        assert (lowers[0] / "etc/dsec-test.conf").exists() and not (lowers[0] / "work/new.txt").exists()
    assert [sha256_file(layer.path) for layer in image.layers] == digests


@pytest.mark.slow
def test_failed_build_leaves_no_layer_mount_or_scratch(default_store: ImageStore, minbase: Image) -> None:
    spec = parse_spec(
        {
            "name": "test-images-fails",
            "base": {"suite": "bookworm"},
            "workspace": {"commands": ["echo oops; exit 3"]},
        }
    )
    def ours() -> set[Path]:  # the store's own: servers and benchmarks elsewhere on the host mount too
        return {m for m in mountpoints() if m.is_relative_to(default_store.root)}

    mounts_before = ours()
    with pytest.raises(ImageBuildError, match=r"(?s)exit 3.*oops"):
        default_store.build(spec)
    assert default_store.layers.get(plan_layers(spec)[-1].digest) is None
    assert ours() == mounts_before
    assert not list((default_store.root / "tmp").glob(f"{plan_layers(spec)[-1].digest[7:]}.*"))
    with pytest.raises(ImageNotFound):
        default_store.get("test-images-fails")


@pytest.mark.slow
def test_ensure_python_builds_an_image_that_runs_python(
    default_store: ImageStore, mounter: LayerMounter, tmp_path: Path
) -> None:
    image = default_store.ensure("python-3.11")
    assert default_store.ensure("python-3.11") == image
    with mounted(image, mounter, tmp_path / "sandbox") as (root, _):
        assert chroot(root, "python3", "-c", "print(1)") == "1\n"
        assert (root / "work").is_dir()
