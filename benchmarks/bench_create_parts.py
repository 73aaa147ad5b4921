"""``dsec bench --only create-parts``: what each difference between a dsec container's start
and bare ``crun run`` costs inside crun, one difference at a time (issue 15's cold create).

``--only create`` times the whole create against ``crun run``; this series tells where crun's
share of the gap goes. Every variant runs ``crun run`` on an overlay of the same image layers
(its bundle made untimed) and is timed from crun's start to the first byte its container
prints; the variants take turns, so each meets the same machine:

- ``crun spec``'s config running ``echo hi`` (the baseline, as ``bench.BareCrun``);
- dsec's config (``oci_spec.container_config``) running ``echo hi``, whole and then with one
  part taken out: the seccomp filter, its compiled form (crun then compiles the profile
  itself, as before stop 34), the cgroup limits, the masked and read-only /proc paths,
  dsec's two binds, the network namespace, the rlimit and OOM score;
- dsec's config as dsec starts it: the agent as init, ``--detach``, until it prints ``R``;
  and the same with the writable layer and run dir on a per-sandbox ext4 disk (disk.py),
  as a create makes them (the disk's attach itself untimed: ``--only create``'s server
  spans time it).

The parts taken out are guarantees dsec keeps; the figures only say what each costs.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from dsec.agent.tools import sandbox_tree
from dsec.images.mount import overlay_mount, unmount_or_detach
from dsec.protocol.models import DEFAULT_DISK_MB, CreateRequest
from dsec.substrates.host import spawn
from dsec.substrates.host.cgroups import remove_cgroups, sandbox_dirs
from dsec.substrates.host.disk import DiskPool
from dsec.substrates.host.loop import unmount_image
from dsec.substrates.host.oci_spec import SECCOMP_BPF_ANNOTATION, container_config
from dsec.substrates.host.seccomp import container_filter_b64
from dsec.substrates.host.spawn import Spawned

from .bench import BARE_CGROUP_PARENT, IMAGE, BareCrun, Sample, bare_workspace, phase

Edit = Callable[[dict[str, Any]], None]
# After each run, untimed: the kernel tears a container's namespaces and loop device down in
# its own workers; without a pause that work lands in the next variant's figure.
SETTLE_S = 0.1


def _without_binds(c: dict[str, Any]) -> None:
    c["mounts"] = [m for m in c["mounts"] if m["type"] != "bind"]


def _without_netns(c: dict[str, Any]) -> None:
    c["linux"]["namespaces"] = [n for n in c["linux"]["namespaces"] if n["type"] != "network"]


def _without_limits(c: dict[str, Any]) -> None:
    c["linux"]["resources"] = {"devices": c["linux"]["resources"]["devices"]}


def _without_rlimits(c: dict[str, Any]) -> None:
    del c["process"]["rlimits"], c["process"]["oomScoreAdj"]


def _without_masks(c: dict[str, Any]) -> None:
    del c["linux"]["maskedPaths"], c["linux"]["readonlyPaths"]


def _without_seccomp(c: dict[str, Any]) -> None:
    del c["linux"]["seccomp"], c["annotations"][SECCOMP_BPF_ANNOTATION]


def _without_compiled_seccomp(c: dict[str, Any]) -> None:
    del c["annotations"][SECCOMP_BPF_ANNOTATION]


# name -> (edits of dsec's config, or None for crun spec's; the agent as init; the writable
# layer on its own disk)
VARIANTS: dict[str, tuple[tuple[Edit, ...] | None, bool, bool]] = {
    "crun spec's config, echo (baseline)": (None, False, False),
    "dsec's config, echo": ((), False, False),
    "  without seccomp": ((_without_seccomp,), False, False),
    "  the profile compiled by crun, not loaded compiled": ((_without_compiled_seccomp,), False, False),
    "  without cgroup limits (memory, cpu, pids)": ((_without_limits,), False, False),
    "  without masked/read-only paths": ((_without_masks,), False, False),
    "  without dsec's binds (/.dsec, run dir)": ((_without_binds,), False, False),
    "  without the network namespace": ((_without_netns,), False, False),
    "  without rlimit and OOM score": ((_without_rlimits,), False, False),
    "dsec's config, the agent as init (--detach, until R)": ((), True, False),
    "  and the writable layer on its own ext4 disk": ((), True, True),
}


async def create_parts_series(console: Console, quick: bool = False) -> list[Sample]:
    rounds = 5 if quick else 40
    with bare_workspace(console) as (root, bare):
        parts = Parts(root / "parts", bare)
        samples = {name: Sample(f"crun run, {name.strip()}", []) for name in VARIANTS}
        base = samples[next(iter(VARIANTS))]
        for name in VARIANTS:  # warm-up: page cache, the agent binary, the golden disk
            await parts.run(name)
        with phase(console, f"crun run, {len(VARIANTS)} variants round-robin, {rounds} rounds"):
            for _ in range(rounds):
                for name, sample in samples.items():
                    sample.add(list(await asyncio.gather(parts.run(name), return_exceptions=True)))
                    await asyncio.sleep(SETTLE_S)
        for sample in samples.values():
            sample.baseline = None if sample is base else base
    return list(samples.values())


class Parts:
    """Bundles of one variant each, on ``bare``'s layers, under ``root``."""

    def __init__(self, root: Path, bare: BareCrun) -> None:
        self.root, self.bare = root, bare
        root.mkdir()
        self.tree = str(sandbox_tree())
        self.seccomp = container_filter_b64()
        self.disks = DiskPool(root / "disks", (DEFAULT_DISK_MB,))
        self.disks.prepare()

    async def run(self, name: str) -> float:
        """ms from starting crun on a ready bundle to the first byte its container prints."""
        edits, agent, disk = VARIANTS[name]
        cid = "part-" + secrets.token_hex(4)
        d = self.root / cid
        try:
            self._bundle(d, cid, edits, agent, disk)
            t0 = time.perf_counter()
            crun = await Spawned.start(["crun", "--root", str(self.bare.state), "run",
                                        *(["--detach"] if agent else []), "--bundle", str(d),
                                        cid], capture_stdout=True, stderr=None)
            first = await crun.first_byte()
            elapsed = (time.perf_counter() - t0) * 1000
            await crun.wait()
            if first != (b"R" if agent else b"h"):
                raise RuntimeError(f"{name.strip()}: crun printed {first!r}")
            return elapsed
        finally:
            await spawn.run(["crun", "--root", str(self.bare.state), "delete", "--force", cid])
            if (d / "rootfs").is_mount():
                unmount_or_detach(d / "rootfs")
            if (d / "disk").is_mount():
                unmount_image(d / "disk", d / "disk.img", discard=True)
            remove_cgroups(sandbox_dirs(BARE_CGROUP_PARENT, cid))
            shutil.rmtree(d, ignore_errors=True)

    def _bundle(self, d: Path, cid: str, edits: tuple[Edit, ...] | None, agent: bool,
                disk: bool) -> None:
        d.mkdir()
        if disk:
            self.disks.attach(d / "disk.img", d / "disk", DEFAULT_DISK_MB)
        layer = d / "disk" if disk else d
        for sub in ("upper/.dsec", "upper/work", "work", "run"):
            (layer / sub).mkdir(parents=True, exist_ok=True)
        (d / "rootfs").mkdir()
        overlay_mount(self.bare.lowerdirs, layer / "upper", layer / "work", d / "rootfs")
        if edits is None:
            config = self.bare.config(cid, d / "rootfs", ["/bin/echo", "hi"])
        else:
            config = container_config(cid, CreateRequest(image=IMAGE), str(d / "rootfs"),
                                      self.tree, str(layer / "run"), BARE_CGROUP_PARENT,
                                      self.seccomp)
            for edit in edits:
                edit(config)
        if not agent:
            config["process"]["args"] = ["/bin/echo", "hi"]
        (d / "config.json").write_text(json.dumps(config))
