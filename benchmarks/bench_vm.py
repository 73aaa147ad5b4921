"""``dsec bench --only microvm|vm``: VM sandboxes against containers, in one server and run.

Measured (ms, p50/p95/p99), alternating batches with the container baseline:
- create-to-first-output: ``create`` + ``stream("echo hi")`` until its first byte, cold boot
  (no warm pool) and restored from a snapshot (``--vm-snapshots``), against the same for a
  container;
- exec round trip of ``true`` in a running VM, against a running container;
- memory per idle VM: PSS and RSS of its QEMU process (MB), against an idle container's
  memory cgroup charge; and how many such idle VMs fit in this host's available memory.
Acceleration is ``$DSEC_BENCH_VM_ACCEL`` (default ``tcg``: this project's hosts lack a usable
KVM); figures under TCG measure emulation, not what KVM would give.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
from pathlib import Path

from rich.console import Console

from dsec.images.store import ImageStore

from .bench import (
    BENCH_ROOT,
    IMAGE,
    Created,
    Sample,
    _run_true,
    bench_server,
    compare,
    idle_memory,
    phase,
    report,
)

IDLE_SETTLE_S = 3.0  # let a fresh guest finish its boot-time work before reading memory


class VMCreated(Created):
    """Created sandboxes of one substrate, with their QEMU processes' memory."""

    def __init__(self, created: Created, substrate: str, state: Path) -> None:
        super().__init__(created.client, substrate, memory_mb=256, ttl_s=600)
        self.state = state

    def qemu_memory(self) -> tuple[list[float], list[float]]:
        """(PSS, RSS) in MB of each live sandbox's QEMU."""
        pss, rss = [], []
        for sb in self.sandboxes:
            pid = int((self.state / "vms" / sb.id / "qemu.pid").read_text())
            fields = dict(line.split(":", 1) for line in
                          Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
            pss.append(int(fields["Pss"].split()[0]) / 1024)
            rss.append(int(fields["Rss"].split()[0]) / 1024)
        return pss, rss


async def run_vm_benchmark(console: Console, substrate: str, quick: bool) -> list[Sample]:
    n_boot, n_exec = (4, 40) if quick else (10, 200)
    accel = os.environ.get("DSEC_BENCH_VM_ACCEL", "tcg")
    ImageStore().ensure(IMAGE, console=console)
    root = BENCH_ROOT / secrets.token_hex(3)
    state = root / substrate
    samples: list[Sample] = []
    try:
        async with bench_server(state, "--warm-pool", "0", "--vm-accel", accel) as containers:
            vms = VMCreated(containers, substrate, state)
            try:
                await containers.first_output()  # warm-up: agent binary, layer mounts, page cache
                await vms.first_output()  # and the guest kernel, initramfs and layers in cache
                await containers.stop_all()
                await vms.stop_all()

                with phase(console, f"{substrate} create-to-first-output ({accel}), cold boot"):
                    samples += await compare(Sample("container create: first output", []),
                                             containers.first_output,
                                             Sample(f"{substrate} create ({accel}, cold boot): first output", []),
                                             vms.first_output, 2, n_boot // 2,
                                             between=lambda: _stop(containers, vms))
                with phase(console, f"{substrate} exec round trip of `true`"):
                    box = await containers.client.create(image=IMAGE, ttl_s=600)
                    vm = await vms.client.create(substrate=substrate, image=IMAGE, memory_mb=256,
                                                 ttl_s=600)
                    samples += await compare(Sample("container exec true", []), lambda: _run_true(box),
                                             Sample(f"{substrate} exec true", []), lambda: _run_true(vm),
                                             20, n_exec // 20)
                    await box.stop()
                    await vm.stop()
                with phase(console, f"memory of idle {substrate}s"):
                    samples += await idle_memory_series(containers, vms, n_boot)
            finally:
                await vms.stop_all()
        snap_state = root / f"{substrate}-snapshots"
        async with bench_server(snap_state, "--warm-pool", "0", "--vm-accel", accel,
                                "--vm-snapshots") as containers:
            restored = VMCreated(containers, substrate, snap_state)
            try:
                await restored.first_output()  # boots and saves the template (cached by content)
                await restored.stop_all()
                with phase(console, f"{substrate} create-to-first-output ({accel}), snapshot restore"):
                    samples += await compare(
                        Sample("container create: first output (again)", []), containers.first_output,
                        Sample(f"{substrate} create ({accel}, snapshot restore): first output", []),
                        restored.first_output, 5, n_boot * 2 // 5 or 1,
                        between=lambda: _stop(containers, restored))
            finally:
                await restored.stop_all()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return samples


async def _stop(*created: Created) -> None:
    for c in created:
        await c.stop_all()


async def idle_memory_series(containers: Created, vms: VMCreated, n: int) -> list[Sample]:
    for _ in range(n):
        await containers.first_output()
        await vms.first_output()
    await asyncio.sleep(IDLE_SETTLE_S)
    pss, rss = vms.qemu_memory()
    container = Sample("idle container memory cgroup (MB, not ms)", idle_memory(containers))
    ours = Sample(f"idle {vms.substrate} QEMU PSS (MB, not ms)", pss, baseline=container)
    available_mb = _mem_available_mb()
    fit = Sample(f"idle {vms.substrate}s that fit in available memory (count, not ms)",
                 [available_mb / p for p in pss])
    return [container, ours, Sample(f"idle {vms.substrate} QEMU RSS (MB, not ms)", rss), fit]


def _mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def main(substrate: str, quick: bool = False, json_out: Path | None = None) -> None:
    if os.geteuid() != 0:
        raise SystemExit("dsec bench runs sandboxes and must run as root")
    console = Console()
    samples = asyncio.run(run_vm_benchmark(console, substrate, quick))
    report(console, samples)
    if json_out:
        json_out.write_text(json.dumps([s.row() for s in samples], indent=2))
        console.print(f"raw figures in {json_out}")
