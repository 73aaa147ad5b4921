"""The web dashboard: one static page (``/dashboard``, vanilla JS, no build step, nothing
fetched from elsewhere) that polls ``/v1/dashboard`` with the key the user gives it.

The page holds no data itself; ``/v1/dashboard`` needs a key and shows what that key may see:
an admin key everything, a project key its own sandboxes, its project's subtree and its
project's failures (the create-latency histogram is server-wide for both).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, params
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CollectorRegistry

from ..control.projects import Projects
from ..control.routing import Router

STATIC = Path(__file__).parent / "static"
SHOWN_FAILURES = 20


def dashboard_routes(router: Router, projects: Projects, registry: CollectorRegistry,
                     auth: list[params.Depends]) -> APIRouter:
    api = APIRouter()

    @api.get("/dashboard", include_in_schema=False, response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse((STATIC / "dashboard.html").read_text())

    @api.get("/dashboard.js", include_in_schema=False, response_class=Response)
    async def script() -> Response:
        return Response((STATIC / "dashboard.js").read_text(), media_type="text/javascript")

    @api.get("/v1/dashboard", dependencies=auth)
    async def data() -> dict[str, Any]:
        """What the dashboard shows: live sandboxes per node and substrate, the create-latency
        histogram, recent failures and per-project usage, as the key may see them."""
        visible = router.list_visible()
        nodes = []
        for edge in router.describe():  # the edges of this process, or of the Ray cluster
            counts = {name: 0 for name in edge["substrates"]}
            for info in visible:
                if info.edge == edge["id"]:
                    counts[info.substrate] = counts.get(info.substrate, 0) + 1
            nodes.append({"edge": edge["id"], "capacity": edge["capacity"],
                          "substrates": counts, "live": sum(counts.values())})
        return {"generated_at": time.time(), "project": projects.caller(),
                "live_total": len(visible), "nodes": nodes,
                "create_latency": create_latency(registry),
                "failures": projects.recent_failures()[:SHOWN_FAILURES],
                "projects": [p.model_dump() for p in projects.list()]}

    return api


def create_latency(registry: CollectorRegistry) -> dict[str, Any]:
    """``dsec_create_seconds`` summed over substrates and sources, as per-bucket counts."""
    cumulative: dict[float, float] = {}
    count = total = 0.0
    for family in registry.collect():
        if family.name != "dsec_create_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                cumulative[le] = cumulative.get(le, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    buckets, below = [], 0.0
    for le in sorted(cumulative):
        buckets.append({"le": None if le == float("inf") else le, "count": int(cumulative[le] - below)})
        below = cumulative[le]
    return {"buckets": buckets, "count": int(count), "sum_s": total}
