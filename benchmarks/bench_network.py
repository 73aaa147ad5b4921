"""``dsec bench --only network``: what an egress policy costs.

- create-to-first-output (``echo hi``) with a policy against ``network="none"``, alternating
  batches on one server: cold (no warm pool), then from a warm pool (pooled sandboxes start
  with no network; a policy is wired when one is claimed);
- ``set_network`` on a running sandbox: replacing its rules (one ``nft -f`` batch), and
  wiring it from ``none`` (veth pair, addresses, route, rules), against ``set_ttl`` (an API
  round trip that changes nothing on the host).
- the same for a ``microvm`` (``$DSEC_BENCH_VM_ACCEL``, default ``tcg``), fewer times: a
  policy there is a tap hot-plugged into the running VM over QMP and the guest's ``eth0``
  configured through its agent.
The policy allows a bench-made destination namespace (``dsec.network.testbed``), so no
outside address is involved and no uplink is switched to forwarding.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from rich.console import Console

from dsec.client.aio import Sandbox as AsyncSandbox
from dsec.images.store import ImageStore
from dsec.network.testbed import make_destination

from .bench import BENCH_ROOT, IMAGE, Created, Sample, bench_server, compare, phase

PORTS = (8001, 8002)


VM = {"substrate": "microvm", "memory_mb": 256}


def first_output(created: Created, network: Any, **create: Any) -> Callable[[], Awaitable[float]]:
    """``Created.first_output`` for a create with ``network`` (and ``create``'s options)."""
    return functools.partial(created.first_output, network=network, **create)


def timed(call: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[float]]:
    async def run() -> float:
        t0 = time.perf_counter()
        await call()
        return (time.perf_counter() - t0) * 1000
    return run


async def network_series(console: Console, quick: bool = False) -> list[Sample]:
    n_create, n_set, pool = (20, 50, 5) if quick else (100, 200, 10)
    ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    dest = make_destination(PORTS)
    policy = {"allow": [f"{dest.address}:{PORTS[0]}"]}
    samples: list[Sample] = []
    try:
        async with bench_server(root / "cold", "--warm-pool", "0") as cold:
            await first_output(cold, policy)()  # warm-up: agent, layers, the nft table
            await cold.stop_all()
            with phase(console, f"create-to-first-output, policy vs none, {n_create} each"):
                samples += await compare(Sample("create (cold), network=none", []),
                                         first_output(cold, "none"),
                                         Sample("create (cold), with a policy", []),
                                         first_output(cold, policy), 10, n_create // 10,
                                         between=cold.stop_all)
            samples += await set_network_series(console, cold, dest.address, n_set)
        async with bench_server(root / "warm", "--warm-pool", str(pool)) as warm:
            with phase(console, f"create-to-first-output from a warm pool of {pool}"):
                await first_output(warm, "none")()  # asks for the image: its pool fills
                await warm.stop_all()

                async def refill() -> None:
                    await warm.stop_all()
                    await warm.wait_warm(pool)
                await refill()
                samples += await compare(Sample("create (warm pool), network=none", []),
                                         first_output(warm, "none"),
                                         Sample("create (warm pool), with a policy", []),
                                         first_output(warm, policy), pool // 2,
                                         max(1, n_create // pool), between=refill, settle_s=1.0)
        samples += await vm_series(console, root / "vm", policy, dest.address, quick)
    finally:
        dest.remove()
        shutil.rmtree(root, ignore_errors=True)
    return samples


async def vm_series(console: Console, state: Path, policy: Any, address: str,
                    quick: bool) -> list[Sample]:
    n_create, n_set = (4, 40) if quick else (10, 40)
    accel = os.environ.get("DSEC_BENCH_VM_ACCEL", "tcg")
    async with bench_server(state, "--warm-pool", "0", "--vm-accel", accel) as vm:
        await first_output(vm, policy, **VM)()  # warm-up: the guest's initramfs
        await vm.stop_all()
        with phase(console, f"microvm ({accel}) create-to-first-output, policy vs none, {n_create} each"):
            samples = await compare(Sample(f"microvm ({accel}) create, network=none", []),
                                    first_output(vm, "none", **VM),
                                    Sample(f"microvm ({accel}) create, with a policy", []),
                                    first_output(vm, policy, **VM), 2, n_create // 2,
                                    between=vm.stop_all)
        return samples + await set_network_series(console, vm, address, n_set, "microvm ", VM,
                                                  "hot-plugs a tap")


async def set_network_series(console: Console, created: Created, address: str, n: int,
                             label: str = "", create: dict[str, Any] | None = None,
                             wiring: str = "wires the veth") -> list[Sample]:
    sb: AsyncSandbox = await created.client.create(image=IMAGE, ttl_s=900, **(create or {}))
    created.sandboxes.append(sb)
    rules = [{"allow": [f"{address}:{PORTS[0]}"]}, {"allow": [f"{address}:{PORTS[1]}"]}]
    turn = iter(range(1 << 30))
    samples: list[Sample] = []
    with phase(console, f"{label}set_network, {n} calls each"):
        samples += await compare(Sample(f"{label}set_ttl (API round trip)", []),
                                 timed(lambda: sb.set_ttl(900)),
                                 Sample(f"{label}set_network: replace the rules", []),
                                 timed(lambda: sb.set_network(rules[next(turn) % 2])),
                                 10, n // 10)
        samples += await compare(Sample(f"{label}set_ttl (API round trip), again", []),
                                 timed(lambda: sb.set_ttl(900)),
                                 Sample(f"{label}set_network: none to a policy ({wiring})", []),
                                 lambda: _wire_then_unwire(sb, rules[0]), 10, n // 40)
    return samples


async def _wire_then_unwire(sb: AsyncSandbox, policy: Any) -> float:
    """Times the wiring only; the unwiring after it is outside the clock."""
    t0 = time.perf_counter()
    await sb.set_network(policy)
    elapsed = (time.perf_counter() - t0) * 1000
    await sb.set_network("none")
    return elapsed
