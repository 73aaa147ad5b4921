"""How the server starts the OCI runtime (``substrates/host/spawn.py``): a vfork child whose
start is slow must not stop the server's other threads (issue 15: ``os.posix_spawn`` held the
GIL until each child had exec'd), and the ctypes call takes nothing the C side would read
differently from what Python holds (a NUL inside an argument)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from dsec.protocol.errors import NotSupported
from dsec.substrates.host import spawn
from dsec.substrates.host.spawn import Spawned


async def test_output_exit_code_and_stderr(tmp_path: Path) -> None:
    err = tmp_path / "err"
    child = await Spawned.start(["sh", "-c", "cat; printf R; echo oops >&2; exit 3"],
                                capture_stdout=True, stderr=err)
    assert await child.first_byte() == b"R"  # stdin is /dev/null: cat ends at once
    assert await child.wait() == 3
    assert err.read_text() == "oops\n" and err.stat().st_mode & 0o777 == 0o600
    assert await spawn.run(["true"]) == 0 and await spawn.run(["false"]) == 1


@pytest.mark.timeout(60)  # the old spawn deadlocked here: a hang fails, never a timing
async def test_a_child_slow_to_start_stops_no_other_thread(tmp_path: Path) -> None:
    """The child's stdout is a FIFO: its spawn cannot finish until another thread of this
    process opens the FIFO's other end, which it can only do while the spawn waits."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened = threading.Event()

    def reader() -> None:
        os.close(os.open(fifo, os.O_RDONLY))
        opened.set()

    thread = threading.Thread(target=reader)
    thread.start()
    pid = await asyncio.to_thread(spawn.posix_spawn, [spawn.resolve("true")], str(fifo),
                                  "/dev/null")
    thread.join()
    assert opened.is_set()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.parametrize("argv", [["echo", "ok\0; rm -rf /"], ["/bin/ec\0ho", "x"]])
async def test_a_nul_inside_an_argument_is_refused(argv: list[str], tmp_path: Path) -> None:
    """ctypes would pass ``ok`` alone (or run another program): refused, nothing started."""
    before = _children()
    with pytest.raises(ValueError, match="null byte"):
        await Spawned.start(argv, capture_stdout=True, stderr=tmp_path / "err")
    assert _children() == before


async def test_a_missing_or_unrunnable_program(tmp_path: Path) -> None:
    with pytest.raises(NotSupported):
        await spawn.run(["dsec-no-such-program"])
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        await spawn.run([str(script)])


def test_path_is_searched_once_per_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime is resolved at every create and stop, on the event loop: PATH is searched
    the first time only. A program that is absent is searched again (and still refused)."""
    monkeypatch.setattr(spawn, "_found", {})  # this test's own, whatever ran before
    found = spawn.resolve("true")
    assert os.path.isabs(found)
    monkeypatch.setenv("PATH", str(tmp_path))  # from now on, a search would find nothing
    assert spawn.resolve("true") == found
    with pytest.raises(NotSupported):
        spawn.resolve("dsec-no-such-program")
    (tmp_path / "dsec-no-such-program").write_text("#!/bin/sh\n")
    (tmp_path / "dsec-no-such-program").chmod(0o755)
    assert spawn.resolve("dsec-no-such-program") == str(tmp_path / "dsec-no-such-program")


async def test_a_cancelled_start_leaves_no_child() -> None:
    before = _children()
    for _ in range(20):
        start = asyncio.ensure_future(Spawned.start(["sleep", "1000"], capture_stdout=True,
                                                    stderr=None))
        await asyncio.sleep(0)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
    while _children() != before:  # killed and reaped by a spawn thread
        await asyncio.sleep(0.05)


def _children() -> set[int]:
    """This process's children, from each of its threads' lists."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            found.update(int(p) for p in (task / "children").read_text().split())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return found
