"""How a runtime start scales with the host's mount table (issue 15's density limit), measured.

A dense node holds two mounts per sandbox (its ext4 disk and its overlay rootfs) in the host's
mount namespace, and every ``crun run`` copies that namespace (``CLONE_NEWNS``) and then drops
the copy after ``pivot_root``: a cost in the size of the whole table, paid by every create on
the node. This lab times, with 0, 3,000 and 6,000 extra mounts in the table (the extra ones
tmpfs, as a node of 1,500 and 3,000 sandboxes has):

- a bare ``crun run`` of ``echo`` on IMAGE's layers (``bench.BareCrun.run_echo``);
- one ``mount(2)`` (not in the table's size: the table's lock is not the cost);
- what the remedy would cost a create: a thread's own mount namespace
  (``unshare(CLONE_FS | CLONE_NEWNS)``), made private, with one mount in it. Made from a host
  table without the sandboxes' mounts, each sandbox's mounts would live only in its own
  namespace and no create would copy another sandbox's.

``python -m dsec_benchmarks.mount_table [--rounds N]``, as root. The process first moves into
a private mount namespace of its own, so its mounts are invisible to the host and vanish with it.
Figures in docs/BENCHMARKS.md, "Density: what limits a node".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console

from dsec.images.mount import tmpfs_mount, unmount

from .bench import bare_workspace

CLONE_FS, CLONE_NEWNS = 0x200, 0x20000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
TMPFS_BYTES = 1 << 20  # each extra mount: empty, nothing is written to it


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _tmpfs(target: Path) -> None:
    target.mkdir(exist_ok=True)
    tmpfs_mount(target, TMPFS_BYTES)


def _private_namespace() -> None:
    """This thread (and what it starts after) in a private copy of its mount namespace."""
    _check(_libc.unshare(CLONE_FS | CLONE_NEWNS), "unshare")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")


def _mount_ms(probe: Path) -> float:
    t0 = time.perf_counter()
    _tmpfs(probe)
    elapsed = (time.perf_counter() - t0) * 1000
    unmount(probe)
    return elapsed


def _own_namespace_ms(target: Path) -> float:
    """ms for a fresh thread to take a private mount namespace of its own and mount in it."""
    took: list[float] = []

    def work() -> None:
        t0 = time.perf_counter()
        _private_namespace()
        _tmpfs(target)
        took.append((time.perf_counter() - t0) * 1000)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if not took:
        raise RuntimeError("the namespace thread failed")
    return took[0]


async def _measure(rounds: int, scratch: Path) -> None:
    console = Console()
    try:
        await _series(console, rounds, scratch)
    finally:  # the scratch dir's mounts, before it is removed (the probes are not mounted)
        for target in sorted(scratch.iterdir()):
            with contextlib.suppress(OSError):
                unmount(target)


async def _series(console: Console, rounds: int, scratch: Path) -> None:
    made = 0
    with bare_workspace(console) as (_, bare):
        for _ in range(3):  # warm-up: layers mounted, crun and the page cache warm
            await bare.run_echo()
        for extra in (0, 3000, 6000):
            while made < extra:
                _tmpfs(scratch / str(made))
                made += 1
            with open("/proc/self/mountinfo") as table:
                mounts = sum(1 for _ in table)
            runs = [await bare.run_echo() for _ in range(rounds)]
            mounts_ms = [_mount_ms(scratch / "probe") for _ in range(rounds)]
            own = [_own_namespace_ms(scratch / "own") for _ in range(rounds)]
            console.print(f"{mounts} mounts: bare crun run → first output p50 "
                          f"{statistics.median(runs):.1f} ms (p95 "
                          f"{statistics.quantiles(runs, n=20)[-1]:.1f}); mount(2) p50 "
                          f"{statistics.median(mounts_ms):.3f} ms; own namespace + private + "
                          f"one mount p50 {statistics.median(own):.2f} ms", soft_wrap=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("mount_table mounts and runs containers: run it as root")
    _private_namespace()  # before any other thread: the whole process, and what it starts
    with tempfile.TemporaryDirectory(prefix="dsec-mount-table-") as scratch:
        asyncio.run(_measure(args.rounds, Path(scratch)))


if __name__ == "__main__":
    main()
