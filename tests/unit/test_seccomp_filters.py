"""The seccomp filters the server compiles (``substrates/host/seccomp.py``), loaded into a
child process as a sandbox loads them: what each refuses, with which errno, and what it
lets through (loading one needs no privilege once no_new_privs is set); and the OCI config
that carries the container's."""

from __future__ import annotations

import base64
import ctypes
import errno
import os
import struct

import pytest

from dsec.protocol.models import CreateRequest
from dsec.substrates.host.oci_spec import (
    SECCOMP_BPF_ANNOTATION,
    container_config,
    seccomp_profile,
)
from dsec.substrates.host.seccomp import (
    container_filter_b64,
    container_filter_bpf,
    fn_filter_bpf,
)

libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SYS_PERSONALITY, SYS_UNSHARE, SYS_CLONE3, SYS_GETPID = 135, 272, 435, 39
QUERY_PERSONALITY = 0xFFFFFFFF


def results_under(bpf: bytes, calls: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Each raw syscall's result (``ok`` or its errno's name) in a child that loaded ``bpf``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: load the filter, make the calls, report, exit
        try:
            program = ctypes.create_string_buffer(bpf, len(bpf))
            fprog = ctypes.create_string_buffer(
                struct.pack("HxxxxxxQ", len(bpf) // 8, ctypes.addressof(program)))
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or \
                    libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0):
                os.write(w, b"load=" + errno.errorcode[ctypes.get_errno()].encode())
                os._exit(1)
            out = []
            for name, (nr, *args) in calls.items():
                rc = libc.syscall(nr, *(ctypes.c_ulong(a) for a in args))
                out.append(f"{name}={'ok' if rc >= 0 else errno.errorcode[ctypes.get_errno()]}")
            os.write(w, "\n".join(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        report = f.read().decode()
    os.waitpid(pid, 0)
    return dict(line.split("=", 1) for line in report.splitlines())


CALLS = {"getpid": (SYS_GETPID,), "unshare": (SYS_UNSHARE, 0), "clone3": (SYS_CLONE3, 0, 0),
         "personality": (SYS_PERSONALITY, QUERY_PERSONALITY)}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 syscall numbers")
def test_the_container_filter_refuses_the_profiles_calls_and_allows_the_rest() -> None:
    assert results_under(container_filter_bpf(), CALLS) == {
        "getpid": "ok", "personality": "ok",
        "unshare": "EPERM",  # even unshare(0), which would change nothing
        "clone3": "ENOSYS",  # so that libc falls back to clone, whose flags the filter sees
    }


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 syscall numbers")
def test_the_fn_filter_refuses_more_than_the_containers() -> None:
    assert results_under(fn_filter_bpf(), CALLS) == {
        "getpid": "ok", "personality": "EPERM", "unshare": "EPERM", "clone3": "ENOSYS"}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 syscall numbers")
def test_unfiltered_the_same_calls_go_through() -> None:
    """The control: without a filter, unshare(0) and the personality query succeed, and
    clone3 with no arguments is refused by the kernel as invalid, not as unimplemented."""
    assert results_under(b"", {}) == {"load": "EINVAL"}  # an empty program is no filter
    r = libc.syscall(SYS_UNSHARE, ctypes.c_ulong(0))
    assert r == 0 and libc.syscall(SYS_PERSONALITY, ctypes.c_ulong(QUERY_PERSONALITY)) >= 0
    assert libc.syscall(SYS_CLONE3, ctypes.c_ulong(0), ctypes.c_ulong(0)) == -1
    assert ctypes.get_errno() in (errno.EINVAL, errno.EFAULT)


def test_a_config_carries_the_compiled_filter_for_crun_and_the_profile_for_other_runtimes() -> None:
    """crun loads the annotation's bytes and ignores the profile; runc and runsc ignore the
    annotation and compile the profile. Without compiled bytes (no libseccomp on the server)
    the profile alone is there, and crun compiles it."""
    args = ("sb-1", CreateRequest(image="debian"), "/r", "/t", "/run", "/dsec")
    config = container_config(*args, container_filter_b64())
    assert base64.b64decode(config["annotations"][SECCOMP_BPF_ANNOTATION]) == container_filter_bpf()
    assert config["linux"]["seccomp"] == seccomp_profile()
    bare = container_config(*args, None)
    assert SECCOMP_BPF_ANNOTATION not in bare["annotations"]
    assert bare["linux"]["seccomp"] == seccomp_profile()
    # gVisor answers clone3 itself: Debian 12's answers a rule's errno as EPERM (no threads)
    gvisor = container_config(*args, None, "runsc")["linux"]["seccomp"]["syscalls"]
    assert gvisor == [r for r in seccomp_profile()["syscalls"] if r["names"] != ["clone3"]]
