"""Fuzz the whole OpenAPI with schemathesis against a real server and real sandboxes.

Checks: no 5xx that is not a typed refusal (``not_a_server_error``), and every 4xx/5xx body
a typed dsec error (``typed_dsec_error``); see tests/support/fuzz_hooks.py. Deterministic: a fixed
seed, one worker, no shrinking, no example database, no cache, and nothing generated from
the server's answers (tests/fuzz.toml), so CI generates exactly the cases a local run does
(clean locally with seeds 1-12, up to 150 examples per operation). Bounded: a fixed number
of examples per operation, and a hard timeout on the run.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from conftest import Server, make_tcp_server, stop_server
from test_recovery import first_edge_id, host_traces

SEED = int(os.environ.get("DSEC_FUZZ_SEED", "20260"))  # fixed; the variable explores others
EXAMPLES_PER_OPERATION = 20
RUN_TIMEOUT_S = 240  # typically 10 s; a hung call fails the test instead of hanging the suite
ST = Path(sys.executable).with_name("st")
OPERATIONS = 20  # at least: the routes of main when this test was written
CONFIG = Path(__file__).with_name("fuzz.toml")  # no cache, nothing learnt from responses


@pytest.fixture(scope="module")
def fuzz_server(images) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    srv = make_tcp_server("--capacity", "4", "--warm-pool", "0").start()  # leak check: all listed
    yield srv
    stop_server(srv)


async def test_openapi_fuzz(fuzz_server: Server, tmp_path: Path) -> None:
    async with fuzz_server.client() as client:
        sb = await client.create(ttl_s=3600)
        await client.create(ttl_s=3600, trajectory=f"fuzz-{sb.id}")
        proc = await sb.start("sleep 3600")
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "support.fuzz_hooks",
               "PYTHONPATH": str(Path(__file__).parent), "DSEC_FUZZ_SANDBOX": sb.id,
               "DSEC_FUZZ_PROCESS": proc.id, "DSEC_FUZZ_TRAJECTORY": f"fuzz-{sb.id}"}
        run = await asyncio.to_thread(
            subprocess.run,
            [str(ST), "--config-file", str(CONFIG), "run", f"{fuzz_server.url}/openapi.json",
             "-H", f"Authorization: Bearer {fuzz_server.key}",
             "--checks", "not_a_server_error,typed_dsec_error",
             "--seed", str(SEED), "--no-shrink", "--workers", "1",
             "--generation-database", "none", "-n", str(EXAMPLES_PER_OPERATION),
             "--request-timeout", "120", "--no-color"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
        generated = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
        assert generated and generated[1] == generated[2], run.stdout[-5000:]
        assert int(generated[1]) >= EXAMPLES_PER_OPERATION * OPERATIONS, run.stdout[-5000:]
        operations = re.search(r"Selected: (\d+)/(\d+)\s+Tested: (\d+)", run.stdout)
        assert operations and int(operations[3]) == int(operations[2]) >= OPERATIONS, \
            run.stdout[-5000:]  # every route of the schema, not just many cases on a few

        # The server and the sandbox under fire are fine, and nothing of anything the fuzzer
        # created is left once it is all stopped.
        assert (await sb.run("echo survived")).stdout == "survived\n"
        for info in await client.list():
            try:
                await (await client.get(info.id)).stop()
            except dsec.SandboxNotFound:  # a fuzzed create with a TTL of a second or so
                pass
    edge_id = first_edge_id(fuzz_server)
    deadline = time.monotonic() + 60
    while any((traces := host_traces(fuzz_server, edge_id)).values()):
        assert time.monotonic() < deadline, traces
        await asyncio.sleep(0.2)
