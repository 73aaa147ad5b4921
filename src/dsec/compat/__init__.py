"""Drop-in compatibility with other sandbox APIs, served by the dsec server itself:

- ``/e2b``: E2B's control plane and envd data plane (the ``e2b`` SDK, sync and async);
- ``/sandboxfusion``: SandboxFusion's ``/run_code`` and ``/v1/ping`` (the ``sandbox-fusion``
  client, verl's reward functions).

Both call the router and edges through their public methods only. See docs/COMPAT.md.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from ..api.routing import Router
from ..store.sqlite import StateStore
from .auth import Keys
from .e2b import create_e2b_app
from .sandboxfusion import create_sandboxfusion_app

E2B_PREFIX = "/e2b"
SANDBOXFUSION_PREFIX = "/sandboxfusion"


def mount_compat(app: FastAPI, router: Router, store: StateStore, state_dir: Path) -> FastAPI:
    keys = Keys(store, state_dir, router.access.enter if router.access is not None else None)
    app.mount(E2B_PREFIX, create_e2b_app(router, keys))
    app.mount(SANDBOXFUSION_PREFIX, create_sandboxfusion_app(router, keys))
    return app


__all__ = ["mount_compat", "E2B_PREFIX", "SANDBOXFUSION_PREFIX"]
