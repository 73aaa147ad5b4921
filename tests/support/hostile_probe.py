"""Run INSIDE a sandbox by tests/test_hostile.py: attacks that need more than a shell.

``python3 probe.py MODE [ARGS]`` prints ``key=value`` lines. Standard library only (it runs
in the sandbox's Python, without dsec).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import socket
import struct
import sys
import time

RUN = "/.dsec/run"
AGENT = f"{RUN}/agent.sock"
libc = ctypes.CDLL(None, use_errno=True)


def err_name(e: int) -> str:
    return errno.errorcode.get(e, str(e))


def attempt(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
        return "allowed"
    except OSError as e:
        return f"denied {err_name(e.errno or 0)}"


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def proc() -> None:
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    host = []
    for pid in pids:
        try:
            cmd = read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(word in cmd for word in ("serve", "pytest", "systemd", "uvicorn", "sshd")):
            host.append(cmd)
    print(f"pids={len(pids)}")
    print(f"host_cmdlines={'|'.join(host)}")
    pid1 = read("/proc/1/cmdline").replace(b"\0", b" ").decode().strip()
    print(f"pid1={pid1}")
    print(f"kcore={len(read('/proc/kcore')) if os.path.exists('/proc/kcore') else 0}")
    print(f"keys={len(read('/proc/keys')) if os.path.exists('/proc/keys') else 0}")
    print(f"sys_write={attempt(lambda: open('/sys/kernel/uevent_helper', 'w').write('x'))}")
    print(f"proc_sys_write={attempt(lambda: open('/proc/sys/kernel/hostname', 'w').write('x'))}")
    print(f"firmware={','.join(os.listdir('/sys/firmware')) if os.path.isdir('/sys/firmware') else ''}")
    print(f"hostname={socket.gethostname()}")
    print(f"agent_environ={attempt(lambda: read('/proc/1/environ'))}")
    print(f"agent_mem={attempt(lambda: open('/proc/1/mem', 'rb').close())}")


def ptrace(*host_pids: str) -> None:
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]

    def attach(pid: int) -> str:
        if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
            return "attached"
        return err_name(ctypes.get_errno())

    print(f"agent={attach(1)}")
    for pid in map(int, host_pids):
        print(f"attach_{pid}={attach(pid)}")
        print(f"kill_{pid}={attempt(functools.partial(os.kill, pid, 0)).removeprefix('denied ')}")


def mount() -> None:
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    rc = libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)
    print(f"mount={'mounted' if rc == 0 else err_name(ctypes.get_errno())}")


def abis() -> None:
    """unshare(0), which changes nothing and needs no privilege, through each of the x86 ABIs
    a 64-bit process can call the kernel in: the seccomp filter must refuse it in every one.
    Each call is made in a child: a call the kernel or the filter kills is seen as killed.
    getpid (always allowed) shows whether the kernel offers the ABI at all."""
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]

    def int80(nr: int) -> int:  # the i386 ABI: push rbx; mov eax, nr; xor ebx, ebx; int 0x80; pop rbx; ret
        page = libc.mmap(None, 4096, 7, 0x22, -1, 0)  # rwx, private anonymous
        code = b"\x53\xb8" + nr.to_bytes(4, "little") + b"\x31\xdb\xcd\x80\x5b\xc3"
        ctypes.memmove(page, code, len(code))
        return ctypes.CFUNCTYPE(ctypes.c_int)(page)()

    def syscall(nr: int) -> int:  # the x86-64 ABI, and x32's (nr | 0x40000000)
        rc = libc.syscall(nr, 0)
        return rc if rc >= 0 else -ctypes.get_errno()

    calls = {"x86_64": (lambda: syscall(39), lambda: syscall(272)),
             "i386": (lambda: int80(20), lambda: int80(310)),
             "x32": (lambda: syscall(0x40000000 | 39), lambda: syscall(0x40000000 | 272))}
    for abi, (getpid, unshare) in calls.items():
        pid = in_child(getpid)
        print(f"{abi}_getpid={'works' if pid.isdigit() else pid}")
        print(f"{abi}_unshare={in_child(unshare)}")


def in_child(call) -> str:  # type: ignore[no-untyped-def]
    """``call()``'s result as a name (``0``, a pid, ``EPERM``), or how its child died."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        rc = call()
        os.write(w, (str(rc) if rc >= 0 else err_name(-rc)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return out if os.WIFEXITED(status) else f"killed by signal {os.WTERMSIG(status)}"


def frame(kind: str, fields: list[tuple[str, str]]) -> bytes:
    body = kind.encode()
    for k, v in fields:
        body += bytes([len(k)]) + k.encode() + struct.pack(">I", len(v.encode())) + v.encode()
    return struct.pack(">I", len(body)) + body


def ask(request: bytes) -> str:
    """Send one request to the agent; the reply's type, errno and message."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(AGENT)
        s.sendall(request)
        reply = b""
        while chunk := s.recv(65536):  # the agent closes the connection after refusing
            reply += chunk
    body, fields, pos = reply[4:], {}, 1
    while pos < len(body):
        klen = body[pos]
        key = body[pos + 1: pos + 1 + klen].decode()
        (vlen,) = struct.unpack(">I", body[pos + 1 + klen: pos + 5 + klen])
        fields[key] = body[pos + 5 + klen: pos + 5 + klen + vlen].decode()
        pos += 5 + klen + vlen
    return f"{chr(body[0])} {fields.get('errno', '')} {fields.get('message', '')}".strip()


def agent() -> None:
    marker = "/work/forged-marker"
    touch = [("argv", "touch"), ("argv", marker), ("env", "PATH=/usr/bin:/bin")]
    print(f"claim={ask(frame('C', [('token', 'a' * 64)]))}")
    print(f"exec_without_token={ask(frame('E', touch))}")
    print(f"exec_with_guess={ask(frame('E', [('token', '0' * 64), *touch]))}")
    print(f"list_without_token={ask(frame('L', []))}")
    print(f"marker={'present' if os.path.exists(marker) else 'absent'}")


def impostor() -> None:
    """Put a fake agent where the edge connects, record what it is sent, then give back."""
    os.rename(AGENT, f"{RUN}/real.sock")  # the agent's socket stays reachable under this name
    got = b""
    with socket.socket(socket.AF_UNIX) as fake:
        fake.bind(AGENT)
        fake.listen(16)
        fake.settimeout(0.1)
        open(f"{RUN}/impostor-ready", "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{RUN}/impostor-done") and time.monotonic() < deadline:
            try:
                conn, _ = fake.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    while chunk := conn.recv(65536):
                        got += chunk
                except OSError:
                    pass
    os.unlink(AGENT)
    os.rename(f"{RUN}/real.sock", AGENT)
    with open("/work/impostor-got", "wb") as f:
        f.write(got)
    open(f"{RUN}/impostor-restored", "w").close()


if __name__ == "__main__":
    {"proc": proc, "ptrace": ptrace, "mount": mount, "agent": agent,
     "impostor": impostor, "abis": abis}[sys.argv[1]](*sys.argv[2:])
