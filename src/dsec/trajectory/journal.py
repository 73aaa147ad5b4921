"""Step outcomes between their answer and the table: an append-only file per server process.

A step's outcome must be durable before its result goes back to the client: a server that
crashes after answering must not leave a step the client saw as interrupted. A commit of the
embedded SQLite database per outcome cost as much as the rest of a logged call together; one
``write`` to a file is as durable (against a crash of the process: what SQLite's
``synchronous=NORMAL`` promises, too) and costs microseconds. The log folds what is journaled
into its table right after the answer (one transaction for every outcome written meanwhile,
so a burst over many trajectories commits once), before it reads the table, and at close.
A process that died leaves its journal to the next one that opens the database: a live
process holds a lock on its own file, so a journal whose lock can be taken is an orphan.

A record is one line: the step's key, status and end time as JSON, a tab, the stored outcome
as JSON. Both are ASCII with every control character escaped, so nothing a sandbox printed
can hold a raw tab or newline: it cannot end a record or start another. A line without its
newline (a write cut short by the crash) was never answered, and is dropped; so is a line
that does not parse. The fold only finishes a step still ``running`` under the journal's own
owner, so a record never touches another server's step, or one finished already.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger("dsec.trajectory")

SUFFIX = ".outcomes"


@dataclass(frozen=True)
class Finish:
    """A claimed step's outcome, as the table's ``UPDATE`` takes it."""

    status: str  # ok | error
    ended_at: float
    trajectory: str
    generation: int
    step: int
    owner: str
    outcome: str  # the stored outcome, as JSON text

    def line(self) -> bytes:
        key = json.dumps([self.status, self.ended_at, self.trajectory, self.generation, self.step,
                          self.owner], separators=(",", ":"))
        return f"{key}\t{self.outcome}\n".encode("ascii")

    @classmethod
    def parse(cls, line: bytes) -> Finish | None:
        """The record of a whole line, or None for one that is not a record."""
        try:
            key, tab, outcome = line.decode("ascii").partition("\t")
            status, ended_at, trajectory, generation, step, owner = json.loads(key)
            if not (tab and status in ("ok", "error") and isinstance(json.loads(outcome), dict)
                    and isinstance(ended_at, float) and isinstance(trajectory, str)
                    and isinstance(owner, str) and type(generation) is int and type(step) is int):
                return None
        except (ValueError, TypeError):  # not ASCII, not JSON, not six fields
            return None
        return cls(status, ended_at, trajectory, generation, step, owner, outcome)

    def params(self) -> tuple[str, str, float, str, int, int, str]:
        return (self.status, self.outcome, self.ended_at, self.trajectory, self.generation,
                self.step, self.owner)


class Journal:
    """This process's journal: ``append`` before answering, ``folded`` once the pending
    records are in the table."""

    def __init__(self, directory: Path, owner: str) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = directory / f"{owner}{SUFFIX}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL
                           | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # held for the life of the process
        self._size = 0
        self.pending: list[Finish] = []

    def append(self, finish: Finish) -> None:
        """The record is in the file when this returns (or raises, and is not)."""
        data = finish.line()
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError:
            os.ftruncate(self._fd, self._size)  # no half record before the next one
            raise
        self._size += len(data)
        self.pending.append(finish)

    def folded(self) -> None:
        self.pending = []
        os.ftruncate(self._fd, 0)
        self._size = 0

    def close(self) -> None:
        """Remove the journal (its records folded)."""
        self.path.unlink(missing_ok=True)
        os.close(self._fd)


def orphans(directory: Path) -> Iterator[list[Finish]]:
    """The records of each journal in ``directory`` that no live process holds, with its
    lock held until the caller asks for the next one (then the file is removed)."""
    if not directory.is_dir():
        return
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # taken and removed by another process meanwhile
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its process is alive
            with os.fdopen(os.dup(fd), "rb") as f:
                lines = f.read().split(b"\n")[:-1]  # the last piece has no newline: cut short
            finishes = [r for r in map(Finish.parse, lines) if r is not None]
            if len(finishes) < len(lines):
                log.warning("journal %s: %d unreadable records dropped", path,
                            len(lines) - len(finishes))
            yield finishes
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
