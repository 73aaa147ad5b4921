"""Assembling and running a single-node dsec server: state store, image store, one edge with
its substrates, the router and the HTTP app, served by uvicorn on a Unix socket or TCP."""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from ..compat import mount_compat
from ..edge.edge import Edge, EdgeConfig
from ..edge.metrics import EdgeMetrics
from ..images.store import ImageStore
from ..store.blobs import BlobStore
from ..store.sqlite import StateStore
from ..substrates.registry import VM_SUBSTRATES, all_substrates
from ..trajectory.log import TrajectoryLog
from .app import create_app
from .logs import configure as configure_logging
from .routing import Router

DEFAULT_STATE_DIR = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"))


@dataclass
class ServerConfig:
    state_dir: Path = DEFAULT_STATE_DIR
    edge_id: str = ""
    capacity: int = 256
    warm_pool: int = 2
    runtime: str = "crun"
    image_store: Path | None = None
    log_format: str = "text"  # or "json": one JSON object per line (see api/logs.py)
    network_services: Path | None = None  # default: <state_dir>/network-services.toml
    vm_accel: str = "kvm"  # or "tcg": emulated VMs where KVM is missing or unusable
    kvm_device: Path = Path("/dev/kvm")
    vm_warm_pool: int = 0  # booted VMs kept per image (each holds its guest's memory)
    vm_snapshots: bool = False  # restore saved booted VMs instead of booting (opt-in)
    state_url: str | None = None  # postgresql://... when scaled out; default SQLite in state_dir
    ray_address: str | None = None  # scale out over this Ray cluster (see dsec.cluster)

    @property
    def socket_path(self) -> Path:
        return self.state_dir / "api.sock"

    @property
    def local_key_path(self) -> Path:
        return self.state_dir / "local.key"


def local_key(config: ServerConfig, store: StateStore) -> str:
    """The key for clients on this host, kept root-only in the state directory: what lets
    ``DSecClient()`` work with no configuration, the way a local Docker socket does."""
    path = config.local_key_path
    if path.exists():
        secret = path.read_text().strip()
        if store.key_for_secret(secret):
            return secret
    _, secret, _ = store.create_key("local")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def build_app(config: ServerConfig) -> FastAPI:
    config.state_dir.mkdir(parents=True, exist_ok=True)
    store = StateStore(config.state_url or config.state_dir / "state.db")
    local_key(config, store)
    if config.ray_address is not None:
        from ..cluster.router import cluster_app
        return cluster_app(config, store)
    edge_config = EdgeConfig(state_dir=config.state_dir, edge_id=config.edge_id,
                             capacity=config.capacity, warm_pool=config.warm_pool,
                             network_services=config.network_services)
    substrates = all_substrates(config.state_dir, edge_config.edge_id, config.runtime,
                                config.vm_accel, config.kvm_device, config.vm_snapshots)
    registry = CollectorRegistry()
    edge = Edge(edge_config, store, ImageStore(config.image_store), substrates,
                EdgeMetrics(registry))
    for vm in VM_SUBSTRATES:
        edge.pools[vm.name].size = config.vm_warm_pool
    trajectories = TrajectoryLog(store.url, BlobStore(config.state_dir / "blobs"),
                                 owner=secrets.token_hex(8))
    router = Router([edge], trajectories)
    return mount_compat(create_app(router, store, registry), router, store, config.state_dir)


def serve(config: ServerConfig, host: str | None = None, port: int | None = None) -> None:
    configure_logging(config.log_format)
    app = build_app(config)
    where = f"http://{host}:{port or 8080}" if host else f"unix://{config.socket_path}"
    logging.getLogger("dsec.server").info("dsec serving on %s", where,
                                          extra={"state_dir": str(config.state_dir)})
    # uvicorn's own handlers for text; for JSON its loggers go through the root handler
    logging_config: dict[str, Any] = {} if config.log_format == "text" else {"log_config": None}
    if host is None:
        config.socket_path.unlink(missing_ok=True)
        uv = uvicorn.Config(app, uds=str(config.socket_path), log_level="warning",
                            timeout_graceful_shutdown=5, **logging_config)
    else:
        uv = uvicorn.Config(app, host=host, port=port or 8080, log_level="warning",
                            timeout_graceful_shutdown=5, **logging_config)
    uvicorn.Server(uv).run()
