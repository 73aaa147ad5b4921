"""Running a dsec server: its control plane composed from the settings by one of the two
composition roots (``control.compose.embedded``: an edge in this process;
``cluster.compose.cluster``: the edges of a Ray cluster), the HTTP app over it, served by
uvicorn on a Unix socket or TCP. Above every layer but the command line: it is where they
are put together."""

from __future__ import annotations

import logging
import os
from typing import Any

import uvicorn
from fastapi import FastAPI

from .api.app import create_app
from .api.logs import configure as configure_logging
from .compat import mount_compat
from .config import Settings, install
from .control.compose import embedded
from .control.plane import ControlPlane
from .control.port_ws import MESSAGE_MAX
from .store.sqlite import StateStore

# Seconds the server keeps an idle HTTP connection open: well above the SDK's 5 s idle
# expiry (client/transport.py's IDLE_S), so the client always drops an idle connection
# first. With both at 5 s (uvicorn's default), a client reusing a connection just as the server's timer closed it got a
# ReadError (ServerUnavailable): 19 calls of a 3,000-sandbox density run on a loaded node.
KEEP_ALIVE_S = 75


def local_key(settings: Settings, store: StateStore) -> str:
    """The key for clients on this host, kept root-only in the state directory: what lets
    ``DSecClient()`` work with no configuration, the way a local Docker socket does."""
    path = settings.local_key_path
    if path.exists():
        secret = path.read_text().strip()
        if store.key_for_secret(secret):
            return secret
    _, secret, _ = store.create_key("local")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def compose(settings: Settings) -> ControlPlane:
    """The control plane: over a Ray cluster's edges with ``ray_address``, else embedded."""
    if settings.ray_address is None:
        return embedded(settings)
    from .cluster.compose import cluster  # Ray is imported only in cluster mode
    return cluster(settings)


def build_app(settings: Settings) -> FastAPI:
    install(settings)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    control = compose(settings)
    local_key(settings, control.store)
    return mount_compat(create_app(control), control)


def serve(settings: Settings) -> None:
    configure_logging(settings.log_format)
    app = build_app(settings)
    host, port = settings.host, settings.port
    where = f"http://{host}:{port}" if host else f"unix://{settings.socket_path}"
    logging.getLogger("dsec.server").info("dsec serving on %s", where,
                                          extra={"state_dir": str(settings.state_dir)})
    # uvicorn's own handlers for text; for JSON its loggers go through the root handler
    logging_config: dict[str, Any] = {} if settings.log_format == "text" else {"log_config": None}
    if host is None:
        settings.socket_path.unlink(missing_ok=True)
        where_args: dict[str, Any] = {"uds": str(settings.socket_path)}
    else:
        where_args = {"host": host, "port": port}
    # WebSocket (sandbox ports, control/port_ws.py) by wsproto, the pinned one, whatever else
    # is installed beside it (uvicorn's "auto" would take the websockets package if present)
    uv = uvicorn.Config(app, **where_args, ws="wsproto", ws_max_size=MESSAGE_MAX, log_level="warning",
                        timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S,
                        **logging_config)
    uvicorn.Server(uv).run()
