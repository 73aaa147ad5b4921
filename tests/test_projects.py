"""Projects, quotas and project keys, against a real server with real sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest

import dsec
from conftest import Server, make_server, stop_server


@pytest.fixture(scope="module")
def srv(images) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    server = make_server("--capacity", "64", "--warm-pool", "0").start()
    yield server
    stop_server(server)


@pytest.fixture
async def admin(srv: Server) -> AsyncIterator[dsec.DSecClient]:
    async with srv.client() as c:
        yield c


def key_client(srv: Server, key: str) -> dsec.DSecClient:
    return dsec.DSecClient(srv.url, key, autostart=False)


def raw(srv: Server, key: str) -> httpx.Client:
    client = srv.http()
    client.headers["authorization"] = f"Bearer {key}"
    return client


def unique(prefix: str) -> str:
    return f"{prefix}-{os.urandom(3).hex()}"


async def used(admin: dsec.DSecClient, project: str) -> tuple[int, float, int]:
    p = await admin.projects().get(project)
    return p.used.sandboxes, p.used.cpu, p.used.memory_mb


async def test_projects_nest_and_never_delegate_more_than_they_hold(admin: dsec.DSecClient) -> None:
    projects = admin.projects()
    a, b, c = unique("a"), unique("b"), unique("c")
    made = await projects.create(a, sandboxes=10, cpu=4, memory_mb=2048)
    assert made.parent == "default" and made.available.sandboxes == 10
    await projects.create(b, parent=a, sandboxes=6, cpu=2, memory_mb=1024)
    with pytest.raises(dsec.DelegationExceeded) as exc:  # 6 + 5 > 10
        await projects.create(c, parent=a, sandboxes=5, cpu=1, memory_mb=256)
    assert exc.value.details["resource"] == "sandboxes" and exc.value.details["delegated"] == 6
    with pytest.raises(dsec.ProjectNotFound):  # the refused create left nothing behind
        await projects.get(c)
    await projects.create(c, parent=a, sandboxes=4, cpu=2, memory_mb=1024)
    parent = await projects.get(a)
    assert (parent.delegated.sandboxes, parent.delegated.cpu, parent.delegated.memory_mb) == (10, 4.0, 2048)
    assert parent.available.sandboxes == 0
    with pytest.raises(dsec.DelegationExceeded):  # b cannot grow: a has no room left
        await projects.set_quota(b, sandboxes=7)
    with pytest.raises(dsec.DelegationExceeded) as exc:  # a cannot shrink below what it handed out
        await projects.set_quota(a, memory_mb=1000)
    assert exc.value.details["resource"] == "memory_mb"
    shrunk = await projects.set_quota(b, sandboxes=2)  # gives 4 back to a
    assert shrunk.quota.sandboxes == 2 and shrunk.quota.cpu == 2.0  # the rest is kept
    assert (await projects.get(a)).available.sandboxes == 4
    grandchild = await projects.create(unique("g"), parent=b, sandboxes=2, cpu=0.5, memory_mb=64)
    assert grandchild.parent == b
    with pytest.raises(dsec.ProjectNotFound):
        await projects.create(unique("x"), parent="no-such-project", sandboxes=1)
    with pytest.raises(dsec.ProjectExists):
        await projects.create(b, parent=a)
    names = {p.name for p in await projects.list()}
    assert {"default", a, b, c, grandchild.name} <= names


def test_sync_twin_and_project_key_rights(srv: Server) -> None:
    with dsec.Client(srv.url, srv.key, autostart=False) as admin:
        team, child, other = unique("team"), unique("child"), unique("other")
        admin.projects().create(team, sandboxes=4, cpu=4, memory_mb=2048)
        admin.projects().create(other, sandboxes=1, cpu=1, memory_mb=256)
        key = admin.projects().create_key(team, "lead")
        assert key.project == team and key.key.startswith("dsk_")
    with dsec.Client(srv.url, key.key, autostart=False) as lead:
        projects = lead.projects()
        projects.create(child, parent=team, sandboxes=2, cpu=1, memory_mb=512)  # in its subtree
        assert {p.name for p in projects.list()} == {team, child}  # not other, not default
        assert projects.set_quota(child, sandboxes=1).quota.sandboxes == 1
        with pytest.raises(dsec.Forbidden):  # never its own quota
            projects.set_quota(team, sandboxes=100)
        for hidden in (other, "default"):  # outside its subtree: as if missing
            with pytest.raises(dsec.ProjectNotFound):
                projects.get(hidden)
            with pytest.raises(dsec.ProjectNotFound):
                projects.set_quota(hidden, sandboxes=1)
            with pytest.raises(dsec.ProjectNotFound):
                projects.create(unique("y"), parent=hidden)
            with pytest.raises(dsec.ProjectNotFound):
                projects.create_key(hidden, "sneaky")
        assert projects.create_key(child, "worker").project == child
        assert projects.create(unique("own"), sandboxes=1).parent == team  # its own, by default


async def test_quota_exceeded_and_given_back(srv: Server, admin: dsec.DSecClient) -> None:
    q = unique("q")
    await admin.projects().create(q, sandboxes=2, cpu=2, memory_mb=1024)
    key = (await admin.projects().create_key(q, "k")).key
    async with key_client(srv, key) as client:
        first = await client.create(memory_mb=256, cpu=0.5)
        second = await client.create(memory_mb=256, cpu=0.5, ttl_s=2)
        assert await used(admin, q) == (2, 1.0, 512)
        with pytest.raises(dsec.QuotaExceeded) as exc:
            await client.create(memory_mb=256, cpu=0.5)
        assert exc.value.details == {"project": q, "resource": "sandboxes", "quota": 2,
                                     "used": 2, "delegated": 0, "asked": 1}
        await first.stop()
        assert await used(admin, q) == (1, 0.5, 256)
        with pytest.raises(dsec.QuotaExceeded) as exc:  # memory, this time
            await client.create(memory_mb=800)
        assert exc.value.details["resource"] == "memory_mb"
        with pytest.raises(dsec.ImageNotFound):  # a failed create gives its share back
            await client.create(image="no-such-image", memory_mb=256)
        assert await used(admin, q) == (1, 0.5, 256)
        deadline = time.monotonic() + 60
        while await used(admin, q) != (0, 0.0, 0):  # the reaper expires the second one
            assert time.monotonic() < deadline, "an expired sandbox still holds its quota"
            await asyncio.sleep(0.2)
        assert (await second.refresh()).state == "expired"
        third = await client.create(memory_mb=512)
        await third.stop()
    assert await used(admin, q) == (0, 0.0, 0)


async def test_concurrent_creates_never_overshoot(srv: Server, admin: dsec.DSecClient) -> None:
    burst = unique("burst")
    await admin.projects().create(burst, sandboxes=3, cpu=8, memory_mb=4096)
    key = (await admin.projects().create_key(burst, "k")).key
    async with key_client(srv, key) as client:
        made = await client.create_many(8, concurrency=8, memory_mb=128, cpu=0.25)
        sandboxes = [m for m in made if isinstance(m, dsec.AsyncSandbox)]
        refused = [m for m in made if not isinstance(m, dsec.AsyncSandbox)]
        assert len(sandboxes) == 3
        assert all(isinstance(e, dsec.QuotaExceeded) for e in refused) and len(refused) == 5
        assert await used(admin, burst) == (3, 0.75, 384)
        assert len(await client.list()) == 3
        await asyncio.gather(*(sb.stop() for sb in sandboxes))
    assert await used(admin, burst) == (0, 0.0, 0)


def sandbox_routes(sandbox_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    """Every route of the API that names a sandbox, with a valid request."""
    base = f"/v1/sandboxes/{sandbox_id}"
    run = {"json": {"command": "true"}}
    return [
        ("GET", base, {}),
        ("PUT", f"{base}/ttl", {"json": {"ttl_s": 30}}),
        ("POST", f"{base}/exec", run),
        ("POST", f"{base}/exec/stream", run),
        ("POST", f"{base}/processes", run),
        ("GET", f"{base}/processes", {}),
        ("GET", f"{base}/processes/p1/output", {}),
        ("POST", f"{base}/processes/p1/signal", {"json": {"signal": 9}}),
        ("GET", f"{base}/files", {"params": {"path": "/etc/hostname"}}),
        ("PUT", f"{base}/files", {"params": {"path": "/work/x"}, "content": b"x"}),
        ("DELETE", f"{base}/files", {"params": {"path": "/work/x"}}),
        ("GET", f"{base}/dirs", {"params": {"path": "/"}}),
        ("POST", f"{base}/dirs", {"params": {"path": "/work/d"}}),
        ("GET", f"{base}/stat", {"params": {"path": "/"}}),
        ("GET", f"{base}/archive", {"params": {"path": "/work"}}),
        ("PUT", f"{base}/archive", {"params": {"path": "/work"}, "content": b""}),
        ("DELETE", base, {}),
    ]


async def test_a_key_never_sees_nor_touches_another_projects_sandboxes(
        srv: Server, admin: dsec.DSecClient) -> None:
    a, b, b_child = unique("pa"), unique("pb"), unique("pbc")
    for name in (a, b):
        await admin.projects().create(name, sandboxes=4, cpu=4, memory_mb=2048)
    await admin.projects().create(b_child, parent=b, sandboxes=1, cpu=1, memory_mb=512)
    key_a = (await admin.projects().create_key(a, "ka")).key
    key_b = (await admin.projects().create_key(b, "kb")).key
    key_child = (await admin.projects().create_key(b_child, "kc")).key
    async with key_client(srv, key_b) as client_b, key_client(srv, key_a) as client_a, \
            key_client(srv, key_child) as client_child:
        theirs = await client_b.create(memory_mb=256)
        mine = await client_a.create(memory_mb=256)
        childs = await client_child.create(memory_mb=256)
        try:
            assert [s.id for s in await client_a.list()] == [mine.id]
            assert [s.id for s in await client_b.list()] == [theirs.id]  # not its child's
            assert {mine.id, theirs.id, childs.id} <= {s.id for s in await admin.list()}
            missing = f"sb-{theirs.info.edge}-000000000000"
            with raw(srv, key_a) as http:
                for (method, path, kwargs), (_, ghost, _) in zip(sandbox_routes(theirs.id),
                                                                 sandbox_routes(missing)):
                    answer = http.request(method, path, **kwargs)
                    assert answer.status_code == 404, (method, path, answer.text)
                    assert answer.json()["error"]["code"] == "sandbox_not_found", (method, path)
                    # the same answer as for a sandbox that does not exist: no existence leak
                    assert http.request(method, ghost, **kwargs).json()["error"]["code"] == \
                        "sandbox_not_found"
                e2b = {"x-api-key": key_a}
                listed = http.get("/e2b/sandboxes", headers=e2b).json()
                assert [s["sandboxID"] for s in listed] == [mine.id]
                assert http.get("/e2b/v2/sandboxes", headers=e2b).headers["x-total-running"] == "1"
                assert http.get(f"/e2b/sandboxes/{theirs.id}", headers=e2b).status_code == 404
                assert http.delete(f"/e2b/sandboxes/{theirs.id}", headers=e2b).status_code == 404
                assert http.get("/metrics").status_code == 403  # every project's usage is there
            with pytest.raises(dsec.SandboxNotFound):
                await client_a.get(theirs.id)
            assert (await theirs.run("echo alive")).stdout == "alive\n"  # untouched by A
            assert (await admin.get(theirs.id)).info.state == "running"  # the admin sees all
        finally:
            for sb in (theirs, mine, childs):
                await sb.stop()


async def test_trajectories_follow_their_sandboxs_project(srv: Server,
                                                         admin: dsec.DSecClient) -> None:
    a, b = unique("ta"), unique("tb")
    for name in (a, b):
        await admin.projects().create(name, sandboxes=2, cpu=2, memory_mb=1024)
    key_a = (await admin.projects().create_key(a, "k")).key
    key_b = (await admin.projects().create_key(b, "k")).key
    trajectory = unique("traj")
    async with key_client(srv, key_b) as client_b, key_client(srv, key_a) as client_a:
        sb = await client_b.create(memory_mb=256, trajectory=trajectory)
        try:
            await sb.run("echo secret-answer")
            assert (await client_b.trajectory(trajectory)).sandbox.id == sb.id
            assert trajectory not in {t.id for t in await client_a.trajectories()}
            for call in (client_a.trajectory(trajectory), client_a.trajectory_steps(trajectory),
                         client_a.resume(trajectory)):
                with pytest.raises(dsec.TrajectoryNotFound):
                    await call
        finally:
            await sb.stop()


BAD_QUOTAS: list[Any] = [
    {"sandboxes": 10**30}, {"sandboxes": -1}, {"cpu": -0.5}, {"memory_mb": 1 << 70},
    {"sandboxes": "3"}, {"sandboxes": True}, {"sandboxes": 1.5}, {"cpu": "1"},
    {"cpu": [1]}, {"memory_mb": {"a": 1}}, {"unknown": 1}, None, [], "quota", 3,
]


def test_malformed_and_extreme_inputs_answer_typed_4xx(srv: Server) -> None:
    name = unique("fuzz")
    with raw(srv, srv.key) as http:
        assert http.post("/v1/projects", json={"name": name, "quota": {"sandboxes": 1}}).status_code == 201
        cases: list[tuple[str, str, Any]] = []
        for body in BAD_QUOTAS:
            cases.append(("PUT", f"/v1/projects/{name}/quota", body))
            cases.append(("POST", "/v1/projects", {"name": unique("n"), "quota": body}))
        for bad_name in ("", "UPPER", "-lead", "a" * 65, "ünïcode", "😀", "a/b", "a b", "..",
                         "\u0000", "\ud800", None, 7, ["x"]):
            cases.append(("POST", "/v1/projects", {"name": bad_name}))
            cases.append(("POST", "/v1/keys", {"name": "k", "project": bad_name}))
            if bad_name != "UPPER":  # a fine key name
                cases.append(("POST", "/v1/keys", {"name": bad_name, "project": name}))
        cases += [
            ("POST", "/v1/projects", {"name": unique("n"), "parent": 5}),
            ("POST", "/v1/projects", {"name": unique("n"), "parent": "missing-parent"}),
            ("PUT", "/v1/projects/missing-project/quota", {"sandboxes": 1}),
            ("GET", "/v1/projects/missing-project", None),
            ("POST", "/v1/keys", {"name": "k", "project": "missing-project"}),
            ("POST", "/v1/keys", {"name": "k"}),
        ]
        for path_name in ("%F0%9F%98%80", "%00", "UPPER", "a" * 200, "%ED%A0%80", "..%2F.."):
            cases.append(("PUT", f"/v1/projects/{path_name}/quota", {"sandboxes": 1}))
            cases.append(("GET", f"/v1/projects/{path_name}", None))
        for method, path, body in cases:
            answer = http.request(method, path, content=json.dumps(body).encode(),
                                  headers={"content-type": "application/json"})
            assert 400 <= answer.status_code < 500, (method, path, body, answer.status_code, answer.text)
            # a typed error; or, for a path no route matches, the framework's 404
            assert "error" in answer.json() or answer.status_code == 404, (method, path, body)
        for raw_body in (b"{", b"\xff\xfe", b'{"cpu": NaN}', b'{"cpu": Infinity}',
                         b'{"sandboxes": 1e999}', b"", b'{"memory_mb": -1e308}'):
            answer = http.put(f"/v1/projects/{name}/quota", content=raw_body,
                              headers={"content-type": "application/json"})
            assert answer.status_code == 400, (raw_body, answer.status_code, answer.text)
        assert http.get(f"/v1/projects/{name}").json()["quota"]["sandboxes"] == 1  # unchanged


def test_cli_makes_projects_and_project_keys(srv: Server) -> None:
    team = unique("cli")
    env = {**os.environ, "DSEC_URL": srv.url, "DSEC_API_KEY": srv.key}

    def dsec_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dsec", *args], env=env, text=True,
                              capture_output=True, timeout=120)

    made = dsec_cli("project", "create", team, "--sandboxes", "2", "--cpu", "1.5",
                    "--memory-mb", "512")
    assert made.returncode == 0, made.stderr
    assert "0/2 sandboxes" in made.stdout
    child = dsec_cli("project", "create", unique("sub"), "--parent", team, "--sandboxes", "3")
    assert child.returncode == 1 and "delegation_exceeded" in child.stderr
    assert dsec_cli("project", "quota", team, "--sandboxes", "1").returncode == 0
    listed = dsec_cli("project", "ls")
    assert listed.returncode == 0 and team in listed.stdout
    key = dsec_cli("key", "create", "cli-key", "--project", team, "--state-dir", str(srv.state_dir))
    assert key.returncode == 0, key.stderr
    secret = key.stdout.strip()
    missing = dsec_cli("key", "create", "k", "--project", "missing-project",
                       "--state-dir", str(srv.state_dir))
    assert missing.returncode == 1 and "project_not_found" in missing.stderr
    with dsec.Client(srv.url, secret, autostart=False) as client:
        assert [p.name for p in client.projects().list()] == [team]
        sb = client.create(memory_mb=256)
        try:
            with pytest.raises(dsec.QuotaExceeded):
                client.create(memory_mb=256)
        finally:
            sb.stop()


async def test_json_logs_are_one_object_per_line(images) -> None:  # type: ignore[no-untyped-def]
    from conftest import LOG_DIR
    server = make_server("--warm-pool", "0", "--log-format", "json").start()
    try:
        async with server.client() as admin:
            await admin.projects().create("empty", sandboxes=0)
            key = (await admin.projects().create_key("empty", "k")).key
            async with key_client(server, key) as client:
                with pytest.raises(dsec.QuotaExceeded):
                    await client.create()
        lines = (LOG_DIR / f"{server.state_dir.name}.log").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]  # every line is JSON
        messages = {(r["logger"], r["message"]) for r in records}
        assert ("dsec.projects", "project empty created under default") in messages
        assert ("dsec.projects", "refused a create in empty: quota of sandboxes") in messages
        serving = next(r for r in records if r["logger"] == "dsec.server")
        assert serving["state_dir"] == str(server.state_dir) and serving["level"] == "info"
    finally:
        stop_server(server)


async def test_usage_survives_a_server_crash(images) -> None:  # type: ignore[no-untyped-def]
    server = make_server("--warm-pool", "0").start()
    try:
        async with server.client() as admin:
            await admin.projects().create("crash", sandboxes=2, cpu=2, memory_mb=1024)
            key = (await admin.projects().create_key("crash", "k")).key
            async with key_client(server, key) as client:
                survivor = await client.create(memory_mb=256)
                doomed = await client.create(memory_mb=256, ttl_s=1)
        server.kill()  # SIGKILL: the sandboxes live on; the second expires meanwhile
        await asyncio.sleep(2)
        server.start()
        async with server.client() as admin, key_client(server, key) as client:
            # adopted: still held; expired while no server ran: given back at start
            deadline = time.monotonic() + 60
            while await used(admin, "crash") != (1, 1.0, 256):
                assert time.monotonic() < deadline, await used(admin, "crash")
                await asyncio.sleep(0.2)
            assert [s.id for s in await client.list()] == [survivor.id]
            assert (await client.get(doomed.id)).info.state in ("expired", "died")
            await (await client.get(survivor.id)).stop()
            assert await used(admin, "crash") == (0, 0.0, 0)
    finally:
        stop_server(server)


def test_reservations_from_many_connections_never_overshoot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Several API servers share one state database: the quota check is one conditional
    UPDATE, so creates racing through separate connections still cannot overshoot."""
    import threading

    from dsec.store.projects import ProjectStore
    from dsec.store.sqlite import StateStore

    StateStore(tmp_path / "state.db").close()  # the sandboxes table
    stores = [ProjectStore(tmp_path / "state.db", "default", (1000, 1000_000, 1 << 20, 0))
              for _ in range(6)]
    assert stores[0].create("race", "default", (25, 1000_000, 1 << 20, 0))
    taken: list[str] = []
    start = threading.Barrier(len(stores))

    def hammer(store: ProjectStore) -> None:
        start.wait()
        for _ in range(20):
            reservation = store.reserve("race", 500, 64)
            if reservation is not None:
                taken.append(reservation)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row = stores[0].get("race")
    assert row is not None and len(taken) == 25 and row.used == (25, 12_500, 1600, 0)
    for reservation in taken:  # given back once, however often asked
        assert stores[0].release(reservation) and not stores[1].release(reservation)
    assert stores[0].get("race").used == (0, 0, 0, 0)  # type: ignore[union-attr]
    for store in stores:
        store.close()
