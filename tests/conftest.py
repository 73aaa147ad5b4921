"""Fixtures that start real dsec servers (``python -m dsec serve``) on private state dirs."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import pytest

import dsec
from dsec.images.store import ImageStore
from dsec.store.local_postgres import LocalPostgres

TEST_ROOT = Path("/run/dsec-test")
LOG_DIR = Path("/tmp/dsec-test-logs")  # server logs outlive the state dirs, for post-mortems


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
                                base_url="http://dsec", headers=headers)
        return httpx.Client(base_url=self.url, headers=headers)

    @property
    def key(self) -> str:
        return (self.state_dir / "local.key").read_text().strip()

    def start(self) -> Server:
        LOG_DIR.mkdir(exist_ok=True)
        log = open(LOG_DIR / f"{self.state_dir.name}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsec", "serve", "--state-dir", str(self.state_dir), *self.args],
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
    shutil.rmtree(server.state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def server(images: ImageStore) -> Iterator[Server]:
    srv = make_server("--capacity", "64").start()
    yield srv
    stop_server(srv)


@pytest.fixture
async def client(server: Server) -> AsyncIterator[dsec.DSecClient]:
    async with server.client() as c:
        yield c


async def _sandbox(client: dsec.DSecClient, image: str, memory_mb: int) -> AsyncIterator[dsec.AsyncSandbox]:
    sb = await client.create(image=image, memory_mb=memory_mb, ttl_s=300)
    yield sb
    try:
        await sb.stop()
    except dsec.DSecError:  # the test stopped it, or it died on purpose
        pass


@pytest.fixture
async def sandbox(client: dsec.DSecClient) -> AsyncIterator[dsec.AsyncSandbox]:
    async for sb in _sandbox(client, "debian-minbase", 256):
        yield sb


@pytest.fixture
async def py_sandbox(client: dsec.DSecClient) -> AsyncIterator[dsec.AsyncSandbox]:
    async for sb in _sandbox(client, "python-3.11", 512):
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
