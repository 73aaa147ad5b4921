"""What the per-sandbox disk quota costs on the create and destroy paths.

Against the baseline of a writable layer that is a plain directory (no quota), in alternating
batches: attaching a disk cloned from the golden image of a pooled size (FICLONE + loop
mount, on an edge's disk volume made for the run), and attaching one of a size with no golden
image (sparse file + mkfs.ext4 + loop mount); then the teardown of each (unmount + loop
release + removal against a directory's removal).
``python -m dsec_benchmarks.bench_disk [--rounds N]``; figures in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import sys
import time
from pathlib import Path

from rich.console import Console

from dsec.substrates.host.disk import DiskPool
from dsec.substrates.host.loop import unmount_image
from dsec.substrates.host.volume import DiskVolume

from .bench import Sample, compare, report

ROOT = Path("/run/dsec-bench")
POOLED_MB, UNPOOLED_MB = 1024, 1000


class DiskBench:
    def __init__(self, root: Path) -> None:
        self.volume = DiskVolume(root, "bench", size_gb=64)
        self.root = self.volume.root
        self.pool = DiskPool(self.root / "disks", (POOLED_MB,))
        self.made: list[tuple[Path, bool]] = []  # (dir, is a disk)

    def _new_dir(self) -> Path:
        d = self.root / secrets.token_hex(4)
        d.mkdir()
        return d

    async def plain(self) -> float:
        d = self._new_dir()
        t0 = time.perf_counter()
        (d / "disk" / "upper").mkdir(parents=True)
        (d / "disk" / "work").mkdir()
        self.made.append((d, False))
        return (time.perf_counter() - t0) * 1000

    async def disk(self, size_mb: int) -> float:
        d = self._new_dir()
        t0 = time.perf_counter()
        self.pool.attach(d / "disk.img", d / "disk", size_mb)
        (d / "disk" / "upper").mkdir()
        (d / "disk" / "work").mkdir()
        self.made.append((d, True))
        return (time.perf_counter() - t0) * 1000

    def teardown(self, is_disk: bool) -> float:
        d = next(d for d, disk in self.made if disk == is_disk)
        self.made.remove((d, is_disk))
        t0 = time.perf_counter()
        if is_disk:
            unmount_image(d / "disk", d / "disk.img")
        shutil.rmtree(d)
        return (time.perf_counter() - t0) * 1000


async def run(rounds: int) -> list[Sample]:
    root = ROOT / f"disk-{secrets.token_hex(3)}"
    root.mkdir(parents=True)
    bench = DiskBench(root)
    bench.volume.open()
    samples: list[Sample] = []
    try:
        bench.pool.prepare()  # formats the golden image
        samples += await compare(Sample("writable layer: plain directory", []), bench.plain,
                                 Sample("writable layer: disk cloned from the golden image", []),
                                 lambda: bench.disk(POOLED_MB), 1, rounds)
        samples += await compare(Sample("writable layer: plain directory (again)", []), bench.plain,
                                 Sample("writable layer: disk formatted on demand", []),
                                 lambda: bench.disk(UNPOOLED_MB), 1, rounds)

        async def teardown_plain() -> float:
            return bench.teardown(False)

        async def teardown_disk() -> float:
            return bench.teardown(True)
        samples += await compare(Sample("teardown: plain directory", []), teardown_plain,
                                 Sample("teardown: unmount, release loop, remove", []),
                                 teardown_disk, 1, rounds)
    finally:
        for d, is_disk in bench.made:
            if is_disk:
                unmount_image(d / "disk", d / "disk.img")
        bench.volume.close()
        shutil.rmtree(root, ignore_errors=True)
    return samples


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 50
    report(Console(), asyncio.run(run(rounds)))


if __name__ == "__main__":
    main()
