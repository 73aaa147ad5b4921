"""Drop-in compatibility with other sandbox APIs, served by the dsec server itself:

- ``/e2b``: E2B's control plane and envd data plane (the ``e2b`` SDK, sync and async);
- ``/sandboxfusion``: SandboxFusion's ``/run_code`` and ``/v1/ping`` (the ``sandbox-fusion``
  client, verl's reward functions);
- ``/swerex/<sandbox id>``: SWE-ReX's remote runtime (swe-rex's ``RemoteRuntime``).

Each calls the router and edges through their public methods only. See docs/COMPAT.md.
"""

from __future__ import annotations

from fastapi import FastAPI

from ..control.plane import ControlPlane
from ..images.store import ImageStore
from ..protocol.build import allow_network
from ..protocol.project_models import ROOT_PROJECT
from ..store.templates import TemplateStore
from .auth import Keys
from .e2b import create_e2b_app, template_mapping
from .e2b_build import Uploads
from .e2b_ports import E2BPorts
from .e2b_templates import Templates
from .sandboxfusion import create_sandboxfusion_app
from .swerex import create_swerex_app

E2B_PREFIX = "/e2b"
SANDBOXFUSION_PREFIX = "/sandboxfusion"
SWEREX_PREFIX = "/swerex"


def mount_compat(app: FastAPI, control: ControlPlane) -> FastAPI:
    """The compatibility front-ends, over the same router (and so the same admission) as the
    native API."""
    keys = Keys(control.store, control.settings.state_dir, control.projects.enter)
    settings = control.settings
    templates = Templates(TemplateStore(control.store.url), ImageStore(settings.image_store),
                          template_mapping(settings.e2b_templates), settings.pull,
                          lambda: control.projects.caller() or ROOT_PROJECT,
                          control.router.build_image, Uploads(settings.state_dir / "e2b-uploads"),
                          allow_network(settings.e2b_build_allow.split(",")),
                          control.projects.caller)
    app.mount(E2B_PREFIX, E2BPorts(create_e2b_app(control.router, keys, templates),
                                   control.router, keys))
    app.mount(SANDBOXFUSION_PREFIX, create_sandboxfusion_app(control.router, keys,
                                                             control.settings.sandboxfusion_image))
    app.mount(SWEREX_PREFIX, create_swerex_app(control.router, keys))
    return app


__all__ = ["mount_compat", "E2B_PREFIX", "SANDBOXFUSION_PREFIX", "SWEREX_PREFIX"]
