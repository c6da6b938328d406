"""One description of the store's tables (rota/store/schema.py): the SQLite migrations build
exactly it, and PostgreSQL's DDL is made from it."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

from rota.store import migrations as db_migrations, schema
from rota.base import protocol as p
from rota.store.rows import worker_row
from rota.store.schema import Column, Index, Table

TYPES = {"TEXT": "TEXT", "INTEGER": "INTEGER", "REAL": "REAL"}


def sqlite_schema(path: Path) -> tuple[list[Table], list[Index]]:
    """The tables and indexes of an SQLite file, read back as the description says them."""
    conn = sqlite3.connect(path)
    try:
        names = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE '\\_%'"
            " ESCAPE '\\' AND name NOT LIKE 'sqlite%' ORDER BY rowid")]
        tables = []
        for name in names:
            info = conn.execute(f"PRAGMA table_info({name})").fetchall()
            columns = tuple(Column(c[1], TYPES[c[2]], bool(c[3]), c[4]) for c in info)
            pk = tuple(c[1] for c in sorted(info, key=lambda c: c[5]) if c[5])
            tables.append(Table(name, columns, pk, rowid=name == "jobs"))
        indexes = []
        for name, table, sql in conn.execute(
                "SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'index'"
                " AND sql IS NOT NULL AND tbl_name NOT LIKE '\\_%' ESCAPE '\\' ORDER BY rowid"):
            columns = tuple(r[2] for r in conn.execute(f"PRAGMA index_info({name})"))
            where = re.search(r"\bWHERE (.*)$", sql, re.S)
            indexes.append(Index(name, table, columns, where.group(1) if where else None))
        return tables, indexes
    finally:
        conn.close()


def test_sqlite_migrations_build_the_description(tmp_path: Path) -> None:
    db_migrations.migrate(tmp_path / "rota.db")
    tables, indexes = sqlite_schema(tmp_path / "rota.db")
    assert sorted(tables, key=lambda t: t.name) == sorted(schema.TABLES, key=lambda t: t.name)
    assert sorted(indexes, key=lambda i: i.name) == sorted(schema.INDEXES,
                                                            key=lambda i: i.name)


def test_the_migration_names_are_the_description_s() -> None:
    assert db_migrations._known_migrations() == frozenset(schema.MIGRATIONS)
    assert [m.name for m in db_migrations.migrations._migrations] == list(schema.MIGRATIONS)


def test_a_registration_becomes_a_row_of_the_workers_table() -> None:
    # The engine says a worker came (WorkerSeen, plain values); the store makes the row.
    reg = p.Registration(hostname="h1", os="linux", pid=42, sdk="rota/0", queues=["q1", "q2"],
                         concurrency=3, specs=[p.SpecRef(name="echo", checksum="sha256:ab")],
                         labels=["gpu"])
    row = worker_row("w1", reg, 1700000000.5)
    assert list(row) == [c.name for c in schema.table("workers").columns]
    assert (row["id"], row["hostname"], row["pid"], row["concurrency"]) == ("w1", "h1", 42, 3)
    assert json.loads(row["queues"]) == ["q1", "q2"] and json.loads(row["labels"]) == ["gpu"]
    assert json.loads(row["specs"]) == [{"name": "echo", "checksum": "sha256:ab"}]
    assert (row["connected_at"], row["disconnected_at"]) == (1700000000.5, None)
