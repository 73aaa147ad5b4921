"""A rollout worker for test_trajectory.py, run as its own process so the test can SIGKILL it:
creates (or resumes) a trajectory and runs STEPS non-idempotent steps, printing each result
as a JSON line the moment it has it.

    python trajectory_worker.py URL KEY TRAJECTORY create|resume
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from typing import Any

import dsec

STEPS = 50
SLOW_STEP = 31  # runs for a while, so a kill after step 30 likely lands while it runs


def step_command(i: int) -> str:
    """Appends a line, increments a counter, and prints something no re-run reproduces."""
    slow = "sleep 1; " if i == SLOW_STEP else ""
    return (f"{slow}echo step-{i} >> /work/appends; n=$(cat /work/counter 2>/dev/null || echo 0); "
            f"n=$((n+1)); echo $n > /work/counter; echo step {i} count $n at $(date +%s%N); "
            f"echo err-{i} >&2")


def result_record(i: int, r: dsec.CommandResult) -> dict[str, Any]:
    return {"step": i, "exit_code": r.exit_code, "signal": r.signal,
            "stdout": base64.b64encode(r.stdout_bytes).decode(),
            "stderr": base64.b64encode(r.stderr_bytes).decode(),
            "stdout_truncated": r.stdout_truncated, "stderr_truncated": r.stderr_truncated,
            "timed_out": r.timed_out, "oom_killed": r.oom_killed, "duration_ms": r.duration_ms}


async def main(url: str, key: str, trajectory: str, mode: str) -> None:
    async with dsec.DSecClient(url, key, autostart=False) as client:
        if mode == "create":
            sb = await client.create(ttl_s=300, memory_mb=256, trajectory=trajectory)
        else:
            sb = await client.resume(trajectory)
        for i in range(1, STEPS + 1):
            r = await sb.run(step_command(i))
            print(json.dumps(result_record(i, r)), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
