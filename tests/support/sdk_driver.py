"""Drives a real server with the SDK alone, in an interpreter that has only ``pip install dsec``
(no extras): ``python sdk_driver.py URL KEY`` prints one JSON object of what it observed, for
tests/test_sdk_pythons.py to check. Nothing here may need more than the SDK's dependencies."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from typing import Any

import dsec

SERVER_MODULES = ("fastapi", "uvicorn", "pyroute2", "psycopg", "prometheus_client", "ray")


async def async_calls(url: str, key: str) -> dict[str, Any]:
    async with dsec.DSecClient(url, key, autostart=False) as client:
        sb = await client.create(ttl_s=120)
        ran = await sb.run("echo hi-$((6 * 7)); echo err >&2; exit 3")
        await sb.write_file("/work/note.txt", b"written by the SDK\n")
        read = await sb.read_file("/work/note.txt")
        listed = sb.id in [s.id for s in await client.list()]
        await sb.stop()
        try:
            await sb.run("true")
            after_stop = "ran"
        except dsec.SandboxNotFound:
            after_stop = "SandboxNotFound"
    return {"stdout": ran.stdout, "stderr": ran.stderr, "exit_code": ran.exit_code,
            "read": read.decode(), "listed": listed, "after_stop": after_stop}


def sync_calls(url: str, key: str) -> dict[str, Any]:
    with dsec.Client(url, key, autostart=False) as client:
        with client.create(ttl_s=120) as sb:
            hostname = sb.run("cat /proc/sys/kernel/hostname").stdout.strip()
            return {"hostname_is_id": hostname == sb.id}


def main() -> None:
    url, key = sys.argv[1:3]
    report: dict[str, Any] = {
        "python": list(sys.version_info[:2]),
        "server_modules_installed": [m for m in SERVER_MODULES if importlib.util.find_spec(m)],
        "async": asyncio.run(async_calls(url, key)),
        "sync": sync_calls(url, key),
    }
    report["dsec_modules_loaded"] = sorted(m for m in sys.modules if m.startswith("dsec"))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
