"""WAL checkpoints of a SQLite state database, in a thread of their own.

SQLite copies its write-ahead log back into the database file (a checkpoint, with an
``fdatasync`` of each) in whichever connection commits once the log holds 1,000 pages. The
server's connections commit on the event loop, so every few hundred trajectory steps one call
stood still for the copy and its syncs (3-13 ms on this project's CI disk) and every other
request of the server with it. Here each process keeps one thread per database file that
runs a ``PASSIVE`` checkpoint every ``INTERVAL_S`` on its own connection (it waits for
nobody and blocks nobody: writers go on appending meanwhile, readers in other processes go on
reading; SQLite releases the GIL while it copies and syncs), and the process's connections
checkpoint themselves only past ``BACKSTOP_PAGES`` (a log this thread cannot keep up with
stays bounded).

Durability is unchanged: a commit is in the log (``synchronous=NORMAL``) whoever checkpoints
it later, and a crash mid-checkpoint is recovered by SQLite as before.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

log = logging.getLogger("dsec.store")

INTERVAL_S = 0.5  # between checkpoints
ROUNDS = 3  # checkpoints in a row at most, while commits come in
BACKSTOP_PAGES = 10_000  # a connection checkpoints itself past this many log pages (40 MiB)


class Checkpointer:
    """The checkpoint thread of one database file, shared by the process's connections to it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.users = 0
        self._stop = threading.Event()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._thread = threading.Thread(target=self._loop, name=f"dsec-wal-checkpoint {path.name}",
                                        daemon=True)
        self._thread.start()

    def checkpoint(self) -> tuple[int, int, int]:
        """One passive checkpoint now: (busy, pages in the log, pages copied back)."""
        # fetchall: a statement left unfinished would hold a read lock, and the log could
        # never start over from its beginning
        ((busy, pages, copied),) = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        return busy, pages, copied

    def _loop(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                # Again while commits came in meanwhile (a few pages now): the log starts
                # over from its beginning only at a commit that finds it all copied back.
                seen = -1
                for _ in range(ROUNDS):
                    busy, pages, copied = self.checkpoint()
                    if busy or pages == seen:
                        break
                    seen = pages
            except sqlite3.Error as exc:  # another process's checkpoint, a full disk: next time
                log.debug("WAL checkpoint of %s: %s", self.path, exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._db.close()


_lock = threading.Lock()
_checkpointers: dict[Path, Checkpointer] = {}


def acquire(path: Path) -> Checkpointer:
    """The checkpointer of ``path`` (started on first use); ``release`` it when done."""
    key = path.resolve()
    with _lock:
        checkpointer = _checkpointers.get(key)
        if checkpointer is None:
            checkpointer = _checkpointers[key] = Checkpointer(key)
        checkpointer.users += 1
        return checkpointer


def release(checkpointer: Checkpointer) -> None:
    """One user fewer; the last one stops the thread."""
    with _lock:
        checkpointer.users -= 1
        if checkpointer.users > 0:
            return
        del _checkpointers[checkpointer.path]
    checkpointer.stop()
