"""The sealed copy the server runs an OCI runtime from (``substrates/host/sealed.py``): the
same bytes as the binary, with every seal, so nobody can change it; copied anew when the
binary changes; it runs under its own name; a child does not inherit it, except the one
chrt starts for an idle-priority start (chrt execs it)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dsec.substrates.host.sealed import ALL_SEALS, F_ADD_SEALS, F_GET_SEALS, sealed_copy
from dsec.substrates.host.spawn import Spawned


def _fd(path: str) -> int:
    """The fd of this process the link ``path`` names."""
    return int(os.readlink(path).rpartition("/")[2])


def test_the_copy_is_the_binary_sealed_and_made_anew_when_it_changes(tmp_path: Path) -> None:
    binary = tmp_path / "tool"
    shutil.copy(shutil.which("true") or "/bin/true", binary)
    path = sealed_copy(str(binary), tmp_path / "bin")
    mine = tmp_path / "bin" / str(os.getpid())
    assert sealed_copy(str(binary), tmp_path / "bin") == path == str(mine / "tool")
    fd = _fd(path)
    assert _fd(sealed_copy(str(binary), tmp_path / "elsewhere")) == fd  # one copy per binary
    assert fcntl.fcntl(fd, F_GET_SEALS) == ALL_SEALS
    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    assert Path(path).read_bytes() == binary.read_bytes()
    old = binary.read_bytes()
    binary.write_bytes(b"#!/bin/sh\nexit 7\n")  # the file changes (an upgrade): the copy does not
    assert Path(path).read_bytes() == old
    assert sealed_copy(str(binary), tmp_path / "bin") == path  # the next start: a new copy
    assert Path(path).read_bytes() == binary.read_bytes() and _fd(path) != fd
    assert os.pread(fd, len(old) + 1, 0) == old  # the old copy stays, for who runs from it
    writable = os.open(path, os.O_RDWR)
    try:
        for change in (lambda: os.write(writable, b"x"), lambda: os.ftruncate(writable, 1),
                       lambda: os.pwrite(writable, b"x", 1 << 20),
                       lambda: fcntl.fcntl(writable, F_ADD_SEALS, 0)):
            with pytest.raises(PermissionError):
                change()
    finally:
        os.close(writable)


def test_links_are_per_process_and_those_of_the_dead_go(tmp_path: Path) -> None:
    """A link names an fd of its process: each process has its own; those of processes
    that no longer run are removed when a new process makes its first."""
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid is gone
    links = tmp_path / "bin"
    dead, alive = links / str(ended.pid), links / "1"  # pid 1 always runs
    for d in (dead, alive):
        d.mkdir(parents=True)
        (d / "crun").symlink_to("/proc/self/fd/33")
    path = sealed_copy(shutil.which("true") or "/bin/true", links)
    assert Path(path).parent == links / str(os.getpid())
    assert not dead.exists() and (alive / "crun").is_symlink()


async def test_it_runs_and_its_child_does_not_keep_it(tmp_path: Path) -> None:
    shell = sealed_copy(shutil.which("sh") or "/bin/sh", tmp_path / "bin")
    listing = ("cat /proc/$$/comm >&2; readlink /proc/$$/exe >&2; "
               "for f in /proc/$$/fd/*; do readlink $f >&2; done; grep '^policy' /proc/$$/sched >&2")
    name, exe, fds, policy = await _child(tmp_path, [shell, "-c", listing], idle_priority=False)
    assert name == "sh" and exe.startswith("/memfd:sh") and policy == os.SCHED_OTHER
    assert not [fd for fd in fds if fd.startswith("/memfd:")]
    # through chrt: the copy is kept open for chrt to exec it
    name, exe, fds, policy = await _child(tmp_path, [shell, "-c", listing], idle_priority=True)
    assert name == "sh" and exe.startswith("/memfd:sh") and policy == os.SCHED_IDLE
    assert [fd for fd in fds if fd.startswith("/memfd:")] == [exe]


async def _child(tmp_path: Path, argv: list[str],
                 idle_priority: bool) -> tuple[str, str, list[str], int]:
    """The child's name, what it runs from, what its fds are and its scheduling policy, as
    it says on its stderr."""
    out = tmp_path / "out"
    child = await Spawned.start(argv, capture_stdout=False, stderr=out,
                                idle_priority=idle_priority)
    assert await child.wait() == 0
    name, exe, *fds, policy = out.read_text().split("\n")[:-1]
    return name, exe, fds, int(policy.split(":")[1])
