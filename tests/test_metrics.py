"""Prometheus metrics as an operator's scraper sees them, from a real server."""

from __future__ import annotations

import asyncio

import pytest

import dsec
from conftest import make_server, scrape, stop_server


async def test_metrics_count_what_happened(images) -> None:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "2", "--warm-pool", "0").start()
    try:
        with srv.http() as http:
            assert http.get("/metrics").status_code == 401  # scraping needs a key too
        async with srv.client() as client:
            sb = await client.create(ttl_s=1)
            await sb.run("true")
            await sb.start("true")
            other = await client.create(ttl_s=60)
            with pytest.raises(dsec.CapacityExhausted):
                await client.create()
            m = scrape(srv)
            assert m["dsec_sandboxes{substrate=container}"] == 2
            assert m["dsec_capacity{}"] == 2
            assert m["dsec_create_seconds_count{source=cold,substrate=container}"] == 2
            assert m["dsec_execs_total{substrate=container}"] == 2
            assert m["dsec_create_failures_total{code=capacity_exhausted,substrate=container}"] == 1
            await asyncio.sleep(2)  # the reaper expires the first one
            await other.stop()
            m = scrape(srv)
            assert m["dsec_sandboxes{substrate=container}"] == 0
            assert m["dsec_sandboxes_ended_total{state=expired,substrate=container}"] == 1
            assert m["dsec_sandboxes_ended_total{state=stopped,substrate=container}"] == 1
    finally:
        stop_server(srv)


async def test_metrics_show_projects_states_and_refusals(images) -> None:  # type: ignore[no-untyped-def]
    srv = make_server("--warm-pool", "0").start()
    try:
        async with srv.client() as admin:
            await admin.projects().create("team", sandboxes=1, cpu=2, memory_mb=512)
            key = (await admin.projects().create_key("team", "k")).key
            async with dsec.DSecClient(srv.url, key, autostart=False) as team:
                sb = await team.create(memory_mb=256, cpu=0.5)
                with pytest.raises(dsec.QuotaExceeded):
                    await team.create(memory_mb=256)
                with srv.http() as http:  # a project key may not scrape every project's usage
                    http.headers["authorization"] = f"Bearer {key}"
                    assert http.get("/metrics").status_code == 403
                m = scrape(srv)
                assert m["dsec_project_used{project=team,resource=sandboxes}"] == 1
                assert m["dsec_project_used{project=team,resource=cpu}"] == 0.5
                assert m["dsec_project_used{project=team,resource=memory_mb}"] == 256
                assert m["dsec_project_quota{project=team,resource=memory_mb}"] == 512
                assert m["dsec_project_delegated{project=default,resource=sandboxes}"] == 1
                assert m["dsec_refusals_total{project=team,reason=quota_sandboxes}"] == 1
                assert m["dsec_sandboxes_by_state{state=running,substrate=container}"] == 1
                assert m["dsec_sandboxes_by_state{state=starting,substrate=container}"] == 0
                await sb.stop()
                m = scrape(srv)
                assert m["dsec_project_used{project=team,resource=sandboxes}"] == 0
                assert m["dsec_sandboxes_by_state{state=running,substrate=container}"] == 0
    finally:
        stop_server(srv)
