"""Admission, and what a server crash leaves: live sandboxes survive and are adopted, half-made
ones are removed, and once all are stopped nothing of them is left on the host."""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import dsec
from conftest import Server, make_server, stop_server
from dsec.substrates.container.container import RUNTIME_DIR
from dsec.substrates.container.starts import StartSlots
from support.disks import attached_disks


def first_edge_id(server: Server) -> str:
    with server.http() as http:
        return http.get("/v1/health").json()["edges"][0]["id"]


def host_traces(server: Server, edge_id: str) -> dict[str, list[str]]:
    """Everything of this edge's sandboxes that the host still holds."""
    root = str(server.volume / "sandboxes")
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(root)]
    cgroups = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/dsec-{edge_id}/*") if p.is_dir()]
    procs = []
    for cg in Path("/proc").glob("[0-9]*/cgroup"):
        try:
            # A killed container init is re-parented to the host's init, which reaps it when it
            # gets to it; until then it is a zombie that holds nothing but its pid.
            if f"/dsec-{edge_id}/" in cg.read_text() and not _zombie(cg.parent / "stat"):
                procs.append(cg.parent.name)
        except OSError:
            pass
    containers = [p.name for p in (server.volume / RUNTIME_DIR).glob("*/*")]
    dirs = [p.name for p in (server.volume / "sandboxes").glob("*")]
    return {"mounts": mounts, "cgroups": cgroups, "processes": procs,
            "containers": containers, "dirs": dirs, "loops": attached_disks(Path(root))}


async def settled(traces: Callable[[], dict[str, list[str]]],
                  timeout_s: float = 60) -> dict[str, list[str]]:
    """``traces()`` once it is empty, or as it is after ``timeout_s``: a stop returns when its
    sandbox can no longer run, and the removal of its mounts, disk, cgroups, runtime record
    and directory finishes in the background (``Edge._remove``)."""
    deadline = time.monotonic() + timeout_s
    while any((found := traces()).values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return found


def _zombie(stat: Path) -> bool:
    return stat.read_text().rpartition(")")[2].split()[0] == "Z"


@pytest.fixture
def fresh_server(images) -> Server:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "60").start()
    yield srv
    stop_server(srv)


async def test_capacity_refusal(images) -> None:  # type: ignore[no-untyped-def]
    srv = make_server("--capacity", "2").start()
    try:
        async with srv.client() as client:
            made = await client.create_many(3, concurrency=3, ttl_s=60)
            refused = [m for m in made if isinstance(m, dsec.CapacityExhausted)]
            assert len(refused) == 1 and len(made) - len(refused) == 2
            for m in made:
                if isinstance(m, dsec.AsyncSandbox):
                    await m.stop()
            await (await client.create(ttl_s=60)).stop()  # a freed slot is usable again
    finally:
        stop_server(srv)


async def test_sandboxes_survive_a_server_crash(fresh_server: Server) -> None:
    async with fresh_server.client() as client:
        sb = await client.create(ttl_s=300)
        await sb.write_file("/work/state", b"before crash")
    fresh_server.kill(signal.SIGKILL)
    fresh_server.start()
    async with fresh_server.client() as client:
        assert sb.id in [s.id for s in await client.list()]
        again = await client.get(sb.id)
        assert await again.read_file("/work/state") == b"before crash"
        assert (await again.run("echo after")).stdout == "after\n"
        await again.stop()


async def test_crash_mid_burst_leaks_nothing(fresh_server: Server) -> None:
    edge_id = first_edge_id(fresh_server)
    async with fresh_server.client() as client:
        burst = asyncio.ensure_future(client.create_many(50, concurrency=25, ttl_s=300))
        while len(await client.list()) < 5:  # kill it once the burst is well under way
            await asyncio.sleep(0.01)
        fresh_server.kill(signal.SIGKILL)
        outcomes = await burst
    assert any(isinstance(o, dsec.ServerUnavailable) for o in outcomes)  # the crash hit the burst
    assert all(isinstance(o, (dsec.AsyncSandbox, dsec.DSecError)) for o in outcomes)

    fresh_server.start()
    async with fresh_server.client() as client:
        survivors = await client.list()
        for info in survivors:  # everything reported live really is
            assert (await (await client.get(info.id)).run("echo ok")).stdout == "ok\n"
        traces = host_traces(fresh_server, edge_id)
        assert sorted(traces["dirs"]) == sorted(s.id for s in survivors)
        assert traces["mounts"] == []  # their disks and overlays are in their own namespaces
        assert len(traces["loops"]) == len(survivors)  # a disk each, still attached
        handles = [await client.get(s.id) for s in survivors]
        await asyncio.gather(*(h.stop() for h in handles))
    assert await settled(lambda: host_traces(fresh_server, edge_id)) == {k: [] for k in traces}


async def test_a_crash_before_stopped_sandboxes_are_removed_leaks_nothing(images) -> None:  # type: ignore[no-untyped-def]
    """A stop returns once the sandbox can no longer run (its processes killed), recorded
    ended; its removal follows in the background. A crash right after the stops return,
    before that removal is done, leaves its remains to the restarted server, which removes
    them all and keeps the sandboxes recorded as stopped. (No warm pool: its sandboxes would
    be running processes of the edge at the crash.)"""
    srv = make_server("--capacity", "60", "--warm-pool", "0").start()
    try:
        await _crash_after_stops(srv)
    finally:
        stop_server(srv)


async def test_a_signal_to_the_servers_group_right_after_stops_leaks_nothing(images) -> None:  # type: ignore[no-untyped-def]
    """A SIGTERM to the server's whole process group (what systemd's stop and a terminal's
    Ctrl-C send) right after stops return also reaches the runtime ``delete``s their
    background removal has under way; the edge's close still leaves nothing of them."""
    srv = make_server("--capacity", "60", "--warm-pool", "0").start()
    try:
        edge_id = first_edge_id(srv)
        await _stop_forty_then_signal(srv, signal.SIGTERM)
        left = host_traces(srv, edge_id)
        assert left == {k: [] for k in left}, left
    finally:
        stop_server(srv)


async def _stop_forty_then_signal(srv: Server, sig: int) -> list[dsec.AsyncSandbox | dsec.DSecError]:
    """40 sandboxes each running a process, all stopped, then ``sig`` to the server's
    process group as soon as the stops return."""
    async with srv.client() as client:
        sandboxes = await client.create_many(40, concurrency=20, ttl_s=300)
        assert all(isinstance(sb, dsec.AsyncSandbox) for sb in sandboxes), sandboxes
        await asyncio.gather(*(sb.start(["sleep", "infinity"]) for sb in sandboxes))
        await asyncio.gather(*(sb.stop() for sb in sandboxes))
        srv.kill(sig)
    return sandboxes


async def _crash_after_stops(srv: Server) -> None:
    edge_id = first_edge_id(srv)
    sandboxes = await _stop_forty_then_signal(srv, signal.SIGKILL)
    left = host_traces(srv, edge_id)
    # The crash came before the background removal ended (40 removals, 16 at a time, each
    # forks the runtime and waits for a loop device), so the restart has remains to remove.
    # (Their mounts went with the server: only its threads held their namespaces.)
    assert left["dirs"], left
    # Stopped means not running: the killed processes are gone without any clean-up.
    assert (await settled(lambda: {"processes": host_traces(srv, edge_id)["processes"]})
            == {"processes": []})
    srv.start()
    async with srv.client() as client:
        assert await client.list() == []
        assert {(await client.get(sb.id)).info.state for sb in sandboxes} == {"stopped"}
    assert host_traces(srv, edge_id) == {k: [] for k in left}


@pytest.fixture(scope="module")
def oci_images(images) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Two imported OCI images: busybox as is, and one whose /proc is a file (unbootable)."""
    from test_images import _busybox_layers, _layer_tar, make_oci_archive
    with tempfile.TemporaryDirectory() as tmp:
        good = images.import_oci(make_oci_archive(Path(tmp) / "good.tar"), "test-busybox")
        layers = [*_busybox_layers(), _layer_tar([("proc", b"not a directory", 0o644)])]
        bad = images.import_oci(make_oci_archive(Path(tmp) / "bad.tar", layers), "test-broken-proc")
    return {"good": good.name, "bad": bad.name}


async def test_imported_oci_image_runs_with_its_env(client: dsec.DSecClient,
                                                     oci_images: dict[str, str]) -> None:
    async with await client.create(image=oci_images["good"], ttl_s=60) as sb:
        r = await sb.run("echo $GREETING; cat /etc/keep.txt; ls /etc")
        assert r.stdout.split() == ["hi", "kept", "keep.txt"]  # the whiteout hides hidden.txt


async def test_failed_create_leaks_nothing(fresh_server: Server, oci_images: dict[str, str]) -> None:
    edge_id = first_edge_id(fresh_server)
    async with fresh_server.client() as client:
        with pytest.raises(dsec.SandboxError, match="failed to start"):
            await client.create(image=oci_images["bad"], ttl_s=60)
        assert await client.list() == []
    assert host_traces(fresh_server, edge_id) == {k: [] for k in
                                                  ("mounts", "cgroups", "processes", "containers", "dirs", "loops")}


async def test_unbootable_creates_in_a_burst_take_no_start_slot(
        images, oci_images: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """A tenant's unbootable creates, mixed into a burst four times the edge's runtime start
    slots (substrates/container/starts.py): each fails typed, every good one runs, and the
    slots all come back: a second burst, three times the slots, completes too. (No warm
    pool: every create starts its own container.)"""
    srv = make_server("--capacity", "60", "--warm-pool", "0").start()
    try:
        edge_id = first_edge_id(srv)
        slots = StartSlots().runs_at_once  # as many as this host's server has
        async with srv.client() as client:
            async def run_once(image: str) -> str:
                async with await client.create(image=image, ttl_s=120) as sb:
                    return (await sb.run("echo up")).stdout

            mixed = await asyncio.gather(*(run_once(oci_images[kind]) for _ in range(2 * slots)
                                           for kind in ("bad", "good")), return_exceptions=True)
            failed = mixed[0::2]
            assert all(isinstance(e, dsec.SandboxError) and "failed to start" in str(e)
                       for e in failed), failed
            assert mixed[1::2] == ["up\n"] * (2 * slots)
            again = await asyncio.gather(*(run_once(oci_images["good"]) for _ in range(3 * slots)))
            assert again == ["up\n"] * (3 * slots)
            assert await client.list() == []
        assert await settled(lambda: host_traces(srv, edge_id)) == {
            k: [] for k in ("mounts", "cgroups", "processes", "containers", "dirs", "loops")}
    finally:
        stop_server(srv)
