"""A seccomp filter compiled on the host with libseccomp (ctypes), as raw BPF.

The fn substrate's workers run the image's Python, which need not have libseccomp: the host
compiles the filter once and each worker loads the bytes with one prctl. The deny-list is the
container substrate's (``oci_spec``) plus ptrace, pidfd_getfd and chroot: an fn worker is
root without capabilities, and must not trace its neighbours, take their file descriptors (the
worker's socket to the server) or build itself a new root.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import tempfile

from ...protocol.errors import NotSupported
from .oci_spec import CLONE_NAMESPACE_FLAGS, DENIED_SYSCALLS

FN_DENIED = sorted({*DENIED_SYSCALLS, "ptrace", "pidfd_getfd", "chroot", "personality"})

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        raise NotSupported("the fn substrate needs libseccomp (Debian package libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def fn_filter_bpf() -> bytes:
    """The worker filter as a ``struct sock_filter[]`` for this (x86-64) host."""
    lib = _lib()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    try:
        for name in FN_DENIED:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr >= 0:
                _add(lib, ctx, _act_errno(errno.EPERM), nr, [])
        clone = lib.seccomp_syscall_resolve_name(b"clone")
        for flag in CLONE_NAMESPACE_FLAGS:  # no new namespaces from inside
            _add(lib, ctx, _act_errno(errno.EPERM), clone, [_ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag)])
        _add(lib, ctx, _act_errno(errno.ENOSYS), lib.seccomp_syscall_resolve_name(b"clone3"), [])
        with tempfile.TemporaryFile() as f:
            if lib.seccomp_export_bpf(ctx, f.fileno()) != 0:
                raise OSError("seccomp_export_bpf failed")
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)


def _add(lib: ctypes.CDLL, ctx: int, action: int, nr: int, args: list[_ArgCmp]) -> None:
    array = (_ArgCmp * max(1, len(args)))(*args)
    rc = lib.seccomp_rule_add_array(ctx, action, nr, len(args), array)
    if rc != 0:
        raise OSError(-rc, f"seccomp rule for syscall {nr}: {os.strerror(-rc)}")
