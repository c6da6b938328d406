"""A server's or a CLI command's start on a file already migrated reads the migrations'
names and nothing more (rota/store/sqlite.py ``up_to_date``): sqlite_utils, which runs
the migrations, is imported only for a file that needs them, and jinja2 only at the
first dashboard page. Each import cost a start 14 to 28 ms. A file a newer Rota migrated
is still refused: tests/store/test_storage.py, with a real `rota serve`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sqlite_utils

from rota.store import migrations, sqlite
from rota.store.schema import MIGRATIONS
from rota.store.tokens import open_database

START = """
import sys
from rota.store.tokens import open_database
import rota.server.app, rota.cli.serve
open_database(sys.argv[1]).close()
print(*(name in sys.modules for name in ("sqlite_utils", "jinja2")))
"""


def imported_by_a_start(path: Path) -> list[str]:
    said = subprocess.run([sys.executable, "-c", START, str(path)], capture_output=True,
                          text=True, check=True, timeout=60)
    return said.stdout.split()


def test_a_start_on_a_migrated_file_imports_neither_sqlite_utils_nor_jinja2(tmp_path: Path):
    path = tmp_path / "rota.db"
    assert imported_by_a_start(path) == ["True", "False"]  # a new file: migrated
    assert imported_by_a_start(path) == ["False", "False"]  # and then no more


def test_a_file_a_migration_behind_is_migrated_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "rota.db"
    with sqlite_utils.Database(path) as db:
        migrations.migrations.apply(db, stop_before=MIGRATIONS[-1])
    conn = sqlite.connect(path)
    try:
        assert not sqlite.up_to_date(conn)
    finally:
        conn.close()
    conn = open_database(path)
    try:
        assert sqlite.up_to_date(conn)
        assert [r[0] for r in conn.execute("SELECT name FROM _sqlite_migrations")
                ] == list(MIGRATIONS)
    finally:
        conn.close()
