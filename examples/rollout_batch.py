"""A batch of 20 toy rollouts, the way an RL trainer uses dsec.

Each rollout gets its own sandbox, "solves" a tiny task the way an agent would (writes a file,
runs shell commands in a session), is scored by a test command, and is thrown away.
"""

from __future__ import annotations

import asyncio
import sys
import time

from rich.console import Console
from rich.table import Table

import dsec

N = 20
TASK = """\
def add(a, b):
    return a + b{bug}
"""
TEST = "python3 -c 'from solution import add; assert add(2, 3) == 5; print(\"pass\")'"


async def rollout(client: dsec.AsyncClient, i: int) -> dict[str, object]:
    started = time.perf_counter()
    async with await client.create(image="python-3.11", cpu=0.5, memory_mb=256, ttl_s=120) as sb:
        ready = time.perf_counter()
        shell = sb.session("agent")
        await shell.run("mkdir -p task && cd task")
        # every fifth "agent" writes a buggy solution, so the rewards are not all equal
        await sb.write_file("/work/task/solution.py", TASK.format(bug=" + 1" if i % 5 == 0 else ""))
        result = await shell.run(TEST, timeout_s=30)
    return {"i": i, "reward": 1.0 if result.stdout.strip() == "pass" else 0.0,
            "create_ms": (ready - started) * 1000, "total_ms": (time.perf_counter() - started) * 1000}


async def main() -> int:
    console = Console()
    async with dsec.AsyncClient() as client:
        with console.status(f"running {N} rollouts"):
            began = time.perf_counter()
            results = await asyncio.gather(*(rollout(client, i) for i in range(N)),
                                           return_exceptions=True)
            wall = time.perf_counter() - began
    table = Table("rollout", "reward", "create ms", "total ms", title="dsec rollout batch")
    failures = 0
    for r in results:
        if isinstance(r, BaseException):
            failures += 1
            table.add_row("-", f"[red]{type(r).__name__}: {r}[/red]", "", "")
        else:
            table.add_row(str(r["i"]), f"{r['reward']:.0f}", f"{r['create_ms']:.0f}", f"{r['total_ms']:.0f}")
    console.print(table)
    rewards = [r["reward"] for r in results if isinstance(r, dict)]
    console.print(f"{len(rewards)}/{N} rollouts finished in {wall:.1f}s, mean reward "
                  f"{sum(rewards) / max(len(rewards), 1):.2f}, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
