"""What a VM sandbox boots: the host's Debian guest kernel and a tiny initramfs.

The initramfs holds busybox (static), the kernel modules the guest needs (the Debian cloud
kernel builds virtio, erofs and overlayfs as modules), the dsec agent and ``/init``. The init
mounts the image's read-only EROFS layers (one virtio disk each) under an overlay whose
writable layer is the sandbox's own ext4 disk, then becomes the agent (``switch_root`` +
``exec``), listening on TCP: the edge reaches it through QEMU's loopback port forward, on the
NIC the init names ``agent0``; ``eth0`` is the NIC network policies use (``substrates/vm/vmnet.py``).

The agent is claimed out of band: it takes its token from the virtio-serial port
``dsec.boot`` (``--token-from``), whose host end is a Unix socket in the sandbox's root-only
directory, and serves nothing before. dsec's own execution path in the guest is
``/.dsec/bin`` (busybox, with ``sh`` and ``tar``) and ``/.dsec/agent``, on a tmpfs the init
fills from the initramfs and remounts read-only; commands run ``--confine``d (agent.c): without
the capabilities to remount or mount over it, ptrace the agent, load kernel code or take
over the agent's NIC. The kernel's usermode helpers, which it starts as root from paths in
the sandbox's file system (``/sbin/request-key`` on any ``request_key``; ``modprobe``; a
``core_pattern`` pipe), get no capabilities (``kernel.usermodehelper.bset`` is empty);
module auto-loading is off (every module the guest needs is loaded by the init); and
``/proc/sys`` and ``/sys`` are read-only, so none of that can be changed back. The serial
console (a file on the host's disk) has no device node once the agent holds it.

Disks are found by their virtio serial (``layer0`` .. ``layerN-1``, ``rw``), not by probe order.
Built artefacts (the initramfs, and the kernel unpacked for PVH entry) are cached under
``$DSEC_CACHE/vm/<digest>/``, keyed by everything they hold.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...agent.build import agent_binary
from ...agent.tools import HOST_SHELL, install_tools
from ...config import current
from ...protocol.errors import NotSupported
from .vmnet import AGENT_MAC, POLICY_MAC

AGENT_PORT = 7000  # inside the guest
BOOT_PORT = "dsec.boot"  # the virtio-serial port that carries the agent's token
# What the agent prints on the console, on a line of its own, once it listens (agent.c's
# CONSOLE_READY): text no firmware or kernel prints, where a single `R` would be found early in
# SeaBIOS's "Booting from ROM..". (The console's tty turns the line's \n into \r\n.)
CONSOLE_READY = b"dsec-agent: listening"
GUEST_IP = "10.0.2.15/24"  # QEMU user networking's fixed guest address; no route beyond its subnet
BUSYBOX = Path("/bin/busybox")
# Loaded in this order; a module the kernel has built in is simply absent from modules.dep.
MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_pci_legacy_dev",
           "virtio_pci_modern_dev", "virtio_pci", "virtio_blk", "failover", "net_failover",
           "virtio_net", "virtio_console", "libcrc32c", "erofs", "overlay")

INIT = r"""#!/bin/busybox sh
# dsec guest init: mount the image, then become the agent.
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.order); do insmod /modules/$m.ko 2>/dev/null; done
cmdline=$(cat /proc/cmdline)
arg() { for kv in $cmdline; do case $kv in dsec.$1=*) echo "${kv#*=}";; esac; done; }
fail() { echo "dsec-init: $*" > /dev/console; poweroff -f; }
disk() {  # the block device whose virtio serial is $1 (devices appear as drivers bind)
  for i in $(seq 500); do
    for s in /sys/block/vd*/serial; do
      [ -e "$s" ] && [ "$(cat $s)" = "$1" ] && { d=${s%/serial}; echo /dev/${d##*/}; return; }
    done
    usleep 10000
  done
  fail "no disk with serial $1"
}
layers=$(arg layers)
lower=""
i=0
while [ "$i" -lt "$layers" ]; do
  mkdir -p /layers/$i
  mount -t erofs -o ro "$(disk layer$i)" /layers/$i || fail "cannot mount layer $i"
  lower="/layers/$i${lower:+:$lower}"
  i=$((i + 1))
done
mkdir -p /rw
mount -t ext4 "$(disk rw)" /rw || fail "cannot mount the writable disk"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o "lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work" /newroot \
  || fail "cannot mount the overlay"
for d in proc sys dev tmp work .dsec; do mkdir -p /newroot/$d; done
mount -t tmpfs -o mode=0755 dsec /newroot/.dsec
mkdir /newroot/.dsec/run /newroot/.dsec/bin
cp /dsec-agent /newroot/.dsec/agent
cp -a /dsec-bin/. /newroot/.dsec/bin/
mount -o remount,ro /newroot/.dsec
mount -t tmpfs -o mode=0700 run /newroot/.dsec/run
nic() {  # the interface whose MAC address is $1
  for a in /sys/class/net/*/address; do
    [ "$(cat $a)" = "$1" ] && { n=${a%/address}; echo ${n##*/}; return; }
  done
  fail "no network interface with MAC $1"
}
ip link set "$(nic @AGENT_MAC@)" name agent0
ip link set "$(nic @POLICY_MAC@)" name eth0
ip link set lo up
ip link set agent0 up
ip addr add @GUEST_IP@ dev agent0
port() {  # the device of the virtio-serial port named $1 (ports appear as the host adds them)
  for i in $(seq 500); do
    for n in /sys/class/virtio-ports/*/name; do
      [ -e "$n" ] && [ "$(cat $n)" = "$1" ] && { p=${n%/name}; echo /dev/${p##*/}; return; }
    done
    usleep 10000
  done
  fail "no virtio-serial port named $1"
}
boot=$(port @BOOT_PORT@)
# The kernel starts usermode helpers (request-key, modprobe, a core_pattern pipe) as root from
# paths in the sandbox's file system: they get no capabilities at all; module auto-loading
# is off (everything needed is loaded above); /proc/sys and /sys are read-only below.
for set in bset inheritable; do
  echo "0 0" > /proc/sys/kernel/usermodehelper/$set || fail "cannot limit usermode helpers"
done
echo > /proc/sys/kernel/modprobe || fail "cannot turn module auto-loading off"
# The console is a file on the host's disk, outside the sandbox's quota: from here on the kernel
# prints only emergencies on it (not, say, each OOM kill's report), no command can write the
# kernel's log (/dev/kmsg: removed below) or run sysrq (whose output ignores the level).
echo 1 > /proc/sys/kernel/printk || fail "cannot quiet the kernel's console"
[ ! -e /proc/sysrq-trigger ] || { mount --bind /proc/sysrq-trigger /proc/sysrq-trigger \
  && mount -o remount,bind,ro /proc/sysrq-trigger; } || fail "cannot make sysrq-trigger read-only"
mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys \
  && mount -o remount,bind,ro /sys || fail "cannot make /proc/sys and /sys read-only"
for fs in proc sys dev; do  # with what is mounted below them
  mount --move /$fs /newroot/$fs || fail "the image has no /$fs directory to mount on"
done
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
# The serial console is a file on the host's disk (QEMU's console.log): once the agent holds it
# (its stdout, for CONSOLE_READY and boot errors), no node leads to it, nor to the kernel's log
# (and commands cannot mknod one).
rm -f /newroot/dev/console /newroot/dev/ttyS* /newroot/dev/kmsg \
  || fail "cannot remove the console's device nodes"
exec switch_root /newroot /.dsec/agent --listen tcp:@AGENT_ADDRESS@:@AGENT_PORT@ \
  --token-from "$boot" --confine
"""


# A bzImage's payload, by its first bytes, and what unpacks it (lz4 for Debian's kernels).
DECOMPRESSORS = {b"\x02\x21\x4c\x18": ["lz4", "-dc"], b"\x28\xb5\x2f\xfd": ["zstd", "-dc"],
                 b"\xfd7zXZ\x00": ["xz", "-dc"], b"\x1f\x8b\x08": ["gzip", "-dc"]}


@dataclass(frozen=True)
class GuestBoot:
    kernel: Path  # the bzImage, booted through firmware
    initramfs: Path
    pvh_kernel: Path | None  # the same kernel uncompressed, entered directly (PVH), if possible


def find_kernel() -> Path:
    """The host's Debian guest kernel: the cloud flavour (virtio, small) if installed."""
    kernels = sorted(Path("/boot").glob("vmlinuz-*-cloud-amd64")) or sorted(Path("/boot").glob("vmlinuz-*"))
    if not kernels:
        raise NotSupported("no guest kernel: install linux-image-cloud-amd64")
    return kernels[-1]


def guest_boot() -> GuestBoot:
    """The kernel and the initramfs for it, building the initramfs once per content."""
    kernel = find_kernel()
    release = kernel.name.removeprefix("vmlinuz-")
    modules = _module_files(Path("/lib/modules") / release)
    agent = agent_binary()
    init = (INIT.replace("@GUEST_IP@", GUEST_IP)
            .replace("@AGENT_MAC@", AGENT_MAC).replace("@POLICY_MAC@", POLICY_MAC)
            .replace("@AGENT_ADDRESS@", GUEST_IP.split("/")[0]).replace("@AGENT_PORT@", str(AGENT_PORT))
            .replace("@BOOT_PORT@", BOOT_PORT))
    digest = hashlib.sha256()
    for part in (b"initramfs+pvh", kernel.read_bytes(), BUSYBOX.read_bytes(), HOST_SHELL.read_bytes(),
                 agent.read_bytes(), init.encode(),
                 *(f"{name}\0".encode() + path.read_bytes() for name, path in modules)):
        digest.update(hashlib.sha256(part).digest())
    out_dir = current().cache / "vm" / digest.hexdigest()[:16]
    initramfs, vmlinux = out_dir / "initramfs.cpio", out_dir / "vmlinux"
    if not initramfs.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not initramfs.exists():
                _extract_pvh_kernel(kernel, release, vmlinux)
                _build_initramfs(initramfs, init, agent, modules)
    return GuestBoot(kernel, initramfs, vmlinux if vmlinux.exists() else None)


def _extract_pvh_kernel(kernel: Path, release: str, target: Path) -> None:
    """Unpack the bzImage's payload (an ELF vmlinux) when the kernel has a PVH entry point:
    QEMU then jumps straight into it, with no firmware. Left absent when it cannot be done."""
    config = Path("/boot") / f"config-{release}"
    if not config.exists() or "CONFIG_PVH=y" not in config.read_text():
        return
    data = kernel.read_bytes()
    setup_sects = data[0x1F1] or 4
    offset, length = struct.unpack_from("<II", data, 0x248)  # payload_offset, payload_length
    payload = data[(setup_sects + 1) * 512 + offset:][:length]
    for magic, argv in DECOMPRESSORS.items():
        if payload.startswith(magic) and shutil.which(argv[0]):
            # The kernel appends the unpacked size after the stream: a decompressor may exit
            # non-zero over that trailer after writing the whole image, so the ELF header decides.
            done = subprocess.run(argv, input=payload, capture_output=True, check=False)
            if done.stdout.startswith(b"\x7fELF"):
                part = target.with_suffix(".part")
                part.write_bytes(done.stdout)
                os.replace(part, target)
            return


def _module_files(moddir: Path) -> list[tuple[str, Path]]:
    """(name, file) of each wanted module this kernel has as a module, in load order."""
    if not BUSYBOX.exists():
        raise NotSupported("busybox-static is not installed (needed for the VM guest's init)")
    try:
        deps = (moddir / "modules.dep").read_text().splitlines()
    except FileNotFoundError:
        raise NotSupported(f"no kernel modules for the guest kernel in {moddir}") from None
    by_name = {}
    for line in deps:
        rel = line.split(":", 1)[0]
        name = Path(rel).name.split(".ko")[0].replace("-", "_")
        by_name[name] = moddir / rel
    return [(m, by_name[m]) for m in MODULES if m in by_name]


def _build_initramfs(target: Path, init: str, agent: Path, modules: list[tuple[str, Path]]) -> None:
    if shutil.which("cpio") is None:
        raise NotSupported("cpio is not installed (needed to build the VM guest's initramfs)")
    with tempfile.TemporaryDirectory(prefix="initramfs.", dir=target.parent) as tmp:
        root = Path(tmp) / "root"
        (root / "bin").mkdir(parents=True)
        (root / "modules").mkdir()
        shutil.copy(BUSYBOX, root / "bin" / "busybox")
        shutil.copy(agent, root / "dsec-agent")
        install_tools(root / "dsec-bin")  # dsec's shell and tar, /.dsec/bin in the guest
        (root / "init").write_text(init)
        (root / "init").chmod(0o755)
        for name, path in modules:
            if path.suffix == ".ko":
                shutil.copy(path, root / "modules" / f"{name}.ko")
            else:
                raise NotSupported(f"compressed kernel module {path} is not handled")
        (root / "modules.order").write_text("\n".join(name for name, _ in modules) + "\n")
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        part = Path(tmp) / "initramfs.cpio"
        with open(part, "wb") as out:
            subprocess.run(["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"], cwd=root,
                           input="\n".join(files).encode(), stdout=out, check=True)
        os.replace(part, target)


def host_tsc_khz() -> int:
    """The host's TSC rate. Under TCG the guest's TSC is the host's, but a guest on a busy
    host fails to measure it (no HPET on a microvm; PIT calibration loses to the load) and then
    crawls: the kernel is told the rate instead (``tsc_early_khz``)."""
    known = Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz")
    if known.exists():
        return int(known.read_text())
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    raise NotSupported("cannot tell the host's TSC rate for an emulated (TCG) guest")
