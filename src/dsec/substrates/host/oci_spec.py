"""The OCI runtime config (config.json) for one container sandbox.

Secure by default: new pid/mount/net/ipc/uts namespaces (the net namespace has loopback only),
no new privileges, a small capability set, a seccomp deny-list, masked /proc paths, a read-only
/sys, and cgroup limits on cpu, memory and pids.
"""

from __future__ import annotations

import errno
import resource
from typing import Any

from ...agent.tools import AGENT_PATH, DSEC_DIR, RUN_DIR
from ...protocol.models import CreateRequest
from .cgroups import CPU_PERIOD_US

AGENT_SOCKET = RUN_DIR + "/agent.sock"

# What a root user in an ordinary Docker container may do, less raw sockets, mknod and
# audit: enough for apt, pip and chown-ing a workspace.
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_NET_BIND_SERVICE",
]

# Calls no sandboxed workload needs that widen the kernel's attack surface; capabilities
# already stop most of them, seccomp stops them again in depth.
DENIED_SYSCALLS = [
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module",
    "delete_module", "finit_module", "fsconfig", "fsmount", "fsopen", "fspick",
    "get_kernel_syms", "init_module", "io_uring_enter", "io_uring_register", "io_uring_setup",
    "ioperm", "iopl", "kcmp",
    "kexec_file_load", "kexec_load", "keyctl", "lookup_dcookie", "mount",
    "mount_setattr", "move_mount", "move_pages", "name_to_handle_at", "nfsservctl",
    "open_by_handle_at", "open_tree", "perf_event_open", "pivot_root",
    "process_vm_readv", "process_vm_writev", "query_module", "quotactl",
    "reboot", "request_key", "setns", "settimeofday", "swapoff",
    "swapon", "syslog", "umount2", "unshare", "uselib", "userfaultfd", "ustat",
    "vhangup",
]
# /proc and /sys files that show the host kernel's internals (DSec's kernel crash came from a
# recursive grep reading /proc/kpagecgroup): masked on every substrate that shares the kernel.
MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/config.gz", "/proc/kallsyms", "/proc/kcore",
    "/proc/keys", "/proc/kmsg", "/proc/kpagecgroup", "/proc/kpagecount", "/proc/kpageflags",
    "/proc/latency_stats", "/proc/sched_debug", "/proc/scsi", "/proc/slabinfo",
    "/proc/timer_list", "/proc/timer_stats", "/proc/vmallocinfo", "/proc/pagetypeinfo",
    "/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug",
]
# Host-global kernel settings under /proc: readable, never writable from a sandbox.
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]

# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NAMESPACE_FLAGS = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000,
                         0x40000000)


# the ABIs whose calls the profile filters (libseccomp's names); any other's are killed
SECCOMP_ARCHES = ("x86_64", "x86", "x32")
# crun loads these bytes (base64) as the filter and ignores the profile (crun(1)); other
# runtimes ignore the annotation and compile the profile
SECCOMP_BPF_ANNOTATION = "run.oci.seccomp_bpf_data"


def seccomp_profile(runtime: str = "crun") -> dict[str, Any]:
    """The deny-list as ``runtime`` applies it. Under runsc (``--oci-seccomp``) gVisor's own
    kernel answers the calls, and Debian 12's (runsc 0.0~20221219) answers every ``ERRNO`` rule
    with EPERM whatever its ``errnoRet``: a clone3 rule there refused each new thread
    (pthread_create falls back to clone only on ENOSYS), so it has none, and gVisor answers
    clone3 itself (ENOSYS in that version; a newer gVisor's namespaces are its own user-space
    kernel's, never the host's)."""
    eperm = 1
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": [f"SCMP_ARCH_{arch.upper()}" for arch in SECCOMP_ARCHES],
        "syscalls": [
            {"names": DENIED_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": eperm},
            # clone() may not make namespaces: one rule per flag, since a rule can only test
            # (flags & mask) == value. clone3 hides its flags in memory, so it answers ENOSYS
            # and libc falls back to clone.
            *({"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": eperm,
               "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}]}
              for flag in CLONE_NAMESPACE_FLAGS),
            *([{"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS}]
              if runtime != "runsc" else []),
        ],
    }


def container_config(
    sandbox_id: str,
    request: CreateRequest,
    rootfs: str,
    dsec_tree: str,
    run_dir: str,
    cgroup_parent: str,
    seccomp_bpf: str | None,
    runtime: str = "crun",
) -> dict[str, Any]:
    """``seccomp_bpf``: ``seccomp_profile()`` compiled (``seccomp.container_filter_bpf``), in
    base64, which crun loads; None leaves its compiling to the runtime. ``runtime`` is the
    one that runs the bundle (the profile it gets)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "LANG": "C.UTF-8"}
    env.update(request.env)
    caps = list(CAPABILITIES)
    period = CPU_PERIOD_US
    memory = request.memory_mb << 20
    nofile = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])  # never above our own
    return {
        "ociVersion": "1.0.2",
        "root": {"path": rootfs, "readonly": False},
        "hostname": sandbox_id[:63],
        "annotations": {SECCOMP_BPF_ANNOTATION: seccomp_bpf} if seccomp_bpf else {},
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [AGENT_PATH, "--listen", AGENT_SOCKET],
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": True,
            "oomScoreAdj": 500,
        },
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            # dsec's agent and tools (agent/tools.py), read-only; a mount point, so the sandbox
            # can neither rename /.dsec away nor put a fake /.dsec/bin in its place.
            {"destination": DSEC_DIR, "type": "bind", "source": dsec_tree,
             "options": ["bind", "ro", "nosuid", "nodev"]},
            # on the sandbox's own disk (container.py): whatever is written here is in its quota
            {"destination": RUN_DIR, "type": "bind", "source": run_dir,
             "options": ["bind", "rw", "nosuid", "nodev", "noexec"]},
        ],
        "linux": {
            "cgroupsPath": f"{cgroup_parent}/{sandbox_id}",
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                "memory": {"limit": memory},
                "cpu": {"quota": int(request.cpu * period), "period": period},
                "pids": {"limit": request.pids},
            },
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "seccomp": seccomp_profile(runtime),
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
        },
    }
