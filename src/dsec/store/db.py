"""One small database interface over SQLite (the embedded default) and PostgreSQL (scale-out).

Callers write one dialect: ``?`` placeholders, ``INSERT ... ON CONFLICT DO NOTHING``, and the
SQLite spelling of the schema; ``open_database`` translates for PostgreSQL. Every statement
commits on its own (autocommit); ``transaction()`` groups several. Rows can be read by
column name or by position on both backends.

A target is a path (SQLite file), ``sqlite:///abs/path`` or ``postgresql://...``.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..protocol.errors import InvalidRequest
from . import walcheckpoint


class IntegrityError(Exception):
    """A constraint (primary key, unique) refused a write, on either backend."""


class Row(dict[str, Any]):
    """A result row readable as ``row["name"]`` and ``row[0]``."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)


class Database(ABC):
    """The interface both backends implement."""

    url: str

    @abstractmethod
    def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        """Run one statement (committed on its own outside a transaction)."""

    @abstractmethod
    def transaction(self) -> AbstractContextManager[None]:
        """Statements inside commit together, or not at all if the block raises."""

    def add_columns(self, table: str, columns: dict[str, str]) -> set[str]:
        """Give a table made by an older dsec the ``columns`` (name -> SQLite declaration)
        it lacks (``CREATE TABLE IF NOT EXISTS`` leaves an existing table as it was); the
        names it lacked."""
        missing = set(columns) - self.columns(table)
        for name in missing:
            self.execute(self._add_column(table, name, columns[name]))
        return missing

    @abstractmethod
    def columns(self, table: str) -> set[str]: ...

    @abstractmethod
    def _add_column(self, table: str, name: str, declaration: str) -> str: ...

    @abstractmethod
    def close(self) -> None: ...


class Result:
    def __init__(self, rows: list[Row], rowcount: int) -> None:
        self.rows = rows
        self.rowcount = rowcount

    def fetchone(self) -> Row | None:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[Row]:
        return self.rows

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)


class SqliteDatabase(Database):
    """One connection guarded by a lock, as PostgresDatabase: a transaction of one thread
    must not take in another thread's statements. Its log is checkpointed by the file's
    checkpoint thread (``store.walcheckpoint``), not by the commits."""

    def __init__(self, path: Path, schema: str) -> None:
        from .sqlite import connect
        self.url = f"sqlite:///{path}"
        self.path = path
        self._lock = threading.RLock()
        self._db = connect(path, schema)
        self._checkpointer: walcheckpoint.Checkpointer | None = walcheckpoint.acquire(path)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        with self._lock:
            try:
                cur = self._db.execute(sql, tuple(args))
            except sqlite3.IntegrityError as exc:
                raise IntegrityError(str(exc)) from exc
            return Result([Row(zip(r.keys(), r)) for r in cur.fetchall()], cur.rowcount)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def columns(self, table: str) -> set[str]:
        return {r["name"] for r in self.execute(f"PRAGMA table_info({table})")}

    def _add_column(self, table: str, name: str, declaration: str) -> str:
        return f"ALTER TABLE {table} ADD COLUMN {name} {declaration}"

    def close(self) -> None:
        self._db.close()
        if self._checkpointer is not None:  # closing twice is no error (sqlite3's close)
            walcheckpoint.release(self._checkpointer)
            self._checkpointer = None


_SCHEMA_WORDS = [(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b", "BIGSERIAL PRIMARY KEY"),
                 (r"\bREAL\b", "DOUBLE PRECISION"), (r"\bBLOB\b", "BYTEA"),
                 (r"\)\s*WITHOUT ROWID", ")")]


def postgres_schema(schema: str) -> str:
    for pattern, replacement in _SCHEMA_WORDS:
        schema = re.sub(pattern, replacement, schema)
    return schema


def postgres_statement(sql: str) -> str:
    """A statement in psycopg's placeholder style: ``?`` becomes ``%s``, a literal ``%`` is
    doubled (statements hold no ``?`` of their own, inside literals or not)."""
    return sql.replace("%", "%%").replace("?", "%s")


class PostgresDatabase(Database):
    """psycopg 3 in autocommit mode; one connection guarded by a lock (callers are the event
    loop thread and a few worker threads)."""

    def __init__(self, url: str, schema: str) -> None:
        import psycopg
        self.url = url
        self._psycopg = psycopg
        self._lock = threading.RLock()
        self._in_transaction = False
        self._db = psycopg.connect(url, autocommit=True)
        with self.transaction():  # schema creation races between processes: serialise it
            self._db.execute("SELECT pg_advisory_xact_lock(7411)")
            for statement in postgres_schema(schema).split(";"):
                if statement.strip():
                    self._db.execute(statement)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        with self._lock:
            try:
                cur = self._run(sql, args)
            except self._psycopg.errors.IntegrityError as exc:
                raise IntegrityError(str(exc)) from exc
            except self._psycopg.OperationalError:
                if not self._db.broken or self._in_transaction:
                    raise
                # The server restarted or dropped the connection: reconnect and run the
                # statement again (all of ours are idempotent or keyed: at worst a write whose
                # commit was lost with the answer meets its own row).
                self._db = self._psycopg.connect(self.url, autocommit=True)
                cur = self._run(sql, args)
            rows = []
            if cur.description is not None:
                names = [c.name for c in cur.description]
                rows = [Row(zip(names, r)) for r in cur.fetchall()]
            return Result(rows, cur.rowcount)

    def _run(self, sql: str, args: Sequence[Any]) -> Any:
        return self._db.execute(postgres_statement(sql), tuple(args))

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock, self._db.transaction():
            self._in_transaction = True
            try:
                yield
            finally:
                self._in_transaction = False

    def columns(self, table: str) -> set[str]:
        return {r["column_name"] for r in self.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name=?", (table,))}

    def _add_column(self, table: str, name: str, declaration: str) -> str:
        # another server may be adding it too
        return postgres_schema(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {declaration}")

    def close(self) -> None:
        self._db.close()


def open_database(target: Path | str, schema: str) -> Database:
    """The database at ``target`` with ``schema`` applied."""
    if isinstance(target, Path):
        return SqliteDatabase(target, schema)
    if target.startswith("sqlite:///"):
        return SqliteDatabase(Path(target.removeprefix("sqlite://")), schema)
    if target.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(target, schema)
    raise InvalidRequest(f"state URL {target!r}: expected sqlite:///PATH or postgresql://...")
