"""Seccomp filters compiled on the host with libseccomp (ctypes), as raw BPF.

Compiled once per server, loaded by each sandbox as bytes:
- the container substrate's (``oci_spec``'s profile): crun would compile the profile of
  config.json with libseccomp at every start (about 1 ms of CPU); given the bytes in the
  ``run.oci.seccomp_bpf_data`` annotation, it loads them instead;
- the fn substrate's: its workers run the image's Python, which need not have libseccomp,
  and each loads the bytes with one prctl. Its deny-list is the container's plus ptrace,
  pidfd_getfd and chroot: an fn worker is root without capabilities, and must not trace its
  neighbours, take their file descriptors (the worker's socket to the server) or build itself
  a new root. It allows the native ABI only.
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import errno
import os
import tempfile

from ...protocol.errors import NotSupported
from .oci_spec import CLONE_NAMESPACE_FLAGS, DENIED_SYSCALLS, SECCOMP_ARCHES

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
        raise NotSupported("sandboxes need libseccomp (Debian package libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def container_filter_bpf() -> bytes:
    """``oci_spec.seccomp_profile()``, compiled: the same rules for the same ABIs."""
    return _deny_list_bpf(DENIED_SYSCALLS, SECCOMP_ARCHES)


def container_filter_b64() -> str:
    """``container_filter_bpf()`` in base64, as crun's annotation takes it."""
    return base64.b64encode(container_filter_bpf()).decode()


def fn_filter_bpf() -> bytes:
    """The fn worker's filter, for the host's own ABI only."""
    return _deny_list_bpf(FN_DENIED, ())


def _deny_list_bpf(denied: list[str], arches: tuple[str, ...]) -> bytes:
    """A filter as a ``struct sock_filter[]``: every call allowed but ``denied`` (EPERM),
    clone with a namespace flag (EPERM) and clone3 (ENOSYS), in the host's ABI and in
    ``arches`` (libseccomp's names; a call of any other ABI kills the thread)."""
    lib = _lib()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    try:
        for arch in arches:
            rc = lib.seccomp_arch_add(ctx, lib.seccomp_arch_resolve_name(arch.encode()))
            if rc not in (0, -errno.EEXIST):  # the host's own is in already
                raise OSError(-rc, f"seccomp architecture {arch}: {os.strerror(-rc)}")
        for name in denied:
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
