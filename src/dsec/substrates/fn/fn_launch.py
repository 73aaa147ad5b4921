"""Starts an fn template: ``python -m dsec.substrates.fn.fn_launch CONFIG_JSON`` (host side).

In a new mount namespace it mounts the image's read-only root (an overlay of the fn support
layer over the image's layers, with no upper: read-only by construction), a small read-only
/dev (nothing of the host is writable there: a worker's run directory is a tmpfs of its
own); opens the worker cgroup parents
(the template makes each worker's cgroup through these fds, as it cannot see /sys after the
pivot); joins the template's own cgroup; pivots into the root; and execs the image's Python
with ``/.dsec/fn/template.py``. The template dies with the server (parent-death signal).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x20000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {fstype or source} on {target}")


def _make_dev(dev: str) -> None:
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    for name in ("shm", "pts", "mqueue"):
        os.mkdir(f"{dev}/{name}")
    _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != cfg["server_pid"]:  # the server died before the signal was armed
        sys.exit(1)
    for procs in cfg["template_cgroup_procs"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    _check(_libc.unshare(CLONE_NEWNS), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = cfg["root"]
    _mount("overlay", root, "overlay", MS_RDONLY | MS_NOSUID,
           "lowerdir=" + ":".join(cfg["lowers"]))
    _make_dev(f"{root}/dev")
    template = cfg["template"]
    for cgroup, parent in zip(template["cgroups"], cfg["worker_cgroup_parents"], strict=True):
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        os.set_inheritable(fd, True)
        cgroup["fd"] = fd
    os.chdir(root)
    _check(_libc.pivot_root(b".", b".dsec/oldroot"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.dsec/oldroot", MNT_DETACH), "umount old root")
    python = cfg["python"]
    os.execve(python, [python, "-I", "/.dsec/fn/template.py", json.dumps(template)],
              {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": "/root", "LANG": "C.UTF-8"})


if __name__ == "__main__":
    main()
