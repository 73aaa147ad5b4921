"""The ``dsec`` command line against a real server, and API keys over TCP."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

import dsec
from conftest import Server, make_tcp_server, stop_server


def dsec_cli(server: Server, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DSEC_URL": server.url, "DSEC_API_KEY": server.key}
    return subprocess.run([sys.executable, "-m", "dsec", *args], env=env, capture_output=True,
                          text=True, timeout=120, check=check)


def test_run_ls_exec_pause_stop(server: Server) -> None:
    done = dsec_cli(server, "run", "echo one-shot; echo err >&2; exit 3", check=False)
    assert done.returncode == 3
    assert done.stdout == "one-shot\n" and "err\n" in done.stderr

    sandbox_id = dsec_cli(server, "run", "cat /proc/sys/kernel/hostname").stdout.strip()
    assert sandbox_id.startswith("sb-")  # the hostname is the sandbox id
    assert sandbox_id not in dsec_cli(server, "ls").stdout  # `run` stops its sandbox

    with dsec.Client(server.url, server.key, autostart=False) as client:
        sb = client.create(ttl_s=120)
        assert sb.id in dsec_cli(server, "ls").stdout
        assert dsec_cli(server, "exec", sb.id, "echo in $PWD").stdout == "in /work\n"
        assert dsec_cli(server, "pause", sb.id).stdout == f"{sb.id}\n"
        assert sb.refresh().state == "paused" and "paused" in dsec_cli(server, "ls").stdout
        dsec_cli(server, "resume", sb.id)
        assert sb.refresh().state == "running"
        dsec_cli(server, "stop", sb.id)
        with pytest.raises(dsec.SandboxNotFound):
            sb.run("true")

    bad = dsec_cli(server, "exec", "sb-e000000-000000000000", "true", check=False)
    assert bad.returncode == 1 and "sandbox_not_found" in bad.stderr


def test_image_ls_shows_built_images(server: Server) -> None:
    listing = dsec_cli(server, "image", "ls").stdout
    assert "debian-minbase" in listing and "python-3.11" in listing


async def test_tcp_server_requires_a_created_key(images) -> None:  # type: ignore[no-untyped-def]
    srv = make_tcp_server()
    key = subprocess.run([sys.executable, "-m", "dsec", "key", "create", "trainer",
                          "--state-dir", str(srv.state_dir)], capture_output=True, text=True,
                         check=True).stdout.strip()
    srv.start()
    try:
        async with dsec.DSecClient(srv.url, key, autostart=False) as client:
            async with await client.create(ttl_s=60) as sb:
                assert (await sb.run("echo over tcp")).stdout == "over tcp\n"
        async with dsec.DSecClient(srv.url, "dsk_not-a-key", autostart=False) as wrong:
            with pytest.raises(dsec.Unauthorized):
                await wrong.list()
        anonymous = httpx.get(f"{srv.url}/v1/sandboxes")
        assert anonymous.status_code == 401
        assert anonymous.json()["error"]["code"] == "unauthorized"
    finally:
        stop_server(srv)
