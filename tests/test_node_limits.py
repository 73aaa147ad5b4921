"""A node's own limits sized to its ``--capacity``: the server's open files.

Each live container holds three files of the server open (its pidfd, its mount namespace, its
bundle dir seen from there), so a server started by a unit or shell with a low ``ulimit -n``
would fail creates with EMFILE below its capacity. It raises its limit to what the capacity
needs when it may (CAP_SYS_RESOURCE), and otherwise refuses to start, saying why; below the
limit it starts and serves."""

from __future__ import annotations

import subprocess
import sys

from conftest import make_server, stop_server

# As a unit with LimitNOFILE=2048 and without CAP_SYS_RESOURCE would start it: the capability
# out of the bounding set (root's capabilities after exec), then the limit.
LIMITED = ["setpriv", "--bounding-set", "-sys_resource", "--inh-caps", "-sys_resource",
           "prlimit", "--nofile=2048:2048", "--"]


def test_a_capacity_the_open_files_cannot_hold_is_refused_at_start() -> None:
    server = make_server("--capacity", "1000", "--warm-pool", "0")
    done = subprocess.run([*LIMITED, sys.executable, "-m", "dsec", "serve", "--state-dir",
                           str(server.state_dir), *server.args],
                          capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert ("a capacity of 1000 sandboxes needs 4024 open files of the server (3 per sandbox, "
            "1024 of its own), and it may open 2048") in said
    assert "lower --capacity" in said
    assert not (server.state_dir / "api.sock").exists()


async def test_a_capacity_within_the_limit_starts_and_serves() -> None:
    server = make_server("--capacity", "300", "--warm-pool", "0")  # 300 * 3 + 1024 <= 2048
    server.launcher = LIMITED
    server.start()
    try:
        assert server.proc is not None
        limits = open(f"/proc/{server.proc.pid}/limits").read()
        assert [line.split()[3:5] for line in limits.splitlines()
                if line.startswith("Max open files")] == [["2048", "2048"]]
        async with server.client() as client:
            sb = await client.create(image="debian-minbase")
            assert (await sb.run("echo served")).stdout == "served\n"
            await sb.stop()
    finally:
        stop_server(server)
