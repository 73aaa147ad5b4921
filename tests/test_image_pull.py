"""Pulls from a real registry on loopback: Debian's ``docker-registry`` (the CNCF distribution
registry), started here on 127.0.0.1 with and without htpasswd auth; images are built as OCI
archives by the tests and pushed with ``skopeo copy``. What the registry serves is hostile data:
corrupted blobs and layer tars that try to escape are pushed like any image, and every pull of
them must end in a typed error with nothing stored."""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import http.server
import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import dsec
from conftest import TEST_ROOT, Server, free_port, make_server, stop_server
from dsec.images.gc import UnusedLayers
from dsec.images.mount import locked, mountpoints, tmpfs_mount
from dsec.images.oci import extract_layer
from dsec.images.store import ImageStore
from dsec.protocol.errors import (
    DigestMismatch,
    ImageNotFound,
    InvalidRequest,
    NotSupported,
    RegistryDenied,
    RegistryUnreachable,
    UnsafeArchive,
)
from test_images import BUSYBOX, _busybox_layers, _config, _layer_tar, make_oci_archive

pytestmark = pytest.mark.skipif(
    not (shutil.which("docker-registry") and shutil.which("skopeo") and shutil.which("htpasswd")),
    reason="needs docker-registry, skopeo and apache2-utils (scripts/setup installs them)")

USER, PASSWORD = "puller", "s3cret-pw"


@dataclass
class Registry:
    host: str  # 127.0.0.1:PORT
    storage: Path
    auth: bool

    def push(self, archive: Path, name: str) -> str:
        """Push an OCI archive as ``name`` (repo:tag); returns the manifest digest."""
        creds = ["--dest-creds", f"{USER}:{PASSWORD}"] if self.auth else []
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", *creds,
                        f"oci-archive:{archive}", f"docker://{self.host}/{name}"],
                       check=True, capture_output=True)
        repo, _, tag = name.partition(":")
        blobs = self.storage / "docker/registry/v2/repositories" / repo / "_manifests/tags"
        link = blobs / tag / "current/link"
        return link.read_text().strip()

    def put_image(self, name: str, config: bytes, layers: list[bytes],
                  layer_type: str = "application/vnd.oci.image.layer.v1.tar") -> None:
        """Push through the registry's own API, for what skopeo refuses to push (a giant config)."""
        repo, _, tag = name.partition(":")
        descriptors = []
        with httpx.Client(base_url=f"http://{self.host}/v2/{repo}") as http:
            for data in (config, *layers):
                digest = "sha256:" + hashlib.sha256(data).hexdigest()
                location = http.post("/blobs/uploads/").raise_for_status().headers["location"]
                url = httpx.URL(location).copy_merge_params({"digest": digest})
                http.put(url, content=data).raise_for_status()
                descriptors.append({"digest": digest, "size": len(data)})
            manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **descriptors[0]},
                        "layers": [{"mediaType": layer_type, **d} for d in descriptors[1:]]}
            http.put(f"/manifests/{tag}", content=json.dumps(manifest), headers={
                "content-type": "application/vnd.oci.image.manifest.v1+json"}).raise_for_status()

    def put_index(self, name: str, platforms: dict[str, str]) -> None:
        """An image index ``name`` of the manifests tagged ``platforms[os/arch]`` in its repo."""
        repo, _, tag = name.partition(":")
        oci = "application/vnd.oci.image.manifest.v1+json"
        entries = []
        with httpx.Client(base_url=f"http://{self.host}/v2/{repo}") as http:
            for platform, manifest_tag in platforms.items():
                body = http.get(f"/manifests/{manifest_tag}", headers={"accept": oci}).content
                os_, arch = platform.split("/")
                entries.append({"mediaType": oci, "digest": "sha256:" + hashlib.sha256(body).hexdigest(),
                                "size": len(body), "platform": {"os": os_, "architecture": arch}})
            index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                     "manifests": entries}
            http.put(f"/manifests/{tag}", content=json.dumps(index), headers={
                "content-type": "application/vnd.oci.image.index.v1+json"}).raise_for_status()

    def config_digest(self, name: str) -> str:
        repo, _, tag = name.partition(":")
        with httpx.Client() as http:
            return str(http.get(f"http://{self.host}/v2/{repo}/manifests/{tag}", headers={
                "accept": "application/vnd.oci.image.manifest.v1+json"}).json()["config"]["digest"])

    def layer_blobs(self, name: str) -> list[Path]:
        """The files the registry serves ``name``'s layers from (skopeo may have compressed them)."""
        repo, _, tag = name.partition(":")
        with httpx.Client() as http:
            manifest = http.get(f"http://{self.host}/v2/{repo}/manifests/{tag}", headers={
                "accept": "application/vnd.oci.image.manifest.v1+json"}).json()
        return [self.blob_data(layer["digest"]) for layer in manifest["layers"]]

    def blob_data(self, digest: str) -> Path:
        hexdigest = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"


class _TokenRealm(http.server.BaseHTTPRequestHandler):
    """The registry's token server (``auth: token``): for the right Basic credentials, a JWT
    signed (RS256, openssl) by the key whose certificate the registry trusts, granting the
    scopes asked for. The registry checks the token; this only issues it."""

    key: Path
    cert_der: bytes
    tokens_issued = 0
    authorizations: list[str | None]  # what each request to the realm carried

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.authorizations.append(self.headers.get("authorization"))
        query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
        expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        if self.headers.get("authorization") != expected:
            self.send_response(401)
            self.end_headers()
            return
        access = []
        for scope in query.get("scope", []):
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"alg": "RS256", "typ": "JWT", "x5c": [base64.b64encode(self.cert_der).decode()]}
        claims = {"iss": "dsec-test-issuer", "sub": USER, "aud": "dsec-test-registry",
                  "exp": now + 600, "nbf": now - 60, "iat": now, "jti": os.urandom(8).hex(),
                  "access": access}
        signing_input = b".".join(_b64url(json.dumps(part).encode()) for part in (header, claims))
        signature = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)],
                                   input=signing_input, check=True, capture_output=True).stdout
        body = json.dumps({"token": (signing_input + b"." + _b64url(signature)).decode()}).encode()
        type(self).tokens_issued += 1
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _b64url(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


def _token_realm(tmp: Path, address: str = "127.0.0.1") -> tuple[http.server.ThreadingHTTPServer,
                                                                 type[_TokenRealm]]:
    key, cert = tmp / "realm.key", tmp / "realm.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=dsec-test-realm"],
                   check=True, capture_output=True)
    der = subprocess.run(["openssl", "x509", "-in", str(cert), "-outform", "DER"],
                         check=True, capture_output=True).stdout
    handler = type("Realm", (_TokenRealm,), {"key": key, "cert_der": der, "authorizations": []})
    server = http.server.ThreadingHTTPServer((address, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


def _start_registry(tmp: Path, auth: str = "") -> tuple[subprocess.Popen[bytes], Registry]:
    port = free_port()
    storage = tmp / "storage"
    storage.mkdir(parents=True)
    config = {"version": 0.1, "log": {"level": "error"},
              "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
              "http": {"addr": f"127.0.0.1:{port}"}}
    if auth == "basic":
        line = subprocess.run(["htpasswd", "-nbB", USER, PASSWORD], check=True,
                              capture_output=True, text=True).stdout.strip()
        (tmp / "htpasswd").write_text(line + "\n")
        config["auth"] = {"htpasswd": {"realm": "dsec-test", "path": str(tmp / "htpasswd")}}
    elif auth.startswith("token "):
        config["auth"] = {"token": {"realm": auth.removeprefix("token "), "service": "dsec-test-registry",
                                    "issuer": "dsec-test-issuer",
                                    "rootcertbundle": str(tmp / "realm.pem")}}
    (tmp / "config.yml").write_text(json.dumps(config))  # JSON is YAML
    proc = subprocess.Popen(["docker-registry", "serve", str(tmp / "config.yml")],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "registry.log", "wb"))
    with httpx.Client() as http:
        for _ in range(600):
            try:
                http.get(f"http://127.0.0.1:{port}/v2/")
                break
            except httpx.TransportError:
                assert proc.poll() is None, (tmp / "registry.log").read_text()
                time.sleep(0.05)
    return proc, Registry(f"127.0.0.1:{port}", storage, bool(auth))


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    proc, reg = _start_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    proc.terminate()
    proc.wait()


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    proc, reg = _start_registry(tmp_path_factory.mktemp("auth-registry"), auth="basic")
    yield reg
    proc.terminate()
    proc.wait()


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Registry, type[_TokenRealm]]]:
    tmp = tmp_path_factory.mktemp("token-registry")
    realm, handler = _token_realm(tmp)
    proc, reg = _start_registry(tmp, auth=f"token http://127.0.0.1:{realm.server_address[1]}/token")
    yield reg, handler
    proc.terminate()
    proc.wait()
    realm.shutdown()


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty credentials file (never the host's docker config)."""
    path = tmp_path / "auth.json"
    path.write_text("{}")
    monkeypatch.setenv("DSEC_REGISTRY_AUTH", str(path))
    return path


def _archive(tmp: Path, name: str, layers: list[bytes]) -> Path:
    return make_oci_archive(tmp / f"{name}.tar", layers)


def _leftovers(store: ImageStore) -> tuple[list[str], list[str]]:
    return sorted(os.listdir(store.root / "tmp")), [i.name for i in store.list()]


# --- pulls --------------------------------------------------------------------------------


def test_pull_by_tag_and_by_digest_keeps_whiteouts_and_config(
        tmp_path: Path, registry: Registry, store: ImageStore, no_credentials: Path) -> None:
    manifest = registry.push(_archive(tmp_path, "busybox", _busybox_layers()), "tests/busybox:1.0")
    image = store.pull(f"{registry.host}/tests/busybox:1.0")
    assert image.name == f"{registry.host}/tests/busybox:1.0"
    assert len(image.layers) == 3  # two image layers and /work
    assert image.config.env == ("PATH=/bin", "GREETING=hi")
    by_digest = store.pull(f"{registry.host}/tests/busybox@{manifest}")
    assert by_digest.name == f"{registry.host}/tests/busybox@{manifest}"
    assert [layer.digest for layer in by_digest.layers] == [layer.digest for layer in image.layers]
    # the same image imported from its archive shares every layer: one conversion per layer
    imported = store.import_oci(_archive(tmp_path, "again", _busybox_layers()), "imported")
    assert imported.digest == image.digest
    assert store.get(f"{registry.host}/tests/busybox:1.0") == image  # any spelling finds it
    assert _leftovers(store)[0] == []


def test_shared_base_layer_is_downloaded_and_converted_once(
        tmp_path: Path, registry: Registry, store: ImageStore, no_credentials: Path) -> None:
    base = gzip.compress(_layer_tar([("bin", None, 0o755), ("bin/busybox", BUSYBOX.read_bytes(), 0o755)]))
    first = _layer_tar([("one.txt", b"1\n", 0o644)])
    second = _layer_tar([("two.txt", b"2\n", 0o644)])
    registry.push(_archive(tmp_path, "a", [base, first]), "tests/shared-a:1")
    registry.push(_archive(tmp_path, "b", [base, second]), "tests/shared-b:1")
    a = store.pull(f"{registry.host}/tests/shared-a:1")
    base_layer = a.layers[0]
    stamp = (os.stat(base_layer.path).st_ino, os.stat(base_layer.path).st_mtime_ns)
    # the second pull must not fetch the shared blob: make it unservable to prove it
    registry.layer_blobs("tests/shared-b:1")[0].write_bytes(b"gone")
    b = store.pull(f"{registry.host}/tests/shared-b:1")
    assert b.layers[0] == base_layer
    assert (os.stat(base_layer.path).st_ino, os.stat(base_layer.path).st_mtime_ns) == stamp
    assert b.layers[1] != a.layers[1]


def test_platform_is_picked_from_an_index(tmp_path: Path, registry: Registry, store: ImageStore,
                                          no_credentials: Path) -> None:
    for arch in ("amd64", "arm64"):
        layer = _layer_tar([("arch.txt", arch.encode(), 0o644)])
        registry.put_image(f"tests/multi:{arch}", _config([layer]), [layer])
    registry.put_index("tests/multi:1", {"linux/amd64": "amd64", "linux/arm64": "arm64"})
    ref = f"{registry.host}/tests/multi:1"
    arm = ImageStore(tmp_path / "arm", layer_format="dir").pull(ref, platform="linux/arm64")
    assert (arm.layers[0].path / "arch.txt").read_text() == "arm64"
    with pytest.raises(dsec.NotSupported, match="none for linux/s390x"):
        store.pull(ref, platform="linux/s390x")
    assert _leftovers(store) == ([], [])


def test_cli_pull_prints_the_image_and_a_line_per_layer(tmp_path: Path, registry: Registry,
                                                       no_credentials: Path) -> None:
    registry.push(_archive(tmp_path, "cli", _busybox_layers()), "tests/cli:1")
    env = {**os.environ, "DSEC_IMAGE_STORE": str(tmp_path / "cli-store")}
    result = subprocess.run([sys.executable, "-m", "dsec", "image", "pull", f"{registry.host}/tests/cli:1"],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    name, digest = result.stdout.split()
    assert name == f"{registry.host}/tests/cli:1" and digest.startswith("sha256:")
    assert "layer 1/2: built" in result.stderr and "layer 2/2: built" in result.stderr
    again = subprocess.run([sys.executable, "-m", "dsec", "image", "pull", f"{registry.host}/tests/cli:1"],
                           env=env, capture_output=True, text=True)
    assert "layer 1/2: cached" in again.stderr and again.stdout == result.stdout
    bad = subprocess.run([sys.executable, "-m", "dsec", "image", "pull", "Not A Ref"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "invalid_request" in bad.stderr


def test_concurrent_pulls_in_two_processes_convert_each_layer_once(
        tmp_path: Path, registry: Registry, no_credentials: Path) -> None:
    registry.push(_archive(tmp_path, "two", _busybox_layers()), "tests/two:1")
    env = {**os.environ, "DSEC_IMAGE_STORE": str(tmp_path / "shared-store")}
    argv = [sys.executable, "-m", "dsec", "image", "pull", f"{registry.host}/tests/two:1"]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [proc.communicate() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    assert outputs[0][0] == outputs[1][0]  # the same image and digest
    stderr = outputs[0][1] + outputs[1][1]
    assert stderr.count("layer 1/2: built") == 1 and stderr.count("layer 2/2: built") == 1
    assert stderr.count("layer 1/2: cached") == 1


def test_docker_hub_shorthand_names_one_image(store: ImageStore) -> None:
    assert store.pullable("python:3.11-slim") and not store.pullable("python-3.11")
    with pytest.raises(ImageNotFound):
        store.get("python:3.11-slim")


# --- typed errors, nothing half-stored -----------------------------------------------------


def test_bad_reference_and_unknown_image(registry: Registry, store: ImageStore,
                                         no_credentials: Path) -> None:
    for bad in ("UPPER/case:1", f"{registry.host}/x:tag with space", "x@sha256:abc", "", "a//b"):
        with pytest.raises(InvalidRequest):
            store.pull(bad)
    with pytest.raises(ImageNotFound):
        store.pull(f"{registry.host}/tests/never-pushed:1")
    assert _leftovers(store) == ([], [])


def test_unreachable_registry(store: ImageStore, no_credentials: Path) -> None:
    with pytest.raises(RegistryUnreachable):
        store.pull(f"127.0.0.1:{free_port()}/tests/busybox:1")
    assert _leftovers(store) == ([], [])


@pytest.mark.parametrize("what", ["layer", "config", "manifest"])
def test_corrupted_blob_is_a_digest_mismatch_and_stores_nothing(
        what: str, tmp_path: Path, registry: Registry, store: ImageStore, no_credentials: Path) -> None:
    """The registry serves altered bytes (its storage was tampered with): a layer, the config,
    or the manifest of a by-digest pull. Refused, and nothing of it stored."""
    layer = _layer_tar([("file.txt", b"the real content\n", 0o644)])
    manifest = registry.push(_archive(tmp_path, "c", [layer]), f"tests/corrupt-{what}:1")
    blobs = {"layer": registry.layer_blobs(f"tests/corrupt-{what}:1")[0],
             "config": registry.blob_data(registry.config_digest(f"tests/corrupt-{what}:1")),
             "manifest": registry.blob_data(manifest)}
    data = blobs[what]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # JSON stays JSON-ish; a gzip stream breaks
    data.write_bytes(bytes(raw))
    ref = f"{registry.host}/tests/corrupt-{what}" + (f"@{manifest}" if what == "manifest" else ":1")
    with pytest.raises(DigestMismatch):
        store.pull(ref)
    assert _leftovers(store) == ([], [])
    assert os.listdir(store.root / "layers") == []


def test_blob_whose_digest_fails_only_after_a_complete_unpack_stores_nothing(
        tmp_path: Path, registry: Registry, store: ImageStore, no_credentials: Path) -> None:
    """Layers unpack while they download, so a blob's digest is known only once it is all
    unpacked. The registry serves another valid gzip of the same tar (shorter, so the whole of
    it streams): it unpacks completely and matches its diff_id; only the blob's digest is
    wrong. Nothing may be stored, and no staging tmpfs may stay mounted."""
    tar = _layer_tar([("file.txt", secrets.token_hex(100_000).encode(), 0o644)])
    served, other = gzip.compress(tar, compresslevel=1), gzip.compress(tar, compresslevel=9)
    assert len(other) < len(served) and gzip.decompress(other) == tar
    registry.put_image("tests/late-mismatch:1", _config([served]), [served],
                       "application/vnd.oci.image.layer.v1.tar+gzip")
    registry.layer_blobs("tests/late-mismatch:1")[0].write_bytes(other)
    with pytest.raises(DigestMismatch, match="has digest"):
        store.pull(f"{registry.host}/tests/late-mismatch:1")
    assert _leftovers(store) == ([], [])
    assert os.listdir(store.root / "layers") == []
    assert not [m for m in mountpoints() if m.is_relative_to(store.root)]


def test_layer_bigger_than_its_staging_tmpfs_is_refused_and_unpacks_on_disk_with_0(
        tmp_path: Path, registry: Registry, no_credentials: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers unpack in a tmpfs of DSEC_IMAGE_LAYER_STAGING_MB: one that does not fit is a typed
    refusal naming the setting (never a silent move to disk); 0 unpacks on the store's disk."""
    store = ImageStore(tmp_path / "store", layer_format="erofs")
    layer = gzip.compress(_layer_tar([("big", secrets.token_bytes(3 << 20), 0o644)]), compresslevel=1)
    registry.put_image("tests/staging:1", _config([layer]), [layer],
                       "application/vnd.oci.image.layer.v1.tar+gzip")
    monkeypatch.setenv("DSEC_IMAGE_LAYER_STAGING_MB", "1")
    with pytest.raises(UnsafeArchive, match="DSEC_IMAGE_LAYER_STAGING_MB"):
        store.pull(f"{registry.host}/tests/staging:1")
    assert _leftovers(store) == ([], [])
    assert not [m for m in mountpoints() if m.is_relative_to(store.root)]
    monkeypatch.setenv("DSEC_IMAGE_LAYER_STAGING_MB", "0")
    image = store.pull(f"{registry.host}/tests/staging:1")
    assert image.layers[0].format == "erofs" and _leftovers(store)[0] == []


def test_a_dead_pullers_staging_tmpfs_is_unmounted_by_the_next_build(tmp_path: Path) -> None:
    """A puller killed mid-layer leaves its scratch directory with the tmpfs still mounted;
    the next build of that layer (under its lock) unmounts and removes it."""
    store = ImageStore(tmp_path / "store", layer_format="erofs")
    digest = "sha256:" + "ab" * 32
    stale = store.root / "tmp" / f"{'ab' * 32}.dead"
    (stale / "rootfs").mkdir(parents=True)
    tmpfs_mount(stale / "rootfs", 1 << 20)
    (stale / "rootfs" / "half-unpacked").write_bytes(b"x")

    def build(scratch: Path) -> None:
        (scratch / "rootfs" / "file").write_bytes(b"layer\n")

    layer, fresh = store.layers.ensure(digest, {}, build, in_memory=True)
    assert fresh and layer.format == "erofs"
    assert not stale.exists() and os.listdir(store.root / "tmp") == []
    assert not [m for m in mountpoints() if m.is_relative_to(store.root)]


async def test_a_dead_pullers_staging_tmpfs_goes_at_the_next_collection(tmp_path: Path) -> None:
    """A layer nobody builds again: the collector unmounts and removes its dead builder's
    scratch directory (lock free), and leaves one whose build is running (lock held)."""
    store = ImageStore(tmp_path / "store", layer_format="erofs")
    dead, running = (store.root / "tmp" / f"{c * 64}.scratch" for c in "cd")
    for scratch in (dead, running):
        (scratch / "rootfs").mkdir(parents=True)
        tmpfs_mount(scratch / "rootfs", 1 << 20)
    with locked(store.root / "locks" / f"{'d' * 64}.lock"):
        await UnusedLayers(store, set, grace_s=0).collect(time.time(), dry_run=False)
        assert not dead.exists() and (running / "rootfs").is_dir()
    store.layers.sweep_scratch()
    assert os.listdir(store.root / "tmp") == []
    assert not [m for m in mountpoints() if m.is_relative_to(store.root)]


@pytest.mark.parametrize("case", ["two-members", "trailing-garbage", "truncated", "zstd"])
def test_gzip_streams_as_python_reads_them(case: str, tmp_path: Path) -> None:
    """The streamed gunzip (ISA-L) takes what Python's gzip module takes: several members in a
    row; a stream with garbage after its end or cut short is corrupt (DigestMismatch), zstd is
    NotSupported."""
    tar = _layer_tar([("a.txt", b"a" * 100_000, 0o644), ("b.txt", b"b\n", 0o644)])
    diff_id = "sha256:" + hashlib.sha256(tar).hexdigest()
    blob = {"two-members": gzip.compress(tar[:70_000]) + gzip.compress(tar[70_000:]),
            "trailing-garbage": gzip.compress(tar) + b"garbage!",
            "truncated": gzip.compress(tar)[:-9],
            "zstd": b"\x28\xb5\x2f\xfd" + tar}[case]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    if case == "two-members":
        extract_layer(io.BytesIO(blob), diff_id, scratch)
        assert (scratch / "rootfs" / "a.txt").read_bytes() == b"a" * 100_000
        return
    with pytest.raises(NotSupported if case == "zstd" else DigestMismatch):
        extract_layer(io.BytesIO(blob), diff_id, scratch)


@pytest.mark.parametrize("kind", ["basic", "token"])
def test_auth_right_and_wrong(kind: str, tmp_path: Path, auth_registry: Registry,
                              token_registry: tuple[Registry, type[_TokenRealm]], store: ImageStore,
                              no_credentials: Path) -> None:
    registry = auth_registry if kind == "basic" else token_registry[0]
    registry.push(_archive(tmp_path, "p", _busybox_layers()), "tests/private:1")
    ref = f"{registry.host}/tests/private:1"
    with pytest.raises(RegistryDenied, match="needs credentials"):
        store.pull(ref)
    wrong = base64.b64encode(f"{USER}:wrong".encode()).decode()
    no_credentials.write_text(json.dumps({"auths": {registry.host: {"auth": wrong}}}))
    with pytest.raises(RegistryDenied, match="refused"):
        store.pull(ref)
    assert _leftovers(store) == ([], [])
    right = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    no_credentials.write_text(json.dumps({"auths": {registry.host: {"auth": right}}}))
    issued = token_registry[1].tokens_issued
    assert store.pull(ref).name == ref
    if kind == "token":  # one token, reused for the manifest, the config and every layer
        assert token_registry[1].tokens_issued == issued + 1


def test_credentials_never_go_to_a_plain_http_realm_elsewhere(
        tmp_path: Path, store: ImageStore, no_credentials: Path) -> None:
    """A registry (on 127.0.0.1) whose challenge names a token realm on another host over plain
    HTTP (127.0.0.2, loopback too): the realm is asked anonymously, never with the credentials."""
    realm, handler = _token_realm(tmp_path, address="127.0.0.2")
    proc, registry = _start_registry(tmp_path, auth=f"token http://127.0.0.2:{realm.server_address[1]}/token")
    try:
        right = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        no_credentials.write_text(json.dumps({"auths": {registry.host: {"auth": right}}}))
        with pytest.raises(RegistryDenied, match="none it sends to http://127.0.0.2"):
            store.pull(f"{registry.host}/tests/anything:1")
        assert handler.authorizations == [None]
    finally:
        proc.terminate()
        proc.wait()
        realm.shutdown()


# --- hostile layers served by the registry -------------------------------------------------


def _raw_tar(members: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info in members:
            payload = (data or {}).get(info.name)
            if payload is not None:
                info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload) if payload is not None else None)
    return buffer.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


HOSTILE = {
    "dotdot": _raw_tar([_member("../../escaped-dotdot")], {"../../escaped-dotdot": b"x"}),
    "symlink-out-then-write": _raw_tar(
        [_member("out", tarfile.SYMTYPE, "/tmp"), _member("out/escaped-symlink")],
        {"out/escaped-symlink": b"x"}),
    "relative-symlink-out": _raw_tar(
        [_member("up", tarfile.SYMTYPE, "../../../.."), _member("up/escaped-relative")],
        {"up/escaped-relative": b"x"}),
    "hardlink-out": _raw_tar([_member("passwd", tarfile.LNKTYPE, "/etc/passwd")]),
    "hardlink-dotdot": _raw_tar([_member("h", tarfile.LNKTYPE, "../../../etc/passwd")]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_layer_is_refused_and_writes_nothing_outside(
        case: str, tmp_path: Path, registry: Registry, store: ImageStore, no_credentials: Path) -> None:
    registry.push(_archive(tmp_path, case, [HOSTILE[case]]), f"tests/hostile-{case}:1")
    before = set(os.listdir("/tmp"))
    with pytest.raises(UnsafeArchive):
        store.pull(f"{registry.host}/tests/hostile-{case}:1")
    assert not any(name.startswith("escaped") for name in set(os.listdir("/tmp")) - before)
    assert not any(p.name.startswith("escaped") for p in store.root.rglob("*"))
    assert _leftovers(store) == ([], [])


def test_absolute_names_land_inside_and_devices_are_dropped(
        tmp_path: Path, registry: Registry, no_credentials: Path) -> None:
    store = ImageStore(tmp_path / "store", layer_format="dir")
    device = _member("dev/sda", tarfile.BLKTYPE)
    device.devmajor, device.devminor = 8, 0
    setuid = _member("bin/su", mode=0o4755)
    layer = _raw_tar([_member("/abs-file"), _member("dev", tarfile.DIRTYPE, mode=0o755), device,
                      _member("bin", tarfile.DIRTYPE, mode=0o755), setuid],
                     {"/abs-file": b"inside\n", "bin/su": b"#!/bin/sh\n"})
    registry.push(_archive(tmp_path, "abs", [layer]), "tests/abs:1")
    image = store.pull(f"{registry.host}/tests/abs:1")
    rootfs = image.layers[0].path
    assert (rootfs / "abs-file").read_bytes() == b"inside\n"
    assert not (rootfs / "dev/sda").exists() and not (rootfs / "dev/sda").is_symlink()
    assert (rootfs / "bin/su").stat().st_mode & 0o4000  # kept: sandboxes run with no_new_privs


def test_decompression_bomb_and_sparse_giant_are_refused(
        tmp_path: Path, registry: Registry, store: ImageStore, no_credentials: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_IMAGE_LAYER_MAX_MB", "1")
    bomb = gzip.compress(_raw_tar([_member("zeros")], {"zeros": bytes(4 << 20)}))
    assert len(bomb) < 64 << 10
    registry.push(_archive(tmp_path, "bomb", [bomb]), "tests/bomb:1")
    with pytest.raises(UnsafeArchive, match="more than 1 MiB"):
        store.pull(f"{registry.host}/tests/bomb:1")
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(64 << 20)
    sparse_tar = subprocess.run(["tar", "-c", "--sparse", "-C", str(tmp_path), "-f", "-", "sparse"],
                                check=True, capture_output=True).stdout
    assert len(sparse_tar) < 1 << 20  # the tar is small, its file is 64 MiB
    registry.push(_archive(tmp_path, "sparse", [sparse_tar]), "tests/sparse:1")
    with pytest.raises(UnsafeArchive, match="add up to more than 1 MiB"):
        store.pull(f"{registry.host}/tests/sparse:1")
    assert _leftovers(store) == ([], [])


def test_too_many_layers_and_a_giant_config_are_refused(
        tmp_path: Path, registry: Registry, store: ImageStore, no_credentials: Path) -> None:
    tiny = _layer_tar([("f", b"", 0o644)])
    registry.push(_archive(tmp_path, "many", [tiny] * 129), "tests/many:1")
    with pytest.raises(dsec.RegistryError, match="at most 128 layers"):
        store.pull(f"{registry.host}/tests/many:1")
    config = json.loads(_config([tiny]))
    config["padding"] = "x" * (5 << 20)
    registry.put_image("tests/giant:1", json.dumps(config).encode(), [tiny])
    with pytest.raises(dsec.RegistryError, match="over the limit"):
        store.pull(f"{registry.host}/tests/giant:1")
    assert _leftovers(store) == ([], [])


def test_unsupported_layers_and_oversized_indexes_are_refused(
        tmp_path: Path, registry: Registry, store: ImageStore, no_credentials: Path) -> None:
    tiny = _layer_tar([("f", b"", 0o644)])
    registry.put_image("tests/zstd:1", _config([tiny]), [tiny],
                       layer_type="application/vnd.oci.image.layer.v1.tar+zstd")
    with pytest.raises(dsec.NotSupported, match="tar\\+zstd"):
        store.pull(f"{registry.host}/tests/zstd:1")
    registry.put_image("tests/wide:one", _config([tiny]), [tiny])
    registry.put_index("tests/wide:1", {f"linux/arch{i}": "one" for i in range(300)})
    with pytest.raises(dsec.RegistryError, match="no usable manifests"):
        store.pull(f"{registry.host}/tests/wide:1")
    assert _leftovers(store) == ([], []) and os.listdir(store.root / "layers") == []


# --- create(image=REF) on a real server -----------------------------------------------------


@pytest.fixture
def registry_auth_env(tmp_path: Path) -> Iterator[None]:
    """DSEC_REGISTRY_AUTH of an empty credentials file, for a server started now (it inherits
    the variable) and no longer."""
    (tmp_path / "server-auth.json").write_text("{}")
    os.environ["DSEC_REGISTRY_AUTH"] = str(tmp_path / "server-auth.json")
    try:
        yield
    finally:
        del os.environ["DSEC_REGISTRY_AUTH"]


@pytest.fixture(scope="module")
def pull_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    auth = tmp_path_factory.mktemp("server-auth") / "auth.json"
    auth.write_text("{}")
    os.environ["DSEC_REGISTRY_AUTH"] = str(auth)  # the server inherits it
    server = make_server("--pull", "missing", "--warm-pool", "0",
                         "--image-store", str(tmp_path_factory.mktemp("pull-store"))).start()
    del os.environ["DSEC_REGISTRY_AUTH"]
    yield server
    stop_server(server)


async def test_concurrent_creates_of_a_new_image_pull_it_once(
        tmp_path: Path, registry: Registry, pull_server: Server) -> None:
    registry.push(_archive(tmp_path, "box", _busybox_layers()), "tests/create-box:1")
    ref = f"{registry.host}/tests/create-box:1"
    async with pull_server.client() as client:
        boxes = await asyncio.gather(*(client.create(image=ref, ttl_s=120) for _ in range(4)))
        try:
            result = await boxes[0].run("echo $GREETING; ls /etc /data")
            # the whiteout hides hidden.txt; the opaque /data hides old.txt
            assert result.stdout.split() == ["hi", "/data:", "new.txt", "/etc:", "keep.txt"]
        finally:
            await asyncio.gather(*(box.stop() for box in boxes))
    store = ImageStore(Path(pull_server.args[pull_server.args.index("--image-store") + 1]))
    sources = [json.loads(p.read_text())["source"] for p in (store.root / "layers").glob("*/layer.json")]
    assert len(sources) == 3  # each layer converted once: two image layers and /work
    assert [i.name for i in store.list()] == [ref]


async def test_pull_never_is_a_typed_image_not_found(tmp_path: Path, registry: Registry,
                                                     client: dsec.DSecClient) -> None:
    registry.push(_archive(tmp_path, "never", _busybox_layers()), "tests/never:1")
    with pytest.raises(dsec.ImageNotFound, match="--pull missing"):
        await client.create(image=f"{registry.host}/tests/never:1", ttl_s=60)


async def test_create_pulls_under_ray(tmp_path: Path, registry: Registry, local_postgres: Any,
                                      registry_auth_env: None) -> None:
    """The same create on an edge that is a Ray actor: the settings (--pull, the credentials
    file) reach it, and it pulls into the store it was given."""
    pytest.importorskip("ray", reason="needs the cluster extra (Ray)")
    from dsec.cluster.local import TOLERANT_HEALTH_CHECKS, LocalRayCluster
    registry.push(_archive(tmp_path, "ray", _busybox_layers()), "tests/ray-box:1")
    ref = f"{registry.host}/tests/ray-box:1"
    state = TEST_ROOT / f"pull-{secrets.token_hex(3)}"
    state.mkdir(parents=True)
    cluster = LocalRayCluster(state, [4], TOLERANT_HEALTH_CHECKS).start()
    store = tmp_path / "ray-store"
    try:
        server = Server(state, ["--host", "127.0.0.1", "--port", str(free_port()),
                                "--ray", cluster.address, "--warm-pool", "0", "--pull", "missing",
                                "--image-store", str(store), "--state-url",
                                local_postgres.fresh_database("pull_" + secrets.token_hex(3))]).start()
        try:
            async with server.client() as client, await client.create(image=ref, ttl_s=120) as sb:
                assert (await sb.run("cat /etc/keep.txt")).stdout == "kept\n"
        finally:
            server.kill(signal.SIGTERM)
    finally:
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)
    assert [image.name for image in ImageStore(store).list()] == [ref]
