"""The fn substrate end to end: a real server, real jailed workers, the public SDK."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest

import dsec
from conftest import Server, make_server, stop_server

OJ = "python-3.11-oj"  # python3 with numpy, gcc and g++


@pytest.fixture(scope="module")
def oj_image(images):  # type: ignore[no-untyped-def]
    return images.ensure(OJ)


async def test_call_returns_the_value(client: dsec.DSecClient) -> None:
    assert await client.call(lambda x, y: x + y, 2, 3) == 5
    assert await client.call(lambda x, k=0: x * k, 7, kwargs={"k": 6}) == 42
    assert await client.call(sorted, [3, 1, 2]) == [1, 2, 3]
    big = await client.call(lambda n: b"x" * n, 3 << 20)  # multi-megabyte results
    assert big == b"x" * (3 << 20)


async def test_functions_of_the_callers_own_modules(client: dsec.DSecClient, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text("SCALE = 10\n\ndef score(x):\n    return x * SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_rewards  # type: ignore[import-not-found]  # not in the image: shipped by value
    assert await client.map(my_rewards.score, [1, 2]) == [10, 20]


async def test_libraries_are_preloaded(client: dsec.DSecClient, oj_image) -> None:  # type: ignore[no-untyped-def]
    def loaded() -> tuple[bool, float]:
        import sys
        preloaded = "numpy" in sys.modules  # imported by the template, before this call
        import numpy
        return preloaded, float(numpy.arange(4).sum())
    assert await client.call(loaded, image=OJ) == (True, 6.0)


async def test_remote_exception_is_typed(client: dsec.DSecClient) -> None:
    def fails() -> None:
        raise KeyError("missing")
    with pytest.raises(dsec.RemoteError) as info:
        await client.call(fails)
    assert info.value.remote_type == "builtins.KeyError"
    assert "in fails" in info.value.traceback and "KeyError: 'missing'" in info.value.traceback
    with pytest.raises(dsec.RemoteError) as info:
        await client.call(lambda: exit(3))
    assert info.value.remote_type == "builtins.SystemExit"


async def test_timeout_is_typed_and_kills_the_worker(client: dsec.DSecClient) -> None:
    with pytest.raises(dsec.CommandTimeout):
        await client.call(time.sleep, 60, timeout_s=1)
    assert await client.call(lambda: "next") == "next"


async def test_a_worker_that_dies_is_reported_died(client: dsec.DSecClient) -> None:
    with pytest.raises(dsec.SandboxDied) as info:
        await client.call(lambda: __import__("ctypes").string_at(0))  # a segfault
    assert "signal 11 (SIGSEGV)" in str(info.value)
    with pytest.raises(dsec.SandboxDied) as info:
        await client.call(lambda: os._exit(4))
    assert "code 4" in str(info.value)


async def test_memory_bomb_is_oom_killed(client: dsec.DSecClient) -> None:
    def bomb() -> int:
        hog = []
        while True:
            hog.append(bytearray(64 << 20))
    with pytest.raises(dsec.SandboxDied) as info:
        await client.call(bomb, timeout_s=60)
    assert "out of memory" in str(info.value)
    assert await client.call(lambda: "alive") == "alive"


async def test_fork_bomb_hits_the_pids_limit(client: dsec.DSecClient) -> None:
    def bomb() -> tuple[int, int]:
        made = refused = 0
        for _ in range(500):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                made += 1
            except OSError:
                refused += 1
        return made, refused
    made, refused = await client.call(bomb, timeout_s=60)
    assert made < 64 <= made + refused and refused > 0
    assert await client.call(lambda: "alive") == "alive"


async def test_no_network(client: dsec.DSecClient) -> None:
    """A call's network namespace has a loopback that is down: nothing answers, not even the
    host's loopback (an fn sandbox's loopback is up: see test_sandbox)."""
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen()
    port = host.getsockname()[1]

    def probe(port: int) -> tuple[list[str], str, list[str]]:
        import socket
        names = [name for _, name in socket.if_nameindex()]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2)
            host_port = "reached"
        except OSError as exc:
            host_port = type(exc).__name__
        routes = open("/proc/net/route").read().strip().splitlines()[1:]  # past the header
        return names, host_port, routes
    try:
        names, host_port, routes = await client.call(probe, port)
    finally:
        host.close()
    assert names == ["lo"]
    assert host_port == "OSError"  # ENETUNREACH: the host's loopback is another namespace
    assert routes == []


async def test_jail(client: dsec.DSecClient) -> None:
    def inside() -> dict[str, object]:
        fields = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines())
        try:
            open("/etc/passwd", "a")
            root = "writable"
        except OSError as exc:
            root = type(exc).__name__
        return {"pid": os.getpid(), "cwd": os.getcwd(), "root": root,
                "seccomp": fields["Seccomp"].strip(), "nnp": fields["NoNewPrivs"].strip(),
                "caps": int(fields["CapEff"], 16) | int(fields["CapBnd"], 16),
                "procs": sorted(p for p in os.listdir("/proc") if p.isdigit())}
    seen = await client.call(inside)  # pid 1 is the worker, which the call cannot reach
    assert seen == {"pid": 2, "cwd": "/work", "root": "OSError", "seccomp": "2", "nnp": "1",
                    "caps": 0, "procs": ["1", "2"]}

    def escapes() -> list[int]:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return [libc.unshare(0x40000000), libc.mount(b"x", b"/tmp", b"tmpfs", 0, None),
                libc.chroot(b"/tmp"), libc.ptrace(16, 1, 0, 0), libc.sethostname(b"x", 1)]
    assert await client.call(escapes) == [-1] * 5


async def test_calls_are_isolated_from_each_other(client: dsec.DSecClient) -> None:
    def write() -> list[str]:
        for path in ("/work/left", "/tmp/left", "/dev/shm/left"):
            with open(path, "w") as f:
                f.write("secret")
        return sorted(os.listdir("/work"))
    assert await client.call(write) == ["left"]

    def look() -> list[bool]:
        return [os.path.exists(p) for p in ("/work/left", "/tmp/left", "/dev/shm/left")]
    assert await client.call(look) == [False, False, False]


async def test_run_code_python_and_bash(client: dsec.DSecClient) -> None:
    r = await client.run_code("python", "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
                              stdin="1 2 3\n")
    assert (r.stdout, r.exit_code, r.ok, r.compile_exit_code) == ("6\n", 0, True, None)
    r = await client.run_code("bash", "read a; echo \"got $a\"; echo oops >&2; exit 3", stdin="x\n")
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("got x\n", "oops\n", 3, False)
    r = await client.run_code("python", "while True: pass", timeout_s=1)
    assert r.timed_out and not r.ok and r.signal == 9
    with pytest.raises(dsec.NotSupported):
        await client.run_code("c", "int main(){return 0;}")  # python-3.11 has no gcc


async def test_run_code_c_and_cpp(client: dsec.DSecClient, oj_image) -> None:  # type: ignore[no-untyped-def]
    c = "#include <stdio.h>\nint main(){int a,b;scanf(\"%d %d\",&a,&b);printf(\"%d\\n\",a+b);}"
    r = await client.run_code("c", c, stdin="2 40", image=OJ)
    assert (r.stdout, r.exit_code, r.compile_exit_code) == ("42\n", 0, 0)
    cpp = "#include <iostream>\nint main(){std::string s; std::cin>>s; std::cout<<s.size()<<'\\n';}"
    r = await client.run_code("cpp", cpp, stdin="hello", image=OJ)
    assert (r.stdout, r.exit_code) == ("5\n", 0)
    r = await client.run_code("c", "int main(){ return oops; }", image=OJ)
    assert r.compile_error and "oops" in r.compile_stderr and not r.ok


async def test_map(client: dsec.DSecClient) -> None:
    assert await client.map(lambda x: x * x, range(20), concurrency=8) == [x * x for x in range(20)]
    results = await client.map(lambda x: 1 // x, [1, 0, 2], return_exceptions=True)
    assert results[0] == 1 and isinstance(results[1], dsec.RemoteError) and results[2] == 0
    with pytest.raises(dsec.NotSupported):
        await client.call(lambda: 1, substrate="container")


async def test_images_without_python_are_refused(client: dsec.DSecClient) -> None:
    with pytest.raises(dsec.NotSupported):
        await client.call(lambda: 1, image="debian-minbase")
    with pytest.raises(dsec.NotSupported):
        await client.create(substrate="fn", image="debian-minbase")
    with pytest.raises(dsec.ImageNotFound):
        await client.call(lambda: 1, image="no-such-image")


async def test_a_dead_template_is_replaced(client: dsec.DSecClient) -> None:
    assert await client.call(lambda: 1) == 1
    templates = _fn_pids((await client.health())["edges"][0]["id"], template_only=True)
    assert templates
    for pid in templates:
        os.kill(pid, signal.SIGKILL)
    assert await client.call(lambda: "again") == "again"


def test_sync_facade(server: Server) -> None:
    with dsec.Client(server.url, server.key, autostart=False) as client:
        assert client.call(lambda: "sync") == "sync"
        assert client.map(str, [1, 2]) == ["1", "2"]
        assert client.run_code("python", "print(1)").stdout == "1\n"
        with pytest.raises(dsec.ResultRefused):  # not plain data: refused unless trusted
            client.call(lambda: __import__("fractions").Fraction(1, 2))
        assert str(client.call(lambda: __import__("fractions").Fraction(1, 2), trusted_result=True)) == "1/2"


def _edge_cgroups(edge: str) -> list[Path]:
    return [p for p in Path("/sys/fs/cgroup").glob(f"*/dsec-fn-{edge}") if p.exists()]


def _fn_pids(edge: str, template_only: bool = False) -> list[int]:
    """Processes in the edge's fn cgroups: templates (``.../template``) and workers."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cgroup = (proc / "cgroup").read_text() if proc.name.isdigit() else ""
        except OSError:
            continue
        mine = [line for line in cgroup.splitlines() if f"/dsec-fn-{edge}/" in line]
        if mine and (not template_only or any(line.endswith("/template") for line in mine)):
            found.append(int(proc.name))
    return found


async def test_nothing_leaks_after_stop_or_crash(images) -> None:  # type: ignore[no-untyped-def]
    srv = make_server().start()
    try:
        async with srv.client() as client:
            edge = (await client.health())["edges"][0]["id"]
            await client.map(lambda x: x, range(10), concurrency=4)
            async with await client.create(substrate="fn", image="python-3.11", ttl_s=60) as sb:
                assert (await sb.run("echo up")).stdout == "up\n"
            assert _edge_cgroups(edge) and _fn_pids(edge, template_only=True)
        srv.kill(signal.SIGKILL)  # a crash: templates and workers follow their parent
        deadline = time.monotonic() + 30
        while _fn_pids(edge) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not _fn_pids(edge)
        srv.start()  # the next server sweeps what the crash left
        srv.kill(signal.SIGTERM)
        assert not _edge_cgroups(edge), "cgroups left behind"
        mounts = Path("/proc/self/mountinfo").read_text()
        assert str(srv.state_dir / "fn") not in mounts
    finally:
        stop_server(srv)
