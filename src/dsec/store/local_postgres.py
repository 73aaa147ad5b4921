"""A throwaway PostgreSQL cluster from the Debian ``postgresql`` package, for tests and
benchmarks: ``initdb`` as the ``postgres`` user into a temporary directory, listening only on
a Unix socket in that directory (on a random port number, which names the socket), removed
on ``stop``. Not for production: fsync is off.
"""

from __future__ import annotations

import glob
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ..protocol.errors import NotSupported


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise NotSupported("PostgreSQL is not installed (apt-get install postgresql)")
    return found[-1]


class LocalPostgres:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
        self.port = random.randint(20000, 60000)
        self.data = self.dir / "data"
        shutil.chown(self.dir, "postgres", "postgres")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@/postgres?host={self.dir}&port={self.port}"

    def _as_postgres(self, *argv: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.dir)

    def start(self) -> LocalPostgres:
        self._as_postgres(_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                          "--no-sync")
        options = (f"-k {self.dir} -p {self.port} -c listen_addresses='' -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._as_postgres(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"),
                          "-o", options, "-w", "-t", "120", "start")
        self._wait()
        return self

    def _wait(self) -> None:
        import psycopg
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(self.url).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        if self.data.exists():
            subprocess.run(["runuser", "-u", "postgres", "--", _bin("pg_ctl"), "-D", str(self.data),
                            "-m", "immediate", "-w", "stop"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, cwd=self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)

    def fresh_database(self, name: str) -> str:
        """The URL of a new empty database in this cluster."""
        import psycopg
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url.replace("/postgres?", f"/{name}?")
