"""``dsec bench --only stdin``: what input to a running process and a terminal's round trip
cost, on one container sandbox, alternating batches (``bench.compare``) against the
cheapest call of the same size through the same stack:

- ``Process.send_stdin`` of 100 bytes to ``cat`` against ``write_file`` of 100 bytes;
- a terminal's round trip (type a line into ``cat`` on a PTY, read one live stream until
  the line comes back) against ``run("echo")``'s round trip;
- stdin throughput: 64 MiB in 1 MiB calls into ``wc -c`` (MiB/s, not ms).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable
from typing import cast

from rich.console import Console

from dsec.client.aio import OutputChunk, Process

from .bench import Sample, compare, one_sandbox, phase


async def stdin_series(console: Console, quick: bool = False) -> list[Sample]:
    rounds = 3 if quick else 10
    samples: list[Sample] = []
    async with one_sandbox("stdin") as sb:
        line = b"x" * 99 + b"\n"
        fed = await sb.start("cat > /dev/null", stdin_open=True)
        with phase(console, "send_stdin"):
            samples += await compare(
                Sample("write_file, 100 B", []), lambda: _ms(sb.write_file("/tmp/w", line)),
                Sample("send_stdin, 100 B", []), lambda: _ms(fed.send_stdin(line)),
                20, rounds)
        await fed.kill()
        term = await sb.pty(80, 24, command="cat")
        reader = _Reader(term)
        counter = iter(range(1 << 30))
        with phase(console, "a terminal's round trip"):
            samples += await compare(
                Sample("run('echo') round trip", []), lambda: _ms(sb.run("echo x")),
                Sample("pty: type a line, read it back", []),
                lambda: reader.round_trip(f"m{next(counter)}z"), 20, rounds)
        await term.kill()
        await reader.close()
        throughput = Sample("stdin throughput (MiB/s, not ms)", [])
        with phase(console, "stdin throughput"):
            for _ in range(rounds):
                counted = await sb.start("wc -c", stdin_open=True)
                t0 = time.perf_counter()
                for _ in range(64):
                    await counted.send_stdin(b"y" * (1 << 20))
                await counted.close_stdin()
                await counted.wait()
                throughput.values_ms.append(64 / (time.perf_counter() - t0))
        samples.append(throughput)
    return samples


class _Reader:
    """One live reader of a terminal, as a harness keeps: a round trip types a marker and
    reads on until it came back twice (the terminal's echo, then what ``cat`` wrote)."""

    def __init__(self, term: Process) -> None:
        self.term = term
        # the stream's iterator is an async generator: closed here, not collected mid-read
        self.chunks = cast(AsyncGenerator[OutputChunk, None], aiter(term.stream()))
        self.seen = ""

    async def close(self) -> None:
        await self.chunks.aclose()

    async def round_trip(self, marker: str) -> float:
        t0 = time.perf_counter()
        await self.term.send_stdin(marker + "\n")
        while self.seen.count(marker) < 2:
            self.seen = self.seen[-4096:] + (await anext(self.chunks)).text
        return (time.perf_counter() - t0) * 1000


async def _ms(call: Awaitable[object]) -> float:
    t0 = time.perf_counter()
    await call
    return (time.perf_counter() - t0) * 1000
