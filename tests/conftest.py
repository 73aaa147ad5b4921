"""Fixtures that start real dsec servers (``python -m dsec serve``) on private state dirs."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dsec
from dsec.images.mount import LayerMounter
from dsec.images.store import ImageStore
from dsec.network.testbed import Destination, make_destination
from dsec.store.local_postgres import LocalPostgres
from dsec.substrates.host.volume import VOLUME_DIR

TEST_ROOT = Path("/run/dsec-test")
SUBSTRATES = ["container", "fn", "microvm", "vm"]
# fn runs the image's own Python as its template: it needs an image that has python3.
NEEDS_PYTHON = {"fn"}
VM_SUBSTRATES = ("microvm", "vm")
# VMs under test are emulated (TCG) unless told otherwise: this host's KVM cannot run them.
VM_ACCEL = os.environ.get("DSEC_TEST_VM_ACCEL", "tcg")
LOG_DIR = Path("/tmp/dsec-test-logs")  # server logs outlive the state dirs, for post-mortems
HTTP_TIMEOUT_S = 120  # a loaded host (shared CPUs) can keep a server busy well beyond httpx's 5 s
# Test servers share the images cache (/var/cache/dsec/images) with every other test and CI,
# each with its own state store, so none knows the others' snapshots: none collects the
# cache's layers (tests of layer collection give their server a private image store).
os.environ.setdefault("DSEC_LAYER_GRACE_S", str(100 * 365 * 86400))


@pytest.fixture(scope="session")
def images() -> ImageStore:
    """The images the sandbox tests use, built once into the shared cache."""
    store = ImageStore()
    store.ensure("debian-minbase")
    store.ensure("python-3.11")
    return store


@dataclass
class Server:
    state_dir: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    launcher: list[str] = field(default_factory=list)  # runs the server (prlimit, setpriv...)

    @property
    def url(self) -> str:
        if "--port" in self.args:
            return f"http://{self.args[self.args.index('--host') + 1]}:{self.args[self.args.index('--port') + 1]}"
        return f"unix://{self.state_dir / 'api.sock'}"

    def http(self, authenticated: bool = False) -> httpx.Client:
        """A raw HTTP client for the server, for what the SDK does not do."""
        headers = {"authorization": f"Bearer {self.key}"} if authenticated else {}
        if self.url.startswith("unix://"):
            return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.state_dir / "api.sock")),
                                base_url="http://dsec", headers=headers, timeout=HTTP_TIMEOUT_S)
        return httpx.Client(base_url=self.url, headers=headers, timeout=HTTP_TIMEOUT_S)

    @property
    def volume(self) -> Path:
        """Its disk volume (``--disk-volume auto``): sandboxes/, snapshots/ and disks/."""
        return self.state_dir / VOLUME_DIR

    @property
    def key(self) -> str:
        return (self.state_dir / "local.key").read_text().strip()

    def start(self) -> Server:
        LOG_DIR.mkdir(exist_ok=True)
        log = open(LOG_DIR / f"{self.state_dir.name}.log", "ab")
        self.proc = subprocess.Popen(
            [*self.launcher, sys.executable, "-m", "dsec", "serve", "--state-dir",
             str(self.state_dir), *self.args],
            stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 120
        with self.http() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited: {(LOG_DIR / f'{self.state_dir.name}.log').read_text()}")
                try:
                    if http.get("/v1/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    time.sleep(0.05)
        raise RuntimeError("server did not become healthy")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)
        self.proc.wait()

    def client(self, **kwargs: object) -> dsec.DSecClient:
        return dsec.DSecClient(self.url, self.key, autostart=False, **kwargs)  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tcp_server(*args: str) -> Server:
    """A server on a free loopback port, the way a remote client reaches one."""
    return make_server("--host", "127.0.0.1", "--port", str(free_port()), *args)


def make_server(*args: str) -> Server:
    state = TEST_ROOT / secrets.token_hex(3)
    state.mkdir(parents=True)
    return Server(state, list(args))


def stop_server(server: Server) -> None:
    """Stop the server, then remove every sandbox it left, the way a fresh edge would."""
    if server.proc and server.proc.poll() is None:
        server.kill(signal.SIGTERM)
    cleanup = Server(server.state_dir, server.args).start()
    with cleanup.http(authenticated=True) as http:
        for sb in http.get("/v1/sandboxes").json():
            http.delete(f"/v1/sandboxes/{sb['id']}")
    cleanup.kill(signal.SIGTERM)
    LayerMounter(server.state_dir / "layers").unmount_all()  # the server's layer mounts
    shutil.rmtree(server.state_dir, ignore_errors=True)


def own_server(*args: str) -> tuple[Any, Any]:
    """A test module's own server, ``make_server(*args)``, and a client of it, as the fixtures
    ``srv`` and ``client``: ``srv, client = own_server(...)`` at the module's top level, for
    tests that kill, restart or fill their server."""

    @pytest.fixture(scope="module")
    def srv(images: ImageStore) -> Iterator[Server]:
        server = make_server(*args).start()
        yield server
        stop_server(server)

    @pytest.fixture
    async def client(srv: Server) -> AsyncIterator[dsec.DSecClient]:
        async with srv.client() as c:
            yield c

    return srv, client


@pytest.fixture
def name(images: ImageStore) -> Iterator[str]:
    """A fresh name for an image a test builds; every image named so is removed after it
    (a project key's too: ``p.<project>.<name>``)."""
    image = f"test-build-{secrets.token_hex(4)}"
    yield image
    for stored in [i.name for i in ImageStore().list() if i.name.endswith(image)]:
        ImageStore().remove(stored)


@pytest.fixture(scope="session")
def server(images: ImageStore) -> Iterator[Server]:
    srv = make_server("--capacity", "64", "--vm-accel", VM_ACCEL).start()
    yield srv
    stop_server(srv)


@pytest.fixture
async def client(server: Server) -> AsyncIterator[dsec.DSecClient]:
    async with server.client() as c:
        yield c


def image_for(substrate: str, image: str = "debian-minbase") -> str:
    """The image a test asks for, or the smallest one the substrate can run."""
    return "python-3.11" if substrate in NEEDS_PYTHON and image == "debian-minbase" else image


async def _sandbox(client: dsec.DSecClient, image: str, memory_mb: int,
                   substrate: str = "container") -> AsyncIterator[dsec.AsyncSandbox]:
    sb = await client.create(substrate=substrate, image=image_for(substrate, image),
                             memory_mb=memory_mb, ttl_s=300)
    yield sb
    try:
        await sb.stop()
    except dsec.DSecError:  # the test stopped it, or it died on purpose
        pass


def scrape(server: Server) -> dict[str, float]:
    """The server's Prometheus samples as a scraper reads them, by ``name{label=value,...}``
    (labels sorted, the edge's left out)."""
    with server.http(authenticated=True) as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "edge")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


async def warm_count(client: dsec.DSecClient, substrate: str, image: str = "debian-minbase") -> int:
    """Pooled sandboxes of ``image`` ready on the server's (first) edge."""
    return (await client.health())["edges"][0]["warm"][substrate].get(image, 0)


async def pool_filled(client: dsec.DSecClient, substrate: str, image: str = "debian-minbase",
                      timeout_s: float = 120) -> None:
    """Wait until the warm pool holds a sandbox of ``image`` (start it with one create)."""
    deadline = time.monotonic() + timeout_s
    while not await warm_count(client, substrate, image):
        if time.monotonic() > deadline:
            pytest.fail(f"the {substrate} warm pool of {image} did not fill in {timeout_s:.0f}s")
        await asyncio.sleep(0.1)


DEST_PORTS = (8001, 8002)


def _destination() -> Iterator[Destination]:
    """A test-made network namespace serving DEST_PORTS (network policy tests)."""
    d = make_destination(DEST_PORTS)
    yield d
    d.remove()


dest = pytest.fixture(scope="module", name="dest")(_destination)
other = pytest.fixture(scope="module", name="other")(_destination)  # a second one, apart


def skip_on_vms(substrate: str, why: str) -> None:
    """For a test of what a host kernel enforces per sandbox (cgroups, namespaces): a VM's
    processes live in its guest kernel, and test_vm.py tests the VM's own version."""
    if substrate in VM_SUBSTRATES:
        pytest.skip(f"{substrate}: {why}")


@pytest.fixture(scope="session", params=SUBSTRATES)
def substrate(request: pytest.FixtureRequest) -> str:
    """Each test that takes it runs once per substrate (session-scoped, so that pytest runs
    a substrate's tests together and the shared VMs below are reused)."""
    return request.param


class SharedVMs:
    """One VM sandbox per (substrate, image), reused by the tests that allow it: a VM boot
    under emulation takes seconds. A test that ends one gets a new one next time."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], str] = {}

    async def get(self, client: dsec.DSecClient, substrate: str, image: str,
                  memory_mb: int) -> dsec.AsyncSandbox:
        sandbox_id = self._ids.get((substrate, image))
        if sandbox_id is not None:
            try:
                sb = await client.get(sandbox_id)
                if sb.info.state == "running":
                    return sb
            except dsec.DSecError:
                pass
        sb = await client.create(substrate=substrate, image=image, memory_mb=memory_mb, ttl_s=3600)
        self._ids[(substrate, image)] = sb.id
        return sb


@pytest.fixture(scope="session")
def shared_vms() -> SharedVMs:
    return SharedVMs()


async def _any_sandbox(client: dsec.DSecClient, substrate: str, shared_vms: SharedVMs,
                       image: str, memory_mb: int) -> AsyncIterator[dsec.AsyncSandbox]:
    if substrate in VM_SUBSTRATES:
        yield await shared_vms.get(client, substrate, image, memory_mb)
    else:
        async for sb in _sandbox(client, image, memory_mb, substrate):
            yield sb


@pytest.fixture
async def sandbox(client: dsec.DSecClient, substrate: str,
                  shared_vms: SharedVMs) -> AsyncIterator[dsec.AsyncSandbox]:
    async for sb in _any_sandbox(client, substrate, shared_vms, "debian-minbase", 256):
        yield sb


@pytest.fixture
async def py_sandbox(client: dsec.DSecClient, substrate: str,
                     shared_vms: SharedVMs) -> AsyncIterator[dsec.AsyncSandbox]:
    async for sb in _any_sandbox(client, substrate, shared_vms, "python-3.11", 512):
        yield sb


@pytest.fixture(scope="session")
def local_postgres() -> Iterator[LocalPostgres]:
    """A throwaway PostgreSQL cluster (the apt package) for the whole session."""
    pg = LocalPostgres().start()
    yield pg
    pg.stop()


@pytest.fixture(scope="session")
def postgres_url(local_postgres: LocalPostgres) -> str:
    """An empty PostgreSQL database for the session's state."""
    return local_postgres.fresh_database("dsec_" + secrets.token_hex(4))
