"""The fn template: runs as the IMAGE's Python inside the image's read-only root (stdlib only,
plus cloudpickle from /.dsec/fn/lib), with the chosen libraries already imported.

It forks workers ahead of demand and jails each one before it takes a call: new pid, mount,
net, ipc and uts namespaces (by a raw clone, so the worker is pid 1 of its own pid namespace
in one fork), its own cgroup (cpu, memory, pids), its own /proc and /sys with the container's
protections (host-global /proc files read-only, host kernel tables masked), a private /tmp,
/work, /dev/shm and run directory (size- and inode-limited tmpfs, charged to the worker's
memory cgroup, gone with its mount namespace), a network namespace of its own whose loopback
stays down (bringing it up costs a millisecond, which only an fn sandbox pays, at its start),
rlimits, no capabilities, no new privileges, not dumpable, and a seccomp filter last. A
jailed worker says ``R`` on its socket; the template then hands the socket (and a pidfd) to
the server over the control socket, so a call never passes through the template. The server
asks for workers with ``+N`` messages; the template reports each worker's end (wait status
and OOM kills) and removes its cgroup: nothing a worker made is on the template's side.

The code of a call never runs in the process that holds the socket (nothing a sandbox runs
may reach the channel its result travels on): the worker forks (before it says ``R``, off the
call's path) the child the call runs in, which holds only two pipes, and the worker, which
nobody in its namespace can trace or open /proc/1/fd of (not dumpable, ptrace and pidfd_getfd
denied), builds the reply and checks how the child ended. ``run_code`` programs are children of the worker, which builds their verdict itself.

Worker protocol (length-prefixed frames, one request, then the worker exits):
``C`` + cloudpickle((fn, args, kwargs)) -> ``O`` + cloudpickle(value) | ``E`` + JSON error
| ``D`` + JSON {"status": wait status} (the call's process died without answering);
``X`` + JSON run_code request -> ``J`` + JSON result; ``A`` -> the worker execs the in-sandbox
agent as its init (it prints ``R`` on the socket once it listens).
"""

import ctypes
import gc
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback

sys.path.insert(0, "/.dsec/fn/lib")
import cloudpickle  # noqa: E402

CFG = json.loads(sys.argv[1])
for _module in CFG["preload"]:
    try:
        __import__(_module)
    except Exception:  # a library the image lacks is simply not preloaded
        pass
import subprocess  # noqa: E402,F401  (run_code; imported here so workers start warm)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_CLONE = 56
CLONE_FLAGS = 0x20000 | 0x4000000 | 0x8000000 | 0x20000000 | 0x40000000  # NS UTS IPC PID NET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 4, 24, 38, 22
MS_REMOUNT = 32
SECCOMP_MODE_FILTER = 2
RUN = "/.dsec/run"
AGENT = "/.dsec/agent"
with open("/.dsec/fn/seccomp.bpf", "rb") as _f:
    SECCOMP_BPF = _f.read()


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


# the worker side -------------------------------------------------------------------------

def jail(wid, sock_fd):
    """Everything a worker does to itself before it may take a call (it is root, pid 1)."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.closerange(3, sock_fd)
    os.closerange(sock_fd + 1, 1 << 16)
    for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("sysfs", "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)  # its own net
    protect_proc_and_sys()
    tmp = f"size={CFG['tmp_mb']}m,nr_inodes={CFG['tmp_mb'] * 256}"  # one inode per 4 KiB
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp + ",mode=1777")
    _mount("tmpfs", "/work", "tmpfs", MS_NOSUID | MS_NODEV, tmp + ",mode=755")
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, tmp + ",mode=1777")
    # the agent socket of an fn sandbox; the server reaches it through /proc/<pid>/root
    _mount("tmpfs", RUN, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,nr_inodes=16,mode=700")
    _check(libc.sethostname(wid.encode(), len(wid)), "sethostname")
    nofile = CFG["nofile"]
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.chdir("/work")
    null = os.open("/dev/null", os.O_RDWR)  # from here on, errors are no longer the template's
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    for cap in range(64):  # empty bounding set: even an exec as root gains nothing
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    # /proc/1/{fd,mem} and pidfd_getfd need ptrace access, which a non-dumpable process
    # grants only to CAP_SYS_PTRACE: nobody in the namespace can reach the worker's socket
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
    program = ctypes.create_string_buffer(SECCOMP_BPF)
    fprog = struct.pack("HxxxxxxQ", len(SECCOMP_BPF) // 8, ctypes.addressof(program))
    fprog_buf = ctypes.create_string_buffer(fprog)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog_buf, 0, 0), "seccomp")


def protect_proc_and_sys():
    """The container's /proc and /sys protections (oci_spec READONLY_PATHS, MASKED_PATHS):
    host-global settings read-only, host kernel tables masked (a directory by an empty
    read-only tmpfs, a file by /dev/null)."""
    for path in CFG["readonly_paths"]:
        if os.path.lexists(path):
            _mount(path, path, None, MS_BIND | MS_REC)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in CFG["masked_paths"]:
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
        elif os.path.lexists(path):
            _mount("/dev/null", path, None, MS_BIND)


def read_frame(sock):
    head = _recv_exact(sock, 4)
    return _recv_exact(sock, struct.unpack(">I", head)[0])


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def send_frame(sock, data):
    sock.sendall(struct.pack(">I", len(data)) + data)


def serve(sock):
    """Take one request, answer it, and let the worker end (it is never reused). The process
    a call runs in is forked before the worker says it is ready, off the call's path."""
    call = CallProcess(sock)
    sock.sendall(b"R")
    request = read_frame(sock)
    kind, body = request[:1], request[1:]
    if kind != b"C":
        call.discard()
    if kind == b"A":
        os.dup2(sock.fileno(), 1)  # the agent prints R on stdout once it listens
        os.execve(AGENT, [AGENT, "--listen", f"{RUN}/agent.sock"],
                  {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
    if kind == b"X":
        send_frame(sock, b"J" + json.dumps(run_code(json.loads(body))).encode())
        return
    send_frame(sock, call.run(body))


class CallProcess:
    """The child a call runs in: it holds a pipe to read the request from and one to write
    its reply to, nothing else. What it wrote is the value (or error), whatever it is; how it
    ended is the worker's own finding, and the worker alone writes to the socket."""

    def __init__(self, sock):
        req_r, self.req_w = os.pipe()
        self.res_r, res_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.req_w)
            os.close(self.res_r)
            sock.close()
            _child(req_r, res_w)
        os.close(req_r)
        os.close(res_w)

    def discard(self):
        os.close(self.req_w)  # an empty request: the child exits
        os.close(self.res_r)
        os.waitpid(self.pid, 0)

    def run(self, body):
        """The reply frame of the call ``body``."""
        try:
            with open(self.req_w, "wb") as f:
                f.write(body)
        except OSError:  # the child died before it read it all; its end says how
            pass
        written = _read_to_end(self.res_r, self.pid)
        size = struct.unpack(">Q", written[:8])[0] if len(written) >= 8 else -1
        if size == len(written) - 8 and written[8:9] in (b"O", b"E"):
            _kill_the_rest()
            return written[8:]  # a whole reply, whatever the call does after writing it
        _, status = os.waitpid(self.pid, 0)  # how the call's process ended, by itself
        _kill_the_rest()
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and written:
            return b"E" + json.dumps({"type": "dsec.MalformedReply", "traceback": "",
                                      "message": "the call wrote a reply that is not one"}).encode()
        return b"D" + json.dumps({"status": status}).encode()


def _child(req_r, res_w):
    code = 0
    try:
        with open(req_r, "rb") as f:
            body = f.read()
        if body:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")  # under memory pressure the call dies, not the worker that reports it
            try:
                fn, args, kwargs = cloudpickle.loads(body)
                reply = b"O" + cloudpickle.dumps(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001  (SystemExit and KeyboardInterrupt too)
                reply = _error_reply(exc)
            with open(res_w, "wb") as out:
                out.write(struct.pack(">Q", len(reply)) + reply)
    except BaseException:  # noqa: BLE001  (the reply could not be made or written)
        code = 1
    os._exit(code)


def _error_reply(exc):
    kind = type(exc)
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001  (an exception made to fail its own report)
        message = "<str() of the exception failed>"
    return b"E" + json.dumps({"type": f"{kind.__module__}.{kind.__qualname__}", "message": message,
                              "traceback": traceback.format_exc()}).encode()


def _read_to_end(r, pid):
    """All that was written to the call's reply pipe, up to its end: the child closed it
    (having written its reply) or died. Once the child has ended, whatever it left running,
    which may hold the pipe open too, is killed."""
    pidfd = os.pidfd_open(pid)
    poll = select.poll()
    poll.register(r, select.POLLIN)
    poll.register(pidfd, select.POLLIN)
    chunks = []
    while True:
        events = dict(poll.poll())
        if pidfd in events:
            poll.unregister(pidfd)
            _kill_the_rest()
        if r in events:
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(pidfd)
    os.close(r)
    return b"".join(chunks)


def _kill_the_rest():
    try:
        os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of the worker's namespace
    except ProcessLookupError:
        pass


SOURCES = {"python": ("main.py", None, ["python3", "main.py"]),
           "bash": ("main.sh", None, ["bash", "main.sh"]),
           "c": ("main.c", ["gcc", "-O2", "-o", "main", "main.c", "-lm"], ["./main"]),
           "cpp": ("main.cpp", ["g++", "-O2", "-std=c++17", "-o", "main", "main.cpp"], ["./main"])}


def run_code(req):
    """Compile (C, C++) and run a program in /work; output capped, wall time limited."""
    name, compile_argv, run_argv = SOURCES[req["language"]]
    with open(name, "w") as f:
        f.write(req["code"])
    result = {"compile_exit_code": None, "compile_stderr": ""}
    if compile_argv:
        compiled = _run(compile_argv, b"", req["timeout_s"], req["max_output_bytes"])
        result.update(compile_exit_code=compiled["exit_code"], compile_stderr=compiled["stderr"])
        if compiled["exit_code"] != 0 or compiled["timed_out"]:
            return {**result, **compiled, "stdout": "", "exit_code": compiled["exit_code"]}
    return {**result, **_run(run_argv, req["stdin"].encode(), req["timeout_s"], req["max_output_bytes"])}


def _run(argv, stdin, timeout_s, cap):
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except FileNotFoundError:
        return {"exit_code": 127, "signal": 0, "stdout": "", "timed_out": False, "duration_ms": 0,
                "stderr": f"{argv[0]}: not found in this image"}
    timed_out = False
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_the_rest()  # the program and whatever it started, in any session
        out, err = proc.communicate()
    code = proc.returncode
    return {"exit_code": code if code >= 0 else -1, "signal": -code if code < 0 else 0,
            "stdout": out[:cap].decode(errors="replace"), "stderr": err[:cap].decode(errors="replace"),
            "stdout_truncated": len(out) > cap, "stderr_truncated": len(err) > cap,
            "timed_out": timed_out, "duration_ms": int((time.monotonic() - started) * 1000)}


# the template side -----------------------------------------------------------------------

class Template:
    def __init__(self):
        self.ctl = socket.socket(fileno=CFG["ctl_fd"])
        self.cgroups = CFG["cgroups"]  # [{"fd", "limits": {file: value}, "oom": [file, *keys]}]
        self.prefix = CFG["prefix"]
        self.seq = 0
        self.workers = {}  # pid -> wid
        self.unremoved = []  # wids whose cgroups were still busy
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def loop(self):
        """Spawn what the server asks for, hand each worker over once it says it is jailed
        (several jail themselves at once), report ends, remove what ended."""
        self.poll = select.poll()
        self.poll.register(self.ctl, select.POLLIN)
        self.poll.register(self.wake_r, select.POLLIN)
        self.jailing = {}  # socket fd -> (wid, pid, socket)
        while True:
            for fd, _ in self.poll.poll(100 if self.unremoved else None):
                if fd == self.ctl.fileno():
                    if not self.take_requests():
                        return  # the server is gone; workers follow by their parent-death signal
                elif fd == self.wake_r:
                    _drain(self.wake_r)
                else:
                    self.hand_over(*self.jailing.pop(fd))
            self.reap()
            self.remove_cgroups()

    def take_requests(self):
        wanted = 0
        while True:
            try:
                message = self.ctl.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if not message:
                return False
            wanted += int(message)
        for _ in range(wanted):
            wid, pid, sock = self.spawn_one()
            self.jailing[sock.fileno()] = (wid, pid, sock)
            self.poll.register(sock, select.POLLIN)
        return True

    def hand_over(self, wid, pid, sock):
        self.poll.unregister(sock)
        if sock.recv(1) == b"R":
            pidfd = os.pidfd_open(pid)
            socket.send_fds(self.ctl, [json.dumps({"wid": wid, "pid": pid}).encode()],
                            [sock.fileno(), pidfd])
            os.close(pidfd)
        else:
            os.kill(pid, signal.SIGKILL)  # failed its jail: reaped and reported like any end
        sock.close()

    def spawn_one(self):
        self.seq += 1
        wid = f"{self.prefix}-{self.seq}"
        for cg in self.cgroups:
            os.mkdir(wid, dir_fd=cg["fd"])
            for name, value in cg["limits"].items():
                _write_at(cg["fd"], f"{wid}/{name}", value)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ctypes.pythonapi.PyOS_BeforeFork()
        pid = libc.syscall(SYS_CLONE, ctypes.c_long(CLONE_FLAGS | signal.SIGCHLD), 0, 0, 0, 0)
        if pid == 0:
            ctypes.pythonapi.PyOS_AfterFork_Child()
            code = 0
            try:
                ours.close()
                if theirs.recv(1) != b"G":  # in its own cgroups: everything it forks is too
                    raise OSError("the template did not place the worker in its cgroups")
                jail(wid, theirs.fileno())
                serve(theirs)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 111
            os._exit(code)
        ctypes.pythonapi.PyOS_AfterFork_Parent()
        theirs.close()
        if pid < 0:
            raise OSError(ctypes.get_errno(), "clone")
        for cg in self.cgroups:
            _write_at(cg["fd"], f"{wid}/cgroup.procs", str(pid))
        ours.sendall(b"G")
        self.workers[pid] = wid
        return wid, pid, ours

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            wid = self.workers.pop(pid, None)
            if wid is None:
                continue
            report = {"dead": wid, "pid": pid, "status": status, "oom": self.oom_kills(wid)}
            self.ctl.send(json.dumps(report).encode())
            self.unremoved.append(wid)

    def oom_kills(self, wid):
        for cg in self.cgroups:
            if cg.get("oom"):
                name, *keys = cg["oom"]  # the larger count: see cgroups.OOM_KEYS
                try:
                    with open(os.open(f"{wid}/{name}", os.O_RDONLY, dir_fd=cg["fd"])) as f:
                        counts = dict(line.split() for line in f)
                    return max(int(counts.get(key, 0)) for key in keys)
                except (OSError, ValueError):
                    pass
        return 0

    def remove_cgroups(self):
        """A worker leaves only its cgroups here (its files were in its own tmpfs mounts),
        and a worker cannot write to a cgroup directory: an rmdir ends it, or fails while
        the pid namespace is still emptying and is tried again."""
        busy = []
        for wid in self.unremoved:
            for cg in self.cgroups:
                try:
                    os.rmdir(wid, dir_fd=cg["fd"])
                except FileNotFoundError:
                    pass
                except OSError:
                    busy.append(wid)
                    break
        self.unremoved = busy


def _drain(fd):
    while True:
        try:
            os.read(fd, 512)
        except BlockingIOError:
            return


def _write_at(dir_fd, path, value):
    fd = os.open(path, os.O_WRONLY, dir_fd=dir_fd)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


if __name__ == "__main__":
    template = Template()
    gc.freeze()  # what is loaded now stays out of every collection: workers share its pages
    template.loop()
