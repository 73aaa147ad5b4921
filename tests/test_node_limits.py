"""What a server sets on its node: its open files sized to its ``--capacity``, and on a
cgroup v1 host the kernel's ``favordynmods`` mode.

Each live container holds three files of the server open (its pidfd, its mount namespace, its
bundle dir seen from there), so a server started by a unit or shell with a low ``ulimit -n``
would fail creates with EMFILE below its capacity. It raises its limit to what the capacity
needs when it may (CAP_SYS_RESOURCE), and otherwise refuses to start, saying why; below the
limit it starts and serves.

On a host with cgroup v1 hierarchies, a server holds a hierarchy of its own mounted with
``favordynmods`` (``cgroups.hold_favordynmods``), attached to no mount table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import make_server, stop_server
from dsec.substrates.host import cgroups

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


@pytest.mark.skipif(cgroups.is_cgroup2_only(), reason="a cgroup v2 host: nothing to hold")
async def test_a_v1_host_is_in_favordynmods_mode_while_a_server_runs() -> None:
    server = make_server("--warm-pool", "0").start()
    try:
        assert server.proc is not None
        pid = server.proc.pid
        # The hierarchy is mounted nowhere: the server holds its root by an fd.
        assert cgroups.FAVOR_HIERARCHY not in open("/proc/self/mountinfo").read()
        assert f"name={cgroups.FAVOR_HIERARCHY}:/" in open(f"/proc/{pid}/cgroup").read()
        fds = [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
        held = [fd for fd in fds if subprocess.run(["stat", "-L", "-f", "-c", "%T", fd],
                                                   capture_output=True, text=True
                                                   ).stdout.strip() == "cgroupfs"]
        assert len(held) == 1 and "cgroup.procs" in os.listdir(held[0])
        async with server.client() as client:  # sandboxes start and run beside it
            sb = await client.create(image="debian-minbase")
            assert (await sb.run("echo served")).stdout == "served\n"
            await sb.stop()
    finally:
        stop_server(server)
