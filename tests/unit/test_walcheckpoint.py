"""WAL checkpoints in a thread of their own (``dsec.store.walcheckpoint``): the process's
connections leave them to it; what they committed is durable before any checkpoint (a
process killed between a step's claim and its outcome leaves the step interrupted, the
one before it whole); readers in other processes (``dsec ls``, a second server on the file)
read every commit while the server writes and checkpoints; the thread is shared per file and
stops with its last user; servers that open a new file at the same moment all get it in WAL mode."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

from dsec.protocol.digest import StepRequest
from dsec.store import walcheckpoint
from dsec.store.blobs import BlobStore
from dsec.store.db import SqliteDatabase
from dsec.store.sqlite import StateStore
from dsec.trajectory.log import TrajectoryLog

REQUEST = StepRequest("exec", {"command": ["true"]})
OK = {"value": {"exit_code": 0}, "bytes": {}}


def test_connections_leave_checkpoints_to_the_thread(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "state.db", "CREATE TABLE IF NOT EXISTS t (x INTEGER);")
    try:
        (pages,) = db.execute("PRAGMA wal_autocheckpoint").fetchone().values()
        assert pages == walcheckpoint.BACKSTOP_PAGES
        for x in range(50):
            db.execute("INSERT INTO t VALUES (?)", (x,))
        checkpointer = db._checkpointer
        assert checkpointer is not None
        busy, logged, copied = checkpointer.checkpoint()
        assert (busy, copied) == (0, logged) and logged > 0
        # everything copied back: the next commit starts the log over from its beginning
        db.execute("INSERT INTO t VALUES (50)")
        assert checkpointer.checkpoint()[1] < logged
        assert db.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 51
    finally:
        db.close()


def test_one_thread_per_file_stopped_by_its_last_user(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    log = TrajectoryLog(tmp_path / "state.db", BlobStore(tmp_path / "blobs"), "unit")
    checkpointer = log._db._checkpointer  # type: ignore[attr-defined]
    assert store._db._checkpointer is checkpointer  # type: ignore[attr-defined]
    assert checkpointer.users == 2 and checkpointer._thread.is_alive()
    store.close()
    assert checkpointer._thread.is_alive()
    log.close()
    assert not checkpointer._thread.is_alive()
    assert checkpointer.path not in walcheckpoint._checkpointers
    log.close()  # twice: no error, the thread is not released again
    reopened = StateStore(tmp_path / "state.db")  # a new thread for the file
    assert reopened._db._checkpointer is not checkpointer  # type: ignore[attr-defined]
    reopened.close()


CRASH = """
import os, signal, sys
from pathlib import Path
from dsec.protocol.digest import StepRequest
from dsec.store.blobs import BlobStore
from dsec.trajectory.log import TrajectoryLog
root = Path(sys.argv[1])
log = TrajectoryLog(root / "state.db", BlobStore(root / "blobs"), "crashed")
log.create("t", "sb-1", {{}}, "img", "sha256:0", None)
request = StepRequest("exec", {{"command": ["true"]}})
for step in range(1, {steps}):
    assert log.claim("t", 1, step, request, "sb-1", None)
    log.finish("t", 1, step, {{"value": {{"exit_code": 0}}, "bytes": {{}}}})
assert log.claim("t", 1, {steps}, request, "sb-1", None)
os.kill(os.getpid(), signal.SIGKILL)  # between the claim and the outcome
"""


def test_a_kill_between_claim_and_outcome_leaves_the_step_interrupted(tmp_path: Path) -> None:
    steps = 300  # more log pages than SQLite's own threshold (1,000): the commits left
    # their checkpoints to the thread, which may or may not have run before the kill
    child = subprocess.run([sys.executable, "-c", CRASH.format(steps=steps), str(tmp_path)],
                           capture_output=True)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    assert (tmp_path / "state.db-wal").stat().st_size > 0  # the rows are (also) in the log
    log = TrajectoryLog(tmp_path / "state.db", BlobStore(tmp_path / "blobs"), "restarted")
    try:
        rows = log.steps("t", 1)
        assert [r.step for r in rows] == list(range(1, steps + 1))
        assert all(r.status == "ok" and r.outcome == OK for r in rows[:-1])
        assert rows[-1].status == "interrupted" and rows[-1].outcome is None
        assert not log.claim("t", 1, steps, REQUEST, "sb-2", None)  # taken: never run twice
        assert log.step("t", 1, steps).status == "interrupted"  # type: ignore[union-attr]
    finally:
        log.close()


READER = """
import sqlite3, sys
seen = 0
for _ in range({reads}):
    with sqlite3.connect(f"file:{{sys.argv[1]}}?mode=ro", uri=True, timeout=10) as db:
        count = db.execute("SELECT COUNT(*) FROM t").fetchone()[0]
    assert count >= seen, (count, seen)
    seen = count
    print(count, flush=True)
    sys.stdin.readline()  # the writer commits and checkpoints meanwhile
"""


def test_a_reader_in_another_process_reads_every_commit(tmp_path: Path) -> None:
    """As ``dsec ls`` reads the state store while the server writes and checkpoints."""
    path = tmp_path / "state.db"
    db = SqliteDatabase(path, "CREATE TABLE IF NOT EXISTS t (x INTEGER);")
    checkpointer = db._checkpointer
    assert checkpointer is not None
    reads = 20
    reader = subprocess.Popen([sys.executable, "-c", READER.format(reads=reads), str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert reader.stdin is not None and reader.stdout is not None
    try:
        for i in range(reads):
            assert int(reader.stdout.readline()) == i * 40  # every commit so far
            for x in range(40):
                db.execute("INSERT INTO t VALUES (?)", (x,))
            if i % 2:
                checkpointer.checkpoint()
            reader.stdin.write("\n")
            reader.stdin.flush()
        assert reader.wait() == 0
    finally:
        if reader.poll() is None:
            os.kill(reader.pid, signal.SIGKILL)
        db.close()
    with sqlite3.connect(path) as check:  # the last connection closed: all in the file
        assert check.execute("SELECT COUNT(*) FROM t").fetchone()[0] == reads * 40


def test_servers_opening_a_new_file_at_once_all_open_it(tmp_path: Path) -> None:
    # the switch to WAL needs the file to itself; SQLite tells the losers "locked" at once
    failures: list[BaseException] = []

    def open_store(path: Path) -> None:
        try:
            StateStore(path).close()
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            failures.append(e)

    for attempt in range(60):
        path = tmp_path / f"{attempt}" / "state.db"
        openers = [threading.Thread(target=open_store, args=(path,)) for _ in range(4)]
        for t in openers:
            t.start()
        for t in openers:
            t.join()
        assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert failures == []
