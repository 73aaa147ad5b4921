"""The warm pool, attacked as a caller who wants another caller's sandbox or its leftovers: a
pooled sandbox serves one caller only, is fresh (never recycled), a pooled sandbox that died
in the pool is never handed out, a burst larger than the pool gets distinct sandboxes, a
crash of the edge while pooled sandboxes are being claimed leaks nothing, and a pool grown by
a burst (``--warm-pool-max``) never takes capacity from callers. (Containers; the VM pool is
opt-in and test_vm covers it.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

import dsec
from conftest import Server, make_server, own_server, stop_server, warm_count
from dsec.substrates.container.container import RUNTIME_DIR
from dsec.substrates.host import cgroups

POOL = 3
srv, client = own_server("--capacity", "32", "--warm-pool", str(POOL))


def _runtime_ids(server: Server) -> set[str]:
    """Sandboxes crun knows on this server: live ones and pooled ones."""
    runtime = server.volume / RUNTIME_DIR / "crun"
    return set(os.listdir(runtime)) if runtime.exists() else set()


def _init_pid(server: Server, sandbox_id: str) -> int:
    """The host pid of a sandbox's init, from the pid file crun wrote in its bundle."""
    found = [p for p in server.state_dir.glob(f"**/{sandbox_id}/pid")]
    assert len(found) == 1, found
    return int(found[0].read_text())


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


async def _pooled_ids(server: Server, c: dsec.DSecClient) -> set[str]:
    return _runtime_ids(server) - {info.id for info in await c.list()}


async def _until(check, what: str, timeout_s: float = 120) -> None:  # type: ignore[no-untyped-def]
    """Wait for an eventual state (not a timing: the bound only ends a broken run)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f}s")
        await asyncio.sleep(0.1)


async def _filled(c: dsec.DSecClient) -> None:
    await (await c.create(ttl_s=60)).stop()  # the image gets a pool
    await _until(lambda: _count_is(c, POOL), f"the pool did not refill to {POOL}")


async def _count_is(c: dsec.DSecClient, n: int) -> bool:
    return await warm_count(c, "container") == n


async def test_nothing_of_a_previous_caller_survives(srv: Server, client: dsec.DSecClient) -> None:
    await _filled(client)
    first = await client.create(ttl_s=60)
    await first.write_file("/work/secret", b"caller one")
    await first.run("echo caller-one > /tmp/secret; echo x > /dev/shm/secret")
    await first.start("sleep 4242")
    await first.stop()
    # every pooled sandbox and then some fresh ones: none is the first caller's, none holds
    # anything it left
    later = [await client.create(ttl_s=60) for _ in range(POOL + 2)]
    try:
        assert first.id not in {sb.id for sb in later}
        for sb in later:
            r = await sb.run("ls -a /work /tmp /dev/shm; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
            assert "secret" not in r.stdout and "4242" not in r.stdout, r.stdout
        with pytest.raises(dsec.SandboxNotFound):
            await first.run("true")
    finally:
        await asyncio.gather(*(sb.stop() for sb in later))


async def test_a_burst_beyond_the_pool_gets_distinct_sandboxes(srv: Server,
                                                               client: dsec.DSecClient) -> None:
    await _filled(client)
    burst = await asyncio.gather(*(client.create(ttl_s=60) for _ in range(3 * POOL)))
    try:
        assert len({sb.id for sb in burst}) == len(burst)
        # each writes its own id where all would, and finds only its own: no two share a disk
        await asyncio.gather(*(sb.write_file("/work/owner", sb.id.encode()) for sb in burst))
        for sb in burst:
            assert await sb.read_file("/work/owner") == sb.id.encode()
            assert (await sb.run("hostname")).stdout.strip() == sb.id
    finally:
        await asyncio.gather(*(sb.stop() for sb in burst))
    await _until(lambda: _count_is(client, POOL), "the pool did not refill after the burst")


def _host_limits(sandbox_id: str) -> tuple[int, int, int]:
    """A sandbox's cgroup limits as the host holds them: cpu quota in µs per 100 ms, memory
    bytes, pids (a hybrid host's v1 hierarchies, or the unified one's files)."""
    if cgroups.is_cgroup2_only():
        files = [f"dsec-*/{sandbox_id}/{name}" for name in ("cpu.max", "memory.max", "pids.max")]
    else:
        files = [f"cpu/dsec-*/{sandbox_id}/cpu.cfs_quota_us",
                 f"memory/dsec-*/{sandbox_id}/memory.limit_in_bytes",
                 f"pids/dsec-*/{sandbox_id}/pids.max"]
    found = [list(Path("/sys/fs/cgroup").glob(f)) for f in files]
    assert all(len(paths) == 1 for paths in found), found
    quota, memory, pids = (int(paths[0].read_text().split()[0]) for paths in found)
    return quota, memory, pids


@pytest.mark.parametrize("asked, expected", [
    ({}, (100_000, 512 << 20, 512)),  # the pool's own limits: the claim writes none
    ({"cpu": 0.5}, (50_000, 512 << 20, 512)),  # one differs: the claim writes them
    ({"memory_mb": 96, "pids": 40}, (100_000, 96 << 20, 40)),
])
async def test_a_claimed_sandbox_runs_under_the_limits_its_caller_asked_for(
        srv: Server, client: dsec.DSecClient, asked: dict[str, float], expected: tuple[int, int, int]) -> None:
    """A caller who asks for less than the pool's limits gets less (its project is charged
    for what it asked), one who asks for the pool's own gets exactly those."""
    await _filled(client)
    pooled = await _pooled_ids(srv, client)
    sb = await client.create(ttl_s=60, **asked)
    try:
        assert sb.id in pooled  # a claim, not a cold start
        assert _host_limits(sb.id) == expected
    finally:
        await sb.stop()


async def test_a_sandbox_that_died_in_the_pool_is_never_handed_out(
        srv: Server, client: dsec.DSecClient) -> None:
    await _filled(client)
    pooled = await _pooled_ids(srv, client)
    assert len(pooled) == POOL
    pids = [_init_pid(srv, sandbox_id) for sandbox_id in pooled]
    for pid in pids:  # as an OOM kill or a crash of its init would
        os.kill(pid, signal.SIGKILL)

    async def dead() -> bool:
        return not any(_running(pid) for pid in pids)

    await _until(dead, "the pooled sandboxes' inits did not die")
    sb = await client.create(ttl_s=60)
    try:
        assert sb.id not in pooled
        assert (await sb.run("echo alive")).stdout == "alive\n"

        async def dead_removed() -> bool:
            return not (pooled & _runtime_ids(srv))

        await _until(dead_removed, "the dead pooled sandboxes were not removed")
    finally:
        await sb.stop()


async def test_a_crash_while_claiming_leaks_nothing(images: object) -> None:
    """The edge killed (SIGKILL) while a burst claims its pool and the pool refills: the next
    start removes every sandbox it did not record as live (the pooled ones, those whose claim
    was not recorded), and the recorded ones still serve; nothing is left that no record names."""
    server = make_server("--capacity", "32", "--warm-pool", str(POOL)).start()
    try:
        async with server.client() as c:
            await _filled(c)
            creates = [asyncio.ensure_future(c.create(ttl_s=60)) for _ in range(2 * POOL)]
            await asyncio.sleep(0)  # the requests are on their way
            server.kill(signal.SIGKILL)
            await asyncio.gather(*creates, return_exceptions=True)
        server.start()
        async with server.client() as c:
            live = {info.id for info in await c.list()}
            for sandbox_id in live:  # what the restarted edge kept still answers
                assert (await (await c.get(sandbox_id)).run("echo ok")).stdout == "ok\n"

            assert _runtime_ids(server) == live  # no create since: the image has no pool yet
    finally:
        stop_server(server)


async def test_a_burst_grows_its_images_pool_for_the_next_burst_then_it_shrinks(
        images: object) -> None:
    """With ``--warm-pool-max``, a burst of creates leaves its image's pool refilled to the
    burst's size (at most the maximum), so the next burst is claimed from it. A caller's
    burst cannot take capacity from others through the pool: it grows only into the edge's
    free capacity, and creates up to the capacity still succeed while it holds some. Once the
    burst's hold is over it shrinks back to ``--warm-pool``, the rest stopped and removed."""
    server = make_server("--capacity", "10", "--warm-pool", "1", "--warm-pool-max", "6",
                         "--warm-pool-hold-s", "45").start()
    try:
        async with server.client() as c:
            await (await c.create(ttl_s=60)).stop()  # the image gets a pool
            await _until(lambda: _count_is(c, 1), "the pool did not fill to --warm-pool")
            burst = await asyncio.gather(*(c.create(ttl_s=60) for _ in range(8)))
            await asyncio.gather(*(sb.stop() for sb in burst))
            await _until(lambda: _count_is(c, 6), "the pool did not grow to --warm-pool-max")
            pooled = await _pooled_ids(server, c)
            again = await asyncio.gather(*(c.create(ttl_s=60) for _ in range(6)))
            assert {sb.id for sb in again} == pooled  # every one claimed, none started cold
            # 6 live of a capacity of 10: the pool refills to the 4 left, and no further
            await _until(lambda: _count_is(c, 4), "the pool did not refill into the free capacity")
            await asyncio.sleep(2)
            assert await warm_count(c, "container") == 4
            # a grown pool never takes capacity from callers: 4 more creates get it all
            more = await asyncio.gather(*(c.create(ttl_s=60) for _ in range(4)))
            with pytest.raises(dsec.CapacityExhausted):
                await c.create(ttl_s=60)
            assert await warm_count(c, "container") <= 1  # --warm-pool's own, as ever
            await asyncio.gather(*(sb.stop() for sb in [*again, *more]))
            await _until(lambda: _count_is(c, 6), "the pool did not regrow once capacity was free")
            await _until(lambda: _count_is(c, 1), "the pool did not shrink after the hold")
            await _until(lambda: _no_more_than_pooled(server, c, 1),
                         "the pool's surplus was not removed")
    finally:
        stop_server(server)


async def _no_more_than_pooled(server: Server, c: dsec.DSecClient, n: int) -> bool:
    return len(await _pooled_ids(server, c)) <= n
