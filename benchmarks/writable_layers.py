"""Writable-layer designs for sandbox state (issues 14 and 15), measured on this kernel.

Each section times one design's create, snapshot, fork and rollback steps and checks that its
disk quota refuses a write past the limit: (ext4) today's ext4 image per sandbox on the host fs;
(xfs) the same images on one reflink XFS volume, copied by FICLONE; (frozen) the
freeze-free snapshot: cgroup freezer + syncfs + FICLONE under a busy writer; (btrfs) a subvolume per
sandbox with a simple-quota (squota) limit; (prj) whether project quotas (a directory per sandbox on one
volume) work at all; (erofs) packing an upper dir into an EROFS layer; (loops, subvols) N loop mounts or N
subvolumes at once, with host memory per sandbox. Root only; everything lives under
/var/tmp/dsec-design and is removed at the end.
``python -m dsec_benchmarks.writable_layers [section ...] [--rounds N] [--count N]``; the ext4
images are attached with dsec's own loop path (ioctls, no mount(8)); figures and the design
they led to in docs/BENCHMARKS.md and the issue-14 design note.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dsec.substrates.host.loop import loop_mount as dsec_loop_mount

ROOT = Path("/var/tmp/dsec-design")
GIB = 1 << 30
MKFS_EXT4 = ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "nodiscard"]
FICLONE, FIFREEZE, FITHAW = 0x40049409, 0xC0045877, 0xC0045878
BTRFS_IOC_SNAP_CREATE, BTRFS_IOC_SUBVOL_CREATE = 0x50009401, 0x5000940E
BTRFS_IOC_QUOTA_CTL, QUOTA_CTL_ENABLE_SIMPLE = 0xC0109428, 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
MS_RDONLY = 1


def sh(*cmd: str | Path) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"{' '.join(map(str, cmd))}: {done.stderr.strip()}")
    return done.stdout


def timed(*steps: Callable[..., object]) -> float:
    """ms for ``steps`` run in turn (each called with no arguments; ``lambda i=i:`` binds a
    loop's variable)."""
    start = time.perf_counter()
    for step in steps:
        step()
    return (time.perf_counter() - start) * 1000


def show(name: str, samples: list[float]) -> None:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    print(f"  {name:<58} p50 {statistics.median(ordered):9.2f} ms  p95 {p95:9.2f} ms"
          f"  (n={len(ordered)})", flush=True)


def umount(target: Path) -> None:
    if _libc.umount2(os.fsencode(target), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def loop_mount(image: Path, target: Path, fstype: str = "ext4", opts: str = "") -> None:
    """An ext4 image the way dsec attaches it; other file systems through mount(8)."""
    target.mkdir(parents=True, exist_ok=True)
    if fstype == "ext4" and not opts:
        dsec_loop_mount(image, target)
    else:
        sh("mount", "-t", fstype, "-o", ",".join(filter(None, ["loop", opts])), image, target)


def loop_devices_of(image: Path) -> list[str]:
    """Loop devices backed by ``image``: a scan of every device (dsec itself reads the one
    device of a mount, host/loop.py; this lab script waits on many images at once)."""
    target = os.path.realpath(image)
    return [b.parent.parent.name for b in Path("/sys/block").glob("loop*/loop/backing_file")
            if b.read_text().strip().removesuffix(" (deleted)") == target]


def detached(images: list[Path]) -> float:
    """Wait until no loop device is backed by ``images`` (autoclear is asynchronous); ms."""
    start = time.perf_counter()
    while any(loop_devices_of(image) for image in images[-1:] + images[:1]):
        time.sleep(0.01)
    return (time.perf_counter() - start) * 1000


def file_mount(image: Path, target: Path) -> None:
    """EROFS straight from a file (CONFIG_EROFS_FS_BACKED_BY_FILE): no loop device."""
    if _libc.mount(os.fsencode(image), os.fsencode(target), b"erofs", MS_RDONLY, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {image}: {os.strerror(err)}")


def fs_ioctl(path: Path, request: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, request, 0)
    finally:
        os.close(fd)


def syncfs(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), f"syncfs {path}")
    finally:
        os.close(fd)


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy only the data extents of ``src`` (SEEK_DATA / SEEK_HOLE, copy_file_range)."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        fout.truncate(size)
        pos = 0
        while pos < size:
            try:
                data = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            hole = os.lseek(fin.fileno(), data, os.SEEK_HOLE)
            left, off = hole - data, data
            while left:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), left, off, off)
                left, off = left - n, off + n
            pos = hole


def reflink(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())


def allocated_mb(path: Path) -> float:
    return os.stat(path).st_blocks * 512 / 1e6


def write_files(directory: Path, count: int, size: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (directory / f"f{i}").write_bytes(os.urandom(size))


def dirty(directory: Path, megabytes: int) -> None:
    with open(directory / "big", "wb") as f:
        for _ in range(megabytes):
            f.write(os.urandom(1 << 20))


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":")
        out[key] = int(value.split()[0])
    return out


def used_kb() -> int:
    info = meminfo()
    return info["MemTotal"] - info["MemAvailable"]


@contextlib.contextmanager
def volume(name: str, fstype: str, size: int, mkfs: list[str], opts: str = "") -> Iterator[Path]:
    """One big sparse file with one file system, loop-mounted once."""
    image, target = ROOT / f"{name}.vol", ROOT / name
    with open(image, "wb") as f:
        f.truncate(size)
    sh(*mkfs, image)
    loop_mount(image, target, fstype, opts)
    try:
        yield target
    finally:
        subprocess.run(["sync", "-f", target])
        sh("umount", "-R", target)
        image.unlink()


def ext4_images(base: Path, rounds: int, copy: Callable[[Path, Path], None], label: str) -> None:
    """Today's design (one ext4 image per sandbox) with images kept in ``base``."""
    images = base / "img"
    images.mkdir(exist_ok=True)

    def fmt(i: int) -> None:
        with open(images / f"m{i}.img", "wb") as f:
            f.truncate(GIB)
        sh(*MKFS_EXT4, images / f"m{i}.img")

    show(f"[{label}] mkfs.ext4 of a 1 GiB sparse image",
         [timed(lambda i=i: fmt(i)) for i in range(rounds)])
    show(f"[{label}] take a spare (rename)",
         [timed(lambda i=i: os.rename(images / f"m{i}.img", images / f"s{i}.img"))
          for i in range(rounds)])
    mnt = [base / f"mnt{i}" for i in range(rounds)]
    show(f"[{label}] loop attach + mount", [timed(lambda i=i: loop_mount(images / f"s{i}.img",
                                                                       mnt[i]))
                                          for i in range(rounds)])
    print(f"  [{label}] a fresh mounted image allocates {allocated_mb(images / 's0.img'):.1f} MB")
    for i in range(rounds):
        write_files(mnt[i] / "upper", 5, 4096)
    show(f"[{label}] FIFREEZE + FITHAW (small diff)",
         [timed(lambda i=i: fs_ioctl(mnt[i], FIFREEZE), lambda i=i: fs_ioctl(mnt[i], FITHAW))
          for i in range(rounds)])

    def snapshot(i: int, tag: str) -> None:
        fs_ioctl(mnt[i], FIFREEZE)
        try:
            copy(images / f"s{i}.img", images / f"{tag}{i}.img")
        finally:
            fs_ioctl(mnt[i], FITHAW)

    show(f"[{label}] snapshot: freeze + copy image + thaw (small diff)",
         [timed(lambda i=i: snapshot(i, "snap")) for i in range(rounds)])
    def synced_snapshot(i: int, tag: str) -> None:
        """syncfs instead of a freeze: consistent only while the sandbox's processes are
        stopped (cgroup freezer), which a filesystem snapshot may do anyway."""
        syncfs(mnt[i])
        copy(images / f"s{i}.img", images / f"{tag}{i}.img")

    show(f"[{label}] snapshot: syncfs + copy image (small diff)",
         [timed(lambda i=i: synced_snapshot(i, "synced")) for i in range(rounds)])
    show(f"[{label}] fork child: copy snapshot image",
         [timed(lambda i=i: copy(images / "snap0.img", images / f"child{i}.img"))
          for i in range(rounds)])

    def rollback(i: int) -> None:
        umount(mnt[i])
        copy(images / f"snap{i}.img", images / f"s{i}.img")
        loop_mount(images / f"s{i}.img", mnt[i])

    for i in range(rounds):
        write_files(mnt[i] / "upper", 3, 4096)
    show(f"[{label}] rollback: umount + copy back + mount (small diff)",
         [timed(lambda i=i: rollback(i)) for i in range(rounds)])
    big = max(3, rounds // 4)
    for i in range(big):
        dirty(mnt[i] / "upper", 100)
    show(f"[{label}] snapshot: freeze + copy + thaw (100 MB dirty)",
         [timed(lambda i=i: snapshot(i, "bigsnap")) for i in range(big)])
    for i in range(big):
        dirty(mnt[i] / "upper", 100)
    show(f"[{label}] snapshot: syncfs + copy (100 MB dirty)",
         [timed(lambda i=i: synced_snapshot(i, "bigsynced")) for i in range(big)])
    show(f"[{label}] rollback (100 MB dirty)", [timed(lambda i=i: rollback(i)) for i in range(big)])
    write_rate(mnt[0] / "rate", label)
    show(f"[{label}] teardown: umount + unlink",
         [timed(lambda i=i: umount(mnt[i]), lambda i=i: os.unlink(images / f"s{i}.img"))
          for i in range(rounds)])
    shutil.rmtree(images)


def section_ext4(rounds: int) -> None:
    base = ROOT / "ext4"
    base.mkdir()
    try:
        ext4_images(base, rounds, sparse_copy, "ext4 on host ext4, sparse copy")
    finally:
        shutil.rmtree(base)


def section_xfs(rounds: int) -> None:
    mkfs = ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"]
    start = time.perf_counter()
    with volume("xfs", "xfs", 64 * GIB, mkfs) as vol:
        print(f"  [xfs] one-off: 64 GiB sparse volume mkfs + mount "
              f"{(time.perf_counter() - start) * 1000:.0f} ms")
        ext4_images(vol, rounds, reflink, "ext4 images on reflink XFS, FICLONE")


def btrfs_subvol(parent: Path, name: str) -> None:
    args = bytearray(struct.pack("=q4088s", 0, name.encode()))  # > 1024 bytes: a buffer
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, args)
    finally:
        os.close(fd)


def btrfs_snapshot(source: Path, parent: Path, name: str) -> None:
    src = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SNAP_CREATE,
                    bytearray(struct.pack("=q4088s", src, name.encode())))
    finally:
        os.close(fd)
        os.close(src)


def quota_refuses(directory: Path, megabytes: int) -> str:
    """Write ``megabytes`` in 1 MB chunks, fsync; the error that stopped it, if any."""
    try:
        with open(directory / "fill", "wb") as f:
            for _ in range(megabytes):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        fill = directory / "fill"
        written = fill.stat().st_size >> 20 if fill.exists() else 0
        return f"refused after {written} MB: {exc.strerror}"
    return f"NOT refused: wrote {megabytes} MB"


def write_rate(directory: Path, label: str) -> None:
    directory.mkdir(exist_ok=True)
    mb = 200
    ms = timed(lambda: dirty(directory, mb), os.sync)
    files = 2000
    fms = timed(lambda: write_files(directory / "many", files, 512), os.sync)
    print(f"  [{label}] {mb} MB sequential {mb / ms * 1000:.0f} MB/s;"
          f" {files} small files {fms * 1000 / files:.0f} us/file")


def section_btrfs(rounds: int) -> None:
    with volume("btrfs", "btrfs", 64 * GIB, ["mkfs.btrfs", "-q", "-f"]) as vol:
        write_rate(vol / "noquota", "btrfs without quota")
        show("[btrfs] subvolume create (ioctl)",
             [timed(lambda i=i: btrfs_subvol(vol, f"plain{i}")) for i in range(rounds)])
        btrfs_quota(vol, "simple")
        write_rate(vol / "quota-on", "btrfs with simple quotas on")
        sv = [vol / f"sb{i}" for i in range(rounds)]
        show("[btrfs] subvolume create (ioctl), simple quotas on",
             [timed(lambda i=i: btrfs_subvol(vol, f"sb{i}")) for i in range(rounds)])
        show("[btrfs] qgroup limit 1G (btrfs qgroup limit, fork+exec)",
             [timed(lambda i=i: sh("btrfs", "qgroup", "limit", "1G", sv[i]))
              for i in range(rounds)])
        lower = ROOT / "lower"
        write_files(lower / "etc", 20, 1024)
        for i in range(rounds):
            (sv[i] / "upper").mkdir()
            (sv[i] / "work").mkdir()
        mnt = [ROOT / f"ovl{i}" for i in range(rounds)]
        for m in mnt:
            m.mkdir()
        show("[btrfs] overlay mount with a btrfs upper",
             [timed(lambda i=i: sh("mount", "-t", "overlay", "overlay", "-o",
                                   f"lowerdir={lower},upperdir={sv[i]}/upper,"
                                   f"workdir={sv[i]}/work", mnt[i]))
              for i in range(rounds)])
        for i in range(rounds):
            write_files(mnt[i] / "etc", 5, 4096)  # copy-up of the lower dir + 5 files
        show("[btrfs] snapshot subvolume (small diff, no freeze)",
             [timed(lambda i=i: btrfs_snapshot(sv[i], vol, f"snap{i}")) for i in range(rounds)])
        show("[btrfs] fork child: snapshot of a snapshot",
             [timed(lambda i=i: btrfs_snapshot(vol / "snap0", vol, f"child{i}"))
              for i in range(rounds)])
        show("[btrfs] fork child: snapshot + qgroup limit",
             [timed(lambda i=i: btrfs_snapshot(vol / "snap0", vol, f"childq{i}"),
                   lambda i=i: sh("btrfs", "qgroup", "limit", "1G", vol / f"childq{i}"))
              for i in range(rounds)])

        def rollback(i: int) -> None:
            umount(mnt[i])
            os.rename(sv[i], vol / f"old{i}")
            btrfs_snapshot(vol / f"snap{i}", vol, f"sb{i}")
            sh("mount", "-t", "overlay", "overlay", "-o",
               f"lowerdir={lower},upperdir={sv[i]}/upper,workdir={sv[i]}/work", mnt[i])

        for i in range(rounds):
            write_files(mnt[i] / "etc", 3, 4096)
        show("[btrfs] rollback: umount ovl + rename + snapshot + mount ovl",
             [timed(lambda i=i: rollback(i)) for i in range(rounds)])
        show("[btrfs] drop old subvolume (btrfs subvolume delete)",
             [timed(lambda i=i: sh("btrfs", "subvolume", "delete", vol / f"old{i}"))
              for i in range(rounds)])
        big = max(3, rounds // 4)
        for i in range(big):
            dirty(mnt[i] / "etc", 100)
        show("[btrfs] snapshot subvolume (100 MB dirty, incl. its flush)",
             [timed(lambda i=i: btrfs_snapshot(sv[i], vol, f"bigsnap{i}")) for i in range(big)])
        for m in mnt:
            umount(m)
        btrfs_subvol(vol, "qtest")
        (vol / "qtest" / "upper").mkdir()
        (vol / "qtest" / "work").mkdir()
        sh("btrfs", "qgroup", "limit", "50M", vol / "qtest")
        sh("mount", "-t", "overlay", "overlay", "-o",
           f"lowerdir={lower},upperdir={vol}/qtest/upper,workdir={vol}/qtest/work", mnt[0])
        print(f"  [btrfs] qgroup limit 50M through overlay, write 100 MB: "
              f"{quota_refuses(mnt[0], 100)}")
        umount(mnt[0])
        btrfs_snapshot(vol / "qtest", vol, "qtest-child")
        print("  [btrfs] the snapshot's qgroup (limit inherited?): "
              + sh("btrfs", "qgroup", "show", "-re", vol).splitlines()[-1])
        shutil.rmtree(lower)


def section_prj() -> None:
    """Project quotas (a directory per sandbox on one volume) need the kernel's quota formats."""
    cases = {"xfs": (["mkfs.xfs", "-q", "-f"], "prjquota"),
             "ext4": (["mkfs.ext4", "-q", "-F", "-O", "quota,project"], "")}
    for fstype, (mkfs, opts) in cases.items():
        try:
            with volume(f"prj-{fstype}", fstype, 4 * GIB, mkfs, opts):
                print(f"  [prj] {fstype} with project quotas mounts")
        except OSError:
            print(f"  [prj] {fstype} with project quotas refused: " + sh("dmesg").splitlines()[-1])
            (ROOT / f"prj-{fstype}.vol").unlink(missing_ok=True)


def wait_frozen(cgroup: Path, state: str) -> None:
    while f"frozen {state}" not in (cgroup / "cgroup.events").read_text():
        time.sleep(0.0002)


def section_frozen(rounds: int) -> None:
    for pause, label in (("0.001", "4 KiB/ms writer"), ("0", "writer flat out")):
        frozen_snapshots(rounds, pause, label)


def frozen_snapshots(rounds: int, pause: str, label: str) -> None:
    """The freeze-free snapshot end to end: a writer keeps appending 4 KiB records to a file
    in a sandbox's ext4 image (on reflink XFS), sleeping ``pause`` s between them;
    cgroup-freeze it, syncfs, FICLONE, thaw; then check each snapshot image mounts and holds
    whole records only."""
    cgroup = Path("/sys/fs/cgroup/unified/dsec-design-bench")
    cgroup.mkdir()
    writer = None
    try:
        with volume("fxfs", "xfs", 8 * GIB, ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"]) as vol:
            image, mnt = vol / "sb.img", vol / "sb"
            with open(image, "wb") as f:
                f.truncate(GIB)
            sh(*MKFS_EXT4, image)
            loop_mount(image, mnt)
            writer = subprocess.Popen(
                ["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs; exec python3 -c \""
                 f"import os\nf = open('{mnt}/log', 'ab', buffering=0)\n"
                 f"import time\n"
                 f"while True: f.write(b'x' * 4095 + bytes([10])); time.sleep({pause})\""])
            time.sleep(0.5)
            freeze, snap = [], []
            for i in range(rounds):
                start = time.perf_counter()
                (cgroup / "cgroup.freeze").write_text("1")
                wait_frozen(cgroup, "1")
                frozen = time.perf_counter()
                syncfs(mnt)
                reflink(image, vol / f"snap{i}.img")
                (cgroup / "cgroup.freeze").write_text("0")
                wait_frozen(cgroup, "0")
                freeze.append((frozen - start) * 1000)
                snap.append((time.perf_counter() - start) * 1000)
                time.sleep(0.05)
            writer.kill()
            writer.wait()
            show(f"[frozen, {label}] cgroup freeze (until frozen)", freeze)
            show(f"[frozen, {label}] snapshot: freeze + syncfs + FICLONE + thaw", snap)
            torn = 0
            for i in range(rounds):
                loop_mount(vol / f"snap{i}.img", vol / f"check{i}")
                torn += (vol / f"check{i}" / "log").stat().st_size % 4096 != 0
                umount(vol / f"check{i}")
            print(f"  [frozen, {label}] {rounds} snapshot images mounted;"
                  f" with a torn last record: {torn}")
            umount(mnt)
            detached([image] + [vol / f"snap{i}.img" for i in range(rounds)])
    finally:
        if writer and writer.poll() is None:
            writer.kill()
            writer.wait()
        cgroup.rmdir()


def section_erofs(rounds: int) -> None:
    upper = ROOT / "erofs-upper"
    write_files(upper / "etc", 5, 4096)
    os.mknod(upper / "etc" / "gone", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout
    show("[erofs] mkfs.erofs of a small upper dir (5 files + whiteout)",
         [timed(lambda: sh("mkfs.erofs", "--quiet", ROOT / "small.erofs", upper))
          for _ in range(rounds)])
    dirty(upper, 100)
    show("[erofs] mkfs.erofs of a 100 MB upper dir",
         [timed(lambda: sh("mkfs.erofs", "--quiet", ROOT / "big.erofs", upper))
          for _ in range(max(3, rounds // 4))])
    show("[erofs] mkfs.erofs -zlz4 of a 100 MB upper dir (random data)",
         [timed(lambda: sh("mkfs.erofs", "--quiet", "-zlz4", ROOT / "bigz.erofs", upper))
          for _ in range(3)])
    target = ROOT / "erofs-mnt"
    show("[erofs] mount + umount the small layer (mount(8), loop device)",
         [timed(lambda: loop_mount(ROOT / "small.erofs", target, "erofs", "ro"),
               lambda: umount(target)) for _ in range(rounds)])
    show("[erofs] mount + umount the small layer (mount(2) of the file, no loop device)",
         [timed(lambda: file_mount(ROOT / "small.erofs", target), lambda: umount(target))
          for _ in range(rounds)])
    shutil.rmtree(upper)


def section_loops(count: int) -> None:
    """``count`` loop-mounted ext4 images (reflinked from one spare) at once: time per mount
    as they accumulate, host memory and kernel tasks per mount."""
    with volume("dxfs", "xfs", 16 * GIB, ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"]) as vol:
        spare = vol / "spare.img"
        with open(spare, "wb") as f:
            f.truncate(GIB)
        sh(*MKFS_EXT4, spare)
        mounts: list[Path] = []
        before, tasks = used_kb(), len(os.listdir("/proc"))
        per_mount: list[float] = []
        try:
            for i in range(count):
                reflink(spare, vol / f"d{i}.img")
                per_mount.append(timed(lambda i=i: loop_mount(vol / f"d{i}.img", vol / f"m{i}")))
                mounts.append(vol / f"m{i}")
            time.sleep(2)
            delta = used_kb() - before
            print(f"  [density] {count} loop ext4 mounts: host memory {delta / count:.0f} KiB"
                  f" each, kernel tasks +{len(os.listdir('/proc')) - tasks},"
                  f" loop devices now {len(list(Path('/sys/block').glob('loop*')))}")
            tenth = max(1, count // 10)
            show("[density] loop attach + mount, first tenth", per_mount[:tenth])
            show("[density] loop attach + mount, last tenth", per_mount[-tenth:])
        finally:
            t1 = time.perf_counter()
            for m in mounts:
                umount(m)
            took = time.perf_counter() - t1 + detached([vol / f"d{i}.img" for i in
                                                        range(len(mounts))]) / 1000
            print(f"  [density] unmount {len(mounts)} and wait for their loop devices: "
                  f"{took * 1000 / max(1, len(mounts)):.1f} ms each")


def slab_kb() -> int:
    info = meminfo()
    return info["Slab"] + info["KernelStack"] + info["PageTables"]


def btrfs_quota(vol: Path, mode: str) -> None:
    """``qgroups`` (full accounting) through btrfs-progs; ``simple`` (squota, kernel 6.7+)
    through the ioctl, as btrfs-progs 6.2 cannot enable it."""
    if mode == "qgroups":
        sh("btrfs", "quota", "enable", vol)
    elif mode == "simple":
        fd = os.open(vol, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, BTRFS_IOC_QUOTA_CTL, struct.pack("=QQ", QUOTA_CTL_ENABLE_SIMPLE, 0))
        finally:
            os.close(fd)


def section_subvols(count: int) -> None:
    for quota in ("none", "simple", "qgroups"):
        btrfs_density(count, quota)


def btrfs_density(count: int, quota: str) -> None:
    """``count`` snapshots of a prepared 20 MB subvolume on one btrfs volume."""
    with volume("dbtrfs", "btrfs", 16 * GIB, ["mkfs.btrfs", "-q", "-f"]) as vol:
        btrfs_quota(vol, quota)
        btrfs_subvol(vol, "base")
        write_files(vol / "base" / "upper", 200, 100_000)
        if quota != "none":
            sh("btrfs", "qgroup", "limit", "1G", vol / "base")
        os.sync()
        before = slab_kb()
        per_snap = [timed(lambda i=i: btrfs_snapshot(vol / "base", vol, f"sb{i}"))
                    for i in range(count)]
        os.sync()
        label = f"[density, btrfs quota={quota}]"
        print(f"  {label} {count} snapshots of a 20 MB base: kernel memory (slab, stacks,"
              f" page tables) {(slab_kb() - before) / count:.0f} KiB each")
        tenth = max(1, count // 10)
        show(f"{label} snapshot, first tenth", per_snap[:tenth])
        show(f"{label} snapshot, last tenth", per_snap[-tenth:])
        ms = timed(*(lambda i=i: write_files(vol / f"sb{i}" / "upper", 5, 4096)
                     for i in range(0, count, 10)), os.sync)
        print(f"  {label} 5 small writes in each of {len(range(0, count, 10))} subvolumes"
              f" + sync: {ms:.0f} ms")
        if quota != "none":
            show(f"{label} qgroup limit (fork+exec) with {count} qgroups",
                 [timed(lambda i=i: sh("btrfs", "qgroup", "limit", "2G", vol / f"sb{i}"))
                  for i in range(0, count, max(1, count // 20))])
            if quota == "simple":
                probe = vol / "probe"
                btrfs_snapshot(vol / "base", vol, "probe")
                sh("btrfs", "qgroup", "limit", "30M", probe)
                print(f"  {label} limit 30M on a fork of the 20 MB base, write 100 MB:"
                      f" {quota_refuses(probe / 'upper', 100)}")
        show(f"{label} subvolume delete (fork+exec)",
             [timed(lambda i=i: sh("btrfs", "subvolume", "delete", vol / f"sb{i}"))
              for i in range(0, count, max(1, count // 20))])


SECTIONS = ("ext4", "xfs", "frozen", "btrfs", "prj", "erofs", "loops", "subvols")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--count", type=int, default=1000)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("root only")
    ROOT.mkdir(parents=True, exist_ok=True)
    try:
        for name in args.sections:
            print(f"== {name}  {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC",
                  flush=True)
            if name == "prj":
                section_prj()
            elif name in ("loops", "subvols"):
                globals()[f"section_{name}"](args.count)
            else:
                globals()[f"section_{name}"](args.rounds)
    finally:
        subprocess.run(["umount", "-R", "-q", *map(str, ROOT.glob("*"))], capture_output=True)
        shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    main()
