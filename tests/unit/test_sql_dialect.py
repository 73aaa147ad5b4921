"""The state store's one SQL dialect: statements written once (SQLite's spelling, ``?``
placeholders) run on SQLite as they are and on PostgreSQL as ``store.db`` renders them.

Without a PostgreSQL server, the rendering is checked with PostgreSQL's own parser (pglast,
libpg_query): every schema and every statement of the stores must parse, with the column
types PostgreSQL's documentation gives for SQLite's; SQLite's side runs on a real file.
"""

from __future__ import annotations

import ast
import inspect
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pglast
import pytest
from pglast import ast as pg

from dsec.protocol.errors import InvalidRequest
from dsec.store import idempotency, projects, templates
from dsec.store import sqlite as state
from dsec.store.db import (
    IntegrityError,
    SqliteDatabase,
    open_database,
    postgres_schema,
    postgres_statement,
)
from dsec.trajectory import log

STORES = [state, projects, idempotency, templates, log]
# SQLite's declared type -> the PostgreSQL type of the same values (as libpg_query names it)
PG_TYPE = {"TEXT": "text", "INTEGER": "int4", "BIGINT": "int8", "REAL": "float8",
           "DOUBLE PRECISION": "float8", "BLOB": "bytea"}


def pg_columns(sql: str) -> dict[str, list[tuple[str, str]]]:
    """table -> [(column, type)] of the CREATE TABLE statements of ``sql``, as PostgreSQL parses it."""
    tables = {}
    for raw in pglast.parse_sql(sql):
        if isinstance(raw.stmt, pg.CreateStmt):
            tables[raw.stmt.relation.relname] = [
                (c.colname, c.typeName.names[-1].sval) for c in raw.stmt.tableElts if isinstance(c, pg.ColumnDef)]
    return tables


def sqlite_columns(schema: str) -> dict[str, list[tuple[str, str]]]:
    db = sqlite3.connect(":memory:")
    db.executescript(schema)
    names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")]
    return {t: [(r[1], r[2]) for r in db.execute(f"PRAGMA table_info({t})")] for t in names}


@pytest.mark.parametrize("module", STORES, ids=lambda m: m.__name__)
def test_every_schema_renders_to_postgresql_with_the_same_columns(module: ModuleType) -> None:
    schema = module.SCHEMA
    rendered = pg_columns(postgres_schema(schema))
    declared = sqlite_columns(schema)
    assert rendered.keys() == declared.keys() and rendered
    for table, columns in declared.items():
        assert [name for name, _ in rendered[table]] == [name for name, _ in columns], table
        for (name, sqlite_type), (_, pg_type) in zip(columns, rendered[table], strict=True):
            autoincrement = re.search(rf"\b{name} INTEGER PRIMARY KEY AUTOINCREMENT\b", schema)
            assert pg_type == ("bigserial" if autoincrement else PG_TYPE[sqlite_type]), (table, name)


def test_sqlite_only_words_are_gone_from_the_rendering() -> None:
    for module in STORES:
        rendered = postgres_schema(module.SCHEMA)
        for word in ("AUTOINCREMENT", "WITHOUT ROWID", "BLOB", " REAL"):
            assert word not in rendered, (module.__name__, word)


def test_placeholders_become_psycopgs_and_a_literal_percent_is_kept() -> None:
    assert postgres_statement("SELECT * FROM t WHERE a=? AND b LIKE 'x%' AND c IN (?,?)") == \
        "SELECT * FROM t WHERE a=%s AND b LIKE 'x%%' AND c IN (%s,%s)"
    assert postgres_statement("SELECT 1") == "SELECT 1"


def as_server_sees_it(statement: str) -> str:
    """What psycopg sends for a %s-style statement: numbered parameters, '%%' as '%'."""
    numbers = iter(range(1, 1000))
    return re.sub(r"%%|%s", lambda m: "%" if m.group() == "%%" else f"${next(numbers)}", statement)


def store_statements(module: ModuleType) -> list[str]:
    """The SQL text of every ``execute(...)`` of a store module whose statement is a literal."""
    found = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "execute"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append(node.args[0].value)
    return [sql for sql in found if not sql.startswith("PRAGMA")]  # SQLite's connection set-up


def assert_postgresql(sql: str) -> None:
    statement = as_server_sees_it(postgres_statement(sql))
    try:
        (parsed,) = pglast.parse_sql(statement)
    except pglast.parser.ParseError as exc:
        raise AssertionError(f"not PostgreSQL: {statement!r}: {exc}") from None
    assert statement.count("$") == sql.count("?")
    assert not isinstance(parsed.stmt, pg.VariableSetStmt)


@pytest.mark.parametrize("module", STORES, ids=lambda m: m.__name__)
def test_every_literal_statement_of_the_stores_parses_as_postgresql(module: ModuleType) -> None:
    statements = store_statements(module)
    assert len(statements) >= 5
    for sql in statements:
        assert_postgresql(sql)


@pytest.fixture
def executed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement the stores run on SQLite during a test (they still run)."""
    seen: list[str] = []
    run = SqliteDatabase.execute

    def execute(self: SqliteDatabase, sql: str, args: Any = ()) -> Any:
        seen.append(sql)
        return run(self, sql, args)

    monkeypatch.setattr(SqliteDatabase, "execute", execute)
    return seen


def test_the_built_statements_of_quotas_parse_as_postgresql(tmp_path: Path, executed: list[str]) -> None:
    target = tmp_path / "state.db"
    state.StateStore(target).close()  # the sandboxes table, which stale() joins
    store = projects.ProjectStore(target, "default", (10, 4000, 4096, 1 << 30))
    try:
        assert store.create("team", "default", (4, 2000, 2048, 1 << 20))
        assert not store.create("greedy", "default", (100, 1, 1, 0))
        reservation = store.reserve("team", 1500, 1024)
        assert reservation is not None
        assert store.reserve("team", 1000, 1) is None  # 2500 of 2000 milli-cpus
        assert store.set_quota("team", (4, 1000, 2048, 1 << 20)) == "team"  # below what it uses
        assert store.set_quota("team", (5, 2500, 2048, 1 << 20)) is None
        store.bind(reservation, "sb-1")
        assert store.stale(started_before=0.0) == [reservation]  # sb-1 is not a live sandbox
        assert store.release(reservation) and not store.release(reservation)
        hold = store.hold_snapshot("team", 1 << 20)
        assert hold is not None and store.hold_snapshot("team", 1) is None  # its room is full
        store.bind_snapshot(hold, "sn-1")
        assert store.snapshot_hold_of("sn-1") == hold
        assert store.stale_snapshot_holds(started_before=0.0) == [hold]  # sn-1 has no record
        assert store.release_snapshot(hold) and not store.release_snapshot(hold)
        row = store.get("team")
        assert row is not None and row.used == (0, 0, 0, 0) and row.quota == (5, 2500, 2048, 1 << 20)
    finally:
        store.close()
    built = {sql for sql in executed if sql not in store_statements(projects) and not sql.startswith("PRAGMA")}
    assert any(sql.startswith("UPDATE projects SET delegated_") for sql in built)
    assert any(sql.startswith("UPDATE projects SET used_") for sql in built)
    assert any(sql.startswith("UPDATE projects SET max_") for sql in built)
    for sql in built:
        assert_postgresql(sql)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SqliteDatabase]:
    database = open_database(tmp_path / "t.db", "CREATE TABLE IF NOT EXISTS t (k TEXT PRIMARY KEY, n INTEGER, "
                                               "x REAL, b BLOB);")
    assert isinstance(database, SqliteDatabase)
    yield database
    database.close()


def test_sqlite_runs_the_dialect_as_written(db: SqliteDatabase) -> None:
    assert db.execute("INSERT INTO t VALUES (?,?,?,?)", ("a", 1, 0.5, b"\x00\xff")).rowcount == 1
    assert db.execute("INSERT INTO t VALUES (?,?,?,?) ON CONFLICT DO NOTHING", ("a", 2, 0.0, None)).rowcount == 0
    row = db.execute("SELECT * FROM t WHERE k=?", ("a",)).fetchone()
    assert row is not None
    assert (row["k"], row["n"], row["x"], row["b"]) == ("a", 1, 0.5, b"\x00\xff")
    assert (row[0], row[1], row[3]) == ("a", 1, b"\x00\xff")  # by position too
    assert db.execute("SELECT * FROM t WHERE k LIKE 'z%'").fetchall() == []
    assert db.execute("SELECT k FROM t WHERE k=?", ("nothing",)).fetchone() is None


def test_a_constraint_is_a_typed_integrity_error(db: SqliteDatabase) -> None:
    db.execute("INSERT INTO t (k) VALUES (?)", ("a",))
    with pytest.raises(IntegrityError):
        db.execute("INSERT INTO t (k) VALUES (?)", ("a",))


def test_a_transaction_commits_together_or_not_at_all(db: SqliteDatabase) -> None:
    with pytest.raises(RuntimeError):
        with db.transaction():
            db.execute("INSERT INTO t (k) VALUES (?)", ("a",))
            raise RuntimeError("the block fails")
    assert db.execute("SELECT COUNT(*) FROM t").fetchone() == {"COUNT(*)": 0}
    with db.transaction():
        db.execute("INSERT INTO t (k) VALUES (?)", ("a",))
        db.execute("INSERT INTO t (k) VALUES (?)", ("b",))
    assert [r["k"] for r in db.execute("SELECT k FROM t ORDER BY k")] == ["a", "b"]


def test_targets(tmp_path: Path) -> None:
    # sqlite:///abs/path: the path is what follows "sqlite://" (tmp_path starts with "/")
    by_url = open_database(f"sqlite://{tmp_path}/u.db", "CREATE TABLE IF NOT EXISTS t (k TEXT);")
    try:
        assert isinstance(by_url, SqliteDatabase) and by_url.path == tmp_path / "u.db"
        assert (tmp_path / "u.db").exists()
    finally:
        by_url.close()
    for bad in ("mysql://host/db", "u.db", "sqlite://relative.db"):
        with pytest.raises(InvalidRequest):
            open_database(bad, "")
