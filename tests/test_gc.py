"""Retention and garbage collection on real servers: one collecting in the background with a
short retention (ended sandboxes, their events and blobs disappear; live sandboxes, attached
trajectories and their blobs stay; a sandbox's hostile output cannot steer it), one
collected by hand (``dsec gc --dry-run`` changes nothing, ``dsec gc`` removes, admin only)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

import dsec
from conftest import Server, make_server, own_server, scrape, stop_server
from dsec.images.store import ImageStore
from test_cli import dsec_cli

RETAIN_S = 3
srv, client = own_server("--warm-pool", "0", "--retain-ended-s", str(RETAIN_S), "--retain-failed-s",
                         str(RETAIN_S), "--gc-interval-s", "1", "--blob-grace-s", "2")
TRAJECTORY_TTL_S = 4
BIG = "head -c 12000 /dev/urandom | base64 -w0"  # above the log's 4 KiB: a blob


def new_id(prefix: str) -> str:
    return f"test/{prefix}-{secrets.token_hex(3)}"


def blob(server: Server, data: bytes) -> Path:
    digest = hashlib.sha256(data).hexdigest()
    return server.state_dir / "blobs" / "sha256" / digest[:2] / digest


def rows_naming(server: Server, table: str, sandbox_id: str) -> int:
    """Rows of ``table`` (events, idempotency_keys: the SDK gives every create a key) that name
    the sandbox."""
    db = sqlite3.connect(f"file:{server.state_dir / 'state.db'}?mode=ro", uri=True)
    try:
        return db.execute(f"SELECT COUNT(*) FROM {table} WHERE sandbox_id=?",
                          (sandbox_id,)).fetchone()[0]
    finally:
        db.close()


def events_of(server: Server, sandbox_id: str) -> int:
    return rows_naming(server, "events", sandbox_id)


def keys_of(server: Server, sandbox_id: str) -> int:
    return rows_naming(server, "idempotency_keys", sandbox_id)


async def gone(c: dsec.DSecClient, sandbox_id: str) -> bool:
    try:
        await c.get(sandbox_id)
    except dsec.SandboxNotFound:
        return True
    return False


async def until(condition, timeout_s: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "garbage collection did not come"
        await asyncio.sleep(0.5)


async def test_ended_records_events_and_blobs_go_the_rest_stays(srv: Server,
                                                                client: dsec.DSecClient) -> None:
    ended = await client.create(ttl_s=120)
    await ended.run("true")
    await ended.stop()
    assert events_of(srv, ended.id) > 0 and keys_of(srv, ended.id) == 1
    live = await client.create(ttl_s=600)

    kept_trajectory = new_id("kept")
    kept = await client.create(ttl_s=120, trajectory=kept_trajectory)
    kept_out = (await kept.run(BIG)).stdout_bytes
    await kept.stop()  # its record stays: the trajectory names it
    deleted_trajectory = new_id("deleted")
    doomed = await client.create(ttl_s=120, trajectory=deleted_trajectory)
    doomed_out = (await doomed.run(BIG)).stdout_bytes
    await client.delete_trajectory(deleted_trajectory)
    assert blob(srv, kept_out).exists() and blob(srv, doomed_out).exists()

    async def collected() -> bool:
        return (await gone(client, ended.id) and await gone(client, doomed.id)
                and not blob(srv, doomed_out).exists())
    await until(collected)
    assert events_of(srv, ended.id) == 0 and events_of(srv, doomed.id) == 0
    assert keys_of(srv, ended.id) == 0  # the key of a collected record goes with it

    await asyncio.sleep(RETAIN_S + 2)  # well past the retention: what stays, stays
    assert (await client.get(live.id)).info.state == "running"
    assert (await live.run("echo alive")).stdout == "alive\n"
    assert events_of(srv, live.id) > 0 and keys_of(srv, live.id) == 1
    assert (await client.get(kept.id)).info.state == "stopped"
    assert (await client.trajectory(kept_trajectory)).sandbox.id == kept.id
    assert blob(srv, kept_out).exists()
    lines = [line async for line in client.export_trajectory(kept_trajectory)]
    assert any(base64.b64encode(kept_out).decode() in json.dumps(line) for line in lines)
    m = scrape(srv)
    assert m["dsec_gc_removed_total{kind=sandboxes}"] >= 2
    assert m["dsec_gc_removed_total{kind=events}"] >= 2
    assert m["dsec_gc_removed_total{kind=blobs}"] >= 1
    assert m["dsec_gc_removed_total{kind=idempotency_keys}"] >= 1
    assert m["dsec_gc_removed_bytes_total{kind=blobs}"] >= len(doomed_out)
    assert not any(k.startswith("dsec_gc_failures_total{") and v for k, v in m.items())
    await live.stop()


async def test_a_sandbox_cannot_steer_the_collector(srv: Server, client: dsec.DSecClient) -> None:
    """An attached sandbox names another trajectory's blob in every way its output can
    (printed refs, file names of blob names and log syntax), fills a directory with odd
    names, and pauses over and over (events); the other trajectory's blob is still
    collected once deleted, its own stays, and no collection fails."""
    victim_trajectory = new_id("victim")
    victim = await client.create(ttl_s=120, trajectory=victim_trajectory)
    victim_out = (await victim.run(BIG)).stdout_bytes
    digest = hashlib.sha256(victim_out).hexdigest()

    hostile_trajectory = new_id("hostile")
    hostile = await client.create(ttl_s=300, trajectory=hostile_trajectory)
    forged = json.dumps({"bytes": {"stdout": {"size": len(victim_out), "sha256": digest}},
                         "payload": {"sha256": digest}, "sha256": digest})
    await hostile.write_file("/work/forged.json", forged * 200)  # a payload above 4 KiB
    own_out = (await hostile.run("cat /work/forged.json; " + BIG)).stdout_bytes
    names = [digest, f"..{digest}", ".gc." + digest, '"sha256"', "x" * 200]
    await hostile.run("mkdir -p /work/odd && cd /work/odd && : > \"$(printf 'a\\nb')\" && "
                      + " && ".join(f": > '{n}'" for n in names))
    names.append("a\nb")
    await hostile.list_files("/work/odd")
    for _ in range(5):
        await hostile.pause()
        await hostile.resume()
    await client.delete_trajectory(victim_trajectory)

    async def collected() -> bool:
        return not blob(srv, victim_out).exists()
    await until(collected)
    assert blob(srv, own_out).exists()
    assert (await hostile.run("ls -qA /work/odd | wc -l")).stdout.strip() == str(len(names))
    m = scrape(srv)
    assert not any(k.startswith("dsec_gc_failures_total{") and v for k, v in m.items())
    await client.delete_trajectory(hostile_trajectory)


async def test_a_snapshot_keeps_its_parents_record_until_its_ttl(srv: Server,
                                                                  client: dsec.DSecClient) -> None:
    """A snapshot needs its parent's record (a full one restores the parent's machine): the
    record outlives the retention while the snapshot lives, and goes after it expired."""
    parent = await client.create(ttl_s=120)
    snap = await parent.snapshot(ttl_s=RETAIN_S + 4)
    await parent.stop()
    await asyncio.sleep(RETAIN_S + 2)
    assert (await client.get(parent.id)).info.state == "stopped"

    async def collected() -> bool:
        return await gone(client, parent.id)
    await until(collected)
    assert snap.id not in [s.id for s in await client.snapshots()]
    assert scrape(srv)["dsec_snapshots_expired_total{}"] >= 1


@pytest.fixture(scope="module")
def manual(images: ImageStore) -> Iterator[Server]:
    """Retention of a second, collection only when asked (the background waits an hour)."""
    server = make_server("--warm-pool", "0", "--retain-ended-s", "1", "--gc-interval-s", "3600",
                         "--blob-grace-s", "1", "--trajectory-ttl-s", str(TRAJECTORY_TTL_S)).start()
    yield server
    stop_server(server)


async def test_dry_run_changes_nothing_then_gc_removes(manual: Server) -> None:
    async with manual.client() as c:
        sb = await c.create(ttl_s=120)
        await sb.stop()
        await asyncio.sleep(1.5)
        dry = json.loads(dsec_cli(manual, "gc", "--dry-run", "--json").stdout)
        assert dry["dry_run"] is True
        would = {r["kind"]: r["count"] for r in dry["removed"]}
        assert would["sandboxes"] == 1 and would["events"] >= 2
        assert dsec_cli(manual, "gc", "--dry-run", "--json").stdout.strip() == json.dumps(
            dry, separators=(",", ":"))  # nothing changed: the same report again
        assert (await c.get(sb.id)).info.state == "stopped" and events_of(manual, sb.id) > 0
        assert not any(k.startswith("dsec_gc_removed_total{") and v
                       for k, v in scrape(manual).items())

        table = dsec_cli(manual, "gc").stdout
        assert "sandboxes" in table and "removed" in table
        assert await gone(c, sb.id) and events_of(manual, sb.id) == 0
        assert scrape(manual)["dsec_gc_removed_total{kind=sandboxes}"] == 1
        again = (await c.gc()).removed
        assert {r.kind: r.count for r in again}["sandboxes"] == 0


async def test_gc_needs_an_admin_key(manual: Server) -> None:
    async with manual.client() as admin:
        team = "gc" + secrets.token_hex(3)
        await admin.projects().create(team, sandboxes=1, cpu=1, memory_mb=256)
        key = (await admin.projects().create_key(team, "member")).key
    async with dsec.DSecClient(manual.url, key, autostart=False) as member:
        with pytest.raises(dsec.Forbidden):
            await member.gc(dry_run=True)
    with manual.http() as http:
        assert http.post("/v1/admin/gc").status_code == 401
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(manual.state_dir / "api.sock")),
                      base_url="http://dsec", headers={"authorization": f"Bearer {key}"}) as http:
        assert http.post("/v1/admin/gc", params={"dry_run": "false"}).status_code == 403


async def test_a_trajectory_past_its_ttl_is_deleted_with_its_sandbox(manual: Server) -> None:
    async with manual.client() as c:
        trajectory = new_id("ttl")
        sb = await c.create(ttl_s=300, trajectory=trajectory)
        out = (await sb.run(BIG)).stdout_bytes
        young = {r.kind: r.count for r in (await c.gc(dry_run=True)).removed}
        assert young["trajectories"] == 0
        await asyncio.sleep(TRAJECTORY_TTL_S + 0.5)
        assert {r.kind: r.count for r in (await c.gc(dry_run=True)).removed}["trajectories"] == 1
        assert (await c.trajectory(trajectory)).sandbox.state == "running"
        removed = {r.kind: r.count for r in (await c.gc()).removed}
        assert removed["trajectories"] == 1
        assert removed["blobs"] >= 1 and not blob(manual, out).exists()  # unnamed, and old
        with pytest.raises(dsec.TrajectoryNotFound):
            await c.trajectory(trajectory)
        assert (await c.get(sb.id)).info.state == "stopped"
        await asyncio.sleep(1.5)  # the record's retention
        assert {r.kind: r.count for r in (await c.gc()).removed}["sandboxes"] == 1
        assert await gone(c, sb.id)


async def test_a_trajectorys_own_ttl_overrides_the_servers(manual: Server) -> None:
    async with manual.client() as c:
        short, long = new_id("short"), new_id("long")
        await c.create(ttl_s=300, trajectory=short, trajectory_ttl_s=1)
        await c.create(ttl_s=300, trajectory=long, trajectory_ttl_s=3600)
        with pytest.raises(dsec.InvalidRequest):
            await c.create(ttl_s=60, trajectory_ttl_s=5)  # no trajectory to expire
        await asyncio.sleep(TRAJECTORY_TTL_S + 0.5)  # past the server's TTL too
        assert {r.kind: r.count for r in (await c.gc()).removed}["trajectories"] == 1
        with pytest.raises(dsec.TrajectoryNotFound):
            await c.trajectory(short)
        kept = await c.trajectory(long)
        assert kept.sandbox.state == "running" and kept.expires_at == kept.created_at + 3600
        await c.delete_trajectory(long)
